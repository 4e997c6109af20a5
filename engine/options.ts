/**
 * `magus engine` command-line options, validated up front so a bad value fails with a clear
 * message before anything loads.
 */
import { availableParallelism } from 'node:os';
import { basename } from 'node:path';
import { ENGINE_CONTEXT, ENGINE_SLOTS_LIMIT, RESUME_SLOTS } from '../shared/engine-slots';
import { UsageError } from '../platform/cli';

export const ENGINE_USAGE = [
  'usage: magus engine --model <file.gguf> [--host 127.0.0.1] [--port 0] [--slots 1] [--resume-slots 1] [--queue 16]',
  '                    [--threads N] [--ctx 4096] [--model-id NAME] [--grace-ms 30000] [--json]',
  '                    [--snapshots DIR [--snapshot-bytes 1073741824]] [--standby [--warm]]',
  '',
  "  --snapshots save the slots' KV caches under DIR as answers are generated, and load those an engine",
  '              before this one saved there: an engine that follows one killed mid-answer (its standby,',
  '              the container restarted) goes on with its answers without evaluating them again;',
  '              at most --snapshot-bytes together (a slot holding more than its share keeps its last)',
  '  --standby   map the model, print "standby" (a JSON event with --json), then wait for a line',
  '              "start" on stdin before listening and serving: a restart in place that costs only',
  "              the context's making (the local runtime keeps one beside each engine)",
  '  --warm      with --standby: make the context too before waiting, so that a start serves at once;',
  "              it holds a second KV cache's memory while it waits",
].join('\n');

export interface EngineOptions {
  /** Path of the GGUF file. */
  model: string;
  host: string;
  /** 0 = any free port. */
  port: number;
  /** Concurrent generations (llama.cpp sequences). distributed-llama serves one. */
  slots: number;
  /**
   * Sequences beside `slots` for answers resumed after their engine went away (their clients wait
   * mid-answer): such an answer starts at once. Each costs a slot's KV cache.
   */
  resumeSlots: number;
  /** Requests that may wait for a slot; more are refused with 429. */
  queue: number;
  /** llama.cpp CPU threads (default: cores − 1). Set it to the pod's CPU limit: Node sees the host's cores. */
  threads: number;
  /** Context tokens per slot (capped at the model's training context). */
  ctx: number;
  /** Name in `/v1/models` and answers; default: the model file's name. */
  modelId: string;
  /** On SIGTERM/SIGINT, how long generations in flight may run on before they are aborted. */
  graceMs: number;
  /** Where the slots' KV caches are saved, and those of the engine before found, and what they may take together on disk (engine/snapshots.ts); absent: not saved. */
  snapshots?: { dir: string; maxBytes: number };
  /** Print lifecycle events as JSON lines on stdout. */
  json: boolean;
  /** Wait on standby, the weights mapped, for a line `start` on stdin (server.ts `Standby`). */
  standby: boolean;
  /** On standby, the context (its KV cache) is made too before it waits (server.ts `Standby`). */
  warm: boolean;
}

const VALUE_FLAGS = [
  '--model',
  '--host',
  '--port',
  '--slots',
  '--resume-slots',
  '--queue',
  '--threads',
  '--ctx',
  '--model-id',
  '--grace-ms',
  '--snapshots',
  '--snapshot-bytes',
] as const;
type ValueFlag = (typeof VALUE_FLAGS)[number];

function integer(flag: string, text: string | undefined, fallback: number, min: number, max: number): number {
  if (text === undefined) return fallback;
  const n = Number(text);
  if (!/^\d+$/.test(text) || !Number.isSafeInteger(n) || n < min || n > max)
    throw new UsageError(`${flag} must be a whole number from ${min} to ${max}, got '${text}'`);
  return n;
}

/**
 * Parses `magus engine` arguments (`--flag value` or `--flag=value`).
 * @throws UsageError (platform/cli.ts) with a message for the user
 */
export function parseEngineArgs(args: readonly string[]): EngineOptions {
  const values: Partial<Record<ValueFlag, string>> = {};
  let json = false;
  let standby = false;
  let warm = false;
  for (let i = 0; i < args.length; i++) {
    const arg = args[i]!;
    if (arg === '--json' || arg === '--standby' || arg === '--warm') {
      if (arg === '--json') json = true;
      else if (arg === '--standby') standby = true;
      else warm = true;
      continue;
    }
    const eq = arg.indexOf('=');
    const flag = eq >= 0 ? arg.slice(0, eq) : arg;
    if (!(VALUE_FLAGS as readonly string[]).includes(flag)) throw new UsageError(arg.startsWith('-') ? `unknown option ${flag}` : `unexpected argument ${arg}`);
    const value = eq >= 0 ? arg.slice(eq + 1) : args[++i];
    if (value === undefined || value === '') throw new UsageError(`${flag} needs a value`);
    values[flag as ValueFlag] = value;
  }
  const model = values['--model'];
  if (!model) throw new UsageError('--model <file.gguf> is required');
  if (warm && !standby) throw new UsageError('--warm goes with --standby (an engine that waits to serve)');
  if (values['--snapshot-bytes'] !== undefined && !values['--snapshots']) throw new UsageError('--snapshot-bytes goes with --snapshots DIR');
  return {
    model,
    host: values['--host'] ?? '127.0.0.1',
    port: integer('--port', values['--port'], 0, 0, 65535),
    slots: integer('--slots', values['--slots'], 1, 1, ENGINE_SLOTS_LIMIT),
    resumeSlots: integer('--resume-slots', values['--resume-slots'], RESUME_SLOTS, 0, 16),
    queue: integer('--queue', values['--queue'], 16, 0, 100_000),
    // One core stays with the event loop (HTTP, SSE): llama.cpp's threads spin while they wait,
    // and on a busy or small host every extra spinning thread costs far more than it gives.
    threads: integer('--threads', values['--threads'], Math.max(1, availableParallelism() - 1), 1, 1024),
    ctx: integer('--ctx', values['--ctx'], ENGINE_CONTEXT, 16, 1 << 24),
    modelId: values['--model-id'] ?? basename(model),
    graceMs: integer('--grace-ms', values['--grace-ms'], 30_000, 0, 3_600_000),
    ...(values['--snapshots']
      ? { snapshots: { dir: values['--snapshots'], maxBytes: integer('--snapshot-bytes', values['--snapshot-bytes'], 2 ** 30, 0, Number.MAX_SAFE_INTEGER) } }
      : {}),
    json,
    standby,
    warm,
  };
}

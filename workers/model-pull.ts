/**
 * `magus model pull <repo>[@revision] --format gguf:q40,dllama:q40 [--hub URL] [--name NAME]
 *  [--namespace NS] [--token-env VAR | --token-file PATH] [--context N] [--detach]`
 *
 * Starts (or re-specs) the model's pipeline workflow and draws its progress until it is ready.
 * The token is passed as a reference (an env var name or a file path the worker can read),
 * never as a value. Where Temporal is: `MAGUS_TEMPORAL_ADDRESS`, else the running `magus dev`'s
 * connection settings (which also name its demo hub, used for the repos it serves when `--hub`
 * is not given), else 127.0.0.1:7233; an address it cannot reach fails at once, named.
 */
import { connect as tcpConnect } from 'node:net';
import { Client, Connection, WorkflowExecutionAlreadyStartedError, type WorkflowHandle } from '@temporalio/client';
import { SearchAttribute, WorkflowSummary } from '../shared/constants';
import { validateModelSpec, type ArtifactRequest, type ModelSpec, type SecretRef } from '../shared/model';
import { modelWorkflowId, progressQuery, specChangedSignal, type PipelineProgress } from '../workflows/model/definitions';
import type { modelPipeline } from '../workflows/model/pipeline';
import { loadConfig, readDevConnection, useDevConnection, type DevConnectionUse } from './config';
import { TerminalProgress, type ProgressState } from './progress';
import { usageFailure, UsageError } from '../platform/cli';

export const PULL_USAGE = [
  'usage: magus model pull <org/repo>[@revision] --format gguf:q40[,dllama:q40…] [--hub URL] [--name NAME] [--namespace NS] [--token-env VAR | --token-file PATH] [--context N] [--detach]',
  '       magus model pull <org/repo-GGUF>[@revision] (--gguf GLOB | --quantization TYPE) [--hub URL] [--name NAME] …',
  '',
  'A GGUF repository publishes one file per quantization: --gguf "*Q4_K_M.gguf" (a glob on the file name) or',
  '--quantization Q4_K_M chooses one (a split GGUF is taken whole); it is served as it is (--format gguf:source, the default).',
  '',
  'Temporal: MAGUS_TEMPORAL_ADDRESS, else the running magus dev (its connection.json in MAGUS_DEV_DATA_DIR,',
  "default ~/.local/share/magus/dev), else 127.0.0.1:7233. Without --hub, the repos of magus dev's demo hub come",
  'from it; others from huggingface.co.',
].join('\n');

export interface PullArgs {
  spec: ModelSpec;
  namespace: string;
  name: string;
  detach: boolean;
}

/** A DNS-label name from a repo id: `TinyLlama/TinyLlama-1.1B-Chat` → `tinyllama-1-1b-chat`. */
export function defaultModelName(repo: string): string {
  const base = (repo.split('/')[1] ?? repo)
    .toLowerCase()
    .replace(/[^a-z0-9]+/g, '-')
    .replace(/^-+|-+$/g, '');
  return base.slice(0, 63).replace(/-+$/, '') || 'model';
}

/** The hub a repo comes from when `--hub` is not given: the running dev's demo hub serves its own repos. */
export function defaultHub(repo: string, dev: Pick<DevConnectionUse, 'connection'> | undefined): string | undefined {
  const hub = dev?.connection.hub;
  return hub && hub.repos.includes(repo) ? hub.url : undefined;
}

export function parsePullArgs(args: string[], dev?: Pick<DevConnectionUse, 'connection'>): PullArgs {
  let ref: string | undefined;
  const opts: Record<string, string> = {};
  let detach = false;
  const valued = new Set(['--format', '--hub', '--name', '--namespace', '--token-env', '--token-file', '--context', '--gguf', '--quantization']);
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (a === '--detach') detach = true;
    else if (valued.has(a)) {
      const v = args[++i];
      if (v === undefined) throw new UsageError(`${a} needs a value`);
      opts[a] = v;
    } else if (a.startsWith('-')) throw new UsageError(`unknown option ${a}`);
    else if (ref === undefined) ref = a;
    else throw new UsageError(`unexpected argument ${a}`);
  }
  if (!ref) throw new UsageError('missing <org/repo>');
  const [repo, revision] = ref.split('@', 2) as [string, string | undefined];
  const hubUrl = opts['--hub'] ?? defaultHub(repo, dev);
  if (opts['--gguf'] !== undefined && opts['--quantization'] !== undefined) throw new UsageError('give --gguf or --quantization, not both');
  const gguf =
    opts['--gguf'] !== undefined ? { file: opts['--gguf'] } : opts['--quantization'] !== undefined ? { quantization: opts['--quantization'] } : undefined;
  const format = opts['--format'] ?? (gguf ? 'gguf:source' : undefined);
  if (!format) throw new UsageError('--format is required, e.g. --format gguf:q40,dllama:q40 (or --gguf / --quantization for a GGUF repository)');
  const artifacts = format.split(',').map((f): ArtifactRequest => {
    const [format, weights] = f.trim().split(':');
    return { format: format as ArtifactRequest['format'], weights: weights as ArtifactRequest['weights'] };
  });
  if (opts['--token-env'] && opts['--token-file']) throw new UsageError('give --token-env or --token-file, not both');
  const tokenRef: SecretRef | undefined = opts['--token-env']
    ? { env: opts['--token-env'] }
    : opts['--token-file']
      ? { file: opts['--token-file'] }
      : undefined;
  const spec: ModelSpec = {
    source: { repo, ...(revision ? { revision } : {}), ...(hubUrl ? { hubUrl } : {}), ...(tokenRef ? { tokenRef } : {}), ...(gguf ? { gguf } : {}) },
    artifacts,
    ...(opts['--context'] ? { contextLength: Number(opts['--context']) } : {}),
  };
  const errors = validateModelSpec(spec);
  if (errors.length > 0) throw new UsageError(errors.join('\n'));
  const name = opts['--name'] ?? defaultModelName(repo);
  const namespace = opts['--namespace'] ?? 'default';
  for (const [what, v] of [
    ['--name', name],
    ['--namespace', namespace],
  ] as const) {
    if (!/^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$/.test(v)) throw new UsageError(`${what} ${v} is not a DNS label`);
  }
  return { spec, namespace, name, detach };
}

/**
 * What the bar shows for a pipeline's progress: a transfer in bytes and files; a conversion in
 * tensors (counts, not bytes) of the artifact being converted, labelled `format:weights (i/n)`,
 * with the bar at the share of all requested artifacts done, so it does not fall back when the
 * next artifact starts. Artifacts convert in the order requested: one before a started one is
 * done (or was there already). Undefined when there is nothing to draw.
 */
export function pipelineBar(p: PipelineProgress, requested: readonly ArtifactRequest[]): ProgressState | undefined {
  if (p.phase === 'transferring')
    return { bytesDone: p.bytes.done, bytesTotal: p.bytes.total, itemsDone: p.files.done, itemsTotal: p.files.total, itemLabel: 'files' };
  if (p.phase !== 'converting') return undefined;
  const started = new Map((p.artifacts ?? []).map((a) => [a.key, a]));
  const keys = requested.map((r) => `${r.format}:${r.weights}`);
  const last = keys.reduce((at, k, i) => (started.has(k) ? i : at), -1);
  if (last < 0) {
    // A worker from before per-artifact progress: the sum, as it is.
    return p.tensors.total > 0 ? { itemsDone: p.tensors.done, itemsTotal: p.tensors.total, itemLabel: 'tensors' } : undefined;
  }
  const shares = keys.map((k, i) => {
    const a = started.get(k);
    if (!a) return i < last ? 1 : 0;
    return a.total > 0 ? Math.min(1, a.done / a.total) : 0;
  });
  const current = started.get(keys[last]!)!;
  return {
    itemsDone: current.done,
    itemsTotal: current.total,
    itemLabel: 'tensors',
    label: `${keys[last]} (${last + 1}/${keys.length})`,
    fraction: shares.reduce((a, b) => a + b, 0) / keys.length,
  };
}

function describe(p: PipelineProgress): string {
  return p.failure ? `${p.phase}: ${p.failure.type}: ${p.failure.message}` : p.phase;
}

/**
 * One line per failed attempt of the activity a pipeline is retrying (Temporal's pending
 * activity: its attempt and last failure), for `magus model pull` and `magus dev`: a pull that
 * cannot reach its hub says so on every retry instead of sitting at `resolving`.
 */
export class RetryReport {
  private readonly told = new Set<string>();

  constructor(private readonly write: (line: string) => void) {}

  async check(handle: Pick<WorkflowHandle, 'describe'>): Promise<void> {
    let pending;
    try {
      pending = (await handle.describe()).raw.pendingActivities ?? [];
    } catch {
      return; // a progress report, not worth failing the pull over
    }
    for (const a of pending) {
      const attempt = a.attempt ?? 1;
      const failure = a.lastFailure?.message;
      const key = `${a.activityId ?? ''}/${attempt}`;
      if (attempt < 2 || !failure || this.told.has(key)) continue;
      this.told.add(key);
      const next = a.nextAttemptScheduleTime?.seconds ? Math.max(0, Math.round(Number(a.nextAttemptScheduleTime.seconds) - Date.now() / 1000)) : undefined;
      const first = failure.split('\n', 1)[0]!.slice(0, 300);
      this.write(
        `${a.activityType?.name ?? 'activity'} failed (attempt ${attempt - 1}): ${first}; attempt ${attempt}${next === undefined ? '' : ` in ${next} s`}`,
      );
    }
  }
}

/** Where the Temporal address came from, for messages. */
function addressOrigin(dev: DevConnectionUse | undefined, env: NodeJS.ProcessEnv): string {
  if (dev?.taken.includes('MAGUS_TEMPORAL_ADDRESS')) return `the running magus dev's, from ${dev.file}`;
  if (env.MAGUS_TEMPORAL_ADDRESS?.trim()) return 'MAGUS_TEMPORAL_ADDRESS';
  const { file, stalePid } = readDevConnection(env);
  const stale = stalePid === undefined ? `no magus dev runs (no ${file})` : `${file} is left from a magus dev (pid ${stalePid}) that no longer runs`;
  return `the default: MAGUS_TEMPORAL_ADDRESS is unset and ${stale}`;
}

/** Whether `host:port` accepts a TCP connection; the reason when it does not (ECONNREFUSED …). */
function tcpReachable(address: string, timeoutMs: number): Promise<string | null> {
  const i = address.lastIndexOf(':');
  return new Promise((done) => {
    const socket = tcpConnect({ host: address.slice(0, i), port: Number(address.slice(i + 1)), timeout: timeoutMs });
    socket.once('connect', () => {
      socket.destroy();
      done(null);
    });
    socket.once('timeout', () => {
      socket.destroy();
      done(`no answer within ${timeoutMs / 1000} s`);
    });
    socket.once('error', (err: NodeJS.ErrnoException) => done(err.code ?? err.message));
  });
}

/** How long `model pull` keeps asking for progress while the query fails before it stops watching. */
const QUERY_PATIENCE_MS = 5 * 60_000;

/**
 * Connects to Temporal, or fails within seconds naming the address and where it came from
 * (the client alone retries until its deadline and then says only "Failed to connect before the
 * deadline").
 */
export async function connectTemporal(address: string, origin: string): Promise<Connection> {
  const cannot = (why: string) =>
    Object.assign(new Error(`cannot reach Temporal at ${address} (${origin}): ${why}. Start magus dev, or set MAGUS_TEMPORAL_ADDRESS.`), {
      name: 'TemporalUnreachable',
    });
  const refused = await tcpReachable(address, 3000);
  if (refused) throw cannot(refused);
  try {
    return await Connection.connect({ address, connectTimeout: '5s' });
  } catch (err) {
    throw cannot((err as Error).message);
  }
}

export async function modelPullCommand(args: string[], env: NodeJS.ProcessEnv = process.env): Promise<number> {
  const dev = useDevConnection(env);
  let parsed: PullArgs;
  try {
    parsed = parsePullArgs(args, dev);
  } catch (err) {
    return usageFailure('magus model pull', PULL_USAGE, err);
  }
  const cfg = loadConfig(env);
  if (dev && dev.taken.length > 0) process.stderr.write(`magus model pull: using the running magus dev (pid ${dev.connection.pid}; ${dev.file})\n`);
  if (parsed.spec.source.hubUrl && !args.includes('--hub'))
    process.stderr.write(`magus model pull: ${parsed.spec.source.repo} comes from magus dev's demo hub at ${parsed.spec.source.hubUrl}\n`);
  let connection: Connection;
  try {
    connection = await connectTemporal(cfg.temporal.address, addressOrigin(dev, env));
  } catch (err) {
    if ((err as Error).name !== 'TemporalUnreachable') throw err;
    process.stderr.write(`magus model pull: ${(err as Error).message}\n`);
    return 1;
  }
  try {
    const client = new Client({ connection, namespace: cfg.temporal.namespace });
    const workflowId = modelWorkflowId(parsed.namespace, parsed.name);
    const input = { namespace: parsed.namespace, name: parsed.name, spec: parsed.spec };
    try {
      await client.workflow.signalWithStart<typeof modelPipeline, [ModelSpec]>('modelPipeline', {
        workflowId,
        taskQueue: cfg.taskQueue,
        args: [input],
        signal: specChangedSignal,
        signalArgs: [parsed.spec],
        memo: { repo: parsed.spec.source.repo, revision: parsed.spec.source.revision ?? 'main' },
        searchAttributes: { [SearchAttribute.kind]: ['model'], [SearchAttribute.model]: [`${parsed.namespace}/${parsed.name}`] },
        staticSummary: WorkflowSummary.model(parsed.namespace, parsed.name, parsed.spec.source.repo),
      });
    } catch (err) {
      if (!(err instanceof WorkflowExecutionAlreadyStartedError)) throw err;
    }
    process.stderr.write(`pipeline ${workflowId} (${parsed.spec.source.repo}@${parsed.spec.source.revision ?? 'main'})\n`);
    if (parsed.detach) return 0;

    const handle = client.workflow.getHandle(workflowId);
    const bar = new TerminalProgress();
    const retries = new RetryReport((line) => {
      bar.finish();
      process.stderr.write(`${line}\n`);
    });
    let stop = false;
    const onSignal = () => {
      stop = true;
    };
    process.once('SIGINT', onSignal);
    let last = '';
    let polls = 0;
    /** Since when the progress query has been failing (a busy or restarting Temporal): retried, said once. */
    let failingSince: number | undefined;
    try {
      for (;;) {
        let p: PipelineProgress;
        try {
          p = await handle.query(progressQuery);
        } catch (err) {
          // The pipeline goes on whatever happens to this watcher: a query that times out or finds
          // Temporal away is asked again, for up to QUERY_PATIENCE_MS, before the command gives up.
          const now = Date.now();
          if (failingSince === undefined) {
            failingSince = now;
            bar.finish();
            process.stderr.write(`magus model pull: cannot read the pipeline's progress (${(err as Error).message}); asking again…\n`);
          } else if (now - failingSince > QUERY_PATIENCE_MS || stop) {
            bar.finish();
            process.stderr.write(
              `magus model pull: gave up watching after ${Math.round((now - failingSince) / 1000)} s of failed queries; the pipeline goes on (workflow ${workflowId})\n`,
            );
            return 1;
          }
          await new Promise((r) => setTimeout(r, 2000));
          continue;
        }
        if (failingSince !== undefined) {
          process.stderr.write(`magus model pull: progress readable again after ${Math.round((Date.now() - failingSince) / 1000)} s\n`);
          failingSince = undefined;
        }
        if (p.phase !== last) {
          bar.finish();
          process.stderr.write(`${describe(p)}\n`);
          last = p.phase;
        }
        const drawn = pipelineBar(p, parsed.spec.artifacts);
        if (drawn) bar.update(drawn);
        if (p.phase === 'ready') {
          bar.finish();
          process.stdout.write(`${parsed.namespace}/${parsed.name} is ready (${p.repo}@${p.sha})\n`);
          return 0;
        }
        if (p.phase === 'failed' || p.phase === 'cancelled') {
          bar.finish();
          return 1;
        }
        if (stop) {
          bar.finish();
          process.stderr.write(`stopped watching; the pipeline goes on (workflow ${workflowId})\n`);
          return 130;
        }
        if (++polls % 4 === 0) await retries.check(handle);
        await new Promise((r) => setTimeout(r, 500));
      }
    } finally {
      process.off('SIGINT', onSignal);
    }
  } finally {
    await connection.close();
  }
}

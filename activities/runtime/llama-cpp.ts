/**
 * The llama.cpp engine's launcher (engines.ts): one `magus engine` process over a GGUF, with
 * distributed-llama's HTTP surface. It reports `listening` and `ready` as JSON lines on stdout.
 * On this machine it runs under supervision (restarted in place when it dies); in a pod it is the
 * magus image's `engine` mode, probed at `/v1/models`.
 */
import { join, resolve } from 'node:path';
import { DEFAULT_INSTANCE_MEMORY_BYTES, engineSizingWith, fixedSlots, ggufFileNames, servedGguf } from '../../shared/engine-slots';
import { RuntimeErrorType, runtimeError } from '../../shared/errors';
import type { ReadyModel } from '../../shared/model';
import { cachedGguf } from './cache';
import type { EngineLauncher, LocalLaunch, LocalServing } from './launcher';
import { restartReport } from './launcher';
import { spawnSupervised, describeExit, type SupervisedProcess } from './process';
import { supervise, type RestartPolicy, type Supervised } from './supervise';

export type { RestartPolicy } from './supervise';

/** How to run `magus engine` from here: the compiled CLI, or the sources under a TS loader. */
function engineArgv(args: string[]): string[] {
  if (__filename.endsWith('.ts')) {
    const root = resolve(__dirname, '..', '..');
    return [
      process.execPath,
      '-r',
      require.resolve('@swc-node/register'),
      '-e',
      `require(${JSON.stringify(join(root, 'workers', 'engine'))}).engineCommand(process.argv.slice(1)).then((c) => process.exit(c))`,
      '--',
      ...args,
    ];
  }
  return [process.execPath, resolve(__dirname, '..', '..', '..', 'bin', 'magus.js'), 'engine', ...args];
}

/**
 * `magus engine …` arguments (after the mode): the one builder of an engine's command line, for
 * the local runtime (loopback, any port) and the Kubernetes one (0.0.0.0 in its pod, so the
 * kubelet's probes reach it).
 */
export function engineArgs(o: {
  model: string;
  modelId: string;
  port: number;
  slots: number;
  threads: number;
  host?: string;
  /** Tokens per slot (default: the engine's). */ ctx?: number;
  /** Sequences beside the slots for resumed answers (default: the engine's, shared/engine-slots.ts `RESUME_SLOTS`). */
  resumeSlots?: number;
}): string[] {
  return [
    ...[
      '--model',
      o.model,
      '--model-id',
      o.modelId,
      ...(o.host ? ['--host', o.host] : []),
      '--port',
      String(o.port),
      '--json',
      '--slots',
      String(o.slots),
      '--threads',
      String(o.threads),
    ],
    ...(o.ctx !== undefined ? ['--ctx', String(o.ctx)] : []),
    ...(o.resumeSlots !== undefined ? ['--resume-slots', String(o.resumeSlots)] : []),
  ];
}

export interface LlamaCppEngine {
  url: string;
  port: number;
  process: SupervisedProcess;
}

/**
 * Starts an engine and resolves with its URL once it reports ready. A failed start (it exits,
 * the deadline passes, `signal` aborts) rejects only once the process has exited, so it leaves
 * none behind; aborted, it rejects with `signal.reason`. `port`: a fixed one (a restart keeps
 * the URL its bridge calls); default any.
 */
export function startLlamaCppEngine(
  model: string,
  opts: {
    modelId: string;
    slots: number;
    threads: number;
    ctx?: number;
    resumeSlots?: number;
    startTimeoutSec: number;
    name: string;
    log: (line: string) => void;
    output?: (line: string) => void;
    port?: number;
    signal?: AbortSignal;
  },
): Promise<LlamaCppEngine> {
  const { signal } = opts;
  if (signal?.aborted) return Promise.reject(signal.reason as Error);
  const argv = engineArgv(
    engineArgs({
      model,
      modelId: opts.modelId,
      port: opts.port ?? 0,
      slots: opts.slots,
      threads: opts.threads,
      ...(opts.ctx !== undefined ? { ctx: opts.ctx } : {}),
      ...(opts.resumeSlots !== undefined ? { resumeSlots: opts.resumeSlots } : {}),
    }),
  );
  let url: string | null = null;
  let onReady: (() => void) | undefined;
  const proc = spawnSupervised(opts.name, argv, {
    log: opts.output ?? (() => undefined),
    onStdoutLine: (line) => {
      let event: { event?: string; url?: string };
      try {
        event = JSON.parse(line) as typeof event;
      } catch {
        return;
      }
      if (event.event === 'listening' && event.url) url = event.url;
      if (event.event === 'ready' && url) onReady?.();
    },
  });
  return new Promise((ok, fail) => {
    /** Why the start is being given up; it fails with this once the process has exited. */
    let giveUp: Error | null = null;
    const abandon = (why: Error) => {
      giveUp ??= why;
      // Nothing is served yet: no grace to give.
      void proc.stop(0);
    };
    const timer = setTimeout(() => abandon(new Error(`engine did not become ready within ${opts.startTimeoutSec}s`)), opts.startTimeoutSec * 1000);
    const onAbort = () => abandon(signal!.reason as Error);
    signal?.addEventListener('abort', onAbort, { once: true });
    void proc.exited.then((e) => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', onAbort);
      fail(giveUp ?? new Error(`engine ${describeExit(e)} before it was ready`));
    });
    onReady = () => {
      if (giveUp) return;
      clearTimeout(timer);
      signal?.removeEventListener('abort', onAbort);
      ok({ url: url!, port: Number(new URL(url!).port), process: proc });
    };
  });
}

/**
 * Starts an engine and keeps it running (supervise.ts): when it exits unexpectedly it is started
 * again on the same port (its URL, which the bridge calls, stays) after a backoff; requests in
 * flight fail over to the bridge's retry (nak, redelivery) and queued ones wait in the instance's
 * consumer. A crash loop and it stays down: `healthy()` turns false, for the pool to replace.
 */
export async function startSupervisedEngine(
  model: string,
  opts: Parameters<typeof startLlamaCppEngine>[1] & { restart?: Partial<RestartPolicy>; stopGraceMs: number },
): Promise<Supervised<LlamaCppEngine>> {
  const first = await startLlamaCppEngine(model, opts);
  const port = first.port;
  // `signal` is the first start's; a restart is aborted by stop() instead.
  const { signal: _startOnly, ...again } = opts;
  return supervise(first, {
    name: opts.name,
    log: opts.log,
    policy: opts.restart,
    where: `on port ${port}`,
    ended: (e) => e.process.exited.then(describeExit),
    running: (e) => !e.process.exit,
    restart: (signal) => startLlamaCppEngine(model, { ...again, port, signal }),
    stop: (e) => e.process.stop(opts.stopGraceMs),
    describe: (e) => `pid ${e.process.child.pid ?? '?'}`,
  });
}

/** SIGTERM → SIGKILL grace when the local runtime stops an engine. */
const STOP_GRACE_MS = 10_000;

/** The GGUF of `ready` llama.cpp serves, or why there is none. */
function gguf(ready: ReadyModel): NonNullable<ReturnType<typeof servedGguf>> | string {
  const served = servedGguf(ready);
  if (!served || served.artifact.files.length === 0) return `model ${ready.namespace}/${ready.name} has no GGUF artifact for llama.cpp`;
  return served;
}

async function startLocal(l: LocalLaunch): Promise<LocalServing> {
  const served = gguf(l.ready);
  if (typeof served === 'string') throw runtimeError(RuntimeErrorType.NoArtifact, served);
  const model = await cachedGguf(l.cache, served.artifact.files, l.signal);
  const fixed = l.settings.slots ?? l.leases;
  const sizing = served.plan && engineSizingWith(served.plan, l.settings.instanceMemory ?? DEFAULT_INSTANCE_MEMORY_BYTES, fixed);
  const slots = sizing?.slots ?? fixedSlots(fixed);
  if (sizing) l.log(`${l.name}: ${slots} slot(s) of ${sizing.contextLength} tokens (${Math.ceil(sizing.kvCachePerSlot / 2 ** 20)} MiB of KV cache each)`);
  // Responses name the model as clients know it, not by its cached file.
  const engine = await startSupervisedEngine(model, {
    modelId: l.ready.name,
    slots,
    ...(sizing ? { ctx: sizing.contextLength } : {}),
    threads: l.settings.threads ?? 1,
    startTimeoutSec: l.settings.startTimeoutSec ?? 120,
    name: `${l.name} engine`,
    log: l.log,
    output: l.settings.output,
    restart: l.settings.restart,
    stopGraceMs: STOP_GRACE_MS,
    signal: l.signal,
  });
  return {
    slots,
    url: engine.current.url, // restarts keep the port
    get processes() {
      return [{ role: 'engine' as const, index: 0, port: engine.current.port, process: engine.current.process }];
    },
    healthy: () => engine.healthy(),
    restarts: () => restartReport(engine, 'engine'),
    stop: () => engine.stop(),
  };
}

export const llamaCppLauncher: EngineLauncher = {
  local: {
    available: () => true,
    refusal: (ready) => {
      const served = gguf(ready);
      return typeof served === 'string' ? served : null;
    },
    start: startLocal,
  },
  kubernetes: {
    plan({ ready, fixedSlots: fixed, resumeSlots, instanceMemory }) {
      const served = gguf(ready);
      if (typeof served === 'string') throw runtimeError(RuntimeErrorType.NoArtifact, served);
      // `fixed` slots at the planned cost per slot, or as many as the memory budget holds.
      const sized = served.plan ? engineSizingWith(served.plan, instanceMemory, fixed, resumeSlots) : undefined;
      // Every part of a split GGUF, under the names llama.cpp finds them by (the engine opens the first).
      const names = ggufFileNames(served.artifact.files.length);
      const files = served.artifact.files.map((f, i) => ({ ...f, name: names[i]! }));
      const bytes = files.reduce((a, f) => a + f.bytes, 0);
      return {
        nodes: 1,
        files,
        maxSeqLen: 0,
        slots: sized?.slots ?? fixedSlots(fixed),
        ...(resumeSlots !== undefined ? { resumeSlots } : {}),
        ...(sized ? { ctx: sized.contextLength } : {}),
        memory: { root: sized?.memory ?? bytes, worker: null },
      };
    },
    containers: (plan, ports, file) => ({
      engine: {
        name: 'engine',
        image: plan.images.magus,
        args: [
          'engine',
          ...engineArgs({
            model: file(plan.files[0]!.name),
            modelId: plan.model,
            host: '0.0.0.0',
            port: ports.engine,
            slots: plan.slots,
            threads: plan.threads,
            ...(plan.ctx !== undefined ? { ctx: plan.ctx } : {}),
            ...(plan.resumeSlots !== undefined ? { resumeSlots: plan.resumeSlots } : {}),
          }),
        ],
        env: [{ name: 'HOME', value: '/tmp' }],
      },
    }),
  },
};

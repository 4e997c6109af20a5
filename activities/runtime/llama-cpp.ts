/**
 * The llama.cpp engine's launcher (engines.ts): one `magus engine` process over a GGUF, with
 * distributed-llama's HTTP surface. It reports `listening` and `ready` as JSON lines on stdout.
 * On this machine it runs under supervision (restarted in place when it dies); in a pod it is the
 * magus image's `engine` mode, probed at `/v1/models`.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { freemem, tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { DEFAULT_INSTANCE_MEMORY_BYTES, engineSizingWith, fixedSlots, ggufFileNames, servedGguf } from '../../shared/engine-slots';
import { RuntimeErrorType, runtimeError } from '../../shared/errors';
import type { ReadyModel } from '../../shared/model';
import { cachedGguf } from './cache';
import type { EngineLauncher, LocalLaunch, LocalServing, StandbyKind, StartedStandby } from './launcher';
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
  /** Where the slots' KV caches are saved for the engine that follows (engine/snapshots.ts). */
  snapshots?: string;
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
    ...(o.snapshots !== undefined ? ['--snapshots', o.snapshots] : []),
  ];
}

export interface LlamaCppEngine {
  url: string;
  port: number;
  process: SupervisedProcess;
}

/** How {@link startLlamaCppEngine} starts an engine. */
export interface EngineStart {
  modelId: string;
  slots: number;
  threads: number;
  ctx?: number;
  resumeSlots?: number;
  /** Where the slots' KV caches are saved for the engine that follows (engine/snapshots.ts). */
  snapshots?: string;
  startTimeoutSec: number;
  name: string;
  log: (line: string) => void;
  output?: (line: string) => void;
  port?: number;
  signal?: AbortSignal;
}

/** An engine process and the events it has reported on stdout (`listening`, `standby`, `ready`). */
function spawnEngine(model: string, opts: EngineStart, standby?: StartedStandby) {
  const argv = engineArgv([
    ...engineArgs({
      model,
      modelId: opts.modelId,
      port: opts.port ?? 0,
      slots: opts.slots,
      threads: opts.threads,
      ...(opts.ctx !== undefined ? { ctx: opts.ctx } : {}),
      ...(opts.resumeSlots !== undefined ? { resumeSlots: opts.resumeSlots } : {}),
      ...(opts.snapshots !== undefined ? { snapshots: opts.snapshots } : {}),
    }),
    ...(standby ? ['--standby', ...(standby === 'warm' ? ['--warm'] : [])] : []),
  ]);
  let url: string | null = null;
  const seen = new Set<string>();
  const waiters = new Set<() => void>();
  const proc = spawnSupervised(standby ? `${opts.name} (standby)` : opts.name, argv, {
    log: opts.output ?? (() => undefined),
    stdin: standby !== undefined,
    onStdoutLine: (line) => {
      let event: { event?: string; url?: string };
      try {
        event = JSON.parse(line) as typeof event;
      } catch {
        return;
      }
      if (event.event === 'listening' && event.url) url = event.url;
      if (event.event) seen.add(event.event);
      for (const w of [...waiters]) w();
    },
  });
  /**
   * Resolves once it has reported `event` (`ready`: with its URL). A failed wait (it exits, the
   * start's deadline passes, `signal` aborts) rejects only once the process has exited, so it
   * leaves none behind; aborted, it rejects with `signal.reason`.
   */
  const until = (event: 'listening' | 'standby' | 'ready', signal: AbortSignal | undefined): Promise<void> =>
    new Promise((ok, fail) => {
      /** Why the wait is given up; it fails with this once the process has exited. */
      let giveUp: Error | null = null;
      const abandon = (why: Error) => {
        giveUp ??= why;
        // Nothing is served yet: no grace to give.
        void proc.stop(0);
      };
      const what = event === 'ready' ? 'ready' : event === 'listening' ? 'listening' : 'ready on standby';
      const timer = setTimeout(() => abandon(new Error(`engine did not become ${what} within ${opts.startTimeoutSec}s`)), opts.startTimeoutSec * 1000);
      const onAbort = () => abandon(signal!.reason as Error);
      const done = () => {
        clearTimeout(timer);
        signal?.removeEventListener('abort', onAbort);
        waiters.delete(check);
      };
      const check = () => {
        if (giveUp || !seen.has(event) || (event !== 'standby' && !url)) return;
        done();
        ok();
      };
      waiters.add(check);
      signal?.addEventListener('abort', onAbort, { once: true });
      void proc.exited.then((e) => {
        done();
        fail(giveUp ?? new Error(`engine ${describeExit(e)} before it was ${what}`));
      });
      if (signal?.aborted) onAbort();
      else check();
    });
  const engine = (): LlamaCppEngine => ({ url: url!, port: Number(new URL(url!).port), process: proc });
  return { proc, until, engine };
}

/**
 * Starts an engine and resolves with its URL once it reports ready. A failed start (it exits,
 * the deadline passes, `signal` aborts) rejects only once the process has exited, so it leaves
 * none behind; aborted, it rejects with `signal.reason`. `port`: a fixed one (a restart keeps
 * the URL its bridge calls); default any.
 */
export async function startLlamaCppEngine(model: string, opts: EngineStart): Promise<LlamaCppEngine> {
  if (opts.signal?.aborted) throw opts.signal.reason as Error;
  const e = spawnEngine(model, opts);
  await e.until('ready', opts.signal);
  return e.engine();
}

/** An engine on standby (`magus engine --standby`): its model mapped (warm: its context made too), not listening yet. */
export interface StandbyEngine {
  process: SupervisedProcess;
  /** Tells it to serve (on the port it was given) and resolves once it is ready, as {@link startLlamaCppEngine} does. */
  start(signal?: AbortSignal): Promise<LlamaCppEngine>;
}

/** Starts an engine on standby for `opts.port` and resolves once it waits there. */
export async function startStandbyEngine(model: string, opts: EngineStart, kind: StartedStandby): Promise<StandbyEngine> {
  if (opts.signal?.aborted) throw opts.signal.reason as Error;
  const e = spawnEngine(model, opts, kind);
  await e.until('standby', opts.signal);
  return {
    process: e.proc,
    start: async (signal) => {
      e.proc.child.stdin?.end('start\n');
      await e.until('ready', signal);
      return e.engine();
    },
  };
}

/**
 * Starts an engine and keeps it running (supervise.ts): when it exits unexpectedly it is started
 * again on the same port (its URL, which the bridge calls, stays) after a backoff; requests in
 * flight fail over to the bridge's retry (nak, redelivery) and queued ones wait in the instance's
 * consumer. A crash loop and it stays down: `healthy()` turns false, for the pool to replace.
 *
 * With `standby`, a second engine waits beside it on standby, its model mapped (the first one
 * started as soon as the engine listens, its port known, so that it loads beside the engine's own
 * load rather than in the first seconds the engine serves — started after the engine was ready,
 * it made its context 3–4 s into a new instance's service, beside the answers a roll had just
 * moved there, under bench:chaos; again after each restart): a death is answered by starting it at once —
 * the restart costs its context's making (~60 ms per 4,096-token slot; nothing when it is
 * `warm`, its context made ahead) and listening, not a process's start and a model's load (~2 s)
 * after a backoff. `standby` may be a function, asked at each standby's start which kind it is
 * (`loading`: the engine beside it has not made its own context yet).
 * A restart that finds it waiting comes at once (a crash loop is still given up after the
 * policy's `maxRestarts`); one that does not backs off as before. A standby that failed or is
 * not ready yet is replaced by a cold start (or waited for, while it loads).
 */
export async function startSupervisedEngine(
  model: string,
  opts: EngineStart & { restart?: Partial<RestartPolicy>; stopGraceMs: number; standby?: StartedStandby | ((loading: boolean) => StartedStandby) },
): Promise<Supervised<LlamaCppEngine>> {
  if (opts.signal?.aborted) throw opts.signal.reason as Error;
  const spawned = spawnEngine(model, opts);
  await spawned.until('listening', opts.signal);
  const port = spawned.engine().port;
  // `signal` is the first start's; a restart is aborted by stop() instead, and so is a standby's start.
  const { signal: _startOnly, standby: withStandby, restart: policy, stopGraceMs, ...again } = opts;
  const stopping = new AbortController();
  let spare: { engine: Promise<StandbyEngine | undefined>; waiting: boolean } | undefined;
  // Standbys lost in a row (died waiting, or failed to start): each next one comes later.
  let lost = 0;
  const keepSpare = (loading = false) => {
    if (!withStandby || stopping.signal.aborted) return;
    const next: NonNullable<typeof spare> = { engine: Promise.resolve(undefined), waiting: false };
    const kind = typeof withStandby === 'function' ? withStandby(loading) : withStandby;
    const startedAt = Date.now();
    // A standby that dies while it waits (the OOM killer picks it, a stray kill) or fails to start
    // is replaced, after 1 s, doubling to 60 s while they keep dying young: otherwise the next
    // death of the engine would find none and cost a cold start after the restart's backoff.
    const replace = (why: string) => {
      if (spare !== next || stopping.signal.aborted) return; // told to serve (the supervisor watches it now), replaced or stopping
      if (Date.now() - startedAt >= STANDBY_LOSS_RESET_MS) lost = 0;
      const wait = Math.min(1000 * 2 ** lost, STANDBY_LOSS_RESET_MS);
      lost += 1;
      opts.log(`${opts.name}: the engine on standby ${why}; another in ${wait} ms`);
      setTimeout(() => spare === next && keepSpare(), wait).unref();
    };
    opts.log(`${opts.name}: starting an engine on standby${kind === 'warm' ? ', warm,' : ''} for port ${port}${loading ? ' beside its load' : ''}`);
    next.engine = startStandbyEngine(model, { ...again, port, signal: stopping.signal }, kind).then(
      (s) => {
        next.waiting = true;
        opts.log(`${opts.name}: an engine waits on standby${kind === 'warm' ? ', warm,' : ''} for port ${port} (pid ${s.process.child.pid ?? '?'})`);
        void s.process.exited.then((e) => {
          next.waiting = false;
          replace(describeExit(e));
        });
        return s;
      },
      (err: unknown) => {
        replace(`did not start (${(err as Error).message})`);
        return undefined;
      },
    );
    spare = next;
  };
  const restart = async (signal: AbortSignal): Promise<LlamaCppEngine> => {
    const s = await spare?.engine;
    spare = undefined;
    if (s && !s.process.exit) {
      try {
        const e = await s.start(signal);
        lost = 0;
        keepSpare();
        return e;
      } catch (err) {
        if (signal.aborted) throw err;
        opts.log(`${opts.name}: the engine on standby did not start (${(err as Error).message}); starting a new one`);
      }
    }
    const e = await startLlamaCppEngine(model, { ...again, port, signal });
    keepSpare();
    return e;
  };
  /** Stops the engine on standby for good (none is started after). */
  const stopSpare = async (): Promise<void> => {
    stopping.abort(new Error('the engine is stopping'));
    const s = spare;
    spare = undefined;
    await s?.engine.then((e) => e?.process.stop(0));
  };
  keepSpare(true);
  try {
    await spawned.until('ready', opts.signal);
  } catch (err) {
    // The engine did not start (it exited, its deadline passed, the start was aborted): nor does its standby.
    await stopSpare();
    throw err;
  }
  const first = spawned.engine();
  return supervise(first, {
    name: opts.name,
    log: opts.log,
    policy,
    where: `on port ${port}`,
    ended: (e) => e.process.exited.then(describeExit),
    running: (e) => !e.process.exit,
    restart,
    immediate: () => spare?.waiting === true,
    // Called once supervise's stop() has ended any restart: the standby goes with the engine.
    stop: async (e) => {
      await Promise.all([e.process.stop(stopGraceMs), stopSpare()]);
    },
    describe: (e) => `pid ${e.process.child.pid ?? '?'}`,
  });
}

/** A standby that waited this long before it died starts the count of lost ones again; also the longest wait for the next. */
const STANDBY_LOSS_RESET_MS = 60_000;

/** SIGTERM → SIGKILL grace when the local runtime stops an engine. */
const STOP_GRACE_MS = 10_000;

/** The GGUF of `ready` llama.cpp serves, or why there is none. */
function gguf(ready: ReadyModel): NonNullable<ReturnType<typeof servedGguf>> | string {
  const served = servedGguf(ready);
  if (!served || served.artifact.files.length === 0) return `model ${ready.namespace}/${ready.name} has no GGUF artifact for llama.cpp`;
  return served;
}

/**
 * The standby of `kind` (launcher.ts `StandbyKind`) for an engine whose KV cache takes `kvCache`
 * bytes (unknown: no memory plan); `auto` is decided at each standby's start, on the free memory
 * then — less the engine's own KV cache while that engine is `loading` (the first standby starts
 * beside the engine's load, before the engine has made its context).
 */
export function standbyKind(kind: StandbyKind, kvCache: number | undefined, free: () => number = freemem): (loading?: boolean) => StartedStandby {
  if (kind !== 'auto') return () => kind;
  return (loading = false) => (kvCache !== undefined && kvCache <= (free() - (loading ? kvCache : 0)) / 2 ? 'warm' : 'mapped');
}

async function startLocal(l: LocalLaunch): Promise<LocalServing> {
  const served = gguf(l.ready);
  if (typeof served === 'string') throw runtimeError(RuntimeErrorType.NoArtifact, served);
  const model = await cachedGguf(l.cache, served.artifact.files, l.signal);
  const fixed = l.settings.slots ?? l.leases;
  const sizing = served.plan && engineSizingWith(served.plan, l.settings.instanceMemory ?? DEFAULT_INSTANCE_MEMORY_BYTES, fixed);
  const slots = sizing?.slots ?? fixedSlots(fixed);
  if (sizing) l.log(`${l.name}: ${slots} slot(s) of ${sizing.contextLength} tokens (${Math.ceil(sizing.kvCachePerSlot / 2 ** 20)} MiB of KV cache each)`);
  const snapshots = l.settings.snapshots === false ? undefined : localSnapshots();
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
    ...(l.settings.standby ? { standby: standbyKind(l.settings.standby, sizing && sizing.kvCachePerSlot * (sizing.slots + sizing.resumeSlots)) } : {}),
    ...(snapshots ? { snapshots } : {}),
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

let localKv: string | undefined;

/**
 * The directory of KV snapshots every llama.cpp engine this process starts shares (under the
 * system's temporary directory, this user's alone; removed when the process exits): an engine's
 * standby or restart loads what it saved, and so does another instance of the same model that
 * an answer is handed to (engine/snapshots.ts).
 */
function localSnapshots(): string {
  if (localKv) return localKv;
  const dir = mkdtempSync(join(tmpdir(), 'magus-kv-'));
  process.once('exit', () => rmSync(dir, { recursive: true, force: true }));
  return (localKv = dir);
}

/** Where an engine's pod keeps its KV snapshots (engine/snapshots.ts): under the pod's /tmp, an emptyDir. */
const POD_SNAPSHOTS = '/tmp/magus-kv';

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
            // The pod's /tmp (an emptyDir) outlives the container: a restart in place loads what it saved.
            snapshots: POD_SNAPSHOTS,
          }),
        ],
        env: [{ name: 'HOME', value: '/tmp' }],
      },
    }),
  },
};

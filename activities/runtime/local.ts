/**
 * The `local` runtime: a topology instance is a set of processes on this machine plus an
 * in-process bridge that pulls the instance's requests from NATS. Which processes is the engine
 * launcher's (engines.ts): the first engine, distributed ones first, that is available here and
 * can serve the model —
 * - a distributed-llama topology (root `dllama-api` + `nodes − 1` `dllama worker`s, dllama.ts)
 *   when the worker is configured with its binaries and the model has a distributed-llama
 *   artifact that runs on that many nodes;
 * - otherwise `magus engine` (llama.cpp, llama-cpp.ts) over the model's GGUF.
 * Model files come from S3 into a local cache once (cache.ts). A llama.cpp engine that dies, or
 * a topology one of whose processes dies, is restarted in place on its ports (supervise.ts: the
 * bridge and the queued requests carry on); one in a crash loop is given up and `describe`
 * reports the instance unhealthy. Every process runs under
 * `setpriv --pdeathsig KILL`, so it dies with the worker that started it; the pool notices
 * (describe) and starts new ones.
 *
 * Nothing is left running that nobody can destroy: a start can be aborted at every step (the
 * download, the engine or topology coming up, the consumer, the bridge), `destroy` aborts and
 * awaits a start of its id before it tears down, and an aborted start registers nothing.
 */
import type { S3Client } from '@aws-sdk/client-s3';
import type { NatsConnection } from 'nats';
import { startBridge, type Bridge, type BridgeSample } from '../../dataplane/bridge';
import { ENGINE_KINDS, engineOf, type EngineKind } from '../../shared/engines';
import { RuntimeErrorType, runtimeError } from '../../shared/errors';
import { deleteInstanceConsumer, ensureInstanceConsumer, requestSubjectOf, type DataPlaneNames } from '../../dataplane';
import type { ModelRegistry } from '../../dataplane/registry';
import type { InstanceInfo, InstanceRequest, WorkerRuntime } from './runtime';
import type { ModelCache } from './cache';
import type { DllamaOptions } from './dllama';
import { launcherOf, type LocalServing } from './engines';
import type { RestartPolicy } from './llama-cpp';

export interface LocalRuntimeOptions {
  nc: NatsConnection;
  names: DataPlaneNames;
  registry: ModelRegistry;
  s3: S3Client;
  bucket: string;
  /** Where model files are cached, by sha256. */
  cacheDir: string;
  /**
   * llama.cpp engine slots per instance, fixed; unset: the leases the instance's pool gives it
   * (`InstanceRequest.leases`), else sized from the model's memory plan within `instanceMemory`
   * (shared/engine-slots.ts), as the pools' default leases per instance are.
   */
  slots?: number;
  /** Memory budget of one instance in bytes (default {@link DEFAULT_INSTANCE_MEMORY_BYTES}). */
  instanceMemory?: number;
  /** llama.cpp engine threads (default 1: on small machines llama.cpp's spinning threads cost more than they give). */
  threads?: number;
  /** Seconds an engine may take to load its model. */
  startTimeoutSec?: number;
  /** When an engine or topology dies it is restarted in place (default: 3 restarts per 10 min, 500 ms backoff doubling). */
  restart?: Partial<RestartPolicy>;
  /** distributed-llama binaries and topology size; unset: llama.cpp only. */
  dllama?: DllamaOptions;
  /** The engines it runs, in the order it tries them (local-entry.ts `localEngines`); default: every engine it can run, distributed ones first. */
  engines?: readonly EngineKind[];
  /** What the runtime does: instances started and stopped, engines restarted or given up. */
  log?: (line: string) => void;
  /**
   * The engines' own output lines (default: dropped; a failed start still quotes its last lines).
   * distributed-llama's `dllama-api` prints prompts and answers: route them only where that is allowed.
   */
  output?: (line: string) => void;
}

/** One process of an instance, as {@link LocalRuntime.processes} reports it. */
export interface LocalProcessInfo {
  /** `engine` (llama.cpp), or the `root`/`worker`s of a distributed-llama topology. */
  role: 'engine' | 'root' | 'worker';
  /** 0 for an engine or root; workers 1..n-1 in the root's `--workers` order. */
  index: number;
  pid: number | undefined;
  /** Loopback port it serves on (HTTP for an engine or root, distributed-llama's protocol for a worker). */
  port: number;
  /** Program and arguments. */
  argv: readonly string[];
  running: boolean;
}

export interface LocalRuntime extends WorkerRuntime {
  /**
   * Starts the instance and resolves once it serves; resolves at once when it already does.
   * Concurrent calls for one id share one start. A caller whose `signal` aborts is rejected
   * with its reason at once while others still wait; when the last waiting caller's signal
   * aborts (an activity cancelled or timed out, with no retry of it waiting), the start itself is
   * aborted, and that caller is rejected once everything the start began has stopped. A call
   * without a signal keeps the start going: only `destroy` or `stopAll` ends it then.
   */
  create(req: InstanceRequest, signal?: AbortSignal): Promise<InstanceInfo>;
  /**
   * Aborts a start of the id under way (its callers are rejected with `InstanceDestroyed`) and
   * waits for it to end, then stops the instance's bridge and processes and deletes its request
   * consumer. Once it resolves, no process of the instance runs, none is started again, and
   * `describe` and `processes` answer null. A `create` of the id made meanwhile waits for it and
   * then starts anew.
   */
  destroy(pool: string, instance: string): Promise<void>;
  /** The processes of an instance (root first), or null when the runtime does not know it. */
  processes(pool: string, instance: string): LocalProcessInfo[] | null;
  /** The in-process bridges of the running instances, for metrics. */
  bridges(): BridgeSample[];
  /** Destroys every instance, and aborts every start under way (its callers are rejected with `RuntimeStopped`). */
  stopAll(): Promise<void>;
}

/** What serves an instance's requests, and which engine it is. */
interface Serving {
  kind: EngineKind;
  engine: LocalServing;
}

interface LocalInstance {
  pool: string;
  info: Omit<InstanceInfo, 'healthy'>;
  serving: Serving;
  bridge: Bridge;
}

/** A start under way, shared by every `create` of its id. */
interface PendingStart {
  pool: string;
  instance: string;
  /** Aborts the start: `destroy`, `stopAll`, or the last waiting caller's signal. */
  abort: AbortController;
  /** Callers still waiting whose signal has not aborted (Infinity once one came without a signal). */
  waiting: number;
  result: Promise<InstanceInfo>;
  /** Resolves when the start has ended either way, an aborted one after stopping what it began. */
  settled: Promise<void>;
}

/** `p`, or `signal`'s reason as soon as it aborts. */
function unlessAborted<T>(p: Promise<T>, signal: AbortSignal | undefined): Promise<T> {
  if (!signal) return p;
  return new Promise((ok, fail) => {
    const onAbort = () => fail(signal.reason as Error);
    if (signal.aborted) return onAbort();
    signal.addEventListener('abort', onAbort, { once: true });
    const done = () => signal.removeEventListener('abort', onAbort);
    p.then(
      (v) => (done(), ok(v)),
      (e: unknown) => (done(), fail(e as Error)),
    );
  });
}

export function createLocalRuntime(opts: LocalRuntimeOptions): LocalRuntime {
  const instances = new Map<string, LocalInstance>();
  const starting = new Map<string, PendingStart>();
  const destroying = new Map<string, Promise<void>>();
  const log = opts.log ?? (() => undefined);
  const cache: ModelCache = { s3: opts.s3, bucket: opts.bucket, dir: opts.cacheDir };
  const distributedFirst = (k: EngineKind) => (engineOf(k).topology === 'distributed' ? 0 : 1);
  const engines = opts.engines ?? [...ENGINE_KINDS].sort((a, b) => distributedFirst(a) - distributedFirst(b));
  const key = (pool: string, instance: string) => `${pool}/${instance}`;
  const infoOf = (i: LocalInstance): InstanceInfo => ({ ...i.info, healthy: i.serving.engine.healthy() });

  /** The first engine of `opts.engines` available here that can serve the model, started. */
  async function startServing(req: InstanceRequest, signal: AbortSignal): Promise<Serving> {
    const ready = await opts.registry.get(req.namespace, req.model);
    signal.throwIfAborted();
    if (!ready) throw runtimeError(RuntimeErrorType.ModelNotReady, `model ${req.namespace}/${req.model} is not in the registry`);
    const name = key(req.pool, req.instance);
    /** Why engines that have an artifact of their format here cannot serve it; then why the others cannot. */
    const refused: { why: string; hasArtifact: boolean }[] = [];
    for (const kind of engines) {
      const launcher = launcherOf(kind).local;
      if (!launcher.available(opts)) continue;
      const why = launcher.refusal(ready, opts);
      if (why !== null) {
        refused.push({ why, hasArtifact: ready.artifacts.some((a) => a.format === engineOf(kind).format) });
        continue;
      }
      const fellBack = refused.filter((r) => r.hasArtifact).map((r) => r.why);
      if (fellBack.length > 0) log(`${name}: ${fellBack.join('; ')}; serving it with ${engineOf(kind).short} instead`);
      const engine = await launcher.start({ ready, name, leases: req.leases, settings: opts, cache, log, signal });
      return { kind, engine };
    }
    const why = (refused.find((r) => r.hasArtifact) ?? refused.at(-1))?.why ?? `no engine on this worker serves model ${req.namespace}/${req.model}`;
    throw runtimeError(RuntimeErrorType.NoArtifact, why);
  }

  /**
   * Starts an instance; registers it only if `signal` has not aborted by then. Aborted, it stops
   * whatever it started (the request consumer included) and rejects with `signal.reason`.
   */
  async function start(req: InstanceRequest, signal: AbortSignal): Promise<InstanceInfo> {
    let serving: Serving | undefined;
    let bridge: Bridge | undefined;
    let consumer = false;
    try {
      serving = await startServing(req, signal);
      signal.throwIfAborted();
      const { slots } = serving.engine;
      await ensureInstanceConsumer(await opts.nc.jetstreamManager(), opts.names, { pool: req.pool, instance: req.instance, slots });
      consumer = true;
      signal.throwIfAborted();
      // A few NATS requests, not worth a signal: an abort meanwhile is seen right after.
      bridge = await startBridge({ nc: opts.nc, names: opts.names, pool: req.pool, instance: req.instance, engineUrl: serving.engine.url, slots, log, engineKind: serving.kind });
      signal.throwIfAborted();
      const instance: LocalInstance = { pool: req.pool, info: { instance: req.instance, subject: requestSubjectOf(opts.names, req.pool, req.instance) }, serving, bridge };
      instances.set(key(req.pool, req.instance), instance);
      log(`instance ${req.pool}/${req.instance} serves ${req.namespace}/${req.model} with ${engineOf(serving.kind).short} at ${serving.engine.url}`);
      return infoOf(instance);
    } catch (err) {
      await bridge?.stop();
      await serving?.engine.stop();
      if (!signal.aborted) throw err;
      if (consumer)
        await opts.nc
          .jetstreamManager()
          .then((jsm) => deleteInstanceConsumer(jsm, opts.names, { pool: req.pool, instance: req.instance }))
          .catch(() => false);
      log(`instance ${req.pool}/${req.instance}: start aborted (${(signal.reason as Error)?.message ?? String(signal.reason)})`);
      throw signal.reason as Error;
    }
  }

  /** A new start of `req`'s id, replacing `broken` (an instance of the same id that no longer serves). */
  function begin(req: InstanceRequest, broken: LocalInstance | undefined): PendingStart {
    const k = key(req.pool, req.instance);
    const abort = new AbortController();
    const result = (async () => {
      // A broken instance of the same id is replaced, not left running beside the new one.
      if (broken) {
        instances.delete(k);
        await teardown(broken);
      }
      return start(req, abort.signal);
    })();
    const pending: PendingStart = { pool: req.pool, instance: req.instance, abort, waiting: 0, result, settled: result.then(() => undefined, () => undefined) };
    starting.set(k, pending);
    // Registered first, so whoever awaits `settled` finds the entry gone.
    void pending.settled.then(() => {
      if (starting.get(k) === pending) starting.delete(k);
    });
    return pending;
  }

  /** One more caller of `pending`, rejected with its own `signal`'s reason when that aborts (see {@link LocalRuntime.create}). */
  function join(pending: PendingStart, signal: AbortSignal | undefined): Promise<InstanceInfo> {
    if (!signal) {
      pending.waiting = Infinity;
      return pending.result;
    }
    pending.waiting += 1;
    return new Promise((ok, fail) => {
      const onAbort = () => {
        pending.waiting -= 1;
        if (pending.waiting > 0) return fail(signal.reason as Error);
        // Nobody waits for this start any more: it would only leave an engine nobody destroys.
        // Answered once it has ended: with what it began stopped, or with the instance if it
        // was registered before the abort (an aborted start never registers one).
        pending.abort.abort(signal.reason);
        pending.result.then(ok, () => fail(signal.reason as Error));
      };
      if (signal.aborted) return onAbort();
      signal.addEventListener('abort', onAbort, { once: true });
      pending.result.then(
        (info) => (signal.removeEventListener('abort', onAbort), ok(info)),
        (err: unknown) => (signal.removeEventListener('abort', onAbort), fail(err as Error)),
      );
    });
  }

  /** Ends the instance `pool/instance` for good, aborting its start under way with `why`. */
  function remove(pool: string, instance: string, why: () => Error): Promise<void> {
    const k = key(pool, instance);
    let done = destroying.get(k);
    if (!done) {
      done = (async () => {
        const pending = starting.get(k);
        if (pending) {
          pending.abort.abort(why());
          await pending.settled;
        }
        const i = instances.get(k);
        instances.delete(k);
        if (i) await teardown(i);
        // NATS may be draining (the worker stopping): the consumer then outlives us, harmlessly.
        await opts.nc
          .jetstreamManager()
          .then((jsm) => deleteInstanceConsumer(jsm, opts.names, { pool, instance }))
          .catch(() => false);
      })().finally(() => destroying.delete(k));
      destroying.set(k, done);
    }
    return done;
  }

  async function teardown(i: LocalInstance): Promise<void> {
    await i.bridge.stop();
    await i.serving.engine.stop();
  }

  const runtime: LocalRuntime = {
    async create(req: InstanceRequest, signal?: AbortSignal): Promise<InstanceInfo> {
      const k = key(req.pool, req.instance);
      for (;;) {
        signal?.throwIfAborted();
        const destroyed = destroying.get(k);
        const pending = starting.get(k);
        // A destroy, or an aborted start, under way: start anew once it has ended.
        if (destroyed) await unlessAborted(destroyed.catch(() => undefined), signal);
        else if (pending?.abort.signal.aborted) await unlessAborted(pending.settled, signal);
        else if (pending) return join(pending, signal);
        else break;
      }
      const existing = instances.get(k);
      if (existing?.serving.engine.healthy()) return infoOf(existing);
      return join(begin(req, existing), signal);
    },
    destroy(pool: string, instance: string): Promise<void> {
      return remove(pool, instance, () => runtimeError(RuntimeErrorType.InstanceDestroyed, `instance ${pool}/${instance} was destroyed while it started`));
    },
    describe(pool: string, instance: string): Promise<InstanceInfo | null> {
      const i = instances.get(key(pool, instance));
      return Promise.resolve(i ? infoOf(i) : null);
    },
    processes(pool: string, instance: string): LocalProcessInfo[] | null {
      const i = instances.get(key(pool, instance));
      return i
        ? i.serving.engine.processes.map((p) => ({ role: p.role, index: p.index, pid: p.process.child.pid, port: p.port, argv: p.process.argv, running: !p.process.exit }))
        : null;
    },
    bridges(): BridgeSample[] {
      return [...instances.values()].map((i) => ({ pool: i.pool, instance: i.info.instance, stats: i.bridge.stats, health: i.bridge.health() }));
    },
    async stopAll(): Promise<void> {
      const all = new Map<string, { pool: string; instance: string }>();
      for (const p of starting.values()) all.set(key(p.pool, p.instance), p);
      for (const i of instances.values()) all.set(key(i.pool, i.info.instance), { pool: i.pool, instance: i.info.instance });
      // Removals already under way are waited for too (a second stopAll must not return before them).
      await Promise.all([...[...all.values()].map(({ pool, instance }) => remove(pool, instance, () => runtimeError(RuntimeErrorType.RuntimeStopped, `the runtime stopped while instance ${pool}/${instance} started`))), ...destroying.values()]);
    },
  };
  return runtime;
}

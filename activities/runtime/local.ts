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
 *
 * {@link LocalRuntime} composes its collaborators: the engine chosen and started
 * ({@link ServingStarter}, local-serving.ts), the starts under way that concurrent `create`s join
 * and that are aborted when nobody waits any more ({@link StartRegistry}, local-starts.ts), and the
 * instances that serve ({@link InstanceTable}, local-instances.ts); it owns the removals.
 */
import type { S3Client } from '@aws-sdk/client-s3';
import type { NatsConnection } from 'nats';
import { startBridge, type Bridge, type BridgeSample } from '../../dataplane/bridge';
import { distributedFirst, engineOf, type EngineKind } from '../../shared/engines';
import { RuntimeErrorType, runtimeError } from '../../shared/errors';
import { deleteInstanceConsumer, ensureInstanceConsumer, requestSubjectOf, type DataPlaneNames } from '../../dataplane';
import type { ModelRegistry } from '../../dataplane/registry';
import type { InstanceInfo, InstanceRequest, WorkerRuntime } from './runtime';
import type { LocalEngineSettings } from './launcher';
import { InstanceTable, instanceKey, type LocalInstance, type LocalProcessInfo, type Serving } from './local-instances';
import { ServingStarter } from './local-serving';
import { StartRegistry, unlessAborted } from './local-starts';

export type { LocalProcessInfo } from './local-instances';

export interface LocalRuntimeOptions extends LocalEngineSettings {
  nc: NatsConnection;
  names: DataPlaneNames;
  registry: ModelRegistry;
  s3: S3Client;
  bucket: string;
  /** Where model files are cached, by sha256. */
  cacheDir: string;
  /** The engines it runs, in the order it tries them (local-entry.ts `localEngines`); default: every engine it can run, distributed ones first. */
  engines?: readonly EngineKind[];
  /** What the runtime does: instances started and stopped, engines restarted or given up. */
  log?: (line: string) => void;
}

export class LocalRuntime implements WorkerRuntime {
  private readonly instances = new InstanceTable();
  private readonly starts = new StartRegistry();
  /** Removals under way, by instance id: a second `destroy` of an id joins the first. */
  private readonly removals = new Map<string, Promise<void>>();
  private readonly serving: ServingStarter;
  private readonly log: (line: string) => void;

  constructor(private readonly opts: LocalRuntimeOptions) {
    this.log = opts.log ?? (() => undefined);
    const engines = opts.engines ?? distributedFirst();
    this.serving = new ServingStarter(opts.registry, engines, opts, { s3: opts.s3, bucket: opts.bucket, dir: opts.cacheDir }, this.log);
  }

  /**
   * Starts the instance and resolves once it serves; resolves at once when it already does.
   * Concurrent calls for one id share one start. A caller whose `signal` aborts is rejected
   * with its reason at once while others still wait; when the last waiting caller's signal
   * aborts (an activity cancelled or timed out, with no retry of it waiting), the start itself is
   * aborted, and that caller is rejected once everything the start began has stopped. A call
   * without a signal keeps the start going: only `destroy` or `stopAll` ends it then.
   */
  async create(req: InstanceRequest, signal?: AbortSignal): Promise<InstanceInfo> {
    const k = instanceKey(req.pool, req.instance);
    for (;;) {
      signal?.throwIfAborted();
      const removal = this.removals.get(k);
      const pending = this.starts.get(k);
      // A destroy, or an aborted start, under way: start anew once it has ended.
      if (removal)
        await unlessAborted(
          removal.catch(() => undefined),
          signal,
        );
      else if (pending?.abort.signal.aborted) await unlessAborted(pending.settled, signal);
      else if (pending) return this.starts.join(pending, signal);
      else break;
    }
    const existing = this.instances.get(k);
    if (existing?.serving.engine.healthy()) return InstanceTable.info(existing);
    const pending = this.starts.begin(k, req.pool, req.instance, async (abort) => {
      // A broken instance of the same id is replaced, not left running beside the new one.
      if (existing) {
        this.instances.take(k);
        await InstanceTable.teardown(existing);
      }
      return this.start(req, abort);
    });
    return this.starts.join(pending, signal);
  }

  /**
   * Aborts a start of the id under way (its callers are rejected with `InstanceDestroyed`) and
   * waits for it to end, then stops the instance's bridge and processes and deletes its request
   * consumer. Once it resolves, no process of the instance runs, none is started again, and
   * `describe` and `processes` answer null. A `create` of the id made meanwhile waits for it and
   * then starts anew.
   */
  destroy(pool: string, instance: string): Promise<void> {
    return this.remove(pool, instance, () => runtimeError(RuntimeErrorType.InstanceDestroyed, `instance ${pool}/${instance} was destroyed while it started`));
  }

  describe(pool: string, instance: string): Promise<InstanceInfo | null> {
    const i = this.instances.get(instanceKey(pool, instance));
    return Promise.resolve(i ? InstanceTable.info(i) : null);
  }

  /** The processes of an instance (root first), or null when the runtime does not know it. */
  processes(pool: string, instance: string): LocalProcessInfo[] | null {
    const i = this.instances.get(instanceKey(pool, instance));
    return i ? InstanceTable.processes(i) : null;
  }

  /** The in-process bridges of the running instances, for metrics. */
  bridges(): BridgeSample[] {
    return this.instances.all().map((i) => InstanceTable.bridge(i));
  }

  /** Destroys every instance, and aborts every start under way (its callers are rejected with `RuntimeStopped`). */
  async stopAll(): Promise<void> {
    const all = new Map<string, { pool: string; instance: string }>();
    for (const p of this.starts.all()) all.set(instanceKey(p.pool, p.instance), p);
    for (const i of this.instances.all()) all.set(instanceKey(i.pool, i.info.instance), { pool: i.pool, instance: i.info.instance });
    // Removals already under way are waited for too (a second stopAll must not return before them).
    await Promise.all([
      ...[...all.values()].map(({ pool, instance }) =>
        this.remove(pool, instance, () => runtimeError(RuntimeErrorType.RuntimeStopped, `the runtime stopped while instance ${pool}/${instance} started`)),
      ),
      ...this.removals.values(),
    ]);
  }

  /**
   * Starts an instance; registers it only if `signal` has not aborted by then. Aborted, it stops
   * whatever it started (the request consumer included) and rejects with `signal.reason`.
   */
  private async start(req: InstanceRequest, signal: AbortSignal): Promise<InstanceInfo> {
    const { nc, names } = this.opts;
    let serving: Serving | undefined;
    let bridge: Bridge | undefined;
    let consumer = false;
    try {
      serving = await this.serving.start(req, signal);
      signal.throwIfAborted();
      const { slots } = serving.engine;
      await ensureInstanceConsumer(await nc.jetstreamManager(), names, { pool: req.pool, instance: req.instance, slots });
      consumer = true;
      signal.throwIfAborted();
      // A few NATS requests, not worth a signal: an abort meanwhile is seen right after.
      bridge = await startBridge({
        nc,
        names,
        pool: req.pool,
        instance: req.instance,
        engineUrl: serving.engine.url,
        slots,
        log: this.log,
        engineKind: serving.kind,
      });
      signal.throwIfAborted();
      const instance: LocalInstance = {
        pool: req.pool,
        info: { instance: req.instance, subject: requestSubjectOf(names, req.pool, req.instance), revision: serving.revision },
        serving,
        bridge,
      };
      this.instances.add(instance);
      const pids = serving.engine.processes.map((p) => `${p.role === 'engine' ? '' : `${p.role} `}${p.process.child.pid ?? '?'}`).join(', ');
      this.log(
        `instance ${req.pool}/${req.instance} serves ${req.namespace}/${req.model} with ${engineOf(serving.kind).short} at ${serving.engine.url} (pid ${pids})`,
      );
      return InstanceTable.info(instance);
    } catch (err) {
      await bridge?.stop();
      await serving?.engine.stop();
      if (!signal.aborted) throw err;
      if (consumer) await this.deleteConsumer(req.pool, req.instance);
      this.log(`instance ${req.pool}/${req.instance}: start aborted (${(signal.reason as Error)?.message ?? String(signal.reason)})`);
      throw signal.reason as Error;
    }
  }

  /** Ends the instance `pool/instance` for good, aborting its start under way with `why`. */
  private remove(pool: string, instance: string, why: () => Error): Promise<void> {
    const k = instanceKey(pool, instance);
    let done = this.removals.get(k);
    if (!done) {
      done = (async () => {
        await this.starts.abort(k, why);
        const i = this.instances.take(k);
        if (i) await InstanceTable.teardown(i);
        await this.deleteConsumer(pool, instance);
      })().finally(() => this.removals.delete(k));
      this.removals.set(k, done);
    }
    return done;
  }

  /** Deletes the instance's request consumer, best effort: NATS may be draining (the worker stopping), and the consumer then outlives us, harmlessly. */
  private async deleteConsumer(pool: string, instance: string): Promise<void> {
    await this.opts.nc
      .jetstreamManager()
      .then((jsm) => deleteInstanceConsumer(jsm, this.opts.names, { pool, instance }))
      .catch(() => false);
  }
}

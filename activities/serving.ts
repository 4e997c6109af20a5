/**
 * Activities of the serving workflows (`dllamaPool`, `session`): instances through a
 * {@link Runtime}, and the `magus_sessions` KV entries the gateway reads on warm turns.
 */
import { ApplicationFailure, heartbeat, Context } from '@temporalio/activity';
import type { KV } from 'nats';
import type { PoolEntry, SessionEntry } from '../shared/serving';
import { RUNTIME_ADVERT_STALE_MS, type RuntimeAdvert } from '../shared/runtimes';

export interface InstanceRequest {
  namespace: string;
  model: string;
  /** Data-plane pool name (a DNS label: the model's name). */
  pool: string;
  instance: string;
}

export interface InstanceInfo {
  instance: string;
  /** NATS subject the instance's bridge consumes. */
  subject: string;
  healthy: boolean;
  /**
   * The task queue of the worker that runs the instance, where its `describeInstance` and
   * `destroyInstance` must go (a local runtime's processes belong to one worker); absent when
   * any worker can answer for it.
   */
  runtimeQueue?: string;
}

/**
 * Where topology instances run (DESIGN.md, "Runtimes"): `local` processes, or Kubernetes.
 * Every call is idempotent by instance id; `create` resolves once the instance serves.
 */
export interface Runtime {
  create(req: InstanceRequest, signal: AbortSignal): Promise<InstanceInfo>;
  destroy(pool: string, instance: string): Promise<void>;
  describe(pool: string, instance: string): Promise<InstanceInfo | null>;
  /**
   * Resolves with the reason once the instance no longer serves (gone, or unhealthy); `alive` is
   * called at least every few seconds while it does. Optional: without it `watchInstance` asks
   * `describe` at an interval. A runtime that can be told of changes (Kubernetes: a pod watch)
   * implements it so that a loss is seen at once.
   */
  watch?(pool: string, instance: string, signal: AbortSignal, alive: () => void): Promise<string>;
}

const HEARTBEAT_EVERY_MS = 5000;
/**
 * Runtime errors (by `Error.name`) that no retry of the same start can fix, or that a retry must
 * not undo (`InstanceDestroyed`: the instance was destroyed while it started). The Kubernetes
 * runtime's `Unschedulable` (a pod the scheduler cannot place) and `NoFit` (no topology fits
 * the cluster's nodes) wait for the pool's backoff instead.
 */
export const PERMANENT_RUNTIME_ERRORS: readonly string[] = ['ModelNotReady', 'NoArtifact', 'InstanceDestroyed', 'Unschedulable', 'NoFit'];

/** The `magus_pools` key of a model's pool. */
export const poolKey = (namespace: string, model: string): string => `${namespace}.${model}`;

export interface ServingDeps {
  runtime: Runtime;
  sessions: KV;
  pools: KV;
  /** This worker's own queue, when its runtime's instances are its processes (named in each `InstanceInfo`). */
  runtimeQueue?: string;
  /**
   * The runtime advert of the worker a runtime queue belongs to (null: none, or not a runtime
   * queue of this deployment). Without it `workerGone` has no evidence and says gone.
   */
  advertOf?: (runtimeQueue: string) => Promise<RuntimeAdvert | null>;
}

export function createServingActivities(deps: ServingDeps) {
  const encode = (e: SessionEntry | PoolEntry) => new TextEncoder().encode(JSON.stringify(e));
  return {
    /**
     * Starts an instance and waits until it serves (heartbeating: a cold start can take minutes).
     * The SDK delivers a cancel only through heartbeats, so they also bring one in: the
     * workflow's, or the server's answer that the activity timed out (`NOT_FOUND`, `TIMED_OUT`).
     * The runtime then aborts the start (unless a retry of this activity has joined it), and this
     * fails with the `CancelledFailure` once everything the start began has stopped.
     */
    async createInstance(input: InstanceRequest): Promise<InstanceInfo> {
      const ctx = Context.current();
      const timer = setInterval(() => heartbeat({ instance: input.instance, phase: 'starting' }), HEARTBEAT_EVERY_MS);
      try {
        const info = await deps.runtime.create(input, ctx.cancellationSignal);
        return deps.runtimeQueue ? { ...info, runtimeQueue: deps.runtimeQueue } : info;
      } catch (err) {
        // No retry can fix these (the model is not published, or has nothing this runtime can
        // serve): fail at once, typed, and let the pool decide when to try again.
        const name = (err as Error).name;
        if (PERMANENT_RUNTIME_ERRORS.includes(name)) throw ApplicationFailure.nonRetryable((err as Error).message, name);
        throw err;
      } finally {
        clearInterval(timer);
      }
    },
    /**
     * Watches one instance for as long as it serves, heartbeating (the pool's liveness check of
     * this worker), and completes with the reason once it does not: the pool then replaces it.
     * Runs for the instance's whole life; the pool cancels it when it stops the instance. How
     * the instance is watched is this activity's business: changing it changes no workflow
     * history (it used to be a probe loop in the pool workflow).
     */
    async watchInstance(input: { pool: string; instance: string; intervalMs: number }): Promise<{ reason: string }> {
      const ctx = Context.current();
      const alive = () => heartbeat({ instance: input.instance, phase: 'serving' });
      if (deps.runtime.watch) return { reason: await deps.runtime.watch(input.pool, input.instance, ctx.cancellationSignal, alive) };
      for (;;) {
        alive();
        const info = await deps.runtime.describe(input.pool, input.instance);
        if (!info) return { reason: `instance ${input.instance} is gone` };
        if (!info.healthy) return { reason: `instance ${input.instance} stopped serving` };
        await ctx.sleep(input.intervalMs); // a cancel (the pool stopped it) ends the sleep with CancelledFailure
      }
    },
    async destroyInstance(input: { pool: string; instance: string }): Promise<void> {
      await deps.runtime.destroy(input.pool, input.instance);
    },
    async describeInstance(input: { pool: string; instance: string }): Promise<InstanceInfo | null> {
      return deps.runtime.describe(input.pool, input.instance);
    },
    /**
     * Whether the worker owning `runtimeQueue` has stopped: its runtime advert withdrawn (a clean
     * stop) or not refreshed for {@link RUNTIME_ADVERT_STALE_MS} (killed). The pool asks before
     * dropping that worker's instances when nobody took an activity from its queue in time: under
     * load Temporal can be slower than that timeout with the worker alive and serving.
     */
    async workerGone(input: { runtimeQueue: string }): Promise<{ gone: boolean; reason: string }> {
      if (!deps.advertOf) return { gone: true, reason: 'no runtime adverts to check' };
      const advert = await deps.advertOf(input.runtimeQueue);
      if (!advert) return { gone: true, reason: 'its runtime advert is withdrawn' };
      const age = Date.now() - advert.at;
      return age > RUNTIME_ADVERT_STALE_MS ? { gone: true, reason: `its runtime advert is ${Math.round(age / 1000)} s old` } : { gone: false, reason: `its runtime advert is ${Math.round(age / 1000)} s old` };
    },
    async writeSession(input: { key: string; entry: SessionEntry }): Promise<void> {
      await deps.sessions.put(input.key, encode(input.entry));
    },
    async deleteSession(input: { key: string }): Promise<void> {
      await deps.sessions.delete(input.key);
    },
    /** Publishes the pool's leasable instances for gateways (`updatedAt` is stamped here). */
    async writePool(input: { namespace: string; model: string; instances: PoolEntry['instances']; leasesPerInstance: number; growable?: boolean }): Promise<void> {
      const entry: PoolEntry = { instances: input.instances, leasesPerInstance: input.leasesPerInstance, updatedAt: Date.now(), ...(input.growable === undefined ? {} : { growable: input.growable }) };
      await deps.pools.put(poolKey(input.namespace, input.model), encode(entry));
    },
  };
}

export type ServingActivities = ReturnType<typeof createServingActivities>;

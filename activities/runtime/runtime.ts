/**
 * The runtime contract (ARCHITECTURE.md, "Runtimes and engines"): what every runtime implements,
 * what the serving activities (../serving.ts) call, and what the worker process that built a
 * runtime holds of it.
 * Which runtimes there are and how a worker builds one: ./index.ts.
 */
import type { BridgeSample } from '../../dataplane/bridge';
import type { RestartReport } from '../../shared/status';
import type { InstanceSpec } from '../../shared/kube';

export interface InstanceRequest {
  namespace: string;
  model: string;
  /** Data-plane pool name (a DNS label: the model's name). */
  pool: string;
  instance: string;
  /**
   * The leases its pool gives the instance: a llama.cpp engine gets one slot per lease, so each
   * conversation keeps its prompt's prefix in a slot of its own. Absent from pools started before
   * pools said it: the runtime then sizes the slots from memory, as the pools' defaults are.
   */
  leases?: number;
}

export interface InstanceInfo {
  instance: string;
  /** NATS subject the instance's bridge consumes. */
  subject: string;
  healthy: boolean;
  /**
   * The task queue of the worker that runs the instance, where its `watchInstance` and
   * `destroyInstance` must go (a local runtime's processes belong to one worker); absent when
   * any worker can answer for it.
   */
  runtimeQueue?: string;
  /**
   * Its restarts in place (the local runtime starts a stopped engine or topology again where it
   * was); absent where a runtime does not restart in place (Kubernetes: a pod not ready is a loss).
   */
  restarts?: RestartReport;
  /**
   * The model revision it serves (shared/model.ts `modelRevision`): its pool replaces instances
   * of an older one. Absent from runtimes that did not say it.
   */
  revision?: string;
  /**
   * What shapes it: the `Dllama` it was built from (shared/kube.ts `instanceSpecOf`). Its pool
   * replaces instances built under another once that `Dllama` changes. Absent where a runtime
   * builds instances from its own configuration only (local).
   */
  spec?: InstanceSpec;
}

/**
 * Where topology instances run (ARCHITECTURE.md, "Runtimes and engines"): `local` processes, or
 * Kubernetes. Every call is idempotent by instance id; `create` resolves once the instance serves.
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

/**
 * A runtime as the worker process that built it holds it: the instances, and what of them lives
 * in this process (the local runtime's processes and bridges; nothing for one whose instances
 * live in a cluster).
 */
export interface WorkerRuntime extends Runtime {
  /** The in-process bridges of the instances it runs, for the worker's `/metrics` ([] when it runs none here). */
  bridges(): BridgeSample[];
  /**
   * At the worker's stop: ends every instance and start that lives in this process (they could
   * not outlive it); resolves at once for a runtime whose instances do not depend on the worker.
   */
  stopAll(): Promise<void>;
}

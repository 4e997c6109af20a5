/** Messages of the `dllamaPool` workflow (id `pool/<namespace>/<model>`). */
import { defineQuery, defineSignal } from '@temporalio/workflow';
import type { PoolStatus } from '../../shared/status';

export interface PoolInput {
  namespace: string;
  /** The model's registry name; instances serve its artifact. */
  model: string;
  /** Instances kept even when idle (0 = scale to zero). */
  minInstances: number;
  maxInstances: number;
  /**
   * Its engine's parallel slots. Scaling on leases (the default of an input without `scaleOn`):
   * the live conversations one instance takes before the pool adds another. On load: the
   * requests in flight or queued one instance takes before the pool adds another.
   */
  leasesPerInstance: number;
  /**
   * What sizes the pool (state.ts, "Scaling"): `load` — requests in flight or queued (an idle
   * conversation costs no instance; one instance stays while any lives) — or `leases`, live
   * conversations, as pools before `SCALE_ON_LOAD_PATCH` did. Absent: `leases`. Every pool magus
   * starts itself (the controller, the gateway's cold start, `magus dev`) says `load`.
   */
  scaleOn?: 'leases' | 'load';
  /** An instance with nothing in flight or queued (scaling on leases: and no live conversation) for this long is stopped (down to `minInstances`). */
  idleTimeoutMs: number;
  /**
   * How long an idle instance stays unpublished from `magus_pools` before it is stopped, so a
   * gateway that picked it a moment earlier still finds it serving (default 5 s).
   */
  drainGraceMs?: number;
  /**
   * How long an instance being replaced (an older model revision) may keep answering what it has
   * in flight before it is stopped anyway (default 5 min, `DEFAULT_DRAIN_TIMEOUT_MS`). A
   * `Dllama`'s `spec.drainTimeout` overrides it.
   */
  drainTimeoutMs?: number;
  /**
   * How often each instance's watcher (`watchInstance`, an activity on the worker that runs it)
   * asks the runtime whether it still serves, when the runtime cannot report changes itself
   * (default 15 s; its heartbeat timeout is 3× this, at least 10 s). One that does not is
   * dropped from the published view and stopped; gateways move its conversations on their next
   * turn, so a dead instance stops receiving turns.
   */
  healthCheckMs?: number;
  /**
   * How long an instance's own activities may wait for the worker that runs it (a local
   * runtime's processes) before that worker counts as gone, and the instance with it (default 10 s).
   */
  ownerTimeoutMs?: number;
  /**
   * Events after which a run continues as new (default 1,500; the server suggests it at 4,000
   * anyway): a busy pool's run is replayed whole whenever a worker's cache loses it.
   */
  runMaxEvents?: number;
  /** The `Dllama` resource that sizes this pool, if one does (its status is written back). */
  resource?: PoolResource;
}

/**
 * A `Dllama` resource at one generation, from the controller (signal-with-start, once per
 * generation): the pool takes its sizes, ignores generations it has applied, and writes the
 * resource's status while it has one. `deleted`: the resource is going away; the pool keeps
 * serving whoever uses the model but may scale to zero.
 */
export interface PoolResource {
  name: string;
  uid: string;
  generation: number;
  /** Instances kept even when idle: the resource's `spec.replicas`. */
  minInstances: number;
  maxInstances: number;
  leasesPerInstance: number;
  idleTimeoutMs: number;
  nodesPerInstance: number;
  /** `spec.drainTimeout` in ms, when the resource sets it. */
  drainTimeoutMs?: number;
  /**
   * What shapes its instances (shared/kube.ts `instanceSpecOf`; absent from controllers before
   * it): instances started under another are replaced (state.ts, "Rollout").
   */
  instanceSpec?: string;
  deleted?: boolean;
}

export type { InstanceView, PoolPhase, PoolStatus } from '../../shared/status';

/**
 * From a gateway replica (signal-with-start), on its cold path: it holds `waiting` first turns of
 * this model for want of an instance with room. Sent at most once a second per replica and model;
 * the pool counts it for 30 s (`DEMAND_HOLD_MS`, state.ts) unless sent again (0 withdraws it).
 */
export const demandSignal = defineSignal<[{ replica: string; waiting: number }]>('demand');
export const poolResourceSignal = defineSignal<[PoolResource]>('resourceChanged');
/**
 * From the model's pipeline: a new version of the model is published; failed starts may succeed
 * now. `revision` (shared/model.ts `modelRevision`; absent from pipelines before it) is what new
 * instances serve: instances of another are replaced (state.ts, "Rollout").
 */
export const modelPublishedSignal = defineSignal<[{ revision?: string }?]>('modelPublished');
export const poolStatusQuery = defineQuery<PoolStatus>('status');

export const poolWorkflowId = (namespace: string, model: string): string => `pool/${namespace}/${model}`;

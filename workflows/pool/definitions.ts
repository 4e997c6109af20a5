/** Messages of the `dllamaPool` workflow (id `pool/<namespace>/<model>`). */
import { defineQuery, defineSignal } from '@temporalio/workflow';

export interface PoolInput {
  namespace: string;
  /** The model's registry name; instances serve its artifact. */
  model: string;
  /** Instances kept even when idle (0 = scale to zero). */
  minInstances: number;
  maxInstances: number;
  /** Leases one instance takes before the pool adds another. */
  leasesPerInstance: number;
  /** An instance without leases for this long is stopped (down to `minInstances`). */
  idleTimeoutMs: number;
}

export interface InstanceView {
  id: string;
  phase: 'starting' | 'ready' | 'stopping';
  subject: string | null;
  leases: number;
}

export interface PoolStatus {
  instances: InstanceView[];
  /** Sessions waiting for a lease (e.g. during a cold start). */
  waiting: number;
  /** Set when the runtime cannot start an instance (e.g. no capacity); cleared on success. */
  lastError: string | null;
}

/** From a session: it wants an instance; answered with {@link leaseGrantedSignal} to `sessionWorkflowId`. */
export const leaseRequestedSignal = defineSignal<[{ sessionId: string; sessionWorkflowId: string }]>('leaseRequested');
export const leaseReleasedSignal = defineSignal<[{ sessionId: string }]>('leaseReleased');
/** Sent with signal-with-start by whoever needs the pool to exist; carries no data. */
export const ensurePoolSignal = defineSignal('ensurePool');
export const poolStatusQuery = defineQuery<PoolStatus>('status');

/** Pool → session. `error` when no instance can be started. */
export const leaseGrantedSignal = defineSignal<[{ instance: string; subject: string } | { error: string }]>('leaseGranted');

export const poolWorkflowId = (namespace: string, model: string): string => `pool/${namespace}/${model}`;

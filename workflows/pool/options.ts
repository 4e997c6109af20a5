/** Activity options and defaults of `dllamaPool` (pool.ts). */
import type { ActivityOptions } from '@temporalio/workflow';

/** Starting an instance waits for it to be healthy: a cold start may take minutes. */
export const startInstance: ActivityOptions = { startToCloseTimeout: '30m', heartbeatTimeout: '30s', retry: { maximumAttempts: 3, initialInterval: '2s' } };
export const quick: ActivityOptions = { startToCloseTimeout: '2m', retry: { initialInterval: '1s', maximumInterval: '30s' } };
export const publish: ActivityOptions = { startToCloseTimeout: '10s', retry: { initialInterval: '200ms', maximumInterval: '5s' } };
export const DEFAULT_HEALTH_CHECK_MS = 15_000;
export const DEFAULT_OWNER_TIMEOUT_MS = 10_000;
/** Events after which a run continues as new (`PoolInput.runMaxEvents`). */
export const POOL_RUN_MAX_EVENTS = 1500;
/** How the pool's watchers run: for the instance's whole life (a new attempt a day), their heartbeats prove the worker alive. */
export const watchOptions = (intervalMs: number): ActivityOptions => ({
  startToCloseTimeout: '1 day',
  heartbeatTimeout: Math.max(10_000, 3 * intervalMs),
  retry: { initialInterval: '1s', maximumInterval: '30s' },
});

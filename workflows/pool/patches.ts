/**
 * The pool's patches (workflows/README.md, "Changing workflow code"): each id guards one change
 * of the commands a pool emits. An id is never reused or renamed: it is in the histories.
 */

/**
 * An instance's watcher reports its restarts in place (a stop, then the end of the restart) and
 * is started again, instead of ending only with the instance's loss: the `Dllama` status and the
 * pool's page show an instance restarting, and how often it did. Pools started before it pass no
 * `known` to `watchInstance`, which then ends only on a loss, as before.
 */
export const RESTART_REPORTS_PATCH = 'pool-restart-reports';

/**
 * The `Dllama`'s status is written by an activity, not a local activity: a local activity's
 * completion could reach a replay beside other jobs and reorder the pool's timers
 * (workflows/resource-status.ts, `statusWrite`).
 */
export const STATUS_ACTIVITY_PATCH = 'pool-status-activity';

/**
 * New instances are named `<model>-<n>-<tag>` (state.ts `instanceIdOf`), not `<model>-<n>`: two
 * namespaces' models of the same name had instances of the same id, and so one request subject,
 * one consumer and one NATS user between two tenants. Instances a pool started before keep their ids.
 */
export const UNIQUE_INSTANCE_IDS_PATCH = 'pool-unique-instance-ids';

/**
 * The published view lists the instances being started (`starting`, with since when): a view is
 * written when a start begins, so gateways can say what a first turn waits for and `/v1/models`
 * can show a model whose engine is starting. Pools before it write no view for a start.
 */
export const VIEW_STARTING_PATCH = 'pool-view-starting';

/**
 * A pool whose input says `scaleOn: 'load'` sizes itself on the requests in flight or queued on
 * its instances, not on its live conversations (state.ts, "Scaling"), and its view says so, so
 * that gateways place by load with no lease limit. Only inputs written after it say `load`.
 */
export const SCALE_ON_LOAD_PATCH = 'pool-scale-on-load';

/**
 * `dllamaPool`: keeps min..max instances of one model serving under the entry-lease protocol
 * (ARCHITECTURE.md, "Data plane", "The entry-lease protocol"). The pool owns instances only — it
 * starts them, watches them, stops them, scales them and publishes the view gateways pick from
 * (`magus_pools`). It records **no event per conversation**: a conversation's lease is its
 * `magus_sessions` entry (created, renewed and moved by gateways, deleted by its session), and the
 * pool sees leases only counted, through its reconciler activity (`watchLoad`), which completes
 * when the counts or backlogs change what the pool decides, at most once every
 * {@link LOAD_REPORT_MIN_MS}. Gateways holding first turns for want of room say so with `demand`
 * (at most one a second per gateway replica and model). What a run carries into the next is
 * O(instances). The workflow never knows which runtime (local processes or Kubernetes) runs the
 * instances.
 *
 * Decisions live in {@link PoolState} (`state.ts`, tested without Temporal); this file wires them
 * to signals, activities and timers.
 */
import {
  ActivityFailure,
  ApplicationFailure,
  CancellationScope,
  allHandlersFinished,
  condition,
  continueAsNew,
  isCancellation,
  patched,
  proxyActivities,
  setHandler,
  TimeoutFailure,
  upsertSearchAttributes,
  uuid4,
  workflowInfo,
  type ActivityOptions,
} from '@temporalio/workflow';
import type { ServingActivities } from '../../activities/serving';
import { ErrorType } from '../../shared/errors';
import type { RestartReport } from '../../shared/status';
import { mirrorStatus, statusWrite, type StatusView } from '../resource-status';
import { visibility } from '../visibility';
import { demandSignal, modelPublishedSignal, poolResourceSignal, poolStatusQuery, type PoolInput, type PoolResource } from './definitions';
import { poolDetails } from './details';
import { DEFAULT_HEALTH_CHECK_MS, DEFAULT_OWNER_TIMEOUT_MS, POOL_RUN_MAX_EVENTS, publish, quick, startInstance, watchOptions } from './options';
import { RESTART_REPORTS_PATCH, SCALE_ON_LOAD_PATCH, STATUS_ACTIVITY_PATCH, UNIQUE_INSTANCE_IDS_PATCH, VIEW_STARTING_PATCH } from './patches';
import { PoolState, PRESSURE_PENDING, type LoadReport, type PoolCarry, type PoolInstance } from './state';

/** The reconciler runs until the load changes; its heartbeats prove it alive. */
const reconciler: ActivityOptions = { startToCloseTimeout: '1 day', heartbeatTimeout: '30s', retry: { initialInterval: '1s', maximumInterval: '30s' } };
/** The reconciler reports at most this often (a pool's events per minute are bounded by it, whatever the rate of conversations). */
export const LOAD_REPORT_MIN_MS = 2000;

export async function dllamaPool(input: PoolInput, carry?: PoolCarry): Promise<void> {
  if (!(input.maxInstances >= 1 && input.minInstances >= 0 && input.minInstances <= input.maxInstances && input.leasesPerInstance >= 1)) {
    throw ApplicationFailure.nonRetryable(
      `invalid pool sizes: min ${input.minInstances}, max ${input.maxInstances}, leases/instance ${input.leasesPerInstance}`,
      ErrorType.InvalidSpec,
    );
  }
  // Only an input written since the patch says `load`; a history without its marker never had one.
  const state = new PoolState(input, carry, { onLoad: input.scaleOn === 'load' && patched(SCALE_ON_LOAD_PATCH) });
  const { createInstance } = proxyActivities<ServingActivities>(startInstance);
  const { destroyInstance, workerGone } = proxyActivities<ServingActivities>(quick);
  const { writePool } = proxyActivities<ServingActivities>(publish);
  const { watchLoad } = proxyActivities<ServingActivities>(reconciler);
  const healthCheckMs = input.healthCheckMs ?? DEFAULT_HEALTH_CHECK_MS;
  const ownerTimeoutMs = input.ownerTimeoutMs ?? DEFAULT_OWNER_TIMEOUT_MS;
  const { watchInstance } = proxyActivities<ServingActivities>(watchOptions(healthCheckMs));
  const owners = new Map<string, Pick<ServingActivities, 'destroyInstance' | 'watchInstance'>>();
  const watchers = new Map<string, CancellationScope>();
  /** Starts, stops and view writes in flight: a run closes once none is. */
  const busy = new Set<Promise<void>>();
  let dirty = true;
  const now = () => Date.now();
  const track = (p: Promise<void>): void => {
    const q = p
      .catch(() => undefined)
      .finally(() => {
        busy.delete(q);
        dirty = true;
      });
    busy.add(q);
  };
  const closing = () => workflowInfo().continueAsNewSuggested || workflowInfo().historyLength >= (input.runMaxEvents ?? POOL_RUN_MAX_EVENTS);

  setHandler(demandSignal, ({ replica, waiting }) => {
    state.demanded(replica, waiting, now());
    dirty = true;
  });
  // The model was (re)published: a start that failed for want of it may work now.
  setHandler(modelPublishedSignal, (published) => {
    state.clearBackoff();
    state.revisionPublished(published?.revision); // instances of another revision are replaced (state.ts, "Rollout")
    dirty = true;
  });
  setHandler(poolResourceSignal, (r: PoolResource) => {
    if (state.resource(r)) dirty = true;
  });
  setHandler(poolStatusQuery, () => state.status(now()));

  // Search attributes are carried over continue-as-new: set once, by the first run.
  if (!carry) upsertSearchAttributes({ MagusKind: ['pool'], MagusModel: [`${input.namespace}/${input.model}`] });
  const shown = visibility({ phase: () => state.phase(), details: () => poolDetails(input, state.phase(), state.status(now()), state.onLoad) });

  // The `Dllama`'s status mirrors the pool: instances, readiness and the last error.
  const writeDllamaStatus = statusWrite('writeDllamaStatus', STATUS_ACTIVITY_PATCH);
  const statusView: StatusView = {
    attached: () => input.resource !== undefined,
    shown: () => JSON.stringify({ s: state.status(0), r: input.resource ?? null }),
    write: (previous) => {
      const r = input.resource!;
      return writeDllamaStatus({
        namespace: input.namespace,
        name: r.name,
        uid: r.uid,
        workflowId: workflowInfo().workflowId,
        observedGeneration: r.generation,
        nodesPerInstance: r.nodesPerInstance,
        pool: state.status(now()),
        previous,
      });
    },
  };
  void mirrorStatus(statusView);

  /** The activities of the worker that runs `i` (a local runtime's processes), or none when any worker answers for it. */
  function ownerOf(i: PoolInstance) {
    if (!i.runtimeQueue) return undefined;
    let o = owners.get(i.runtimeQueue);
    if (!o) {
      const bound = { taskQueue: i.runtimeQueue, scheduleToStartTimeout: ownerTimeoutMs };
      o = {
        destroyInstance: proxyActivities<ServingActivities>({ ...quick, ...bound }).destroyInstance,
        watchInstance: proxyActivities<ServingActivities>({ ...watchOptions(healthCheckMs), ...bound }).watchInstance,
      };
      owners.set(i.runtimeQueue, o);
    }
    return o;
  }
  const ownerGone = (err: unknown) => err instanceof ActivityFailure && err.cause instanceof TimeoutFailure && err.cause.timeoutType === 'SCHEDULE_TO_START';

  /** Stops `i` through its worker; that worker gone or failing, any worker still removes the request consumer. */
  function destroy(i: PoolInstance): Promise<void> {
    watchers.get(i.id)?.cancel();
    const anyWorker = () => destroyInstance({ pool: input.model, instance: i.id });
    const o = ownerOf(i);
    return o ? o.destroyInstance({ pool: input.model, instance: i.id }).catch(anyWorker) : anyWorker();
  }

  /** `i` no longer serves: dropped and cleaned up; gateways move its conversations once the view no longer lists it. */
  function lost(i: PoolInstance, reason: string): void {
    if (!state.lost(i, reason)) return;
    track(destroy(i));
    dirty = true;
  }

  /** `i` was restarted in place, or is being: recorded for its status, and watched again. */
  function restarted(i: PoolInstance, report: RestartReport): void {
    if (!state.restarted(i, report)) return;
    watchers.delete(i.id);
    watch(i);
    dirty = true;
  }

  /**
   * Watches `i` for its life: when the watcher completes, `i` is lost. A watcher's retry that its
   * worker's queue did not take within `ownerTimeoutMs` proves only that the worker is gone *or*
   * Temporal is slow: `i` is lost only when that worker's runtime advert says it is gone.
   */
  function watch(i: PoolInstance): void {
    if (watchers.has(i.id)) return;
    const scope = new CancellationScope();
    watchers.set(i.id, scope);
    const run = ownerOf(i)?.watchInstance ?? watchInstance;
    const known = patched(RESTART_REPORTS_PATCH) ? (i.restarts ?? { stops: 0, recovering: false }) : undefined;
    scope
      .run(() => run({ pool: input.model, instance: i.id, intervalMs: healthCheckMs, ...(known ? { known } : {}) }))
      .then(
        ({ reason, restart }) => (restart ? restarted(i, restart) : lost(i, reason)),
        async (err: unknown) => {
          if (isCancellation(err)) return; // the pool stopped it, or the run closes
          if (ownerGone(err) && i.runtimeQueue) {
            const answer = await workerGone({ runtimeQueue: i.runtimeQueue }).catch(() => undefined);
            watchers.delete(i.id);
            if (answer?.gone) lost(i, `the worker running instance ${i.id} is gone (${answer.reason})`);
            else if (state.instances.get(i.id) === i) watch(i);
            return;
          }
          lost(i, `instance ${i.id} could not be watched: ${err instanceof ActivityFailure && err.cause ? err.cause.message : String(err)}`);
        },
      )
      .finally(() => {
        if (watchers.get(i.id) === scope) watchers.delete(i.id);
      });
  }

  /** Starts instance `id` with the pool's leases per instance (its engine's parallel slots). */
  function start(id: string): void {
    track(
      createInstance({ namespace: input.namespace, model: input.model, pool: input.model, instance: id, leases: input.leasesPerInstance }).then(
        (info) => {
          state.started(id, info, now());
          const i = state.instances.get(id);
          if (i) watch(i);
        },
        (err: unknown) => state.startFailed(id, err instanceof ActivityFailure && err.cause ? err.cause.message : String(err), now()),
      ),
    );
  }

  // The reconciler: restarted with what it reported, and whenever the serving instances change.
  let reconciling: { ids: string; scope: CancellationScope } | null = null;
  const stopReconciler = (): void => {
    reconciling?.scope.cancel();
    reconciling = null;
  };
  function reconcileLoad(): void {
    const ids = state.serving().map((i) => i.id);
    const retiring = state.retiring();
    const draining = retiring.map((i) => i.id);
    const key = draining.length > 0 ? `${ids.join(',')}|${draining.join(',')}` : ids.join(',');
    if (reconciling?.ids === key) return;
    stopReconciler();
    if (ids.length === 0) return;
    const scope = new CancellationScope();
    const mine = { ids: key, scope };
    reconciling = mine;
    scope
      .run(() =>
        watchLoad({
          namespace: input.namespace,
          model: input.model,
          instances: ids,
          leasesPerInstance: input.leasesPerInstance,
          maxInstances: input.maxInstances,
          known: unreported(state.lastLoad, retiring),
          minIntervalMs: LOAD_REPORT_MIN_MS,
          pressurePending: PRESSURE_PENDING,
          ...(draining.length > 0 ? { draining } : {}),
          ...(state.onLoad ? { scaleOn: 'load' as const } : {}),
        }),
      )
      .then(
        (report) => state.loaded(report, now()),
        () => undefined, // cancelled (the instances changed, or the run closes); a failure is retried by the activity's policy
      )
      .finally(() => {
        if (reconciling === mine) reconciling = null;
        dirty = true;
      });
  }

  function reconcile(): void {
    if (closing()) return; // what is in flight settles; the next run, a task away, decides
    const plan = state.plan(now(), () => (patched(UNIQUE_INSTANCE_IDS_PATCH) ? uuid4().replace(/-/g, '').slice(0, 8) : undefined));
    for (const id of plan.start) start(id);
    for (const i of plan.stop) track(destroy(i).then(() => state.stopped(i.id)));
    reconcileLoad();
    const view = state.viewToWrite(now(), patched(VIEW_STARTING_PATCH));
    if (view) {
      track(
        writePool({ namespace: input.namespace, model: input.model, ...view }).then(
          () => state.written(true, now()),
          (err: unknown) => {
            state.written(false, now()); // retried by the next reconcile
            throw err;
          },
        ),
      );
    }
  }

  // Instances carried over are watched like any other (their watcher reports one that died meanwhile).
  for (const i of state.instances.values()) watch(i);

  for (;;) {
    if (dirty) {
      dirty = false;
      reconcile();
    }
    shown.refresh();
    const wait = closing() ? undefined : state.nextDeadline(now());
    if (!(await condition(() => dirty, wait ?? '1 day'))) dirty = true; // a deadline passed: look again
    if (closing() && busy.size === 0) {
      stopReconciler();
      await condition(allHandlersFinished);
      await continueAsNew<typeof dllamaPool>(input, state.carry(now()));
    }
  }
}

/**
 * The reconciler's `known`, less the instances retired since it last reported on them: what it
 * had of their in-flight requests may be stale (their leases kept them busy, so a change was never
 * reported), and an instance it does not know is reported at its first look.
 */
function unreported(known: LoadReport | null, retiring: PoolInstance[]): LoadReport | null {
  const stale = retiring.filter((i) => !i.flightReported).map((i) => i.id);
  if (!known || stale.length === 0) return known;
  return { instances: Object.fromEntries(Object.entries(known.instances).filter(([id]) => !stale.includes(id))) };
}

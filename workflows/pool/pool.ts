/**
 * `dllamaPool`: keeps min..max topology instances of one model and leases them to sessions.
 * Grants go to the ready instance with the fewest leases below `leasesPerInstance`; when every
 * ready instance is full, or sessions are waiting, it asks the runtime for another (up to max;
 * at max, leases are spread over the existing ones). Instances without leases for
 * `idleTimeoutMs` are stopped, down to `minInstances` (zero included). The workflow never knows
 * which runtime (local processes or Kubernetes) runs the instances.
 *
 * It publishes its ready instances and their lease counts to `magus_pools` whenever they change
 * (one write in flight at a time, the latest state wins), so gateways serve first turns without
 * waiting on a workflow; a session then asks for a lease on the instance its gateway picked
 * (`preferred`). An idle instance is first unpublished (`draining`) and stopped only after
 * `drainGraceMs`, once the write that removed it has completed; a session taking it meanwhile
 * keeps it.
 */
import {
  ActivityFailure,
  ApplicationFailure,
  CancellationScope,
  allHandlersFinished,
  isCancellation,
  condition,
  continueAsNew,
  makeContinueAsNewFunc,
  getExternalWorkflowHandle,
  patched,
  proxyActivities,
  proxyLocalActivities,
  setHandler,
  TimeoutFailure,
  upsertSearchAttributes,
  workflowInfo,
  type ActivityOptions,
} from '@temporalio/workflow';
import type { KubernetesActivities } from '../../activities/kubernetes/activities';
import type { InstanceInfo } from '../../activities/runtime/runtime';
import type { ServingActivities } from '../../activities/serving';
import { ErrorType } from '../../shared/errors';
import { mirrorStatus, STATUS_WRITE, type StatusView } from '../resource-status';
import { legacySessionWorkflowId } from '../session/definitions';
import { visibility } from '../visibility';
import { poolDetails } from './details';
import { DEFAULT_HEALTH_CHECK_MS, DEFAULT_OWNER_TIMEOUT_MS, POOL_RUN_MAX_EVENTS, publish, quick, startInstance, watchOptions } from './options';
import { entryLeasePool, entryPoolQueue } from './entry-pool';
import {
  CARRIED_WATCH_PATCH,
  ENTRY_LEASES_PATCH,
  ENTRY_LEASES_SWITCH_PATCH,
  GRANTS_SETTLE_PATCH,
  OWNER_CONFIRM_PATCH,
  OWNER_QUEUE_PATCH,
  PHASE_ATTRIBUTE_PATCH,
  PUBLISH_GROWABLE_PATCH,
  QUIESCE_PATCH,
  RELEASE_WITHDRAWS_PATCH,
  RESOURCE_STATUS_PATCH,
  SHORTER_RUNS_PATCH,
  START_BACKOFF_PATCH,
  VIEW_THROTTLE_PATCH,
  WATCH_PATCH,
} from './patches';
// Failed starts back off ({@link START_BACKOFF_PATCH}): the n-th failure in a row waits base × 2^(n−1), capped.
import { DEFAULT_DRAIN_GRACE_MS, START_BACKOFF_BASE_MS, START_BACKOFF_MAX_MS, type PoolCarryV2 } from './state';

export { poolDetails };
import { leaseGrantedSignal, leaseReleasedSignal, leaseRequestedSignal, ensurePoolSignal, modelPublishedSignal, poolResourceSignal, poolStatusQuery, type InstanceView, type PoolInput, type PoolPhase, type PoolResource, type PoolStatus } from './definitions';

/** The published view is rewritten at least this often, so gateways can tell a live pool's entry from a dead one's. */
const POOL_ENTRY_REFRESH_MS = 60_000;
/** Sessions that would wait longer than this for the next start are refused at once (a prompt 503 with the reason). */
const START_WAIT_MAX_MS = 30_000;
/** Lease counts alone are published at most this often ({@link VIEW_THROTTLE_PATCH}). */
const LEASE_VIEW_MIN_MS = 5000;
/** A health probe never holds the pool up: one short attempt; a failed probe proves nothing. */
const probe: ActivityOptions = { scheduleToCloseTimeout: '15s', retry: { maximumAttempts: 1 } };

interface Instance {
  id: string;
  phase: InstanceView['phase'];
  subject: string | null;
  leases: Set<string>;
  /** Workflow time the last lease was released (or the instance became ready). */
  idleSince: number;
  /** Workflow time it was unpublished for stopping (phase `draining`). */
  drainSince: number;
  /** The task queue of the worker that runs it, if only that worker can describe or destroy it. */
  runtimeQueue?: string;
}

/** State carried over continue-as-new. */
export interface PoolCarry {
  instances: { id: string; subject: string; leases: string[]; idleSince: number; runtimeQueue?: string }[];
  nextId: number;
  waiting: { sessionId: string; sessionWorkflowId: string }[];
  /** The workflow id of each session holding a lease (ids name their model since sessions did). */
  sessionWorkflowIds?: Record<string, string>;
  /** Leases given while the run closed, their grants not yet sent: the next run sends them ({@link QUIESCE_PATCH}). */
  grants?: { sessionId: string; sessionWorkflowId: string; instance: string; subject: string }[];
}

export async function dllamaPool(input: PoolInput, prior?: PoolCarry | PoolCarryV2): Promise<void> {
  if (!(input.maxInstances >= 1 && input.minInstances >= 0 && input.minInstances <= input.maxInstances && input.leasesPerInstance >= 1)) {
    throw ApplicationFailure.nonRetryable(`invalid pool sizes: min ${input.minInstances}, max ${input.maxInstances}, leases/instance ${input.leasesPerInstance}`, ErrorType.InvalidSpec);
  }
  if (prior && 'protocol' in prior) return entryLeasePool(input, prior);
  if (patched(ENTRY_LEASES_PATCH)) return entryLeasePool(input, prior && fromOldCarry(prior), prior?.grants ?? []);
  const carry = prior;
  const { createInstance, destroyInstance } = proxyActivities<ServingActivities>(startInstance);
  const { describeInstance } = proxyActivities<ServingActivities>(quick);
  const { writePool } = proxyActivities<ServingActivities>(publish);
  const { describeInstance: probeInstance } = proxyActivities<ServingActivities>(probe);
  const { workerGone } = proxyActivities<ServingActivities>(quick);
  const ownerQueues = patched(OWNER_QUEUE_PATCH);
  const ownerTimeoutMs = input.ownerTimeoutMs ?? DEFAULT_OWNER_TIMEOUT_MS;
  const owners = new Map<string, Pick<ServingActivities, 'describeInstance' | 'destroyInstance' | 'watchInstance'> & { probe: ServingActivities['describeInstance'] }>();
  const drainGraceMs = input.drainGraceMs ?? DEFAULT_DRAIN_GRACE_MS;
  const healthCheckMs = input.healthCheckMs ?? DEFAULT_HEALTH_CHECK_MS;
  let nextHealthCheck = Date.now() + healthCheckMs;
  const watching = patched(WATCH_PATCH);
  const { watchInstance } = proxyActivities<ServingActivities>(watchOptions(healthCheckMs));
  /** The running watcher of each ready instance, cancelled when the pool stops the instance. */
  const watchers = new Map<string, CancellationScope>();
  const instances = new Map<string, Instance>();
  const waiting: { sessionId: string; sessionWorkflowId: string }[] = [...(carry?.waiting ?? [])];
  let nextId = carry?.nextId ?? 1;
  /**
   * The workflow id of each session that asked for a lease, to hand it a new one when its
   * instance is lost (from its request: a session's id is not derived from its key alone).
   */
  const sessionIds = new Map<string, string>(Object.entries(carry?.sessionWorkflowIds ?? {}));
  const sessionWorkflowOf = (sessionId: string): string => sessionIds.get(sessionId) ?? legacySessionWorkflowId(sessionId);
  let lastError: string | null = null;
  const startBackoff = patched(START_BACKOFF_PATCH);
  let startFailures = 0;
  let nextStartAt = 0;
  let dirty = true;
  const publishGrowable = patched(PUBLISH_GROWABLE_PATCH);
  const viewThrottle = patched(VIEW_THROTTLE_PATCH);
  const settleGrants = patched(GRANTS_SETTLE_PATCH);
  /** Grants signalled and not yet delivered (with {@link GRANTS_SETTLE_PATCH}). */
  const granting = new Set<Promise<void>>();
  const quiesce = patched(QUIESCE_PATCH);
  let shorterRuns = false; // checked where it always was, before the main loop
  /** The run is due to continue as new (the server suggests it, or it reached its event budget). */
  let switching = false;
  const closing = () => switching || workflowInfo().continueAsNewSuggested || (shorterRuns && workflowInfo().historyLength >= (input.runMaxEvents ?? POOL_RUN_MAX_EVENTS));
  /** Closing, with {@link QUIESCE_PATCH}: no scaling, no view write, no deadline to wake for. */
  const settling = () => quiesce && closing();
  /**
   * Closing with only grants in flight: leases given now are granted by the next run. While a
   * start, a stop or a view write is still in flight (it is waited for anyway, and may take
   * seconds) grants go out at once.
   */
  const quiescing = () => settling() && starting.size === 0;
  /** Leases given while the run closes ({@link QUIESCE_PATCH}): carried to the next run, which sends their grants. */
  const deferred: NonNullable<PoolCarry['grants']> = [];
  /** A lease-count change held back by the throttle is due then (0: none held back). */
  let viewDueAt = 0;
  const starting = new Set<Promise<void>>();
  // What gateways see in `magus_pools`: the last completed write (`key` is its view as JSON,
  // never ''), and the instance ids of the write in flight, if any.
  let published = { key: '', shape: '', at: 0, ids: new Set<string>() };
  let inFlight: Set<string> | null = null;

  for (const c of carry?.instances ?? []) {
    instances.set(c.id, { id: c.id, phase: 'ready', subject: c.subject, leases: new Set(c.leases), idleSince: c.idleSince, drainSince: 0, runtimeQueue: c.runtimeQueue });
  }

  setHandler(leaseRequestedSignal, (req) => {
    sessionIds.set(req.sessionId, req.sessionWorkflowId);
    // A session asking again (e.g. after a retry) keeps its lease.
    for (const i of instances.values()) {
      if (i.leases.has(req.sessionId) && i.subject) {
        offer(req.sessionWorkflowId, { instance: i.id, subject: i.subject }, req.sessionId);
        return;
      }
    }
    // Its gateway already sent the first turn there: keep the conversation where its KV cache is.
    const preferred = req.preferred === undefined ? undefined : instances.get(req.preferred);
    if (preferred?.subject && (preferred.phase === 'ready' || preferred.phase === 'draining')) {
      preferred.phase = 'ready';
      preferred.leases.add(req.sessionId);
      offer(req.sessionWorkflowId, { instance: preferred.id, subject: preferred.subject }, req.sessionId);
      dirty = true;
      return;
    }
    if (!waiting.some((w) => w.sessionId === req.sessionId)) waiting.push(req);
    dirty = true;
  });
  setHandler(leaseReleasedSignal, ({ sessionId }) => {
    sessionIds.delete(sessionId);
    for (const i of instances.values()) {
      if (i.leases.delete(sessionId) && i.leases.size === 0) i.idleSince = Date.now();
    }
    // A session whose caller went away withdraws its request: it is no demand any more.
    if (patched(RELEASE_WITHDRAWS_PATCH)) {
      const k = waiting.findIndex((w) => w.sessionId === sessionId);
      if (k >= 0) waiting.splice(k, 1);
    }
    dirty = true;
  });
  setHandler(ensurePoolSignal, () => {
    dirty = true;
  });
  // The model was (re)published: a start that failed for want of it may work now.
  setHandler(modelPublishedSignal, () => {
    startFailures = 0;
    nextStartAt = 0;
    dirty = true;
  });
  const status = (): PoolStatus => ({
    instances: [...instances.values()].map((i) => ({ id: i.id, phase: i.phase, subject: i.subject, leases: i.leases.size })),
    waiting: waiting.length,
    lastError,
    ...(startBackoff ? { startFailures, nextStartAt } : {}),
  });
  setHandler(poolStatusQuery, status);
  // The `Dllama` resource sizing this pool: a generation already applied is ignored; the sizes
  // are validated by the CRD (and again here: a pool never takes min > max).
  setHandler(poolResourceSignal, (r: PoolResource) => {
    const known = input.resource;
    if (known && known.uid === r.uid && r.generation <= known.generation && !r.deleted) return;
    if (r.deleted) {
      if (known?.uid !== r.uid) return;
      input.resource = undefined;
      input.minInstances = 0;
    } else if (r.maxInstances >= 1 && r.minInstances >= 0 && r.minInstances <= r.maxInstances && r.leasesPerInstance >= 1 && r.idleTimeoutMs >= 0) {
      input.resource = r;
      Object.assign(input, { minInstances: r.minInstances, maxInstances: r.maxInstances, leasesPerInstance: r.leasesPerInstance, idleTimeoutMs: r.idleTimeoutMs });
      // A new spec is a new reason to try at once.
      startFailures = 0;
      nextStartAt = 0;
    }
    dirty = true;
  });
  upsertSearchAttributes({ MagusKind: ['pool'], MagusModel: [`${input.namespace}/${input.model}`] });
  const phase = (): PoolPhase => {
    const all = [...instances.values()];
    if (all.some((i) => i.phase === 'ready' || i.phase === 'draining')) return 'serving';
    if (all.some((i) => i.phase === 'starting')) return 'starting';
    return startFailures > 0 ? 'failing' : 'idle';
  };
  const shown = visibility({ phase, details: () => poolDetails(input, phase(), status()), upsertPhase: patched(PHASE_ATTRIBUTE_PATCH) });

  /** A lease given now: granted at once, or — the run closing — by the next run. */
  function offer(sessionWorkflowId: string, lease: { instance: string; subject: string }, sessionId: string): void {
    if (!quiescing()) return void grant(sessionWorkflowId, lease, sessionId);
    const k = deferred.findIndex((g) => g.sessionId === sessionId);
    if (k >= 0) deferred.splice(k, 1);
    deferred.push({ sessionId, sessionWorkflowId, ...lease });
    dirty = true;
  }

  function grant(sessionWorkflowId: string, payload: { instance: string; subject: string } | { error: string }, sessionId?: string): Promise<void> {
    if (!settleGrants) return send(sessionWorkflowId, payload, sessionId);
    const p = send(sessionWorkflowId, payload, sessionId).finally(() => {
      granting.delete(p);
      dirty = true;
    });
    granting.add(p);
    return p;
  }
  async function send(sessionWorkflowId: string, payload: { instance: string; subject: string } | { error: string }, sessionId?: string): Promise<void> {
    try {
      await getExternalWorkflowHandle(sessionWorkflowId).signal(leaseGrantedSignal, payload);
    } catch {
      // The session has ended meanwhile: nobody holds the lease granted to it.
      if (sessionId !== undefined && 'instance' in payload) {
        const i = instances.get(payload.instance);
        if (i?.leases.delete(sessionId) && i.leases.size === 0) i.idleSince = Date.now();
        dirty = true;
      }
    }
  }

  /** The activities of the worker that runs `i` (by its runtime queue); none when any worker answers for it. */
  function ownerOf(i: Instance) {
    const queue = ownerQueues ? i.runtimeQueue : undefined;
    if (!queue) return undefined;
    let o = owners.get(queue);
    if (!o) {
      const bound = { taskQueue: queue, scheduleToStartTimeout: ownerTimeoutMs };
      o = {
        probe: proxyActivities<ServingActivities>({ ...probe, ...bound }).describeInstance,
        describeInstance: proxyActivities<ServingActivities>({ ...quick, ...bound }).describeInstance,
        destroyInstance: proxyActivities<ServingActivities>({ ...quick, ...bound }).destroyInstance,
        watchInstance: proxyActivities<ServingActivities>({ ...watchOptions(healthCheckMs), ...bound }).watchInstance,
      };
      owners.set(queue, o);
    }
    return o;
  }

  /** Nobody took the activity from the owner's queue in time: that worker, and its instances, are gone. */
  const ownerGone = (err: unknown) => err instanceof ActivityFailure && err.cause instanceof TimeoutFailure && err.cause.timeoutType === 'SCHEDULE_TO_START';

  /**
   * Whether `i` serves: its description, `null` when it is gone (also when its worker is), or
   * `undefined` when the check failed (which proves nothing). `probe`: one short attempt.
   */
  async function describe(i: Instance, how: 'probe' | 'describe'): Promise<InstanceInfo | null | undefined> {
    const o = ownerOf(i);
    const ask = how === 'probe' ? (o?.probe ?? probeInstance) : (o?.describeInstance ?? describeInstance);
    try {
      return await ask({ pool: input.model, instance: i.id });
    } catch (err) {
      if (ownerGone(err)) return null;
      if (how === 'probe') return undefined;
      throw err;
    }
  }

  /**
   * Stops `i` through its worker. That worker gone (its processes died with it), or failing, any
   * worker still removes the request consumer.
   */
  function destroy(i: Instance): Promise<void> {
    const anyWorker = () => destroyInstance({ pool: input.model, instance: i.id });
    const o = ownerOf(i);
    return o ? o.destroyInstance({ pool: input.model, instance: i.id }).catch(anyWorker) : anyWorker();
  }

  /**
   * Asks the runtime about every serving instance; one that no longer serves is dropped (and
   * cleaned up) and its sessions wait for a new lease like any other (reconcile grants them).
   */
  async function checkHealth(): Promise<void> {
    const serving = [...instances.values()].filter((i) => i.phase === 'ready' || i.phase === 'draining');
    const infos = await Promise.all(serving.map((i) => describe(i, 'probe')));
    serving.forEach((i, k) => {
      const info = infos[k];
      if (info === undefined || info?.healthy) return; // unknown (the check failed), or healthy
      lost(i, `instance ${i.id} stopped serving`);
    });
  }

  /** `i` no longer serves: drop it (and clean it up); its sessions wait for a new lease. */
  function lost(i: Instance, reason: string): void {
    if (instances.get(i.id) !== i || (i.phase !== 'ready' && i.phase !== 'draining')) return; // changed meanwhile
    lastError = reason;
    instances.delete(i.id);
    for (const sessionId of i.leases) {
      if (!waiting.some((w) => w.sessionId === sessionId)) waiting.push({ sessionId, sessionWorkflowId: sessionWorkflowOf(sessionId) });
    }
    watchers.get(i.id)?.cancel();
    const p = destroy(i)
      .catch(() => undefined)
      .finally(() => {
        starting.delete(p);
        dirty = true;
      });
    starting.add(p);
    dirty = true;
  }

  /** Starts `i`'s watcher (with the watch patch): when it completes, or its worker is gone, `i` is lost. */
  function watch(i: Instance): void {
    if (!watching || watchers.has(i.id)) return;
    const scope = new CancellationScope();
    watchers.set(i.id, scope);
    const run = ownerOf(i)?.watchInstance ?? watchInstance;
    scope
      .run(() => run({ pool: input.model, instance: i.id, intervalMs: healthCheckMs }))
      .then(
        ({ reason }) => lost(i, reason),
        (err: unknown) => {
          if (isCancellation(err)) return; // the pool stopped it
          if (ownerGone(err) && i.runtimeQueue && patched(OWNER_CONFIRM_PATCH)) return void confirmOwnerGone(i);
          lost(i, ownerGone(err) ? `the worker running instance ${i.id} is gone` : `instance ${i.id} could not be watched: ${err instanceof ActivityFailure && err.cause ? err.cause.message : String(err)}`);
        },
      )
      .finally(() => {
        if (watchers.get(i.id) === scope) watchers.delete(i.id);
      });
  }

  /**
   * Nobody took `i`'s watcher from its worker's queue in time: drop `i` if that worker is gone
   * (its runtime advert says so), else watch it again (Temporal was slow, the worker lives).
   * A check that fails proves nothing either: watch again.
   */
  async function confirmOwnerGone(i: Instance): Promise<void> {
    const answer = await workerGone({ runtimeQueue: i.runtimeQueue! }).catch(() => undefined);
    if (instances.get(i.id) !== i || (i.phase !== 'ready' && i.phase !== 'draining')) return; // changed meanwhile
    if (answer?.gone) lost(i, `the worker running instance ${i.id} is gone (${answer.reason})`);
    else watch(i);
  }

  function start(): void {
    const id = `${input.model}-${nextId++}`;
    const inst: Instance = { id, phase: 'starting', subject: null, leases: new Set(), idleSince: Date.now(), drainSince: 0 };
    instances.set(id, inst);
    const p = createInstance({ namespace: input.namespace, model: input.model, pool: input.model, instance: id })
      .then((info) => {
        inst.phase = 'ready';
        inst.subject = info.subject;
        inst.runtimeQueue = info.runtimeQueue;
        inst.idleSince = Date.now();
        watch(inst);
        lastError = null;
        startFailures = 0;
        nextStartAt = 0;
      })
      .catch((err: unknown) => {
        instances.delete(id);
        lastError = err instanceof ActivityFailure && err.cause ? err.cause.message : String(err);
        if (startBackoff) {
          startFailures++;
          const delay = Math.min(START_BACKOFF_MAX_MS, START_BACKOFF_BASE_MS * 2 ** (startFailures - 1));
          nextStartAt = Date.now() + delay;
          lastError = `${lastError} (${startFailures} failed start${startFailures > 1 ? 's' : ''} in a row; next attempt in ${Math.round(delay / 1000)}s)`;
        }
        // Nobody can be served by an instance that cannot start: tell the waiting sessions now
        // rather than leaving them to time out (the gateway answers 503).
        if ([...instances.values()].every((i) => i.phase !== 'starting' && i.phase !== 'ready')) {
          for (const w of waiting.splice(0)) void grant(w.sessionWorkflowId, { error: lastError });
        }
      })
      .finally(() => {
        starting.delete(p);
        dirty = true;
      });
    starting.add(p);
  }

  function reconcile(): void {
    // Closing (QUIESCE_PATCH): no grant once only grants are in flight, and no scaling or view
    // write at all; what is in flight settles, and the next run, a task away, picks it all up.
    if (quiescing()) return;
    // 1. Grants: the least-loaded ready instance with room; at max, the least-loaded one. A
    //    draining instance is as good as a ready one (it is taken back).
    const leasable = () => [...instances.values()].filter((i) => i.phase === 'ready' || i.phase === 'draining');
    const live = () => [...instances.values()].filter((i) => i.phase !== 'stopping');
    while (waiting.length > 0) {
      const candidates = leasable().sort((a, b) => a.leases.size - b.leases.size);
      const roomy = candidates.find((i) => i.leases.size < input.leasesPerInstance);
      const target = roomy ?? (live().length >= input.maxInstances ? candidates[0] : undefined);
      if (!target?.subject) break;
      const w = waiting.shift()!;
      target.phase = 'ready';
      target.leases.add(w.sessionId);
      void grant(w.sessionWorkflowId, { instance: target.id, subject: target.subject }, w.sessionId);
    }
    if (settling()) return;
    // 2. Scale up: enough instances for the leases and the waiting sessions, within min..max.
    const leases = live().reduce((n, i) => n + i.leases.size, 0);
    const wanted = Math.min(input.maxInstances, Math.max(input.minInstances, Math.ceil((leases + waiting.length) / input.leasesPerInstance)));
    const backingOff = startBackoff && Date.now() < nextStartAt;
    if (!backingOff) for (let n = live().length; n < wanted; n++) start();
    else if (waiting.length > 0 && nextStartAt - Date.now() > START_WAIT_MAX_MS && live().every((i) => i.phase !== 'starting' && i.phase !== 'ready')) {
      // Nothing serves and the next start is far off: say so now rather than let them wait.
      for (const w of waiting.splice(0)) void grant(w.sessionWorkflowId, { error: lastError ?? 'no instance can be started' });
    }
    // 3. Scale down: idle instances beyond the minimum, once their idle timeout has passed, are
    //    unpublished (draining) and stopped after the grace, once no published view lists them.
    let surplus = live().length - Math.max(input.minInstances, wanted);
    for (const i of [...instances.values()].filter((x) => x.phase === 'draining')) {
      if (i.leases.size > 0 || surplus <= 0) {
        i.phase = 'ready'; // needed again
        continue;
      }
      surplus--;
      if (Date.now() - i.drainSince >= drainGraceMs && !published.ids.has(i.id) && !inFlight?.has(i.id)) {
        i.phase = 'stopping';
        watchers.get(i.id)?.cancel();
        const p = destroy(i).finally(() => {
          instances.delete(i.id);
          starting.delete(p);
          dirty = true;
        });
        starting.add(p);
      }
    }
    for (const i of [...instances.values()].filter((x) => x.phase === 'ready').sort((a, b) => a.idleSince - b.idleSince)) {
      if (surplus <= 0) break;
      if (i.leases.size === 0 && Date.now() - i.idleSince >= input.idleTimeoutMs) {
        i.phase = 'draining';
        i.drainSince = Date.now();
        surplus--;
      }
    }
    // 4. Publish what gateways may pick from, when it changed (one write at a time).
    const view = [...instances.values()].filter((i) => i.phase === 'ready' && i.subject).map((i) => ({ instance: i.id, subject: i.subject!, leases: i.leases.size }));
    const growable = publishGrowable ? { growable: live().length < input.maxInstances } : {};
    const key = JSON.stringify(publishGrowable ? { view, ...growable } : view);
    // What gateways must learn at once: which instances, which of them are full, whether the pool grows.
    const shape = JSON.stringify({ s: view.map((v) => [v.instance, v.subject, v.leases >= input.leasesPerInstance]), ...growable });
    const held = viewThrottle && key !== published.key && shape === published.shape && Date.now() - published.at < LEASE_VIEW_MIN_MS;
    viewDueAt = held ? published.at + LEASE_VIEW_MIN_MS : 0;
    if ((key !== published.key || (view.length > 0 && Date.now() - published.at >= POOL_ENTRY_REFRESH_MS)) && !inFlight && !held) {
      const ids = new Set(view.map((v) => v.instance));
      inFlight = ids;
      const p = writePool({ namespace: input.namespace, model: input.model, instances: view, leasesPerInstance: input.leasesPerInstance, ...growable })
        .then(
          () => {
            published = { key, shape, at: Date.now(), ids };
          },
          () => undefined, // retried by the next reconcile
        )
        .finally(() => {
          inFlight = null;
          starting.delete(p);
          dirty = true;
        });
      starting.add(p);
    }
  }

  /** Milliseconds until the next idle instance may be unpublished or a draining one stopped, if any. */
  function nextIdleDeadline(): number | undefined {
    const deadlines: number[] = [];
    const idle = [...instances.values()].filter((i) => i.phase === 'ready' && i.leases.size === 0);
    if (idle.length > input.minInstances) deadlines.push(...idle.map((i) => i.idleSince + input.idleTimeoutMs - Date.now()));
    for (const i of instances.values()) if (i.phase === 'draining') deadlines.push(i.drainSince + drainGraceMs - Date.now());
    // A start held back by the backoff is due then (when one is wanted).
    if (startBackoff && nextStartAt > Date.now() && (waiting.length > 0 || [...instances.values()].filter((i) => i.phase !== 'stopping').length < input.minInstances)) deadlines.push(nextStartAt - Date.now());
    // Lease counts held back by the view throttle are published then.
    if (viewDueAt > 0) deadlines.push(viewDueAt - Date.now());
    return deadlines.length > 0 ? Math.max(0, Math.min(...deadlines)) : undefined;
  }

  // The `Dllama`'s status mirrors the pool: instances, readiness and the last error.
  const { writeDllamaStatus } = proxyLocalActivities<KubernetesActivities>(STATUS_WRITE);
  const statusView: StatusView = {
    attached: () => input.resource !== undefined,
    shown: () => JSON.stringify({ s: status(), r: input.resource ?? null }),
    write: (previous) => {
      const r = input.resource!;
      return writeDllamaStatus({ namespace: input.namespace, name: r.name, uid: r.uid, workflowId: workflowInfo().workflowId, observedGeneration: r.generation, nodesPerInstance: r.nodesPerInstance, pool: status(), previous });
    },
  };
  if (patched(RESOURCE_STATUS_PATCH)) void mirrorStatus(statusView);

  // Instances carried over continue-as-new may have died with their worker: their watchers tell
  // (before the patch: each described inline, and dropped without a stop when it did not answer).
  if (patched(CARRIED_WATCH_PATCH) && watching) {
    for (const i of instances.values()) watch(i);
  } else {
    for (const i of [...instances.values()]) {
      const info = await describe(i, 'describe');
      if (!info?.healthy) instances.delete(i.id);
      else watch(i);
    }
  }
  shorterRuns = patched(SHORTER_RUNS_PATCH);
  // Grants the run before this one gave and did not send: the lease is carried, the grant sent now.
  for (const g of carry?.grants ?? []) {
    const i = instances.get(g.instance);
    if (i?.subject === g.subject && i.leases.has(g.sessionId)) void grant(g.sessionWorkflowId, { instance: g.instance, subject: g.subject }, g.sessionId);
  }

  for (;;) {
    if (!switching && patched(ENTRY_LEASES_SWITCH_PATCH)) {
      switching = true;
      dirty = true;
    }
    if (dirty) {
      dirty = false;
      reconcile();
    }
    shown.refresh();
    // Closing: no deadline matters (reconcile waits for the next run); only what settles wakes it.
    const idle = settling() ? undefined : nextIdleDeadline();
    const checking = !watching && [...instances.values()].some((i) => i.phase === 'ready' || i.phase === 'draining');
    const untilCheck = checking ? Math.max(0, nextHealthCheck - Date.now()) : undefined;
    const wait = idle === undefined ? untilCheck : untilCheck === undefined ? idle : Math.min(idle, untilCheck);
    await condition(() => dirty, wait ?? '1 day');
    if (checking && Date.now() >= nextHealthCheck) {
      nextHealthCheck = Date.now() + healthCheckMs;
      await checkHealth();
    } else if (!checking) {
      nextHealthCheck = Date.now() + healthCheckMs;
    }
    if (!dirty) dirty = wait !== undefined; // a deadline passed (idle, or the health check): look again
    if (closing() && starting.size === 0 && granting.size === 0) {
      await condition(allHandlersFinished);
      const carried: PoolCarry = {
        instances: [...instances.values()].filter((i) => i.subject).map((i) => ({ id: i.id, subject: i.subject!, leases: [...i.leases], idleSince: i.idleSince, ...(i.runtimeQueue ? { runtimeQueue: i.runtimeQueue } : {}) })),
        nextId,
        waiting,
        sessionWorkflowIds: Object.fromEntries([...sessionIds].filter(([id]) => [...instances.values()].some((i) => i.subject && i.leases.has(id)))),
        ...(deferred.length > 0 ? { grants: deferred } : {}),
      };
      if (switching) await makeContinueAsNewFunc<typeof dllamaPool>({ taskQueue: entryPoolQueue(workflowInfo().taskQueue) })(input, carried);
      await continueAsNew<typeof dllamaPool>(input, carried);
    }
  }
}

/** An old-protocol run's carry as the entry-lease protocol's: its instances (lease counts until the reconciler reports), its waiting sessions. */
function fromOldCarry(c: PoolCarry): PoolCarryV2 {
  return {
    protocol: 2,
    instances: c.instances.map((i) => ({ id: i.id, subject: i.subject, ...(i.runtimeQueue ? { runtimeQueue: i.runtimeQueue } : {}), leases: i.leases.length, pending: 0, ackPending: 0, idleSince: i.idleSince })),
    nextId: c.nextId,
    startFailures: 0,
    nextStartAt: 0,
    lastError: null,
    demand: {},
    legacyWaiting: c.waiting.map((w) => ({ sessionId: w.sessionId, sessionWorkflowId: w.sessionWorkflowId })),
    legacyLeases: c.instances.flatMap((i) => i.leases.map((sessionId) => ({ sessionId, sessionWorkflowId: c.sessionWorkflowIds?.[sessionId] ?? legacySessionWorkflowId(sessionId), instance: i.id }))),
  };
}


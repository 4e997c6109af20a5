/**
 * The `dllamaPool` workflow's state (ARCHITECTURE.md, "Data plane", "The entry-lease protocol"):
 * its instances, the load its reconciler reports, the demand gateways signal on their cold path,
 * failed starts and their backoff — and the decisions made from them: how many instances to
 * start, which to drain and which to stop, what gateways may pick from (`magus_pools`) and when
 * to write it again.
 *
 * Rollout: the pool knows the model revision new instances serve (the pipeline's
 * `modelPublished`, else the first instance that says its own). An instance of another revision
 * is replaced: new instances are started for what the load wants, beside the old ones (a surge
 * past `maxInstances`); once enough of them serve, the old ones are retired — unpublished, so new
 * first turns and, at their next turn, their conversations go to the new ones (gateways move an
 * entry whose instance the view no longer lists) — and each is stopped once the answers it has in
 * flight have ended, or at the drain deadline. An old instance is never retired before a new one
 * serves in its place: a revision that cannot start leaves the old ones serving. The same holds
 * for what shapes an instance (its `Dllama`'s engine, topology, slots, resources, placement and
 * images: shared/kube.ts `instanceSpecOf`): the pool knows the newest (the resource's signal, or
 * a start that read a newer generation of it), and an instance built under another is replaced.
 *
 * Scaling: on load (`scaleOn: 'load'`, every pool magus starts since `SCALE_ON_LOAD_PATCH`), the
 * pool wants ⌈(requests in flight + queued on its instances + first turns gateways hold) /
 * `leasesPerInstance`⌉ instances — its engine's slots —, and at least one while any conversation
 * lives (its instance keeps the conversations' prefixes; an idle one costs a cache entry, not a
 * slot). An instance with nothing in flight or queued is idle whatever its conversations; one
 * idle for `idleTimeoutMs` beyond what is wanted is drained, and its conversations move at their
 * next turn (gateways move an entry whose instance the view no longer lists). So a burst grows the
 * pool and the pool shrinks back `idleTimeoutMs` after it. On leases (pools before the patch, and
 * inputs without `scaleOn`): ⌈(live conversations + held first turns) / `leasesPerInstance`⌉, and
 * an instance is idle only without conversations either.
 *
 * Nothing here is per conversation. A conversation's lease is its `magus_sessions` entry, which
 * gateways create, renew and move and its session deletes; the pool sees them only counted, per
 * instance, in the reconciler's {@link LoadReport}. What a run carries into the next is
 * O(instances) ({@link PoolCarry}).
 *
 * Deterministic and free of Temporal: time is passed in, so the class is tested as plain code
 * (`state.test.ts`); `pool.ts` wires it to signals, activities and timers.
 */
import { DEFAULT_DRAIN_SECONDS, type InstanceSpec } from '../../shared/kube';
import type { PoolEntry } from '../../shared/serving';
import type { RestartReport } from '../../shared/status';
import type { InstanceView, PoolInput, PoolPhase, PoolResource, PoolStatus } from './definitions';

/** Failed starts back off: the n-th failure in a row waits base × 2^(n−1), capped. */
export const START_BACKOFF_BASE_MS = 5000;
export const START_BACKOFF_MAX_MS = 5 * 60_000;
/** A gateway's signalled demand counts this long unless signalled again. */
export const DEMAND_HOLD_MS = 30_000;
/** Requests queued on an instance (not yet delivered to its engine) at which it counts as pressed. */
export const PRESSURE_PENDING = 4;
/** The published view is rewritten at least this often while it lists instances, so gateways can tell a live pool's entry from a dead one's. */
export const VIEW_REFRESH_MS = 60_000;
export const DEFAULT_DRAIN_GRACE_MS = 5000;
/** How long an instance being replaced may finish what it has in flight before it is stopped anyway: a `Dllama`'s default. */
export const DEFAULT_DRAIN_TIMEOUT_MS = DEFAULT_DRAIN_SECONDS * 1000;

export interface PoolInstance {
  id: string;
  phase: InstanceView['phase'];
  subject: string | null;
  /** The task queue of the worker that runs it, if only that worker can describe or destroy it. */
  runtimeQueue?: string;
  /** Live `magus_sessions` entries on it, as last reported. */
  leases: number;
  /** Requests queued (not yet delivered) and in flight at its engine, as last reported. */
  pending: number;
  ackPending: number;
  /** Time it last became idle (no leases, no backlog) as reported; an instance is idle only once reported on. */
  idleSince: number;
  /** The reconciler has reported on it (a new instance is not idle before: its first conversations may be on their way). */
  reported?: boolean;
  /** Time it was unpublished for stopping (phase `draining`). */
  drainSince: number;
  /** The model revision it serves, as its runtime said (absent: not said). */
  revision?: string;
  /** What shaped it, as its runtime said (absent: not said). */
  spec?: InstanceSpec;
  /** Set while it is replaced (phase `draining`): why. */
  retiring?: string;
  /** False from its retirement until the reconciler has reported on it since (its in-flight count before may be stale). */
  flightReported?: boolean;
  /** Its restarts in place as its watcher last reported them (absent: none reported). */
  restarts?: RestartReport;
}

/** The reconciler's summary: per instance of the pool, its live entries and its consumer's backlog. */
export interface LoadReport {
  instances: Record<string, { leases: number; pending: number; ackPending: number }>;
  /**
   * The pool's entries counted by the server for the pool as a whole (a pool on load, by workers
   * of this version): each instance's `leases` is then 0. Absent: the instances' leases are counted.
   */
  live?: number;
}

/** What one run of the pool carries into the next: O(instances), never per conversation. */
export interface PoolCarry {
  instances: {
    id: string;
    subject: string;
    runtimeQueue?: string;
    leases: number;
    pending: number;
    ackPending: number;
    idleSince: number;
    /** Absent in an older run's carry. */
    restarts?: RestartReport;
    revision?: string;
    spec?: InstanceSpec;
    /** Being replaced since `drainSince`. */
    retiring?: string;
    drainSince?: number;
  }[];
  /** The revision new instances serve, once known. */
  revision?: string;
  /** What shapes new instances, once known. */
  spec?: InstanceSpec;
  nextId: number;
  startFailures: number;
  nextStartAt: number;
  lastError: string | null;
  /** When the last start failed (epoch ms; 0: none in a row). */
  failedAt?: number;
  /** Demand signalled by gateway replicas, each until its time. */
  demand: Record<string, { waiting: number; until: number }>;
  /** The pool's live entries as last reported for the pool as a whole ({@link LoadReport.live}). */
  live?: number;
}

/** What gateways may pick from: the pool's `magus_pools` entry, less the time stamp the activity adds. */
export interface PoolView {
  instances: { instance: string; subject: string; leases: number }[];
  leasesPerInstance: number;
  growable: boolean;
  /** Why nothing can serve now (no instance serves or starts, and starts fail). */
  failing?: string;
  /** With `failing`: when the next start may be tried, and when the last one failed (epoch ms). */
  nextStartAt?: number;
  failedAt?: number;
  /** Instances being started and since when (only with `VIEW_STARTING_PATCH`). */
  starting?: PoolEntry['starting'];
  /** The pool scales on load: gateways place by load, with no lease limit (only with `SCALE_ON_LOAD_PATCH`). */
  scalesOn?: 'load';
}

/** The next things the workflow must do, decided at one moment. */
export interface Plan {
  /** New instances to start (their ids, already registered as `starting`). */
  start: string[];
  /** Instances to stop now (already marked `stopping`). */
  stop: PoolInstance[];
}

/** Longest instance id: one subject token and one DNS label (`mg-<instance>` names its Kubernetes objects). */
export const MAX_INSTANCE_ID = 63;

/**
 * The id of a pool's `n`th instance: `<model>-<n>-<tag>`, the model's name cut so the whole fits
 * {@link MAX_INSTANCE_ID}. Pools of models with the same name in two namespaces count from 1
 * alike, and an instance's id names its NATS subject, consumer and user: the random `tag` (8 hex
 * digits from the workflow's seeded random) keeps one tenant's instance from sharing another's.
 */
export function instanceIdOf(model: string, n: number, tag: string): string {
  const suffix = `-${n}-${tag}`;
  const head = model.slice(0, MAX_INSTANCE_ID - suffix.length).replace(/[^A-Za-z0-9]+$/, '');
  return `${head}${suffix}`;
}

export class PoolState {
  readonly input: PoolInput;
  readonly instances = new Map<string, PoolInstance>();
  nextId: number;
  startFailures: number;
  nextStartAt: number;
  lastError: string | null;
  failedAt: number;
  /** The model revision new instances serve, once known. */
  revision: string | null;
  /** What shapes new instances (their `Dllama`'s, the newest generation seen), once known. */
  spec: InstanceSpec | null;
  readonly demand = new Map<string, { waiting: number; until: number }>();
  /**
   * The reconciler's last report (at the start of a run, the counts carried over): the activity
   * reports only what differs from it.
   */
  lastLoad: LoadReport | null;
  /** The last view gateways have seen for sure: its instances, its {@link PoolState.shape}, and when its write completed (0: none in this run). */
  private published: { ids: ReadonlySet<string>; shape: string; at: number } = { ids: new Set(), shape: '', at: 0 };
  /** The view being written, if a write is under way. */
  private writingView: { ids: ReadonlySet<string>; shape: string } | null = null;

  /** Whether it scales on load ({@link PoolInput.scaleOn}, `SCALE_ON_LOAD_PATCH`), not on leases. */
  readonly onLoad: boolean;

  constructor(input: PoolInput, carry?: PoolCarry, opts: { onLoad?: boolean } = {}) {
    this.input = input;
    this.onLoad = opts.onLoad ?? false;
    this.nextId = carry?.nextId ?? 1;
    this.startFailures = carry?.startFailures ?? 0;
    this.nextStartAt = carry?.nextStartAt ?? 0;
    this.lastError = carry?.lastError ?? null;
    this.failedAt = carry?.failedAt ?? 0;
    this.revision = carry?.revision ?? null;
    const r = input.resource;
    this.spec = carry?.spec ?? (r?.instanceSpec ? { digest: r.instanceSpec, uid: r.uid, generation: r.generation } : null);
    for (const [replica, d] of Object.entries(carry?.demand ?? {})) this.demand.set(replica, d);
    this.lastLoad = carry
      ? {
          instances: Object.fromEntries(carry.instances.map((i) => [i.id, { leases: i.leases, pending: i.pending, ackPending: i.ackPending }])),
          ...(carry.live !== undefined ? { live: carry.live } : {}),
        }
      : null;
    for (const c of carry?.instances ?? []) {
      this.instances.set(c.id, {
        id: c.id,
        phase: 'ready',
        subject: c.subject,
        runtimeQueue: c.runtimeQueue,
        leases: c.leases,
        pending: c.pending,
        ackPending: c.ackPending,
        idleSince: c.idleSince,
        drainSince: 0,
        reported: true,
        ...(c.restarts ? { restarts: c.restarts } : {}),
        ...(c.revision ? { revision: c.revision } : {}),
        ...(c.spec ? { spec: c.spec } : {}),
        ...(c.retiring ? { phase: 'draining', retiring: c.retiring, drainSince: c.drainSince ?? 0, flightReported: false } : {}),
      });
    }
  }

  get drainGraceMs(): number {
    return this.input.drainGraceMs ?? DEFAULT_DRAIN_GRACE_MS;
  }

  get drainTimeoutMs(): number {
    return this.input.drainTimeoutMs ?? DEFAULT_DRAIN_TIMEOUT_MS;
  }

  /** `i` serves another revision than new instances do, or was shaped by another spec (each: both known). */
  outdated(i: PoolInstance): boolean {
    return this.outdatedWhy(i) !== null;
  }

  /** Why `i` is {@link outdated}, null when it is not. */
  private outdatedWhy(i: PoolInstance): string | null {
    if (this.revision !== null && i.revision !== undefined && i.revision !== this.revision) return `revision ${i.revision} is replaced by ${this.revision}`;
    if (this.spec !== null && i.spec !== undefined && i.spec.digest !== this.spec.digest)
      return `built from Dllama generation ${i.spec.generation}, replaced by instances of generation ${this.spec.generation}`;
    return null;
  }

  /**
   * What shapes instances, as a `Dllama` signal or a start said it: kept when it is newer than what
   * the pool knew (a later generation of the same resource; the pool's resource when it was
   * created again), so a start that read a generation not yet signalled is not replaced.
   */
  private specSeen(s: InstanceSpec): void {
    const known = this.spec;
    if (!known || (s.uid === known.uid ? s.generation > known.generation : s.uid === this.input.resource?.uid)) this.spec = s;
  }

  /** Instances being replaced, still answering what they have in flight. */
  retiring(): PoolInstance[] {
    return [...this.instances.values()].filter((i) => i.retiring !== undefined && i.phase === 'draining');
  }

  /** The pipeline published the model at `revision`: true when new instances now serve another. */
  revisionPublished(revision: string | undefined): boolean {
    if (!revision || revision === this.revision) return false;
    this.revision = revision;
    return true;
  }

  /** Instances that serve (ready, or draining: unpublished but still answering). */
  serving(): PoolInstance[] {
    return [...this.instances.values()].filter((i) => (i.phase === 'ready' || i.phase === 'draining') && i.subject !== null);
  }

  /** Instances that count towards the pool's size (all but those being stopped or replaced). */
  live(): PoolInstance[] {
    return [...this.instances.values()].filter((i) => i.phase !== 'stopping' && i.retiring === undefined);
  }

  /** First turns gateways are holding for want of room. */
  waiting(now: number): number {
    let n = 0;
    for (const d of this.demand.values()) if (d.until > now) n += d.waiting;
    return n;
  }

  /** A gateway replica holds `waiting` first turns for want of room (its cold path). */
  demanded(replica: string, waiting: number, now: number): void {
    if (waiting > 0) this.demand.set(replica, { waiting, until: now + DEMAND_HOLD_MS });
    else this.demand.delete(replica);
  }

  /** The reconciler's counts: leases, backlog; an instance turning idle starts its idle clock. */
  loaded(report: LoadReport, now: number): void {
    this.lastLoad = report;
    for (const i of this.instances.values()) {
      const r = report.instances[i.id];
      if (!r) continue; // not reported on (started since the reconciler began)
      const wasIdle = this.idle(i);
      i.leases = r.leases;
      i.pending = r.pending;
      i.ackPending = r.ackPending;
      i.reported = true;
      if (i.retiring !== undefined) i.flightReported = true;
      if (!wasIdle && this.idle(i)) i.idleSince = now;
      if (i.phase === 'draining' && i.retiring === undefined && !this.idle(i)) i.phase = 'ready'; // someone uses it after all
    }
  }

  /** `id` serves now. */
  started(id: string, info: { subject: string; runtimeQueue?: string; revision?: string; spec?: InstanceSpec }, now: number): void {
    const i = this.instances.get(id);
    if (!i || i.phase !== 'starting') return;
    i.phase = 'ready';
    i.subject = info.subject;
    if (info.runtimeQueue) i.runtimeQueue = info.runtimeQueue;
    if (info.revision) {
      i.revision = info.revision;
      this.revision ??= info.revision; // a pipeline's word, when one came, is the newer
    }
    if (info.spec) {
      i.spec = info.spec;
      this.specSeen(info.spec);
    }
    i.idleSince = now;
    i.reported = false;
    this.lastError = null;
    this.startFailures = 0;
    this.nextStartAt = 0;
  }

  /** `id` could not be started: it is forgotten, and the next start backs off. */
  startFailed(id: string, reason: string, now: number): void {
    this.instances.delete(id);
    this.startFailures++;
    this.failedAt = now;
    const delay = Math.min(START_BACKOFF_MAX_MS, START_BACKOFF_BASE_MS * 2 ** (this.startFailures - 1));
    this.nextStartAt = now + delay;
    this.lastError = `${reason} (${this.startFailures} failed start${this.startFailures > 1 ? 's' : ''} in a row; next attempt in ${Math.round(delay / 1000)}s)`;
  }

  /** Nothing serves or starts, and the next start is not now: what waiting callers are told. */
  failing(): string | undefined {
    if (this.startFailures === 0 || this.lastError === null) return undefined;
    if (this.live().length > 0) return undefined;
    return this.lastError;
  }

  /**
   * `i` no longer serves: it is dropped (the caller destroys it). Gateways move its conversations
   * when the view they see no longer lists it. False when it changed meanwhile.
   */
  lost(i: PoolInstance, reason: string): boolean {
    if (this.instances.get(i.id) !== i || (i.phase !== 'ready' && i.phase !== 'draining')) return false;
    this.lastError = reason;
    this.instances.delete(i.id);
    return true;
  }

  /**
   * `i` stopped by itself and is being (or has been) restarted in place, as its watcher reports
   * it: shown in the status while it restarts, counted after. False when it changed meanwhile.
   */
  restarted(i: PoolInstance, report: RestartReport): boolean {
    if (this.instances.get(i.id) !== i || (i.phase !== 'ready' && i.phase !== 'draining')) return false;
    i.restarts = report;
    return true;
  }

  /** A stopped instance is gone. */
  stopped(id: string): void {
    this.instances.delete(id);
  }

  /** The model was (re)published, or its resource changed: a start that failed may work now. */
  clearBackoff(): void {
    this.startFailures = 0;
    this.nextStartAt = 0;
  }

  /**
   * The `Dllama` resource sizing this pool: a generation already applied is ignored, a deleted
   * resource lets the pool scale to zero; sizes the CRD let through are checked again. True when
   * the sizes changed.
   */
  resource(r: PoolResource): boolean {
    const known = this.input.resource;
    if (known && known.uid === r.uid && r.generation <= known.generation && !r.deleted) return false;
    if (r.deleted) {
      if (known?.uid !== r.uid) return false;
      this.input.resource = undefined;
      this.input.minInstances = 0;
      return true;
    }
    if (!(r.maxInstances >= 1 && r.minInstances >= 0 && r.minInstances <= r.maxInstances && r.leasesPerInstance >= 1 && r.idleTimeoutMs >= 0)) return false;
    if (r.drainTimeoutMs !== undefined && !(r.drainTimeoutMs >= 0)) return false;
    this.input.resource = r;
    if (r.instanceSpec) this.specSeen({ digest: r.instanceSpec, uid: r.uid, generation: r.generation });
    Object.assign(this.input, {
      minInstances: r.minInstances,
      maxInstances: r.maxInstances,
      leasesPerInstance: r.leasesPerInstance,
      idleTimeoutMs: r.idleTimeoutMs,
      ...(r.drainTimeoutMs !== undefined ? { drainTimeoutMs: r.drainTimeoutMs } : {}),
    });
    this.clearBackoff();
    return true;
  }

  /** Whether `i` is idle: nothing queued or in flight (on leases: and no conversation either). */
  idle(i: PoolInstance): boolean {
    return this.onLoad ? isIdleOnLoad(i) : isIdle(i);
  }

  /** How many instances the load asks for, within min..max (above, "Scaling"). */
  wanted(now: number): number {
    const { minInstances, maxInstances, leasesPerInstance } = this.input;
    const live = this.live();
    // Conversations (requests) on instances being replaced count: they move to the others at their next turn.
    const counted = [...live, ...this.retiring()];
    const leases = this.lastLoad?.live ?? counted.reduce((n, i) => n + i.leases, 0);
    let wanted: number;
    if (this.onLoad) {
      const busy = counted.reduce((n, i) => n + i.pending + i.ackPending, 0);
      wanted = Math.max(Math.ceil((busy + this.waiting(now)) / leasesPerInstance), leases > 0 ? 1 : 0);
    } else wanted = Math.ceil((leases + this.waiting(now)) / leasesPerInstance);
    // Backlog pressure: every serving instance has requests queued and none is on its way.
    const ready = live.filter((i) => i.phase === 'ready');
    if (ready.length > 0 && !live.some((i) => i.phase === 'starting') && ready.every((i) => i.pending >= PRESSURE_PENDING))
      wanted = Math.max(wanted, live.length + 1);
    return Math.min(maxInstances, Math.max(minInstances, wanted));
  }

  /**
   * Decides what to start and stop now; registers the starts and marks the stops. `tag` gives each
   * new instance a random token ({@link instanceIdOf}); without one (pools from before
   * `UNIQUE_INSTANCE_IDS_PATCH`) ids are `<model>-<n>`.
   */
  plan(now: number, tag?: () => string | undefined): Plan {
    for (const [replica, d] of this.demand) if (d.until <= now) this.demand.delete(replica);
    const plan: Plan = { start: [], stop: [] };
    const wanted = this.wanted(now);
    // Instances being replaced (an older revision, another spec) do not count: as many new ones start as the load wants.
    const current = this.live().filter((i) => !this.outdated(i));
    if (now >= this.nextStartAt) {
      for (let n = current.length; n < wanted; n++) {
        const t = tag?.();
        const id = t ? instanceIdOf(this.input.model, this.nextId++, t) : `${this.input.model}-${this.nextId++}`;
        this.instances.set(id, { id, phase: 'starting', subject: null, leases: 0, pending: 0, ackPending: 0, idleSince: now, drainSince: 0 });
        plan.start.push(id);
      }
    }
    // Scale down: idle instances beyond what is wanted, once idle for the timeout, are
    // unpublished (draining), and stopped after the grace once no view gateways may hold lists them.
    this.roll(current, wanted, now, plan);
    let surplus = this.live().length - Math.max(this.input.minInstances, wanted);
    for (const i of [...this.instances.values()].filter((x) => x.phase === 'draining' && x.retiring === undefined)) {
      if (!this.idle(i) || surplus <= 0) {
        i.phase = 'ready'; // needed again
        continue;
      }
      surplus--;
      if (now - i.drainSince >= this.drainGraceMs && !this.published.ids.has(i.id) && !this.writingView?.ids.has(i.id)) {
        i.phase = 'stopping';
        plan.stop.push(i);
      }
    }
    for (const i of [...this.instances.values()].filter((x) => x.phase === 'ready').sort((a, b) => a.idleSince - b.idleSince)) {
      if (surplus <= 0) break;
      if (this.idle(i) && now - i.idleSince >= this.input.idleTimeoutMs) {
        i.phase = 'draining';
        i.drainSince = now;
        surplus--;
      }
    }
    return plan;
  }

  /**
   * Rollout: outdated instances beyond what the new ones serving leave wanted are retired
   * (the least loaded first); retired ones whose answers in flight have ended (reported since,
   * after the drain grace) or whose drain deadline passed are stopped, once no view lists them.
   */
  private roll(current: PoolInstance[], wanted: number, now: number, plan: Plan): void {
    const serving = current.filter((i) => i.phase === 'ready').length;
    let keep = Math.max(0, wanted - serving);
    const old = [...this.instances.values()].filter((i) => i.phase === 'ready' && this.outdated(i)).sort((a, b) => b.leases - a.leases);
    for (const i of old) {
      if (keep > 0) {
        keep--;
        continue;
      }
      i.phase = 'draining';
      i.retiring = this.outdatedWhy(i)!;
      i.drainSince = now;
      i.flightReported = false;
    }
    for (const i of this.retiring()) {
      const ended = i.flightReported === true && i.pending === 0 && i.ackPending === 0 && now - i.drainSince >= this.drainGraceMs;
      const deadline = now - i.drainSince >= this.drainTimeoutMs;
      if ((ended || deadline) && !this.published.ids.has(i.id) && !this.writingView?.ids.has(i.id)) {
        i.phase = 'stopping';
        plan.stop.push(i);
      }
    }
  }

  /** Milliseconds until a decision may change with no new input (idle timeouts, drain graces, backoff, demand, the view's refresh), if any. */
  nextDeadline(now: number): number | undefined {
    const deadlines: number[] = [];
    const idle = this.live().filter((i) => i.phase === 'ready' && this.idle(i));
    if (idle.length > this.input.minInstances) deadlines.push(...idle.map((i) => i.idleSince + this.input.idleTimeoutMs - now));
    for (const i of this.instances.values()) if (i.phase === 'draining' && i.retiring === undefined) deadlines.push(i.drainSince + this.drainGraceMs - now);
    // One being replaced waits for its report of nothing in flight (new input), its grace, and its deadline.
    for (const i of this.retiring()) deadlines.push(...[i.drainSince + this.drainGraceMs - now, i.drainSince + this.drainTimeoutMs - now].filter((d) => d > 0));
    if (this.nextStartAt > now && this.wanted(now) > this.live().length) deadlines.push(this.nextStartAt - now);
    for (const d of this.demand.values()) deadlines.push(d.until - now);
    if (this.published.at > 0 && this.serving().length > 0) deadlines.push(this.published.at + VIEW_REFRESH_MS - now);
    return deadlines.length > 0 ? Math.max(0, Math.min(...deadlines)) : undefined;
  }

  /** What gateways may pick from now; with `starting`, what they wait for too. */
  view(starting = false): PoolView {
    const failing = this.failing();
    const begun = starting ? [...this.instances.values()].filter((i) => i.phase === 'starting') : [];
    return {
      instances: [...this.instances.values()]
        .filter((i) => i.phase === 'ready' && i.subject)
        .map((i) => ({ instance: i.id, subject: i.subject!, leases: i.leases })),
      leasesPerInstance: this.input.leasesPerInstance,
      growable: this.live().length < this.input.maxInstances,
      ...(failing ? { failing, nextStartAt: this.nextStartAt, failedAt: this.failedAt } : {}),
      // A starting instance's idleSince is when its start was decided (started() resets it).
      ...(begun.length > 0 ? { starting: begun.map((i) => ({ instance: i.id, since: i.idleSince })) } : {}),
      ...(this.onLoad ? { scalesOn: 'load' as const } : {}),
    };
  }

  /** What a view must be rewritten for: instances, growable, failing — not lease counts alone. */
  static shape(v: PoolView): string {
    const shape = [v.instances.map((i) => [i.instance, i.subject]), v.leasesPerInstance, v.growable, v.failing ?? null];
    const withStarting = v.starting ? [...shape, v.starting.map((i) => i.instance)] : shape;
    return JSON.stringify(v.scalesOn ? [...withStarting, v.scalesOn] : withStarting);
  }

  /**
   * The view to write now, if one must be: no write is under way, and its shape changed since
   * the last one written, or it lists instances and was last written {@link VIEW_REFRESH_MS} ago.
   * Registered as being written.
   */
  viewToWrite(now: number, starting = false): PoolView | undefined {
    const view = this.view(starting);
    const shape = PoolState.shape(view);
    const refresh = view.instances.length > 0 && now - this.published.at >= VIEW_REFRESH_MS;
    if ((shape === this.published.shape && !refresh) || this.writeInFlight) return undefined;
    this.writing(view);
    return view;
  }

  /** `view` is being written. */
  writing(view: PoolView): void {
    this.writingView = { ids: new Set(view.instances.map((v) => v.instance)), shape: PoolState.shape(view) };
  }

  /** The write under way completed (`ok`, at `now`) or failed. */
  written(ok: boolean, now: number): void {
    if (ok && this.writingView) this.published = { ...this.writingView, at: now };
    this.writingView = null;
  }

  get writeInFlight(): boolean {
    return this.writingView !== null;
  }

  /** The status query's answer. */
  status(now: number): PoolStatus {
    return {
      instances: [...this.instances.values()].map((i) => ({
        id: i.id,
        phase: i.phase,
        subject: i.subject,
        leases: i.leases,
        ...(i.reported === false ? { reported: false } : {}),
        ...restartView(i.restarts),
        ...(i.revision ? { revision: i.revision } : {}),
        ...(i.retiring !== undefined ? { retiring: i.retiring } : {}),
        ...(i.phase === 'draining' && i.reported !== false ? { inFlight: i.pending + i.ackPending } : {}),
      })),
      waiting: this.waiting(now),
      lastError: this.lastError,
      startFailures: this.startFailures,
      nextStartAt: this.nextStartAt,
      ...(this.lastLoad?.live !== undefined ? { live: this.lastLoad.live } : {}),
    };
  }

  phase(): PoolPhase {
    const all = [...this.instances.values()];
    if (all.some((i) => i.phase === 'ready' || i.phase === 'draining')) return 'serving';
    if (all.some((i) => i.phase === 'starting')) return 'starting';
    return this.startFailures > 0 ? 'failing' : 'idle';
  }

  carry(now: number): PoolCarry {
    return {
      instances: this.serving().map((i) => ({
        id: i.id,
        subject: i.subject!,
        ...(i.runtimeQueue ? { runtimeQueue: i.runtimeQueue } : {}),
        leases: i.leases,
        pending: i.pending,
        ackPending: i.ackPending,
        idleSince: i.idleSince,
        ...(i.restarts ? { restarts: i.restarts } : {}),
        ...(i.revision ? { revision: i.revision } : {}),
        ...(i.spec ? { spec: i.spec } : {}),
        ...(i.retiring !== undefined ? { retiring: i.retiring, drainSince: i.drainSince } : {}),
      })),
      ...(this.revision ? { revision: this.revision } : {}),
      ...(this.spec ? { spec: this.spec } : {}),
      nextId: this.nextId,
      startFailures: this.startFailures,
      nextStartAt: this.nextStartAt,
      lastError: this.lastError,
      ...(this.failedAt ? { failedAt: this.failedAt } : {}),
      demand: Object.fromEntries([...this.demand].filter(([, d]) => d.until > now)),
      ...(this.lastLoad?.live !== undefined ? { live: this.lastLoad.live } : {}),
    };
  }
}

/** An instance's restarts as its status shows them: the reason while it restarts, the count and the last reason once it did. */
function restartView(r: RestartReport | undefined): Pick<InstanceView, 'restarting' | 'restarts' | 'lastRestart'> {
  if (!r || r.stops === 0) return {};
  return {
    ...(r.recovering ? { restarting: r.last ?? 'it stopped by itself' } : {}),
    restarts: r.stops,
    ...(r.last ? { lastRestart: r.last } : {}),
  };
}

/** No conversation on it and nothing queued or in flight. */
export const isIdle = (i: Pick<PoolInstance, 'leases' | 'pending' | 'ackPending' | 'reported'>): boolean =>
  i.reported !== false && i.leases === 0 && i.pending === 0 && i.ackPending === 0;

/** Nothing queued or in flight on it, whatever its conversations (a pool that scales on load). */
export const isIdleOnLoad = (i: Pick<PoolInstance, 'pending' | 'ackPending' | 'reported'>): boolean =>
  i.reported !== false && i.pending === 0 && i.ackPending === 0;

/**
 * The KV-backed session broker: which instance serves a conversation, answered for warm turns
 * from a watch-backed mirror of `magus_sessions` (no Temporal call, no KV read per request).
 *
 * It composes its collaborators and owns their lifetimes: the mirror and its per-instance counts
 * ({@link SessionMirror}), the pools' views ({@link PoolViews}), the pick of an instance with room
 * ({@link InstancePicker}), the entry-lease protocol's writes ({@link SessionEntries}), placement
 * of first turns, moves and renewals ({@link Placement}) with the demand told to pools
 * ({@link Demand}) and the session workflows started afterwards ({@link SessionStarts}), one
 * shared placement per conversation ({@link SharedCalls}) and the counters ({@link SessionCounters}).
 *
 * A broker without `FirstTurns` places no conversation itself: a turn with no fresh entry
 * takes the injected {@link ColdStart} (tests pin conversations so; the gateway process always
 * has first turns).
 */
import type { KvCache } from '../../../dataplane/kv-mirror';
import { SessionError, SessionErrorType } from '../../plugins/errors';
import type { ReadyModel } from '../../../shared/model';
import type { PoolEntry, SessionEntry } from '../../../shared/serving';
import { Demand } from './demand';
import { SessionEntries, unavailable } from './entries';
import { instanceKey, SessionMirror } from './mirror';
import { InstancePicker } from './picker';
import { ORPHAN_SWEEP_GRACE_MS, Placement, usable } from './placement';
import { PoolViews } from './pool-views';
import { SharedCalls } from './shared-calls';
import { SessionStarts } from './starts';
import { SessionCounters } from './stats';
import type {
  AcquireRequest,
  CachedEntry,
  ColdStart,
  ModelServing,
  QueueRefusal,
  QueueWaitsView,
  SessionBroker,
  SessionCacheOptions,
  SessionStats,
} from './types';

/** Expired entries and renewal marks are swept this often. */
const SWEEP_MS = 60_000;
/** How long an answer moved to an instance counts against it when the next one is moved (`another`). */
const MOVES_SPREAD_MS = 10_000;

export class SessionCache implements SessionBroker {
  /** The mirror of `magus_sessions` (the gateway reopens it after a reconnect, and reports whether it is live). */
  readonly cache: KvCache<CachedEntry>;
  /** The mirror of `magus_pools` (absent without a pools bucket). */
  readonly pools: KvCache<PoolEntry> | undefined;
  /** Both mirrors loaded. */
  readonly ready: Promise<void>;

  private readonly mirror: SessionMirror;
  private readonly views: PoolViews;
  private readonly picker: InstancePicker;
  private readonly counters = new SessionCounters();
  /** Concurrent turns of one conversation share one placement, aborted only when all of them have gone. */
  private readonly placing = new SharedCalls<SessionEntry>();
  /** Absent without first turns: such a broker places through its {@link ColdStart}. */
  private readonly placement: Placement | undefined;
  private readonly starts: SessionStarts | undefined;
  private readonly coldStart: ColdStart | undefined;
  private readonly now: () => number;
  private readonly marginMs: number;
  private readonly sweep: NodeJS.Timeout;
  private readonly waits: QueueWaitsView | undefined;
  /** When this gateway last moved answers to each instance ({@link instanceKey}), within {@link MOVES_SPREAD_MS}. */
  private readonly movedTo = new Map<string, number[]>();

  constructor(opts: SessionCacheOptions) {
    this.now = opts.now ?? Date.now;
    this.marginMs = opts.freshnessMarginMs ?? 5_000;
    this.coldStart = opts.coldStart;
    this.mirror = new SessionMirror(opts.kv, opts.onError, opts.recent);
    this.views = new PoolViews(opts.pools, opts.firstTurns, this.now, opts.onError);
    this.waits = opts.waits;
    this.picker = new InstancePicker(this.mirror, this.views, this.counters, opts.waits, opts.silent, opts.stopping);
    const first = opts.firstTurns;
    if (first) {
      this.starts = new SessionStarts(first, this.now, opts.maxPendingSessionStarts, opts.onError);
      this.placement = new Placement(
        first,
        {
          mirror: this.mirror,
          views: this.views,
          picker: this.picker,
          entries: new SessionEntries(first.sessions, this.mirror),
          starts: this.starts,
          demand: new Demand(first, this.now, opts.onError),
          counters: this.counters,
          crowded: (model, e) => this.crowded(model, e),
        },
        {
          marginMs: this.marginMs,
          renewWithinMs: opts.renewWithinMs ?? Infinity,
          renewIntervalMs: opts.renewIntervalMs ?? 30_000,
          now: this.now,
          onError: opts.onError,
        },
      );
    }
    this.cache = this.mirror.cache;
    this.pools = this.views.cache;
    this.ready = this.pools ? Promise.all([this.cache.ready, this.pools.ready]).then(() => undefined) : this.cache.ready;
    this.sweep = setInterval(() => this.sweepNow(), SWEEP_MS);
    this.sweep.unref();
  }

  /**
   * The minute's sweep: entries long expired leave the mirror — and, with first turns, the bucket
   * (nobody's session deleted them) —, renewal marks and move records go.
   */
  sweepNow(): void {
    const t = this.now();
    const orphans = this.mirror.sweep(t, ORPHAN_SWEEP_GRACE_MS);
    this.placement?.sweepOrphans(orphans);
    this.placement?.sweep(t);
    this.picker.sweep(t);
    for (const [k, times] of this.movedTo) if (!times.some((at) => t - at < MOVES_SPREAD_MS)) this.movedTo.delete(k);
  }

  stats(): SessionStats {
    return this.counters.snapshot(this.starts?.pending ?? 0);
  }

  serving(model: Pick<ReadyModel, 'namespace' | 'name'>): ModelServing {
    return servingOf(this.views.viewOf(model.namespace, model.name), this.now());
  }

  nextInstanceMs(model: Pick<ReadyModel, 'namespace' | 'name'>): number | undefined {
    return this.views.nextInstanceMs(model.namespace, model.name);
  }

  /** Live entries on an instance, as this gateway's mirror counts them (or, holding recent ones only, as the pool's view and this gateway's placements since say). */
  leasesOn(namespace: string, pool: string, instance: string): number {
    return this.picker.leasesOn(namespace, pool, instance);
  }

  acquire(req: AcquireRequest): Promise<SessionEntry> {
    const entry = this.mirror.get(req.conversationKey);
    // Not held by a mirror of recent conversations: read from the bucket first.
    if (!entry && !this.mirror.counts)
      return this.mirror.lookup(req.conversationKey).then(
        (read) => this.acquireWith(req, read),
        (err: unknown) => Promise.reject(unavailable(err, "the conversation's entry could not be read")),
      );
    return this.acquireWith(req, entry);
  }

  private acquireWith(req: AcquireRequest, entry: CachedEntry | undefined): Promise<SessionEntry> {
    const key = req.conversationKey;
    if (entry && usable(entry, this.now(), this.marginMs, this.views) && !this.crowded(req.model, entry)) {
      this.counters.warmHits++;
      this.placement?.renewLater(key, entry);
      this.placement?.adoptOrphan(req, entry);
      return Promise.resolve(entry);
    }
    const placement = this.placement;
    return this.placing.join(key, (signal) => (placement ? placement.place(req, signal, { entry }) : this.fromColdStart(req, signal)), req.signal);
  }

  async route({ model, signal }: { model: ReadyModel; signal: AbortSignal }): Promise<SessionEntry> {
    let target = this.picker.pick(model, { anyLoad: true });
    if (!target) {
      if (!this.placement)
        throw new SessionError(
          SessionErrorType.NoCapacity,
          `no instance of ${model.namespace}/${model.name} serves, and this gateway cannot ask its pool for one`,
        );
      target = await this.placement.room(model, signal);
      this.picker.release(model, target.instance);
    }
    return { subject: target.subject, pool: model.name, namespace: model.namespace, instance: target.instance, expiresAt: this.now() };
  }

  queueAdmit(model: ReadyModel, conversationKey: string | undefined): QueueRefusal | undefined {
    const waits = this.waits;
    if (!waits || waits.budgetMs <= 0) return undefined;
    const instances = this.instancesOf(model);
    if (!instances || instances.length === 0) return undefined; // none serves: the cold path waits for one
    const fits = (i: string) => !waits.overBudget(model.name, i);
    const entry = conversationKey === undefined ? undefined : this.mirror.get(conversationKey);
    const own = entry && usable(entry, this.now(), this.marginMs, this.views) ? entry.instance : undefined;
    // Where it goes: its own instance, else (a first turn, or a warm one moved) the picker's choice,
    // which puts instances over the budget last. Counted there at once, so that a burst's turns
    // see each other before their publishes are done.
    // (A broker that places nothing itself moves nothing: a warm turn stays where it is.)
    const target = own !== undefined && (fits(own) || !this.placement) ? own : this.picker.pick(model, { anyLoad: true })?.instance;
    if (target !== undefined && fits(target)) {
      waits.published(model.name, target);
      return undefined;
    }
    let best: QueueRefusal | undefined;
    for (const i of instances) {
      const waitMs = waits.waitMs(model.name, i);
      const retryAfterMs = waits.retryAfterMs(model.name, i);
      if (waitMs === undefined || retryAfterMs === undefined) continue;
      if (!best || retryAfterMs < best.retryAfterMs) best = { retryAfterMs, waitMs, budgetMs: waits.budgetMs };
    }
    if (best) {
      // A new instance may take it sooner than any queue drains: the pool's next start.
      const start = this.views.nextInstanceMs(model.namespace, model.name);
      if (start !== undefined && start < best.retryAfterMs) best = { ...best, retryAfterMs: start };
      this.counters.refusedForQueueWait++;
      // Demand only where the pool may grow: at its maximum, telling it costs its history events and changes nothing.
      if (this.views.viewOf(model.namespace, model.name)?.growable !== false) this.placement?.refusedForWait(model);
    }
    return best;
  }

  /** The instances `model`'s pool publishes now (its view: none without one). */
  instancesOf(model: ReadyModel): string[] | undefined {
    return this.views.viewOf(model.namespace, model.name)?.instances.map((i) => i.instance);
  }

  hasAnother(model: ReadyModel, instance: string): boolean {
    return (this.instancesOf(model) ?? []).some((i) => i !== instance);
  }

  another(model: ReadyModel, instance: string, { spread, byLoad }: { spread?: number; byLoad?: boolean } = {}): SessionEntry | undefined {
    const now = this.now();
    const recent = (i: string) => (this.movedTo.get(instanceKey(model.namespace, model.name, i)) ?? []).filter((t) => now - t < MOVES_SPREAD_MS);
    // Told its place among a bridge's hand-backs: the same choice on every gateway (ranked before
    // this gateway's own count of recent moves, after a queue over the budget).
    const others =
      spread !== undefined && Number.isSafeInteger(spread) && spread >= 0 ? (this.instancesOf(model) ?? []).filter((i) => i !== instance).sort() : [];
    const spreadTo = others.length > 0 ? others[spread! % others.length] : undefined;
    const busier = (i: string) => (i === spreadTo ? -1 : recent(i).length);
    // Its queue does not rank an instance: a bridge takes the answers moved to it before what is queued there
    // (ranked by it, a drain's hand-backs all went to the one instance a roll just started, past its resume sequences).
    // Nothing said of it: it goes before the target's queue in its place, so each instance's queue
    // pays for what it takes — the least full takes it (by name, each went where the n-th went
    // whatever its load, and a drained instance's queue doubled the queues of two while the third idled).
    const target = this.picker.pick(model, { anyLoad: true, avoid: instance, busier, queuesAside: true, ...(byLoad ? { byLoad: true } : {}) });
    if (!target) return undefined;
    this.movedTo.set(instanceKey(model.namespace, model.name, target.instance), [...recent(target.instance), now]);
    if (byLoad) this.waits?.published(model.name, target.instance);
    return { subject: target.subject, pool: model.name, namespace: model.namespace, instance: target.instance, expiresAt: now };
  }

  /** Whether `e`'s instance would keep a turn waiting past the budget where another of the pool would not (the picker's choice). */
  private crowded(model: ReadyModel, e: CachedEntry): boolean {
    if (!this.placement || !this.waits?.overBudget(model.name, e.instance)) return false;
    const other = this.picker.pick(model, { anyLoad: true, avoid: e.instance });
    return other !== undefined && !this.waits.overBudget(model.name, other.instance);
  }

  async close(): Promise<void> {
    clearInterval(this.sweep);
    this.placement?.close();
    this.placing.abortAll(new Error('gateway closing'));
    await Promise.all([this.cache.close(), this.views.close()]);
  }

  /** Without first turns: the injected {@link ColdStart} places the conversation. */
  private async fromColdStart(req: AcquireRequest, signal: AbortSignal): Promise<SessionEntry> {
    this.counters.coldStarts++;
    if (!this.coldStart)
      throw new SessionError(
        SessionErrorType.NoCapacity,
        `no instance of ${req.model.namespace}/${req.model.name} is placed for this conversation, and this gateway cannot place one`,
      );
    const entry = await this.coldStart({ ...req, signal });
    this.mirror.set(req.conversationKey, { ...entry, revision: 0 });
    return entry;
  }
}

/** A pool's published view (none: never started, or gone) as `/v1/models` and a waiting turn see it. */
export function servingOf(view: PoolEntry | undefined, now: number): ModelServing {
  const instances = view?.instances.length ?? 0;
  const starting = view?.starting ?? [];
  const oldest = starting.length > 0 ? Math.min(...starting.map((i) => i.since)) : undefined;
  const status = instances > 0 ? 'ready' : starting.length > 0 ? 'starting' : view?.failing ? 'failing' : 'idle';
  return {
    status,
    instances,
    starting: starting.length,
    ...(oldest !== undefined ? { startingForSec: Math.max(0, Math.round((now - oldest) / 1000)) } : {}),
    ...(status === 'failing' && view?.failing ? { failing: view.failing } : {}),
  };
}

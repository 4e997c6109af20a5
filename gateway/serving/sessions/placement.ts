/**
 * Placing a conversation with no entry fit to use (the entry-lease protocol's first turns, moves
 * and renewals): renew its entry when it is near expiry, move it when its instance is gone,
 * create it when there is none — compare-and-swap throughout, so every replica ends up with one
 * entry per conversation. With no instance with room, a first turn tells the pool of the demand
 * and waits on the view, bounded by its signal. A conversation created here gets its session
 * workflow once its turn is answered, and gives its entry back when it is not.
 */
import { SessionError, SessionErrorType } from '../../plugins/errors';
import type { ReadyModel } from '../../../shared/model';
import type { SessionEntry } from '../../../shared/serving';
import type { Demand } from './demand';
import { withoutRevision, type SessionEntries } from './entries';
import type { SessionMirror } from './mirror';
import type { InstancePicker } from './picker';
import type { PoolViews } from './pool-views';
import type { SessionStarts } from './starts';
import type { SessionCounters } from './stats';
import type { AcquireRequest, CachedEntry, FirstTurns, PublishedInstance } from './types';

/** How often a first turn waiting for room looks again. */
const ROOM_POLL_MS = 200;
/** A first turn waits for room at most this long when the pool says the next start is further away. */
const START_WAIT_MAX_MS = 30_000;
/** Writes lost to other replicas' before a turn gives up (each loss means the entry changed under it). */
const PLACE_ATTEMPTS = 8;
/** An entry unwatched this long past its first TTL has no session: its first expiry check would have marked it. */
export const ORPHAN_ADOPT_GRACE_MS = 60_000;
export { ORPHAN_SWEEP_GRACE_MS } from '../../../shared/serving';

/** An entry a turn uses as it is: not ending within `marginMs`, its instance still published. */
export function usable(e: CachedEntry, now: number, marginMs: number, views: PoolViews): boolean {
  return e.expiresAt - marginMs > now && !views.gone(e);
}

/** The collaborators placement works with (the session cache makes them and owns their lifetimes). */
export interface PlacementParts {
  mirror: SessionMirror;
  views: PoolViews;
  picker: InstancePicker;
  entries: SessionEntries;
  starts: SessionStarts;
  demand: Demand;
  counters: SessionCounters;
  /**
   * Whether a conversation's entry should move for its instance's queue: over the wait budget,
   * where another instance of the pool is within it (serving/queue-waits.ts).
   */
  crowded?: (model: ReadyModel, entry: CachedEntry) => boolean;
}

export interface PlacementSettings {
  /** An entry ending sooner than this is not used as it is: the turn renews it. */
  marginMs: number;
  /** A warm turn renews an entry with less than this left, at most once per `renewIntervalMs` per conversation. */
  renewWithinMs: number;
  renewIntervalMs: number;
  now: () => number;
  onError?: (err: unknown) => void;
}

export class Placement {
  /** When this gateway last wrote each conversation's entry (renewals are spaced by it). */
  private readonly lastRenewed = new Map<string, number>();
  /** Conversations whose missing session this gateway started, and when (once per TTL each). */
  private readonly adopted = new Map<string, number>();

  constructor(
    private readonly first: FirstTurns,
    private readonly parts: PlacementParts,
    private readonly settings: PlacementSettings,
  ) {}

  /** A warm turn's renewal (not awaited): once part of the TTL is used, at most once per interval. */
  renewLater(key: string, entry: CachedEntry): void {
    const { counters, entries } = this.parts;
    const t = this.settings.now();
    if (entry.expiresAt - t >= this.settings.renewWithinMs) return;
    const last = this.lastRenewed.get(key);
    if (last !== undefined && t - last < this.settings.renewIntervalMs) return;
    this.lastRenewed.set(key, t);
    counters.renewals++;
    entries.swap(key, entry, { ...withoutRevision(entry), expiresAt: t + this.first.ttlMs }).catch((err: unknown) => this.settings.onError?.(err));
  }

  /**
   * A warm turn's entry with no session workflow — placed more than a TTL (and
   * {@link ORPHAN_ADOPT_GRACE_MS}) ago and never `watched` by one: its gateway died before starting
   * it — gets one now (not awaited; a session already there is kept), so the Temporal UI lists
   * the conversation and its expiry is enforced. At most once per TTL per conversation here.
   */
  adoptOrphan(req: Pick<AcquireRequest, 'conversationKey' | 'model' | 'owner'>, entry: CachedEntry): void {
    if (entry.watched || entry.placedAt === undefined) return;
    const t = this.settings.now();
    if (t - entry.placedAt < this.first.ttlMs + ORPHAN_ADOPT_GRACE_MS) return;
    const last = this.adopted.get(req.conversationKey);
    if (last !== undefined && t - last < this.first.ttlMs) return;
    this.adopted.set(req.conversationKey, t);
    this.parts.counters.orphansAdopted++;
    this.parts.starts.start({ conversationKey: req.conversationKey, model: req.model, owner: req.owner }, withoutRevision(entry));
  }

  /** Deletes (compare-and-swap) entries that expired {@link ORPHAN_SWEEP_GRACE_MS} ago and are still there: nobody's session will. */
  sweepOrphans(orphans: readonly (readonly [key: string, revision: number])[]): void {
    for (const [key, revision] of orphans)
      this.parts.entries.giveBack(key, revision).then(
        (deleted) => void (deleted && this.parts.counters.orphansSwept++),
        (err: unknown) => this.settings.onError?.(err),
      );
  }

  /**
   * Places the conversation of `req`: renews, moves or creates its entry. `known`: its entry as the
   * caller just found it (held, or read from the bucket); else it is looked up here.
   */
  async place(req: AcquireRequest, signal: AbortSignal, known?: { entry: CachedEntry | undefined }): Promise<SessionEntry> {
    const { mirror, views, picker, entries, starts, counters } = this.parts;
    const { now, marginMs } = this.settings;
    const key = req.conversationKey;
    // (An entry that could not be read is found by the create, which then reads it.)
    let entry = known ? (mirror.get(key) ?? known.entry) : await mirror.lookup(key).catch(() => mirror.get(key));
    const crowded = (e: CachedEntry) => this.parts.crowded?.(req.model, e) === true;
    for (let attempt = 0; attempt < PLACE_ATTEMPTS; attempt++) {
      const t = now();
      // Moved for its queue alone: its instance serves, but would keep the turn waiting past the budget.
      const forQueue = entry !== undefined && !views.gone(entry) && crowded(entry);
      if (entry && usable(entry, t, marginMs, views) && !forQueue) return entry; // another turn placed it meanwhile
      // A pick is reserved at once (concurrent turns of this replica see it before its entry is written).
      const picked = !(entry && !views.gone(entry)) || forQueue;
      if (!entry && starts.full) {
        counters.refusedForPendingStarts++;
        throw new SessionError(
          SessionErrorType.Unavailable,
          `${starts.pending} conversations answered by this gateway still wait for their session workflow to start (Temporal starts them more slowly than they arrive): no new one until they drain`,
        );
      }
      // Moved for its queue: to the picker's choice whatever its leases (a warm turn never waits for a start), else kept where it is.
      const target = !picked
        ? { instance: entry!.instance, subject: entry!.subject }
        : forQueue
          ? picker.reserve(req.model, picker.pick(req.model, { anyLoad: true }) ?? { instance: entry!.instance, subject: entry!.subject, leases: 0 })
          : await this.room(req.model, signal);
      try {
        const placedAt = entry && entry.instance === target.instance ? (entry.placedAt ?? now()) : now();
        const next: SessionEntry = {
          subject: target.subject,
          pool: req.model.name,
          namespace: req.model.namespace,
          instance: target.instance,
          expiresAt: now() + this.first.ttlMs,
          placedAt,
          ...(entry?.watched ? { watched: true as const } : {}),
        };
        if (!entry) {
          const created = await entries.create(key, next);
          if (!created.won) {
            entry = created.entry; // lost the create: the key exists
            continue;
          }
          this.created(req, next, created.entry.revision);
          return next;
        }
        const expired = entry.expiresAt <= t;
        const moved = entry.instance !== target.instance;
        const swapped = await entries.swap(key, entry, next);
        if (!swapped.won) {
          entry = swapped.entry;
          continue;
        }
        if (moved) counters.moves++;
        if (moved && !views.gone(entry)) counters.queueMoves++;
        this.lastRenewed.set(key, now());
        // Its session may have ended with the expiry (or never started): one runs for it again.
        if (expired) starts.start({ conversationKey: key, model: req.model, owner: req.owner }, next);
        return next;
      } finally {
        if (picked) picker.release(req.model, target.instance);
      }
    }
    throw new SessionError(
      SessionErrorType.Unavailable,
      `the entry of a conversation on ${req.model.namespace}/${req.model.name} kept changing under this gateway`,
    );
  }

  /**
   * An instance with room for one more conversation of `model`, reserved (the caller releases
   * it), waiting — and telling the pool of the demand — until there is one, the pool says none
   * can start soon, or `signal` aborts.
   */
  async room(model: ReadyModel, signal: AbortSignal): Promise<PublishedInstance> {
    const { views, picker, demand, counters } = this.parts;
    const { now } = this.settings;
    const found = picker.pick(model);
    if (found) return picker.reserve(model, found);
    // A view too old to use as it is: its instances are looked at first (once per interval).
    await views.probed(model);
    const alive = picker.pick(model);
    if (alive) return picker.reserve(model, alive);
    const k = demand.wait(model);
    counters.coldStarts++;
    const since = now();
    try {
      for (;;) {
        if (this.first.reachable && !this.first.reachable())
          throw new SessionError(
            SessionErrorType.Unavailable,
            `Temporal is unreachable: no instance of ${model.namespace}/${model.name} has room, and its pool cannot be told`,
          );
        demand.tell(k);
        await sleepFor(ROOM_POLL_MS, signal);
        const i = picker.pick(model);
        if (i) return picker.reserve(model, i);
        const view = views.viewOf(model.namespace, model.name);
        // Nothing serves or starts and starts fail: refused once a start failed while this turn
        // waited (its answer), or when the next start is far off; an older failure is no answer
        // to this turn (its demand may be what the next start is for).
        if (view?.failing && view.instances.length === 0 && ((view.failedAt ?? 0) >= since || (view.nextStartAt ?? Infinity) - now() > START_WAIT_MAX_MS)) {
          throw new SessionError(SessionErrorType.NoCapacity, `no instance of ${model.namespace}/${model.name} can be started: ${view.failing}`);
        }
      }
    } finally {
      demand.leave(k);
    }
  }

  /** A turn of `model` refused for its queue wait: told to its pool as demand for a while (its client comes back). */
  refusedForWait(model: ReadyModel): void {
    this.parts.demand.refused(model);
  }

  /** Forgets renewal marks older than the renewal interval (they would otherwise pile up for every conversation ever seen). */
  sweep(now: number): void {
    for (const [key, at] of this.lastRenewed) if (now - at > this.settings.renewIntervalMs) this.lastRenewed.delete(key);
    for (const [key, at] of this.adopted) if (now - at > this.first.ttlMs) this.adopted.delete(key);
  }

  close(): void {
    this.parts.demand.close();
    this.parts.starts.close();
  }

  /** A conversation this turn created: its session starts once the turn is answered; unanswered, its entry is given back. */
  private created(req: AcquireRequest, entry: SessionEntry, revision: number): void {
    const { entries, starts, counters } = this.parts;
    const key = req.conversationKey;
    counters.firstTurns++;
    this.lastRenewed.set(key, this.settings.now());
    const adoption = { conversationKey: key, model: req.model, owner: req.owner };
    const giveBack = () => {
      counters.givenBack++;
      entries.giveBack(key, revision).catch((err: unknown) => this.settings.onError?.(err));
    };
    if (!req.answered) starts.start(adoption, entry);
    else req.answered.then((ok) => (ok ? starts.start(adoption, entry) : giveBack()), giveBack);
  }
}

/** Resolves after `ms`, or rejects with the signal's reason once it aborts. */
function sleepFor(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise<void>((resolve, reject) => {
    if (signal.aborted) return reject(signal.reason instanceof Error ? signal.reason : new Error('aborted'));
    const onAbort = () => {
      clearTimeout(t);
      reject(signal.reason instanceof Error ? signal.reason : new Error('aborted'));
    };
    const t = setTimeout(() => {
      signal.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    signal.addEventListener('abort', onAbort, { once: true });
  });
}

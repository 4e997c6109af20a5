/**
 * Sessions: which instance serves a conversation. The gateway asks a {@link SessionBroker}; the
 * broker here answers warm turns from a watch-backed mirror of the `magus_sessions` KV bucket
 * (no Temporal call, no KV read per request).
 *
 * The entry-lease protocol (ARCHITECTURE.md, "Data plane", "The entry-lease protocol"): a
 * conversation's entry **is** its lease.
 * A first turn picks an instance with room from the pool's published instances (`magus_pools`),
 * counting the entries on each instance in this mirror (every replica's, as the watch delivers
 * them) plus its own picks not yet written, and creates the entry (KV create: one per
 * conversation across replicas); the conversation's session workflow is started afterwards, off
 * the client's path. Warm turns renew the entry's expiry themselves (compare-and-swap, at most
 * once per `renewIntervalMs` and only once part of the TTL is used): no Temporal call. An entry
 * whose instance the pool no longer publishes is moved (compare-and-swap: one replica wins, the
 * others use its choice). With no instance with room, the turn tells the pool there is demand
 * (`demand`, at most once a second per model) and waits on the view, bounded by its signal.
 *
 * A broker without {@link FirstTurns} places no conversation itself: a turn with no fresh entry
 * takes the injected {@link ColdStart} (tests pin conversations so; the gateway process always
 * has first turns).
 */
import type { KvEntry } from 'nats';
import { isRevisionConflict } from '../../dataplane';
import { SessionError, SessionErrorType } from '../plugins/errors';
import type { ReadyModel } from '../../shared/model';
import { decodePoolEntry, decodeSessionEntry, POOL_ENTRY_MAX_AGE_MS, type PoolEntry, type SessionEntry } from '../../shared/serving';

export { decodePoolEntry, decodeSessionEntry };
import { watchKv, type KvCache, type WatchableKv } from '../../dataplane/kv-mirror';

export interface AcquireRequest {
  /** The conversation key (conversation.ts): stable across the turns of one conversation. */
  conversationKey: string;
  model: ReadyModel;
  /** The calling key's owner (plugins/auth.ts `Principal.owner`). */
  owner: string;
  /** Aborted when the client goes away or the gateway gives up waiting. */
  signal: AbortSignal;
  /**
   * Settles once the turn that asked is over: true when it was answered. A conversation this turn
   * created gets its session workflow only then; a first turn refused (a full backlog), failed or
   * left by its client gives its entry back (deleted with compare-and-swap), so it leaves nothing
   * behind: no lease counted, no workflow. Absent: the session starts at once.
   */
  answered?: Promise<boolean>;
}

/**
 * Finds (or starts) the instance for a conversation. Throws errors whose `type` is a
 * `SessionErrorType` (plugins/errors.ts: `BacklogFull` → 429, `NoCapacity` → 503) when it cannot.
 */
export interface SessionBroker {
  acquire(req: AcquireRequest): Promise<SessionEntry>;
  /**
   * An instance for a request that belongs to no conversation (embeddings): the least loaded
   * one the pool publishes, whether or not it has room for another conversation (such a request
   * takes no lease; the instance's queue bounds it); none serving — the cold path, as a first
   * turn waits. Nothing is written and no session starts. The entry answered expires at once.
   */
  route(req: { model: ReadyModel; signal: AbortSignal }): Promise<SessionEntry>;
  /** Counters for /metrics, when the broker keeps them. */
  stats?(): SessionStats;
}

export interface SessionStats {
  /** Turns answered from the session cache. */
  warmHits: number;
  /** Conversations moved off an instance the pool no longer publishes. */
  moves?: number;
  /** Entries renewed by this gateway (compare-and-swap). */
  renewals?: number;
  /** Entries of first turns that were not answered (refused, failed, left), deleted again. */
  givenBack?: number;
  /** Turns that waited: for an instance with room (telling the pool of the demand), or on the {@link ColdStart}. */
  coldStarts: number;
  /** First turns served from a pool's published instances (the session workflow confirms later). */
  firstTurns: number;
  /** Of those, picks from a view its pool had not rewritten in time, among its instances found consuming. */
  staleViewPicks?: number;
  /** Conversations answered whose session workflow has not started yet (a gauge). */
  pendingSessionStarts?: number;
  /** New conversations refused because too many wait for their session to start. */
  refusedForPendingStarts?: number;
}

/** How a broker without {@link FirstTurns} places a conversation with no fresh entry, resolving to its entry. */
export type ColdStart = (req: AcquireRequest) => Promise<SessionEntry>;

/** What the `magus_sessions` bucket must offer: an atomic create, a compare-and-swap update, and a read after losing either. */
export interface SessionWriter {
  create(key: string, value: Uint8Array): Promise<number>;
  update(key: string, value: Uint8Array, version: number): Promise<number>;
  get(key: string): Promise<KvEntry | null>;
  delete(key: string, opts?: { previousSeq?: number }): Promise<void>;
}

/**
 * First turns without a workflow on the client's path (the entry-lease protocol). The entry is
 * created with KV `create`, so concurrent first turns of one conversation (on any replica) agree
 * on the winner's instance; `adopt` then starts the conversation's session workflow.
 */
export interface FirstTurns {
  sessions: SessionWriter;
  /** Lifetime of an entry after its last renewal (the session's TTL). */
  ttlMs: number;
  /** Starts the session workflow of an entry this gateway created (or revived); not awaited by the request. */
  adopt(req: Omit<AcquireRequest, 'signal'>, entry: SessionEntry): Promise<void>;
  /**
   * Tells the model's pool that this replica holds `waiting` first turns for want of an instance
   * with room (signal-with-start: it starts the pool too). Called at most once a second per model.
   * Absent: first turns wait for room without telling anyone (a pool sized by its resource).
   */
  demand?(model: ReadyModel, waiting: number): Promise<void>;
  /** Whether the pools can be told (Temporal answers): a first turn without room is refused at once (503) when not. */
  reachable?(): boolean;
  /**
   * Whether an instance's bridge is consuming its requests (its consumer has a pull waiting).
   * Asked only about the instances of a view older than {@link POOL_ENTRY_MAX_AGE_MS}: a pool
   * whose workflow is too slow to rewrite its view (an overloaded Temporal) still serves new
   * conversations on the instances found alive, instead of sending every first turn to the pool
   * that cannot answer. Absent: a view that old is not used.
   */
  alive?(namespace: string, pool: string, instance: string): Promise<boolean>;
}

export interface SessionCacheOptions {
  /** The `magus_sessions` bucket (key = conversation key). */
  kv: WatchableKv;
  /** Places conversations when there are no {@link SessionCacheOptions.firstTurns}. Default: 503 `NoCapacity`. */
  coldStart?: ColdStart;
  /** Serve first turns from pools' published instances; without it every turn with no fresh entry takes `coldStart`. */
  firstTurns?: FirstTurns;
  /**
   * The `magus_pools` bucket (key `<namespace>.<model>`): the pools' published views, which first
   * turns (`firstTurns`) and requests of no conversation (`route`) are placed by.
   */
  pools?: WatchableKv;
  /** A lease ending sooner than this is not used as it is: the turn renews it (first turns) or takes `coldStart`. */
  freshnessMarginMs?: number;
  /**
   * With first turns, a warm hit whose entry has less than `renewWithinMs` left renews it (a
   * compare-and-swap, not awaited), at most once per `renewIntervalMs` per conversation: renewing
   * only once part of the entry is used spares the bucket a write per interval for every live
   * conversation.
   */
  renewIntervalMs?: number;
  /**
   * Default: every warm hit may renew. The gateway sets TTL − max(30 s, TTL/10): a session ends
   * between that much and TTL after its last turn, and a live conversation costs at most ten
   * renewals per TTL (one per 3 min at the default 30 min) instead of one per 30 s.
   */
  renewWithinMs?: number;
  /**
   * At most this many conversations answered by this gateway may wait for their session workflow
   * to start (Temporal slower than new conversations arrive, or away); beyond it a new
   * conversation is refused (503 with `Retry-After`) until they drain. Default
   * {@link MAX_PENDING_SESSION_STARTS}.
   */
  maxPendingSessionStarts?: number;
  now?: () => number;
  onError?: (err: unknown) => void;
}

export interface SessionCache extends SessionBroker {
  stats(): SessionStats;
  readonly cache: KvCache<CachedEntry>;
  /** Live entries on an instance, as this gateway's mirror counts them. */
  leasesOn(namespace: string, pool: string, instance: string): number;
  /** The mirror of `magus_pools` (absent without first turns). */
  readonly pools: KvCache<PoolEntry> | undefined;
  readonly ready: Promise<void>;
  close(): Promise<void>;
}

/** A mirrored entry with the revision it was read at (for compare-and-swap). */
export type CachedEntry = SessionEntry & { revision: number };

/** How often a first turn waiting for room looks again. */
const ROOM_POLL_MS = 200;
/** A first turn waits for room at most this long when the pool says the next start is further away. */
const START_WAIT_MAX_MS = 30_000;
/** Demand is told to a pool at most this often per model, and again at least this often while it lasts. */
const DEMAND_MIN_MS = 1000;
const DEMAND_REFRESH_MS = 10_000;

/** A stale view's instances are looked at again at most this often, and what was found is used this long. */
const PROBE_INTERVAL_MS = 5_000;
const PROBE_TTL_MS = 15_000;

/**
 * The default bound on sessions waiting to start ({@link SessionCacheOptions.maxPendingSessionStarts}):
 * about a minute of new conversations above what a small Temporal starts (dev's ~50–90 starts/s
 * on 2 cores), each a gRPC call in flight or a retry timer in this process.
 */
export const MAX_PENDING_SESSION_STARTS = 5_000;

/** First wait before a failed adoption is tried again; it doubles up to {@link ADOPT_RETRY_MAX_MS}. */
const ADOPT_RETRY_MS = 1_000;
const ADOPT_RETRY_MAX_MS = 15_000;

interface PendingStart {
  promise: Promise<SessionEntry>;
  waiters: number;
  abort: AbortController;
}

/**
 * The KV-backed broker. Concurrent cold starts of one conversation share one call, which is
 * aborted only when every request waiting for it has gone away.
 */
export function createSessionCache(opts: SessionCacheOptions): SessionCache {
  const now = opts.now ?? Date.now;
  const margin = opts.freshnessMarginMs ?? 5_000;
  const renewInterval = opts.renewIntervalMs ?? 30_000;
  const renewWithin = opts.renewWithinMs ?? Infinity;
  /** Live entries per instance (`<namespace>/<pool>/<instance>`), kept in step with the mirror. */
  const load = new Map<string, number>();
  const loadKey = (e: Pick<SessionEntry, 'namespace' | 'pool' | 'instance'>) => `${e.namespace ?? 'default'}/${e.pool}/${e.instance}`;
  const count = (e: SessionEntry | undefined, by: number) => {
    if (!e) return;
    const k = loadKey(e);
    const n = (load.get(k) ?? 0) + by;
    if (n > 0) load.set(k, n);
    else load.delete(k);
  };
  const cache = watchKv<CachedEntry>(opts.kv, {
    decode: (e: KvEntry) => {
      const entry = decodeSessionEntry(e.value);
      return entry && { ...entry, revision: e.revision };
    },
    onError: opts.onError,
    onChange: (_key, before, after) => {
      count(before, -1);
      count(after, 1);
    },
    onReset: (map) => {
      load.clear();
      for (const e of map.values()) count(e, 1);
    },
  });
  const pending = new Map<string, PendingStart>();
  const lastRenewed = new Map<string, number>();
  let warmHits = 0;
  let coldStarts = 0;
  let firstTurnCount = 0;
  let moves = 0;
  let renewals = 0;
  let givenBack = 0;
  const first = opts.firstTurns;
  const pools = opts.pools ? watchKv<PoolEntry>(opts.pools, { decode: (e: KvEntry) => decodePoolEntry(e.value), onError: opts.onError }) : undefined;
  /** This gateway's picks whose entries are not written yet, per instance. */
  const reserved = new Map<string, number>();
  const encode = (e: SessionEntry) => new TextEncoder().encode(JSON.stringify(e));

  /** Counts `i` as taken by a placement of this replica until it is written (the caller releases it: {@link unreserve}). */
  const reserve = (model: ReadyModel, i: PoolEntry['instances'][number]): PoolEntry['instances'][number] => {
    const k = loadKey({ namespace: model.namespace, pool: model.name, instance: i.instance });
    reserved.set(k, (reserved.get(k) ?? 0) + 1);
    return i;
  };
  const unreserve = (model: ReadyModel, instance: string): void => {
    const k = loadKey({ namespace: model.namespace, pool: model.name, instance });
    const n = (reserved.get(k) ?? 1) - 1;
    if (n > 0) reserved.set(k, n);
    else reserved.delete(k);
  };

  /**
   * Views their pools have not rewritten for {@link POOL_ENTRY_MAX_AGE_MS}: the instances found
   * consuming (`alive`) when last looked at, per view key. A pool that is gone is not told apart
   * from one its Temporal is too slow to run: the instances still consuming are what both can serve.
   */
  const probes = new Map<string, { at: number; updatedAt: number; alive: Set<string>; looking?: Promise<void> }>();
  let staleViewPicks = 0;
  let pendingSessionStarts = 0;
  let refusedForPendingStarts = 0;
  const maxPendingSessionStarts = opts.maxPendingSessionStarts ?? MAX_PENDING_SESSION_STARTS;
  /** Not rewritten by its pool for {@link POOL_ENTRY_MAX_AGE_MS}: not used as written. */
  const stale = (entry: PoolEntry): boolean => now() - entry.updatedAt > POOL_ENTRY_MAX_AGE_MS;
  /** Looks at a stale view's instances (at most once per interval); the look under way, if any. */
  const probe = (namespace: string, model: string, entry: PoolEntry): Promise<void> | undefined => {
    const f = first;
    if (!f?.alive) return undefined;
    const key = `${namespace}.${model}`;
    const known = probes.get(key);
    if (known?.looking) return known.looking;
    if (known && known.updatedAt === entry.updatedAt && now() - known.at < PROBE_INTERVAL_MS) return undefined;
    const record = known ?? { at: 0, updatedAt: entry.updatedAt, alive: new Set<string>() };
    record.looking = Promise.all(entry.instances.map(async (i) => ((await f.alive!(namespace, model, i.instance).catch(() => false)) ? i.instance : undefined))).then((ids) => {
      probes.set(key, { at: now(), updatedAt: entry.updatedAt, alive: new Set(ids.filter((id): id is string => id !== undefined)) });
    });
    probes.set(key, record);
    return record.looking;
  };

  /** The model's published view: as written while its pool rewrites it, else only its instances found consuming. */
  const viewOf = (namespace: string, model: string): PoolEntry | undefined => {
    const key = `${namespace}.${model}`;
    const entry = pools?.get(key);
    if (!entry) return undefined;
    if (!stale(entry)) {
      probes.delete(key);
      return entry;
    }
    void probe(namespace, model, entry);
    const p = probes.get(key);
    if (!p || p.updatedAt !== entry.updatedAt || now() - p.at > PROBE_TTL_MS || p.alive.size === 0) return undefined;
    return { ...entry, instances: entry.instances.filter((i) => p.alive.has(i.instance)) };
  };
  /** Waits for a look at the model's stale view, if one is due or under way. */
  const probed = async (model: ReadyModel): Promise<void> => {
    const entry = pools?.get(`${model.namespace}.${model.name}`);
    if (entry && stale(entry)) await probe(model.namespace, model.name, entry);
  };

  /**
   * The pool's instance with the most room, counting every replica's entries and this one's
   * picks in flight. When all are full: none (the pool may start another), unless the pool
   * cannot grow or the request takes no lease (`anyLoad`: `route`) — then the least-loaded one.
   */
  const pick = (model: ReadyModel, opts: { anyLoad?: boolean } = {}): PoolEntry['instances'][number] | undefined => {
    const entry = viewOf(model.namespace, model.name);
    if (!entry) return undefined;
    const limit = opts.anyLoad || entry.growable === false ? Infinity : entry.leasesPerInstance;
    let best: PoolEntry['instances'][number] | undefined;
    let bestLoad = Infinity;
    for (const i of entry.instances) {
      const k = loadKey({ namespace: model.namespace, pool: model.name, instance: i.instance });
      const n = (load.get(k) ?? 0) + (reserved.get(k) ?? 0);
      if (n < limit && n < bestLoad) {
        best = i;
        bestLoad = n;
      }
    }
    if (best && stale(entry)) staleViewPicks++;
    return best;
  };

  /** The pool no longer publishes the entry's instance (its view is newer than the entry's placement; an entry without `placedAt` is pinned, never moved). */
  const gone = (e: SessionEntry): boolean => {
    if (e.placedAt === undefined) return false;
    const view = viewOf(e.namespace ?? 'default', e.pool);
    return view !== undefined && view.updatedAt > e.placedAt && !view.instances.some((i) => i.instance === e.instance);
  };

  // Expired leases and renew marks would otherwise accumulate for every conversation ever seen.
  const sweep = setInterval(() => {
    const t = now();
    for (const [key, e] of cache.entries()) if (e.expiresAt <= t) cache.delete(key);
    for (const [key, at] of lastRenewed) if (t - at > renewInterval) lastRenewed.delete(key);
  }, 60_000);
  sweep.unref();

  /** Writes `next` over `entry` (compare-and-swap on its revision); the entry now in the bucket when another write won. */
  const swap = async (f: FirstTurns, key: string, entry: CachedEntry, next: SessionEntry): Promise<{ won: true; entry: CachedEntry } | { won: false; entry: CachedEntry | undefined }> => {
    try {
      const revision = await f.sessions.update(key, encode(next), entry.revision);
      const written = { ...next, revision };
      cache.set(key, written);
      return { won: true, entry: written };
    } catch (err) {
      if (!isRevisionConflict(err)) throw err;
      return { won: false, entry: await read(f, key) };
    }
  };

  const read = async (f: FirstTurns, key: string): Promise<CachedEntry | undefined> => {
    const theirs = await f.sessions.get(key);
    const e = theirs && theirs.operation === 'PUT' ? decodeSessionEntry(theirs.value) : undefined;
    const cached = e && { ...e, revision: theirs!.revision };
    if (cached) cache.set(key, cached);
    else cache.delete(key);
    return cached;
  };

  /** A warm turn's renewal (not awaited): once part of the TTL is used, at most once per interval. */
  const renewLater = (f: FirstTurns, key: string, entry: CachedEntry): void => {
    const t = now();
    if (entry.expiresAt - t >= renewWithin) return;
    const last = lastRenewed.get(key);
    if (last !== undefined && t - last < renewInterval) return;
    lastRenewed.set(key, t);
    renewals++;
    swap(f, key, entry, { ...stripRevision(entry), expiresAt: t + f.ttlMs }).catch((err: unknown) => opts.onError?.(err));
  };

  /** Registers the one placement of `key` that concurrent turns share; `run` gets its abort signal. */
  const track = (key: string, run: (signal: AbortSignal) => Promise<SessionEntry>): PendingStart => {
    const abort = new AbortController();
    const p: PendingStart = { abort, waiters: 0, promise: run(abort.signal) };
    const forget = () => {
      if (pending.get(key) === p) pending.delete(key);
    };
    p.promise.then(forget, forget);
    pending.set(key, p);
    return p;
  };

  /** Without first turns: the injected {@link ColdStart} places the conversation. */
  const fromColdStart = async (req: AcquireRequest, signal: AbortSignal): Promise<SessionEntry> => {
    coldStarts++;
    if (!opts.coldStart) throw new SessionError(SessionErrorType.NoCapacity, `no instance of ${req.model.namespace}/${req.model.name} is placed for this conversation, and this gateway cannot place one`);
    const entry = await opts.coldStart({ ...req, signal });
    cache.set(req.conversationKey, { ...entry, revision: 0 });
    return entry;
  };

  /**
   * First turns of each model waiting for room here (what `demand` tells the pool), what the pool
   * was last told and when. A change is told at most once per {@link DEMAND_MIN_MS} (a later one
   * by a timer), an unchanged demand again every {@link DEMAND_REFRESH_MS}; when the last waiter
   * leaves, 0 is told, so a client that leaves leaves no demand behind.
   */
  const waitingFor = new Map<string, { model: ReadyModel; waiting: number; told: number; at: number; timer?: NodeJS.Timeout }>();
  const tellDemand = (f: FirstTurns, k: string): void => {
    const w = waitingFor.get(k);
    if (!w || !f.demand || closed) return;
    const t = now();
    if (w.waiting === w.told && (w.waiting === 0 || t - w.at < DEMAND_REFRESH_MS)) {
      if (w.waiting === 0 && !w.timer) waitingFor.delete(k);
      return;
    }
    if (t - w.at < DEMAND_MIN_MS) {
      w.timer ??= setTimeout(() => {
        w.timer = undefined;
        tellDemand(f, k);
      }, w.at + DEMAND_MIN_MS - t);
      w.timer.unref();
      return;
    }
    w.told = w.waiting;
    w.at = t;
    if (w.waiting === 0 && !w.timer) waitingFor.delete(k);
    f.demand(w.model, w.told).catch((err: unknown) => opts.onError?.(err));
  };

  /**
   * An instance with room for one more conversation of `model`, waiting (and telling the pool of
   * the demand) until there is one, the pool says none can start soon, or `signal` aborts.
   */
  const room = async (f: FirstTurns, model: ReadyModel, signal: AbortSignal): Promise<PoolEntry['instances'][number]> => {
    const found = pick(model);
    if (found) return reserve(model, found);
    // A view too old to use as it is: its instances are looked at first (once per interval).
    await probed(model);
    const alive = pick(model);
    if (alive) return reserve(model, alive);
    const k = `${model.namespace}/${model.name}`;
    let w = waitingFor.get(k);
    if (!w) waitingFor.set(k, (w = { model, waiting: 0, told: 0, at: 0 }));
    w.waiting++;
    coldStarts++;
    const since = now();
    try {
      for (;;) {
        if (f.reachable && !f.reachable()) throw new SessionError(SessionErrorType.Unavailable, `Temporal is unreachable: no instance of ${model.namespace}/${model.name} has room, and its pool cannot be told`);
        tellDemand(f, k);
        await sleepFor(ROOM_POLL_MS, signal);
        const i = pick(model);
        if (i) return reserve(model, i);
        const view = viewOf(model.namespace, model.name);
        // Nothing serves or starts and starts fail: refused once a start failed while this turn
        // waited (its answer), or when the next start is far off; an older failure is no answer
        // to this turn (its demand may be what the next start is for).
        if (view?.failing && view.instances.length === 0 && ((view.failedAt ?? 0) >= since || (view.nextStartAt ?? Infinity) - now() > START_WAIT_MAX_MS)) {
          throw new SessionError(SessionErrorType.NoCapacity, `no instance of ${model.namespace}/${model.name} can be started: ${view.failing}`);
        }
      }
    } finally {
      w.waiting--;
      tellDemand(f, k);
    }
  };

  /**
   * Places a conversation: renews its entry (near expiry), moves it (its instance gone), or
   * creates it (none); compare-and-swap throughout, so every replica ends up with one entry.
   */
  const place = async (f: FirstTurns, req: AcquireRequest, signal: AbortSignal): Promise<SessionEntry> => {
    const key = req.conversationKey;
    let entry = cache.get(key);
    for (let attempt = 0; attempt < 8; attempt++) {
      const t = now();
      if (entry && entry.expiresAt - margin > t && !gone(entry)) return entry; // another turn placed it meanwhile
      // A pick is reserved at once (concurrent turns of this replica see it before its entry is written).
      const picked = !(entry && !gone(entry));
      if (!entry && pendingSessionStarts >= maxPendingSessionStarts) {
        refusedForPendingStarts++;
        throw new SessionError(SessionErrorType.Unavailable, `${pendingSessionStarts} conversations answered by this gateway still wait for their session workflow to start (Temporal starts them more slowly than they arrive): no new one until they drain`);
      }
      const target = picked ? await room(f, req.model, signal) : { instance: entry!.instance, subject: entry!.subject };
      try {
        const placedAt = entry && entry.instance === target.instance ? (entry.placedAt ?? now()) : now();
        const next: SessionEntry = { subject: target.subject, pool: req.model.name, namespace: req.model.namespace, instance: target.instance, expiresAt: now() + f.ttlMs, placedAt };
        if (!entry) {
          try {
            const revision = await f.sessions.create(key, encode(next));
            cache.set(key, { ...next, revision });
            firstTurnCount++;
            lastRenewed.set(key, now());
            const adoption = { conversationKey: key, model: req.model, owner: req.owner };
            if (!req.answered) adoptUntilDone(f, adoption, next);
            else {
              req.answered.then(
                (ok) => (ok ? adoptUntilDone(f, adoption, next) : giveBack(f, key, revision)),
                () => giveBack(f, key, revision),
              );
            }
            return next;
          } catch (err) {
            if (!isRevisionConflict(err)) throw err; // lost the create: the key exists
            entry = await read(f, key);
            continue;
          }
        }
        const expired = entry.expiresAt <= t;
        const moved = entry.instance !== target.instance;
        const r = await swap(f, key, entry, next);
        if (!r.won) {
          entry = r.entry;
          continue;
        }
        if (moved) moves++;
        lastRenewed.set(key, now());
        // Its session may have ended with the expiry (or never started): one runs for it again.
        if (expired) adoptUntilDone(f, { conversationKey: key, model: req.model, owner: req.owner }, next);
        return next;
      } finally {
        if (picked) unreserve(req.model, target.instance);
      }
    }
    throw new SessionError(SessionErrorType.Unavailable, `the entry of a conversation on ${req.model.namespace}/${req.model.name} kept changing under this gateway`);
  };

  /**
   * Deletes the entry a first turn created and was not answered on, unless it changed since (a
   * later turn renewed or moved it: the conversation lives on). The watch removes it from the
   * mirror, and with it its count.
   */
  const giveBack = (f: FirstTurns, key: string, revision: number): void => {
    givenBack++;
    f.sessions.delete(key, { previousSeq: revision }).catch((err: unknown) => {
      if (!isRevisionConflict(err)) opts.onError?.(err);
    });
  };

  /** Adoptions waiting to be tried again (Temporal unreachable): their timers. */
  const adoptRetries = new Set<NodeJS.Timeout>();
  let closed = false;
  /**
   * Has the session workflow adopt `entry`, again after a failure (Temporal away) with backoff
   * ({@link ADOPT_RETRY_MS} doubling to {@link ADOPT_RETRY_MAX_MS}) until it works, the entry
   * expires or the gateway closes: a first turn served while Temporal was down still gets its
   * session workflow (its expiry enforced) once Temporal is back.
   */
  const adoptUntilDone = (f: FirstTurns, req: Omit<AcquireRequest, 'signal'>, entry: SessionEntry): void => {
    pendingSessionStarts++;
    const attempt = (delay: number): void => {
      f.adopt(req, entry).then(
        () => void pendingSessionStarts--,
        (err: unknown) => {
          opts.onError?.(err);
          if (closed || entry.expiresAt <= now()) return void pendingSessionStarts--;
          const timer = setTimeout(() => {
            adoptRetries.delete(timer);
            attempt(Math.min(delay * 2, ADOPT_RETRY_MAX_MS));
          }, delay);
          timer.unref();
          adoptRetries.add(timer);
        },
      );
    };
    attempt(ADOPT_RETRY_MS);
  };

  const join = (p: PendingStart, key: string, signal: AbortSignal): Promise<SessionEntry> =>
    new Promise<SessionEntry>((resolve, reject) => {
      p.waiters++;
      const onAbort = () => {
        if (--p.waiters === 0) {
          if (pending.get(key) === p) pending.delete(key);
          p.abort.abort(signal.reason);
        }
        reject(signal.reason instanceof Error ? signal.reason : new Error('aborted'));
      };
      if (signal.aborted) return onAbort();
      signal.addEventListener('abort', onAbort, { once: true });
      p.promise.then(
        (entry) => {
          signal.removeEventListener('abort', onAbort);
          resolve(entry);
        },
        (err: unknown) => {
          signal.removeEventListener('abort', onAbort);
          reject(err instanceof Error ? err : new Error(String(err)));
        },
      );
    });

  return {
    cache,
    pools,
    ready: pools ? Promise.all([cache.ready, pools.ready]).then(() => undefined) : cache.ready,
    stats: () => ({ warmHits, coldStarts, firstTurns: firstTurnCount, moves, renewals, givenBack, staleViewPicks, pendingSessionStarts, refusedForPendingStarts }),
    leasesOn: (namespace, pool, instance) => load.get(loadKey({ namespace, pool, instance })) ?? 0,
    acquire(req) {
      const key = req.conversationKey;
      const entry = cache.get(key);
      if (entry && entry.expiresAt - margin > now() && !gone(entry)) {
        warmHits++;
        if (first) renewLater(first, key, entry);
        return Promise.resolve(entry);
      }
      let p = pending.get(key);
      if (!p) p = first ? track(key, (signal) => place(first, req, signal)) : track(key, (signal) => fromColdStart(req, signal));
      return join(p, key, req.signal);
    },
    async route({ model, signal }) {
      let target = pick(model, { anyLoad: true });
      if (!target) {
        if (!first) throw new SessionError(SessionErrorType.NoCapacity, `no instance of ${model.namespace}/${model.name} serves, and this gateway cannot ask its pool for one`);
        target = await room(first, model, signal);
        unreserve(model, target.instance);
      }
      return { subject: target.subject, pool: model.name, namespace: model.namespace, instance: target.instance, expiresAt: now() };
    },
    async close() {
      closed = true;
      clearInterval(sweep);
      for (const t of adoptRetries) clearTimeout(t);
      for (const w of waitingFor.values()) clearTimeout(w.timer);
      for (const p of pending.values()) p.abort.abort(new Error('gateway closing'));
      await Promise.all([cache.close(), pools?.close()]);
    },
  };
}

/** An entry as written to the bucket (the revision is the bucket's, not part of the value). */
function stripRevision(e: CachedEntry): SessionEntry {
  const { revision: _revision, ...entry } = e;
  return entry;
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

/**
 * Sessions: which instance serves a conversation. The gateway asks a {@link SessionBroker}; the
 * broker here answers warm turns from a watch-backed mirror of the `magus_sessions` KV bucket
 * (no Temporal call, no KV read per request). A first turn on a warm pool is served from the
 * pool's published instances (`magus_pools`, see {@link FirstTurns}): the gateway picks one with
 * room, creates the session entry itself and has the session workflow confirm the lease
 * afterwards, off the client's path. Everything else — a pool without a ready instance, expired
 * or nearly expired leases — goes to an injected {@link ColdStart} (in production a Temporal
 * update-with-start on the conversation's `session` workflow, which also writes the KV entry).
 */
import type { KvEntry } from 'nats';
import { isRevisionConflict } from '../../activities/nats/data-plane';
import type { ReadyModel } from '../../shared/model';
import { POOL_ENTRY_MAX_AGE_MS, type PoolEntry, type SessionEntry } from '../../shared/serving';
import { watchKv, type KvCache, type WatchableKv } from './kv-cache';

export interface AcquireRequest {
  /** The conversation key (conversation.ts): stable across the turns of one conversation. */
  conversationKey: string;
  model: ReadyModel;
  tokenId: string;
  /** Aborted when the client goes away or the gateway gives up waiting. */
  signal: AbortSignal;
}

/**
 * Finds (or starts) the instance for a conversation. Throws errors whose `type` is a
 * `SessionErrorType` (errors.ts: `BacklogFull` → 429, `NoCapacity` → 503) when it cannot.
 */
export interface SessionBroker {
  acquire(req: AcquireRequest): Promise<SessionEntry>;
  /** Counters for /metrics, when the broker keeps them. */
  stats?(): SessionStats;
}

export interface SessionStats {
  /** Turns answered from the session cache. */
  warmHits: number;
  /** Turns that waited on the slow path (Temporal). */
  coldStarts: number;
  /** First turns served from a pool's published instances (the session workflow confirms later). */
  firstTurns: number;
}

/** Starts or re-acquires a conversation's session (the slow path), resolving to its entry. */
export type ColdStart = (req: AcquireRequest) => Promise<SessionEntry>;

/** Extends a session's lease (debounced, fire-and-forget): the caller may not wait for it. */
export type RenewSession = (req: Omit<AcquireRequest, 'signal'>, entry: SessionEntry) => Promise<void>;

/** What the `magus_sessions` bucket must offer for first turns: an atomic create, and a read after losing it. */
export interface SessionWriter {
  create(key: string, value: Uint8Array): Promise<number>;
  get(key: string): Promise<KvEntry | null>;
}

/**
 * First turns without a workflow on the client's path. The session entry is created with KV
 * `create`, so concurrent first turns of one conversation (on any replica) agree on the winner's
 * instance; `adopt` then starts the conversation's session workflow with that instance as its
 * preferred lease (the pool grants it, or another one and the workflow rewrites the entry).
 */
export interface FirstTurns {
  /** The `magus_pools` bucket (key `<namespace>.<model>`). */
  pools: WatchableKv;
  sessions: SessionWriter;
  /** Lifetime of the entry the gateway creates (the session workflow's TTL). */
  ttlMs: number;
  /** Starts the session workflow for an entry this gateway created; not awaited by the request. */
  adopt(req: Omit<AcquireRequest, 'signal'>, entry: SessionEntry): Promise<void>;
}

export interface SessionCacheOptions {
  /** The `magus_sessions` bucket (key = conversation key). */
  kv: WatchableKv;
  coldStart: ColdStart;
  /** Serve first turns from pools' published instances; without it every first turn is a cold start. */
  firstTurns?: FirstTurns;
  /** A lease ending sooner than this is not used: the turn goes through `coldStart`, which extends it. */
  freshnessMarginMs?: number;
  /**
   * Called on a warm hit (not awaited) whose entry has less than `renewWithinMs` left, at most
   * once per `renewIntervalMs` per conversation. Each call is a signal and a KV write by the
   * session workflow, so renewing only once part of the entry is used spares Temporal a touch
   * per interval for every live conversation.
   */
  renew?: RenewSession;
  renewIntervalMs?: number;
  /**
   * Default: every warm hit may renew. The gateway sets TTL − max(30 s, TTL/10): a session ends
   * between that much and TTL after its last turn, and a live conversation costs at most ten
   * touches per TTL (one per 3 min at the default 30 min) instead of one per 30 s.
   */
  renewWithinMs?: number;
  now?: () => number;
  onError?: (err: unknown) => void;
}

export interface SessionCache extends SessionBroker {
  stats(): SessionStats;
  readonly cache: KvCache<SessionEntry>;
  /** The mirror of `magus_pools` (absent without first turns). */
  readonly pools: KvCache<PoolEntry> | undefined;
  readonly ready: Promise<void>;
  close(): Promise<void>;
}

/** A `magus_sessions` value, checked; `undefined` (ignored) when malformed. */
export function decodeSessionEntry(value: Uint8Array): SessionEntry | undefined {
  const e = JSON.parse(new TextDecoder().decode(value)) as Partial<SessionEntry> | null;
  if (typeof e !== 'object' || e === null) return undefined;
  if (typeof e.subject !== 'string' || e.subject === '' || typeof e.expiresAt !== 'number' || typeof e.pool !== 'string' || typeof e.instance !== 'string') return undefined;
  return { subject: e.subject, pool: e.pool, ...(typeof e.namespace === 'string' ? { namespace: e.namespace } : {}), instance: e.instance, expiresAt: e.expiresAt };
}

/** A `magus_pools` value, checked; `undefined` (ignored) when malformed. */
export function decodePoolEntry(value: Uint8Array): PoolEntry | undefined {
  const e = JSON.parse(new TextDecoder().decode(value)) as Partial<PoolEntry> | null;
  if (typeof e !== 'object' || e === null || !Array.isArray(e.instances) || !Number.isInteger(e.leasesPerInstance) || (e.leasesPerInstance as number) < 1) return undefined;
  const instances = e.instances.filter(
    (i): i is PoolEntry['instances'][number] =>
      typeof i === 'object' && i !== null && typeof i.instance === 'string' && i.instance !== '' && typeof i.subject === 'string' && i.subject !== '' && Number.isInteger(i.leases) && i.leases >= 0,
  );
  return { instances, leasesPerInstance: e.leasesPerInstance as number, updatedAt: typeof e.updatedAt === 'number' ? e.updatedAt : 0, ...(typeof e.growable === 'boolean' ? { growable: e.growable } : {}) };
}

/** First wait before a failed adoption is tried again; it doubles up to {@link ADOPT_RETRY_MAX_MS}. */
const ADOPT_RETRY_MS = 1_000;
const ADOPT_RETRY_MAX_MS = 15_000;

interface PendingStart {
  promise: Promise<SessionEntry>;
  waiters: number;
  abort: AbortController;
}

/**
 * The KV-backed broker. Concurrent cold starts of one conversation share one `coldStart` call,
 * which is aborted only when every request waiting for it has gone away.
 */
export function createSessionCache(opts: SessionCacheOptions): SessionCache {
  const now = opts.now ?? Date.now;
  const margin = opts.freshnessMarginMs ?? 5_000;
  const renewInterval = opts.renewIntervalMs ?? 30_000;
  const renewWithin = opts.renewWithinMs ?? Infinity;
  const cache = watchKv<SessionEntry>(opts.kv, { decode: (e: KvEntry) => decodeSessionEntry(e.value), onError: opts.onError });
  const pending = new Map<string, PendingStart>();
  const lastRenewed = new Map<string, number>();
  let warmHits = 0;
  let coldStarts = 0;
  let firstTurnCount = 0;
  const first = opts.firstTurns;
  const pools = first ? watchKv<PoolEntry>(first.pools, { decode: (e: KvEntry) => decodePoolEntry(e.value), onError: opts.onError }) : undefined;
  /** Leases this gateway handed out since the pool last published (per entry object, so a new publication resets them). */
  const localLeases = new WeakMap<PoolEntry, Map<string, number>>();

  /**
   * The pool's instance with the most room, counting this gateway's own recent picks. When all
   * are full: none (the pool may start another: the cold path asks it), unless the pool cannot
   * grow — then the least-loaded one, which is what the pool itself would grant.
   */
  const pick = (model: ReadyModel): { entry: PoolEntry; instance: PoolEntry['instances'][number] } | undefined => {
    const entry = pools?.get(`${model.namespace}.${model.name}`);
    if (!entry || now() - entry.updatedAt > POOL_ENTRY_MAX_AGE_MS) return undefined; // none, or its pool is gone
    const local = localLeases.get(entry);
    const limit = entry.growable === false ? Infinity : entry.leasesPerInstance;
    let best: PoolEntry['instances'][number] | undefined;
    let bestLoad = Infinity;
    for (const i of entry.instances) {
      const load = i.leases + (local?.get(i.instance) ?? 0);
      if (load < limit && load < bestLoad) {
        best = i;
        bestLoad = load;
      }
    }
    return best ? { entry, instance: best } : undefined;
  };

  // Expired leases and renew marks would otherwise accumulate for every conversation ever seen.
  const sweep = setInterval(() => {
    const t = now();
    for (const [key, e] of cache.entries()) if (e.expiresAt <= t) cache.delete(key);
    for (const [key, at] of lastRenewed) if (t - at > renewInterval) lastRenewed.delete(key);
  }, 60_000);
  sweep.unref();

  const renew = (req: AcquireRequest, entry: SessionEntry): void => {
    if (!opts.renew) return;
    const t = now();
    if (entry.expiresAt - t >= renewWithin) return;
    const last = lastRenewed.get(req.conversationKey);
    if (last !== undefined && t - last < renewInterval) return;
    lastRenewed.set(req.conversationKey, t);
    opts.renew({ conversationKey: req.conversationKey, model: req.model, tokenId: req.tokenId }, entry).catch((err: unknown) => opts.onError?.(err));
  };

  /** Registers the one start of `key`'s session that concurrent turns share; `run` gets its abort signal. */
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

  /** The session from Temporal (the workflow leases an instance), remembered as just renewed. */
  const fromTemporal = async (req: AcquireRequest, signal: AbortSignal): Promise<SessionEntry> => {
    coldStarts++;
    const entry = await opts.coldStart({ ...req, signal });
    cache.set(req.conversationKey, entry);
    lastRenewed.set(req.conversationKey, now());
    return entry;
  };

  const startCold = (req: AcquireRequest): PendingStart => track(req.conversationKey, (signal) => fromTemporal(req, signal));

  /**
   * A first turn on a pool with room: create the entry (or use the one a concurrent first turn
   * created), then have the workflow adopt it without waiting. Falls back to the cold path when
   * an existing entry is unusable.
   */
  const startFirst = (req: AcquireRequest, f: FirstTurns, choice: NonNullable<ReturnType<typeof pick>>): PendingStart => {
    const key = req.conversationKey;
    const entry: SessionEntry = { subject: choice.instance.subject, pool: req.model.name, namespace: req.model.namespace, instance: choice.instance.instance, expiresAt: now() + f.ttlMs };
    let local = localLeases.get(choice.entry);
    if (!local) localLeases.set(choice.entry, (local = new Map<string, number>()));
    local.set(entry.instance, (local.get(entry.instance) ?? 0) + 1);
    return track(key, async (signal) => {
      try {
        await f.sessions.create(key, new TextEncoder().encode(JSON.stringify(entry)));
      } catch (err) {
        if (!isRevisionConflict(err)) throw err; // lost the create: the key exists
        const theirs = await f.sessions.get(key);
        const e = theirs && theirs.operation === 'PUT' ? decodeSessionEntry(theirs.value) : undefined;
        if (e && e.expiresAt - margin > now()) {
          cache.set(key, e);
          return e;
        }
        return fromTemporal(req, signal);
      }
      firstTurnCount++;
      cache.set(key, entry);
      lastRenewed.set(key, now());
      adoptUntilDone(f, { conversationKey: key, model: req.model, tokenId: req.tokenId }, entry);
      return entry;
    });
  };

  /** Adoptions waiting to be tried again (Temporal unreachable): their timers. */
  const adoptRetries = new Set<NodeJS.Timeout>();
  let closed = false;
  /**
   * Has the workflow adopt `entry`, again after a failure (Temporal away) with backoff
   * ({@link ADOPT_RETRY_MS} doubling to {@link ADOPT_RETRY_MAX_MS}) until it works, the entry
   * expires or the gateway closes: a first turn served while Temporal was down still gets its
   * session workflow (its lease counted, its TTL kept) once Temporal is back.
   */
  const adoptUntilDone = (f: FirstTurns, req: Omit<AcquireRequest, 'signal'>, entry: SessionEntry, delay = ADOPT_RETRY_MS): void => {
    f.adopt(req, entry).catch((err: unknown) => {
      opts.onError?.(err);
      if (closed || entry.expiresAt <= now()) return;
      const timer = setTimeout(() => {
        adoptRetries.delete(timer);
        adoptUntilDone(f, req, entry, Math.min(delay * 2, ADOPT_RETRY_MAX_MS));
      }, delay);
      timer.unref();
      adoptRetries.add(timer);
    });
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
    stats: () => ({ warmHits, coldStarts, firstTurns: firstTurnCount }),
    acquire(req) {
      const entry = cache.get(req.conversationKey);
      if (entry && entry.expiresAt - margin > now()) {
        warmHits++;
        renew(req, entry);
        return Promise.resolve(entry);
      }
      let p = pending.get(req.conversationKey);
      if (!p) {
        // An entry that exists but is (nearly) expired belongs to a session that must extend it: the cold path.
        const choice = first && !entry ? pick(req.model) : undefined;
        p = choice ? startFirst(req, first!, choice) : startCold(req);
      }
      return join(p, req.conversationKey, req.signal);
    },
    async close() {
      closed = true;
      clearInterval(sweep);
      for (const t of adoptRetries) clearTimeout(t);
      for (const p of pending.values()) p.abort.abort(new Error('gateway closing'));
      await Promise.all([cache.close(), pools?.close()]);
    },
  };
}

/**
 * Sessions: which instance serves a conversation. The gateway asks a {@link SessionBroker}; the
 * broker here answers warm turns from a watch-backed mirror of the `magus_sessions` KV bucket
 * (no Temporal call, no KV read per request) and hands everything else — first turns, expired or
 * nearly expired leases — to an injected {@link ColdStart} (in production a Temporal
 * update-with-start on the conversation's `session` workflow, which also writes the KV entry).
 */
import type { KvEntry } from 'nats';
import type { ReadyModel } from '../../shared/model';
import type { SessionEntry } from '../../shared/serving';
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
  stats?(): { warmHits: number; coldStarts: number };
}

/** Starts or re-acquires a conversation's session (the slow path), resolving to its entry. */
export type ColdStart = (req: AcquireRequest) => Promise<SessionEntry>;

/** Extends a session's lease (debounced, fire-and-forget): the caller may not wait for it. */
export type RenewSession = (req: Omit<AcquireRequest, 'signal'>, entry: SessionEntry) => Promise<void>;

export interface SessionCacheOptions {
  /** The `magus_sessions` bucket (key = conversation key). */
  kv: WatchableKv;
  coldStart: ColdStart;
  /** A lease ending sooner than this is not used: the turn goes through `coldStart`, which extends it. */
  freshnessMarginMs?: number;
  /** Called on a warm hit at most once per `renewIntervalMs` per conversation (not awaited). */
  renew?: RenewSession;
  renewIntervalMs?: number;
  now?: () => number;
  onError?: (err: unknown) => void;
}

export interface SessionCache extends SessionBroker {
  stats(): { warmHits: number; coldStarts: number };
  readonly cache: KvCache<SessionEntry>;
  readonly ready: Promise<void>;
  close(): Promise<void>;
}

/** A `magus_sessions` value, checked; `undefined` (ignored) when malformed. */
export function decodeSessionEntry(value: Uint8Array): SessionEntry | undefined {
  const e = JSON.parse(new TextDecoder().decode(value)) as Partial<SessionEntry> | null;
  if (typeof e !== 'object' || e === null) return undefined;
  if (typeof e.subject !== 'string' || e.subject === '' || typeof e.expiresAt !== 'number' || typeof e.pool !== 'string' || typeof e.instance !== 'string') return undefined;
  return { subject: e.subject, pool: e.pool, instance: e.instance, expiresAt: e.expiresAt };
}

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
  const cache = watchKv<SessionEntry>(opts.kv, { decode: (e: KvEntry) => decodeSessionEntry(e.value), onError: opts.onError });
  const pending = new Map<string, PendingStart>();
  const lastRenewed = new Map<string, number>();
  let warmHits = 0;
  let coldStarts = 0;

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
    const last = lastRenewed.get(req.conversationKey);
    if (last !== undefined && t - last < renewInterval) return;
    lastRenewed.set(req.conversationKey, t);
    opts.renew({ conversationKey: req.conversationKey, model: req.model, tokenId: req.tokenId }, entry).catch((err: unknown) => opts.onError?.(err));
  };

  const startCold = (req: AcquireRequest): PendingStart => {
    const abort = new AbortController();
    coldStarts++;
    const p: PendingStart = {
      abort,
      waiters: 0,
      promise: opts.coldStart({ ...req, signal: abort.signal }).then((entry) => {
        cache.set(req.conversationKey, entry);
        lastRenewed.set(req.conversationKey, now());
        return entry;
      }),
    };
    const forget = () => {
      if (pending.get(req.conversationKey) === p) pending.delete(req.conversationKey);
    };
    p.promise.then(forget, forget);
    pending.set(req.conversationKey, p);
    return p;
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
    ready: cache.ready,
    stats: () => ({ warmHits, coldStarts }),
    acquire(req) {
      const entry = cache.get(req.conversationKey);
      if (entry && entry.expiresAt - margin > now()) {
        warmHits++;
        renew(req, entry);
        return Promise.resolve(entry);
      }
      return join(pending.get(req.conversationKey) ?? startCold(req), req.conversationKey, req.signal);
    },
    async close() {
      clearInterval(sweep);
      for (const p of pending.values()) p.abort.abort(new Error('gateway closing'));
      await cache.close();
    },
  };
}

/**
 * Per-key limits in KV `magus_limits` (the rules and their invariants: shared/limits.ts). One
 * entry per limited scope — a key's identity (`<namespace>/<name>`, `local/<name>`,
 * `config/<id>`) — under {@link limitKeyOf}: the identity's UTF-8 bytes in base64url, unpadded,
 * which is always a valid KV key (`[A-Za-z0-9_-]`) and never collides, whatever the identity
 * holds (`/`, `.`, non-ASCII).
 *
 * Every change is a compare-and-swap on the entry's revision: `create` when there is none,
 * `update` with the revision read, and on a conflict (another replica wrote first) read again,
 * decide again, after a short jittered backoff; so N gateway replicas enforce one limit with no
 * process in the middle. To keep an admission at one round trip, the store remembers the state
 * and revision it last read or wrote per scope and tries its update on that first; a stale one
 * only costs the conflict. A decision that writes nothing (a refusal, a settle of an unknown id)
 * is never taken on a remembered state: only on one just read, since no revision check confirms
 * it.
 *
 * Within one process the operations on a scope are batched ("group commit"): while one
 * compare-and-swap of the scope is in flight, the operations that arrive queue, and the next
 * write applies them all, in order, to the state it read. So the writers of one key are the
 * replicas, not the requests: 256 concurrent admissions of one key from one replica cost a few
 * writes, where each alone would retry against the 255 others.
 *
 * A settle is not written alone at once: it is *held* for the scope's next write (an admission's,
 * usually the next request's), which applies it before its own operation, and written alone only
 * when none came within `settleHoldMs` (default {@link SETTLE_HOLD_MS}) — so a key with steady
 * traffic costs one write per request, not two. Within the process nothing changes: every
 * decision of the scope is taken after the held settles are applied. Another replica sees a
 * freed slot or a refund up to `settleHoldMs` late, which can only refuse more, never exceed a
 * limit. {@link LimitStore.flush} (and {@link LimitStore.close}) write every held settle now.
 *
 * Writes are core publishes to the entry's subject (`$KV.<bucket>.<key>`, as the bucket's view
 * names it for editing: a JetStream domain's or a mirror's prefix included) with the
 * `Nats-Expected-Last-Subject-Sequence` header — the revision, or 0 to create — whose
 * acknowledgements come to one inbox subscription per store and settle an entry of a `Map`
 * ({@link kvCasWriter}): what `kv.update` does, without its request per write (a timer, a promise
 * race and an `Error` with a stack per write). A write unacknowledged within `writeTimeoutMs`, or
 * under way when the connection drops, fails.
 *
 * A gateway renews the leases of its live reservations with a {@link LimitRenewer} every third of
 * the lease, so a reservation of a gateway that died is released (charged its worst case) within
 * one lease of its last renewal.
 *
 * **Slices.** Far from its limits, a key's requests are not written one by one: the store leases a
 * *slice* (shared/limits.ts `leaseSlice`: requests, tokens and concurrent slots, at most an eighth
 * of what each limit has available, held in the document as one reservation) in the write of the
 * request that found none, and admits the next requests from it in the process — no write, no
 * round trip — exactly within what it holds; their settles only count there. A slice admits for
 * `sliceMs` (default {@link SLICE_MS}; at most a third of a lease) and the next is leased when half
 * of it is gone, off any request's way (requests that find none wait for a lease under way rather
 * than write alone); a closed slice is given back (`returnSlice`: what its requests used charged,
 * the rest returned; held like a settle) once nothing admitted from it is in flight. A request's
 * lease is its slice's: renewing the request renews the slice, and a slice that lapsed loses its
 * requests (reported as such). Near a limit (an eighth would not hold two of the request's worst
 * case, a request or a slot) no slice is leased and each admission is written, as above. The price:
 * what one replica's slice holds and has not used is not available to another until it is given
 * back (at most `sliceMs` later, or when its last request ends) — it can refuse sooner, never
 * admit beyond a limit; a replica's own refusal while its slice sat idle gives the slice back and
 * asks again. Requests that store a response under a storage quota are always written.
 */
import { headers, type KV, type NatsConnection } from 'nats';
import { ackedPublisher } from './acked-publish';
import { randomUUID } from 'node:crypto';
import {
  admit,
  chargeStorage,
  decodeLimitState,
  emptyLimitState,
  leaseSlice,
  modelLimitsOf,
  rateLimitHeaders,
  releaseStorage,
  renew,
  returnSlice,
  settle,
  sweep,
  withSliceLeft,
  type Admission,
  type AdmitRequest,
  type KeyLimits,
  type LimitState,
  type Settlement,
  type Slice,
} from '../shared/limits';
import { isRevisionConflict } from './errors';

/** Keys of scopes seen lately (each operation of a scope needs its key; a gateway serves a bounded set of keys). */
const limitKeys = new Map<string, string>();

/** The KV key of scope `identity`: its UTF-8 bytes in base64url without padding. */
export const limitKeyOf = (identity: string): string => {
  let key = limitKeys.get(identity);
  if (key !== undefined) return key;
  if (!identity) throw new Error('a limit scope needs a key identity');
  key = Buffer.from(identity, 'utf8').toString('base64url');
  if (limitKeys.size >= 10_000) limitKeys.clear();
  limitKeys.set(identity, key);
  return key;
};

/** Compare-and-swap attempts that all conflicted: more writers on one key at once than the store retries for. */
export class LimitContentionError extends Error {
  override readonly name = 'LimitContentionError';
  constructor(
    readonly scope: string,
    readonly attempts: number,
  ) {
    super(`limits of '${scope}': ${attempts} compare-and-swap attempts all lost to other writers; try again`);
  }
}

/** A stored entry that is not a limit state (fails closed: nothing is admitted on a state nobody can read). */
export class LimitStateUnreadableError extends Error {
  override readonly name = 'LimitStateUnreadableError';
  constructor(readonly scope: string) {
    super(`limits of '${scope}': the stored state (KV key ${limitKeyOf(scope)}) is not a limit state; delete the entry to start it afresh`);
  }
}

export interface LimitStoreOptions {
  /** Epoch ms now (tests pin it). Default `Date.now`. */
  clock?: () => number;
  /** Compare-and-swap attempts per operation before {@link LimitContentionError}. Default 64. */
  maxAttempts?: number;
  /** Scopes whose last state is remembered (least recently used forgotten first). Default 10 000. */
  rememberedScopes?: number;
  /** Longest a settle waits for its scope's next write before it is written alone, ms (0: at once). Default {@link SETTLE_HOLD_MS}. */
  settleHoldMs?: number;
  /** A write unacknowledged this long fails, ms. Default {@link WRITE_TIMEOUT_MS}. */
  writeTimeoutMs?: number;
  /**
   * How long one leased slice admits requests, ms (at most a third of a request's lease); 0: no
   * slices, every admission is a write. Default {@link SLICE_MS}.
   */
  sliceMs?: number;
}

/** How long a slice admits, by default: another replica sees what it did not use at most this late. */
export const SLICE_MS = 1_000;

/** How long a settle waits, by default, for its scope's next write to ride in. */
export const SETTLE_HOLD_MS = 20;
/** How long a write waits for its acknowledgement, by default (nats.js's JetStream default). */
export const WRITE_TIMEOUT_MS = 5_000;

interface Stored {
  state: LimitState;
  /** 0: no entry (written with `create`); otherwise the revision to `update` on. */
  revision: number;
}

/** One step of a transaction: the state to write (none: the result stands as it is) and the result. */
type Step<R> = (state: LimitState, nowMs: number) => { write?: LimitState; result: R };

/** An operation waiting for its scope's next write. */
interface Pending {
  step: Step<unknown>;
  resolve: (result: unknown) => void;
  reject: (err: unknown) => void;
  /** A settle that may wait for another operation's write (cleared once its hold is over). */
  holdable: boolean;
}

/** A scope's held settles, and the timer that writes them alone. */
interface Held {
  scope: string;
  ops: Pending[];
  timer: NodeJS.Timeout;
}

/** A request admitted from a slice, in flight. */
interface LocalRequest {
  tokens: number;
  at: number;
}

/** A slice of a scope's limits this store leased (shared/limits.ts `leaseSlice`), and what it did with it. */
interface LocalSlice {
  id: string;
  scope: string;
  key: string;
  /** Its scopes' key in {@link LimitStore}'s maps: the KV key, and the model when the slice counts in the model's limits. */
  sliceKey: string;
  model: string | undefined;
  limits: KeyLimits;
  /** `limits` as JSON: a request under other limits (an ApiKey changed) is not admitted from it. */
  limitsText: string;
  /** What it may still hand out (null: unbounded); tokens are net of the worst cases in flight and of what settled requests used. */
  requestsLeft: number | null;
  tokensLeft: number | null;
  slots: number | null;
  leased: Slice;
  live: Map<string, LocalRequest>;
  admitted: number;
  usedTokens: number;
  meanDurationMs: number | undefined;
  /** The scope's state as leased (the headers' base). */
  view: LimitState;
  leasedAt: number;
  closesAt: number;
  /** Admits requests (until it closes: then it is given back once none is in flight). */
  open: boolean;
  timer: NodeJS.Timeout | undefined;
}

/** The scope's state as `slice`'s replica sees it: as leased, with what the slice still holds counted in. */
const sliceState = (slice: LocalSlice, requests: number | null, tokens: number | null): LimitState =>
  withSliceLeft(slice.view, slice.model, { requests, tokens });

/** What a scope's past slices tell the next one's size. */
interface SliceStats {
  /** Requests per ms the last slice admitted. */
  rate: number;
  /** The largest worst case one request asked for. */
  maxWant: number;
  /** The most requests in flight at once. */
  peakLive: number;
}

/** Most operations one write of a scope applies. */
const MAX_BATCH = 256;

const decoder = new TextDecoder();

/** A random wait before attempt `attempt` (≥ 1) again: up to 2 ms × 2^attempt, at most 100 ms ("full jitter"). */
const backoff = (attempt: number): Promise<void> =>
  new Promise((resolve) => setTimeout(resolve, Math.random() * Math.min(100, 2 * 2 ** Math.min(attempt, 6))).unref());

/**
 * The limit state of every key, over one `magus_limits` bucket (bound, never declared here:
 * declare.ts declares it). Safe to share by every request of a process.
 */
export class LimitStore {
  private readonly clock: () => number;
  private readonly maxAttempts: number;
  private readonly rememberedScopes: number;
  private readonly remembered = new Map<string, Stored>();
  private readonly settleHoldMs: number;
  private readonly writeTimeoutMs: number;
  /** Per KV key, the operations queued behind the write in flight (present while one is). */
  private readonly queues = new Map<string, Pending[]>();
  /** Per KV key, the drain writing its queue (present while one runs). */
  private readonly drains = new Map<string, Promise<void>>();
  /** Per KV key, the settles held for its next write (present while any are). */
  private readonly held = new Map<string, Held>();
  /** Made at the first write (a store that only reads subscribes to nothing). */
  private writer: KvCasWriter | undefined;
  private closed = false;
  private readonly sliceMs: number;
  /** The slice admitting now, per slice key. */
  private readonly openSlices = new Map<string, LocalSlice>();
  /** Every slice not yet given back (open or draining), per KV key. */
  private readonly slices = new Map<string, Set<LocalSlice>>();
  /** The slice of each request admitted from one, by `<KV key> <id>`. */
  private readonly localIds = new Map<string, LocalSlice>();
  /** Slice keys with a lease under way, and when it is over. */
  private readonly leasing = new Map<string, Promise<void>>();
  /** Slice keys whose last lease was refused (near a limit): no other is asked for until then. */
  private readonly noSliceUntil = new Map<string, number>();
  private readonly sliceStats = new Map<string, SliceStats>();

  constructor(
    private readonly kv: KV,
    opts: LimitStoreOptions = {},
  ) {
    this.clock = opts.clock ?? Date.now;
    this.maxAttempts = opts.maxAttempts ?? 64;
    this.rememberedScopes = opts.rememberedScopes ?? 10_000;
    this.settleHoldMs = opts.settleHoldMs ?? SETTLE_HOLD_MS;
    this.writeTimeoutMs = opts.writeTimeoutMs ?? WRITE_TIMEOUT_MS;
    this.sliceMs = opts.sliceMs ?? SLICE_MS;
  }

  /**
   * Reserves `reservation`'s worst case in `scope` if `limits` allow it (shared/limits.ts
   * `admit`). A thrown error (a timeout, say) leaves unknown whether the write landed: ask again
   * with the same id, which never counts twice; or settle it.
   */
  admit(scope: string, limits: KeyLimits, reservation: AdmitRequest): Promise<Admission> {
    const exact: Step<Admission> = (state, now) => {
      const a = admit(state, limits, reservation, now);
      return a.ok ? { write: a.state, result: a } : { result: a };
    };
    const sliced = this.sliceable(limits, reservation);
    if (!sliced) return this.enqueue<Admission>(scope, exact);
    const key = limitKeyOf(scope);
    const sliceKey = sliced.model === undefined ? key : `${key} ${sliced.model}`;
    const fromSlice = () => this.admitFromSlice(key, sliceKey, limits, reservation, sliced.want);
    const local = fromSlice();
    if (local) return Promise.resolve(local);
    // A slice on its way: this request waits for it rather than write alone.
    const coming = this.leasing.get(sliceKey);
    if (coming) return coming.then(() => fromSlice() ?? this.admitExactly(scope, sliceKey, exact));
    if ((this.noSliceUntil.get(sliceKey) ?? 0) > this.clock()) return this.admitExactly(scope, sliceKey, exact);
    // No slice to admit from: lease one in this request's write and admit it from that; near a limit (no slice), exactly.
    return this.lease(scope, key, sliceKey, limits, reservation, sliced.model, sliced.want, exact).then(
      (a) => a ?? fromSlice() ?? this.admitExactly(scope, sliceKey, exact),
    );
  }

  /**
   * Leases a slice of `sliceKey` (one write) and makes it the open one; near a limit (none leased),
   * no other is asked for during `sliceMs`, and `otherwise` — an admission's exact step — is
   * taken in the same write instead, its result returned. Admissions meanwhile wait for it.
   */
  private lease(
    scope: string,
    key: string,
    sliceKey: string,
    limits: KeyLimits,
    req: AdmitRequest,
    model: string | undefined,
    want: number,
    otherwise?: Step<Admission>,
  ): Promise<Admission | undefined> {
    const id = `~slice.${randomUUID()}`;
    const ask = this.sliceRequest(sliceKey, id, req, model, want);
    type Leased = { slice: Slice; state: LimitState } | { admission: Admission | undefined };
    const leased = this.enqueue<Leased>(scope, (state, at) => {
      const l = leaseSlice(state, limits, ask, at);
      if (l.ok) return { write: l.state, result: { slice: l.slice, state: l.state } };
      const a = otherwise?.(state, at);
      return { ...(a?.write ? { write: a.write } : {}), result: { admission: a?.result } };
    }).then((r) => {
      if ('admission' in r) {
        this.noSliceUntil.set(sliceKey, this.clock() + this.sliceMs);
        return r.admission;
      }
      this.install(scope, key, sliceKey, id, limits, req, model, r.slice, r.state);
      return undefined;
    });
    this.whileLeasing(sliceKey, leased);
    return leased;
  }

  /** Marks a lease of `sliceKey` under way until `leased` settles (admissions meanwhile wait for it). */
  private whileLeasing(sliceKey: string, leased: Promise<unknown>): void {
    const done = leased.then(
      () => undefined,
      () => undefined,
    );
    this.leasing.set(sliceKey, done);
    void done.then(() => this.leasing.get(sliceKey) === done && this.leasing.delete(sliceKey));
  }

  /**
   * Admits by a write of its own. Refused while this replica's open slice of the scope sat idle
   * (nothing in flight: what it holds is what refused), the slice is given back in the same write
   * as a second try; one with requests in flight closes and is given back once they end.
   */
  private admitExactly(scope: string, sliceKey: string, exact: Step<Admission>): Promise<Admission> {
    return this.enqueue<Admission>(scope, exact).then((a) => {
      const open = this.openSlices.get(sliceKey);
      if (a.ok || !open) return a;
      const idle = open.live.size === 0;
      this.closeSlice(open);
      return idle ? this.enqueue<Admission>(scope, exact) : a;
    });
  }

  /**
   * Settles request `id` of `scope` to `tokens` used (shared/limits.ts `settle`; an unknown id
   * changes nothing). Held for the scope's next write, at most `settleHoldMs`: resolves once
   * written.
   */
  settle(scope: string, limits: KeyLimits, id: string, tokens: number): Promise<Settlement> {
    const key = limitKeyOf(scope);
    const slice = this.localIds.get(`${key} ${id}`);
    if (slice && Number.isSafeInteger(tokens) && tokens >= 0) return Promise.resolve(this.settleInSlice(slice, id, tokens));
    return this.enqueue<Settlement>(
      scope,
      (state, now) => {
        const s = settle(state, limits, id, tokens, now);
        return s.settled ? { write: s.state, result: s } : { result: s };
      },
      true,
    );
  }

  /**
   * Charges `bytes` of a response of `scope` stored now that expires at `expiresAtMs` to its
   * stored bytes — or, with `release`, gives back those of one deleted before it expired
   * (shared/limits.ts `chargeStorage`, `releaseStorage`). Nothing is written when the key has no
   * storage quota.
   */
  storage(scope: string, limits: KeyLimits, change: { bytes: number; expiresAtMs: number; release?: boolean }): Promise<void> {
    return this.enqueue<void>(scope, (state, now) => {
      const next = (change.release ? releaseStorage : chargeStorage)(state, limits, change.bytes, change.expiresAtMs, now);
      return next === state ? { result: undefined } : { write: next, result: undefined };
    });
  }

  /**
   * Extends to now + `leaseMs` the leases of `replica`'s reservations, one compare-and-swap per
   * scope (scopes in parallel). Returns, per scope, the ids that are no longer reserved by
   * `replica` (settled, or released after their lease passed and charged in full). Leases that
   * passed are released first: a renewal never brings a released reservation back.
   */
  async renew(replica: string, reservations: ReadonlyMap<string, Iterable<string>>, leaseMs: number): Promise<Map<string, string[]>> {
    const missing = new Map<string, string[]>();
    await Promise.all(
      [...reservations].map(async ([scope, ids]) => {
        const key = limitKeyOf(scope);
        // A request admitted from a slice lives by its slice's lease: that one is renewed instead.
        const bySlice = new Map<string, { slice: LocalSlice; ids: string[] }>();
        const list: string[] = [];
        for (const id of ids) {
          const slice = this.localIds.get(`${key} ${id}`);
          if (!slice) list.push(id);
          else if (bySlice.has(slice.id)) bySlice.get(slice.id)!.ids.push(id);
          else {
            bySlice.set(slice.id, { slice, ids: [id] });
            list.push(slice.id);
          }
        }
        if (list.length === 0) return;
        const gone = await this.enqueue(scope, (state, now) => {
          const swept = sweep(state, now);
          const r = renew(swept, replica, list, now + leaseMs);
          return r.state === swept ? { result: r.missing } : { write: r.state, result: r.missing };
        });
        const lost = gone.flatMap((id) => {
          const held = bySlice.get(id);
          if (!held) return [id];
          // The slice lapsed (released, charged in full): so did every request admitted from it.
          this.forget(held.slice);
          return held.ids;
        });
        if (lost.length > 0) missing.set(scope, lost);
      }),
    );
    return missing;
  }

  /** The state of `scope` as stored, and its revision; undefined when it has none. */
  async read(scope: string): Promise<{ state: LimitState; revision: number } | undefined> {
    const stored = await this.fetch(scope);
    return stored.revision === 0 ? undefined : stored;
  }

  /**
   * Writes every held settle now; resolves once every write under way (those included) has
   * finished, whatever its outcome.
   */
  async flush(): Promise<void> {
    for (const slice of [...this.openSlices.values()]) this.closeSlice(slice);
    while (this.held.size > 0 || this.drains.size > 0) {
      for (const key of [...this.held.keys()]) this.release(key);
      await Promise.all(this.drains.values());
    }
  }

  /**
   * {@link flush}es, then stops listening for acknowledgements. Settles after it are written at
   * once, not held; a later write listens again.
   */
  async close(): Promise<void> {
    this.closed = true;
    for (const set of [...this.slices.values()])
      for (const slice of [...set]) {
        // Requests still in flight are charged their worst case now (as their lapsed leases would be later).
        for (const [id, r] of slice.live) {
          slice.usedTokens += r.tokens;
          this.localIds.delete(`${slice.key} ${id}`);
        }
        slice.live.clear();
        this.closeSlice(slice);
      }
    await this.flush();
    const writer = this.writer;
    this.writer = undefined;
    await writer?.close();
  }

  /**
   * Whether `req` may be admitted from a slice, and then its worst case (`upTo` when set: a slice
   * grants it only whole, as the exact admission would with that much room) and the model whose
   * own limits the slice counts in. Not: slices off, a request that stores (the storage quota is
   * counted exactly), or input `admit` would refuse (it says why).
   */
  private sliceable(limits: KeyLimits, req: AdmitRequest): { want: number; model: string | undefined } | undefined {
    if (this.sliceMs <= 0 || this.closed || !req.id) return undefined;
    if (req.storeBytes !== undefined && limits.storageBytes !== undefined) return undefined;
    const whole = (n: number | undefined, min: number) => n === undefined || (Number.isSafeInteger(n) && n >= min);
    if (!whole(req.tokens, 0) || !whole(req.upTo, 0) || !whole(req.leaseMs, 1)) return undefined;
    const model = modelLimitsOf(limits, req.model) ? req.model : undefined;
    return { want: Math.max(req.tokens, req.upTo ?? 0), model };
  }

  /** Admits `req` from its scope's open slice when that has room for it (or already admitted it); otherwise undefined. */
  private admitFromSlice(key: string, sliceKey: string, limits: KeyLimits, req: AdmitRequest, want: number): Admission | undefined {
    const known = this.localIds.get(`${key} ${req.id}`);
    if (known) return this.admitted(known, known.live.get(req.id)!.tokens);
    const slice = this.openSlices.get(sliceKey);
    if (!slice) return undefined;
    const now = this.clock();
    if (slice.limits !== limits) {
      if (slice.limitsText !== JSON.stringify(limits)) {
        this.closeSlice(slice);
        return undefined;
      }
      slice.limits = limits;
    }
    if (now >= slice.closesAt) {
      this.closeSlice(slice);
      return undefined;
    }
    const fits =
      (slice.requestsLeft === null || slice.requestsLeft >= 1) &&
      (slice.slots === null || slice.live.size < slice.slots) &&
      (slice.tokensLeft === null || slice.tokensLeft >= want);
    if (!fits) return undefined;
    if (slice.requestsLeft !== null) slice.requestsLeft -= 1;
    if (slice.tokensLeft !== null) slice.tokensLeft -= want;
    slice.live.set(req.id, { tokens: want, at: now });
    slice.admitted += 1;
    this.localIds.set(`${key} ${req.id}`, slice);
    const stats = this.sliceStats.get(slice.sliceKey)!;
    stats.maxWant = Math.max(stats.maxWant, want);
    stats.peakLive = Math.max(stats.peakLive, slice.live.size);
    // Half used, or half its time gone: the next slice is leased now, off any request's way.
    const low =
      (slice.requestsLeft !== null && slice.requestsLeft * 2 < slice.leased.requests!) ||
      (slice.tokensLeft !== null && slice.tokensLeft * 2 < slice.leased.tokens!) ||
      now * 2 >= slice.leasedAt + slice.closesAt;
    if (low && !this.leasing.has(slice.sliceKey)) this.leaseAhead(slice, req, want);
    return this.admitted(slice, want);
  }

  /** An admission from `slice`: the headers as this replica sees the key (what its slice still holds counted in). */
  private admitted(slice: LocalSlice, tokens: number): Admission {
    const state = sliceState(slice, slice.requestsLeft, slice.tokensLeft);
    return { ok: true, state, headers: rateLimitHeaders(state, slice.limits, this.clock(), slice.model), tokens };
  }

  /** The next slice of `slice`'s scope, leased before this one runs out (this one closes once it is in). */
  private leaseAhead(slice: LocalSlice, req: AdmitRequest, want: number): void {
    // Not written: requests go on from the slice there is, then the exact way.
    this.lease(slice.scope, slice.key, slice.sliceKey, slice.limits, req, slice.model, want).catch(() => undefined);
  }

  /**
   * What to lease for `sliceKey`: twice what its last slice admitted in a slice's time, and as
   * many slots as twice its most requests in flight, at least 8 of each, tokens for that many of
   * its largest worst case; at least two of this request's (`want`) for it to be worth a slice.
   */
  private sliceRequest(sliceKey: string, id: string, req: AdmitRequest, model: string | undefined, want: number) {
    let stats = this.sliceStats.get(sliceKey);
    if (!stats) this.sliceStats.set(sliceKey, (stats = { rate: 0, maxWant: want, peakLive: 1 }));
    const open = this.openSlices.get(sliceKey);
    if (open) stats.rate = open.admitted / Math.max(1, this.clock() - open.leasedAt);
    const requests = Math.min(1_000_000, Math.max(8, Math.ceil(stats.rate * this.sliceMs * 2)));
    const maxWant = Math.max(stats.maxWant, want, 1);
    return {
      id,
      replica: req.replica,
      leaseMs: req.leaseMs,
      ...(model !== undefined ? { model } : {}),
      requests,
      tokens: Math.min(Number.MAX_SAFE_INTEGER, requests * maxWant),
      slots: Math.min(1_000_000, Math.max(8, 2 * stats.peakLive)),
      minTokens: 2 * want,
    };
  }

  /** Makes a slice just leased the scope's open one (the one before closes). */
  private install(
    scope: string,
    key: string,
    sliceKey: string,
    id: string,
    limits: KeyLimits,
    req: AdmitRequest,
    model: string | undefined,
    leased: Slice,
    state: LimitState,
  ): void {
    const now = this.clock();
    const slice: LocalSlice = {
      id,
      scope,
      key,
      sliceKey,
      model,
      limits,
      limitsText: JSON.stringify(limits),
      requestsLeft: leased.requests,
      tokensLeft: leased.tokens,
      slots: leased.slots,
      leased,
      live: new Map(),
      admitted: 0,
      usedTokens: 0,
      meanDurationMs: (model !== undefined ? state.models?.[model] : state)?.meanDurationMs,
      view: state,
      leasedAt: now,
      // A slice admits for at most a third of a lease: one with nothing in flight is never renewed.
      closesAt: now + Math.min(this.sliceMs, Math.floor(req.leaseMs / 3)),
      open: true,
      timer: undefined,
    };
    let set = this.slices.get(key);
    if (!set) this.slices.set(key, (set = new Set()));
    set.add(slice);
    const before = this.openSlices.get(sliceKey);
    this.openSlices.set(sliceKey, slice);
    if (before) this.closeSlice(before);
    slice.timer = setTimeout(() => this.closeSlice(slice), Math.max(0, slice.closesAt - now));
    slice.timer.unref();
    if (this.closed) this.closeSlice(slice);
  }

  /** Settles a request admitted from `slice`: what it used counted, the rest of its worst case back in the slice. */
  private settleInSlice(slice: LocalSlice, id: string, tokens: number): Settlement {
    const r = slice.live.get(id)!;
    slice.live.delete(id);
    this.localIds.delete(`${slice.key} ${id}`);
    slice.usedTokens += tokens;
    if (slice.tokensLeft !== null) slice.tokensLeft += r.tokens - tokens;
    const duration = Math.max(0, this.clock() - r.at);
    slice.meanDurationMs = slice.meanDurationMs === undefined ? duration : slice.meanDurationMs + (duration - slice.meanDurationMs) / 8;
    if (!slice.open && slice.live.size === 0) this.giveBack(slice);
    // The state and headers as this replica sees them, made only if asked for (a gateway's settle asks for neither).
    const now = this.clock();
    const [requestsLeft, tokensLeft] = [slice.requestsLeft, slice.tokensLeft];
    return {
      settled: true,
      get state() {
        return sliceState(slice, requestsLeft, tokensLeft);
      },
      get headers() {
        return rateLimitHeaders(sliceState(slice, requestsLeft, tokensLeft), slice.limits, now, slice.model);
      },
    };
  }

  /** Stops admitting from `slice`; given back at once when nothing of it is in flight, else when its last request settles. */
  private closeSlice(slice: LocalSlice): void {
    if (!slice.open) return;
    slice.open = false;
    clearTimeout(slice.timer);
    if (this.openSlices.get(slice.sliceKey) === slice) this.openSlices.delete(slice.sliceKey);
    const stats = this.sliceStats.get(slice.sliceKey);
    if (stats) stats.rate = slice.admitted / Math.max(1, this.clock() - slice.leasedAt);
    if (slice.live.size === 0) this.giveBack(slice);
  }

  /** Writes `slice` back (held like a settle, for the scope's next write): what it did not use returns to the key. */
  private giveBack(slice: LocalSlice): void {
    const use = {
      requestsLeft: slice.requestsLeft ?? 0,
      usedTokens: slice.usedTokens,
      ...(slice.meanDurationMs !== undefined ? { meanDurationMs: slice.meanDurationMs } : {}),
    };
    this.enqueue<Settlement>(
      slice.scope,
      (state, now) => {
        const s = returnSlice(state, slice.limits, slice.id, use, now);
        return s.settled ? { write: s.state, result: s } : { result: s };
      },
      true,
    )
      .then(() => this.forget(slice))
      .catch(() => {
        // Not written: kept in `slices` (flush and close try again); its lease lapses otherwise, charged in full.
        slice.open = false;
        setTimeout(() => this.slices.get(slice.key)?.has(slice) && this.giveBack(slice), this.sliceMs).unref();
      });
  }

  /** Drops every trace of `slice` here (given back, or lapsed). */
  private forget(slice: LocalSlice): void {
    clearTimeout(slice.timer);
    slice.open = false;
    if (this.openSlices.get(slice.sliceKey) === slice) this.openSlices.delete(slice.sliceKey);
    for (const id of slice.live.keys()) this.localIds.delete(`${slice.key} ${id}`);
    const set = this.slices.get(slice.key);
    set?.delete(slice);
    if (set?.size === 0) this.slices.delete(slice.key);
  }

  /** Runs `step` in the scope's next batch; a `holdable` one (a settle) may wait up to `settleHoldMs` for another's. */
  private enqueue<R>(scope: string, step: Step<R>, holdable = false): Promise<R> {
    const key = limitKeyOf(scope);
    return new Promise<R>((resolve, reject) => {
      const op: Pending = { step, resolve: resolve as (result: unknown) => void, reject, holdable: holdable && this.holding() };
      const queue = this.queues.get(key);
      if (queue) queue.push(op);
      else if (op.holdable) this.hold(scope, key, [op]);
      else this.start(scope, key, [...this.unhold(key), op]);
    });
  }

  private holding(): boolean {
    return this.settleHoldMs > 0 && !this.closed;
  }

  /** Holds `ops` (settles, oldest first) for the scope's next write; written alone after `settleHoldMs`. */
  private hold(scope: string, key: string, ops: Pending[]): void {
    const h = this.held.get(key);
    if (h) h.ops.push(...ops);
    else this.held.set(key, { scope, ops, timer: setTimeout(() => this.release(key), this.settleHoldMs) });
  }

  /** The scope's held settles, no longer held (they go into the write about to start). */
  private unhold(key: string): Pending[] {
    const h = this.held.get(key);
    if (!h) return [];
    clearTimeout(h.timer);
    this.held.delete(key);
    for (const op of h.ops) op.holdable = false;
    return h.ops;
  }

  /** Writes the scope's held settles now (their hold is over). */
  private release(key: string): void {
    const scope = this.held.get(key)?.scope;
    const ops = this.unhold(key);
    if (scope === undefined || ops.length === 0) return;
    const queue = this.queues.get(key);
    if (queue) queue.push(...ops);
    else this.start(scope, key, ops);
  }

  private start(scope: string, key: string, ops: Pending[]): void {
    this.queues.set(key, ops);
    const drained: Promise<void> = this.drain(scope, key).finally(() => {
      if (this.drains.get(key) === drained) this.drains.delete(key);
    });
    this.drains.set(key, drained);
  }

  /**
   * Writes the scope's batches one after the other until its queue is empty, or holds only
   * settles still in their hold (then held for the next write). Never rejects.
   */
  private async drain(scope: string, key: string): Promise<void> {
    for (let queue = this.queues.get(key)!; queue.length > 0;) {
      if (queue.every((op) => op.holdable) && this.holding()) {
        this.hold(scope, key, queue.splice(0));
        break;
      }
      const batch = queue.splice(0, MAX_BATCH);
      try {
        const outcomes = await this.transact(scope, (state, now) => {
          let current = state;
          let write: LimitState | undefined;
          const results = batch.map((op) => {
            try {
              const r = op.step(current, now);
              if (r.write) current = write = r.write;
              return { ok: true as const, result: r.result };
            } catch (err) {
              // A step refusing its input (shared/limits.ts throws RangeError) fails that operation only.
              return { ok: false as const, err };
            }
          });
          return { write, result: results };
        });
        outcomes.forEach((o, i) => (o.ok ? batch[i]!.resolve(o.result) : batch[i]!.reject(o.err)));
      } catch (err) {
        for (const op of batch) op.reject(err);
      }
    }
    this.queues.delete(key);
  }

  /**
   * Runs `step` on the scope's state and writes what it returns by compare-and-swap, reading
   * again and deciding again on a conflict. A result without a write stands only when it was
   * decided on a state just read. One at a time per scope (its batches run in turn).
   */
  private async transact<R>(scope: string, step: Step<R>): Promise<R> {
    const key = limitKeyOf(scope);
    let current = this.remembered.get(key);
    let fresh = false;
    for (let attempt = 1; attempt <= this.maxAttempts; attempt += 1) {
      if (!current) {
        current = await this.fetch(scope);
        fresh = true;
      }
      const { write, result } = step(current.state, this.clock());
      if (!write) {
        if (fresh) return result;
        current = undefined;
        continue;
      }
      const data = JSON.stringify(write);
      try {
        this.writer ??= kvCasWriter(this.kv, this.writeTimeoutMs);
        const revision = await this.writer.write(key, data, current.revision);
        this.remember(key, { state: write, revision });
        return result;
      } catch (err) {
        this.remembered.delete(key);
        if (!isRevisionConflict(err)) throw err;
        current = undefined;
        await backoff(attempt);
      }
    }
    throw new LimitContentionError(scope, this.maxAttempts);
  }

  /** The stored state of `scope` (an empty one at revision 0 when there is no entry, or it was deleted). */
  private async fetch(scope: string): Promise<Stored> {
    const key = limitKeyOf(scope);
    const e = await this.kv.get(key);
    let stored: Stored;
    if (!e) stored = { state: emptyLimitState(), revision: 0 };
    // A deleted entry is written again on its delete marker's revision.
    else if (e.operation !== 'PUT') stored = { state: emptyLimitState(), revision: e.revision };
    else {
      const state = decodeLimitState(decoder.decode(e.value));
      if (!state) throw new LimitStateUnreadableError(scope);
      stored = { state, revision: e.revision };
    }
    this.remember(key, stored);
    return stored;
  }

  private remember(key: string, stored: Stored): void {
    this.remembered.delete(key);
    this.remembered.set(key, stored);
    if (this.remembered.size > this.rememberedScopes) this.remembered.delete(this.remembered.keys().next().value!);
  }
}

/** Compare-and-swap writes of a KV bucket's entries. */
export interface KvCasWriter {
  /**
   * Writes `data` to entry `key` if its last revision is `revision` (0: if it has none); resolves
   * with the new revision. A conflict rejects with the server's error (`isRevisionConflict`).
   */
  write(key: string, data: string, revision: number): Promise<number>;
  /** Stops listening; writes still waiting for an acknowledgement fail. */
  close(): Promise<void>;
}

/** What a nats.js bucket view (`views.kv`) holds that a core publish needs: its connection, and its entries' subject for writing. */
interface BucketInternals {
  js?: { nc?: NatsConnection };
  subjectForKey?: (key: string, edit?: boolean) => string;
}

/**
 * Compare-and-swap writes of `kv`'s entries as core publishes on the bucket's connection: to the
 * entry's subject as the view names it for a write (`subjectForKey(key, true)`: `$KV.<bucket>.<key>`,
 * with a JetStream API prefix or a mirror's prefix when the view has one), with
 * `Nats-Expected-Last-Subject-Sequence: <revision>`, its reply subject one inbox subscription's
 * prefix plus a counter; the stream's acknowledgement (`{"stream","seq"}`, or `{"error"}` with the
 * server's `api_error`, as nats.js keeps it) settles an entry of a `Map`. Writes unacknowledged
 * after `timeoutMs` fail (checked every `min(timeoutMs, 1 s)`); so do those under way when the
 * connection drops (their acknowledgements would go to the old connection), and a write while it
 * is down fails at once. A `kv` that is not a nats.js bucket view (a test's fake) is written with
 * `kv.create` / `kv.update`.
 */
export function kvCasWriter(kv: KV, timeoutMs = WRITE_TIMEOUT_MS): KvCasWriter {
  const internals = kv as unknown as BucketInternals;
  const nc = internals.js?.nc;
  const subjectForKey = internals.subjectForKey?.bind(kv);
  if (!nc || !subjectForKey) {
    return {
      write: (key, data, revision) => (revision === 0 ? kv.create(key, data) : kv.update(key, data, revision)),
      close: () => Promise.resolve(),
    };
  }
  // A key's subject, built once (the view joins its parts on every call).
  const subjects = new Map<string, string>();
  const subjectOf = (key: string): string => {
    let subject = subjects.get(key);
    if (subject === undefined) {
      if (subjects.size >= 10_000) subjects.clear();
      subjects.set(key, (subject = subjectForKey(key, true)));
    }
    return subject;
  };
  const acks = ackedPublisher(nc, timeoutMs, {
    unreachable: 'NATS is unreachable: the limits were not written',
    disconnected: 'NATS disconnected before the limits write was acknowledged',
    timedOut: `the limits write was not acknowledged within ${timeoutMs} ms`,
    closed: 'the limits writer is closed',
  });
  return {
    async write(key, data, revision) {
      const h = headers();
      h.set('Nats-Expected-Last-Subject-Sequence', String(revision));
      const msg = await acks.publish(subjectOf(key), data, h);
      const ack = casAckOf(msg.data, msg.headers?.code ?? 0);
      if (typeof ack === 'number') return ack;
      throw ack;
    },
    close: () => acks.close(),
  };
}

const ACK_SEQ = /"seq":(\d+)[,}]/;

/**
 * A stream's reply to a KV write: the entry's new revision (`seq`), or the error — with the
 * server's `api_error` (`isRevisionConflict` reads its `err_code`) when the stream refused it.
 */
function casAckOf(data: Uint8Array, status: number): number | Error {
  if (data.length === 0)
    return new Error(status === 503 ? 'no stream stores the limits bucket (no responders)' : `unexpected empty reply to a limits write (status ${status})`);
  const text = decoder.decode(data);
  // An acknowledgement, `{"stream":"KV_…","seq":N}` (perhaps a domain after): its seq without a JSON parse.
  const seq = text.startsWith('{"stream":') && !text.includes('"error"') ? ACK_SEQ.exec(text) : null;
  if (seq) return Number(seq[1]);
  let ack: { seq?: unknown; error?: { code?: number; err_code?: number; description?: string } };
  try {
    ack = JSON.parse(text) as typeof ack;
  } catch {
    return new Error('malformed reply to a limits write');
  }
  if (ack.error) return Object.assign(new Error(ack.error.description ?? `limits write failed (${ack.error.code ?? '?'})`), { api_error: ack.error });
  return typeof ack.seq === 'number' ? ack.seq : new Error('malformed reply to a limits write');
}

/**
 * Renews one gateway replica's live reservations every third of the lease, so each is renewed
 * about three times before it could lapse (a renewal that fails is retried at the next tick).
 * `track` a reservation once admitted, `untrack` it once settled. A reservation found no longer
 * reserved (released after a lapse, charged in full) is reported to `onLost` and no longer renewed.
 */
export class LimitRenewer {
  private readonly live = new Map<string, Set<string>>();
  private timer: NodeJS.Timeout | undefined;
  private running: Promise<void> | undefined;

  constructor(
    private readonly store: LimitStore,
    private readonly replica: string,
    private readonly leaseMs: number,
    private readonly hooks: { onLost?: (scope: string, id: string) => void; onError?: (err: unknown) => void } = {},
  ) {
    if (!Number.isInteger(leaseMs) || leaseMs < 1) throw new RangeError(`leaseMs must be a whole number of ms, got ${leaseMs}`);
  }

  /** Renews reservation `id` of `scope` from now on (admitted with this renewer's `leaseMs`). */
  track(scope: string, id: string): void {
    let ids = this.live.get(scope);
    if (!ids) this.live.set(scope, (ids = new Set()));
    ids.add(id);
  }

  /** Stops renewing reservation `id` of `scope` (settled). */
  untrack(scope: string, id: string): void {
    const ids = this.live.get(scope);
    if (!ids) return;
    ids.delete(id);
    if (ids.size === 0) this.live.delete(scope);
  }

  /** Starts renewing every `leaseMs / 3`. */
  start(): void {
    if (this.timer) return;
    this.timer = setInterval(
      () => {
        // One renewal at a time: a slow one is not overtaken by the next tick.
        this.running ??= this.renewNow()
          .catch((err: unknown) => this.hooks.onError?.(err))
          .finally(() => (this.running = undefined));
      },
      Math.floor(this.leaseMs / 3),
    );
    this.timer.unref();
  }

  /** Renews every tracked reservation once, now. */
  async renewNow(): Promise<void> {
    const snapshot = new Map([...this.live].map(([scope, ids]) => [scope, [...ids]]));
    if (snapshot.size === 0) return;
    const missing = await this.store.renew(this.replica, snapshot, this.leaseMs);
    for (const [scope, ids] of missing) {
      for (const id of ids) {
        // Settled meanwhile (untracked) is no loss.
        if (!this.live.get(scope)?.has(id)) continue;
        this.untrack(scope, id);
        this.hooks.onLost?.(scope, id);
      }
    }
  }

  /** Stops renewing (a renewal under way finishes); the leases then lapse unless settled. */
  async stop(): Promise<void> {
    clearInterval(this.timer);
    this.timer = undefined;
    await this.running;
  }
}

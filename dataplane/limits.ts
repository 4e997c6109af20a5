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
 * A gateway renews the leases of its live reservations with a {@link LimitRenewer} every third of
 * the lease, so a reservation of a gateway that died is released (charged its worst case) within
 * one lease of its last renewal.
 */
import type { KV } from 'nats';
import {
  admit,
  chargeStorage,
  decodeLimitState,
  emptyLimitState,
  releaseStorage,
  renew,
  settle,
  sweep,
  type Admission,
  type AdmitRequest,
  type KeyLimits,
  type LimitState,
  type Settlement,
} from '../shared/limits';
import { isRevisionConflict } from './errors';

/** The KV key of scope `identity`: its UTF-8 bytes in base64url without padding. */
export const limitKeyOf = (identity: string): string => {
  if (!identity) throw new Error('a limit scope needs a key identity');
  return Buffer.from(identity, 'utf8').toString('base64url');
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
}

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
  /** Per KV key, the operations queued behind the write in flight (present while one is). */
  private readonly queues = new Map<string, Pending[]>();

  constructor(
    private readonly kv: KV,
    opts: LimitStoreOptions = {},
  ) {
    this.clock = opts.clock ?? Date.now;
    this.maxAttempts = opts.maxAttempts ?? 64;
    this.rememberedScopes = opts.rememberedScopes ?? 10_000;
  }

  /**
   * Reserves `reservation`'s worst case in `scope` if `limits` allow it (shared/limits.ts
   * `admit`). A thrown error (a timeout, say) leaves unknown whether the write landed: ask again
   * with the same id, which never counts twice; or settle it.
   */
  admit(scope: string, limits: KeyLimits, reservation: AdmitRequest): Promise<Admission> {
    return this.enqueue<Admission>(scope, (state, now) => {
      const a = admit(state, limits, reservation, now);
      return a.ok ? { write: a.state, result: a } : { result: a };
    });
  }

  /** Settles request `id` of `scope` to `tokens` used (shared/limits.ts `settle`; an unknown id changes nothing). */
  settle(scope: string, limits: KeyLimits, id: string, tokens: number): Promise<Settlement> {
    return this.enqueue<Settlement>(scope, (state, now) => {
      const s = settle(state, limits, id, tokens, now);
      return s.settled ? { write: s.state, result: s } : { result: s };
    });
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
        const list = [...ids];
        if (list.length === 0) return;
        const gone = await this.enqueue(scope, (state, now) => {
          const swept = sweep(state, now);
          const r = renew(swept, replica, list, now + leaseMs);
          return r.state === swept ? { result: r.missing } : { write: r.state, result: r.missing };
        });
        if (gone.length > 0) missing.set(scope, gone);
      }),
    );
    return missing;
  }

  /** The state of `scope` as stored, and its revision; undefined when it has none. */
  async read(scope: string): Promise<{ state: LimitState; revision: number } | undefined> {
    const stored = await this.fetch(scope);
    return stored.revision === 0 ? undefined : stored;
  }

  /** Runs `step` in the scope's next batch. */
  private enqueue<R>(scope: string, step: Step<R>): Promise<R> {
    const key = limitKeyOf(scope);
    return new Promise<R>((resolve, reject) => {
      const op: Pending = { step, resolve: resolve as (result: unknown) => void, reject };
      const queue = this.queues.get(key);
      if (queue) queue.push(op);
      else {
        this.queues.set(key, [op]);
        void this.drain(scope, key);
      }
    });
  }

  /** Writes the scope's batches one after the other until its queue is empty. Never rejects. */
  private async drain(scope: string, key: string): Promise<void> {
    for (let queue = this.queues.get(key)!; queue.length > 0;) {
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
        const revision = current.revision === 0 ? await this.kv.create(key, data) : await this.kv.update(key, data, current.revision);
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

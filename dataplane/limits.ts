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
 */
import { headers, type KV, type NatsConnection } from 'nats';
import { ackedPublisher } from './acked-publish';
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
}

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

  constructor(
    private readonly kv: KV,
    opts: LimitStoreOptions = {},
  ) {
    this.clock = opts.clock ?? Date.now;
    this.maxAttempts = opts.maxAttempts ?? 64;
    this.rememberedScopes = opts.rememberedScopes ?? 10_000;
    this.settleHoldMs = opts.settleHoldMs ?? SETTLE_HOLD_MS;
    this.writeTimeoutMs = opts.writeTimeoutMs ?? WRITE_TIMEOUT_MS;
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

  /**
   * Settles request `id` of `scope` to `tokens` used (shared/limits.ts `settle`; an unknown id
   * changes nothing). Held for the scope's next write, at most `settleHoldMs`: resolves once
   * written.
   */
  settle(scope: string, limits: KeyLimits, id: string, tokens: number): Promise<Settlement> {
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

  /**
   * Writes every held settle now; resolves once every write under way (those included) has
   * finished, whatever its outcome.
   */
  async flush(): Promise<void> {
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
    await this.flush();
    const writer = this.writer;
    this.writer = undefined;
    await writer?.close();
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

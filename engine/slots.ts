/**
 * Generation slots with a bounded queue in front of them. A slot is one llama.cpp sequence (its
 * own KV cache); distributed-llama has exactly one. Requests beyond the free slots wait; beyond
 * the queue bound they are refused at once, so a burst turns into 429s the caller can retry
 * instead of unbounded latency.
 *
 * A released slot goes to the waiter that scores it highest (the conversation whose prefix that
 * slot's KV cache holds: it then evaluates only its new tokens instead of the whole prompt, and
 * no other conversation's cache is evicted for it); without such a waiter, to the first in
 * arrival order. Passing the first waiter over is bounded: once it has been passed over
 * `maxSkips` times it is served next, so affinity never starves anyone. An *urgent* waiter (an
 * answer resumed after its engine went away: its client is waiting mid-answer) goes before every
 * other, in arrival order among the urgent, and is not turned away by the queue bound; the pool
 * may keep `reserved` slots beside its `size` for the urgent (a resumed answer then starts at once
 * rather than when a slot frees). Those are a reserve, not slots of their own: any waiter that is
 * not urgent is served only while fewer than `size` slots are busy, the urgent while fewer than
 * `size + reserved` are, so a slot an urgent one takes from the reserve is given back by the next
 * one released — whichever it is — and not only when that answer ends (faults come again before
 * a resumed answer ends). A waiter that goes *first* (a request handed back by
 * another instance with nothing said: it waited its turn in that one's queue) goes after the
 * urgent and is not turned away either (its bridge sends at most its slots of them at once); neither
 * they nor the urgent count towards the queue bound, which turns away only the rest. With
 * a `due` (its client's deadline), it goes before the waiters due later and after those due
 * sooner — the earliest deadline first, so requests handed back from drained instances, which
 * keep coming while faults do, no longer starve an instance's own queue past its clients'
 * deadlines; without one, before every waiter that does not go first, in arrival order.
 */

export const QUEUE_FULL_ERROR = 'QueueFullError';

/** Raised by {@link SlotPool.acquire} when every slot is busy and the queue is full. */
export class QueueFullError extends Error {
  override readonly name = QUEUE_FULL_ERROR;
}

/** The rejection of a request that gave up waiting: the signal's reason if it is an Error. */
function abortError(signal: AbortSignal): Error {
  const reason: unknown = signal.reason;
  if (reason instanceof Error) return reason;
  const err = new Error('gave up waiting for a slot');
  err.name = 'AbortError';
  return err;
}

interface Waiter {
  resolve(slot: number): void;
  reject(err: unknown): void;
  signal?: AbortSignal;
  onAbort?: () => void;
  score?: (slot: number) => number;
  /** Where it stands ({@link RANK}): the urgent first, then those that go first, then the rest. */
  rank: number;
  /** Times a later waiter got a released slot before this one. */
  skipped: number;
  /** Its client's deadline (epoch ms), when known: places one that goes first among the rest. */
  due?: number;
}

/** How often the first waiter may be passed over for a waiter that owns the released slot's cache. */
export const DEFAULT_MAX_SKIPS = 4;

export interface AcquireOptions {
  /** Aborting gives up the place in the queue (the promise rejects with an AbortError). */
  signal?: AbortSignal;
  /**
   * Preference for a slot (higher wins, 0: none), e.g. how much of the conversation a slot has
   * cached: among free slots now, and among waiters when a slot is released.
   */
  score?: (slot: number) => number;
  /** Served before every waiter that is not, and never refused for a full queue (see the class comment). */
  urgent?: boolean;
  /** Served after the urgent and before every other waiter (with `due`: those due no sooner), and never refused for a full queue (see the class comment). */
  first?: boolean;
  /** Its client's deadline (epoch ms): where a waiter that goes first stands among the rest. */
  due?: number;
}

/** Where a waiter stands (higher waits ahead). */
const RANK = { urgent: 2, first: 1, other: 0 } as const;

export class SlotPool {
  /** Slots released and free again, in release order. */
  private readonly free: number[] = [];
  /** Slots never used yet are numbered lazily, so `size` may be Infinity. */
  private nextFresh = 0;
  private readonly waiters: Waiter[] = [];
  private busyCount = 0;
  /** `size + reserved`: the slots the urgent may fill. */
  private readonly total: number;

  /**
   * @param size number of slots (Infinity: never queue)
   * @param maxQueue how many requests that are neither urgent nor first may wait for a slot (0: none)
   * @param maxSkips how often the first waiter may be passed over for one that owns a released slot's cache
   * @param reserved slots beside `size` kept for urgent requests (the class comment)
   */
  constructor(
    readonly size: number,
    readonly maxQueue: number,
    readonly maxSkips: number = DEFAULT_MAX_SKIPS,
    readonly reserved = 0,
  ) {
    if (!(size >= 1)) throw new RangeError(`slot count must be at least 1, got ${size}`);
    if (!(maxQueue >= 0)) throw new RangeError(`queue bound must be at least 0, got ${maxQueue}`);
    if (!(maxSkips >= 0)) throw new RangeError(`skip bound must be at least 0, got ${maxSkips}`);
    if (!(Number.isInteger(reserved) && reserved >= 0 && (reserved === 0 || Number.isFinite(size))))
      throw new RangeError(`reserved slots must be a whole number, beside a finite size, got ${reserved}`);
    this.total = size + reserved;
  }

  get busy(): number {
    return this.busyCount;
  }

  get queued(): number {
    return this.waiters.length;
  }

  /**
   * A free slot now, or a released one later: the one whose cache it owns, or its turn in arrival order.
   * @throws QueueFullError (rejected promise) when no slot is free and the queue is full
   */
  acquire(opts: AcquireOptions = {}): Promise<number> {
    const { signal, score } = opts;
    const urgent = opts.urgent === true;
    const rank = urgent ? RANK.urgent : opts.first === true ? RANK.first : RANK.other;
    if (signal?.aborted) return Promise.reject(abortError(signal));
    // The urgent go before every waiter, so a free slot is theirs whoever waits (only those kept
    // out by `size` can be waiting while one is free).
    if (urgent ? this.busyCount < this.total : this.waiters.length === 0 && this.busyCount < this.size) {
      const slot = this.takeFree(score);
      if (slot !== undefined) {
        this.busyCount++;
        return Promise.resolve(slot);
      }
    }
    // Only the requests it may refuse count towards the bound: the requests handed back and the
    // resumed answers waiting ahead of them must not turn the instance's own queue away.
    if (rank === RANK.other) {
      const refusable = this.waiters.reduce((n, w) => n + (w.rank === RANK.other ? 1 : 0), 0);
      if (refusable >= this.maxQueue) {
        const ahead = this.waiters.length - refusable;
        return Promise.reject(
          new QueueFullError(`all ${this.size} slots are busy and ${refusable} requests are queued${ahead > 0 ? ` (and ${ahead} ahead of them)` : ''}`),
        );
      }
    }
    return new Promise<number>((resolve, reject) => {
      const due = opts.due !== undefined && Number.isFinite(opts.due) ? opts.due : undefined;
      const waiter: Waiter = { resolve, reject, signal, score, rank, skipped: 0, ...(due !== undefined ? { due } : {}) };
      if (signal) {
        waiter.onAbort = () => {
          const at = this.waiters.indexOf(waiter);
          if (at >= 0) this.waiters.splice(at, 1);
          reject(abortError(signal));
        };
        signal.addEventListener('abort', waiter.onAbort, { once: true });
      }
      const at = this.placeOf(rank, due);
      if (at >= 0) this.waiters.splice(at, 0, waiter);
      else this.waiters.push(waiter);
    });
  }

  /**
   * Where a new waiter stands (−1: last): the urgent after the urgent; one that goes first after
   * the urgent, those that go first due no later (or, without a due, all of them), and the rest
   * due sooner than it (without a due on either side: before all of the rest); the rest last.
   */
  private placeOf(rank: number, due: number | undefined): number {
    if (rank === RANK.urgent) return this.waiters.findIndex((w) => w.rank < RANK.urgent);
    if (rank === RANK.other) return -1;
    return this.waiters.findIndex((w) =>
      w.rank === RANK.urgent
        ? false
        : w.rank === RANK.first
          ? due !== undefined && (w.due ?? Infinity) > due
          : due === undefined || w.due === undefined || w.due > due,
    );
  }

  /**
   * Gives `slot` to the waiter it suits best (see the class comment) — to one that is not urgent
   * only while fewer than `size` others are busy — or back to the free list.
   */
  release(slot: number): void {
    const first = this.waiters[0];
    if (first && (first.rank === RANK.urgent || this.busyCount <= this.size)) {
      const at = first.rank === RANK.urgent ? 0 : this.waiterFor(slot);
      if (at >= 0) return this.handOver(at, slot);
    }
    this.busyCount--;
    this.free.push(slot);
  }

  private handOver(at: number, slot: number): void {
    const [waiter] = this.waiters.splice(at, 1) as [Waiter];
    for (let i = 0; i < at; i++) this.waiters[i]!.skipped++;
    if (waiter.onAbort) waiter.signal?.removeEventListener('abort', waiter.onAbort);
    waiter.resolve(slot);
  }

  /**
   * The index of the waiter to get `slot` (−1: none waits): the first one when it is urgent or
   * goes first (those wait at the head) or once it has been passed over `maxSkips` times (it has been passed over
   * at least as often as anyone behind it), else the best positive score, the earliest on a tie,
   * else the first.
   */
  private waiterFor(slot: number): number {
    if (this.waiters.length === 0) return -1;
    if (this.waiters[0]!.rank > RANK.other) return 0;
    if (this.waiters[0]!.skipped >= this.maxSkips) return 0;
    let best = 0;
    let bestScore = 0;
    for (let i = 0; i < this.waiters.length; i++) {
      const s = this.waiters[i]!.score?.(slot) ?? 0;
      if (s > bestScore) {
        best = i;
        bestScore = s;
      }
    }
    return best;
  }

  /** Rejects every queued request with `err` (shutdown); slots in use are untouched. */
  rejectWaiting(err: unknown): void {
    for (const waiter of this.waiters.splice(0)) {
      if (waiter.onAbort) waiter.signal?.removeEventListener('abort', waiter.onAbort);
      waiter.reject(err);
    }
  }

  private takeFree(score: ((slot: number) => number) | undefined): number | undefined {
    if (this.free.length > 0 && score) {
      let best = -1;
      let bestScore = 0;
      for (let i = 0; i < this.free.length; i++) {
        const s = score(this.free[i]!);
        if (s > bestScore) {
          best = i;
          bestScore = s;
        }
      }
      if (best >= 0) return this.free.splice(best, 1)[0];
    }
    if (this.nextFresh < this.total) return this.nextFresh++;
    return this.free.shift();
  }
}

/**
 * Generation slots with a bounded FIFO queue in front of them. A slot is one llama.cpp sequence
 * (its own KV cache); distributed-llama has exactly one. Requests beyond the free slots wait in
 * arrival order; beyond the queue bound they are refused at once, so a burst turns into 429s the
 * caller can retry instead of unbounded latency.
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
}

export interface AcquireOptions {
  /** Aborting gives up the place in the queue (the promise rejects with an AbortError). */
  signal?: AbortSignal;
  /** Preference among free slots (higher wins), e.g. how much of the conversation a slot has cached. */
  score?: (slot: number) => number;
}

export class SlotPool {
  /** Slots released and free again, in release order. */
  private readonly free: number[] = [];
  /** Slots never used yet are numbered lazily, so `size` may be Infinity. */
  private nextFresh = 0;
  private readonly waiters: Waiter[] = [];
  private busyCount = 0;

  /**
   * @param size number of slots (Infinity: never queue)
   * @param maxQueue how many requests may wait for a slot (0: none)
   */
  constructor(
    readonly size: number,
    readonly maxQueue: number,
  ) {
    if (!(size >= 1)) throw new RangeError(`slot count must be at least 1, got ${size}`);
    if (!(maxQueue >= 0)) throw new RangeError(`queue bound must be at least 0, got ${maxQueue}`);
  }

  get busy(): number {
    return this.busyCount;
  }

  get queued(): number {
    return this.waiters.length;
  }

  /**
   * A free slot now, or the next one released once the requests queued before this one got theirs.
   * @throws QueueFullError (rejected promise) when no slot is free and the queue is full
   */
  acquire(opts: AcquireOptions = {}): Promise<number> {
    const { signal, score } = opts;
    if (signal?.aborted) return Promise.reject(abortError(signal));
    if (this.waiters.length === 0) {
      const slot = this.takeFree(score);
      if (slot !== undefined) {
        this.busyCount++;
        return Promise.resolve(slot);
      }
    }
    if (this.waiters.length >= this.maxQueue) {
      return Promise.reject(new QueueFullError(`all ${this.size} slots are busy and ${this.waiters.length} requests are queued`));
    }
    return new Promise<number>((resolve, reject) => {
      const waiter: Waiter = { resolve, reject, signal };
      if (signal) {
        waiter.onAbort = () => {
          const at = this.waiters.indexOf(waiter);
          if (at >= 0) this.waiters.splice(at, 1);
          reject(abortError(signal));
        };
        signal.addEventListener('abort', waiter.onAbort, { once: true });
      }
      this.waiters.push(waiter);
    });
  }

  /** Gives `slot` to the first waiter, or back to the free list. */
  release(slot: number): void {
    const waiter = this.waiters.shift();
    if (waiter) {
      if (waiter.onAbort) waiter.signal?.removeEventListener('abort', waiter.onAbort);
      waiter.resolve(slot);
      return;
    }
    this.busyCount--;
    this.free.push(slot);
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
    if (this.nextFresh < this.size) return this.nextFresh++;
    return this.free.shift();
  }
}

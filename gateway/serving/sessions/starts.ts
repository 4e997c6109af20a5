/**
 * Session workflows for the conversations this gateway placed, started off the client's path:
 * `FirstTurns.adopt`, again after a failure (Temporal away) with backoff ({@link ADOPT_RETRY_MS}
 * doubling to {@link ADOPT_RETRY_MAX_MS}) until it works, the entry expires or the gateway closes,
 * so a first turn served while Temporal was down still gets its session workflow (its expiry
 * enforced) once Temporal is back. How many wait is bounded ({@link SessionStarts.full}): beyond
 * it new conversations are refused until Temporal catches up.
 */
import type { SessionEntry } from '../../../shared/serving';
import type { AcquireRequest, FirstTurns } from './types';

/**
 * The default bound on sessions waiting to start (`SessionCacheOptions.maxPendingSessionStarts`):
 * about a minute of new conversations above what a small Temporal starts (dev's ~50–90 starts/s
 * on 2 cores), each a gRPC call in flight or a retry timer in this process.
 */
export const MAX_PENDING_SESSION_STARTS = 5_000;

/** First wait before a failed adoption is tried again; it doubles up to {@link ADOPT_RETRY_MAX_MS}. */
const ADOPT_RETRY_MS = 1_000;
const ADOPT_RETRY_MAX_MS = 15_000;

export class SessionStarts {
  /** Conversations whose session workflow has not started yet. */
  private waiting = 0;
  /** Adoptions waiting to be tried again: their timers. */
  private readonly retries = new Set<NodeJS.Timeout>();
  private closed = false;

  constructor(
    private readonly first: FirstTurns,
    private readonly now: () => number,
    private readonly max: number = MAX_PENDING_SESSION_STARTS,
    private readonly onError?: (err: unknown) => void,
  ) {}

  get pending(): number {
    return this.waiting;
  }

  /** As many wait as may: no new conversation until they drain. */
  get full(): boolean {
    return this.waiting >= this.max;
  }

  /** Has the session workflow adopt `entry`, retrying as the module says; not awaited. */
  start(req: Omit<AcquireRequest, 'signal'>, entry: SessionEntry): void {
    this.waiting++;
    const attempt = (delay: number): void => {
      this.first.adopt(req, entry).then(
        () => void this.waiting--,
        (err: unknown) => {
          this.onError?.(err);
          if (this.closed || entry.expiresAt <= this.now()) return void this.waiting--;
          const timer = setTimeout(() => {
            this.retries.delete(timer);
            attempt(Math.min(delay * 2, ADOPT_RETRY_MAX_MS));
          }, delay);
          timer.unref();
          this.retries.add(timer);
        },
      );
    };
    attempt(ADOPT_RETRY_MS);
  }

  close(): void {
    this.closed = true;
    for (const t of this.retries) clearTimeout(t);
  }
}

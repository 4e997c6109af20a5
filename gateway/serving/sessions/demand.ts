/**
 * What this replica tells pools about the first turns waiting for room (`FirstTurns.demand`,
 * signal-with-start on the pool): per model, how many wait, what the pool was last told and when.
 * A change is told at most once per {@link DEMAND_MIN_MS} (a later one by a timer), an unchanged
 * demand again every {@link DEMAND_REFRESH_MS}; when the last waiter leaves, 0 is told, so a
 * client that leaves leaves no demand behind. A model's record is dropped only once nobody waits
 * and nothing is left to tell.
 */
import type { ReadyModel } from '../../../shared/model';
import type { FirstTurns } from './types';

/** Demand is told to a pool at most this often per model, and again at least this often while it lasts. */
const DEMAND_MIN_MS = 1000;
const DEMAND_REFRESH_MS = 10_000;
/** A turn refused for its queue wait counts as demand this long. */
const REFUSED_DEMAND_MS = 5_000;

interface Waiting {
  model: ReadyModel;
  waiting: number;
  told: number;
  at: number;
  timer?: NodeJS.Timeout;
}

export class Demand {
  /** Per model (`<namespace>/<name>`). */
  private readonly models = new Map<string, Waiting>();
  private closed = false;

  constructor(
    private readonly first: FirstTurns,
    private readonly now: () => number,
    private readonly onError?: (err: unknown) => void,
  ) {}

  /** A first turn of `model` waits for room; the key to {@link tell} and {@link leave} with. */
  wait(model: ReadyModel): string {
    const k = `${model.namespace}/${model.name}`;
    let w = this.models.get(k);
    if (!w) this.models.set(k, (w = { model, waiting: 0, told: 0, at: 0 }));
    w.waiting++;
    return k;
  }

  /**
   * A turn of `model` was refused because every instance's queue is over the wait budget: it
   * counts as waiting for {@link REFUSED_DEMAND_MS} (its client retries after its Retry-After), so
   * the pool hears of the demand its instances could not take.
   */
  refused(model: ReadyModel): void {
    const k = this.wait(model);
    this.tell(k);
    setTimeout(() => this.leave(k), REFUSED_DEMAND_MS).unref();
  }

  /** A waiting first turn is over (placed, refused or gone). */
  leave(k: string): void {
    // Still there: a record is not dropped while a turn waits.
    this.models.get(k)!.waiting--;
    this.tell(k);
  }

  /** Tells the pool what waits now, when it is due. */
  tell(k: string): void {
    const w = this.models.get(k);
    if (!w || !this.first.demand || this.closed) return;
    const t = this.now();
    if (w.waiting === w.told && (w.waiting === 0 || t - w.at < DEMAND_REFRESH_MS)) {
      if (w.waiting === 0 && !w.timer) this.models.delete(k);
      return;
    }
    if (t - w.at < DEMAND_MIN_MS) {
      w.timer ??= setTimeout(
        () => {
          w.timer = undefined;
          this.tell(k);
        },
        w.at + DEMAND_MIN_MS - t,
      );
      w.timer.unref();
      return;
    }
    w.told = w.waiting;
    w.at = t;
    if (w.waiting === 0 && !w.timer) this.models.delete(k);
    this.first.demand(w.model, w.told).catch((err: unknown) => this.onError?.(err));
  }

  close(): void {
    this.closed = true;
    for (const w of this.models.values()) clearTimeout(w.timer);
  }
}

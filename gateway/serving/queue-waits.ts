/**
 * How long one more request would wait in an instance's queue before its engine begins it, from
 * the load its bridge's beats say (shared/serving.ts `BridgeLoad`, four a second) and the turns
 * this gateway sent there since the last one (counted as each is admitted, before its publish): with every slot taken, the k-th request
 * waiting begins after about k × serviceMs / slots (the instance drains `slots / serviceMs`).
 *
 * A turn whose instance would keep it waiting longer than the budget (`MAGUS_MAX_QUEUE_WAIT`) is
 * placed on an instance of the pool that can begin it within it (a first turn; a warm one is moved
 * there), or — none can — refused at once with 429 `queue_full` and a `Retry-After` of the time
 * the shortest queue takes to come back within the budget (serving/sessions/cache.ts
 * `queueRefusal`). What this cannot see it does not bound: an instance whose bridge says no load
 * (an older bridge, or none answered yet) or was not heard within {@link LOAD_FRESH_MS}.
 */
import type { BridgeLoad } from '../../shared/serving';

/** A load heard longer ago than this says nothing (its bridge is silent: serving/exchange.ts moves its answers). */
export const LOAD_FRESH_MS = 2_000;

/**
 * Turns sent this shortly before a beat arrived are still counted after it: the beat's queue was
 * read before they reached it (the read waits up to 100 ms, then the beat travels).
 */
export const SENT_OVERLAP_MS = 150;

interface Heard {
  load: BridgeLoad;
  at: number;
  /** When this gateway sent each turn the load does not show yet. */
  sent: number[];
}

export class QueueWaits {
  /** `<pool>.<instance>` (the beat subject's tail) → its bridge's last load. */
  private readonly heard = new Map<string, Heard>();

  constructor(
    /** The longest a turn may be expected to wait in a queue; 0: no bound. */
    readonly budgetMs: number,
    private readonly now: () => number = Date.now,
  ) {}

  /** The load a beat of `<pool>.<instance>` said (undefined: it said none). */
  beat(key: string, load: BridgeLoad | undefined): void {
    if (!load) return void this.heard.delete(key);
    const at = this.now();
    // Sends after the queue was read are not in it (its age: a read the bridge waited on long is older).
    const since = at - Math.min(load.queuedAgeMs ?? 0, LOAD_FRESH_MS) - SENT_OVERLAP_MS;
    this.heard.set(key, { load, at, sent: (this.heard.get(key)?.sent ?? []).filter((t) => t > since) });
  }

  /** This gateway sends a request to the instance (counted from its decision until a beat that shows it: {@link SENT_OVERLAP_MS}). */
  published(pool: string, instance: string): void {
    const h = this.heard.get(`${pool}.${instance}`);
    if (h) h.sent.push(this.now());
  }

  /** Forgets every load (after a reconnect: what was heard before may be old). */
  forget(): void {
    this.heard.clear();
  }

  /** Loads not heard for a minute go (their instances are gone). */
  sweep(): void {
    const old = this.now() - 60_000;
    for (const [k, h] of this.heard) if (h.at < old) this.heard.delete(k);
  }

  /** Whether the instance's bridge, as last heard, pulls the requests handed back to it (shared/serving.ts `BridgeLoad.requeued`). */
  requeues(pool: string, instance: string): boolean {
    return this.heard.get(`${pool}.${instance}`)?.load.requeued === true;
  }

  /** How long one more request is expected to wait at the instance (undefined: unknown). */
  waitMs(pool: string, instance: string): number | undefined {
    const h = this.heard.get(`${pool}.${instance}`);
    if (!h || this.now() - h.at > LOAD_FRESH_MS) return undefined;
    const { running, queued, slots, serviceMs } = h.load;
    const ahead = running + queued + h.sent.length - slots; // waiting before it, once it is queued
    if (ahead < 0) return 0;
    if (serviceMs === null) return undefined;
    return ((ahead + 1) * serviceMs) / slots;
  }

  /** How full the instance is: its requests in flight and queued (with those sent since) per slot; undefined: unknown. */
  occupancy(pool: string, instance: string): number | undefined {
    const h = this.heard.get(`${pool}.${instance}`);
    if (!h || this.now() - h.at > LOAD_FRESH_MS) return undefined;
    const { running, queued, slots } = h.load;
    return (running + queued + h.sent.length) / Math.max(1, slots);
  }

  /** Whether a request at the instance is expected to wait longer than the budget. */
  overBudget(pool: string, instance: string): boolean {
    if (this.budgetMs <= 0) return false;
    const w = this.waitMs(pool, instance);
    return w !== undefined && w > this.budgetMs;
  }

  /** {@link retryAfterMs} in seconds for the soonest of `instances`, or `fallbackSec` when none is known. */
  retryAfterSec(pool: string, instances: readonly string[], fallbackSec: number): number {
    const known = instances.map((i) => this.retryAfterMs(pool, i)).filter((ms): ms is number => ms !== undefined);
    return known.length > 0 ? Math.ceil(Math.min(...known) / 1000) : fallbackSec;
  }

  /**
   * When a request refused at the instance may come back: once its queue is within the budget
   * again (at least a second; undefined: unknown, or within it now).
   */
  retryAfterMs(pool: string, instance: string): number | undefined {
    const w = this.waitMs(pool, instance);
    if (w === undefined) return undefined;
    const over = w - this.budgetMs;
    return over > 0 ? Math.max(1_000, Math.ceil(over)) : undefined;
  }
}

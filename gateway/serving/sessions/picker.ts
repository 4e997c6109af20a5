/**
 * Which published instance a conversation goes to: the one with the most room, counting every
 * replica's entries (the mirror) and this replica's picks whose entries are not written yet
 * (reservations), so concurrent first turns of this replica spread before the watch shows them.
 * Every {@link InstancePicker.reserve} is matched by one {@link InstancePicker.release} once its
 * entry is written, or not.
 */
import type { ReadyModel } from '../../../shared/model';
import { instanceKey, type SessionMirror } from './mirror';
import type { PoolViews } from './pool-views';
import type { SessionCounters } from './stats';
import type { PublishedInstance, QueueWaitsView } from './types';

/** Picks remembered beside a pool's published counts, at most this long (views are rewritten at least every minute). */
const PICKS_KEPT_MS = 2 * 60_000;

export class InstancePicker {
  /** This gateway's picks whose entries are not written yet, per instance ({@link instanceKey}). */
  private readonly reserved = new Map<string, number>();
  /** When this gateway picked each instance lately ({@link instanceKey}): counted beside a view's counts until a newer view. */
  private readonly picked = new Map<string, number[]>();

  constructor(
    private readonly mirror: SessionMirror,
    private readonly views: PoolViews,
    private readonly counters: SessionCounters,
    private readonly waits?: QueueWaitsView,
    /** Whether the instance's bridge went silent (serving/beats.ts): it serves nothing now, whatever its counts say. */
    private readonly silent?: (pool: string, instance: string) => boolean,
    /** Whether the instance's bridge said it stops (serving/beats.ts): it finishes what it holds, and is going. */
    private readonly stopping?: (pool: string, instance: string) => boolean,
  ) {}

  /**
   * The pool's instance with the most room. When all are full: none (the pool may start another),
   * unless the pool cannot grow or the request takes no lease (`anyLoad`: `route`) — then the
   * least-loaded one. An instance whose bridge went silent (its pod or process lost, not yet
   * replaced in the view) comes after every other: a turn or a moved answer sent there would wait
   * for a bridge that may never come. One whose bridge says it stops (its pod deleted, its
   * instance drained, not yet out of the view) comes before those and after every other: what is
   * sent there is served only if its pod is let live that long. Then one whose queue is over the wait budget
   * (not with `queuesAside`: a moved answer, which its bridge takes before its queue);
   * `byLoad` ranks instances by how full their bridges say they are (in flight and queued per
   * slot; unknown last) next (`another`, an answer with nothing said), then
   * `busier` (`another`: the answers moved to each just now, so that those of
   * one lost instance spread over the others), then their leases. A pool that scales on load
   * (its view's `scalesOn`) has no lease limit: its instances rank by how full their bridges say
   * they are (in flight and queued per slot), then by leases; it grows on that load itself.
   */
  pick(
    model: ReadyModel,
    opts: { anyLoad?: boolean; avoid?: string; busier?: (instance: string) => number; queuesAside?: boolean; byLoad?: boolean } = {},
  ): PublishedInstance | undefined {
    const entry = this.views.viewOf(model.namespace, model.name);
    if (!entry) return undefined;
    const onLoad = entry.scalesOn === 'load';
    const limit = opts.anyLoad || onLoad || entry.growable === false ? Infinity : entry.leasesPerInstance;
    let best: PublishedInstance | undefined;
    let bestRank: number[] | undefined;
    for (const i of entry.instances) {
      if (i.instance === opts.avoid) continue;
      const n = this.leasesOf(model.namespace, model.name, i, entry.updatedAt) + (this.reserved.get(instanceKey(model.namespace, model.name, i.instance)) ?? 0);
      if (n >= limit) continue;
      // One whose bridge is silent last, one that stops before it, then one whose queue would keep a request waiting past the budget, then `busier` (answers moved there just now), then (on load) how full it is, then leases.
      const silent = this.silent?.(model.name, i.instance) === true ? 2 : this.stopping?.(model.name, i.instance) === true ? 1 : 0;
      const crowded = !opts.queuesAside && this.waits?.overBudget(model.name, i.instance) === true ? 1 : 0;
      const occupancy = onLoad || opts.byLoad ? this.waits?.occupancy(model.name, i.instance) : undefined;
      const full = onLoad ? (occupancy ?? 0) : 0;
      const load = opts.byLoad ? (occupancy ?? Infinity) : 0;
      const rank = [silent, crowded, load, opts.busier?.(i.instance) ?? 0, full, n];
      if (!bestRank || before(rank, bestRank)) {
        best = i;
        bestRank = rank;
      }
    }
    if (best && this.views.stale(entry)) this.counters.staleViewPicks++;
    return best;
  }

  /**
   * Live conversations on an instance: every replica's as the mirror counts them, or — a mirror of
   * recent conversations counts none — as the pool's view says (its reconciler's count when the
   * view was written) plus this gateway's picks since.
   */
  leasesOn(namespace: string, pool: string, instance: string): number {
    const entry = this.views.viewOf(namespace, pool);
    const i = entry?.instances.find((x) => x.instance === instance);
    return i ? this.leasesOf(namespace, pool, i, entry!.updatedAt) : this.mirror.counts ? this.mirror.leasesOn(namespace, pool, instance) : 0;
  }

  private leasesOf(namespace: string, pool: string, i: PublishedInstance, viewAt: number): number {
    if (this.mirror.counts) return this.mirror.leasesOn(namespace, pool, i.instance);
    const k = instanceKey(namespace, pool, i.instance);
    const since = (this.picked.get(k) ?? []).filter((t) => t > viewAt);
    return i.leases + since.length;
  }

  /** Counts `i` as taken by a placement of this replica until it is released. */
  reserve(model: ReadyModel, i: PublishedInstance): PublishedInstance {
    const k = instanceKey(model.namespace, model.name, i.instance);
    this.reserved.set(k, (this.reserved.get(k) ?? 0) + 1);
    if (!this.mirror.counts) {
      const now = Date.now();
      this.picked.set(k, [...(this.picked.get(k) ?? []).filter((t) => now - t < PICKS_KEPT_MS), now]);
    }
    return i;
  }

  /** Forgets picks older than any view they could be counted beside. */
  sweep(now: number): void {
    for (const [k, times] of this.picked) {
      const kept = times.filter((t) => now - t < PICKS_KEPT_MS);
      if (kept.length > 0) this.picked.set(k, kept);
      else this.picked.delete(k);
    }
  }

  release(model: ReadyModel, instance: string): void {
    const k = instanceKey(model.namespace, model.name, instance);
    const n = (this.reserved.get(k) ?? 1) - 1;
    if (n > 0) this.reserved.set(k, n);
    else this.reserved.delete(k);
  }
}

/** Whether rank `a` comes before `b` (compared element by element). */
function before(a: readonly number[], b: readonly number[]): boolean {
  for (let k = 0; k < a.length; k++) if (a[k] !== b[k]) return a[k]! < b[k]!;
  return false;
}

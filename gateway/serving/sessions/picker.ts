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

export class InstancePicker {
  /** This gateway's picks whose entries are not written yet, per instance ({@link instanceKey}). */
  private readonly reserved = new Map<string, number>();

  constructor(
    private readonly mirror: SessionMirror,
    private readonly views: PoolViews,
    private readonly counters: SessionCounters,
    private readonly waits?: QueueWaitsView,
  ) {}

  /**
   * The pool's instance with the most room. When all are full: none (the pool may start another),
   * unless the pool cannot grow or the request takes no lease (`anyLoad`: `route`) — then the
   * least-loaded one. An instance whose queue is over the wait budget comes after every other; `busier` ranks instances before their leases do (`another`: the answers
   * moved to each just now, so that those of one lost instance spread over the others).
   */
  pick(model: ReadyModel, opts: { anyLoad?: boolean; avoid?: string; busier?: (instance: string) => number } = {}): PublishedInstance | undefined {
    const entry = this.views.viewOf(model.namespace, model.name);
    if (!entry) return undefined;
    const limit = opts.anyLoad || entry.growable === false ? Infinity : entry.leasesPerInstance;
    let best: PublishedInstance | undefined;
    let bestLoad = Infinity;
    for (const i of entry.instances) {
      if (i.instance === opts.avoid) continue;
      const n = this.mirror.leasesOn(model.namespace, model.name, i.instance) + (this.reserved.get(instanceKey(model.namespace, model.name, i.instance)) ?? 0);
      // One whose queue would keep a request waiting past the budget last, then `busier` (answers moved there just now), then leases.
      const crowded = this.waits?.overBudget(model.name, i.instance) === true;
      const load = (crowded ? 1e12 : 0) + (opts.busier?.(i.instance) ?? 0) * 1e6 + n;
      if (n < limit && load < bestLoad) {
        best = i;
        bestLoad = load;
      }
    }
    if (best && this.views.stale(entry)) this.counters.staleViewPicks++;
    return best;
  }

  /** Counts `i` as taken by a placement of this replica until it is released. */
  reserve(model: ReadyModel, i: PublishedInstance): PublishedInstance {
    const k = instanceKey(model.namespace, model.name, i.instance);
    this.reserved.set(k, (this.reserved.get(k) ?? 0) + 1);
    return i;
  }

  release(model: ReadyModel, instance: string): void {
    const k = instanceKey(model.namespace, model.name, instance);
    const n = (this.reserved.get(k) ?? 1) - 1;
    if (n > 0) this.reserved.set(k, n);
    else this.reserved.delete(k);
  }
}

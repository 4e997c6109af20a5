/**
 * The requests handed back to an instance with nothing said (its `requeued` lane, names.ts
 * `LANES`), held by its bridge and handed to its engine earliest deadline first, `slots` at a
 * time as before. The lane is first come, first served by hand-back time: pulled `slots` at a
 * time, a request handed back again (a drain, then a roll) went behind every request handed back
 * there before it, younger ones included, each time — under bench:chaos one that had moved three
 * times waited 152 s in its third instance's lane until its deadline. Held here (up to the lane
 * consumer's `max_ack_pending`, dataplane/consumers.ts `REQUEUED_HELD`), the oldest goes first;
 * the engine is handed no more of the lane at once than before (session 67 handed it all of them,
 * and the instances' own queues paid). "Oldest" is its place (shared/serving.ts `queueDueOf`), which
 * an answer keeps across its moves: a resume gave the request it moved on a later deadline, and
 * ordered by that one a turn handed back again went behind each lane it came to — under
 * bench:chaos one moved nine times and began 714 s after it was asked.
 */
import type { JsMsg } from 'nats';
import { queueDueOf } from '../../shared/serving';

/**
 * A request's place in a queue (epoch ms) as its message says it: its `due`, else its deadline
 * (shared/serving.ts `queueDueOf`); -Infinity when it says neither (it goes first, to be refused at once).
 */
export function dueOf(data: Uint8Array): number {
  const finite = (v: unknown): number | undefined => (typeof v === 'number' && Number.isFinite(v) ? v : undefined);
  try {
    const r = JSON.parse(new TextDecoder().decode(data)) as { due?: unknown; deadline?: unknown } | null;
    return queueDueOf({ due: finite(r?.due), deadline: finite(r?.deadline) ?? -Infinity });
  } catch {
    return -Infinity;
  }
}

/** Deliveries held until a slot is free, kept from redelivery meanwhile (`working()`). */
export class HeldRequests {
  private readonly held: { m: JsMsg; due: number }[] = [];
  private readonly ticker: NodeJS.Timeout;

  /** `workingEveryMs`: how often each held delivery says it is being worked on (well inside `ack_wait`). */
  constructor(workingEveryMs: number) {
    this.ticker = setInterval(() => {
      for (const { m } of this.held) {
        try {
          m.working();
        } catch {
          // closed connection: JetStream redelivers it to the next bridge
        }
      }
    }, workingEveryMs);
    this.ticker.unref();
  }

  get size(): number {
    return this.held.length;
  }

  /**
   * Holds `m`; a delivery of a message it holds already (a new consumer leader, which knew nothing
   * of the first, delivers it again) replaces it: that one is the delivery the consumer waits on,
   * and the request is served once.
   */
  hold(m: JsMsg): void {
    const same = this.held.find((h) => h.m.seq === m.seq);
    if (same) same.m = m;
    else this.held.push({ m, due: dueOf(m.data) });
  }

  /** The held delivery whose deadline comes first (of equal ones, the first in the stream), no longer held. */
  next(): JsMsg | undefined {
    let best = -1;
    for (let i = 0; i < this.held.length; i += 1) {
      const h = this.held[i]!;
      const b = this.held[best];
      if (!b || h.due < b.due || (h.due === b.due && h.m.seq < b.m.seq)) best = i;
    }
    return best < 0 ? undefined : this.held.splice(best, 1)[0]!.m;
  }

  /** Every held delivery, no longer held (earliest deadline first). */
  takeAll(): JsMsg[] {
    const all: JsMsg[] = [];
    for (let m = this.next(); m; m = this.next()) all.push(m);
    return all;
  }

  /** Stops keeping them alive. */
  close(): void {
    clearInterval(this.ticker);
  }
}

import { bridgeLoadOf } from '../../shared/serving';
import { LOAD_FRESH_MS, QueueWaits, SENT_OVERLAP_MS } from './queue-waits';

const load = (running: number, queued: number, serviceMs: number | null, slots = 2) => ({ running, slots, queued, serviceMs });

describe('QueueWaits', () => {
  let t = 0;
  const now = () => t;
  beforeEach(() => (t = 1_000_000));

  it('is 0 while a slot is free, then (waiting ahead + 1) × service / slots', () => {
    const w = new QueueWaits(5_000, now);
    w.beat('p.i1', load(1, 0, 4_000));
    expect(w.waitMs('p', 'i1')).toBe(0);
    w.beat('p.i1', load(2, 0, 4_000));
    expect(w.waitMs('p', 'i1')).toBe(2_000); // first in line: one of two slots frees in 2 s on average
    w.beat('p.i1', load(2, 3, 4_000));
    expect(w.waitMs('p', 'i1')).toBe(8_000);
    expect(w.overBudget('p', 'i1')).toBe(true);
    expect(w.retryAfterMs('p', 'i1')).toBe(3_000);
    expect(w.retryAfterSec('p', ['i1'], 5)).toBe(3);
  });

  it('says how full an instance is: in flight, queued and sent since, per slot; nothing once its load is old', () => {
    const w = new QueueWaits(5_000, now);
    expect(w.occupancy('p', 'i1')).toBeUndefined();
    w.beat('p.i1', load(1, 0, null, 4));
    expect(w.occupancy('p', 'i1')).toBe(0.25);
    w.published('p', 'i1');
    w.beat('p.i1', load(4, 2, null, 4)); // the send is still counted (SENT_OVERLAP_MS)
    expect(w.occupancy('p', 'i1')).toBe(1.75);
    t += LOAD_FRESH_MS + 1;
    expect(w.occupancy('p', 'i1')).toBeUndefined();
  });

  it("counts this gateway's sends until a beat read after them", () => {
    const w = new QueueWaits(5_000, now);
    w.beat('p.i1', load(2, 0, 1_000));
    expect(w.waitMs('p', 'i1')).toBe(500);
    for (let n = 0; n < 4; n++) w.published('p', 'i1');
    expect(w.waitMs('p', 'i1')).toBe(2_500);
    // A beat right after: its queue was read before they arrived, so they still count.
    t += SENT_OVERLAP_MS - 50;
    w.beat('p.i1', load(2, 4, 1_000));
    expect(w.waitMs('p', 'i1')).toBe(4_500);
    // The next beat (250 ms on) shows them: counted once.
    t += 250;
    w.beat('p.i1', load(2, 4, 1_000));
    expect(w.waitMs('p', 'i1')).toBe(2_500);
    // A beat whose queue was read a second before it (a slow read): what was sent since still counts.
    w.published('p', 'i1');
    t += 600;
    w.beat('p.i1', { ...load(2, 4, 1_000), queuedAgeMs: 1_000 });
    expect(w.waitMs('p', 'i1')).toBe(3_000);
  });

  it('knows nothing of an instance unheard, silent, empty-beating or without a service time', () => {
    const w = new QueueWaits(5_000, now);
    expect(w.waitMs('p', 'i1')).toBeUndefined();
    w.beat('p.i1', load(2, 50, null));
    expect(w.waitMs('p', 'i1')).toBeUndefined();
    expect(w.overBudget('p', 'i1')).toBe(false);
    w.beat('p.i1', load(2, 50, 1_000));
    expect(w.overBudget('p', 'i1')).toBe(true);
    t += LOAD_FRESH_MS + 1;
    expect(w.overBudget('p', 'i1')).toBe(false);
    w.beat('p.i1', load(2, 50, 1_000));
    w.beat('p.i1', undefined); // a bridge from before loads
    expect(w.waitMs('p', 'i1')).toBeUndefined();
    expect(w.retryAfterSec('p', ['i1'], 7)).toBe(7);
  });

  it('bounds nothing with a budget of 0, yet says when a full queue drains', () => {
    const w = new QueueWaits(0, now);
    w.beat('p.i1', load(2, 9, 1_000));
    expect(w.overBudget('p', 'i1')).toBe(false);
    expect(w.retryAfterMs('p', 'i1')).toBe(5_000);
  });

  it('retries after at least a second, at the soonest instance', () => {
    const w = new QueueWaits(5_000, now);
    w.beat('p.a', load(2, 9, 1_100)); // 5.5 s
    w.beat('p.b', load(2, 19, 1_000)); // 10 s
    expect(w.retryAfterMs('p', 'a')).toBe(1_000);
    expect(w.retryAfterSec('p', ['a', 'b'], 9)).toBe(1);
    expect(w.retryAfterSec('p', ['b'], 9)).toBe(5);
  });
});

describe('QueueWaits.requeues', () => {
  it("is what the instance's bridge last said: a bridge from before says nothing, an instance never heard is false", () => {
    const w = new QueueWaits(5_000);
    expect(w.requeues('p', 'i1')).toBe(false);
    w.beat('p.i1', { ...load(1, 0, 250), requeued: true });
    w.beat('p.i2', load(1, 0, 250));
    expect([w.requeues('p', 'i1'), w.requeues('p', 'i2')]).toEqual([true, false]);
    w.beat('p.i1', load(1, 0, 250)); // its bridge replaced by an older one
    expect(w.requeues('p', 'i1')).toBe(false);
  });
});

describe('bridgeLoadOf', () => {
  it('reads a beat, and refuses what it cannot trust', () => {
    expect(bridgeLoadOf(JSON.stringify(load(1, 0, 250)))).toEqual(load(1, 0, 250));
    expect(bridgeLoadOf(new TextEncoder().encode(JSON.stringify(load(0, 0, null))))).toEqual(load(0, 0, null));
    // Whether it pulls the requests handed back: only `true` says so.
    expect(bridgeLoadOf(JSON.stringify({ ...load(1, 0, 250), requeued: true }))).toEqual({ ...load(1, 0, 250), requeued: true });
    expect(bridgeLoadOf(JSON.stringify({ ...load(1, 0, 250), requeued: 'yes' }))).toEqual(load(1, 0, 250));
    // Whether it stops (shared/continuation.ts STOPPING_SILENT_MS): only `true` says so.
    expect(bridgeLoadOf(JSON.stringify({ ...load(1, 0, 250), stopping: true }))).toEqual({ ...load(1, 0, 250), stopping: true });
    expect(bridgeLoadOf(JSON.stringify({ ...load(1, 0, 250), stopping: 1 }))).toEqual(load(1, 0, 250));
    // Which start of the bridge beats (gateway/serving/beats.ts): an id, or nothing.
    expect(bridgeLoadOf(JSON.stringify({ ...load(1, 0, 250), boot: 'a1_B-2' }))).toEqual({ ...load(1, 0, 250), boot: 'a1_B-2' });
    expect(bridgeLoadOf(JSON.stringify({ ...load(1, 0, 250), boot: 'x.y' }))).toEqual(load(1, 0, 250));
    expect(bridgeLoadOf(JSON.stringify({ ...load(1, 0, 250), boot: 'b'.repeat(65) }))).toEqual(load(1, 0, 250));
    for (const bad of [
      '',
      'x',
      '[]',
      'null',
      JSON.stringify({ ...load(1, 0, 1), slots: 0 }),
      JSON.stringify({ ...load(1, 0, 1), queued: -1 }),
      JSON.stringify({ ...load(1, 0, 1), serviceMs: 'x' }),
    ])
      expect(bridgeLoadOf(bad)).toBeUndefined();
  });
});

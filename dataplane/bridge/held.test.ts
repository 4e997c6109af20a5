import type { JsMsg } from 'nats';
import { dueOf, HeldRequests } from './held';

const bytes = (s: string) => new TextEncoder().encode(s);

describe('dueOf: the place a held request is ordered by', () => {
  it("is the request's deadline when it says no place of its own", () => {
    expect(dueOf(bytes(JSON.stringify({ id: 'r', deadline: 1_796_550_000_000 })))).toBe(1_796_550_000_000);
  });

  it("is the request's due when it says one (a continuation keeps its first request's place), its deadline when that is no finite number", () => {
    expect(dueOf(bytes(JSON.stringify({ id: 'r', deadline: 1_796_550_300_000, due: 1_796_550_000_000 })))).toBe(1_796_550_000_000);
    expect(dueOf(bytes(JSON.stringify({ id: 'r', deadline: 1_796_550_300_000, due: 'soon' })))).toBe(1_796_550_300_000);
    expect(dueOf(bytes(JSON.stringify({ id: 'r', deadline: 1_796_550_300_000, due: null })))).toBe(1_796_550_300_000);
  });

  it('is -Infinity for a request that says none, or none that is a finite number, or is not JSON: it goes first, to be refused at once', () => {
    for (const data of ['{"id":"r"}', '{"deadline":"soon"}', '{"deadline":null}', '{"due":"soon"}', 'null', '[1', ''])
      expect(dueOf(bytes(data))).toBe(-Infinity);
  });
});

describe('HeldRequests', () => {
  /** A delivery as the bridge sees it: its stream seq, its data, and what `working()` was called. */
  const delivery = (seq: number, deadline: number) => {
    const m = { seq, data: bytes(JSON.stringify({ id: `r${seq}`, deadline })), worked: 0, working: () => (m.worked += 1) };
    return m;
  };
  it('gives the earliest deadline first, of equal ones the first in the stream; a delivery of one it holds replaces it', () => {
    jest.useFakeTimers();
    const held = new HeldRequests(20);
    const [a, b, c, d] = [delivery(1, 3_000), delivery(2, 1_000), delivery(3, 2_000), delivery(4, 1_000)];
    for (const m of [a, b, c, d]) held.hold(m as unknown as JsMsg);
    const again = delivery(3, 2_000);
    held.hold(again as unknown as JsMsg);
    expect(held.size).toBe(4);
    jest.advanceTimersByTime(70);
    // Each kept from redelivery meanwhile, every 20 ms (the replaced delivery no more).
    expect([a, b, again, d].map((m) => m.worked)).toEqual([3, 3, 3, 3]);
    expect(c.worked).toBe(0);
    expect(held.next()).toBe(b);
    expect(held.takeAll()).toEqual([d, again, a]);
    expect(held.next()).toBeUndefined();
    held.close();
    jest.useRealTimers();
  });
});

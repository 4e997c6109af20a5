import { QUEUE_FULL_ERROR, SlotPool } from './slots';

const settled = async <T>(p: Promise<T>): Promise<{ value?: T; error?: unknown } | 'pending'> => {
  const tick = new Promise<'pending'>((r) => setImmediate(() => r('pending')));
  return Promise.race([
    p.then(
      (value) => ({ value }),
      (error: unknown) => ({ error }),
    ),
    tick,
  ]);
};

describe('SlotPool', () => {
  test('hands out free slots, then queues in FIFO order, then refuses', async () => {
    const pool = new SlotPool(2, 2);
    expect(await pool.acquire()).toBe(0);
    expect(await pool.acquire()).toBe(1);
    const third = pool.acquire();
    const fourth = pool.acquire();
    expect(pool.queued).toBe(2);
    await expect(pool.acquire()).rejects.toMatchObject({ name: QUEUE_FULL_ERROR });
    pool.release(1);
    expect(await third).toBe(1);
    expect(await settled(fourth)).toBe('pending');
    pool.release(0);
    expect(await fourth).toBe(0);
    expect(pool.busy).toBe(2);
    pool.release(0);
    pool.release(1);
    expect(pool.busy).toBe(0);
  });

  test('an urgent request (a resumed answer) goes before every waiter that is not, past the queue bound and past cache affinity', async () => {
    const pool = new SlotPool(1, 2);
    await pool.acquire();
    const plain1 = pool.acquire();
    const plain2 = pool.acquire({ score: () => 100 }); // owns the slot's cache: would be preferred
    await expect(pool.acquire()).rejects.toMatchObject({ name: QUEUE_FULL_ERROR });
    const urgent1 = pool.acquire({ urgent: true });
    const urgent2 = pool.acquire({ urgent: true });
    expect(pool.queued).toBe(4);
    const order: string[] = [];
    for (const [name, p] of Object.entries({ plain1, plain2, urgent1, urgent2 })) void p.then(() => order.push(name));
    for (let i = 0; i < 4; i++) {
      pool.release(0);
      await new Promise((r) => setImmediate(r));
    }
    expect(order).toEqual(['urgent1', 'urgent2', 'plain2', 'plain1']);
  });

  test('a request that goes first (handed back by another instance) goes after the urgent and before the rest, past the queue bound and past cache affinity', async () => {
    const pool = new SlotPool(1, 2);
    await pool.acquire();
    const plain1 = pool.acquire();
    const plain2 = pool.acquire({ score: () => 100 }); // owns the slot's cache: would be preferred
    await expect(pool.acquire()).rejects.toMatchObject({ name: QUEUE_FULL_ERROR });
    const first1 = pool.acquire({ first: true });
    const urgent = pool.acquire({ urgent: true });
    const first2 = pool.acquire({ first: true });
    expect(pool.queued).toBe(5);
    const order: string[] = [];
    for (const [name, p] of Object.entries({ plain1, plain2, first1, urgent, first2 })) void p.then(() => order.push(name));
    for (let i = 0; i < 5; i++) {
      pool.release(0);
      await new Promise((r) => setImmediate(r));
    }
    expect(order).toEqual(['urgent', 'first1', 'first2', 'plain2', 'plain1']);
  });

  test('the queue bound counts only the requests it may refuse: the urgent and those that go first, however many, do not turn the rest away', async () => {
    const pool = new SlotPool(1, 2);
    await pool.acquire();
    const ahead = Array.from({ length: 10 }, (_, i) => pool.acquire(i % 5 === 0 ? { urgent: true } : { first: true, due: 100 + i }));
    const plain1 = pool.acquire();
    const plain2 = pool.acquire();
    expect(pool.queued).toBe(12);
    await expect(pool.acquire()).rejects.toMatchObject({
      name: QUEUE_FULL_ERROR,
      message: 'all 1 slots are busy and 2 requests are queued (and 10 ahead of them)',
    });
    for (let i = 0; i < 12; i++) {
      pool.release(0);
      await new Promise((r) => setImmediate(r));
    }
    for (const p of [...ahead, plain1, plain2]) expect(await settled(p)).toEqual({ value: 0 });
  });

  test('requests that go first with a deadline stand among the rest by it: the earliest deadline first, the urgent still ahead, and without deadlines as before', async () => {
    const pool = new SlotPool(1, 3);
    await pool.acquire();
    const plain1 = pool.acquire({ due: 100 });
    const plain2 = pool.acquire({ due: 200 });
    const plain3 = pool.acquire({ due: 300 });
    const first1 = pool.acquire({ first: true, due: 150 });
    const first2 = pool.acquire({ first: true, due: 50 });
    const first3 = pool.acquire({ first: true, due: 150 }); // as due as first1: after it
    const firstUndue = pool.acquire({ first: true }); // no deadline (an older bridge): before every waiter that does not go first, as before deadlines
    const urgent = pool.acquire({ urgent: true, due: 999 });
    expect(pool.queued).toBe(8);
    const order: string[] = [];
    for (const [name, p] of Object.entries({ plain1, plain2, plain3, first1, first2, first3, firstUndue, urgent })) void p.then(() => order.push(name));
    for (let i = 0; i < 8; i++) {
      pool.release(0);
      await new Promise((r) => setImmediate(r));
    }
    expect(order).toEqual(['urgent', 'first2', 'firstUndue', 'plain1', 'first1', 'first3', 'plain2', 'plain3']);
  });

  test('reserved slots serve urgent requests alone: at once while one is free, then back to the urgent first', async () => {
    const pool = new SlotPool(1, 4, undefined, 1);
    expect(await pool.acquire()).toBe(0);
    const plain = pool.acquire();
    expect(await settled(plain)).toBe('pending'); // the reserved slot is not for it
    expect(await pool.acquire({ urgent: true })).toBe(1);
    expect(pool.busy).toBe(2);
    const urgent = pool.acquire({ urgent: true });
    pool.release(1); // the reserved slot goes to the waiting urgent request
    expect(await urgent).toBe(1);
    expect(await settled(plain)).toBe('pending');
    pool.release(1); // nobody urgent waits: free again, still not for the plain one
    expect(await settled(plain)).toBe('pending');
    pool.release(0);
    expect(await plain).toBe(0);
    expect(await pool.acquire({ urgent: true })).toBe(1);
    expect(() => new SlotPool(Infinity, 0, undefined, 1)).toThrow(RangeError);
  });

  test('the reserve is given back by the next slot released, not only when the urgent answer in it ends', async () => {
    const pool = new SlotPool(2, 4, undefined, 1);
    expect([await pool.acquire(), await pool.acquire()]).toEqual([0, 1]);
    const held = await pool.acquire({ urgent: true }); // the reserve, taken
    expect(held).toBe(2);
    const plain = pool.acquire();
    pool.release(0); // three were busy: kept free, the reserve again
    expect(await settled(plain)).toBe('pending');
    expect(pool.busy).toBe(2);
    expect(await pool.acquire({ urgent: true })).toBe(0); // a second resumed answer starts at once
    pool.release(held);
    expect(await settled(plain)).toBe('pending'); // still the reserve
    pool.release(1);
    expect(await plain).toBe(1);
    expect(pool.busy).toBe(2);
    await expect(settled(pool.acquire())).resolves.toBe('pending'); // two busy of two: queued, the third free slot kept
  });

  test('a queued request that aborts leaves the queue; the next one gets the slot', async () => {
    const pool = new SlotPool(1, 5);
    await pool.acquire();
    const ac = new AbortController();
    const gaveUp = pool.acquire({ signal: ac.signal });
    const next = pool.acquire();
    ac.abort();
    await expect(gaveUp).rejects.toMatchObject({ name: 'AbortError' });
    expect(pool.queued).toBe(1);
    pool.release(0);
    expect(await next).toBe(0);
  });

  test('rejectWaiting turns queued requests away and leaves busy slots alone', async () => {
    const pool = new SlotPool(1, 5);
    await pool.acquire();
    const waiting = pool.acquire();
    pool.rejectWaiting(new Error('stopping'));
    await expect(waiting).rejects.toThrow('stopping');
    expect(pool.busy).toBe(1);
  });

  test('prefers the free slot with the best score; queue 0 refuses at once', async () => {
    const pool = new SlotPool(3, 0);
    const all = [await pool.acquire(), await pool.acquire(), await pool.acquire()];
    all.forEach((s) => pool.release(s));
    expect(await pool.acquire({ score: (s) => (s === 2 ? 5 : s === 1 ? 3 : 0) })).toBe(2);
    expect(await pool.acquire({ score: () => 0 })).toBe(0);
    expect(await pool.acquire()).toBe(1);
    await expect(pool.acquire()).rejects.toMatchObject({ name: QUEUE_FULL_ERROR });
  });

  test('a released slot goes to the waiter that owns its cache, else to the first in line', async () => {
    const pool = new SlotPool(2, 5);
    const owner = (slot: number) => (s: number) => (s === slot ? 10 : 0);
    expect(await pool.acquire()).toBe(0);
    expect(await pool.acquire()).toBe(1);
    const first = pool.acquire({ score: owner(1) });
    const ownsZero = pool.acquire({ score: owner(0) });
    const nobody = pool.acquire();
    pool.release(0);
    expect(await ownsZero).toBe(0);
    expect(await settled(first)).toBe('pending');
    // No waiter owns slot 0's cache now: arrival order.
    pool.release(0);
    expect(await first).toBe(0);
    expect(await settled(nobody)).toBe('pending');
    pool.release(1);
    expect(await nobody).toBe(1);
    expect(pool.queued).toBe(0);
  });

  test('the best score wins among the waiters; a tie goes to the earliest', async () => {
    const pool = new SlotPool(1, 5);
    await pool.acquire();
    const some = pool.acquire({ score: () => 2 });
    const most = pool.acquire({ score: () => 7 });
    const tied = pool.acquire({ score: () => 7 });
    pool.release(0);
    expect(await most).toBe(0);
    pool.release(0);
    expect(await tied).toBe(0);
    pool.release(0);
    expect(await some).toBe(0);
  });

  test('a waiter passed over maxSkips times is served next, whoever owns the slot', async () => {
    const pool = new SlotPool(1, 10, 2);
    await pool.acquire();
    const starving = pool.acquire();
    const owners = [pool.acquire({ score: () => 1 }), pool.acquire({ score: () => 1 }), pool.acquire({ score: () => 1 })];
    pool.release(0);
    expect(await owners[0]).toBe(0);
    pool.release(0);
    expect(await owners[1]).toBe(0);
    // Passed over twice: its turn, although the last owner still waits.
    pool.release(0);
    expect(await starving).toBe(0);
    expect(await settled(owners[2]!)).toBe('pending');
    pool.release(0);
    expect(await owners[2]).toBe(0);
  });

  test('a waiter that aborts after being passed over leaves; the bound holds for the next first waiter', async () => {
    const pool = new SlotPool(1, 10, 1);
    await pool.acquire();
    const ac = new AbortController();
    const leaving = pool.acquire({ signal: ac.signal });
    const second = pool.acquire();
    const owners = [pool.acquire({ score: () => 3 }), pool.acquire({ score: () => 3 })];
    pool.release(0);
    expect(await owners[0]).toBe(0);
    ac.abort();
    await expect(leaving).rejects.toMatchObject({ name: 'AbortError' });
    // `second` was passed over once too: the bound of 1 makes it next.
    pool.release(0);
    expect(await second).toBe(0);
    pool.release(0);
    expect(await owners[1]).toBe(0);
  });

  test('unlimited slots never queue', async () => {
    const pool = new SlotPool(Infinity, 0);
    const slots = await Promise.all(Array.from({ length: 1000 }, () => pool.acquire()));
    expect(new Set(slots).size).toBe(1000);
    expect(pool.busy).toBe(1000);
  });
});

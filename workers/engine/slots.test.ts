import { QUEUE_FULL_ERROR, SlotPool } from './slots';

const settled = async <T>(p: Promise<T>): Promise<{ value?: T; error?: unknown } | 'pending'> => {
  const tick = new Promise<'pending'>((r) => setImmediate(() => r('pending')));
  return Promise.race([p.then((value) => ({ value }), (error: unknown) => ({ error })), tick]);
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

  test('unlimited slots never queue', async () => {
    const pool = new SlotPool(Infinity, 0);
    const slots = await Promise.all(Array.from({ length: 1000 }, () => pool.acquire()));
    expect(new Set(slots).size).toBe(1000);
    expect(pool.busy).toBe(1000);
  });
});

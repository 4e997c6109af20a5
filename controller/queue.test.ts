import { WorkQueue } from './queue';

const tick = () => new Promise((r) => setTimeout(r, 5));

test('a key queued many times while waiting is handled once; a change while it runs queues it once more', async () => {
  const handled: string[] = [];
  let release: () => void = () => undefined;
  const q = new WorkQueue(
    async (key) => {
      handled.push(key);
      if (handled.length === 1) await new Promise<void>((r) => (release = r));
    },
    { concurrency: 1 },
  );
  q.add('a');
  await tick();
  for (let i = 0; i < 5; i++) q.add('a'); // while running: one more run afterwards
  q.add('b');
  q.add('b');
  release();
  await q.drained();
  expect(handled).toEqual(['a', 'b', 'a']);
});

test('never runs one key twice at once, and respects the concurrency', async () => {
  let running = 0;
  let peak = 0;
  const busy = new Set<string>();
  let overlaps = 0;
  const q = new WorkQueue(
    async (key) => {
      if (busy.has(key)) overlaps++;
      busy.add(key);
      running++;
      peak = Math.max(peak, running);
      await tick();
      running--;
      busy.delete(key);
    },
    { concurrency: 3 },
  );
  for (let i = 0; i < 20; i++) q.add(`k${i % 10}`);
  await q.drained();
  expect(peak).toBe(3);
  expect(overlaps).toBe(0);
  // k0..k2 were running when added again, so they run once more; the rest were still queued.
  expect(q.stats.handled).toBe(13);
});

test('a failing key backs off exponentially instead of looping', async () => {
  const at: number[] = [];
  const errors: number[] = [];
  const q = new WorkQueue(
    () => {
      at.push(Date.now());
      return Promise.reject(new Error('broken'));
    },
    { concurrency: 1, baseDelayMs: 20, maxDelayMs: 80, onError: (_k, _e, attempt) => errors.push(attempt) },
  );
  q.add('x');
  await new Promise((r) => setTimeout(r, 400));
  q.stop();
  // 0, ~20, ~40, ~80, ~80 …: a handful of attempts in 400 ms, not thousands.
  expect(at.length).toBeGreaterThanOrEqual(4);
  expect(at.length).toBeLessThanOrEqual(8);
  expect(errors.slice(0, 4)).toEqual([1, 2, 3, 4]);
  const gaps = at.slice(1).map((t, i) => t - at[i]!);
  expect(gaps[2]!).toBeGreaterThan(gaps[0]!);
});

test('a handler may ask to come back later', async () => {
  let n = 0;
  const q = new WorkQueue(() => Promise.resolve(++n < 3 ? { afterMs: 10 } : undefined), { concurrency: 1 });
  q.add('k');
  await new Promise((r) => setTimeout(r, 200));
  expect(n).toBe(3);
  expect(q.stats.requeued).toBe(2);
});

/**
 * `workerGone`: the evidence the pool asks for before dropping a worker's instances when
 * Temporal handed its watcher to nobody in time (the fresh and withdrawn cases run against real
 * servers in test/pool-runs.int.test.ts; the stale one, which takes 30 s there, here). And
 * `loadSignature`: what of a load report makes the reconciler report, on leases and on load.
 */
import type { KV } from 'nats';
import { runtimeQueueFor, workerOfRuntimeQueue } from '../shared/constants';
import { RUNTIME_ADVERT_STALE_MS, type RuntimeAdvert } from '../shared/runtimes';
import type { Runtime } from './runtime/runtime';
import { createServingActivities, loadSignature, type LoadSummary } from './serving';

const queue = runtimeQueueFor('magus-control', 'vm-1-abc');
const advert = (ageMs: number): RuntimeAdvert => ({ worker: 'vm-1-abc', runtime: 'local', formats: ['gguf'], at: Date.now() - ageMs });
const activitiesWith = (advertOf?: (q: string) => Promise<RuntimeAdvert | null>) =>
  createServingActivities({ runtime: {} as Runtime, sessions: {} as KV, pools: {} as KV, ...(advertOf ? { advertOf } : {}) });

test('a worker whose advert is fresh lives; withdrawn or older than the stale limit, it is gone', async () => {
  const asked: string[] = [];
  let current: RuntimeAdvert | null = advert(1_000);
  const serving = activitiesWith((q) => (asked.push(q), Promise.resolve(current)));
  expect(await serving.workerGone({ runtimeQueue: queue })).toEqual({ gone: false, reason: 'its runtime advert is 1 s old' });
  current = advert(RUNTIME_ADVERT_STALE_MS + 5_000);
  expect(await serving.workerGone({ runtimeQueue: queue })).toEqual({
    gone: true,
    reason: `its runtime advert is ${(RUNTIME_ADVERT_STALE_MS + 5_000) / 1000} s old`,
  });
  current = null;
  expect(await serving.workerGone({ runtimeQueue: queue })).toEqual({ gone: true, reason: 'its runtime advert is withdrawn' });
  expect(asked).toEqual([queue, queue, queue]);
});

test('without adverts to read, a worker counts as gone (the timeout alone, as before)', async () => {
  expect(await activitiesWith().workerGone({ runtimeQueue: queue })).toEqual({ gone: true, reason: 'no runtime adverts to check' });
});

test('a runtime queue names its worker; another queue names none', () => {
  expect(workerOfRuntimeQueue('magus-control', queue)).toBe('vm-1-abc');
  expect(workerOfRuntimeQueue('magus-control', 'magus-control')).toBeNull();
  expect(workerOfRuntimeQueue('magus-control', runtimeQueueFor('magus-control', ''))).toBeNull();
  expect(workerOfRuntimeQueue('other', queue)).toBeNull();
});

test('the reconciler reports what changes a decision: on leases, conversations count; on load, only requests in flight or queued, and whether any conversation lives', () => {
  const summary = (r: Record<string, [number, number, number]>): LoadSummary => ({
    instances: Object.fromEntries(Object.entries(r).map(([id, [leases, pending, ackPending]]) => [id, { leases, pending, ackPending }])),
  });
  const ids = ['a', 'b'];
  const o = { leasesPerInstance: 4, pressurePending: 4 };
  const leases = (r: Record<string, [number, number, number]>) => loadSignature(summary(r), ids, o);
  const load = (r: Record<string, [number, number, number]>) => loadSignature(summary(r), ids, { ...o, onLoad: true });
  // On leases: a conversation more on an idle instance, or one that fills another instance, is a report.
  expect(leases({ a: [1, 0, 0], b: [0, 0, 0] })).not.toBe(leases({ a: [1, 0, 0], b: [1, 0, 0] }));
  expect(leases({ a: [4, 0, 0], b: [0, 0, 0] })).not.toBe(leases({ a: [5, 0, 0], b: [0, 0, 0] }));
  // On load: conversations come and go unreported; requests fill instances; the first and last conversation count.
  expect(load({ a: [1, 0, 0], b: [0, 0, 0] })).toBe(load({ a: [900, 0, 0], b: [300, 0, 0] }));
  expect(load({ a: [9, 0, 1], b: [0, 0, 0] })).not.toBe(load({ a: [9, 0, 1], b: [0, 0, 1] })); // b busy now
  expect(load({ a: [9, 0, 4], b: [0, 0, 0] })).not.toBe(load({ a: [9, 1, 4], b: [0, 0, 0] })); // a second instance's worth
  expect(load({ a: [9, 0, 2], b: [0, 0, 0] })).toBe(load({ a: [9, 0, 3], b: [0, 0, 0] })); // still one instance's worth
  expect(load({ a: [1, 0, 0], b: [0, 0, 0] })).not.toBe(load({ a: [0, 0, 0], b: [0, 0, 0] }));
  // Counted by the server for the pool as a whole: the same decisions as the instances' leases.
  const counted = (live: number) => loadSignature({ ...summary({ a: [0, 0, 1], b: [0, 0, 0] }), live }, ids, { ...o, onLoad: true });
  expect(counted(3)).toBe(load({ a: [2, 0, 1], b: [1, 0, 0] }));
  expect(counted(0)).toBe(load({ a: [0, 0, 1], b: [0, 0, 0] }));
  expect(counted(1)).toBe(counted(50_000));
});

/**
 * The pool's reconciler (`watchLoad`) against a real `magus_sessions`-shaped bucket, run in the
 * SDK's mock activity environment: it counts a pool's live entries per instance, and deletes
 * (compare-and-swap) those still there 5 minutes after they expired — orphans no session will
 * delete, which gateways holding only their recent conversations never see.
 */
import { MockActivityEnvironment } from '@temporalio/testing';
import type { KV, NatsConnection } from 'nats';
import { ORPHAN_SWEEP_GRACE_MS, type SessionEntry } from '../shared/serving';
import { isolation, natsConnect } from '../test/harness';
import type { Runtime } from './runtime/runtime';
import { createServingActivities } from './serving';

const iso = isolation();
const bucket = `${iso.natsPrefix}_reconciler_sessions`;
const enc = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));
const entry = (instance: string, expiresAt: number): SessionEntry => ({
  subject: `magus.req.m.${instance}`,
  pool: 'm',
  namespace: 'default',
  instance,
  expiresAt,
  placedAt: expiresAt - 600_000,
});

let nc: NatsConnection;
let kv: KV;

beforeAll(async () => {
  nc = await natsConnect();
  kv = await nc.jetstream().views.kv(bucket);
});
afterAll(async () => {
  await (await nc.jetstreamManager()).streams.delete(`KV_${bucket}`);
  await nc.drain();
});

test('the reconciler counts the live entries per instance and sweeps its pool’s orphans (expired 5 min ago), nothing else', async () => {
  const now = Date.now();
  await kv.put('live-1', enc(entry('i1', now + 600_000)));
  await kv.put('live-2', enc(entry('i2', now + 600_000)));
  await kv.put('expired-lately', enc(entry('i1', now - 60_000))); // its session deletes it
  await kv.put('orphan-1', enc(entry('i1', now - ORPHAN_SWEEP_GRACE_MS - 60_000)));
  await kv.put('orphan-2', enc(entry('i2', now - ORPHAN_SWEEP_GRACE_MS - 60_000)));
  await kv.put('other-pool', enc({ ...entry('x1', now - ORPHAN_SWEEP_GRACE_MS - 60_000), pool: 'other', subject: 'magus.req.other.x1' }));
  const serving = createServingActivities({ runtime: {} as Runtime, sessions: kv, pools: kv });
  const summary = await new MockActivityEnvironment().run((input: Parameters<typeof serving.watchLoad>[0]) => serving.watchLoad(input), {
    namespace: 'default',
    model: 'm',
    instances: ['i1', 'i2'],
    leasesPerInstance: 4,
    known: null,
    minIntervalMs: 0,
    pollMs: 100,
    pressurePending: 4,
  });
  expect(summary).toEqual({ instances: { i1: { leases: 1, pending: 0, ackPending: 0 }, i2: { leases: 1, pending: 0, ackPending: 0 } } });
  const present = async (k: string) => (await kv.get(k))?.operation === 'PUT';
  expect(await present('orphan-1')).toBe(false);
  expect(await present('orphan-2')).toBe(false);
  expect(await present('expired-lately')).toBe(true);
  expect(await present('live-1')).toBe(true);
  expect(await present('other-pool')).toBe(true); // another pool's reconciler's
});

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
import {
  claimOrphanRead,
  counterNameOf,
  deleteEntry,
  markerSettings,
  orphanReadClaimKey,
  poolEntryCounter,
  poolKeyPrefix,
  SESSION_MARKER_TTL_MS,
} from '../dataplane/session-keys';
import { createServingActivities, type LoadSummary } from './serving';

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

test('a pool on load is counted by the server, holding no entry; its orphans are found by a read of its keys alone, and deletes leave markers that expire', async () => {
  const jsm = await nc.jetstreamManager();
  const js = nc.jetstream();
  const pooled = `${iso.natsPrefix}_reconciler_pooled`;
  const kvp = await js.views.kv(pooled, { history: 1 });
  const { config } = await jsm.streams.info(`KV_${pooled}`);
  await jsm.streams.update(`KV_${pooled}`, { ...config, ...markerSettings });
  try {
    const now = Date.now();
    const m = poolKeyPrefix('default', 'm');
    await kvp.put(`${m}.live-1`, enc(entry('i1', now + 600_000)));
    await kvp.put(`${m}.live-2`, enc(entry('i2', now + 600_000)));
    await kvp.put(`${m}.orphan-1`, enc(entry('i1', now - ORPHAN_SWEEP_GRACE_MS - 60_000)));
    await kvp.put(`${m}.orphan-2`, enc(entry('i2', now - ORPHAN_SWEEP_GRACE_MS - 60_000)));
    // Another model, and one whose name has a dot and starts like this one's: neither is this pool's.
    const otherOrphan = { ...entry('x1', now - ORPHAN_SWEEP_GRACE_MS - 60_000), pool: 'other', subject: 'magus.req.other.x1' };
    await kvp.put(`${poolKeyPrefix('default', 'other')}.orphan`, enc(otherOrphan));
    await kvp.put(`${poolKeyPrefix('default', 'm.v2')}.orphan`, enc({ ...otherOrphan, pool: 'm.v2' }));
    const serving = createServingActivities({
      runtime: {} as Runtime,
      sessions: kvp,
      pools: kvp,
      countEntries: poolEntryCounter(jsm, pooled),
      deleteSession: (key, previousSeq) => deleteEntry(js, pooled, key, { previousSeq }),
      orphanScanEveryMs: 200,
    });
    const input = {
      namespace: 'default',
      model: 'm',
      instances: ['i1', 'i2'],
      leasesPerInstance: 4,
      known: null as LoadSummary | null,
      minIntervalMs: 0,
      pollMs: 100,
      pressurePending: 4,
      scaleOn: 'load' as const,
    };
    const run = (i: typeof input & { refreshMs?: number }): Promise<LoadSummary> => new MockActivityEnvironment().run((x: typeof i) => serving.watchLoad(x), i);
    const first = await run(input);
    // Counted for the pool as a whole: the instances' leases are not counted.
    expect(first).toEqual({ live: 4, instances: { i1: { leases: 0, pending: 0, ackPending: 0 }, i2: { leases: 0, pending: 0, ackPending: 0 } } });
    // The reconciler as the pool runs it again, waiting for a change: its scan (in the background,
    // due within orphanScanEveryMs) deletes this pool's orphans, each leaving a marker a watcher sees.
    const second = run({ ...input, known: first, refreshMs: 0 });
    const op = async (k: string) => (await kvp.get(k))?.operation;
    const until = async (what: () => Promise<boolean>, ms: number) => {
      for (const end = Date.now() + ms; Date.now() < end;) {
        if (await what()) return true;
        await new Promise((r) => setTimeout(r, 200));
      }
      return what();
    };
    expect(await until(async () => (await op(`${m}.orphan-1`)) === 'DEL' && (await op(`${m}.orphan-2`)) === 'DEL', 10_000)).toBe(true);
    expect(await op(`${m}.live-1`)).toBe('PUT');
    expect(await op(`${poolKeyPrefix('default', 'other')}.orphan`)).toBe('PUT'); // another pool's reconciler's
    expect(await op(`${poolKeyPrefix('default', 'm.v2')}.orphan`)).toBe('PUT');
    // The markers go away by themselves, and the count with them: reported (refreshMs 0) once the count changes.
    const gone = async () => (await kvp.get(`${m}.orphan-1`)) === null && (await kvp.get(`${m}.orphan-2`)) === null;
    expect(await until(gone, SESSION_MARKER_TTL_MS + 5_000)).toBe(true);
    expect((await second).live).toBeLessThan(4);
    const third = await run({ ...input, known: first, refreshMs: 0 });
    expect(third.live).toBe(2);
    // Every look of every run was one consumer's info: the pool's, whoever counts it.
    const counters = (await jsm.consumers.list(`KV_${pooled}`).next()).filter((c) => c.name.startsWith('count_'));
    expect(counters.map((c) => [c.name, c.config.filter_subject])).toEqual([[counterNameOf(m), `$KV.${pooled}.${m}.*`]]);
  } finally {
    await jsm.streams.delete(`KV_${pooled}`);
  }
}, 40_000);

test("a pool's read for orphans is claimed across workers: two processes reconciling it read its entries once per interval between them, not each", async () => {
  const jsm = await nc.jetstreamManager();
  const js = nc.jetstream();
  const pooled = `${iso.natsPrefix}_reconciler_claimed`;
  const kvp = await js.views.kv(pooled, { history: 1 });
  const { config } = await jsm.streams.info(`KV_${pooled}`);
  await jsm.streams.update(`KV_${pooled}`, { ...config, ...markerSettings });
  try {
    const m = poolKeyPrefix('default', 'm');
    await kvp.put(`${m}.live-1`, enc(entry('i1', Date.now() + 600_000)));
    const EVERY_MS = 1_000; // a claim's TTL is counted in whole seconds
    const reads: string[] = [];
    const claims: [string, boolean][] = [];
    // Two worker processes: each its own activities (its own `scanned`), the same bucket; a read is a watch of the pool's keys.
    const processOf = (name: string) => {
      const sessions = new Proxy(kvp, {
        get(target, p) {
          if (p === 'watch') return (...a: Parameters<KV['watch']>) => (reads.push(name), target.watch(...a));
          const v = Reflect.get(target, p) as unknown;
          return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
        },
      });
      return createServingActivities({
        runtime: {} as Runtime,
        sessions,
        pools: kvp,
        countEntries: poolEntryCounter(jsm, pooled),
        deleteSession: (key, previousSeq) => deleteEntry(js, pooled, key, { previousSeq }),
        claimOrphanRead: async (prefix, forMs) => {
          const mine = await claimOrphanRead(js, pooled, prefix, forMs, name);
          claims.push([name, mine]);
          return mine;
        },
        orphanScanEveryMs: EVERY_MS,
      });
    };
    const WINDOW_MS = 6_000;
    const input = {
      namespace: 'default',
      model: 'm',
      instances: ['i1'],
      leasesPerInstance: 4,
      known: { live: 1, instances: { i1: { leases: 0, pending: 0, ackPending: 0 } } } as LoadSummary | null,
      minIntervalMs: 0,
      pollMs: 100,
      pressurePending: 4,
      scaleOn: 'load' as const,
    };
    // Nothing changes: each reconciler looks every 100 ms, waiting, until the pool closes its run (a cancel).
    const started = Date.now();
    const runs = ['a', 'b'].map((name) => {
      const env = new MockActivityEnvironment();
      setTimeout(() => env.cancel(), WINDOW_MS);
      return env
        .run((x: typeof input) => processOf(name).watchLoad(x), input)
        .then(
          () => 'reported',
          (err: Error) => err.name,
        );
    });
    expect(await Promise.all(runs)).toEqual(['CancelledFailure', 'CancelledFailure']);
    const elapsed = Date.now() - started;
    // The claim is no entry of the pool: nobody counts it.
    const counted: LoadSummary = await new MockActivityEnvironment().run((x: typeof input) => processOf('c').watchLoad(x), { ...input, known: null });
    expect(counted.live).toBe(1);
    // Each process asked about once per interval (its first at a random point of it)…
    for (const name of ['a', 'b']) expect(claims.filter(([n]) => n === name).length).toBeGreaterThanOrEqual(Math.floor(WINDOW_MS / EVERY_MS) - 2);
    // …and between them they read the entries once per claim won, at most once per interval (and
    // the first) — alone each would have read at every ask.
    expect(reads.length).toBe(claims.filter(([, mine]) => mine).length);
    expect(reads.length).toBeLessThanOrEqual(Math.ceil(elapsed / EVERY_MS) + 1);
    expect(claims.filter(([, mine]) => !mine).length).toBeGreaterThan(0);
    // The claim expires by itself.
    const key = orphanReadClaimKey(m);
    const until = Date.now() + EVERY_MS + 5_000;
    while ((await kvp.get(key)) !== null && Date.now() < until) await new Promise((r) => setTimeout(r, 200));
    expect(await kvp.get(key)).toBeNull();
    process.stderr.write(
      `orphan reads claimed: ${reads.length} reads (a ${reads.filter((r) => r === 'a').length}, b ${reads.filter((r) => r === 'b').length}) for ${claims.length} asks in ${elapsed} ms\n`,
    );
  } finally {
    await jsm.streams.delete(`KV_${pooled}`);
  }
}, 40_000);

/**
 * The entry-lease protocol's parts against real servers (ARCHITECTURE.md, "Data plane", "The
 * entry-lease protocol"): a session
 * that only watches its conversation's `magus_sessions` entry (its history events per TTL), a
 * renewal that races the expiry, and a pool whose reconciler counts 50,000 live conversations
 * and whose runs carry O(instances) into the next. Real Temporal, nats-server and s3proxy; the
 * pool's instances are real llama.cpp engines of the tiny GGUF (local runtime).
 */
import type { S3Client } from '@aws-sdk/client-s3';
import type { Client } from '@temporalio/client';
import { temporal } from '@temporalio/proto';
import { randomBytes } from 'node:crypto';
import type { KV, NatsConnection } from 'nats';
import { dataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import type { Runtime } from '../activities/runtime/runtime';
import { createServingActivities } from '../activities/serving';
import { poolQueueFor } from '../shared/constants';
import type { SessionEntry } from '../shared/serving';
import { demandSignal, poolStatusQuery, poolWorkflowId, type PoolInput } from '../workflows/pool/definitions';
import type { dllamaPool } from '../workflows/pool/pool';
import { sessionStart } from '../workflows/session/definitions';
import type { session } from '../workflows/session/session';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { isolation, listWorkflowIds, recordHistory } from './harness';
import { magusStack, poolTerminated, TestStack } from './harness/stack';
import { sleep, until } from './harness/wait';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
const MODEL = `etiny-${iso.id}`;
const encode = (e: SessionEntry) => new TextEncoder().encode(JSON.stringify(e));
const decode = (v: Uint8Array) => JSON.parse(new TextDecoder().decode(v)) as SessionEntry;

let dir: string;
let s3: S3Client;
let nc: NatsConnection;
let kv: KV;
let client: Client;
let taskQueue: string;
const stack = new TestStack();

beforeAll(async () => {
  const magus = await stack.open(magusStack(iso, { dirPrefix: 'magus-entries-' }));
  ({ dir, s3, nc, client } = magus);
  taskQueue = magus.cfg.taskQueue;
  kv = await nc.jetstream().views.kv(names.sessionsBucket);
  await publishTinyGguf({ dir, s3, bucket: iso.bucket, registry: await openModelRegistry(nc, names.modelsBucket), name: MODEL });
  stack.defer(poolTerminated(client, MODEL));
}, 180_000);

afterAll(() => stack.close(), 60_000);

/** Starts a conversation's session as the gateway does, for an entry written first. */
async function startSession(key: string, expiresAt: number, ttlMs: number) {
  return client.workflow.start<typeof session>(
    'session',
    sessionStart({ taskQueue, namespace: 'default', model: MODEL, key, ttlMs, expiresAt, now: Date.now() }),
  );
}

const entry = (instance: string, expiresAt: number): SessionEntry => ({
  subject: `magus.req.${MODEL}.${instance}`,
  pool: MODEL,
  namespace: 'default',
  instance,
  expiresAt,
  placedAt: Date.now(),
});

test('a session lives on its entry: 7 events for one TTL (started when its lease would end), 6 for each renewal, the entry deleted at the end', async () => {
  const ttl = 1500;
  // One TTL, no turn after the first.
  const once = `once-${randomBytes(4).toString('hex')}`;
  await kv.create(once, encode(entry('x-1', Date.now() + ttl)));
  const h1 = await startSession(once, Date.now() + ttl, ttl);
  // Renewed twice by "gateways" (compare-and-swap updates) before it expires.
  const twice = `twice-${randomBytes(4).toString('hex')}`;
  await kv.create(twice, encode(entry('x-1', Date.now() + ttl)));
  const h2 = await startSession(twice, Date.now() + ttl, ttl);
  for (let k = 0; k < 2; k++) {
    await sleep(ttl - 500);
    // As a gateway renews: compare-and-swap on what it read, keeping what it did not write (the session's mark).
    const e = (await kv.get(twice))!;
    await kv.update(twice, encode({ ...decode(e.value), expiresAt: Date.now() + ttl }), e.revision);
  }
  await h1.result();
  await h2.result();
  expect(await kv.get(once).then((e) => e?.operation)).not.toBe('PUT');
  expect(await kv.get(twice).then((e) => e?.operation)).not.toBe('PUT');
  const events = async (h: typeof h1) => (await h.fetchHistory()).events ?? [];
  const e1 = await events(h1);
  const e2 = await events(h2);
  // Started with a delay to its lease's end: no task or timer before its first look.
  expect(e1.length).toBeLessThanOrEqual(7);
  expect(e1.some((e) => e.eventType === temporal.api.enums.v1.EventType.EVENT_TYPE_TIMER_STARTED)).toBe(false);
  // Each renewal the session notices costs a wake: a timer, a task and a look (≤ 6 events).
  expect(e2.length - e1.length).toBeLessThanOrEqual(2 * 6);
  // No signal, no update, no upsert but the final phase.
  const kinds = new Set(e2.map((e) => temporal.api.enums.v1.EventType[e.eventType!]));
  for (const none of [
    'EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED',
    'EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED',
    'EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED',
  ])
    expect(kinds.has(none)).toBe(false);
  expect(e2.filter((e) => e.eventType === temporal.api.enums.v1.EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES)).toHaveLength(1);
  expect(await listWorkflowIds(client, `MagusKind="session" AND MagusModel="default/${MODEL}" AND MagusPhase="ended"`)).toEqual(
    expect.arrayContaining([h1.workflowId, h2.workflowId]),
  );
  await recordHistory('session-renewed', h2);
  await recordHistory('session-delayed', h1);
}, 60_000);

test('a renewal landing between the expiry’s read and its delete wins; an entry already gone ends the session', async () => {
  const key = `race-${randomBytes(4).toString('hex')}`;
  await kv.create(key, encode(entry('x-1', Date.now() - 1)));
  // The bucket as the activity sees it: the first read is followed at once by a gateway's renewal.
  let renewed = false;
  const racing = new Proxy(kv, {
    get(target, prop, receiver) {
      if (prop !== 'get') return Reflect.get(target, prop, receiver) as unknown;
      return async (k: string) => {
        const e = await target.get(k);
        if (!renewed && e) {
          renewed = true;
          await target.update(k, encode(entry('x-1', Date.now() + 60_000)), e.revision);
        }
        return e;
      };
    },
  });
  const noRuntime = {} as Runtime;
  const acts = createServingActivities({ runtime: noRuntime, sessions: racing, pools: kv });
  const r = await acts.expireSession({ key });
  expect(renewed).toBe(true);
  expect(Object.keys(r)).toEqual(['expiresAt']);
  expect((r as { expiresAt: number }).expiresAt).toBeGreaterThan(Date.now());
  expect(decode((await kv.get(key))!.value).expiresAt).toBe((r as { expiresAt: number }).expiresAt);
  // Renewed, the entry is marked as having its session (an orphan has not: gateway/serving/sessions/placement.ts), once.
  expect(decode((await kv.get(key))!.value).watched).toBe(true);
  const marked = (await kv.get(key))!.revision;
  await acts.expireSession({ key });
  expect((await kv.get(key))!.revision).toBe(marked);
  // Expired with nobody renewing: deleted. Gone already: nothing to do.
  await kv.put(key, encode(entry('x-1', Date.now() - 1)));
  expect(await acts.expireSession({ key })).toEqual({ ended: 'expired' });
  expect(await acts.expireSession({ key })).toEqual({ ended: 'gone' });
}, 30_000);

test('a pool with 50,000 live conversations scales on them and continues as new with an input under 16 KB', async () => {
  const input: PoolInput = {
    namespace: 'default',
    model: MODEL,
    minInstances: 1,
    maxInstances: 2,
    leasesPerInstance: 4,
    idleTimeoutMs: 60 * 60_000,
    runMaxEvents: 60,
  };
  const pool = await client.workflow.start<typeof dllamaPool>('dllamaPool', {
    workflowId: poolWorkflowId('default', MODEL),
    taskQueue: poolQueueFor(taskQueue),
    args: [input],
  });
  let first = '';
  await until(
    'the pool serves its first instance',
    async () => {
      const s = await pool.query(poolStatusQuery);
      first = s.instances.find((i) => i.phase === 'ready')?.id ?? '';
      return first !== '';
    },
    120_000,
  );
  // 50,000 conversations on it, written as gateways write them.
  const expiresAt = Date.now() + 30 * 60_000;
  for (let k = 0; k < 50_000; k += 1000) {
    await Promise.all(Array.from({ length: 1000 }, (_, j) => kv.put(`load-${k + j}`, encode(entry(first, expiresAt)))));
  }
  // The reconciler counts them; the pool wants its maximum and starts the second instance.
  await until(
    'the pool counts 50,000 leases and runs two instances',
    async () => {
      const s = await pool.query(poolStatusQuery);
      return s.instances.find((i) => i.id === first)?.leases === 50_000 && s.instances.filter((i) => i.phase === 'ready').length === 2;
    },
    120_000,
  );
  // Demand signals push it past its run budget (60 events): it continues as new carrying instances only.
  for (let k = 0; k < 20; k++) await pool.signal(demandSignal, { replica: `gw-${k}`, waiting: 1 });
  let carried = 0;
  await until(
    'a run continued as new',
    async () => {
      const events = (await client.workflow.getHandle(pool.workflowId, pool.firstExecutionRunId).fetchHistory()).events ?? [];
      const can = events.find((e) => e.workflowExecutionContinuedAsNewEventAttributes);
      if (!can) return false;
      carried = (can.workflowExecutionContinuedAsNewEventAttributes!.input?.payloads ?? []).reduce((n, p) => n + (p.data?.length ?? 0), 0);
      return true;
    },
    60_000,
  );
  expect(carried).toBeGreaterThan(0);
  expect(carried).toBeLessThan(16 * 1024);
  process.stderr.write(`serving-entries: 50,000 live conversations; the pool continued as new with a ${carried}-byte input\n`);
  await recordHistory('pool-continued', client.workflow.getHandle(pool.workflowId, pool.firstExecutionRunId));
  // The next run still knows both instances and their load.
  await until(
    'the next run reports the load',
    async () => (await pool.query(poolStatusQuery)).instances.find((i) => i.id === first)?.leases === 50_000,
    60_000,
  );
  const keys: string[] = [];
  for (let k = 0; k < 50_000; k += 1000) keys.push(...Array.from({ length: 1000 }, (_, j) => `load-${k + j}`));
  for (let k = 0; k < keys.length; k += 1000) await Promise.all(keys.slice(k, k + 1000).map((key) => kv.delete(key)));
}, 420_000);

test('the pool’s history grows with its decisions, not with conversations: 5 and 40 new conversations a second cost it the same', async () => {
  const model = `${MODEL}-rate`;
  await publishTinyGguf({ dir, s3, bucket: iso.bucket, registry: await openModelRegistry(nc, names.modelsBucket), name: model });
  // Four conversations an instance, at most two instances: the lease count stops mattering at 8.
  const input: PoolInput = { namespace: 'default', model, minInstances: 1, maxInstances: 2, leasesPerInstance: 4, idleTimeoutMs: 600_000 };
  const pool = await client.workflow.start<typeof dllamaPool>('dllamaPool', {
    workflowId: poolWorkflowId('default', model),
    taskQueue: poolQueueFor(taskQueue),
    args: [input],
  });
  const written: string[] = [];
  try {
    let instances: string[] = [];
    await until(
      'two instances serve',
      async () => {
        const s = await pool.query(poolStatusQuery);
        if (s.instances.length < 2) await pool.signal(demandSignal, { replica: 'test', waiting: 8 });
        instances = s.instances.filter((i) => i.phase === 'ready').map((i) => i.id);
        return instances.length === 2;
      },
      180_000,
    );
    const events = async () => (await pool.describe()).historyLength;
    /** New conversations for `seconds` at `perSec`, as gateways write their entries; the pool's new events a minute. */
    const load = async (perSec: number, seconds: number): Promise<number> => {
      const e0 = await events();
      const t0 = Date.now();
      for (let k = 0; k < perSec * seconds; k++) {
        const due = t0 + (k * 1000) / perSec;
        if (due > Date.now()) await sleep(due - Date.now());
        const key = `rate-${perSec}-${k}-${randomBytes(3).toString('hex')}`;
        written.push(key);
        await kv.put(key, encode({ ...entry(instances[k % 2]!, Date.now() + 600_000), pool: model }));
      }
      return ((await events()) - e0) * (60 / ((Date.now() - t0) / 1000));
    };
    const slow = await load(5, 20);
    const fast = await load(40, 20);
    process.stderr.write(`serving-entries: the pool's history grew ${slow.toFixed(0)} events/min at 5 new conversations/s and ${fast.toFixed(0)} at 40/s\n`);
    // Reports come at most every 2 s (~8 events each) and only when a decision may change — here
    // how many of its two instances the leases fill, which stops changing at eight — whatever
    // the rate: bounded, and no more at 8× the rate.
    expect(slow).toBeLessThanOrEqual(250);
    expect(fast).toBeLessThanOrEqual(Math.max(60, slow));
    // Conversations come and go without a signal: only the test's demand above reached the pool.
    const history = (await pool.fetchHistory()).events ?? [];
    expect(
      history.filter((e) => e.workflowExecutionSignaledEventAttributes && e.workflowExecutionSignaledEventAttributes.signalName !== 'demand'),
    ).toHaveLength(0);
  } finally {
    for (let k = 0; k < written.length; k += 500) await Promise.all(written.slice(k, k + 500).map((key) => kv.delete(key).catch(() => undefined)));
    await pool.terminate().catch(() => undefined);
  }
}, 420_000);

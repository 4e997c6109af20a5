/**
 * The pool workflow under churn: its runs continue as new early and carry their instances
 * (watched, never described inline), lease counts alone are published at most every 5 s, and a
 * watcher that its worker's queue did not take in time drops the instance only once that
 * worker's runtime advert says it is gone. One real worker, real sessions, real Temporal.
 */
import { CreateBucketCommand, type S3Client } from '@aws-sdk/client-s3';
import type { Client, Connection, WorkflowHandle, WorkflowHandleWithFirstExecutionRunId } from '@temporalio/client';
import { type temporal } from '@temporalio/proto';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import { dataPlaneNames } from '../activities/nats/data-plane';
import { openModelRegistry, type ModelRegistry } from '../activities/nats/registry';
import { runtimeQueueFor } from '../shared/constants';
import type { PoolEntry } from '../shared/serving';
import type { PoolCarry } from '../workflows/pool/pool';
import { poolStatusQuery, poolWorkflowId, type PoolInput, type PoolStatus } from '../workflows/pool/definitions';
import { sessionWorkflowId } from '../workflows/session/definitions';
import { startWorkers, type RunningWorkers } from '../workers/worker';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { isolation, natsConnect, recordHistory, s3Client, temporalClient, workerConfig } from './harness';
import { until } from './harness/wait';

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
/** Its own model (and so its own pool workflow ids): other test files serve `tiny` and `wtiny`. */
const MODEL = 'rtiny';
const cfgOf = (dir: string) => workerConfig(iso, dir);

let dir: string;
let s3: S3Client;
let nc: NatsConnection;
let client: Client;
let connection: Connection;
let workers: RunningWorkers;
let registry: ModelRegistry;
const pools: WorkflowHandle[] = [];

beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), 'magus-pool-runs-'));
  s3 = s3Client();
  await s3.send(new CreateBucketCommand({ Bucket: iso.bucket }));
  workers = await startWorkers(cfgOf(dir));
  nc = await natsConnect();
  registry = await openModelRegistry(nc, names.modelsBucket);
  await publishTinyGguf({ dir, s3, bucket: iso.bucket, registry, name: MODEL });
  ({ client, connection } = await temporalClient());
}, 180_000);

afterAll(async () => {
  for (const p of pools) await p.terminate().catch(() => undefined);
  await workers?.shutdown();
  await nc?.drain();
  await connection?.close();
  s3?.destroy();
  rmSync(dir, { recursive: true, force: true });
}, 60_000);

type HistoryEvent = temporal.api.history.v1.IHistoryEvent;
const scheduled = (events: HistoryEvent[], name: string) => events.filter((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === name);
const eventMs = (e: HistoryEvent) => Number(e.eventTime?.seconds ?? 0) * 1000 + Math.floor((e.eventTime?.nanos ?? 0) / 1e6);

type WriteView = { instances: { instance: string; subject: string; leases: number }[]; growable?: boolean };
/** What a scheduled `writePool` was asked to publish. */
const writeInput = (e: HistoryEvent): WriteView => JSON.parse(new TextDecoder().decode(e.activityTaskScheduledEventAttributes!.input!.payloads![0]!.data)) as WriteView;
/** A view without its lease counts. */
const shapeOf = (v: WriteView) => JSON.stringify([v.instances.map((i) => [i.instance, i.subject]), v.growable]);

/** Every run of a workflow from its first, following continue-as-new. */
async function runs(id: string, firstRunId: string): Promise<{ runId: string; events: HistoryEvent[] }[]> {
  const out: { runId: string; events: HistoryEvent[] }[] = [];
  for (let runId: string | null | undefined = firstRunId; runId; ) {
    const events: HistoryEvent[] = (await client.workflow.getHandle(id, runId).fetchHistory()).events ?? [];
    out.push({ runId, events });
    runId = events.at(-1)?.workflowExecutionContinuedAsNewEventAttributes?.newExecutionRunId;
  }
  return out;
}

/** A pool of `input`'s model started on the test's worker, once it has a ready instance. */
async function readyPool(input: PoolInput): Promise<{ pool: WorkflowHandleWithFirstExecutionRunId; instance: PoolStatus['instances'][number] }> {
  const pool = await client.workflow.start('dllamaPool', { workflowId: poolWorkflowId(input.namespace, input.model), taskQueue: cfgOf(dir).taskQueue, args: [input] });
  pools.push(pool);
  let status: PoolStatus = await pool.query(poolStatusQuery);
  await until('a ready instance', async () => (status = await pool.query(poolStatusQuery)).instances.some((i) => i.phase === 'ready'), 120_000);
  return { pool, instance: status.instances.find((i) => i.phase === 'ready')! };
}

test('a busy pool continues as new early, carries its instance to a watcher (no inline describe), and publishes lease counts at most every 5 s', async () => {
  const cfg = cfgOf(dir);
  const input: PoolInput = { namespace: 'default', model: MODEL, minInstances: 1, maxInstances: 1, leasesPerInstance: 100, idleTimeoutMs: 600_000, healthCheckMs: 1000, runMaxEvents: 400 };
  const { pool, instance } = await readyPool(input);
  let status: PoolStatus = await pool.query(poolStatusQuery);

  // 60 conversations over 18 s, each leased the instance its gateway picked and expiring 3 s
  // after: 120 lease changes, and well over 400 events (runs of several seconds each).
  const sessions: WorkflowHandle[] = [];
  for (let n = 0; n < 60; n++) {
    const key = `conv-${randomBytes(4).toString('hex')}`;
    sessions.push(
      await client.workflow.start('session', {
        workflowId: sessionWorkflowId('default', MODEL, key),
        taskQueue: cfg.taskQueue,
        args: [{ key, namespace: 'default', model: MODEL, ttlMs: 3000, preferred: { instance: instance.id, subject: instance.subject! } }],
      }),
    );
    if (n % 2 === 1) await sleep(600);
  }
  for (const s of sessions) await s.result();
  await until('every lease released', async () => (status = await pool.query(poolStatusQuery)).instances.every((i) => i.leases === 0), 60_000);
  expect(status.instances.map((i) => [i.id, i.phase])).toEqual([[instance.id, 'ready']]);
  expect(status.waiting).toBe(0);

  const all = await runs(pool.workflowId, pool.firstExecutionRunId);
  expect(all.length).toBeGreaterThanOrEqual(2);
  for (const run of all.slice(0, -1)) expect(run.events.length).toBeLessThan(550); // continued early, not at the server's 4,000
  // Every later run watches the carried instance on the worker that runs it and describes nothing inline.
  for (const run of all.slice(1)) {
    expect(scheduled(run.events, 'describeInstance')).toHaveLength(0);
    const watchers = scheduled(run.events, 'watchInstance');
    expect(watchers.length).toBeGreaterThanOrEqual(1);
    expect(watchers.every((w) => w.activityTaskScheduledEventAttributes?.taskQueue?.name === workers.runtimeQueue)).toBe(true);
  }
  // Once the instance is ready only lease counts change (it stays, never full, the pool never
  // grows): within a run, writes of the same instances and growable are at least 5 s apart.
  let writes = 0;
  let leaseOnly = 0;
  for (const run of all) {
    const ws = scheduled(run.events, 'writePool').map((e) => ({ at: eventMs(e), view: writeInput(e) }));
    writes += ws.length;
    for (let k = 1; k < ws.length; k++) {
      const [a, b] = [ws[k - 1]!, ws[k]!];
      if (shapeOf(a.view) !== shapeOf(b.view)) continue;
      leaseOnly++;
      expect(b.at - a.at).toBeGreaterThanOrEqual(4900);
    }
  }
  const runsSeen = all.map((r) => `${r.events.length} events in ${((eventMs(r.events.at(-1)!) - eventMs(r.events[0]!)) / 1000).toFixed(1)} s, ${scheduled(r.events, 'writePool').length} writes`).join('; ');
  if (leaseOnly === 0) throw new Error(`no two writes of the same instances in one run, so the throttle went unseen: ${runsSeen}`);
  expect(writes).toBeLessThan(120 / 4);
  // The counts held back were published in the end: the view says 0 leases.
  const poolsKv = await nc.jetstream().views.kv(names.poolsBucket);
  await until('the published view at 0 leases', async () => {
    const e = await poolsKv.get(`default.${MODEL}`);
    const view = e?.value.length ? (JSON.parse(new TextDecoder().decode(e.value)) as PoolEntry) : undefined;
    return view?.instances.length === 1 && view.instances[0]!.leases === 0;
  }, 15_000);

  await recordHistory('pool-continued', client.workflow.getHandle(pool.workflowId, all[0]!.runId));
  await recordHistory('pool-carried-watch', client.workflow.getHandle(pool.workflowId, all[1]!.runId));
}, 300_000);

test('a pool asked for leases without pause still closes its runs: grants asked for once a run is due to close are sent by the next one', async () => {
  // Found by a 25-minute soak: with new conversations every half second and tasks slowed by the
  // load, every workflow task brought a lease request, so a grant was always in flight when the
  // run looked whether it could close. It never did: 26,000 events in one run, tasks timing out.
  const cfg = cfgOf(dir);
  const model = `${MODEL}-busy`;
  await publishTinyGguf({ dir, s3, bucket: iso.bucket, registry, name: model });
  const input: PoolInput = { namespace: 'default', model, minInstances: 1, maxInstances: 1, leasesPerInstance: 1000, idleTimeoutMs: 600_000, healthCheckMs: 1000, runMaxEvents: 150 };
  const { pool, instance } = await readyPool(input);
  let status: PoolStatus = await pool.query(poolStatusQuery);

  // Sessions confirming the instance their gateway picked, ten a second for 15 s (the soak's
  // rate was 2 a second, on a machine busier than this test's): a request in nearly every task.
  const sessions: WorkflowHandle[] = [];
  for (const until15s = Date.now() + 15_000; Date.now() < until15s; ) {
    const key = `busy-${randomBytes(4).toString('hex')}`;
    sessions.push(
      await client.workflow.start('session', {
        workflowId: sessionWorkflowId('default', model, key),
        taskQueue: cfg.taskQueue,
        args: [{ key, namespace: 'default', model, ttlMs: 30_000, preferred: { instance: instance.id, subject: instance.subject! } }],
      }),
    );
    await sleep(100);
  }
  // Every session got its grant (a lost one would leave it re-asking until its TTL), and ended.
  // (Their TTL is long enough that a pool held up by a busy CI machine still answers within it:
  // a session whose TTL passed first withdraws its request, and is rightly never granted.)
  for (const s of sessions) await s.result();
  await until('every lease released', async () => (status = await pool.query(poolStatusQuery)).instances.every((i) => i.leases === 0), 60_000);
  expect(status.waiting).toBe(0);
  const all = await runs(pool.workflowId, pool.firstExecutionRunId);
  const sizes = all.map((r) => r.events.length);
  process.stderr.write(`busy pool: ${sessions.length} sessions in 15 s; runs of ${sizes.join(', ')} events\n`);
  expect(all.length).toBeGreaterThanOrEqual(3);
  // Closed soon after it was due: what was in flight settles within a few tasks (seen: 153–370
  // events; before, the first run took every request until the load stopped: 897 events).
  for (const run of all.slice(0, -1)) expect(run.events.length).toBeLessThan(4 * input.runMaxEvents!);
  // Each session's lease was granted once: never twice, never lost across runs.
  const granted = new Map<string, number>();
  for (const run of all) {
    for (const e of run.events) {
      const id = e.signalExternalWorkflowExecutionInitiatedEventAttributes?.workflowExecution?.workflowId;
      if (id) granted.set(id, (granted.get(id) ?? 0) + 1);
    }
  }
  expect(sessions.map((s) => [s.workflowId, granted.get(s.workflowId) ?? 0]).filter(([, n]) => n !== 1)).toEqual([]);
  // The runs that closed with leases given and their grants not yet sent: the next run sent them.
  const carriedGrants = (run: { events: HistoryEvent[] }) => {
    const carry = run.events.at(-1)?.workflowExecutionContinuedAsNewEventAttributes?.input?.payloads?.[1]?.data;
    return carry ? ((JSON.parse(new TextDecoder().decode(carry)) as PoolCarry).grants?.length ?? 0) : 0;
  };
  process.stderr.write(`busy pool: grants carried to the next run: ${all.map(carriedGrants).join(', ')}\n`);
  const k = all.findIndex((run) => carriedGrants(run) > 0);
  if (k >= 0) {
    await recordHistory('pool-quiesced', client.workflow.getHandle(pool.workflowId, all[k]!.runId));
    await recordHistory('pool-carried-grants', client.workflow.getHandle(pool.workflowId, all[k + 1]!.runId));
  }
  await pool.terminate('test over');
}, 300_000);

test('a watcher its worker’s queue did not take in time: the instance stays while the worker’s advert is fresh, and is dropped (its sessions waiting) once it is withdrawn', async () => {
  const cfg = cfgOf(dir);
  const worker = `fake-${randomBytes(3).toString('hex')}`;
  const queue = runtimeQueueFor(cfg.taskQueue, worker);
  const advertise = () => registry.advertiseRuntime({ worker, runtime: 'local', formats: ['gguf'], at: Date.now() });
  await advertise();
  const refresh = setInterval(() => void advertise(), 1000);
  try {
    const gone = `${MODEL}-100`;
    const carry: PoolCarry = {
      instances: [{ id: gone, subject: 'magus.req.nobody', leases: ['conv-fake'], idleSince: 0, runtimeQueue: queue }],
      nextId: 101,
      waiting: [],
      sessionWorkflowIds: { 'conv-fake': sessionWorkflowId('default', MODEL, 'conv-fake') },
    };
    const input: PoolInput = { namespace: 'default', model: MODEL, minInstances: 0, maxInstances: 1, leasesPerInstance: 4, idleTimeoutMs: 600_000, healthCheckMs: 1000, ownerTimeoutMs: 1000 };
    const pool = await client.workflow.start('dllamaPool', { workflowId: `${poolWorkflowId('default', MODEL)}-carried`, taskQueue: cfg.taskQueue, args: [input, carry] });
    pools.push(pool);
    const events = async () => (await pool.fetchHistory()).events ?? [];

    // Nobody polls the fake worker's queue, but its advert is fresh: asked, kept, watched again.
    await until('the owner asked about twice', async () => scheduled(await events(), 'workerGone').length >= 2, 60_000);
    let status: PoolStatus = await pool.query(poolStatusQuery);
    expect(status.instances.map((i) => [i.id, i.phase, i.leases])).toEqual([[gone, 'ready', 1]]);
    expect(status.lastError).toBeNull();
    let history = await events();
    expect(scheduled(history, 'describeInstance')).toHaveLength(0);
    const watchers = scheduled(history, 'watchInstance');
    expect(watchers.length).toBeGreaterThanOrEqual(2);
    expect(watchers.every((w) => w.activityTaskScheduledEventAttributes?.taskQueue?.name === queue)).toBe(true);
    expect(scheduled(history, 'destroyInstance')).toHaveLength(0);

    // The worker stops (its advert withdrawn): the instance is lost, stopped, and its session waits
    // for a new lease, so the pool starts an instance on the worker that lives.
    clearInterval(refresh);
    await registry.withdrawRuntime(worker);
    await until('the instance dropped', async () => !(status = await pool.query(poolStatusQuery)).instances.some((i) => i.id === gone), 30_000);
    expect(status.lastError).toBe(`the worker running instance ${gone} is gone (its runtime advert is withdrawn)`);
    await until('a destroy and a start', async () => {
      history = await events();
      return scheduled(history, 'destroyInstance').length >= 1 && scheduled(history, 'createInstance').length >= 1;
    }, 30_000);
    expect(scheduled(history, 'destroyInstance')[0]!.activityTaskScheduledEventAttributes?.taskQueue?.name).toBe(queue);
    await until('the new instance ready', async () => (status = await pool.query(poolStatusQuery)).instances.some((i) => i.id === `${MODEL}-101` && i.phase === 'ready'), 120_000);
    await recordHistory('pool-owner-confirmed', pool);
  } finally {
    clearInterval(refresh);
  }
}, 180_000);

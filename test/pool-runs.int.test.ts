/**
 * The pool workflow's runs: an instance carried into a run is watched, and a watcher that its
 * worker's queue did not take in time drops the instance only once that worker's runtime advert
 * says it is gone. One real worker, real Temporal. (A busy run's carry into the next is in
 * test/serving-entries.int.test.ts.)
 */
import type { Client, WorkflowHandle } from '@temporalio/client';
import { type temporal } from '@temporalio/proto';
import { randomBytes } from 'node:crypto';
import type { NatsConnection } from 'nats';
import { consumerNameOf, dataPlaneNames } from '../dataplane';
import { openModelRegistry, type ModelRegistry } from '../dataplane/registry';
import { poolQueueFor, runtimeQueueFor } from '../shared/constants';
import type { SessionEntry } from '../shared/serving';
import type { PoolCarry } from '../workflows/pool/state';
import { poolStatusQuery, poolWorkflowId, type PoolInput, type PoolStatus } from '../workflows/pool/definitions';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { isolation, recordHistory, workerConfig } from './harness';
import { magusStack, TestStack } from './harness/stack';
import { until } from './harness/wait';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
/** A model of its own (its isolation id), and so pool workflow ids no other test file uses. */
const MODEL = `rtiny-${iso.id}`;
const cfgOf = (dir: string) => workerConfig(iso, dir);

let dir: string;
let nc: NatsConnection;
let client: Client;
let registry: ModelRegistry;
const pools: WorkflowHandle[] = [];
const stack = new TestStack();

beforeAll(async () => {
  const magus = await stack.open(magusStack(iso, { dirPrefix: 'magus-pool-runs-' }));
  ({ dir, nc, client } = magus);
  registry = await openModelRegistry(nc, names.modelsBucket);
  await publishTinyGguf({ dir, s3: magus.s3, bucket: iso.bucket, registry, name: MODEL });
  stack.defer(async () => {
    for (const p of pools) await p.terminate().catch(() => undefined);
  });
}, 180_000);

afterAll(() => stack.close(), 60_000);

type HistoryEvent = temporal.api.history.v1.IHistoryEvent;
const scheduled = (events: HistoryEvent[], name: string) => events.filter((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === name);

test('a watcher its worker’s queue did not take in time: the instance stays while the worker’s advert is fresh, and is dropped (and replaced) once it is withdrawn', async () => {
  const cfg = cfgOf(dir);
  const worker = `fake-${randomBytes(3).toString('hex')}`;
  const queue = runtimeQueueFor(cfg.taskQueue, worker);
  const advertise = () => registry.advertiseRuntime({ worker, runtime: 'local', formats: ['gguf'], at: Date.now() });
  await advertise();
  const refresh = setInterval(() => void advertise(), 1000);
  try {
    const gone = `${MODEL}-100`;
    // The carry's next id is 101; an instance started now is named with a random tag as well
    // (UNIQUE_INSTANCE_IDS_PATCH): another namespace's model of this name counts from 1 alike.
    const fresh = new RegExp(`^${MODEL}-101-[0-9a-f]{8}$`);
    // A conversation on it, as a gateway writes it: the pool's reconciler counts it.
    const sessions = await nc.jetstream().views.kv(names.sessionsBucket);
    const entry: SessionEntry = {
      subject: 'magus.req.nobody',
      pool: MODEL,
      namespace: 'default',
      instance: gone,
      expiresAt: Date.now() + 600_000,
      placedAt: Date.now(),
    };
    await sessions.put('conv-fake', new TextEncoder().encode(JSON.stringify(entry)));
    const carry: PoolCarry = {
      instances: [{ id: gone, subject: 'magus.req.nobody', leases: 0, pending: 0, ackPending: 0, idleSince: 0, runtimeQueue: queue }],
      nextId: 101,
      startFailures: 0,
      nextStartAt: 0,
      lastError: null,
      demand: {},
    };
    const input: PoolInput = {
      namespace: 'default',
      model: MODEL,
      minInstances: 1,
      maxInstances: 1,
      leasesPerInstance: 4,
      idleTimeoutMs: 600_000,
      healthCheckMs: 1000,
      ownerTimeoutMs: 1000,
    };
    const pool = await client.workflow.start('dllamaPool', {
      workflowId: `${poolWorkflowId('default', MODEL)}-carried`,
      taskQueue: poolQueueFor(cfg.taskQueue),
      args: [input, carry],
    });
    pools.push(pool);
    const events = async () => (await pool.fetchHistory()).events ?? [];

    // Nobody polls the fake worker's queue, but its advert is fresh: asked, kept, watched again.
    await until('the owner asked about twice', async () => scheduled(await events(), 'workerGone').length >= 2, 60_000);
    let status: PoolStatus = await pool.query(poolStatusQuery);
    await until('the conversation counted', async () => (status = await pool.query(poolStatusQuery)).instances[0]?.leases === 1, 30_000);
    expect(status.instances.map((i) => [i.id, i.phase, i.leases])).toEqual([[gone, 'ready', 1]]);
    expect(status.lastError).toBeNull();
    let history = await events();
    const watchers = scheduled(history, 'watchInstance');
    expect(watchers.length).toBeGreaterThanOrEqual(2);
    expect(watchers.every((w) => w.activityTaskScheduledEventAttributes?.taskQueue?.name === queue)).toBe(true);
    expect(scheduled(history, 'destroyInstance')).toHaveLength(0);

    // The worker stops (its advert withdrawn): the instance is lost, stopped, and the pool starts
    // another on the worker that lives (its minimum); gateways move the conversation on its next turn.
    clearInterval(refresh);
    await registry.withdrawRuntime(worker);
    await until('the instance dropped', async () => !(status = await pool.query(poolStatusQuery)).instances.some((i) => i.id === gone), 30_000);
    expect(status.lastError).toBe(`the worker running instance ${gone} is gone (its runtime advert is withdrawn)`);
    await until(
      'a destroy and a start',
      async () => {
        history = await events();
        return scheduled(history, 'destroyInstance').length >= 1 && scheduled(history, 'createInstance').length >= 1;
      },
      30_000,
    );
    expect(scheduled(history, 'destroyInstance')[0]!.activityTaskScheduledEventAttributes?.taskQueue?.name).toBe(queue);
    await until(
      'the new instance ready',
      async () => (status = await pool.query(poolStatusQuery)).instances.some((i) => fresh.test(i.id) && i.phase === 'ready'),
      120_000,
    );
    // Started with the pool's leases per instance, and its engine serves that many at once (a
    // slot per lease), not the 16 slots the tiny model's memory plan fits in the default budget.
    const [started] = scheduled(history, 'createInstance');
    const created = JSON.parse(Buffer.from(started!.activityTaskScheduledEventAttributes!.input!.payloads![0]!.data!).toString()) as {
      instance: string;
      leases: number;
    };
    expect([fresh.test(created.instance), created.leases]).toEqual([true, 4]);
    const consumer = await (await nc.jetstreamManager()).consumers.info(names.requestStream, consumerNameOf(MODEL, created.instance));
    expect(consumer.config.max_ack_pending).toBe(4);
    await recordHistory('pool-owner-confirmed', pool);
    await recordHistory('pool-instance-ids-unique', pool);
    await sessions.delete('conv-fake');
  } finally {
    clearInterval(refresh);
  }
}, 180_000);

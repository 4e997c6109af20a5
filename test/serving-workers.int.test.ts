/**
 * Two `magus worker`s on one task queue, each with its own local runtime: an instance's watcher
 * and its destroy go to the worker that runs it (its runtime queue), so the other worker
 * never reports it dead; when its worker goes away, the pool counts it gone and starts another
 * on the worker left.
 */
import type { Client } from '@temporalio/client';
import { dataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import type { RunningWorkers } from '../workers/worker';
import { poolStatusQuery, poolWorkflowId, type PoolInput, type PoolStatus } from '../workflows/pool/definitions';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { isolation, recordHistory, workerConfig } from './harness';
import { magusStack, poolTerminated, TestStack, workersStack } from './harness/stack';
import { sleep, until } from './harness/wait';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
/** A model of its own (its isolation id), and so a pool workflow id no other test file uses. */
const MODEL = `wtiny-${iso.id}`;

let dir: string;
let client: Client;
let a: RunningWorkers | undefined;
let b: RunningWorkers | undefined;
const stack = new TestStack();

beforeAll(async () => {
  const magus = await stack.open(magusStack(iso, { dirPrefix: 'magus-workers-' }));
  ({ dir, client, workers: a } = magus);
  ({ workers: b } = await stack.open(workersStack(iso, dir)));
  await publishTinyGguf({ dir, s3: magus.s3, bucket: iso.bucket, registry: await openModelRegistry(magus.nc, names.modelsBucket), name: MODEL });
  stack.defer(poolTerminated(client, MODEL));
}, 180_000);

afterAll(() => stack.close(), 60_000);

const readyInstances = (s: PoolStatus) => s.instances.filter((i) => i.phase === 'ready').map((i) => i.id);

test('an instance is watched on the worker that runs it; when that worker goes, the pool replaces the instance on the other', async () => {
  const input: PoolInput = {
    namespace: 'default',
    model: MODEL,
    minInstances: 1,
    maxInstances: 1,
    leasesPerInstance: 4,
    idleTimeoutMs: 600_000,
    healthCheckMs: 250,
    ownerTimeoutMs: 2_000,
  };
  const pool = await client.workflow.start('dllamaPool', {
    workflowId: poolWorkflowId('default', MODEL),
    taskQueue: workerConfig(iso, dir).taskQueue,
    args: [input],
  });
  let status: PoolStatus = await pool.query(poolStatusQuery);
  await until('a ready instance', async () => readyInstances((status = await pool.query(poolStatusQuery))).length === 1, 120_000);
  const first = readyInstances(status)[0]!;
  const owner = (await a!.runtime.describe(MODEL, first)) ? a! : b!;
  const other = owner === a ? b! : a!;
  expect(await other.runtime.describe(MODEL, first)).toBeNull(); // the other worker knows nothing of it

  // One long-running watcher, on the owner's queue, heartbeating: had it run on the other worker it
  // would have found no such instance and the pool would have dropped it.
  const scheduled = async (name: string) =>
    (await pool.fetchHistory()).events!.filter((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === name);
  await until(
    'the watcher heartbeating',
    async () => {
      const pending = (await pool.describe()).raw.pendingActivities ?? [];
      return pending.some((p) => p.activityType?.name === 'watchInstance' && p.heartbeatDetails != null);
    },
    30_000,
  );
  await sleep(3000); // twelve of its health-check intervals: still the one watcher
  const watchers = await scheduled('watchInstance');
  expect(watchers).toHaveLength(1);
  expect(watchers[0]!.activityTaskScheduledEventAttributes?.taskQueue?.name).toBe(owner.runtimeQueue);
  status = await pool.query(poolStatusQuery);
  expect(status.instances.map((i) => [i.id, i.phase])).toEqual([[first, 'ready']]);
  expect(status.lastError).toBeNull();

  // Its worker goes away (its engine with it): the watcher's heartbeats stop, its retry finds
  // nobody on that worker's queue, and the instance is replaced on the worker left.
  await owner.shutdown();
  if (owner === a) a = undefined;
  else b = undefined;
  await until(
    'a new instance on the other worker',
    async () => {
      const ids = readyInstances((status = await pool.query(poolStatusQuery)));
      return ids.length === 1 && ids[0] !== first;
    },
    120_000,
  );
  const second = readyInstances(status)[0]!;
  expect((await other.runtime.describe(MODEL, second))?.healthy).toBe(true);
  expect(status.instances.map((i) => i.id)).not.toContain(first);
  await recordHistory('pool-watch-owner-gone', pool);
}, 300_000);

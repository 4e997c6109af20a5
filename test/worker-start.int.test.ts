/**
 * How a `magus worker` process starts:
 * - quiet about what is expected: neither the Temporal SDK's "No workflows registered" (its
 *   pipeline and runtime queues have activities only) nor the AWS SDK's NodeVersionSupportWarning,
 *   while it still prints its own start line;
 * - with Temporal unreachable: it serves `/healthz`, `/readyz` (200 `degraded: …`) and `/metrics`
 *   at once and tries again with a capped backoff (counted here, by its lines and by the TCP
 *   connections a listener on Temporal's port sees), then — once a Temporal dev server of this
 *   file's own starts on that port — polls its queues and runs a pool workflow and its activity;
 * - a SIGTERM while it waits for Temporal ends it at once, exit 0.
 */
import { Client, Connection } from '@temporalio/client';
import { spawn, type ChildProcess } from 'node:child_process';
import { createServer } from 'node:net';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import { dataPlaneNames } from '../dataplane';
import { freePort, startServices, type RunningServices } from '../workers/dev/services';
import type { dllamaPool } from '../workflows/pool/pool';
import { poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import { endpoint, isolation, natsConnect, workerEnv } from './harness';
import { s3Stack, tempDir, TestStack } from './harness/stack';
import { sleep, until } from './harness/wait';

const iso = isolation();
const spawned: ChildProcess[] = [];
/** The bucket, and what the tests open (a folder, a Temporal server, clients). */
const stack = new TestStack();

beforeAll(async () => {
  await stack.open(s3Stack(iso));
});

afterAll(async () => {
  for (const w of spawned) if (w.exitCode === null && w.signalCode === null) w.kill('SIGKILL');
  await stack.close();
}, 60_000);

interface WorkerProcess {
  proc: ChildProcess;
  stderr(): string;
  exited: Promise<number | null>;
  /** `/healthz`, `/readyz`, `/metrics` on its health address. */
  get(path: string): Promise<{ status: number; text: string }>;
}

function startWorker(temporalAddress: string, healthPort: number, extraEnv: NodeJS.ProcessEnv = {}): WorkerProcess {
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    ...workerEnv(iso),
    MAGUS_TEMPORAL_ADDRESS: temporalAddress,
    MAGUS_HEALTH_ADDRESS: `127.0.0.1:${healthPort}`,
    // Not using any leftover dev's connection.
    MAGUS_DEV_DATA_DIR: join(__dirname, 'no-such-dev'),
    ...extraEnv,
  };
  delete env.AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED;
  delete env.NODE_NO_WARNINGS;
  const proc = spawn(
    process.execPath,
    ['-r', require.resolve('@swc-node/register'), '-e', "require('./workers/magus').main(['worker']).then((c) => process.exit(c))"],
    {
      cwd: join(__dirname, '..'),
      stdio: ['ignore', 'ignore', 'pipe'],
      env,
    },
  );
  spawned.push(proc);
  let stderr = '';
  proc.stderr.setEncoding('utf8');
  proc.stderr.on('data', (d: string) => (stderr += d));
  const exited = new Promise<number | null>((resolve) => proc.once('exit', (code) => resolve(code)));
  return {
    proc,
    stderr: () => stderr,
    exited,
    async get(path) {
      const res = await fetch(`http://127.0.0.1:${healthPort}${path}`);
      return { status: res.status, text: await res.text() };
    },
  };
}

/** Until `/readyz` answers 200 `degraded: Temporal unreachable for N s` (the process compiles its TypeScript first: seconds). */
async function untilDegraded(w: WorkerProcess): Promise<void> {
  await until(
    'the worker says degraded',
    async () => {
      if (w.proc.exitCode !== null) throw new Error(`the worker exited (${w.proc.exitCode}):\n${w.stderr()}`);
      const r = await w.get('/readyz').catch(() => undefined);
      return r?.status === 200 && r.text.startsWith('degraded: Temporal unreachable for ');
    },
    60_000,
  );
}

const metric = (text: string, name: string): number | undefined => {
  const line = text.split('\n').find((l) => l.startsWith(`${name} `));
  return line === undefined ? undefined : Number(line.slice(name.length + 1));
};
const attemptLines = (stderr: string): string[] => stderr.split('\n').filter((l) => /is unreachable \(attempt \d+: /.test(l));

test('a worker start prints neither "No workflows registered" nor the AWS SDK Node-version notice', async () => {
  const w = startWorker(endpoint('temporal').address, await freePort());
  const deadline = Date.now() + 60_000;
  while (!w.stderr().includes('magus worker: polling') && Date.now() < deadline && w.proc.exitCode === null) await sleep(100);
  expect(w.stderr()).toContain('magus worker: polling');
  // The warnings come once the workers run their pollers, just after the start line.
  await sleep(2000);
  w.proc.kill('SIGTERM');
  expect(await w.exited).toBe(0);
  expect(w.stderr()).not.toContain('No workflows registered');
  expect(w.stderr()).not.toContain('NodeVersionSupportWarning');
  // Temporal answered the first attempt: nothing said about waiting.
  expect(attemptLines(w.stderr())).toEqual([]);
}, 90_000);

test('started while Temporal is unreachable: degraded at once, a bounded number of attempts, then it polls and runs a workflow once Temporal is up', async () => {
  const { dir } = stack.open(tempDir('magus-worker-start-'));
  // Temporal's port: nothing listens on it yet.
  const port = await freePort();
  const address = `127.0.0.1:${port}`;
  const w = startWorker(address, await freePort());
  const t0 = Date.now();

  // Health endpoints and metrics while it waits; a clear line per failed attempt, no stack.
  await untilDegraded(w);
  const degradedAfter = Date.now() - t0;
  expect(await w.get('/healthz')).toEqual({ status: 200, text: 'ok\n' });
  const metrics = (await w.get('/metrics')).text;
  expect(metric(metrics, 'magus_worker_temporal_reachable')).toBe(0);
  expect(metric(metrics, 'magus_worker_temporal_probe_failures_total')).toBeGreaterThanOrEqual(1);
  expect(metric(metrics, 'magus_worker_cached_workflows')).toBeUndefined(); // no Temporal worker yet
  const [first] = attemptLines(w.stderr());
  expect(first).toBe(
    `magus worker: Temporal at ${address} is unreachable (attempt 1: No connection established. Last error: connect ECONNREFUSED ${address}); next attempt in 1 s, the task queues are polled once it answers`,
  );
  expect(w.stderr()).not.toMatch(/^\s+at /m);

  // A listener on the port that drops every connection (a Temporal not up yet) counts the
  // attempts that reach it: 1 s, 2 s, then 3 s apart — never a hot loop.
  let connections = 0;
  const counter = createServer((s) => {
    connections++;
    s.destroy();
  });
  await new Promise<void>((r) => counter.listen(port, '127.0.0.1', r));
  const countFrom = attemptLines(w.stderr()).length;
  const COUNT_MS = 9_000;
  await sleep(COUNT_MS);
  await new Promise<void>((r) => counter.close(() => r()));
  const countedLines = attemptLines(w.stderr()).length - countFrom;
  // gRPC's reconnects: 1 s, 1.6 s, 2.6 s, then 3 s apart (±20 %); the attempts: 1 s, 2 s, then 3 s apart.
  expect(connections).toBeGreaterThanOrEqual(2);
  expect(connections).toBeLessThanOrEqual(6);
  expect(countedLines).toBeLessThanOrEqual(5);
  expect(Math.abs(connections - countedLines)).toBeLessThanOrEqual(2);
  expect((await w.get('/readyz')).text).toMatch(/^degraded: Temporal unreachable for \d+ s\n$/);
  expect(w.proc.exitCode).toBeNull();

  // Temporal starts on that port: the worker polls, says ok, and runs workflows and activities.
  const downMs = Date.now() - t0;
  const attemptsWhileDown = attemptLines(w.stderr()).length;
  // 1 s, 2 s, then every 3 s after the first failure (which came within `degradedAfter`).
  expect(attemptsWhileDown).toBeLessThanOrEqual(3 + Math.ceil(downMs / 3_000));
  const services: RunningServices = await startServices({
    services: ['temporal'],
    dataDir: join(dir, 'services'),
    log: () => undefined,
    portPicker: async ({ role }) => (role === 'frontend' ? port : freePort()),
  });
  stack.defer(() => services.stop());
  expect(services.endpoints.temporal!.address).toBe(address);
  const upAt = Date.now();
  const answers = new RegExp(`Temporal at ${address.replace(/\./g, '\\.')} answers, after \\d+ failed attempts in \\d+ s`);
  await until('the worker sees Temporal', () => answers.test(w.stderr()) || w.proc.exitCode !== null, 30_000);
  const answeredAfter = Date.now() - upAt;
  expect(answeredAfter).toBeLessThan(8_000); // its channel reconnects ≤ 3 s apart (±20 %), and the attempt follows at once
  // Then as any start: search attributes, the workers (the workflow bundle takes seconds).
  await until('the worker polls', () => w.stderr().includes('magus worker: polling') || w.proc.exitCode !== null, 60_000);
  expect(w.proc.exitCode).toBeNull();
  const pollingAfter = Date.now() - upAt;
  expect(await w.get('/readyz')).toEqual({ status: 200, text: 'ok\n' });
  const after = (await w.get('/metrics')).text;
  expect(metric(after, 'magus_worker_temporal_reachable')).toBe(1);
  // The counter carries on from the start's attempts (a Prometheus counter never goes back).
  expect(metric(after, 'magus_worker_temporal_probe_failures_total')).toBeGreaterThanOrEqual(attemptLines(w.stderr()).length);

  // The cheapest real work: a pool with no instance runs its first workflow task (with the
  // MagusPhase search attribute this worker registered on a server that had only the other two)
  // and its writePool activity, which publishes the pool's (empty) view to NATS.
  const connection = await Connection.connect({ address });
  stack.defer(() => connection.close());
  const client = new Client({ connection });
  const model = `worker-start-${iso.id}`;
  const handle = await client.workflow.start<typeof dllamaPool>('dllamaPool', {
    workflowId: poolWorkflowId('default', model),
    taskQueue: `${iso.id}-control`,
    args: [{ namespace: 'default', model, minInstances: 0, maxInstances: 1, leasesPerInstance: 1, idleTimeoutMs: 60_000 }],
  });
  const startedAt = Date.now();
  const nc: NatsConnection = await natsConnect();
  stack.defer(() => nc.drain());
  const pools = await nc.jetstream().views.kv(dataPlaneNames(iso.natsPrefix).poolsBucket);
  await until('the pool publishes its view', async () => (await pools.get(`default.${model}`)) !== null, 30_000);
  const publishedAfter = Date.now() - startedAt;
  expect(await handle.query(poolStatusQuery)).toMatchObject({ instances: [], lastError: null });
  // The pool, running, is in the SDK's cache: its state lives in the workflow threads.
  expect(metric((await w.get('/metrics')).text, 'magus_worker_cached_workflows')).toBe(1);
  await handle.terminate('test over');

  process.stderr.write(
    `worker start with Temporal down: degraded ${degradedAfter} ms after spawn; ${attemptsWhileDown} attempts in ${(downMs / 1000).toFixed(1)} s down ` +
      `(${connections} TCP connections / ${countedLines} logged in a ${COUNT_MS / 1000} s window); Temporal seen ${answeredAfter} ms and polling ${pollingAfter} ms after it was up; pool view published ${publishedAfter} ms after the start\n`,
  );

  w.proc.kill('SIGTERM');
  expect(await w.exited).toBe(0);
}, 180_000);

test('a SIGTERM while it waits for Temporal ends it at once, exit 0', async () => {
  const w = startWorker(`127.0.0.1:${await freePort()}`, await freePort());
  await untilDegraded(w);
  const t = Date.now();
  w.proc.kill('SIGTERM');
  expect(await w.exited).toBe(0);
  const stoppedIn = Date.now() - t;
  expect(stoppedIn).toBeLessThan(3_000);
  expect(w.stderr()).toContain('magus worker: stopped before Temporal answered');
  expect(w.stderr()).not.toMatch(/^\s+at /m);
  process.stderr.write(`worker SIGTERMed while waiting for Temporal: exit 0 in ${stoppedIn} ms\n`);
}, 90_000);

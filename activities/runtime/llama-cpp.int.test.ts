/**
 * The local runtime's llama.cpp instances against the real nats-server and S3 store, with a real
 * `magus engine` on the tiny synthetic model: an engine that dies is restarted in place (same
 * port, so the in-process bridge and the requests queued for the instance carry on), and one that
 * keeps dying is given up, which `describe` reports for the pool to replace it.
 */
import type { S3Client } from '@aws-sdk/client-s3';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import { publishTinyGguf } from '../../test/fixtures/tiny-gguf';
import { isolation } from '../../test/harness';
import { askInstance } from '../../test/harness/data-plane';
import { runtimeStack, TestStack } from '../../test/harness/stack';
import { processRunning, sleep, until } from '../../test/harness/wait';
import { bridgeMetricsText } from '../../dataplane/bridge';
import { consumerNameOf, type DataPlaneNames } from '../../dataplane';
import { openModelRegistry, type ModelRegistry } from '../../dataplane/registry';
import { engineSizing, servedGguf } from '../../shared/engine-slots';
import { LocalRuntime, type LocalRuntimeOptions } from './local';

const POOL = 'tiny';

let nc: NatsConnection;
let s3: S3Client;
let names: DataPlaneNames;
let dir: string;
let bucket: string;
let rt: LocalRuntime;
const logs: string[] = [];
const stack = new TestStack();

/** Waits like `until`, with the runtime's log (`log`, default this file's runtime's) in the error when it times out. */
const untilLogged = (what: string, cond: () => boolean | Promise<boolean>, timeoutMs = 60_000, log: readonly string[] = logs): Promise<void> =>
  until(() => `${what}; runtime log:\n${log.join('\n')}`, cond, timeoutMs);

beforeAll(async () => {
  const iso = isolation();
  let registry: ModelRegistry;
  ({ nc, names, registry, s3, dir } = await stack.open(runtimeStack(iso, { dirPrefix: 'magus-llama-cpp-' })));
  bucket = iso.bucket;
  await publishTinyGguf({ dir, s3, bucket: iso.bucket, registry, name: POOL, seed: 7 });
  // One restart allowed per window: the second death is a crash loop.
  rt = new LocalRuntime({
    nc,
    names,
    registry,
    s3,
    bucket: iso.bucket,
    cacheDir: join(dir, 'cache'),
    restart: { maxRestarts: 1, backoffMs: 100 },
    log: (l) => logs.push(l),
  });
  stack.defer(() => rt.stopAll());
}, 120_000);

afterAll(() => stack.close());

/** Another runtime on this file's servers and cache, with `settings`. */
async function runtimeWith(settings: Partial<LocalRuntimeOptions>): Promise<LocalRuntime> {
  return new LocalRuntime({ nc, names, registry: await openModelRegistry(nc, names.modelsBucket), s3, bucket, cacheDir: join(dir, 'cache'), ...settings });
}

test('a dead engine is restarted on its port and serves the instance again; a crash loop is given up and reported', async () => {
  const info = await rt.create({ namespace: 'default', model: POOL, pool: POOL, instance: 'tiny-1' }, new AbortController().signal);
  expect(info.healthy).toBe(true);
  const before = rt.processes(POOL, 'tiny-1')![0]!;
  expect(before).toMatchObject({ role: 'engine', running: true });
  const greedy = { max_tokens: 4, temperature: 0, stream: false };
  const first = await askInstance(nc, names, POOL, 'tiny-1', greedy);
  expect(first.text.length).toBeGreaterThan(0);
  // The worker's /metrics reports the instance's in-process bridge (it acks once the answer's frames are stored, just after the client has them).
  await untilLogged('the answer acked', () => rt.bridges()[0]?.stats.acked === 1);
  expect(rt.bridges().map((b) => ({ pool: b.pool, instance: b.instance, pulled: b.stats.pulled, acked: b.stats.acked }))).toEqual([
    { pool: POOL, instance: 'tiny-1', pulled: 1, acked: 1 },
  ]);
  expect(bridgeMetricsText(rt.bridges())).toContain(`magus_bridge_acked_total{pool="${POOL}",instance="tiny-1"} 1`);

  // Killed from outside (OOM killer, crash): a new process on the same port, same instance.
  process.kill(before.pid!, 'SIGKILL');
  // A request sent while it is down waits in the instance's consumer or is retried by the bridge.
  const during = askInstance(nc, names, POOL, 'tiny-1', greedy, 60_000);
  await untilLogged('the engine restarted', () => {
    const p = rt.processes(POOL, 'tiny-1')![0]!;
    return p.pid !== before.pid && p.running;
  });
  const after = rt.processes(POOL, 'tiny-1')![0]!;
  expect(after.port).toBe(before.port);
  expect((await rt.describe(POOL, 'tiny-1'))?.healthy).toBe(true);
  expect((await during).text).toBe(first.text); // greedy: the same answer from the new process
  expect((await askInstance(nc, names, POOL, 'tiny-1', greedy)).text).toBe(first.text);
  expect(logs.some((l) => /restarting it on port/.test(l))).toBe(true);

  // It dies again within the window: no more restarts; the pool learns it from describe.
  process.kill(after.pid!, 'SIGKILL');
  await untilLogged('given up', async () => (await rt.describe(POOL, 'tiny-1'))?.healthy === false);
  await sleep(500);
  expect(rt.processes(POOL, 'tiny-1')![0]!.running).toBe(false);
  expect(logs.some((l) => /giving up/.test(l))).toBe(true);

  // The pool replaces it: creating the same id again starts a healthy instance.
  const again = await rt.create({ namespace: 'default', model: POOL, pool: POOL, instance: 'tiny-1' }, new AbortController().signal);
  expect(again.healthy).toBe(true);
  expect((await askInstance(nc, names, POOL, 'tiny-1', greedy)).text).toBe(first.text);
}, 180_000);

test.each(['mapped', 'warm'] as const)(
  "with an engine on standby (%s), started beside the engine's load, a dead engine is replaced by it at once, on its port; another waits after, and replaces a standby killed; none is left once stopped",
  async (kind) => {
    const standbyLogs: string[] = [];
    // A backoff far longer than the restart: the restart that comes sooner is the standby's.
    const warm = await runtimeWith({ restart: { backoffMs: 30_000 }, standby: kind, log: (l) => standbyLogs.push(l), output: (l) => standbyLogs.push(l) });
    const said = kind === 'warm' ? ', warm,' : '';
    const waiting = () =>
      standbyLogs
        .flatMap((l) => new RegExp(`waits on standby${said} for port (\\d+) \\(pid (\\d+)\\)`).exec(l) ?? [])
        .filter((_, i) => i % 3 === 2)
        .map(Number);
    try {
      await warm.create({ namespace: 'default', model: POOL, pool: POOL, instance: 'warm-1' }, new AbortController().signal);
      const before = warm.processes(POOL, 'warm-1')![0]!;
      // The first standby starts as soon as the engine listens, beside its load (not once it serves).
      const startedAt = standbyLogs.findIndex((l) => l.includes(`starting an engine on standby${said} for port ${before.port} beside its load`));
      const readyAt = standbyLogs.findIndex((l) => /magus engine: ready:/.test(l));
      expect(startedAt).toBeGreaterThan(standbyLogs.findIndex((l) => l.includes(`listening on http://127.0.0.1:${before.port}`)));
      expect(startedAt).toBeLessThan(readyAt);
      const greedy = { max_tokens: 4, temperature: 0, stream: false };
      const first = await askInstance(nc, names, POOL, 'warm-1', greedy);
      await untilLogged('an engine on standby', () => waiting().length === 1, 60_000, standbyLogs);
      const [standbyPid] = waiting();
      expect(processRunning(standbyPid!)).toBe(true);
      expect(standbyLogs.find((l) => l.includes('waits on standby'))).toContain(`for port ${before.port}`);

      process.kill(before.pid!, 'SIGKILL');
      await untilLogged(
        'the standby serving',
        () => {
          const p = warm.processes(POOL, 'warm-1')![0]!;
          return p.pid !== before.pid && p.running;
        },
        30_000,
        standbyLogs,
      );
      const after = warm.processes(POOL, 'warm-1')![0]!;
      expect(after).toMatchObject({ pid: standbyPid, port: before.port });
      expect(standbyLogs.some((l) => new RegExp(`restarting it on port ${before.port} in 0 ms`).test(l))).toBe(true);
      expect((await askInstance(nc, names, POOL, 'warm-1', greedy)).text).toBe(first.text);
      await untilLogged('another engine on standby', () => waiting().length === 2, 60_000, standbyLogs);
      const [, nextPid] = waiting();
      expect(nextPid).not.toBe(standbyPid);

      // The standby itself killed while it waits (the OOM killer's pick): another replaces it, a second later.
      process.kill(nextPid!, 'SIGKILL');
      await untilLogged('a third engine on standby', () => waiting().length === 3, 60_000, standbyLogs);
      const [, , thirdPid] = waiting();
      expect(standbyLogs).toContainEqual(expect.stringMatching(/the engine on standby was killed by SIGKILL; another in 1000 ms/));
      expect(warm.processes(POOL, 'warm-1')![0]!).toMatchObject({ pid: after.pid, running: true });
      expect((await askInstance(nc, names, POOL, 'warm-1', greedy)).text).toBe(first.text);

      await warm.stopAll();
      expect([after.pid!, nextPid!, thirdPid!].filter(processRunning)).toEqual([]);
    } finally {
      await warm.stopAll();
    }
  },
  180_000,
);

test('an engine gets the slots and context its memory plan gives within the instance budget, and so does its consumer', async () => {
  const ready = await publishTinyGguf({
    dir,
    s3,
    bucket,
    registry: await openModelRegistry(nc, names.modelsBucket),
    name: 'planned',
    seed: 7,
    memoryPlan: { contextLength: 512 },
  });
  const plan = servedGguf(ready)!.plan!;
  // A budget for 3 slots: the plan's weights and buffers plus four slots' KV cache (one is the resume sequence).
  const kvPerSlot = engineSizing(plan, 2 ** 40).kvCachePerSlot;
  const budget = plan.root.weights + plan.root.buffers + 4 * kvPerSlot + kvPerSlot / 2;
  const sized = await runtimeWith({ instanceMemory: budget, log: (l) => logs.push(l) });
  try {
    await sized.create({ namespace: 'default', model: 'planned', pool: 'planned', instance: 'planned-1' }, new AbortController().signal);
    const argv = sized.processes('planned', 'planned-1')![0]!.argv;
    expect(argv.slice(argv.indexOf('--slots'), argv.indexOf('--slots') + 2)).toEqual(['--slots', '3']);
    expect(argv.slice(argv.indexOf('--ctx'), argv.indexOf('--ctx') + 2)).toEqual(['--ctx', String(Math.min(512, plan.contextLength))]);
    const consumer = await (await nc.jetstreamManager()).consumers.info(names.requestStream, consumerNameOf('planned', 'planned-1'));
    expect(consumer.config.max_ack_pending).toBe(3);
    expect(sized.bridges()[0]?.health.slots).toBe(3);
    expect((await askInstance(nc, names, 'planned', 'planned-1', { max_tokens: 2, temperature: 0, stream: false })).text.length).toBeGreaterThan(0);
  } finally {
    await sized.stopAll();
  }
}, 120_000);

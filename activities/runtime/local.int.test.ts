/**
 * The local runtime leaves nothing running that nobody can destroy, against the real
 * nats-server and S3 store and a real `magus engine`: `destroy` during a start, the caller's
 * cancellation during a start (one of two joined callers, then both), and a cancellation during
 * the model's download from S3. An engine is held "still loading" by SIGSTOP, so the abort
 * always lands before it is ready; a download is held midway by a proxy that stops passing S3's
 * answer after its first bytes.
 */
import { PutObjectCommand, S3Client } from '@aws-sdk/client-s3';
import { createHash } from 'node:crypto';
import { CancelledFailure } from '@temporalio/common';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import { splitGguf } from '../../test/fixtures/split-gguf';
import { publishTinyGguf } from '../../test/fixtures/tiny-gguf';
import { askInstance } from '../../test/harness/data-plane';
import { endpoint, isolation } from '../../test/harness';
import { runtimeStack, TestStack } from '../../test/harness/stack';
import { startTcpProxy } from '../../test/harness/tcp-proxy';
import { processesUsing, processRunning, until } from '../../test/harness/wait';
import type { DataPlaneNames } from '../../dataplane';
import type { ModelRegistry } from '../../dataplane/registry';
import type { InstanceInfo } from './runtime';
import { LocalRuntime } from './local';

const POOL = 'tiny';

let nc: NatsConnection;
let s3: S3Client;
let names: DataPlaneNames;
let registry: ModelRegistry;
let bucket: string;
let dir: string;
let modelBytes: number;
const runtimes: LocalRuntime[] = [];
const logs: string[] = [];
const stack = new TestStack();

function runtime(cacheDir: string, s3Of: S3Client = s3): LocalRuntime {
  const r = new LocalRuntime({ nc, names, registry, s3: s3Of, bucket, cacheDir, startTimeoutSec: 60, log: (l) => logs.push(l) });
  runtimes.push(r);
  return r;
}

const request = (instance: string) => ({ namespace: 'default', model: POOL, pool: POOL, instance });

/** The outcome of `p` once it settles, and whether it has; never rejects. */
function watch(p: Promise<InstanceInfo>): { settled: () => boolean; outcome: Promise<InstanceInfo | Error> } {
  let settled = false;
  const outcome = p.then(
    (info) => ((settled = true), info),
    (err: Error) => ((settled = true), err),
  );
  return { settled: () => settled, outcome };
}

/** Starts `instance` and waits for its engine process, then freezes it before it can report ready. */
async function startFrozen(rt: LocalRuntime, cacheDir: string, instance: string, signal: AbortSignal) {
  const create = watch(rt.create(request(instance), signal));
  await until('the engine process', () => processesUsing(cacheDir).length > 0 || create.settled(), 60_000);
  const [pid] = processesUsing(cacheDir);
  if (pid !== undefined) process.kill(pid, 'SIGSTOP');
  // The premise of the test: the start is still under way.
  if (create.settled()) {
    const outcome = await create.outcome;
    throw new Error(`create settled before its engine could be held: ${outcome instanceof Error ? outcome.message : JSON.stringify(outcome)}`);
  }
  return { create, pid: pid! };
}

beforeAll(async () => {
  const iso = isolation();
  ({ nc, names, registry, s3, dir } = await stack.open(runtimeStack(iso, { dirPrefix: 'magus-local-' })));
  bucket = iso.bucket;
  const ready = await publishTinyGguf({ dir, s3, bucket, registry, name: POOL, seed: 7 });
  modelBytes = ready.artifacts[0]!.files[0]!.bytes;
}, 120_000);

afterEach(async () => {
  // Whatever a failing test left behind (a frozen engine would otherwise wait for its deadline).
  for (const pid of processesUsing(dir)) process.kill(pid, 'SIGKILL');
  for (const r of runtimes.splice(0)) await r.stopAll();
});

afterAll(() => stack.close());

test('destroy() while the engine is still loading: the start is aborted, its engine gone and nothing registered when destroy resolves', async () => {
  const cacheDir = join(dir, 'cache-destroy');
  const rt = runtime(cacheDir);
  const { create, pid } = await startFrozen(rt, cacheDir, 'tiny-1', new AbortController().signal);

  await rt.destroy(POOL, 'tiny-1');
  expect(processRunning(pid)).toBe(false);
  expect(processesUsing(cacheDir)).toEqual([]);
  expect(await create.outcome).toMatchObject({ name: 'InstanceDestroyed' });
  expect(await rt.describe(POOL, 'tiny-1')).toBeNull();
  expect(rt.processes(POOL, 'tiny-1')).toBeNull();
  expect(rt.bridges()).toEqual([]);

  // The id is free again: a new create starts (and serves) from scratch.
  expect(await rt.create(request('tiny-1'), new AbortController().signal)).toMatchObject({ instance: 'tiny-1', healthy: true });
  await rt.destroy(POOL, 'tiny-1');
  expect(processesUsing(cacheDir)).toEqual([]);
}, 180_000);

test("the callers' cancellation: one of two joined callers leaves and the start goes on; when the last one leaves, the start is aborted and leaves nothing", async () => {
  const cacheDir = join(dir, 'cache-cancel');
  const rt = runtime(cacheDir);
  const first = new AbortController();
  const { create, pid } = await startFrozen(rt, cacheDir, 'tiny-2', first.signal);
  // A retry of the activity on this worker joins the start under way.
  const second = new AbortController();
  const joined = watch(rt.create(request('tiny-2'), second.signal));

  // The first attempt timed out (the SDK aborts its signal with a CancelledFailure): it is
  // answered at once, and the start carries on for the second.
  first.abort(new CancelledFailure('TIMED_OUT'));
  await until('the first caller to be answered', create.settled, 30_000);
  expect(await create.outcome).toMatchObject({ name: 'CancelledFailure', message: 'TIMED_OUT' });
  expect(processRunning(pid)).toBe(true);
  expect(joined.settled()).toBe(false);

  // The second goes too: nobody waits for the start any more, so it is aborted, and the caller
  // is answered once the engine is gone.
  second.abort(new CancelledFailure('CANCELLED'));
  await until('the last caller to be answered', joined.settled, 30_000);
  expect(processRunning(pid)).toBe(false);
  expect(await joined.outcome).toMatchObject({ name: 'CancelledFailure', message: 'CANCELLED' });
  expect(processesUsing(cacheDir)).toEqual([]);
  expect(await rt.describe(POOL, 'tiny-2')).toBeNull();
  expect(rt.processes(POOL, 'tiny-2')).toBeNull();
  expect(rt.bridges()).toEqual([]);
}, 180_000);

test('cancelled during the model download: the download stops, its temporary file is removed and nothing is cached', async () => {
  expect(modelBytes).toBeGreaterThan(64 * 1024); // so that it is held midway
  const real = endpoint('s3');
  const target = new URL(real.endpoint);
  const proxy = await startTcpProxy({ host: target.hostname, port: Number(target.port) }, '127.0.0.1', { holdAnswerAfter: 32 * 1024 });
  const slowS3 = new S3Client({
    endpoint: `http://${proxy.address}`,
    region: real.region,
    forcePathStyle: true,
    credentials: { accessKeyId: real.accessKeyId, secretAccessKey: real.secretAccessKey },
  });
  try {
    const cacheDir = join(dir, 'cache-download');
    const rt = runtime(cacheDir, slowS3);
    const signal = new AbortController();
    const create = watch(rt.create(request('tiny-3'), signal.signal));
    const partial = () => readdirSync(cacheDir, { withFileTypes: true }).filter((f) => f.name.includes('.tmp-') && statSync(join(cacheDir, f.name)).size > 0);
    await until(
      'part of the model in a temporary file',
      () => (statSync(cacheDir, { throwIfNoEntry: false }) ? partial().length > 0 : false) || create.settled(),
      30_000,
    );
    expect(create.settled()).toBe(false);

    signal.abort(new CancelledFailure('CANCELLED'));
    await until('create to be answered', create.settled, 30_000);
    expect(await create.outcome).toMatchObject({ name: 'CancelledFailure' });
    expect(readdirSync(cacheDir)).toEqual([]);
    expect(processesUsing(cacheDir)).toEqual([]);
    expect(await rt.describe(POOL, 'tiny-3')).toBeNull();
  } finally {
    slowS3.destroy();
    await proxy.close();
  }
}, 120_000);

test("a split GGUF: every part is fetched and checked, linked under llama.cpp's part names, and the engine serves the model as from the whole file", async () => {
  // The tiny model's GGUF (written by publishTinyGguf) in two parts, published as a GGUF source's artifact is.
  const parts = await splitGguf(join(dir, `${POOL}.gguf`), dir, 'Tiny.Q8_0', 2);
  const files = [];
  for (const part of parts) {
    const bytes = readFileSync(join(dir, part));
    const key = `sources/test/split/${part}`;
    await s3.send(new PutObjectCommand({ Bucket: bucket, Key: key, Body: bytes }));
    files.push({ key, bytes: bytes.length, sha256: createHash('sha256').update(bytes).digest('hex') });
  }
  const whole = (await registry.get('default', POOL))!;
  await registry.put({
    ...whole,
    name: 'split',
    artifacts: [{ format: 'gguf', weights: 'source', sourceType: 'Q8_0', converterVersion: whole.artifacts[0]!.converterVersion, files }],
  });
  const cacheDir = join(dir, 'cache-split');
  const rt = runtime(cacheDir);
  await rt.create({ namespace: 'default', model: POOL, pool: POOL, instance: 'whole' }, new AbortController().signal);
  await rt.create({ namespace: 'default', model: 'split', pool: 'split', instance: 'parts' }, new AbortController().signal);
  // Both parts cached by their sha256, and linked beside each other under the names llama.cpp looks for.
  const linked = join(cacheDir, `split-${files[0]!.sha256}`);
  expect(readdirSync(linked).sort()).toEqual(['model-00001-of-00002.gguf', 'model-00002-of-00002.gguf']);
  expect(readFileSync(join(linked, 'model-00002-of-00002.gguf')).equals(readFileSync(join(dir, parts[1]!)))).toBe(true);
  expect(processesUsing(linked)).toHaveLength(1); // the engine was given the first part
  const ask = (pool: string, instance: string) =>
    askInstance(nc, names, pool, instance, { messages: [{ role: 'user', content: 'Once upon a time' }], max_tokens: 12, temperature: 0 }, 60_000);
  const [a, b] = [await ask(POOL, 'whole'), await ask('split', 'parts')];
  expect(a.text.length).toBeGreaterThan(0);
  expect(b.text).toBe(a.text);
}, 180_000);

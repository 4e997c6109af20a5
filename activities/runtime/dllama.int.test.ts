/**
 * The local runtime with distributed-llama configured, against the real nats-server and S3
 * store, with test/fixtures/fake-dllama.js standing in for `dllama` and `dllama-api` (they parse
 * the real command lines strictly, workers listen, the root connects to every worker before it
 * serves). Requests go the production way: published to the instance's subject, answered by the
 * runtime's in-process bridge through the root's HTTP API.
 */
import { PutObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import { createHash, randomBytes } from 'node:crypto';
import { chmodSync, mkdirSync, readdirSync, readFileSync, symlinkSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import type { ChatCompletionRequest } from '../../shared/chat';
import type { ReadyModel } from '../../shared/model';
import { isolation } from '../../test/harness';
import { askInstance } from '../../test/harness/data-plane';
import { runtimeStack, TestStack } from '../../test/harness/stack';
import { requestSubjectOf, type DataPlaneNames } from '../../dataplane';
import type { ModelRegistry } from '../../dataplane/registry';
import { LocalRuntime } from './local';
import { sleep, until } from '../../test/harness/wait';

const FAKE = join(__dirname, '..', '..', 'test', 'fixtures', 'fake-dllama.js');
const POOL = 'tiny';

/** The fake binaries' folder, under `dir`. */
let bin: string;
let dir: string;
let nc: NatsConnection;
let names: DataPlaneNames;
let registry: ModelRegistry;
let s3: S3Client;
let bucket: string;
const runtimes: LocalRuntime[] = [];
const logs: string[] = [];
const stack = new TestStack();
const files = { model: randomBytes(64 * 1024), tokenizer: randomBytes(2 * 1024) };
const sha = (b: Buffer) => createHash('sha256').update(b).digest('hex');

/** Whether a process with this pid exists (a zombie counts as gone: the runtime reaps its children). */
function alive(pid: number): boolean {
  try {
    return !/^\d+ \([^)]*\) Z/.test(readFileSync(`/proc/${pid}/stat`, 'utf8'));
  } catch {
    return false;
  }
}

/** Pids of every process running a program from `folder` (the stand-ins, however they were started). */
function processesFrom(folder: string): number[] {
  return readdirSync('/proc')
    .filter((p) => /^\d+$/.test(p))
    .filter((p) => {
      try {
        return (
          readFileSync(`/proc/${p}/cmdline`, 'utf8')
            .split('\0')
            .some((a) => a.startsWith(`${folder}/`)) && alive(Number(p))
        );
      } catch {
        return false;
      }
    })
    .map(Number);
}

/** A model whose only artifact is distributed-llama q40, planned for 1, 2 and 4 nodes at context 256. */
async function registerModel(name: string): Promise<ReadyModel> {
  const prefix = `artifacts/org/${name}/abc/dllama-q40/1/`;
  for (const [file, body] of [
    ['model.m', files.model],
    ['tokenizer.t', files.tokenizer],
  ] as const) {
    await s3.send(new PutObjectCommand({ Bucket: bucket, Key: `${prefix}${file}`, Body: body }));
  }
  const node = (total: number) => ({ weights: total, kvCache: 0, buffers: 0, total });
  const ready: ReadyModel = {
    namespace: 'default',
    name,
    source: { repo: `org/${name}`, revision: 'main', sha: 'abc' },
    artifacts: [
      {
        format: 'dllama',
        weights: 'q40',
        converterVersion: '1',
        files: [
          { key: `${prefix}model.m`, bytes: files.model.length, sha256: sha(files.model) },
          { key: `${prefix}tokenizer.t`, bytes: files.tokenizer.length, sha256: sha(files.tokenizer) },
        ],
      },
    ],
    memory: [
      {
        format: 'dllama',
        weights: 'q40',
        contextLength: 256,
        topologies: [1, 2, 4].map((n) => ({ nodes: n, root: node(2 ** 20 * n), worker: n > 1 ? node(2 ** 19) : null })),
      },
    ],
    readyAt: new Date().toISOString(),
  };
  await registry.put(ready);
  return ready;
}

function runtime(dllama: { nodes: number; apiBin?: string }): LocalRuntime {
  const r = new LocalRuntime({
    nc,
    names,
    registry,
    s3,
    bucket,
    cacheDir: join(dir, 'cache'),
    dllama: {
      apiBin: dllama.apiBin ?? join(bin, 'dllama-api'),
      workerBin: join(bin, 'dllama'),
      nodes: dllama.nodes,
      threads: 2,
      stopGraceMs: 2000,
      startTimeoutSec: 60,
    },
    // One restart in place allowed per window: the second death is a crash loop.
    restart: { maxRestarts: 1, backoffMs: 100 },
    log: (l) => logs.push(l),
    output: (l) => logs.push(l),
  });
  runtimes.push(r);
  return r;
}

const ask = (instance: string, body: Partial<ChatCompletionRequest>) => askInstance(nc, names, POOL, instance, body);

beforeAll(async () => {
  const iso = isolation();
  ({ nc, names, registry, s3, dir } = await stack.open(runtimeStack(iso, { dirPrefix: 'magus-dllama-' })));
  bucket = iso.bucket;
  stack.defer(async () => {
    for (const r of runtimes) await r.stopAll();
  });
  bin = join(dir, 'bin');
  mkdirSync(bin);
  for (const name of ['dllama', 'dllama-api']) symlinkSync(FAKE, join(bin, name));
  await registerModel('tiny');
});

afterAll(() => stack.close());

test('a 4-node topology serves through NATS, is restarted in place when a worker dies, given up in a crash loop, replaced and destroyed without leftovers', async () => {
  const rt = runtime({ nodes: 4 });
  const info = await rt.create({ namespace: 'default', model: 'tiny', pool: POOL, instance: 'tiny-1' }, new AbortController().signal);
  expect(info).toEqual({ instance: 'tiny-1', subject: requestSubjectOf(names, POOL, 'tiny-1'), healthy: true });

  // Shape: the root and three workers on distinct loopback ports, with the real programs' flags.
  const procs = rt.processes(POOL, 'tiny-1')!;
  expect(procs.map((p) => [p.role, p.index, p.running])).toEqual([
    ['root', 0, true],
    ['worker', 1, true],
    ['worker', 2, true],
    ['worker', 3, true],
  ]);
  expect(new Set(procs.map((p) => p.port)).size).toBe(4);
  const [root, ...workers] = procs;
  const cached = (b: Buffer, ext: string) => join(dir, 'cache', `${sha(b)}${ext}`);
  expect(root!.argv).toEqual([
    join(bin, 'dllama-api'),
    '--host',
    '127.0.0.1',
    '--port',
    String(root!.port),
    '--model',
    cached(files.model, '.m'),
    '--tokenizer',
    cached(files.tokenizer, '.t'),
    '--buffer-float-type',
    'q80',
    '--nthreads',
    '2',
    '--max-seq-len',
    '256',
    '--workers',
    ...workers.map((w) => `127.0.0.1:${w.port}`),
  ]);
  for (const w of workers) expect(w.argv).toEqual([join(bin, 'dllama'), 'worker', '--host', '127.0.0.1', '--port', String(w.port), '--nthreads', '2']);
  // What each process really runs (setpriv and stdbuf exec it): its command line ends with exactly that.
  for (const p of procs) {
    const cmdline = readFileSync(`/proc/${p.pid}/cmdline`, 'utf8').split('\0').slice(0, -1);
    expect(cmdline.slice(-p.argv.length)).toEqual(p.argv);
  }
  // The files came from S3 through the cache, verified.
  expect(readFileSync(cached(files.model, '.m')).equals(files.model)).toBe(true);
  expect(readFileSync(cached(files.tokenizer, '.t')).equals(files.tokenizer)).toBe(true);
  // The root connected to every worker before it served; output is logged per process.
  for (const w of workers) {
    expect(logs).toContain(`${POOL}/tiny-1 worker ${w.index} :${w.port}: ⭕ NodeIndex: ${w.index}`);
    expect(logs).toContain(`${POOL}/tiny-1 worker ${w.index} :${w.port}: ⭕ nNodes: 4`);
  }
  expect(logs).toContain(`${POOL}/tiny-1 root :${root!.port}: ⭕ Network is initialized (4 nodes)`);
  expect(
    logs.some((l) =>
      l.startsWith('tiny/tiny-1: distributed-llama on 4 node(s), q40 weights, --max-seq-len 256; planned memory: root 4 MiB, each worker 1 MiB'),
    ),
  ).toBe(true);

  // Requests through NATS → bridge → root, streamed and not.
  const streamed = await ask('tiny-1', { stream: true, messages: [{ role: 'user', content: 'Hello, topology' }] });
  expect(streamed.text).toBe('Hello, topology [4 nodes]');
  expect(streamed.frames.at(-1)?.type).toBe('done');
  const whole = await ask('tiny-1', { stream: false, messages: [{ role: 'user', content: 'Once more' }] });
  expect(whole.text).toBe('Once more [4 nodes]');
  const models = (await (await fetch(`http://127.0.0.1:${root!.port}/v1/models`)).json()) as { data: { id: string }[] };
  expect(models.data.map((m) => m.id)).toEqual([`${sha(files.model)}.m`]); // dllama-api names the model by its file

  // A worker dies: the rest of the topology is stopped, and all of it starts again on the same
  // ports (the bridge calls the same root URL), serving the instance again.
  process.kill(workers[1]!.pid!, 'SIGKILL');
  await until('the rest of the topology to stop', () => procs.every((p) => !alive(p.pid!)));
  expect(logs).toContain(`${POOL}/tiny-1 worker 2 :${workers[1]!.port} was killed by SIGKILL: stopping the rest of the topology`);
  await until('the topology restarted', async () => {
    const now = rt.processes(POOL, 'tiny-1')!;
    return now.every((p) => p.running && !procs.some((old) => old.pid === p.pid)) && (await rt.describe(POOL, 'tiny-1'))?.healthy === true;
  });
  const restarted = rt.processes(POOL, 'tiny-1')!;
  expect(restarted.map((p) => [p.role, p.index, p.port])).toEqual(procs.map((p) => [p.role, p.index, p.port]));
  expect(
    logs.some((l) =>
      l.startsWith(
        `${POOL}/tiny-1 worker 2 :${workers[1]!.port} was killed by SIGKILL; restarting it on ports ${procs.map((p) => p.port).join(', ')} in 100 ms`,
      ),
    ),
  ).toBe(true);
  expect((await ask('tiny-1', { stream: false, messages: [{ role: 'user', content: 'Still there?' }] })).text).toBe('Still there? [4 nodes]');

  // The root dies too, within the window: a crash loop, no more restarts; describe says unhealthy.
  process.kill(restarted[0]!.pid!, 'SIGKILL');
  await until('describe to report the instance unhealthy', async () => (await rt.describe(POOL, 'tiny-1'))?.healthy === false);
  await until('the rest of the topology to stop', () => restarted.every((p) => !alive(p.pid!)));
  await sleep(300);
  expect(rt.processes(POOL, 'tiny-1')!.every((p) => !p.running)).toBe(true);
  expect(logs.some((l) => /giving up/.test(l))).toBe(true);

  // create() for the same id replaces the broken instance with a new topology.
  expect(await rt.create({ namespace: 'default', model: 'tiny', pool: POOL, instance: 'tiny-1' }, new AbortController().signal)).toMatchObject({
    healthy: true,
  });
  const again = rt.processes(POOL, 'tiny-1')!;
  expect(again).toHaveLength(4);
  expect(again.every((p) => p.running && !procs.some((old) => old.pid === p.pid) && !restarted.some((old) => old.pid === p.pid))).toBe(true);
  expect((await ask('tiny-1', { stream: true })).text).toBe('Hello [4 nodes]');

  // destroy(): every process is gone when it resolves, and the runtime forgets the instance.
  await rt.destroy(POOL, 'tiny-1');
  expect(again.filter((p) => alive(p.pid!))).toEqual([]);
  expect(processesFrom(bin)).toEqual([]);
  expect(await rt.describe(POOL, 'tiny-1')).toBeNull();
  expect(rt.processes(POOL, 'tiny-1')).toBeNull();
});

test('a root that cannot start fails create() with its own words, and leaves no worker behind', async () => {
  const broken = join(dir, 'broken-dllama-api');
  writeFileSync(broken, '#!/bin/sh\necho "cannot load the model" >&2\nexit 3\n');
  chmodSync(broken, 0o755);
  const rt = runtime({ nodes: 2, apiBin: broken });
  const err = await rt.create({ namespace: 'default', model: 'tiny', pool: POOL, instance: 'tiny-2' }, new AbortController().signal).catch((e: Error) => e);
  expect(err).toMatchObject({ name: 'TopologyStartFailed' });
  expect((err as Error).message).toMatch(/^tiny\/tiny-2 root :\d+ exited with code 3 while waiting for the root to load the model, connect 1 worker\(s\)/);
  expect((err as Error).message).toContain('cannot load the model');
  expect(processesFrom(bin)).toEqual([]);
  expect(await rt.describe(POOL, 'tiny-2')).toBeNull();
});

test('nodes the model cannot be split into: create() says so (no GGUF to fall back on)', async () => {
  const rt = runtime({ nodes: 8 });
  await expect(rt.create({ namespace: 'default', model: 'tiny', pool: POOL, instance: 'tiny-3' }, new AbortController().signal)).rejects.toMatchObject({
    name: 'NoArtifact',
    message: 'model default/tiny has no distributed-llama artifact that runs on 8 nodes (q40: splits into 1, 2, 4 nodes)',
  });
  expect(processesFrom(bin)).toEqual([]);
});

test('destroy() while the topology starts: the start is aborted, and no process is left when destroy resolves', async () => {
  const rt = runtime({ nodes: 2 });
  let settled = false;
  const outcome = rt.create({ namespace: 'default', model: 'tiny', pool: POOL, instance: 'tiny-4' }, new AbortController().signal).then(
    (info) => ((settled = true), info),
    (err: Error) => ((settled = true), err),
  );
  // The root is held before it serves, as if it were still loading the model.
  const rootPid = () => processesFrom(bin).find((pid) => readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').includes(join(bin, 'dllama-api')));
  // The pid the wait found is the one held (looking again could miss it: CI saw `undefined` once).
  let root: number | undefined;
  await until('the root to start', () => (root = rootPid()) !== undefined || settled);
  if (root === undefined) throw new Error(`the start settled before its root was seen: ${JSON.stringify(await outcome)}`);
  process.kill(root, 'SIGSTOP');
  expect(settled).toBe(false);

  await rt.destroy(POOL, 'tiny-4');
  expect(processesFrom(bin)).toEqual([]);
  expect(await outcome).toMatchObject({ name: 'InstanceDestroyed' });
  expect(await rt.describe(POOL, 'tiny-4')).toBeNull();
  expect(rt.processes(POOL, 'tiny-4')).toBeNull();
});

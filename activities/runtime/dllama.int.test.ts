/**
 * The local runtime with distributed-llama configured, against the real nats-server and S3
 * store, running the real programs (`dllama-api` root, `dllama worker`s: built from the vendored
 * source with magus's patches by scripts/dev-services) over a real model, the padded stories260K
 * (test/fixtures/stories260k-dllama.ts) in F32. Requests go the production way: published to the
 * instance's subject, answered by the runtime's in-process bridge through the root's HTTP API.
 * Greedy answers are compared before and after every restart and replacement: a topology started
 * again must answer exactly as before.
 */
import { PutObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import { createHash, randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { connect } from 'node:net';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import type { ChatCompletionRequest } from '../../shared/chat';
import { modelRevision, type ReadyModel } from '../../shared/model';
import { isolation } from '../../test/harness';
import { askInstance } from '../../test/harness/data-plane';
import { runtimeStack, TestStack } from '../../test/harness/stack';
import { publishPaddedStories, writePaddedStories } from '../../test/fixtures/stories260k-dllama';
import { requestSubjectOf, type DataPlaneNames } from '../../dataplane';
import type { ModelRegistry } from '../../dataplane/registry';
import { resolveBinaries } from '../../workers/dev/services';
import { CONNECT_ATTEMPTS, CONNECT_ATTEMPTS_ENV, dllamaApiArgs, dllamaWorkerArgs, freePorts, listensOn, NETWORK_KEY_ENV, netTurboFits } from './dllama';
import { spawnSupervised, type SupervisedProcess } from './process';
import { LocalRuntime } from './local';
import { processRunning, sleep, until } from '../../test/harness/wait';
import { descendantsRunning } from '../../test/harness/dev';

const POOL = 'tiny';

/** The real programs. */
let bins: { api: string; worker: string };
let dir: string;
let nc: NatsConnection;
let names: DataPlaneNames;
let registry: ModelRegistry;
let s3: S3Client;
let bucket: string;
/** The registered model's two files, as the runtime caches them. */
let files: { model: Buffer; tokenizer: Buffer };
/** Where the padded stories260K's `.m` and `.t` were written. */
let modelDir: string;
const modelFiles = () => ({ model: join(modelDir, 'model.m'), tokenizer: join(modelDir, 'tokenizer.t') });
const runtimes: LocalRuntime[] = [];
const logs: string[] = [];
const stack = new TestStack();
const sha = (b: Buffer) => createHash('sha256').update(b).digest('hex');

/**
 * Pids of the distributed-llama processes this test process started and that still run (setpriv
 * and stdbuf exec them in place). Its own only: another suite may run the same programs meanwhile.
 */
function ourDllamaProcesses(): number[] {
  return descendantsRunning(process.pid, [bins.api, bins.worker]).map((p) => p.pid);
}

/** A process's environment (its own: the test runs as the same user). */
function environOf(pid: number): Record<string, string> {
  const pairs = readFileSync(`/proc/${pid}/environ`, 'utf8').split('\0').filter(Boolean);
  return Object.fromEntries(pairs.map((kv) => [kv.slice(0, kv.indexOf('=')), kv.slice(kv.indexOf('=') + 1)]));
}

/** A model whose `.m` is not a model: the real root refuses to load it. */
async function registerBroken(name: string): Promise<void> {
  const prefix = `artifacts/org/${name}/dllama-f32/`;
  const put = async (file: string, body: Buffer) => {
    await s3.send(new PutObjectCommand({ Bucket: bucket, Key: prefix + file, Body: body }));
    return { key: prefix + file, bytes: body.length, sha256: sha(body) };
  };
  const ready: ReadyModel = {
    namespace: 'default',
    name,
    source: { repo: `org/${name}`, revision: 'main', sha: 'b'.repeat(40) },
    artifacts: [
      {
        format: 'dllama',
        weights: 'f32',
        converterVersion: '1',
        files: [await put('model.m', randomBytes(64 * 1024)), await put('tokenizer.t', files.tokenizer)],
      },
    ],
    memory: [],
    readyAt: new Date().toISOString(),
  };
  await registry.put(ready);
}

function runtime(dllama: { nodes: number }): LocalRuntime {
  const r = new LocalRuntime({
    nc,
    names,
    registry,
    s3,
    bucket,
    cacheDir: join(dir, 'cache'),
    dllama: {
      apiBin: bins.api,
      workerBin: bins.worker,
      nodes: dllama.nodes,
      threads: 1,
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

/** Greedy, short: the same question answers the same text from any healthy topology of this model. */
const ask = (instance: string, body: Partial<ChatCompletionRequest>, model = 'tiny') =>
  askInstance(nc, names, POOL, instance, { model, temperature: 0, max_tokens: 16, messages: [{ role: 'user', content: 'Once upon a time' }], ...body });

beforeAll(async () => {
  const iso = isolation();
  ({ nc, names, registry, s3, dir } = await stack.open(runtimeStack(iso, { dirPrefix: 'magus-dllama-' })));
  bucket = iso.bucket;
  stack.defer(async () => {
    for (const r of runtimes) await r.stopAll();
  });
  const resolved = await resolveBinaries(['dllama', 'dllama-api']);
  bins = { api: resolved['dllama-api']!, worker: resolved.dllama! };
  const model = await writePaddedStories(join(dir, 'stories'), ['f32']);
  await publishPaddedStories(model, 'f32', { s3, bucket, registry, name: 'tiny', contextLength: 256 });
  modelDir = model.dllama.f32!;
  files = { model: readFileSync(join(model.dllama.f32!, 'model.m')), tokenizer: readFileSync(join(model.dllama.f32!, 'tokenizer.t')) };
}, 120_000);

afterAll(() => stack.close());

test('a 4-node topology serves through NATS, is restarted in place when a worker dies, given up in a crash loop, replaced and destroyed without leftovers', async () => {
  const rt = runtime({ nodes: 4 });
  const info = await rt.create({ namespace: 'default', model: 'tiny', pool: POOL, instance: 'tiny-1' }, new AbortController().signal);
  expect(info).toEqual({
    instance: 'tiny-1',
    subject: requestSubjectOf(names, POOL, 'tiny-1'),
    healthy: true,
    restarts: { stops: 0, recovering: false },
    revision: modelRevision((await registry.get('default', 'tiny'))!),
  });

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
  // 4 single-threaded processes: with fewer cores than that, none spins on its sockets.
  const turbo = netTurboFits(4, 1) ? [] : ['--net-turbo', '0'];
  expect(procs.map((p) => p.pid).sort()).toEqual(ourDllamaProcesses().sort());
  expect(root!.argv).toEqual([
    bins.api,
    '--host',
    '127.0.0.1',
    '--port',
    String(root!.port),
    '--model',
    cached(files.model, '.m'),
    '--tokenizer',
    cached(files.tokenizer, '.t'),
    '--buffer-float-type',
    'f32', // the weights are f32: q80 buffers would abort at the first matmul
    '--nthreads',
    '1',
    '--max-seq-len',
    '256',
    ...turbo,
    '--workers',
    ...workers.map((w) => `127.0.0.1:${w.port}`),
  ]);
  for (const w of workers) expect(w.argv).toEqual([bins.worker, 'worker', '--host', '127.0.0.1', '--port', String(w.port), '--nthreads', '1', ...turbo]);
  // What each process really runs (setpriv and stdbuf exec it): its command line ends with exactly that.
  for (const p of procs) {
    const cmdline = readFileSync(`/proc/${p.pid}/cmdline`, 'utf8').split('\0').slice(0, -1);
    expect(cmdline.slice(-p.argv.length)).toEqual(p.argv);
  }
  // One network key for the topology (patch 0003), in each process's environment, never on a command line.
  const keys = procs.map((p) => environOf(p.pid!)[NETWORK_KEY_ENV]);
  expect(keys[0]).toMatch(/^[0-9a-f]{64}$/);
  expect(new Set(keys)).toEqual(new Set([keys[0]]));
  for (const p of procs) expect(readFileSync(`/proc/${p.pid}/cmdline`, 'utf8')).not.toContain(keys[0]);
  // The files came from S3 through the cache, verified.
  expect(readFileSync(cached(files.model, '.m')).equals(files.model)).toBe(true);
  expect(readFileSync(cached(files.tokenizer, '.t')).equals(files.tokenizer)).toBe(true);
  // The root connected to every worker before it served; output is logged per process.
  // (A worker's lines come through its own pipe: they may arrive after the root serves.)
  await until('every worker to log its place', () =>
    workers.every(
      (w) =>
        // distributed-llama counts a worker's peers (the other workers) and its index among them from 0.
        logs.includes(`${POOL}/tiny-1 worker ${w.index} :${w.port}: ⭕ The root node has connected`) &&
        logs.includes(`${POOL}/tiny-1 worker ${w.index} :${w.port}: ⭕ NodeIndex: ${w.index - 1}`) &&
        logs.includes(`${POOL}/tiny-1 worker ${w.index} :${w.port}: ⭕ Network is initialized`),
    ),
  );
  for (const w of workers) expect(logs).toContain(`${POOL}/tiny-1 root :${root!.port}: ⭕ Socket[${w.index - 1}]: connecting to 127.0.0.1:${w.port} worker`);
  expect(logs).toContain(`${POOL}/tiny-1 root :${root!.port}: ⭕ Network is initialized`);
  expect(
    logs.some((l) =>
      /^tiny\/tiny-1: distributed-llama on 4 node\(s\), f32 weights, --max-seq-len 256; planned memory: root \d+ MiB, each worker \d+ MiB$/.test(l),
    ),
  ).toBe(true);

  // Requests through NATS → bridge → root, streamed and not: the same greedy story.
  const streamed = await ask('tiny-1', { stream: true });
  expect(streamed.frames.at(-1)?.type).toBe('done');
  const story = streamed.text;
  expect(story.length).toBeGreaterThan(20);
  expect((await ask('tiny-1', { stream: false })).text).toBe(story);
  const models = (await (await fetch(`http://127.0.0.1:${root!.port}/v1/models`)).json()) as { data: { id: string }[] };
  expect(models.data.map((m) => m.id)).toEqual([`${sha(files.model)}.m`]); // dllama-api names the model by its file

  // A worker dies: the rest of the topology is stopped, and all of it starts again on the same
  // ports (the bridge calls the same root URL), serving the instance again.
  process.kill(workers[1]!.pid!, 'SIGKILL');
  await until('the rest of the topology to stop', () => procs.every((p) => !processRunning(p.pid!)));
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
  expect((await ask('tiny-1', { stream: false })).text).toBe(story);
  // What the pool is told (watchInstance): one stop, which node and how, and that it serves again.
  expect((await rt.describe(POOL, 'tiny-1'))?.restarts).toEqual({ stops: 1, last: `worker 2 :${workers[1]!.port} was killed by SIGKILL`, recovering: false });
  // A new key for the new topology: the old processes' key proves nothing to the new ones.
  expect(environOf(restarted[0]!.pid!)[NETWORK_KEY_ENV]).not.toBe(keys[0]);

  // The root dies too, within the window: a crash loop, no more restarts; describe says unhealthy.
  process.kill(restarted[0]!.pid!, 'SIGKILL');
  await until('describe to report the instance unhealthy', async () => (await rt.describe(POOL, 'tiny-1'))?.healthy === false);
  await until('the rest of the topology to stop', () => restarted.every((p) => !processRunning(p.pid!)));
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
  expect((await ask('tiny-1', { stream: true })).text).toBe(story);

  // destroy(): every process is gone when it resolves, and the runtime forgets the instance.
  await rt.destroy(POOL, 'tiny-1');
  expect(again.filter((p) => processRunning(p.pid!))).toEqual([]);
  expect(ourDllamaProcesses()).toEqual([]);
  expect(await rt.describe(POOL, 'tiny-1')).toBeNull();
  expect(rt.processes(POOL, 'tiny-1')).toBeNull();
});

test('a worker serves only its own root: a connection that cannot prove the network key is refused, and the root holding it is served', async () => {
  const [workerPort, rootPort, otherRootPort] = await freePorts(3);
  const key = randomBytes(32).toString('hex');
  const out: string[] = [];
  const spawned: SupervisedProcess[] = [];
  const spawnWith = (name: string, argv: string[], env: Record<string, string>) => {
    const p = spawnSupervised(name, argv, { log: (l) => out.push(l), lineBuffered: true, env });
    spawned.push(p);
    return p;
  };
  try {
    const worker = spawnWith('worker', [bins.worker, ...dllamaWorkerArgs({ port: workerPort!, threads: 1, netTurbo: false })], { [NETWORK_KEY_ENV]: key });
    await until('the worker listens', () => listensOn(worker.child.pid!, workerPort!), 10_000);
    // Anything first: bytes that are no proof. The worker drops the connection and keeps its place.
    const rogue = connect(workerPort!, '127.0.0.1');
    rogue.on('error', () => undefined);
    rogue.resume(); // its challenge read and dropped, so the close is seen
    rogue.write(Buffer.from('mgs-rogue-hello'));
    await new Promise<void>((resolve) => rogue.once('close', () => resolve()));
    await until('the worker says why', () => out.some((l) => /^worker: ⭕ Refused a connection from 127\.0\.0\.1:\d+: /.test(l)), 10_000);
    // A root with another key: refused too.
    const files = modelFiles();
    const rootArgs = (port: number) => [
      bins.api,
      ...dllamaApiArgs({ port, ...files, buffer: 'f32', netTurbo: false, threads: 1, maxSeqLen: 256, workerPorts: [workerPort!] }),
    ];
    const impostor = spawnWith('impostor', rootArgs(otherRootPort!), { [NETWORK_KEY_ENV]: randomBytes(32).toString('hex') });
    await until('the impostor refused', () => out.filter((l) => /^worker: ⭕ Refused a connection/.test(l)).length >= 2, 20_000);
    await impostor.stop(2000);
    expect(worker.exit).toBeNull(); // still running, still free for its root
    // The root holding the key gets the worker and answers.
    spawnWith('root', rootArgs(rootPort!), { [NETWORK_KEY_ENV]: key });
    let models: Response | undefined;
    await until('the root serves', async () => (models = await fetch(`http://127.0.0.1:${rootPort}/v1/models`).catch(() => undefined))?.ok === true, 30_000);
    await models?.body?.cancel();
    expect(out).toContain('worker: ⭕ The root node has connected');
  } catch (err) {
    throw new Error(`${(err as Error).message}; output:\n${out.join('\n')}`);
  } finally {
    for (const p of spawned.reverse()) await p.stop(2000);
  }
}, 90_000);

test('a root that cannot reach its worker exits within seconds, naming it (not an endless retry)', async () => {
  const [rootPort, nobody] = await freePorts(2);
  const out: string[] = [];
  const root = spawnSupervised(
    'root',
    [bins.api, ...dllamaApiArgs({ port: rootPort!, ...modelFiles(), buffer: 'f32', netTurbo: false, threads: 1, maxSeqLen: 256, workerPorts: [nobody!] })],
    {
      log: (l) => out.push(l),
      lineBuffered: true,
      env: { [NETWORK_KEY_ENV]: randomBytes(32).toString('hex'), [CONNECT_ATTEMPTS_ENV]: String(CONNECT_ATTEMPTS) },
    },
  );
  try {
    // CONNECT_ATTEMPTS attempts 3 s apart.
    const exit = await Promise.race([root.exited, sleep(30_000).then(() => 'still running' as const)]);
    expect(exit).toMatchObject({ code: 1 });
    expect(root.tail().at(-1)).toBe(`🚨 giving up after ${CONNECT_ATTEMPTS} attempts: cannot reach worker 1 at 127.0.0.1:${nobody}: Connection refused`);
  } finally {
    await root.stop(2000);
  }
}, 60_000);

test('a root that cannot load its model fails create() with its own words, and leaves no worker behind', async () => {
  await registerBroken('broken');
  const rt = runtime({ nodes: 2 });
  const err = await rt.create({ namespace: 'default', model: 'broken', pool: POOL, instance: 'tiny-2' }, new AbortController().signal).catch((e: Error) => e);
  expect(err).toMatchObject({ name: 'TopologyStartFailed' });
  // dllama-api throws, and the uncaught exception aborts it.
  expect((err as Error).message).toMatch(/^tiny\/tiny-2 root :\d+ was killed by SIGABRT while waiting for the root to load the model, connect 1 worker\(s\)/);
  expect((err as Error).message).toContain('Unsupported magic number');
  expect(ourDllamaProcesses()).toEqual([]);
  expect(await rt.describe(POOL, 'tiny-2')).toBeNull();
});

test('nodes the model cannot be split into: create() says so (no GGUF to fall back on)', async () => {
  const rt = runtime({ nodes: 8 });
  await expect(rt.create({ namespace: 'default', model: 'tiny', pool: POOL, instance: 'tiny-3' }, new AbortController().signal)).rejects.toMatchObject({
    name: 'NoArtifact',
    message:
      'model default/tiny has no distributed-llama artifact that runs on 8 nodes (f32: splits into 1, 2, 4 nodes (num_key_value_heads 4 / 8 nodes is not a whole number of KV heads per node))',
  });
  expect(ourDllamaProcesses()).toEqual([]);
});

test('destroy() while the topology starts: the start is aborted, and no process is left when destroy resolves', async () => {
  const rt = runtime({ nodes: 2 });
  let settled = false;
  const outcome = rt.create({ namespace: 'default', model: 'tiny', pool: POOL, instance: 'tiny-4' }, new AbortController().signal).then(
    (info) => ((settled = true), info),
    (err: Error) => ((settled = true), err),
  );
  // The root is held before it serves, as if it were still loading the model.
  const rootPid = () => descendantsRunning(process.pid, [bins.api])[0]?.pid;
  // The pid the wait found is the one held (looking again could miss it: CI saw `undefined` once).
  let root: number | undefined;
  await until('the root to start', () => (root = rootPid()) !== undefined || settled);
  if (root === undefined) throw new Error(`the start settled before its root was seen: ${JSON.stringify(await outcome)}`);
  process.kill(root, 'SIGSTOP');
  expect(settled).toBe(false);

  await rt.destroy(POOL, 'tiny-4');
  expect(ourDllamaProcesses()).toEqual([]);
  expect(await outcome).toMatchObject({ name: 'InstanceDestroyed' });
  expect(await rt.describe(POOL, 'tiny-4')).toBeNull();
  expect(rt.processes(POOL, 'tiny-4')).toBeNull();
});

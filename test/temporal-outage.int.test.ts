/**
 * A Temporal outage under serving traffic, on a Temporal dev server of this file's own (with its
 * database file, so it comes back with every workflow): the shared one is never touched.
 * A worker (local runtime, a real llama.cpp engine) and a gateway run against it; Temporal is
 * SIGKILLed while warm conversations keep asking, then started again on the same port and database.
 * - warm turns are answered throughout (their path is gateway → NATS → bridge → engine);
 * - a new conversation is answered from the pool's published view while it has room; one the view
 *   cannot serve gets 503 `unavailable` with `Retry-After` within seconds, not the client's ~20 s;
 * - the gateway's `/readyz` says `degraded` (200), its metrics say unreachable, the worker's probe
 *   too; a gateway *started* during the outage starts and serves warm turns;
 * - once Temporal is back: readyz ok, a new conversation is served, the first turn served during
 *   the outage gets its session workflow, and the pool runs no duplicate instance.
 * The figures (longest warm-turn pause, turns answered, time to a 503) are printed for bench/README.md.
 * And a pipeline through two outages, one in the middle of a multipart transfer and one during
 * the conversion: it finishes with sources and artifacts byte-identical to a faultless run's.
 */
import { GetObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import { Client, Connection } from '@temporalio/client';
import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import { convertModel } from '../convert/convert';
import { dataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import { listIncompleteUploads } from '../activities/storage/cleanup';
import type { RunningGateway } from '../gateway/server';
import type { PoolEntry } from '../shared/serving';
import { startServices, type RunningServices } from '../workers/dev/services';
import { TEMPORAL_CHANNEL_ARGS, watchTemporal } from '../platform/temporal-health';
import type { RunningWorkers } from '../workers/worker';
import { modelWorkflowId, progressQuery, type PipelinePhase, type PipelineProgress } from '../workflows/model/definitions';
import { modelPipeline } from '../workflows/model/pipeline';
import { poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import { sessionWorkflowId } from '../workflows/session/definitions';
import { startTestHub } from './fixtures/hub';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { writeTinyModel } from '../workers/dev/tiny-model';
import { endpoint, isolation, workerConfig } from './harness';
import { gatewayStack, natsStack, s3Stack, tempDir, TestStack, workersStack } from './harness/stack';
import { startTcpProxy, type TcpProxy } from './harness/tcp-proxy';
import { onStandby, processesUsing, sleep, until } from './harness/wait';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
const TOKEN = `mgs_t1_${randomBytes(16).toString('hex')}`;
const SECRET = randomBytes(32).toString('hex');
/** How long Temporal stays down (the warm loops run throughout). */
const OUTAGE_MS = 25_000;
/** The models served here, named with the file's isolation id (as every test file's). */
const MODEL = `tiny-${iso.id}`;
const COLD = `cold-${iso.id}`;
const OUTAGE = `outage-${iso.id}`;
const POOL = { minInstances: 0, maxInstances: 2, leasesPerInstance: 3, idleTimeoutMs: 600_000, healthCheckMs: 1000 };

let dir: string;
let services: RunningServices;
let s3: S3Client;
let nc: NatsConnection;
let workers: RunningWorkers;
/** The workers' way to S3, so a test can slow their reads (the conversion's source). */
let s3Proxy: TcpProxy;
let client: Client;
let gateway: RunningGateway;
/** Everything above, and the gateway a test starts during the outage. */
const stack = new TestStack();

interface Answer {
  status: number;
  ms: number;
  retryAfter: string | null;
  body: { error?: { code: string | null; type: string }; choices?: { message: { content: string } }[] };
}

async function chat(url: string, conversation: string, content: string, model = MODEL): Promise<Answer> {
  const t0 = performance.now();
  const res = await fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', 'x-session-id': conversation },
    body: JSON.stringify({ model, messages: [{ role: 'user', content }], max_tokens: 4, temperature: 0 }),
  });
  const body = (await res.json()) as Answer['body'];
  return { status: res.status, ms: performance.now() - t0, retryAfter: res.headers.get('retry-after'), body };
}

async function readyz(url: string): Promise<{ status: number; body: { status: string; checks: Record<string, boolean> } }> {
  const res = await fetch(`${url}/readyz`);
  return { status: res.status, body: (await res.json()) as { status: string; checks: Record<string, boolean> } };
}

async function metric(url: string, name: string): Promise<number | undefined> {
  const text = await (await fetch(`${url}/metrics`)).text();
  const line = text.split('\n').find((l) => l.startsWith(`${name} `));
  return line === undefined ? undefined : Number(line.slice(name.length + 1));
}

/** A gateway on this file's Temporal (lazy connection: it starts with Temporal away too), on `stack`. */
async function gatewayOn(address: string): Promise<RunningGateway> {
  const connection = Connection.lazy({ address, channelArgs: TEMPORAL_CHANNEL_ARGS });
  stack.defer(() => connection.close());
  const health = watchTemporal(connection);
  stack.defer(() => health.close());
  const { gateway } = await stack.open(
    gatewayStack(names, {
      secret: SECRET,
      tokens: { t1: TOKEN },
      env: { MAGUS_LOG_LEVEL: 'error', MAGUS_GATEWAY_RETRY_AFTER_SEC: '3' },
      sessions: { client: new Client({ connection }), taskQueue: `${iso.id}-control`, pool: POOL, sessionTtlMs: 600_000 },
      deps: { temporal: health },
    }),
  );
  return gateway;
}

beforeAll(async () => {
  ({ dir } = stack.open(tempDir('magus-temporal-outage-')));
  services = await startServices({ services: ['temporal'], dataDir: join(dir, 'services'), log: () => undefined });
  stack.defer(() => services.stop());
  const address = services.endpoints.temporal!.address;
  ({ s3 } = await stack.open(s3Stack(iso)));
  const s3Url = new URL(endpoint('s3').endpoint);
  s3Proxy = stack.open(await startTcpProxy({ host: s3Url.hostname, port: Number(s3Url.port) }));
  ({ workers } = await stack.open(
    workersStack(iso, dir, {
      temporal: { address, namespace: 'default' },
      s3: { ...workerConfig(iso, dir).s3, endpoint: `${s3Url.protocol}//${s3Proxy.address}` },
    }),
  ));
  ({ nc } = await stack.open(natsStack(iso)));
  await publishTinyGguf({ dir, s3, bucket: iso.bucket, registry: await openModelRegistry(nc, names.modelsBucket), name: MODEL });
  const connection = await Connection.connect({ address, channelArgs: TEMPORAL_CHANNEL_ARGS });
  stack.defer(() => connection.close());
  client = new Client({ connection });
  gateway = await gatewayOn(address);
}, 180_000);

afterAll(() => stack.close(), 120_000);

test('Temporal killed and restarted under traffic: warm turns carry on, new ones from the published view or a prompt 503, then everything resumes', async () => {
  const url = gateway.url;
  const pools = await nc.jetstream().views.kv(names.poolsBucket);
  const sessionsKv = await nc.jetstream().views.kv(names.sessionsBucket);
  const published = async () => {
    const e = await pools.get(`default.${MODEL}`);
    return e ? (JSON.parse(new TextDecoder().decode(e.value)) as PoolEntry) : undefined;
  };
  const sessionKeys = async () => {
    const out = new Set<string>();
    for await (const k of await sessionsKv.keys()) out.add(k);
    return out;
  };

  // Two warm conversations, their entries counted by the gateway (the leases it picks by).
  const warm = [`warm-a-${iso.id}`, `warm-b-${iso.id}`];
  for (const w of warm) expect((await chat(url, w, `hello ${w}`)).status).toBe(200);
  const counted = async () => ((await published())?.instances ?? []).reduce((n, i) => n + gateway.sessionCache!.leasesOn('default', MODEL, i.instance), 0);
  await until('the gateway counts both leases on the published instance', async () => (await counted()) === 2, 60_000);
  expect((await readyz(url)).body).toMatchObject({ status: 'ok', checks: { temporal: true } });
  expect(await metric(url, 'magus_gateway_temporal_reachable')).toBe(1);

  // Warm traffic, one loop per conversation, from before the kill until after the restart.
  const turns: Answer[] = [];
  let traffic = true;
  const loops = warm.map(async (w, n) => {
    for (let i = 0; traffic; i++) turns.push(await chat(url, w, `turn ${i} of ${n}`));
  });
  await sleep(1000);

  const failuresBefore = (await metric(url, 'magus_gateway_temporal_probe_failures_total')) ?? 0;
  const killedAt = Date.now();
  await services.killTemporal();
  const turnsAtKill = turns.length;

  // The gateway notices within a probe interval or two: degraded, still ready.
  await until('the gateway sees Temporal unreachable', async () => (await readyz(url)).body.status === 'degraded', 20_000);
  const degraded = await readyz(url);
  expect(degraded.status).toBe(200);
  expect(degraded.body.checks).toMatchObject({ temporal: false, nats: true });
  expect(await metric(url, 'magus_gateway_temporal_reachable')).toBe(0);
  await until('the worker sees Temporal unreachable', () => !workers.temporal.reachable(), 20_000);

  // A new conversation while the published view has room (2 of 3 leases): answered, no Temporal.
  const before = await sessionKeys();
  const fromView = await chat(url, `new-1-${iso.id}`, 'a new conversation during the outage');
  expect(fromView.status).toBe(200);
  const [viewKey] = [...(await sessionKeys())].filter((k) => !before.has(k));
  expect(viewKey).toBeDefined();

  // The view is full now (3 of 3, counting this gateway's own pick): the next one needs Temporal.
  const refused = await chat(url, `new-2-${iso.id}`, 'another new conversation during the outage');
  expect(refused.status).toBe(503);
  expect(refused.body.error).toMatchObject({ code: 'unavailable', type: 'server_error' });
  expect(Number(refused.retryAfter)).toBeGreaterThanOrEqual(1);
  expect(refused.ms).toBeLessThan(10_000); // prompt (measured: see the log line below), not the client's ~20 s of retries

  // A gateway started while Temporal is away starts, says degraded, and serves warm turns.
  const extra = await gatewayOn(services.endpoints.temporal!.address);
  await until('the new gateway sees Temporal unreachable', async () => (await readyz(extra.url)).body.status === 'degraded', 20_000);
  expect((await chat(extra.url, warm[0]!, 'a warm turn through a gateway started during the outage')).status).toBe(200);

  await sleep(Math.max(0, killedAt + OUTAGE_MS - Date.now()));
  const downFor = Date.now() - killedAt;
  const turnsDuringOutage = turns.slice(turnsAtKill);
  const failuresDuring = ((await metric(url, 'magus_gateway_temporal_probe_failures_total')) ?? 0) - failuresBefore;
  // Nothing hot-loops: one probe every 2 s while it is away (plus one per refused cold start).
  expect(failuresDuring).toBeGreaterThan(0);
  expect(failuresDuring).toBeLessThanOrEqual(downFor / 1000);

  await services.restartTemporal();
  const restartedAt = Date.now();
  await until('the gateway sees Temporal back', async () => (await readyz(url)).body.status === 'ok', 30_000);
  const readyAfterMs = Date.now() - restartedAt;
  traffic = false;
  await Promise.all(loops);
  await until('the worker sees Temporal back', () => workers.temporal.reachable(), 30_000);

  // Warm turns: every one answered, before, during and after the outage.
  expect(turns.filter((t) => t.status !== 200)).toEqual([]);
  expect(turnsDuringOutage.length).toBeGreaterThan(4);
  const longestWarm = Math.max(...turns.map((t) => t.ms));

  // The conversation refused during the outage is served now (through Temporal: the pool grows).
  const t0 = Date.now();
  const served = await chat(url, `new-2-${iso.id}`, 'another new conversation during the outage');
  expect(served.status).toBe(200);
  const coldAfterMs = Date.now() - t0;

  // The first turn served from the view during the outage got its session workflow afterwards
  // (the gateway retried its start until Temporal was back).
  await until(
    'the outage first turn has its session workflow',
    async () =>
      (
        await client.workflow
          .getHandle(sessionWorkflowId('default', MODEL, viewKey!))
          .describe()
          .catch(() => undefined)
      )?.status.name === 'RUNNING',
    60_000,
  );

  // The pool carries on: no duplicate instance, and what it knows is what runs.
  const pool = client.workflow.getHandle(poolWorkflowId('default', MODEL));
  await until(
    'the pool and the runtime agree',
    async () => {
      const status = await pool.query(poolStatusQuery);
      const ids = status.instances.map((i) => i.id);
      const running = workers.runtime.bridges().map((b) => b.instance);
      return new Set(ids).size === ids.length && ids.length <= POOL.maxInstances && running.length === ids.length && running.every((r) => ids.includes(r));
    },
    60_000,
  );
  expect((await chat(url, warm[1]!, 'a warm turn after the outage')).status).toBe(200);

  process.stderr.write(
    `temporal outage: down ${(downFor / 1000).toFixed(1)} s; warm turns answered during it ${turnsDuringOutage.length}/${turnsDuringOutage.length}, all ${turns.length}/${turns.length}; ` +
      `longest warm turn ${longestWarm.toFixed(0)} ms; first turn from the view ${fromView.ms.toFixed(0)} ms; 503 unavailable in ${refused.ms.toFixed(0)} ms; ` +
      `probe failures ${failuresDuring}; readyz ok ${readyAfterMs} ms after the restart; a new cold conversation ${coldAfterMs} ms\n`,
  );
}, 300_000);

test('Temporal killed during a multipart transfer and again during a conversion: the pipeline finishes with the artifacts a faultless conversion makes', async () => {
  // ~63 MB of F32 weights (model.safetensors in several multipart parts), its hub throttled so the transfer is under way when Temporal goes.
  const model = join(dir, 'outage-model');
  await writeTinyModel(model, { seed: 43, dtype: 'F32', hiddenSize: 512, intermediateSize: 1024, numLayers: 4, numHeads: 8, numKvHeads: 4, vocabSize: 6144 });
  const hub = await startTestHub();
  try {
    const repo = 'magus-test/outage-llama';
    const commit = await hub.addRepo({ id: repo, dir: model });
    hub.setFaults({ bytesPerSecond: 3_000_000 });
    const handle = await client.workflow.start(modelPipeline, {
      workflowId: modelWorkflowId('default', OUTAGE),
      taskQueue: `${iso.id}-control`,
      args: [{ namespace: 'default', name: OUTAGE, spec: { source: { repo, hubUrl: hub.url }, artifacts: [{ format: 'gguf', weights: 'q80' }] } }],
    });
    const progress = async (): Promise<PipelineProgress | undefined> => handle.query(progressQuery).catch(() => undefined);
    const outage = async (during: PipelinePhase, downMs: number): Promise<PipelineProgress> => {
      let p: PipelineProgress | undefined;
      await until(
        `the pipeline ${during}`,
        async () => (p = await progress())?.phase === during && (during === 'transferring' ? p!.bytes.done > 0 : p!.tensors.total > 0),
        120_000,
      );
      await services.killTemporal();
      await sleep(downMs);
      await services.restartTemporal();
      return p!;
    };
    const atTransfer = await outage('transferring', 10_000);
    // Until Temporal and the worker are back, progress cannot be asked; the conversion reads its
    // source (~63 MB) from S3 slowly meanwhile (about a minute at 1 MB/s), so it is still under way when it can.
    hub.setFaults({});
    s3Proxy.throttleAnswers(1_000_000);
    let atConversion: PipelineProgress;
    try {
      atConversion = await outage('converting', 8_000);
    } finally {
      s3Proxy.throttleAnswers(undefined);
    }
    let p: PipelineProgress | undefined;
    await until('the pipeline ready', async () => (p = await progress())?.phase === 'ready' || p?.phase === 'failed', 180_000);
    expect([p!.phase, p!.failure]).toEqual(['ready', null]);
    expect(atTransfer.bytes.done).toBeLessThan(atTransfer.bytes.total); // it was in the middle of it
    expect(atConversion.tensors.done).toBeLessThan(atConversion.tensors.total); // and of this

    // Sources byte-identical to the hub's, artifacts byte-identical to a local conversion, nothing half-uploaded.
    const get = async (key: string) => Buffer.from(await (await s3.send(new GetObjectCommand({ Bucket: iso.bucket, Key: key }))).Body!.transformToByteArray());
    for (const f of commit.files) expect([f.path, (await get(`sources/${repo}/${commit.sha}/${f.path}`)).equals(f.content)]).toEqual([f.path, true]);
    const ready = await openModelRegistry(nc, names.modelsBucket).then((r) => r.get('default', OUTAGE));
    const local = join(dir, 'outage.gguf');
    await convertModel({ source: model, format: 'gguf', weights: 'q80', output: local, threads: 1, name: 'outage-llama' }); // general.name: the repo's name, as the pipeline sets it
    const files = ready!.artifacts[0]!.files;
    expect(files).toHaveLength(1);
    expect((await get(files[0]!.key)).equals(readFileSync(local))).toBe(true);
    expect(await listIncompleteUploads(s3, iso.bucket, `sources/${repo}/`)).toEqual([]);
    process.stderr.write(
      `temporal outage during a pipeline: killed at ${atTransfer.bytes.done}/${atTransfer.bytes.total} bytes and at ${atConversion.tensors.done}/${atConversion.tensors.total} tensors; ready, artifacts identical\n`,
    );
  } finally {
    await hub.stop();
  }
}, 420_000);

test('Temporal killed while a cold pool scales up for a first turn: the turn gets a prompt 503, the pool finishes its start without a duplicate, the retry is served', async () => {
  // The test before restarted Temporal too: start once the gateway has seen it back (it probes every 2 s while it is away).
  await until('the gateway sees Temporal', async () => (await readyz(gateway.url)).body.status === 'ok', 30_000);
  const registry = await openModelRegistry(nc, names.modelsBucket);
  await publishTinyGguf({ dir, s3, bucket: iso.bucket, registry, name: COLD, seed: 52 });
  const pool = client.workflow.getHandle(poolWorkflowId('default', COLD));
  const conversation = `cold-${iso.id}`;
  let answer: Answer;
  let afterKillMs: number;
  // The first turn: no pool yet, so it tells the pool of the demand (signal-with-start) and waits for room while the pool starts an instance.
  const models = join(dir, 'models'); // the worker's model cache: every engine's command line names its model there
  const enginesBefore = new Set(processesUsing(models));
  const first = chat(gateway.url, conversation, 'a first turn on a cold model', COLD);
  // Its engine held (SIGSTOP) before it can report ready: the start cannot win the race with the
  // kill, so the turn is refused, always.
  let held: number | undefined;
  await until(
    'the cold pool’s engine process',
    () => (held = processesUsing(models).find((pid) => !enginesBefore.has(pid) && !onStandby(pid))) !== undefined,
    60_000,
  );
  process.kill(held!, 'SIGSTOP');
  try {
    await until(
      'the pool starting an instance',
      async () => (await pool.query(poolStatusQuery).catch(() => undefined))?.instances.some((i) => i.phase === 'starting') === true,
      60_000,
    );
    await services.killTemporal();
    const killedAt = Date.now();
    answer = await first;
    afterKillMs = Date.now() - killedAt;
  } finally {
    process.kill(held!, 'SIGCONT');
  }
  // Killed mid-start, the caller cannot be told the instance: 503 unavailable, at once.
  expect([answer.status, answer.body.error?.code, Number(answer.retryAfter) >= 1]).toEqual([503, 'unavailable', true]);
  expect(afterKillMs).toBeLessThan(15_000); // once a probe notices (≤ ~7 s), not the client's ~20 s of retries
  await sleep(8_000);
  await services.restartTemporal();

  // The client retries as told: served once Temporal is back and the start has finished.
  let retried: Answer | undefined;
  let retries = 0;
  await until(
    'the retried turn served',
    async () => {
      retried = await chat(gateway.url, conversation, 'the retry', COLD);
      retries++;
      if (retried.status !== 200) await sleep(Math.max(1, Number(retried.retryAfter ?? 1)) * 1000);
      return retried.status === 200;
    },
    120_000,
  );
  const status = await pool.query(poolStatusQuery);
  const ids = status.instances.filter((i) => i.phase !== 'stopping').map((i) => i.id);
  const running = workers.runtime
    .bridges()
    .filter((b) => b.instance.startsWith(`${COLD}-`))
    .map((b) => b.instance);
  expect(new Set(ids).size).toBe(ids.length);
  expect(ids.length).toBeLessThanOrEqual(POOL.maxInstances);
  expect(running.sort()).toEqual([...ids].sort());
  process.stderr.write(
    `temporal outage during a scale-up: the pool starting its instance (its engine held) at the kill; the first turn got ${answer.status} ${afterKillMs} ms after the kill (${answer.ms.toFixed(0)} ms in all); served after ${retries} tries; instances ${ids.join(', ')}\n`,
  );
}, 300_000);

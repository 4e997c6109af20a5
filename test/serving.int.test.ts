/**
 * The serving path end to end with the official `openai` client: gateway → (first turn: Temporal
 * session + pool → local runtime starts a real llama.cpp engine and a bridge) → NATS JetStream →
 * bridge → engine, and back as a stream. Real Temporal, nats-server and MinIO; the model is the
 * tiny synthetic Llama converted to GGUF, put in S3 and the registry by the test.
 */
import { CreateBucketCommand, type S3Client } from '@aws-sdk/client-s3';
import type { Client, Connection } from '@temporalio/client';
import { temporal } from '@temporalio/proto';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import OpenAI from 'openai';
import { dataPlaneNames } from '../activities/nats/data-plane';
import { openModelRegistry } from '../activities/nats/registry';
import { gatewayConfigFor } from './harness/gateway';
import { startGateway, type RunningGateway } from '../gateway/server';
import { temporalSessions } from '../gateway/temporal';
import type { PoolEntry, SessionEntry } from '../shared/serving';
import { poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import { sessionWorkflowId } from '../workflows/session/definitions';
import { startWorkers, type RunningWorkers } from '../workers/worker';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { currentDetails, isolation, listWorkflowIds, natsConnect, recordHistory, s3Client, temporalClient, workerConfig } from './harness';
import { until } from './harness/wait';
import { historyText } from './support/history';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
const TOKEN = `mgs_t1_${randomBytes(16).toString('hex')}`;
const IDLE_MS = 4000;
/**
 * Longer than the gateway's freshness margin (5 s), so turns in quick succession are warm, and
 * than an instance's replacement takes here (a conversation outlives it).
 */
const SESSION_TTL_MS = 15_000;
/** The session of the conversation started cold (test 2), recorded again once it has expired. */
let coldSession: string | undefined;

let dir: string;
let s3: S3Client;
let nc: NatsConnection;
let client: Client;
let connection: Connection;
let workers: RunningWorkers;
let gateway: RunningGateway;
let openai: OpenAI;

beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), 'magus-serving-'));
  s3 = s3Client();
  await s3.send(new CreateBucketCommand({ Bucket: iso.bucket }));
  const cfg = workerConfig(iso, dir);
  workers = await startWorkers(cfg); // also declares the data plane (streams, buckets)
  nc = await natsConnect();
  await publishTinyGguf({ dir, s3, bucket: iso.bucket, registry: await openModelRegistry(nc, names.modelsBucket) });

  ({ client, connection } = await temporalClient());
  const sessions = temporalSessions({ client, taskQueue: cfg.taskQueue, pool: { minInstances: 0, maxInstances: 2, leasesPerInstance: 1, idleTimeoutMs: IDLE_MS, drainGraceMs: 1000, healthCheckMs: 1000 }, sessionTtlMs: SESSION_TTL_MS });
  const gatewayConfig = gatewayConfigFor(iso.natsPrefix, {
    secret: randomBytes(32).toString('hex'),
    tokens: { t1: TOKEN },
    env: { MAGUS_GATEWAY_COLD_START_TIMEOUT_MS: '120000', MAGUS_LOG_LEVEL: 'warn' },
  });
  gateway = await startGateway(gatewayConfig, { nc, ...sessions });
  openai = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: TOKEN, maxRetries: 0 });
}, 180_000);

afterAll(async () => {
  await gateway?.close();
  await workers?.shutdown();
  await nc?.drain();
  await connection?.close();
  s3?.destroy();
  rmSync(dir, { recursive: true, force: true });
}, 60_000);

test('chat completions through the gateway, NATS, the bridge and llama.cpp: non-stream and stream', async () => {
  const models = await openai.models.list();
  expect(models.data.map((m) => m.id)).toContain('tiny');

  const messages = [{ role: 'user' as const, content: 'hello there' }];
  const done = await openai.chat.completions.create({ model: 'tiny', messages, max_tokens: 8, temperature: 0 });
  expect(done.choices[0]?.message.content?.length).toBeGreaterThan(0);
  expect(done.usage?.completion_tokens).toBe(8);

  const stream = await openai.chat.completions.create({ model: 'tiny', messages, max_tokens: 8, temperature: 0, stream: true });
  let text = '';
  let chunks = 0;
  for await (const c of stream) {
    text += c.choices[0]?.delta?.content ?? '';
    chunks++;
  }
  expect(chunks).toBeGreaterThan(1);
  // Greedy decoding of the same conversation: the stream says what the non-stream said.
  expect(text).toBe(done.choices[0]?.message.content);

  // stream_options.include_usage: the engine's usage chunk comes last, through the whole path.
  const counted = await openai.chat.completions.create({ model: 'tiny', messages, max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true } });
  const all: OpenAI.ChatCompletionChunk[] = [];
  for await (const c of counted) all.push(c);
  expect(all.at(-1)).toMatchObject({ choices: [], usage: { completion_tokens: 8, prompt_tokens: done.usage?.prompt_tokens } });
  expect(all.slice(0, -1).every((c) => !c.usage)).toBe(true);
}, 180_000);

test('turns of one conversation stay on one instance and need no Temporal call; the token never enters a history', async () => {
  const kv = await nc.jetstream().views.kv(names.sessionsBucket);
  const keys = async () => {
    const out: string[] = [];
    for await (const k of await kv.keys()) out.push(k);
    return out;
  };
  const entryOf = async (k: string) => JSON.parse(new TextDecoder().decode((await kv.get(k))!.value)) as SessionEntry;
  const id = `conv-${randomBytes(4).toString('hex')}`;
  const turn = (content: string) =>
    openai.chat.completions.create({ model: 'tiny', messages: [{ role: 'user', content }], max_tokens: 4 }, { headers: { 'x-session-id': id } });

  const before = new Set(await keys());
  const s0 = gateway.sessionCache!.stats();
  await turn('first turn');
  const mine = (await keys()).filter((k) => !before.has(k));
  expect(mine).toHaveLength(1);
  const first = await entryOf(mine[0]!);
  await turn('second turn');
  await turn('third turn');
  expect((await entryOf(mine[0]!)).instance).toBe(first.instance);

  // One turn found the instance (a cold start through Temporal, or a pool's published instance);
  // the later turns went gateway → NATS directly, and the session workflow saw at most that one acquire.
  const s1 = gateway.sessionCache!.stats();
  expect(s1.coldStarts - s0.coldStarts + (s1.firstTurns - s0.firstTurns)).toBe(1);
  expect(s1.warmHits - s0.warmHits).toBe(2);
  // The session is found by its model in the Temporal UI, and its page says where it is served.
  const sessionHandle = client.workflow.getHandle(sessionWorkflowId('default', 'tiny', mine[0]!));
  coldSession = sessionHandle.workflowId;
  expect(sessionHandle.workflowId).toBe(`session/default/tiny/${mine[0]!}`);
  expect(await listWorkflowIds(client, `MagusKind="session" AND MagusModel="default/tiny" AND MagusPhase="serving"`)).toContain(sessionHandle.workflowId);
  expect(await currentDetails(sessionHandle)).toMatch(new RegExp(`^\\*\\*serving\\*\\* · a conversation on model \`default/tiny\` · instance \`${first.instance}\` {2}\\nexpires \\S+Z unless a turn comes first`));
  const pool = client.workflow.getHandle(poolWorkflowId('default', 'tiny'));
  expect(await listWorkflowIds(client, `MagusKind="pool" AND MagusModel="default/tiny" AND MagusPhase="serving"`)).toEqual([pool.workflowId]);
  expect(await currentDetails(pool)).toMatch(new RegExp(`^\\*\\*serving\\*\\* · model \`default/tiny\` · [^]*\\n- \`${first.instance}\` ready, \\d+ leases?`));
  if (s1.coldStarts > s0.coldStarts) expect(await (await sessionHandle.describe()).staticSummary()).toBe('A conversation on model default/tiny');
  // Recorded from today's code (the `session-search-attributes` and `pool-phase-search-attribute` patches);
  // `session-cold-start.json` is the same path recorded before them and stays as it is.
  await recordHistory('session-cold-start-named', sessionHandle);
  await recordHistory('pool-serving', pool);
  const history = await client.workflow.getHandle(sessionWorkflowId('default', 'tiny', mine[0]!)).fetchHistory();
  const updates = (history.events ?? []).filter((e) => e.eventType === temporal.api.enums.v1.EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED);
  expect(updates).toHaveLength(s1.coldStarts - s0.coldStarts);
  for (const wf of [poolWorkflowId('default', 'tiny'), sessionWorkflowId('default', 'tiny', mine[0]!)]) {
    expect(historyText(await client.workflow.getHandle(wf).fetchHistory()).includes(TOKEN)).toBe(false);
  }
}, 120_000);

test('a first turn on a warm pool is served from the pool’s published instances; the session confirms the lease afterwards', async () => {
  const pools = await nc.jetstream().views.kv(names.poolsBucket);
  const sessionsKv = await nc.jetstream().views.kv(names.sessionsBucket);
  const published = async () => {
    const e = await pools.get('default.tiny');
    return e ? (JSON.parse(new TextDecoder().decode(e.value)) as PoolEntry) : undefined;
  };
  // Wait until an instance has room (leasesPerInstance 1: the earlier sessions expire after their TTL).
  const deadline = Date.now() + 60_000;
  let room: PoolEntry['instances'][number] | undefined;
  while (!(room = (await published())?.instances.find((i) => i.leases === 0)) && Date.now() < deadline) await new Promise((r) => setTimeout(r, 200));
  expect(room).toBeDefined();

  const before = new Set<string>();
  for await (const k of await sessionsKv.keys()) before.add(k);
  const s0 = gateway.sessionCache!.stats();
  const r = await openai.chat.completions.create({ model: 'tiny', messages: [{ role: 'user', content: 'a new conversation' }], max_tokens: 4, temperature: 0 }, { headers: { 'x-session-id': `fast-${randomBytes(4).toString('hex')}` } });
  expect(r.choices[0]?.message.content?.length).toBeGreaterThan(0);
  const s1 = gateway.sessionCache!.stats();
  expect(s1.firstTurns - s0.firstTurns).toBe(1);
  expect(s1.coldStarts - s0.coldStarts).toBe(0);

  const mine: string[] = [];
  for await (const k of await sessionsKv.keys()) if (!before.has(k)) mine.push(k);
  expect(mine).toHaveLength(1);
  const entry = JSON.parse(new TextDecoder().decode((await sessionsKv.get(mine[0]!))!.value)) as SessionEntry;
  expect(entry.instance).toBe(room!.instance);
  // The gateway started the session workflow after answering; it asks the pool for that instance
  // and is granted it: the pool publishes the lease, no acquire update ran, the entry stands.
  const session = client.workflow.getHandle(sessionWorkflowId('default', 'tiny', mine[0]!));
  let granted = false;
  for (let i = 0; i < 100 && !granted; i++) {
    const events = (await session.fetchHistory().catch(() => undefined))?.events ?? [];
    granted = events.some((e) => e.workflowExecutionSignaledEventAttributes?.signalName === 'leaseGranted');
    if (!granted) await new Promise((res) => setTimeout(res, 100));
  }
  expect(granted).toBe(true);
  const events = (await session.fetchHistory()).events ?? [];
  expect(events.filter((e) => e.eventType === temporal.api.enums.v1.EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED)).toHaveLength(0);
  let leases = 0;
  for (let i = 0; i < 100 && leases === 0; i++) {
    leases = (await published())?.instances.find((x) => x.instance === room!.instance)?.leases ?? 0;
    if (leases === 0) await new Promise((res) => setTimeout(res, 100));
  }
  expect(leases).toBe(1);
  expect((JSON.parse(new TextDecoder().decode((await sessionsKv.get(mine[0]!))!.value)) as SessionEntry).instance).toBe(room!.instance);
}, 120_000);

test('an instance that stops serving for good is replaced, and its conversation moves with it', async () => {
  const kv = await nc.jetstream().views.kv(names.sessionsBucket);
  const entryOf = async (k: string) => JSON.parse(new TextDecoder().decode((await kv.get(k))!.value)) as SessionEntry;
  const id = `moving-${randomBytes(4).toString('hex')}`;
  // Greedy: a sampled answer of the tiny model may be empty (an end token first).
  const turn = (content: string) => openai.chat.completions.create({ model: 'tiny', messages: [{ role: 'user', content }], max_tokens: 4, temperature: 0 }, { headers: { 'x-session-id': id } });
  const before = new Set<string>();
  for await (const k of await kv.keys()) before.add(k);
  await turn('before');
  const mine: string[] = [];
  for await (const k of await kv.keys()) if (!before.has(k)) mine.push(k);
  expect(mine).toHaveLength(1);
  // The first turn may have gone to an instance the idle pool was already stopping (the
  // gateway's view lagged): the session then takes a lease elsewhere and rewrites the entry.
  // Break the instance the pool has confirmed.
  const pool = client.workflow.getHandle(poolWorkflowId('default', 'tiny'));
  let doomed = '';
  await until('the lease confirmed', async () => {
    doomed = (await entryOf(mine[0]!)).instance;
    const leased = (await pool.query(poolStatusQuery)).instances.find((i) => i.id === doomed);
    return leased?.phase === 'ready' && leased.leases >= 1;
  }, 30_000);

  // Broken for good: its model file is gone from the cache and its engine dies, so every
  // restart fails and the runtime gives the instance up.
  for (const f of readdirSync(join(dir, 'models'))) rmSync(join(dir, 'models', f), { force: true });
  process.kill(workers.runtime.processes('tiny', doomed)![0]!.pid!, 'SIGKILL');
  const deadline = Date.now() + 60_000;
  // Unhealthy, or already gone: under load the pool can see it and destroy it between two looks.
  const serving = async () => (await workers.runtime.describe('tiny', doomed))?.healthy === true;
  while ((await serving()) && Date.now() < deadline) await new Promise((r) => setTimeout(r, 100));
  expect(await serving()).toBe(false);

  // The pool's health check drops it and leases the session another instance, which it records.
  let moved = doomed;
  while ((moved = (await entryOf(mine[0]!)).instance) === doomed && Date.now() < deadline) await new Promise((r) => setTimeout(r, 100));
  expect(moved).not.toBe(doomed);
  const status = await pool.query(poolStatusQuery);
  expect(status.instances.map((i) => i.id)).not.toContain(doomed);
  expect(status.instances.find((i) => i.id === moved)?.phase).toBe('ready');
  // The conversation's next turn is answered, by the new instance.
  const r = await turn('after');
  expect(r.choices[0]?.message.content?.length).toBeGreaterThan(0);
  expect((await entryOf(mine[0]!)).instance).toBe(moved);
}, 120_000);

test('an idle pool goes to zero instances and comes back on the next request', async () => {
  const pool = client.workflow.getHandle(poolWorkflowId('default', 'tiny'));
  const deadline = Date.now() + 60_000;
  let status = await pool.query(poolStatusQuery);
  while (status.instances.length > 0 && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 500));
    status = await pool.query(poolStatusQuery);
  }
  expect(status.instances).toEqual([]);
  // The sessions expired first: their TTL passed, they released their leases and ended.
  if (coldSession) {
    const ended = client.workflow.getHandle(coldSession);
    expect((await ended.describe()).status.name).toBe('COMPLETED');
    await recordHistory('session-expired', ended);
  }
  const r = await openai.chat.completions.create({ model: 'tiny', messages: [{ role: 'user', content: 'wake up' }], max_tokens: 4, temperature: 0 });
  expect(r.choices[0]?.message.content?.length).toBeGreaterThan(0);
  expect((await pool.query(poolStatusQuery)).instances.filter((i) => i.phase === 'ready')).toHaveLength(1);
  // Scaled up, down to zero and up again.
  await recordHistory('pool-scaled-to-zero-and-back', pool);
}, 120_000);

test('errors reach the client as the openai library expects them', async () => {
  await expect(openai.chat.completions.create({ model: 'no-such-model', messages: [{ role: 'user', content: 'x' }] })).rejects.toBeInstanceOf(OpenAI.NotFoundError);
  await expect(new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: 'mgs_t1_wrong', maxRetries: 0 }).models.list()).rejects.toBeInstanceOf(OpenAI.AuthenticationError);
  await expect(openai.chat.completions.create({ model: 'tiny', messages: [] })).rejects.toBeInstanceOf(OpenAI.BadRequestError);
});


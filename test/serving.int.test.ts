/**
 * The serving path end to end with the official `openai` client: gateway → (first turn: the
 * model's pool, told of the demand, has the local runtime start a real llama.cpp engine and a
 * bridge; the gateway creates the conversation's entry and starts its session) → NATS JetStream →
 * bridge → engine, and back as a stream. Real Temporal, nats-server and s3proxy; the model is the
 * tiny synthetic Llama converted to GGUF, put in S3 and the registry by the test.
 */
import type { Client } from '@temporalio/client';
import { temporal } from '@temporalio/proto';
import { randomBytes } from 'node:crypto';
import { readdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import OpenAI from 'openai';
import type { LocalRuntime } from '../activities/runtime/local';
import { dataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import type { RunningGateway } from '../gateway/server';
import type { PoolEntry, SessionEntry } from '../shared/serving';
import { poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import { sessionWorkflowId } from '../workflows/session/definitions';
import type { RunningWorkers } from '../workers/worker';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { currentDetails, isolation, listWorkflowIds, recordHistory } from './harness';
import { gatewayStack, magusStack, TestStack } from './harness/stack';
import { sleep, until } from './harness/wait';
import { historyText } from './harness/history';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
/** The model served here: its pool's and sessions' workflow ids are this file's own. */
const MODEL = `tiny-${iso.id}`;
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
let nc: NatsConnection;
let client: Client;
let workers: RunningWorkers;
let gateway: RunningGateway;
let openai: OpenAI;
const stack = new TestStack();

beforeAll(async () => {
  const magus = await stack.open(magusStack(iso, { dirPrefix: 'magus-serving-' }));
  ({ dir, nc, client, workers } = magus);
  await publishTinyGguf({ dir, s3: magus.s3, bucket: iso.bucket, registry: await openModelRegistry(nc, names.modelsBucket), name: MODEL });
  ({ gateway } = await stack.open(
    gatewayStack(names, {
      secret: randomBytes(32).toString('hex'),
      tokens: { t1: TOKEN },
      env: { MAGUS_GATEWAY_COLD_START_TIMEOUT_MS: '120000', MAGUS_LOG_LEVEL: 'warn' },
      sessions: {
        client,
        taskQueue: magus.cfg.taskQueue,
        pool: { minInstances: 0, maxInstances: 2, leasesPerInstance: 1, idleTimeoutMs: IDLE_MS, drainGraceMs: 1000, healthCheckMs: 1000 },
        sessionTtlMs: SESSION_TTL_MS,
      },
    }),
  ));
  openai = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: TOKEN, maxRetries: 0 });
}, 180_000);

afterAll(() => stack.close(), 60_000);

test('chat completions through the gateway, NATS, the bridge and llama.cpp: non-stream and stream', async () => {
  const models = await openai.models.list();
  expect(models.data.map((m) => m.id)).toContain(MODEL);

  const messages = [{ role: 'user' as const, content: 'hello there' }];
  const done = await openai.chat.completions.create({ model: MODEL, messages, max_tokens: 8, temperature: 0 });
  expect(done.choices[0]?.message.content?.length).toBeGreaterThan(0);
  expect(done.usage?.completion_tokens).toBe(8);

  const stream = await openai.chat.completions.create({ model: MODEL, messages, max_tokens: 8, temperature: 0, stream: true });
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
  const counted = await openai.chat.completions.create({
    model: MODEL,
    messages,
    max_tokens: 8,
    temperature: 0,
    stream: true,
    stream_options: { include_usage: true },
  });
  const all: OpenAI.ChatCompletionChunk[] = [];
  for await (const c of counted) all.push(c);
  // The same prompt a third time on the instance's one slot: all of it but the last token was
  // cached (that one is evaluated again for the first answer token's logits).
  const prompt = done.usage!.prompt_tokens;
  expect(all.at(-1)).toMatchObject({
    choices: [],
    usage: { completion_tokens: 8, prompt_tokens: prompt, prompt_tokens_details: { cached_tokens: prompt - 1 } },
  });
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
    openai.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content }], max_tokens: 4 }, { headers: { 'x-session-id': id } });

  const before = new Set(await keys());
  const s0 = gateway.sessionCache!.stats();
  await turn('first turn');
  const mine = (await keys()).filter((k) => !before.has(k));
  expect(mine).toHaveLength(1);
  const first = await entryOf(mine[0]!);
  await turn('second turn');
  await turn('third turn');
  expect((await entryOf(mine[0]!)).instance).toBe(first.instance);

  // The first turn created the entry (after waiting for the pool to start an instance, if none
  // had room); the later turns went gateway → NATS directly.
  const s1 = gateway.sessionCache!.stats();
  expect(s1.firstTurns - s0.firstTurns).toBe(1);
  expect(s1.coldStarts - s0.coldStarts).toBeLessThanOrEqual(1);
  expect(s1.warmHits - s0.warmHits).toBe(2);
  // The conversation's key carries its pool; its session is named by its model and the key's HMAC.
  expect(mine[0]).toMatch(new RegExp(`^default\\.${MODEL}\\.[0-9a-f]{64}$`));
  const sessionHandle = client.workflow.getHandle(sessionWorkflowId('default', MODEL, mine[0]!));
  coldSession = sessionHandle.workflowId;
  expect(sessionHandle.workflowId).toBe(`session/default/${MODEL}/${mine[0]!.split('.').at(-1)!}`);
  // It is found by its model in the Temporal UI at once, though its start is delayed to its lease's
  // end (its first task is its first look), and its page says what it waits for.
  await until('the session is started', async () => (await sessionHandle.describe().catch(() => undefined)) !== undefined);
  expect(await listWorkflowIds(client, `MagusKind="session" AND MagusModel="default/${MODEL}" AND MagusPhase="serving"`)).toContain(sessionHandle.workflowId);
  const described = await sessionHandle.describe();
  expect(await described.staticSummary()).toBe(`A conversation on model default/${MODEL}`);
  expect(await described.staticDetails()).toBe(
    "Its first look at its lease comes when the lease ends unless renewed, 15 s after the conversation's last turn; it sleeps until then.",
  );
  const pool = client.workflow.getHandle(poolWorkflowId('default', MODEL));
  expect(await listWorkflowIds(client, `MagusKind="pool" AND MagusModel="default/${MODEL}" AND MagusPhase="serving"`)).toEqual([pool.workflowId]);
  // The pool's page counts the conversation once its reconciler has reported it.
  await until('the pool counts the lease', async () => /\n- `[^`]+` ready, [1-9]\d* leases?/.test(await currentDetails(pool)));
  expect(await currentDetails(pool)).toMatch(
    new RegExp(`^\\*\\*serving\\*\\* · model \`default/${MODEL}\` · [^]*\\n- \`${first.instance}\` ready, \\d+ leases?`),
  );
  await recordHistory('pool-serving', pool);
  // The session takes no update, no signal: the pool is never told of a conversation.
  for (const [wf, name] of [
    [sessionHandle.workflowId, 'session'],
    [pool.workflowId, 'pool'],
  ] as const) {
    const events = (await client.workflow.getHandle(wf).fetchHistory()).events ?? [];
    expect([name, events.filter((e) => e.eventType === temporal.api.enums.v1.EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED).length]).toEqual([
      name,
      0,
    ]);
    expect([name, events.filter((e) => /^lease/.test(e.workflowExecutionSignaledEventAttributes?.signalName ?? '')).length]).toEqual([name, 0]);
  }
  for (const wf of [poolWorkflowId('default', MODEL), sessionWorkflowId('default', MODEL, mine[0]!)]) {
    expect(historyText(await client.workflow.getHandle(wf).fetchHistory()).includes(TOKEN)).toBe(false);
  }
}, 120_000);

test('a first turn on a warm pool is served from the pool’s published instances; its session starts afterwards', async () => {
  const pools = await nc.jetstream().views.kv(names.poolsBucket);
  const sessionsKv = await nc.jetstream().views.kv(names.sessionsBucket);
  const published = async () => {
    const e = await pools.get(`default.${MODEL}`);
    return e ? (JSON.parse(new TextDecoder().decode(e.value)) as PoolEntry) : undefined;
  };
  // Wait until an instance has room (leasesPerInstance 1: the earlier conversations expire after their TTL).
  const cache = gateway.sessionCache!;
  let room: PoolEntry['instances'][number] | undefined;
  await until(
    'an instance has room',
    async () => !!(room = (await published())?.instances.find((i) => cache.leasesOn('default', MODEL, i.instance) === 0)),
    60_000,
  );

  const before = new Set<string>();
  for await (const k of await sessionsKv.keys()) before.add(k);
  const s0 = cache.stats();
  const r = await openai.chat.completions.create(
    { model: MODEL, messages: [{ role: 'user', content: 'a new conversation' }], max_tokens: 4, temperature: 0 },
    { headers: { 'x-session-id': `fast-${randomBytes(4).toString('hex')}` } },
  );
  expect(r.choices[0]?.message.content?.length).toBeGreaterThan(0);
  const s1 = cache.stats();
  expect(s1.firstTurns - s0.firstTurns).toBe(1);
  expect(s1.coldStarts - s0.coldStarts).toBe(0);

  const mine: string[] = [];
  for await (const k of await sessionsKv.keys()) if (!before.has(k)) mine.push(k);
  expect(mine).toHaveLength(1);
  const entry = JSON.parse(new TextDecoder().decode((await sessionsKv.get(mine[0]!))!.value)) as SessionEntry;
  expect(entry.instance).toBe(room!.instance);
  expect(entry.placedAt).toEqual(expect.any(Number));
  // The gateway started the session workflow after answering, delayed until the entry's expiry:
  // nothing runs (no task, no timer) before its first look.
  const session = client.workflow.getHandle(sessionWorkflowId('default', MODEL, mine[0]!));
  let events: temporal.api.history.v1.IHistoryEvent[] = [];
  await until('the session is started', async () => (events = (await session.fetchHistory().catch(() => undefined))?.events ?? []).length > 0);
  expect(events.map((e) => temporal.api.enums.v1.EventType[e.eventType!])).toEqual(['EVENT_TYPE_WORKFLOW_EXECUTION_STARTED']);
  const backoff = Number(events[0]!.workflowExecutionStartedEventAttributes?.firstWorkflowTaskBackoff?.seconds ?? 0);
  expect(backoff).toBeGreaterThan(SESSION_TTL_MS / 1000 - 5);
  expect(backoff).toBeLessThanOrEqual(SESSION_TTL_MS / 1000);
  // The pool learns of it only counted, from its reconciler.
  const pool = client.workflow.getHandle(poolWorkflowId('default', MODEL));
  await until('the pool counts it', async () => ((await pool.query(poolStatusQuery)).instances.find((i) => i.id === room!.instance)?.leases ?? 0) >= 1);
}, 120_000);

test('an engine killed once is restarted in place: the pool reports it (the Temporal UI, the status) and its conversation carries on there', async () => {
  const id = `restarted-${randomBytes(4).toString('hex')}`;
  const turn = (content: string) =>
    openai.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content }], max_tokens: 4, temperature: 0 }, { headers: { 'x-session-id': id } });
  await turn('before');
  const pool = client.workflow.getHandle(poolWorkflowId('default', MODEL));
  const runtime = workers.runtime as LocalRuntime; // the stack's worker runs the local runtime
  const serving = (await pool.query(poolStatusQuery)).instances.filter((i) => i.phase === 'ready' && runtime.processes(MODEL, i.id));
  const victim = serving.find((i) => i.leases > 0) ?? serving[0]!;
  const pid = runtime.processes(MODEL, victim.id)![0]!.pid!;
  process.kill(pid, 'SIGKILL');
  // Its watcher reports the stop (phase `restarting` while the engine starts again), then the end of the restart.
  await until(
    'the pool counts the restart',
    async () => {
      const i = (await pool.query(poolStatusQuery)).instances.find((x) => x.id === victim.id);
      return i?.restarts === 1 && !i.restarting;
    },
    60_000,
  );
  const after = (await pool.query(poolStatusQuery)).instances.find((i) => i.id === victim.id)!;
  expect(after).toMatchObject({ phase: 'ready', restarts: 1 });
  expect(after.lastRestart).toMatch(/^engine was killed by SIGKILL$/);
  expect(runtime.processes(MODEL, victim.id)![0]!.pid).not.toBe(pid);
  await until('the pool page says so', async () => (await currentDetails(pool)).includes(`\`${victim.id}\` ready`), 10_000);
  expect(await currentDetails(pool)).toMatch(new RegExp(`- \`${victim.id}\` ready, \\d+ leases?, revision \`[0-9a-f]{16}\`; restarted once, last: .*SIGKILL`));
  // Restarted where it was, not replaced: the conversation's next turn is answered on it.
  const r = await turn('after');
  expect(r.choices[0]?.message.content?.length).toBeGreaterThan(0);
  expect((await pool.query(poolStatusQuery)).instances.some((i) => i.id === victim.id && i.phase === 'ready')).toBe(true);
  await recordHistory('pool-restart-reported', pool);
}, 120_000);

test('an instance that stops serving for good is replaced, and its conversation moves on its next turn', async () => {
  const kv = await nc.jetstream().views.kv(names.sessionsBucket);
  const entryOf = async (k: string) => {
    const e = await kv.get(k);
    return e?.operation === 'PUT' ? (JSON.parse(new TextDecoder().decode(e.value)) as SessionEntry) : undefined;
  };
  const id = `moving-${randomBytes(4).toString('hex')}`;
  // Greedy: a sampled answer of the tiny model may be empty (an end token first).
  const turn = (content: string) =>
    openai.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content }], max_tokens: 4, temperature: 0 }, { headers: { 'x-session-id': id } });
  const before = new Set<string>();
  for await (const k of await kv.keys()) before.add(k);
  await turn('before');
  const mine: string[] = [];
  for await (const k of await kv.keys()) if (!before.has(k)) mine.push(k);
  expect(mine).toHaveLength(1);
  const doomed = (await entryOf(mine[0]!))!.instance;
  const pool = client.workflow.getHandle(poolWorkflowId('default', MODEL));
  // The premise: the conversation is live when its instance is lost — its entry renewed, as a
  // turn renews it (compare-and-swap, a later expiry) — so its next turn must move it, not find
  // it expired (the stack's TTL, 15 s, is about as long as the pool may take to notice the loss).
  const placed = (await kv.get(mine[0]!))!;
  const renewed = { ...(JSON.parse(new TextDecoder().decode(placed.value)) as SessionEntry), expiresAt: Date.now() + 120_000 };
  await kv.update(mine[0]!, JSON.stringify(renewed), placed.revision);

  // Broken for good: its model file is gone from the cache and its engine dies, then the engine
  // on standby that serves in its place (the file still mapped) dies too, so every restart fails
  // and the runtime gives the instance up.
  for (const f of readdirSync(join(dir, 'models'))) rmSync(join(dir, 'models', f), { force: true });
  const runtime = workers.runtime as LocalRuntime; // the stack's worker runs the local runtime
  const engineOf = () => runtime.processes(MODEL, doomed)?.[0];
  const first = engineOf()!.pid!;
  process.kill(first, 'SIGKILL');
  // (No standby may be ready: the one the last test's restart started may have lost its file.)
  await until('the engine on standby serving in its place, or none', async () => {
    const now = engineOf();
    return !now || (now.pid !== first && now.running) || (await runtime.describe(MODEL, doomed))?.healthy === false;
  });
  const standby = engineOf();
  if (standby?.running && standby.pid !== first) process.kill(standby.pid!, 'SIGKILL');
  // The pool's watcher sees it and drops it from its view (another instance starts when the
  // conversation's next turn finds no room: its entry on the lost instance counts no more).
  await until('the pool drops the instance', async () => !(await pool.query(poolStatusQuery)).instances.some((i) => i.id === doomed), 60_000);
  await until(
    'the gateway sees the new view',
    () => !(gateway.sessionCache!.pools?.get(`default.${MODEL}`)?.instances ?? []).some((i) => i.instance === doomed),
    10_000,
  );
  // The conversation's next turn moves it (compare-and-swap) and is answered by the new instance.
  expect((await entryOf(mine[0]!))?.instance).toBe(doomed);
  const m0 = gateway.sessionCache!.stats().moves ?? 0;
  const r = await turn('after');
  expect(r.choices[0]?.message.content?.length).toBeGreaterThan(0);
  const moved = (await entryOf(mine[0]!))!.instance;
  expect(moved).not.toBe(doomed);
  expect((await pool.query(poolStatusQuery)).instances.find((i) => i.id === moved)?.phase).toBe('ready');
  expect((gateway.sessionCache!.stats().moves ?? 0) - m0).toBe(1);
}, 120_000);

test('an idle pool goes to zero instances and comes back on the next request', async () => {
  const pool = client.workflow.getHandle(poolWorkflowId('default', MODEL));
  const deadline = Date.now() + 60_000;
  let status = await pool.query(poolStatusQuery);
  while (status.instances.length > 0 && Date.now() < deadline) {
    await sleep(500);
    status = await pool.query(poolStatusQuery);
  }
  expect(status.instances).toEqual([]);
  // The sessions expired first: their TTL passed, they deleted their entries and ended.
  if (coldSession) {
    const ended = client.workflow.getHandle(coldSession);
    expect((await ended.describe()).status.name).toBe('COMPLETED');
    await recordHistory('session-expired', ended);
  }
  const r = await openai.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'wake up' }], max_tokens: 4, temperature: 0 });
  expect(r.choices[0]?.message.content?.length).toBeGreaterThan(0);
  expect((await pool.query(poolStatusQuery)).instances.filter((i) => i.phase === 'ready')).toHaveLength(1);
  // Scaled up, down to zero and up again.
  await recordHistory('pool-scaled-to-zero-and-back', pool);
}, 120_000);

test('errors reach the client as the openai library expects them', async () => {
  await expect(openai.chat.completions.create({ model: 'no-such-model', messages: [{ role: 'user', content: 'x' }] })).rejects.toBeInstanceOf(
    OpenAI.NotFoundError,
  );
  await expect(new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: 'mgs_t1_wrong', maxRetries: 0 }).models.list()).rejects.toBeInstanceOf(
    OpenAI.AuthenticationError,
  );
  await expect(openai.chat.completions.create({ model: MODEL, messages: [] })).rejects.toBeInstanceOf(OpenAI.BadRequestError);
});

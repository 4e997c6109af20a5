/**
 * A new model revision rolled out under live streams (issue "Streams that never break", §2): the
 * pool starts an instance of the new revision beside the old, unpublishes the old once the new one
 * serves, lets the old finish every answer it has in flight, and stops it then; new first turns go
 * to the new instance at once, and every conversation moves there at its next turn. Real Temporal,
 * nats-server and s3proxy; real workers with the local runtime and llama.cpp engines over the tiny
 * GGUF; the official `openai` client through the gateway.
 *
 * The old engine is frozen (SIGSTOP) with the streams delivered to it, so they are surely in flight
 * while the pool rolls: it must not stop the instance under them. Thawed, each stream ends whole.
 */
import type { Client } from '@temporalio/client';
import { randomBytes } from 'node:crypto';
import type { NatsConnection } from 'nats';
import OpenAI from 'openai';
import type { LocalRuntime } from '../activities/runtime/local';
import { consumerNameOf, dataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import type { RunningGateway } from '../gateway/server';
import { modelRevision, type ReadyModel } from '../shared/model';
import type { SessionEntry } from '../shared/serving';
import { modelPublishedSignal, poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import type { RunningWorkers } from '../workers/worker';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { currentDetails, isolation, recordHistory } from './harness';
import { gatewayStack, magusStack, TestStack } from './harness/stack';
import { readTimed, type TimedAnswer } from './harness/timed-stream';
import { until } from './harness/wait';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
const MODEL = `rollout-tiny-${iso.id}`;
const TOKEN = `mgs_t1_${randomBytes(16).toString('hex')}`;
const ANSWER_TOKENS = 100;

let nc: NatsConnection;
let client: Client;
let workers: RunningWorkers;
let gateway: RunningGateway;
let openai: OpenAI;
let ready: ReadyModel;
let registry: Awaited<ReturnType<typeof openModelRegistry>>;
const stack = new TestStack();

beforeAll(async () => {
  const magus = await stack.open(magusStack(iso, { dirPrefix: 'magus-rollout-' }));
  ({ nc, client, workers } = magus);
  registry = await openModelRegistry(nc, names.modelsBucket);
  ready = await publishTinyGguf({ dir: magus.dir, s3: magus.s3, bucket: iso.bucket, registry, name: MODEL });
  ({ gateway } = await stack.open(
    gatewayStack(names, {
      secret: randomBytes(32).toString('hex'),
      tokens: { t1: TOKEN },
      // Keep-alive comments every 200 ms: a cold start here takes about a second.
      env: { MAGUS_GATEWAY_COLD_START_TIMEOUT_MS: '120000', MAGUS_LOG_LEVEL: 'warn', MAGUS_GATEWAY_SSE_KEEPALIVE_MS: '200' },
      sessions: {
        client,
        taskQueue: magus.cfg.taskQueue,
        pool: { minInstances: 0, maxInstances: 1, leasesPerInstance: 4, idleTimeoutMs: 300_000, drainGraceMs: 1000, healthCheckMs: 1000 },
        sessionTtlMs: 300_000,
      },
    }),
  ));
  openai = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: TOKEN, maxRetries: 0 });
}, 180_000);

afterAll(() => stack.close(), 60_000);

/** The conversations' entries now (`magus_sessions` keys). */
async function entryKeys(): Promise<Set<string>> {
  const out = new Set<string>();
  for await (const k of await (await nc.jetstream().views.kv(names.sessionsBucket)).keys()) out.add(k);
  return out;
}

/** The instance conversation `key`'s entry is on. */
async function instanceOf(key: string): Promise<string> {
  const e = await (await nc.jetstream().views.kv(names.sessionsBucket)).get(key);
  return (JSON.parse(new TextDecoder().decode(e!.value)) as SessionEntry).instance;
}

/** Publishes a new revision of the model (new weights' digest `sha`, as a pipeline run on a new commit does) and tells its pool; returns the revision. */
async function publishRevision(sha: string): Promise<string> {
  const next: ReadyModel = { ...ready, source: { ...ready.source, sha }, readyAt: new Date().toISOString() };
  await registry.put(next);
  await client.workflow.getHandle(poolWorkflowId('default', MODEL)).signal(modelPublishedSignal, { revision: modelRevision(next) });
  return modelRevision(next);
}

/** Until instance `id` of the pool is gone and its processes stopped. */
const stopped = (id: string): Promise<void> =>
  until(
    'the old instance is stopped',
    async () =>
      !(await client.workflow.getHandle(poolWorkflowId('default', MODEL)).query(poolStatusQuery)).instances.some((i) => i.id === id) &&
      (workers.runtime as LocalRuntime).processes(MODEL, id) === null,
    60_000,
  );

test("a cold first turn's stream says what it waits for before its first token; /v1/models shows the engine starting", async () => {
  const models = async () => ((await openai.models.retrieve(MODEL)) as unknown as { serving?: { status: string; starting: number } }).serving;
  expect(await models()).toEqual({ status: 'idle', instances: 0, starting: 0 });
  const seen = new Set<string>();
  let polling = true;
  const poll = (async () => {
    while (polling) {
      const s = await models();
      if (s) seen.add(s.status);
      await new Promise((r) => setTimeout(r, 50));
    }
  })();
  const res = await fetch(`${gateway.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', 'x-session-id': `cold-${iso.id}` },
    body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'a cold start' }], max_tokens: 4, stream: true }),
  });
  const lines = (await res.text()).split('\n').filter((l) => l !== '');
  polling = false;
  await poll;
  const firstData = lines.findIndex((l) => l.startsWith('data: '));
  const said = lines.slice(0, firstData).filter((l) => l.startsWith(': keep-alive: '));
  expect(said.length).toBeGreaterThan(0);
  expect(said.some((l) => new RegExp(`^: keep-alive: engine starting: an instance of default/${MODEL} has been starting for \\d+ s`).test(l))).toBe(true);
  expect(lines.at(-1)).toBe('data: [DONE]');
  expect(seen.has('starting')).toBe(true);
  expect(await models()).toMatchObject({ status: 'ready', instances: 1, starting: 0 });
}, 120_000);

test('a new model revision under live streams: none is cut, new first turns and next turns go to the new instance, the old one stops once its answers ended', async () => {
  const pool = client.workflow.getHandle(poolWorkflowId('default', MODEL));
  const runtime = workers.runtime as LocalRuntime; // the stack's worker runs the local runtime
  const ask = (session: string, content: string, max = 4) =>
    openai.chat.completions.create(
      { model: MODEL, messages: [{ role: 'user', content }], max_tokens: max, temperature: 0 },
      { headers: { 'x-session-id': session } },
    );

  // Three conversations on the one instance of revision r1.
  const sessions = [1, 2, 3].map((n) => `conv-${n}-${iso.id}`);
  const entries: string[] = [];
  for (const s of sessions) {
    const before = await entryKeys();
    await ask(s, `hello ${s}`);
    entries.push([...(await entryKeys())].find((k) => !before.has(k))!);
  }
  const r1 = modelRevision(ready);
  const old = (await pool.query(poolStatusQuery)).instances;
  expect(old).toEqual([expect.objectContaining({ phase: 'ready', revision: r1 })]);
  const oldId = old[0]!.id;
  expect(new Set(await Promise.all(entries.map(instanceOf)))).toEqual(new Set([oldId]));

  // Its engine frozen, three long answers are delivered to it: they are in flight there.
  const pid = runtime.processes(MODEL, oldId)![0]!.pid!;
  process.kill(pid, 'SIGSTOP');
  let thawed = false;
  try {
    const streams = sessions.map(async (s) => {
      const stream = await openai.chat.completions.create(
        {
          model: MODEL,
          messages: [{ role: 'user', content: `tell me a long story, ${s}` }],
          max_tokens: ANSWER_TOKENS,
          temperature: 0,
          stream: true,
          stream_options: { include_usage: true },
        },
        { headers: { 'x-session-id': s } },
      );
      let text = '';
      let finish: string | null | undefined;
      let usage: OpenAI.CompletionUsage | undefined;
      for await (const c of stream) {
        text += c.choices[0]?.delta?.content ?? '';
        finish = c.choices[0]?.finish_reason ?? finish;
        usage = c.usage ?? usage;
      }
      return { text, finish, usage };
    });
    await until('the three streams are delivered to the frozen engine', async () => {
      return (
        (await nc.jetstreamManager().then((m) => m.consumers.info(names.requestStream, consumerNameOf(MODEL, oldId)).catch(() => null)))?.num_ack_pending === 3
      );
    });

    // Revision r2 is published: new weights' digest, as a pipeline run on a new commit publishes them.
    const r2 = await publishRevision('1'.repeat(40));
    expect(r2).not.toBe(r1);

    // The new instance serves; the old one is unpublished and drains, its three answers in flight shown.
    await until(
      'the old instance drains beside a new one',
      async () => {
        const s = await pool.query(poolStatusQuery);
        const o = s.instances.find((i) => i.id === oldId);
        return o?.phase === 'draining' && o.inFlight === 3 && s.instances.some((i) => i.id !== oldId && i.phase === 'ready' && i.revision === r2);
      },
      60_000,
    );
    const status = await pool.query(poolStatusQuery);
    const newId = status.instances.find((i) => i.id !== oldId)!.id;
    expect(status.instances.find((i) => i.id === oldId)).toMatchObject({ revision: r1, retiring: `revision ${r1} is replaced by ${r2}` });
    await until('the pool page shows the rollout', async () => (await currentDetails(pool)).includes('**rolling out**'), 10_000);
    expect(await currentDetails(pool)).toContain('**rolling out**: 1 instance being replaced draining, 3 answers in flight on them');

    // A new conversation's first turn goes to the new instance, at once (the old one is frozen).
    const before = await entryKeys();
    const fresh = await ask(`conv-new-${iso.id}`, 'a new conversation');
    expect(fresh.choices[0]?.message.content?.length).toBeGreaterThan(0);
    const freshKey = [...(await entryKeys())].find((k) => !before.has(k))!;
    expect(await instanceOf(freshKey)).toBe(newId);

    // The old instance is not stopped under its answers: past its grace, it still drains.
    await new Promise((r) => setTimeout(r, 3000));
    expect((await pool.query(poolStatusQuery)).instances.find((i) => i.id === oldId)?.phase).toBe('draining');
    expect(runtime.processes(MODEL, oldId)).not.toBeNull();

    process.kill(pid, 'SIGCONT');
    thawed = true;
    const answers = await Promise.all(streams);
    for (const a of answers) {
      expect(a.finish).toBe('length'); // whole: every token asked for, none cut
      expect(a.usage?.completion_tokens).toBe(ANSWER_TOKENS);
      expect(a.text.length).toBeGreaterThan(0);
    }

    // With nothing left in flight the old instance stops; each conversation's next turn moves to the new one.
    await stopped(oldId);
    for (const [n, s] of sessions.entries()) {
      const r = await ask(s, `and then, ${s}?`);
      expect(r.choices[0]?.message.content?.length).toBeGreaterThan(0);
      expect(await instanceOf(entries[n]!)).toBe(newId);
    }
    expect((await pool.query(poolStatusQuery)).instances).toEqual([expect.objectContaining({ id: newId, phase: 'ready', revision: r2 })]);
    await recordHistory('pool-rolled-out', pool);
  } finally {
    if (!thawed) process.kill(pid, 'SIGCONT');
  }
}, 240_000);

test("a rollout under 50 live streams: none cut or repeated, each the undisturbed answer, every conversation's next turn on the new revision", async () => {
  const STREAMS = 50;
  const TOKENS = 60;
  const prompts = ['a boat', 'a fox', 'the sea', 'a lamp', 'the hills'].map((p) => `tell me about ${p}`);
  const pool = client.workflow.getHandle(poolWorkflowId('default', MODEL));
  const runtime = workers.runtime as LocalRuntime;
  const stream = async (session: string, content: string): Promise<TimedAnswer> =>
    readTimed(
      await openai.chat.completions.create(
        { model: MODEL, messages: [{ role: 'user', content }], max_tokens: TOKENS, temperature: 0, stream: true, stream_options: { include_usage: true } },
        { headers: { 'x-session-id': session } },
      ),
    );

  const [current] = (await pool.query(poolStatusQuery)).instances;
  expect(current).toMatchObject({ phase: 'ready' });
  const oldId = current!.id;
  const oldRevision = current!.revision;
  // The undisturbed answers, one at a time on the instance about to be replaced.
  const reference: string[] = [];
  for (const [n, p] of prompts.entries()) reference.push((await stream(`ref-${n}-${iso.id}`, p)).text);
  expect(reference.every((t) => t.length > 0)).toBe(true);

  // Its engine frozen, 50 conversations' first turns are sent: its slots hold 4, the rest queue for it.
  const pid = runtime.processes(MODEL, oldId)![0]!.pid!;
  process.kill(pid, 'SIGSTOP');
  let thawed = false;
  try {
    const before = await entryKeys();
    const sessions = Array.from({ length: STREAMS }, (_, n) => `live-${n}-${iso.id}`);
    const streams = sessions.map((s, n) => stream(s, prompts[n % prompts.length]!));
    const jsm = await nc.jetstreamManager();
    await until('the 50 streams are in flight or queued at the frozen instance', async () => {
      const c = await jsm.consumers.info(names.requestStream, consumerNameOf(MODEL, oldId)).catch(() => null);
      return c !== null && c.num_ack_pending + c.num_pending === STREAMS;
    });

    const r3 = await publishRevision('2'.repeat(40));
    expect(r3).not.toBe(oldRevision);
    await until(
      'a new instance serves beside the draining old one',
      async () => {
        const s = await pool.query(poolStatusQuery);
        return (
          s.instances.find((i) => i.id === oldId)?.phase === 'draining' && s.instances.some((i) => i.id !== oldId && i.phase === 'ready' && i.revision === r3)
        );
      },
      60_000,
    );
    const newId = (await pool.query(poolStatusQuery)).instances.find((i) => i.id !== oldId)!.id;
    // Each of the 50 conversations has its entry on the old instance.
    const live = [...(await entryKeys())].filter((k) => !before.has(k));
    expect(live).toHaveLength(STREAMS);
    for (const k of live) expect(await instanceOf(k)).toBe(oldId);
    // A first turn meanwhile is answered at once, by the new instance.
    const fresh = await stream(`fresh-${iso.id}`, prompts[0]!);
    expect(fresh.text).toBe(reference[0]);
    const freshKeys = [...(await entryKeys())].filter((k) => !before.has(k) && !live.includes(k));
    expect(freshKeys).toHaveLength(1);
    expect(await instanceOf(freshKeys[0]!)).toBe(newId);

    process.kill(pid, 'SIGCONT');
    thawed = true;
    const answers = await Promise.all(streams);
    for (const [n, a] of answers.entries()) {
      // Whole and once: the undisturbed text, every token asked for counted once, no piece twice.
      expect({ n, text: a.text, finish: a.finish, tokens: a.usage?.completion_tokens, roles: a.roles }).toEqual({
        n,
        text: reference[n % prompts.length],
        finish: 'length',
        tokens: TOKENS,
        roles: 1,
      });
      expect(a.pieces).toBeLessThanOrEqual(TOKENS);
    }
    expect(new Set(answers.map((a) => a.id)).size).toBe(STREAMS);

    await stopped(oldId);
    // Every conversation's next turn is on the new revision's instance.
    for (const [n, s] of sessions.entries()) {
      const r = await openai.chat.completions.create(
        { model: MODEL, messages: [{ role: 'user', content: prompts[n % prompts.length]! }], max_tokens: 2, temperature: 0 },
        { headers: { 'x-session-id': s } },
      );
      expect(r.choices[0]?.message.content?.length).toBeGreaterThan(0);
    }
    for (const k of live) expect(await instanceOf(k)).toBe(newId);
  } finally {
    if (!thawed) process.kill(pid, 'SIGCONT');
  }
}, 300_000);

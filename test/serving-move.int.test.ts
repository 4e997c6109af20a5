/**
 * An answer moved to another instance mid-stream, seen from the official `openai` client through
 * the real gateway, nats-server, two bridges and two real llama.cpp engines (`magus engine`,
 * SmolLM2-135M-Instruct) of one pool: its bridge hands it back (shared/continuation.ts
 * `CONTINUE_ELSEWHERE`) and the gateway sends the rest as a request that continues it on the other
 * instance — which evaluates the prompt and the tokens already sent and samples on, rather than
 * generating the answer again.
 *
 * - The engine SIGKILLed mid-answer (its supervisor starts it again, ~3 s): the other instance
 *   goes on after the bridge's half second of waiting, so the client's silence is about 1 s, not
 *   the engine's restart.
 * - The instance stopped mid-answer (its bridge's drain deadline passes): the answer goes on on
 *   the other instance instead of being cut.
 * - The bridge cut off mid-answer (its NATS connection gone): it no longer beats, and the gateway
 *   continues the answer on the other instance about a second later, not at ack_wait (30 s).
 * - A gateway started after the bridge died (it never heard it): the conversation's turn sent
 *   there goes to the other instance about a second later, not at the request's deadline.
 *
 * Each time: what the client had is the undisturbed answer's beginning to the byte, nothing is
 * repeated or missing (the engine's count of the answer's tokens is `max_tokens`, and the client
 * got no more pieces than that), one usage record under the request's id with the whole answer.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import type OpenAI from 'openai';
import { startSupervisedEngine, type LlamaCppEngine } from '../activities/runtime/llama-cpp';
import type { Supervised } from '../activities/runtime/supervise';
import { ensureInstanceConsumer, laneConsumerNameOf, requestSubjectOf, type DataPlaneNames, type Lane } from '../dataplane';
import { UsageLedger } from '../dataplane/usage';
import { startBridge, type Bridge } from '../dataplane/bridge/bridge';
import { demoModelFile } from '../workers/dev/demo-model';
import { isolation, natsConnectAs, natsConnectAsBridge } from './harness';
import { publishPoolView, refusedColdStart } from './harness/gateway';
import { gatewayStack, natsStack, pinnedGatewayStack, TestStack } from './harness/stack';
import { until } from './harness/wait';
import { gapAfter, readTimed, textAt, type TimedAnswer } from './harness/timed-stream';

const iso = isolation();
const POOL = 'moving';
const TOKEN_ID = 'move';
const SESSION = `move-${iso.id}`;
const ANSWER_TOKENS = 200;
/**
 * The longest silence asserted from the fault to the answer's next piece. Issue 38 §1 asks ≤ 2 s;
 * alone these cases take 0.4–1.3 s (printed below as measured), but beside other suites in CI the
 * engine that continues the answer shares 2 cores (3.1 s once): the bound catches a wait for a
 * redelivery or an ack deadline (≥ 10 s), the figure is measured and written down, not asserted.
 */
const MAX_GAP_MS = 6000;
const measured: string[] = [];

let nc: NatsConnection;
let names: DataPlaneNames;
let openai: OpenAI;
let gateway: { url: string };
let secret: string;
const engines: Record<string, Supervised<LlamaCppEngine>> = {};
const bridges: Record<string, Bridge> = {};
const coldStarts: string[] = [];
const stack = new TestStack();

beforeAll(async () => {
  const nats = await stack.open(natsStack(iso, { declare: true }));
  ({ names, nc } = nats);
  const gguf = await demoModelFile(() => undefined);
  // One directory of KV snapshots for both engines, as the local runtime gives a process's engines
  // (the answers here are one greedy answer, which i2's slot soon holds: engine/snapshots.test.ts
  // checks what is loaded).
  const kvDir = mkdtempSync(join(tmpdir(), 'magus-move-kv-'));
  stack.defer(() => rmSync(kvDir, { recursive: true, force: true }));
  for (const instance of ['i1', 'i2']) {
    const engine = await startSupervisedEngine(gguf, {
      modelId: POOL,
      slots: 1,
      threads: 1,
      ctx: 1024,
      startTimeoutSec: 60,
      name: `engine-${instance}`,
      log: () => undefined,
      snapshots: kvDir,
      stopGraceMs: 1000,
      restart: { maxRestarts: 10, backoffMs: 0 },
    });
    stack.defer(() => engine.stop());
    engines[instance] = engine;
    await ensureInstanceConsumer(await nc.jetstreamManager(), names, { pool: POOL, instance, slots: 1 });
    const bridgeNc = await natsConnectAsBridge(names, POOL, instance);
    stack.defer(() => bridgeNc.drain());
    const bridge = await startBridge({ nc: bridgeNc, names, pool: POOL, instance, engineUrl: engine.current.url, slots: 1, drainTimeoutMs: 1000 });
    stack.defer(() => bridge.stop());
    bridges[instance] = bridge;
  }
  // The conversation is on i1; the pool publishes both.
  ({ openai, gateway, secret } = await stack.open(
    // Streams are queued behind each other on purpose (one slot each): no bound on their wait (serving-queue-wait tests it).
    pinnedGatewayStack(nc, names, {
      tokenId: TOKEN_ID,
      pool: POOL,
      instance: 'i1',
      sessionId: SESSION,
      coldStarts,
      why: 'cold start in the move test',
      env: { MAGUS_MAX_QUEUE_WAIT: '0' },
    }),
  ));
  await publishPoolView(nc, names, POOL, ['i1', 'i2']);
}, 180_000);

afterAll(async () => {
  console.log(`moved answers:\n${measured.map((l) => `  ${l}`).join('\n')}`);
  await stack.close();
}, 60_000);

afterEach(() => {
  expect(coldStarts).toEqual([]);
});

type Streamed = TimedAnswer;

/**
 * Streams a greedy answer of {@link ANSWER_TOKENS} tokens; `onPiece` sees the count of pieces so
 * far. Through `via`, of conversation `session` (by default this file's gateway and conversation).
 */
async function stream(onPiece?: (pieces: number) => Promise<void> | void, via = openai, session = SESSION): Promise<Streamed> {
  const chunks = await via.chat.completions.create(
    {
      model: POOL,
      messages: [{ role: 'user', content: 'Tell me a long story about a small boat.' }],
      max_tokens: ANSWER_TOKENS,
      temperature: 0,
      stream: true,
      stream_options: { include_usage: true },
    },
    { headers: { 'x-session-id': session } },
  );
  return readTimed(chunks, onPiece);
}

/** Ledger records already looked at (earlier tests'). */
const seenRecords = new Set<string>();

/**
 * The key's ledger records written since the last look, once the one of the request answered as
 * `responseId` is there: a moved answer must be one record under the request's id, with no other
 * (a continuation's own id, the handed-back attempt's) beside it.
 */
async function records(responseId: string): Promise<Awaited<ReturnType<UsageLedger['read']>>> {
  const ledger = await UsageLedger.open(nc.jetstream(), names);
  const id = responseId.replace(/^chatcmpl-/, '');
  const read = () => ledger.read({ key: `config/${TOKEN_ID}` });
  await until('the usage record', async () => (await read()).some((r) => r.id === id));
  await new Promise((resolve) => setTimeout(resolve, 500)); // another would be written by now
  const fresh = (await read()).filter((r) => !seenRecords.has(r.id));
  for (const r of fresh) seenRecords.add(r.id);
  return fresh;
}

/** Checks a moved answer against the undisturbed one: its beginning to the byte, nothing repeated, usage once (`besides`: answers whose records are written meanwhile). */
async function expectWhole(what: string, answer: Streamed, reference: Streamed, cutAt: number, besides: Streamed[] = []): Promise<void> {
  const had = textAt(answer, cutAt);
  expect(had.length).toBeGreaterThan(0);
  expect(had).toBe(reference.text.slice(0, had.length));
  expect(answer.text.startsWith(had)).toBe(true);
  expect(answer).toMatchObject({ finish: 'length', usage: { completion_tokens: ANSWER_TOKENS, prompt_tokens: reference.usage!.prompt_tokens } });
  // A repeat would show as more pieces than tokens (each piece is at least one token).
  expect(answer.pieces).toBeLessThanOrEqual(ANSWER_TOKENS);
  const mine = await records(answer.id);
  expect(mine.map((r) => `${r.id} ${r.outcome} ${r.tokens.completion}`).sort()).toEqual(
    [answer, ...besides].map((a) => `${a.id.replace(/^chatcmpl-/, '')} completed ${ANSWER_TOKENS}`).sort(),
  );
  measured.push(`${what}: longest silence after the cut ${gapAfter(answer, cutAt)} ms`);
  // Continued exactly as undisturbed (engine/llama.ts `EXACT_BATCH`).
  expect(answer.text).toBe(reference.text);
}

let reference: Streamed;

test('the premise: an undisturbed answer of 200 tokens on i1', async () => {
  reference = await stream();
  expect(reference).toMatchObject({ finish: 'length', usage: { completion_tokens: ANSWER_TOKENS } });
  expect(await records(reference.id)).toHaveLength(1);
  await until('i1 acks it', () => bridges.i1!.stats.acked === 1);
  expect(bridges.i2!.stats.pulled).toBe(0);
  // Its engine's cache now holds this answer: a fresh one, so the next answer starts as this one did.
  const before = engines.i1!.restarts;
  process.kill(engines.i1!.current.process.child.pid!, 'SIGKILL');
  await until('i1 runs again', () => engines.i1!.restarts > before, 30_000);
}, 120_000);

/** i1's engine restarts before this: the next test waits for it. */
let restartsBeforeKill = 0;

test("i1's engine SIGKILLed at token ~50: the answer goes on on i2, continued from its tokens (its silence measured)", async () => {
  const continued = bridges.i2!.stats.continued;
  restartsBeforeKill = engines.i1!.restarts;
  let killedAt = 0;
  const answer = await stream((pieces) => {
    if (pieces !== 50) return;
    killedAt = Date.now();
    process.kill(engines.i1!.current.process.child.pid!, 'SIGKILL');
  });
  expect(bridges.i1!.stats.handedBack).toBe(1);
  expect(bridges.i2!.stats.continued - continued).toBe(1);
  await expectWhole('engine SIGKILLed at token 50', answer, reference, killedAt);
  expect(gapAfter(answer, killedAt)).toBeLessThanOrEqual(MAX_GAP_MS);
}, 120_000);

test("i1's engine SIGKILLed in the prompt phase: the answer is generated on i2 instead, its role said once", async () => {
  await until('i1 runs again', () => engines.i1!.restarts > restartsBeforeKill, 30_000);
  restartsBeforeKill = engines.i1!.restarts;
  const handedBack = bridges.i1!.stats.handedBack;
  const pid = engines.i1!.current.process.child.pid!;
  process.kill(pid, 'SIGSTOP');
  const pending = stream();
  await until('i1 calls its frozen engine', () => bridges.i1!.stats.inFlight === 1);
  const killedAt = Date.now();
  process.kill(pid, 'SIGKILL');
  const answer = await pending;
  expect(bridges.i1!.stats.handedBack - handedBack).toBe(1);
  expect(answer).toMatchObject({ finish: 'length', roles: 1, usage: { completion_tokens: ANSWER_TOKENS, prompt_tokens: reference.usage!.prompt_tokens } });
  expect(answer.pieces).toBeLessThanOrEqual(ANSWER_TOKENS);
  const mine = await records(answer.id);
  expect(mine.map((r) => `${r.id} ${r.outcome} ${r.tokens.completion}`)).toEqual([`${answer.id.replace(/^chatcmpl-/, '')} completed ${ANSWER_TOKENS}`]);
  measured.push(`engine SIGKILLed in the prompt phase: first piece ${gapAfter(answer, killedAt)} ms after the kill (the whole answer generated on i2)`);
  expect(gapAfter(answer, killedAt)).toBeLessThanOrEqual(MAX_GAP_MS);
}, 120_000);

/**
 * A raw SSE stream of the chat request (greedy, 200 tokens) through the gateway at `via` (the
 * test's, unless said), optionally resumed after `lastEventId`; `onEvent` sees each chunk event's
 * count, and when it resolves true the client goes away there (the stream not done).
 */
async function rawStream(
  o: { via?: string; lastEventId?: string; onEvent?: (n: number) => boolean | void | Promise<boolean | void> } = {},
): Promise<{ events: { id: string; content: string; at: number }[]; done: boolean }> {
  const ctl = new AbortController();
  const res = await fetch(`${o.via ?? gateway.url}/v1/chat/completions`, {
    method: 'POST',
    headers: {
      authorization: `Bearer ${openai.apiKey}`,
      'content-type': 'application/json',
      'x-session-id': SESSION,
      ...(o.lastEventId ? { 'last-event-id': o.lastEventId } : {}),
    },
    body: JSON.stringify({
      model: POOL,
      messages: [{ role: 'user', content: 'Tell me a long story about a small boat.' }],
      max_tokens: ANSWER_TOKENS,
      temperature: 0,
      stream: true,
    }),
    signal: ctl.signal,
  });
  expect(res.status).toBe(200);
  const events: { id: string; content: string; at: number }[] = [];
  let done = false;
  let buffer = '';
  const decoder = new TextDecoder();
  for await (const part of res.body as unknown as AsyncIterable<Uint8Array>) {
    buffer += decoder.decode(part, { stream: true });
    for (let end = buffer.indexOf('\n\n'); end >= 0; end = buffer.indexOf('\n\n')) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const id = /^id: (.*)$/m.exec(event)?.[1];
      const data = /^data: (.*)$/m.exec(event)?.[1];
      if (data === '[DONE]') done = true;
      else if (id && data) {
        const chunk = JSON.parse(data) as OpenAI.ChatCompletionChunk;
        events.push({ id, content: chunk.choices[0]?.delta?.content ?? '', at: Date.now() });
        if ((await o.onEvent?.(events.length)) === true) {
          // Leaving the loop cancels the body; the abort ends the connection whatever undici keeps of it.
          setImmediate(() => ctl.abort());
          return { events, done: false };
        }
      }
    }
  }
  return { events, done };
}

/** The response id of a raw stream's answer (its chunks' `id`): from the event ids' request id. */
const answerIdOf = (s: { events: { id: string }[] }): string =>
  `chatcmpl-${Buffer.from(s.events[0]!.id.split('.')[0]!, 'base64url').toString('utf8').split('/')[3]!}`;

const contentOf = (events: { content: string }[]): string => events.map((e) => e.content).join('');

test('a stream resumed (Last-Event-ID) from before its move gets the rest across the move, each piece once', async () => {
  await until('i1 runs again', () => engines.i1!.restarts > restartsBeforeKill, 30_000);
  restartsBeforeKill = engines.i1!.restarts;
  const moved = bridges.i1!.stats.handedBack;
  const whole = await rawStream({
    onEvent: (n) => {
      if (n === 40) process.kill(engines.i1!.current.process.child.pid!, 'SIGKILL');
    },
  });
  expect(whole.done).toBe(true);
  expect(bridges.i1!.stats.handedBack - moved).toBe(1);
  expect(await records(answerIdOf(whole))).toHaveLength(1);
  // From the 20th event (before the move): the rest, after it, as the first stream had it.
  const resumed = await rawStream({ lastEventId: whole.events[19]!.id });
  expect(resumed.done).toBe(true);
  expect(resumed.events.map((e) => e.id)).toEqual(whole.events.slice(20).map((e) => e.id));
  expect(contentOf(resumed.events)).toBe(contentOf(whole.events.slice(20)));
  // And from an event after the move.
  const late = await rawStream({ lastEventId: whole.events[100]!.id });
  expect(contentOf(late.events)).toBe(contentOf(whole.events.slice(101)));
}, 120_000);

test('a stream whose gateway died, then whose engine was SIGKILLed: resumed on another replica, which continues it on i2 itself (nobody else can)', async () => {
  await until('i1 runs again', () => engines.i1!.restarts > restartsBeforeKill, 30_000);
  restartsBeforeKill = engines.i1!.restarts;
  // The replica the stream begins on, on a connection of its own: cut, it is dead as far as the data plane can tell.
  const doomedNc = await natsConnectAs('gateway', names, 'magus-test-doomed-gateway');
  const doomed = await gatewayStack(names, {
    nc: doomedNc,
    secret,
    tokens: { [TOKEN_ID]: openai.apiKey! },
    env: { MAGUS_LOG_LEVEL: 'silent', MAGUS_MAX_QUEUE_WAIT: '0' },
    deps: { coldStart: refusedColdStart(coldStarts, 'cold start in the move test') },
  });
  const handedBack = bridges.i1!.stats.handedBack;
  const continued = bridges.i2!.stats.continued;
  // 20 pieces in, the gateway dies (its NATS connection cut before its client's: it cancels nothing), then the client's connection goes.
  const first = await rawStream({
    via: doomed.gateway.url,
    onEvent: async (n) => {
      if (n < 20) return false;
      await doomedNc.close();
      return true;
    },
  });
  await Promise.resolve(doomed.close()).catch(() => undefined);
  expect(first.events).toHaveLength(20);
  // Then its engine: i1's bridge hands the answer back, and no gateway that published it is there to move it.
  process.kill(engines.i1!.current.process.child.pid!, 'SIGKILL');
  await until('i1 hands the answer back', () => bridges.i1!.stats.handedBack - handedBack === 1, 30_000);
  const resumedAt = Date.now();
  const rest = await rawStream({ lastEventId: first.events[19]!.id });
  expect(rest.done).toBe(true);
  expect(bridges.i2!.stats.continued - continued).toBe(1);
  // The ids go on as the first stream had them: its seqs, in order, none twice.
  const seqs = rest.events.map((e) => Number(e.id.split('.')[2]));
  expect(seqs).toEqual(seqs.map((_, i) => 20 + i));
  expect(rest.events.every((e) => e.id.startsWith(first.events[0]!.id.slice(0, first.events[0]!.id.lastIndexOf('.') + 1)))).toBe(true);
  const text = contentOf(first.events) + contentOf(rest.events);
  expect(contentOf(first.events)).toBe(reference.text.slice(0, contentOf(first.events).length));
  // A repeat would show as more pieces of text than tokens (the role's and the finish's events hold none).
  expect([...first.events, ...rest.events].filter((e) => e.content !== '').length).toBeLessThanOrEqual(ANSWER_TOKENS);
  // One record under the request's id, with the whole answer.
  const mine = await records(answerIdOf(first));
  expect(mine.map((r) => `${r.id} ${r.outcome} ${r.tokens.completion}`)).toEqual([`${answerIdOf(first).replace(/^chatcmpl-/, '')} completed ${ANSWER_TOKENS}`]);
  // What was stored came at once; the longest silence is the move (the first replica is gone: NATS says so, and the move is claimed here at once).
  const silence = Math.max(...rest.events.map((e, i) => e.at - (i === 0 ? resumedAt : rest.events[i - 1]!.at)));
  measured.push(`gateway gone, then engine SIGKILLed: resumed on another replica, longest silence ${silence} ms`);
  expect(text).toBe(reference.text);
}, 120_000);

test('a background response whose gateway died, then whose engine was SIGKILLed: a poll on another replica adopts it, continues it on the other instance and stores it whole', async () => {
  await until('i1 runs again', () => engines.i1!.restarts > restartsBeforeKill, 30_000);
  restartsBeforeKill = engines.i1!.restarts;
  const doomedNc = await natsConnectAs('gateway', names, 'magus-test-doomed-background-gateway');
  const doomed = await gatewayStack(names, {
    nc: doomedNc,
    secret,
    tokens: { [TOKEN_ID]: openai.apiKey! },
    env: { MAGUS_LOG_LEVEL: 'silent', MAGUS_MAX_QUEUE_WAIT: '0' },
    // A response is a conversation of its own: placed on i1 (pinned: never moved but by a hand-back).
    deps: { coldStart: () => Promise.resolve({ subject: requestSubjectOf(names, POOL, 'i1'), pool: POOL, instance: 'i1', expiresAt: Date.now() + 120_000 }) },
  });
  const handedBack = { i1: bridges.i1!.stats.handedBack, i2: bridges.i2!.stats.handedBack };
  const continued = { i1: bridges.i1!.stats.continued, i2: bridges.i2!.stats.continued };
  const ask = (via: string, path: string, body?: unknown) =>
    fetch(`${via}${path}`, {
      method: body ? 'POST' : 'GET',
      headers: { authorization: `Bearer ${openai.apiKey}`, 'content-type': 'application/json' },
      ...(body ? { body: JSON.stringify(body) } : {}),
    });
  const created = await ask(doomed.gateway.url, '/v1/responses', {
    model: POOL,
    input: 'Tell me a long story about a small boat.',
    background: true,
    max_output_tokens: ANSWER_TOKENS,
    temperature: 0,
  });
  expect(created.status).toBe(200);
  const requestId = created.headers.get('x-request-id')!;
  const { id } = (await created.json()) as { id: string };
  type Polled = { status: string; incomplete_details?: unknown; output: { content?: { text: string }[] }[]; usage?: { output_tokens: number } };
  const textOf = (r: Polled) =>
    r.output
      .flatMap((o) => o.content ?? [])
      .map((c) => c.text)
      .join('');
  const poll = async (): Promise<Polled> => (await (await ask(gateway.url, `/v1/responses/${id}`)).json()) as Polled;
  // Some of it said, on whichever instance took it; then its gateway is gone (cut off from NATS first: it cancels nothing).
  let before: Polled | undefined;
  await until('the answer under way', async () => textOf((before = await poll())).length > 40, 60_000);
  const [on, other] = ['i1', 'i2'] as const;
  await doomedNc.close();
  await Promise.resolve(doomed.close()).catch(() => undefined);
  // Then its engine: its bridge hands the answer back, and the replica that would move it is gone.
  process.kill(engines[on]!.current.process.child.pid!, 'SIGKILL');
  await until('the answer handed back', () => bridges[on]!.stats.handedBack - handedBack[on] === 1, 30_000);
  // Polled on the replica left: it adopts the run, claims the move and sends the rest to the other instance.
  let after: Polled = before!;
  // Cut by max_output_tokens, as the undisturbed answer is: `incomplete`.
  await until('the response ended', async () => !['queued', 'in_progress'].includes((after = await poll()).status), 90_000);
  expect(after).toMatchObject({ status: 'incomplete', incomplete_details: { reason: 'max_output_tokens' } });
  expect(bridges[other]!.stats.continued - continued[other]).toBe(1);
  expect(textOf(after).startsWith(textOf(before!))).toBe(true);
  expect(after.usage?.output_tokens).toBe(ANSWER_TOKENS);
  // One usage record under the request's id, with the whole answer.
  const mine = await records(requestId);
  expect(mine.map((r) => `${r.id} ${r.outcome} ${r.tokens.completion}`)).toEqual([`${requestId} completed ${ANSWER_TOKENS}`]);
  measured.push(`background response, gateway gone, then engine SIGKILLed: adopted by a poll on another replica, continued on ${other}`);
}, 180_000);

test('i1 stopped at token ~30 (its drain deadline, 1 s, passes mid-answer): the answer goes on on i2 instead of being cut, and the one queued behind it is served there', async () => {
  await until('i1 runs again', () => engines.i1!.restarts > restartsBeforeKill, 30_000);
  const continued = bridges.i2!.stats.continued;
  const handedBack = bridges.i1!.stats.handedBack;
  // What i2's lanes delivered: the answer mid-way to its moved answers, the one with nothing said to its requeued requests.
  const lanes = async () => {
    const jsm = await nc.jetstreamManager();
    const delivered = async (lane: Lane) => (await jsm.consumers.info(names.requestStream, laneConsumerNameOf(POOL, 'i2', lane))).delivered.consumer_seq;
    return { moved: await delivered('moved'), requeued: await delivered('requeued') };
  };
  const lanesBefore = await lanes();
  let stoppedAt = 0;
  let stopping: Promise<void> | undefined;
  let queued: Promise<Streamed> | undefined;
  const answer = await stream((pieces) => {
    // A second answer of the conversation, queued behind this one on i1 (one slot).
    if (pieces === 5) queued = stream();
    if (pieces !== 30) return;
    stoppedAt = Date.now();
    stopping = bridges.i1!.stop();
  });
  await stopping;
  // Still queued at the deadline: handed back before any of it was said, and answered whole on i2.
  const behind = await queued!;
  expect(behind).toMatchObject({ finish: 'length', roles: 1, usage: { completion_tokens: ANSWER_TOKENS, prompt_tokens: reference.usage!.prompt_tokens } });
  expect(behind.pieces).toBeLessThanOrEqual(ANSWER_TOKENS);
  expect(bridges.i1!.stats.handedBack - handedBack).toBe(2);
  expect(bridges.i2!.stats.continued - continued).toBe(1);
  expect(await lanes()).toEqual({ moved: lanesBefore.moved + 1, requeued: lanesBefore.requeued + 1 });
  await expectWhole('instance stopped at token 30 (drain 1 s)', answer, reference, stoppedAt, [behind]);
  expect(gapAfter(answer, stoppedAt)).toBeLessThanOrEqual(MAX_GAP_MS);
  measured.push(`queued behind it when the instance stopped: its first piece ${gapAfter(behind, stoppedAt)} ms after the stop, from i2`);
}, 120_000);

test("i1's bridge cut off at token ~50 (its NATS connection gone, as a SIGKILL leaves it): the gateway hears no beat and continues on i2 (its silence measured)", async () => {
  // A new bridge for i1 (the last one was stopped).
  const bridgeNc = await natsConnectAsBridge(names, POOL, 'i1');
  const bridge = await startBridge({ nc: bridgeNc, names, pool: POOL, instance: 'i1', engineUrl: engines.i1!.current.url, slots: 1 });
  stack.defer(() => bridge.stop());
  const continued = bridges.i2!.stats.continued;
  let cutAt = 0;
  const answer = await stream(async (pieces) => {
    if (pieces !== 50) return;
    cutAt = Date.now();
    await bridgeNc.close();
  });
  expect(bridge.stats.pulled).toBe(1);
  expect(bridges.i2!.stats.continued - continued).toBe(1);
  await expectWhole('bridge cut off at token 50', answer, reference, cutAt);
  expect(gapAfter(answer, cutAt)).toBeLessThanOrEqual(MAX_GAP_MS);
}, 120_000);

test("a conversation on i1 whose bridge died before this gateway started (it never heard it): its turn is answered whole on i2 about a second later, not at the request's deadline", async () => {
  // i1 has no bridge now (the last one's connection was cut above); i1's consumer still holds its queue.
  const session = `${SESSION}-unheard`;
  const coldStarted: string[] = [];
  const late = await stack.open(
    pinnedGatewayStack(nc, names, { tokenId: `${TOKEN_ID}-late`, pool: POOL, instance: 'i1', sessionId: session, coldStarts: coldStarted, why: 'cold start' }),
  );
  const pulled = bridges.i2!.stats.pulled;
  const asked = Date.now();
  const answer = await stream(undefined, late.openai, session);
  const firstPieceMs = answer.times[0]! - asked;
  measured.push(`a turn sent to i1 whose bridge this gateway never heard: first piece after ${firstPieceMs} ms, on i2`);
  expect(coldStarted).toEqual([]);
  // Nothing was said on i1: i2 answers it whole, as undisturbed.
  expect(answer).toMatchObject({ finish: 'length', roles: 1, usage: { completion_tokens: ANSWER_TOKENS } });
  expect(answer.text).toBe(reference.text);
  expect(bridges.i2!.stats.pulled - pulled).toBe(1);
  // Moved once this gateway had listened for a second and heard only i2: well before any deadline.
  expect(firstPieceMs).toBeLessThan(MAX_GAP_MS);
}, 120_000);

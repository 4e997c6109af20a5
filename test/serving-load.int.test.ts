/**
 * The warm serving path under load: 200 conversations at once, each with its own `x-session-id`
 * and three turns (non-stream and stream mixed), through the real gateway → nats-server
 * (JetStream) → two real bridges → two stub engines that echo the last user message. Sessions
 * are warm-seeded: the test writes each conversation's `magus_sessions` entry, as the session
 * workflow would, before the gateway starts, so no turn may take the cold path.
 */
import { randomBytes } from 'node:crypto';
import type { NatsConnection } from 'nats';
import OpenAI from 'openai';
import { openModelRegistry } from '../dataplane/registry';
import { pinConversation, refusedColdStart } from './harness/gateway';
import { conversationKey } from '../gateway/serving/conversation';
import type { RunningGateway } from '../gateway/server';
import { LogSink, readyModel } from './harness/gateway-app';
import type { ChatMessage } from '../shared/chat';
import type { Bridge } from '../dataplane/bridge';
import type { StubEngine } from './fixtures/stub-engine';
import { isolation } from './harness';
import { gatewayStack, natsStack, stubInstanceStack, TestStack } from './harness/stack';
import { sleep } from './harness/wait';

const iso = isolation();
const POOL = 'stub-load';
const MODEL = readyModel(POOL);
const INSTANCES = ['i1', 'i2'] as const;
const CONVERSATIONS = 200;
const TURNS = 3;
const SLOTS = 16;
const STREAM_CHUNKS = 8;
const TOKEN_ID = 'load';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(24).toString('hex')}`;
const SECRET = randomBytes(32).toString('hex');

let nc: NatsConnection;
let gateway: RunningGateway;
const engines = new Map<string, StubEngine>();
const bridges = new Map<string, Bridge>();
const bridgeLog: string[] = [];
const gatewayLog = new LogSink();
const coldStarts: string[] = [];
const stack = new TestStack();

/** Conversation `i` runs on instance `instanceOf(i)`, as its seeded session says. */
const instanceOf = (i: number) => INSTANCES[i % INSTANCES.length]!;
const sessionId = (i: number) => `load-${iso.id}-${i}`;

beforeAll(async () => {
  const nats = await stack.open(natsStack(iso, { declare: true }));
  const { names } = nats;
  nc = nats.nc;
  for (const instance of INSTANCES) {
    const { engine, bridge } = await stack.open(
      stubInstanceStack(nc, names, {
        pool: POOL,
        instance,
        slots: SLOTS,
        engine: { chunks: STREAM_CHUNKS },
        bridge: { log: (line) => bridgeLog.push(`${instance}: ${line}`) },
      }),
    );
    engines.set(instance, engine);
    bridges.set(instance, bridge);
  }
  await (await openModelRegistry(nc, names.modelsBucket)).put(MODEL);

  // Pin every conversation to its instance (an entry without `placedAt`), as a gateway would place it.
  for (let i = 0; i < CONVERSATIONS; i++) {
    const key = conversationKey(SECRET, { scope: TOKEN_ID, model: `${MODEL.namespace}/${MODEL.name}`, messages: [], sessionId: sessionId(i) });
    await pinConversation(nc, names, key, POOL, instanceOf(i));
  }

  // The entries were written before the watch started, so `ready` means they are all loaded.
  ({ gateway } = await stack.open(
    gatewayStack(names, {
      secret: SECRET,
      tokens: { [TOKEN_ID]: TOKEN },
      env: {
        MAGUS_GATEWAY_REQUEST_TIMEOUT_MS: '30000',
        // Everything the gateway says, so the token check below covers the most log lines.
        MAGUS_LOG_LEVEL: 'trace',
      },
      deps: { coldStart: refusedColdStart(coldStarts, 'cold start during the warm load test'), logStream: gatewayLog },
    }),
  ));
}, 60_000);

afterAll(() => stack.close(), 60_000);

interface TurnResult {
  conversation: number;
  turn: number;
  stream: boolean;
  prompt: string;
  id: string;
  text: string;
  finishReason: string | null | undefined;
  chunks: number;
}

/** One conversation as a chat client runs it: every turn resends the history so far. */
async function converse(openai: OpenAI, i: number): Promise<TurnResult[]> {
  const messages: { role: 'system' | 'user' | 'assistant'; content: string }[] = [{ role: 'system', content: 'You echo.' }];
  const out: TurnResult[] = [];
  const headers = { 'x-session-id': sessionId(i) };
  for (let t = 0; t < TURNS; t++) {
    // Mixed per turn and per conversation; long enough for every stub chunk to carry text.
    const stream = (i + t) % 2 === 1;
    const prompt = `conversation ${i} turn ${t} ${randomBytes(6).toString('hex')}`;
    messages.push({ role: 'user', content: prompt });
    let r: TurnResult;
    if (stream) {
      const s = await openai.chat.completions.create({ model: POOL, messages, stream: true }, { headers });
      let text = '';
      let chunks = 0;
      let id = '';
      let finishReason: string | null | undefined;
      for await (const c of s) {
        id = c.id;
        const choice = c.choices[0];
        text += choice?.delta?.content ?? '';
        finishReason = choice?.finish_reason ?? finishReason;
        if (choice?.delta?.content) chunks++;
      }
      r = { conversation: i, turn: t, stream, prompt, id, text, finishReason, chunks };
    } else {
      const c = await openai.chat.completions.create({ model: POOL, messages }, { headers });
      r = {
        conversation: i,
        turn: t,
        stream,
        prompt,
        id: c.id,
        text: c.choices[0]?.message.content ?? '',
        finishReason: c.choices[0]?.finish_reason,
        chunks: 0,
      };
    }
    out.push(r);
    messages.push({ role: 'assistant', content: r.text });
  }
  return out;
}

test(`${CONVERSATIONS} concurrent conversations of ${TURNS} turns all complete, correctly and once`, async () => {
  const openai = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: TOKEN, maxRetries: 0, timeout: 30_000 });
  const settled = await Promise.allSettled(Array.from({ length: CONVERSATIONS }, (_, i) => converse(openai, i)));
  const failures = settled.flatMap((s, i) => (s.status === 'rejected' ? [`conversation ${i}: ${String(s.reason)}`] : []));
  expect(failures).toEqual([]);
  const results = settled.flatMap((s) => (s.status === 'fulfilled' ? s.value : []));
  expect(results).toHaveLength(CONVERSATIONS * TURNS);

  // Complete and correct: the echo of exactly this turn's prompt, ended normally.
  for (const r of results) {
    expect(r).toEqual({ ...r, text: r.prompt });
    expect(r.finishReason).toBe('stop');
    if (r.stream) expect(r.chunks).toBe(STREAM_CHUNKS);
  }
  expect(results.filter((r) => r.stream)).toHaveLength((CONVERSATIONS * TURNS) / 2);
  // None duplicated: one response id per request, and each prompt reached an engine exactly once …
  expect(new Set(results.map((r) => r.id)).size).toBe(results.length);
  const received = [...engines.values()].flatMap((e) => e.requests.map((q) => (q.body as { messages: ChatMessage[] }).messages.at(-1)!.content));
  expect(received.length).toBe(results.length);
  expect(new Set(received).size).toBe(received.length);
  // … on the instance its session names (affinity), without any JetStream redelivery.
  for (const [instance, engine] of engines) {
    const mine = results
      .filter((r) => instanceOf(r.conversation) === instance)
      .map((r) => r.prompt)
      .sort();
    expect(engine.requests.map((q) => (q.body as { messages: ChatMessage[] }).messages.at(-1)!.content).sort()).toEqual(mine);
  }
  // A bridge records the answer in the claim and acks right after the client has it: let the last ones finish.
  for (let i = 0; i < 200 && [...bridges.values()].some((b) => b.stats.inFlight > 0); i++) await sleep(10);
  for (const b of bridges.values()) {
    expect(b.stats).toMatchObject({ redelivered: 0, replayed: 0, superseded: 0, nakked: 0, termed: 0, errors: 0, inFlight: 0 });
  }
  expect([...bridges.values()].reduce((n, b) => n + b.stats.acked, 0)).toBe(results.length);
  expect(bridgeLog).toEqual([]);

  // Every turn was warm: answered from the sessions mirror, never the cold path.
  expect(coldStarts).toEqual([]);
  expect(gateway.sessionCache!.stats()).toEqual({
    warmHits: CONVERSATIONS * TURNS,
    coldStarts: 0,
    firstTurns: 0,
    moves: 0,
    renewals: 0,
    givenBack: 0,
    staleViewPicks: 0,
    pendingSessionStarts: 0,
    refusedForPendingStarts: 0,
    queueMoves: 0,
    refusedForQueueWait: 0,
    orphansAdopted: 0,
    orphansSwept: 0,
  });

  // The gateway logged (at trace level) but never the token, nor its secret part.
  expect(gatewayLog.lines.length).toBeGreaterThan(results.length);
  const secretPart = TOKEN.slice(`mgs_${TOKEN_ID}_`.length);
  expect(gatewayLog.lines.filter((l) => l.includes(TOKEN) || l.includes(secretPart))).toEqual([]);
}, 60_000);

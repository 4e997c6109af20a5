/**
 * The bridge against the real nats-server and a tiny OpenAI-like engine written here (streams N
 * SSE chunks or one JSON completion, with controllable delays and failures). The subscriber in
 * these tests applies the gateway's rule (FrameSequencer) to whatever arrives on the response
 * subject, exactly as the gateway must.
 */
import { setTimeout as timer } from 'node:timers/promises';
import { createServer, type IncomingHttpHeaders, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import { randomBytes } from 'node:crypto';
import { type AddressInfo } from 'node:net';
import { connect, Events, type JetStreamManager, type NatsConnection } from 'nats';
import { endpoint, isolation, natsConnectAsBridge, natsSignerFile } from '../../test/harness';
import { natsStack, TestStack } from '../../test/harness/stack';
import type { ChatCompletionRequest } from '../../shared/chat';
import {
  bridgeLoadOf,
  type BridgeLoad,
  type ChatInference,
  type CompletionsInference,
  type EmbeddingsInference,
  type InferenceRequest,
  type ResponseFrame,
} from '../../shared/serving';
import { bridgeCredentialsText, bridgePermissions, natsAuthOptions, parseCredentialsFile, readNatsSigner } from '../roles';
import { claimKeyOf, endClaim, openRequestClaims } from '../claims';
import { ensureInstanceConsumer, REQUEUED_HELD, type InstanceConsumerOptions } from '../consumers';
import { ensureDataPlane } from '../declare';
import { encodeJson } from '../json';
import {
  beatSubjectOf,
  cancelSubjectOf,
  consumerNameOf,
  instanceResponseSubjectOf,
  laneConsumerNameOf,
  laneSubjectOf,
  requestSubjectFor,
  requestSubjectOf,
  responseSubjectOf,
  scopedSubject,
  type DataPlaneNames,
} from '../names';
import { publishRequest } from '../publish';
import { readStoredFrames } from '../response-stream';
import { UsageLedger } from '../usage';
import type { UsageRecord } from '../../shared/usage';
import { decodeFrame, FrameSequencer } from '../frames';
import { CLAIM_CHECK_MS } from './attempt';
import { startBridge, type Bridge, type BridgeOptions } from './bridge';
import { BridgeErrorCode } from './error-frames';
import { seedFor } from './requests';
import { CONTINUE_ELSEWHERE, DUE_HEADER, ENGINE_STARTING, REQUEUED_HEADER, STOPPING_BEAT_EVERY_MS } from '../../shared/continuation';
import { sleep, until } from '../../test/harness/wait';

const POOL = 'pool';

// ---------------------------------------------------------------------------------------------
// A minimal OpenAI-compatible engine

interface Reply {
  /** Non-2xx: answer with an OpenAI error body. */
  status?: number;
  /** Streamed chunks with content (a final `finish_reason` chunk follows). Default 4. */
  chunks?: number;
  delayMs?: number;
  firstDelayMs?: number;
  /** Ignore the seed (an engine that does not repeat itself). */
  random?: boolean;
  /** The error's code (non-2xx). Default `stub_error`. */
  code?: string;
  /** Dies after this many content chunks: the connection is destroyed mid-stream. */
  dieAfter?: number;
  /** Says its tokens when asked, and resumes an answer after the tokens it is sent (shared/continuation.ts). */
  tokens?: boolean;
}

/** What a deterministic engine says for `seed`: the i-th content delta. */
const token = (seed: number, i: number) => `w${(seed + i * 7919) % 997}.${i} `;
const expectedText = (seed: number, n: number) => Array.from({ length: n }, (_, i) => token(seed, i)).join('');

class StubEngine {
  readonly calls: ChatCompletionRequest[] = [];
  /** The headers of each of {@link calls}. */
  readonly callHeaders: IncomingHttpHeaders[] = [];
  /** Calls whose connection closed before the answer was complete (the bridge cut them). */
  cut = 0;
  active = 0;
  maxActive = 0;
  private server!: Server;
  url = '';
  constructor(private readonly reply: (call: number, body: ChatCompletionRequest) => Reply) {}

  async start(): Promise<this> {
    this.server = createServer((req, res) => void this.handle(req, res));
    await new Promise<void>((r) => this.server.listen(0, '127.0.0.1', r));
    this.url = `http://127.0.0.1:${(this.server.address() as AddressInfo).port}`;
    return this;
  }

  /** Bodies posted to `/v1/embeddings`. */
  readonly embeddingCalls: unknown[] = [];
  /** Bodies posted to `/v1/completions` (answered with the text `a`, `b` streamed, or `ab`). */
  readonly textCalls: { stream?: boolean; seed?: number }[] = [];

  /** Its process dies: every connection is cut at once (it answers again, as a restarted engine). */
  dropConnections(): void {
    this.server.closeAllConnections();
  }

  async close(): Promise<void> {
    this.server.closeAllConnections();
    await new Promise<void>((r) => this.server.close(() => r()));
  }

  private async handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    if (req.url === '/health') {
      res.end('{"status":"ok"}');
      return;
    }
    let raw = '';
    for await (const c of req) raw += String(c);
    if (req.url === '/v1/completions') {
      const body = JSON.parse(raw) as { stream?: boolean; seed?: number };
      this.textCalls.push(body);
      const base = { id: 'cmpl-engine', object: 'text_completion', created: 1, model: 'stub' };
      if (!body.stream) {
        res.writeHead(200, { 'content-type': 'application/json' });
        res.end(JSON.stringify({ ...base, choices: [{ index: 0, text: 'ab', logprobs: null, finish_reason: 'stop' }] }));
        return;
      }
      res.writeHead(200, { 'content-type': 'text/event-stream' });
      for (const [text, finish] of [
        ['a', null],
        ['b', null],
        ['', 'stop'],
      ])
        res.write(`data: ${JSON.stringify({ ...base, choices: [{ index: 0, text, logprobs: null, finish_reason: finish }] })}\n\n`);
      res.end('data: [DONE]\n\n');
      return;
    }
    if (req.url === '/v1/embeddings') {
      this.embeddingCalls.push(JSON.parse(raw) as unknown);
      res.writeHead(200, { 'content-type': 'application/json' });
      res.end(JSON.stringify(EMBEDDINGS));
      return;
    }
    const body = JSON.parse(raw) as ChatCompletionRequest;
    const call = this.calls.push(body) - 1;
    this.callHeaders.push(req.headers);
    const r = this.reply(call, body);
    this.active += 1;
    this.maxActive = Math.max(this.maxActive, this.active);
    const closed = new AbortController();
    const gone = () => closed.signal.aborted;
    res.on('close', () => {
      closed.abort();
      if (!res.writableEnded) this.cut += 1;
    });
    try {
      if (r.firstDelayMs) await timer(r.firstDelayMs, undefined, { signal: closed.signal }).catch(() => undefined);
      if (gone()) return;
      if (r.status && r.status >= 300) {
        res.writeHead(r.status, { 'content-type': 'application/json' });
        res.end(
          JSON.stringify({
            error: { message: `stub says ${r.status}`, type: r.status < 500 ? 'invalid_request_error' : 'server_error', code: r.code ?? 'stub_error' },
          }),
        );
        return;
      }
      const seed = r.random ? Math.floor(Math.random() * 1e6) : (body.seed ?? 0);
      const n = r.chunks ?? 4;
      const base = { id: `chatcmpl-stub-${call}`, created: Math.floor(Date.now() / 1000), model: body.model };
      if (!body.stream) {
        if (r.delayMs) await sleep(r.delayMs * n);
        res.writeHead(200, { 'content-type': 'application/json' });
        res.end(
          JSON.stringify({
            ...base,
            object: 'chat.completion',
            choices: [{ index: 0, message: { role: 'assistant', content: expectedText(seed, n) }, finish_reason: 'stop' }],
          }),
        );
        return;
      }
      res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' });
      const event = (choice: unknown, extra: Record<string, unknown> = {}) =>
        res.write(`data: ${JSON.stringify({ ...base, object: 'chat.completion.chunk', choices: [choice], ...extra })}\n\n`);
      // With `tokens`: content delta i is token i, and an answer resumes after the tokens sent.
      const magus = r.tokens ? (body as { magus?: { tokens?: boolean; resume?: { tokens: number[] } } }).magus : undefined;
      for (let i = magus?.resume?.tokens.length ?? 0; i < n && !gone(); i += 1) {
        if (i > 0 && r.delayMs) await sleep(r.delayMs);
        if (r.dieAfter !== undefined && i >= r.dieAfter) {
          res.destroy();
          return;
        }
        event({ index: 0, delta: { content: token(seed, i) }, finish_reason: null }, magus?.tokens ? { magus: { tokens: [i] } } : {});
      }
      if (!gone()) {
        event({ index: 0, delta: {}, finish_reason: 'stop' }, { timings: { predicted_ms: Math.random() } });
        res.end('data: [DONE]\n\n');
      }
    } finally {
      this.active -= 1;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Harness

let nc: NatsConnection;
let jsm: JetStreamManager;
let names: DataPlaneNames;
const cleanups: (() => Promise<unknown>)[] = [];
const stack = new TestStack();

/** The usage ledger the bridges write to. */
let ledger: UsageLedger;

beforeAll(async () => {
  ({ nc, names } = await stack.open(natsStack(isolation(), { declare: true })));
  jsm = await nc.jetstreamManager();
  ledger = await UsageLedger.open(nc.jetstream(), names);
});

afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c().catch(() => undefined);
});

afterAll(() => stack.close());

let instanceCounter = 0;
/** A fresh instance (its own consumer and subject) so tests never see each other's requests. */
async function instanceWith(consumer: Partial<InstanceConsumerOptions> = {}): Promise<string> {
  instanceCounter += 1;
  const instance = `i${instanceCounter}`;
  await ensureInstanceConsumer(jsm, names, { pool: POOL, instance, slots: 1, ...consumer });
  return instance;
}

async function engine(reply: (call: number, body: ChatCompletionRequest) => Reply): Promise<StubEngine> {
  const e = await new StubEngine(reply).start();
  cleanups.push(() => e.close());
  return e;
}

const logs: string[] = [];
/** A bridge of `instance` on `conn`, by default a connection of its own as the instance's bridge user (as a runtime starts one). */
async function bridge(instance: string, engineUrl: string, opts: Partial<BridgeOptions> = {}, conn?: NatsConnection): Promise<Bridge> {
  if (!conn) {
    const own = await natsConnectAsBridge(names, POOL, instance);
    cleanups.push(() => own.close());
    conn = own;
  }
  const b = await startBridge({ nc: conn, names, pool: POOL, instance, engineUrl, slots: 1, retryDelayMs: 100, log: (l) => logs.push(l), ...opts });
  cleanups.push(() => b.stop());
  return b;
}

const EMBEDDINGS = {
  object: 'list',
  data: [
    { object: 'embedding', index: 0, embedding: [0.25] },
    { object: 'embedding', index: 1, embedding: [-0.5] },
  ],
  model: 'stub',
  usage: { prompt_tokens: 2, total_tokens: 2 },
};

const newId = () => `req-${randomBytes(6).toString('hex')}`;

/** The gateway replica this suite's requests name, as a gateway's do. */
const REPLICA = 'gw-test';
/** A request's envelope as a gateway sends it: its replica's reply subject, its frames asked for on the instance's subject. */
const envelopeOf = (id: string) => ({ id, replyTo: responseSubjectOf(names, id, REPLICA), instanceFrames: true });
/** Where `instance`'s bridge publishes the frames of `req` (and reads them back). */
const framesSubjectOf = (instance: string, req: InferenceRequest) => instanceResponseSubjectOf(req.replyTo, req.id, POOL, instance);

function requestFor(body: Partial<ChatCompletionRequest> = {}, over: Partial<ChatInference> = {}): ChatInference {
  const id = over.id ?? newId();
  return {
    ...envelopeOf(id),
    deadline: Date.now() + 60_000,
    body: { model: 'stub', messages: [{ role: 'user', content: 'Say something.' }], stream: true, ...body },
    ...over,
  };
}

interface Answer {
  /** Every frame that arrived, in arrival order. */
  raw: ResponseFrame[];
  /** What the gateway relays (FrameSequencer). */
  relayed: ResponseFrame[];
  /** Resolves with the relayed frames once a terminal frame was relayed. */
  finished: Promise<ResponseFrame[]>;
  text(): string;
}

/**
 * Subscribes to a request's frames (before publishing, like the gateway): on any instance's
 * subject for it, or with `subject` on that one (a request without `instanceFrames`: its `replyTo`).
 */
async function listen(id: string, timeoutMs = 30_000, subject = scopedSubject(names, `magus.res.${REPLICA}.*.*.${id}`)): Promise<Answer> {
  const raw: ResponseFrame[] = [];
  const relayed: ResponseFrame[] = [];
  const sequencer = new FrameSequencer();
  const sub = nc.subscribe(subject);
  const finished = (async () => {
    const timer = setTimeout(() => sub.unsubscribe(), timeoutMs);
    for await (const m of sub) {
      const f = decodeFrame(m.data);
      if (!f) continue;
      raw.push(f);
      relayed.push(...sequencer.push(f));
      if (sequencer.finished) break;
    }
    clearTimeout(timer);
    sub.unsubscribe();
    if (!sequencer.finished) throw new Error(`no complete answer for ${id} within ${timeoutMs} ms; got seqs ${raw.map((f) => f.seq).join(',')}`);
    return relayed;
  })();
  finished.catch(() => undefined); // awaited by the test; avoid an unhandled rejection before that
  await nc.flush();
  return {
    raw,
    relayed,
    finished,
    text: () =>
      relayed
        .map((f) => {
          const d = (f as { data?: { choices?: { delta?: { content?: string }; message?: { content?: string } }[] } }).data;
          return d?.choices?.map((c) => c.delta?.content ?? c.message?.content ?? '').join('') ?? '';
        })
        .join(''),
  };
}

async function send(instance: string, req: InferenceRequest): Promise<void> {
  await publishRequest(nc.jetstream(), names, { pool: POOL, instance }, req);
}

/** A new request to `instance`, published once its answer is listened for. */
async function sent(instance: string, ...request: Parameters<typeof requestFor>): Promise<{ req: InferenceRequest; answer: Answer }> {
  const req = requestFor(...request);
  const answer = await listen(req.id);
  await send(instance, req);
  return { req, answer };
}

const consumerState = (instance: string) => jsm.consumers.info(names.requestStream, consumerNameOf(POOL, instance));
/** Waits until `instance`'s consumer holds nothing: the server applies acks and terms asynchronously, shortly after they are sent. */
const consumerEmptied = (instance: string, what = 'the consumer empty') =>
  until(
    what,
    async () => {
      const state = await consumerState(instance);
      return state.num_ack_pending + state.num_pending === 0;
    },
    10_000,
  );

// ---------------------------------------------------------------------------------------------

describe('stored frames', () => {
  it('frames the response stream cannot store yet reach the listener at once; the request is acked only once they are stored', async () => {
    const stub = await engine(() => ({ chunks: 3 }));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    // No stream stores the frames (what a cluster's election looks like to a publisher).
    await jsm.streams.delete(names.responseStream);
    let req: InferenceRequest;
    try {
      const asked = await sent(instance);
      req = asked.req;
      expect((await asked.answer.finished).map((f) => f.seq)).toEqual([0, 1, 2, 3, 4]);
      await sleep(2_500);
      expect((await consumerState(instance)).num_ack_pending).toBe(1); // answered, not acked: not stored
      expect(b.stats.acked).toBe(0);
      expect(b.stats.framesResent).toBeGreaterThanOrEqual(5);
    } finally {
      await ensureDataPlane(nc, { prefix: names.prefix });
    }
    await until('the request acked', async () => b.stats.acked === 1 && (await consumerState(instance)).num_ack_pending === 0, 10_000);
    const stored = await readStoredFrames(nc.jetstream(), jsm, names.responseStream, framesSubjectOf(instance, req));
    expect(stored.frames.map((f) => f.seq)).toEqual([0, 1, 2, 3, 4]);
    expect(stored.complete).toBe(true);
    expect(b.stats.framesUnstored).toBe(0);
    expect(stub.calls).toHaveLength(1);
  }, 30_000);
});

describe('bridge round trips', () => {
  it('streams a completion as frames 0..n with done last, carrying the engine content', async () => {
    const stub = await engine(() => ({ chunks: 5 }));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    const { req, answer } = await sent(instance);
    const frames = await answer.finished;

    expect(answer.raw.map((f) => f.seq)).toEqual([0, 1, 2, 3, 4, 5, 6]);
    expect(frames.map((f) => f.type)).toEqual(['chunk', 'chunk', 'chunk', 'chunk', 'chunk', 'chunk', 'done']);
    const seed = seedFor(req.id);
    expect(stub.calls[0]?.seed).toBe(seed); // pinned, so a retry regenerates the same text
    expect(answer.text()).toBe(expectedText(seed, 5));
    // Chunks carry the request's id, whichever attempt produced them.
    expect((frames[0] as { data: { id: string } }).data.id).toBe(`chatcmpl-${req.id}`);
    await until('ack', () => b.stats.acked === 1);
    expect(b.stats).toMatchObject({ pulled: 1, acked: 1, termed: 0, nakked: 0, redelivered: 0, errors: 0 });
    expect(b.health()).toMatchObject({ ok: true, problems: [] });
    expect(await b.checkEngine()).toMatchObject({ ok: true, status: 200 });
  });

  it('answers a non-streaming request with a single done frame holding the completion', async () => {
    const stub = await engine(() => ({ chunks: 3 }));
    const instance = await instanceWith();
    await bridge(instance, stub.url);
    const { req, answer } = await sent(instance, { stream: false, seed: 42 });
    const frames = await answer.finished;
    expect(frames).toHaveLength(1);
    expect(frames[0]).toMatchObject({ seq: 0, type: 'done', data: { object: 'chat.completion', id: `chatcmpl-${req.id}` } });
    expect(answer.text()).toBe(expectedText(42, 3));
    expect(stub.calls[0]).toMatchObject({ stream: false, seed: 42 });
  });
});

describe('concurrency', () => {
  it.each([1, 2])('serves at most slots=%i requests at once', async (slots) => {
    const stub = await engine(() => ({ chunks: 3, delayMs: 150 }));
    const instance = await instanceWith({ slots });
    const b = await bridge(instance, stub.url, { slots });
    const reqs = Array.from({ length: slots * 2 + 1 }, () => requestFor());
    const answers = await Promise.all(reqs.map((r) => listen(r.id)));
    for (const r of reqs) await send(instance, r);
    await Promise.all(answers.map((a) => a.finished));
    expect(stub.calls).toHaveLength(reqs.length);
    expect(stub.maxActive).toBe(slots);
    await until('all acked', () => b.stats.acked === reqs.length);
  });
});

describe('redelivery', () => {
  it('working() keeps a slow request from being redelivered', async () => {
    // ack_wait 1 s, first token after 3.5 s: without working() JetStream would redeliver it three times.
    const stub = await engine(() => ({ chunks: 3, firstDelayMs: 3500 }));
    const instance = await instanceWith({ ackWaitMs: 1000 });
    const b = await bridge(instance, stub.url);
    const { req, answer } = await sent(instance);
    await answer.finished;
    expect(answer.text()).toBe(expectedText(seedFor(req.id), 3));
    await sleep(1500);
    expect(stub.calls).toHaveLength(1);
    expect(b.stats).toMatchObject({ pulled: 1, redelivered: 0, acked: 1 });
  });

  it('a bridge killed mid-answer is taken over by another, and the client assembles exactly one complete answer', async () => {
    const stub = await engine(() => ({ chunks: 12, delayMs: 120 }));
    const instance = await instanceWith({ ackWaitMs: 1500 });
    const doomedConnection = await natsConnectAsBridge(names, POOL, instance);
    const doomed = await bridge(instance, stub.url, {}, doomedConnection);
    const { req, answer } = await sent(instance);
    await until('a few chunks from the first bridge', () => answer.raw.length >= 4);
    // Killed after it pulled and streamed part of the answer, before it acked: no ack, no nak.
    await doomedConnection.close();
    expect(doomed.stats.acked).toBe(0);

    const heir = await bridge(instance, stub.url);
    const frames = await answer.finished;

    expect(answer.text()).toBe(expectedText(seedFor(req.id), 12));
    expect(frames.filter((f) => f.type !== 'chunk')).toEqual([{ seq: 13, type: 'done' }]);
    // The heir published only what the client had not received: every seq arrived exactly once.
    expect(answer.raw.map((f) => f.seq)).toEqual(Array.from({ length: 14 }, (_, i) => i));
    expect(stub.calls).toHaveLength(2);
    expect(stub.calls[1]?.seed).toBe(stub.calls[0]?.seed);
    await until('ack', () => heir.stats.acked === 1);
    expect(heir.stats).toMatchObject({ pulled: 1, redelivered: 1, resumed: 1, acked: 1, errors: 0 });
    await consumerEmptied(instance);
  });

  it('a request delivered again to the bridge serving it (a new consumer leader hands it out again) is not taken over: its attempt goes on, the engine called once, both deliveries resolved', async () => {
    const stub = await engine(() => ({ chunks: 12, delayMs: 120 }));
    // Two slots: the second delivery is pulled while the first is served (with every slot busy it
    // waits for one, and is adopted if its request is still being served then).
    const instance = await instanceWith({ slots: 2 });
    const b = await bridge(instance, stub.url, { slots: 2 });
    const { req, answer } = await sent(instance);
    await until('a few chunks', () => answer.raw.length >= 4);
    // The same request as a second message (no dedup id): to the bridge, another delivery of a
    // request it is serving, as a consumer's new leader that did not know of the first hands out.
    await nc
      .jetstream()
      .publish(requestSubjectFor(requestSubjectOf(names, POOL, instance), req, true), encodeJson(req), { expect: { streamName: names.requestStream } });
    await until('the second delivery pulled', () => b.stats.pulled === 2);
    expect(answer.raw.at(-1)?.type).toBe('chunk'); // while the first was served
    await answer.finished;
    expect(answer.text()).toBe(expectedText(seedFor(req.id), 12));
    // Each seq once: nothing generated again, nothing published twice.
    expect(answer.raw.map((f) => f.seq)).toEqual(Array.from({ length: 14 }, (_, i) => i));
    expect(stub.calls).toHaveLength(1);
    await consumerEmptied(instance, 'both deliveries resolved');
    expect(b.stats).toMatchObject({ pulled: 2, adopted: 1, resumed: 0, superseded: 0, acked: 1, errors: 0 });
    expect(await (await nc.jetstream().views.kv(names.claimsBucket)).get(claimKeyOf({ pool: POOL, instance }, req.id))).toBeNull();
  });

  it('a redelivery resumes after the frames a first delivery published, though it finds no claim', async () => {
    const stub = await engine(() => ({ chunks: 12, delayMs: 120 }));
    const instance = await instanceWith({ ackWaitMs: 1500 });
    const doomedConnection = await natsConnectAsBridge(names, POOL, instance);
    await bridge(instance, stub.url, {}, doomedConnection);
    const { req, answer } = await sent(instance);
    await until('a few chunks from the first bridge', () => answer.raw.length >= 4);
    // A first delivery writes no claim until it has answered: the heir finds none.
    expect(await (await nc.jetstream().views.kv(names.claimsBucket)).get(claimKeyOf({ pool: POOL, instance }, req.id))).toBeNull();
    await doomedConnection.close();

    const heir = await bridge(instance, stub.url);
    await answer.finished;
    expect(answer.text()).toBe(expectedText(seedFor(req.id), 12));
    expect(answer.raw.map((f) => f.seq)).toEqual(Array.from({ length: 14 }, (_, i) => i));
    await until('ack', () => heir.stats.acked === 1);
    expect(heir.stats).toMatchObject({ pulled: 1, redelivered: 1, resumed: 1, acked: 1, errors: 0 });
  });

  /**
   * The first attempt's frames of `req` up to `atLeast`, its stored frame `lost` then deleted from
   * the response stream (as a frame published while the stream had no leader is never stored,
   * though its client got it), and its connection closed: the heir's read-back finds a gap.
   */
  async function loseStoredFrame(instance: string, req: InferenceRequest, answer: Answer, lost: number, doomed: NatsConnection): Promise<void> {
    await until('frames past the lost one', () => answer.raw.length >= lost + 3);
    const consumer = await nc.jetstream().consumers.get(names.responseStream, { filterSubjects: framesSubjectOf(instance, req) });
    const stored = await consumer.fetch({ max_messages: lost + 1, expires: 2_000 });
    let deleted = false;
    for await (const m of stored) {
      if (decodeFrame(m.data)?.seq !== lost) continue;
      deleted = await jsm.streams.deleteMessage(names.responseStream, m.seq);
      break;
    }
    expect(deleted).toBe(true);
    await doomed.close();
  }

  it('a redelivery that finds a frame lost between stored ones generates on from before it, in the words of the frames stored after it', async () => {
    const stub = await engine(() => ({ chunks: 12, delayMs: 120, tokens: true }));
    const instance = await instanceWith({ ackWaitMs: 1500 });
    const doomed = await natsConnectAsBridge(names, POOL, instance);
    await bridge(instance, stub.url, {}, doomed);
    const { req, answer } = await sent(instance);
    await loseStoredFrame(instance, req, answer, 3, doomed);

    const heir = await bridge(instance, stub.url);
    expect((await answer.finished).at(-1)).toMatchObject({ type: 'done' });
    const seed = seedFor(req.id);
    expect(answer.text()).toBe(expectedText(seed, 12));
    // Continued after the three tokens stored in order, not ended with resume_failed.
    expect(stub.calls.at(-1)).toMatchObject({ magus: { resume: { tokens: [0, 1, 2] } } });
    await until('ack', () => heir.stats.acked === 1);
    expect(heir.stats).toMatchObject({ redelivered: 1, resumed: 1, resumedAcrossGap: 1, resumeFailed: 0, termed: 0, errors: 0 });
    // The lost frame is stored again: a later read-back finds the whole answer.
    const after = await readStoredFrames(nc.jetstream(), jsm, names.responseStream, framesSubjectOf(instance, req));
    expect(after).toMatchObject({ complete: true, highestSeq: 13 });
    expect(after.frames.map((f) => f.seq)).toEqual(Array.from({ length: 14 }, (_, i) => i));
  });

  it('across a lost frame, an engine that does not say the same words after it ends the answer with an error after every frame its client may have', async () => {
    const stub = await engine(() => ({ chunks: 12, delayMs: 120, tokens: true, random: true }));
    const instance = await instanceWith({ ackWaitMs: 1500 });
    const doomed = await natsConnectAsBridge(names, POOL, instance);
    await bridge(instance, stub.url, {}, doomed);
    const { req, answer } = await sent(instance);
    await loseStoredFrame(instance, req, answer, 3, doomed);
    const said = answer.raw.length;

    const heir = await bridge(instance, stub.url);
    const frames = await answer.finished;
    // The first attempt's frames (the client had the lost one from its publish), then the error.
    expect(frames.at(-1)).toMatchObject({ type: 'error', error: { code: BridgeErrorCode.generationDiverged } });
    expect(frames.length).toBeGreaterThan(said);
    expect(frames.slice(0, -1).every((f, i) => f.type === 'chunk' && answer.raw[i] === f)).toBe(true);
    await until('term', () => heir.stats.termed === 1);
    expect(heir.stats).toMatchObject({ resumedAcrossGap: 1, resumeFailed: 0 });
  });

  /**
   * Every stored frame of `req` gone, as a stream that evicts under pressure loses them: the
   * first attempt's connection closed once its client has `said` frames (none for an answer not
   * streamed), the response stream purged, and a younger frame of another request stored, so the
   * heir's read-back finds none of the request's although the stream dropped frames younger than it.
   */
  async function loseEveryStoredFrame(instance: string, answer: Answer, said: number, doomed: NatsConnection): Promise<void> {
    await until('frames from the first bridge', () => answer.raw.length >= said);
    await doomed.close();
    await jsm.streams.purge(names.responseStream);
    const other = requestFor();
    await nc.jetstream().publish(framesSubjectOf(instance, other), encodeJson({ seq: 0, type: 'chunk', data: {} }));
  }

  it('a redelivery that finds every stored frame of a streamed answer gone hands it back, to go on after what its gateway relayed', async () => {
    const stub = await engine(() => ({ chunks: 12, delayMs: 120, tokens: true }));
    const instance = await instanceWith({ ackWaitMs: 1500 });
    const doomed = await natsConnectAsBridge(names, POOL, instance);
    await bridge(instance, stub.url, {}, doomed);
    const { req, answer } = await sent(instance);
    await loseEveryStoredFrame(instance, answer, 4, doomed);
    const said = answer.raw.length;

    const heir = await bridge(instance, stub.url);
    await until('the hand-back', () => answer.raw.length > said);
    // At seq 0 (none stored), which the client's gateway has: it takes it after what it relayed
    // (gateway/serving/exchange.ts), where the gateway's own read-back of the gap would wait.
    expect(answer.raw.slice(said)).toEqual([
      {
        seq: 0,
        type: 'error',
        afterRelayed: true,
        spread: 0,
        due: req.deadline,
        error: expect.objectContaining({ status: 503, code: CONTINUE_ELSEWHERE }) as unknown,
      },
    ]);
    expect(stub.calls).toHaveLength(1); // not generated again: its gateway continues it
    await until('term', () => heir.stats.termed === 1);
    expect(heir.stats).toMatchObject({ redelivered: 1, resumed: 0, handedBack: 1, resumeFailed: 0, errors: 0 });
    await consumerEmptied(instance);
  });

  it('one whose answer cannot be handed back (not streamed) ends with resume_failed after what its gateway relayed', async () => {
    const stub = await engine(() => ({ chunks: 12, delayMs: 300 }));
    const instance = await instanceWith({ ackWaitMs: 1500 });
    const doomed = await natsConnectAsBridge(names, POOL, instance);
    await bridge(instance, stub.url, {}, doomed);
    const { answer } = await sent(instance, { stream: false });
    await until('the first bridge at the engine', () => stub.calls.length === 1);
    await loseEveryStoredFrame(instance, answer, 0, doomed);

    const heir = await bridge(instance, stub.url);
    const frames = await answer.finished;
    expect(frames).toEqual([
      { seq: 0, type: 'error', afterRelayed: true, error: expect.objectContaining({ status: 502, code: BridgeErrorCode.resumeFailed }) as unknown },
    ]);
    expect(stub.calls).toHaveLength(1);
    await until('term', () => heir.stats.termed === 1);
    expect(heir.stats).toMatchObject({ redelivered: 1, handedBack: 0, resumeFailed: 1 });
  });

  it('a take-over whose engine does not repeat itself ends the answer with an error instead of mixing two', async () => {
    const stub = await engine(() => ({ chunks: 12, delayMs: 120, random: true }));
    const instance = await instanceWith({ ackWaitMs: 1500 });
    const doomedConnection = await natsConnectAsBridge(names, POOL, instance);
    await bridge(instance, stub.url, {}, doomedConnection);
    const { answer } = await sent(instance);
    await until('a few chunks', () => answer.raw.length >= 3);
    await doomedConnection.close();
    const heir = await bridge(instance, stub.url);
    const frames = await answer.finished;

    const last = frames.at(-1);
    expect(last).toMatchObject({ type: 'error', error: { code: BridgeErrorCode.generationDiverged, status: 502 } });
    expect(frames.filter((f) => f.type !== 'chunk')).toHaveLength(1);
    // Everything before the error came from the first attempt.
    expect(answer.raw.map((f) => f.seq)).toEqual(frames.map((f) => f.seq));
    await until('term', () => heir.stats.termed === 1);
  });

  it('an attempt that lost its claim to a later delivery stops publishing, and that delivery finishes the answer', async () => {
    const stub = await engine(() => ({ chunks: 15, delayMs: 100 }));
    const instance = await instanceWith({ ackWaitMs: 1200 });
    const b = await bridge(instance, stub.url);
    const { req, answer } = await sent(instance);
    await until('a few chunks', () => answer.raw.length >= 3);
    // A zombie scenario: someone else now owns the request (as after an ack_wait expiry the
    // bridge did not notice). The running attempt must notice at its next check and go quiet.
    // (A first delivery writes no claim while it runs, so the intruder's is the first one.)
    const claims = await openRequestClaims(nc.jetstream(), names, { pool: POOL, instance });
    expect((await claims.acquire(req.id, 'intruder')).kind).toBe('fresh');
    await until('the attempt gives up', () => b.stats.superseded === 1);
    const frames = await answer.finished;
    // The intruder never answers, so JetStream redelivers after ack_wait; this bridge takes over
    // (attempt 2 of the claim), checks the frames already out and completes the same text.
    expect(answer.text()).toBe(expectedText(seedFor(req.id), 15));
    expect(frames.filter((f) => f.type !== 'chunk')).toHaveLength(1);
    expect(new Set(answer.raw.map((f) => f.seq)).size).toBe(answer.raw.length);
    await until('ack', () => b.stats.acked === 1);
    expect(b.stats).toMatchObject({ pulled: 2, redelivered: 1, resumed: 1, acked: 1 });
  });

  /** A request answered in 15 chunks `delayMs` apart by a bridge on a connection of its own, once a few chunks are out. */
  const underWay = async (delayMs: number) => {
    const stub = await engine(() => ({ chunks: 15, delayMs }));
    const instance = await instanceWith();
    const conn = await natsConnectAsBridge(names, POOL, instance);
    cleanups.push(() => conn.close());
    const b = await bridge(instance, stub.url, {}, conn);
    const { req, answer } = await sent(instance);
    await until('a few chunks', () => answer.raw.length >= 3);
    return { instance, conn, b, req, answer };
  };

  it('frames produced while NATS reconnects are held and released in order once the claim is confirmed', async () => {
    const { conn, b, req, answer } = await underWay(60);
    await conn.reconnect();
    await answer.finished;
    expect(answer.text()).toBe(expectedText(seedFor(req.id), 15));
    // In order, each seq first seen once. Frames published just before the disconnect whose
    // acknowledgements it swallowed are published again after it (`framesResent`): copies with a
    // seq already seen and the same content, which sequencers drop (stored-frames.ts).
    const firsts = new Map<number, string>();
    for (const f of answer.raw) {
      const json = JSON.stringify(f);
      if (firsts.has(f.seq)) expect(json).toBe(firsts.get(f.seq));
      else firsts.set(f.seq, json);
    }
    expect([...firsts.keys()]).toEqual(Array.from({ length: 17 }, (_, i) => i));
    await until('ack', () => b.stats.acked === 1);
    expect(b.stats).toMatchObject({ errors: 0, superseded: 0 });
    expect(answer.raw.length - 17).toBeLessThanOrEqual(b.stats.framesResent);
    expect(logs.some((l) => l.includes('NATS disconnected'))).toBe(true);
  });

  it('held over a reconnect while the claims bucket elects a leader: the frames and the end go out once a read of the claim is answered, not when it takes writes again', async () => {
    const { instance, conn, b, req, answer } = await underWay(100);
    // The bucket as a cluster's election leaves it: no write is taken (no stream listens to its
    // subjects), and a direct get goes unanswered (a replica that knows of no leader drops it).
    const bucket = `KV_${names.claimsBucket}`;
    const { subjects, allow_direct } = (await jsm.streams.info(bucket)).config;
    const dropped = nc.subscribe(`$JS.API.DIRECT.GET.${bucket}.>`);
    let restored = false;
    const restore = async () => {
      if (restored) return;
      restored = true;
      await jsm.streams.update(bucket, { subjects, allow_direct });
    };
    cleanups.push(restore);
    await jsm.streams.update(bucket, { subjects: [`${bucket}.elsewhere.>`], allow_direct: false });
    await nc.flush();
    await conn.reconnect();
    // The engine's answer ends meanwhile (15 × 100 ms): its last frames and its end are held.
    await until('the claim could not be finished', () => logs.some((l) => l.includes(`request ${req.id}: finishing the claim failed`)), 5_000);
    await sleep(500);
    const heldAt = answer.raw.length;
    expect(answer.relayed.some((f) => f.type !== 'chunk')).toBe(false);
    // Reads are answered again; writes are not, yet.
    dropped.unsubscribe();
    await jsm.streams.update(bucket, { allow_direct: true });
    const readable = Date.now();
    const frames = await answer.finished;
    // Within a bounded check and a sweep (CLAIM_CHECK_MS + 500 ms), not the client's 5-s timeout.
    expect(Date.now() - readable).toBeLessThan(CLAIM_CHECK_MS + 1_000);
    expect(answer.raw.length).toBeGreaterThan(heldAt);
    expect(answer.text()).toBe(expectedText(seedFor(req.id), 15));
    expect(frames.filter((f) => f.type !== 'chunk')).toHaveLength(1);
    // Resolved only once the claim records the end, which waits for the bucket's writes.
    expect(b.stats.acked).toBe(0);
    await restore();
    await until('ack', () => b.stats.acked === 1);
    expect(b.stats).toMatchObject({ errors: 0, superseded: 0 });
    const claims = await openRequestClaims(nc.jetstream(), names, { pool: POOL, instance });
    expect(await claims.acquire(req.id, 'later')).toMatchObject({ kind: 'finished', claim: { terminal: frames.at(-1) } });
  });

  it('a redelivery of an answered request re-publishes its recorded terminal frame without calling the engine', async () => {
    // As if a bridge finished the claim, published `done` and died before its ack reached the server.
    const stub = await engine(() => ({}));
    const instance = await instanceWith({ ackWaitMs: 1000 });
    const req = requestFor({ stream: false }, { meter: { key: 'tenant/replayed', model: 'default/stub', at: Date.now() } });
    const claims = await openRequestClaims(nc.jetstream(), names, { pool: POOL, instance });
    const claimed = await claims.acquire(req.id, 'dead-bridge');
    const terminal: ResponseFrame = {
      seq: 0,
      type: 'done',
      data: { object: 'chat.completion', choices: [{ index: 0, message: { role: 'assistant', content: 'earlier answer' } }] },
    };
    // It died before writing the usage record the claim carries: the redelivery writes it.
    const usage: UsageRecord = {
      id: req.id,
      key: 'tenant/replayed',
      model: 'default/stub',
      kind: 'chat',
      start: req.meter!.at,
      end: Date.now(),
      outcome: 'completed',
      tokens: { prompt: 9, cached: 0, completion: 2, total: 11 },
      reported: true,
    };
    expect(await claims.finish(req.id, claimed.claim, claimed.revision, terminal, usage)).toBe(true);
    // The dead bridge's delivery: pulled, never acked; JetStream redelivers it after ack_wait.
    await send(instance, req);
    const first = await (await nc.jetstream().consumers.get(names.requestStream, consumerNameOf(POOL, instance))).next({ expires: 5000 });
    expect(first?.info.deliveryCount).toBe(1);

    const answer = await listen(req.id);
    const b = await bridge(instance, stub.url);
    expect(await answer.finished).toEqual([terminal]);
    await until('ack', () => b.stats.acked === 1);
    expect(b.stats.replayed).toBe(1);
    expect(stub.calls).toHaveLength(0);
    expect(await ledger.read({ key: 'tenant/replayed' })).toEqual([usage]);
    expect(b.stats.usageRecorded).toBe(1);
  });
});

describe('a first delivery that answers writes no claim', () => {
  it('answered and acked: nothing in the claims bucket', async () => {
    const stub = await engine(() => ({}));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    const { req, answer } = await sent(instance, { stream: false });
    expect((await answer.finished).map((f) => f.type)).toEqual(['done']);
    await until('ack', () => b.stats.acked === 1);
    expect(await (await nc.jetstream().views.kv(names.claimsBucket)).get(claimKeyOf({ pool: POOL, instance }, req.id))).toBeNull();
  });

  it('its ack lost: the redelivery finds the terminal frame it published and repeats it, without calling the engine', async () => {
    const stub = await engine(() => ({}));
    const instance = await instanceWith({ ackWaitMs: 1000 });
    const req = requestFor({ stream: false }, { meter: { key: 'tenant/ack-lost', model: 'default/stub', at: Date.now() } });
    // The dead bridge's delivery: pulled, answered (its `done` reached the server), never acked.
    await send(instance, req);
    const first = await (await nc.jetstream().consumers.get(names.requestStream, consumerNameOf(POOL, instance))).next({ expires: 5000 });
    expect(first?.info.deliveryCount).toBe(1);
    const terminal: ResponseFrame = {
      seq: 0,
      type: 'done',
      data: {
        object: 'chat.completion',
        choices: [{ index: 0, message: { role: 'assistant', content: 'the answer that went out' } }],
        usage: { prompt_tokens: 7, completion_tokens: 3, total_tokens: 10, prompt_tokens_details: { cached_tokens: 4 } },
      },
    };
    nc.publish(framesSubjectOf(instance, req), encodeJson(terminal));
    await nc.flush();

    const answer = await listen(req.id);
    const b = await bridge(instance, stub.url);
    expect(await answer.finished).toEqual([terminal]);
    await until('ack', () => b.stats.acked === 1);
    expect(b.stats).toMatchObject({ pulled: 1, redelivered: 1, resumed: 1, errors: 0 });
    expect(stub.calls).toHaveLength(0);
    // It died before its usage record too: the redelivery writes it, from the frame it read back.
    expect(await ledger.read({ key: 'tenant/ack-lost' })).toEqual([
      expect.objectContaining({ id: req.id, outcome: 'completed', reported: true, tokens: { prompt: 7, cached: 4, completion: 3, total: 10 } }),
    ]);
  });
});

describe('cancels from the gateway (the client went away)', () => {
  const cancel = (instance: string, id: string) => nc.publish(cancelSubjectOf(names, POOL, instance), encodeJson({ id }));

  it('a cancel stops the engine call mid-answer and resolves the request once (term), never redelivered', async () => {
    const stub = await engine(() => ({ chunks: 40, delayMs: 50 }));
    const instance = await instanceWith({ ackWaitMs: 1000 });
    const b = await bridge(instance, stub.url);
    const { req, answer } = await sent(instance, {}, { meter: { key: 'tenant/cancelled', model: 'default/stub', at: Date.now() } });
    await until('a few chunks', () => answer.raw.length >= 3);
    cancel(instance, req.id);
    await until('term', () => b.stats.termed === 1);
    expect(b.stats).toMatchObject({ cancelled: 1, acked: 0, nakked: 0, errors: 0 });
    await until('the engine call cut', () => stub.cut === 1);
    expect(answer.raw.length).toBeLessThan(40); // generation stopped early
    // Recorded as cancelled: no usage came from the engine, so its chunks are counted.
    const chunks = answer.raw.filter((f) => f.type === 'chunk').length;
    expect(await ledger.read({ key: 'tenant/cancelled' })).toEqual([
      expect.objectContaining({
        id: req.id,
        outcome: 'cancelled',
        error: 'client_closed',
        reported: false,
        tokens: { prompt: 0, cached: 0, completion: chunks, total: chunks },
      }),
    ]);
    await sleep(1500); // past ack_wait: nothing comes back
    expect(stub.calls).toHaveLength(1);
    const state = await consumerState(instance);
    expect(state.num_ack_pending + state.num_pending).toBe(0);
  });

  it('a request cancelled while queued is dropped unserved when it is pulled', async () => {
    // One slot, held by a slow first request while the second waits in the stream and is cancelled.
    const stub = await engine((call) => (call === 0 ? { chunks: 2, firstDelayMs: 800 } : { chunks: 2 }));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    const first = requestFor();
    const second = requestFor();
    const firstAnswer = await listen(first.id);
    await send(instance, first);
    await send(instance, second);
    await until('the first reached the engine', () => stub.calls.length === 1);
    cancel(instance, second.id);
    await firstAnswer.finished;
    await until('the cancelled one resolved, the first acked', () => b.stats.termed === 1 && b.stats.acked === 1);
    expect(b.stats).toMatchObject({ cancelled: 1, acked: 1, errors: 0 });
    expect(stub.calls).toHaveLength(1); // only the first reached the engine
  });
});

describe('a request its gateway ended: the answer moved away while its bridge was silent (claims.ts endClaim)', () => {
  const endedBy = async (instance: string, id: string, at: number) =>
    endClaim(await nc.jetstream().views.kv(names.claimsBucket, { bindOnly: true }), { pool: POOL, instance }, id, at);

  it('queued meanwhile, and pulled by a bridge that never heard the cancel (started since): not answered, ended as the cancel would have ended it', async () => {
    // Its answer would be done long before the attempt's first periodic check (a third of ack_wait).
    const stub = await engine(() => ({ chunks: 4, firstDelayMs: 200 }));
    const instance = await instanceWith({ ackWaitMs: 3000 });
    const { req, answer } = await sent(instance);
    await endedBy(instance, req.id, 0);
    const b = await bridge(instance, stub.url);
    // Nothing of an answer: a hand-back (nobody reads it), and the message resolved at once, not redelivered.
    expect((await answer.finished).map((f) => (f.type === 'error' ? `${f.seq} ${f.error.code}` : `${f.seq} ${f.type}`))).toEqual([`0 ${CONTINUE_ELSEWHERE}`]);
    await consumerEmptied(instance, 'resolved');
    await until('an engine call begun beside the claim check cut', () => stub.cut === stub.calls.length);
    expect(b.stats).toMatchObject({ pulled: 1, termed: 1, acked: 0, superseded: 0 });
  });

  it('being answered by a bridge that did not hear the cancel (cut off then): it stops at its next check, and no answer ends there', async () => {
    const stub = await engine(() => ({ chunks: 60, delayMs: 50 }));
    const instance = await instanceWith({ ackWaitMs: 1500 });
    const b = await bridge(instance, stub.url);
    const { req, answer } = await sent(instance);
    await until('a few chunks', () => answer.raw.length >= 3);
    await endedBy(instance, req.id, 2);
    await until('superseded', () => b.stats.superseded === 1);
    const said = answer.raw.length;
    await until('the redelivery resolved it', () => b.stats.replayed === 1);
    expect(said).toBeLessThan(30);
    expect(answer.raw.some((f) => f.type === 'done')).toBe(false);
    expect(answer.raw.filter((f) => f.type === 'chunk').length).toBeLessThanOrEqual(said);
  });

  it('an attempt that finished first keeps its claim: ending it then changes nothing', async () => {
    const stub = await engine(() => ({ chunks: 2 }));
    const instance = await instanceWith();
    const claims = await nc.jetstream().views.kv(names.claimsBucket, { bindOnly: true });
    const key = claimKeyOf({ pool: POOL, instance }, 'req-finished');
    await claims.create(key, encodeJson({ attempt: 2, owner: 'b', createdAt: 1, state: 'finished', terminal: { seq: 3, type: 'done' } }));
    await endedBy(instance, 'req-finished', 1);
    expect((await claims.get(key))?.json()).toMatchObject({ attempt: 2, state: 'finished', terminal: { seq: 3, type: 'done' } });
    // A running one's is ended (its attempt kept), and a request nobody claimed gets one.
    await claims.put(claimKeyOf({ pool: POOL, instance }, 'req-running'), encodeJson({ attempt: 2, owner: 'b', createdAt: 1, state: 'running' }));
    await endedBy(instance, 'req-running', 1);
    await endedBy(instance, 'req-unclaimed', 0);
    for (const [id, attempt, seq] of [
      ['req-running', 2, 1],
      ['req-unclaimed', 0, 0],
    ] as const)
      expect((await claims.get(claimKeyOf({ pool: POOL, instance }, id)))?.json()).toMatchObject({
        attempt,
        owner: 'gateway',
        state: 'finished',
        terminal: { seq, type: 'error', error: { code: CONTINUE_ELSEWHERE } },
      });
    expect(stub.calls).toHaveLength(0);
  });
});

describe('a request id seen again as a first delivery', () => {
  it('published again after the de-duplication window: one answer, the earlier claim stays, resolved once', async () => {
    const stub = await engine(() => ({}));
    const instance = await instanceWith({ ackWaitMs: 1000 });
    const req = requestFor({ stream: false });
    const claims = await openRequestClaims(nc.jetstream(), names, { pool: POOL, instance });
    const claimed = await claims.acquire(req.id, 'earlier-bridge');
    const terminal: ResponseFrame = {
      seq: 0,
      type: 'done',
      data: { object: 'chat.completion', choices: [{ index: 0, message: { role: 'assistant', content: 'the first answer' } }] },
    };
    expect(await claims.finish(req.id, claimed.claim, claimed.revision, terminal)).toBe(true);

    const b = await bridge(instance, stub.url);
    const answer = await listen(req.id);
    await send(instance, req); // deliveryCount 1: a first delivery, which neither reads nor writes a claim
    // The engine's answer goes out (seq 0) and the message is acked: one answer, one delivery.
    const frames = await answer.finished;
    expect(frames).toHaveLength(1);
    expect(frames[0]).toMatchObject({ seq: 0, type: 'done' });
    await until('ack', () => b.stats.acked === 1);
    await sleep(1500); // past ack_wait: nothing is redelivered
    expect(b.stats).toMatchObject({ pulled: 1, replayed: 0, superseded: 0, nakked: 0, termed: 0 });
    expect(stub.calls).toHaveLength(1);
    // The claim still records the first answer: a later delivery repeats that one.
    expect(await claims.acquire(req.id, 'later')).toMatchObject({ kind: 'finished', claim: { terminal } });
  });
});

describe('failures', () => {
  it('engine 400: error frame with the engine message, then term (never redelivered)', async () => {
    const stub = await engine(() => ({ status: 400 }));
    const instance = await instanceWith({ ackWaitMs: 1000 });
    const b = await bridge(instance, stub.url);
    const { answer } = await sent(instance);
    expect(await answer.finished).toEqual([
      { seq: 0, type: 'error', error: { status: 400, type: 'invalid_request_error', code: 'stub_error', message: 'stub says 400' } },
    ]);
    await sleep(1500);
    expect(stub.calls).toHaveLength(1);
    expect(b.stats).toMatchObject({ pulled: 1, termed: 1, nakked: 0, acked: 0 });
    const state = await consumerState(instance);
    expect(state.num_ack_pending + state.num_pending).toBe(0);
  });

  it('engine 503 (starting again): tried again in place, answered without a redelivery', async () => {
    const stub = await engine((call) => (call < 3 ? { status: 503 } : { chunks: 2 }));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    const { req, answer } = await sent(instance);
    expect((await answer.finished).at(-1)).toMatchObject({ type: 'done' });
    expect(answer.text()).toBe(expectedText(seedFor(req.id), 2));
    expect(stub.calls).toHaveLength(4);
    await until('ack', () => b.stats.acked === 1);
    expect(b.stats).toMatchObject({ pulled: 1, nakked: 0, redelivered: 0, acked: 1, termed: 0 });
  });

  it.each([
    ['starts from standby (503 engine_starting): waited for where every slot is free, not handed back', ENGINE_STARTING, false],
    ['loads its model from nothing (503 engine_unavailable): handed back to its gateway at 500 ms', 'engine_unavailable', true],
  ])('an engine that died mid-stream and %s', async (_, code, handedBack) => {
    let restartedAt = 0;
    const stub = await engine((call) => {
      if (call === 0) return { chunks: 6, dieAfter: 3, delayMs: 50, tokens: true };
      restartedAt ||= Date.now();
      return Date.now() - restartedAt < 1_000 ? { status: 503, code } : { chunks: 6, tokens: true };
    });
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url); // llama.cpp's engine: it continues answers
    const { req, answer } = await sent(instance);
    const frames = await answer.finished;
    const seed = seedFor(req.id);
    if (handedBack) {
      // What it said, then the hand-back: its gateway continues it on another instance.
      expect(frames.at(-1)).toMatchObject({ seq: 3, type: 'error', error: { status: 503, code: CONTINUE_ELSEWHERE } });
      expect(answer.text()).toBe(expectedText(seed, 3));
      expect(b.stats.handedBack).toBe(1);
    } else {
      // Continued where it stopped on the engine restarted in place, from the tokens it said.
      expect(frames.at(-1)).toMatchObject({ type: 'done' });
      expect(answer.text()).toBe(expectedText(seed, 6));
      expect(stub.calls.at(-1)).toMatchObject({ magus: { tokens: true, resume: { tokens: [0, 1, 2], text: expectedText(seed, 3) } } });
      expect(b.stats.handedBack).toBe(0);
    }
  });

  it('an engine that died with an answer mid-way and one queued is given the answer mid-way first, the queued one once that has its slot again', async () => {
    // A real engine takes requests in arrival order while it has free slots: after a restart the
    // queued one, coming back as fast, could take the slot the answer mid-way needs.
    const RESUME_SLOT_MS = 300;
    const arrived: { content: string; resume: boolean; at: number }[] = [];
    const stub = await engine((call, body) => {
      const resume = (body as { magus?: { resume?: unknown } }).magus?.resume !== undefined;
      arrived.push({ content: body.messages[0]!.content, resume, at: Date.now() });
      if (call === 0) return { chunks: 8, delayMs: 50, tokens: true };
      if (call === 1) return { firstDelayMs: 60_000 }; // queued behind it
      return { chunks: 8, tokens: true, ...(resume ? { firstDelayMs: RESUME_SLOT_MS } : {}) };
    });
    const instance = await instanceWith({ slots: 2 });
    const b = await bridge(instance, stub.url, { slots: 2 });
    const asked = (text: string) => ({ messages: [{ role: 'user' as const, content: text }] });
    const { req: midway, answer: midwayAnswer } = await sent(instance, asked('mid-way'));
    await until('three pieces said', () => midwayAnswer.raw.length >= 4);
    const { req: queued, answer: queuedAnswer } = await sent(instance, asked('queued'));
    await until('the second at the engine', () => arrived.length === 2);
    stub.dropConnections();
    for (const a of [midwayAnswer, queuedAnswer]) expect((await a.finished).at(-1)).toMatchObject({ type: 'done' });
    expect(midwayAnswer.text()).toBe(expectedText(seedFor(midway.id), 8));
    expect(queuedAnswer.text()).toBe(expectedText(seedFor(queued.id), 8));
    expect(arrived.map((c) => `${c.content}${c.resume ? ' (resumed)' : ''}`)).toEqual(['mid-way', 'queued', 'mid-way (resumed)', 'queued']);
    // Not before the engine answered the resumed one (it had its slot then).
    expect(arrived[3]!.at - arrived[2]!.at).toBeGreaterThanOrEqual(RESUME_SLOT_MS);
    expect(b.stats.continued).toBe(1);
  });

  it('engine 503 for longer than engineWaitMs: nak, redelivered, answered on the retry', async () => {
    const stub = await engine((call) => (call === 0 ? { status: 503 } : { chunks: 2 }));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url, { engineWaitMs: 0 });
    const { req, answer } = await sent(instance);
    const frames = await answer.finished;
    expect(frames.at(-1)).toMatchObject({ type: 'done' });
    expect(answer.text()).toBe(expectedText(seedFor(req.id), 2));
    expect(stub.calls).toHaveLength(2);
    await until('ack', () => b.stats.acked === 1);
    expect(b.stats).toMatchObject({ pulled: 2, nakked: 1, redelivered: 1, acked: 1, termed: 0 });
  });

  it('unreachable engine: nak until the last allowed delivery, then an error frame and term', async () => {
    const gone = await engine(() => ({}));
    await gone.close(); // nothing listens on its port any more: connection refused
    const instance = await instanceWith({ maxDeliver: 3 });
    const b = await bridge(instance, gone.url, { engineWaitMs: 300 });
    const { answer } = await sent(instance);
    const frames = await answer.finished;
    expect(frames).toEqual([{ seq: 0, type: 'error', error: expect.objectContaining({ status: 503, code: BridgeErrorCode.engineUnavailable }) as unknown }]);
    await until('term', () => b.stats.termed === 1); // right after the frame: the claim records it first
    expect(b.stats).toMatchObject({ pulled: 3, nakked: 2, termed: 1 });
  });

  it('a request whose deadline passed: error frame and term, the engine is never called', async () => {
    const stub = await engine(() => ({}));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    const { answer } = await sent(instance, {}, { deadline: Date.now() - 1 });
    expect(await answer.finished).toEqual([
      { seq: 0, type: 'error', error: expect.objectContaining({ status: 504, code: BridgeErrorCode.deadlineExceeded }) as unknown },
    ]);
    expect(stub.calls).toHaveLength(0);
    await until('term', () => b.stats.termed === 1);
  });

  it("structured output for distributed-llama's engine: 400 unsupported_feature naming it, the engine never called; plain chat is served", async () => {
    const stub = await engine(() => ({ chunks: 2 }));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url, { engineKind: 'dllama' });
    const { answer } = await sent(instance, { response_format: { type: 'json_schema', json_schema: { name: 'r', schema: { type: 'boolean' } } } });
    const frames = await answer.finished;
    expect(frames).toEqual([
      {
        seq: 0,
        type: 'error',
        error: {
          status: 400,
          type: 'invalid_request_error',
          code: 'unsupported_feature',
          param: 'response_format',
          message: expect.stringContaining("distributed-llama's dllama-api") as unknown,
        },
      },
    ]);
    expect(JSON.stringify(frames)).toContain('`response_format`');
    expect(stub.calls).toHaveLength(0);
    await until('term', () => b.stats.termed === 1);
    const plain = await sent(instance, { response_format: { type: 'text' } });
    expect((await plain.answer.finished).at(-1)).toMatchObject({ type: 'done' });
    expect(stub.calls).toHaveLength(1);
  });

  it('an embeddings request goes to /v1/embeddings and its answer comes back as it is, in one done frame; to distributed-llama it is refused', async () => {
    const stub = await engine(() => ({}));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    const embeddingsReq = (): EmbeddingsInference => {
      const id = newId();
      return { ...envelopeOf(id), deadline: Date.now() + 60_000, kind: 'embeddings', body: { model: 'stub', input: ['a', 'b'] } };
    };
    const req = embeddingsReq();
    const answer = await listen(req.id);
    await send(instance, req);
    expect(await answer.finished).toEqual([{ seq: 0, type: 'done', data: EMBEDDINGS }]);
    expect(stub.embeddingCalls).toEqual([{ model: 'stub', input: ['a', 'b'] }]);
    expect(stub.calls).toHaveLength(0);
    await until('ack', () => b.stats.acked === 1);

    const other = await instanceWith();
    const dllama = await bridge(other, stub.url, { engineKind: 'dllama' });
    const refused = embeddingsReq();
    const refusal = await listen(refused.id);
    await send(other, refused);
    expect(await refusal.finished).toEqual([
      {
        seq: 0,
        type: 'error',
        error: {
          status: 400,
          type: 'invalid_request_error',
          code: 'unsupported_feature',
          param: 'model',
          message: expect.stringContaining("distributed-llama's dllama-api") as unknown,
        },
      },
    ]);
    expect(stub.embeddingCalls).toHaveLength(1);
    await until('term', () => dllama.stats.termed === 1);
  });

  it("a text completion goes to /v1/completions with a pinned seed; its chunks and answer carry the request's cmpl- id; to distributed-llama it is refused", async () => {
    const stub = await engine(() => ({}));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    const textReq = (stream: boolean): CompletionsInference => {
      const id = newId();
      return { ...envelopeOf(id), deadline: Date.now() + 60_000, kind: 'completions', body: { model: 'stub', prompt: 'x', stream } };
    };
    const streamed = textReq(true);
    const frames = await listen(streamed.id);
    await send(instance, streamed);
    const got = await frames.finished;
    expect(got.map((f) => f.type)).toEqual(['chunk', 'chunk', 'chunk', 'done']);
    const chunks = got.flatMap((f) => (f.type === 'chunk' ? [f.data as { id: string; object: string; choices: { text: string }[] }] : []));
    expect(chunks.map((c) => c.choices[0]!.text)).toEqual(['a', 'b', '']);
    for (const c of chunks) expect(c).toMatchObject({ id: `cmpl-${streamed.id}`, object: 'text_completion' });
    const whole = textReq(false);
    const answer = await listen(whole.id);
    await send(instance, whole);
    expect(await answer.finished).toEqual([
      { seq: 0, type: 'done', data: expect.objectContaining({ id: `cmpl-${whole.id}`, choices: [expect.objectContaining({ text: 'ab' })] }) as unknown },
    ]);
    expect(stub.textCalls.map((c) => [c.stream, typeof c.seed])).toEqual([
      [true, 'number'],
      [false, 'number'],
    ]);
    expect(stub.calls).toHaveLength(0);
    await until('acks', () => b.stats.acked === 2);

    const other = await instanceWith();
    const dllama = await bridge(other, stub.url, { engineKind: 'dllama' });
    const refused = textReq(false);
    const refusal = await listen(refused.id);
    await send(other, refused);
    expect(await refusal.finished).toEqual([
      {
        seq: 0,
        type: 'error',
        error: {
          status: 400,
          type: 'invalid_request_error',
          code: 'unsupported_feature',
          param: 'model',
          message: expect.stringContaining("distributed-llama's dllama-api") as unknown,
        },
      },
    ]);
    expect(stub.textCalls).toHaveLength(2);
    await until('term', () => dllama.stats.termed === 1);
  });

  it('a deadline cuts an answer its client has nothing of yet; a stream that has begun goes on to its end, a continuation of one too', async () => {
    const stub = await engine((call, body) =>
      body.stream !== true ? { chunks: 12, delayMs: 100 } : call === 0 ? { chunks: 3, firstDelayMs: 2_000 } : { chunks: 12, delayMs: 100, tokens: true },
    );
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    // Nothing said when the deadline passes: a stream (its first piece late) and an answer not streamed.
    const silent = await sent(instance, {}, { deadline: Date.now() + 800 });
    expect(await silent.answer.finished).toEqual([
      { seq: 0, type: 'error', error: expect.objectContaining({ status: 504, code: BridgeErrorCode.deadlineExceeded }) as unknown },
    ]);
    const whole = await sent(instance, { stream: false }, { deadline: Date.now() + 800 });
    expect(await whole.answer.finished).toEqual([
      { seq: 0, type: 'error', error: expect.objectContaining({ status: 504, code: BridgeErrorCode.deadlineExceeded }) as unknown },
    ]);
    // Its first piece before the deadline: all 12, the last 1.2 s later.
    const begun = await sent(instance, {}, { deadline: Date.now() + 400 });
    const frames = await begun.answer.finished;
    expect(frames.at(-1)).toMatchObject({ type: 'done' });
    expect(begun.answer.text()).toBe(expectedText(seedFor(begun.req.id), 12));
    // Handed back mid-answer and continued here past the deadline it had: served, after what was said.
    const continued = newId();
    const said = { tokens: [0, 1, 2], text: expectedText(seedFor(continued), 3) };
    const continuation = await sent(instance, {}, { deadline: Date.now() - 1, continues: { id: continued, createdAt: Date.now(), resume: said } });
    expect((await continuation.answer.finished).at(-1)).toMatchObject({ type: 'done' });
    expect(said.text + continuation.answer.text()).toBe(expectedText(seedFor(continued), 12));
    // One continued with nothing said is a first piece not yet had: cut like the first.
    const unsaid = await sent(instance, {}, { deadline: Date.now() - 1, continues: { id: newId(), createdAt: Date.now(), resume: { tokens: [], text: '' } } });
    expect(await unsaid.answer.finished).toEqual([
      { seq: 0, type: 'error', error: expect.objectContaining({ code: BridgeErrorCode.deadlineExceeded }) as unknown },
    ]);
    await until('terms', () => b.stats.termed === 3);
  });

  it('malformed and invalid requests are terminated, with an error frame when there is a replyTo', async () => {
    const stub = await engine(() => ({}));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    const js = nc.jetstream();
    const subject = requestSubjectOf(names, POOL, instance);
    await js.publish(subject, new TextEncoder().encode('{not json'));
    const invalid = requestFor({ messages: [] });
    const answer = await listen(invalid.id);
    await js.publish(subject, encodeJson(invalid));
    expect(await answer.finished).toEqual([
      { seq: 0, type: 'error', error: expect.objectContaining({ status: 400, code: BridgeErrorCode.invalidRequest }) as unknown },
    ]);
    await until('both termed', () => b.stats.termed === 2);
    expect(stub.calls).toHaveLength(0);
  });

  it('duplicate publishes of one request id are answered once', async () => {
    const stub = await engine(() => ({ chunks: 2 }));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    const req = requestFor();
    const answer = await listen(req.id);
    const js = nc.jetstream();
    const acks = [];
    for (let i = 0; i < 3; i += 1) acks.push(await publishRequest(js, names, { pool: POOL, instance }, req));
    expect(acks.map((a) => a.duplicate)).toEqual([false, true, true]);
    await answer.finished;
    await sleep(300);
    expect(stub.calls).toHaveLength(1);
    expect(b.stats.pulled).toBe(1);
  });
});

describe("an instance's lanes", () => {
  it('a request handed back with nothing said is served before the requests queued for the instance, beside the one in flight', async () => {
    const stub = await engine(() => ({ chunks: 4, delayMs: 150 }));
    const instance = await instanceWith();
    await bridge(instance, stub.url);
    const asked = (text: string) => ({ messages: [{ role: 'user' as const, content: text }] });
    const deadlines = new Map<string, number>();
    const { req: firstReq, answer: inFlight } = await sent(instance, asked('first'));
    deadlines.set('first', firstReq.deadline);
    await until('the first in flight', () => inFlight.raw.length >= 1);
    const queued = [];
    for (const n of [1, 2, 3]) {
      const { req, answer } = await sent(instance, asked(`queued ${n}`));
      deadlines.set(`queued ${n}`, req.deadline);
      queued.push(answer);
    }
    await until('three queued', async () => (await consumerState(instance)).num_pending === 3);
    // Handed back by another instance (its drain deadline passed while it waited there): its
    // gateway sends it on, continuing an answer of which nothing was said (names.ts requestSubjectFor).
    const { req: handedBackReq, answer: handedBack } = await sent(instance, asked('handed back'), {
      continues: { id: newId(), createdAt: Date.now(), resume: { tokens: [], text: '' } },
    });
    deadlines.set('handed back', handedBackReq.deadline);
    for (const a of [inFlight, handedBack, ...queued]) expect((await a.finished).at(-1)).toMatchObject({ type: 'done' });
    const order = stub.calls.map((c) => c.messages[0]!.content);
    // Beside the one in flight (a real engine queues it first: at most the slots' requests before it), before every queued one.
    expect(order).toEqual(['first', 'handed back', 'queued 1', 'queued 2', 'queued 3']);
    // Its engine is told it waited its turn elsewhere (it puts it before its own queue: engine/slots.ts); no other.
    expect(stub.callHeaders.map((h) => h[REQUEUED_HEADER])).toEqual([undefined, '1', undefined, undefined, undefined]);
    // And every call says its request's deadline (the engine places one handed back among its queue by it).
    expect(stub.callHeaders.map((h) => Number(h[DUE_HEADER]))).toEqual(order.map((text) => Math.round(deadlines.get(text)!)));
    const lane = await jsm.consumers.info(names.requestStream, laneConsumerNameOf(POOL, instance, 'requeued'));
    expect(lane.config.filter_subject).toBe(laneSubjectOf(names, POOL, instance, 'requeued'));
    expect(lane.num_pending + lane.num_ack_pending).toBe(0);
  });

  /**
   * A request handed back to `instance` with nothing said, due `inMs` from now; with `placeInMs`,
   * its place in a queue apart from its deadline (a continuation keeps the place of the request it
   * continues, a resume gives it a later deadline: shared/serving.ts `queueDueOf`).
   */
  const handedBack = (instance: string, text: string, inMs: number, placeInMs?: number) =>
    sent(
      instance,
      { messages: [{ role: 'user', content: text }] },
      {
        deadline: Date.now() + inMs,
        ...(placeInMs !== undefined ? { due: Date.now() + placeInMs } : {}),
        continues: { id: newId(), createdAt: Date.now(), resume: { tokens: [], text: '' } },
      },
    );

  it('the requests handed back are served earliest place first (their deadline, or the place they keep), as many at once as its slots, not in the order handed back', async () => {
    // The two in flight outlast the five handed back meanwhile.
    const stub = await engine((_, body) =>
      body.messages[0]!.content === 'first' || body.messages[0]!.content === 'second' ? { chunks: 20, delayMs: 150 } : { chunks: 3, delayMs: 50 },
    );
    const instance = await instanceWith({ slots: 2 });
    const b = await bridge(instance, stub.url, { slots: 2 });
    // The lane's slots (its own, beside its requests'), taken.
    const first = [await handedBack(instance, 'first', 60_000), await handedBack(instance, 'second', 60_000)];
    await until('both in flight', () => first.every(({ answer }) => answer.raw.length >= 1));
    // Handed back meanwhile, the youngest first (a request handed back again is older than those before it).
    const back = [];
    for (const [text, inMs] of [
      ['due in 60 s', 60_000],
      ['due in 20 s', 20_000],
      ['due in 50 s', 50_000],
      ['due in 10 s', 10_000],
      ['due in 30 s', 30_000],
    ] as const)
      back.push(await handedBack(instance, text, inMs));
    // Moved on by a resume: due in 90 s, its place that of a request due in 15 s.
    const kept = await handedBack(instance, 'placed at 15 s', 90_000, 15_000);
    back.push(kept);
    for (const { answer } of [...first, ...back]) expect((await answer.finished).at(-1)).toMatchObject({ type: 'done' });
    const order = stub.calls.map((c) => c.messages[0]!.content);
    expect(order.slice(2)).toEqual(['due in 10 s', 'placed at 15 s', 'due in 20 s', 'due in 30 s', 'due in 50 s', 'due in 60 s']);
    // Its engine is told its place, not its deadline (the engine orders its own queue by it).
    expect(Number(stub.callHeaders[3]![DUE_HEADER])).toBe(Math.round(kept.req.due!));
    // The engine never had more than its slots of them: the lane's consumer held the rest.
    expect(stub.maxActive).toBe(2);
    expect(stub.callHeaders.every((h) => h[REQUEUED_HEADER] === '1')).toBe(true);
    await until('all acked', () => b.stats.acked === 8);
    expect(b.stats.nakked).toBe(0);
    const lane = await jsm.consumers.info(names.requestStream, laneConsumerNameOf(POOL, instance, 'requeued'));
    expect(lane.config.max_ack_pending).toBe(REQUEUED_HELD);
    expect(lane.num_pending + lane.num_ack_pending).toBe(0);
  });

  it('those held are kept from redelivery while they wait, and handed back past the drain deadline like those still queued', async () => {
    const stub = await engine(() => ({ chunks: 80, delayMs: 100 }));
    const instance = await instanceWith({ ackWaitMs: 1_500 });
    const b = await bridge(instance, stub.url, { drainTimeoutMs: 4_500 });
    // The lane's slot taken, on an engine whose frames say no tokens: it cannot be continued elsewhere.
    const { answer: inFlight } = await handedBack(instance, 'in flight', 60_000);
    await until('in flight', () => inFlight.raw.length >= 1);
    const held = [await handedBack(instance, 'held 1', 60_000), await handedBack(instance, 'held 2', 30_000)];
    const lane = () => jsm.consumers.info(names.requestStream, laneConsumerNameOf(POOL, instance, 'requeued'));
    await until('both held', async () => (await lane()).num_ack_pending === 3);
    // Three ack waits pass while they are held, before the drain deadline: neither is delivered again.
    await b.stop();
    expect(b.stats.redelivered).toBe(0);
    for (const { answer } of held) {
      const frames = await answer.finished;
      expect(frames).toHaveLength(1);
      expect(frames[0]).toMatchObject({ seq: 0, type: 'error', error: { code: CONTINUE_ELSEWHERE } });
    }
    // The one in flight outlasted the deadline too: back to its consumer, for the bridge of the instance that comes back.
    expect(stub.calls).toHaveLength(1);
    expect(b.stats).toMatchObject({ handedBack: 2, nakked: 1, acked: 0 });
    // Of the three, the lane keeps only the one in flight, nak'd, for the instance's next bridge.
    const left = await lane();
    expect(left.num_ack_pending + left.num_pending).toBe(1);
  });
});

describe("a bridge's beats say whether it pulls the requests handed back", () => {
  /** The next beat of `instance`'s bridge, as the gateway reads it. */
  const nextBeat = async (instance: string): Promise<BridgeLoad | undefined> => {
    const sub = nc.subscribe(beatSubjectOf(names, POOL, instance), { max: 1, timeout: 5_000 });
    for await (const m of sub) return bridgeLoadOf(m.data);
    return undefined;
  };

  it('a bridge of this version says it does', async () => {
    const stub = await engine(() => ({}));
    const instance = await instanceWith();
    await bridge(instance, stub.url);
    const first = await nextBeat(instance);
    expect(first).toMatchObject({ slots: 1, requeued: true });
    expect(first?.boot).toMatch(/^[A-Za-z0-9_-]{8}$/);
    // The same start beats the same id (gateway/serving/beats.ts tells starts apart by it).
    expect((await nextBeat(instance))?.boot).toBe(first?.boot);
  });

  it('once told to stop, it says so and beats every STOPPING_BEAT_EVERY_MS while it finishes its answer (a gateway moves its answers sooner once it dies)', async () => {
    const stub = await engine(() => ({ chunks: 20, delayMs: 100 }));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    expect((await nextBeat(instance))?.stopping).toBeUndefined();
    const { answer } = await sent(instance);
    await until('the first chunk', () => answer.raw.length >= 1);
    const beats: { at: number; load?: BridgeLoad }[] = [];
    const sub = nc.subscribe(beatSubjectOf(names, POOL, instance), { callback: (_err, m) => beats.push({ at: Date.now(), load: bridgeLoadOf(m.data) }) });
    const asked = Date.now();
    const stopped = b.stop();
    await until('1 s of beats', () => Date.now() - asked >= 1000);
    sub.unsubscribe();
    expect(beats.length).toBeGreaterThan(0);
    expect(beats.every((x) => x.load?.stopping === true)).toBe(true);
    // Its beats at 250 ms would be 4 or 5 in that second.
    expect(beats.length).toBeGreaterThanOrEqual(1000 / STOPPING_BEAT_EVERY_MS - 3);
    await stopped;
    expect((await answer.finished).at(-1)).toMatchObject({ type: 'done' });
  });

  (natsSignerFile() ? it : it.skip)(
    'one whose NATS user was made before that lane starts and serves without it, and says so (gateways then queue hand-backs with its requests)',
    async () => {
      const stub = await engine(() => ({}));
      const instance = await instanceWith();
      const now = bridgePermissions(names, POOL, instance);
      const before = (allow: string[]) => allow.filter((s) => !s.includes('requeued'));
      const older = { publish: { allow: before(now.publish.allow) }, subscribe: { allow: before(now.subscribe.allow) } };
      expect(older.publish.allow.length).toBeLessThan(now.publish.allow.length);
      const text = await bridgeCredentialsText(readNatsSigner(natsSignerFile()!), names, POOL, instance, older);
      const creds = parseCredentialsFile(text);
      if ('error' in creds) throw new Error(creds.error);
      const conn = await connect({ servers: endpoint('nats').servers, ...natsAuthOptions(creds) });
      cleanups.push(() => conn.close());
      const seen = logs.length;
      await bridge(instance, stub.url, {}, conn);
      expect(logs.slice(seen).some((l) => l.startsWith('not pulling the requests handed back to this instance'))).toBe(true);
      const beat = await nextBeat(instance);
      expect(beat).toMatchObject({ slots: 1 });
      expect(beat?.requeued).toBeUndefined();
      const { answer } = await sent(instance);
      expect((await answer.finished).at(-1)).toMatchObject({ type: 'done' });
    },
  );
});

describe('frames on the instance’s subject', () => {
  it('a request without instanceFrames (an older gateway’s) is answered on its replyTo itself; under its own NATS user a bridge may not publish there', async () => {
    const stub = await engine(() => ({ chunks: 2 }));
    // A bridge connected as the worker (no instance user, as a data plane without NATS users has it).
    const open = await instanceWith();
    const b = await bridge(open, stub.url, {}, nc);
    const older = requestFor({}, { instanceFrames: undefined });
    const answer = await listen(older.id, 30_000, older.replyTo);
    await send(open, older);
    expect((await answer.finished).map((f) => f.type)).toEqual(['chunk', 'chunk', 'chunk', 'done']); // the role, two contents, done
    await until('ack', () => b.stats.acked === 1);
    // Its own instance's subject is where a bridge user's frames go; the bare reply subject is refused by the server.
    const scoped = await instanceWith();
    const conn = await natsConnectAsBridge(names, POOL, scoped);
    cleanups.push(() => conn.close());
    const refused = new Promise<unknown>((resolve) => {
      void (async () => {
        for await (const st of conn.status()) if (st.type === Events.Error) return resolve({ code: st.data, ...st.permissionContext });
      })();
    });
    const bare = responseSubjectOf(names, newId(), REPLICA);
    conn.publish(bare, encodeJson({ seq: 0, type: 'done' }));
    expect(await refused).toEqual({ code: 'PERMISSIONS_VIOLATION', operation: 'publish', subject: bare });
  });
});

describe('shutdown', () => {
  it('stop() serves what its consumer holds, lets the request in flight finish, then stops pulling', async () => {
    const stub = await engine(() => ({ chunks: 5, delayMs: 150 }));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url);
    const req = requestFor();
    const later = requestFor();
    const answer = await listen(req.id);
    const queued = await listen(later.id);
    await send(instance, req);
    await until('the first chunk', () => answer.raw.length >= 1);
    await send(instance, later);
    await until('the second is queued', async () => (await consumerState(instance)).num_pending === 1);
    await b.stop();
    expect((await answer.finished).at(-1)).toMatchObject({ type: 'done' });
    // The queued one was served before the bridge stopped: nothing is left for another bridge.
    expect((await queued.finished).at(-1)).toMatchObject({ type: 'done' });
    expect(b.stats.acked).toBe(2);
    expect(b.health().problems).toContain('not consuming');
    await consumerEmptied(instance);
    expect(stub.calls).toHaveLength(2);
  });

  it('stop() hands requests that outlast the drain timeout back for another bridge to finish', async () => {
    const stub = await engine(() => ({ chunks: 20, delayMs: 100 }));
    const instance = await instanceWith();
    const first = await bridge(instance, stub.url, { drainTimeoutMs: 300 });
    const { req, answer } = await sent(instance);
    await until('some chunks', () => answer.raw.length >= 3);
    await first.stop();
    expect(first.stats).toMatchObject({ nakked: 1, acked: 0 });
    const second = await bridge(instance, stub.url);
    await answer.finished;
    expect(answer.text()).toBe(expectedText(seedFor(req.id), 20));
    expect(answer.raw.map((f) => f.seq)).toEqual(Array.from({ length: 22 }, (_, i) => i));
    await until('ack', () => second.stats.acked === 1);
    expect(second.stats.resumed).toBe(1);
  });

  it('stop() past its drain deadline numbers what it hands back together: answers mid-way 0, 1 …, and apart from them those with nothing said', async () => {
    const stub = await engine(() => ({ chunks: 40, delayMs: 100, tokens: true }));
    const instance = await instanceWith({ slots: 2 });
    const b = await bridge(instance, stub.url, { slots: 2, drainTimeoutMs: 300 }); // llama.cpp's engine: it continues answers
    const inFlight = [await sent(instance), await sent(instance)];
    await until('both answering', () => inFlight.every(({ answer }) => answer.raw.length >= 3));
    // One queued with a place of its own (a continuation's: shared/serving.ts `queueDueOf`), before its deadline.
    const queued = [await sent(instance), await sent(instance, {}, { due: Date.now() - 30_000 })];
    await until('two queued', async () => (await consumerState(instance)).num_pending === 2);
    await b.stop();
    const last = async (list: typeof inFlight) => Promise.all(list.map(async ({ answer }) => (await answer.finished).at(-1)));
    const midway = await last(inFlight);
    for (const f of midway) expect(f).toMatchObject({ type: 'error', error: { code: CONTINUE_ELSEWHERE } });
    expect(midway.map((f) => (f as { spread?: number }).spread).sort()).toEqual([0, 1]);
    const unsaid = await last(queued);
    for (const f of unsaid) expect(f).toMatchObject({ seq: 0, type: 'error', error: { code: CONTINUE_ELSEWHERE } });
    expect(unsaid.map((f) => (f as { spread?: number }).spread).sort()).toEqual([0, 1]);
    // Each says its request's place in a queue, which the request continuing it keeps.
    expect([...midway, ...unsaid].map((f) => (f as { due?: number }).due)).toEqual([...inFlight, ...queued].map(({ req }) => req.due ?? req.deadline));
    expect(queued[1]!.req.due).toBeLessThan(queued[1]!.req.deadline);
    expect(b.stats.handedBack).toBe(4);
  });

  it('stop() past its drain deadline hands back what is still queued: a stream at once, nothing of it said; any other answered 503', async () => {
    const stub = await engine(() => ({ chunks: 20, delayMs: 100 }));
    const instance = await instanceWith();
    const b = await bridge(instance, stub.url, { drainTimeoutMs: 300 });
    // In flight, on an engine whose frames say no tokens: it cannot be continued elsewhere, so it runs on past the deadline.
    const { answer: inFlight } = await sent(instance);
    await until('some chunks', () => inFlight.raw.length >= 2);
    // Queued behind it: a stream (its gateway can send it elsewhere) and an answer not streamed (it cannot).
    const { answer: stream } = await sent(instance);
    const { answer: whole } = await sent(instance, { stream: false });
    await until('both queued', async () => (await consumerState(instance)).num_pending === 2);
    const stopping = Date.now();
    await b.stop();
    expect((await inFlight.finished).at(-1)).toMatchObject({ type: 'done' });
    // The stream: one frame, at seq 0, handing it back (its gateway sends it to another instance: routes/inference.ts).
    const handed = await stream.finished;
    expect(handed).toHaveLength(1);
    expect(handed[0]).toMatchObject({ seq: 0, type: 'error', error: { code: CONTINUE_ELSEWHERE } });
    // The other: told at once, to retry.
    const told = await whole.finished;
    expect(told).toHaveLength(1);
    expect(told[0]).toMatchObject({ seq: 0, type: 'error', error: { status: 503, code: BridgeErrorCode.instanceStopped } });
    // Nothing left to go with the consumer; the engine was called for the one in flight only.
    await consumerEmptied(instance);
    expect(stub.calls).toHaveLength(1);
    expect(b.stats).toMatchObject({ handedBack: 1, acked: 1 });
    expect(Date.now() - stopping).toBeLessThan(8_000);
    expect(logs.some((l) => l.includes('the drain deadline passed; handing'))).toBe(true);
  });
});

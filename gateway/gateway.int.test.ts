/**
 * The gateway process (startGateway: real port, real NATS connection, KV watches, JetStream
 * publish, shared response subscription) against the real nats-server, with a fake *bridge*
 * written here: it pulls requests from a JetStream work-queue stream through a durable consumer
 * and answers with ResponseFrames on the reply subject — in order, shuffled, duplicated, failing
 * or not at all, as each test's prompt asks.
 */
import OpenAI from 'openai';
import { AckPolicy, nanos, RetentionPolicy, StorageType, type ConsumerMessages, type JetStreamClient, type KV, type NatsConnection } from 'nats';
import { dataPlaneNames, ensureResponsesBucket, type DataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import type { ChatInference as InferenceRequest, ResponseFrame, SessionEntry } from '../shared/serving';
import { endpoint, isolation, natsConnect, natsCredentialsEnv, natsRoleCredentials } from '../test/harness';
import { loadGatewayConfig } from './config';
import { conversationKey } from './serving/conversation';
import { keyOwner } from '../shared/serving';
import type { AcquireRequest } from './serving/sessions';
import { startGateway, type RunningGateway } from './server';
import { LogSink, makeToken, readyModel, sseEvents, TEST_SECRET } from '../test/harness/gateway-app';
import { sleep, until } from '../test/harness/wait';

const iso = isolation();
// A scoped data plane (`<scope>.magus.req.…`, `<scope>.magus.res.…`), as tests of the data-plane
// module use, so nothing here overlaps another test file's streams on the shared server.
const scope = iso.natsPrefix.toLowerCase();
const pool = 'gw';
const instance = 'inst-1';
const subject = `${scope}.magus.req.${pool}.${instance}`;
const streamName = `${iso.natsPrefix}_REQUESTS`;
const buckets = {
  models: `${iso.natsPrefix}_models`,
  tokens: `${iso.natsPrefix}_tokens`,
  sessions: `${iso.natsPrefix}_sessions`,
  responses: `${iso.natsPrefix}_responses`,
  limits: `${iso.natsPrefix}_limits`,
  pools: `${iso.natsPrefix}_pools`,
};
const alice = makeToken('alice');
/** Its `magus_tokens` entry names no key (as an older magus wrote them): the key `token/alice`. */
const ALICE_OWNER = keyOwner('token/alice', 'alice');
const enc = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));
/** The names the gateways here use (the buckets above, the rest unprefixed): what their NATS user may reach. */
const gatewayNames: DataPlaneNames = {
  ...dataPlaneNames(),
  subjectScope: scope,
  modelsBucket: buckets.models,
  tokensBucket: buckets.tokens,
  sessionsBucket: buckets.sessions,
  responsesBucket: buckets.responses,
  limitsBucket: buckets.limits,
  poolsBucket: buckets.pools,
};
/** The gateway's credentials file for {@link gatewayNames} (none when the test server has no users). */
let gatewayCredentials: string | undefined;

let nc: NatsConnection;
let js: JetStreamClient;
let tokensKv: KV;
let sessionsKv: KV;
let gw: RunningGateway;
let bridge: ConsumerMessages;
const log = new LogSink();
const seen: { req: InferenceRequest; msgId: string | undefined }[] = [];
const coldStarts: Omit<AcquireRequest, 'signal'>[] = [];
let coldStartDelayMs = 0;

const chunkData = (content: string) => ({
  id: 'chatcmpl-b',
  object: 'chat.completion.chunk',
  created: 1,
  model: 'tiny',
  choices: [{ index: 0, delta: { content }, finish_reason: null }],
});

/** What the fake bridge answers, keyed by the last user message. */
function script(req: InferenceRequest): ResponseFrame[] {
  const prompt = req.body.messages[req.body.messages.length - 1]!.content;
  const c = (seq: number, text: string): ResponseFrame => ({ seq, type: 'chunk', data: chunkData(text) });
  switch (prompt) {
    case 'shuffle': // out of order, duplicated, and a redelivered restart from seq 0
      return [c(1, 'b'), c(0, 'a'), c(0, 'a'), c(3, 'd'), c(2, 'c'), c(0, 'a'), c(1, 'b'), c(4, 'e'), { seq: 5, type: 'done' }];
    case 'bad-request':
      return [
        {
          seq: 0,
          type: 'error',
          error: { status: 400, message: 'prompt exceeds the context window', type: 'invalid_request_error', code: 'context_length_exceeded' },
        },
      ];
    case 'fail-midway':
      return [c(0, 'a'), { seq: 1, type: 'error', error: { status: 500, message: 'engine 10.1.2.3 crashed', type: 'server_error', code: null } }];
    case 'silence':
      return [];
    default:
      return req.body.stream
        ? [c(0, 'Hel'), c(1, 'lo'), { seq: 2, type: 'done' }]
        : [
            {
              seq: 0,
              type: 'done',
              data: {
                id: `chatcmpl-${req.id}`,
                object: 'chat.completion',
                created: 1,
                model: req.body.model,
                choices: [{ index: 0, message: { role: 'assistant', content: `echo: ${prompt}` }, finish_reason: 'stop' }],
              },
            },
          ];
  }
}

async function startBridge(): Promise<void> {
  const jsm = await nc.jetstreamManager();
  // Only this pool's subjects: a request to another pool finds no stream (the 503 below).
  await jsm.streams.add({ name: streamName, subjects: [`${scope}.magus.req.${pool}.>`], retention: RetentionPolicy.Workqueue, storage: StorageType.Memory });
  await jsm.consumers.add(streamName, { durable_name: 'bridge', ack_policy: AckPolicy.Explicit, filter_subject: subject });
  bridge = await (await js.consumers.get(streamName, 'bridge')).consume({ max_messages: 16 });
  void (async () => {
    for await (const m of bridge) {
      const req = m.json<InferenceRequest>();
      if (!req.replyTo.startsWith(`${scope}.magus.res.`)) throw new Error(`unexpected replyTo ${req.replyTo}`);
      seen.push({ req, msgId: m.headers?.get('Nats-Msg-Id') });
      m.ack();
      for (const frame of script(req)) {
        nc.publish(req.replyTo, enc(frame));
        await nc.flush();
      }
    }
  })();
}

const coldStart = async (req: AcquireRequest): Promise<SessionEntry> => {
  coldStarts.push({ conversationKey: req.conversationKey, model: req.model, owner: req.owner });
  await sleep(coldStartDelayMs);
  // Pin the conversation to the instance (an entry without `placedAt`): its warm turns go there.
  const entry: SessionEntry = { subject, pool, instance, expiresAt: Date.now() + 600_000 };
  await sessionsKv.put(req.conversationKey, enc(entry));
  return entry;
};

beforeAll(async () => {
  gatewayCredentials = await natsRoleCredentials('gateway', gatewayNames);
  nc = await natsConnect();
  js = nc.jetstream();
  const registry = await openModelRegistry(nc, buckets.models);
  await registry.put(readyModel('tiny'));
  tokensKv = await js.views.kv(buckets.tokens);
  sessionsKv = await js.views.kv(buckets.sessions);
  // Declared as the worker declares them: the gateway's user may use them, not create them.
  for (const bucket of [buckets.limits, buckets.pools]) await js.views.kv(bucket);
  await tokensKv.put('alice', enc(alice.entry));
  await startBridge();
  gw = await startGateway(loadGatewayConfig(gatewayEnv(), { host: '127.0.0.1', port: '0' }), { coldStart, logStream: log });
}, 60_000);

/** The environment of the gateways started here: this file's data plane, short timeouts. */
function gatewayEnv(more: NodeJS.ProcessEnv = {}): NodeJS.ProcessEnv {
  return {
    MAGUS_NATS_URL: endpoint('nats').servers,
    ...natsCredentialsEnv(gatewayCredentials),
    MAGUS_NATS_SUBJECT_SCOPE: scope,
    MAGUS_GATEWAY_SECRET: TEST_SECRET,
    MAGUS_MODELS_BUCKET: buckets.models,
    MAGUS_TOKENS_BUCKET: buckets.tokens,
    MAGUS_SESSIONS_BUCKET: buckets.sessions,
    MAGUS_RESPONSES_BUCKET: buckets.responses,
    MAGUS_LIMITS_BUCKET: buckets.limits,
    MAGUS_POOLS_BUCKET: buckets.pools,
    MAGUS_RESPONSES_TTL: '2h',
    MAGUS_GATEWAY_REQUEST_TIMEOUT_MS: '1500',
    MAGUS_GATEWAY_GAP_TIMEOUT_MS: '300',
    MAGUS_GATEWAY_SSE_KEEPALIVE_MS: '100',
    MAGUS_GATEWAY_RESUME_HOLD_MS: '400',
    MAGUS_LOG_LEVEL: 'info',
    ...more,
  };
}

afterAll(async () => {
  await gw?.close();
  await bridge?.close();
  const jsm = await nc?.jetstreamManager();
  for (const b of Object.values(buckets)) await jsm?.streams.delete(`KV_${b}`).catch(() => undefined);
  await jsm?.streams.delete(streamName).catch(() => undefined);
  await nc?.drain();
});

beforeEach(() => {
  coldStartDelayMs = 0;
});

function post(body: object, headers: Record<string, string> = {}, token: string | null = alice.token): Promise<Response> {
  return fetch(`${gw.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...(token ? { authorization: `Bearer ${token}` } : {}), ...headers },
    body: JSON.stringify(body),
  });
}
const turn = (content: string, stream = false, system = 'You are a test.') => ({
  model: 'tiny',
  stream,
  messages: [
    { role: 'system', content: system },
    { role: 'user', content },
  ],
});

describe('round trips through NATS', () => {
  it('non-stream: publishes with Nats-Msg-Id = request id after subscribing, relays the completion', async () => {
    const res = await post(turn('hi there', false, 'non-stream'));
    expect(res.status).toBe(200);
    const body = (await res.json()) as { id: string; choices: { message: { content: string } }[] };
    const id = res.headers.get('x-request-id')!;
    expect(body.choices[0]!.message.content).toBe('echo: hi there');
    expect(body.id).toBe(`chatcmpl-${id}`);
    const got = seen.find((s) => s.req.id === id)!;
    expect(got.msgId).toBe(id);
    expect(got.req.replyTo).toMatch(new RegExp(`^${scope}\\.magus\\.res\\.gw-[0-9a-f]{12}\\.${id}$`)); // this replica's own subject
  });

  it('stream: SSE chunks then [DONE]', async () => {
    const res = await post(turn('hello', true, 'stream'));
    expect(res.status).toBe(200);
    expect(res.headers.get('content-type')).toBe('text/event-stream; charset=utf-8');
    const events = sseEvents(await res.text());
    expect(events).toHaveLength(3);
    expect(
      events
        .slice(0, 2)
        .map((e) => (e as ReturnType<typeof chunkData>).choices[0]!.delta.content)
        .join(''),
    ).toBe('Hello');
    expect(events[2]).toBe('[DONE]');
  });

  it('frames out of order and duplicated over NATS are assembled in order, once', async () => {
    const res = await post(turn('shuffle', true, 'shuffle'));
    const events = sseEvents(await res.text());
    expect(events[events.length - 1]).toBe('[DONE]');
    expect(
      events
        .slice(0, -1)
        .map((e) => (e as ReturnType<typeof chunkData>).choices[0]!.delta.content)
        .join(''),
    ).toBe('abcde');
  });

  it('an error frame before the stream started is the HTTP answer', async () => {
    const res = await post(turn('bad-request', true, 'err-before'));
    expect(res.status).toBe(400);
    expect(await res.json()).toEqual({
      error: { message: 'prompt exceeds the context window', type: 'invalid_request_error', param: null, code: 'context_length_exceeded' },
    });
  });

  it('an error frame after the stream started is an SSE error event, then the stream ends', async () => {
    const res = await post(turn('fail-midway', true, 'err-after'));
    expect(res.status).toBe(200);
    const text = await res.text();
    const events = sseEvents(text);
    expect(events).toHaveLength(2);
    expect(events[1]).toMatchObject({ error: { type: 'server_error', code: 'engine_error' } });
    expect(text).not.toContain('10.1.2.3');
    expect(text).not.toContain('[DONE]');
  });

  it('504 when the engine never answers', async () => {
    const started = Date.now();
    const res = await post(turn('silence', false, 'silent'));
    expect(res.status).toBe(504);
    expect(((await res.json()) as { error: { code: string } }).error.code).toBe('timeout');
    expect(Date.now() - started).toBeGreaterThanOrEqual(1400);
  });

  it('503 (details hidden) when no stream takes the instance subject', async () => {
    const sid = 'nowhere';
    const key = conversationKey(TEST_SECRET, { scope: 'alice', model: 'default/tiny', messages: [], sessionId: sid });
    // A request subject the gateway may publish to (its user's permissions), which no stream takes.
    await sessionsKv.put(key, enc({ subject: `${scope}.magus.req.nostream.x`, pool: 'nostream', instance: 'x', expiresAt: Date.now() + 600_000 }));
    const res = await post(turn('hi'), { 'x-session-id': sid });
    expect(res.status).toBe(503);
    expect(await res.text()).not.toContain('nostream');
  });

  /**
   * A pool whose request stream comes only `afterMs` in (as one electing its leader answers no
   * publish until it has one), answered `answerAfterMs` after by a bridge written here; returns the client's response.
   */
  async function turnWhileNoStream(name: string, body: object, afterMs: number, answerAfterMs = 0): Promise<Response> {
    const key = conversationKey(TEST_SECRET, { scope: 'alice', model: 'default/tiny', messages: [], sessionId: name });
    const late = `${scope}.magus.req.${name}.x`;
    await sessionsKv.put(key, enc({ subject: late, pool: name, instance: 'x', expiresAt: Date.now() + 600_000 }));
    const stream = `${streamName}_${name.toUpperCase()}`;
    const bridged = (async () => {
      await sleep(afterMs);
      const jsm = await nc.jetstreamManager();
      await jsm.streams.add({ name: stream, subjects: [`${scope}.magus.req.${name}.>`], retention: RetentionPolicy.Workqueue, storage: StorageType.Memory });
      await jsm.consumers.add(stream, { durable_name: 'late', ack_policy: AckPolicy.Explicit });
      const m = await (await js.consumers.get(stream, 'late')).next({ expires: 5_000 });
      if (!m) throw new Error('no request reached the stream');
      const req = m.json<InferenceRequest>();
      m.ack();
      await sleep(answerAfterMs);
      for (const frame of script(req)) nc.publish(req.replyTo, enc(frame));
      await nc.flush();
      return req;
    })();
    bridged.catch(() => undefined);
    try {
      const res = await post(body, { 'x-session-id': name });
      await bridged;
      return res;
    } finally {
      await (await nc.jetstreamManager()).streams.delete(stream).catch(() => undefined);
    }
  }

  it('a request stream that takes no publish yet (a leader election): a turn not committed waits it out and is answered, not refused', async () => {
    const retries = async () => Number(/magus_gateway_publish_retries_total (\d+)/.exec(await (await fetch(`${gw.url}/metrics`)).text())?.[1] ?? 0);
    const before = await retries();
    const res = await turnWhileNoStream('electing', turn('elected'), 600);
    expect(res.status).toBe(200);
    expect(((await res.json()) as { choices: { message: { content: string } }[] }).choices[0]!.message.content).toBe('echo: elected');
    expect(await retries()).toBeGreaterThan(before);
  });

  it('a streamed one says in its keep-alives that it is not queued yet, then streams the answer', async () => {
    const res = await turnWhileNoStream('electing2', turn('elected', true), 600, 400);
    expect(res.status).toBe(200);
    const text = await res.text();
    const said = text.split('\n').filter((l) => l.startsWith(': keep-alive: '));
    const notYet = ': keep-alive: not queued yet at instance x of default/tiny (its request stream elects a leader, or NATS is away): trying again';
    const queued = ': keep-alive: queued at instance x of default/tiny: waiting for its engine to begin the answer';
    // Not queued, then queued once the stream took it; none of it after the answer began.
    expect(said[0]).toBe(notYet);
    expect(said.at(-1)).toBe(queued);
    expect(said.lastIndexOf(notYet)).toBeLessThan(said.indexOf(queued));
    expect(text.lastIndexOf(': keep-alive')).toBeLessThan(text.indexOf('data: '));
    expect(sseEvents(text).map((e) => (e === '[DONE]' ? e : (e as { choices: { delta: { content: string } }[] }).choices[0]!.delta.content))).toEqual([
      'Hel',
      'lo',
      '[DONE]',
    ]);
  });
});

describe('the official openai client', () => {
  const client = () => new OpenAI({ apiKey: alice.token, baseURL: `${gw.url}/v1`, maxRetries: 0 });

  it('creates a completion, streams one, and lists models', async () => {
    const completion = await client().chat.completions.create({
      model: 'tiny',
      messages: [
        { role: 'system', content: 'sdk' },
        { role: 'user', content: 'from the sdk' },
      ],
    });
    expect(completion.choices[0]!.message.content).toBe('echo: from the sdk');
    let text = '';
    const stream = await client().chat.completions.create({
      model: 'tiny',
      stream: true,
      messages: [
        { role: 'system', content: 'sdk-stream' },
        { role: 'user', content: 'shuffle' },
      ],
    });
    for await (const chunk of stream) text += chunk.choices[0]?.delta.content ?? '';
    expect(text).toBe('abcde');
    const models = [];
    for await (const m of client().models.list()) models.push(m.id);
    expect(models).toEqual(['tiny']);
  });

  it('raises typed errors with OpenAI’s fields', async () => {
    const notFound = await client()
      .chat.completions.create({ model: 'nope', messages: [{ role: 'user', content: 'x' }] })
      .catch((e: unknown) => e);
    // The SDK's error classes, by name (not instanceof across module boundaries).
    const className = (e: unknown) => (e as object).constructor.name;
    expect(className(notFound)).toBe('NotFoundError');
    expect(notFound).toMatchObject({ status: 404, code: 'model_not_found', param: 'model', type: 'invalid_request_error' });
    const unauthorized = await new OpenAI({ apiKey: 'mgs_alice_wrong', baseURL: `${gw.url}/v1`, maxRetries: 0 }).models.list().catch((e: unknown) => e);
    expect(className(unauthorized)).toBe('AuthenticationError');
    expect(unauthorized).toMatchObject({ status: 401, code: 'invalid_api_key' });
    const midway = await (async () => {
      const s = await client().chat.completions.create({
        model: 'tiny',
        stream: true,
        messages: [
          { role: 'system', content: 'sdk-err' },
          { role: 'user', content: 'fail-midway' },
        ],
      });
      for await (const _ of s) {
        // consume until the error event
      }
    })().catch((e: unknown) => e);
    expect(className(midway)).toBe('APIError');
    expect((midway as Error).message).not.toContain('10.1.2.3');
  });
});

describe('the Responses API over NATS, its chain in the magus_responses KV', () => {
  const client = () => new OpenAI({ apiKey: alice.token, baseURL: `${gw.url}/v1`, maxRetries: 0 });

  it('the gateway declares the bucket with the configured max age, and brings an existing one to its own', async () => {
    const jsm = await nc.jetstreamManager();
    expect((await jsm.streams.info(`KV_${buckets.responses}`)).config).toMatchObject({
      max_age: nanos(2 * 3_600_000),
      max_msgs_per_subject: 1,
      storage: StorageType.File,
    });
    await ensureResponsesBucket(nc, buckets.responses, { maxAgeMs: 3 * 3_600_000 });
    expect((await jsm.streams.info(`KV_${buckets.responses}`)).config.max_age).toBe(nanos(3 * 3_600_000));
    await ensureResponsesBucket(nc, buckets.responses, { maxAgeMs: 2 * 3_600_000 });
    expect((await jsm.streams.info(`KV_${buckets.responses}`)).config.max_age).toBe(nanos(2 * 3_600_000));
  });

  it('stored, read back, continued on the same session, streamed, and deleted, with the official client', async () => {
    const kv = await js.views.kv(buckets.responses);
    const first = await client().responses.create({ model: 'tiny', input: 'first turn', instructions: 'sdk-responses' });
    expect(first).toMatchObject({ object: 'response', status: 'completed', output_text: 'echo: first turn' });
    // The record as the KV holds it: the chain's root, the turn's messages, the response.
    const stored = JSON.parse(new TextDecoder().decode((await kv.get(first.id))!.value)) as Record<string, unknown>;
    expect(stored).toMatchObject({
      owner: ALICE_OWNER,
      model: 'default/tiny',
      root: first.id,
      previous: null,
      depth: 0,
      input: [{ role: 'user', content: 'first turn' }],
      output: [{ role: 'assistant', content: 'echo: first turn' }],
      response: { id: first.id },
    });
    expect(await client().responses.retrieve(first.id)).toMatchObject({ id: first.id, output_text: 'echo: first turn' });

    const key = conversationKey(TEST_SECRET, { scope: 'alice', model: 'default/tiny', messages: [], sessionId: first.id });
    expect(coldStarts.filter((c) => c.conversationKey === key)).toHaveLength(1);
    const second = await client().responses.create({ model: 'tiny', input: 'second turn', previous_response_id: first.id });
    expect(second.output_text).toBe('echo: second turn');
    expect(seen.at(-1)!.req.body.messages).toEqual([
      { role: 'user', content: 'first turn' },
      { role: 'assistant', content: 'echo: first turn' },
      { role: 'user', content: 'second turn' },
    ]);
    // The second turn found the chain's session: no cold start of its own.
    expect(coldStarts.filter((c) => c.conversationKey === key)).toHaveLength(1);

    const stream = client().responses.stream({ model: 'tiny', input: 'third turn', previous_response_id: second.id });
    const types: string[] = [];
    for await (const event of stream) types.push(event.type);
    const third = await stream.finalResponse();
    expect(third).toMatchObject({ status: 'completed', output_text: 'Hello', previous_response_id: second.id });
    expect(types[0]).toBe('response.created');
    expect(types.at(-1)).toBe('response.completed');
    expect(JSON.parse(new TextDecoder().decode((await kv.get(third.id))!.value))).toMatchObject({ root: first.id, previous: second.id, depth: 2 });

    await client().responses.delete(first.id);
    expect((await kv.get(first.id))?.operation).toBe('PURGE');
    await expect(client().responses.retrieve(first.id)).rejects.toMatchObject({ status: 404, code: 'response_not_found' });
    await expect(client().responses.create({ model: 'tiny', input: 'fourth', previous_response_id: third.id })).rejects.toMatchObject({
      status: 404,
      code: 'previous_response_not_found',
      param: 'previous_response_id',
    });
  });
});

describe('clients that go away', () => {
  it('a client closing a stream mid-wait ends the request at once (499, nothing left in flight) and tells the bridge once the resume hold has passed', async () => {
    const cancels: { subject: string; id: unknown; at: number }[] = [];
    const cancelSub = nc.subscribe(`${scope}.magus.cancel.>`, {
      callback: (_e, m) => cancels.push({ subject: m.subject, id: m.json<{ id: unknown }>().id, at: Date.now() }),
    });
    await nc.flush();
    const metrics = async () => (await fetch(`${gw.url}/metrics`)).text();
    const before = /status="499"\} (\d+)/.exec(await metrics())?.[1] ?? '0';
    const ctl = new AbortController();
    const res = await fetch(`${gw.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', authorization: `Bearer ${alice.token}` },
      body: JSON.stringify(turn('silence', true, 'walk-away')),
      signal: ctl.signal,
    });
    const reader = res.body!.getReader();
    const first = new TextDecoder().decode((await reader.read()).value as Uint8Array);
    expect(first).toMatch(
      /^id: \S+\.\S+\.\n: keep-alive: (queued at instance \S+ of \S+: waiting for its engine to begin the answer|waiting for an instance of \S+ to take the request \(one may be starting\))\n\n$/,
    );
    ctl.abort();
    const started = Date.now();
    let text = '';
    for (;;) {
      text = await metrics();
      if (text.includes('magus_gateway_requests_in_flight 1\n')) break;
      await sleep(10);
    }
    expect(Date.now() - started).toBeLessThan(1000); // well before the 1.5 s request timeout
    expect(Number(/route="\/v1\/chat\/completions",status="499"\} (\d+)/.exec(text)?.[1])).toBe(Number(before) + 1);
    // The bridge serving the instance learns that nobody waits for this request any more — once
    // the 400-ms resume hold has passed with no client back for it (a resumable stream).
    await until('the cancel sent to the bridge', () => cancels.length > 0, 5_000);
    expect(cancels.map(({ subject, id }) => ({ subject, id }))).toEqual([
      { subject: `${scope}.magus.cancel.${pool}.${instance}`, id: res.headers.get('x-request-id') },
    ]);
    expect(cancels[0]!.at - started).toBeGreaterThanOrEqual(390);
    cancelSub.unsubscribe();
  });
});

describe('sessions from the magus_sessions KV', () => {
  it('the first turn cold-starts; later turns are served from the watch cache', async () => {
    const before = coldStarts.length;
    const first = await post(turn('turn one', false, 'warm-test'));
    expect(first.status).toBe(200);
    expect(coldStarts.length).toBe(before + 1);
    const key = coldStarts[coldStarts.length - 1]!.conversationKey;
    const second = await post({
      model: 'tiny',
      messages: [
        { role: 'system', content: 'warm-test' },
        { role: 'user', content: 'turn one' },
        { role: 'assistant', content: 'echo: turn one' },
        { role: 'user', content: 'turn two' },
      ],
    });
    expect(second.status).toBe(200);
    expect(coldStarts.length).toBe(before + 1);
    expect(gw.sessionCache!.cache.get(key)?.subject).toBe(subject);
  });

  it('an entry written beforehand is used without any cold start', async () => {
    const sid = 'prewarmed-1';
    const key = conversationKey(TEST_SECRET, { scope: 'alice', model: 'default/tiny', messages: [], sessionId: sid });
    await sessionsKv.put(key, enc({ subject, pool, instance, expiresAt: Date.now() + 600_000 }));
    // Read from the bucket at its first turn (the gateway holds only the conversations it serves), then held.
    const before = coldStarts.length;
    for (let i = 0; i < 3; i++) expect((await post(turn(`q${i}`), { 'x-session-id': sid })).status).toBe(200);
    expect(coldStarts.length).toBe(before);
    expect(gw.sessionCache!.cache.get(key)?.subject).toBe(subject);
  });

  it('expired or deleted entries go back to the cold path', async () => {
    const sid = 'expiring-1';
    const key = conversationKey(TEST_SECRET, { scope: 'alice', model: 'default/tiny', messages: [], sessionId: sid });
    await sessionsKv.put(key, enc({ subject, pool, instance, expiresAt: Date.now() - 1 }));
    const before = coldStarts.length;
    expect((await post(turn('a'), { 'x-session-id': sid })).status).toBe(200);
    expect(coldStarts.length).toBe(before + 1); // expired → cold start (which writes a fresh entry)
    await until('the renewal mirrored', () => (gw.sessionCache!.cache.get(key)?.expiresAt ?? 0) > Date.now(), 5_000);
    expect((await post(turn('b'), { 'x-session-id': sid })).status).toBe(200);
    expect(coldStarts.length).toBe(before + 1);
    await sessionsKv.delete(key);
    await until('the session deletion mirrored', () => gw.sessionCache!.cache.get(key) === undefined, 5_000);
    expect((await post(turn('c'), { 'x-session-id': sid })).status).toBe(200);
    expect(coldStarts.length).toBe(before + 2);
  });

  it('sends keep-alive comments while a streamed request waits for a slow cold start', async () => {
    coldStartDelayMs = 450;
    const res = await post(turn('hello', true, 'slow-cold-start'));
    expect(res.status).toBe(200);
    const text = await res.text();
    const keepAlives = text.split('\n\n').filter((e) => e.startsWith(': keep-alive: waiting for an instance of ')).length;
    expect(keepAlives).toBeGreaterThanOrEqual(3);
    expect(text.indexOf(': keep-alive')).toBeLessThan(text.indexOf('data: '));
    expect(sseEvents(text)[2]).toBe('[DONE]');
  });
});

describe('tokens from the magus_tokens KV', () => {
  it('a token added later works, a deleted one stops working, a wrong one never did', async () => {
    const bob = makeToken('bob');
    expect((await post(turn('x'), {}, bob.token)).status).toBe(401);
    await tokensKv.put('bob', enc(bob.entry));
    let status = 0;
    for (let i = 0; i < 50 && status !== 200; i++) {
      status = (await post(turn('x', false, 'bob'), {}, bob.token)).status;
      if (status !== 200) await sleep(20);
    }
    expect(status).toBe(200);
    expect((await post(turn('x'), {}, `${bob.token}x`)).status).toBe(401);
    await tokensKv.delete('bob');
    for (let i = 0; i < 50 && status !== 401; i++) {
      status = (await post(turn('x', false, 'bob'), {}, bob.token)).status;
      if (status !== 401) await sleep(20);
    }
    expect(status).toBe(401);
    expect(log.lines.join('\n')).not.toContain(bob.token);
  });
});

// Issue "new user" item 7: `/v1/models` served a copy up to 5 s old while `/v1/models/:model`
// re-read the registry on a miss, so right after a publish the item answered 200 and the list
// did not name it (3.4 s after `magus dev`'s ready banner).
describe('the model list and the model item agree', () => {
  it('right after a model is published, and right after it is removed', async () => {
    const registry = await openModelRegistry(nc, buckets.models);
    const headers = { authorization: `Bearer ${alice.token}` };
    const both = async (id: string) => {
      const [list, item] = await Promise.all([fetch(`${gw.url}/v1/models`, { headers }), fetch(`${gw.url}/v1/models/${id}`, { headers })]);
      const listed = ((await list.json()) as { data: { id: string }[] }).data.find((m) => m.id === id);
      return { listed, status: item.status, item: await item.json() };
    };
    for (let i = 0; i < 4; i++) {
      const id = `fresh-${i}`;
      await registry.put(readyModel(id));
      const published = await both(id);
      expect(published.status).toBe(200);
      expect(published.listed).toEqual(published.item);
      await registry.remove('default', id);
      const removed = await both(id);
      expect(removed).toMatchObject({ status: 404, listed: undefined });
    }
  });
});

describe('models, health and metrics', () => {
  it('lists the registry’s models; readyz is ready; metrics count warm hits and cold starts', async () => {
    const models = await fetch(`${gw.url}/v1/models`, { headers: { authorization: `Bearer ${alice.token}` } });
    expect(await models.json()).toEqual({
      object: 'list',
      data: [
        {
          id: 'tiny',
          object: 'model',
          created: expect.any(Number) as number,
          owned_by: 'magus',
          servable: true,
          engines: [],
          capabilities: ['json_schema', 'tools', 'logprobs', 'embeddings', 'completions'],
          sampling: {},
          // Its pool's view lists no instance of it (the test pins conversations itself).
          serving: { status: 'idle', instances: 0, starting: 0 },
        },
      ],
    });
    const ready = await fetch(`${gw.url}/readyz`);
    expect(ready.status).toBe(200);
    expect(await ready.json()).toEqual({ status: 'ok', checks: { registry: true, nats: true, tokens: true, pools: true } });
    const metrics = await (await fetch(`${gw.url}/metrics`)).text();
    const { warmHits, coldStarts: cold } = gw.sessionCache!.stats();
    expect(warmHits).toBeGreaterThan(0);
    expect(metrics).toContain(`magus_gateway_session_warm_hits_total ${warmHits}`);
    expect(metrics).toContain(`magus_gateway_session_cold_starts_total ${cold}`);
    expect(metrics).toMatch(/magus_gateway_upstream_errors_total\{reason="timeout"\} 1/);
  });
});

describe('a gateway with an operations listener (MAGUS_GATEWAY_HEALTH_ADDRESS) and an authenticated OpenAPI description', () => {
  let ops: RunningGateway;
  beforeAll(async () => {
    const config = loadGatewayConfig(gatewayEnv({ MAGUS_GATEWAY_OPENAPI: 'authenticated' }), { host: '127.0.0.1', port: '0', healthAddress: '127.0.0.1:0' });
    ops = await startGateway(config, { coldStart, logStream: log });
  }, 60_000);
  afterAll(() => ops?.close());

  const get = (url: string, token?: string) => fetch(url, token === undefined ? {} : { headers: { authorization: `Bearer ${token}` } });
  const code = async (res: Response) => ((await res.json()) as { error: { code: string } }).error.code;

  it('serves /healthz, /readyz and /metrics on its own port, with the API port’s checks and counts; /metrics is gone from the API port', async () => {
    expect(ops.healthUrl).toMatch(/^http:\/\/127\.0\.0\.1:\d+$/);
    expect(ops.healthUrl).not.toBe(ops.url);
    // A request on the API port, counted where the scraper looks.
    const models = await get(`${ops.url}/v1/models`, alice.token);
    expect(models.status).toBe(200);
    const scrape = await get(`${ops.healthUrl}/metrics`);
    expect(scrape.status).toBe(200);
    expect(scrape.headers.get('content-type')).toBe('text/plain; version=0.0.4; charset=utf-8');
    const text = await scrape.text();
    expect(text).toContain('magus_gateway_requests_total{route="/v1/models",status="200"} 1');
    expect(text).toMatch(/^process_resident_memory_bytes \d+/m);
    // Probes and scrapes on the operations port are not API requests.
    expect(text).not.toContain('route="/metrics"');
    expect(text).not.toContain('route="/healthz"');

    const onApi = await get(`${ops.url}/metrics`);
    expect(onApi.status).toBe(404);
    expect(await code(onApi)).toBe('unknown_url');
    expect((await get(`${ops.url}/metrics`, alice.token)).status).toBe(404);

    // Health stays on both ports (load balancers check the port they send to), with the same checks.
    const checks = { status: 'ok', checks: { registry: true, nats: true, tokens: true, pools: true } };
    for (const base of [ops.url, ops.healthUrl!]) {
      expect({ base, status: (await get(`${base}/healthz`)).status }).toEqual({ base, status: 200 });
      const ready = await get(`${base}/readyz`);
      expect({ base, status: ready.status, body: await ready.json() }).toEqual({ base, status: 200, body: checks });
    }
  });

  it('the operations port serves nothing of the API: no routes, no OpenAPI description, unknown paths in the API’s error shape', async () => {
    for (const path of ['/v1/models', '/v1/chat/completions', '/openapi.json', '/']) {
      const res = await get(`${ops.healthUrl}${path}`, alice.token);
      expect({ path, status: res.status, code: await code(res) }).toEqual({ path, status: 404, code: 'unknown_url' });
    }
    const post = await fetch(`${ops.healthUrl}/metrics`, { method: 'POST' });
    expect([post.status, post.headers.get('allow')]).toEqual([405, 'GET, HEAD']);
  });

  it('/openapi.json on the API port needs a valid key: 200 with one, 401 invalid_api_key without or with a wrong one', async () => {
    const ok = await get(`${ops.url}/openapi.json`, alice.token);
    expect(ok.status).toBe(200);
    const doc = (await ok.json()) as { paths: Record<string, unknown> };
    expect(Object.keys(doc.paths)).toContain('/v1/chat/completions');
    expect(Object.keys(doc.paths)).not.toContain('/metrics');
    for (const token of [undefined, `${alice.token.slice(0, -4)}0000`, 'garbage']) {
      const res = await get(`${ops.url}/openapi.json`, token);
      expect({ token, status: res.status, code: await code(res) }).toEqual({ token, status: 401, code: 'invalid_api_key' });
    }
  });

  it('closes both listeners', async () => {
    const healthUrl = ops.healthUrl!;
    await ops.close();
    await expect(fetch(`${healthUrl}/healthz`)).rejects.toThrow();
    await expect(fetch(`${ops.url}/healthz`)).rejects.toThrow();
  });
});

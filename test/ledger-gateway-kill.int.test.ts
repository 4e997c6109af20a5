/**
 * The usage ledger when a gateway process is killed (SIGKILL) mid-answer: its clients lose their
 * connections, but nobody cancels their requests, so the bridge generates every answer to its end
 * (its frames go to the response stream, which stores them whether a gateway listens or not) and
 * writes exactly one `completed` record per request, with the engine's full usage — not the
 * pieces the client saw. Requests refused before they reached a bridge (an unknown token: 401; a
 * model that does not exist: 404) leave no record. A gateway process started after the kill
 * serves the next turn normally, and the ledger gets exactly one more record, with the tokens its
 * client was told. Past the consumer's ack wait nothing is redelivered or recorded again.
 * Then what a client gets back after its gateway dies: a chat stream resumed with `Last-Event-ID`,
 * and a background response polled and streamed on from its last event on another replica.
 *
 * Deterministic: the gateways run as `magus gateway` processes (the TS sources under the swc
 * loader, `setpriv --pdeathsig KILL`) with Temporal unreachable — their turns are warm: each
 * conversation is pinned to the bridge's instance by a `magus_sessions` entry the test writes, as
 * the session workflow would. The bridge runs in this process (1 s ack wait) in front of a stub
 * engine that holds each of the first answers after a few pieces until the test lets them go,
 * which it does only once the clients hold those pieces and the gateway is dead.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import OpenAI from 'openai';
import { consumerNameOf, ensureInstanceConsumer, type DataPlaneNames } from '../dataplane';
import { startBridge, type Bridge } from '../dataplane/bridge';
import { openModelRegistry } from '../dataplane/registry';
import { MeterVerifier } from '../dataplane/meter';
import { UsageLedger } from '../dataplane/usage';
import { tokenDigest } from '../gateway/plugins/auth';
import { conversationKey } from '../gateway/serving/conversation';
import type { UsageRecord } from '../shared/usage';
import { freePort } from '../workers/dev/services';
import { splitText, type StubEngine } from './fixtures/stub-engine';
import { endpoint, isolation, natsConnectAsBridge, natsCredentialsEnv, natsRoleCredentials } from './harness';
import { pinConversation, publishPoolView } from './harness/gateway';
import { readyModel } from './harness/gateway-app';
import { natsStack, stubEngineStack, TestStack } from './harness/stack';
import { sseMessages, sseRecords, type RawEvent } from './harness/sse-stream';
import { sleep, until } from './harness/wait';

const iso = isolation();
const MODEL = `gwkill-${iso.id}`;
const INSTANCE = 'i1';
/** Streams in flight when the gateway dies. */
const STREAMS = 4;
/** Pieces of each answer (one completion token each), and those the clients hold when the gateway dies. */
const CHUNKS = 40;
const HELD_AFTER = 3;
const ACK_WAIT_MS = 1000;
const TOKEN_ID = 'gwkill';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(16).toString('hex')}`;
const KEY = `config/${TOKEN_ID}`;
const SECRET = randomBytes(32).toString('hex');
const ROOT = join(__dirname, '..');

let nc: NatsConnection;
let names: DataPlaneNames;
let engine: StubEngine;
let bridge: Bridge;
/** Where the gateway processes look for Temporal: a port nobody listens on. */
let temporalAddress: string;
const bridgeLog: string[] = [];
const processes = new Set<GatewayProcess>();
const stack = new TestStack();

/** While set, each chat answer the stub starts is held after {@link HELD_AFTER} pieces until `released`. */
let hold: { released: Promise<void>; reached: number } | undefined;

interface GatewayProcess {
  child: ChildProcess;
  url: string;
  output: string[];
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
}

/** `magus gateway` on this file's data plane, from the TS sources; resolves once it listens. */
async function startGatewayProcess(env: Record<string, string> = {}): Promise<GatewayProcess> {
  const code = `require(${JSON.stringify(join(ROOT, 'workers', 'magus'))}).main(['gateway']).then((c) => process.exit(c))`;
  // pdeathsig: the gateway dies with this test process, whatever happens to it.
  const child = spawn('setpriv', ['--pdeathsig', 'KILL', '--', process.execPath, '-r', require.resolve('@swc-node/register'), '-e', code], {
    cwd: ROOT,
    env: {
      ...process.env,
      MAGUS_NATS_URL: endpoint('nats').servers,
      ...natsCredentialsEnv(await natsRoleCredentials('gateway', names)),
      MAGUS_NATS_PREFIX: iso.natsPrefix,
      MAGUS_GATEWAY_HOST: '127.0.0.1',
      MAGUS_GATEWAY_PORT: '0',
      MAGUS_GATEWAY_SECRET: SECRET,
      MAGUS_GATEWAY_TOKENS: JSON.stringify({ [TOKEN_ID]: { digest: tokenDigest(TOKEN), name: 'the gateway kill test' } }),
      // Warm turns never need Temporal: the gateway starts and serves them with it unreachable.
      MAGUS_TEMPORAL_ADDRESS: temporalAddress,
      MAGUS_LOG_LEVEL: 'warn',
      ...env,
    },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  const output: string[] = [];
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) =>
    child.once('exit', (c, signal) => resolve({ code: c, signal })),
  );
  child.stdout.on('data', (d: Buffer) => output.push(d.toString()));
  const url = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`magus gateway did not listen within 60 s:\n${output.join('')}`)), 60_000);
    child.stderr.on('data', (d: Buffer) => {
      output.push(d.toString());
      const listening = /magus gateway: listening on (http:\/\/\S+) /.exec(output.join(''));
      if (listening) {
        clearTimeout(timer);
        resolve(listening[1]!);
      }
    });
    void exited.then(({ code: c, signal }) => {
      clearTimeout(timer);
      reject(new Error(`magus gateway exited (${c ?? signal}) before listening:\n${output.join('')}`));
    });
  });
  const p: GatewayProcess = { child, url, output, exited };
  processes.add(p);
  return p;
}

beforeAll(async () => {
  ({ nc, names } = await stack.open(natsStack(iso, { declare: true })));
  temporalAddress = `127.0.0.1:${await freePort()}`;
  ({ engine } = await stack.open(
    stubEngineStack({
      modelId: MODEL,
      chunks: CHUNKS,
      chunkDelayMs: 10,
      pause: () => {
        if (!hold) return undefined;
        const h = hold;
        return { afterChunks: HELD_AFTER, until: h.released, reached: () => (h.reached += 1) };
      },
    }),
  ));
  await (await openModelRegistry(nc, names.modelsBucket)).put(readyModel(MODEL));
  await ensureInstanceConsumer(await nc.jetstreamManager(), names, { pool: MODEL, instance: INSTANCE, slots: 2 * STREAMS, ackWaitMs: ACK_WAIT_MS });
  // The bridge on a connection of its own, as its instance's bridge user.
  const bridgeNc = await natsConnectAsBridge(names, MODEL, INSTANCE);
  stack.defer(() => bridgeNc.drain());
  bridge = await startBridge({
    nc: bridgeNc,
    names,
    pool: MODEL,
    instance: INSTANCE,
    engineUrl: engine.url,
    slots: 2 * STREAMS,
    log: (line) => bridgeLog.push(line),
  });
  stack.defer(() => bridge.stop());
  stack.defer(async () => {
    for (const p of processes) p.child.kill('SIGKILL');
    await Promise.all([...processes].map((p) => p.exited));
  });
}, 60_000);

afterAll(() => stack.close(), 60_000);

/** Conversation `session`, pinned to the bridge's instance: its turns are warm on every gateway. */
async function pinnedSession(name: string): Promise<string> {
  const session = `${name}-${randomBytes(4).toString('hex')}`;
  const key = conversationKey(SECRET, { scope: TOKEN_ID, model: `default/${MODEL}`, messages: [], sessionId: session });
  await pinConversation(nc, names, key, MODEL, INSTANCE);
  return session;
}

interface Streaming {
  session: string;
  content: string;
  requestId: string;
  deltas: string[];
  finishReasons: string[];
  usage: OpenAI.CompletionUsage | undefined;
  chunks: AsyncIterator<OpenAI.ChatCompletionChunk>;
}

/** A streamed chat turn of `session` through `gateway`, its usage asked for; resolves with the response's headers. */
async function streamTurn(gateway: GatewayProcess, session: string, what: string): Promise<Streaming> {
  const openai = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: TOKEN, maxRetries: 0 });
  // Longer than CHUNKS characters: the stub splits it into CHUNKS pieces.
  const content = `${what}: tell me what a gateway forgets when it dies ${randomBytes(8).toString('hex')}`;
  const { data, request_id } = await openai.chat.completions
    .create(
      { model: MODEL, messages: [{ role: 'user', content }], stream: true, stream_options: { include_usage: true } },
      { headers: { 'x-session-id': session } },
    )
    .withResponse();
  expect(request_id).toEqual(expect.any(String));
  return { session, content, requestId: request_id!, deltas: [], finishReasons: [], usage: undefined, chunks: data[Symbol.asyncIterator]() };
}

/** Reads `s` until it holds `pieces` pieces of text, or to its end (`pieces` undefined). */
async function read(s: Streaming, pieces?: number): Promise<void> {
  while (pieces === undefined || s.deltas.length < pieces) {
    const r = await s.chunks.next();
    if (r.done) {
      if (pieces !== undefined) throw new Error(`the stream ended after ${s.deltas.length} pieces`);
      return;
    }
    const c = r.value;
    if (c.usage) s.usage = c.usage;
    const choice = c.choices[0];
    if (choice?.delta.content) s.deltas.push(choice.delta.content);
    if (choice?.finish_reason) s.finishReasons.push(choice.finish_reason);
  }
}

/** The stub's usage of an answer to `content`: ⌈characters / 4⌉ prompt tokens, one token per piece. */
function engineUsage(content: string): UsageRecord['tokens'] {
  const prompt = Math.ceil(content.length / 4);
  return { prompt, cached: 0, completion: CHUNKS, total: prompt + CHUNKS };
}

/** The ledger's records (of `key`), every one signed by a gateway (dataplane/meter.ts): those a gateway recorded itself too. */
async function ledgerRecords(key?: string): Promise<UsageRecord[]> {
  const verifier = new MeterVerifier(await nc.jetstream().views.kv(names.limitsBucket, { bindOnly: true }));
  const { records, unsigned } = await (await UsageLedger.open(nc.jetstream(), names)).readSigned(key === undefined ? {} : { key }, verifier);
  expect(unsigned).toBe(0);
  return records;
}

/** What went on, for a failure's message. */
function diagnosis(): string {
  return [
    `bridge stats: ${JSON.stringify(bridge.stats)}`,
    `bridge log:\n${bridgeLog.join('\n')}`,
    ...[...processes].map((p) => `gateway ${p.url}:\n${p.output.join('')}`),
  ].join('\n');
}

test('a gateway SIGKILLed with 4 streams mid-answer: the bridge ends each, one completed record apiece with the full usage; none for refusals; a new gateway’s turn adds exactly one', async () => {
  const t0 = Date.now();
  const first = await startGatewayProcess();
  const sessions = await Promise.all(Array.from({ length: STREAMS }, (_, i) => pinnedSession(`s${i}`)));

  // Refused before any bridge: a token the gateway does not know, a model that does not exist.
  const post = (token: string, model: string) =>
    fetch(`${first.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json', 'x-session-id': sessions[0]! },
      body: JSON.stringify({ model, messages: [{ role: 'user', content: 'refused before it reaches a bridge' }], stream: true }),
    });
  const unknownToken = await post(`mgs_nobody_${randomBytes(16).toString('hex')}`, MODEL);
  expect(unknownToken.status).toBe(401);
  await unknownToken.body?.cancel();
  const unknownModel = await post(TOKEN, `no-such-model-${iso.id}`);
  expect(unknownModel.status).toBe(404);
  await unknownModel.body?.cancel();

  // 4 streams, each held by the engine after HELD_AFTER pieces; the clients read those pieces.
  let release!: () => void;
  const released = new Promise<void>((resolve) => (release = resolve));
  hold = { released, reached: 0 };
  const streams = await Promise.all(sessions.map((session, i) => streamTurn(first, session, `stream ${i}`)));
  await until('every answer held by the engine', () => hold!.reached === STREAMS);
  hold = undefined;
  await Promise.all(streams.map((s) => read(s, HELD_AFTER)));
  for (const s of streams) expect(s.deltas).toEqual(splitText(s.content, CHUNKS).slice(0, HELD_AFTER));
  expect(new Set(streams.map((s) => s.requestId)).size).toBe(STREAMS);
  expect(engine.requests).toHaveLength(STREAMS); // the refusals never reached it

  // SIGKILL: no cancel is sent, no stream is closed cleanly; each client's connection fails.
  const killedAt = Date.now();
  first.child.kill('SIGKILL');
  expect(await first.exited).toEqual({ code: null, signal: 'SIGKILL' });
  processes.delete(first);
  for (const s of streams) await expect(read(s)).rejects.toThrow();
  for (const s of streams) {
    expect(s.deltas).toHaveLength(HELD_AFTER);
    expect(s.finishReasons).toEqual([]);
    expect(s.usage).toBeUndefined();
  }
  expect(bridge.stats).toMatchObject({ acked: 0, usageRecorded: 0, cancelled: 0 });

  // The engine goes on: the bridge ends every answer, acks it and records it — once, in full.
  release();
  try {
    await until('every answer acked and recorded', () => bridge.stats.acked === STREAMS && bridge.stats.usageRecorded === STREAMS);
  } catch (err) {
    throw new Error(`${(err as Error).message}\n${diagnosis()}`);
  }
  const records = await ledgerRecords(KEY);
  expect(records.map((r) => r.id).sort()).toEqual(streams.map((s) => s.requestId).sort());
  for (const s of streams) {
    const r = records.find((x) => x.id === s.requestId)!;
    expect(r).toMatchObject({
      key: KEY,
      model: `default/${MODEL}`,
      kind: 'chat',
      outcome: 'completed',
      reported: true,
      tokens: engineUsage(s.content),
    });
    expect(r.error).toBeUndefined();
    expect(r.start).toBeGreaterThanOrEqual(t0);
    expect(r.start).toBeLessThan(killedAt);
    // Ended after the gateway had died: by the bridge, on its own.
    expect(r.end).toBeGreaterThan(killedAt);
  }

  // A new gateway process: the first conversation's next turn is served normally, and recorded once.
  const second = await startGatewayProcess();
  const again = await streamTurn(second, sessions[0]!, 'again');
  await read(again);
  expect(again.deltas).toEqual(splitText(again.content, CHUNKS));
  expect(again.finishReasons).toEqual(['stop']);
  expect(again.usage).toMatchObject({ completion_tokens: CHUNKS, total_tokens: engineUsage(again.content).total });
  await until('the new turn recorded', () => bridge.stats.usageRecorded === STREAMS + 1);
  const after = await ledgerRecords(KEY);
  expect(after).toHaveLength(STREAMS + 1);
  const fresh = after.filter((r) => !records.some((x) => x.id === r.id));
  expect(fresh).toHaveLength(1);
  expect(fresh[0]).toMatchObject({ id: again.requestId, key: KEY, kind: 'chat', outcome: 'completed', reported: true });
  expect(fresh[0]!.tokens.total).toBe(again.usage!.total_tokens);
  expect(fresh[0]!.tokens.completion).toBe(again.usage!.completion_tokens);
  expect(fresh[0]!.tokens.prompt).toBe(again.usage!.prompt_tokens);

  // Past the consumer's ack wait (three times over): nothing redelivered, answered or recorded again.
  // (Nothing is to happen, so there is no condition to wait for: a sleep.)
  await sleep(3 * ACK_WAIT_MS);
  const consumer = await (await nc.jetstreamManager()).consumers.info(names.requestStream, consumerNameOf(MODEL, INSTANCE));
  expect({ pending: consumer.num_pending, ackPending: consumer.num_ack_pending, redelivered: consumer.num_redelivered }).toEqual({
    pending: 0,
    ackPending: 0,
    redelivered: 0,
  });
  expect(bridge.stats).toMatchObject({
    pulled: STREAMS + 1,
    acked: STREAMS + 1,
    redelivered: 0,
    termed: 0,
    nakked: 0,
    cancelled: 0,
    errors: 0,
    usageRecorded: STREAMS + 1,
    usageUnrecorded: 0,
    inFlight: 0,
  });
  expect(engine.requests).toHaveLength(STREAMS + 1);
  // The whole ledger: these records and no other (no key of a refused request), each written once.
  const all = await ledgerRecords();
  expect(all).toHaveLength(STREAMS + 1);
  expect(new Set(all.map((r) => r.id)).size).toBe(STREAMS + 1);
  expect(new Set(all.map((r) => r.key))).toEqual(new Set([KEY]));
  const usageStream = await (await nc.jetstreamManager()).streams.info(`KV_${names.usageBucket}`);
  expect(usageStream.state.messages).toBe(STREAMS + 1);

  // The new gateway stops cleanly.
  second.child.kill('SIGTERM');
  expect(await second.exited).toEqual({ code: 0, signal: null });
  processes.delete(second);
}, 60_000);

/** POSTs a streamed chat turn of `content` in `session` to `gateway` (with `Last-Event-ID` when given); yields its events. */
async function* rawStream(gateway: GatewayProcess, session: string, content: string, lastEventId?: string, signal?: AbortSignal): AsyncGenerator<RawEvent> {
  const res = await fetch(`${gateway.url}/v1/chat/completions`, {
    method: 'POST',
    headers: {
      authorization: `Bearer ${TOKEN}`,
      'content-type': 'application/json',
      'x-session-id': session,
      ...(lastEventId ? { 'last-event-id': lastEventId } : {}),
    },
    body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content }], stream: true, stream_options: { include_usage: true } }),
    ...(signal ? { signal } : {}),
  });
  expect(res.status).toBe(200);
  yield* sseMessages(res);
}

const pieceOf = (e: RawEvent): string | undefined =>
  e.data === '[DONE]' ? undefined : (JSON.parse(e.data) as OpenAI.ChatCompletionChunk).choices[0]?.delta.content || undefined;

test('a stream resumed on another gateway with Last-Event-ID after its gateway was SIGKILLed: the rest, exactly once, then [DONE]; a forged or foreign id is a 400', async () => {
  const first = await startGatewayProcess();
  const second = await startGatewayProcess();
  const session = await pinnedSession('resumed');
  const content = `resume: tell me what a gateway forgets when it dies ${randomBytes(8).toString('hex')}`;
  const whole = splitText(content, CHUNKS);
  let release!: () => void;
  const released = new Promise<void>((resolve) => (release = resolve));
  hold = { released, reached: 0 };
  const events = rawStream(first, session, content);
  const had: RawEvent[] = [];
  while (had.filter(pieceOf).length < HELD_AFTER) had.push((await events.next()).value as RawEvent);
  hold = undefined;
  // Every chunk event carries an id: the last one the client has is where it resumes.
  expect(had.every((e) => e.id !== undefined)).toBe(true);
  expect(had.map(pieceOf).filter(Boolean)).toEqual(whole.slice(0, HELD_AFTER));
  const lastId = had.at(-1)!.id!;

  first.child.kill('SIGKILL');
  expect(await first.exited).toEqual({ code: null, signal: 'SIGKILL' });
  processes.delete(first);
  await expect(events.next()).rejects.toThrow();

  // A Last-Event-ID the gateways never issued, or issued to another scope, resumes nothing.
  const [prefix, mac, seq] = lastId.split('.') as [string, string, string];
  for (const forged of [`${prefix}.${'A'.repeat(mac.length)}.${seq}`, 'not-an-event-id', `${Buffer.from('gw-x/p/i/r').toString('base64url')}.${mac}.${seq}`]) {
    const res = await fetch(`${second.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', 'x-session-id': session, 'last-event-id': forged },
      body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content }], stream: true }),
    });
    expect({ status: res.status, body: await res.json() }).toMatchObject({
      status: 400,
      body: { error: { code: 'invalid_last_event_id', param: 'Last-Event-ID' } },
    });
  }

  // The same request with Last-Event-ID on the other replica: the rest of that answer, once.
  const rest: RawEvent[] = [];
  const resumed = (async () => {
    for await (const e of rawStream(second, session, content, lastId)) rest.push(e);
  })();
  release();
  await resumed;
  expect(rest.at(-1)!.data).toBe('[DONE]');
  expect([...had, ...rest].map(pieceOf).filter(Boolean)).toEqual(whole);
  const chunks = rest.slice(0, -1).map((e) => JSON.parse(e.data) as OpenAI.ChatCompletionChunk);
  expect(chunks.flatMap((c) => c.choices.map((x) => x.finish_reason)).filter(Boolean)).toEqual(['stop']);
  expect(chunks.at(-1)!.usage).toMatchObject({ completion_tokens: CHUNKS });
  // The ids go on from where the client was, one per chunk.
  const seqs = [...had, ...rest.slice(0, -1)].map((e) => Number(e.id!.split('.')[2]));
  expect(seqs).toEqual(seqs.map((_, i) => i));
  // Generated once: one request reached the engine, one record.
  const answered = engine.requests.filter((r) => JSON.stringify(r).includes(content));
  expect(answered).toHaveLength(1);

  // Resumed again once it is over: the same rest, from the stream's store.
  const again: RawEvent[] = [];
  for await (const e of rawStream(second, session, content, lastId)) again.push(e);
  expect(again.map((e) => e.data)).toEqual(rest.map((e) => e.data));

  second.child.kill('SIGTERM');
  expect(await second.exited).toEqual({ code: 0, signal: null });
  processes.delete(second);
}, 60_000);

/** The answer to `content` as a client that had `had` and then `rest` got it: whole, each piece once, to [DONE], and generated once. */
function expectWholeOnce(content: string, had: RawEvent[], rest: RawEvent[]): void {
  expect(rest.at(-1)!.data).toBe('[DONE]');
  expect([...had, ...rest].map(pieceOf).filter(Boolean)).toEqual(splitText(content, CHUNKS));
  expect(engine.requests.filter((r) => JSON.stringify(r).includes(content))).toHaveLength(1);
}

test('a client that drops its stream and comes back on another replica within the hold gets the rest, once, generated once; one that does not come back is cancelled when the hold ends', async () => {
  const HOLD_MS = 1500;
  const first = await startGatewayProcess({ MAGUS_GATEWAY_RESUME_HOLD_MS: String(HOLD_MS) });
  const second = await startGatewayProcess();
  const cancelledBefore = bridge.stats.cancelled;

  /** A stream on `first` whose answer is held after HELD_AFTER pieces and whose client drops its connection there. */
  const dropped = async (name: string) => {
    const session = await pinnedSession(name);
    const content = `${name}: tell me what a gateway forgets when it dies ${randomBytes(8).toString('hex')}`;
    let release!: () => void;
    hold = { released: new Promise<void>((resolve) => (release = resolve)), reached: 0 };
    const client = new AbortController();
    const events = rawStream(first, session, content, undefined, client.signal);
    const had: RawEvent[] = [];
    while (had.filter(pieceOf).length < HELD_AFTER) had.push((await events.next()).value as RawEvent);
    hold = undefined;
    client.abort();
    await expect(events.next()).rejects.toThrow();
    return { session, content, had, release, droppedAt: Date.now() };
  };

  // Dropped (a proxy's timeout, a network blip), then the same request with Last-Event-ID on the other replica.
  const back = await dropped('came-back');
  await sleep(300);
  const rest: RawEvent[] = [];
  const resumed = (async () => {
    for await (const e of rawStream(second, back.session, back.content, back.had.at(-1)!.id)) rest.push(e);
  })();
  await sleep(300);
  back.release();
  await resumed;
  expectWholeOnce(back.content, back.had, rest);
  expect(bridge.stats.cancelled).toBe(cancelledBefore);

  // Dropped and never come back for: the engine goes on for the hold, then the answer is cancelled.
  const gone = await dropped('never-came-back');
  await until('the abandoned answer cancelled', () => bridge.stats.cancelled > cancelledBefore, HOLD_MS + 10_000);
  expect(Date.now() - gone.droppedAt).toBeGreaterThanOrEqual(HOLD_MS - 100);
  gone.release();

  for (const p of [first, second]) {
    p.child.kill('SIGTERM');
    expect(await p.exited).toEqual({ code: 0, signal: null });
    processes.delete(p);
  }
}, 60_000);

test('a resumed stream whose client leaves again is cancelled when the hold ends there, unless its client comes back once more', async () => {
  const HOLD_MS = 1500;
  const env = { MAGUS_GATEWAY_RESUME_HOLD_MS: String(HOLD_MS) };
  const [first, second] = [await startGatewayProcess(env), await startGatewayProcess(env)];
  const cancelledBefore = bridge.stats.cancelled;

  /** The stream of `content` on `gateway` (resumed after `lastEventId`), its client gone after `pieces` pieces of text (its events so far). */
  const leaveAfter = async (gateway: GatewayProcess, session: string, content: string, pieces: number, lastEventId?: string) => {
    const client = new AbortController();
    const events = rawStream(gateway, session, content, lastEventId, client.signal);
    const had: RawEvent[] = [];
    const reading = (async () => {
      for (;;) had.push((await events.next()).value as RawEvent);
    })();
    reading.catch(() => undefined);
    // With no piece to wait for (the answer held), long enough for the resume to be under way.
    if (pieces === 0) await sleep(500);
    else await until(`${pieces} pieces`, () => had.filter(pieceOf).length >= pieces, 10_000);
    client.abort();
    await expect(reading).rejects.toThrow();
    return had;
  };
  /** A stream on `first` whose answer is held after HELD_AFTER pieces, its client gone there, then back on `second` and gone again. */
  const twice = async (name: string) => {
    const session = await pinnedSession(name);
    const content = `${name}: tell me what a gateway forgets when it dies ${randomBytes(8).toString('hex')}`;
    let release!: () => void;
    hold = { released: new Promise<void>((resolve) => (release = resolve)), reached: 0 };
    const had = await leaveAfter(first, session, content, HELD_AFTER);
    hold = undefined;
    const lastId = had.filter(pieceOf).at(-1)!.id;
    // Back on the other replica: nothing new yet (the answer is held), then gone again.
    await leaveAfter(second, session, content, 0, lastId);
    return { session, content, had, lastId, release, leftAt: Date.now() };
  };

  // Gone twice and back a third time, on the first replica: neither replica cancels, and the rest comes once.
  const thrice = await twice('came-back-twice');
  await sleep(300);
  const rest: RawEvent[] = [];
  const resumed = (async () => {
    for await (const e of rawStream(first, thrice.session, thrice.content, thrice.lastId)) rest.push(e);
  })();
  await sleep(HOLD_MS + 500); // both holds have passed
  expect(bridge.stats.cancelled).toBe(cancelledBefore);
  thrice.release();
  await resumed;
  expectWholeOnce(thrice.content, thrice.had, rest);
  expect(bridge.stats.cancelled).toBe(cancelledBefore);

  // Gone twice, never back: the replica it was resumed on cancels it when its hold ends (the first
  // replica's hold saw the resume, and leaves it).
  const gone = await twice('gone-twice');
  await until('the answer abandoned twice cancelled', () => bridge.stats.cancelled > cancelledBefore, HOLD_MS + 10_000);
  expect(Date.now() - gone.leftAt).toBeGreaterThanOrEqual(HOLD_MS - 100);
  gone.release();
  await sleep(500);
  expect(bridge.stats.cancelled).toBe(cancelledBefore + 1);

  for (const p of [first, second]) {
    p.child.kill('SIGTERM');
    expect(await p.exited).toEqual({ code: 0, signal: null });
    processes.delete(p);
  }
}, 60_000);

/**
 * The id a stream's keep-alive says while the answer waits for its first chunk (a message with no
 * data), and the messages before it. The body is left open (a client that closed it would have
 * its request cancelled when the resume hold ends: this one is cut off by its gateway's death).
 */
async function keepAliveId(res: Response): Promise<{ id: string; before: string[] }> {
  const records = sseRecords(res);
  const before: string[] = [];
  for (;;) {
    const next = await records.next();
    if (next.done) throw new Error(`the stream ended before a keep-alive said its id: ${before.join(' | ')}`);
    const { id, data, raw } = next.value;
    if (id !== undefined && data === undefined) return { id, before };
    before.push(raw);
  }
}

test('a stream cut off while it waits in its queue comes back with the id its keep-alive said: the whole answer from its role chunk, generated once', async () => {
  const first = await startGatewayProcess();
  const second = await startGatewayProcess();
  // Every slot of the bridge busy with an answer held mid-way: the next request waits in its queue.
  let release!: () => void;
  const released = new Promise<void>((resolve) => (release = resolve));
  hold = { released, reached: 0 };
  const filling = Promise.all(
    Array.from({ length: 2 * STREAMS }, async (_, i) => {
      const session = await pinnedSession(`filler-${i}`);
      const events = rawStream(second, session, `filler ${i}: a story that takes its time ${randomBytes(8).toString('hex')}`);
      for (let pieces = 0; pieces < HELD_AFTER;) if (pieceOf((await events.next()).value as RawEvent)) pieces++;
      return events;
    }),
  );
  const fillers = await Promise.race([
    filling,
    sleep(30_000).then(() => {
      throw new Error(`not every slot's answer reached its hold (${hold?.reached} did): ${diagnosis()}`);
    }),
  ]);
  hold = undefined;
  const session = await pinnedSession('queued');
  const content = `queued: tell me what a gateway forgets when it dies ${randomBytes(8).toString('hex')}`;
  const whole = splitText(content, CHUNKS);
  const res = await fetch(`${first.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', 'x-session-id': session },
    body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content }], stream: true, stream_options: { include_usage: true } }),
    // Keep-alives come every 2 s: one with the id well within this.
    signal: AbortSignal.timeout(20_000),
  });
  expect(res.status).toBe(200);
  // Nothing but keep-alives came (it waits); the first that came after its publish says its id, without a seq.
  const { id, before } = await keepAliveId(res);
  expect(before.every((m) => m.startsWith(': keep-alive'))).toBe(true);
  expect(id).toMatch(/^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]{16}\.$/);
  expect(engine.requests.filter((r) => JSON.stringify(r).includes(content))).toHaveLength(0);

  first.child.kill('SIGKILL');
  expect(await first.exited).toEqual({ code: null, signal: 'SIGKILL' });
  processes.delete(first);

  // Resumed on the other replica with that id: the answer whole, from its role chunk, once it is served.
  const rest: RawEvent[] = [];
  const resumed = (async () => {
    for await (const e of rawStream(second, session, content, id)) rest.push(e);
  })();
  release();
  const within = <T>(what: string, p: Promise<T>) =>
    Promise.race([
      p,
      sleep(20_000).then(() => {
        throw new Error(
          `${what} did not end within 20 s (resumed: ${rest.map((e) => e.data.slice(0, 60)).join(' | ')}; engine requests ${engine.requests.length}): ${diagnosis()}`,
        );
      }),
    ]);
  await within('the resumed stream', resumed);
  await within(
    'the other answers',
    (async () => {
      for (const f of fillers) for await (const _ of f);
    })(),
  );
  expect(rest.at(-1)!.data).toBe('[DONE]');
  const chunks = rest.slice(0, -1).map((e) => JSON.parse(e.data) as OpenAI.ChatCompletionChunk);
  expect(chunks[0]!.choices[0]!.delta.role).toBe('assistant');
  expect(rest.map(pieceOf).filter(Boolean)).toEqual(whole);
  expect(chunks.at(-1)!.usage).toMatchObject({ completion_tokens: CHUNKS });
  const seqs = rest.slice(0, -1).map((e) => Number(e.id!.split('.')[2]));
  expect(seqs).toEqual(seqs.map((_, i) => i));
  // Generated once: the request its dead gateway published, not one sent again.
  expect(engine.requests.filter((r) => JSON.stringify(r).includes(content))).toHaveLength(1);

  second.child.kill('SIGTERM');
  expect(await second.exited).toEqual({ code: 0, signal: null });
  processes.delete(second);
}, 90_000);

/** The Responses API's events of a stream (`event:` and `data:` lines), as they come. */
async function* responseEvents(res: Response): AsyncGenerator<OpenAI.Responses.ResponseStreamEvent> {
  for await (const e of sseMessages(res)) yield JSON.parse(e.data) as OpenAI.Responses.ResponseStreamEvent;
}

const deltaOf = (e: OpenAI.Responses.ResponseStreamEvent): string | undefined => (e.type === 'response.output_text.delta' ? e.delta : undefined);

test('a background response whose gateway was SIGKILLed mid-answer: polled and streamed on from event N on another replica with the official client, finished and stored there', async () => {
  const first = await startGatewayProcess();
  const second = await startGatewayProcess();
  // A response's conversation is new (its id is its session): placed by the gateway on the instance the pool view offers.
  // (Room beyond the conversations this file's other tests pinned there.)
  await publishPoolView(nc, names, MODEL, [INSTANCE], 64);
  const content = `background: tell me what a gateway forgets when it dies ${randomBytes(8).toString('hex')}`;
  const whole = splitText(content, CHUNKS);
  let release!: () => void;
  hold = { released: new Promise<void>((resolve) => (release = resolve)), reached: 0 };
  const res = await fetch(`${first.url}/v1/responses`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
    body: JSON.stringify({ model: MODEL, input: content, background: true, stream: true }),
  });
  expect(res.status).toBe(200);
  const events = responseEvents(res);
  const had: OpenAI.Responses.ResponseStreamEvent[] = [];
  while (had.filter(deltaOf).length < HELD_AFTER) {
    const next = await events.next();
    if (next.done) throw new Error(`the stream ended after ${JSON.stringify(had).slice(0, 2000)}`);
    had.push(next.value);
  }
  hold = undefined;
  expect(had[0]).toMatchObject({ type: 'response.created', sequence_number: 0, response: { status: 'queued', background: true } });
  const id = (had[0] as OpenAI.Responses.ResponseCreatedEvent).response.id;
  const last = had.at(-1)!.sequence_number;

  first.child.kill('SIGKILL');
  expect(await first.exited).toEqual({ code: null, signal: 'SIGKILL' });
  processes.delete(first);

  const client = new OpenAI({ baseURL: `${second.url}/v1`, apiKey: TOKEN, maxRetries: 0 });
  // Polled on the other replica: in progress, with the text the frames hold so far.
  const polled = await client.responses.retrieve(id);
  expect(polled.status).toBe('in_progress');
  expect(polled.output_text).toBe(whole.slice(0, HELD_AFTER).join(''));
  // Streamed on from the last event the client had.
  const stream = await client.responses.retrieve(id, { stream: true, starting_after: last });
  const rest: OpenAI.Responses.ResponseStreamEvent[] = [];
  const reading = (async () => {
    for await (const e of stream) rest.push(e);
  })();
  release();
  await reading;
  expect([...had, ...rest].map((e) => e.sequence_number)).toEqual([...had, ...rest].map((_, i) => i));
  expect([...had, ...rest].map(deltaOf).filter(Boolean)).toEqual(whole);
  const completed = rest.at(-1) as OpenAI.Responses.ResponseCompletedEvent;
  expect(completed).toMatchObject({ type: 'response.completed', response: { id, status: 'completed', usage: { output_tokens: CHUNKS } } });
  // Finished and stored by the replica that followed it: a poll reads it whole; generated once.
  const stored = await client.responses.retrieve(id);
  expect({ status: stored.status, text: stored.output_text }).toEqual({ status: 'completed', text: whole.join('') });
  expect(engine.requests.filter((r) => JSON.stringify(r).includes(content))).toHaveLength(1);

  second.child.kill('SIGTERM');
  expect(await second.exited).toEqual({ code: 0, signal: null });
  processes.delete(second);
}, 60_000);

/**
 * Answers larger than a NATS message may be (issue 39: the servers' `max_payload`, 1 MiB by
 * default, is smaller than what a long answer or its log-probabilities take), through the real
 * gateway, nats-server and a real bridge in front of a stub engine:
 * - a non-streamed chat completion of ~2.4 MB: the bridge publishes it in parts (each message
 *   within `max_payload`) and a `done` that counts them; the client gets every byte of it;
 * - a stored response (`/v1/responses`) whose record, with its log-probabilities, is several
 *   times `max_payload`: kept in parts, read back whole (`GET`), continued (`previous_response_id`)
 *   and deleted with its parts.
 */
import { randomBytes } from 'node:crypto';
import type { NatsConnection, Subscription } from 'nats';
import type { DataPlaneNames } from '../dataplane';
import { decodeFrame } from '../dataplane/frames';
import { openModelRegistry } from '../dataplane/registry';
import type { RunningGateway } from '../gateway/server';
import type { ResponseFrame } from '../shared/serving';
import { isolation } from './harness';
import { pinConversation } from './harness/gateway';
import { readyModel } from './harness/gateway-app';
import { gatewayStack, natsStack, stubInstanceStack, TestStack } from './harness/stack';
import type { StubEngine } from './fixtures/stub-engine';

const iso = isolation();
const POOL = 'large';
const TOKEN_ID = 'large';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(16).toString('hex')}`;
/** Not ASCII throughout: a part may cut a character in two. */
const WORDS = 'grüße ✓ 答え ';
/** `big <n>` is answered with WORDS n times; anything else is echoed. */
const replyTo = (text: string) => {
  const n = /^big (\d+)$/.exec(text)?.[1];
  return n ? WORDS.repeat(Number(n)) : text;
};

let nc: NatsConnection;
let names: DataPlaneNames;
let gateway: RunningGateway;
let engine: StubEngine;
const stack = new TestStack();
/** Every frame message the response stream captured, as published. */
const published: { bytes: number; frame: ResponseFrame | undefined }[] = [];
let frameSub: Subscription;

beforeAll(async () => {
  ({ nc, names } = await stack.open(natsStack(iso, { declare: true })));
  await (await openModelRegistry(nc, names.modelsBucket)).put(readyModel(POOL));
  ({ engine } = await stack.open(
    stubInstanceStack(nc, names, {
      pool: POOL,
      instance: 'i1',
      slots: 2,
      // 20,000 pieces: as many tokens, each with its log-probabilities when asked.
      engine: { chunks: 20_000, reply: (req) => replyTo(req.messages.at(-1)?.content ?? '') },
    }),
  ));
  // Every conversation starts on the one instance.
  ({ gateway } = await stack.open(
    gatewayStack(names, {
      secret: randomBytes(32).toString('hex'),
      tokens: { [TOKEN_ID]: TOKEN },
      env: { MAGUS_LOG_LEVEL: 'silent' },
      deps: { coldStart: (req) => pinConversation(nc, names, req.conversationKey, POOL, 'i1') },
    }),
  ));
  const jsm = await nc.jetstreamManager();
  const subjects = (await jsm.streams.info(names.responseStream)).config.subjects;
  frameSub = nc.subscribe(subjects[0]!, { callback: (_err, m) => published.push({ bytes: m.data.length, frame: decodeFrame(m.data) }) });
}, 60_000);

afterAll(async () => {
  frameSub?.unsubscribe();
  await stack.close();
}, 60_000);

async function post(path: string, body: unknown): Promise<{ status: number; body: Record<string, unknown> }> {
  const res = await fetch(`${gateway.url}${path}`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
  return { status: res.status, body: (await res.json()) as Record<string, unknown> };
}

test('a non-streamed answer larger than max_payload comes in parts, each within it, and reaches the client whole', async () => {
  const max = nc.info!.max_payload;
  const expected = replyTo('big 120000');
  expect(Buffer.byteLength(expected)).toBeGreaterThan(2 * max);
  published.length = 0;
  const res = await post('/v1/chat/completions', { model: POOL, messages: [{ role: 'user', content: 'big 120000' }] });
  expect(res.status).toBe(200);
  const choice = (res.body.choices as { message: { content: string }; finish_reason: string }[])[0]!;
  expect(choice.message.content.length).toBe(expected.length);
  expect(choice.message.content === expected).toBe(true);
  expect(choice.finish_reason).toBe('stop');
  expect((res.body.usage as { completion_tokens: number }).completion_tokens).toBe(20_000);
  // On the wire: parts, then a done that counts them and carries no data; every message within max_payload.
  await nc.flush();
  const frames = published.map((p) => p.frame!);
  // Distinct by seq: a frame the stream did not acknowledge in time is published again, with its seq (readers drop the second).
  const parts = [...new Map(frames.filter((f) => f.type === 'part').map((f) => [f.seq, f])).values()];
  expect(parts.length).toBeGreaterThanOrEqual(3);
  expect(frames.at(-1)).toMatchObject({ type: 'done', parts: parts.length });
  expect(frames.at(-1)).not.toHaveProperty('data');
  for (const p of published) expect(p.bytes).toBeLessThanOrEqual(max);
  process.stderr.write(
    `serving-large-answers: ${Buffer.byteLength(expected)} bytes of text in ${parts.length} parts of ≤ ${Math.max(...published.map((p) => p.bytes))} bytes (max_payload ${max})\n`,
  );
});

test('a stored response larger than max_payload (its log-probabilities) is kept in parts, read back whole, continued and deleted with them', async () => {
  const max = nc.info!.max_payload;
  const expected = replyTo('big 6000'); // ~90 KB of text: a history the next turn can still send
  const first = await post('/v1/responses', { model: POOL, input: 'big 6000', include: ['message.output_text.logprobs'], top_logprobs: 5 });
  expect([first.status, first.body.error]).toEqual([200, null]);
  const id = first.body.id as string;
  const text = (r: Record<string, unknown>) =>
    (r.output as { type: string; content?: { text: string }[] }[])
      .filter((o) => o.type === 'message')
      .flatMap((o) => o.content!.map((c) => c.text))
      .join('');
  expect(text(first.body) === expected).toBe(true);

  // As stored: a head naming its parts, each within max_payload, the record several times that.
  const kv = await nc.jetstream().views.kv(names.responsesBucket);
  const head = JSON.parse((await kv.get(id))!.string()) as { split?: { prefix: string; parts: number; bytes: number } };
  expect(head.split).toBeDefined();
  const { prefix, parts, bytes } = head.split!;
  expect(bytes).toBeGreaterThan(3 * max);
  expect(parts).toBe(Math.ceil(bytes / (max - 1024)));
  for (let k = 0; k < parts; k++) {
    const part = await kv.get(`${prefix}.${k}`);
    expect(part?.operation).toBe('PUT');
    expect(part!.value.length).toBeLessThanOrEqual(max);
  }

  // Read back whole, log-probabilities and all.
  const got = await fetch(`${gateway.url}/v1/responses/${id}`, { headers: { authorization: `Bearer ${TOKEN}` } });
  expect(got.status).toBe(200);
  const gotBody = (await got.json()) as Record<string, unknown>;
  // (Compared as text: a deep comparison of 20,000 log-probabilities takes jest seconds.)
  expect(JSON.stringify(gotBody) === JSON.stringify(first.body)).toBe(true);
  const logprobs = (gotBody.output as { type: string; content?: { logprobs?: unknown[] }[] }[]).find((o) => o.type === 'message')!.content![0]!.logprobs!;
  expect(logprobs).toHaveLength(20_000);

  // Continued: the chain is read from the parts, and the engine gets the first answer as history.
  const served = engine.requests.length;
  const second = await post('/v1/responses', { model: POOL, input: 'and then?', previous_response_id: id });
  expect(second.status).toBe(200);
  expect(text(second.body)).toBe('and then?');
  const history = (engine.requests[served]!.body as { messages: { role: string; content: string }[] }).messages;
  expect(history.map((m) => m.role)).toEqual(['user', 'assistant', 'user']);
  expect(history[1]!.content === expected).toBe(true);

  // Deleted: the head and every part.
  const del = await fetch(`${gateway.url}/v1/responses/${id}`, { method: 'DELETE', headers: { authorization: `Bearer ${TOKEN}` } });
  expect(del.status).toBe(200);
  expect((await kv.get(id))?.operation).not.toBe('PUT');
  for (let k = 0; k < parts; k++) expect((await kv.get(`${prefix}.${k}`))?.operation).not.toBe('PUT');
  expect((await fetch(`${gateway.url}/v1/responses/${id}`, { headers: { authorization: `Bearer ${TOKEN}` } })).status).toBe(404);
});

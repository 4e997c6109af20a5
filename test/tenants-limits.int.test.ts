/**
 * A key's limits held across gateway replicas (gateway/serving/limits.ts over `magus_limits`):
 * two real gateway processes' worth of gateways (two replicas, each its own NATS connection) →
 * nats-server → a real bridge → a stub engine. Keys are `magus_tokens` entries as the controller
 * and `magus keys` write them, each with its limits. Text completions go to the pool's published
 * instance: no Temporal.
 *
 * What must hold: a token budget is never exceeded — 64 concurrent streams on one key through
 * both replicas against 500 tokens: what the clients were told they used sums to at most 500,
 * every refusal is a 429 `insufficient_quota`, and the budget's `used` is exactly the clients'
 * sum —; a rate limit answers 429 `rate_limit_exceeded` with a Retry-After computed from its
 * window; every answer carries OpenAI's `x-ratelimit-*` headers, streamed or not; the official
 * client does not retry a refusal that waiting cannot cure; a request without `max_tokens` is
 * served up to what the key has left, then refused. The usage ledger holds one record per served
 * request, with the tokens its client was told, and none for a refused one. A model's limits of
 * its own hold beside the key's, and say so; a storage quota refuses a response that would not
 * fit, until one is deleted.
 */
import { randomBytes } from 'node:crypto';
import type { NatsConnection } from 'nats';
import OpenAI from 'openai';
import { registerKey, tokenDigest } from '../dataplane/keys';
import { LimitStore } from '../dataplane/limits';
import { MeterVerifier } from '../dataplane/meter';
import { UsageLedger } from '../dataplane/usage';
import { openModelRegistry } from '../dataplane/registry';
import type { DataPlaneNames } from '../dataplane';
import type { RunningGateway } from '../gateway/server';
import type { KeyLimits } from '../shared/limits';
import type { UsageRecord } from '../shared/usage';
import type { StubEngine } from './fixtures/stub-engine';
import { isolation } from './harness';
import { pinConversation, publishPoolView } from './harness/gateway';
import { readyModel } from './harness/gateway-app';
import { gatewayStack, natsStack, stubInstanceStack, TestStack } from './harness/stack';

const iso = isolation();
const MODEL = `limited-${iso.id}`;
const SECRET = randomBytes(32).toString('hex');

let nc: NatsConnection;
let names: DataPlaneNames;
let engine: StubEngine;
const gateways: RunningGateway[] = [];
const stack = new TestStack();

/** A key `tenant/<name>` with `limits`, registered as the controller registers an ApiKey's; its token. */
async function keyWith(name: string, limits: KeyLimits): Promise<string> {
  const id = `${name}-${randomBytes(4).toString('hex')}`;
  const token = `mgs_${id}_${randomBytes(16).toString('hex')}`;
  const kv = await nc.jetstream().views.kv(names.tokensBucket);
  const registered = await registerKey(kv, id, {
    digest: tokenDigest(token),
    name,
    key: `tenant/${name}`,
    uid: randomBytes(8).toString('hex'),
    origin: `apikey/tenant/${name}`,
    limits,
  });
  expect(registered).toMatchObject({ ok: true });
  // Both replicas see it (their watch of magus_tokens).
  for (const g of gateways) {
    for (let i = 0; ; i++) {
      const r = await fetch(`${g.url}/v1/models`, { headers: { authorization: `Bearer ${token}` } });
      await r.body?.cancel();
      if (r.status === 200) break;
      if (i > 200) throw new Error(`gateway ${g.url} never accepted the key`);
      await new Promise((res) => setTimeout(res, 25));
    }
  }
  return token;
}

const clientOf = (token: string, replica = 0, maxRetries = 0) => new OpenAI({ baseURL: `${gateways[replica]!.url}/v1`, apiKey: token, maxRetries });

beforeAll(async () => {
  const nats = await stack.open(natsStack(iso, { declare: true }));
  ({ nc, names } = nats);
  await (await openModelRegistry(nc, names.modelsBucket)).put(readyModel(MODEL));
  // Slow enough that 64 concurrent streams overlap (each piece 20 ms apart).
  ({ engine } = await stack.open(stubInstanceStack(nc, names, { pool: MODEL, instance: 'i1', slots: 64, engine: { chunks: 4, chunkDelayMs: 20 } })));
  await publishPoolView(nc, names, MODEL, ['i1']);
  for (let i = 0; i < 2; i++) {
    const { gateway } = await stack.open(
      gatewayStack(names, {
        secret: SECRET,
        tokens: {},
        env: { MAGUS_LOG_LEVEL: 'silent' },
        // Conversations (the Responses test's) are pinned to the one instance: no Temporal here.
        deps: { coldStart: (req) => pinConversation(nc, names, req.conversationKey, MODEL, 'i1') },
      }),
    );
    gateways.push(gateway);
  }
}, 60_000);

afterAll(() => stack.close(), 60_000);

test('64 concurrent streams through two replicas against a 500-token budget: never more than 500 used, every refusal insufficient_quota, the budget’s count the clients’ sum', async () => {
  const limits: KeyLimits = { budget: { tokens: 500, period: 'day' } };
  const token = await keyWith('budget', limits);
  const one = async (i: number): Promise<{ used: number } | { refused: string }> => {
    try {
      const stream = await clientOf(token, i % 2).completions.create({
        model: MODEL,
        prompt: `story ${i} begins`,
        max_tokens: 4,
        stream: true,
        stream_options: { include_usage: true },
      });
      let used = -1;
      for await (const c of stream) if (c.usage) used = c.usage.total_tokens;
      return { used };
    } catch (err) {
      expect(err).toBeInstanceOf(OpenAI.RateLimitError);
      return { refused: String((err as InstanceType<typeof OpenAI.APIError>).code) };
    }
  };
  const results = await Promise.all(Array.from({ length: 64 }, (_, i) => one(i)));
  const served = results.filter((r): r is { used: number } => 'used' in r);
  const refused = results.filter((r): r is { refused: string } => 'refused' in r);
  expect(served.length).toBeGreaterThan(0);
  expect(served.every((r) => r.used > 0)).toBe(true);
  expect(refused.length).toBeGreaterThan(0);
  expect(new Set(refused.map((r) => r.refused))).toEqual(new Set(['insufficient_quota']));
  const sum = served.reduce((n, r) => n + r.used, 0);
  expect(sum).toBeLessThanOrEqual(500);
  // The count the replicas share is exactly what the clients were told, once every settlement landed.
  const store = new LimitStore(await nc.jetstream().views.kv(names.limitsBucket, { bindOnly: true }));
  for (let i = 0; ; i++) {
    const s = (await store.read('tenant/budget'))?.state;
    if (s && Object.keys(s.reservations).length === 0) {
      expect(s.budget?.used).toBe(sum);
      break;
    }
    if (i > 200) throw new Error('reservations never settled');
    await new Promise((res) => setTimeout(res, 25));
  }
  // The ledger: one record per served request (none for a refused one, which reached no bridge),
  // its tokens what each client was told (records are written as each answer ends).
  const ledger = await UsageLedger.open(nc.jetstream(), names);
  let records: UsageRecord[] = [];
  for (let i = 0; records.length < served.length && i < 200; i++) {
    records = await ledger.read({ key: 'tenant/budget' });
    if (records.length < served.length) await new Promise((res) => setTimeout(res, 25));
  }
  expect(records).toHaveLength(served.length);
  expect(records.every((r) => r.outcome === 'completed' && r.reported && r.model === `default/${MODEL}` && r.kind === 'completions')).toBe(true);
  expect(records.map((r) => r.tokens.total).sort((a, b) => a - b)).toEqual(served.map((r) => r.used).sort((a, b) => a - b));
  expect(new Set(records.map((r) => r.id)).size).toBe(served.length);
  // Each signed by the gateway that sent its request (dataplane/meter.ts): what `magus usage` and the controller count.
  const verifier = new MeterVerifier(await nc.jetstream().views.kv(names.limitsBucket, { bindOnly: true }));
  for (const r of records) expect({ id: r.id, signed: await verifier.verify(r) }).toEqual({ id: r.id, signed: true });
  expect(await verifier.verify({ ...records[0]!, key: 'tenant/other' })).toBe(false);
  // Spent down to less than any request's worst case, the next is refused, saying why.
  for (;;) {
    const r = await one(99);
    if ('refused' in r) break;
  }
  // (the same request, its prompt longer by more than a stream's fields: its worst case is larger)
  const err = await clientOf(token)
    .completions.create({ model: MODEL, prompt: `story 99 begins ${'and goes on '.repeat(8)}`, max_tokens: 4 })
    .catch((e: unknown) => e);
  expect(err).toMatchObject({ status: 429, code: 'insufficient_quota', type: 'insufficient_quota' });
  expect((err as InstanceType<typeof OpenAI.APIError>).message).toMatch(/token budget per day/);
}, 120_000);

test('requests per minute: answers carry the x-ratelimit headers, streamed or not; the one too many is a 429 with a Retry-After from the window', async () => {
  const token = await keyWith('rpm', { requestsPerMinute: 3, tokensPerMinute: 10_000 });
  const post = (replica: number, stream: boolean) =>
    fetch(`${gateways[replica]!.url}/v1/completions`, {
      method: 'POST',
      headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
      body: JSON.stringify({ model: MODEL, prompt: 'hi', max_tokens: 2, stream }),
    });
  const first = await post(0, false);
  expect(first.status).toBe(200);
  await first.json();
  expect(first.headers.get('x-ratelimit-limit-requests')).toBe('3');
  expect(first.headers.get('x-ratelimit-remaining-requests')).toBe('2');
  expect(first.headers.get('x-ratelimit-reset-requests')).toMatch(/^\d+(\.\d+)?(ms|s)$/);
  expect(first.headers.get('x-ratelimit-limit-tokens')).toBe('10000');
  expect(Number(first.headers.get('x-ratelimit-remaining-tokens'))).toBeLessThan(10_000);
  expect(first.headers.get('x-ratelimit-reset-tokens')).toMatch(/s$/);
  // Streamed, through the other replica: the same count goes on.
  const second = await post(1, true);
  expect(second.status).toBe(200);
  expect(second.headers.get('content-type')).toMatch(/^text\/event-stream/);
  expect(second.headers.get('x-ratelimit-remaining-requests')).toBe('1');
  await second.text();
  expect((await post(0, false).then(async (r) => (await r.json(), r))).headers.get('x-ratelimit-remaining-requests')).toBe('0');
  const refused = await post(1, false);
  expect(refused.status).toBe(429);
  const body = (await refused.json()) as { error: { code: string; type: string; message: string } };
  expect(body.error).toMatchObject({ code: 'rate_limit_exceeded', type: 'rate_limit_exceeded' });
  expect(body.error.message).toMatch(/^Rate limit reached on requests per min \(RPM\): Limit 3, Used 3, Requested 1\. Please try again in /);
  // One request refills in 60 s / 3 = 20 s, less what passed since the first: a wait computed from the window, not a constant.
  const retryAfter = Number(refused.headers.get('retry-after'));
  expect(retryAfter).toBeGreaterThan(15);
  expect(retryAfter).toBeLessThanOrEqual(20);
  expect(Number(refused.headers.get('retry-after-ms'))).toBeLessThanOrEqual(20_000);
  expect(refused.headers.get('x-ratelimit-remaining-requests')).toBe('0');
  expect(refused.headers.get('x-should-retry')).toBeNull(); // soon enough for a client to wait
}, 60_000);

test('the official client does not retry what waiting cannot cure: a request beyond the budget is one call', async () => {
  const token = await keyWith('toolarge', { budget: { tokens: 20, period: 'month' } });
  let calls = 0;
  const counting = new OpenAI({
    baseURL: `${gateways[0]!.url}/v1`,
    apiKey: token,
    maxRetries: 3,
    fetch: (url, init) => (calls++, fetch(url, init)),
  });
  const before = engine.requests.length;
  const err = await counting.completions
    .create({ model: MODEL, prompt: 'a prompt longer than the whole budget of this key', max_tokens: 4 })
    .catch((e: unknown) => e);
  expect(err).toMatchObject({ status: 429, code: 'insufficient_quota' });
  expect((err as InstanceType<typeof OpenAI.APIError>).message).toMatch(/^429 Request too large for the token budget per month: Limit 20, Requested \d+/);
  expect(calls).toBe(1);
  expect(engine.requests.length).toBe(before); // nothing reached the engine
}, 30_000);

test('without max_tokens a request is served up to what the key has left, its output cut there; then refused', async () => {
  const token = await keyWith('open', { budget: { tokens: 120, period: 'day' } });
  const openai = clientOf(token);
  const before = engine.requests.length;
  const r = await openai.completions.create({ model: MODEL, prompt: 'hello there' });
  // The engine was told the output it may use: all the budget had beyond the prompt's bound.
  const sent = engine.requests[before]!.body as { max_tokens?: number };
  expect(sent.max_tokens).toBeGreaterThan(0);
  expect(sent.max_tokens).toBeLessThan(120);
  expect(r.usage!.total_tokens).toBeLessThanOrEqual(120);
  let spent = r.usage!.total_tokens;
  for (;;) {
    const next = await openai.completions.create({ model: MODEL, prompt: 'hello there' }).catch((e: unknown) => e);
    if (next instanceof OpenAI.APIError) {
      expect(next).toMatchObject({ status: 429, code: 'insufficient_quota' });
      break;
    }
    spent += (next as OpenAI.Completion).usage!.total_tokens;
  }
  expect(spent).toBeLessThanOrEqual(120);
}, 30_000);

test('limits of one model hold beside the key’s: its requests per minute refuse, naming the model, and the headers show the tighter', async () => {
  const model = `default/${MODEL}`;
  const token = await keyWith('per-model', { requestsPerMinute: 100, models: { [model]: { requestsPerMinute: 2 } } });
  const post = (replica: number) =>
    fetch(`${gateways[replica]!.url}/v1/completions`, {
      method: 'POST',
      headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
      body: JSON.stringify({ model: MODEL, prompt: 'hi', max_tokens: 2 }),
    });
  const first = await post(0);
  await first.json();
  expect(first.status).toBe(200);
  expect(first.headers.get('x-ratelimit-limit-requests')).toBe('2');
  expect(first.headers.get('x-ratelimit-remaining-requests')).toBe('1');
  const second = await post(1);
  await second.json();
  expect(second.headers.get('x-ratelimit-remaining-requests')).toBe('0');
  const refused = await post(0);
  expect(refused.status).toBe(429);
  const body = (await refused.json()) as { error: { code: string; message: string } };
  expect(body.error.code).toBe('rate_limit_exceeded');
  expect(body.error.message).toMatch(new RegExp(`^Rate limit reached for ${model} on requests per min \\(RPM\\): Limit 2, Used 2, Requested 1\\.`));
  // The key's own count went on beside the model's: 2 of its 100.
  const state = await new LimitStore(await nc.jetstream().views.kv(names.limitsBucket)).read('tenant/per-model');
  expect(Math.floor(state!.state.requests!.level / 60_000)).toBe(98);
}, 60_000);

test('a storage quota: a response that would not fit is refused with insufficient_quota; deleting one makes room; the count is the stored bytes', async () => {
  const token = await keyWith('storage', { storageBytes: 4_000 });
  const create = (input: string) =>
    fetch(`${gateways[0]!.url}/v1/responses`, {
      method: 'POST',
      headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
      body: JSON.stringify({ model: MODEL, input, max_output_tokens: 4 }),
    });
  const responses = await nc.jetstream().views.kv(names.responsesBucket);
  const limits = new LimitStore(await nc.jetstream().views.kv(names.limitsBucket));
  const ids: string[] = [];
  let refusal: Response | undefined;
  for (let i = 0; i < 20 && !refusal; i++) {
    const r = await create(`stored turn ${i}: ${'x'.repeat(400)}`);
    if (r.status === 429) refusal = r;
    else {
      expect(r.status).toBe(200);
      ids.push(((await r.json()) as { id: string }).id);
    }
  }
  expect(refusal).toBeDefined();
  expect(ids.length).toBeGreaterThan(1);
  const body = (await refusal!.json()) as { error: { code: string; message: string } };
  expect(body.error.code).toBe('insufficient_quota');
  expect(body.error.message).toMatch(
    /^You exceeded your storage quota for stored responses: Limit 4000 bytes, Stored \d+, Requested \d+\. Delete stored responses/,
  );
  // What the key is charged is what is stored, to the byte.
  const storedSizes = async () => {
    let sum = 0;
    for (const id of ids) {
      const e = await responses.get(id);
      if (e?.operation === 'PUT') sum += e.value.length;
    }
    return sum;
  };
  const charged = async () => Object.values((await limits.read('tenant/storage'))!.state.stored ?? {}).reduce((a, b) => a + b, 0);
  expect(await charged()).toBe(await storedSizes());
  expect(await charged()).toBeLessThanOrEqual(4_000 + 1_000); // over by at most the last response's answer
  // Deleted: its bytes are given back, and the next fits again.
  const del = await fetch(`${gateways[1]!.url}/v1/responses/${ids.shift()!}`, { method: 'DELETE', headers: { authorization: `Bearer ${token}` } });
  expect(del.status).toBe(200);
  expect(await charged()).toBe(await storedSizes());
  const again = await create('after a delete');
  expect(again.status).toBe(200);
  ids.push(((await again.json()) as { id: string }).id);
  expect(await charged()).toBe(await storedSizes());
  // Not stored: not held to the quota.
  const unstored = await fetch(`${gateways[0]!.url}/v1/responses`, {
    method: 'POST',
    headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
    body: JSON.stringify({ model: MODEL, input: 'x'.repeat(5_000), store: false, max_output_tokens: 4 }),
  });
  expect(unstored.status).toBe(200);
  await unstored.json();
}, 60_000);

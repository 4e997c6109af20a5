/**
 * The gateway's error answers as the official `openai` client sees them (`maxRetries: 0`, so no
 * retry hides a status), through the real gateway process (`startGateway`), nats-server and —
 * for a first turn — Temporal with the real workers and local runtime:
 * - 413 for a body over the limit, decided before the token is looked at (`APIError` 413);
 * - 400 naming the offending `param` (`BadRequestError`);
 * - 503 with `Retry-After` when no instance of the model can start (`InternalServerError`);
 * - 504 when the engine never answers (`InternalServerError`), streamed or not;
 * - 429 with `Retry-After` when the instance's backlog is full (`RateLimitError`).
 * 401 and 404 (`model_not_found`) are covered at client level by serving.int.test.ts and
 * gateway/gateway.int.test.ts.
 */
import type { Client } from '@temporalio/client';
import { randomBytes } from 'node:crypto';
import type { NatsConnection } from 'nats';
import OpenAI, { type APIError } from 'openai';
import { DEFAULT_INSTANCE_BACKLOG, dataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import { pinConversation } from './harness/gateway';
import { conversationKey } from '../gateway/serving/conversation';
import type { RunningGateway } from '../gateway/server';
import { readyModel } from './harness/gateway-app';
import { modelPublishedSignal, poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import type { StubEngine } from './fixtures/stub-engine';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { isolation, recordHistory, s3Client } from './harness';
import { gatewayStack, magusStack, stubInstanceStack, TestStack } from './harness/stack';
import { eventually, sleep } from './harness/wait';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
const TOKEN_ID = 'errs';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(16).toString('hex')}`;
const SECRET = randomBytes(32).toString('hex');
/** The gateway's smallest allowed body limit: every ordinary request here is far below it. */
const BODY_LIMIT = 1024;
const REQUEST_TIMEOUT_MS = 3000;
const RETRY_AFTER_SEC = 7;
/** In the registry, but without a GGUF file: the local runtime cannot start an instance of it. */
const UNSTARTABLE = `no-gguf-${iso.id}`;
/** Served by a warm-seeded session whose engine never answers. */
const SILENT = `silent-${iso.id}`;
const SILENT_INSTANCE = 'i1';
const SILENT_SESSION = `silent-${iso.id}`;
/** Pulled with only `dllama:q40`: the worker here has no distributed-llama binaries, so nothing can serve it. */
const DLLAMA_ONLY = `dllama-only-${iso.id}`;

let dir: string;
let nc: NatsConnection;
let client: Client;
let engine: StubEngine;
const bridgeLog: string[] = [];
let gateway: RunningGateway;
let openai: OpenAI;
const stack = new TestStack();

/** What a rejected call rejected with. */
async function failure(call: Promise<unknown>): Promise<unknown> {
  try {
    await call;
  } catch (err) {
    return err;
  }
  throw new Error('the call succeeded; an error was expected');
}

beforeAll(async () => {
  const magus = await stack.open(magusStack(iso, { dirPrefix: 'magus-serving-errors-' })); // the workers declare the data plane (streams, buckets)
  ({ dir, nc, client } = magus);
  const registry = await openModelRegistry(nc, names.modelsBucket);
  await registry.put(readyModel(UNSTARTABLE));
  await registry.put(readyModel(SILENT));
  const file = (key: string) => ({ key, bytes: 1, sha256: '0'.repeat(64) });
  await registry.put({
    ...readyModel(DLLAMA_ONLY),
    artifacts: [{ format: 'dllama', weights: 'q40', converterVersion: 'test', files: [file('m/model.m'), file('m/model.t')] }],
  });

  ({ engine } = await stack.open(
    stubInstanceStack(nc, names, {
      pool: SILENT,
      instance: SILENT_INSTANCE,
      slots: 4,
      engine: { stall: true },
      bridge: { log: (line) => bridgeLog.push(line) },
    }),
  ));
  // The silent model's conversation is pinned to that instance, as the session workflow would do.
  const key = conversationKey(SECRET, { scope: TOKEN_ID, model: `default/${SILENT}`, messages: [], sessionId: SILENT_SESSION });
  await pinConversation(nc, names, key, SILENT, SILENT_INSTANCE);

  ({ gateway } = await stack.open(
    gatewayStack(names, {
      secret: SECRET,
      tokens: { [TOKEN_ID]: TOKEN },
      env: {
        MAGUS_GATEWAY_BODY_LIMIT: String(BODY_LIMIT),
        MAGUS_GATEWAY_REQUEST_TIMEOUT_MS: String(REQUEST_TIMEOUT_MS),
        MAGUS_GATEWAY_GAP_TIMEOUT_MS: '1000',
        // Longer than any wait here: a streamed request is not committed (200) by a keep-alive
        // before its error, so the error is the HTTP answer.
        MAGUS_GATEWAY_SSE_KEEPALIVE_MS: '60000',
        // The 503 must come from the failed instance start, not from the gateway giving up.
        MAGUS_GATEWAY_COLD_START_TIMEOUT_MS: '110000',
        MAGUS_GATEWAY_RETRY_AFTER_SEC: String(RETRY_AFTER_SEC),
        MAGUS_LOG_LEVEL: 'silent',
      },
      sessions: {
        client,
        taskQueue: magus.cfg.taskQueue,
        pool: { minInstances: 0, maxInstances: 1, leasesPerInstance: 1, idleTimeoutMs: 60_000 },
        sessionTtlMs: 60_000,
      },
    }),
  ));
  openai = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: TOKEN, maxRetries: 0 });
}, 120_000);

afterAll(() => stack.close(), 60_000);

test('413 for a body over the limit, before authentication: the wrong token is never looked at', async () => {
  const wrong = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: `mgs_${TOKEN_ID}_${'0'.repeat(32)}`, maxRetries: 0 });
  const small = { model: SILENT, messages: [{ role: 'user' as const, content: 'hi' }] };
  // Far more than socket buffers hold: the gateway answers without reading it.
  const big = { model: SILENT, messages: [{ role: 'user' as const, content: 'x'.repeat(1024 * BODY_LIMIT) }] };

  // The token really is wrong: with a body within the limit it is refused.
  const unauthorized = await failure(wrong.chat.completions.create(small));
  expect(unauthorized).toBeInstanceOf(OpenAI.AuthenticationError);
  expect(unauthorized).toMatchObject({ status: 401, code: 'invalid_api_key' });

  for (const caller of [wrong, openai]) {
    const tooLarge = await failure(caller.chat.completions.create(big));
    // The client has no class of its own for 413: the base class, exactly.
    expect(tooLarge).toBeInstanceOf(OpenAI.APIError);
    expect((tooLarge as object).constructor).toBe(OpenAI.APIError);
    expect(tooLarge).toMatchObject({ status: 413, code: 'request_too_large', type: 'invalid_request_error' });
  }
  // Nothing reached the engine.
  expect(engine.requests).toHaveLength(0);
});

test('400 names the offending param', async () => {
  const cases: [Record<string, unknown>, string][] = [
    [{ temperature: 3 }, 'temperature'],
    [{ messages: [{ role: 'wizard', content: 'x' }] }, 'messages[0].role'],
    [{ messages: [{ role: 'user', content: 'x' }, { role: 'user' }] }, 'messages[1].content'],
  ];
  for (const [override, param] of cases) {
    const body = { model: SILENT, messages: [{ role: 'user', content: 'x' }], ...override } as unknown as OpenAI.ChatCompletionCreateParamsNonStreaming;
    const err = await failure(openai.chat.completions.create(body));
    expect(err).toBeInstanceOf(OpenAI.BadRequestError);
    expect(err).toMatchObject({ status: 400, param, type: 'invalid_request_error', code: 'invalid_value' });
    expect((err as Error).message).toContain(param);
  }
  // A kind of answer the engines do not give: refused, not answered with plain text.
  const choices = await failure(openai.chat.completions.create({ model: SILENT, messages: [{ role: 'user', content: 'x' }], n: 2 }));
  expect(choices).toBeInstanceOf(OpenAI.BadRequestError);
  expect(choices).toMatchObject({ status: 400, param: 'n', type: 'invalid_request_error', code: 'unsupported_feature' });
  // Log-probabilities with tools: each is served, together they are not (with a response format they are).
  const logprobs = await failure(
    openai.chat.completions.create({
      model: SILENT,
      messages: [{ role: 'user', content: 'x' }],
      logprobs: true,
      tools: [{ type: 'function', function: { name: 'lookup', parameters: { type: 'object', properties: {} } } }],
    }),
  );
  expect(logprobs).toMatchObject({ status: 400, param: 'logprobs', type: 'invalid_request_error', code: 'unsupported_feature' });
  // Parameters the grammar cannot enforce: refused before anything is queued, naming the keyword.
  const tools = await failure(
    openai.chat.completions.create({
      model: SILENT,
      messages: [{ role: 'user', content: 'x' }],
      tools: [{ type: 'function', function: { name: 'lookup', parameters: { type: 'object', properties: { n: { type: 'integer', minimum: 0 } } } } }],
    }),
  );
  expect(tools).toMatchObject({
    status: 400,
    param: 'tools[0].function.parameters.properties.n.minimum',
    type: 'invalid_request_error',
    code: 'unsupported_schema',
  });
  expect(engine.requests).toHaveLength(0);
});

/** The 503 answer of the test below, for the check after it. */
let noCapacity: APIError | undefined;

test('503 with Retry-After when no instance of the model can start', async () => {
  const err = await failure(openai.chat.completions.create({ model: UNSTARTABLE, messages: [{ role: 'user', content: 'anyone there?' }] }));
  expect(err).toBeInstanceOf(OpenAI.InternalServerError);
  noCapacity = err as APIError;
  expect(err).toMatchObject({ status: 503, code: 'no_capacity', type: 'server_error' });
  expect(noCapacity.headers?.get('retry-after')).toMatch(/^[1-9][0-9]*$/);
  // 5xx hide internals: the runtime's reason stays out of the answer …
  expect(noCapacity.message).not.toMatch(/gguf|artifact/i);
  // … but it is why: the pool tried to start an instance and recorded the runtime's failure.
  const status = await client.workflow.getHandle(poolWorkflowId('default', UNSTARTABLE)).query(poolStatusQuery);
  expect(status.lastError).toMatch(/artifact/i);
  expect(status.instances).toEqual([]);
}, 110_000);

// Issue "new user" item 6: a model only distributed-llama could run, on workers without its
// binaries, was listed as any other and answered 503 `no_capacity` after a failed cold start
// (6.3 s); the reason (`no GGUF artifact for llama.cpp`) was only in the log.
test('a model no live runtime can run is refused at once with the reason, and marked in /v1/models', async () => {
  const started = Date.now();
  const err = await failure(openai.chat.completions.create({ model: DLLAMA_ONLY, messages: [{ role: 'user', content: 'hello?' }] }));
  const tookMs = Date.now() - started;
  expect(err).toBeInstanceOf(OpenAI.BadRequestError);
  expect(err).toMatchObject({ status: 400, code: 'model_not_servable', param: 'model', type: 'invalid_request_error' });
  expect((err as Error).message).toMatch(/dllama:q40/);
  expect((err as Error).message).toMatch(/gguf/i);
  expect(tookMs).toBeLessThan(1000);
  // No cold start was tried: no pool workflow for it.
  await expect(client.workflow.getHandle(poolWorkflowId('default', DLLAMA_ONLY)).describe()).rejects.toMatchObject({ name: 'WorkflowNotFoundError' });
  // The list and the item say so, and why; a servable model is marked servable.
  const listed = [];
  for await (const m of openai.models.list()) listed.push(m);
  const entry = listed.find((m) => m.id === DLLAMA_ONLY);
  expect(entry).toMatchObject({ servable: false, not_servable_reason: (err as Error).message.replace(/^400 /, '') });
  expect(await openai.models.retrieve(DLLAMA_ONLY)).toEqual(entry);
  expect(listed.find((m) => m.id === SILENT)).toMatchObject({ servable: true });
});

// The Temporal broker's error used to carry retryAfterSec = 5, which won over the setting.
test('the 503 Retry-After is the configured MAGUS_GATEWAY_RETRY_AFTER_SEC', () => {
  expect(noCapacity).toBeDefined();
  expect(noCapacity?.headers?.get('retry-after')).toBe(String(RETRY_AFTER_SEC));
});

// A retry after `no_capacity` is a new first turn: answered once the pool can start an instance,
// not refused from the reason of the failure before.
test('a retry after no_capacity is served once an instance can start, not refused from the old reason', async () => {
  expect(noCapacity).toBeDefined(); // the 503 above; its session is still alive
  const s3 = s3Client();
  try {
    await publishTinyGguf({ dir, s3, bucket: iso.bucket, registry: await openModelRegistry(nc, names.modelsBucket), name: UNSTARTABLE });
  } finally {
    s3.destroy();
  }
  // The same conversation as the 503's (same messages, no session id): the same session workflow.
  const answer = await openai.chat.completions.create({ model: UNSTARTABLE, messages: [{ role: 'user', content: 'anyone there?' }], max_tokens: 4 });
  expect(answer.choices[0]?.message.role).toBe('assistant');
}, 110_000);

// Review finding 3: a pool whose instances can never start used to start another every few
// seconds for ever (each one pulling and spawning). Now the error is typed and final, and
// failed starts back off (5 s, 10 s, 20 s … capped at 5 min), visibly in the pool's state.
test('a model whose instances can never start is tried a bounded number of times, with the backoff in the pool’s state', async () => {
  const model = `never-published-${iso.id}`;
  const handle = await client.workflow.start('dllamaPool', {
    workflowId: poolWorkflowId('default', model),
    taskQueue: `${iso.id}-control`,
    args: [{ namespace: 'default', model, minInstances: 1, maxInstances: 1, leasesPerInstance: 1, idleTimeoutMs: 60_000 }],
  });
  await sleep(60_000);
  const history = await handle.fetchHistory();
  const starts = (history.events ?? []).filter((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === 'createInstance').length;
  const status = await handle.query(poolStatusQuery);
  // The model's pipeline tells the pool when it publishes the model: the next start is at once.
  await handle.signal(modelPublishedSignal);
  await eventually(async () => {
    const again = await handle.fetchHistory();
    expect((again.events ?? []).filter((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === 'createInstance').length).toBe(starts + 1);
  }, 5_000);
  await recordHistory('pool-start-backoff', handle);
  await handle.terminate('test over');
  // 0, 5, 15, 35 s (+ the time each attempt takes): 4 in a minute; before, one every ~6 s.
  expect(starts).toBeGreaterThanOrEqual(3);
  expect(starts).toBeLessThanOrEqual(5);
  expect(status.startFailures).toBe(starts);
  expect(status.nextStartAt).toBeGreaterThan(Date.now() - 1000);
  expect(status.lastError).toMatch(/ModelNotReady|not in the registry/);
  expect(status.lastError).toMatch(/failed starts in a row; next attempt in \d+s/);
}, 120_000);

test('504 when the engine never answers, streamed or not', async () => {
  const headers = { 'x-session-id': SILENT_SESSION };
  const messages = [{ role: 'user' as const, content: 'say something' }];
  const attempts: [string, () => Promise<unknown>][] = [
    ['non-stream', () => openai.chat.completions.create({ model: SILENT, messages }, { headers })],
    ['stream', () => openai.chat.completions.create({ model: SILENT, messages, stream: true }, { headers })],
  ];
  for (const [what, call] of attempts) {
    const before = engine.requests.length;
    const err = await failure(call());
    expect(err).toBeInstanceOf(OpenAI.InternalServerError);
    expect({ what, ...(err as APIError) }).toMatchObject({ what, status: 504, type: 'server_error' });
    // The gateway's own timeout or the bridge's deadline frame, whichever comes first: the same
    // answer, and nothing of the engine.
    expect((err as APIError).code).toBe('timeout');
    // The request did reach the engine: the silence is the engine's, not a lost request.
    expect(engine.requests.length).toBe(before + 1);
  }
  expect(bridgeLog).toEqual([]);
});

test('429 with Retry-After when the instance’s backlog is full; a slot freed is usable again', async () => {
  // An instance nobody consumes (its engine is gone), its backlog filled to the request stream's
  // per-subject limit by requests already queued: the next one is refused at publish.
  const instance = 'backlogged';
  const key = conversationKey(SECRET, { scope: TOKEN_ID, model: `default/${SILENT}`, messages: [], sessionId: `backlog-${iso.id}` });
  const { subject } = await pinConversation(nc, names, key, SILENT, instance);
  const js = nc.jetstream();
  const queued = await Promise.all(
    Array.from({ length: DEFAULT_INSTANCE_BACKLOG }, (_, i) => js.publish(subject, new TextEncoder().encode(`{"queued":${i}}`))),
  );
  const headers = { 'x-session-id': `backlog-${iso.id}` };
  const messages = [{ role: 'user' as const, content: 'one more, please' }];
  for (const stream of [false, true]) {
    const err = await failure(openai.chat.completions.create({ model: SILENT, messages, stream }, { headers }));
    expect(err).toBeInstanceOf(OpenAI.RateLimitError);
    expect(err).toMatchObject({ status: 429, code: 'backlog_full', type: 'rate_limit_exceeded' });
    expect((err as APIError).headers?.get('retry-after')).toBe(String(RETRY_AFTER_SEC));
  }
  // One queued request leaves (as when a bridge acks it): the next publish is accepted again,
  // which the gateway shows by waiting for an answer (it times out: nobody serves the instance).
  const jsm = await nc.jetstreamManager();
  expect(await jsm.streams.deleteMessage(names.requestStream, queued[0]!.seq)).toBe(true);
  const err = await failure(openai.chat.completions.create({ model: SILENT, messages }, { headers }));
  expect(err).toMatchObject({ status: 504 });
  await jsm.streams.purge(names.requestStream, { filter: subject });
}, 60_000);

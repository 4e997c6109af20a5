/**
 * A model's sampling defaults reach the engine (shared/sampling.ts): through the real gateway
 * process → nats-server → real bridges → stub engines that record every request body they
 * receive, a request that sets no sampling field is generated with the `Model`'s `spec.sampling`
 * over what its repository publishes, one that sets a field keeps its own, and `/v1/models` shows
 * the defaults. One instance's bridge serves llama.cpp's engine, the other distributed-llama's
 * `dllama-api` (`--engine-kind dllama`): both get the same fields (dllama-api applies temperature
 * and top_p and ignores the rest). Sessions are pinned, text completions routed by a published
 * pool view: no Temporal.
 */
import { randomBytes } from 'node:crypto';
import type { NatsConnection } from 'nats';
import OpenAI from 'openai';
import { openModelRegistry } from '../dataplane/registry';
import { conversationKey } from '../gateway/serving/conversation';
import type { RunningGateway } from '../gateway/server';
import type { ReadyModel } from '../shared/model';
import type { StubEngine } from './fixtures/stub-engine';
import { isolation } from './harness';
import { pinConversation, publishPoolView, refusedColdStart } from './harness/gateway';
import { readyModel } from './harness/gateway-app';
import { gatewayStack, natsStack, stubInstanceStack, TestStack } from './harness/stack';

const iso = isolation();
const TOKEN_ID = 'sampling';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(24).toString('hex')}`;
const SECRET = randomBytes(32).toString('hex');
const SESSION = `sampling-${iso.id}`;
const file = (key: string) => ({ key, bytes: 1, sha256: '0'.repeat(64) });

/** On llama.cpp: its repository publishes temperature 0.6, top_k 50 and a repetition penalty; its Model sets temperature 0.2 and top_p 0.9. */
const LLAMA: ReadyModel = {
  ...readyModel(`tuned-${iso.id}`),
  artifacts: [
    {
      format: 'gguf',
      weights: 'q40',
      converterVersion: 'test',
      files: [file('a/model.gguf')],
      sampling: { temperature: 0.6, top_k: 50, repetition_penalty: 1.1 },
    },
  ],
  sampling: { temperature: 0.2, top_p: 0.9 },
};
/** On distributed-llama, with the same defaults. */
const DLLAMA: ReadyModel = {
  ...LLAMA,
  name: `tuned-dl-${iso.id}`,
  artifacts: [{ ...LLAMA.artifacts[0]!, format: 'dllama', files: [file('d/model.m'), file('d/tokenizer.t')] }],
};
/** Without defaults: the engine decides. */
const PLAIN = readyModel(`plain-${iso.id}`);
const EFFECTIVE = { temperature: 0.2, top_p: 0.9, top_k: 50, repetition_penalty: 1.1 };

let nc: NatsConnection;
let gateway: RunningGateway;
let openai: OpenAI;
const engines = new Map<string, StubEngine>();
const coldStarts: string[] = [];
const stack = new TestStack();

/** The sampling fields of the last body `model`'s engine received. */
function lastSampling(model: ReadyModel): Record<string, unknown> {
  const body = engines.get(model.name)!.requests.at(-1)!.body as Record<string, unknown>;
  return Object.fromEntries(['temperature', 'top_p', 'top_k', 'repetition_penalty'].filter((k) => k in body).map((k) => [k, body[k]]));
}

beforeAll(async () => {
  const nats = await stack.open(natsStack(iso, { declare: true }));
  const { names } = nats;
  nc = nats.nc;
  const registry = await openModelRegistry(nc, names.modelsBucket);
  for (const [model, engineKind] of [
    [LLAMA, 'llamacpp'],
    [DLLAMA, 'dllama'],
    [PLAIN, 'llamacpp'],
  ] as const) {
    await registry.put(model);
    const { engine } = await stack.open(stubInstanceStack(nc, names, { pool: model.name, instance: 'i1', slots: 2, bridge: { engineKind } }));
    engines.set(model.name, engine);
    const key = conversationKey(SECRET, { scope: TOKEN_ID, model: `default/${model.name}`, messages: [], sessionId: SESSION });
    await pinConversation(nc, names, key, model.name, 'i1');
  }
  await publishPoolView(nc, names, LLAMA.name, ['i1']);
  ({ gateway } = await stack.open(
    gatewayStack(names, {
      secret: SECRET,
      tokens: { [TOKEN_ID]: TOKEN },
      env: { MAGUS_LOG_LEVEL: 'silent' },
      deps: { coldStart: refusedColdStart(coldStarts, 'no cold start in the sampling test') },
    }),
  ));
  openai = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: TOKEN, maxRetries: 0, defaultHeaders: { 'x-session-id': SESSION } });
}, 60_000);

afterAll(() => stack.close(), 60_000);

const ask = (model: ReadyModel, extra: { temperature?: number; top_p?: number } = {}) =>
  openai.chat.completions.create({ model: model.name, messages: [{ role: 'user', content: 'What is the capital of France?' }], max_tokens: 8, ...extra });

test('a chat request without sampling fields is generated with the model’s defaults: spec.sampling over the repository’s', async () => {
  expect((await ask(LLAMA)).choices[0]!.message.content).toBe('What is the capital of France?');
  expect(lastSampling(LLAMA)).toEqual(EFFECTIVE);
  // Streamed alike.
  const stream = await openai.chat.completions.create({ model: LLAMA.name, messages: [{ role: 'user', content: 'hi' }], stream: true });
  for await (const _ of stream);
  expect(lastSampling(LLAMA)).toEqual(EFFECTIVE);
});

test('the request’s own temperature and top_p win; what it leaves out is still the model’s', async () => {
  await ask(LLAMA, { temperature: 1 });
  expect(lastSampling(LLAMA)).toEqual({ ...EFFECTIVE, temperature: 1 });
  await ask(LLAMA, { temperature: 0, top_p: 1 });
  expect(lastSampling(LLAMA)).toEqual({ ...EFFECTIVE, temperature: 0, top_p: 1 });
});

test('distributed-llama’s instance gets the same defaults', async () => {
  await ask(DLLAMA);
  expect(lastSampling(DLLAMA)).toEqual(EFFECTIVE);
});

test('text completions get them too; a model without defaults gets nothing added', async () => {
  await openai.completions.create({ model: LLAMA.name, prompt: 'The capital of France is', max_tokens: 4, top_p: 0.5 });
  expect(lastSampling(LLAMA)).toEqual({ ...EFFECTIVE, top_p: 0.5 });
  await ask(PLAIN);
  expect(lastSampling(PLAIN)).toEqual({});
  expect(coldStarts).toEqual([]);
});

test('/v1/models shows each model’s effective defaults', async () => {
  const listed = new Map<string, unknown>();
  for await (const m of openai.models.list()) listed.set(m.id, (m as unknown as { sampling: unknown }).sampling);
  expect(listed.get(LLAMA.name)).toEqual(EFFECTIVE);
  expect(listed.get(DLLAMA.name)).toEqual(EFFECTIVE);
  expect(listed.get(PLAIN.name)).toEqual({});
  expect(((await openai.models.retrieve(LLAMA.name)) as unknown as { sampling: unknown }).sampling).toEqual(EFFECTIVE);
});

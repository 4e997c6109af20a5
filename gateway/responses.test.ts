/**
 * The Responses API through `app.inject`, with fakes of the gateway's own interfaces (the app
 * tests' harness, its stored responses in memory): a response and its stream as OpenAI shapes
 * them, the chain that `previous_response_id` walks (what the engine is sent, which session it
 * reaches), stored responses read and deleted by their own token only, and the refusals chat
 * gives, naming the Responses field.
 */
// As in app.test.ts: light-my-request's ESM-only `cookie`, which these tests never use.
jest.mock('cookie', () => ({
  stringifySetCookie: () => {
    throw new Error('cookies are not used in these tests');
  },
}));
import type { LightMyRequestResponse } from 'fastify';
import type { ChatMessage } from '../shared/chat';
import type { ReadyModel } from '../shared/model';
import type { ResponseObject } from '../shared/responses';
import type { RuntimeAdvert } from '../shared/runtimes';
import { conversationKey } from './serving/conversation';
import { configOwner } from './plugins/auth';
import { createModelCatalog } from './serving/model-catalog';
import { MAX_STORED_REQUEST_BYTES, memoryResponseStore } from './serving/response-store';
import { buildTestApp, chunk, readyModel, TEST_SECRET, testSettings, type TestApp } from '../test/harness/gateway-app';

let t: TestApp;
let store: ReturnType<typeof memoryResponseStore>;
beforeEach(async () => {
  store = memoryResponseStore();
  t = await buildTestApp({ storedResponses: store });
});
afterEach(async () => {
  await t?.app.close();
});

const auth = (token: string) => ({ authorization: `Bearer ${token}`, 'content-type': 'application/json' });

function create(body: object, token = t.tokens.alice.token): Promise<LightMyRequestResponse> {
  return t.app.inject({ method: 'POST', url: '/v1/responses', headers: auth(token), payload: JSON.stringify({ model: 'tiny', ...body }) });
}

const errorOf = (res: LightMyRequestResponse) => res.json<{ error: { message: string; type: string; param: string | null; code: string | null } }>().error;

/** The engine's whole chat completion. */
function answers(content: string | null, extra: { tool_calls?: object[]; finish_reason?: string; usage?: object } = {}): void {
  t.plane.script = () => [
    {
      seq: 0,
      type: 'done',
      data: {
        id: 'chatcmpl-1',
        object: 'chat.completion',
        choices: [
          {
            index: 0,
            message: { role: 'assistant', content, ...(extra.tool_calls ? { tool_calls: extra.tool_calls } : {}) },
            finish_reason: extra.finish_reason ?? 'stop',
          },
        ],
        usage: extra.usage ?? { prompt_tokens: 10, completion_tokens: 3, total_tokens: 13, prompt_tokens_details: { cached_tokens: 4 } },
      },
    },
  ];
}

/** The messages the engine received in the `i`th request. */
const sent = (i: number): ChatMessage[] => t.plane.chat(i).body.messages;

/** The `event:` names and `data:` payloads of a Responses stream. */
function events(body: string): { event: string; data: { type: string; sequence_number: number } & Record<string, unknown> }[] {
  return body
    .split('\n\n')
    .filter((e) => e.startsWith('event: '))
    .map((e) => {
      const [head, data] = e.split('\n');
      return { event: head!.slice('event: '.length), data: JSON.parse(data!.slice('data: '.length)) as { type: string; sequence_number: number } };
    });
}

describe('POST /v1/responses', () => {
  it('a response object of the chat answer, from instructions and input as chat messages, stored', async () => {
    answers('Paris.');
    const res = await create({ input: 'Capital of France?', instructions: 'Be brief.', max_output_tokens: 32, temperature: 0, metadata: { k: 'v' } });
    expect(res.statusCode).toBe(200);
    const r = res.json<ResponseObject>();
    expect(r).toMatchObject({
      object: 'response',
      status: 'completed',
      incomplete_details: null,
      model: 'tiny',
      instructions: 'Be brief.',
      max_output_tokens: 32,
      temperature: 0,
      tool_choice: 'auto',
      parallel_tool_calls: true,
      text: { format: { type: 'text' } },
      previous_response_id: null,
      store: true,
      metadata: { k: 'v' },
      error: null,
      usage: {
        input_tokens: 10,
        input_tokens_details: { cached_tokens: 4 },
        output_tokens: 3,
        output_tokens_details: { reasoning_tokens: 0 },
        total_tokens: 13,
      },
    });
    expect(r.id).toMatch(/^resp_[A-Za-z0-9]+$/);
    expect(r.id).toBe(`resp_${res.headers['x-request-id'] as string}`);
    expect(r.output).toEqual([
      {
        type: 'message',
        id: expect.stringMatching(/^msg_/) as unknown,
        status: 'completed',
        role: 'assistant',
        content: [{ type: 'output_text', text: 'Paris.', annotations: [] }],
      },
    ]);
    expect(t.plane.chat(0).body).toEqual({
      model: 'tiny',
      messages: [
        { role: 'system', content: 'Be brief.' },
        { role: 'user', content: 'Capital of France?' },
      ],
      stream: false,
      temperature: 0,
      max_tokens: 32,
    });
    expect(store.records.get(r.id)).toMatchObject({
      owner: configOwner('alice'),
      model: 'default/tiny',
      root: r.id,
      previous: null,
      depth: 0,
      input: [{ role: 'user', content: 'Capital of France?' }],
      output: [{ role: 'assistant', content: 'Paris.' }],
      response: r,
    });
    expect(t.plane.listening).toBe(0);
    expect((await t.app.inject({ method: 'GET', url: '/metrics' })).body).toMatch(/magus_gateway_requests_total\{route="\/v1\/responses",status="200"\} 1/);
  });

  it('cut by max_output_tokens: incomplete', async () => {
    answers('Par', { finish_reason: 'length' });
    const r = (await create({ input: 'Capital of France?', max_output_tokens: 1 })).json<ResponseObject>();
    expect(r).toMatchObject({ status: 'incomplete', incomplete_details: { reason: 'max_output_tokens' }, output: [{ type: 'message', status: 'incomplete' }] });
  });

  it("the engine's tool calls are function_call items; text.format and tools are chat's response_format and tools", async () => {
    answers(null, {
      tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Paris"}' } }],
      finish_reason: 'tool_calls',
    });
    const tool = {
      type: 'function',
      name: 'get_weather',
      description: 'Weather',
      parameters: { type: 'object', properties: { city: { type: 'string' } } },
      strict: true,
    };
    const res = await create({
      input: 'Weather in Paris?',
      tools: [tool],
      tool_choice: { type: 'function', name: 'get_weather' },
      parallel_tool_calls: false,
      text: { format: { type: 'json_schema', name: 'w', schema: { type: 'object' } } },
    });
    expect(res.statusCode).toBe(200);
    const r = res.json<ResponseObject>();
    expect(r.output).toEqual([
      {
        type: 'function_call',
        id: expect.stringMatching(/^fc_/) as unknown,
        call_id: 'call_1',
        name: 'get_weather',
        arguments: '{"city":"Paris"}',
        status: 'completed',
      },
    ]);
    expect(r).toMatchObject({ tools: [tool], tool_choice: { type: 'function', name: 'get_weather' }, parallel_tool_calls: false });
    expect(t.plane.chat(0).body).toMatchObject({
      tools: [{ type: 'function', function: { name: 'get_weather', description: 'Weather', parameters: tool.parameters, strict: true } }],
      tool_choice: { type: 'function', function: { name: 'get_weather' } },
      parallel_tool_calls: false,
      response_format: { type: 'json_schema', json_schema: { name: 'w', schema: { type: 'object' } } },
    });
    expect(store.records.get(r.id)!.output).toEqual([
      { role: 'assistant', content: '', tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Paris"}' } }] },
    ]);
  });

  it('store: false answers without storing', async () => {
    answers('Hi.');
    const r = (await create({ input: 'Hello', store: false })).json<ResponseObject>();
    expect(r.store).toBe(false);
    expect(store.records.size).toBe(0);
    expect((await create({ input: 'Again', previous_response_id: r.id })).statusCode).toBe(404);
  });

  it('an input too large to store → 400 input_too_large before anything is queued; with store: false it is served', async () => {
    await t.app.close();
    t = await buildTestApp({ storedResponses: store, settings: testSettings({ bodyLimit: 4 * 1024 * 1024 }) });
    answers('Long.');
    const input = 'x'.repeat(MAX_STORED_REQUEST_BYTES + 1);
    const refused = await create({ input });
    expect(refused.statusCode).toBe(400);
    expect(errorOf(refused)).toMatchObject({ param: 'input', code: 'input_too_large' });
    expect(t.plane.published).toHaveLength(0);
    const served = await create({ input, store: false });
    expect(served.statusCode).toBe(200);
    expect(store.records.size).toBe(0);
  });
});

describe('streaming', () => {
  it("OpenAI's events in order, numbered; the deltas are the text; completed with the whole response, stored before it", async () => {
    t.plane.script = () => [
      chunk(0, 'Hel'),
      chunk(1, 'lo'),
      { seq: 2, type: 'chunk', data: { object: 'chat.completion.chunk', choices: [{ index: 0, delta: {}, finish_reason: 'stop' }] } },
      {
        seq: 3,
        type: 'chunk',
        data: {
          object: 'chat.completion.chunk',
          choices: [],
          usage: { prompt_tokens: 5, completion_tokens: 2, total_tokens: 7, prompt_tokens_details: { cached_tokens: 0 } },
        },
      },
      { seq: 4, type: 'done' },
    ];
    const res = await create({ input: 'Say hello', stream: true });
    expect(res.statusCode).toBe(200);
    expect(res.headers['content-type']).toBe('text/event-stream; charset=utf-8');
    const all = events(res.body);
    expect(all.map((e) => e.event)).toEqual([
      'response.created',
      'response.in_progress',
      'response.output_item.added',
      'response.content_part.added',
      'response.output_text.delta',
      'response.output_text.delta',
      'response.output_text.done',
      'response.content_part.done',
      'response.output_item.done',
      'response.completed',
    ]);
    expect(all.every((e) => e.event === e.data.type)).toBe(true);
    expect(all.map((e) => e.data.sequence_number)).toEqual(all.map((_e, i) => i));
    expect(all.filter((e) => e.event === 'response.output_text.delta').map((e) => e.data.delta)).toEqual(['Hel', 'lo']);
    expect(all[0]!.data.response).toMatchObject({ status: 'in_progress', output: [] });
    const completed = all.at(-1)!.data.response as ResponseObject;
    expect(completed).toMatchObject({
      status: 'completed',
      output: [{ type: 'message', content: [{ type: 'output_text', text: 'Hello' }] }],
      usage: { input_tokens: 5, output_tokens: 2, total_tokens: 7 },
    });
    expect(all[6]!.data).toMatchObject({ text: 'Hello', output_index: 0, content_index: 0, item_id: completed.output[0]!.id });
    expect(store.records.get(completed.id)?.response).toEqual(completed);
    expect(t.plane.chat(0).body).toMatchObject({ stream: true, stream_options: { include_usage: true } });
    expect(res.body).not.toContain('[DONE]');
  });

  it('a tool call: a function_call item, its arguments as a delta, then done', async () => {
    t.plane.script = () => [
      {
        seq: 0,
        type: 'chunk',
        data: {
          choices: [
            {
              index: 0,
              delta: { tool_calls: [{ index: 0, id: 'call_9', type: 'function', function: { name: 'f', arguments: '{"x":1}' } }] },
              finish_reason: null,
            },
          ],
        },
      },
      { seq: 1, type: 'chunk', data: { choices: [{ index: 0, delta: {}, finish_reason: 'tool_calls' }] } },
      { seq: 2, type: 'done' },
    ];
    const res = await create({ input: 'Call f', stream: true, tools: [{ type: 'function', name: 'f' }], tool_choice: 'required' });
    const all = events(res.body);
    expect(all.map((e) => e.event)).toEqual([
      'response.created',
      'response.in_progress',
      'response.output_item.added',
      'response.function_call_arguments.delta',
      'response.function_call_arguments.done',
      'response.output_item.done',
      'response.completed',
    ]);
    expect(all[2]!.data.item).toMatchObject({ type: 'function_call', call_id: 'call_9', name: 'f', arguments: '', status: 'in_progress' });
    expect(all[4]!.data).toMatchObject({ name: 'f', arguments: '{"x":1}' });
    expect((all.at(-1)!.data.response as ResponseObject).output).toEqual([
      expect.objectContaining({ type: 'function_call', call_id: 'call_9', arguments: '{"x":1}', status: 'completed' }),
    ]);
  });

  it('an error after the stream started: response.failed, then an error event; nothing stored', async () => {
    t.plane.script = () => [chunk(0, 'a'), { seq: 1, type: 'error', error: { status: 503, message: 'engine crashed: segfault', type: 'x', code: null } }];
    const res = await create({ input: 'hi', stream: true });
    const all = events(res.body);
    expect(all.slice(-2).map((e) => e.event)).toEqual(['response.failed', 'error']);
    expect(all.at(-2)!.data.response).toMatchObject({ status: 'failed', error: { code: 'engine_error' } });
    expect(all.at(-1)!.data).toMatchObject({ type: 'error', code: 'engine_error', error: { type: 'server_error', code: 'engine_error' } });
    expect(res.body).not.toContain('segfault');
    expect(store.records.size).toBe(0);
  });
});

describe('previous_response_id', () => {
  it("rebuilds the chain's conversation (instructions not inherited), and every turn reaches the chain's session", async () => {
    answers('Paris.');
    const first = (await create({ input: 'Capital of France?', instructions: 'Be brief.' })).json<ResponseObject>();
    answers('Berlin.');
    const second = (
      await create({
        input: [{ role: 'user', content: [{ type: 'input_text', text: 'And Germany?' }] }],
        previous_response_id: first.id,
        instructions: 'Be kind.',
      })
    ).json<ResponseObject>();
    expect(second.previous_response_id).toBe(first.id);
    answers('Rome.');
    const third = await create({ input: 'And Italy?', previous_response_id: second.id });
    expect(third.statusCode).toBe(200);
    expect(sent(1)).toEqual([
      { role: 'system', content: 'Be kind.' },
      { role: 'user', content: 'Capital of France?' },
      { role: 'assistant', content: 'Paris.' },
      { role: 'user', content: 'And Germany?' },
    ]);
    expect(sent(2)).toEqual([
      { role: 'user', content: 'Capital of France?' },
      { role: 'assistant', content: 'Paris.' },
      { role: 'user', content: 'And Germany?' },
      { role: 'assistant', content: 'Berlin.' },
      { role: 'user', content: 'And Italy?' },
    ]);
    const key = conversationKey(TEST_SECRET, { scope: 'alice', model: 'default/tiny', messages: [], sessionId: first.id });
    expect(t.broker.calls.map((c) => c.conversationKey)).toEqual([key, key, key]);
    expect(store.records.get(third.json<ResponseObject>().id)).toMatchObject({ root: first.id, previous: second.id, depth: 2 });
    // A new chain is another conversation.
    answers('Hi.');
    await create({ input: 'Hello' });
    expect(t.broker.calls[3]!.conversationKey).not.toBe(key);
  });

  it("a turn that answered with tool calls, continued with their outputs: the calls and results reach the engine in chat's shape", async () => {
    answers(null, { tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'f', arguments: '{}' } }], finish_reason: 'tool_calls' });
    const tools = [{ type: 'function', name: 'f' }];
    const first = (await create({ input: 'Use f', tools })).json<ResponseObject>();
    answers('Done.');
    const res = await create({ input: [{ type: 'function_call_output', call_id: 'call_1', output: '42' }], previous_response_id: first.id, tools });
    expect(res.statusCode).toBe(200);
    expect(sent(1)).toEqual([
      { role: 'user', content: 'Use f' },
      { role: 'assistant', content: '', tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'f', arguments: '{}' } }] },
      { role: 'tool', content: '42', tool_call_id: 'call_1' },
    ]);
  });

  it('unknown, malformed or another token’s → 404 previous_response_not_found, nothing queued', async () => {
    answers('Paris.');
    const alices = (await create({ input: 'Capital of France?' })).json<ResponseObject>();
    const published = t.plane.published.length;
    for (const [id, token] of [
      ['resp_unknown', t.tokens.alice.token],
      ['not an id', t.tokens.alice.token],
      [alices.id, t.tokens.bob.token],
    ] as const) {
      const res = await create({ input: 'And Germany?', previous_response_id: id }, token);
      expect(res.statusCode).toBe(404);
      expect(errorOf(res)).toEqual({
        type: 'invalid_request_error',
        code: 'previous_response_not_found',
        param: 'previous_response_id',
        message: `No response found with id '${id}'.`,
      });
    }
    expect(t.plane.published).toHaveLength(published);
  });

  it('an earlier turn of the chain gone (deleted, expired) → 404 naming it', async () => {
    answers('a');
    const first = (await create({ input: '1' })).json<ResponseObject>();
    const second = (await create({ input: '2', previous_response_id: first.id })).json<ResponseObject>();
    store.records.delete(first.id);
    const res = await create({ input: '3', previous_response_id: second.id });
    expect(res.statusCode).toBe(404);
    expect(errorOf(res)).toMatchObject({
      code: 'previous_response_not_found',
      param: 'previous_response_id',
      message: `Response '${first.id}', an earlier turn of '${second.id}', is no longer stored.`,
    });
  });
});

describe('GET and DELETE /v1/responses/{response_id}', () => {
  const get = (id: string, token = t.tokens.alice.token) =>
    t.app.inject({ method: 'GET', url: `/v1/responses/${id}`, headers: { authorization: `Bearer ${token}` } });
  const del = (id: string, token = t.tokens.alice.token) =>
    t.app.inject({ method: 'DELETE', url: `/v1/responses/${id}`, headers: { authorization: `Bearer ${token}` } });

  it('the stored response to its own token only; deleted, it is gone (and cannot be continued)', async () => {
    answers('Paris.');
    const created = (await create({ input: 'Capital of France?' })).json<ResponseObject>();
    const got = await get(created.id);
    expect(got.statusCode).toBe(200);
    expect(got.json()).toEqual(created);
    for (const res of [await get(created.id, t.tokens.bob.token), await del(created.id, t.tokens.bob.token)]) {
      expect(res.statusCode).toBe(404);
      expect(errorOf(res)).toMatchObject({ code: 'response_not_found', param: 'response_id' });
    }
    expect(store.records.has(created.id)).toBe(true);
    const deleted = await del(created.id);
    expect(deleted.statusCode).toBe(200);
    expect(deleted.json()).toEqual({ id: created.id, object: 'response', deleted: true });
    expect((await get(created.id)).statusCode).toBe(404);
    expect((await del(created.id)).statusCode).toBe(404);
    expect((await create({ input: 'And Germany?', previous_response_id: created.id })).statusCode).toBe(404);
    expect((await t.app.inject({ method: 'GET', url: `/v1/responses/${created.id}` })).statusCode).toBe(401);
  });

  it('a store that cannot be reached → 503 unavailable with Retry-After', async () => {
    store.get = () => Promise.reject(new Error('NATS is away'));
    const res = await get('resp_x');
    expect(res.statusCode).toBe(503);
    expect(res.headers['retry-after']).toBeDefined();
    expect(errorOf(res).code).toBe('unavailable');
  });
});

describe('log-probabilities', () => {
  const lp = (token: string, logprob: number) => ({
    token,
    logprob,
    bytes: [...Buffer.from(token)],
    top_logprobs: [{ token, logprob, bytes: [...Buffer.from(token)] }],
  });

  it('include message.output_text.logprobs asks the engine for them (top_logprobs alternatives) and the text part carries them', async () => {
    t.plane.script = () => [
      {
        seq: 0,
        type: 'done',
        data: {
          id: 'c',
          object: 'chat.completion',
          choices: [
            { index: 0, message: { role: 'assistant', content: 'Hi!' }, logprobs: { content: [lp('Hi', -0.1), lp('!', -0.5)] }, finish_reason: 'stop' },
          ],
        },
      },
    ];
    const r = (await create({ input: 'Hello', include: ['message.output_text.logprobs'], top_logprobs: 1 })).json<ResponseObject>();
    expect(t.plane.chat(0).body).toMatchObject({ logprobs: true, top_logprobs: 1 });
    expect(r.top_logprobs).toBe(1);
    expect(r.output[0]).toMatchObject({ type: 'message', content: [{ type: 'output_text', text: 'Hi!', logprobs: [lp('Hi', -0.1), lp('!', -0.5)] }] });
    // Without them: the engine is not asked, and the part has none.
    answers('Hi!');
    const plain = (await create({ input: 'Hello' })).json<ResponseObject>();
    expect(t.plane.chat(1).body).not.toHaveProperty('logprobs');
    expect(plain.output[0]).not.toHaveProperty('content.0.logprobs');
  });

  it('streamed: each output_text.delta carries its tokens, output_text.done all of them', async () => {
    const piece = (seq: number, content: string, tokens: object[]) => ({
      seq,
      type: 'chunk' as const,
      data: { id: 'c', object: 'chat.completion.chunk', choices: [{ index: 0, delta: { content }, logprobs: { content: tokens }, finish_reason: null }] },
    });
    t.plane.script = () => [piece(0, 'Hi', [lp('Hi', -0.1)]), piece(1, '!', [lp('!', -0.5)]), { seq: 2, type: 'done' }];
    const res = await create({ input: 'Hello', stream: true, include: ['message.output_text.logprobs'] });
    const events = res.body
      .split('\n\n')
      .filter((e) => e.includes('data: '))
      .map((e) => JSON.parse(e.slice(e.indexOf('data: ') + 6)) as { type: string; logprobs?: unknown[] });
    expect(events.filter((e) => e.type === 'response.output_text.delta').map((e) => e.logprobs)).toEqual([[lp('Hi', -0.1)], [lp('!', -0.5)]]);
    expect(events.find((e) => e.type === 'response.output_text.done')?.logprobs).toEqual([lp('Hi', -0.1), lp('!', -0.5)]);
  });

  it('with tools or a JSON format: 400 unsupported_feature naming include; top_logprobs above 20: 400', async () => {
    const tools = await create({ input: 'Hello', include: ['message.output_text.logprobs'], tools: [{ type: 'function', name: 'f' }] });
    expect(errorOf(tools)).toMatchObject({ param: 'include', code: 'unsupported_feature' });
    const many = await create({ input: 'Hello', top_logprobs: 21 });
    expect(errorOf(many)).toMatchObject({ param: 'top_logprobs' });
    expect(t.plane.published).toHaveLength(0);
  });
});

describe('refusals', () => {
  it.each([
    ['tools[0].type', { tools: [{ type: 'web_search' }] }],
    ['tool_choice.type', { tool_choice: { type: 'web_search' } }],
    ['include[0]', { include: ['file_search_call.results'] }],
    ['reasoning', { reasoning: { effort: 'high' } }],
    ['conversation', { conversation: 'conv_1' }],
    ['truncation', { truncation: 'auto' }],
    ['input[0].content[0].type', { input: [{ role: 'user', content: [{ type: 'input_image', image_url: 'https://example.invalid/x.png' }] }] }],
    ['input[0].type', { input: [{ type: 'reasoning', summary: [] }] }],
  ])('what magus does not do (%s) → 400 unsupported_feature naming it, nothing queued', async (param, body) => {
    const res = await create({ input: 'hi', ...body });
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toMatchObject({ type: 'invalid_request_error', param, code: 'unsupported_feature' });
    expect(t.plane.published).toHaveLength(0);
  });

  it.each([
    ['input', {}, 'is required'],
    ['input[0].call_id', { input: [{ type: 'function_call', name: 'f', arguments: '{}' }] }, 'is required'],
    ['input[0].role', { input: [{ content: 'hi' }] }, 'is required'],
    [
      'metadata',
      { input: 'x', metadata: Object.fromEntries(Array.from({ length: 17 }, (_v, i) => [`k${i}`, 'v'])) },
      'must be at most 16 string pairs (keys ≤ 64, values ≤ 512 characters)',
    ],
  ])('malformed (%s) → 400 invalid_value naming the field', async (param, body, what) => {
    const res = await t.app.inject({
      method: 'POST',
      url: '/v1/responses',
      headers: auth(t.tokens.alice.token),
      payload: JSON.stringify({ model: 'tiny', ...body }),
    });
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toMatchObject({ param, code: 'invalid_value', message: `Invalid request: ${param} ${what}.` });
  });

  it("chat's structure checks, naming the Responses field", async () => {
    const cases: [object, string, string][] = [
      [
        { input: [{ type: 'function_call_output', call_id: 'nope', output: 'x' }] },
        'input[0].call_id',
        "input[0] answers tool call 'nope', which no earlier assistant message made.",
      ],
      [
        { tools: [{ type: 'function', name: 'f' }], tool_choice: { type: 'function', name: 'g' } },
        'tool_choice.name',
        "tool_choice names 'g', which is not among the tools.",
      ],
      [
        { tools: [{ type: 'function', name: 'f', parameters: { type: 'object', properties: { n: { type: 'number', minimum: 1 } } } }] },
        'tools[0].parameters.properties.n.minimum',
        'tools[0].parameters.properties.n ',
      ],
      [
        { text: { format: { type: 'json_schema', name: 's', schema: { type: 'array', uniqueItems: true } } } },
        'text.format.schema.uniqueItems',
        'at text.format.schema ',
      ],
    ];
    for (const [body, param, message] of cases) {
      const res = await create({ input: 'hi', ...body });
      expect(res.statusCode).toBe(400);
      expect(errorOf(res).param).toBe(param);
      if (message.endsWith('.')) expect(errorOf(res).message).toBe(message);
      else expect(errorOf(res).message).toContain(message);
    }
    expect(t.plane.published).toHaveLength(0);
  });

  it('a model served by distributed-llama only: tools, json_schema and a chain with tool calls → 400 unsupported_feature; plain text is served', async () => {
    const dllamaArtifact = { format: 'dllama', weights: 'q40', files: [] } as unknown as ReadyModel['artifacts'][number];
    const plan = { format: 'dllama', weights: 'q40', topologies: [{ nodes: 2 }] } as unknown as ReadyModel['memory'][number];
    const big: ReadyModel = { ...readyModel('big'), artifacts: [dllamaArtifact], memory: [plan] };
    const advert: RuntimeAdvert = { worker: 'w1', runtime: 'local', formats: ['gguf', 'dllama'], dllamaNodes: 2, at: Date.now() };
    await t.app.close();
    t = await buildTestApp({
      storedResponses: store,
      models: createModelCatalog({
        list: () => Promise.resolve([big, readyModel('tiny')]),
        read: () => Promise.resolve({ models: [big, readyModel('tiny')], runtimes: [{ ...advert, at: Date.now() }] }),
      }),
    });
    for (const [body, param] of [
      [{ tools: [{ type: 'function', name: 'f' }] }, 'tools'],
      [{ text: { format: { type: 'json_schema', name: 's', schema: { type: 'object' } } } }, 'text.format'],
      [{ text: { format: { type: 'json_object' } } }, 'text.format'],
      [
        {
          input: [
            { role: 'user', content: 'x' },
            { type: 'function_call', call_id: 'c', name: 'f', arguments: '{}' },
          ],
        },
        'input[1]',
      ],
    ] as const) {
      const res = await create({ model: 'big', input: 'hi', ...body });
      expect(res.statusCode).toBe(400);
      expect(errorOf(res)).toMatchObject({ param, code: 'unsupported_feature' });
      expect(errorOf(res).message).toContain("distributed-llama's dllama-api");
    }
    expect(t.plane.published).toHaveLength(0);
    answers('Hi.');
    expect((await create({ model: 'big', input: 'hi' })).statusCode).toBe(200);
  });

  it('needs a token and a model it may use', async () => {
    expect(
      (
        await t.app.inject({
          method: 'POST',
          url: '/v1/responses',
          headers: { 'content-type': 'application/json' },
          payload: JSON.stringify({ model: 'tiny', input: 'x' }),
        })
      ).statusCode,
    ).toBe(401);
    const res = await create({ input: 'x' }, t.tokens.narrow.token);
    expect(res.statusCode).toBe(404);
    expect(errorOf(res).code).toBe('model_not_found');
  });
});

describe('background responses (background: true)', () => {
  let cancelled: string[];
  beforeEach(async () => {
    await t.app.close();
    cancelled = [];
    t = await buildTestApp({ storedResponses: store, cancel: (_entry, id) => void cancelled.push(id) }, { storedFrames: true });
  });

  /** The engine streams `words`, then its usage, then ends. */
  function streams(words: string[]): void {
    t.plane.script = () => [
      ...words.map((w, i) => chunk(i, w)),
      { seq: words.length, type: 'chunk', data: { choices: [], usage: { prompt_tokens: 9, completion_tokens: words.length, total_tokens: 9 + words.length } } },
      { seq: words.length + 1, type: 'done' },
    ];
  }
  const get = (id: string, query = '', token = t.tokens.alice.token) =>
    t.app.inject({ method: 'GET', url: `/v1/responses/${id}${query}`, headers: auth(token) });
  const cancel = (id: string, token = t.tokens.alice.token) =>
    t.app.inject({ method: 'POST', url: `/v1/responses/${id}/cancel`, headers: { authorization: `Bearer ${token}` } });
  async function until(id: string, status: string): Promise<ResponseObject> {
    for (let i = 0; i < 200; i++) {
      const r = (await get(id)).json<ResponseObject>();
      if (r.status === status) return r;
      await new Promise((resolve) => setTimeout(resolve, 5));
    }
    throw new Error(`${id} never became ${status}`);
  }

  it('answers at once, queued; the engine is asked for a stream; a poll sees it completed, stored as an ordinary response', async () => {
    streams(['Hel', 'lo']);
    const res = await create({ input: 'Hi', background: true });
    expect(res.statusCode).toBe(200);
    const queued = res.json<ResponseObject>();
    expect(queued).toMatchObject({ status: 'queued', background: true, output: [] });
    const done = await until(queued.id, 'completed');
    expect(done.output).toEqual([
      expect.objectContaining({ type: 'message', id: `msg_${queued.id.slice(5)}_0`, content: [expect.objectContaining({ text: 'Hello' })] }),
    ]);
    expect(done.usage).toMatchObject({ input_tokens: 9, output_tokens: 2 });
    expect(t.plane.chat(0).body).toMatchObject({ stream: true, stream_options: { include_usage: true } });
    expect(store.records.get(queued.id)).toMatchObject({ output: [{ role: 'assistant', content: 'Hello' }] });
    expect(store.records.get(queued.id)!.run).toMatchObject({ instance: t.broker.entry.instance }); // where its frames are, for a stream of it
    // A next turn continues it as any stored response.
    answers('Again');
    const next = await create({ input: 'More', previous_response_id: queued.id });
    expect(next.json<ResponseObject>().status).toBe('completed');
    expect(sent(1).map((m) => m.content)).toEqual(['Hi', 'Hello', 'More']);
  });

  it('streamed: events numbered from 0; streamed again after event N, the same events from N + 1', async () => {
    streams(['One', ' two', ' three']);
    const res = await create({ input: 'Count', background: true, stream: true });
    expect(res.statusCode).toBe(200);
    const all = events(res.body);
    expect(all.map((e) => e.data.sequence_number)).toEqual(all.map((_, i) => i));
    expect(all[0]!.data).toMatchObject({ type: 'response.created', response: { status: 'queued', background: true } });
    expect(all.at(-1)!.data).toMatchObject({ type: 'response.completed', response: { status: 'completed' } });
    const id = (all[0]!.data as unknown as { response: { id: string } }).response.id;
    const again = await get(id, '?stream=true&starting_after=3');
    expect(again.headers['content-type']).toMatch(/^text\/event-stream/);
    expect(events(again.body).map((e) => e.data)).toEqual(all.slice(4).map((e) => e.data));
    expect(events((await get(id, '?stream=true')).body).map((e) => e.data)).toEqual(all.map((e) => e.data));
    // Once its frames are gone: from its record, one delta per item, the same end.
    t.plane.stored.clear();
    const fromRecord = events((await get(id, '?stream=true')).body).map((e) => e.data);
    expect(fromRecord.filter((e) => e.type === 'response.output_text.delta').map((e) => e.delta)).toEqual(['One two three']);
    expect(fromRecord.at(-1)).toEqual(
      all.at(-1)!.data.type === 'response.completed' ? { ...all.at(-1)!.data, sequence_number: fromRecord.length - 1 } : undefined,
    );
  });

  it('cancelled while it runs: stored cancelled, its run stopped and its bridge told; a cancel again changes nothing', async () => {
    t.plane.script = () => 'silence';
    const id = (await create({ input: 'Hi', background: true })).json<ResponseObject>().id;
    for (let i = 0; i < 100 && !store.records.get(id)?.run?.instance; i++) await new Promise((resolve) => setTimeout(resolve, 5));
    const res = await cancel(id);
    expect(res.statusCode).toBe(200);
    expect(res.json<ResponseObject>()).toMatchObject({ id, status: 'cancelled', error: { code: 'cancelled' } });
    expect(cancelled).toContain(t.plane.published[0]!.req.id);
    expect((await get(id)).json<ResponseObject>().status).toBe('cancelled');
    expect((await cancel(id)).json<ResponseObject>().status).toBe('cancelled');
    expect(events((await get(id, '?stream=true')).body).at(-1)!.data).toMatchObject({ type: 'response.failed', response: { status: 'cancelled' } });
    expect((await cancel(id, t.tokens.bob.token)).statusCode).toBe(404);
  });

  it('one whose replica is gone: a poll reads its answer back from the frames and stores it as ended', async () => {
    streams(['Hel', 'lo']);
    const id = (await create({ input: 'Hi', background: true })).json<ResponseObject>().id;
    await until(id, 'completed');
    // As if the replica that ran it had died before storing its end: its record still running.
    const record = store.records.get(id)!;
    store.records.set(id, {
      ...record,
      output: [],
      response: { ...record.response, status: 'in_progress', output: [] },
      run: { request: t.plane.published[0]!.req.id, publishBy: 0, logprobs: false, replica: 'test', pool: 'p', instance: 'i', deadline: Date.now() + 60_000 },
    });
    const read = (await get(id)).json<ResponseObject>();
    expect(read).toMatchObject({ status: 'completed', output: [{ id: `msg_${id.slice(5)}_0`, content: [{ text: 'Hello' }] }] });
    expect(store.records.get(id)).toMatchObject({ response: { status: 'completed' }, output: [{ content: 'Hello' }] });
    // Never queued by its deadline: failed, saying why.
    store.records.set(id, {
      ...record,
      response: { ...record.response, status: 'queued', output: [] },
      run: { request: 'gone', publishBy: Date.now() - 1, logprobs: false },
    });
    const failed = (await get(id)).json<ResponseObject>();
    expect(failed).toMatchObject({ status: 'failed', error: { code: 'server_error' } });
    expect(failed.error!.message).toMatch(/stopped before its request was queued/);
  });

  it('refused without a store; a response not in the background is neither cancelled nor streamed again', async () => {
    expect(errorOf(await create({ input: 'Hi', background: true, store: false }))).toMatchObject({ param: 'store', code: 'invalid_value' });
    answers('Hi');
    const plain = (await create({ input: 'Hi' })).json<ResponseObject>();
    expect(plain.background).toBe(false);
    const notCancelled = errorOf(await cancel(plain.id));
    expect(notCancelled.param).toBe('response_id');
    expect(notCancelled.message).toMatch(/only background responses can be cancelled/);
    expect(errorOf(await get(plain.id, '?stream=true')).message).toMatch(/only background responses can be streamed again/);
  });
});

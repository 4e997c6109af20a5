/**
 * The gateway app through `app.inject`, with fakes of its own interfaces (session broker,
 * publish, response router): validation, size limit before auth, authentication, model lookup,
 * conversation keys, error mapping, streaming, /v1/models, /metrics, health.
 */
// fastify's inject (light-my-request) requires `cookie`, which is ESM-only since v2 and not in
// jest.config's transform list; it is only used to send cookies, which these tests never do.
// (The lasting fix: add 'cookie' to `esmDeps` in jest.config.js.)
jest.mock('cookie', () => ({
  stringifySetCookie: () => {
    throw new Error('cookies are not used in these tests');
  },
}));
import type * as crypto from 'node:crypto';
import { connect, type AddressInfo } from 'node:net';
import { Readable } from 'node:stream';
import type { InjectOptions, LightMyRequestResponse } from 'fastify';
import { ChatCompletionBody } from '../shared/chat';
import type { PoolEntry, ResponseFrame } from '../shared/serving';
import { graced } from './routes/health';
import { waitingForInstance } from './routes/inference';
import { servingOf } from './serving/sessions';
import { SessionError, SessionErrorType } from './plugins/errors';
import { createModelCatalog } from './serving/model-catalog';
import type { ModelObject } from './schemas/models';
import { EmbeddingsBody } from '../shared/embeddings';
import { ResponsesBody } from '../shared/responses';
import type { RuntimeAdvert } from '../shared/runtimes';
import type { ReadyModel } from '../shared/model';
import { buildTestApp, chunk, readyModel, sseEvents, testSettings, type TestApp } from '../test/harness/gateway-app';

let t: TestApp;
afterEach(async () => {
  await t?.app.close();
  jest.restoreAllMocks();
});

const userTurn = (content: string, extra: object = {}) => ({ model: 'tiny', messages: [{ role: 'user', content }], ...extra });

function chat(body: unknown, opts: { token?: string | null; headers?: Record<string, string> } = {}): Promise<LightMyRequestResponse> {
  const headers: Record<string, string> = { 'content-type': 'application/json', ...opts.headers };
  const token = opts.token === undefined ? t.tokens.alice.token : opts.token;
  if (token !== null) headers.authorization = `Bearer ${token}`;
  const req: InjectOptions = { method: 'POST', url: '/v1/chat/completions', headers, payload: typeof body === 'string' ? body : JSON.stringify(body) };
  return t.app.inject(req);
}

interface ErrorJson {
  error: { message: string; type: string; param: string | null; code: string | null };
}
const errorOf = (res: LightMyRequestResponse): ErrorJson['error'] => {
  const body = res.json<ErrorJson>();
  expect(Object.keys(body.error).sort()).toEqual(['code', 'message', 'param', 'type']);
  return body.error;
};

describe('request validation', () => {
  beforeEach(async () => {
    t = await buildTestApp();
  });

  it.each([
    ['missing model', 'model', { messages: [{ role: 'user', content: 'hi' }] }],
    ['missing messages', 'messages', { model: 'tiny' }],
    ['empty messages', 'messages', { model: 'tiny', messages: [] }],
    ['bad role', 'messages[0].role', { model: 'tiny', messages: [{ role: 'wizard', content: 'hi' }] }],
    ['missing content', 'messages[1].content', { model: 'tiny', messages: [{ role: 'user', content: 'a' }, { role: 'user' }] }],
    ['string max_tokens (no coercion)', 'max_tokens', userTurn('hi', { max_tokens: '12' })],
    ['temperature out of range', 'temperature', userTurn('hi', { temperature: 3 })],
    ['n < 1', 'n', userTurn('hi', { n: 0 })],
    ['an empty stop text (the engines refuse it)', 'stop', userTurn('hi', { stop: ['x', ''] })],
    ['missing role', 'messages[0].role', { model: 'tiny', messages: [{ content: 'hi' }] }],
    ['role not a string', 'messages[0].role', { model: 'tiny', messages: [{ role: 5, content: 'hi' }] }],
    [
      'null user content',
      'messages[1].content',
      {
        model: 'tiny',
        messages: [
          { role: 'assistant', content: 'hello' },
          { role: 'user', content: null },
        ],
      },
    ],
    [
      'null system content',
      'messages[0].content',
      {
        model: 'tiny',
        messages: [
          { role: 'system', content: null },
          { role: 'user', content: 'hi' },
        ],
      },
    ],
    [
      'null assistant content without tool calls',
      'messages[0].content',
      {
        model: 'tiny',
        messages: [
          { role: 'assistant', content: null },
          { role: 'user', content: 'hi' },
        ],
      },
    ],
    [
      'null assistant content beside an empty tool_calls',
      'messages[0].content',
      {
        model: 'tiny',
        messages: [
          { role: 'assistant', content: null, tool_calls: [] },
          { role: 'user', content: 'hi' },
        ],
      },
    ],
    ['stream not boolean', 'stream', userTurn('hi', { stream: 'yes' })],
  ])('%s → 400 naming %s', async (_name, param, body) => {
    const res = await chat(body);
    expect(res.statusCode).toBe(400);
    const e = errorOf(res);
    expect(e).toMatchObject({ type: 'invalid_request_error', param });
    expect(e.message).toContain(param);
    expect(t.broker.calls).toHaveLength(0);
  });

  it.each([
    ['functions', { functions: [{ name: 'f', parameters: {} }] }],
    ['n', { n: 5 }],
    ['logprobs', { logprobs: true, tools: [{ type: 'function', function: { name: 'f', parameters: {} } }] }],
  ])('a different kind of answer (%s) → 400 unsupported_feature, not plain text', async (param, extra) => {
    const res = await chat(userTurn('hi', extra));
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toMatchObject({ type: 'invalid_request_error', param, code: 'unsupported_feature' });
    expect(t.broker.calls).toHaveLength(0);
  });

  it.each([
    ['tools', { tools: 'f' }, 'must be null or a list of up to 128 function tools'],
    ['functions', { functions: {} }, 'must be null or an empty list'],
    ['response_format.type', { response_format: {} }, 'is required'],
    ['response_format.type', { response_format: { type: 5 } }, 'must be one of "text", "json_object", "json_schema"'],
    [
      'response_format',
      { response_format: 'json' },
      'must be null, {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema"}}',
    ],
    ['logprobs', { logprobs: 'yes' }, 'must be a boolean or null'],
    ['top_logprobs', { logprobs: true, top_logprobs: 21 }, 'must be an integer from 0 to 20 or null'],
    ['n', { n: 0 }, 'must be >= 1'],
  ])('those fields malformed (%s) → 400 invalid_value, saying what they must be', async (param, extra, what) => {
    const res = await chat(userTurn('hi', extra));
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toEqual({ type: 'invalid_request_error', param, code: 'invalid_value', message: `Invalid request: ${param} ${what}.` });
  });

  it('their empty, plain or null forms are fine: no tools, text format, no logprobs, one choice', async () => {
    const res = await chat(userTurn('hi', { tools: [], functions: [], response_format: { type: 'text' }, logprobs: false, tool_choice: 'none', n: 1 }));
    expect(res.statusCode).toBe(200);
    const nulls = await chat(userTurn('hi', { tools: null, functions: null, response_format: null, logprobs: null }));
    expect(nulls.statusCode).toBe(200);
  });

  it.each([
    ['user', { role: 'user', content: null }, 'messages[0].content must be a string or a list of text parts'],
    ['system', { role: 'system', content: null }, 'messages[0].content must be a string or a list of text parts'],
    [
      'assistant, no tool calls',
      { role: 'assistant', content: null },
      'messages[0].content must be a string or a list of text parts (null only beside tool_calls or function_call)',
    ],
  ])('null content (%s) → 400 invalid_value naming the field and what it must be', async (_who, message, text) => {
    const res = await chat({ model: 'tiny', messages: [message, { role: 'user', content: 'hi' }] });
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toEqual({ type: 'invalid_request_error', code: 'invalid_value', param: 'messages[0].content', message: `Invalid request: ${text}.` });
    expect(t.broker.calls).toHaveLength(0);
  });

  it('a role outside system, user, assistant, tool → 400 listing them', async () => {
    const res = await chat({ model: 'tiny', messages: [{ role: 'function', name: 'f', content: '42' }] });
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toMatchObject({
      param: 'messages[0].role',
      message: 'Invalid request: messages[0].role must be one of "system", "user", "assistant", "tool".',
    });
  });

  it("forwards an assistant's tool calls (its null content empty) and the tool results answering them; function_call is history only", async () => {
    const call = { id: 'c1', type: 'function', function: { name: 'f', arguments: '{"x":1}' } };
    const res = await chat({
      model: 'tiny',
      n: 1,
      messages: [
        { role: 'user', content: 'hi' },
        { role: 'assistant', content: null, tool_calls: [call] },
        {
          role: 'tool',
          tool_call_id: 'c1',
          content: [
            { type: 'text', text: '4' },
            { type: 'text', text: '2' },
          ],
        },
        { role: 'assistant', content: null, function_call: { name: 'f', arguments: '{}' } },
        { role: 'assistant', content: 'text beside calls', tool_calls: [] },
        { role: 'user', content: 'again' },
      ],
    });
    expect(res.statusCode).toBe(200);
    expect(t.plane.chat(0).body.messages).toEqual([
      { role: 'user', content: 'hi' },
      { role: 'assistant', content: '', tool_calls: [call] },
      { role: 'tool', content: '42', tool_call_id: 'c1' },
      { role: 'assistant', content: '' },
      { role: 'assistant', content: 'text beside calls' },
      { role: 'user', content: 'again' },
    ]);
  });

  it('tools, tool_choice and parallel_tool_calls are forwarded as sent', async () => {
    const tools = [
      { type: 'function', function: { name: 'get_weather', description: 'd', parameters: { type: 'object', properties: { city: { type: 'string' } } } } },
    ];
    const res = await chat(userTurn('hi', { tools, tool_choice: { type: 'function', function: { name: 'get_weather' } }, parallel_tool_calls: false }));
    expect(res.statusCode).toBe(200);
    expect(t.plane.chat(0).body).toMatchObject({ tools, tool_choice: { type: 'function', function: { name: 'get_weather' } }, parallel_tool_calls: false });
  });

  it.each([
    [
      'a tool result answering no earlier call',
      {
        messages: [
          { role: 'user', content: 'hi' },
          { role: 'tool', tool_call_id: 'nope', content: 'x' },
        ],
      },
      'messages[1].tool_call_id',
      'invalid_value',
    ],
    [
      'tool_choice naming no tool',
      { tools: [{ type: 'function', function: { name: 'f' } }], tool_choice: { type: 'function', function: { name: 'g' } } },
      'tool_choice.function.name',
      'invalid_value',
    ],
    ['tool_choice required without tools', { tool_choice: 'required' }, 'tool_choice', 'invalid_value'],
    [
      'two tools of one name',
      {
        tools: [
          { type: 'function', function: { name: 'f' } },
          { type: 'function', function: { name: 'f' } },
        ],
      },
      'tools[1].function.name',
      'invalid_value',
    ],
    [
      'parameters the grammar cannot enforce',
      { tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'string', pattern: 'x' } } }] },
      'tools[0].function.parameters.pattern',
      'unsupported_schema',
    ],
    ['a bad tool name', { tools: [{ type: 'function', function: { name: 'has space' } }] }, 'tools[0].function.name', 'invalid_value'],
  ])('tools: %s → 400 naming %s, nothing queued', async (_what, extra, param, code) => {
    const res = await chat({ ...userTurn('hi'), ...extra });
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toMatchObject({ type: 'invalid_request_error', param, code });
    expect(t.plane.published).toHaveLength(0);
  });

  it.each([
    ['a bare CR', 'x-bad: a\rb'],
    ['a bare LF', 'x-bad: a\nb: c'],
    ['a NUL', 'x-bad: a\u0000b'],
  ])("a header with %s (refused by Node's HTTP parser) → 400 in OpenAI's error shape", async (_what, header) => {
    await t.app.listen({ host: '127.0.0.1', port: 0 });
    const { port } = t.app.server.address() as AddressInfo;
    const raw = await new Promise<string>((resolve, reject) => {
      const socket = connect({ host: '127.0.0.1', port }, () => {
        socket.write(`POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n${header}\r\nContent-Length: 2\r\n\r\n{}`);
      });
      let got = '';
      socket.setEncoding('utf8');
      socket.on('data', (d: string) => (got += d));
      socket.on('end', () => resolve(got));
      socket.on('error', reject);
    });
    const [head, body] = raw.split('\r\n\r\n', 2) as [string, string];
    expect(head).toMatch(/^HTTP\/1\.1 400 Bad Request\r\n/);
    expect(head.toLowerCase()).toContain('content-type: application/json');
    expect(JSON.parse(body)).toEqual({
      error: { message: expect.stringContaining('not valid HTTP') as string, type: 'invalid_request_error', param: null, code: 'invalid_http_request' },
    });
    expect(t.broker.calls).toHaveLength(0);
  });

  it('asks engines for usage on every stream, never on a non-streamed answer', async () => {
    expect((await chat(userTurn('hi', { stream: true, stream_options: { include_usage: true } }))).statusCode).toBe(200);
    expect((await chat(userTurn('hi', { stream_options: { include_usage: true } }))).statusCode).toBe(200);
    expect((await chat(userTurn('hi', { stream: true, stream_options: null }))).statusCode).toBe(200);
    expect(t.plane.published.map((_, i) => t.plane.chat(i).body.stream_options)).toEqual([{ include_usage: true }, undefined, { include_usage: true }]);
  });

  it("relays cached_tokens; a stream's usage chunk only to clients that asked; /metrics counts prompt and cached tokens of every answer", async () => {
    const usage = (prompt: number, cached: number) => ({
      prompt_tokens: prompt,
      completion_tokens: 1,
      total_tokens: prompt + 1,
      prompt_tokens_details: { cached_tokens: cached },
    });
    const usageChunk = (seq: number, prompt: number, cached: number): ResponseFrame => ({
      seq,
      type: 'chunk',
      data: { id: 'chatcmpl-x', object: 'chat.completion.chunk', created: 1, model: 'tiny', choices: [], usage: usage(prompt, cached) },
    });
    t.plane.script = (req) =>
      req.kind !== 'embeddings' && req.body.stream
        ? [chunk(0, 'a'), usageChunk(1, 40, 30), { seq: 2, type: 'done' }]
        : [{ seq: 0, type: 'done', data: { id: 'chatcmpl-y', object: 'chat.completion', choices: [], usage: usage(50, 45) } }];

    const whole = await chat(userTurn('hi'));
    expect(whole.json()).toMatchObject({ usage: usage(50, 45) });
    const asked = sseEvents((await chat(userTurn('hi', { stream: true, stream_options: { include_usage: true } }))).body);
    expect(asked.at(-2)).toMatchObject({ choices: [], usage: usage(40, 30) });
    const unasked = sseEvents((await chat(userTurn('hi', { stream: true }))).body);
    expect(unasked).toHaveLength(2); // the text chunk and [DONE]
    expect(JSON.stringify(unasked)).not.toContain('usage');

    const metrics = (await t.app.inject({ method: 'GET', url: '/metrics' })).body;
    expect(metrics).toContain('magus_gateway_prompt_tokens_total{model="default/tiny"} 130');
    expect(metrics).toContain('magus_gateway_cached_prompt_tokens_total{model="default/tiny"} 105');
  });

  it('rejects malformed JSON and a bad X-Session-Id with 400', async () => {
    const bad = await chat('{"model": "tiny", ');
    expect(bad.statusCode).toBe(400);
    expect(errorOf(bad).type).toBe('invalid_request_error');
    const sid = await chat(userTurn('hi'), { headers: { 'x-session-id': 'no spaces allowed' } });
    expect(sid.statusCode).toBe(400);
    expect(errorOf(sid).param).toBe('x-session-id');
  });

  it('accepts OpenAI text parts and fields it ignores, forwarding only what engines take', async () => {
    const res = await chat({
      model: 'tiny',
      messages: [
        {
          role: 'system',
          content: [
            { type: 'text', text: 'be ' },
            { type: 'text', text: 'brief' },
          ],
        },
        { role: 'user', content: 'hi', name: 'ann' },
      ],
      max_completion_tokens: 5,
      temperature: 0,
      seed: 3,
      stop: ['\n'],
      user: 'u1',
      presence_penalty: 0.5,
      logit_bias: { '1': 2 },
    });
    expect(res.statusCode).toBe(200);
    const { req, subject } = t.plane.published[0]!;
    expect(subject).toBe(t.broker.entry.subject);
    expect(req.replyTo).toBe(`magus.res.${req.id}`);
    expect(req.deadline).toBeGreaterThan(Date.now());
    expect(req.body).toEqual({
      model: 'tiny',
      messages: [
        { role: 'system', content: 'be brief' },
        { role: 'user', content: 'hi' },
      ],
      stream: false,
      max_tokens: 5,
      temperature: 0,
      seed: 3,
      stop: ['\n'],
      presence_penalty: 0.5,
    });
  });

  it('log-probabilities: logprobs and top_logprobs are forwarded; top_logprobs alone is a 400', async () => {
    expect((await chat(userTurn('hi', { logprobs: true, top_logprobs: 3 }))).statusCode).toBe(200);
    expect(t.plane.published[0]!.req.body).toMatchObject({ logprobs: true, top_logprobs: 3 });
    const res = await chat(userTurn('hi', { top_logprobs: 3 }));
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toMatchObject({ param: 'top_logprobs', code: 'invalid_value' });
    expect(t.plane.published).toHaveLength(1);
  });

  it('structured output: json_object and json_schema are forwarded as sent', async () => {
    const schema = { type: 'object', properties: { city: { type: 'string' } }, required: ['city'], title: 'Answer' };
    const format = { type: 'json_schema', json_schema: { name: 'answer', schema, strict: true } };
    expect((await chat(userTurn('hi', { response_format: format }))).statusCode).toBe(200);
    expect(t.plane.chat(0).body.response_format).toEqual(format);
    expect((await chat(userTurn('hi', { response_format: { type: 'json_object' } }))).statusCode).toBe(200);
    expect(t.plane.chat(1).body.response_format).toEqual({ type: 'json_object' });
  });

  it.each([
    [
      'a keyword the grammar cannot enforce',
      { type: 'object', properties: { n: { type: 'array', uniqueItems: true } } },
      'response_format.json_schema.schema.properties.n.uniqueItems',
      "The keyword 'uniqueItems'",
    ],
    ['a required key that is no property', { type: 'object', properties: {}, required: ['x'] }, 'response_format.json_schema.schema.required', "names 'x'"],
    ['a string format the grammar does not know', { type: 'string', format: 'uri' }, 'response_format.json_schema.schema.format', "The keyword 'format'"],
  ])('structured output with %s → 400 unsupported_schema naming where, nothing queued', async (_what, schema, param, says) => {
    const res = await chat(userTurn('hi', { response_format: { type: 'json_schema', json_schema: { name: 's', schema } } }));
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toMatchObject({ type: 'invalid_request_error', code: 'unsupported_schema', param });
    expect(errorOf(res).message).toContain(says);
    expect(t.broker.calls).toHaveLength(0);
    expect(t.plane.published).toHaveLength(0);
  });

  it('structured output: a bad name or an oversized schema → 400 naming the field', async () => {
    await t.app.close();
    t = await buildTestApp({ settings: testSettings({ bodyLimit: 1024 * 1024 }) });
    const badName = await chat(userTurn('hi', { response_format: { type: 'json_schema', json_schema: { name: 'no spaces', schema: { type: 'string' } } } }));
    expect(badName.statusCode).toBe(400);
    expect(errorOf(badName).param).toBe('response_format.json_schema.name');
    const props = Object.fromEntries(Array.from({ length: 200 }, (_, i) => [`p${i}`, { type: 'string', description: 'x'.repeat(400) }]));
    const big = await chat(
      userTurn('hi', { response_format: { type: 'json_schema', json_schema: { name: 's', schema: { type: 'object', properties: props } } } }),
    );
    expect(big.statusCode).toBe(400);
    expect(errorOf(big)).toMatchObject({ param: 'response_format.json_schema.schema', code: 'invalid_value' });
  });
});

describe('body size is checked before authentication', () => {
  beforeEach(async () => {
    t = await buildTestApp({ settings: testSettings({ bodyLimit: 2048 }) });
  });

  it('answers 413 to an oversized body without a token', async () => {
    const res = await chat(userTurn('x'.repeat(4096)), { token: null });
    expect(res.statusCode).toBe(413);
    expect(errorOf(res)).toMatchObject({ code: 'request_too_large', type: 'invalid_request_error' });
  });

  it('answers 413 to an oversized body with a wrong token', async () => {
    const res = await chat(userTurn('x'.repeat(4096)), { token: 'mgs_alice_wrong' });
    expect(res.statusCode).toBe(413);
  });

  it('answers 413 to a body without content-length once the parser passes the limit', async () => {
    const res = await t.app.inject({
      method: 'POST',
      url: '/v1/chat/completions',
      headers: { authorization: `Bearer ${t.tokens.alice.token}`, 'content-type': 'application/json' },
      payload: Readable.from([Buffer.from(JSON.stringify(userTurn('x'.repeat(4096))))]), // a stream: sent chunked
    });
    expect(res.statusCode).toBe(413);
    expect(errorOf(res).code).toBe('request_too_large');
  });
});

describe('authentication', () => {
  beforeEach(async () => {
    t = await buildTestApp();
  });

  it.each([
    ['no header', null],
    ['wrong secret', 'mgs_alice_notthesecret'],
    ['unknown id', 'mgs_mallory_whatever'],
    ['not a magus token', 'sk-abc'],
  ])('%s → 401 invalid_api_key', async (_name, token) => {
    const res = await chat(userTurn('hi'), { token });
    expect(res.statusCode).toBe(401);
    expect(errorOf(res)).toMatchObject({ type: 'invalid_request_error', code: 'invalid_api_key', param: null });
    expect(t.broker.calls).toHaveLength(0);
  });

  it('compares a digest in constant time on every path that presents a token', async () => {
    // The module object itself (a namespace import is a copy under swc's CommonJS interop).
    const spy = jest.spyOn(jest.requireActual<typeof crypto>('node:crypto'), 'timingSafeEqual');
    for (const token of ['mgs_alice_notthesecret', 'mgs_mallory_whatever', 'sk-abc', t.tokens.alice.token]) {
      spy.mockClear();
      await chat(userTurn('hi'), { token });
      expect(spy).toHaveBeenCalledTimes(1);
      const [a, b] = spy.mock.calls[0]!;
      expect([(a as Buffer).length, (b as Buffer).length]).toEqual([32, 32]);
    }
  });

  it('serves anonymous callers only when allowed, and still rejects a bad token then', async () => {
    await t.app.close();
    t = await buildTestApp({ settings: testSettings({ allowAnonymous: true }) });
    expect((await chat(userTurn('hi'), { token: null })).statusCode).toBe(200);
    expect(t.broker.calls[0]!.owner).toBe('anonymous');
    expect((await chat(userTurn('hi'), { token: 'mgs_alice_wrong' })).statusCode).toBe(401);
  });

  it('never logs the token', async () => {
    await chat(userTurn('hi'));
    await chat(userTurn('hi'), { token: 'mgs_alice_notthesecret' });
    const all = t.log.lines.join('\n');
    expect(t.log.lines.length).toBeGreaterThan(0);
    expect(all).not.toContain(t.tokens.alice.token);
    expect(all).not.toContain('notthesecret');
  });

  it("one access-log line per request: fastify's own pair is off", async () => {
    const before = t.log.lines.length;
    await chat(userTurn('hi'));
    const lines = t.log.lines.slice(before).map((l) => JSON.parse(l) as { msg: string; res?: { statusCode: number } });
    expect(lines.filter((l) => l.msg === 'request completed').map((l) => l.res?.statusCode)).toEqual([200]);
    expect(lines.filter((l) => l.msg === 'incoming request')).toEqual([]);
  });
});

describe('models', () => {
  beforeEach(async () => {
    t = await buildTestApp({ models: [readyModel('tiny'), readyModel('other-model'), readyModel('tiny', 'team-b')] });
  });

  it('unknown model → 404 model_not_found', async () => {
    const res = await chat({ model: 'gpt-17', messages: [{ role: 'user', content: 'hi' }] });
    expect(res.statusCode).toBe(404);
    expect(errorOf(res)).toMatchObject({ code: 'model_not_found', param: 'model', type: 'invalid_request_error' });
  });

  it('a model outside the token’s list is not found either', async () => {
    const res = await chat(userTurn('hi'), { token: t.tokens.narrow.token });
    expect(res.statusCode).toBe(404);
    expect(errorOf(res).code).toBe('model_not_found');
  });

  it('GET /v1/models lists names once, OpenAI-shaped, filtered by token', async () => {
    const res = await t.app.inject({ method: 'GET', url: '/v1/models', headers: { authorization: `Bearer ${t.tokens.alice.token}` } });
    expect(res.statusCode).toBe(200);
    expect(res.json()).toEqual({
      object: 'list',
      data: [
        // No artifacts, no runtime adverts (a hand-made entry): nothing rules llama.cpp out.
        {
          id: 'tiny',
          object: 'model',
          created: Date.parse('2025-01-02T03:04:05Z') / 1000,
          owned_by: 'magus',
          servable: true,
          engines: [],
          capabilities: ['json_schema', 'tools', 'logprobs', 'embeddings', 'completions'],
          sampling: {},
        },
        {
          id: 'other-model',
          object: 'model',
          created: Date.parse('2025-01-02T03:04:05Z') / 1000,
          owned_by: 'magus',
          servable: true,
          engines: [],
          capabilities: ['json_schema', 'tools', 'logprobs', 'embeddings', 'completions'],
          sampling: {},
        },
      ],
    });
    const narrow = await t.app.inject({ method: 'GET', url: '/v1/models', headers: { authorization: `Bearer ${t.tokens.narrow.token}` } });
    expect(narrow.json<{ data: { id: string }[] }>().data.map((m) => m.id)).toEqual(['other-model']);
    expect((await t.app.inject({ method: 'GET', url: '/v1/models' })).statusCode).toBe(401);
  });

  it("GET /v1/models says whether each model's pool serves, starts (and for how long) or fails, from its published view", async () => {
    const views: Record<string, PoolEntry | undefined> = {
      tiny: { instances: [], leasesPerInstance: 1, updatedAt: Date.now(), starting: [{ instance: 'tiny-1', since: Date.now() - 12_000 }] },
      'other-model': { instances: [], leasesPerInstance: 1, updatedAt: Date.now(), failing: 'NoFit: no node has 9 GiB' },
    };
    t.broker.serving = (m) => servingOf(views[m.name], Date.now());
    const res = await t.app.inject({ method: 'GET', url: '/v1/models', headers: { authorization: `Bearer ${t.tokens.alice.token}` } });
    const served = Object.fromEntries(res.json<{ data: ModelObject[] }>().data.map((m) => [m.id, m.serving]));
    expect(served).toEqual({
      tiny: { status: 'starting', instances: 0, starting: 1, starting_for_s: 12 },
      'other-model': { status: 'failing', instances: 0, starting: 0, failing: 'NoFit: no node has 9 GiB' },
    });
    views.tiny = { instances: [{ instance: 'tiny-1', subject: 's', leases: 0 }], leasesPerInstance: 1, updatedAt: Date.now() };
    views['other-model'] = undefined;
    const one = await t.app.inject({ method: 'GET', url: '/v1/models/tiny', headers: { authorization: `Bearer ${t.tokens.alice.token}` } });
    expect(one.json<ModelObject>().serving).toEqual({ status: 'ready', instances: 1, starting: 0 });
    const other = await t.app.inject({ method: 'GET', url: '/v1/models/other-model', headers: { authorization: `Bearer ${t.tokens.alice.token}` } });
    expect(other.json<ModelObject>().serving).toEqual({ status: 'idle', instances: 0, starting: 0 });
  });

  it('a turn waiting for an instance is told what it waits for, from the pool view', () => {
    const now = Date.now();
    const starting = servingOf({ instances: [], leasesPerInstance: 1, updatedAt: now, starting: [{ instance: 'a', since: now - 4_000 }] }, now);
    expect(waitingForInstance(starting, 'default/tiny')).toBe(
      'engine starting: an instance of default/tiny has been starting for 4 s; the answer begins once it serves',
    );
    expect(waitingForInstance(servingOf(undefined, now), 'default/tiny')).toBe(
      'waiting for an instance of default/tiny to take the request (one may be starting)',
    );
    expect(waitingForInstance(servingOf({ instances: [], leasesPerInstance: 1, updatedAt: now, failing: 'NoFit' }, now), 'm')).toBe(
      'no instance of m starts (NoFit); waiting for the next try',
    );
  });

  it('capabilities follow the engines the live runtimes would run a model on; structured output for distributed-llama only is refused before anything is queued', async () => {
    const base = readyModel('big');
    const dllamaArtifact = { format: 'dllama', weights: 'q40', files: [] } as unknown as ReadyModel['artifacts'][number];
    const ggufArtifact = { format: 'gguf', weights: 'q80', files: [] } as unknown as ReadyModel['artifacts'][number];
    const plan = { format: 'dllama', weights: 'q40', topologies: [{ nodes: 2 }] } as unknown as ReadyModel['memory'][number];
    const big: ReadyModel = { ...base, artifacts: [dllamaArtifact], memory: [plan] };
    const both: ReadyModel = { ...readyModel('both'), artifacts: [dllamaArtifact, ggufArtifact], memory: [plan] };
    const now = Date.now();
    const runtimes: RuntimeAdvert[] = [{ worker: 'w1', runtime: 'local', formats: ['gguf', 'dllama'], dllamaNodes: 2, at: now }];
    await t.app.close();
    t = await buildTestApp({
      models: createModelCatalog({
        list: () => Promise.resolve([big, both]),
        read: () => Promise.resolve({ models: [big, both], runtimes: [{ ...runtimes[0]!, at: Date.now() }] }),
      }),
    });
    const auth = { authorization: `Bearer ${t.tokens.alice.token}` };
    const listed = (await t.app.inject({ method: 'GET', url: '/v1/models', headers: auth })).json<{ data: ModelObject[] }>().data;
    // The local runtime with distributed-llama on 2 nodes runs both models' q40 split on dllama-api.
    expect(listed.map((m) => [m.id, m.engines, m.capabilities])).toEqual([
      ['big', ['dllama'], []],
      ['both', ['dllama'], []],
    ]);
    const res = await chat({ model: 'big', messages: [{ role: 'user', content: 'hi' }], response_format: { type: 'json_object' } });
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toMatchObject({ type: 'invalid_request_error', param: 'response_format', code: 'unsupported_feature' });
    expect(errorOf(res).message).toContain("distributed-llama's dllama-api");
    expect(t.broker.calls).toHaveLength(0);
    expect(t.plane.published).toHaveLength(0);
    const lp = await chat({ model: 'big', messages: [{ role: 'user', content: 'hi' }], logprobs: true });
    expect(errorOf(lp)).toMatchObject({ param: 'logprobs', code: 'unsupported_feature' });
    expect(t.plane.published).toHaveLength(0);
    expect((await chat({ model: 'big', messages: [{ role: 'user', content: 'hi' }] })).statusCode).toBe(200);
  });

  it('GET /v1/models/:model retrieves one, or 404', async () => {
    const auth = { authorization: `Bearer ${t.tokens.alice.token}` };
    expect((await t.app.inject({ method: 'GET', url: '/v1/models/tiny', headers: auth })).json()).toMatchObject({ id: 'tiny', object: 'model' });
    expect((await t.app.inject({ method: 'GET', url: '/v1/models/nope', headers: auth })).statusCode).toBe(404);
  });

  it('namespace/name reaches a model a bare name does not', async () => {
    await chat({ model: 'team-b/tiny', messages: [{ role: 'user', content: 'hi' }] });
    await chat(userTurn('hi'));
    expect(t.broker.calls.map((c) => c.model.namespace)).toEqual(['team-b', 'default']);
  });
});

describe("a model's sampling defaults", () => {
  const artifact = (sampling?: object) =>
    ({ format: 'gguf', weights: 'q40', converterVersion: 'test', files: [], ...(sampling ? { sampling } : {}) }) as ReadyModel['artifacts'][number];
  // The Model's spec.sampling (temperature, top_p) over what its repository publishes (temperature, top_k, repetition_penalty).
  const tuned: ReadyModel = {
    ...readyModel('tuned'),
    artifacts: [artifact({ temperature: 0.6, top_k: 50, repetition_penalty: 1.1 }), artifact({ temperature: 0.6, top_k: 50, repetition_penalty: 1.1 })],
    sampling: { temperature: 0.2, top_p: 0.9 },
  };
  const published: ReadyModel = { ...readyModel('published'), artifacts: [artifact({ temperature: 0, top_p: 7 })] };
  const auth = () => ({ authorization: `Bearer ${t.tokens.alice.token}` });
  const bodyOf = (i: number) => t.plane.published[i]!.req.body as unknown as Record<string, unknown>;

  beforeEach(async () => {
    t = await buildTestApp({ models: [tuned, published, readyModel('plain')] });
  });

  it('a request that sets no sampling field gets them all: spec.sampling over the repository’s, field by field', async () => {
    expect((await chat({ model: 'tuned', messages: [{ role: 'user', content: 'hi' }] })).statusCode).toBe(200);
    expect(bodyOf(0)).toMatchObject({ temperature: 0.2, top_p: 0.9, top_k: 50, repetition_penalty: 1.1 });
  });

  it("the request's own parameter wins; what it leaves out still comes from the model", async () => {
    expect((await chat({ model: 'tuned', messages: [{ role: 'user', content: 'hi' }], temperature: 1.3 })).statusCode).toBe(200);
    expect(bodyOf(0)).toMatchObject({ temperature: 1.3, top_p: 0.9, top_k: 50, repetition_penalty: 1.1 });
    expect((await chat({ model: 'tuned', messages: [{ role: 'user', content: 'hi' }], temperature: 0, top_p: 1 })).statusCode).toBe(200);
    expect(bodyOf(1)).toMatchObject({ temperature: 0, top_p: 1 });
  });

  it('a model without defaults adds nothing (the engine decides); an invalid stored value is dropped', async () => {
    expect((await chat({ model: 'plain', messages: [{ role: 'user', content: 'hi' }] })).statusCode).toBe(200);
    expect(Object.keys(bodyOf(0)).filter((k) => ['temperature', 'top_p', 'top_k', 'repetition_penalty'].includes(k))).toEqual([]);
    expect((await chat({ model: 'published', messages: [{ role: 'user', content: 'hi' }] })).statusCode).toBe(200);
    expect(bodyOf(1)).toMatchObject({ temperature: 0 });
    expect(bodyOf(1).top_p).toBeUndefined();
  });

  it('text completions and the Responses API get them too; embeddings nothing', async () => {
    t.plane.script = (req) => [{ seq: 0, type: 'done', data: { id: `x-${req.id}`, object: 'chat.completion', created: 1, model: 'tuned', choices: [] } }];
    const post = (url: string, payload: object) => t.app.inject({ method: 'POST', url, headers: { ...auth(), 'content-type': 'application/json' }, payload });
    expect((await post('/v1/completions', { model: 'tuned', prompt: 'hi', top_p: 0.5 })).statusCode).toBe(200);
    expect(t.plane.published[0]!.req.kind).toBe('completions');
    expect(bodyOf(0)).toMatchObject({ temperature: 0.2, top_p: 0.5, top_k: 50, repetition_penalty: 1.1 });
    expect((await post('/v1/responses', { model: 'tuned', input: 'hi', store: false })).statusCode).toBe(200);
    expect(bodyOf(1)).toMatchObject({ temperature: 0.2, top_p: 0.9, top_k: 50, repetition_penalty: 1.1 });
    await post('/v1/embeddings', { model: 'tuned', input: 'hi' });
    expect(t.plane.published[2]!.req.kind).toBe('embeddings');
    expect(bodyOf(2)).toEqual({ model: 'tuned', input: 'hi' });
  });

  it('GET /v1/models shows each model’s effective defaults', async () => {
    const listed = (await t.app.inject({ method: 'GET', url: '/v1/models', headers: auth() })).json<{ data: ModelObject[] }>().data;
    expect(listed.map((m) => [m.id, m.sampling])).toEqual([
      ['tuned', { temperature: 0.2, top_p: 0.9, top_k: 50, repetition_penalty: 1.1 }],
      ['published', { temperature: 0 }],
      ['plain', {}],
    ]);
    expect((await t.app.inject({ method: 'GET', url: '/v1/models/tuned', headers: auth() })).json<ModelObject>().sampling).toEqual({
      temperature: 0.2,
      top_p: 0.9,
      top_k: 50,
      repetition_penalty: 1.1,
    });
  });
});

describe('conversation keys', () => {
  beforeEach(async () => {
    t = await buildTestApp();
  });
  const sys = { role: 'system', content: 'You are terse.' };
  const keyOf = async (messages: object[], opts: { token?: string; headers?: Record<string, string> } = {}) => {
    const res = await chat({ model: 'tiny', messages }, opts);
    expect(res.statusCode).toBe(200);
    return t.broker.calls[t.broker.calls.length - 1]!.conversationKey;
  };

  it('is the same for every turn of a conversation', async () => {
    const k1 = await keyOf([sys, { role: 'user', content: 'first' }]);
    const k2 = await keyOf([sys, { role: 'user', content: 'first' }, { role: 'assistant', content: 'ok' }, { role: 'user', content: 'second' }]);
    expect(k1).toMatch(/^default\.tiny\.[0-9a-f]{64}$/); // its pool, then an HMAC
    expect(k2).toBe(k1);
  });

  it('differs when the system prompt, the first user message, the token or the model differ', async () => {
    const base = await keyOf([sys, { role: 'user', content: 'first' }]);
    const others = [
      await keyOf([
        { role: 'system', content: 'You are verbose.' },
        { role: 'user', content: 'first' },
      ]),
      await keyOf([sys, { role: 'user', content: 'another' }]),
      await keyOf([sys, { role: 'user', content: 'first' }], { token: t.tokens.bob.token }),
      await keyOf([{ role: 'user', content: 'first' }]),
    ];
    const res = await chat({ model: 'other-model', messages: [sys, { role: 'user', content: 'first' }] });
    expect(res.statusCode).toBe(200);
    others.push(t.broker.calls[t.broker.calls.length - 1]!.conversationKey);
    expect(new Set([base, ...others]).size).toBe(6);
  });

  it('X-Session-Id wins over the messages', async () => {
    const headers = { 'x-session-id': 'conv-42' };
    const a = await keyOf([sys, { role: 'user', content: 'first' }], { headers });
    const b = await keyOf([{ role: 'user', content: 'something else' }], { headers });
    const c = await keyOf([sys, { role: 'user', content: 'first' }]);
    expect(b).toBe(a);
    expect(c).not.toBe(a);
    expect(await keyOf([{ role: 'user', content: 'x' }], { headers: { 'x-session-id': 'conv-43' } })).not.toBe(a);
  });
});

describe('round trips over the (fake) data plane', () => {
  beforeEach(async () => {
    t = await buildTestApp();
  });

  it('non-stream: the done frame’s completion is the body', async () => {
    t.plane.script = (req) => [
      {
        seq: 0,
        type: 'done',
        data: {
          id: 'chatcmpl-1',
          object: 'chat.completion',
          created: 5,
          model: 'tiny',
          choices: [{ index: 0, message: { role: 'assistant', content: 'hello' }, finish_reason: 'stop' }],
          usage: { total_tokens: 3 },
          timings: { extra: true },
          echo: req.id,
        },
      },
    ];
    const res = await chat(userTurn('hi'));
    expect(res.statusCode).toBe(200);
    const body = res.json<{ choices: { message: { content: string } }[]; timings: unknown; echo: string }>();
    expect(body.choices[0]!.message.content).toBe('hello');
    expect(body.timings).toEqual({ extra: true }); // engine fields pass through
    expect(res.headers['x-request-id']).toBe(body.echo);
    expect(t.plane.listening).toBe(0);
  });

  it('stream: SSE chunks in seq order, duplicates and a redelivered restart dropped, then [DONE]', async () => {
    t.plane.script = () => [
      chunk(1, 'b'),
      chunk(0, 'a'),
      chunk(0, 'a'),
      chunk(2, 'c'),
      chunk(0, 'a'),
      chunk(1, 'b'),
      chunk(4, 'e'),
      chunk(3, 'd'),
      { seq: 5, type: 'done' },
    ];
    const res = await chat(userTurn('hi', { stream: true }));
    expect(res.statusCode).toBe(200);
    expect(res.headers['content-type']).toBe('text/event-stream; charset=utf-8');
    expect(res.headers['x-request-id']).toBe(t.plane.published[0]!.req.id);
    const events = sseEvents(res.body);
    expect(events[events.length - 1]).toBe('[DONE]');
    const text = events.slice(0, -1).map((e) => (e as { choices: { delta: { content: string } }[] }).choices[0]!.delta.content);
    expect(text.join('')).toBe('abcde');
    expect(res.body.endsWith('data: [DONE]\n\n')).toBe(true);
    expect(t.plane.chat(0).body.stream).toBe(true);
  });

  it('stream: keep-alive comments while the session is cold-starting', async () => {
    await t.app.close();
    t = await buildTestApp({ settings: testSettings({ keepAliveMs: 50 }) });
    t.broker.impl = () => new Promise((resolve) => setTimeout(() => resolve(t.broker.entry), 230));
    t.plane.script = () => [chunk(0, 'a'), { seq: 1, type: 'done' }];
    const res = await chat(userTurn('hi', { stream: true }));
    expect(res.statusCode).toBe(200);
    // Each says what the answer waits for: never a silent wait.
    const comments = res.body.split('\n\n').filter((e) => e.startsWith(': keep-alive'));
    expect(comments.length).toBeGreaterThanOrEqual(2); // ~4 expected; timers may run late on a busy machine
    expect(comments[0]).toMatch(/^: keep-alive: waiting for an instance of default\/\S+ to take the request \(one may be starting\)$/);
    expect(res.body.indexOf(': keep-alive')).toBeLessThan(res.body.indexOf('data: '));
    expect(sseEvents(res.body)).toHaveLength(2);
  });

  it('stream: a placement unavailable after the keep-alives went out (an election) is tried again, not an error event', async () => {
    await t.app.close();
    t = await buildTestApp({ settings: testSettings({ keepAliveMs: 50 }) });
    let tries = 0;
    t.broker.impl = () =>
      new Promise((resolve, reject) =>
        setTimeout(
          () => (++tries < 3 ? reject(new SessionError(SessionErrorType.Unavailable, 'the sessions bucket has no leader', 1)) : resolve(t.broker.entry)),
          120,
        ),
      );
    t.plane.script = () => [chunk(0, 'a'), { seq: 1, type: 'done' }];
    const res = await chat(userTurn('hi', { stream: true }));
    expect(res.statusCode).toBe(200);
    expect(tries).toBe(3);
    expect(res.body).not.toContain('"error"');
    expect(sseEvents(res.body)).toHaveLength(2);
    expect(res.body.endsWith('data: [DONE]\n\n')).toBe(true);
    expect((await t.app.inject({ method: 'GET', url: '/metrics' })).body).toContain('magus_gateway_placement_retries_total 2');
    // Not committed yet (refused before any keep-alive): a 503 the client retries, as before.
    t.broker.impl = () => Promise.reject(new SessionError(SessionErrorType.Unavailable, 'no leader', 1));
    expect((await chat(userTurn('hi', { stream: true }))).statusCode).toBe(503);
  });
});

describe('error mapping', () => {
  beforeEach(async () => {
    t = await buildTestApp();
  });

  it('an engine 4xx before the stream started passes through', async () => {
    t.plane.script = () => [
      {
        seq: 0,
        type: 'error',
        error: { status: 400, message: 'prompt is longer than the context (4096 tokens)', type: 'invalid_request_error', code: 'context_length_exceeded' },
      },
    ];
    for (const stream of [false, true]) {
      const res = await chat(userTurn('hi', { stream }));
      expect(res.statusCode).toBe(400);
      expect(errorOf(res)).toEqual({
        message: 'prompt is longer than the context (4096 tokens)',
        type: 'invalid_request_error',
        param: null,
        code: 'context_length_exceeded',
      });
    }
  });

  it('an engine 5xx is answered without its internals', async () => {
    t.plane.script = () => [
      { seq: 0, type: 'error', error: { status: 500, message: 'CUDA error at /src/ggml.c:1234 secret-host', type: 'engine', code: null } },
    ];
    const res = await chat(userTurn('hi'));
    expect(res.statusCode).toBe(500);
    const e = errorOf(res);
    expect(e.type).toBe('server_error');
    expect(e.message).not.toContain('CUDA');
    expect(e.message).not.toContain('secret-host');
    expect(e.message).toContain(String(res.headers['x-request-id']));
    expect(t.log.lines.some((l) => l.includes('secret-host'))).toBe(true); // details stay in the log
  });

  it('an error after the stream started becomes an SSE error event, then the stream closes', async () => {
    t.plane.script = () => [chunk(0, 'a'), { seq: 1, type: 'error', error: { status: 503, message: 'engine crashed: segfault', type: 'x', code: null } }];
    const res = await chat(userTurn('hi', { stream: true }));
    expect(res.statusCode).toBe(200);
    const events = sseEvents(res.body);
    expect(events).toHaveLength(2);
    const last = events[1] as ErrorJson;
    expect(last.error).toMatchObject({ type: 'server_error', code: 'engine_error' });
    expect(last.error.message).not.toContain('segfault');
    expect(res.body).not.toContain('[DONE]');
  });

  it('backlog full (check or broker error) → 429 with Retry-After', async () => {
    await t.app.close();
    let full = true;
    t = await buildTestApp({ backlogFull: () => (full ? { retryAfterSec: 12 } : undefined) });
    const res = await chat(userTurn('hi'));
    expect(res.statusCode).toBe(429);
    expect(res.headers['retry-after']).toBe('12');
    expect(errorOf(res).code).toBe('backlog_full');
    expect(t.broker.calls).toHaveLength(0);
    full = false;
    t.broker.impl = () =>
      Promise.reject(Object.assign(new Error('update failed'), { cause: new SessionError(SessionErrorType.BacklogFull, 'queue of tiny is full') }));
    const viaBroker = await chat(userTurn('hi'));
    expect(viaBroker.statusCode).toBe(429);
    expect(viaBroker.headers['retry-after']).toBe('7');
  });

  it('a request larger than a NATS message may be (max_payload) → 413 naming the limit, before any placement', async () => {
    await t.app.close();
    t = await buildTestApp({ maxMessageBytes: () => 4096 });
    const res = await chat(userTurn('x'.repeat(5000)));
    expect(res.statusCode).toBe(413);
    expect(errorOf(res)).toMatchObject({ type: 'invalid_request_error', code: 'request_too_large' });
    expect(errorOf(res).message).toContain("(4096 bytes, the NATS servers' max_payload)");
    expect(t.broker.calls).toHaveLength(0);
    // Well under it: served.
    expect((await chat(userTurn('x'.repeat(1000)))).statusCode).toBe(200);
  });

  it('what a new conversation needs is unreachable (Temporal) → 503 unavailable with Retry-After, details hidden', async () => {
    t.broker.impl = () =>
      Promise.reject(
        Object.assign(new Error('start failed'), { cause: new SessionError(SessionErrorType.Unavailable, 'Temporal at 10.0.0.7:7233 is unreachable', 4) }),
      );
    const res = await chat(userTurn('hi'));
    expect(res.statusCode).toBe(503);
    expect(res.headers['retry-after']).toBe('4');
    expect(errorOf(res)).toMatchObject({ type: 'server_error', code: 'unavailable', param: null });
    expect(errorOf(res).message).toMatch(/^A new conversation cannot be started right now; retry later\. \(request id /);
    expect(errorOf(res).message).not.toContain('10.0.0.7');
    // Logged as what it is: a warning with the reason, no stack.
    const line = t.log.lines.map((l) => JSON.parse(l) as { level: number; reason?: string; err?: unknown }).find((l) => l.reason !== undefined);
    expect(line).toMatchObject({ level: 40, reason: 'start failed: Temporal at 10.0.0.7:7233 is unreachable' });
    expect(line?.err).toBeUndefined();
  });

  it('no instance can start → 503 with Retry-After (broker error, or cold-start timeout)', async () => {
    t.broker.impl = () => Promise.reject(new SessionError(SessionErrorType.NoCapacity, 'no node has 40 GiB free', 30));
    const res = await chat(userTurn('hi'));
    expect(res.statusCode).toBe(503);
    expect(res.headers['retry-after']).toBe('30');
    expect(errorOf(res)).toMatchObject({ type: 'server_error', code: 'no_capacity' });
    expect(errorOf(res).message).not.toContain('40 GiB');

    await t.app.close();
    t = await buildTestApp({ settings: testSettings({ coldStartTimeoutMs: 100 }) });
    let aborted = false;
    t.broker.impl = (req) =>
      new Promise((_, reject) => {
        req.signal.addEventListener('abort', () => {
          aborted = true;
          reject(new Error('AbortError'));
        });
      });
    const slow = await chat(userTurn('hi'));
    expect(slow.statusCode).toBe(503);
    expect(errorOf(slow).code).toBe('no_capacity');
    expect(aborted).toBe(true);
  });

  it('an unexpected broker failure → 500 with a generic message', async () => {
    t.broker.impl = () => Promise.reject(new Error('temporal at 10.0.0.7:7233 refused: password=hunter2'));
    const res = await chat(userTurn('hi'));
    expect(res.statusCode).toBe(500);
    expect(res.body).not.toContain('hunter2');
    expect(res.body).not.toContain('10.0.0.7');
    expect(errorOf(res).type).toBe('server_error');
  });

  it('no frame within requestTimeoutMs → 504', async () => {
    await t.app.close();
    t = await buildTestApp({ settings: testSettings({ requestTimeoutMs: 150, gapTimeoutMs: 50 }) });
    t.plane.script = () => 'silence';
    const res = await chat(userTurn('hi'));
    expect(res.statusCode).toBe(504);
    expect(errorOf(res)).toMatchObject({ type: 'server_error', code: 'timeout' });
    expect(t.plane.listening).toBe(0);
  });

  it('a missing frame that never arrives → 502', async () => {
    t.plane.script = () => [chunk(0, 'a'), chunk(2, 'c'), { seq: 3, type: 'done' }];
    const res = await chat(userTurn('hi'));
    expect(res.statusCode).toBe(502);
    expect(errorOf(res).code).toBe('frames_lost');
  });

  it('a request the gateway gives up on is cancelled at the bridge; one the bridge ended or the stream refused is not', async () => {
    const scenarios: [string, (app: TestApp) => void, number, boolean][] = [
      ['no frame in time', (a) => (a.plane.script = () => 'silence'), 504, true],
      ['a frame lost', (a) => (a.plane.script = () => [chunk(0, 'a'), chunk(2, 'c'), { seq: 3, type: 'done' }]), 502, true],
      ['a failed publish (it may still land)', (a) => (a.plane.publishError = new Error('no ack within 5 s')), 503, true],
      [
        'an error frame: the bridge ended it',
        (a) => (a.plane.script = () => [{ seq: 0, type: 'error', error: { status: 500, message: 'boom', type: 'engine', code: null } }]),
        500,
        false,
      ],
      ['a full backlog: never queued', (a) => (a.plane.publishError = new SessionError(SessionErrorType.BacklogFull, 'full')), 429, false],
    ];
    for (const [what, arrange, status, cancels] of scenarios) {
      await t.app.close();
      const cancelled: string[] = [];
      t = await buildTestApp({
        settings: testSettings({ requestTimeoutMs: 150, gapTimeoutMs: 50 }),
        cancel: (session, id) => cancelled.push(`${session.subject} ${id}`),
      });
      arrange(t);
      const res = await chat(userTurn('hi'));
      expect({ what, status: res.statusCode, cancelled }).toEqual({
        what,
        status,
        cancelled: cancels ? [`${t.broker.entry.subject} ${String(res.headers['x-request-id'])}`] : [],
      });
    }
  });

  it('a failed publish → 503 unavailable with Retry-After, details only in the log', async () => {
    t.plane.publishError = new Error('503 no responders on magus.req.pool-a.inst-1');
    const res = await chat(userTurn('hi'));
    expect(res.statusCode).toBe(503);
    expect(errorOf(res)).toMatchObject({ type: 'server_error', code: 'unavailable' });
    expect(res.headers['retry-after']).toMatch(/^[1-9][0-9]*$/);
    expect(res.body).not.toContain('no responders');
    expect(t.plane.listening).toBe(0);
  });

  it.each([
    ['GET', '/v1/nothing?x=1'],
    ['DELETE', '/v1/nothing'],
    ['POST', '/v1/chat'],
    ['GET', '/v1/chat/completions/x'],
  ])('unknown URLs get an OpenAI-shaped 404 (%s %s), whatever the method', async (method, url) => {
    const res = await t.app.inject({ method: method as 'GET', url });
    expect(res.statusCode).toBe(404);
    expect(res.headers.allow).toBeUndefined();
    expect(errorOf(res)).toMatchObject({ code: 'unknown_url', message: `Unknown request URL: ${method} ${url.split('?')[0]}.` });
  });

  it.each([
    ['DELETE', '/v1/chat/completions', 'POST'],
    ['GET', '/v1/chat/completions', 'POST'],
    ['PUT', '/v1/models', 'GET, HEAD'],
    ['PUT', '/v1/models?x=1', 'GET, HEAD'],
    ['DELETE', '/v1/models/tiny', 'GET, HEAD'],
    ['POST', '/healthz', 'GET, HEAD'],
    ['OPTIONS', '/openapi.json', 'GET, HEAD'],
    ['PURGE', '/metrics', 'GET, HEAD'], // a method fastify routes nothing by
  ])('%s %s (a known path, another method) → 405 with Allow: %s, in OpenAI’s shape', async (method, url, allow) => {
    const res = await t.app.inject({ method: method as 'GET', url, headers: { authorization: `Bearer ${t.tokens.alice.token}` } });
    expect(res.statusCode).toBe(405);
    expect(res.headers.allow).toBe(allow);
    expect(res.headers['content-type']).toMatch(/^application\/json/);
    const path = url.split('?')[0]!;
    expect(errorOf(res)).toEqual({
      type: 'invalid_request_error',
      code: 'method_not_allowed',
      param: null,
      message: `Method ${method} is not allowed for ${path}; use ${allow.replace(', ', ' or ')}.`,
    });
  });

  it('405 is decided before the token or the body is looked at', async () => {
    // No token, a body that is not JSON, or none at all where fastify demands a content type (QUERY).
    const bad = await t.app.inject({ method: 'PUT', url: '/v1/models', headers: { 'content-type': 'application/json' }, payload: '{' });
    expect(bad.statusCode).toBe(405);
    expect(bad.headers.allow).toBe('GET, HEAD');
    const query = await t.app.inject({ method: 'QUERY' as 'GET', url: '/v1/models/tiny' });
    expect(query.statusCode).toBe(405);
    const head = await t.app.inject({ method: 'HEAD', url: '/v1/chat/completions' });
    expect(head.statusCode).toBe(405);
    expect(head.headers.allow).toBe('POST');
    // The methods a path has still work.
    const list = await t.app.inject({ method: 'GET', url: '/v1/models', headers: { authorization: `Bearer ${t.tokens.alice.token}` } });
    expect(list.statusCode).toBe(200);
  });
});

describe('/openapi.json', () => {
  it('describes every route from the schemas fastify validates with, bearer auth where the route authenticates', async () => {
    t = await buildTestApp();
    const res = await t.app.inject({ method: 'GET', url: '/openapi.json' });
    expect(res.statusCode).toBe(200);
    type Operation = {
      requestBody?: { content: Record<string, { schema: unknown }> };
      parameters: { name: string; in: string }[];
      responses: Record<string, { content: Record<string, unknown> }>;
      security: unknown[];
    };
    const doc = res.json<{ openapi: string; paths: Record<string, Record<string, Operation>> }>();
    expect(doc.openapi).toBe('3.1.0');
    expect(
      Object.entries(doc.paths)
        .flatMap(([path, ops]) => Object.keys(ops).map((m) => `${m} ${path}`))
        .sort(),
    ).toEqual(
      [
        'get /healthz',
        'get /metrics',
        'get /readyz',
        'get /v1/models',
        'get /v1/models/{model}',
        'post /v1/chat/completions',
        'post /v1/completions',
        'post /v1/embeddings',
        'post /v1/responses',
        'post /v1/responses/{response_id}/cancel',
        'get /v1/responses/{response_id}',
        'delete /v1/responses/{response_id}',
      ].sort(),
    );
    const chatOp = doc.paths['/v1/chat/completions']!.post!;
    expect(chatOp.requestBody!.content['application/json']!.schema).toEqual(JSON.parse(JSON.stringify(ChatCompletionBody)));
    expect(Object.keys(chatOp.responses['200']!.content)).toEqual(['application/json', 'text/event-stream']);
    expect(Object.keys(chatOp.responses)).toEqual(['200', '4XX', '5XX']);
    expect(chatOp.parameters).toEqual([expect.objectContaining({ name: 'x-session-id', in: 'header' })]);
    expect(doc.paths['/v1/models/{model}']!.get!.parameters).toEqual([expect.objectContaining({ name: 'model', in: 'path', required: true })]);
    expect(chatOp.security).toEqual([{ bearer: [] }]);
    const embeddingsOp = doc.paths['/v1/embeddings']!.post!;
    expect(embeddingsOp.requestBody!.content['application/json']!.schema).toEqual(JSON.parse(JSON.stringify(EmbeddingsBody)));
    expect(embeddingsOp.security).toEqual([{ bearer: [] }]);
    const responsesOp = doc.paths['/v1/responses']!.post!;
    expect(responsesOp.requestBody!.content['application/json']!.schema).toEqual(JSON.parse(JSON.stringify(ResponsesBody)));
    expect(Object.keys(responsesOp.responses['200']!.content)).toEqual(['application/json', 'text/event-stream']);
    for (const method of ['get', 'delete']) {
      const op = doc.paths['/v1/responses/{response_id}']![method]!;
      expect(op.parameters).toEqual([
        expect.objectContaining({ name: 'response_id', in: 'path', required: true }),
        // GET streams a background response again from an event on.
        ...(method === 'get'
          ? ['stream', 'starting_after', 'include', 'include_obfuscation'].map((name): unknown => expect.objectContaining({ name, in: 'query' }))
          : []),
      ]);
      expect(op.security).toEqual([{ bearer: [] }]);
    }
    expect(doc.paths['/v1/responses/{response_id}/cancel']!.post!.security).toEqual([{ bearer: [] }]);
    expect(doc.paths['/healthz']!.get!.security).toEqual([]);
  });

  describe('MAGUS_GATEWAY_OPENAPI', () => {
    const get = (token?: string) =>
      t.app.inject({ method: 'GET', url: '/openapi.json', headers: token === undefined ? {} : { authorization: `Bearer ${token}` } });
    const wrongSecret = () => `${t.tokens.alice.token.slice(0, -4)}0000`;

    it('public (the default): anyone, with or without a key', async () => {
      t = await buildTestApp();
      expect((await get()).statusCode).toBe(200);
      expect((await get(t.tokens.alice.token)).statusCode).toBe(200);
      await t.app.close();
      t = await buildTestApp({ settings: testSettings({ openApi: 'public' }) });
      expect((await get()).json()).toMatchObject({ openapi: '3.1.0' });
    });

    it('authenticated: a valid key reads it; none, a wrong one or garbage is a 401 in the shape every API route answers', async () => {
      t = await buildTestApp({ settings: testSettings({ openApi: 'authenticated' }) });
      const ok = await get(t.tokens.alice.token);
      expect(ok.statusCode).toBe(200);
      expect(ok.headers['content-type']).toBe('application/json; charset=utf-8');
      expect(ok.json()).toMatchObject({ openapi: '3.1.0', paths: { '/v1/chat/completions': {} } });
      const models = await t.app.inject({ method: 'GET', url: '/v1/models' }); // what an API route answers without a key
      expect(models.statusCode).toBe(401);
      for (const res of [await get(), await get(wrongSecret()), await get('not-a-token')]) {
        expect(res.statusCode).toBe(401);
        expect(errorOf(res)).toMatchObject({ type: 'invalid_request_error', code: 'invalid_api_key', param: null });
      }
      expect(errorOf(await get())).toEqual(errorOf(models));
      // /healthz and /readyz stay open: load balancers probe them without a key.
      expect((await t.app.inject({ method: 'GET', url: '/healthz' })).statusCode).toBe(200);
    });

    it('authenticated, with anonymous callers allowed: what the API routes let in, so a wrong key is still a 401', async () => {
      t = await buildTestApp({ settings: testSettings({ openApi: 'authenticated', allowAnonymous: true }) });
      expect((await get()).statusCode).toBe(200);
      expect((await get(wrongSecret())).statusCode).toBe(401);
    });

    it('off: 404 unknown_url, with a key or without, for any method', async () => {
      t = await buildTestApp({ settings: testSettings({ openApi: 'off' }) });
      for (const res of [await get(), await get(t.tokens.alice.token), await get(wrongSecret())]) {
        expect(res.statusCode).toBe(404);
        expect(errorOf(res)).toMatchObject({ code: 'unknown_url', message: 'Unknown request URL: GET /openapi.json.' });
      }
      const options = await t.app.inject({ method: 'OPTIONS', url: '/openapi.json' });
      expect([options.statusCode, errorOf(options).code]).toEqual([404, 'unknown_url']);
      // The API is unchanged.
      expect((await chat(userTurn('hi'))).statusCode).toBe(200);
    });
  });

  it("what fastify's router refuses is answered in OpenAI's shape too: a malformed or overlong path", async () => {
    t = await buildTestApp();
    const bad = await t.app.inject({ method: 'GET', url: '/v1/models/%E0%A4%A', headers: { authorization: `Bearer ${t.tokens.alice.token}` } });
    expect(bad.statusCode).toBe(400);
    expect(errorOf(bad).code).toBe('invalid_url');
    const long = await t.app.inject({ method: 'GET', url: `/v1/models/${'m'.repeat(600)}`, headers: { authorization: `Bearer ${t.tokens.alice.token}` } });
    expect(long.statusCode).toBe(414);
    expect(errorOf(long).code).toBe('uri_too_long');
  });

  it('a JSON body that is not UTF-8 → 400 invalid_encoding, nothing published', async () => {
    t = await buildTestApp();
    const payload = Buffer.concat([Buffer.from('{"model":"tiny","messages":[{"role":"user","content":"'), Buffer.from([0xc3, 0x28]), Buffer.from('"}]}')]);
    const res = await t.app.inject({
      method: 'POST',
      url: '/v1/chat/completions',
      headers: { 'content-type': 'application/json', authorization: `Bearer ${t.tokens.alice.token}` },
      payload,
    });
    expect(res.statusCode).toBe(400);
    expect(errorOf(res).code).toBe('invalid_encoding');
    expect(t.plane.published).toHaveLength(0);
  });

  it.each([
    ['a `__proto__` key in an ignored field', '{"model":"tiny","messages":[{"role":"user","content":"hi"}],"logit_bias":{"a":[{"__proto__":{"x":1}}]}}'],
    ['a `constructor` holding `prototype` in a message', '{"model":"tiny","messages":[{"role":"user","content":"hi","constructor":{"prototype":{}}}]}'],
  ])('%s (prototype poisoning, at any depth; not in the OpenAPI description) → 400 forbidden_key, nothing published', async (_what, payload) => {
    t = await buildTestApp();
    const res = await t.app.inject({
      method: 'POST',
      url: '/v1/chat/completions',
      headers: { 'content-type': 'application/json', authorization: `Bearer ${t.tokens.alice.token}` },
      payload,
    });
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toMatchObject({ type: 'invalid_request_error', code: 'forbidden_key', message: expect.stringContaining('"__proto__"') as string });
    expect(t.plane.published).toHaveLength(0);
    // Invalid JSON is still called that.
    const bad = await t.app.inject({
      method: 'POST',
      url: '/v1/chat/completions',
      headers: { 'content-type': 'application/json', authorization: `Bearer ${t.tokens.alice.token}` },
      payload: payload.slice(0, -1),
    });
    expect(bad.statusCode).toBe(400);
    expect(errorOf(bad).message).toContain('not valid JSON');
  });
});

describe('/metrics, /healthz, /readyz', () => {
  it('exposes request counts, latency histogram, in-flight and session counters in Prometheus text', async () => {
    t = await buildTestApp();
    await chat(userTurn('hi'));
    await chat(userTurn('hi'), { token: null });
    const res = await t.app.inject({ method: 'GET', url: '/metrics' });
    expect(res.statusCode).toBe(200);
    expect(res.headers['content-type']).toBe('text/plain; version=0.0.4; charset=utf-8');
    const text = res.body;
    expect(text).toContain('# TYPE magus_gateway_requests_total counter');
    expect(text).toContain('magus_gateway_requests_total{route="/v1/chat/completions",status="200"} 1');
    expect(text).toContain('magus_gateway_requests_total{route="/v1/chat/completions",status="401"} 1');
    expect(text).toContain('# TYPE magus_gateway_request_duration_seconds histogram');
    expect(text).toMatch(/magus_gateway_request_duration_seconds_bucket\{route="\/v1\/chat\/completions",le="\+Inf"\} 2/);
    expect(text).toMatch(/magus_gateway_request_duration_seconds_count\{route="\/v1\/chat\/completions"\} 2/);
    expect(text).toContain('magus_gateway_requests_in_flight 1'); // this scrape
    expect(text).toContain('magus_gateway_session_warm_hits_total 1');
    expect(text).toContain('magus_gateway_session_cold_starts_total 0');
    // The process's own gauges (platform/process-metrics.ts): a live process has memory and open files.
    const sample = (name: string) => Number(new RegExp(`^${name} (\\S+)$`, 'm').exec(text)?.[1]);
    expect(sample('process_resident_memory_bytes')).toBeGreaterThan(sample('nodejs_heap_size_used_bytes'));
    expect(sample('nodejs_heap_size_total_bytes')).toBeGreaterThanOrEqual(sample('nodejs_heap_size_used_bytes'));
    expect(sample('nodejs_heap_size_used_bytes')).toBeGreaterThan(1e6);
    expect(sample('process_open_fds')).toBeGreaterThan(2);
    expect(sample('process_start_time_seconds') * 1000).toBeLessThanOrEqual(Date.now());
    // Every sample line is `name{labels} value` and every family has HELP and TYPE.
    for (const line of text.trim().split('\n')) expect(line).toMatch(/^(# (HELP|TYPE) \w+ .+|\w+(\{[^}]*\})? [-+0-9.eE]+|\w+(\{[^}]*\})? \+Inf)$/);
    // Buckets are cumulative.
    const buckets = [...text.matchAll(/_bucket\{route="\/v1\/chat\/completions",le="[^"]+"\} (\d+)/g)].map((m) => Number(m[1]));
    expect(buckets).toEqual([...buckets].sort((a, b) => a - b));
  });

  it('serveMetrics: false (an operations listener serves them): no /metrics on the API app, and not in its OpenAPI description', async () => {
    t = await buildTestApp({ serveMetrics: false });
    const res = await t.app.inject({ method: 'GET', url: '/metrics' });
    expect(res.statusCode).toBe(404);
    expect(errorOf(res).code).toBe('unknown_url');
    const paths = Object.keys((await t.app.inject({ method: 'GET', url: '/openapi.json' })).json<{ paths: object }>().paths);
    expect(paths).toEqual(expect.arrayContaining(['/healthz', '/readyz', '/v1/models']));
    expect(paths).not.toContain('/metrics');
    expect((await t.app.inject({ method: 'GET', url: '/healthz' })).statusCode).toBe(200);
    expect((await t.app.inject({ method: 'GET', url: '/readyz' })).statusCode).toBe(200);
  });

  it('healthz is up; readyz reflects the checks', async () => {
    let natsUp = true;
    t = await buildTestApp({ readiness: [{ name: 'nats', check: () => natsUp }] });
    expect((await t.app.inject({ method: 'GET', url: '/healthz' })).json()).toEqual({ status: 'ok' });
    const ok = await t.app.inject({ method: 'GET', url: '/readyz' });
    expect(ok.statusCode).toBe(200);
    expect(ok.json()).toEqual({ status: 'ok', checks: { registry: true, nats: true } });
    natsUp = false;
    const down = await t.app.inject({ method: 'GET', url: '/readyz' });
    expect(down.statusCode).toBe(503);
    // The registry is read over NATS: with NATS down it is not read (a probe is answered at once).
    expect(down.json()).toEqual({ status: 'unavailable', checks: { registry: false, nats: false } });
  });

  it('readyz: a check that only degrades (Temporal) failing is 200 degraded; with a required one failing, 503', async () => {
    let natsUp = true;
    let temporalUp = false;
    t = await buildTestApp({
      readiness: [
        { name: 'nats', check: () => natsUp },
        { name: 'temporal', check: () => temporalUp, degrades: true },
      ],
    });
    const degraded = await t.app.inject({ method: 'GET', url: '/readyz' });
    expect(degraded.statusCode).toBe(200);
    expect(degraded.json()).toEqual({ status: 'degraded', checks: { registry: true, nats: true, temporal: false } });
    natsUp = false;
    const down = await t.app.inject({ method: 'GET', url: '/readyz' });
    expect(down.statusCode).toBe(503);
    expect(down.json()).toEqual({ status: 'unavailable', checks: { registry: false, nats: false, temporal: false } });
    natsUp = temporalUp = true;
    expect((await t.app.inject({ method: 'GET', url: '/readyz' })).json()).toEqual({ status: 'ok', checks: { registry: true, nats: true, temporal: true } });
  });

  it('readyz: a check with a grace failing degrades the replica until it has failed that long, then fails it; passing again, ok', async () => {
    let natsUp = true;
    let clock = 1_000;
    const nats = graced({ name: 'nats', check: () => natsUp }, 30_000, () => clock);
    try {
      // The registry, read over NATS, degrades with it: it was read within the grace (the real clock's).
      t = await buildTestApp({ readiness: [nats.check], settings: { ...testSettings(), natsGraceMs: 30_000 } });
      const ask = async () => {
        const r = await t.app.inject({ method: 'GET', url: '/readyz' });
        return [r.statusCode, r.json<{ status: string }>().status];
      };
      natsUp = false; // a NATS restart: every replica reconnects at once
      clock += 29_999;
      expect(await ask()).toEqual([200, 'degraded']);
      clock += 1; // cut off for the whole grace: this replica leaves its Service
      expect(await ask()).toEqual([503, 'unavailable']);
      natsUp = true;
      expect(await ask()).toEqual([200, 'ok']);
      natsUp = false; // the grace counts from the last time it passed
      clock += 10_000;
      expect(await ask()).toEqual([200, 'degraded']);
    } finally {
      nats.stop();
    }
  });
});

describe('embeddings', () => {
  beforeEach(async () => {
    t = await buildTestApp();
  });
  const embed = (body: unknown, token: string | null = t.tokens.alice.token): Promise<LightMyRequestResponse> =>
    t.app.inject({
      method: 'POST',
      url: '/v1/embeddings',
      headers: { 'content-type': 'application/json', ...(token ? { authorization: `Bearer ${token}` } : {}) },
      payload: JSON.stringify(body),
    });
  const answer = {
    object: 'list',
    data: [
      { object: 'embedding', index: 0, embedding: [0.5, -1] },
      { object: 'embedding', index: 1, embedding: 'AAAAPwAAgL8=' },
    ],
    model: 'tiny',
    usage: { prompt_tokens: 7, total_tokens: 7 },
  };

  it("forwards the body (without `user`) as an embeddings request to an instance of the model's pool, with no conversation, and answers the engine's list", async () => {
    t.plane.script = (req) => [{ seq: 0, type: 'done', data: req.kind === 'embeddings' ? answer : null }];
    const res = await embed({ model: 'tiny', input: ['a', 'b'], encoding_format: 'base64', user: 'u-1' });
    expect(res.statusCode).toBe(200);
    expect(res.json()).toEqual(answer);
    expect(t.plane.published).toHaveLength(1);
    const { req, subject } = t.plane.published[0]!;
    expect(subject).toBe(t.broker.entry.subject);
    expect(req).toMatchObject({ kind: 'embeddings', body: { model: 'tiny', input: ['a', 'b'], encoding_format: 'base64' } });
    expect(req.body).not.toHaveProperty('user');
    expect(res.headers['x-request-id']).toBe(req.id);
    expect(t.broker.routed).toEqual(['default/tiny']);
    expect(t.broker.calls).toHaveLength(0); // no conversation, no entry
    expect((await t.app.inject({ method: 'GET', url: '/metrics' })).body).toMatch(/magus_gateway_prompt_tokens_total\{model="default\/tiny"\} 7/);
  });

  it.each([
    ['no input', { model: 'tiny' }, 'input'],
    ['an empty list', { model: 'tiny', input: [] }, 'input'],
    ['too many inputs', { model: 'tiny', input: Array.from({ length: 257 }, () => 'x') }, 'input'],
    ['a negative token id', { model: 'tiny', input: [1, -2] }, 'input'],
    ['strings and token lists mixed', { model: 'tiny', input: ['a', [1, 2]] }, 'input'],
    ['an unknown encoding', { model: 'tiny', input: 'a', encoding_format: 'utf8' }, 'encoding_format'],
    ['dimensions of 0', { model: 'tiny', input: 'a', dimensions: 0 }, 'dimensions'],
  ])('refuses %s with a 400 naming the field, before anything is published', async (_what, body, param) => {
    const res = await embed(body);
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toMatchObject({ type: 'invalid_request_error', param });
    expect(t.plane.published).toHaveLength(0);
  });

  it('needs a token, and a model the token may use', async () => {
    expect((await embed({ model: 'tiny', input: 'a' }, null)).statusCode).toBe(401);
    const res = await embed({ model: 'tiny', input: 'a' }, t.tokens.narrow.token);
    expect(res.statusCode).toBe(404);
    expect(errorOf(res).code).toBe('model_not_found');
  });

  it('a model whose engines are all distributed-llama: 400 unsupported_feature naming the engine, nothing queued', async () => {
    const dllamaArtifact = { format: 'dllama', weights: 'q40', files: [] } as unknown as ReadyModel['artifacts'][number];
    const plan = { format: 'dllama', weights: 'q40', topologies: [{ nodes: 2 }] } as unknown as ReadyModel['memory'][number];
    const big: ReadyModel = { ...readyModel('big'), artifacts: [dllamaArtifact], memory: [plan] };
    await t.app.close();
    const runtimes: RuntimeAdvert[] = [{ worker: 'w1', runtime: 'local', formats: ['gguf', 'dllama'], dllamaNodes: 2, at: Date.now() }];
    t = await buildTestApp({
      models: createModelCatalog({
        list: () => Promise.resolve([big]),
        read: () => Promise.resolve({ models: [big], runtimes: [{ ...runtimes[0]!, at: Date.now() }] }),
      }),
    });
    const res = await embed({ model: 'big', input: 'a' });
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toMatchObject({ param: 'model', code: 'unsupported_feature' });
    expect(errorOf(res).message).toContain("distributed-llama's dllama-api");
    expect(t.broker.routed).toHaveLength(0);
    expect(t.plane.published).toHaveLength(0);
  });

  it('no instance can be found: the broker says why (503 with Retry-After)', async () => {
    t.broker.impl = () => Promise.reject(new SessionError(SessionErrorType.NoCapacity, 'nothing serves'));
    const res = await embed({ model: 'tiny', input: 'a' });
    expect(res.statusCode).toBe(503);
    expect(res.headers['retry-after']).toBeDefined();
    expect(t.plane.published).toHaveLength(0);
  });
});

describe('text completions', () => {
  beforeEach(async () => {
    t = await buildTestApp();
  });
  const complete = (body: unknown, token: string | null = t.tokens.alice.token): Promise<LightMyRequestResponse> =>
    t.app.inject({
      method: 'POST',
      url: '/v1/completions',
      headers: { 'content-type': 'application/json', ...(token ? { authorization: `Bearer ${token}` } : {}) },
      payload: JSON.stringify(body),
    });
  const usage = { prompt_tokens: 4, completion_tokens: 2, total_tokens: 6, prompt_tokens_details: { cached_tokens: 1 } };
  const answer = {
    id: 'cmpl-x',
    object: 'text_completion',
    created: 1,
    model: 'tiny',
    choices: [{ index: 0, text: ' there', logprobs: null, finish_reason: 'length' }],
    usage,
  };
  const textChunk = (seq: number, index: number, text: string): ResponseFrame => ({
    seq,
    type: 'chunk',
    data: { id: 'cmpl-x', object: 'text_completion', created: 1, model: 'tiny', choices: [{ index, text, logprobs: null, finish_reason: null }] },
  });

  it("forwards the sampling fields (not `user`, `echo`, `n`) as a completions request to an instance of the model's pool, with no conversation, and answers the engine's completion", async () => {
    t.plane.script = (req) => [{ seq: 0, type: 'done', data: req.kind === 'completions' ? answer : null }];
    const res = await complete({
      model: 'tiny',
      prompt: ['hi', 'ho'],
      max_tokens: 2,
      temperature: 0,
      seed: 4,
      stop: '\n',
      logprobs: 2,
      user: 'u',
      echo: false,
      n: 1,
    });
    expect(res.statusCode).toBe(200);
    expect(res.json()).toEqual(answer);
    const { req, subject } = t.plane.published[0]!;
    expect(subject).toBe(t.broker.entry.subject);
    expect(req).toMatchObject({ kind: 'completions' });
    expect(req.body).toEqual({ model: 'tiny', prompt: ['hi', 'ho'], max_tokens: 2, temperature: 0, seed: 4, stop: '\n', logprobs: 2 });
    expect(res.headers['x-request-id']).toBe(req.id);
    expect(t.broker.routed).toEqual(['default/tiny']);
    expect(t.broker.calls).toHaveLength(0); // no conversation, no entry
    expect((await t.app.inject({ method: 'GET', url: '/metrics' })).body).toMatch(/magus_gateway_prompt_tokens_total\{model="default\/tiny"\} 4/);
  });

  it("streams the engine's text_completion chunks in order, usage only when asked, then [DONE]", async () => {
    const usageChunk: ResponseFrame = {
      seq: 3,
      type: 'chunk',
      data: { id: 'cmpl-x', object: 'text_completion', created: 1, model: 'tiny', choices: [], usage },
    };
    t.plane.script = () => [textChunk(1, 0, 'b'), textChunk(0, 0, 'a'), textChunk(2, 1, 'c'), usageChunk, { seq: 4, type: 'done' }];
    const res = await complete({ model: 'tiny', prompt: ['x', 'y'], stream: true });
    expect(res.statusCode).toBe(200);
    expect(res.headers['content-type']).toBe('text/event-stream; charset=utf-8');
    expect(t.plane.published[0]!.req.body).toMatchObject({ stream: true, stream_options: { include_usage: true } });
    const events = sseEvents(res.body) as ({ choices: { index: number; text: string }[] } | string)[];
    expect(events.at(-1)).toBe('[DONE]');
    expect(events.slice(0, -1).map((e) => (e as { choices: { index: number; text: string }[] }).choices.map((c) => `${c.index}:${c.text}`).join())).toEqual([
      '0:a',
      '0:b',
      '1:c',
    ]);
    const asked = sseEvents((await complete({ model: 'tiny', prompt: 'x', stream: true, stream_options: { include_usage: true } })).body);
    expect(asked.at(-2)).toMatchObject({ choices: [], usage });
  });

  it.each([
    ['no prompt', { model: 'tiny' }, 'prompt', 'invalid_value'],
    ['an empty list of prompts', { model: 'tiny', prompt: [] }, 'prompt', 'invalid_value'],
    ['more than 16 prompts', { model: 'tiny', prompt: Array.from({ length: 17 }, () => 'x') }, 'prompt', 'invalid_value'],
    ['logprobs above 20', { model: 'tiny', prompt: 'x', logprobs: 21 }, 'logprobs', 'invalid_value'],
    ['echo', { model: 'tiny', prompt: 'x', echo: true }, 'echo', 'unsupported_feature'],
    ['best_of 2', { model: 'tiny', prompt: 'x', best_of: 2 }, 'best_of', 'unsupported_feature'],
    ['a suffix', { model: 'tiny', prompt: 'x', suffix: 'end' }, 'suffix', 'unsupported_feature'],
  ])('refuses %s with a 400 naming the field, before anything is published', async (_what, body, param, code) => {
    const res = await complete(body);
    expect(res.statusCode).toBe(400);
    expect(errorOf(res)).toMatchObject({ type: 'invalid_request_error', param, code });
    expect(t.plane.published).toHaveLength(0);
  });

  it('needs a token and a model it may use; a distributed-llama-only model is a 400 naming the engine', async () => {
    expect((await complete({ model: 'tiny', prompt: 'a' }, null)).statusCode).toBe(401);
    expect(errorOf(await complete({ model: 'tiny', prompt: 'a' }, t.tokens.narrow.token)).code).toBe('model_not_found');
    const dllamaArtifact = { format: 'dllama', weights: 'q40', files: [] } as unknown as ReadyModel['artifacts'][number];
    const plan = { format: 'dllama', weights: 'q40', topologies: [{ nodes: 2 }] } as unknown as ReadyModel['memory'][number];
    const big: ReadyModel = { ...readyModel('big'), artifacts: [dllamaArtifact], memory: [plan] };
    await t.app.close();
    const runtime: RuntimeAdvert = { worker: 'w1', runtime: 'local', formats: ['gguf', 'dllama'], dllamaNodes: 2, at: Date.now() };
    t = await buildTestApp({
      models: createModelCatalog({
        list: () => Promise.resolve([big]),
        read: () => Promise.resolve({ models: [big], runtimes: [{ ...runtime, at: Date.now() }] }),
      }),
    });
    const res = await complete({ model: 'big', prompt: 'a' });
    expect(errorOf(res)).toMatchObject({ param: 'model', code: 'unsupported_feature' });
    expect(errorOf(res).message).toContain("distributed-llama's dllama-api");
    expect(t.plane.published).toHaveLength(0);
  });
});

/**
 * The engine's HTTP layer and options with a scripted backend (no model): states, shutdown, errors.
 * Over a real loopback port: `app.inject` needs light-my-request, whose ESM-only `cookie`
 * dependency jest's CommonJS runtime cannot load.
 */
import type { FastifyInstance } from 'fastify';
import { invalidRequest, normalizeRequest, paramPath, type ChatRequest, type CompletionBackend, type GenerationIO, type GenerationResult } from './api';
import { createEngineHttp } from './app';
import { EngineCore } from './core';
import { parseEngineArgs } from './options';
import { USAGE_ERROR as ENGINE_USAGE_ERROR } from '../platform/cli';
import { until } from '../test/harness/wait';
import { DUE_HEADER, REQUEUED_HEADER } from '../shared/continuation';

/** A backend whose generations finish when the test says so. */
class ScriptedBackend implements CompletionBackend {
  readonly pending: { io: GenerationIO; finish(r: GenerationResult): void; fail(e: unknown): void }[] = [];
  /** The first message of each generation begun, in the order they began. */
  readonly prompts: string[] = [];
  prepare(req: ChatRequest) {
    if (req.messages[0]!.content === 'too long') throw invalidRequest('too long', 'messages', 'context_length_exceeded');
    return {
      promptTokens: 3,
      generate: (_slot: number, io: GenerationIO) =>
        new Promise<GenerationResult>((resolve, reject) => {
          io.signal.addEventListener('abort', () => reject(new Error('aborted')), { once: true });
          this.prompts.push(String(req.messages[0]!.content));
          this.pending.push({ io, finish: resolve, fail: reject });
        }),
    };
  }
}

const body = (content = 'hi', extra: Record<string, unknown> = {}) => ({ messages: [{ role: 'user', content }], ...extra });

describe('engine HTTP layer', () => {
  let core: EngineCore;
  let app: FastifyInstance;
  let base: string;
  let backend: ScriptedBackend;
  const logged: string[] = [];
  beforeEach(async () => {
    core = new EngineCore({ modelId: 'm', slots: 1, queue: 1 });
    app = createEngineHttp(core, { logError: (m) => logged.push(m) });
    base = await app.listen({ host: '127.0.0.1', port: 0 });
    backend = new ScriptedBackend();
  });
  afterEach(() => app.close());

  interface Answer {
    statusCode: number;
    body: string;
    json(): unknown;
  }
  const answer = async (res: Response): Promise<Answer> => {
    const text = await res.text();
    return { statusCode: res.status, body: text, json: () => JSON.parse(text) as unknown };
  };
  const get = async (path: string): Promise<Answer> => answer(await fetch(`${base}${path}`));
  const complete = async (payload: unknown, headers: Record<string, string> = {}): Promise<Answer> =>
    answer(
      await fetch(`${base}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', ...headers },
        body: JSON.stringify(payload),
      }),
    );
  /** A chat turn saying `content`, with more request headers. */
  const post = (content: string, headers: Record<string, string> = {}) => complete(body(content), headers);
  /** The prompts of the backend's next `n` generations, in the order it began them, each finished in turn. */
  const servedInOrder = async (n: number): Promise<string[]> => {
    const order: string[] = [];
    for (let i = 0; i < n; i++) {
      await until(`generation ${i + 1}`, () => backend.pending.length === i + 1, 5_000);
      order.push(backend.prompts[i]!);
      backend.pending[i]!.finish({ text: 'ok', finishReason: 'stop', completionTokens: 1, cachedPromptTokens: 0 });
    }
    return order;
  };

  test('answers 503 while the model loads, then serves', async () => {
    const health = await get('/health');
    expect(health.statusCode).toBe(503);
    expect(health.json()).toMatchObject({ status: 'loading', model: 'm' });
    const early = await complete(body());
    expect(early.statusCode).toBe(503);
    expect(early.json()).toEqual({ error: { message: 'The model is still loading.', type: 'server_error', param: null, code: 'engine_unavailable' } });
    expect((await get('/metrics')).body).toContain('magus_engine_model_loaded 0');
    // Started from standby (its model mapped before it listened): it says it is coming at once.
    core.mapped = true;
    expect((await complete(body())).json()).toMatchObject({ error: { code: 'engine_starting' } });

    core.ready(backend);
    expect((await get('/health')).statusCode).toBe(200);
    const answer = complete(body());
    await until('a generation at the backend', () => backend.pending.length === 1, 5_000);
    backend.pending[0]!.io.onText('hel');
    backend.pending[0]!.finish({ text: 'hello', finishReason: 'stop', completionTokens: 2, cachedPromptTokens: 1 });
    const res = await answer;
    expect(res.statusCode).toBe(200);
    expect(res.json()).toMatchObject({
      model: 'm',
      choices: [{ message: { content: 'hello' }, finish_reason: 'stop' }],
      usage: { prompt_tokens: 3, completion_tokens: 2, total_tokens: 5, prompt_tokens_details: { cached_tokens: 1 } },
    });
    expect((await get('/metrics')).body).toContain('magus_engine_cached_prompt_tokens_total 1');
  });

  test('drain turns queued requests away with 503, lets the running one finish; abortInFlight ends it with 503', async () => {
    core.ready(backend);
    const running = complete(body('one'));
    await until('a generation at the backend', () => backend.pending.length === 1, 5_000);
    const queued = complete(body('two'));
    await until('a request queued for a slot', () => core.slots.queued === 1, 5_000);
    core.drain();
    expect((await queued).statusCode).toBe(503);
    expect((await get('/health')).json()).toMatchObject({ status: 'stopping' });
    expect((await complete(body('three'))).json()).toMatchObject({ error: { message: 'The engine is shutting down.' } });
    core.abortInFlight();
    const res = await running;
    expect(res.statusCode).toBe(503);
    expect(res.json()).toMatchObject({ error: { code: 'engine_unavailable' } });
    expect(core.slots.busy).toBe(0);
  });

  test('a request with the requeued header (handed back by another instance) is not refused for a full queue and goes before the queued ones', async () => {
    core.ready(backend);
    const running = post('running');
    await until('a generation at the backend', () => backend.pending.length === 1, 5_000);
    const queued = post('queued');
    await until('one queued (the bound)', () => core.slots.queued === 1, 5_000);
    expect((await post('refused')).statusCode).toBe(429);
    const handedBack = post('handed back', { [REQUEUED_HEADER]: '1' });
    await until('both waiting', () => core.slots.queued === 2, 5_000);
    expect(await servedInOrder(3)).toEqual(['running', 'handed back', 'queued']);
    for (const r of [running, handedBack, queued]) expect((await r).statusCode).toBe(200);
  });

  test('a request handed back whose deadline comes after a queued one’s goes after it (the deadline header), and one whose deadline is bad is placed as if it had none', async () => {
    core.ready(backend);
    const running = post('running', { [DUE_HEADER]: '1000' });
    await until('a generation at the backend', () => backend.pending.length === 1, 5_000);
    const queued = post('queued', { [DUE_HEADER]: '2000' });
    await until('one queued', () => core.slots.queued === 1, 5_000);
    const later = post('handed back, due later', { [REQUEUED_HEADER]: '1', [DUE_HEADER]: '3000' });
    await until('two waiting', () => core.slots.queued === 2, 5_000);
    const bad = post('handed back, a bad deadline', { [REQUEUED_HEADER]: '1', [DUE_HEADER]: 'soon' });
    await until('three waiting', () => core.slots.queued === 3, 5_000);
    expect(await servedInOrder(4)).toEqual(['running', 'handed back, a bad deadline', 'queued', 'handed back, due later']);
    for (const r of [running, queued, later, bad]) expect((await r).statusCode).toBe(200);
  });

  test('backend errors: 400s pass through; unexpected ones are a 500 without details, logged', async () => {
    core.ready(backend);
    const long = await complete(body('too long'));
    expect(long.statusCode).toBe(400);
    expect(long.json()).toMatchObject({ error: { param: 'messages', code: 'context_length_exceeded' } });

    const failing = complete(body());
    await until('a generation at the backend', () => backend.pending.length === 1, 5_000);
    backend.pending[0]!.fail(new Error('secret internals'));
    const res = await failing;
    expect(res.statusCode).toBe(500);
    expect(res.json()).toEqual({ error: { message: 'The engine had an internal error.', type: 'server_error', param: null, code: null } });
    expect(logged.join('\n')).toContain('secret internals');
  });

  test('a failure mid-stream ends the stream with an error event and no [DONE]', async () => {
    core.ready(backend);
    const stream = complete(body('x', { stream: true }));
    await until('a generation at the backend', () => backend.pending.length === 1, 5_000);
    backend.pending[0]!.io.onText('partial');
    backend.pending[0]!.fail(new Error('boom'));
    const res = await stream;
    expect(res.statusCode).toBe(200);
    const events = res.body.split('\n\n').filter(Boolean);
    expect(events).toHaveLength(3);
    expect(events[1]).toContain('"content":"partial"');
    expect(JSON.parse(events[2]!.slice('data: '.length))).toEqual({
      error: { message: 'The engine had an internal error.', type: 'server_error', param: null, code: null },
    });
    expect((await get('/metrics')).body).toContain('magus_engine_errors_total{type="server_error"} 1');
  });
});

describe('request normalisation', () => {
  test('applies OpenAI defaults and maps fields', () => {
    expect(normalizeRequest({ messages: [{ role: 'developer', content: 'd' }] })).toEqual({
      messages: [{ role: 'system', content: 'd' }],
      stream: false,
      includeUsage: false,
      maxTokens: undefined,
      temperature: 1,
      topP: 1,
      repetitionPenalty: 1,
      seed: undefined,
      stop: [],
      frequencyPenalty: 0,
      presencePenalty: 0,
      tools: [],
      toolChoice: 'auto',
      parallelToolCalls: true,
    });
    const r = normalizeRequest({
      messages: [],
      max_tokens: 5,
      max_completion_tokens: 7,
      seed: -1,
      stop: 'x',
      stream: true,
      stream_options: { include_usage: true },
    });
    expect(r).toMatchObject({ maxTokens: 7, seed: 0xffffffff, stop: ['x'], stream: true, includeUsage: true });
    // tool_choice none offers no tools; a named one is kept by name; parameters as sent (checked: the grammar enforces them).
    const tool = {
      type: 'function' as const,
      function: { name: 'f', parameters: { type: 'object', properties: { a: { type: 'string' } }, required: ['a'], title: 'F' } },
    };
    expect(normalizeRequest({ messages: [], tools: [tool], tool_choice: 'none' })).toMatchObject({ tools: [] });
    expect(
      normalizeRequest({ messages: [], tools: [tool], tool_choice: { type: 'function', function: { name: 'f' } }, parallel_tool_calls: false }),
    ).toMatchObject({
      tools: [{ name: 'f', params: tool.function.parameters }],
      toolChoice: { name: 'f' },
      parallelToolCalls: false,
    });
  });

  test('param paths use OpenAI spelling', () => {
    expect(paramPath('/messages/0/role')).toBe('messages[0].role');
    expect(paramPath('', 'messages')).toBe('messages');
    expect(paramPath('/stop/1')).toBe('stop[1]');
    expect(paramPath('')).toBeNull();
  });
});

describe('magus engine options', () => {
  test('defaults and both flag spellings', () => {
    const o = parseEngineArgs(['--model', '/m/tiny.gguf', '--port=8080', '--slots', '2', '--json']);
    expect(o).toMatchObject({
      model: '/m/tiny.gguf',
      host: '127.0.0.1',
      port: 8080,
      slots: 2,
      resumeSlots: 1,
      queue: 16,
      ctx: 4096,
      modelId: 'tiny.gguf',
      json: true,
      standby: false,
      warm: false,
      graceMs: 30_000,
    });
    expect(o.threads).toBeGreaterThanOrEqual(1);
    expect(parseEngineArgs(['--model', 'x', '--standby'])).toMatchObject({ standby: true, warm: false });
    expect(parseEngineArgs(['--model', 'x', '--standby', '--warm'])).toMatchObject({ standby: true, warm: true });
    expect(o.snapshots).toBeUndefined();
    expect(parseEngineArgs(['--model', 'x', '--snapshots', '/tmp/kv'])).toMatchObject({ snapshots: { dir: '/tmp/kv', maxBytes: 2 ** 30 } });
    expect(parseEngineArgs(['--model', 'x', '--snapshots=/tmp/kv', '--snapshot-bytes', '1000'])).toMatchObject({
      snapshots: { dir: '/tmp/kv', maxBytes: 1000 },
    });
  });

  test.each([
    [[], /--model/],
    [['--model'], /needs a value/],
    [['--model', 'x', '--slots', '0'], /--slots must be a whole number from 1/],
    [['--model', 'x', '--port', 'http'], /--port/],
    [['--model', 'x', '--gpu'], /unknown option --gpu/],
    [['--model', 'x', 'extra'], /unexpected argument extra/],
    [['--model', 'x', '--warm'], /--warm goes with --standby/],
    [['--model', 'x', '--snapshot-bytes', '10'], /--snapshot-bytes goes with --snapshots/],
    [['--model', 'x', '--snapshots', '/tmp/kv', '--snapshot-bytes', '-1'], /--snapshot-bytes must be a whole number/],
  ])('%j is refused', (args, message) => {
    expect(() => parseEngineArgs(args)).toThrow(message);
    expect(() => parseEngineArgs(args)).toThrow(expect.objectContaining({ name: ENGINE_USAGE_ERROR }) as Error);
  });
});

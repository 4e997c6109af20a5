/**
 * The engine's HTTP API as a fastify plugin: the routes `dllama-api` serves
 * (`POST /v1/chat/completions`, `GET /v1/models`, CORS preflight) plus `GET /health` and
 * `GET /metrics`. Every error is answered in OpenAI's shape; 5xx details stay in the log.
 *
 * A completion request is validated, measured by the backend (400 if it cannot fit), then waits
 * for a slot (429 when the queue is full). Streaming answers are written straight to the socket as
 * server-sent events; a client that disconnects aborts its generation, which frees the slot.
 */
import { performance } from 'node:perf_hooks';
import fastify, {
  type FastifyError,
  type FastifyInstance,
  type FastifyPluginAsync,
  type FastifyReply,
  type FastifyRequest,
  type preValidationAsyncHookHandler,
} from 'fastify';
import type { ServerResponse } from 'node:http';
import {
  chatCompletionBodySchema,
  chatCompletionResponseSchemas,
  completionsBodySchema,
  ENGINE_HTTP_ERROR,
  EngineHttpError,
  healthResponseSchema,
  modelListResponseSchema,
  invalidRequest,
  normalizeRequest,
  normalizeTextRequest,
  starting,
  unavailable,
  validationFailure,
  type ChatCompletion,
  type ChatCompletionBody,
  type CompletionBackend,
  type FinishReason,
  type GenerationResult,
  type PreparedCompletion,
  type TokenLogprob,
  type Usage,
  chatLogprobs,
  textLogprobs,
  usageOf,
} from './api';
import type { ToolCall } from '../shared/chat';
import { DUE_HEADER, holdsPart, REQUEUED_HEADER, RESUME_MISMATCH } from '../shared/continuation';
import type { CompletionsRequest } from '../shared/completions';
import { EmbeddingsRequest, embeddingInputs, type EmbeddingsResponse } from '../shared/embeddings';
import type { EngineCore } from './core';
import { QUEUE_FULL_ERROR } from './slots';

export const COMPLETIONS_URL = '/v1/chat/completions';
export const EMBEDDINGS_URL = '/v1/embeddings';
export const TEXT_COMPLETIONS_URL = '/v1/completions';

export interface EngineApiOptions {
  core: EngineCore;
  /**
   * Runs on every completion request before validation (the stub engine records requests and
   * injects failures here). Answering the reply ends the request.
   */
  preValidation?: preValidationAsyncHookHandler;
  /** Where 5xx details go (default: stderr). */
  logError?: (message: string) => void;
}

/** Abort reason of a generation whose client went away. */
const CLIENT_CLOSED = Symbol('client closed');

const ID_PREFIX = `chatcmpl-${Math.random().toString(36).slice(2, 10)}`;
let idCounter = 0;
const nextId = (): string => `${ID_PREFIX}${(++idCounter).toString(36)}`;

const SSE_HEADERS = {
  'content-type': 'text/event-stream; charset=utf-8',
  'cache-control': 'no-cache',
  'x-accel-buffering': 'no',
  'access-control-allow-origin': '*',
} as const;

/**
 * Server-sent `chat.completion.chunk` events, or `text_completion` ones for `/v1/completions`
 * (a choice per prompt, `text` in place of `delta`). Only the text is serialised per chunk; the
 * rest of each event is a prebuilt prefix (hot path: one event per token).
 */
class ChunkWriter {
  private readonly prefix: string;
  private corked = false;
  private readonly uncork = (): void => {
    if (!this.corked) return;
    this.corked = false;
    this.res.uncork();
  };

  constructor(
    private readonly res: ServerResponse,
    id: string,
    created: number,
    model: string,
    private readonly kind: 'chat' | 'text' = 'chat',
  ) {
    const object = kind === 'chat' ? 'chat.completion.chunk' : 'text_completion';
    this.prefix = `data: {"id":${JSON.stringify(id)},"object":"${object}","created":${created},"model":${JSON.stringify(model)},"choices":[`;
  }

  /** Events written in the same tick leave in one packet (a stub writes a whole answer at once). */
  private write(event: string): void {
    if (!this.corked) {
      this.corked = true;
      this.res.cork();
      process.nextTick(this.uncork);
    }
    this.res.write(event);
  }

  /** A chat stream's first chunk (text completions have none). */
  role(): void {
    if (this.kind === 'chat') this.write(`${this.prefix}{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n`);
  }

  /**
   * A piece of choice `index`'s text, with its tokens' log-probabilities when asked for (a text
   * completion's offsets count from `promptChars`) and, for a bridge that asked, the ids of the
   * tokens it begins (`magus.tokens`, shared/continuation.ts).
   */
  text(text: string, index = 0, logprobs?: readonly TokenLogprob[], promptChars = 0, tokens?: readonly number[]): void {
    const end = tokens ? `],"magus":{"tokens":[${tokens.join(',')}]}}\n\n` : ']}\n\n';
    if (this.kind === 'text') {
      const lp = logprobs ? JSON.stringify(textLogprobs(logprobs, promptChars)) : 'null';
      this.write(`${this.prefix}{"index":${index},"text":${JSON.stringify(text)},"logprobs":${lp},"finish_reason":null}${end}`);
    } else {
      const lp = logprobs ? JSON.stringify(chatLogprobs(logprobs)) : 'null';
      this.write(`${this.prefix}{"index":0,"delta":{"content":${JSON.stringify(text)}},"logprobs":${lp},"finish_reason":null}${end}`);
    }
  }

  /** The calls of an answer, one delta each with its whole arguments (OpenAI's clients join fragments; one is a fragment too). */
  toolCalls(calls: readonly ToolCall[]): void {
    calls.forEach((c, index) => {
      const delta = { tool_calls: [{ index, ...c }] };
      this.write(`${this.prefix}{"index":0,"delta":${JSON.stringify(delta)},"logprobs":null,"finish_reason":null}]}\n\n`);
    });
  }

  finish(reason: FinishReason, index = 0): void {
    if (this.kind === 'text') this.write(`${this.prefix}{"index":${index},"text":"","logprobs":null,"finish_reason":"${reason}"}]}\n\n`);
    else this.write(`${this.prefix}{"index":0,"delta":{},"logprobs":null,"finish_reason":"${reason}"}]}\n\n`);
  }

  usage(usage: Usage): void {
    this.write(`${this.prefix}],"usage":${JSON.stringify(usage)}}\n\n`);
  }

  done(): void {
    this.write('data: [DONE]\n\n');
    this.end();
  }

  /** A failure after the stream started: one `{"error":…}` event, then the stream ends without `[DONE]`. */
  fail(err: EngineHttpError): void {
    this.write(`data: ${JSON.stringify(err.body())}\n\n`);
    this.end();
  }

  /**
   * Uncorks before ending: Node 24's `end()` sends the last chunk of a corked chunked response
   * ahead of the events still corked, so the client would see the stream end without them.
   */
  private end(): void {
    this.uncork();
    this.res.end();
  }
}

/** Any error as the OpenAI error to answer with; internals of unexpected errors are hidden. */
export function toEngineError(err: unknown): EngineHttpError {
  if (err instanceof Error && err.name === ENGINE_HTTP_ERROR) return err as EngineHttpError;
  const fe = err as Partial<FastifyError> | undefined;
  if (fe?.validation) return validationFailure(fe.validation);
  if (typeof fe?.statusCode === 'number' && fe.statusCode >= 400 && fe.statusCode < 500) {
    const message =
      fe.statusCode === 400 && /JSON/i.test(fe.message ?? '') ? 'We could not parse the JSON body of your request.' : (fe.message ?? 'Bad request.');
    return new EngineHttpError(fe.statusCode, message, 'invalid_request_error');
  }
  return new EngineHttpError(500, 'The engine had an internal error.', 'server_error');
}

/** The backend, or 503 while the model loads (`engine_starting` when it was mapped on standby) or the engine stops. */
function servingBackend(core: EngineCore): CompletionBackend {
  const backend = core.backend;
  if (backend) return backend;
  if (core.status !== 'loading') throw unavailable('The engine is shutting down.');
  throw core.mapped ? starting() : unavailable('The model is still loading.');
}

/** `POST /v1/embeddings`: every input's vector, in order (no slot: the backend embeds one request at a time). */
async function embed(core: EngineCore, request: FastifyRequest, reply: FastifyReply): Promise<EmbeddingsResponse | FastifyReply> {
  const backend = servingBackend(core);
  const embedder = backend.embeddings;
  if (!embedder) throw invalidRequest('This engine does not compute embeddings.', 'model', 'unsupported_feature');
  const body = request.body as EmbeddingsRequest;
  if (body.dimensions !== undefined && body.dimensions !== embedder.dimensions) {
    throw invalidRequest(
      `This model's embeddings have ${embedder.dimensions} dimensions and cannot be shortened; send \`dimensions: ${embedder.dimensions}\` or leave it out.`,
      'dimensions',
      'unsupported_value',
    );
  }
  const abort = new AbortController();
  const onClose = (): void => {
    if (!reply.raw.writableEnded) abort.abort(CLIENT_CLOSED);
  };
  reply.raw.on('close', onClose);
  core.track(abort);
  try {
    const inputs = embeddingInputs(body);
    const { vectors, promptTokens } = await embedder.embed(inputs, abort.signal);
    core.metrics.embeddedInputs += inputs.length;
    core.metrics.embeddedTokens += promptTokens;
    return {
      object: 'list',
      data: vectors.map((v, index) => ({ object: 'embedding', index, embedding: encodeEmbedding(v, body.encoding_format) })),
      model: core.modelId,
      usage: { prompt_tokens: promptTokens, total_tokens: promptTokens },
    };
  } catch (err) {
    if (abort.signal.reason === CLIENT_CLOSED) return reply.hijack();
    throw err;
  } finally {
    core.untrack(abort);
    reply.raw.off('close', onClose);
  }
}

/** One vector as OpenAI sends it: numbers, or base64 of its little-endian float32s. */
function encodeEmbedding(vector: readonly number[], format: 'float' | 'base64' | undefined): number[] | string {
  if (format !== 'base64') return [...vector];
  const out = Buffer.alloc(vector.length * 4);
  vector.forEach((v, i) => out.writeFloatLE(v, i * 4));
  return out.toString('base64');
}

/** What one request generates, one prepared generation per choice (chat: one), and how it is answered. */
interface Job {
  kind: 'chat' | 'text';
  stream: boolean;
  /** Chunks say the token ids their text begins (a bridge asked; one choice only). */
  streamTokens: boolean;
  /** It continues an earlier attempt's answer: the stream has no role chunk (the client has it). */
  resumes: boolean;
  /** It resumes an answer its client holds part of: it goes before the queue, to a resume slot if one is free (slots.ts). */
  urgent: boolean;
  includeUsage: boolean;
  prepared: PreparedCompletion[];
  /** Text completions: each prompt's length in characters (log-probabilities' `text_offset` counts from the prompt's start). */
  promptChars?: number[];
  /** How well a slot's KV cache serves the request (higher is better). */
  score?: (slot: number) => number;
}

/** `POST /v1/chat/completions`. */
function complete(core: EngineCore, opts: EngineApiOptions, request: FastifyRequest, reply: FastifyReply): Promise<unknown> {
  const arrived = performance.now();
  const backend = servingBackend(core);
  const req = normalizeRequest(request.body as ChatCompletionBody);
  const prepared = backend.prepare(req);
  const affinity = backend.affinity?.bind(backend);
  return serve(core, opts, reply, arrived, {
    kind: 'chat',
    stream: req.stream,
    streamTokens: req.streamTokens === true,
    resumes: req.resume !== undefined,
    urgent: holdsPart(req.resume),
    includeUsage: req.includeUsage,
    prepared: [prepared],
    ...(affinity ? { score: (slot) => affinity(slot, req) } : {}),
  });
}

/** `POST /v1/completions`: each prompt continued as raw text, one choice each, in one slot one after another. */
function completeText(core: EngineCore, opts: EngineApiOptions, request: FastifyRequest, reply: FastifyReply): Promise<unknown> {
  const arrived = performance.now();
  const backend = servingBackend(core);
  const prepareText = backend.prepareText?.bind(backend);
  if (!prepareText) throw invalidRequest('This engine does not serve text completions.', 'model', 'unsupported_feature');
  const body = request.body as CompletionsRequest;
  const req = normalizeTextRequest(body);
  if (req.resume && req.prompts.length > 1) throw invalidRequest('Only an answer to one prompt can be resumed.', 'magus.resume', RESUME_MISMATCH);
  const prepared = req.prompts.map((prompt, i) => prepareText(prompt, req, typeof body.prompt === 'string' ? 'prompt' : `prompt[${i}]`));
  return serve(core, opts, reply, arrived, {
    kind: 'text',
    stream: req.stream,
    streamTokens: req.streamTokens === true && req.prompts.length === 1,
    resumes: req.resume !== undefined,
    urgent: holdsPart(req.resume),
    includeUsage: req.includeUsage,
    prepared,
    promptChars: req.prompts.map((p) => p.length),
  });
}

/** Usage of several generations (a text completion's choices) as one. */
function sumUsage(prepared: readonly PreparedCompletion[], results: readonly GenerationResult[]): Usage {
  const promptTokens = prepared.reduce((n, p) => n + p.promptTokens, 0);
  return usageOf(promptTokens, {
    completionTokens: results.reduce((n, r) => n + r.completionTokens, 0),
    cachedPromptTokens: results.reduce((n, r) => n + r.cachedPromptTokens, 0),
  });
}

/** Takes a slot, generates the job's choices in it, and answers: JSON, or server-sent events. */
async function serve(core: EngineCore, opts: EngineApiOptions, reply: FastifyReply, arrived: number, job: Job): Promise<unknown> {
  const { metrics } = core;
  const res = reply.raw;
  const abort = new AbortController();
  const onClose = (): void => {
    if (!res.writableEnded) abort.abort(CLIENT_CLOSED);
  };
  res.on('close', onClose);
  const clientGone = (): FastifyReply => {
    metrics.countRequest(499);
    metrics.countError('client_closed');
    return reply.hijack();
  };

  let slot: number;
  try {
    // Another instance handed it back with nothing said (shared/continuation.ts `REQUEUED_HEADER`): after the urgent, before the rest.
    const first = reply.request.headers[REQUEUED_HEADER] === '1';
    // Its client's deadline (shared/continuation.ts `DUE_HEADER`): where one handed back stands among the queue.
    const dueHeader = reply.request.headers[DUE_HEADER];
    const due = typeof dueHeader === 'string' && /^\d{1,16}$/.test(dueHeader) ? Number(dueHeader) : undefined;
    slot = await core.slots.acquire({ signal: abort.signal, score: job.score, urgent: job.urgent, first, ...(due !== undefined ? { due } : {}) });
  } catch (err) {
    res.off('close', onClose);
    if (abort.signal.aborted) return clientGone();
    if (err instanceof Error && err.name === QUEUE_FULL_ERROR) {
      throw new EngineHttpError(429, `The engine is busy (${err.message}); retry later.`, 'rate_limit_error', null, 'queue_full', {
        'retry-after': String(core.retryAfterSeconds()),
      });
    }
    throw err;
  }

  const acquired = performance.now();
  metrics.queueWait.observe((acquired - arrived) / 1000);
  for (const p of job.prepared) metrics.promptTokens += p.promptTokens;
  core.track(abort);
  let firstText = 0;
  let generated = 0;
  const observeText = (): void => {
    if (firstText === 0) {
      firstText = performance.now();
      metrics.timeToFirstToken.observe((firstText - arrived) / 1000);
    }
  };
  const observeEnd = (results: readonly GenerationResult[]): void => {
    const end = performance.now();
    for (const { completionTokens, cachedPromptTokens } of results) {
      metrics.generatedTokens += completionTokens;
      metrics.cachedPromptTokens += cachedPromptTokens;
      generated += completionTokens;
    }
    metrics.requestDuration.observe((end - arrived) / 1000);
    if (firstText > 0 && generated > 1) metrics.timePerOutputToken.observe((end - firstText) / 1000 / (generated - 1));
  };
  const abortReason = (): EngineHttpError | typeof CLIENT_CLOSED => {
    const reason: unknown = abort.signal.reason;
    return reason === CLIENT_CLOSED ? CLIENT_CLOSED : toEngineError(reason);
  };

  const id = job.kind === 'chat' ? nextId() : `cmpl-${nextId().slice('chatcmpl-'.length)}`;
  const created = Math.floor(Date.now() / 1000);
  try {
    if (!job.stream) {
      const results: GenerationResult[] = [];
      try {
        for (const p of job.prepared) results.push(await p.generate(slot, { signal: abort.signal, onText: observeText }));
      } catch (err) {
        if (!abort.signal.aborted) throw err;
        const reason = abortReason();
        if (reason === CLIENT_CLOSED) return clientGone();
        throw reason;
      }
      observeEnd(results);
      metrics.countRequest(200);
      if (job.kind === 'text') {
        return {
          id,
          object: 'text_completion',
          created,
          model: core.modelId,
          choices: results.map((r, index) => ({
            index,
            text: r.text,
            logprobs: r.logprobs ? textLogprobs(r.logprobs, job.promptChars?.[index] ?? 0) : null,
            finish_reason: r.finishReason,
          })),
          usage: sumUsage(job.prepared, results),
        };
      }
      const result = results[0]!;
      const body: ChatCompletion = {
        id,
        object: 'chat.completion',
        created,
        model: core.modelId,
        choices: [
          {
            index: 0,
            message: result.toolCalls?.length
              ? { role: 'assistant', content: result.text === '' ? null : result.text, tool_calls: result.toolCalls }
              : { role: 'assistant', content: result.text },
            logprobs: result.logprobs ? chatLogprobs(result.logprobs) : null,
            finish_reason: result.finishReason,
          },
        ],
        usage: usageOf(job.prepared[0]!.promptTokens, result),
      };
      return body;
    }

    reply.hijack();
    res.writeHead(200, SSE_HEADERS);
    res.flushHeaders(); // now, not with the first chunk: a resumed answer sends no role chunk, and its bridge learns it has a slot
    const out = new ChunkWriter(res, id, created, core.modelId, job.kind);
    if (!job.resumes) out.role();
    try {
      const results: GenerationResult[] = [];
      for (const [index, p] of job.prepared.entries()) {
        const result = await p.generate(slot, {
          signal: abort.signal,
          onText: (text, logprobs, tokens) => {
            if (text.length === 0) return;
            observeText();
            out.text(text, index, logprobs, job.promptChars?.[index], job.streamTokens ? tokens : undefined);
          },
        });
        results.push(result);
        if (result.toolCalls?.length) out.toolCalls(result.toolCalls);
        out.finish(result.finishReason, index);
      }
      if (job.includeUsage) out.usage(sumUsage(job.prepared, results));
      out.done();
      observeEnd(results);
      metrics.countRequest(200);
    } catch (err) {
      const failure = abort.signal.aborted ? abortReason() : toEngineError(err);
      if (failure === CLIENT_CLOSED) {
        clientGone();
        return reply;
      }
      if (failure.status >= 500 && !abort.signal.aborted) (opts.logError ?? defaultLog)(`stream failed: ${describe(err)}`);
      metrics.countRequest(failure.status);
      metrics.countError(failure.type);
      out.fail(failure);
    }
    return reply;
  } finally {
    core.untrack(abort);
    core.slots.release(slot);
    res.off('close', onClose);
  }
}

const defaultLog = (message: string): void => {
  process.stderr.write(`magus engine: ${message}\n`);
};

const describe = (err: unknown): string => (err instanceof Error ? (err.stack ?? err.message) : String(err));

/** The engine API: register it on an instance made by {@link createEngineHttp} (or with the same ajv options). */
export const engineApi: FastifyPluginAsync<EngineApiOptions> = (app, opts) => {
  const { core } = opts;
  const logError = opts.logError ?? defaultLog;

  // dllama-api parses every body as JSON whatever its content type; so does the engine.
  app.removeContentTypeParser('text/plain');
  app.addContentTypeParser('*', { parseAs: 'string' }, (_req, body, done) => {
    try {
      done(null, JSON.parse(body as string));
    } catch {
      done(Object.assign(new Error('We could not parse the JSON body of your request.'), { statusCode: 400 }), undefined);
    }
  });

  app.setErrorHandler((err: FastifyError, request, reply) => {
    const e = toEngineError(err);
    if (e.status >= 500 && err.name !== ENGINE_HTTP_ERROR) logError(`${request.method} ${request.url}: ${describe(err)}`);
    if (request.routeOptions.url === COMPLETIONS_URL || request.routeOptions.url === TEXT_COMPLETIONS_URL) {
      core.metrics.countRequest(e.status);
      core.metrics.countError(e.type);
    }
    return reply.code(e.status).headers(e.headers).send(e.body());
  });

  app.setNotFoundHandler((request, reply) =>
    reply
      .code(404)
      .send(new EngineHttpError(404, `Unknown request URL: ${request.method} ${request.url}.`, 'invalid_request_error', null, 'unknown_url').body()),
  );

  app.addHook('onSend', async (_request, reply, payload) => {
    reply.header('access-control-allow-origin', '*');
    return payload;
  });

  // CORS preflight, answered like dllama-api.
  app.options('*', (_request, reply) =>
    reply.code(204).headers({ 'access-control-allow-methods': 'GET, POST, PUT, DELETE', 'access-control-allow-headers': 'Content-Type, Authorization' }).send(),
  );

  app.post(COMPLETIONS_URL, {
    schema: { body: chatCompletionBodySchema, response: chatCompletionResponseSchemas },
    ...(opts.preValidation ? { preValidation: opts.preValidation } : {}),
    handler: (request, reply) => complete(core, opts, request, reply),
  });

  app.post(EMBEDDINGS_URL, { schema: { body: EmbeddingsRequest } }, (request, reply) => embed(core, request, reply));

  app.post(TEXT_COMPLETIONS_URL, {
    // The client's body as the gateway takes it: what the engine cannot honour (`echo` …) is refused, not ignored.
    schema: { body: completionsBodySchema },
    ...(opts.preValidation ? { preValidation: opts.preValidation } : {}),
    handler: (request, reply) => completeText(core, opts, request, reply),
  });

  app.get('/v1/models', { schema: { response: modelListResponseSchema } }, () => ({
    object: 'list',
    data: [{ id: core.modelId, object: 'model', created: core.created, owned_by: 'magus' }],
  }));

  app.get('/health', { schema: { response: healthResponseSchema } }, (_request, reply) => {
    const size = core.slots.size;
    return reply.code(core.status === 'ready' ? 200 : 503).send({
      status: core.status === 'ready' ? 'ok' : core.status,
      model: core.modelId,
      slots: Number.isFinite(size) ? size : -1,
      busy: core.slots.busy,
      queued: core.slots.queued,
    });
  });

  app.get('/metrics', (_request, reply) =>
    reply.type('text/plain; version=0.0.4; charset=utf-8').send(
      core.metrics.render({
        loaded: core.status === 'ready',
        slots: core.slots.size,
        busy: core.slots.busy,
        queued: core.slots.queued,
        ...(core.backend?.snapshots ? { snapshots: core.backend.snapshots } : {}),
      }),
    ),
  );

  return Promise.resolve();
};

export interface EngineHttpOptions extends Omit<EngineApiOptions, 'core'> {
  /** Destroy open connections on close instead of letting them finish (stubs). Default false. */
  forceCloseConnections?: boolean;
}

/**
 * A fastify instance serving the engine API. Validation does not coerce types (`"0.5"` is not a
 * temperature) and keeps unknown fields; generations may stream for minutes, so no request timeout.
 */
export function createEngineHttp(core: EngineCore, opts: EngineHttpOptions = {}): FastifyInstance {
  const { forceCloseConnections = false, ...api } = opts;
  const app = fastify({
    logger: false,
    bodyLimit: 16 * 1024 * 1024,
    keepAliveTimeout: 65_000,
    requestTimeout: 0,
    forceCloseConnections: forceCloseConnections ? true : 'idle',
    ajv: { customOptions: { coerceTypes: false, removeAdditional: false, useDefaults: false, allowUnionTypes: true } },
  });
  void app.register(engineApi, { core, ...api });
  return app;
}

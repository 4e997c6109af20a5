/**
 * The engine's HTTP contract (the OpenAI chat-completions subset `dllama-api` serves): the
 * request body schema, its normalised form, the error shape, and the backend interface that
 * turns a request into text. Shared by the real engine (node-llama-cpp) and the stub engine
 * (test/fixtures/stub-engine.ts), so both speak exactly the same HTTP.
 */
import type { FastifySchemaValidationError } from 'fastify';
import type { ChatMessage, CompletionUsage } from '../shared/serving';

/** OpenAI's `finish_reason` values the engine produces. */
export type FinishReason = 'stop' | 'length';

/** A validated chat-completion request with defaults applied. */
export interface ChatRequest {
  /** `developer` messages arrive as `system`. */
  messages: ChatMessage[];
  stream: boolean;
  /** `stream_options.include_usage`: end the stream with a usage chunk. */
  includeUsage: boolean;
  /** `max_completion_tokens` ?? `max_tokens`; absent = until the context is full. */
  maxTokens?: number;
  /** 0 = greedy. Default 1 (OpenAI's). */
  temperature: number;
  topP: number;
  /** uint32 (OpenAI seeds are int64; reduced modulo 2^32). */
  seed?: number;
  /** Stop texts: generation ends before the first one and it is not returned. */
  stop: string[];
  frequencyPenalty: number;
  presencePenalty: number;
}

/** What generating a completion produced. */
export interface GenerationResult {
  text: string;
  finishReason: FinishReason;
  /** Tokens sampled (including a stop token or stop text that is not returned). */
  completionTokens: number;
  /**
   * Prompt tokens the slot's KV cache already held, so they were not evaluated again (OpenAI's
   * `usage.prompt_tokens_details.cached_tokens`); 0 for a backend without a cache.
   */
  cachedPromptTokens: number;
}

/** Callbacks and cancellation for one generation. */
export interface GenerationIO {
  /** Aborted when the client goes away or the engine stops; the generation then rejects. */
  signal: AbortSignal;
  /** Called with each new piece of the returned text, in order. */
  onText(text: string): void;
}

/** A request the backend has measured and accepted; generating it needs a slot. */
export interface PreparedCompletion {
  promptTokens: number;
  generate(slot: number, io: GenerationIO): Promise<GenerationResult>;
}

/** Turns requests into text: node-llama-cpp in the engine, canned text in the stub. */
export interface CompletionBackend {
  /**
   * Applies the chat template and measures the prompt, before the request queues for a slot.
   * @throws EngineHttpError (400 `context_length_exceeded`) when the prompt cannot fit
   */
  prepare(req: ChatRequest): PreparedCompletion;
  /** How well `slot`'s cached state serves `req` (higher is better; slots are otherwise equal). */
  affinity?(slot: number, req: ChatRequest): number;
}

// ---------------------------------------------------------------------------------------------
// Errors

/** OpenAI error types used by the engine. */
export type OpenAiErrorType = 'invalid_request_error' | 'rate_limit_error' | 'server_error';

/** `{"error": {...}}`, OpenAI's error body. */
export interface OpenAiErrorBody {
  error: { message: string; type: OpenAiErrorType; param: string | null; code: string | null };
}

export const ENGINE_HTTP_ERROR = 'EngineHttpError';

/** An error with the HTTP status and OpenAI error fields to answer it with. */
export class EngineHttpError extends Error {
  override readonly name = ENGINE_HTTP_ERROR;
  constructor(
    readonly status: number,
    message: string,
    readonly type: OpenAiErrorType,
    readonly param: string | null = null,
    readonly code: string | null = null,
    /** Extra response headers (e.g. `retry-after`). */
    readonly headers: Record<string, string> = {},
  ) {
    super(message);
  }

  body(): OpenAiErrorBody {
    return { error: { message: this.message, type: this.type, param: this.param, code: this.code } };
  }
}

export const invalidRequest = (message: string, param: string | null = null, code: string | null = null): EngineHttpError =>
  new EngineHttpError(400, message, 'invalid_request_error', param, code);

export const unavailable = (message: string): EngineHttpError => new EngineHttpError(503, message, 'server_error', null, 'engine_unavailable');

// ---------------------------------------------------------------------------------------------
// Request body

const nullable = <T extends string>(type: T): [T, 'null'] => [type, 'null'];

/**
 * JSON schema of the request body. Unknown fields are ignored (as `dllama-api` does); fields the
 * engine cannot honour with another value (`n`) are rejected. Validated without type coercion.
 */
export const chatCompletionBodySchema = {
  type: 'object',
  required: ['messages'],
  properties: {
    model: { type: 'string' },
    messages: {
      type: 'array',
      minItems: 1,
      items: {
        type: 'object',
        required: ['role', 'content'],
        properties: {
          role: { type: 'string', enum: ['system', 'developer', 'user', 'assistant'] },
          content: { type: 'string' },
          name: { type: 'string' },
        },
      },
    },
    stream: { type: nullable('boolean') },
    stream_options: { type: nullable('object'), properties: { include_usage: { type: 'boolean' } } },
    max_tokens: { type: nullable('integer'), minimum: 1 },
    max_completion_tokens: { type: nullable('integer'), minimum: 1 },
    temperature: { type: nullable('number'), minimum: 0, maximum: 2 },
    top_p: { type: nullable('number'), minimum: 0, maximum: 1 },
    seed: { type: nullable('integer') },
    // `items`, `maxItems` apply to the array form only, `minLength` to the string form only.
    stop: { type: ['string', 'array', 'null'], minLength: 1, maxItems: 4, items: { type: 'string', minLength: 1 } },
    n: { type: nullable('integer'), minimum: 1, maximum: 1 },
    frequency_penalty: { type: nullable('number'), minimum: -2, maximum: 2 },
    presence_penalty: { type: nullable('number'), minimum: -2, maximum: 2 },
  },
} as const;

/** The body as the schema admits it. */
export interface ChatCompletionBody {
  model?: string;
  messages: { role: 'system' | 'developer' | 'user' | 'assistant'; content: string; name?: string }[];
  stream?: boolean | null;
  stream_options?: { include_usage?: boolean } | null;
  max_tokens?: number | null;
  max_completion_tokens?: number | null;
  temperature?: number | null;
  top_p?: number | null;
  seed?: number | null;
  stop?: string | string[] | null;
  n?: number | null;
  frequency_penalty?: number | null;
  presence_penalty?: number | null;
}

/** Applies defaults to a body that passed {@link chatCompletionBodySchema}. */
export function normalizeRequest(body: ChatCompletionBody): ChatRequest {
  const stop = body.stop == null ? [] : typeof body.stop === 'string' ? [body.stop] : body.stop;
  return {
    messages: body.messages.map((m) => ({ role: m.role === 'developer' ? 'system' : m.role, content: m.content })),
    stream: body.stream === true,
    includeUsage: body.stream === true && body.stream_options?.include_usage === true,
    maxTokens: body.max_completion_tokens ?? body.max_tokens ?? undefined,
    temperature: body.temperature ?? 1,
    topP: body.top_p ?? 1,
    seed: body.seed == null ? undefined : Number(BigInt.asUintN(32, BigInt(body.seed))),
    stop,
    frequencyPenalty: body.frequency_penalty ?? 0,
    presencePenalty: body.presence_penalty ?? 0,
  };
}

/** `/messages/0/role` → `messages[0].role` (OpenAI's `param` spelling). */
export function paramPath(instancePath: string, child?: string): string | null {
  const parts = instancePath.split('/').filter(Boolean);
  if (child !== undefined) parts.push(child);
  let out = '';
  for (const p of parts) out += /^\d+$/.test(p) ? `[${p}]` : out ? `.${p}` : p;
  return out || null;
}

const TYPE_NAMES: Record<string, string> = { integer: 'an integer', number: 'a number', string: 'a string', boolean: 'a boolean', object: 'an object', array: 'an array' };

/** The first schema violation as a 400 in OpenAI's shape, naming the offending `param`. */
export function validationFailure(errors: readonly FastifySchemaValidationError[]): EngineHttpError {
  const e = errors[0];
  if (e === undefined) return invalidRequest('Invalid request body.');
  const params = e.params;
  if (e.keyword === 'required') {
    const param = paramPath(e.instancePath, String(params.missingProperty));
    return invalidRequest(`Missing required parameter: '${param}'.`, param, 'missing_required_parameter');
  }
  const param = paramPath(e.instancePath);
  const name = param ?? 'body';
  if (e.keyword === 'type') {
    const types = String(params.type)
      .split(',')
      .filter((t) => t !== 'null')
      .map((t) => TYPE_NAMES[t] ?? t);
    return invalidRequest(`Invalid type for '${name}': expected ${types.join(' or ')}.`, param, 'invalid_type');
  }
  if (e.keyword === 'enum') {
    const allowed = (params.allowedValues as unknown[]).map(String).join(', ');
    return invalidRequest(`Invalid value for '${name}': expected one of ${allowed}.`, param, 'invalid_value');
  }
  return invalidRequest(`Invalid value for '${name}': ${e.message ?? 'not allowed'}.`, param, 'invalid_value');
}

// ---------------------------------------------------------------------------------------------
// Response bodies (schemas let fastify serialise them quickly and keep the shape exact)

const errorResponseSchema = {
  type: 'object',
  properties: {
    error: {
      type: 'object',
      properties: { message: { type: 'string' }, type: { type: 'string' }, param: { type: nullable('string') }, code: { type: nullable('string') } },
    },
  },
} as const;

const usageSchema = {
  type: 'object',
  properties: {
    prompt_tokens: { type: 'integer' },
    completion_tokens: { type: 'integer' },
    total_tokens: { type: 'integer' },
    prompt_tokens_details: { type: 'object', properties: { cached_tokens: { type: 'integer' } } },
  },
} as const;

/** Response schemas by status for `POST /v1/chat/completions` (non-streaming). */
export const chatCompletionResponseSchemas = {
  200: {
    type: 'object',
    properties: {
      id: { type: 'string' },
      object: { type: 'string' },
      created: { type: 'integer' },
      model: { type: 'string' },
      choices: {
        type: 'array',
        items: {
          type: 'object',
          properties: {
            index: { type: 'integer' },
            message: { type: 'object', properties: { role: { type: 'string' }, content: { type: 'string' } } },
            logprobs: { type: 'null' },
            finish_reason: { type: 'string' },
          },
        },
      },
      usage: usageSchema,
    },
  },
  '4xx': errorResponseSchema,
  '5xx': errorResponseSchema,
} as const;

export const modelListResponseSchema = {
  200: {
    type: 'object',
    properties: {
      object: { type: 'string' },
      data: {
        type: 'array',
        items: { type: 'object', properties: { id: { type: 'string' }, object: { type: 'string' }, created: { type: 'integer' }, owned_by: { type: 'string' } } },
      },
    },
  },
} as const;

const healthSchema = {
  type: 'object',
  properties: { status: { type: 'string' }, model: { type: 'string' }, slots: { type: 'integer' }, busy: { type: 'integer' }, queued: { type: 'integer' } },
} as const;

export const healthResponseSchema = { 200: healthSchema, 503: healthSchema } as const;

/** `chat.completion` (non-streaming answer). */
export interface ChatCompletion {
  id: string;
  object: 'chat.completion';
  created: number;
  model: string;
  choices: { index: 0; message: { role: 'assistant'; content: string }; logprobs: null; finish_reason: FinishReason }[];
  usage: Usage;
}

/** OpenAI's `usage`: the engine always says how much of the prompt its slot had cached. */
export type Usage = Required<CompletionUsage>;

/** The `usage` of an answer to a prompt of `promptTokens`. */
export function usageOf(promptTokens: number, result: Pick<GenerationResult, 'completionTokens' | 'cachedPromptTokens'>): Usage {
  return {
    prompt_tokens: promptTokens,
    completion_tokens: result.completionTokens,
    total_tokens: promptTokens + result.completionTokens,
    prompt_tokens_details: { cached_tokens: result.cachedPromptTokens },
  };
}

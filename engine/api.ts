/**
 * The engine's HTTP contract (the OpenAI chat-completions subset `dllama-api` serves): the
 * request body schema, its normalised form, the error shape, and the backend interface that
 * turns a request into text. Shared by the real engine (node-llama-cpp) and the stub engine
 * (test/fixtures/stub-engine.ts), so both speak exactly the same HTTP.
 */
import { Type, type Static, type TNull, type TOptional, type TProperties, type TSchema, type TUnion } from '@sinclair/typebox';
import type { FastifySchemaValidationError } from 'fastify';
import {
  ChatCompletionBody as OpenAiChatBody,
  ChatCompletionRequest,
  ChatMessage,
  StringEnum,
  checkStructure,
  type ToolCall,
  type ToolSpec,
} from '../shared/chat';
import type { GrammarSchema } from '../shared/json-schema';
import { COMPLETIONS_DEFAULT_MAX_TOKENS, CompletionsRequest, promptsOf } from '../shared/completions';
import { ENGINE_STARTING, EngineExtension, type ResumedAnswer } from '../shared/continuation';
import type { CompletionUsage } from '../shared/serving';
import type { SnapshotStats } from './snapshots';

/** OpenAI's `finish_reason` values the engine produces. */
export type FinishReason = 'stop' | 'length' | 'tool_calls';

/** How a request samples and answers, with defaults applied: what chat and text completions share. */
export interface Sampling {
  stream: boolean;
  /** `stream_options.include_usage`: end the stream with a usage chunk. */
  includeUsage: boolean;
  /** 0 = greedy. Default 1 (OpenAI's). */
  temperature: number;
  topP: number;
  /** 0 = off; absent = the backend's default (node-llama-cpp's 40). */
  topK?: number;
  /** llama.cpp's repeat penalty (1 = off, the default) over the last 64 tokens. */
  repetitionPenalty: number;
  /** uint32 (OpenAI seeds are int64; reduced modulo 2^32). */
  seed?: number;
  /** Stop texts: generation ends before the first one and it is not returned. */
  stop: string[];
  frequencyPenalty: number;
  presencePenalty: number;
  /** Each token's log-probability with this many alternatives; absent = none. */
  logprobs?: number;
  /** A bridge's: streamed chunks say the token ids their text begins (shared/continuation.ts). */
  streamTokens?: boolean;
  /** A bridge's: the answer so far, continued from its next position (shared/continuation.ts). */
  resume?: ResumedAnswer;
}

/** The sampling fields as a chat or text-completion body has them (any optional one may be `null`). */
interface SamplingFields {
  stream?: boolean | null;
  stream_options?: { include_usage?: boolean } | null;
  temperature?: number | null;
  top_p?: number | null;
  top_k?: number | null;
  repetition_penalty?: number | null;
  seed?: number | null;
  stop?: string | string[] | null;
  frequency_penalty?: number | null;
  presence_penalty?: number | null;
  magus?: EngineExtension | null;
}

/** {@link Sampling} of a body, defaults applied (`logprobs`, spelt differently by chat and text completions, aside). */
function samplingOf(body: SamplingFields): Omit<Sampling, 'logprobs'> {
  return {
    stream: body.stream === true,
    includeUsage: body.stream === true && body.stream_options?.include_usage === true,
    temperature: body.temperature ?? 1,
    topP: body.top_p ?? 1,
    ...(body.top_k == null ? {} : { topK: body.top_k }),
    repetitionPenalty: body.repetition_penalty ?? 1,
    ...(body.seed == null ? {} : { seed: Number(BigInt.asUintN(32, BigInt(body.seed))) }),
    stop: body.stop == null ? [] : typeof body.stop === 'string' ? [body.stop] : body.stop,
    frequencyPenalty: body.frequency_penalty ?? 0,
    presencePenalty: body.presence_penalty ?? 0,
    ...(body.magus?.tokens === true ? { streamTokens: true } : {}),
    ...(body.magus?.resume ? { resume: body.magus.resume } : {}),
  };
}

/** A validated text-completion request with defaults applied: prompts in place of messages. */
export interface TextRequest extends Sampling {
  prompts: string[];
  /** Default 16 (OpenAI's for completions). */
  maxTokens: number;
}

/**
 * JSON schema of a `/v1/completions` body: the request the bridge forwards (shared/completions.ts),
 * plus the fields a client may send that ask for what the engine does not do — accepted only in
 * their plain form, so they are refused rather than ignored.
 */
export const completionsBodySchema = Type.Object({
  ...CompletionsRequest.properties,
  model: Type.Optional(Type.String()),
  n: Type.Optional(Type.Union([Type.Null(), Type.Integer({ minimum: 1, maximum: 1 })])),
  best_of: Type.Optional(Type.Union([Type.Null(), Type.Integer({ minimum: 1, maximum: 1 })])),
  echo: Type.Optional(Type.Union([Type.Null(), Type.Literal(false)])),
  suffix: Type.Optional(Type.Union([Type.Null(), Type.Literal('')])),
  magus: Type.Optional(Type.Union([EngineExtension, Type.Null()])),
});

/** Defaults of a body that passed {@link completionsBodySchema}. */
export function normalizeTextRequest(body: CompletionsRequest): TextRequest {
  return {
    ...samplingOf(body),
    prompts: promptsOf(body),
    maxTokens: body.max_tokens ?? COMPLETIONS_DEFAULT_MAX_TOKENS,
    ...(body.logprobs == null ? {} : { logprobs: body.logprobs }),
  };
}

/** A validated chat-completion request with defaults applied. */
export interface ChatRequest extends Sampling {
  /** `developer` messages arrive as `system`. */
  messages: ChatMessage[];
  /** `max_completion_tokens` ?? `max_tokens`; absent = until the context is full. */
  maxTokens?: number;
  /** Functions the model may call (`tools`), and how: `auto` (text or calls), `required` (a call), a name (a call of it). */
  tools: ToolSpec[];
  toolChoice: 'auto' | 'required' | { name: string };
  /** Whether one answer may hold several calls (`parallel_tool_calls`, default true). */
  parallelToolCalls: boolean;
  /** Structured output: any JSON object, or JSON valid against a schema (converted for the grammar); absent = text. */
  responseFormat?: { type: 'json_object' } | { type: 'json_schema'; schema: GrammarSchema };
}

/** One candidate for a position of the answer: its text, UTF-8 bytes and natural-log probability. */
export interface TokenChoice {
  token: string;
  logprob: number;
  bytes: number[];
}

/** A returned token's log-probability, its most likely alternatives (most likely first), and where its text starts in the answer. */
export interface TokenLogprob extends TokenChoice {
  top: TokenChoice[];
  /** Characters of the answer before this token's text. */
  offset: number;
}

/** What generating a completion produced. */
export interface GenerationResult {
  text: string;
  finishReason: FinishReason;
  /** The calls the model made, in OpenAI's shape (`finishReason` is then `tool_calls`). */
  toolCalls?: ToolCall[];
  /** Tokens sampled (including a stop token or stop text that is not returned). */
  completionTokens: number;
  /**
   * Prompt tokens the slot's KV cache already held, so they were not evaluated again (OpenAI's
   * `usage.prompt_tokens_details.cached_tokens`); 0 for a backend without a cache.
   */
  cachedPromptTokens: number;
  /** The returned tokens' log-probabilities, when the request asked for them. */
  logprobs?: TokenLogprob[];
}

/** Callbacks and cancellation for one generation. */
export interface GenerationIO {
  /** Aborted when the client goes away or the engine stops; the generation then rejects. */
  signal: AbortSignal;
  /**
   * Called with each new piece of the returned text, in order, the log-probabilities (when asked
   * for) of the tokens it completes, and — from backends that can continue an answer — the ids of
   * the tokens whose text begins in it (shared/continuation.ts).
   */
  onText(text: string, logprobs?: TokenLogprob[], tokens?: readonly number[]): void;
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
  /** Backends that compute embeddings: their vectors' length and the computation. */
  embeddings?: EmbeddingBackend;
  /**
   * Backends that continue raw text (`/v1/completions`): measures one prompt before the request
   * queues for a slot (`param` names it in a refusal).
   * @throws EngineHttpError (400 `context_length_exceeded`) when the prompt cannot fit
   */
  prepareText?(prompt: string, req: TextRequest, param: string): PreparedCompletion;
  /** Backends that save their slots' KV caches (engine/snapshots.ts): what they saved and loaded. */
  readonly snapshots?: SnapshotStats;
}

/** Embeddings of a model: one vector per input, in order. */
export interface EmbeddingBackend {
  /** The length of every vector (the model's embedding size). */
  readonly dimensions: number;
  /**
   * Embeds each input (a text, or token ids) on its own, one request at a time.
   * @throws EngineHttpError (400 `context_length_exceeded`, naming the input) when one is longer than the embedding context
   */
  embed(inputs: readonly (string | readonly number[])[], signal: AbortSignal): Promise<{ vectors: number[][]; promptTokens: number }>;
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
/** 503 while an engine started from standby makes its context (shared/continuation.ts `ENGINE_STARTING`). */
export const starting = (): EngineHttpError => new EngineHttpError(503, 'The engine is starting (its model is loaded).', 'server_error', null, ENGINE_STARTING);

// ---------------------------------------------------------------------------------------------
// Request body

const nullable = <T extends string>(type: T): [T, 'null'] => [type, 'null'];

/** Each of `properties`, optional and also `null` (OpenAI's clients send `null` for "not given"). */
function orNull<P extends TProperties>(properties: P): { [K in keyof P]: TOptional<TUnion<[P[K], TNull]>> } {
  const out: Record<string, TSchema> = {};
  for (const [key, schema] of Object.entries(properties)) out[key] = Type.Optional(Type.Union([Type.Optional(schema, false), Type.Null()]));
  return out as { [K in keyof P]: TOptional<TUnion<[P[K], TNull]>> };
}

/**
 * JSON schema of the request body: the request the bridge forwards (shared/chat.ts
 * `ChatCompletionRequest`: same fields, same bounds), as leniently as `dllama-api`'s own clients
 * need — `model` optional and unchecked, `developer` messages (OpenAI's newer `system`) with an
 * ignored `name`, any optional field `null` — plus `max_completion_tokens` and `n` (only 1), which
 * such clients send. Unknown fields are ignored (as `dllama-api` does); fields the engine cannot
 * honour with another value (`n`) are rejected. Validated without type coercion.
 */
export const chatCompletionBodySchema = Type.Object({
  model: Type.Optional(Type.String()),
  messages: Type.Array(
    Type.Object({
      role: StringEnum(['system', 'developer', 'user', 'assistant', 'tool']),
      content: Type.Union([Type.String(), Type.Null()]),
      name: Type.Optional(Type.String()),
      tool_calls: Type.Optional(Type.Union([ChatMessage.properties.tool_calls, Type.Null()])),
      tool_call_id: Type.Optional(Type.Union([ChatMessage.properties.tool_call_id, Type.Null()])),
    }),
    { minItems: 1 },
  ),
  ...orNull({
    ...Type.Omit(ChatCompletionRequest, ['model', 'messages']).properties,
    max_completion_tokens: OpenAiChatBody.properties.max_completion_tokens,
    n: Type.Integer({ minimum: 1, maximum: 1 }),
    magus: EngineExtension,
  }),
});

/** The body as the schema admits it. */
export type ChatCompletionBody = Static<typeof chatCompletionBodySchema>;

/** Applies defaults to a body that passed {@link chatCompletionBodySchema}. */
export function normalizeRequest(body: ChatCompletionBody): ChatRequest {
  const checked = checkStructure(body);
  if (!checked.ok) throw invalidRequest(checked.problem.message, checked.problem.param, checked.problem.code);
  const { responseFormat } = checked.structure;
  // Tools: none offered, or `tool_choice: "none"`, is plain chat.
  const choice = body.tool_choice ?? 'auto';
  const tools = choice === 'none' ? [] : checked.structure.tools;
  return {
    ...(responseFormat ? { responseFormat } : {}),
    tools,
    toolChoice: typeof choice === 'object' ? { name: choice.function.name } : choice === 'required' ? 'required' : 'auto',
    parallelToolCalls: body.parallel_tool_calls !== false,
    messages: body.messages.map((m): ChatMessage => {
      const out: ChatMessage = { role: m.role === 'developer' ? 'system' : m.role, content: m.content ?? '' };
      if (m.tool_calls?.length) out.tool_calls = m.tool_calls;
      if (m.tool_call_id) out.tool_call_id = m.tool_call_id;
      return out;
    }),
    ...samplingOf(body),
    maxTokens: body.max_completion_tokens ?? body.max_tokens ?? undefined,
    // `logprobs: true` with `top_logprobs` alternatives.
    ...(body.logprobs === true ? { logprobs: body.top_logprobs ?? 0 } : {}),
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

const TYPE_NAMES: Record<string, string> = {
  integer: 'an integer',
  number: 'a number',
  string: 'a string',
  boolean: 'a boolean',
  object: 'an object',
  array: 'an array',
};

/** How deep in the body an error points (a missing property counts as one level below its object). */
const depth = (e: FastifySchemaValidationError): number => e.instancePath.split('/').length + (e.keyword === 'required' ? 1 : 0);

/**
 * The schema violation as a 400 in OpenAI's shape, naming the offending `param`. In an `anyOf` (a
 * nullable field, `stop`) every branch reports: the error deepest in the body is the one that
 * says what is wrong (`stop[1]`, not `stop`), and the types of all branches are what was expected.
 */
export function validationFailure(errors: readonly FastifySchemaValidationError[]): EngineHttpError {
  // At equal depth a bound beats a type: `21` for an integer-or-null is too large, not of the wrong type.
  const e = errors.reduce<FastifySchemaValidationError | undefined>(
    (best, o) => (best === undefined || depth(o) > depth(best) || (depth(o) === depth(best) && best.keyword === 'type' && o.keyword !== 'type') ? o : best),
    undefined,
  );
  if (e === undefined) return invalidRequest('Invalid request body.');
  const params = e.params;
  if (e.keyword === 'required') {
    const param = paramPath(e.instancePath, String(params.missingProperty));
    return invalidRequest(`Missing required parameter: '${param}'.`, param, 'missing_required_parameter');
  }
  const param = paramPath(e.instancePath);
  const name = param ?? 'body';
  if (e.keyword === 'type') {
    const types = new Set(errors.filter((o) => o.keyword === 'type' && o.instancePath === e.instancePath).flatMap((o) => String(o.params.type).split(',')));
    types.delete('null');
    return invalidRequest(`Invalid type for '${name}': expected ${[...types].map((t) => TYPE_NAMES[t] ?? t).join(' or ')}.`, param, 'invalid_type');
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

const tokenChoiceProperties = { token: { type: 'string' }, logprob: { type: 'number' }, bytes: { type: 'array', items: { type: 'integer' } } } as const;
/** A chat answer's token in `logprobs.content`. */
const tokenLogprobSchema = {
  type: 'object',
  properties: { ...tokenChoiceProperties, top_logprobs: { type: 'array', items: { type: 'object', properties: tokenChoiceProperties } } },
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
            message: {
              type: 'object',
              properties: {
                role: { type: 'string' },
                content: { type: nullable('string') },
                tool_calls: {
                  type: 'array',
                  items: {
                    type: 'object',
                    properties: {
                      id: { type: 'string' },
                      type: { type: 'string' },
                      function: { type: 'object', properties: { name: { type: 'string' }, arguments: { type: 'string' } } },
                    },
                  },
                },
              },
            },
            logprobs: {
              type: nullable('object'),
              properties: { content: { type: 'array', items: tokenLogprobSchema }, refusal: { type: 'null' } },
            },
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
        items: {
          type: 'object',
          properties: { id: { type: 'string' }, object: { type: 'string' }, created: { type: 'integer' }, owned_by: { type: 'string' } },
        },
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
  choices: {
    index: 0;
    message: { role: 'assistant'; content: string | null; tool_calls?: ToolCall[] };
    logprobs: ChatLogprobs | null;
    finish_reason: FinishReason;
  }[];
  usage: Usage;
}

/** A chat choice's `logprobs`, in OpenAI's shape. */
export interface ChatLogprobs {
  content: (TokenChoice & { top_logprobs: TokenChoice[] })[];
  refusal: null;
}

/** Log-probabilities as a chat choice carries them. */
export const chatLogprobs = (logprobs: readonly TokenLogprob[]): ChatLogprobs => ({
  content: logprobs.map(({ token, logprob, bytes, top }) => ({ token, logprob, bytes, top_logprobs: top })),
  refusal: null,
});

/** A text completion choice's `logprobs`, in OpenAI's legacy shape (`text_offset` counts from the prompt's start, as if it were echoed). */
export interface TextLogprobs {
  tokens: string[];
  token_logprobs: number[];
  top_logprobs: Record<string, number>[];
  text_offset: number[];
}

/** Log-probabilities as a text completion choice carries them, for a prompt of `promptChars` characters. */
export const textLogprobs = (logprobs: readonly TokenLogprob[], promptChars: number): TextLogprobs => ({
  tokens: logprobs.map((l) => l.token),
  token_logprobs: logprobs.map((l) => l.logprob),
  top_logprobs: logprobs.map((l) => Object.fromEntries(l.top.map((t) => [t.token, t.logprob]))),
  text_offset: logprobs.map((l) => promptChars + l.offset),
});

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

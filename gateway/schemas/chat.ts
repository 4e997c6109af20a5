/**
 * `POST /v1/chat/completions`: the request body magus accepts (compiled once at start-up by
 * fastify's validator, and published as is in the OpenAPI description) and its response. Fields
 * OpenAI defines that only tune sampling (penalties, `logit_bias`, `user` …) are accepted and
 * ignored, so stock clients work; fields that ask for a different kind of answer — tool calls,
 * structured output, log-probabilities, several choices — accept only their empty or plain form
 * ({@link unsupported}): anything else is a 400 `unsupported_feature` naming the field, since
 * answering them with plain text would be a silent failure. Only the fields below reach the engine.
 */
import { SESSION_ID_PATTERN } from '../plugins/conversation';
import { errorResponses } from './errors';

const textPart = {
  type: 'object',
  required: ['type', 'text'],
  properties: { type: { type: 'string', enum: ['text'] }, text: { type: 'string' } },
} as const;

// A `description` on a checked value completes the sentence "<param> must be …" of its 400
// (plugins/errors.ts), and tells readers of the OpenAPI description the same.

/** A message's text: a string, or OpenAI's list of text parts (joined before forwarding). */
const text = [{ type: 'string' }, { type: 'array', maxItems: 1024, items: textPart }] as const;
const name = { type: 'string', maxLength: 256 } as const;

/** `system` and `user` messages: `content` is required and never null (OpenAI refuses null too). */
const promptMessage = {
  type: 'object',
  required: ['role', 'content'],
  properties: {
    role: { type: 'string', enum: ['system', 'user'] },
    content: { description: 'a string or a list of text parts', anyOf: text },
    name,
  },
} as const;

/**
 * The assistant's own earlier turns. OpenAI's rule: `content` may be null only beside `tool_calls`
 * (or the older `function_call`), the shape OpenAI clients replay a tool-calling turn in. magus
 * runs no tools (a request with `tools` is {@link unsupported}): those calls are accepted
 * as history and not forwarded; the engine sees the turn's text, `""` for null.
 */
const assistantMessage = {
  type: 'object',
  required: ['role', 'content'],
  properties: {
    role: { type: 'string', enum: ['assistant'] },
    content: { description: 'a string, a list of text parts, or null beside tool_calls', anyOf: [...text, { type: 'null' }] },
    name,
    tool_calls: { type: 'array', items: { type: 'object' } },
    function_call: { type: 'object' },
  },
  // Text, or calls: a null content needs at least one tool call (or a function call) beside it.
  anyOf: [
    { properties: { content: { description: 'a string or a list of text parts (null only beside tool_calls or function_call)', not: { type: 'null' } } } },
    { required: ['tool_calls'], properties: { tool_calls: { type: 'array', minItems: 1 } } },
    { required: ['function_call'] },
  ],
} as const;

/**
 * One message, by its `role` (Ajv's `discriminator`: only the schema of the message's own role
 * is checked, so a 400 names what is wrong in it, not a mismatch with every role).
 */
const message = {
  type: 'object',
  required: ['role'],
  discriminator: { propertyName: 'role' },
  oneOf: [promptMessage, assistantMessage],
} as const;

/**
 * The schema of a field whose other values ask for an answer magus cannot give (a valid OpenAI
 * request, not a malformed value: OpenAI accepts any n ≥ 1, so clients read `unsupported_feature`
 * as "this server", not "my request"): failing `keyword` is a 400 `unsupported_feature` with
 * `message` (plugins/errors.ts reads `x-unsupported`); failing another (a wrong type) is
 * `invalid_value`, as anywhere else.
 */
function unsupported<S extends object, K extends keyof S & string>(schema: S, keyword: K, message: string): S & { 'x-unsupported': { readonly [k in K]: string } } {
  return { ...schema, 'x-unsupported': { [keyword]: message } as { [k in K]: string } };
}

export const chatCompletionBody = {
  type: 'object',
  required: ['model', 'messages'],
  // For readers of the OpenAPI description (and its fuzzer's first case): `magus dev`'s model.
  examples: [{ model: 'demo', messages: [{ role: 'user', content: 'Hello' }] }],
  properties: {
    model: { type: 'string', minLength: 1, maxLength: 256 },
    messages: { type: 'array', minItems: 1, maxItems: 10_000, items: message },
    stream: { type: 'boolean' },
    max_tokens: { type: 'integer', minimum: 1, maximum: 1_000_000 },
    /** The newer name of `max_tokens` (OpenAI clients send either). */
    max_completion_tokens: { type: 'integer', minimum: 1, maximum: 1_000_000 },
    temperature: { type: 'number', minimum: 0, maximum: 2 },
    top_p: { type: 'number', minimum: 0, maximum: 1 },
    seed: { type: 'integer' },
    // Not empty: the engines refuse an empty stop text (engine/api.ts).
    stop: { description: 'a non-empty string or a list of up to 4', anyOf: [{ type: 'string', minLength: 1 }, { type: 'array', maxItems: 4, items: { type: 'string', minLength: 1 } }] },
    /** Only one choice per request: more is {@link unsupported}. */
    n: unsupported({ type: 'integer', minimum: 1, maximum: 1 }, 'maximum', 'Only one choice per request is supported by this server; send `n: 1` or leave it out.'),
    /** Streams: `include_usage` adds a last chunk with `usage` before `[DONE]`. */
    stream_options: { anyOf: [{ type: 'null' }, { type: 'object', properties: { include_usage: { type: 'boolean' } } }] },
    user: { type: 'string', maxLength: 256 },
    // What magus's engines do not offer: accepted only empty, plain or null.
    tools: { description: 'null or an empty list', anyOf: [{ type: 'null' }, unsupported({ type: 'array', maxItems: 0 }, 'maxItems', 'Tool calls are not supported by this server; send the request without `tools`.')] },
    functions: { description: 'null or an empty list', anyOf: [{ type: 'null' }, unsupported({ type: 'array', maxItems: 0 }, 'maxItems', 'Function calls are not supported by this server; send the request without `functions`.')] },
    response_format: {
      description: 'null or {"type": "text"}',
      anyOf: [
        { type: 'null' },
        {
          type: 'object',
          required: ['type'],
          properties: { type: unsupported({ type: 'string', enum: ['text'] }, 'enum', 'Structured output is not supported by this server; only `{"type": "text"}` is.') },
        },
      ],
    },
    logprobs: { description: 'null or false', anyOf: [{ type: 'null' }, unsupported({ type: 'boolean', enum: [false] }, 'enum', 'Log-probabilities are not supported by this server.')] },
  },
} as const;

export const chatCompletionHeaders = {
  type: 'object',
  properties: { 'x-session-id': { type: 'string', pattern: SESSION_ID_PATTERN } },
} as const;

export interface TextPart {
  type: 'text';
  text: string;
}

/** A validated message (matches {@link message}). */
export type ChatCompletionMessage =
  | { role: 'system' | 'user'; content: string | TextPart[]; name?: string }
  | { role: 'assistant'; content: string | TextPart[] | null; name?: string; tool_calls?: object[]; function_call?: object };

/** The validated body (matches {@link chatCompletionBody}). */
export interface ChatCompletionBody {
  model: string;
  messages: ChatCompletionMessage[];
  stream?: boolean;
  max_tokens?: number;
  max_completion_tokens?: number;
  temperature?: number;
  top_p?: number;
  seed?: number;
  stop?: string | string[];
  n?: number;
  stream_options?: { include_usage?: boolean } | null;
  user?: string;
}

/** `usage` (shared/serving.ts `CompletionUsage`): `prompt_tokens_details.cached_tokens` is the prompt the engine found in its slot's KV cache. */
const usage = {
  type: 'object',
  additionalProperties: true,
  properties: {
    prompt_tokens: { type: 'integer' },
    completion_tokens: { type: 'integer' },
    total_tokens: { type: 'integer' },
    prompt_tokens_details: { type: 'object', additionalProperties: true, properties: { cached_tokens: { type: 'integer' } } },
  },
} as const;

/** A `chat.completion` as the engine produced it: the known fields, anything else passed through. */
const chatCompletion = {
  type: 'object',
  additionalProperties: true,
  properties: {
    id: { type: 'string' },
    object: { type: 'string' },
    created: { type: 'integer' },
    model: { type: 'string' },
    usage,
  },
} as const;

export const chatCompletionSchema = {
  // Descriptive only (gateway/openapi.ts): fastify ignores both.
  summary: 'Creates a chat completion; `stream: true` answers server-sent events of chunks.',
  produces: ['application/json', 'text/event-stream'],
  body: chatCompletionBody,
  headers: chatCompletionHeaders,
  // 200 with `stream: true` is `text/event-stream`, written directly (plugins/sse.ts).
  response: { 200: chatCompletion, ...errorResponses },
} as const;

/**
 * `POST /v1/chat/completions`: the request body magus accepts (compiled once at start-up by
 * fastify's validator) and its response. Fields OpenAI defines that only tune sampling
 * (penalties, `logit_bias`, `user` …) are accepted and ignored, so stock clients work; fields
 * that ask for a different kind of answer — tool calls, structured output, log-probabilities,
 * several choices — are refused with a 400 naming the field ({@link unsupportedFeature}), since
 * answering them with plain text would be a silent failure. Only the fields below reach the engine.
 */
import { SESSION_ID_PATTERN } from '../plugins/conversation';
import { errorResponses } from './errors';

const textPart = {
  type: 'object',
  required: ['type', 'text'],
  properties: { type: { type: 'string', enum: ['text'] }, text: { type: 'string' } },
} as const;

const message = {
  type: 'object',
  required: ['role', 'content'],
  properties: {
    role: { type: 'string', enum: ['system', 'user', 'assistant'] },
    // A string, or OpenAI's list of text parts (joined before forwarding); `null` only from the
    // assistant (OpenAI clients send it with `tool_calls`), checked by {@link nullContent}.
    content: { anyOf: [{ type: 'string' }, { type: 'array', maxItems: 1024, items: textPart }, { type: 'null' }] },
    name: { type: 'string', maxLength: 256 },
  },
} as const;

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
    stop: { anyOf: [{ type: 'string' }, { type: 'array', maxItems: 4, items: { type: 'string' } }] },
    /** Only one choice per request: more is {@link unsupportedFeature}. */
    n: { type: 'integer', minimum: 1 },
    /** Streams: `include_usage` adds a last chunk with `usage` before `[DONE]`. */
    stream_options: { anyOf: [{ type: 'null' }, { type: 'object', properties: { include_usage: { type: 'boolean' } } }] },
    user: { type: 'string', maxLength: 256 },
  },
} as const;

/** A feature the request asks for that magus's engines do not offer: the field and why. */
export function unsupportedFeature(body: Readonly<Record<string, unknown>>): { param: string; message: string } | undefined {
  const nonEmpty = (v: unknown) => Array.isArray(v) && v.length > 0;
  if (nonEmpty(body.tools)) return { param: 'tools', message: 'Tool calls are not supported by this server; send the request without `tools`.' };
  if (nonEmpty(body.functions)) return { param: 'functions', message: 'Function calls are not supported by this server; send the request without `functions`.' };
  const format = body.response_format as { type?: unknown } | null | undefined;
  if (format !== undefined && format !== null && format.type !== 'text') {
    return { param: 'response_format', message: 'Structured output is not supported by this server; only `{"type": "text"}` is.' };
  }
  if (body.logprobs === true) return { param: 'logprobs', message: 'Log-probabilities are not supported by this server.' };
  // A valid request for an answer magus cannot give (like `tools`), not a malformed value: OpenAI
  // accepts any n ≥ 1, so clients read `unsupported_feature` as "this server", not "my request".
  if (typeof body.n === 'number' && body.n > 1) return { param: 'n', message: 'Only one choice per request is supported by this server; send `n: 1` or leave it out.' };
  return undefined;
}

/**
 * The first message whose `content` is `null` but whose role is not `assistant`: OpenAI accepts a
 * null content only for the assistant's own turns (e.g. beside `tool_calls`).
 */
export function nullContent(body: Pick<ChatCompletionBody, 'messages'>): { param: string; message: string } | undefined {
  const i = body.messages.findIndex((m) => m.content === null && m.role !== 'assistant');
  if (i < 0) return undefined;
  return { param: `messages[${i}].content`, message: `Invalid request: messages[${i}].content must be a string or a list of text parts (only assistant messages may have null content).` };
}

export const chatCompletionHeaders = {
  type: 'object',
  properties: { 'x-session-id': { type: 'string', pattern: SESSION_ID_PATTERN } },
} as const;

export interface TextPart {
  type: 'text';
  text: string;
}

/** The validated body (matches {@link chatCompletionBody}). */
export interface ChatCompletionBody {
  model: string;
  messages: { role: 'system' | 'user' | 'assistant'; content: string | TextPart[] | null; name?: string }[];
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

/** A `chat.completion` as the engine produced it: the known fields, anything else passed through. */
const chatCompletion = {
  type: 'object',
  additionalProperties: true,
  properties: {
    id: { type: 'string' },
    object: { type: 'string' },
    created: { type: 'integer' },
    model: { type: 'string' },
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

/**
 * `POST /v1/chat/completions`: the request body magus accepts (shared/chat.ts
 * {@link ChatCompletionBody}: compiled once at start-up by fastify's validator, and published as is
 * in the OpenAPI description), the headers, and the response.
 */
import { ChatCompletionBody } from '../../shared/chat';
import { SESSION_ID_PATTERN } from '../serving/conversation';
import { errorResponses } from './errors';

export const chatCompletionHeaders = {
  type: 'object',
  properties: { 'x-session-id': { type: 'string', pattern: SESSION_ID_PATTERN } },
} as const;

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

/** What every completion the engine produces has (a `chat.completion`, a `text_completion`). */
export const completionProperties = {
  id: { type: 'string' },
  object: { type: 'string' },
  created: { type: 'integer' },
  model: { type: 'string' },
  usage,
} as const;

/** A `chat.completion` as the engine produced it: the known fields, anything else passed through. */
const chatCompletion = { type: 'object', additionalProperties: true, properties: completionProperties } as const;

export const chatCompletionSchema = {
  // Descriptive only (gateway/openapi.ts): fastify ignores both.
  summary: 'Creates a chat completion; `stream: true` answers server-sent events of chunks.',
  produces: ['application/json', 'text/event-stream'],
  body: ChatCompletionBody,
  headers: chatCompletionHeaders,
  // 200 with `stream: true` is `text/event-stream`, written directly (routes/sse.ts).
  response: { 200: chatCompletion, ...errorResponses },
} as const;

/**
 * `POST /v1/completions`: the request body magus accepts (shared/completions.ts
 * {@link CompletionsBody}, compiled once by fastify's validator and published as is in the
 * OpenAPI description) and the response.
 */
import { CompletionsBody } from '../../shared/completions';
import { completionProperties } from './chat';
import { errorResponses } from './errors';

/** A `text_completion` as the engine produced it: one choice per prompt, in order; other fields passed through. */
const textCompletion = {
  type: 'object',
  additionalProperties: true,
  properties: {
    ...completionProperties,
    choices: {
      type: 'array',
      items: {
        type: 'object',
        additionalProperties: true,
        properties: { index: { type: 'integer' }, text: { type: 'string' }, finish_reason: { type: 'string' } },
      },
    },
  },
} as const;

export const completionsSchema = {
  summary: 'Continues each prompt as raw text (no chat template); `stream: true` answers server-sent events of `text_completion` chunks.',
  produces: ['application/json', 'text/event-stream'],
  body: CompletionsBody,
  response: { 200: textCompletion, ...errorResponses },
} as const;

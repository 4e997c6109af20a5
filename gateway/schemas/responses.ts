/**
 * `POST /v1/responses`, `GET` and `DELETE /v1/responses/{response_id}`, `POST …/cancel`: the request body magus
 * accepts (shared/responses.ts {@link ResponsesBody}, compiled once by fastify's validator and
 * published as is in the OpenAPI description), the path parameter and the answers.
 */
import { ResponsesBody } from '../../shared/responses';
import { errorResponses } from './errors';

/** A response object (shared/responses.ts `ResponseObject`): the fields every answer has, the rest passed through as built. */
const responseObject = {
  type: 'object',
  additionalProperties: true,
  required: ['id', 'object', 'created_at', 'status', 'model', 'output'],
  properties: {
    id: { type: 'string' },
    object: { type: 'string', enum: ['response'] },
    created_at: { type: 'integer' },
    status: { type: 'string', enum: ['queued', 'in_progress', 'completed', 'incomplete', 'failed', 'cancelled'] },
    model: { type: 'string' },
    output: { type: 'array', items: { type: 'object', additionalProperties: true } },
  },
} as const;

export const responseIdParams = {
  type: 'object',
  required: ['response_id'],
  properties: { response_id: { type: 'string', minLength: 1, maxLength: 256 } },
} as const;

export const createResponseSchema = {
  // Descriptive only (gateway/openapi.ts): fastify ignores both.
  summary: 'Creates a response; `stream: true` answers server-sent events of the Responses API; `previous_response_id` continues a stored one.',
  produces: ['application/json', 'text/event-stream'],
  body: ResponsesBody,
  response: { 200: responseObject, ...errorResponses },
} as const;

export const getResponseSchema = {
  summary:
    "Retrieves a stored response of this key; a background one as far as it got. `stream=true` streams a background response's events again, after `starting_after`.",
  produces: ['application/json', 'text/event-stream'],
  params: responseIdParams,
  querystring: {
    type: 'object',
    properties: {
      // Query values are strings (the gateway's validator coerces nothing).
      stream: { type: 'string', enum: ['true', 'false'] },
      starting_after: { type: 'string', pattern: '^(-1|0|[1-9][0-9]{0,14})$' },
      // Sent by the official clients; a stored response keeps what its request included.
      include: { anyOf: [{ type: 'string' }, { type: 'array', items: { type: 'string' } }] },
      include_obfuscation: { type: 'string', enum: ['true', 'false'] },
    },
  },
  response: { 200: responseObject, ...errorResponses },
} as const;

export const cancelResponseSchema = {
  summary: 'Cancels a background response of this key that is still queued or in progress; answers the response as it now stands.',
  params: responseIdParams,
  response: { 200: responseObject, ...errorResponses },
} as const;

export const deleteResponseSchema = {
  summary: 'Deletes a stored response of this token.',
  params: responseIdParams,
  response: {
    200: {
      type: 'object',
      required: ['id', 'object', 'deleted'],
      properties: { id: { type: 'string' }, object: { type: 'string', enum: ['response'] }, deleted: { type: 'boolean' } },
    },
    ...errorResponses,
  },
} as const;

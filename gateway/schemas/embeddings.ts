/**
 * `POST /v1/embeddings`: the request body magus accepts (shared/embeddings.ts
 * {@link EmbeddingsBody}, compiled once by fastify's validator and published as is in the OpenAPI
 * description) and the response.
 */
import { EmbeddingsBody } from '../../shared/embeddings';
import { errorResponses } from './errors';

/** OpenAI's embeddings list: each vector numbers, or base64 of little-endian float32s. */
const embeddingsList = {
  type: 'object',
  required: ['object', 'data', 'model', 'usage'],
  properties: {
    object: { type: 'string', enum: ['list'] },
    data: {
      type: 'array',
      items: {
        type: 'object',
        required: ['object', 'index', 'embedding'],
        properties: {
          object: { type: 'string', enum: ['embedding'] },
          index: { type: 'integer' },
          embedding: { anyOf: [{ type: 'array', items: { type: 'number' } }, { type: 'string' }] },
        },
      },
    },
    model: { type: 'string' },
    usage: { type: 'object', properties: { prompt_tokens: { type: 'integer' }, total_tokens: { type: 'integer' } } },
  },
} as const;

export const embeddingsSchema = {
  summary: 'Creates embeddings: one vector per input, in order.',
  body: EmbeddingsBody,
  response: { 200: embeddingsList, ...errorResponses },
} as const;

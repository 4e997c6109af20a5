/** The OpenAI error body every error response has (plugins/errors.ts builds it). */
export const errorResponse = {
  type: 'object',
  required: ['error'],
  properties: {
    error: {
      type: 'object',
      required: ['message', 'type', 'param', 'code'],
      properties: {
        message: { type: 'string' },
        type: { type: 'string' },
        param: { type: ['string', 'null'] },
        code: { type: ['string', 'null'] },
      },
    },
  },
} as const;

/** `response` entries for the error statuses of a route. */
export const errorResponses = { '4xx': errorResponse, '5xx': errorResponse } as const;

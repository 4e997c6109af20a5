/** `/healthz` (the process is up) and `/readyz` (its dependencies answer: `ok`, `degraded` or `unavailable`, and each check). */
const status = {
  type: 'object',
  required: ['status'],
  properties: {
    status: { type: 'string' },
    checks: { type: 'object', additionalProperties: { type: 'boolean' } },
  },
} as const;

export const healthSchema = { response: { 200: status } } as const;
export const readySchema = { response: { 200: status, 503: status } } as const;

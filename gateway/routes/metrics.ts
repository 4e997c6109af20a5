/** `GET /metrics`: Prometheus text format (plugins/metrics.ts). Unauthenticated, like /healthz: expose it on a private network. */
import type { FastifyPluginCallback } from 'fastify';
import { PROMETHEUS_CONTENT_TYPE } from '../plugins/metrics';

export const metricsRoutes: FastifyPluginCallback = (app, _opts, done) => {
  app.get('/metrics', { schema: { response: { 200: { type: 'string' } } } }, async (_request, reply) => {
    await app.metrics.collect();
    return reply.type(PROMETHEUS_CONTENT_TYPE).send(app.metrics.render());
  });
  done();
};

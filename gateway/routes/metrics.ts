/**
 * `GET /metrics`: Prometheus text format (plugins/metrics.ts). Unauthenticated, like /healthz (a
 * scraper carries no API key): on the operations listener (operations.ts) when the gateway has
 * one, else on the API port, which is then for a private network only (README, "Operations").
 */
import type { FastifyPluginCallback } from 'fastify';
import { PROMETHEUS_CONTENT_TYPE, type GatewayMetrics } from '../plugins/metrics';

export interface MetricsRoutesOptions {
  metrics: GatewayMetrics;
}

export const metricsRoutes: FastifyPluginCallback<MetricsRoutesOptions> = (app, opts, done) => {
  app.get('/metrics', { schema: { response: { 200: { type: 'string' } } } }, async (_request, reply) => {
    await opts.metrics.collect();
    return reply.type(PROMETHEUS_CONTENT_TYPE).send(opts.metrics.render());
  });
  done();
};

/**
 * The gateway's operations listener (`MAGUS_GATEWAY_HEALTH_ADDRESS`, `--health-address`):
 * `/healthz`, `/readyz` and `/metrics` on a port of their own, with the API app's checks and
 * metrics. A NetworkPolicy can then open the API port to clients and this one to the kubelet and
 * the scraper only, and a LoadBalancer or Ingress in front of the API never publishes the metrics
 * (they name models, and in `magus dev` keys). Nothing here authenticates (a probe or a scraper
 * carries no API key), no API route is served, and requests are neither access-logged (probes come
 * every few seconds) nor counted in the API's request metrics.
 */
import type { FastifyPluginAsync } from 'fastify';
import { errorsPlugin } from './plugins/errors';
import type { GatewayMetrics } from './plugins/metrics';
import type { ReadinessCheck } from './plugins/services';
import { healthRoutes } from './routes/health';
import { metricsRoutes } from './routes/metrics';

export interface OperationsAppOptions {
  metrics: GatewayMetrics;
  /** The API app's checks (app.ts `readinessChecks`), so both ports answer `/readyz` alike. */
  readiness: readonly ReadinessCheck[];
  retryAfterSec: number;
}

export const operationsApp: FastifyPluginAsync<OperationsAppOptions> = async (app, opts) => {
  // Unknown paths and methods answer in the API's error shape (404 `unknown_url`, 405 + `Allow`).
  await app.register(errorsPlugin, { retryAfterSec: opts.retryAfterSec });
  await app.register(healthRoutes, { readiness: opts.readiness });
  await app.register(metricsRoutes, { metrics: opts.metrics });
};

/**
 * `/healthz`: the process is up (liveness; touches nothing). `/readyz`: every readiness check
 * (NATS connected, registry readable, KV mirrors live …) passes within 2 s (readiness): 200
 * `{"status":"ok"}`; one fails: 503 `{"status":"unavailable"}`. A check that only `degrades`
 * (Temporal reachable) failing: 200 `{"status":"degraded"}` — the replica still serves warm turns
 * and first turns from the pools' published view, and every replica shares that dependency, so
 * taking them out of a Service would refuse everything instead of some first turns.
 * A check failing within its grace (`degradesNow`: NATS cut off, a KV mirror rebuilt after a
 * reconnect, for less than `MAGUS_GATEWAY_NATS_GRACE_MS`) degrades likewise: a NATS restart
 * reconnects every replica at once, and no replica leaves its Service for it; one cut off for
 * longer does. `checks` has every check's result either way.
 * Registered on the API app and, when there is one, on the operations listener (operations.ts),
 * with the same checks.
 */
import type { FastifyPluginCallback } from 'fastify';
import type { ReadinessCheck } from '../plugins/services';
import { healthSchema, readySchema } from '../schemas/health';

const CHECK_TIMEOUT_MS = 2_000;

async function passes(check: () => boolean | Promise<boolean>): Promise<boolean> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([
      Promise.resolve().then(check),
      new Promise<boolean>((resolve) => {
        timer = setTimeout(() => resolve(false), CHECK_TIMEOUT_MS);
      }),
    ]);
  } catch {
    return false;
  } finally {
    clearTimeout(timer);
  }
}

export interface HealthRoutesOptions {
  readiness: readonly ReadinessCheck[];
}

export const healthRoutes: FastifyPluginCallback<HealthRoutesOptions> = (app, opts, done) => {
  app.get('/healthz', { schema: healthSchema }, (_request, reply) => reply.send({ status: 'ok' }));

  app.get('/readyz', { schema: readySchema }, async (_request, reply) => {
    const checks = opts.readiness;
    const results = await Promise.all(checks.map((c) => passes(() => c.check())));
    const out: Record<string, boolean> = {};
    checks.forEach((c, i) => (out[c.name] = results[i]!));
    const ok = checks.every((c, i) => c.degrades === true || results[i] || c.degradesNow?.() === true);
    const status = !ok ? 'unavailable' : results.every(Boolean) ? 'ok' : 'degraded';
    return reply.code(ok ? 200 : 503).send({ status, checks: out });
  });
  done();
};

/**
 * `c` with a grace: failing, it degrades the replica (`degradesNow`) until it has failed for
 * `graceMs`, then fails it. It is sampled every 250 ms (`stop` ends that), so the time it has
 * failed for is known whether or not `/readyz` was asked meanwhile.
 */
export function graced(c: { name: string; check: () => boolean }, graceMs: number, now: () => number = Date.now): { check: ReadinessCheck; stop: () => void } {
  let passedAt = now();
  const sample = () => {
    const ok = c.check();
    if (ok) passedAt = now();
    return ok;
  };
  const timer = setInterval(sample, 250);
  timer.unref();
  return {
    check: { name: c.name, check: sample, degradesNow: () => now() - passedAt < graceMs },
    stop: () => clearInterval(timer),
  };
}

/**
 * The gateway as a fastify plugin: OpenAI-compatible routes over injected services (server.ts
 * wires the NATS-backed ones; tests wire fakes). `options` are the server options the app
 * expects from whoever creates the fastify instance.
 */
import { LogController, type FastifyPluginAsync, type FastifyServerOptions } from 'fastify';
import { authPlugin } from './plugins/auth';
import { clientErrorHandler, errors, errorsPlugin, frameworkErrors } from './plugins/errors';
import { metricsPlugin, type GatewayMetrics } from './plugins/metrics';
import { servicesPlugin, type GatewayServices, type ReadinessCheck } from './plugins/services';
import type { ModelCatalog } from './serving/model-catalog';
import { chatRoutes } from './routes/chat';
import { completionsRoutes } from './routes/completions';
import { embeddingsRoutes } from './routes/embeddings';
import { healthRoutes } from './routes/health';
import { metricsRoutes } from './routes/metrics';
import { modelRoutes } from './routes/models';
import { responsesRoutes } from './routes/responses';
import { describedRoute, openApiDocument, type DescribedRoute } from './openapi';
import { lazySerializers, lazyValidators } from './compilers';

/** The services the routes use (plugins/services.ts), plus the app's own extras. */
export interface GatewayAppOptions extends Omit<GatewayServices, 'readiness'> {
  /** Added to the app's own check (the registry answers). */
  readiness?: ReadinessCheck[];
  metrics?: GatewayMetrics;
  /**
   * Whether this app serves `/metrics` (default) or leaves it to the operations listener
   * (operations.ts, `MAGUS_GATEWAY_HEALTH_ADDRESS`), so the API port never publishes it.
   */
  serveMetrics?: boolean;
}

/** A registry read a readiness probe waits for: a kubelet's probe times out after 1 s. */
const REGISTRY_CHECK_MS = 500;

/**
 * A gateway's readiness checks: the registry answers, then the process's own (NATS, the KV
 * mirrors, Temporal). The registry is read over NATS: while NATS is down it is not read, and a
 * read is waited for {@link REGISTRY_CHECK_MS} at most, so a probe is answered at once. With
 * `graceMs` (the server's `MAGUS_GATEWAY_NATS_GRACE_MS`), a registry read within that long
 * degrades the replica when the registry fails now, as NATS's check does.
 */
export function readinessChecks(models: ModelCatalog, more: readonly ReadinessCheck[] = [], graceMs?: number): ReadinessCheck[] {
  const nats = more.find((c) => c.name === 'nats');
  let readAt = Date.now();
  const registry: ReadinessCheck = {
    name: 'registry',
    check: async () => {
      if (nats?.check() === false) return false;
      let timer: NodeJS.Timeout | undefined;
      const ok = await Promise.race([
        models.refresh().then(() => true),
        new Promise<boolean>((resolve) => (timer = setTimeout(() => resolve(false), REGISTRY_CHECK_MS))),
      ]).finally(() => clearTimeout(timer));
      if (ok) readAt = Date.now();
      return ok;
    },
  };
  if (graceMs !== undefined) registry.degradesNow = () => Date.now() - readAt < graceMs;
  return [registry, ...more];
}

const strictUtf8 = new TextDecoder('utf-8', { fatal: true });

function isJson(text: string): boolean {
  try {
    JSON.parse(text);
    return true;
  } catch {
    return false;
  }
}

/** The longest path parameter (a model id) the router takes: beyond the schema's 256, so those get a 400 naming `model`. */
const MAX_PARAM_LENGTH = 512;

/**
 * Server options the app relies on: no type coercion (a string is not a number in a JSON body);
 * Ajv's `discriminator` (a chat message's schema is chosen by its `role`) and `verbose` (a failed
 * check carries its schema, whose `description` or `x-unsupported` — an annotation Ajv is told
 * of — words the 400: plugins/errors.ts); the `authorization` header never reaches a log line,
 * and one access-log line per request (the app's onResponse hook) instead of fastify's two; a
 * request Node's HTTP parser refuses, or fastify's router (a malformed or too long path), is
 * answered in OpenAI's error shape too. A route's validators are made when a request first needs
 * them, from the code `npm run build` generated for them, and compiled only without it: nothing is
 * compiled at start (compilers.ts).
 */
export const options = {
  clientErrorHandler,
  frameworkErrors,
  routerOptions: { maxParamLength: MAX_PARAM_LENGTH },
  ajv: { customOptions: { coerceTypes: false, discriminator: true, verbose: true, keywords: ['x-unsupported'] } },
  schemaController: { compilersFactory: { buildValidator: lazyValidators(), buildSerializer: lazySerializers() } },
  logController: new LogController({ disableRequestLogging: true }),
  logger: {
    redact: {
      paths: ['req.headers.authorization', 'request.headers.authorization', 'headers.authorization'],
      censor: '[redacted]',
    },
  },
} satisfies FastifyServerOptions;

const gatewayApp: FastifyPluginAsync<GatewayAppOptions> = async (app, opts) => {
  const { settings } = opts;
  await app.register(errorsPlugin, { retryAfterSec: settings.retryAfterSec });
  await app.register(metricsPlugin, { metrics: opts.metrics });
  app.metrics.setSessionStats(() => opts.sessions.stats?.());
  const { metrics: _metrics, serveMetrics = true, readiness, ...services } = opts;
  await app.register(servicesPlugin, { services: { ...services, readiness: readinessChecks(opts.models, readiness, opts.settings.natsGraceMs) } });
  await app.register(authPlugin, { tokens: opts.tokens, allowAnonymous: settings.allowAnonymous });

  // Before any route's own onRequest hooks (authentication): an oversized body is refused
  // without reading it or looking at the token. Bodies without content-length hit the route's
  // `bodyLimit` while being parsed.
  app.addHook('onRequest', (request, _reply, done) => {
    const length = request.headers['content-length'];
    if (length !== undefined && Number(length) > settings.bodyLimit) done(errors.tooLarge(settings.bodyLimit));
    else done();
  });

  // JSON bodies must be UTF-8: fastify's own parser decodes leniently, so a body with invalid
  // bytes reached the engine with U+FFFD in their place (a prompt silently changed; found by the
  // fuzz test). Decoded strictly here, then parsed by fastify's parser (prototype poisoning
  // refused: a `__proto__` key, or a `constructor` holding `prototype`, at any depth).
  const parseJson = app.getDefaultJsonParser('error', 'error');
  app.removeContentTypeParser('application/json');
  app.addContentTypeParser('application/json', { parseAs: 'buffer' }, (request, body, done) => {
    let text: string;
    try {
      text = strictUtf8.decode(body as Buffer);
    } catch {
      done(errors.invalid('The request body is not valid UTF-8.', null, 'invalid_encoding'), undefined);
      return;
    }
    void parseJson(request, text, (err, parsed) => {
      // fastify's parser calls a valid body it refuses for such a key "not valid JSON": say which.
      if (err && isJson(text))
        done(
          errors.invalid('The request body has a "__proto__" key, or a "constructor" holding "prototype", which this server refuses.', null, 'forbidden_key'),
          undefined,
        );
      else done(err, parsed);
    });
  });

  // The access log: one line per request once answered, with what fastify's two lines had.
  app.addHook('onResponse', (request, reply, done) => {
    request.log.info({ req: request, res: reply, responseTime: reply.elapsedTime }, 'request completed');
    done();
  });

  // The OpenAPI description is made of the routes as registered (their schemas and whether they
  // authenticate), so it is what the server validates, not a copy kept beside it.
  const described: DescribedRoute[] = [];
  app.addHook('onRoute', (route) => void described.push(...describedRoute(route, (hook) => hook === app.authenticate)));
  // /healthz and /readyz stay here even beside an operations listener: load balancers and
  // Ingress controllers health-check the port they send traffic to.
  await app.register(healthRoutes, { readiness: app.gateway.readiness });
  if (serveMetrics) await app.register(metricsRoutes, { metrics: app.metrics });
  await app.register(modelRoutes);
  await app.register(chatRoutes);
  await app.register(completionsRoutes);
  await app.register(embeddingsRoutes);
  await app.register(responsesRoutes);
  // Public by default: it says nothing a client of the OpenAI API does not know. `authenticated`
  // asks what the API routes ask (401 in the same shape), `off` leaves the path unrouted (404).
  const openApiAccess = settings.openApi ?? 'public';
  if (openApiAccess !== 'off') {
    let openApi: string | undefined;
    app.get('/openapi.json', openApiAccess === 'authenticated' ? { onRequest: app.authenticate } : {}, (_request, reply) =>
      reply.type('application/json; charset=utf-8').send((openApi ??= JSON.stringify(openApiDocument(described)))),
    );
  }
};

export default gatewayApp;

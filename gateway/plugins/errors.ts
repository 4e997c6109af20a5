/**
 * The one place errors become HTTP responses: every failure leaves the gateway in OpenAI's shape
 * `{"error":{"message","type","param","code"}}`. 4xx messages say what to fix; 5xx messages are
 * generic (with the request id to quote) and the details go to the log only.
 */
import { STATUS_CODES } from 'node:http';
import type { Socket } from 'node:net';
import type { FastifyError, FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { ServingErrorType } from '../../shared/errors';
import { servicePlugin } from './plugin';

/** The body of every error response. */
export interface OpenAIErrorBody {
  error: { message: string; type: string; param: string | null; code: string | null };
}

/** OpenAI's `error.type` values the gateway uses. */
export const OpenAIErrorType = {
  invalidRequest: 'invalid_request_error',
  permission: 'permission_error',
  rateLimit: 'rate_limit_exceeded',
  insufficientQuota: 'insufficient_quota',
  server: 'server_error',
} as const;

/**
 * A failure with a deliberate HTTP answer. `expose` = the message is safe for the client (always
 * for 4xx; for 5xx only messages the gateway wrote itself, never an upstream's text).
 */
export class GatewayError extends Error {
  override readonly name = 'GatewayError';
  constructor(
    readonly status: number,
    message: string,
    readonly type: string,
    readonly code: string | null,
    readonly param: string | null = null,
    readonly headers: Readonly<Record<string, string>> = {},
    readonly expose: boolean = status < 500,
  ) {
    super(message);
  }
}

/**
 * The serving failures ({@link ServingErrorType}, shared/errors.ts) a {@link SessionBroker}
 * (serving/sessions/) raises, as `error.type` (or a cause's, so an error wrapped on its way maps too),
 * each answered as {@link sessionAnswers} says. Matched by value, never by class, so the broker
 * may live in another module or process.
 */
export const SessionErrorType = {
  /** The model's request backlog is full: 429 with `Retry-After`. */
  BacklogFull: ServingErrorType.BacklogFull,
  /** No instance of the model can be started (capacity, placement): 503. */
  NoCapacity: ServingErrorType.NoCapacity,
  /** What the turn needs cannot be reached (Temporal, for a first turn the published view cannot serve): 503 `unavailable`. */
  Unavailable: ServingErrorType.Unavailable,
} as const;
export type SessionErrorType = (typeof SessionErrorType)[keyof typeof SessionErrorType];
const ERROR_TYPES = new Set<unknown>(Object.values(SessionErrorType));
const isSessionErrorType = (type: unknown): type is SessionErrorType => ERROR_TYPES.has(type);

/** What a broker throws; `retryAfterSec` becomes the `Retry-After` header (unset: the gateway's configured one). */
export class SessionError extends Error {
  override readonly name = 'SessionError';
  constructor(
    readonly type: SessionErrorType,
    message: string,
    readonly retryAfterSec?: number,
  ) {
    super(message);
  }
}

/** The `Retry-After` header of an answer that asks the client to come back: whole seconds, at least 1. */
export const retryAfter = (seconds: number): Record<string, string> => ({ 'retry-after': String(Math.max(1, Math.ceil(seconds))) });

export const errors = {
  invalid: (message: string, param: string | null = null, code: string | null = null) =>
    new GatewayError(400, message, OpenAIErrorType.invalidRequest, code, param),
  unauthorized: (message = 'Invalid or missing API key. Send `Authorization: Bearer mgs_<id>_<secret>`.') =>
    new GatewayError(401, message, OpenAIErrorType.invalidRequest, 'invalid_api_key'),
  /** A known path, another method: the methods it has go in `Allow` (RFC 9110 §15.5.6). */
  /** A known key that its owner suspended (ApiKey `spec.suspended`): not a wrong key, so not a 401. */
  keySuspended: (key: string) => new GatewayError(403, `The API key ${key} is suspended.`, OpenAIErrorType.permission, 'key_suspended'),
  methodNotAllowed: (method: string, path: string, allow: readonly string[]) =>
    new GatewayError(
      405,
      `Method ${method} is not allowed for ${path}; use ${allow.join(' or ')}.`,
      OpenAIErrorType.invalidRequest,
      'method_not_allowed',
      null,
      { allow: allow.join(', ') },
    ),
  modelNotFound: (model: string) =>
    new GatewayError(404, `The model '${model}' does not exist or you do not have access to it.`, OpenAIErrorType.invalidRequest, 'model_not_found', 'model'),
  /** A stored response that is not there for this caller: never stored, expired, deleted, or another token's (which is not told apart). */
  responseNotFound: (id: string, param: string, code = 'response_not_found', message = `No response found with id '${id}'.`) =>
    new GatewayError(404, message, OpenAIErrorType.invalidRequest, code, param),
  // `connection: close`: the unread body is not drained, the connection just ends.
  tooLarge: (limit: number) =>
    new GatewayError(413, `Request body is larger than ${limit} bytes.`, OpenAIErrorType.invalidRequest, 'request_too_large', null, { connection: 'close' }),
  /** A request larger, as queued, than a NATS message may be (the servers' `max_payload`): no retry can help. */
  tooLargeForBus: (bytes: number, limit: number) =>
    new GatewayError(
      413,
      `The request is ${bytes} bytes as queued, more than the message bus carries (${limit} bytes, the NATS servers' max_payload). Send less, or raise max_payload on the NATS servers.`,
      OpenAIErrorType.invalidRequest,
      'request_too_large',
    ),
  /** A key's limit (gateway/serving/limits.ts): `rate_limit_exceeded` (a rate, or concurrency) or `insufficient_quota` (its budget), with OpenAI's headers. */
  limited: (code: 'rate_limit_exceeded' | 'insufficient_quota', message: string, headers: Record<string, string>) =>
    new GatewayError(429, message, code === 'insufficient_quota' ? OpenAIErrorType.insufficientQuota : OpenAIErrorType.rateLimit, code, null, headers),
  backlogFull: (retryAfterSec: number) =>
    new GatewayError(429, 'The model has too many queued requests; retry later.', OpenAIErrorType.rateLimit, 'backlog_full', null, retryAfter(retryAfterSec)),
  /** Every instance of the model would keep the request queued longer than the gateway's wait budget (serving/queue-waits.ts). */
  queueFull: ({ waitMs, budgetMs, retryAfterMs }: { waitMs: number; budgetMs: number; retryAfterMs: number }) =>
    new GatewayError(
      429,
      `Every instance of the model would keep this request queued for about ${(waitMs / 1000).toFixed(1)} s, longer than this gateway lets a request wait (${(budgetMs / 1000).toFixed(1)} s, MAGUS_MAX_QUEUE_WAIT); retry after the Retry-After.`,
      OpenAIErrorType.rateLimit,
      'queue_full',
      null,
      { ...retryAfter(retryAfterMs / 1000), 'retry-after-ms': String(Math.ceil(retryAfterMs)) },
    ),
  noCapacity: (retryAfterSec: number) =>
    new GatewayError(
      503,
      'No instance of the model could be started; retry later.',
      OpenAIErrorType.server,
      'no_capacity',
      null,
      retryAfter(retryAfterSec),
      true,
    ),
  /** The request could not be queued (NATS unreachable, no stream acknowledgement), or its session could not be started (Temporal unreachable). */
  unavailable: (retryAfterSec: number, message = 'The request could not be queued; retry later.') =>
    new GatewayError(503, message, OpenAIErrorType.server, 'unavailable', null, retryAfter(retryAfterSec), true),
  timeout: () => new GatewayError(504, 'The model did not answer in time.', OpenAIErrorType.server, 'timeout', null, {}, true),
  /** A stream whose answer had to move, claimed first by a replica its client resumed it on (`Last-Event-ID`): the rest goes there. */
  resumedElsewhere: () =>
    new GatewayError(
      409,
      'This stream was resumed on another connection (Last-Event-ID), which receives the rest of the answer.',
      OpenAIErrorType.invalidRequest,
      'resumed_elsewhere',
    ),
  /** The engine side failed (an `error` frame with a 5xx status, lost frames, a bad frame). */
  upstream: (status = 502, code = 'upstream_error') =>
    new GatewayError(status >= 500 && status <= 599 ? status : 502, 'The model failed to complete the request.', OpenAIErrorType.server, code, null, {}, true),
};

/** How each serving failure is answered, given the `Retry-After` seconds. */
const sessionAnswers: Readonly<Record<SessionErrorType, (retryAfterSec: number) => GatewayError>> = {
  [SessionErrorType.BacklogFull]: (s) => errors.backlogFull(s),
  [SessionErrorType.NoCapacity]: (s) => errors.noCapacity(s),
  [SessionErrorType.Unavailable]: (s) => errors.unavailable(s, 'A new conversation cannot be started right now; retry later.'),
};

/** An error and its causes, outermost first, at most `depth` of them. */
function* causeChain(err: unknown, depth: number): Generator<unknown> {
  for (let e = err, n = 0; e !== undefined && e !== null && n < depth; e = (e as { cause?: unknown }).cause, n++) yield e;
}

/** The {@link SessionErrorType} of an error (or of its cause), if it has one. */
export function sessionErrorType(err: unknown): SessionErrorType | undefined {
  for (const e of causeChain(err, 3)) {
    const type = (e as { type?: unknown }).type;
    if (isSessionErrorType(type)) return type;
  }
  return undefined;
}

function retryAfterOf(err: unknown, fallback: number): number {
  for (const e of causeChain(err, 3)) {
    const r = (e as { retryAfterSec?: unknown }).retryAfterSec;
    if (typeof r === 'number' && Number.isFinite(r) && r > 0) return r;
  }
  return fallback;
}

interface AjvError {
  instancePath?: string;
  schemaPath?: string;
  keyword?: string;
  message?: string;
  params?: { missingProperty?: string; allowedValues?: unknown[]; tag?: string; type?: unknown };
  /** The schema holding the failed keyword (Ajv's `verbose`, app.ts). */
  parentSchema?: { description?: unknown; oneOf?: unknown; 'x-unsupported'?: Record<string, unknown> };
}

/** `/messages/0/role` → `messages[0].role` (OpenAI names params the way the client wrote them). */
function paramOf(e: AjvError, context: string | undefined): string | null {
  const segments = (e.instancePath ?? '')
    .split('/')
    .slice(1)
    .map((s) => s.replace(/~1/g, '/').replace(/~0/g, '~'));
  if (e.keyword === 'required' && e.params?.missingProperty) segments.push(e.params.missingProperty);
  // A `discriminator` (a message's `role`) that is missing a branch names the object; the param is its tag.
  if (e.keyword === 'discriminator' && e.params?.tag) segments.push(e.params.tag);
  let out = '';
  for (const s of segments) out += /^\d+$/.test(s) ? `[${s}]` : out === '' ? s : `.${s}`;
  if (out === '') return context === 'body' || context === undefined ? null : context;
  return out;
}

/** The values a `discriminator`'s tag may take: each `oneOf` branch's `const` or `enum` for it. */
function tagValues(e: AjvError): unknown[] {
  const branches = Array.isArray(e.parentSchema?.oneOf)
    ? (e.parentSchema.oneOf as { properties?: Record<string, { const?: unknown; enum?: unknown[] }> }[])
    : [];
  return branches.flatMap((b) => {
    const p = b.properties?.[e.params?.tag ?? ''];
    return p?.enum ?? (p && 'const' in p ? [p.const] : []);
  });
}

/** What is wrong with the value Ajv's first error points at, as the rest of "<param> …". */
function problemOf(errs: readonly AjvError[]): string {
  const first = errs[0] ?? {};
  if (first.keyword === 'required') return 'is required';
  if (first.keyword === 'enum' && Array.isArray(first.params?.allowedValues))
    return `must be one of ${first.params.allowedValues.map((v) => JSON.stringify(v)).join(', ')}`;
  if (first.keyword === 'discriminator')
    return `must be one of ${tagValues(first)
      .map((v) => JSON.stringify(v))
      .join(', ')}`;
  // A value whose schema describes it (a message's content: several shapes, so Ajv's own words
  // would name one, "must be string"): what it must be, in the schema's words.
  const described = errs.filter((e) => e.instancePath === first.instancePath && typeof e.parentSchema?.description === 'string').at(-1);
  if (described) return `must be ${described.parentSchema!.description as string}`;
  return first.message ?? 'is invalid';
}

function validationError(err: FastifyError): GatewayError {
  const errs = (err.validation ?? []) as AjvError[];
  // A value that asks for an answer magus cannot give (shared/chat.ts `unsupported`): its own 400,
  // when that keyword is all its schema refused (not, say, a wrong type as well).
  const schemaOf = (e: AjvError) => `${e.instancePath ?? ''} ${(e.schemaPath ?? '').replace(/\/[^/]*$/, '')}`;
  for (const e of errs) {
    const message = e.parentSchema?.['x-unsupported']?.[e.keyword ?? ''];
    if (typeof message !== 'string' || errs.some((o) => o !== e && schemaOf(o) === schemaOf(e))) continue;
    return errors.invalid(message, paramOf(e, err.validationContext), 'unsupported_feature');
  }
  // A nullable object (`null` or a format): Ajv reports "must be null" first; what is wrong inside
  // the object, when something deeper is, says more ("response_format.json_schema.name …").
  const depthOf = (e: AjvError) => (e.instancePath ?? '').split('/').length + (e.keyword === 'required' || e.keyword === 'discriminator' ? 1 : 0);
  const first = errs[0];
  const deeper = first?.keyword === 'type' && first.params?.type === 'null' ? errs.filter((e) => depthOf(e) > depthOf(first)) : [];
  const shown = deeper.length > 0 ? deeper : errs;
  const param = paramOf(shown[0] ?? {}, err.validationContext);
  const where = err.validationContext === 'headers' ? `header ${param ?? ''}` : (param ?? 'body');
  return errors.invalid(`Invalid request: ${where} ${problemOf(shown)}.`, param, 'invalid_value');
}

/** Maps anything thrown to the {@link GatewayError} that answers it. */
export function toGatewayError(err: unknown, retryAfterSec: number): GatewayError {
  if (err instanceof GatewayError) return err;
  const type = sessionErrorType(err);
  if (type !== undefined) return sessionAnswers[type](retryAfterOf(err, retryAfterSec));
  const fe = err as Partial<FastifyError>;
  if (Array.isArray(fe.validation)) return validationError(fe as FastifyError);
  const status = typeof fe.statusCode === 'number' ? fe.statusCode : 500;
  if (status === 413) return new GatewayError(413, 'Request body is too large.', OpenAIErrorType.invalidRequest, 'request_too_large');
  // fastify's own 4xx (bad JSON, empty body, unsupported media type …) say what is wrong.
  if (status >= 400 && status < 500) return new GatewayError(status, fe.message ?? 'Bad request.', OpenAIErrorType.invalidRequest, null);
  return new GatewayError(500, 'internal error', OpenAIErrorType.server, null, null, {}, false);
}

/** The response body for a {@link GatewayError}, hiding what must not leave the process. */
export function errorBody(e: GatewayError, requestId: string): OpenAIErrorBody {
  const message = e.status < 500 ? e.message : `${e.expose ? e.message : 'The server had an error while processing your request.'} (request id ${requestId})`;
  return { error: { message, type: e.type, param: e.param, code: e.code } };
}

export interface ErrorHandlerOptions {
  /** `Retry-After` (seconds) when a broker error does not say. */
  retryAfterSec: number;
}

/** An error's message and its causes', `a: b: c` (no stack). */
function reasonOf(err: unknown): string {
  return [...causeChain(err, 5)].map((e) => (e instanceof Error ? e.message : typeof e === 'string' ? e : `a thrown ${typeof e}`)).join(': ');
}

function sendError(err: unknown, request: FastifyRequest, reply: FastifyReply, retryAfterSec: number): FastifyReply {
  const e = toGatewayError(err, retryAfterSec);
  // The id the client sees (`x-request-id`, set by routes that publish a request) or fastify's own.
  const header = reply.getHeader('x-request-id');
  const requestId = typeof header === 'string' ? header : request.id;
  // A 503 with Retry-After is one the gateway means (Temporal or the data plane away, no capacity):
  // a warning with its reason, not an error with a stack (an outage would fill the log with them).
  if (e.status === 503 && e.headers['retry-after'] !== undefined)
    request.log.warn({ status: e.status, code: e.code, reason: reasonOf(err), requestId }, e.message);
  else if (e.status >= 500) request.log.error({ err, requestId }, 'request failed');
  else if (e.status !== 404 && e.status !== 405 && e.status !== 401) request.log.info({ status: e.status, code: e.code, param: e.param, requestId }, e.message);
  return reply.code(e.status).headers(e.headers).send(errorBody(e, requestId));
}

/** What is wrong with a request llhttp refused, by its error code (the rest: a header's bytes). */
const PARSE_ERRORS: Readonly<Record<string, string>> = {
  HPE_INVALID_EOF_STATE: 'the connection ended before the request did, e.g. a body shorter than its Content-Length',
  HPE_INVALID_CHUNK_SIZE: 'malformed chunked transfer encoding',
  HPE_INVALID_METHOD: 'not an HTTP method',
  HPE_INVALID_URL: 'an invalid character in the URL',
};

/** What a request Node's HTTP parser refused is answered with: status, code and message. */
function clientErrorAnswer(code: string | undefined): { status: number; code: string; message: string } {
  if (code === 'ERR_HTTP_REQUEST_TIMEOUT') return { status: 408, code: 'timeout', message: 'The request was not received in time.' };
  if (code === 'HPE_HEADER_OVERFLOW') return { status: 431, code: 'request_headers_too_large', message: 'The request headers are too large.' };
  const why = (code !== undefined && PARSE_ERRORS[code]) || 'e.g. a bare CR, LF or NUL in a header';
  return { status: 400, code: 'invalid_http_request', message: `The request is not valid HTTP/1.1 (${why}).` };
}

/**
 * fastify's `clientErrorHandler`: a request Node's HTTP parser refuses (a bare CR/LF/NUL in a
 * header, headers too large, too slow) never reaches fastify's routes or error handler, and
 * fastify's default answers it in its own shape; this answers in OpenAI's, like every other error.
 */
export function clientErrorHandler(this: FastifyInstance, err: NodeJS.ErrnoException, socket: Socket): void {
  // A reset connection has nobody to answer (Node's own handler does the same).
  if (err.code === 'ECONNRESET' || socket.destroyed) return;
  const a = clientErrorAnswer(err.code);
  const body = JSON.stringify({ error: { message: a.message, type: OpenAIErrorType.invalidRequest, param: null, code: a.code } } satisfies OpenAIErrorBody);
  this.log.debug({ err: { code: err.code, message: err.message } }, 'client error');
  if (!socket.writable) {
    socket.destroy(err);
    return;
  }
  // `end`, then destroy once flushed: a destroy right after a write may drop the answer.
  socket.end(
    `HTTP/1.1 ${a.status} ${STATUS_CODES[a.status]}\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`,
    () => socket.destroy(),
  );
}

/**
 * fastify's `frameworkErrors`: what its router refuses before any route or error handler sees
 * the request — a path that is not valid percent-encoding (`FST_ERR_BAD_URL`) or a path parameter
 * longer than `maxParamLength` (`FST_ERR_MAX_PARAM_LENGTH`) — which fastify would otherwise
 * answer in its own shape (`{"error":"Bad Request","code":"FST_ERR_…"}`, found by the OpenAPI fuzz test).
 */
export function frameworkErrors(err: FastifyError, _request: FastifyRequest, reply: FastifyReply): void {
  const e =
    err.code === 'FST_ERR_MAX_PARAM_LENGTH'
      ? new GatewayError(414, 'The URL path is too long.', OpenAIErrorType.invalidRequest, 'uri_too_long')
      : new GatewayError(400, 'The URL path is not valid (malformed percent-encoding).', OpenAIErrorType.invalidRequest, 'invalid_url');
  void reply.code(e.status).send(errorBody(e, reply.request.id));
}

/**
 * The methods `path` has routes for, other than `method` (its `HEAD` twins included), asking
 * fastify's router itself, so a path matches here exactly when it would match for those methods.
 */
function allowedMethods(app: FastifyInstance, method: string, path: string): string[] {
  return app.supportedMethods.filter((m) => m !== method && app.findRoute({ method: m, url: path }) !== null);
}

/** Installs the error and not-found handlers for the whole app. */
export const errorsPlugin = servicePlugin<ErrorHandlerOptions>(
  (app, opts, done) => {
    app.setErrorHandler((err, request, reply) => sendError(err, request, reply, opts.retryAfterSec));
    // A request no route takes: a path some route has under another method is a 405 with `Allow`,
    // decided before its body is read (fastify reads a 404's body before its handler); any other, a 404.
    app.addHook('onRequest', (request, _reply, hookDone) => {
      if (!request.is404) return hookDone();
      const path = request.url.split('?')[0]!;
      const allow = allowedMethods(app, request.method, path);
      hookDone(allow.length > 0 ? errors.methodNotAllowed(request.method, path, allow) : undefined);
    });
    app.setNotFoundHandler((request, reply) =>
      reply.code(404).send({
        error: {
          message: `Unknown request URL: ${request.method} ${request.url.split('?')[0]}.`,
          type: OpenAIErrorType.invalidRequest,
          param: null,
          code: 'unknown_url',
        },
      }),
    );
    done();
  },
  { name: 'magus-errors' },
);

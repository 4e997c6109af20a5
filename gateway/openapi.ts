/**
 * The gateway's OpenAPI 3.1 description, built from the routes' own JSON schemas (the ones
 * fastify validates and serializes with), so it cannot drift from what the server does. Served at
 * `GET /openapi.json`; the fuzz test (`test/gateway-fuzz.int.test.ts`) feeds it to schemathesis.
 *
 * 3.1 rather than 3.0: its schemas are JSON Schema, so ours go in unchanged (`type: [string, null]`
 * has no 3.0 spelling). Two hints a route schema may carry beside fastify's own keys, in
 * `@fastify/swagger`'s spelling: `summary`, and `produces` — the media types of its 200 answer
 * when there is more than JSON (a stream); JSON ones get the 200 schema, an event stream its events.
 */
import type { RouteOptions } from 'fastify';
import { errorResponse } from './schemas/errors';

/** A route as the `onRoute` hook sees it, reduced to what the document needs. */
export interface DescribedRoute {
  method: string;
  url: string;
  schema: RouteSchema;
  /** The route answers 401 without a valid bearer token. */
  authenticated: boolean;
}

interface RouteSchema {
  summary?: string;
  produces?: readonly string[];
  body?: JsonSchema;
  headers?: JsonSchema;
  params?: JsonSchema;
  querystring?: JsonSchema;
  response?: Record<string, JsonSchema>;
}

type JsonSchema = { type?: unknown; properties?: Record<string, JsonSchema>; required?: readonly string[] } & Record<string, unknown>;

/** The routes worth describing: those with a schema, once each (not fastify's implicit HEAD twins). */
export function describedRoute(route: RouteOptions, isAuthHook: (hook: unknown) => boolean): DescribedRoute[] {
  if (!route.schema) return [];
  const methods = (Array.isArray(route.method) ? route.method : [route.method]).filter((m) => m !== 'HEAD');
  const hooks = route.onRequest === undefined ? [] : Array.isArray(route.onRequest) ? route.onRequest : [route.onRequest];
  const authenticated = hooks.some(isAuthHook);
  return methods.map((method) => ({ method, url: route.url, schema: route.schema as RouteSchema, authenticated }));
}

const isJson = (mediaType: string) => mediaType === 'application/json' || mediaType.endsWith('+json');

/**
 * One server-sent event (OpenAPI 3.2's reading of a `text/event-stream` schema, which
 * schemathesis checks every event against): `data` is `[DONE]` or a JSON object (a chunk, or an
 * error after the stream started).
 */
const sseEvent = {
  type: 'object',
  required: ['data'],
  properties: {
    event: { type: 'string' },
    data: { anyOf: [{ const: '[DONE]' }, { type: 'string', contentMediaType: 'application/json', contentSchema: { type: 'object' } }] },
  },
} as const;

function contentSchema(mediaType: string, schema: JsonSchema): unknown {
  if (isJson(mediaType)) return schema;
  return mediaType === 'text/event-stream' ? sseEvent : { type: 'string' };
}

/** `200`, `4xx` (fastify) → `200`, `4XX` (OpenAPI). */
const statusKey = (code: string) => code.replace(/xx$/i, 'XX');

function parameters(where: 'header' | 'path' | 'query', schema: JsonSchema | undefined): unknown[] {
  if (!schema?.properties) return [];
  const required = new Set(schema.required ?? []);
  return Object.entries(schema.properties).map(([name, s]) => ({ name, in: where, required: where === 'path' || required.has(name), schema: s }));
}

function responses(schema: RouteSchema): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [code, s] of Object.entries(schema.response ?? {})) {
    const text = s.type === 'string';
    const types = code === '200' && schema.produces ? schema.produces : [text ? 'text/plain' : 'application/json'];
    const content = Object.fromEntries(types.map((t) => [t, { schema: contentSchema(t, s) }]));
    out[statusKey(code)] = {
      description: code.startsWith('2') ? 'OK' : s === errorResponse ? 'An error in OpenAI’s shape' : `Status ${statusKey(code)}`,
      content,
    };
  }
  return out;
}

/** The OpenAPI 3.1 document of `routes`. Its `info.version` is the API's (`/v1`), not magus's release. */
export function openApiDocument(routes: readonly DescribedRoute[]): Record<string, unknown> {
  const paths: Record<string, Record<string, unknown>> = {};
  for (const r of routes) {
    const path = r.url.replace(/:([A-Za-z0-9_]+)/g, '{$1}');
    const s = r.schema;
    const operation: Record<string, unknown> = {
      operationId: `${r.method.toLowerCase()}${path.replace(/[^A-Za-z0-9]+(.)?/g, (_m, c: string | undefined) => (c ?? '').toUpperCase())}`,
      ...(s.summary ? { summary: s.summary } : {}),
      parameters: [...parameters('path', s.params), ...parameters('query', s.querystring), ...parameters('header', s.headers)],
      ...(s.body ? { requestBody: { required: true, content: { 'application/json': { schema: s.body } } } } : {}),
      responses: responses(s),
      security: r.authenticated ? [{ bearer: [] }] : [],
    };
    (paths[path] ??= {})[r.method.toLowerCase()] = operation;
  }
  return {
    openapi: '3.1.0',
    info: { title: 'magus gateway', version: 'v1', description: 'OpenAI-compatible chat completions over magus-served models.' },
    paths,
    components: { securitySchemes: { bearer: { type: 'http', scheme: 'bearer', description: '`mgs_<id>_<secret>`' } } },
  };
}

import { AjvCompiler } from '@fastify/ajv-compiler';
import { SerializerSelector } from '@fastify/fast-json-stringify-compiler';
import Fastify, { type FastifyServerOptions, type InjectOptions } from 'fastify';
import { options } from './app';
import { buildTestApp, type TestApp } from '../test/harness/gateway-app';
import { mkdirSync, mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { lazySerializers, lazyValidators, type BuildValidator } from './compilers';
import { generateValidators } from './validators-build';

/** fastify's compilers, counting what they compile: the routes' (method, url, part); validators generated in `dir` are loaded, not compiled. */
function counting(dir = '') {
  const validated: string[] = [];
  const serialized: string[] = [];
  const ajv = AjvCompiler() as unknown as BuildValidator;
  const fjs = SerializerSelector();
  return {
    validated,
    serialized,
    buildValidator: lazyValidators({
      build: (externals, options) => {
        const compile = ajv(externals, options);
        return (route) => {
          validated.push(`${route.method} ${route.url} ${route.httpPart}`);
          return compile(route);
        };
      },
      dir,
    }),
    buildSerializer: lazySerializers((externals, options) => {
      const compile = fjs(externals, options);
      return (route) => {
        serialized.push(`${route.method} ${route.url} ${route.httpStatus}`);
        return compile(route);
      };
    }),
  };
}

const auth = (t: TestApp) => ({ authorization: `Bearer ${t.tokens.alice.token}` });
const chat = (t: TestApp, payload: unknown): InjectOptions => ({ method: 'POST', url: '/v1/chat/completions', headers: auth(t), payload: payload as object });

const invalidBodies: [string, unknown][] = [
  ['no model', { messages: [{ role: 'user', content: 'hi' }] }],
  ['a role nobody has', { model: 'tiny', messages: [{ role: 'wizard', content: 'hi' }] }],
  ['a string for a number', { model: 'tiny', messages: [{ role: 'user', content: 'hi' }], max_tokens: '12' }],
  ['an unsupported parameter', { model: 'tiny', messages: [{ role: 'user', content: 'hi' }], n: 2 }],
  ['an unknown tool type', { model: 'tiny', messages: [{ role: 'user', content: 'hi' }], tools: [{ type: 'web' }] }],
];

describe('route compilers on first use (compilers.ts)', () => {
  let apps: TestApp[] = [];
  afterEach(async () => {
    await Promise.all(apps.map((a) => a.app.close()));
    apps = [];
  });
  const build = async (server?: FastifyServerOptions) => {
    const t = await buildTestApp({}, server ? { server } : {});
    apps.push(t);
    return t;
  };

  it('every route schema compiles with fastify’s eager compilers and the app’s ajv options', async () => {
    // The default compilers compile at ready: a schema Ajv or fast-json-stringify refuses throws here.
    const t = await build({ schemaController: {} });
    expect((await t.app.inject({ method: 'GET', url: '/healthz' })).statusCode).toBe(200);
  });

  it('compiles nothing at start, then only the parts of the routes asked for, once each', async () => {
    const c = counting();
    const t = await build({ schemaController: { compilersFactory: { buildValidator: c.buildValidator, buildSerializer: c.buildSerializer } } });
    expect([c.validated, c.serialized]).toEqual([[], []]);
    await t.app.inject(chat(t, { messages: [] }));
    await t.app.inject(chat(t, { model: 'tiny', messages: [] }));
    expect(c.validated).toEqual(['POST /v1/chat/completions body']);
    // Both refused: the route's error schema, compiled once for the two.
    expect(c.serialized).toEqual(['POST /v1/chat/completions 4xx']);
  });

  it.each(invalidBodies)('%s: the same 400 as fastify’s eager validator gives', async (_name, body) => {
    const eager = await build({ schemaController: {} });
    const lazy = await build();
    const [a, b] = await Promise.all([eager.app.inject(chat(eager, body)), lazy.app.inject(chat(lazy, body))]);
    expect(a.statusCode).toBe(400);
    expect([b.statusCode, b.json()]).toEqual([a.statusCode, a.json()]);
  });

  it('a valid body passes, and a response schema serializes as fastify’s own does', async () => {
    const eager = await build({ schemaController: {} });
    const lazy = await build();
    const body = { model: 'tiny', messages: [{ role: 'user', content: 'hi' }] };
    const [a, b] = await Promise.all([eager.app.inject(chat(eager, body)), lazy.app.inject(chat(lazy, body))]);
    // Nothing answers on the fake plane: both wait, so each is told apart only by its validation.
    expect(a.statusCode).not.toBe(400);
    expect(b.statusCode).toBe(a.statusCode);
    const [ma, mb] = await Promise.all([eager.app.inject({ method: 'GET', url: '/metrics' }), lazy.app.inject({ method: 'GET', url: '/metrics' })]);
    expect([mb.statusCode, mb.headers['content-type']]).toEqual([ma.statusCode, ma.headers['content-type']]);
  });

  it('refuses a headers schema that names a header in capitals (fastify lowercases them only for its own compiler)', async () => {
    const app = Fastify({ ...options, logger: false });
    app.get('/h', { schema: { headers: { type: 'object', properties: { 'X-Magus': { type: 'string' } } } } }, () => 'ok');
    await expect(app.ready()).rejects.toThrow(/header 'X-Magus' in its headers schema is to be named in lower case/);
    const ok = Fastify({ ...options, logger: false });
    ok.get('/h', { schema: { headers: { type: 'object', properties: { 'x-magus': { type: 'string', minLength: 2 } } } } }, () => 'ok');
    expect((await ok.inject({ method: 'GET', url: '/h', headers: { 'X-Magus': 'a' } })).statusCode).toBe(400);
    expect((await ok.inject({ method: 'GET', url: '/h', headers: { 'X-Magus': 'ab' } })).statusCode).toBe(200);
    await Promise.all([app.close(), ok.close()]);
  });

  describe('generated by the build (validators-build.ts)', () => {
    let dir: string;
    beforeAll(async () => {
      // Within the project, as dist/ is: the generated code requires Ajv's runtime from its node_modules.
      const cache = join(__dirname, '..', 'node_modules', '.cache');
      mkdirSync(cache, { recursive: true });
      dir = mkdtempSync(join(cache, 'magus-validators-'));
      await generateValidators(dir);
    });
    afterAll(() => rmSync(dir, { recursive: true, force: true }));

    it('every route part with a schema has its code, one file per distinct schema', async () => {
      const stored = await generateValidators(dir);
      expect(stored).toEqual(
        expect.arrayContaining(['POST /v1/chat/completions body', 'POST /v1/responses body', 'POST /v1/embeddings body', 'POST /v1/completions body']),
      );
      const files = readdirSync(dir);
      expect(files.every((f) => /^[0-9a-f]{32}\.js$/.test(f))).toBe(true);
      expect(files.length).toBeGreaterThan(3);
      expect(files.length).toBeLessThanOrEqual(stored.length);
    });

    it.each(invalidBodies)('%s: loaded, not compiled, and the same 400 as fastify’s eager validator gives', async (_name, body) => {
      const c = counting(dir);
      const eager = await build({ schemaController: {} });
      const loaded = await build({ schemaController: { compilersFactory: { buildValidator: c.buildValidator } } });
      const [a, b] = await Promise.all([eager.app.inject(chat(eager, body)), loaded.app.inject(chat(loaded, body))]);
      expect(a.statusCode).toBe(400);
      expect([b.statusCode, b.json()]).toEqual([a.statusCode, a.json()]);
      expect(c.validated).toEqual([]);
    });

    it('a schema the build did not see is compiled', async () => {
      const c = counting(dir);
      const app = Fastify({ ...options, logger: false, schemaController: { compilersFactory: { buildValidator: c.buildValidator } } });
      app.post('/other', { schema: { body: { type: 'object', required: ['a'], properties: { a: { type: 'integer' } } } } }, () => 'ok');
      expect((await app.inject({ method: 'POST', url: '/other', payload: { a: 'x' } })).statusCode).toBe(400);
      expect((await app.inject({ method: 'POST', url: '/other', payload: { a: 1 } })).statusCode).toBe(200);
      expect(c.validated).toEqual(['POST /other body']);
      await app.close();
    });
  });
});

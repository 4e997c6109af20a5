/**
 * Fuzzing the gateway's edges (issue 14), against the real process (`startGateway` on a loopback
 * port, nats-server, the real bridge and the stub engine; only the session workflow is replaced
 * by a cold start that pins each conversation to the one instance, as gateway tests do):
 * - schemathesis, fed the gateway's own OpenAPI description (`GET /openapi.json`, made from the
 *   routes' schemas): positive and negative cases for every operation; no 5xx, answers conform to
 *   the documented schemas and media types (SSE events included), requests that break the schema
 *   are refused with a 4xx, requests that keep to it are accepted, a method a path does not have
 *   is a 405 with an `Allow` listing the ones it has. Bodies with a `__proto__` key are left out
 *   (schemathesis_hooks.py says why). Its seed is fixed unless `MAGUS_FUZZ_SEED=random`, and
 *   printed; `MAGUS_FUZZ_SEED` replays one.
 * - hand-written requests fetch cannot send (raw sockets): huge headers, a body trickled a byte
 *   a second, invalid UTF-8, duplicated keys, deep nesting, an endless chunked body, a wrong
 *   content type, a body cut short, a malformed or overlong URL, a non-HTTP line. Each answer is a
 *   4xx in OpenAI's error shape (or a 200 where the request is fine), with no stack trace or path
 *   in it, and the gateway still answers `/healthz` afterwards.
 */
import { execFile } from 'node:child_process';
import { randomBytes, randomInt } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { connect } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import type { DataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import type { RunningGateway } from '../gateway/server';
import { LogSink, readyModel } from './harness/gateway-app';
import type { StubEngine } from './fixtures/stub-engine';
import { isolation } from './harness';
import { pinConversation, publishPoolView } from './harness/gateway';
import { gatewayStack, natsStack, stubInstanceStack, TestStack } from './harness/stack';
import { sleep } from './harness/wait';

const iso = isolation();
const MODEL = 'demo'; // the example of the chat body's schema: schemathesis's first case reaches the engine
const INSTANCE = 'i1';
const TOKEN_ID = 'fuzz';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(16).toString('hex')}`;
const BODY_LIMIT = 1024 * 1024;
/** The HTTP request (and headers) timeout: a trickled body is cut after this. */
const HTTP_TIMEOUT_MS = 2_000;
// A fixed seed by default, so a CI run fails only on a change; MAGUS_FUZZ_SEED=random explores new ground (a campaign).
const SEED = process.env.MAGUS_FUZZ_SEED === 'random' ? randomInt(2 ** 31) : Number(process.env.MAGUS_FUZZ_SEED ?? 20261124);
/** Cases schemathesis generates per operation and phase (~700 requests in all at 40). */
const MAX_EXAMPLES = 40;

let nc: NatsConnection;
let names: DataPlaneNames;
let engine: StubEngine;
let gateway: RunningGateway;
let port: number;
const log = new LogSink();
const stack = new TestStack();

beforeAll(async () => {
  ({ nc, names } = await stack.open(natsStack(iso, { declare: true })));
  await (await openModelRegistry(nc, names.modelsBucket)).put(readyModel(MODEL));
  ({ engine } = await stack.open(stubInstanceStack(nc, names, { pool: MODEL, instance: INSTANCE, slots: 4 })));
  ({ gateway } = await stack.open(
    gatewayStack(names, {
      secret: randomBytes(32).toString('hex'),
      tokens: { [TOKEN_ID]: TOKEN },
      env: {
        MAGUS_GATEWAY_BODY_LIMIT: String(BODY_LIMIT),
        MAGUS_GATEWAY_HTTP_REQUEST_TIMEOUT_MS: String(HTTP_TIMEOUT_MS),
        MAGUS_GATEWAY_HEADERS_TIMEOUT_MS: String(HTTP_TIMEOUT_MS),
        MAGUS_GATEWAY_REQUEST_TIMEOUT_MS: '10000',
        MAGUS_LOG_LEVEL: 'info',
      },
      // What the session workflow does on a cold start: lease the instance and record it for warm turns.
      deps: { logStream: log, coldStart: (req) => pinConversation(nc, names, req.conversationKey, MODEL, INSTANCE) },
    }),
  ));
  port = Number(new URL(gateway.url).port);
  // Requests of no conversation (embeddings) go where the pool's view says its instances are.
  await publishPoolView(nc, names, MODEL, [INSTANCE]);
}, 60_000);

afterAll(() => stack.close());

/** What a client must never read: a stack frame or a path of this machine. */
function expectNoLeak(text: string): void {
  expect(text).not.toMatch(/\n\s*at \S/);
  expect(text).not.toMatch(/\.[jt]s:\d+/);
  expect(text).not.toContain('node_modules');
  expect(text).not.toContain(process.cwd());
}

interface RawAnswer {
  status: number;
  head: string;
  body: string;
  ms: number;
}

type Part = string | Buffer | { waitMs: number };

/**
 * Sends `parts` on a fresh connection (pausing at each `waitMs`), half-closes it when `end`, and
 * reads until the server closes: the first answer's status line, head and body.
 */
function rawRequest(parts: Part[], opts: { end?: boolean } = {}): Promise<RawAnswer> {
  const started = Date.now();
  return new Promise((resolve, reject) => {
    const socket = connect({ host: '127.0.0.1', port });
    const chunks: Buffer[] = [];
    const timer = setTimeout(() => socket.destroy(new Error('no answer within 15 s')), 15_000);
    socket.on('data', (d: Buffer) => chunks.push(d));
    // A server that answers and closes while we still write makes our writes fail: not our concern.
    socket.on('error', (err: NodeJS.ErrnoException) => {
      if (err.code !== 'EPIPE' && err.code !== 'ECONNRESET') reject(err);
    });
    socket.on('close', () => {
      clearTimeout(timer);
      const text = Buffer.concat(chunks).toString('utf8');
      const m = /^HTTP\/1\.1 (\d{3}) /.exec(text);
      if (!m) return reject(new Error(`no HTTP answer: ${JSON.stringify(text.slice(0, 200))}`));
      const [head, body] = [text.slice(0, text.indexOf('\r\n\r\n')), text.slice(text.indexOf('\r\n\r\n') + 4)];
      resolve({ status: Number(m[1]), head, body, ms: Date.now() - started });
    });
    // A pause that ends early when the connection does: no timer outlives the request.
    const pause = (ms: number) =>
      new Promise<void>((r) => {
        const done = () => {
          clearTimeout(t);
          socket.off('close', done);
          r();
        };
        const t = setTimeout(done, ms);
        socket.once('close', done);
      });
    void (async () => {
      for (const p of parts) {
        if (socket.destroyed) return;
        if (typeof p === 'object' && 'waitMs' in p) await pause(p.waitMs);
        else socket.write(p);
      }
      if (opts.end && !socket.destroyed) socket.end();
    })();
  });
}

/** The head of a chat request; `length` undefined → chunked. */
function chatHead(opts: { length?: number; contentType?: string; extra?: string } = {}): string {
  const length = opts.length === undefined ? 'Transfer-Encoding: chunked\r\n' : `Content-Length: ${opts.length}\r\n`;
  return `POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer ${TOKEN}\r\nContent-Type: ${opts.contentType ?? 'application/json'}\r\n${length}${opts.extra ?? ''}Connection: close\r\n\r\n`;
}

const chat = (body: string | Buffer): Part[] => [chatHead({ length: Buffer.byteLength(body) }), body];
const hello = (extra = '') => `{"model":"${MODEL}","messages":[{"role":"user","content":"Hello"}]${extra}}`;

/** The OpenAI error of an answer, checked for shape and leaks. */
function openAiError(a: RawAnswer): { message: string; type: string; param: string | null; code: string | null } {
  expectNoLeak(a.head + a.body);
  expect(a.head.toLowerCase()).toContain('content-type: application/json');
  const { error } = JSON.parse(a.body) as { error: { message: string; type: string; param: string | null; code: string | null } };
  expect(Object.keys(error).sort()).toEqual(['code', 'message', 'param', 'type']);
  expect(error.type).toBe('invalid_request_error');
  return error;
}

async function expectHealthy(): Promise<void> {
  const res = await fetch(`${gateway.url}/healthz`, { signal: AbortSignal.timeout(2_000) });
  expect(res.status).toBe(200);
}

describe('schemathesis against the OpenAPI description', () => {
  test('every operation, positive and negative cases: no 5xx, answers as documented, bad requests refused', async () => {
    const bin = await new Promise<string>((resolve, reject) =>
      execFile(join(__dirname, '..', 'scripts', 'schemathesis'), ['--check'], (err, stdout) =>
        err ? reject(new Error('schemathesis is missing: run scripts/schemathesis')) : resolve(stdout.trim()),
      ),
    );
    // Its own folder: hypothesis keeps an example database in the working directory.
    const cwd = mkdtempSync(join(tmpdir(), 'magus-schemathesis-'));
    const checks = [
      'not_a_server_error',
      'status_code_conformance',
      'content_type_conformance',
      'response_schema_conformance',
      'response_headers_conformance',
      'negative_data_rejection',
      'positive_data_acceptance',
      'missing_required_header',
      'unsupported_method',
      'allow_header_conformance',
      'ignored_auth',
    ];
    const args = [
      '--config-file',
      join(__dirname, 'schemathesis.toml'),
      'run',
      `${gateway.url}/openapi.json`,
      '--header',
      `Authorization: Bearer ${TOKEN}`,
      '--checks',
      checks.join(','),
      '--max-examples',
      String(MAX_EXAMPLES),
      '--seed',
      String(SEED),
      '--workers',
      '1',
      '--request-timeout',
      '15',
      '--output-truncate',
      'true',
    ];
    const run = await new Promise<{ code: number; output: string }>((resolve) =>
      execFile(
        bin,
        args,
        {
          cwd,
          env: { ...process.env, NO_COLOR: '1', SCHEMATHESIS_HOOKS: join(__dirname, 'schemathesis_hooks.py') },
          maxBuffer: 64 * 1024 * 1024,
          timeout: 150_000,
        },
        (err, stdout, stderr) => resolve({ code: err ? (typeof err.code === 'number' ? err.code : -1) : 0, output: stdout + stderr }),
      ),
    ).finally(() => rmSync(cwd, { recursive: true, force: true }));
    const cases = Number(/(\d+) generated/.exec(run.output)?.[1] ?? 0);
    const operations = /Tested: (\d+)/.exec(run.output)?.[1];
    // The seed and counts on every run (jest shows them with a failure; -i shows them always).
    process.stdout.write(`schemathesis: seed ${SEED} (MAGUS_FUZZ_SEED=${SEED} replays it), ${cases} cases over ${operations} operations, exit ${run.code}\n`);
    if (run.code !== 0) throw new Error(`schemathesis failed (seed ${SEED}, MAGUS_FUZZ_SEED=${SEED} replays it):\n${run.output.slice(-20_000)}`);
    // Every route the gateway has, and enough cases that the run was not a formality.
    expect(operations).toBe('12');
    expect(cases).toBeGreaterThan(200);
    // The example request went all the way to the engine and back.
    expect(engine.requests.length).toBeGreaterThan(0);
    await expectHealthy();
  }, 170_000);
});

describe('requests fetch cannot send', () => {
  afterEach(expectHealthy);

  test('a 64 KiB header → 431, the connection closed', async () => {
    const a = await rawRequest([chatHead({ length: 2, extra: `X-Big: ${'a'.repeat(64 * 1024)}\r\n` }), '{}']);
    expect(a.status).toBe(431);
    expect(openAiError(a).code).toBe('request_headers_too_large');
  });

  test('a body trickled a byte a second → 408 once the HTTP request timeout passes; others are served meanwhile', async () => {
    const body = hello();
    const trickle: Part[] = [chatHead({ length: body.length })];
    for (const ch of body.slice(0, 8)) trickle.push(ch, { waitMs: 1_000 });
    const slow = rawRequest(trickle);
    await sleep(500);
    const started = Date.now();
    await expectHealthy();
    expect(Date.now() - started).toBeLessThan(1_000);
    const a = await slow;
    expect(a.status).toBe(408);
    expect(openAiError(a).code).toBe('timeout');
    // Cut within a quarter of the timeout after it passed (the server's check interval), plus slack.
    expect(a.ms).toBeLessThan(HTTP_TIMEOUT_MS * 1.25 + 1_000);
  });

  test('invalid UTF-8 in the body → 400 invalid_encoding; nothing reaches the engine', async () => {
    const before = engine.requests.length;
    const body = Buffer.concat([
      Buffer.from(`{"model":"${MODEL}","messages":[{"role":"user","content":"a`),
      Buffer.from([0xff, 0xfe, 0xc3]),
      Buffer.from('"}]}'),
    ]);
    const a = await rawRequest(chat(body));
    expect(a.status).toBe(400);
    expect(openAiError(a)).toMatchObject({ code: 'invalid_encoding', message: 'The request body is not valid UTF-8.' });
    expect(engine.requests.length).toBe(before);
  });

  test('duplicated keys: the last one wins, as in JSON.parse and Python', async () => {
    const served = await rawRequest(
      chat(`{"model":"nope","model":"${MODEL}","messages":[{"role":"user","content":"x"}],"messages":[{"role":"user","content":"last"}]}`),
    );
    expect(served.status).toBe(200);
    expectNoLeak(served.body);
    expect(engine.requests.at(-1)?.body).toMatchObject({ model: MODEL, messages: [{ role: 'user', content: 'last' }] });
    const refused = await rawRequest(chat(`{"model":"${MODEL}","model":"nope","messages":[{"role":"user","content":"x"}]}`));
    expect(refused.status).toBe(404);
    expect(openAiError(refused)).toMatchObject({ code: 'model_not_found', param: 'model' });
  });

  test('deep nesting: 200,000 levels in an ignored field is served; in a checked field, 400 naming it', async () => {
    const deep = `${'['.repeat(200_000)}${']'.repeat(200_000)}`;
    const ignored = await rawRequest(chat(hello(`,"logit_bias":${deep}`)));
    expect(ignored.status).toBe(200);
    expectNoLeak(ignored.body);
    const checked = await rawRequest(chat(`{"model":"${MODEL}","messages":[{"role":"user","content":${deep}}]}`));
    expect(checked.status).toBe(400);
    expect(openAiError(checked).param).toBe('messages[0].content');
  });

  test('a chunked body that never ends → 413 once past the limit, the rest unread', async () => {
    const piece = Buffer.alloc(64 * 1024, 'a');
    const parts: Part[] = [chatHead(), `{"model":"${MODEL}","messages":[{"role":"user","content":"`];
    for (let i = 0; i < 64; i++) parts.push(`${piece.length.toString(16)}\r\n`, piece, '\r\n'); // 4 MiB, 4× the limit
    parts[1] = `${Buffer.byteLength(parts[1] as string).toString(16)}\r\n${parts[1] as string}\r\n`;
    const a = await rawRequest(parts);
    expect(a.status).toBe(413);
    expect(openAiError(a).code).toBe('request_too_large');
  });

  test.each([
    ['text/plain', 400],
    ['application/x-www-form-urlencoded', 415],
  ])('content type %s → %d', async (contentType, status) => {
    const body = hello();
    const a = await rawRequest([chatHead({ length: body.length, contentType }), body]);
    expect(a.status).toBe(status);
    openAiError(a);
  });

  test('a charset parameter on application/json is ignored (RFC 8259 defines none): UTF-8 still', async () => {
    const body = hello().replace('Hello', 'héllo');
    const a = await rawRequest([chatHead({ length: Buffer.byteLength(body), contentType: 'application/json; charset=latin1' }), body]);
    expect(a.status).toBe(200);
    expect(engine.requests.at(-1)?.body).toMatchObject({ messages: [{ role: 'user', content: 'héllo' }] });
  });

  test('a body shorter than its Content-Length, then the client half-closes → 400, nothing reaches the engine', async () => {
    const before = engine.requests.length;
    const a = await rawRequest([chatHead({ length: 100 }), `{"model":"${MODEL}"`], { end: true });
    expect(a.status).toBe(400);
    expect(openAiError(a)).toMatchObject({ code: 'invalid_http_request', message: expect.stringContaining('ended before the request did') as string });
    expect(engine.requests.length).toBe(before);
  });

  test.each([
    ['malformed percent-encoding in the path', 400, 'invalid_url', `/v1/models/%E0%A4%A`],
    ['a model id longer than the router takes', 414, 'uri_too_long', `/v1/models/${'m'.repeat(600)}`],
    ['a model id longer than the schema allows', 400, 'invalid_value', `/v1/models/${'m'.repeat(300)}`],
  ])('%s → %d %s', async (_what, status, code, path) => {
    const a = await rawRequest([`GET ${path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer ${TOKEN}\r\nConnection: close\r\n\r\n`]);
    expect(a.status).toBe(status);
    expect(openAiError(a).code).toBe(code);
  });

  test('a line that is not HTTP → 400 invalid_http_request', async () => {
    const a = await rawRequest(['GARBAGE /x\r\n\r\n']);
    expect(a.status).toBe(400);
    expect(openAiError(a)).toMatchObject({ code: 'invalid_http_request', message: expect.stringContaining('not an HTTP method') as string });
  });

  test('none of it made the gateway log a failure of its own', () => {
    const failures = log.lines.map((l) => JSON.parse(l) as { level: number; msg: string }).filter((l) => l.level >= 50);
    expect(failures).toEqual([]);
  });
});

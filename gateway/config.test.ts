/** Gateway configuration: defaults, and a bad value fails fast naming the variable. */
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { loadGatewayConfig, loadSessionTtl, SESSION_TTL_MS } from './config';
import { gatewayCommand } from './server';
import { makeToken } from '../test/harness/gateway-app';

const SECRET = 'x'.repeat(32);

it('has working defaults once a secret is given', () => {
  const c = loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET });
  expect(c).toMatchObject({
    host: '0.0.0.0',
    port: 8080,
    natsServers: 'nats://127.0.0.1:4222',
    buckets: { models: 'magus_models', tokens: 'magus_tokens', sessions: 'magus_sessions' },
    settings: { secret: SECRET, allowAnonymous: false, requestTimeoutMs: 300_000 },
    responseRouting: 'shared',
    replicaId: expect.stringMatching(/^gw-[0-9a-f]{12}$/) as string,
    staticTokens: [],
  });
  // Random at start: two replicas started alike do not share response subjects.
  expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET }).replicaId).not.toBe(c.replicaId);
  expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_REPLICA_ID: 'magus-gateway-7d9f8-x2x7q' }).replicaId).toBe(
    'magus-gateway-7d9f8-x2x7q',
  );
});

it('reads the Temporal settings and the instance memory, and none of the worker’s own variables', () => {
  expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET })).toMatchObject({
    temporal: { address: '127.0.0.1:7233', namespace: 'default', taskQueue: 'magus-control' },
  });
  expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET }).instanceMemory).toBeUndefined();
  const c = loadGatewayConfig({
    MAGUS_GATEWAY_SECRET: SECRET,
    MAGUS_TEMPORAL_ADDRESS: 'temporal.magus:7233',
    MAGUS_TEMPORAL_NAMESPACE: 'magus',
    MAGUS_TASK_QUEUE: 'prod-control',
    MAGUS_INSTANCE_MEMORY: '12Gi',
    // The worker's S3 settings: a gateway never reads them.
    MAGUS_S3_BUCKET: 'Not_A_Bucket',
  });
  expect(c).toMatchObject({ temporal: { address: 'temporal.magus:7233', namespace: 'magus', taskQueue: 'prod-control' }, instanceMemory: 12 * 2 ** 30 });
  // A bad one is one more line of the one error.
  expect(() => loadGatewayConfig({ MAGUS_TEMPORAL_ADDRESS: 'http://temporal:7233' })).toThrow(
    /^invalid gateway configuration:\n {2}MAGUS_TEMPORAL_ADDRESS=http:\/\/temporal:7233 is not host:port\n {2}MAGUS_GATEWAY_SECRET .* is required/,
  );
});

it('takes --host/--port over the environment', () => {
  const c = loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_PORT: '9000' }, { port: '0', host: '127.0.0.1' });
  expect([c.host, c.port]).toEqual(['127.0.0.1', 0]);
});

describe('the operations listener and /openapi.json: MAGUS_GATEWAY_HEALTH_ADDRESS, MAGUS_GATEWAY_OPENAPI', () => {
  it('unset: no operations listener (everything on the API port) and a public OpenAPI description', () => {
    const c = loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET });
    expect(c.healthAddress).toBeUndefined();
    expect(c.settings.openApi).toBe('public');
    expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_HEALTH_ADDRESS: ' ', MAGUS_GATEWAY_OPENAPI: '' })).toMatchObject({
      settings: { openApi: 'public' },
    });
  });

  it.each([
    ['0.0.0.0:9467', { host: '0.0.0.0', port: 9467 }],
    ['127.0.0.1:0', { host: '127.0.0.1', port: 0 }],
    ['gateway.local:9467', { host: 'gateway.local', port: 9467 }],
    ['[::]:9467', { host: '::', port: 9467 }],
    ['[::1]:9467', { host: '::1', port: 9467 }],
  ])('reads host:port %s', (value, address) => {
    expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_HEALTH_ADDRESS: value }).healthAddress).toEqual(address);
  });

  it.each(['public', 'authenticated', 'off'] as const)('reads MAGUS_GATEWAY_OPENAPI=%s', (value) => {
    expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_OPENAPI: value }).settings.openApi).toBe(value);
  });

  it('takes --health-address and --openapi over the environment', () => {
    const c = loadGatewayConfig(
      { MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_HEALTH_ADDRESS: '0.0.0.0:9467', MAGUS_GATEWAY_OPENAPI: 'public' },
      { healthAddress: '127.0.0.1:9999', openApi: 'off' },
    );
    expect([c.healthAddress, c.settings.openApi]).toEqual([{ host: '127.0.0.1', port: 9999 }, 'off']);
  });

  it.each([
    [{ MAGUS_GATEWAY_HEALTH_ADDRESS: '9467' }, 'MAGUS_GATEWAY_HEALTH_ADDRESS (--health-address)=9467 must be host:port'],
    [{ MAGUS_GATEWAY_HEALTH_ADDRESS: ':9467' }, 'MAGUS_GATEWAY_HEALTH_ADDRESS (--health-address)=:9467 must be host:port'],
    [{ MAGUS_GATEWAY_HEALTH_ADDRESS: 'http://0.0.0.0:9467' }, 'must be host:port'],
    [{ MAGUS_GATEWAY_HEALTH_ADDRESS: '0.0.0.0:70000' }, 'MAGUS_GATEWAY_HEALTH_ADDRESS (--health-address)=0.0.0.0:70000 must be host:port'],
    [{ MAGUS_GATEWAY_HEALTH_ADDRESS: '::1:9467' }, 'must be host:port'], // IPv6 needs its brackets
    [
      { MAGUS_GATEWAY_HEALTH_ADDRESS: '0.0.0.0:8080' },
      "MAGUS_GATEWAY_HEALTH_ADDRESS (--health-address) 0.0.0.0:8080 must be on another port than the API's (8080)",
    ],
    [{ MAGUS_GATEWAY_PORT: '9000', MAGUS_GATEWAY_HEALTH_ADDRESS: '127.0.0.1:9000' }, "must be on another port than the API's (9000)"],
    [{ MAGUS_GATEWAY_OPENAPI: 'private' }, 'MAGUS_GATEWAY_OPENAPI (--openapi)=private must be one of public, authenticated, off'],
    [{ MAGUS_GATEWAY_OPENAPI: 'Public' }, 'MAGUS_GATEWAY_OPENAPI (--openapi)=Public must be one of public, authenticated, off'],
  ])('refuses %j', (env, message) => {
    expect(() => loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, ...env })).toThrow(message);
  });
});

it.each([
  [{}, 'MAGUS_GATEWAY_SECRET (or MAGUS_GATEWAY_SECRET_FILE) is required'],
  [{ MAGUS_GATEWAY_SECRET: 'short' }, 'MAGUS_GATEWAY_SECRET must be at least 32 characters'],
  [{ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_PORT: 'http' }, 'MAGUS_GATEWAY_PORT (--port)=http must be a whole number'],
  [{ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_ALLOW_ANONYMOUS: 'maybe' }, 'MAGUS_GATEWAY_ALLOW_ANONYMOUS=maybe must be true or false'],
  [{ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_NATS_URL: 'http://x:4222' }, 'MAGUS_NATS_URL=http://x:4222 is not a list of nats:// URLs'],
  [{ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_TEMPORAL_ADDRESS: 'temporal' }, 'MAGUS_TEMPORAL_ADDRESS=temporal is not host:port'],
  [{ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_INSTANCE_MEMORY: 'lots' }, 'MAGUS_INSTANCE_MEMORY=lots must be bytes or a quantity'],
  [{ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_SESSIONS_BUCKET: 'a.b' }, 'MAGUS_SESSIONS_BUCKET=a.b is not a KV bucket name'],
  [
    { MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_GAP_TIMEOUT_MS: '5000', MAGUS_GATEWAY_REQUEST_TIMEOUT_MS: '1000' },
    'MAGUS_GATEWAY_GAP_TIMEOUT_MS (5000) must be below MAGUS_GATEWAY_REQUEST_TIMEOUT_MS (1000)',
  ],
  [{ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_CONNECTION_TIMEOUT_MS: '60000' }, 'MAGUS_GATEWAY_CONNECTION_TIMEOUT_MS (60000) must be 0 or above'],
  [{ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_TOKENS: '{"a": {"digest": "abc", "name": "a"}}' }, 'MAGUS_GATEWAY_TOKENS.a.digest: must be the hex sha256'],
  [{ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_TOKENS: '{oops' }, 'MAGUS_GATEWAY_TOKENS is not valid JSON'],
  [
    { MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_TOKENS_FILE: '/nonexistent/tokens.json' },
    'MAGUS_GATEWAY_TOKENS_FILE=/nonexistent/tokens.json cannot be read (ENOENT)',
  ],
  [{ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_LOG_LEVEL: 'loud' }, 'MAGUS_LOG_LEVEL=loud must be one of'],
  [{ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_REPLICA_ID: 'gw.1' }, 'MAGUS_GATEWAY_REPLICA_ID=gw.1 is not a subject token'],
])('%j fails naming the variable', (env, message) => {
  expect(() => loadGatewayConfig(env)).toThrow(
    expect.objectContaining({ name: 'GatewayConfigError', message: expect.stringContaining(message) as string }) as Error,
  );
});

describe('MAGUS_SESSION_TTL_MS', () => {
  it('is 30 min unset or empty, and read as whole milliseconds', () => {
    expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET }).sessionTtlMs).toBe(30 * 60_000);
    expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_SESSION_TTL_MS: '  ' }).sessionTtlMs).toBe(30 * 60_000);
    expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_SESSION_TTL_MS: '180000' }).sessionTtlMs).toBe(180_000);
    expect(loadSessionTtl({})).toBe(SESSION_TTL_MS.default);
    expect(loadSessionTtl({ MAGUS_SESSION_TTL_MS: ' 60000 ' })).toBe(60_000);
    expect(loadSessionTtl({ MAGUS_SESSION_TTL_MS: '86400000' })).toBe(24 * 3_600_000);
  });

  it.each(['59999', '86400001', '0', '-60000', '90000.5', '1e6', '3m', '0x30000', 'thirty minutes'])('%j fails naming the variable and the range', (value) => {
    const message = `MAGUS_SESSION_TTL_MS=${value} must be whole milliseconds from 60000 (1 min`;
    const named = expect.objectContaining({ name: 'GatewayConfigError', message: expect.stringContaining(message) as string }) as Error;
    expect(() => loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_SESSION_TTL_MS: value })).toThrow(named);
    // `magus dev` reads it alone, before it starts anything.
    expect(() => loadSessionTtl({ MAGUS_SESSION_TTL_MS: value })).toThrow(named);
  });

  it('is reported with the other problems', () => {
    expect(() => loadGatewayConfig({ MAGUS_SESSION_TTL_MS: '10' })).toThrow(/MAGUS_GATEWAY_SECRET .* is required.*\n.*MAGUS_SESSION_TTL_MS=10 must be/s);
  });
});

describe('stored responses: MAGUS_RESPONSES_BUCKET, MAGUS_RESPONSES_TTL', () => {
  it('magus_responses (named by the prefix) for 30 days unset; a duration with a unit or whole milliseconds', () => {
    const c = loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET });
    expect(c.buckets.responses).toBe('magus_responses');
    expect(c.responsesTtlMs).toBe(30 * 24 * 3_600_000);
    expect(c.natsReplicas).toBeUndefined();
    expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_NATS_PREFIX: 'T_X' }).buckets.responses).toBe('T_X_magus_responses');
    expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_RESPONSES_BUCKET: 'mine', MAGUS_NATS_REPLICAS: '3' })).toMatchObject({
      buckets: { responses: 'mine' },
      natsReplicas: 3,
    });
    for (const [value, ms] of [
      ['7d', 7 * 24 * 3_600_000],
      ['12h', 12 * 3_600_000],
      ['90m', 90 * 60_000],
      ['60s', 60_000],
      ['120000', 120_000],
    ] as const) {
      expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_RESPONSES_TTL: value }).responsesTtlMs).toBe(ms);
    }
  });

  it.each(['30', '59s', '366d', '1.5d', 'a week', '-1h'])('refuses %j naming the variable', (value) => {
    expect(() => loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_RESPONSES_TTL: value })).toThrow(
      `MAGUS_RESPONSES_TTL=${value} must be a duration from 1m to 365d`,
    );
  });
});

describe('MAGUS_MAX_QUEUE_WAIT', () => {
  it('is 5 s unless set; a duration, 0 bounding nothing', () => {
    expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET }).maxQueueWaitMs).toBe(5_000);
    for (const [value, ms] of [
      ['0', 0],
      ['1500ms', 1_500],
      ['3s', 3_000],
      ['2m', 120_000],
      ['800', 800],
    ] as const)
      expect(loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_MAX_QUEUE_WAIT: value }).maxQueueWaitMs).toBe(ms);
  });

  it.each(['11m', '1.5s', 'soon', '-1s'])('refuses %j naming the variable', (value) => {
    expect(() => loadGatewayConfig({ MAGUS_GATEWAY_SECRET: SECRET, MAGUS_MAX_QUEUE_WAIT: value })).toThrow(
      `MAGUS_MAX_QUEUE_WAIT=${value} must be a duration from 0 (no bound) to 10m`,
    );
  });
});

it('never echoes the secret', () => {
  const secret = 'tiny-secret';
  expect(() => loadGatewayConfig({ MAGUS_GATEWAY_SECRET: secret })).toThrow(
    expect.not.objectContaining({ message: expect.stringContaining(secret) as string }) as Error,
  );
});

it('reads the secret and tokens from files', () => {
  const dir = mkdtempSync(join(tmpdir(), 'magus-gw-config-'));
  const t = makeToken('local');
  writeFileSync(join(dir, 'secret'), `${SECRET}\n`);
  writeFileSync(join(dir, 'tokens.json'), JSON.stringify({ local: t.entry }));
  const c = loadGatewayConfig({ MAGUS_GATEWAY_SECRET_FILE: join(dir, 'secret'), MAGUS_GATEWAY_TOKENS_FILE: join(dir, 'tokens.json') });
  expect(c.settings.secret).toBe(SECRET);
  expect(c.staticTokens).toEqual([{ origin: 'MAGUS_GATEWAY_TOKENS_FILE', entries: { local: t.entry } }]);
});

describe('gatewayCommand', () => {
  let stderr: jest.SpyInstance;
  let stdout: jest.SpyInstance;
  const saved = { ...process.env };
  beforeEach(() => {
    stderr = jest.spyOn(process.stderr, 'write').mockImplementation(() => true);
    stdout = jest.spyOn(process.stdout, 'write').mockImplementation(() => true);
  });
  afterEach(() => {
    jest.restoreAllMocks();
    process.env = { ...saved };
  });
  const written = (spy: jest.SpyInstance) => (spy.mock.calls as unknown[][]).map((c) => String(c[0])).join('');

  it('--help prints the variables and exits 0', async () => {
    expect(await gatewayCommand(['--help'])).toBe(0);
    expect(written(stdout)).toContain('MAGUS_GATEWAY_SECRET');
    expect(written(stdout)).toContain('MAGUS_SESSION_TTL_MS');
    for (const name of ['MAGUS_TEMPORAL_ADDRESS', 'MAGUS_TEMPORAL_NAMESPACE', 'MAGUS_TASK_QUEUE', 'MAGUS_INSTANCE_MEMORY'])
      expect(written(stdout)).toContain(name);
    for (const text of ['MAGUS_GATEWAY_HEALTH_ADDRESS', '--health-address host:port', 'MAGUS_GATEWAY_OPENAPI', '--openapi public|authenticated|off'])
      expect(written(stdout)).toContain(text);
  });

  it('exits 1 naming the problem: unknown flag, bad configuration, unreachable NATS', async () => {
    expect(await gatewayCommand(['--colour'])).toBe(1);
    expect(written(stderr)).toContain("unknown argument '--colour'");
    expect(await gatewayCommand(['--health-address'])).toBe(1);
    expect(written(stderr)).toContain('--health-address needs a value');
    process.env.MAGUS_GATEWAY_SECRET = SECRET;
    expect(await gatewayCommand(['--openapi', 'secret'])).toBe(1);
    expect(written(stderr)).toContain('MAGUS_GATEWAY_OPENAPI (--openapi)=secret must be one of public, authenticated, off');
    expect(await gatewayCommand(['--health-address=localhost'])).toBe(1);
    expect(written(stderr)).toContain('MAGUS_GATEWAY_HEALTH_ADDRESS (--health-address)=localhost must be host:port');
    delete process.env.MAGUS_GATEWAY_SECRET;
    delete process.env.MAGUS_GATEWAY_SECRET_FILE;
    expect(await gatewayCommand(['--port', '8080'])).toBe(1);
    expect(written(stderr)).toContain('MAGUS_GATEWAY_SECRET (or MAGUS_GATEWAY_SECRET_FILE) is required');
    process.env.MAGUS_GATEWAY_SECRET = SECRET;
    process.env.MAGUS_SESSION_TTL_MS = '5000';
    expect(await gatewayCommand([])).toBe(1);
    expect(written(stderr)).toContain('magus gateway: invalid gateway configuration:\n  MAGUS_SESSION_TTL_MS=5000 must be whole milliseconds');
    delete process.env.MAGUS_SESSION_TTL_MS;
    process.env.MAGUS_GATEWAY_SECRET = SECRET;
    process.env.MAGUS_NATS_URL = 'nats://127.0.0.1:1';
    expect(await gatewayCommand(['--port=0'])).toBe(1);
    expect(written(stderr)).toContain('magus gateway: cannot start:');
  });
});

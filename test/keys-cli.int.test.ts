/**
 * `magus keys` as users run it — the built CLI (`npm run build`) as a child process — against the
 * file's data plane on the test NATS server, with a real gateway on it: a created key's token is
 * printed once, alone on stdout, and accepted by the gateway within seconds, for its models only;
 * a name is created once; `list --json` shows keys without digests or tokens; limits given as
 * flags are stored in the key's entry (and replaced by `keys limits`), bad ones are an exit 1
 * naming the flag with nothing written; a revoked token is refused within seconds; NATS away or
 * the data plane missing is an exit 1 naming what is wrong.
 */
import type { KV, NatsConnection } from 'nats';
import { dataPlaneNames, type DataPlaneNames } from '../dataplane';
import type { TokenEntry } from '../shared/serving';
import { TOKEN_PATTERN } from '../dataplane/keys';
import { openModelRegistry } from '../dataplane/registry';
import { tokenDigest } from '../gateway/plugins/auth';
import type { RunningGateway } from '../gateway/server';
import { MAX_PER_MINUTE } from '../shared/limits';
import { endpoint, isolation, natsCredentialsEnv, natsRoleCredentials } from './harness';
import { runMagus, type MagusRun } from './harness/dev';
import { LogSink, readyModel, TEST_SECRET } from './harness/gateway-app';
import { gatewayStack, natsStack, tempDir, TestStack } from './harness/stack';
import { until } from './harness/wait';

const iso = isolation();
const stack = new TestStack();
const model = `tiny-${iso.id}`;
let nc: NatsConnection;
let names: DataPlaneNames;
let gateway: RunningGateway;
let tokens: KV;
let env: NodeJS.ProcessEnv;
const log = new LogSink();
/** Every token the CLI printed. */
const printedTokens: string[] = [];

beforeAll(async () => {
  ({ nc, names } = await stack.open(natsStack(iso, { declare: true })));
  await (await openModelRegistry(nc, names.modelsBucket)).put(readyModel(model));
  tokens = await nc.jetstream().views.kv(names.tokensBucket, { bindOnly: true });
  // Its log (every request, at info) is kept to show it never holds a token.
  ({ gateway } = await stack.open(gatewayStack(names, { secret: TEST_SECRET, tokens: {}, env: { MAGUS_LOG_LEVEL: 'info' }, deps: { logStream: log } })));
  // Only the test's NATS and prefix; an empty dev folder, so no running `magus dev` is picked up.
  const { dir } = stack.open(tempDir('magus-keys-cli-'));
  env = { ...process.env, MAGUS_NATS_URL: endpoint('nats').servers, MAGUS_NATS_PREFIX: iso.natsPrefix, MAGUS_DEV_DATA_DIR: dir };
  for (const name of Object.keys(env)) if (/^MAGUS_(?!NATS_URL$|NATS_PREFIX$|DEV_DATA_DIR$)|^AWS_/.test(name)) delete env[name];
  // `magus keys` connects as the controller (its role), as in production.
  Object.assign(env, natsCredentialsEnv(await natsRoleCredentials('controller', names)));
}, 60_000);
afterAll(() => stack.close());

/** `magus keys <args>` (the built CLI) with the test's environment and `extra` over it; killed after `timeoutMs`. */
function keys(args: string[], extra: NodeJS.ProcessEnv = {}, timeoutMs = 20_000): Promise<MagusRun> {
  return runMagus(['keys', ...args], { ...env, ...extra }, timeoutMs);
}

/** `GET path` at the gateway with `token`: status and JSON body. */
async function get(path: string, token: string): Promise<{ status: number; body: { data?: { id: string }[]; error?: { code?: string } } }> {
  const res = await fetch(`${gateway.url}${path}`, { headers: { authorization: `Bearer ${token}` } });
  return { status: res.status, body: (await res.json()) as { data?: { id: string }[] } };
}
const status = async (token: string) => (await get('/v1/models', token)).status;

/** A created key's token: alone on stdout, once; stderr names the key and token id, never the token. */
async function create(name: string, args: string[] = []): Promise<{ token: string; id: string }> {
  const r = await keys(['create', name, ...args]);
  expect(r).toMatchObject({ code: 0 });
  const m = /^(mgs_([0-9a-f]{16})_[A-Za-z0-9_-]{43})\n$/.exec(r.stdout);
  if (!m) throw new Error(`keys create ${name}: stdout is not one token line: ${JSON.stringify(r.stdout)}\n${r.stderr}`);
  const [, token, id] = m as unknown as [string, string, string];
  printedTokens.push(token);
  expect(r.stderr).toContain(`key local/${name} created (token id ${id};`);
  expect(r.stderr).not.toContain(token);
  return { token, id };
}

interface Listed {
  key: string;
  tokenId: string;
  models: string[];
  limits?: TokenEntry['limits'];
  suspended: boolean;
  origin: string;
  owner: string;
}

async function list(): Promise<{ keys: Listed[]; text: string }> {
  const r = await keys(['list', '--json']);
  expect(r).toMatchObject({ code: 0, stderr: '' });
  return { keys: JSON.parse(r.stdout) as Listed[], text: r.stdout };
}

let teamA: { token: string; id: string };

test('create: the token is printed once, on stdout only, and the gateway accepts it within seconds', async () => {
  teamA = await create('team-a');
  expect(await status(`${teamA.token}x`)).toBe(401);
  const t0 = Date.now();
  await until('the gateway accepts the new token', async () => (await status(teamA.token)) === 200, 10_000);
  process.stderr.write(`keys create → token accepted by the gateway in ${Date.now() - t0} ms\n`);
  const listed = await get('/v1/models', teamA.token);
  expect(listed.body.data?.map((m) => m.id)).toEqual([model]); // no --models: every model
  expect((await get(`/v1/models/${model}`, teamA.token)).status).toBe(200);
});

test('create: a name that exists is refused with a clear message, nothing printed on stdout', async () => {
  const r = await keys(['create', 'team-a']);
  expect(r.code).toBe(1);
  expect(r.stdout).toBe('');
  expect(r.stderr).toBe('magus keys: a key named team-a exists; revoke it first (magus keys revoke team-a)\n');
  expect((await list()).keys.filter((k) => k.key === 'local/team-a')).toHaveLength(1);
});

test('list --json: the key with its token id and models, no digest and no token', async () => {
  const { keys: listed, text } = await list();
  const a = listed.find((k) => k.key === 'local/team-a');
  expect(a).toEqual({
    key: 'local/team-a',
    tokenId: teamA.id,
    models: ['*'],
    suspended: false,
    origin: 'local',
    owner: expect.stringMatching(/^local\/team-a#[0-9a-f-]{36}$/) as string,
  });
  expect(text).not.toContain(teamA.token);
  expect(text).not.toContain(tokenDigest(teamA.token));
  expect(text).not.toContain('digest');
  // The table: a header and the key's row.
  const table = await keys(['list']);
  expect(table.code).toBe(0);
  expect(table.stdout).toMatch(/^KEY +TOKEN ID +MODELS +LIMITS +SUSPENDED +FROM\n/);
  expect(table.stdout).toMatch(new RegExp(`^local/team-a +${teamA.id} +\\* +unlimited +no +local$`, 'm'));
});

test('create --models: the token works, for the listed models only', async () => {
  const b = await create('team-b', ['--models', 'nope']);
  await until('the gateway accepts team-b', async () => (await status(b.token)) === 200, 10_000);
  expect((await get('/v1/models', b.token)).body.data).toEqual([]); // `model` is not `nope`
  expect(await get(`/v1/models/${model}`, b.token)).toMatchObject({ status: 404 });
  expect((await get(`/v1/models/${model}`, teamA.token)).status).toBe(200);
  expect((await list()).keys.find((k) => k.key === 'local/team-b')).toMatchObject({ tokenId: b.id, models: ['nope'], origin: 'local' });
});

/** The entry the bucket holds under token id `id`. */
async function entryOf(id: string): Promise<TokenEntry | undefined> {
  const e = await tokens.get(id);
  return e?.operation === 'PUT' ? (JSON.parse(new TextDecoder().decode(e.value)) as TokenEntry) : undefined;
}

test('create with limits: stored in the entry, named on stderr, shown by list; keys limits replaces them', async () => {
  const r = await keys(['create', 'team-limited', '--budget-tokens', '300', '--period', 'day', '--rpm', '5']);
  expect(r.code).toBe(0);
  printedTokens.push(r.stdout.trim());
  const id = TOKEN_PATTERN.exec(r.stdout.trim())![1]!;
  expect(r.stderr).toContain(`key local/team-limited created (token id ${id}; every model; limits: rpm 5, budget 300/day)`);
  const entry = await entryOf(id);
  expect(entry?.limits).toEqual({ budget: { tokens: 300, period: 'day' }, requestsPerMinute: 5 });
  expect(Object.keys(entry!.limits!)).toEqual(['requestsPerMinute', 'budget']); // one order, whatever the flags'
  await until('the gateway accepts team-limited', async () => (await status(printedTokens.at(-1)!)) === 200, 10_000);

  expect((await list()).keys.find((k) => k.key === 'local/team-limited')).toMatchObject({
    tokenId: id,
    limits: { requestsPerMinute: 5, budget: { tokens: 300, period: 'day' } },
  });
  const table = await keys(['list']);
  expect(table.stdout).toMatch(new RegExp(`^local/team-limited +${id} +\\* +rpm 5, budget 300/day +no +local$`, 'm'));

  // Replaced as a whole, in place: the same token, new limits; --none leaves it unlimited.
  const changed = await keys(['limits', 'team-limited', '--tpm', '10000', '--concurrency', '2']);
  expect(changed).toMatchObject({ code: 0, stdout: '' });
  expect(changed.stderr).toBe('key local/team-limited: limits tpm 10000, concurrency 2, at every gateway within seconds\n');
  expect((await entryOf(id))?.limits).toEqual({ tokensPerMinute: 10000, concurrency: 2 });
  const none = await keys(['limits', 'team-limited', '--none']);
  expect(none).toMatchObject({ code: 0, stderr: 'key local/team-limited: no limits, at every gateway within seconds\n' });
  expect(await entryOf(id)).not.toHaveProperty('limits');
  expect(await entryOf(id)).toMatchObject({ key: 'local/team-limited', origin: 'local' });
  const missing = await keys(['limits', 'nobody', '--rpm', '1']);
  expect(missing).toMatchObject({ code: 1, stdout: '' });
  expect(missing.stderr).toContain('magus keys: no local key named nobody');
}, 60_000);

test('bad limits: exit 1 naming the flag, with the usage, and nothing written', async () => {
  const lastSeq = async () => (await tokens.status()).streamInfo.state.last_seq;
  const before = await lastSeq();
  for (const [flags, message] of [
    [['--rpm', '0'], `--rpm must be a whole number from 1 to ${MAX_PER_MINUTE} (requests per minute), got "0"`],
    [['--rpm', 'x'], `--rpm must be a whole number from 1 to ${MAX_PER_MINUTE} (requests per minute), got "x"`],
    [['--budget-tokens', '5'], '--budget-tokens needs --period day or --period month: the budget renews each UTC day or each calendar month'],
    [['--budget-tokens', '5', '--period', 'week'], '--period must be day or month, got "week"'],
    [['--period', 'week'], '--period must be day or month, got "week"'],
  ] as const) {
    const r = await keys(['create', 'team-bad', ...flags]);
    expect(r).toMatchObject({ code: 1, stdout: '' });
    expect(r.stderr.startsWith(`magus keys: ${message}\nusage: magus keys create NAME`)).toBe(true);
  }
  expect(await lastSeq()).toBe(before);
  expect((await list()).keys.map((k) => k.key)).not.toContain('local/team-bad');
});

test('revoke: exit 0 and the gateway refuses the token within seconds; again: exit 1; the name can be created anew', async () => {
  const r = await keys(['revoke', 'team-a']);
  expect(r).toMatchObject({ code: 0, stdout: '' });
  expect(r.stderr).toContain('key local/team-a revoked');
  const t0 = Date.now();
  await until('the gateway refuses the revoked token', async () => (await status(teamA.token)) === 401, 10_000);
  process.stderr.write(`keys revoke → token refused by the gateway in ${Date.now() - t0} ms\n`);
  const keysNow = (await list()).keys;
  expect(keysNow.map((k) => k.key)).not.toContain('local/team-a');
  expect(keysNow.map((k) => k.key)).toContain('local/team-b'); // only the named key goes

  const again = await keys(['revoke', 'team-a']);
  expect(again).toMatchObject({ code: 1, stdout: '' });
  expect(again.stderr).toBe('magus keys: no local key named team-a (magus keys list shows them)\n');

  const renewed = await create('team-a');
  expect(renewed.id).not.toBe(teamA.id);
  await until('the gateway accepts the renewed key', async () => (await status(renewed.token)) === 200, 10_000);
  expect(await status(teamA.token)).toBe(401); // the old token stays refused
}, 60_000);

test('--help exits 0 with the usage; a bad command line exits 1 with it', async () => {
  const help = await keys(['--help']);
  expect(help).toMatchObject({ code: 0 });
  expect(help.stdout).toContain('usage: magus keys create NAME');
  for (const flag of ['--rpm N', '--tpm N', '--concurrency N', '--budget-tokens N --period P']) expect(help.stdout).toContain(flag);
  const bad = await keys(['create', 'Team-A']);
  expect(bad).toMatchObject({ code: 1, stdout: '' });
  expect(bad.stderr).toMatch(/^magus keys: key name "Team-A" must be .*\nusage: magus keys create NAME/);
});

test('NATS unreachable: exit 1 within seconds naming the address; no data plane there: exit 1 naming the bucket', async () => {
  const away = await keys(['create', 'team-c'], { MAGUS_NATS_URL: 'nats://127.0.0.1:1' });
  expect(away).toMatchObject({ code: 1, stdout: '' });
  expect(away.stderr).toContain('magus keys: cannot reach NATS at nats://127.0.0.1:1');
  expect(away.ms).toBeLessThan(10_000);
  // Without a scheme it is not a NATS URL at all: a configuration error naming the variable.
  const bare = await keys(['create', 'team-c'], { MAGUS_NATS_URL: '127.0.0.1:1' });
  expect(bare).toMatchObject({ code: 1, stdout: '' });
  expect(bare.stderr).toContain('MAGUS_NATS_URL=127.0.0.1:1');
  expect(bare.ms).toBeLessThan(10_000);

  const missing = `${iso.natsPrefix}_NONE`;
  const bucket = dataPlaneNames(missing).tokensBucket;
  // The controller's user of that data plane: what is missing is the bucket, not a permission.
  const there = { MAGUS_NATS_PREFIX: missing, ...natsCredentialsEnv(await natsRoleCredentials('controller', dataPlaneNames(missing))) };
  const none = await keys(['create', 'team-c'], there);
  expect(none).toMatchObject({ code: 1, stdout: '' });
  expect(none.stderr).toBe(`magus keys: NATS at ${endpoint('nats').servers} has no ${bucket} bucket: start magus dev (or a gateway) first\n`);
  const noneList = await keys(['list'], there);
  expect(noneList).toMatchObject({ code: 1, stdout: '' });
  // Nothing was created there by asking.
  expect(await (await nc.jetstreamManager()).streams.info(`KV_${bucket}`).catch(() => undefined)).toBeUndefined();
});

test('the gateway logged the requests, and no token', () => {
  expect(log.lines.filter((l) => l.includes('/v1/models')).length).toBeGreaterThan(5);
  expect(printedTokens).toHaveLength(4);
  const text = log.lines.join('\n');
  for (const token of printedTokens) expect(text).not.toContain(TOKEN_PATTERN.exec(token)![2]); // the secret
});

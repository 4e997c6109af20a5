/**
 * NATS users per role (dataplane/roles.ts) against a real nats-server configured with them, as
 * `magus nats-auth` writes them (its credentials files, the server's operator-mode configuration,
 * and an instance's bridge user signed with its signer): a gateway, a `magus bridge` process and
 * a controller each connect as their own user (a JWT), and
 * a request goes gateway → bridge → engine and back, its record read by `magus usage` with the
 * controller's credentials; what a role must not do is a permissions error — a bridge
 * reading tokens or stored responses or writing the registry, a gateway consuming the request
 * stream, a controller reading another role's inbox or the answers, another instance's bridge (a
 * tenant's pod holding its own instance's credentials) reading this instance's prompts, reading
 * or forging its answers and claims, or reading the ledger — and a connection without
 * credentials is refused.
 */
import { METER_KEY_ENTRY } from '../dataplane/meter';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { connect, type NatsConnection } from 'nats';
import { dataPlaneNames, ensureDataPlane, readStoredFrames } from '../dataplane';
import { openRequestClaims } from '../dataplane/claims';
import { registerKey, tokenDigest } from '../dataplane/keys';
import { openModelRegistry } from '../dataplane/registry';
import { bridgeInboxPrefixOf, inboxPrefixOf, natsAuthOptions, parseCredentialsFile, type NatsCredentials } from '../dataplane/roles';
import { pinConversation, publishPoolView } from './harness/gateway';
import { readyModel } from './harness/gateway-app';
import { chartMergedConfig, startNatsCluster, type TestNatsCluster } from './harness/nats-cluster';
import { MAGUS_BIN, runMagus } from './harness/dev';
import { gatewayStack, stubEngineStack, TestStack } from './harness/stack';

const names = dataPlaneNames('ROLES');
const MODEL = 'guarded';
const stack = new TestStack();
let cluster: TestNatsCluster;
/** The users: each role's, and the bridges of instances i1 (serves the test's requests) and i2 (another tenant's). */
const USERS = ['gateway', 'controller', 'worker', 'bridge-i1', 'bridge-i2'] as const;
type User = (typeof USERS)[number];
const creds = new Map<User, NatsCredentials>();
const conns = new Map<User, NatsConnection>();

const as = (user: User) => conns.get(user)!;
const connectAs = (user: User) => connect({ servers: cluster.servers, ...natsAuthOptions(creds.get(user)), name: `test-${user}`, timeout: 5000 });

const dir = mkdtempSync(join(tmpdir(), 'magus-nats-auth-'));
const credsFile = (user: User) => join(dir, `${user}.creds`);

beforeAll(async () => {
  const made = await runMagus(['nats-auth', '--out', dir, '--prefix', names.prefix], process.env);
  expect(made.stderr).toBe('');
  expect(made.code).toBe(0);
  expect(statSync(join(dir, 'bridge-signer.nk')).mode & 0o777).toBe(0o600);
  for (const instance of ['i1', 'i2']) {
    const minted = await runMagus(
      ['nats-auth', '--bridge', `${MODEL}/${instance}`, '--signer', join(dir, 'bridge-signer.nk'), '--prefix', names.prefix],
      process.env,
    );
    expect(minted.stderr).toBe('');
    writeFileSync(credsFile(`bridge-${instance}` as User), minted.stdout, { mode: 0o600 });
  }
  for (const user of USERS) {
    if (!user.startsWith('bridge')) expect(statSync(credsFile(user)).mode & 0o777).toBe(0o600);
    const c = parseCredentialsFile(readFileSync(credsFile(user), 'utf8'));
    if ('error' in c) throw new Error(`${user}: ${c.error}`);
    creds.set(user, c);
  }
  expect(creds.get('bridge-i1')!.inboxPrefix).toBe(bridgeInboxPrefixOf(MODEL, 'i1'));
  // A signer that is not one: refused with why.
  const bad = await runMagus(['nats-auth', '--bridge', `${MODEL}/i1`, '--signer', credsFile('worker')], process.env);
  expect(bad.code).toBe(1);
  expect(bad.stderr).toContain('not a magus NATS signer file');
  // Written again: refused, nothing overwritten.
  const again = await runMagus(['nats-auth', '--out', dir], process.env);
  expect(again.code).toBe(1);
  expect(again.stderr).toContain('nothing written');
  // The server configured as the official nats chart would be with nats-values.yaml: its config.merge
  // rendered into the configuration as JSON (`magus dev` and dev.int.test.ts use nats-auth.conf).
  cluster = await startNatsCluster({ size: 1, extraConfig: chartMergedConfig(join(dir, 'nats-values.yaml')) });
  stack.defer(() => cluster.stop());
  for (const user of USERS) {
    const nc = await connectAs(user);
    conns.set(user, nc);
    stack.defer(() => nc.close());
  }
  await ensureDataPlane(as('worker'), { prefix: names.prefix });
  await (await openModelRegistry(as('worker'), names.modelsBucket)).put(readyModel(MODEL));
}, 120_000);
afterAll(async () => {
  await stack.close();
  rmSync(dir, { recursive: true, force: true });
}, 60_000);

/** `magus bridge` as a process of its own, with the bridge's credentials file. */
async function bridgeProcess(engineUrl: string): Promise<void> {
  const child = spawn(
    'setpriv',
    [
      '--pdeathsig',
      'KILL',
      '--',
      process.execPath,
      MAGUS_BIN,
      'bridge',
      '--pool',
      MODEL,
      '--instance',
      'i1',
      '--engine',
      engineUrl,
      '--nats',
      cluster.servers.join(','),
      '--slots',
      '2',
      '--prefix',
      names.prefix,
    ],
    { env: { ...process.env, MAGUS_NATS_CREDENTIALS: credsFile('bridge-i1') }, stdio: ['ignore', 'ignore', 'pipe'] },
  );
  let stderr = '';
  child.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
  stack.defer(async () => {
    if (process.env.DEBUG_BRIDGE) console.log(stderr);
    child.kill('SIGTERM');
    await new Promise((r) => child.once('close', r));
  });
  // Ready once its consumer exists.
  const jsm = await as('worker').jetstreamManager();
  for (let i = 0; ; i++) {
    if (
      await jsm.consumers.info(names.requestStream, `${MODEL}_i1`).then(
        () => true,
        () => false,
      )
    )
      return;
    if (i > 200 || child.exitCode !== null) throw new Error(`magus bridge did not start: ${stderr}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

test('a request goes gateway → bridge → engine and back, each process as its own user', async () => {
  // The controller registers a key; the worker starts an instance (its consumer) and publishes the pool.
  const id = randomBytes(6).toString('hex');
  const token = `mgs_${id}_${randomBytes(16).toString('hex')}`;
  const tokens = await as('controller').jetstream().views.kv(names.tokensBucket, { bindOnly: true });
  // With limits: the gateway's writes to magus_limits too.
  const limits = { requestsPerMinute: 100, storageBytes: 1_000_000 };
  expect(await registerKey(tokens, id, { digest: tokenDigest(token), name: 'team-a', key: 'team/a', uid: 'u1', limits })).toMatchObject({ ok: true });
  const { engine } = await stack.open(stubEngineStack({ modelId: MODEL }));
  await bridgeProcess(engine.url);
  await publishPoolView(as('worker'), names, MODEL, ['i1']);
  const { gateway } = await stack.open(
    gatewayStack(names, {
      nc: as('gateway'),
      secret: randomBytes(32).toString('hex'),
      tokens: {},
      env: { MAGUS_LOG_LEVEL: 'silent' },
      // A conversation is placed as the pool workflow places it (the worker writes its session).
      deps: { coldStart: (req) => pinConversation(as('worker'), names, req.conversationKey, MODEL, 'i1') },
    }),
  );
  let r: Response | undefined;
  for (let i = 0; i < 100; i++) {
    r = await fetch(`${gateway.url}/v1/completions`, {
      method: 'POST',
      headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
      body: JSON.stringify({ model: MODEL, prompt: 'hello roles', max_tokens: 4 }),
    });
    if (r.status !== 401) break;
    await r.body?.cancel();
    await new Promise((res) => setTimeout(res, 50)); // the gateway's watch of the tokens
  }
  expect(r!.status).toBe(200);
  const body = (await r!.json()) as { choices: { text: string }[] };
  expect(body.choices[0]!.text).toContain('hello roles');
  expect(r!.headers.get('x-ratelimit-remaining-requests')).toBe('99');
  // A stored response (magus_responses, the storage quota) of a conversation (magus_sessions), read back.
  const post = await fetch(`${gateway.url}/v1/responses`, {
    method: 'POST',
    headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
    body: JSON.stringify({ model: MODEL, input: 'hello again', max_output_tokens: 4 }),
  });
  expect(post.status).toBe(200);
  const stored = (await post.json()) as { id: string };
  const got = await fetch(`${gateway.url}/v1/responses/${stored.id}`, { headers: { authorization: `Bearer ${token}` } });
  expect(got.status).toBe(200);
  expect(((await got.json()) as { id: string }).id).toBe(stored.id);

  // The bridge's records, read with the controller's credentials; without any, the server refuses.
  const env = { ...process.env, MAGUS_NATS_URL: cluster.servers.join(','), MAGUS_NATS_PREFIX: names.prefix, MAGUS_DEV_DATA_DIR: dir };
  let rows: { key: string; requests: number }[] = [];
  for (let i = 0; i < 50 && rows.length === 0; i++) {
    const usage = await runMagus(['usage', '--json'], { ...env, MAGUS_NATS_CREDENTIALS: credsFile('controller') });
    expect(usage.code).toBe(0);
    rows = JSON.parse(usage.stdout || '[]') as { key: string; requests: number }[];
    if (rows.length === 0) await new Promise((res) => setTimeout(res, 100));
  }
  expect(rows).toEqual([expect.objectContaining({ key: 'team/a', requests: 2 })]);
  const anonymous = await runMagus(['usage'], env);
  expect(anonymous.code).not.toBe(0);
  expect(anonymous.stderr).toMatch(/Authorization Violation/i);
}, 60_000);

const denied = /permissions violation|PERMISSIONS_VIOLATION/i;

test('a bridge cannot read tokens, stored responses or the meter key, nor write the registry', async () => {
  const js = as('bridge-i1').jetstream();
  await expect(js.views.kv(names.tokensBucket, { bindOnly: true }).then((kv) => kv.get('x'))).rejects.toThrow(denied);
  // The key gateways sign usage meters with (dataplane/meter.ts): a bridge could forge records with it.
  await expect(js.views.kv(names.limitsBucket, { bindOnly: true }).then((kv) => kv.get(METER_KEY_ENTRY))).rejects.toThrow(denied);
  await expect(js.views.kv(names.responsesBucket, { bindOnly: true }).then((kv) => kv.get('x'))).rejects.toThrow(denied);
  await expect(js.publish(`$KV.${names.modelsBucket}.default.evil`, '{}', { timeout: 2000 })).rejects.toThrow(denied);
});

test('a gateway cannot consume the request stream, write tokens or the registry', async () => {
  const js = as('gateway').jetstream();
  const jsm = await as('gateway').jetstreamManager({ checkAPI: false });
  await expect(jsm.consumers.add(names.requestStream, { name: 'evil', filter_subject: `${names.subjectScope}.magus.req.>` })).rejects.toThrow(denied);
  await expect(jsm.consumers.info(names.requestStream, `${MODEL}_i1`)).rejects.toThrow(denied);
  await expect(js.publish(`$KV.${names.tokensBucket}.stolen`, '{}', { timeout: 2000 })).rejects.toThrow(denied);
  await expect(js.publish(`$KV.${names.modelsBucket}.default.evil`, '{}', { timeout: 2000 })).rejects.toThrow(denied);
});

test('a controller cannot read the answers nor another role’s inbox; no credentials, no connection', async () => {
  const nc = as('controller');
  const refused = (subject: string) =>
    new Promise<Error>((resolve) => {
      nc.subscribe(subject, { callback: (err) => err && resolve(err) });
    });
  const answers = refused(`${names.subjectScope}.magus.res.>`);
  const inbox = refused(`${inboxPrefixOf('gateway')}.>`);
  await nc.flush();
  expect((await answers).message).toMatch(/Permissions Violation for Subscription to "?roles\.magus\.res\.>/i);
  expect((await inbox).message).toMatch(/Permissions Violation for Subscription to "?_INBOX_gateway\.>/i);
  await expect(connect({ servers: cluster.servers, timeout: 3000, reconnect: false })).rejects.toThrow(/Authorization Violation/i);
});

test("another instance's bridge (a tenant's pod with its own credentials) cannot read this instance's prompts", async () => {
  const nc = as('bridge-i2');
  const jsm = await nc.jetstreamManager({ checkAPI: false });
  const prompts = `${names.subjectScope}.magus.req.${MODEL}.i1`;
  // Neither a consumer of its own on them, nor pulling from i1's, nor reading them directly.
  await expect(jsm.consumers.add(names.requestStream, { name: 'evil', filter_subject: `${names.subjectScope}.magus.req.>` })).rejects.toThrow(denied);
  await expect(jsm.consumers.add(names.requestStream, { name: `${MODEL}_i2`, filter_subject: prompts })).rejects.toThrow(denied);
  await expect(jsm.consumers.info(names.requestStream, `${MODEL}_i1`)).rejects.toThrow(denied);
  await expect(jsm.streams.getMessage(names.requestStream, { last_by_subj: prompts })).rejects.toThrow(denied);
  await expect(nc.request(`$JS.API.CONSUMER.MSG.NEXT.${names.requestStream}.${MODEL}_i1`, JSON.stringify({ batch: 1 }), { timeout: 2000 })).rejects.toThrow(
    denied,
  );
  // Nor i1's inbox (where i1's pulled requests arrive), its cancels, or the prompts' subjects.
  const refused = (subject: string) =>
    new Promise<Error>((resolve) => {
      nc.subscribe(subject, { callback: (err) => err && resolve(err) });
    });
  const inbox = refused(`${bridgeInboxPrefixOf(MODEL, 'i1')}.>`);
  const live = refused(prompts);
  const cancels = refused(`${names.subjectScope}.magus.cancel.${MODEL}.i1`);
  await nc.flush();
  for (const err of await Promise.all([inbox, live, cancels])) expect(err.message).toMatch(/Permissions Violation for Subscription/i);
  // Its own consumer (were its instance running) is what it may pull from: the same calls on i2's name pass the permission check.
  await expect(jsm.consumers.info(names.requestStream, `${MODEL}_i2`)).rejects.toThrow(/consumer not found/i);
});

test("another instance's bridge cannot read or forge this instance's answers or claims, nor read the ledger; its own it reads back", async () => {
  const nc = as('bridge-i2');
  const js = nc.jetstream();
  const jsm = await nc.jetstreamManager({ checkAPI: false });
  const scope = names.subjectScope;
  const id = `req-${randomBytes(6).toString('hex')}`;
  const i1Frames = `${scope}.magus.res.gw-any.${MODEL}.i1.${id}`;
  // Reading i1's answers: a stream get (any subject), a direct get of its subject, a consumer on it or on every answer.
  await expect(jsm.streams.getMessage(names.responseStream, { last_by_subj: `${scope}.magus.res.>` })).rejects.toThrow(denied);
  await expect(nc.request(`$JS.API.DIRECT.GET.${names.responseStream}.${i1Frames}`, '', { timeout: 2000 })).rejects.toThrow(denied);
  await expect(jsm.consumers.add(names.responseStream, { name: 'evil', filter_subject: `${scope}.magus.res.*.${MODEL}.i1.*` })).rejects.toThrow(denied);
  await expect(jsm.consumers.add(names.responseStream, { name: 'evil', filter_subject: `${scope}.magus.res.>` })).rejects.toThrow(denied);
  // Forging them: a frame on i1's subject, or on a gateway's reply subject itself.
  await expect(js.publish(i1Frames, '{"seq":0,"type":"done"}', { timeout: 2000 })).rejects.toThrow(denied);
  await expect(js.publish(`${scope}.magus.res.gw-any.${id}`, '{"seq":0,"type":"done"}', { timeout: 2000 })).rejects.toThrow(denied);
  // i1's claims: read or written.
  const claims = await js.views.kv(names.claimsBucket, { bindOnly: true, allow_direct: true });
  await expect(claims.get(`${MODEL}.i1.${id}`)).rejects.toThrow(denied);
  await expect(js.publish(`$KV.${names.claimsBucket}.${MODEL}.i1.${id}`, '{}', { timeout: 2000 })).rejects.toThrow(denied);
  // The ledger: written by bridges, read by nobody but the controller and gateways.
  const usage = await js.views.kv(names.usageBucket, { bindOnly: true, allow_direct: true });
  await expect(usage.get('any.day.id')).rejects.toThrow(denied);
  await expect(jsm.consumers.add(`KV_${names.usageBucket}`, { name: 'evil', filter_subject: `$KV.${names.usageBucket}.>` })).rejects.toThrow(denied);
  // Its own instance's frames and claims it may publish and read back (what a take-over does).
  const own = `${scope}.magus.res.gw-any.${MODEL}.i2.${id}`;
  await js.publish(own, JSON.stringify({ seq: 0, type: 'done' }));
  expect(await readStoredFrames(js, jsm, names.responseStream, own)).toMatchObject({ frames: [{ seq: 0, type: 'done' }], complete: true });
  const mine = await openRequestClaims(js, names, { pool: MODEL, instance: 'i2' });
  expect((await mine.acquire(id, 'i2')).kind).toBe('fresh');
  expect((await mine.acquire(id, 'i2-again')).kind).toBe('takeover');
});

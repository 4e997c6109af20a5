/**
 * The entry-lease protocol's migration, live: `magus worker` and `magus gateway` of the last
 * commit before it (its pool leased every conversation and carried the leases; its sessions took
 * touch signals) serve conversations against real Temporal, nats-server and MinIO; then they stop
 * and today's worker and gateway take over the same workflows. Today's code replays the old pool's
 * run, switches it to the new protocol (its next run on the pools' task queue) and keeps granting
 * the old sessions, whose instances went with the old worker; every old conversation's next turns
 * are answered, each on its one session workflow (none dropped, none doubled), and a new
 * conversation takes the new protocol.
 */
import type { S3Client } from '@aws-sdk/client-s3';
import type { Client } from '@temporalio/client';
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import { dataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import { conversationKey } from '../gateway/plugins/conversation';
import { poolQueueFor } from '../shared/constants';
import { decodeSessionEntry } from '../shared/serving';
import { poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import { sessionWorkflowId } from '../workflows/session/definitions';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { oldMagusBin } from './harness/old-magus';
import { isolation, recordHistory, workerConfig } from './harness';
import { gatewayStack, natsStack, s3Stack, tempDir, temporalStack, TestStack, workersStack } from './harness/stack';
import { sleep, until } from './harness/wait';
import { tokenDigest } from '../gateway/plugins/auth';

/** The last commit of the old protocol (pool-granted leases, touch signals). */
const OLD_COMMIT = 'ccc5f71';
const CONVERSATIONS = 6;
const iso = isolation();
const MODEL = `utiny-${iso.id}`;
const names = dataPlaneNames(iso.natsPrefix);
const TOKEN = `mgs_up_${randomBytes(16).toString('hex')}`;
const SECRET = randomBytes(32).toString('hex');
const POOL = { minInstances: 0, maxInstances: 1, leasesPerInstance: 8, idleTimeoutMs: 10 * 60_000 };
const TTL_MS = 10 * 60_000;

let dir: string;
let s3: S3Client;
let nc: NatsConnection;
let client: Client;
const children: ChildProcess[] = [];
const stack = new TestStack();

beforeAll(async () => {
  ({ dir } = stack.open(tempDir('magus-upgrade-')));
  ({ s3 } = await stack.open(s3Stack(iso)));
  ({ nc } = await stack.open(natsStack(iso)));
  ({ client } = await stack.open(temporalStack()));
  stack.defer(() => client.workflow.getHandle(poolWorkflowId('default', MODEL)).terminate().catch(() => undefined));
  stack.defer(() => {
    for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
  });
}, 60_000);

afterAll(() => stack.close(), 60_000);

/** `magus <mode>` of the old build, its output kept; resolves once `ready` matches its stderr. */
async function startOld(mode: 'worker' | 'gateway', env: Record<string, string>, ready: RegExp): Promise<{ child: ChildProcess; output: () => string; exited: Promise<number | null> }> {
  const child = spawn(process.execPath, [oldMagusBin(OLD_COMMIT), mode], { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  children.push(child);
  let out = '';
  child.stdout.on('data', (d: Buffer) => (out += d.toString()));
  child.stderr.on('data', (d: Buffer) => (out += d.toString()));
  const exited = new Promise<number | null>((r) => child.once('exit', (code) => r(code)));
  const deadline = Date.now() + 120_000;
  while (!ready.test(out)) {
    if (child.exitCode !== null || Date.now() > deadline) throw new Error(`old magus ${mode} did not start:\n${out}`);
    await sleep(200);
  }
  return { child, output: () => out, exited };
}

type Message = { role: 'user' | 'assistant'; content: string };

/** One turn of a conversation (its id in `x-session-id`); the reply is appended to `messages`. */
async function turn(url: string, id: string, messages: Message[], content: string): Promise<{ status: number; body: string }> {
  messages.push({ role: 'user', content });
  const res = await fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', 'x-session-id': id },
    body: JSON.stringify({ model: MODEL, messages, max_tokens: 4 }),
    signal: AbortSignal.timeout(120_000),
  });
  const body = await res.text();
  if (res.status === 200) messages.push({ role: 'assistant', content: (JSON.parse(body) as { choices: { message: { content: string } }[] }).choices[0]!.message.content });
  return { status: res.status, body: res.status === 200 ? '' : body };
}

test('old-protocol conversations live through the switch to today’s worker and gateway: each answered again, on its one session, none doubled', async () => {
  const cfg = workerConfig(iso, dir);
  await publishTinyGguf({ dir, s3, bucket: iso.bucket, registry: await openModelRegistry(nc, names.modelsBucket), name: MODEL });
  const common = {
    MAGUS_TEMPORAL_ADDRESS: cfg.temporal.address,
    MAGUS_TEMPORAL_NAMESPACE: cfg.temporal.namespace,
    MAGUS_TASK_QUEUE: cfg.taskQueue,
    MAGUS_NATS_URL: cfg.nats.servers,
    MAGUS_NATS_PREFIX: iso.natsPrefix,
    MAGUS_S3_ENDPOINT: cfg.s3.endpoint!,
    MAGUS_S3_BUCKET: iso.bucket,
    MAGUS_S3_REGION: cfg.s3.region,
    MAGUS_MODEL_CACHE: join(dir, 'old-models'),
    MAGUS_DEV_DATA_DIR: join(dir, 'no-dev'),
    MAGUS_SESSION_TTL_MS: String(TTL_MS),
  };
  const oldWorker = await startOld('worker', common, /magus worker: polling /);
  const oldGateway = await startOld(
    'gateway',
    { ...common, MAGUS_GATEWAY_HOST: '127.0.0.1', MAGUS_GATEWAY_PORT: '0', MAGUS_GATEWAY_SECRET: SECRET, MAGUS_GATEWAY_TOKENS: JSON.stringify({ up: { digest: tokenDigest(TOKEN), name: 'upgrade' } }) },
    /listening on http:\S+/,
  );
  const oldUrl = /listening on (http:\S+)/.exec(oldGateway.output())![1]!;
  const tag = randomBytes(3).toString('hex');
  const conversations = Array.from({ length: CONVERSATIONS }, (_, k) => ({ id: `up-${tag}-${k}`, messages: [] as Message[] }));
  for (const c of conversations) expect(await turn(oldUrl, c.id, c.messages, `hello number ${c.id}`)).toEqual({ status: 200, body: '' });
  const keyOf = (id: string) => conversationKey(SECRET, { scope: 'up', model: `default/${MODEL}`, messages: [], sessionId: id });
  const kv = await nc.jetstream().views.kv(names.sessionsBucket);
  const entryOf = async (id: string) => {
    const e = await kv.get(keyOf(id));
    return e?.operation === 'PUT' ? decodeSessionEntry(e.value) : undefined;
  };
  // The old protocol's entries: without `placedAt`, leased by the old pool.
  for (const c of conversations) expect(await entryOf(c.id)).toEqual(expect.not.objectContaining({ placedAt: expect.anything() as unknown }));
  const oldInstances = new Set(await Promise.all(conversations.map(async (c) => (await entryOf(c.id))!.instance)));
  const oldPoolRun = (await client.workflow.getHandle(poolWorkflowId('default', MODEL)).describe()).runId;

  // The upgrade: the old processes stop (the worker's engines with it), today's take over.
  oldGateway.child.kill('SIGTERM');
  oldWorker.child.kill('SIGTERM');
  expect(await oldGateway.exited).toBe(0);
  expect(await oldWorker.exited).toBe(0);
  await stack.open(workersStack(iso, dir));
  const sessions = { client, taskQueue: cfg.taskQueue, pool: POOL, sessionTtlMs: TTL_MS };
  const { gateway } = await stack.open(gatewayStack(names, { nc, secret: SECRET, tokens: { up: TOKEN }, env: { MAGUS_GATEWAY_COLD_START_TIMEOUT_MS: '120000', MAGUS_LOG_LEVEL: 'warn' }, sessions }));
  // The old worker's instance went with it: once the pool has noticed, it grants the old sessions
  // another and they rewrite their entries. (A turn sent to the lost instance before that waits for
  // its deadline, under either protocol: the gateway does not take back what it queued.)
  await until('every old conversation’s entry on an instance of today’s worker', async () => {
    const serving = new Set((await client.workflow.getHandle(poolWorkflowId('default', MODEL)).query(poolStatusQuery)).instances.filter((i) => i.phase === 'ready' && !oldInstances.has(i.id)).map((i) => i.id));
    const on = await Promise.all(conversations.map(async (c) => (await entryOf(c.id))?.instance));
    return serving.size > 0 && on.every((i) => i !== undefined && serving.has(i));
  }, 180_000);
  for (let t = 2; t <= 3; t++) {
    const answers = await Promise.all(conversations.map((c) => turn(gateway.url, c.id, c.messages, `turn ${t} of ${c.id}`)));
    expect(answers).toEqual(conversations.map(() => ({ status: 200, body: '' })));
  }
  // A new conversation takes the new protocol: its entry carries `placedAt`.
  const fresh = { id: `up-${tag}-new`, messages: [] as Message[] };
  expect(await turn(gateway.url, fresh.id, fresh.messages, 'a conversation of today')).toEqual({ status: 200, body: '' });
  expect(await entryOf(fresh.id)).toEqual(expect.objectContaining({ placedAt: expect.any(Number) as unknown }));

  // Each old conversation: its entry still there, on the instance that serves it now, and one
  // session execution, still running (its lease re-acquired from the switched pool).
  for (const c of conversations) {
    expect(await entryOf(c.id)).toEqual(expect.objectContaining({ pool: MODEL }));
    const runs: string[] = [];
    for await (const w of client.workflow.list({ query: `WorkflowId = "${sessionWorkflowId('default', MODEL, keyOf(c.id))}"` })) runs.push(w.status.name);
    expect(runs).toEqual(['RUNNING']);
  }
  // The old pool's run was replayed and switched: its current run is on the pools' task queue.
  const pool = await client.workflow.getHandle(poolWorkflowId('default', MODEL)).describe();
  expect(pool.runId).not.toBe(oldPoolRun);
  expect(pool.taskQueue).toBe(poolQueueFor(cfg.taskQueue));
  // The run that regranted the old sessions, for test/replay.test.ts.
  await recordHistory('pool-entry-legacy-regrant', client.workflow.getHandle(poolWorkflowId('default', MODEL), pool.runId));
}, 600_000);

/**
 * A pool that scales on load (workflows/pool/state.ts, "Scaling"; issue 39, the leases policy):
 * a burst of new conversations on a warm pool of one instance is placed there with no lease
 * limit, queues, and the pool grows on what is in flight and queued; conversations that come
 * while it is grown go to the emptier new instances; once the burst is over the pool shrinks
 * back to one instance `idleTimeout` after it — though every conversation is still alive —, and
 * a conversation whose instance was drained is answered at its next turn where the pool still
 * serves. Real Temporal, nats-server and s3proxy; a real worker with the local runtime and a
 * llama.cpp engine over the tiny GGUF (one slot per instance); the real gateway.
 */
import type { Client } from '@temporalio/client';
import { randomBytes } from 'node:crypto';
import type { NatsConnection } from 'nats';
import { dataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import type { RunningGateway } from '../gateway/server';
import { conversationKey } from '../gateway/serving/conversation';
import { decodePoolEntry, decodeSessionEntry } from '../shared/serving';
import { poolStatusQuery, poolWorkflowId, type PoolInput } from '../workflows/pool/definitions';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { isolation, recordHistory } from './harness';
import { gatewayStack, magusStack, poolTerminated, TestStack } from './harness/stack';
import { eventually } from './harness/wait';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
const MODEL = `burst-tiny-${iso.id}`;
const IDLE_MS = 8_000;
/** New conversations in the burst: enough that it still runs once the pool has grown (48 took 6 s, growing ~5 s). */
const BURST = 96;
const DRAIN_GRACE_MS = 500;
const TOKEN_ID = 'burst';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(16).toString('hex')}`;
const SECRET = randomBytes(32).toString('hex');
const POOL: Omit<PoolInput, 'namespace' | 'model'> = {
  minInstances: 1,
  maxInstances: 3,
  leasesPerInstance: 1,
  idleTimeoutMs: IDLE_MS,
  drainGraceMs: DRAIN_GRACE_MS,
  healthCheckMs: 1000,
  scaleOn: 'load',
};

let nc: NatsConnection;
let client: Client;
let gateway: RunningGateway;
const stack = new TestStack();

beforeAll(async () => {
  const magus = await stack.open(magusStack(iso, { dirPrefix: 'magus-scale-on-load-' }));
  ({ nc, client } = magus);
  const registry = await openModelRegistry(nc, names.modelsBucket);
  await publishTinyGguf({ dir: magus.dir, s3: magus.s3, bucket: iso.bucket, registry, name: MODEL });
  ({ gateway } = await stack.open(
    gatewayStack(names, {
      secret: SECRET,
      tokens: { [TOKEN_ID]: TOKEN },
      // The queue's own length is what grows the pool here: no bound on a turn's wait in it.
      env: { MAGUS_GATEWAY_COLD_START_TIMEOUT_MS: '120000', MAGUS_MAX_QUEUE_WAIT: '0', MAGUS_LOG_LEVEL: 'silent' },
      sessions: { client, taskQueue: magus.cfg.taskQueue, pool: POOL, sessionTtlMs: 30 * 60_000 },
    }),
  ));
  stack.defer(poolTerminated(client, MODEL));
}, 180_000);

afterAll(() => stack.close(), 60_000);

/** A turn of conversation `id` (its own session id); its status and how many tokens it was answered with. */
async function turn(id: string, maxTokens: number): Promise<{ status: number; tokens?: number }> {
  const res = await fetch(`${gateway.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', 'x-session-id': id },
    body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: `tell me about ${id}` }], max_tokens: maxTokens, temperature: 0 }),
    signal: AbortSignal.timeout(120_000),
  });
  const body = (await res.json()) as { usage?: { completion_tokens?: number } };
  return { status: res.status, tokens: body.usage?.completion_tokens };
}

/** The instance conversation `id`'s entry is on. */
async function instanceOf(id: string): Promise<string | undefined> {
  const key = conversationKey(SECRET, { scope: TOKEN_ID, model: `default/${MODEL}`, messages: [], sessionId: id });
  const e = await (await nc.jetstream().views.kv(names.sessionsBucket)).get(key);
  return e?.operation === 'PUT' ? decodeSessionEntry(e.value)?.instance : undefined;
}

/** The instances the pool's view (what gateways place from) lists. */
async function publishedIds(): Promise<string[]> {
  const e = await (await nc.jetstream().views.kv(names.poolsBucket)).get(`default.${MODEL}`);
  return e?.operation === 'PUT' ? (decodePoolEntry(e.value)?.instances.map((i) => i.instance) ?? []) : [];
}

test('a burst grows a pool that scales on load, and it shrinks back idleTimeout after, its conversations alive; one on a drained instance is answered where the pool serves', async () => {
  const pool = client.workflow.getHandle(poolWorkflowId('default', MODEL));
  const readyIds = async () => (await pool.query(poolStatusQuery)).instances.filter((i) => i.phase === 'ready').map((i) => i.id);
  expect(await turn('warm', 4)).toMatchObject({ status: 200 });
  const first = (await instanceOf('warm'))!;
  expect(await readyIds()).toEqual([first]);

  // The burst: new conversations at once, long answers (~220 tokens, all a slot's context holds),
  // on one slot. All are placed on the one instance (no lease limit) and queue there; the pool
  // hears what is queued and grows. The later turns below must come while it still runs: with 48
  // the tiny model was done 6 s in, the pool grown at 5.2 s; once done, nothing the pool decides
  // on changes, and its count of live conversations is not reported again (CI failed so).
  const t0 = Date.now();
  const burst = Array.from({ length: BURST }, (_, k) => turn(`burst-${k}`, 200));
  let grownTo = 1;
  await eventually(async () => {
    grownTo = Math.max(grownTo, (await readyIds()).length);
    expect(grownTo).toBeGreaterThanOrEqual(2);
  }, 90_000);
  // The pool marks an instance ready before its activity writes the view gateways place from
  // (CI once sent all three later turns to the first instance in between): wait for the view.
  await eventually(async () => expect((await publishedIds()).length).toBeGreaterThanOrEqual(2), 30_000);
  // Conversations that come now go to the emptier instances.
  const later = ['later-0', 'later-1', 'later-2'];
  for (const id of later) expect(await turn(id, 8)).toMatchObject({ status: 200 });
  const elsewhere: string[] = [];
  for (const id of later) if ((await instanceOf(id)) !== first) elsewhere.push(id);
  expect(elsewhere.length).toBeGreaterThan(0);
  const answers = await Promise.all(burst);
  const burstMs = Date.now() - t0;
  for (const a of answers) expect(a.status).toBe(200);
  grownTo = Math.max(grownTo, (await readyIds()).length);

  // Over: the pool shrinks back to one instance idleTimeout after, though every conversation lives.
  const over = Date.now();
  await eventually(async () => expect(await readyIds()).toHaveLength(1), IDLE_MS + 60_000);
  const shrunkMs = Date.now() - over;
  // Counted by the NATS server for the pool as a whole: every conversation of the test lives. As
  // the pool last heard it: a count comes with a change of decision (CI once read 98 of 100, counted
  // as the burst ended, before its last entries were written); the shrink's report follows.
  let leases: number | undefined;
  await eventually(async () => {
    leases = (await pool.query(poolStatusQuery)).live;
    expect(leases).toBe(1 + BURST + later.length);
  }, 30_000);
  process.stderr.write(
    `serving-scale-on-load: the burst took ${burstMs} ms and grew the pool to ${grownTo}; ${shrunkMs} ms after it, one instance again (idleTimeout ${IDLE_MS} ms), ${leases} live conversations counted\n`,
  );
  expect(shrunkMs).toBeLessThan(IDLE_MS + 20_000);
  for (const id of [...later, 'warm']) expect(await instanceOf(id)).toBeDefined(); // alive: their entries are kept

  // A conversation whose instance was drained: its next turn is answered, on the instance left.
  // Among the later ones and 'warm' there is one: if the pool kept the first instance, a later one
  // placed elsewhere; if it kept another, 'warm' (the later ones may all be on the one it kept).
  const left = (await readyIds())[0]!;
  let moved: string | undefined;
  for (const id of [...later, 'warm']) if ((await instanceOf(id)) !== left) moved ??= id;
  expect(moved).toBeDefined();
  if (!moved) return;
  expect(await turn(moved, 8)).toMatchObject({ status: 200 });
  expect(await instanceOf(moved)).toBe(left);
  await recordHistory('pool-counted-by-server', pool);
}, 300_000);

/**
 * A first turn whose caller leaves while the pool starts an instance for it (the serving
 * control-loop issue, finding 2): its wait ends with the request's signal, it leaves no entry and
 * no session, the demand it told the pool falls, and the pool scales to what live conversations
 * need — not to phantom demand. Sessions of the old protocol (started by older gateways) still
 * withdraw their requests and have a deadline. Real Temporal, nats-server and MinIO; real workers with the local runtime and a
 * llama.cpp engine over the tiny GGUF.
 */
import { WorkflowUpdateFailedError, type Client } from '@temporalio/client';
import { ApplicationFailure } from '@temporalio/common';
import type { NatsConnection } from 'nats';
import { dataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import { createSessionCache, type AcquireRequest } from '../gateway/plugins/sessions';
import { temporalSessions } from '../gateway/temporal';
import type { ReadyModel } from '../shared/model';
import { leaseGrantedSignal, poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import { acquireUpdate, sessionWorkflowId } from '../workflows/session/definitions';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { isolation, recordHistory } from './harness';
import { magusStack, TestStack } from './harness/stack';
import { eventually, sleep } from './harness/wait';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
const IDLE_MS = 6000;
/**
 * A model name of its own: pool workflow ids are `pool/<namespace>/<model>` on the one Temporal
 * server all test files share, so a pool left by one file would take another file's signals.
 */
const MODEL = `withdraw-tiny-${iso.id}`;

let nc: NatsConnection;
let client: Client;
let model: ReadyModel;
let taskQueue: string;
const stack = new TestStack();

beforeAll(async () => {
  const magus = await stack.open(magusStack(iso, { dirPrefix: 'magus-withdraw-' }));
  ({ nc, client } = magus);
  taskQueue = magus.cfg.taskQueue;
  const registry = await openModelRegistry(nc, names.modelsBucket);
  await publishTinyGguf({ dir: magus.dir, s3: magus.s3, bucket: iso.bucket, registry, name: MODEL });
  model = (await registry.get('default', MODEL))!;
}, 120_000);

afterAll(() => stack.close(), 60_000);

test('first turns that leave while the pool starts instances: their calls end at once, they leave no entry, session or demand, and the pool serves only who stayed', async () => {
  const t = temporalSessions({ client, taskQueue, pool: { minInstances: 0, maxInstances: 3, leasesPerInstance: 1, idleTimeoutMs: IDLE_MS, drainGraceMs: 500 }, sessionTtlMs: 120_000 });
  const js = nc.jetstream();
  const kv = await js.views.kv(names.sessionsBucket);
  const cache = createSessionCache({ kv, pools: await js.views.kv(names.poolsBucket), coldStart: t.coldStart, firstTurns: { ...t.firstTurns, sessions: kv } });
  await cache.ready;
  const pool = client.workflow.getHandle(poolWorkflowId('default', MODEL));
  const request = (key: string, signal: AbortSignal): AcquireRequest => ({ conversationKey: key, model, owner: 't', signal });
  try {
    // One conversation stays; three leave while the pool is still starting instances for them.
    const stayKey = `stay-${iso.id}`;
    const stay = cache.acquire(request(stayKey, new AbortController().signal));
    const leavers = [1, 2, 3].map((k) => {
      const abort = new AbortController();
      const key = `leave-${k}-${iso.id}`;
      return { key, abort, call: cache.acquire(request(key, abort.signal)).then(() => 'answered', (err: unknown) => err) };
    });
    // The pool hears of the four (the gateway's demand) and starts instances for them.
    await eventually(async () => {
      const s = await pool.query(poolStatusQuery);
      expect(s.waiting).toBe(4);
      expect(s.instances.some((i) => i.phase === 'starting')).toBe(true); // still cold
    }, 30_000);
    const abortedAt = Date.now();
    for (const l of leavers) l.abort.abort(new Error('client went away'));
    // No call is left waiting: each ends with its signal, long before any instance could serve it.
    for (const l of leavers) expect(await l.call).not.toBe('answered');
    expect(Date.now() - abortedAt).toBeLessThan(1000);

    // The one who stayed is served.
    const entry = await stay;
    expect(entry.pool).toBe(MODEL);

    // The leavers left nothing: no entry, no session; the pool hears the demand fall and stops the
    // idle instances it started for them, down to the one the conversation that stayed is on.
    for (const l of leavers) {
      expect((await kv.get(l.key))?.operation === 'PUT').toBe(false);
      await expect(client.workflow.getHandle(sessionWorkflowId('default', MODEL, l.key)).describe()).rejects.toMatchObject({ name: 'WorkflowNotFoundError' });
    }
    await eventually(async () => {
      const s = await pool.query(poolStatusQuery);
      expect(s.waiting).toBe(0);
      expect(s.instances.filter((i) => i.phase !== 'stopping').map((i) => [i.id, i.leases])).toEqual([[entry.instance, 1]]);
    }, 60_000);
    // A leaver can come back: its retry is served.
    const back = await cache.acquire(request(leavers[0]!.key, new AbortController().signal));
    expect(back.pool).toBe(MODEL);
    await recordHistory('pool-entry-demand-withdrawn', pool);
  } finally {
    await cache.close();
    await t.close();
    await pool.terminate('test over').catch(() => undefined);
  }
}, 180_000);

/** A pool nobody runs (no worker polls its queue): it accepts lease requests and never answers one, as if each grant were lost. */
const deafPool = (model: string) =>
  client.workflow.start('dllamaPool', {
    workflowId: poolWorkflowId('default', model),
    taskQueue: `${taskQueue}-nobody`,
    args: [{ namespace: 'default', model, minInstances: 0, maxInstances: 1, leasesPerInstance: 1, idleTimeoutMs: 60_000 }],
  });

test('an acquire that the pool never answers is refused at its deadline, and withdrawn', async () => {
  const lonely = `lonely-${iso.id}`;
  const deadPool = await deafPool(lonely);
  const key = `deadline-${iso.id}`;
  const session = await client.workflow.start('session', { workflowId: sessionWorkflowId('default', lonely, key), taskQueue, args: [{ key, namespace: 'default', model: lonely, ttlMs: 60_000, acquireTimeoutMs: 1500 }] });
  const t0 = Date.now();
  const err = await session.executeUpdate(acquireUpdate, { args: [{ model: lonely }] }).then(
    () => undefined,
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(WorkflowUpdateFailedError);
  const cause = (err as WorkflowUpdateFailedError).cause;
  expect(cause).toBeInstanceOf(ApplicationFailure);
  expect(cause).toMatchObject({ type: 'NoCapacity' });
  expect(cause?.message).toMatch(/no instance of .* was leased within 2s/);
  expect(Date.now() - t0).toBeLessThan(15_000);
  // The request was taken back: the session told the pool (a release), which will drop it from its waiting list.
  await eventually(async () => {
    const history = await session.fetchHistory();
    const released = history.events?.some((e) => e.signalExternalWorkflowExecutionInitiatedEventAttributes?.signalName === 'leaseReleased');
    expect(released).toBe(true);
  }, 15_000);
  await session.terminate();
  await deadPool.terminate();
}, 60_000);

/**
 * The first turn of a conversation can be served from the pool's published view before its
 * session exists; the session then asks the pool to confirm that lease (`preferred`). With
 * `session-preferred-reask` it asks again while unanswered, so a grant lost on the way (or a pool
 * that ended) no longer leaves it waiting for ever with its entry in `magus_sessions`.
 */
describe('a session confirming a lease its first turn already used', () => {
  const startPreferred = async (model: string, key: string, ttlMs: number) => {
    const sessions = await nc.jetstream().views.kv(names.sessionsBucket);
    // The gateway wrote the entry when it served the first turn from the view.
    await sessions.put(key, new TextEncoder().encode(JSON.stringify({ subject: 'nobody.listens', pool: model, namespace: 'default', instance: 'gone-1', expiresAt: Date.now() + ttlMs })));
    const handle = await client.workflow.start('session', {
      workflowId: sessionWorkflowId('default', model, key),
      taskQueue,
      args: [{ key, namespace: 'default', model, ttlMs, preferred: { instance: 'gone-1', subject: 'nobody.listens' }, reaskMs: 1000 }],
    });
    const requests = async () => ((await handle.fetchHistory()).events ?? []).filter((e) => e.signalExternalWorkflowExecutionInitiatedEventAttributes?.signalName === 'leaseRequested').length;
    const entry = async () => {
      const e = await sessions.get(key);
      return e && e.operation === 'PUT' ? (JSON.parse(new TextDecoder().decode(e.value)) as { instance: string }) : null;
    };
    return { handle, requests, entry };
  };

  test('unanswered, it asks again; when the pool is gone, it removes the entry and ends', async () => {
    const model = `deaf-${iso.id}`;
    const pool = await deafPool(model);
    const s = await startPreferred(model, `reask-gone-${iso.id}`, 120_000);
    await eventually(async () => expect(await s.requests()).toBeGreaterThanOrEqual(3), 20_000);
    expect(await s.entry()).toMatchObject({ instance: 'gone-1' }); // still waiting, the entry still there
    await pool.terminate('the pool ended while the session waited');
    // Before the patch the session waited for ever here, and warm turns kept going to an instance nobody leased.
    await expect(s.handle.result()).resolves.toBeUndefined();
    expect(await s.entry()).toBeNull();
  }, 60_000);

  test('unanswered for a whole TTL without a turn, it hands its place back and ends', async () => {
    const model = `deaf-ttl-${iso.id}`;
    const pool = await deafPool(model);
    const s = await startPreferred(model, `reask-ttl-${iso.id}`, 3000);
    const t0 = Date.now();
    await expect(s.handle.result()).resolves.toBeUndefined();
    expect(Date.now() - t0).toBeGreaterThanOrEqual(2000);
    expect(await s.entry()).toBeNull();
    const signals = ((await s.handle.fetchHistory()).events ?? []).map((e) => e.signalExternalWorkflowExecutionInitiatedEventAttributes?.signalName).filter(Boolean);
    expect(signals.at(-1)).toBe('leaseReleased'); // off the pool's waiting list
    await pool.terminate();
  }, 60_000);

  test('a grant lost on the way: it asks again, and the answer to a later request is taken as the pool’s confirmation', async () => {
    const model = `deaf-late-${iso.id}`;
    const pool = await deafPool(model);
    const s = await startPreferred(model, `reask-late-${iso.id}`, 60_000);
    await eventually(async () => expect(await s.requests()).toBeGreaterThanOrEqual(2), 20_000);
    // The pool's answer (here sent by the test, as a pool that finally answers would): another
    // instance than the one the first turn went to, so the session rewrites its entry.
    await s.handle.signal(leaseGrantedSignal, { instance: 'late-1', subject: 'late.subject' });
    await eventually(async () => expect(await s.entry()).toMatchObject({ instance: 'late-1', subject: 'late.subject' }), 20_000);
    const asked = await s.requests();
    await sleep(2500);
    expect(await s.requests()).toBe(asked); // confirmed: it asks no more
    await recordHistory('session-preferred-reask', s.handle);
    await s.handle.terminate();
    await pool.terminate();
  }, 60_000);
});

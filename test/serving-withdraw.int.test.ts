/**
 * A first turn whose caller leaves while the pool starts an instance for it (the serving
 * control-loop issue, finding 2): its wait ends with the request's signal, it leaves no entry and
 * no session, the demand it told the pool falls, and the pool scales to what live conversations
 * need — not to phantom demand. Real Temporal, nats-server and s3proxy; real workers with the local
 * runtime and a llama.cpp engine over the tiny GGUF.
 */
import type { Client } from '@temporalio/client';
import type { NatsConnection } from 'nats';
import { dataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import { SessionCache, type AcquireRequest } from '../gateway/serving/sessions';
import { temporalSessions } from '../gateway/temporal';
import type { ReadyModel } from '../shared/model';
import { poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import { sessionWorkflowId } from '../workflows/session/definitions';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { isolation, recordHistory } from './harness';
import { magusStack, TestStack } from './harness/stack';
import { eventually } from './harness/wait';

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
  const t = temporalSessions({
    client,
    taskQueue,
    pool: { minInstances: 0, maxInstances: 3, leasesPerInstance: 1, idleTimeoutMs: IDLE_MS, drainGraceMs: 500 },
    sessionTtlMs: 120_000,
  });
  const js = nc.jetstream();
  const kv = await js.views.kv(names.sessionsBucket);
  const cache = new SessionCache({ kv, pools: await js.views.kv(names.poolsBucket), firstTurns: { ...t.firstTurns, sessions: kv } });
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
      return {
        key,
        abort,
        call: cache.acquire(request(key, abort.signal)).then(
          () => 'answered',
          (err: unknown) => err,
        ),
      };
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
    await recordHistory('pool-demand-withdrawn', pool);
  } finally {
    await cache.close();
    await t.close();
    await pool.terminate('test over').catch(() => undefined);
  }
}, 180_000);

/**
 * Per-replica reply subjects against the real nats-server, a real bridge and the stub engine:
 * two gateway replicas (one `shared` router, one `per-request`, each on its own connection, as
 * two processes would have) send requests through the gateway's `exchange`, and each connection
 * is delivered the frames of its own requests and nothing else — counted by the connection's own
 * message counter, not by what the routers pass on; the frames come on the instance's subject
 * (`instanceFrames`), and a frame for a request's id on another instance's subject is not the
 * request's. A request with the older reply subject (queued by a gateway from before) is still
 * answered, on that subject, by a bridge without an instance user.
 */
import { randomBytes } from 'node:crypto';
import type { NatsConnection } from 'nats';
import { instanceResponseSubjectOf, publishRequest, requestSubjectOf, responseSubjectOf, type DataPlaneNames } from '../../dataplane';
import { decodeFrame, FrameSequencer } from '../../dataplane/frames';
import type { Bridge } from '../../dataplane/bridge';
import type { InferenceRequest, ResponseFrame, SessionEntry } from '../../shared/serving';
import { isolation, natsConnectAs } from '../../test/harness';
import { natsStack, stubInstanceStack, TestStack } from '../../test/harness/stack';
import { exchange, perRequestResponseRouter, sharedResponseRouter, type ResponseRouter } from './exchange';
import { until } from '../../test/harness/wait';

const POOL = 'routing';
const INSTANCE = 'i1';
const REQUESTS = 6;

let names: DataPlaneNames;
let bridge: Bridge;
/** The test's own connection: declares, publishes requests (as the gateways' publisher would), cleans up. */
let nc: NatsConnection;
let bridgeNc: NatsConnection;
const replicas: { name: string; nc: NatsConnection; router: ResponseRouter }[] = [];
const stack = new TestStack();

beforeAll(async () => {
  const iso = isolation();
  ({ nc, names } = await stack.open(natsStack(iso, { declare: true })));
  ({ nc: bridgeNc } = await stack.open(natsStack(iso)));
  ({ bridge } = await stack.open(
    stubInstanceStack(bridgeNc, names, { pool: POOL, instance: INSTANCE, slots: 4, engine: { chunks: 4 }, bridge: { log: () => undefined } }),
  ));
  // Two gateway replicas, each as the gateway's user.
  const a = await natsConnectAs('gateway', names, 'gw-a');
  const b = await natsConnectAs('gateway', names, 'gw-b');
  replicas.push(
    { name: 'gw-a', nc: a, router: await sharedResponseRouter(a, { subjectScope: names.subjectScope, replica: 'gw-a' }) },
    { name: 'gw-b', nc: b, router: perRequestResponseRouter(b, { subjectScope: names.subjectScope, replica: 'gw-b' }) },
  );
  stack.defer(async () => {
    for (const r of replicas) {
      await r.router.close();
      await r.nc.close();
    }
  });
});

afterAll(() => stack.close());

const session: () => SessionEntry = () => ({
  subject: requestSubjectOf(names, POOL, INSTANCE),
  pool: POOL,
  instance: INSTANCE,
  expiresAt: Date.now() + 60_000,
});
const body = (content: string) => ({ model: POOL, messages: [{ role: 'user' as const, content }], stream: true });

/** One streamed request through a replica's router, as the gateway makes it; resolves with the frames relayed to the client. */
async function ask({ nc: own, router }: (typeof replicas)[number], content: string): Promise<number> {
  const id = `req-${randomBytes(6).toString('hex')}`;
  const req: InferenceRequest = { id, replyTo: router.replySubject(id), instanceFrames: true, deadline: Date.now() + 30_000, body: body(content) };
  let relayed = 0;
  await exchange(session(), req, {
    router,
    // Published on the test's connection, so the replica's is delivered frames only; a flush
    // first puts a per-request subscription in place on the server, as publishing on its own
    // connection would.
    publish: async (_subject, r) => {
      await own.flush();
      await publishRequest(nc.jetstream(), names, { pool: POOL, instance: INSTANCE }, r);
    },
    requestTimeoutMs: 30_000,
    gapTimeoutMs: 5_000,
    retryAfterSec: 1,
    signal: new AbortController().signal,
    onChunk: () => (relayed += 1),
  });
  return relayed + 1; // and the done frame
}

test('each replica is delivered the frames of its own requests, and only those', async () => {
  const before = replicas.map((r) => r.nc.stats().inMsgs);
  // Both replicas at once, so their frames are on the wire together.
  const relayed = await Promise.all(replicas.map((r) => Promise.all(Array.from({ length: REQUESTS }, (_, i) => ask(r, `${r.name} asks ${i}`)))));
  for (const r of replicas) await r.nc.flush(); // anything the server still had for a connection has arrived
  const delivered = replicas.map((r, i) => r.nc.stats().inMsgs - before[i]!);
  const own = relayed.map((frames) => frames.reduce((a, b) => a + b, 0));
  expect(own.every((n) => n >= REQUESTS * 2)).toBe(true); // streamed: several frames per request
  // With one magus.res.> subscription per replica, each would be delivered both replicas' frames.
  expect(delivered).toEqual(own);
  // A request is acked once its frames are stored, just after its client has them.
  await until('every request acked', () => bridge.stats.acked === 2 * REQUESTS);
  expect(bridge.stats).toMatchObject({ acked: 2 * REQUESTS, errors: 0 });
});

test('a router hands a request the frames on its reply subject and on its instance’s, never those on another instance’s', async () => {
  for (const { name, nc: conn, router } of replicas) {
    const id = `req-${randomBytes(6).toString('hex')}`;
    const got: number[] = [];
    const unlisten = router.listen(id, (f) => got.push(f.seq), { pool: POOL, instance: INSTANCE });
    await conn.flush();
    const reply = router.replySubject(id);
    const frame = (seq: number) => JSON.stringify({ seq, type: 'chunk', data: {} });
    nc.publish(reply, frame(0));
    nc.publish(instanceResponseSubjectOf(reply, id, POOL, INSTANCE), frame(1));
    nc.publish(instanceResponseSubjectOf(reply, id, POOL, 'i2'), frame(2)); // another instance (another tenant's bridge)
    nc.publish(instanceResponseSubjectOf(reply, id, 'other-pool', INSTANCE), frame(3));
    await nc.flush();
    await until(`${name}: frames 0 and 1`, () => got.length >= 2);
    await conn.flush();
    expect([name, got]).toEqual([name, [0, 1]]);
    unlisten();
  }
});

test('a request with the older reply subject (queued by a gateway from before) is answered on it by a bridge without an instance user, and reaches no replica', async () => {
  // An instance's own NATS user may publish only on its instance's subjects (bridge.int.test.ts
  // shows the refusal): the older gateways' requests are answered where bridges run without users.
  await stack.open(
    stubInstanceStack(nc, names, { pool: POOL, instance: 'open', slots: 1, engine: { chunks: 2 }, bridge: { log: () => undefined }, bridgeOnNc: true }),
  );
  const before = replicas.map((r) => r.nc.stats().inMsgs);
  const id = `req-${randomBytes(6).toString('hex')}`;
  const replyTo = responseSubjectOf(names, id); // magus.res.<id>, no replica
  const sequencer = new FrameSequencer();
  const relayed: ResponseFrame[] = [];
  const sub = nc.subscribe(replyTo);
  const answered = (async () => {
    for await (const m of sub) {
      const f = decodeFrame(m.data);
      if (f) relayed.push(...sequencer.push(f));
      if (sequencer.finished) break;
    }
  })();
  await nc.flush();
  await publishRequest(
    nc.jetstream(),
    names,
    { pool: POOL, instance: 'open' },
    { id, replyTo, deadline: Date.now() + 30_000, body: body('from an older gateway') },
  );
  await answered;
  expect(relayed.at(-1)).toMatchObject({ type: 'done' });
  expect(relayed.length).toBeGreaterThan(2);
  for (const r of replicas) await r.nc.flush();
  expect(replicas.map((r, i) => r.nc.stats().inMsgs - before[i]!)).toEqual([0, 0]);
});

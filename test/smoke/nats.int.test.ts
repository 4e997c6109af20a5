import { AckPolicy, connect, RetentionPolicy, type NatsConnection, StringCodec } from 'nats';
import { endpoint, isolation, natsConnect } from '../harness';

const sc = StringCodec();
let nc: NatsConnection;
const iso = isolation();

beforeAll(async () => {
  nc = await natsConnect();
});
afterAll(async () => {
  await nc.drain();
});

test('JetStream: publish, pull-consume and ack on a work-queue stream', async () => {
  const jsm = await nc.jetstreamManager();
  const stream = `${iso.natsPrefix}_REQ`;
  const subject = `${iso.id}.req.>`;
  await jsm.streams.add({ name: stream, subjects: [subject], retention: RetentionPolicy.Workqueue });
  await jsm.consumers.add(stream, { durable_name: 'bridge', ack_policy: AckPolicy.Explicit, max_ack_pending: 1 });

  const js = nc.jetstream();
  const first = await js.publish(`${iso.id}.req.a`, sc.encode('one'), { msgID: 'req-1' });
  const dup = await js.publish(`${iso.id}.req.a`, sc.encode('one again'), { msgID: 'req-1' });
  await js.publish(`${iso.id}.req.b`, sc.encode('two'), { msgID: 'req-2' });
  expect(first.duplicate).toBe(false);
  expect(dup.duplicate).toBe(true); // Nats-Msg-Id de-duplication is real

  const consumer = await js.consumers.get(stream, 'bridge');
  const got: string[] = [];
  for (let i = 0; i < 2; i++) {
    const m = await consumer.next({ expires: 5000 });
    if (!m) throw new Error('no message delivered');
    got.push(sc.decode(m.data));
    await m.ackAck();
  }
  expect(got).toEqual(['one', 'two']);
  // Work-queue retention: acked messages are gone from the stream.
  expect((await jsm.streams.info(stream)).state.messages).toBe(0);
});

test('KV: compare-and-set conflicts on a stale revision', async () => {
  const kv = await nc.jetstream().views.kv(`${iso.natsPrefix}_kv`, { history: 3 });
  const rev1 = await kv.create('session.a', sc.encode('instance-1'));
  await expect(kv.create('session.a', sc.encode('instance-2'))).rejects.toThrow(/wrong last sequence|exists/i);
  const rev2 = await kv.update('session.a', sc.encode('instance-2'), rev1);
  expect(rev2).toBeGreaterThan(rev1);
  await expect(kv.update('session.a', sc.encode('instance-3'), rev1)).rejects.toThrow(/wrong last sequence/i);
  const entry = await kv.get('session.a');
  expect(entry && sc.decode(entry.value)).toBe('instance-2');
  expect(entry?.revision).toBe(rev2);
});

test('the server has users per role (harness/global-setup.ts): a connection without credentials is refused, unless MAGUS_TEST_NATS_AUTH=0', async () => {
  const anonymous = connect({ servers: endpoint('nats').servers, timeout: 3000, reconnect: false });
  if (process.env.MAGUS_TEST_NATS_AUTH === '0') {
    await (await anonymous).close();
    return;
  }
  await expect(anonymous).rejects.toThrow(/Authorization Violation/i);
});

/**
 * Whether another gateway replica runs, asked of a real NATS server with the gateway role's
 * permissions: a replica that listens is not gone, nor one that listened but whose question times
 * out; once its connection closes (as a SIGKILLed process's does), it is gone as soon as the server reads the close.
 */
import { isolation, natsConnectAs } from '../../test/harness';
import { natsStack, TestStack } from '../../test/harness/stack';
import { listenAsReplica, REPLICA_ASK_MS, replicaGone } from './replicas';

const iso = isolation();
const stack = new TestStack();

afterAll(() => stack.close());

test('a replica that holds its subject is not gone; once its connection is closed it is (NATS says no responders, not a time out)', async () => {
  const { names } = await stack.open(natsStack(iso, { declare: true }));
  const asker = await natsConnectAs('gateway', names, 'magus-test-asker');
  stack.defer(() => asker.close());
  const other = await natsConnectAs('gateway', names, 'magus-test-other');
  const scope = names.subjectScope;

  // Never listened: gone.
  expect(await replicaGone(asker, scope, 'gw-000000000001')).toBe(true);
  const unlisten = await listenAsReplica(other, scope, 'gw-000000000002');
  // Listening: not gone (the question waits its time out, so it takes about that long).
  const asked = Date.now();
  expect(await replicaGone(asker, scope, 'gw-000000000002')).toBe(false);
  expect(Date.now() - asked).toBeGreaterThanOrEqual(REPLICA_ASK_MS - 50);
  // A replica's subject is its own: another's listening says nothing of it.
  expect(await replicaGone(asker, scope, 'gw-000000000003')).toBe(true);
  // Unsubscribed (a replica closing), then listening again, then its connection closed without a word.
  unlisten();
  await other.flush();
  expect(await replicaGone(asker, scope, 'gw-000000000002')).toBe(true);
  await listenAsReplica(other, scope, 'gw-000000000002');
  expect(await replicaGone(asker, scope, 'gw-000000000002')).toBe(false);
  await other.close();
  // close() resolves once the socket is closed on this side; the server drops the subscription when
  // it reads the close, a moment later — so a question asked at once may still find it. Asked again
  // until NATS says no responders, which must come well inside 1.5 s (each "not gone" costs REPLICA_ASK_MS).
  const closed = Date.now();
  let gone = await replicaGone(asker, scope, 'gw-000000000002');
  while (!gone && Date.now() - closed < 2000) gone = await replicaGone(asker, scope, 'gw-000000000002');
  expect(gone).toBe(true);
  expect(Date.now() - closed).toBeLessThan(1500);
});

test("a question with the asker's connection closed says nothing: not gone", async () => {
  const { names } = await stack.open(natsStack(iso, { declare: true }));
  const asker = await natsConnectAs('gateway', names, 'magus-test-closed-asker');
  await asker.close();
  expect(await replicaGone(asker, names.subjectScope, 'gw-000000000009')).toBe(false);
});

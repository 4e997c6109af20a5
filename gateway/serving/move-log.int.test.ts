/**
 * The move log on a real `magus_responses` bucket: a move of an answer is claimed once, by
 * whichever replica comes first, and every other claim of it gets the one that holds; a resume of
 * it is recorded.
 */
import { ensureResponsesBucket } from '../../dataplane/declare';
import { isolation } from '../../test/harness';
import { natsStack, TestStack } from '../../test/harness/stack';
import { kvMoveLog, type MoveLog } from './resume';

const iso = isolation();
const stack = new TestStack();
let log: MoveLog;

beforeAll(async () => {
  const { nc, names } = await stack.open(natsStack(iso, { declare: true }));
  stack.defer(async () => (await nc.jetstreamManager()).streams.delete(`KV_${names.responsesBucket}`).catch(() => false));
  log = kvMoveLog(await ensureResponsesBucket(nc, names.responsesBucket, { maxAgeMs: 60_000 }));
});
afterAll(() => stack.close());

test('a move is claimed once: the first claim holds, a later or simultaneous one gets it; the next move is its own', async () => {
  const mine = { replica: 'r1', pool: 'p', instance: 'i2', requestId: 'req1-m1' };
  const theirs = { replica: 'r1', pool: 'p', instance: 'i3', requestId: 'req1-m1x' };
  expect(await log.find('req1', 1)).toBeUndefined();
  expect(await log.claim('req1', 1, mine)).toEqual(mine);
  expect(await log.claim('req1', 1, theirs)).toEqual(mine);
  expect(await log.find('req1', 1)).toEqual(mine);
  // Ten replicas at once: one wins, all agree on it.
  const claims = await Promise.all(Array.from({ length: 10 }, (_, i) => log.claim('req2', 1, { ...mine, requestId: `req2-m1-${i}` })));
  expect(new Set(claims.map((c) => c.requestId)).size).toBe(1);
  expect(await log.find('req2', 1)).toEqual(claims[0]);
  const second = { ...mine, instance: 'i1', requestId: 'req1-m2' };
  expect(await log.claim('req1', 2, second)).toEqual(second);
});

test('a move records where the answer left the request it moved from; a record without it (an older gateway) or with a bad one is read without it', async () => {
  const left = { replica: 'r1', pool: 'p', instance: 'i2', requestId: 'req3-m1', at: 7 };
  expect(await log.claim('req3', 1, left)).toEqual(left);
  expect(await log.find('req3', 1)).toEqual(left);
  expect(await log.claim('req3', 1, { ...left, requestId: 'other', at: 2 })).toEqual(left);
  const { at: _, ...older } = left;
  expect(await log.claim('req4', 1, older)).toEqual(older);
  expect(await log.find('req4', 1)).toEqual(older);
  expect(await log.claim('req5', 1, { ...left, at: -1 })).toMatchObject({ at: -1 }); // as claimed here …
  expect(await log.find('req5', 1)).toEqual(older); // … but not believed when read
});

test("a resume is recorded under the answer's first request: none until one is, a later one after an earlier, and a move's record is no resume", async () => {
  await log.claim('req6', 1, { replica: 'r1', pool: 'p', instance: 'i2', requestId: 'req6-m1' });
  expect(await log.lastResumed!('req6')).toBe(0);
  const first = await log.resumed!('req6');
  expect(first).toBeGreaterThan(0);
  expect(await log.lastResumed!('req6')).toBe(first);
  const again = await log.resumed!('req6'); // its client gone again and back once more
  expect(again).toBeGreaterThan(first);
  expect(await log.lastResumed!('req6')).toBe(again);
  expect(await log.lastResumed!('req7')).toBe(0);
});

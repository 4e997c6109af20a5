/**
 * dataplane/limits.ts against a real `magus_limits` bucket (the file's own data plane), with two
 * NATS connections standing for two gateway replicas, each with its own `LimitStore`: 64
 * concurrent admissions on a 500-token budget admit exactly 10 (each its own writer, so by
 * compare-and-swap alone); settling lets exactly the room left through and `used` is the sum
 * settled; one replica's concurrent operations on a key share writes; requests per minute refuse the 6th with the 12 s the
 * bucket needs; concurrency 2 refuses the 3rd until one settles; a replica that stops renewing
 * has its reservation released, charged its worst case, within one lease. The write path: a
 * settle is held for the key's next write (written with the next admission, in one
 * compare-and-swap), written alone once its hold is over, and at once by `flush` / `close`; the
 * store's writes are core publishes (not `kv.update`) whose compare-and-swap conflicts as
 * `kv.update`'s does and is retried; a write nobody acknowledges fails after its timeout.
 */
import { StorageType, type KV, type NatsConnection, type StreamConfig } from 'nats';
import { reservedSlots, type Admission, type KeyLimits } from '../shared/limits';
import { isolation } from '../test/harness';
import { natsStack, TestStack } from '../test/harness/stack';
import { sleep, until } from '../test/harness/wait';
import { isRevisionConflict } from './errors';
import { kvCasWriter, LimitRenewer, LimitStore, limitKeyOf } from './limits';

const iso = isolation();
const stack = new TestStack();
/** Two replicas: a connection and a bucket view each. */
let kvA: KV;
let kvB: KV;
let ncA: NatsConnection;
let bucketConfig: StreamConfig;

beforeAll(async () => {
  const { nc, names } = await stack.open(natsStack(iso, { declare: true }));
  // The harness deletes the streams and buckets it knows of; this one too.
  stack.defer(async () => (await nc.jetstreamManager()).streams.delete(`KV_${names.limitsBucket}`).catch(() => false));
  const { nc: other } = await stack.open(natsStack(iso));
  ncA = nc;
  kvA = await nc.jetstream().views.kv(names.limitsBucket, { bindOnly: true });
  kvB = await other.jetstream().views.kv(names.limitsBucket, { bindOnly: true });
  ({ config: bucketConfig } = await (await nc.jetstreamManager()).streams.info(`KV_${names.limitsBucket}`));
});
afterAll(() => stack.close());

const refusedCode = (a: Admission): string | undefined => (a.ok ? undefined : a.code);

it('ensureDataPlane declares the bucket: file, history 1, no max age', () => {
  expect(bucketConfig).toMatchObject({ storage: StorageType.File, max_msgs_per_subject: 1, max_age: 0, num_replicas: 1 });
});

it('the scope key is the identity in base64url: a valid KV key for any identity', () => {
  expect(limitKeyOf('team-a/chat')).toBe('dGVhbS1hL2NoYXQ');
  for (const identity of ['local/ä.b', 'config/x', 'ns/name.with.dots']) expect(limitKeyOf(identity)).toMatch(/^[A-Za-z0-9_-]+$/);
  expect(limitKeyOf('a/b')).not.toBe(limitKeyOf('a.b'));
});

it('64 concurrent admissions from two replicas on a 500-token budget: exactly 10; settled, exactly the room left', async () => {
  const scope = 'team/budget';
  const limits: KeyLimits = { budget: { tokens: 500, period: 'day' } };
  const stores = [new LimitStore(kvA), new LimitStore(kvB)];
  const settledTokens: number[] = [];

  /** 64 admissions at once, alternating between the replicas; `writers` each its own store (no batching: compare-and-swap alone). */
  const round = async (tag: string, writers: 'per-replica' | 'per-request') => {
    const storeFor = (i: number) => (writers === 'per-request' ? new LimitStore(i % 2 ? kvB : kvA) : stores[i % 2]!);
    const results = await Promise.all(
      Array.from({ length: 64 }, (_, i) =>
        storeFor(i)
          .admit(scope, limits, { id: `${tag}-${i}`, tokens: 50, replica: `gw-${i % 2}`, leaseMs: 60_000 })
          .then((a) => ({ i, a })),
      ),
    );
    const admitted = results.filter((r) => r.a.ok).map((r) => r.i);
    const codes = results.filter((r) => !r.a.ok).map((r) => refusedCode(r.a));
    return { admitted, codes };
  };
  const settleAll = async (tag: string, admitted: number[], tokens: number) => {
    const settled = await Promise.all(admitted.map((i) => stores[i % 2]!.settle(scope, limits, `${tag}-${i}`, tokens)));
    expect(settled.every((s) => s.settled)).toBe(true);
    settledTokens.push(...admitted.map(() => tokens));
  };

  const first = await round('r1', 'per-request');
  expect(first.admitted).toHaveLength(10);
  expect(first.codes).toEqual(Array(54).fill('insufficient_quota'));
  const afterFirst = await stores[0]!.read(scope);
  expect(afterFirst!.state.budget!.used).toBe(0);
  expect(Object.values(afterFirst!.state.reservations).map((r) => r.tokens)).toEqual(Array(10).fill(50));

  // 10 × 30 used leaves 200: room for exactly 4 worst cases of 50.
  await settleAll('r1', first.admitted, 30);
  const second = await round('r2', 'per-replica');
  expect(second.admitted).toHaveLength(4);
  expect(second.codes).toEqual(Array(60).fill('insufficient_quota'));

  // 420 used leaves 80: exactly 1.
  await settleAll('r2', second.admitted, 30);
  const third = await round('r3', 'per-replica');
  expect(third.admitted).toHaveLength(1);
  await settleAll('r3', third.admitted, 50);

  // A retried settle charges nothing more.
  const again = await stores[1]!.settle(scope, limits, `r3-${third.admitted[0]}`, 50);
  expect(again.settled).toBe(false);

  const stored = await stores[1]!.read(scope);
  expect(stored!.state.reservations).toEqual({});
  expect(stored!.state.budget!.used).toBe(settledTokens.reduce((a, b) => a + b, 0));
  expect(stored!.state.budget!.used).toBe(470);
});

it.each([
  ['each admission written', 0],
  ['slices', undefined],
])('one replica batches its operations on a key (%s): 256 at once cost a few writes; a bad one fails alone', async (_, sliceMs) => {
  const scope = `team/batched-${sliceMs ?? 'sliced'}`;
  const limits: KeyLimits = { concurrency: 100 };
  const store = new LimitStore(kvA, sliceMs === undefined ? {} : { sliceMs });
  const lastSeq = async () => (await kvA.status()).streamInfo.state.last_seq;
  const before = await lastSeq();
  const results = await Promise.allSettled(
    Array.from({ length: 256 }, (_, i) => store.admit(scope, limits, { id: `b${i}`, tokens: i === 7 ? 1.5 : 1, replica: 'gw-a', leaseMs: 60_000 })),
  );
  expect(results[7]).toMatchObject({ status: 'rejected', reason: { name: 'RangeError' } });
  const admissions = results.flatMap((r) => (r.status === 'fulfilled' ? [r.value] : []));
  expect(admissions.filter((a) => a.ok)).toHaveLength(100);
  expect(admissions.filter((a) => refusedCode(a) === 'rate_limit_exceeded')).toHaveLength(155);
  // Each request holds a slot in the document: its own reservation's, or one of its slice's.
  expect(reservedSlots(Object.values((await store.read(scope))!.state.reservations))).toBe(100);
  expect((await lastSeq()) - before).toBeLessThanOrEqual(8);
});

it('requests per minute 5: the 6th is refused with the 12 s one request takes to refill, then admitted', async () => {
  const scope = 'team/rpm';
  const limits: KeyLimits = { requestsPerMinute: 5 };
  let now = Date.UTC(2026, 10, 29, 12);
  const stores = [new LimitStore(kvA, { clock: () => now }), new LimitStore(kvB, { clock: () => now })];
  const ask = (i: number) => stores[i % 2]!.admit(scope, limits, { id: `q${i}`, tokens: 10, replica: `gw-${i % 2}`, leaseMs: 60_000 });

  for (let i = 0; i < 5; i += 1) expect((await ask(i)).ok).toBe(true);
  expect(await ask(5)).toEqual({
    ok: false,
    code: 'rate_limit_exceeded',
    // 1 request ÷ (5 requests / 60 s).
    retryAfterMs: 12_000,
    message: 'Rate limit reached on requests per min (RPM): Limit 5, Used 5, Requested 1. Please try again in 12s.',
    headers: { 'x-ratelimit-limit-requests': '5', 'x-ratelimit-remaining-requests': '0', 'x-ratelimit-reset-requests': '1m0s' },
  });
  now += 1500;
  const later = await ask(5);
  // (1 request − 1.5 s × 5/60 s) ÷ (5/60 s) = 12 s − 1.5 s.
  expect(later.ok ? undefined : [later.retryAfterMs, later.headers['x-ratelimit-reset-requests']]).toEqual([10_500, '58.5s']);
  now += 10_499;
  expect(refusedCode(await ask(5))).toBe('rate_limit_exceeded');
  now += 1;
  expect((await ask(5)).ok).toBe(true);
  const seventh = await ask(6);
  expect(seventh.ok ? undefined : seventh.retryAfterMs).toBe(12_000);
});

it('concurrency 2: the 3rd is refused until one settles', async () => {
  const scope = 'team/concurrency';
  const limits: KeyLimits = { concurrency: 2, tokensPerMinute: 10_000 };
  const [a, b] = [new LimitStore(kvA), new LimitStore(kvB)];
  const req = (id: string, replica: string) => ({ id, tokens: 100, replica, leaseMs: 60_000 });
  expect((await a.admit(scope, limits, req('c1', 'gw-a'))).ok).toBe(true);
  expect((await b.admit(scope, limits, req('c2', 'gw-b'))).ok).toBe(true);
  const third = await a.admit(scope, limits, req('c3', 'gw-a'));
  expect(third.ok).toBe(false);
  if (third.ok) return;
  expect(third.code).toBe('rate_limit_exceeded');
  expect(third.message).toMatch(/^Rate limit reached on concurrent requests: Limit 2, Used 2, Requested 1\./);
  expect(third.retryAfterMs).toBeGreaterThanOrEqual(1);
  expect(third.headers).toMatchObject({ 'x-ratelimit-limit-tokens': '10000' });

  const s = await b.settle(scope, limits, 'c2', 40);
  expect(s.settled).toBe(true);
  // c1's 100 still reserved, c2 charged 40 (its other 60 refunded), plus what refilled since.
  expect(Number(s.headers['x-ratelimit-remaining-tokens'])).toBeGreaterThanOrEqual(9860);
  expect((await a.admit(scope, limits, req('c3', 'gw-a'))).ok).toBe(true);
  expect(refusedCode(await b.admit(scope, limits, req('c4', 'gw-b')))).toBe('rate_limit_exceeded');
});

it('a replica that stops renewing has its reservation released within one lease, charged its worst case', async () => {
  const scope = 'team/leases';
  const leaseMs = 1500;
  const limits: KeyLimits = { concurrency: 2, budget: { tokens: 1000, period: 'month' } };
  const [a, b] = [new LimitStore(kvA), new LimitStore(kvB)];
  const lost: string[] = [];
  const renewers = [
    new LimitRenewer(a, 'gw-a', leaseMs, { onLost: (_, id) => lost.push(id) }),
    new LimitRenewer(b, 'gw-b', leaseMs, { onLost: (_, id) => lost.push(id) }),
  ];
  for (const r of renewers) stack.defer(() => r.stop());
  const [renewA, renewB] = renewers as [LimitRenewer, LimitRenewer];

  expect((await a.admit(scope, limits, { id: 'dies', tokens: 200, replica: 'gw-a', leaseMs })).ok).toBe(true);
  renewA.track(scope, 'dies');
  expect((await b.admit(scope, limits, { id: 'lives', tokens: 100, replica: 'gw-b', leaseMs })).ok).toBe(true);
  renewB.track(scope, 'lives');
  renewA.start();
  renewB.start();

  // Renewed, both outlive their first lease.
  await sleep(2 * leaseMs);
  expect(refusedCode(await b.admit(scope, limits, { id: 'next', tokens: 100, replica: 'gw-b', leaseMs }))).toBe('rate_limit_exceeded');

  // Replica a stops renewing: within one lease of its last renewal (at most a third of a lease before), the slot frees.
  await renewA.stop();
  const stoppedAt = Date.now();
  await until(
    'the lapsed reservation to be released',
    async () => (await b.admit(scope, limits, { id: 'next', tokens: 100, replica: 'gw-b', leaseMs })).ok,
    10_000,
  );
  renewB.track(scope, 'next');
  const releasedAfter = Date.now() - stoppedAt;
  expect(releasedAfter).toBeGreaterThanOrEqual(leaseMs - Math.ceil(leaseMs / 3) - 50);
  expect(releasedAfter).toBeLessThanOrEqual(leaseMs + 700);

  const stored = await a.read(scope);
  expect(Object.keys(stored!.state.reservations).sort()).toEqual(['lives', 'next']);
  expect(stored!.state.budget!.used).toBe(200);

  // The stopped replica, renewing once more, learns its reservation is gone; a late settle charges nothing.
  await renewA.renewNow();
  expect(lost).toEqual(['dies']);
  expect((await a.settle(scope, limits, 'dies', 20)).settled).toBe(false);
  expect((await b.settle(scope, limits, 'lives', 60)).settled).toBe(true);
  renewB.untrack(scope, 'lives');
  expect((await a.read(scope))!.state.budget!.used).toBe(260);
  await renewB.stop();
  expect(lost).toEqual(['dies']);
});

/** The bucket's last sequence: every write to any of its entries adds one. */
const lastSeq = async (): Promise<number> => (await kvA.status()).streamInfo.state.last_seq;

/** `promise`'s state now (after pending callbacks ran). */
const stateOf = async (promise: Promise<unknown>): Promise<'pending' | 'settled'> =>
  Promise.race([promise.then(() => 'settled' as const), new Promise<'pending'>((resolve) => setImmediate(() => resolve('pending')))]);

it("a settle is held for the key's next write: the next admission writes both in one compare-and-swap", async () => {
  const scope = 'team/held';
  const limits: KeyLimits = { concurrency: 1, budget: { tokens: 1000, period: 'month' } };
  // A hold far longer than the test: only the next write (or a flush) writes the settle.
  const store = new LimitStore(kvA, { settleHoldMs: 600_000 });
  stack.defer(() => store.close());
  const req = (id: string) => ({ id, tokens: 100, replica: 'gw-a', leaseMs: 60_000 });
  expect((await store.admit(scope, limits, req('h1'))).ok).toBe(true);
  const before = await lastSeq();

  const settled = store.settle(scope, limits, 'h1', 40);
  expect(await stateOf(settled)).toBe('pending');
  expect(await lastSeq()).toBe(before);
  expect(Object.keys((await store.read(scope))!.state.reservations)).toEqual(['h1']);

  // Concurrency 1: admitted only because the held settle is applied first, in the same write.
  expect((await store.admit(scope, limits, req('h2'))).ok).toBe(true);
  expect(await settled).toMatchObject({ settled: true });
  expect((await lastSeq()) - before).toBe(1);
  const stored = (await store.read(scope))!.state;
  expect(Object.keys(stored.reservations)).toEqual(['h2']);
  expect(stored.budget!.used).toBe(40);
});

it('a held settle is written alone once its hold is over, and at once by flush and close', async () => {
  const scope = 'team/flushed';
  const limits: KeyLimits = { budget: { tokens: 1000, period: 'month' } };
  const req = (id: string) => ({ id, tokens: 100, replica: 'gw-a', leaseMs: 60_000 });

  const timed = new LimitStore(kvA, { settleHoldMs: 10 });
  stack.defer(() => timed.close());
  expect((await timed.admit(scope, limits, req('t1'))).ok).toBe(true);
  // Nothing else comes: the hold's timer writes it.
  expect(await timed.settle(scope, limits, 't1', 30)).toMatchObject({ settled: true });
  expect((await timed.read(scope))!.state).toMatchObject({ reservations: {}, budget: { used: 30 } });

  const held = new LimitStore(kvA, { settleHoldMs: 600_000 });
  expect((await held.admit(scope, limits, req('t2'))).ok).toBe(true);
  expect((await held.admit(scope, limits, req('t3'))).ok).toBe(true);
  const s2 = held.settle(scope, limits, 't2', 20);
  expect(await stateOf(s2)).toBe('pending');
  await held.flush();
  expect(await stateOf(s2)).toBe('settled');
  expect((await s2).settled).toBe(true);
  expect((await held.read(scope))!.state).toMatchObject({ budget: { used: 50 } });

  const s3 = held.settle(scope, limits, 't3', 10);
  await held.close();
  expect((await s3).settled).toBe(true);
  expect((await held.read(scope))!.state).toMatchObject({ reservations: {}, budget: { used: 60 } });
  // Closed, it holds nothing: a settle is written at once (the 10-minute hold would time the test out).
  expect((await held.admit(scope, limits, req('t4'))).ok).toBe(true);
  expect((await held.settle(scope, limits, 't4', 5)).settled).toBe(true);
  expect((await held.read(scope))!.state).toMatchObject({ reservations: {}, budget: { used: 65 } });
  await held.close();
});

it("the store's writes are core publishes: kv.update is never called; a conflict is read again and retried", async () => {
  const scope = 'team/cas';
  const limits: KeyLimits = { concurrency: 10 };
  const req = (id: string, replica: string) => ({ id, tokens: 1, replica, leaseMs: 60_000 });
  const refuse = () => Promise.reject(new Error('the store wrote through kv.create / kv.update'));
  // The view's own writes throw: every write the store makes goes by its core publish.
  const viewA = await ncA.jetstream().views.kv((await kvA.status()).bucket, { bindOnly: true });
  Object.assign(viewA, { create: refuse, update: refuse, put: refuse });
  // Each admission its own write (slices would hold these as one reservation).
  const [a, b] = [new LimitStore(viewA, { sliceMs: 0 }), new LimitStore(kvB, { sliceMs: 0 })];
  stack.defer(() => a.close());
  stack.defer(() => b.close());

  expect((await a.admit(scope, limits, req('x1', 'gw-a'))).ok).toBe(true); // created
  expect((await b.admit(scope, limits, req('x2', 'gw-b'))).ok).toBe(true); // b read a's entry, updated it
  // a's remembered revision is stale now: its write conflicts, it reads b's and writes again.
  const before = await lastSeq();
  expect((await a.admit(scope, limits, req('x3', 'gw-a'))).ok).toBe(true);
  expect((await lastSeq()) - before).toBe(1);
  const stored = await a.read(scope);
  expect(Object.keys(stored!.state.reservations).sort()).toEqual(['x1', 'x2', 'x3']);
  expect(stored!.revision).toBe((await kvA.get(limitKeyOf(scope)))!.revision);
});

it('kvCasWriter: create on 0, update on the last revision, a conflict otherwise; an unacknowledged write times out', async () => {
  const writer = kvCasWriter(kvA, 5_000);
  stack.defer(() => writer.close());
  const key = limitKeyOf('team/writer');
  const first = await writer.write(key, '{"reservations":{}}', 0);
  expect((await kvA.get(key))!.revision).toBe(first);
  const conflict = await writer.write(key, '{"reservations":{}}', 0).catch((err: unknown) => err);
  expect(isRevisionConflict(conflict)).toBe(true);
  const second = await writer.write(key, '{"reservations":{"a":{"tokens":1,"replica":"r","leaseUntil":1,"at":1}}}', first);
  expect(second).toBeGreaterThan(first);
  expect(isRevisionConflict(await writer.write(key, '{}', first).catch((err: unknown) => err))).toBe(true);
  expect((await kvA.get(key))!.revision).toBe(second);
  await writer.close();
  await expect(writer.write(key, '{}', second)).rejects.toThrow(/closed/);

  // A subject someone listens on but never acknowledges: the write fails after its timeout.
  const silent = `${iso.natsPrefix}.silent.limits`;
  const sub = ncA.subscribe(`${silent}.>`, { callback: () => undefined });
  stack.defer(() => sub.unsubscribe());
  await ncA.flush();
  const fake = { js: { nc: ncA }, subjectForKey: (k: string) => `${silent}.${k}` } as unknown as KV;
  const timing = kvCasWriter(fake, 50);
  stack.defer(() => timing.close());
  await expect(timing.write(key, '{}', 1)).rejects.toThrow(/not acknowledged within 50 ms/);
  // Nobody listens at all: NATS says so at once.
  const nobody = kvCasWriter({ js: { nc: ncA }, subjectForKey: (k: string) => `${silent}-none.${k}` } as unknown as KV, 60_000);
  stack.defer(() => nobody.close());
  await expect(nobody.write(key, '{}', 1)).rejects.toThrow(/no responders/);
});

describe('slices', () => {
  const generous: KeyLimits = {
    requestsPerMinute: 1_000_000,
    tokensPerMinute: 1_000_000_000,
    concurrency: 1000,
    budget: { tokens: 1_000_000_000_000, period: 'month' },
  };

  it('1,000 requests one after another cost a few writes, with headers that move; given back, the key is charged exactly what they used', async () => {
    const scope = 'team/sliced';
    const now = Date.UTC(2026, 10, 30, 12);
    const store = new LimitStore(kvA, { clock: () => now });
    stack.defer(() => store.close());
    const before = await lastSeq();
    const remaining: number[] = [];
    for (let i = 0; i < 1000; i += 1) {
      const a = await store.admit(scope, generous, { id: `s${i}`, tokens: 100, replica: 'gw-a', leaseMs: 60_000 });
      expect(a).toMatchObject({ ok: true, tokens: 100 });
      remaining.push(Number(a.headers['x-ratelimit-remaining-requests']));
      expect((await store.settle(scope, generous, `s${i}`, 37)).settled).toBe(true);
    }
    expect((await lastSeq()) - before).toBeLessThanOrEqual(20);
    // The clock stands still: each admission takes one request off what the key has left, as this replica sees it.
    expect(remaining.slice(1).every((r, i) => r === remaining[i]! - 1)).toBe(true);
    expect(remaining[999]).toBe(1_000_000 - 1000);

    await store.flush();
    const { state } = (await store.read(scope))!;
    expect(state.reservations).toEqual({});
    expect(state.budget).toEqual({ period: '2026-11', used: 37_000 });
    // What the slices did not use came back: the buckets lost what the requests took, no more.
    expect(state.requests!.level).toBe((1_000_000 - 1000) * 60_000);
    expect(state.tokens!.level).toBe((1_000_000_000 - 37_000) * 60_000);
    expect(state.meanDurationMs).toBeGreaterThanOrEqual(0);
  });

  it('slices of two replicas never exceed a budget; what one did not use comes back for the other', async () => {
    const scope = 'team/sliced-budget';
    const limits: KeyLimits = { budget: { tokens: 10_000, period: 'month' } };
    const stores = [new LimitStore(kvA), new LimitStore(kvB)];
    for (const st of stores) stack.defer(() => st.close());
    let admitted = 0;
    const codes = new Set<string>();
    let next = 0;
    // 16 clients per replica, each asking until its replica refuses.
    await Promise.all(
      Array.from({ length: 32 }, async (_, c) => {
        const store = stores[c % 2]!;
        for (;;) {
          const id = `q${next++}`;
          const a = await store.admit(scope, limits, { id, tokens: 10, replica: `gw-${c % 2}`, leaseMs: 60_000 });
          if (!a.ok) {
            codes.add(a.code);
            return;
          }
          admitted += 1;
          await sleep(Math.random() * 2);
          await store.settle(scope, limits, id, 10);
        }
      }),
    );
    expect(admitted * 10).toBeLessThanOrEqual(10_000);
    expect([...codes]).toEqual(['insufficient_quota']);
    await Promise.all(stores.map((st) => st.flush()));
    expect((await stores[0]!.read(scope))!.state).toMatchObject({ reservations: {}, budget: { used: admitted * 10 } });
    // Every slice given back: the rest of the budget is there to be taken, to the token.
    for (;;) {
      const id = `r${next++}`;
      const a = await stores[0]!.admit(scope, limits, { id, tokens: 10, replica: 'gw-0', leaseMs: 60_000 });
      if (!a.ok) break;
      admitted += 1;
      await stores[0]!.settle(scope, limits, id, 10);
    }
    await stores[0]!.flush();
    expect(admitted).toBe(1000);
    expect((await stores[1]!.read(scope))!.state).toMatchObject({ reservations: {}, budget: { used: 10_000 } });
  });

  it('renewing a request renews its slice; a replica that dies holding a slice has it released within a lease, charged in full, and learns its requests were lost', async () => {
    const scope = 'team/sliced-lapse';
    const leaseMs = 1500;
    const limits: KeyLimits = { budget: { tokens: 100_000, period: 'month' } };
    const [a, b] = [new LimitStore(kvA), new LimitStore(kvB)];
    stack.defer(() => b.close());
    expect(await a.admit(scope, limits, { id: 'd1', tokens: 100, replica: 'gw-a', leaseMs })).toMatchObject({ ok: true });
    const sliceOf = async () => Object.entries((await a.read(scope))!.state.reservations).find(([id]) => id.startsWith('~slice.'))!;
    const [sliceId, slice] = await sliceOf();
    expect(slice).toMatchObject({ replica: 'gw-a', tokens: 800 }); // 8 requests of 100
    // The request's renewal renews its slice; then replica a goes silent (no renewal, no flush).
    await sleep(300);
    expect(await a.renew('gw-a', new Map([[scope, ['d1']]]), leaseMs)).toEqual(new Map());
    const renewedAt = Date.now();
    const [, renewed] = await sliceOf();
    expect(renewed.leaseUntil).toBeGreaterThanOrEqual(slice.leaseUntil + 300);
    await until(
      "a's slice to be released by b's writes",
      async () => {
        await b.admit(scope, limits, { id: `b${Date.now()}`, tokens: 10, replica: 'gw-b', leaseMs: 60_000 });
        return !(sliceId in (await b.read(scope))!.state.reservations);
      },
      10_000,
    );
    expect(Date.now() - renewedAt).toBeGreaterThanOrEqual(leaseMs - 100);
    // Charged its whole 800: what its requests used is not known.
    expect((await b.read(scope))!.state.budget!.used).toBe(800);
    expect(await a.renew('gw-a', new Map([[scope, ['d1']]]), leaseMs)).toEqual(new Map([[scope, ['d1']]]));
    expect((await a.settle(scope, limits, 'd1', 20)).settled).toBe(false);
    await a.close();
    expect((await b.read(scope))!.state.budget!.used).toBe(800);
  });

  it('a request under other limits (its key changed) is not admitted from the slice leased under the old', async () => {
    const scope = 'team/sliced-change';
    const store = new LimitStore(kvA);
    stack.defer(() => store.close());
    const first = await store.admit(scope, generous, { id: 'c1', tokens: 10, replica: 'gw-a', leaseMs: 60_000 });
    expect(first.headers['x-ratelimit-limit-requests']).toBe('1000000');
    const changed = { ...generous, requestsPerMinute: 500_000 };
    const second = await store.admit(scope, changed, { id: 'c2', tokens: 10, replica: 'gw-a', leaseMs: 60_000 });
    expect(second.headers['x-ratelimit-limit-requests']).toBe('500000');
    await store.settle(scope, generous, 'c1', 10);
    await store.settle(scope, changed, 'c2', 10);
    await store.flush();
    expect((await store.read(scope))!.state).toMatchObject({ reservations: {}, budget: { used: 20 } });
  });
});

/**
 * The KV-backed session broker against a real `magus_sessions`-shaped bucket: warm hits from the
 * watch mirror, freshness margin, shared cold starts and abort accounting (a broker without first
 * turns), and the entry-lease protocol's first turns, renewals and moves against a
 * `magus_pools`-shaped bucket, with two gateway replicas where it matters.
 */
import type { KV, NatsConnection } from 'nats';
import type { PoolEntry, SessionEntry } from '../../../shared/serving';
import { isolation, natsConnect } from '../../../test/harness';
import { readyModel } from '../../../test/harness/gateway-app';
import { QueueWaits } from '../queue-waits';
import { SessionCache } from './cache';
import { ORPHAN_ADOPT_GRACE_MS, ORPHAN_SWEEP_GRACE_MS } from './placement';
import type { AcquireRequest, FirstTurns } from './types';
import { sessionErrorType, SessionErrorType, type SessionError } from '../../plugins/errors';
import { sleep, until } from '../../../test/harness/wait';

const iso = isolation();
const bucket = `${iso.natsPrefix}_sessions`;
const poolsBucket = `${iso.natsPrefix}_pools`;
const model = readyModel('tiny');
const enc = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));
const entry = (instance: string, ttlMs = 600_000): SessionEntry => ({ subject: `magus.req.p.${instance}`, pool: 'p', instance, expiresAt: Date.now() + ttlMs });

let nc: NatsConnection;
let kv: KV;
let pools: KV;
let cache: SessionCache | undefined;
let other: SessionCache | undefined;

beforeAll(async () => {
  nc = await natsConnect();
  kv = await nc.jetstream().views.kv(bucket);
  pools = await nc.jetstream().views.kv(poolsBucket);
});
afterEach(async () => {
  await cache?.close();
  await other?.close();
  cache = other = undefined;
});
afterAll(async () => {
  await (await nc.jetstreamManager()).streams.delete(`KV_${bucket}`);
  await (await nc.jetstreamManager()).streams.delete(`KV_${poolsBucket}`);
  await nc.drain();
});

const req = (conversationKey: string, signal = new AbortController().signal): AcquireRequest => ({ conversationKey, model, owner: 't', signal });

it('loads existing entries before ready, follows updates and deletes, skips malformed ones', async () => {
  await kv.put('k-existing', enc(entry('a')));
  await kv.put('k-malformed', enc({ nope: true }));
  cache = new SessionCache({ kv, coldStart: () => Promise.reject(new Error('no cold starts here')) });
  await cache.ready;
  expect(cache.cache.live).toBe(true);
  expect((await cache.acquire(req('k-existing'))).instance).toBe('a');
  expect(cache.cache.get('k-malformed')).toBeUndefined();
  await kv.put('k-existing', enc(entry('b')));
  await until('the update mirrored', () => cache!.cache.get('k-existing')?.instance === 'b', 10_000);
  await kv.delete('k-existing');
  await until('the delete mirrored', () => cache!.cache.get('k-existing') === undefined, 10_000);
  await expect(cache.acquire(req('k-existing'))).rejects.toThrow('no cold starts here');
  expect(cache.stats()).toEqual({
    warmHits: 1,
    coldStarts: 1,
    firstTurns: 0,
    moves: 0,
    renewals: 0,
    givenBack: 0,
    staleViewPicks: 0,
    pendingSessionStarts: 0,
    refusedForPendingStarts: 0,
    queueMoves: 0,
    refusedForQueueWait: 0,
    orphansAdopted: 0,
    orphansSwept: 0,
  });
});

it('does not use a lease that ends within the freshness margin', async () => {
  await kv.put('k-ending', enc(entry('old', 2_000)));
  const cold: string[] = [];
  cache = new SessionCache({ kv, freshnessMarginMs: 5_000, coldStart: (r) => (cold.push(r.conversationKey), Promise.resolve(entry('new'))) });
  await cache.ready;
  expect((await cache.acquire(req('k-ending'))).instance).toBe('new');
  expect(cold).toEqual(['k-ending']);
  expect((await cache.acquire(req('k-ending'))).instance).toBe('new'); // the cold start's entry is kept
  expect(cold).toHaveLength(1);
});

it('concurrent first turns share one cold start', async () => {
  let calls = 0;
  cache = new SessionCache({
    kv,
    coldStart: async () => {
      calls++;
      await sleep(100);
      return entry('shared');
    },
  });
  await cache.ready;
  const got = await Promise.all([1, 2, 3].map(() => cache!.acquire(req('k-concurrent'))));
  expect(got.map((e) => e.instance)).toEqual(['shared', 'shared', 'shared']);
  expect(calls).toBe(1);
  expect(cache.stats().coldStarts).toBe(1);
});

it('aborts a shared cold start only when every waiter has gone', async () => {
  let coldSignal: AbortSignal | undefined;
  cache = new SessionCache({
    kv,
    coldStart: (r) =>
      new Promise((_, reject) => {
        coldSignal = r.signal;
        r.signal.addEventListener('abort', () => reject(new Error('cold start aborted')));
      }),
  });
  await cache.ready;
  const a = new AbortController();
  const b = new AbortController();
  const pa = cache.acquire(req('k-abort', a.signal));
  const pb = cache.acquire(req('k-abort', b.signal));
  a.abort(new Error('client a left'));
  await expect(pa).rejects.toThrow('client a left');
  expect(coldSignal!.aborted).toBe(false);
  b.abort(new Error('client b left'));
  await expect(pb).rejects.toThrow('client b left');
  expect(coldSignal!.aborted).toBe(true);
});

describe('the entry-lease protocol: first turns, renewals and moves', () => {
  const poolKey = `${model.namespace}.${model.name}`;
  const publishPool = (instances: string[], leasesPerInstance: number, extra: Partial<PoolEntry> = {}) =>
    pools.put(
      poolKey,
      enc({
        instances: instances.map((instance) => ({ instance, subject: `magus.req.tiny.${instance}`, leases: 0 })),
        leasesPerInstance,
        updatedAt: Date.now(),
        ...extra,
      } satisfies PoolEntry),
    );
  /** A conversation some gateway placed on `instance`. */
  const placed = (instance: string, over: Partial<SessionEntry> = {}): SessionEntry => ({
    subject: `magus.req.tiny.${instance}`,
    pool: 'tiny',
    namespace: 'default',
    instance,
    expiresAt: Date.now() + 600_000,
    placedAt: Date.now(),
    ...over,
  });
  const adopted: { key: string; entry: SessionEntry }[] = [];
  const demands: number[] = [];
  const firstTurns = (over: Partial<FirstTurns> = {}): FirstTurns => ({
    sessions: kv,
    ttlMs: 600_000,
    adopt: (r, e) => {
      adopted.push({ key: r.conversationKey, entry: e });
      return Promise.resolve();
    },
    demand: (_m, waiting) => {
      demands.push(waiting);
      return Promise.resolve();
    },
    ...over,
  });
  const noCold = () => Promise.reject(new Error('unexpected cold start'));
  let n = 0;
  /** Keys unique to each case (the bucket is shared by the file). */
  const key = (what: string) => `k-${what}-${++n}`;
  beforeEach(async () => {
    adopted.length = 0;
    demands.length = 0;
    // Listed first, then purged: purging while the listing runs ends it early.
    const keys: string[] = [];
    for await (const k of await kv.keys()) keys.push(k);
    for (const k of keys) await kv.purge(k);
  });
  const stored = async (k: string) => {
    const e = await kv.get(k);
    return e?.operation === 'PUT' ? (JSON.parse(new TextDecoder().decode(e.value)) as SessionEntry) : undefined;
  };
  const start = async (over: Partial<FirstTurns> = {}) => {
    const c = new SessionCache({ kv, pools, coldStart: noCold, firstTurns: firstTurns(over), renewWithinMs: 300_000, renewIntervalMs: 1000 });
    await c.ready;
    return c;
  };
  /** A cache that ranks by queue waits (a wait budget of `budgetMs`), ready, and the waits its bridges' beats go to. */
  const startWithWaits = async (budgetMs: number) => {
    const waits = new QueueWaits(budgetMs);
    const c = new SessionCache({ kv, pools, coldStart: noCold, firstTurns: firstTurns(), waits });
    await c.ready;
    return { c, waits };
  };

  it('NATS not answering a first turn’s create or a renewal: Unavailable (a 503 with Retry-After), not a failure of the request', async () => {
    await publishPool(['i1'], 4);
    const down = Object.assign(new Error('TIMEOUT'), { code: 'TIMEOUT' });
    const writer = Object.assign(Object.create(kv) as KV, { create: () => Promise.reject(down), update: () => Promise.reject(down) });
    cache = await start({ sessions: writer });
    const first = await cache.acquire(req(key('down'))).catch((e: unknown) => e);
    expect(first).toMatchObject({ name: 'SessionError', type: SessionErrorType.Unavailable });
    expect((first as Error).message).toMatch(/entry could not be created: TIMEOUT/);
    expect(sessionErrorType(first)).toBe(SessionErrorType.Unavailable);
    expect(adopted).toEqual([]);
  });

  it('picks the instance with the fewest live entries (every replica’s), creates the entry and starts its session; the next turn is warm', async () => {
    await publishPool(['i1', 'i2', 'i3'], 4);
    for (const [k, i] of [
      ['a', 'i1'],
      ['b', 'i1'],
      ['c', 'i3'],
    ] as const)
      await kv.put(`other-${k}`, enc(placed(i)));
    cache = await start();
    expect(cache.leasesOn('default', 'tiny', 'i1')).toBe(2);
    const k = key('first');
    const got = await cache.acquire(req(k));
    expect(got).toMatchObject({ instance: 'i2', subject: 'magus.req.tiny.i2', pool: 'tiny', namespace: 'default' });
    expect(got.placedAt).toBeGreaterThan(Date.now() - 5000);
    expect(got.expiresAt).toBeGreaterThan(Date.now() + 500_000);
    const { revision: _r, ...written } = got as SessionEntry & { revision?: number };
    expect(await stored(k)).toEqual(written);
    expect(adopted.map((a) => a.key)).toEqual([k]);
    expect(cache.stats()).toMatchObject({ warmHits: 0, coldStarts: 0, firstTurns: 1 });
    expect((await cache.acquire(req(k))).instance).toBe('i2');
    expect(cache.stats()).toMatchObject({ warmHits: 1, firstTurns: 1 });
    expect(adopted).toHaveLength(1);
  });

  it('a first turn not answered (refused, failed, left) gives its entry back and starts no session; an answered one starts it only then', async () => {
    await publishPool(['i1'], 10);
    cache = await start();
    const refusedKey = key('refused');
    let settleRefused!: (ok: boolean) => void;
    await cache.acquire({ ...req(refusedKey), answered: new Promise<boolean>((r) => (settleRefused = r)) });
    expect(await stored(refusedKey)).toBeDefined();
    expect(cache.leasesOn('default', 'tiny', 'i1')).toBe(1);
    settleRefused(false);
    for (let i = 0; i < 200 && (await stored(refusedKey)) !== undefined; i++) await sleep(10);
    expect(await stored(refusedKey)).toBeUndefined();
    await until('the refused lease released', () => cache!.leasesOn('default', 'tiny', 'i1') === 0, 10_000);
    expect(adopted).toEqual([]);
    expect(cache.stats().givenBack).toBe(1);

    const answeredKey = key('answered');
    let settleAnswered!: (ok: boolean) => void;
    await cache.acquire({ ...req(answeredKey), answered: new Promise<boolean>((r) => (settleAnswered = r)) });
    await sleep(100);
    expect(adopted).toEqual([]); // not before the answer
    settleAnswered(true);
    await until('the entry adopted', () => adopted.length === 1, 10_000);
    expect(adopted[0]!.key).toBe(answeredKey);
    expect(await stored(answeredKey)).toBeDefined();

    // Renewed meanwhile by another turn of the conversation: the entry lives on (compare-and-swap).
    const renewedKey = key('renewed');
    let settleRenewed!: (ok: boolean) => void;
    await cache.acquire({ ...req(renewedKey), answered: new Promise<boolean>((r) => (settleRenewed = r)) });
    const e = await kv.get(renewedKey);
    await kv.update(renewedKey, e!.value, e!.revision);
    settleRenewed(false);
    await sleep(300);
    expect(await stored(renewedKey)).toBeDefined();
  });

  it('answered conversations waiting for their session to start are bounded: beyond maxPendingSessionStarts a new one is refused (503), warm turns go on, and new ones are served again once sessions start', async () => {
    await publishPool(['i1'], 100);
    const waiting: (() => void)[] = [];
    const slowAdopt = (r: { conversationKey: string }, e: SessionEntry) =>
      new Promise<void>((resolve) => waiting.push(() => (adopted.push({ key: r.conversationKey, entry: e }), resolve())));
    cache = new SessionCache({ kv, pools, coldStart: noCold, firstTurns: firstTurns({ adopt: slowAdopt }), maxPendingSessionStarts: 3 });
    await cache.ready;
    const keys = [key('p'), key('p'), key('p')];
    for (const k of keys) await cache.acquire(req(k));
    expect(cache.stats()).toMatchObject({ firstTurns: 3, pendingSessionStarts: 3, refusedForPendingStarts: 0 });
    const refused = key('refused');
    const err = (await cache.acquire(req(refused)).catch((e: unknown) => e)) as SessionError;
    expect([err.name, err.type]).toEqual(['SessionError', 'Unavailable']);
    expect(err.message).toContain('3 conversations answered by this gateway still wait for their session workflow to start');
    expect(await stored(refused)).toBeUndefined(); // refused before its entry was written
    expect((await cache.acquire(req(keys[0]!))).instance).toBe('i1'); // a warm turn is not a new conversation
    expect(cache.stats()).toMatchObject({ pendingSessionStarts: 3, refusedForPendingStarts: 1, warmHits: 1 });
    waiting.shift()!();
    await until('two session starts pending', () => cache!.stats().pendingSessionStarts === 2, 10_000);
    expect((await cache.acquire(req(refused))).instance).toBe('i1');
    expect(cache.stats()).toMatchObject({ pendingSessionStarts: 3, firstTurns: 4 });
    for (const w of waiting.splice(0)) w();
    await until('no session start pending', () => cache!.stats().pendingSessionStarts === 0, 10_000);
    expect(adopted.map((a) => a.key).sort()).toEqual([...keys, refused].sort());
  });

  it('a replica sees the other’s entries: with every instance full it waits, tells the pool of the demand, and is served when an instance is added', async () => {
    await publishPool(['i1'], 2);
    cache = await start();
    other = await start();
    await cache.acquire(req(key('full')));
    await cache.acquire(req(key('full')));
    await until('the other replica counting both leases', () => other!.leasesOn('default', 'tiny', 'i1') === 2, 10_000);
    const waiting = other.acquire(req(key('waits')));
    await until('a demand of one', () => demands.includes(1), 10_000);
    expect(other.stats().coldStarts).toBe(1);
    await publishPool(['i1', 'i2'], 2);
    expect((await waiting).instance).toBe('i2');
    // Its waiter gone, the replica withdraws its demand.
    await until('the demand back to zero', () => demands.at(-1) === 0, 10_000);
  });

  it('a pool at its maximum: every instance full still serves first turns, least-loaded first', async () => {
    await publishPool(['i1', 'i2'], 1, { growable: false });
    await kv.put('other-x', enc(placed('i1')));
    cache = await start();
    const got: string[] = [];
    for (let k = 0; k < 3; k++) got.push((await cache.acquire(req(key('atmax')))).instance);
    expect(got).toEqual(['i2', 'i1', 'i2']);
    expect(demands).toEqual([]);
  });

  it('a request of no conversation (route) goes to the least-loaded instance even when all are full, writes no entry and starts no session; with none serving it waits for one as a first turn does', async () => {
    await publishPool(['i1', 'i2'], 1);
    await kv.put('other-x', enc(placed('i1')));
    await kv.put('other-y', enc(placed('i2')));
    await kv.put('other-z', enc(placed('i2')));
    cache = await start();
    await until('both instances counted', () => cache!.leasesOn('default', 'tiny', 'i2') === 2, 10_000);
    const signal = new AbortController().signal;
    const routed = await cache.route({ model, signal });
    expect(routed).toMatchObject({ instance: 'i1', subject: 'magus.req.tiny.i1', pool: 'tiny', namespace: 'default' });
    expect(routed.expiresAt).toBeLessThanOrEqual(Date.now());
    const keys: string[] = [];
    for await (const k of await kv.keys()) keys.push(k);
    expect(keys.sort()).toEqual(['other-x', 'other-y', 'other-z']);
    expect(adopted).toEqual([]);
    expect(demands).toEqual([]);

    await publishPool([], 1);
    await sleep(300); // the watch delivers the empty view
    const waiting = cache.route({ model, signal });
    await until('a demand of one', () => demands.includes(1), 10_000);
    await publishPool(['i3'], 1);
    expect((await waiting).instance).toBe('i3');
    expect(adopted).toEqual([]);
  });

  it('two gateways racing on one conversation: one entry, one session, one answer each', async () => {
    await publishPool(['i1', 'i2'], 10);
    cache = await start();
    other = await start();
    // Make the two replicas' picks differ: this one sent a conversation to i1 a moment ago.
    expect((await cache.acquire(req(key('warmup')))).instance).toBe('i1');
    const k = key('race');
    const [a, b] = await Promise.all([cache.acquire(req(k)), other.acquire(req(k))]);
    expect(a.instance).toBe(b.instance);
    expect((await stored(k))?.instance).toBe(a.instance);
    expect(adopted.filter((x) => x.key === k)).toHaveLength(1);
  });

  it('a conversation whose instance the pool no longer publishes moves once (compare-and-swap), whichever replica takes its next turn', async () => {
    await publishPool(['i1', 'i2'], 10);
    const k = key('move');
    await kv.put(k, enc(placed('i1', { placedAt: Date.now() - 1000 })));
    cache = await start();
    other = await start();
    await publishPool(['i2', 'i3'], 10); // i1 lost
    await until(
      'both replicas seeing the moved instance',
      () => cache!.pools!.get(poolKey)?.instances[0]?.instance === 'i2' && other!.pools!.get(poolKey)?.instances[0]?.instance === 'i2',
      10_000,
    );
    const [a, b] = await Promise.all([cache.acquire(req(k)), other.acquire(req(k))]);
    expect(a.instance).not.toBe('i1');
    expect(b.instance).toBe(a.instance);
    expect((await stored(k))?.instance).toBe(a.instance);
    expect((cache.stats().moves ?? 0) + (other.stats().moves ?? 0)).toBe(1);
    expect(adopted).toEqual([]); // its session lives on: a move starts none
  });

  it('an instance lost with 100 conversations on it: each moves once, none lost or doubled, across two replicas taking their turns at once', async () => {
    await publishPool(['i1', 'i2', 'i3'], 1000);
    const keys = Array.from({ length: 100 }, (_, k) => key(`lost-${k}`));
    await Promise.all(keys.map((k) => kv.put(k, enc(placed('i1', { placedAt: Date.now() - 1000 })))));
    cache = await start();
    other = await start();
    await until(
      'both replicas counting 100 leases',
      () => cache!.leasesOn('default', 'tiny', 'i1') === 100 && other!.leasesOn('default', 'tiny', 'i1') === 100,
      10_000,
    );
    await publishPool(['i2', 'i3'], 1000); // i1 lost
    await until(
      'both replicas seeing two instances',
      () => cache!.pools!.get(poolKey)?.instances.length === 2 && other!.pools!.get(poolKey)?.instances.length === 2,
      10_000,
    );
    // Every conversation's next turn, on both replicas at once (the same turn retried elsewhere, or two clients).
    const [a, b] = await Promise.all([Promise.all(keys.map((k) => cache!.acquire(req(k)))), Promise.all(keys.map((k) => other!.acquire(req(k))))]);
    for (let k = 0; k < keys.length; k++) {
      expect([keys[k], a[k]!.instance]).toEqual([keys[k], b[k]!.instance]);
      expect(['i2', 'i3']).toContain(a[k]!.instance);
      expect((await stored(keys[k]!))?.instance).toBe(a[k]!.instance);
    }
    expect((cache.stats().moves ?? 0) + (other.stats().moves ?? 0)).toBe(100);
    // Spread over what is left, and no conversation started anew (no session started for a move).
    expect(cache.leasesOn('default', 'tiny', 'i2') + cache.leasesOn('default', 'tiny', 'i3')).toBe(100);
    expect(Math.abs(cache.leasesOn('default', 'tiny', 'i2') - cache.leasesOn('default', 'tiny', 'i3'))).toBeLessThanOrEqual(20);
    expect(adopted).toEqual([]);
  });

  it('answers a lost instance handed back together spread evenly over the others by their place, whichever replica moves each; without one, each replica spreads its own', async () => {
    await publishPool(['i1', 'i2', 'i3'], 4);
    cache = await start();
    other = await start();
    await until('both replicas see the pool', () => cache!.instancesOf(model)?.length === 3 && other!.instancesOf(model)?.length === 3, 10_000);
    // i2's bridge handed back four answers (spread 0–3): three of them this replica's clients', one the other's.
    const movedTo = [
      cache.another(model, 'i2', { spread: 0 }),
      cache.another(model, 'i2', { spread: 1 }),
      other.another(model, 'i2', { spread: 2 }),
      cache.another(model, 'i2', { spread: 3 }),
    ].map((e) => e?.instance);
    expect(movedTo).toEqual(['i1', 'i3', 'i1', 'i3']);
    // Without a place (a bridge gone silent, an older bridge): each replica's own recent moves, so both may pick the same.
    const unplaced = [cache.another(model, 'i1')?.instance, other.another(model, 'i1')?.instance];
    expect(unplaced.every((i) => i === 'i2' || i === 'i3')).toBe(true);
    // No other instance: none.
    await publishPool(['i1'], 4);
    await until('the view shrank', () => cache!.instancesOf(model)?.length === 1, 10_000);
    expect(cache.another(model, 'i1', { spread: 0 })).toBeUndefined();
  });

  it('an entry of a brand-new instance the replica’s view does not list yet is not moved', async () => {
    await publishPool(['i1'], 10);
    cache = await start();
    const k = key('new-instance');
    await kv.put(k, enc(placed('i9', { placedAt: Date.now() + 5000 }))); // placed after the view it has
    await until('the entry mirrored', () => cache!.cache.get(k) !== undefined, 10_000);
    expect((await cache.acquire(req(k))).instance).toBe('i9');
    expect(cache.stats().moves).toBe(0);
  });

  it('renews a warm entry itself (compare-and-swap) once part of its TTL is used, at most once per interval; one near expiry is renewed before it is used', async () => {
    await publishPool(['i1'], 10);
    cache = await start();
    const k = key('renew');
    await kv.put(k, enc(placed('i1', { expiresAt: Date.now() + 400_000 })));
    await until('the entry mirrored', () => cache!.cache.get(k) !== undefined, 10_000);
    await cache.acquire(req(k)); // 400 s left of 600: not yet (renewWithin 300 s)
    expect(cache.stats().renewals).toBe(0);
    await kv.put(k, enc(placed('i1', { expiresAt: Date.now() + 200_000 })));
    await until('the shortened expiry mirrored', () => (cache!.cache.get(k)?.expiresAt ?? 0) < Date.now() + 250_000, 10_000);
    await cache.acquire(req(k));
    await cache.acquire(req(k));
    expect(cache.stats().renewals).toBe(1);
    await until('the renewal mirrored', () => (cache!.cache.get(k)?.expiresAt ?? 0) > Date.now() + 500_000, 10_000);
    expect((await stored(k))!.expiresAt).toBeGreaterThan(Date.now() + 500_000);
    // About to expire: renewed on the turn's path, same instance.
    const ending = key('ending');
    await kv.put(ending, enc(placed('i1', { expiresAt: Date.now() + 2000 })));
    await until('the ending entry mirrored', () => cache!.cache.get(ending) !== undefined, 10_000);
    const got = await cache.acquire(req(ending));
    expect(got.instance).toBe('i1');
    expect(got.expiresAt).toBeGreaterThan(Date.now() + 500_000);
    // Already expired (its session may have ended with it): renewed, and a session started for it again.
    const expired = key('expired');
    await kv.put(expired, enc(placed('i1', { expiresAt: Date.now() - 1000 })));
    await until('the expired entry mirrored', () => cache!.cache.get(expired) !== undefined, 10_000);
    expect((await cache.acquire(req(expired))).instance).toBe('i1');
    expect(adopted.map((a) => a.key)).toEqual([expired]);
  });

  it('a pinned conversation (no placedAt) near its expiry is renewed on its instance, never moved, never a cold start', async () => {
    await publishPool(['i1'], 10);
    const cold: string[] = [];
    cache = new SessionCache({ kv, coldStart: (r) => (cold.push(r.conversationKey), Promise.resolve(entry('cold'))), firstTurns: firstTurns(), pools });
    await cache.ready;
    const k = key('pinned');
    await kv.put(k, enc(entry('pinned-1', 2_000)));
    await until('the entry mirrored', () => cache!.cache.get(k) !== undefined, 10_000);
    const got = await cache.acquire(req(k));
    expect(got.instance).toBe('pinned-1'); // the view does not list it: a pinned entry stays
    expect(got.expiresAt).toBeGreaterThan(Date.now() + 60_000);
    expect(cold).toEqual([]);
  });

  it('a view its pool has not rewritten in time (an overloaded Temporal) still serves first turns, on the instances found consuming only, even while Temporal is unreachable', async () => {
    await publishPool(['i1', 'i2'], 4, { updatedAt: Date.now() - 4 * 60_000, growable: false });
    const asked: string[] = [];
    let i1Alive = true;
    cache = await start({
      reachable: () => false,
      alive: (_ns, _pool, instance) => {
        asked.push(instance);
        return Promise.resolve(instance === 'i1' && i1Alive);
      },
    });
    await until('the pool view mirrored', () => cache!.pools!.get(poolKey) !== undefined, 10_000);
    const placedOn = await Promise.all([1, 2, 3].map(async () => (await cache!.acquire(req(key('stale')))).instance));
    expect(placedOn).toEqual(['i1', 'i1', 'i1']);
    expect(cache.stats()).toMatchObject({ firstTurns: 3, staleViewPicks: 3, coldStarts: 0 });
    // Looked at once for the three turns (then at most once per interval), each instance once.
    expect(asked.sort()).toEqual(['i1', 'i2']);
    // Nothing found consuming: the view is not used, and with Temporal away the turn is refused (503) at once.
    await cache.close();
    i1Alive = false;
    cache = await start({ reachable: () => false, alive: () => Promise.resolve(false) });
    await until('the pool view mirrored', () => cache!.pools!.get(poolKey) !== undefined, 10_000);
    await expect(cache.acquire(req(key('dead')))).rejects.toMatchObject({ type: 'Unavailable' });
    // Rewritten by its pool: used as written again.
    await publishPool(['i2'], 4);
    await until('a fresh pool view', () => Date.now() - (cache!.pools!.get(poolKey)?.updatedAt ?? 0) < 60_000, 10_000);
    expect((await cache.acquire(req(key('fresh')))).instance).toBe('i2');
    expect(cache.stats().staleViewPicks).toBe(0);
  });

  it('a pool that cannot start anything refuses at once with its reason; one that stopped refreshing, or a malformed entry, is not picked from', async () => {
    await publishPool([], 4, { failing: 'no node fits 3 GiB', nextStartAt: Date.now() + 120_000 });
    cache = await start();
    await until('the pool failure mirrored', () => cache!.pools!.get(poolKey)?.failing !== undefined, 10_000);
    const refused = await cache.acquire(req(key('failing'))).then(
      () => undefined,
      (e: unknown) => e as { type?: string; message?: string },
    );
    expect(refused?.type).toBe('NoCapacity');
    expect(refused?.message).toMatch(/no node fits 3 GiB/);
    await cache.close();
    await pools.put(
      poolKey,
      enc({
        instances: [{ instance: 'i1', subject: 'magus.req.tiny.i1', leases: 0 }],
        leasesPerInstance: 5,
        updatedAt: Date.now() - 4 * 60_000,
      } satisfies PoolEntry),
    );
    cache = await start();
    const left = new AbortController();
    const stale = cache.acquire(req(key('stale'), left.signal));
    await until('a demand sent', () => demands.length > 0, 10_000);
    left.abort(new Error('client left'));
    await expect(stale).rejects.toThrow('client left');
    await cache.close();
    await pools.put(poolKey, enc({ instances: [{ instance: 'i1' }], leasesPerInstance: 0 }));
    cache = await start();
    expect(cache.pools!.get(poolKey)).toBeUndefined();
    expect(adopted).toEqual([]);
  });

  it('queue waits: turns go where the wait is within the budget, a warm one moves off a long queue, and with every queue too long a turn is refused with the soonest Retry-After and its pool told the demand', async () => {
    await publishPool(['i1', 'i2'], 100);
    const { c, waits } = await startWithWaits(2_000);
    cache = c;
    const load = (running: number, queued: number) => ({ running, slots: 1, queued, serviceMs: 1_000 });
    await until('the pool view mirrored', () => cache!.pools!.get(poolKey) !== undefined, 10_000);
    const warm = key('warm');
    await kv.put(warm, enc(placed('i1')));
    await until('the entry mirrored', () => cache!.cache.get(warm) !== undefined, 10_000);

    // i1: one running, two queued (3 s for one more); i2 idle. A first turn is counted at i2 and placed there.
    waits.beat('tiny.i1', load(1, 2));
    waits.beat('tiny.i2', load(0, 0));
    const first = key('first');
    expect(cache.queueAdmit(model, first)).toBeUndefined();
    expect(waits.waitMs('tiny', 'i2')).toBe(1_000); // counted there: the next one waits for its one slot
    expect((await cache.acquire(req(first))).instance).toBe('i2');

    // The warm conversation's instance is over the budget: admitted, counted at i2, and moved there by compare-and-swap.
    expect(cache.queueAdmit(model, warm)).toBeUndefined();
    const moved = await cache.acquire(req(warm));
    expect(moved.instance).toBe('i2');
    expect((await stored(warm))?.instance).toBe('i2');
    expect(cache.stats()).toMatchObject({ queueMoves: 1, moves: 1 });

    // Both over the budget (i1 3 s, i2 4 s): refused, retry when i1 is within it again (1 s), and the pool hears of it.
    waits.beat('tiny.i2', load(1, 3));
    const before = demands.length;
    expect(cache.queueAdmit(model, key('refused'))).toEqual({ retryAfterMs: 1_000, waitMs: 3_000, budgetMs: 2_000 });
    expect(cache.queueAdmit(model, warm)).toEqual({ retryAfterMs: 1_000, waitMs: 3_000, budgetMs: 2_000 });
    expect(cache.stats()).toMatchObject({ refusedForQueueWait: 2 });
    await until('the demand told', () => demands.slice(before).some((d) => d > 0), 5_000);

    // A bridge that says no load (older, or silent) bounds nothing.
    waits.beat('tiny.i1', undefined);
    expect(cache.queueAdmit(model, key('unknown'))).toBeUndefined();
  });

  it('queue waits: a warm turn moved off a long queue goes to an instance within the budget even when that one is past its leases — it never waits for a start', async () => {
    await publishPool(['i1', 'i2'], 1);
    const { c, waits } = await startWithWaits(2_000);
    cache = c;
    const warm = key('warm-full');
    await kv.put(warm, enc(placed('i1')));
    await kv.put(key('other'), enc(placed('i2')));
    await until('the view and entries mirrored', () => cache!.pools!.get(poolKey) !== undefined && cache!.leasesOn('default', 'tiny', 'i2') === 1, 10_000);
    waits.beat('tiny.i1', { running: 1, slots: 1, queued: 5, serviceMs: 1_000 });
    waits.beat('tiny.i2', { running: 0, slots: 1, queued: 0, serviceMs: 1_000 });
    const t0 = Date.now();
    expect((await cache.acquire(req(warm))).instance).toBe('i2');
    expect(Date.now() - t0).toBeLessThan(1_000);
    expect(demands).toEqual([]);
  });

  it('queue waits: answers handed back together spread by their place whatever the queues — only one instance within the budget (a roll’s new one) does not take them all', async () => {
    await publishPool(['i1', 'i2', 'i3', 'i4'], 4);
    const { c, waits } = await startWithWaits(2_000);
    cache = c;
    await until('the view mirrored', () => cache!.instancesOf(model)?.length === 4, 10_000);
    // i2 and i3 have long queues, i4 (just started) none; i1 stops and hands back four answers.
    waits.beat('tiny.i2', { running: 4, slots: 4, queued: 60, serviceMs: 8_000 });
    waits.beat('tiny.i3', { running: 4, slots: 4, queued: 60, serviceMs: 8_000 });
    waits.beat('tiny.i4', { running: 0, slots: 4, queued: 0, serviceMs: 8_000 });
    expect(waits.overBudget('tiny', 'i2') && waits.overBudget('tiny', 'i3') && !waits.overBudget('tiny', 'i4')).toBe(true);
    const movedTo = [0, 1, 2, 3].map((spread) => cache!.another(model, 'i1', { spread })?.instance);
    expect(movedTo).toEqual(['i2', 'i3', 'i4', 'i2']);
    // A turn, not a moved answer, still goes where the queue is short.
    waits.beat('tiny.i1', { running: 4, slots: 4, queued: 60, serviceMs: 8_000 });
    expect((await cache.acquire(req(key('new-turn')))).instance).toBe('i4');
  });

  it('answers handed back with nothing said go to the least full instance, counting those this gateway sent since; of equal ones, by their place', async () => {
    await publishPool(['i1', 'i2', 'i3', 'i4'], 4);
    const { c, waits } = await startWithWaits(0);
    cache = c;
    await until('the view mirrored', () => cache!.instancesOf(model)?.length === 4, 10_000);
    // i1 drains: i2 and i3 hold 3 per slot, i4 one (a drained instance back, its queue handed away).
    waits.beat('tiny.i2', { running: 4, slots: 4, queued: 8, serviceMs: 8_000 });
    waits.beat('tiny.i3', { running: 4, slots: 4, queued: 8, serviceMs: 8_000 });
    waits.beat('tiny.i4', { running: 4, slots: 4, queued: 0, serviceMs: 8_000 });
    const unsaid = (spread: number) => cache!.another(model, 'i1', { spread, byLoad: true })?.instance;
    // Eight to i4 (1 → 3 per slot), then by their place where all are equal.
    expect([0, 1, 2, 3, 4, 5, 6, 7].map(unsaid)).toEqual(Array(8).fill('i4'));
    expect([8, 9, 10].map(unsaid)).toEqual(['i4', 'i2', 'i3']);
    // Answers with part said still go by their place (a resume sequence each, whatever the queues).
    expect([0, 1, 2].map((spread) => cache!.another(model, 'i1', { spread })?.instance)).toEqual(['i2', 'i3', 'i4']);
    // One whose bridge said no load lately comes after those that did.
    waits.beat('tiny.i2', undefined);
    expect([0, 1, 2, 3].map((n) => unsaid(n + 11))).not.toContain('i2');
  });

  it('queue waits: a refusal’s Retry-After is the pool’s next instance when that comes sooner than a queue drains, paced by how long its starts took', async () => {
    const { c, waits } = await startWithWaits(2_000);
    cache = c;
    const t0 = Date.now();
    // A start seen from its beginning to its end: i2 listed starting since t0 − 4 s, then ready in a view written at t0.
    await publishPool(['i1'], 4, { starting: [{ instance: 'i2', since: t0 - 4_000 }], updatedAt: t0 - 4_000 });
    await until('the starting view mirrored', () => cache!.pools!.get(poolKey)?.starting !== undefined, 10_000);
    expect(cache.nextInstanceMs(model)).toBeUndefined(); // no start seen to its end yet
    await publishPool(['i1', 'i2'], 4, { updatedAt: t0 });
    await until('the ready view mirrored', () => cache!.pools!.get(poolKey)?.instances.length === 2, 10_000);
    // None starting: one refusal asks for, a whole start; at the pool's maximum, none.
    expect(cache.nextInstanceMs(model)).toBe(4_000);
    // Queues of 20 s: the next instance (4 s) comes first.
    waits.beat('tiny.i1', { running: 1, slots: 1, queued: 20, serviceMs: 1_000 });
    waits.beat('tiny.i2', { running: 1, slots: 1, queued: 20, serviceMs: 1_000 });
    expect(cache.queueAdmit(model, key('paced'))).toMatchObject({ retryAfterMs: 4_000 });
    // One starting since a second ago: about 3 s left (at least a second).
    await publishPool(['i1', 'i2'], 4, { starting: [{ instance: 'i3', since: Date.now() - 1_000 }] });
    await until('the next start mirrored', () => cache!.pools!.get(poolKey)?.starting?.[0]?.instance === 'i3', 10_000);
    const left = cache.nextInstanceMs(model)!;
    expect(left).toBeGreaterThanOrEqual(2_000);
    expect(left).toBeLessThanOrEqual(3_000);
    // Short queues (1 s past the budget): they come first.
    waits.beat('tiny.i1', { running: 1, slots: 1, queued: 2, serviceMs: 1_000 });
    expect(cache.queueAdmit(model, key('drains'))).toMatchObject({ retryAfterMs: 1_000 });
    // At its maximum with nothing starting: no next instance.
    await publishPool(['i1', 'i2'], 4, { growable: false });
    await until('the full view mirrored', () => cache!.pools!.get(poolKey)?.growable === false, 10_000);
    expect(cache.nextInstanceMs(model)).toBeUndefined();
  });

  it('orphans: a warm entry placed over a TTL ago that no session ever marked gets its session once; one expired 5 min ago is deleted by the sweep', async () => {
    await publishPool(['i1'], 100);
    cache = await start();
    const longAgo = Date.now() - (600_000 + ORPHAN_ADOPT_GRACE_MS + 1_000);
    const orphan = key('orphan');
    const watched = key('watched');
    const young = key('young');
    await kv.put(orphan, enc(placed('i1', { placedAt: longAgo })));
    await kv.put(watched, enc(placed('i1', { placedAt: longAgo, watched: true })));
    await kv.put(young, enc(placed('i1', { placedAt: Date.now() - 60_000 })));
    await until('the entries mirrored', () => [orphan, watched, young].every((k) => cache!.cache.get(k) !== undefined), 10_000);
    for (const k of [orphan, watched, young, orphan]) expect((await cache.acquire(req(k))).instance).toBe('i1');
    await until('the orphan adopted', () => adopted.length === 1, 5_000);
    expect(adopted.map((a) => a.key)).toEqual([orphan]); // once, and only the orphan
    expect(cache.stats()).toMatchObject({ orphansAdopted: 1, warmHits: 4 });

    // Expired 6 min ago and still there (nobody's session deleted it): swept from the bucket; 1 min ago: kept for its session.
    const stale = key('stale');
    const recent = key('recent');
    await kv.put(stale, enc(placed('i1', { expiresAt: Date.now() - ORPHAN_SWEEP_GRACE_MS - 60_000 })));
    await kv.put(recent, enc(placed('i1', { expiresAt: Date.now() - 60_000 })));
    await until('the expired entries mirrored', () => cache!.cache.get(stale) !== undefined && cache!.cache.get(recent) !== undefined, 10_000);
    cache.sweepNow();
    await until('the stale entry deleted', async () => (await stored(stale)) === undefined && cache!.stats().orphansSwept === 1, 5_000);
    expect(await stored(recent)).toBeDefined();
  });
});

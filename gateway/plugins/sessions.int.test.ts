/**
 * The KV-backed session broker against a real `magus_sessions`-shaped bucket: warm hits from the
 * watch mirror, freshness margin, shared cold starts, abort accounting and debounced renewals,
 * and first turns served from a `magus_pools`-shaped bucket.
 */
import type { KV, NatsConnection } from 'nats';
import type { PoolEntry, SessionEntry } from '../../shared/serving';
import { isolation, natsConnect } from '../../test/harness';
import { readyModel } from '../test-support';
import { createSessionCache, type AcquireRequest, type FirstTurns, type SessionCache } from './sessions';

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

const req = (conversationKey: string, signal = new AbortController().signal): AcquireRequest => ({ conversationKey, model, tokenId: 't', signal });

async function until(cond: () => boolean): Promise<void> {
  for (let i = 0; i < 500 && !cond(); i++) await new Promise((r) => setTimeout(r, 10));
  expect(cond()).toBe(true);
}

it('loads existing entries before ready, follows updates and deletes, skips malformed ones', async () => {
  await kv.put('k-existing', enc(entry('a')));
  await kv.put('k-malformed', enc({ nope: true }));
  cache = createSessionCache({ kv, coldStart: () => Promise.reject(new Error('no cold starts here')) });
  await cache.ready;
  expect(cache.cache.live).toBe(true);
  expect((await cache.acquire(req('k-existing'))).instance).toBe('a');
  expect(cache.cache.get('k-malformed')).toBeUndefined();
  await kv.put('k-existing', enc(entry('b')));
  await until(() => cache!.cache.get('k-existing')?.instance === 'b');
  await kv.delete('k-existing');
  await until(() => cache!.cache.get('k-existing') === undefined);
  await expect(cache.acquire(req('k-existing'))).rejects.toThrow('no cold starts here');
  expect(cache.stats()).toEqual({ warmHits: 1, coldStarts: 1, firstTurns: 0 });
});

it('does not use a lease that ends within the freshness margin', async () => {
  await kv.put('k-ending', enc(entry('old', 2_000)));
  const cold: string[] = [];
  cache = createSessionCache({ kv, freshnessMarginMs: 5_000, coldStart: (r) => (cold.push(r.conversationKey), Promise.resolve(entry('new'))) });
  await cache.ready;
  expect((await cache.acquire(req('k-ending'))).instance).toBe('new');
  expect(cold).toEqual(['k-ending']);
  expect((await cache.acquire(req('k-ending'))).instance).toBe('new'); // the cold start's entry is kept
  expect(cold).toHaveLength(1);
});

it('concurrent first turns share one cold start', async () => {
  let calls = 0;
  cache = createSessionCache({
    kv,
    coldStart: async () => {
      calls++;
      await new Promise((r) => setTimeout(r, 100));
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
  cache = createSessionCache({
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

it('renews a warm session at most once per interval, without waiting for it', async () => {
  await kv.put('k-renew', enc(entry('r')));
  const renewals: string[] = [];
  let now = Date.now();
  cache = createSessionCache({ kv, renewIntervalMs: 1_000, now: () => now, coldStart: () => Promise.reject(new Error('x')), renew: (r) => (renewals.push(r.conversationKey), new Promise(() => undefined)) });
  await cache.ready;
  for (let i = 0; i < 5; i++) await cache.acquire(req('k-renew'));
  expect(renewals).toEqual(['k-renew']);
  now += 1_001;
  await cache.acquire(req('k-renew'));
  expect(renewals).toEqual(['k-renew', 'k-renew']);
});

it('renews only once the entry has less than renewWithinMs left: a fresh entry needs no touch', async () => {
  let now = Date.now();
  await kv.put('k-half', enc({ ...entry('h'), expiresAt: now + 100_000 }));
  const renewals: string[] = [];
  cache = createSessionCache({ kv, renewIntervalMs: 1_000, renewWithinMs: 50_000, now: () => now, coldStart: () => Promise.reject(new Error('x')), renew: (r) => (renewals.push(r.conversationKey), Promise.resolve()) });
  await cache.ready;
  await cache.acquire(req('k-half'));
  now += 49_000; // 51 s left
  await cache.acquire(req('k-half'));
  expect(renewals).toEqual([]);
  now += 2_000; // 49 s left: renewed, then at most once per interval
  await cache.acquire(req('k-half'));
  await cache.acquire(req('k-half'));
  expect(renewals).toEqual(['k-half']);
  now += 1_001;
  await cache.acquire(req('k-half'));
  expect(renewals).toEqual(['k-half', 'k-half']);
});

describe('first turns from the pool’s published instances', () => {
  const poolKey = `${model.namespace}.${model.name}`;
  const publishPool = (instances: [string, number][], leasesPerInstance: number, growable?: boolean) =>
    pools.put(
      poolKey,
      enc({ instances: instances.map(([instance, leases]) => ({ instance, subject: `magus.req.tiny.${instance}`, leases })), leasesPerInstance, updatedAt: Date.now(), ...(growable === undefined ? {} : { growable }) } satisfies PoolEntry),
    );
  const adopted: { key: string; entry: SessionEntry }[] = [];
  const firstTurns = (): FirstTurns => ({
    pools,
    sessions: kv,
    ttlMs: 600_000,
    adopt: (r, e) => {
      adopted.push({ key: r.conversationKey, entry: e });
      return Promise.resolve();
    },
  });
  const noCold = () => Promise.reject(new Error('unexpected cold start'));
  beforeEach(() => {
    adopted.length = 0;
  });
  const stored = async (key: string) => JSON.parse(new TextDecoder().decode((await kv.get(key))!.value)) as SessionEntry;

  it('picks the least-loaded instance with room, creates the entry and has the workflow adopt it; no cold start', async () => {
    await publishPool([['i1', 2], ['i2', 0], ['i3', 1]], 4);
    cache = createSessionCache({ kv, coldStart: noCold, firstTurns: firstTurns() });
    await cache.ready;
    const got = await cache.acquire(req('k-first-1'));
    expect(got).toMatchObject({ instance: 'i2', subject: 'magus.req.tiny.i2', pool: 'tiny' });
    expect(got.expiresAt).toBeGreaterThan(Date.now() + 500_000);
    expect(await stored('k-first-1')).toEqual(got);
    expect(adopted).toEqual([{ key: 'k-first-1', entry: got }]);
    expect(cache.stats()).toEqual({ warmHits: 0, coldStarts: 0, firstTurns: 1 });
    // The next turn is warm (the entry is in the cache at once), and adopts nothing.
    expect(await cache.acquire(req('k-first-1'))).toEqual(got);
    expect(cache.stats()).toEqual({ warmHits: 1, coldStarts: 0, firstTurns: 1 });
    expect(adopted).toHaveLength(1);
  });

  it('counts its own picks until the pool publishes again, and goes cold when every instance is full', async () => {
    await publishPool([['i1', 0]], 2);
    const cold: string[] = [];
    cache = createSessionCache({ kv, coldStart: (r) => (cold.push(r.conversationKey), Promise.resolve(entry('from-temporal'))), firstTurns: firstTurns() });
    await cache.ready;
    expect((await cache.acquire(req('k-count-1'))).instance).toBe('i1');
    expect((await cache.acquire(req('k-count-2'))).instance).toBe('i1');
    expect((await cache.acquire(req('k-count-3'))).instance).toBe('from-temporal'); // i1 holds 2 of 2
    expect(cold).toEqual(['k-count-3']);
    // A new publication replaces the local counts: the pool has seen the two leases and added an instance.
    await publishPool([['i1', 2], ['i2', 0]], 2);
    await until(() => cache!.pools!.get(poolKey)?.instances.length === 2);
    expect((await cache.acquire(req('k-count-4'))).instance).toBe('i2');
  });

  it('a pool at its maximum: every instance full still serves first turns, least-loaded first (no cold start)', async () => {
    await publishPool([['i1', 3], ['i2', 2]], 2, false);
    cache = createSessionCache({ kv, coldStart: noCold, firstTurns: firstTurns() });
    await cache.ready;
    const got: string[] = [];
    for (let k = 0; k < 4; k++) got.push((await cache.acquire(req(`k-atmax-${k}`))).instance);
    // i2 (2) → i1 and i2 at 3 → i1 (the first of equals) → i2.
    expect(got).toEqual(['i2', 'i1', 'i2', 'i1']);
    expect(cache.stats()).toEqual({ warmHits: 0, coldStarts: 0, firstTurns: 4 });
    expect(adopted.map((a) => a.key)).toEqual(['k-atmax-0', 'k-atmax-1', 'k-atmax-2', 'k-atmax-3']);
    // The pool can grow again (an instance stopped): full instances send first turns to it.
    const cold: string[] = [];
    await cache.close();
    cache = createSessionCache({ kv, coldStart: (r) => (cold.push(r.conversationKey), Promise.resolve(entry('from-temporal'))), firstTurns: firstTurns() });
    await publishPool([['i1', 2], ['i2', 2]], 2, true);
    await cache.ready;
    await until(() => cache!.pools!.get(poolKey)?.growable === true);
    expect((await cache.acquire(req('k-atmax-growable'))).instance).toBe('from-temporal');
    expect(cold).toEqual(['k-atmax-growable']);
  });

  it('two gateways racing on one conversation agree on one instance (KV create decides)', async () => {
    await publishPool([['i1', 0], ['i2', 0]], 10);
    cache = createSessionCache({ kv, coldStart: noCold, firstTurns: firstTurns() });
    other = createSessionCache({ kv, coldStart: noCold, firstTurns: firstTurns() });
    await Promise.all([cache.ready, other.ready]);
    // Make the two gateways' picks differ: this one has already sent a conversation to i1.
    expect((await cache.acquire(req('k-race-warmup'))).instance).toBe('i1');
    const [a, b] = await Promise.all([cache.acquire(req('k-race')), other.acquire(req('k-race'))]);
    expect(a).toEqual(b);
    expect(await stored('k-race')).toEqual(a);
    // Only the winner adopts it.
    expect(adopted.filter((x) => x.key === 'k-race')).toHaveLength(1);
  });

  it('no published pool, or an existing entry that is about to expire: the cold path', async () => {
    const cold: string[] = [];
    cache = createSessionCache({ kv, coldStart: (r) => (cold.push(r.conversationKey), Promise.resolve(entry('from-temporal'))), firstTurns: { ...firstTurns(), pools } });
    await cache.ready;
    const unknown = { ...model, name: 'no-pool-yet' };
    expect((await cache.acquire({ ...req('k-nopool'), model: unknown })).instance).toBe('from-temporal');
    await publishPool([['i1', 0]], 5);
    await kv.put('k-ending', enc(entry('old', 2_000)));
    await until(() => cache!.cache.get('k-ending') !== undefined && cache!.pools!.get(poolKey) !== undefined);
    expect((await cache.acquire(req('k-ending'))).instance).toBe('from-temporal');
    expect(cold).toEqual(['k-nopool', 'k-ending']);
    expect(adopted).toEqual([]);
  });

  it('an entry its pool stopped refreshing (the pool is gone) is not picked from', async () => {
    await pools.put(poolKey, enc({ instances: [{ instance: 'i1', subject: 'magus.req.tiny.i1', leases: 0 }], leasesPerInstance: 5, updatedAt: Date.now() - 4 * 60_000 } satisfies PoolEntry));
    const cold: string[] = [];
    cache = createSessionCache({ kv, coldStart: (r) => (cold.push(r.conversationKey), Promise.resolve(entry('from-temporal'))), firstTurns: firstTurns() });
    await cache.ready;
    expect(cache.pools!.get(poolKey)?.instances).toHaveLength(1);
    expect((await cache.acquire(req('k-stale-pool'))).instance).toBe('from-temporal');
    expect(cold).toEqual(['k-stale-pool']);
    expect(adopted).toEqual([]);
  });

  it('a malformed pool entry is ignored (cold path), not trusted', async () => {
    await pools.put(poolKey, enc({ instances: [{ instance: 'i1' }], leasesPerInstance: 0 }));
    const cold: string[] = [];
    cache = createSessionCache({ kv, coldStart: (r) => (cold.push(r.conversationKey), Promise.resolve(entry('from-temporal'))), firstTurns: firstTurns() });
    await cache.ready;
    expect(cache.pools!.get(poolKey)).toBeUndefined();
    expect((await cache.acquire(req('k-malformed-pool'))).instance).toBe('from-temporal');
    expect(cold).toEqual(['k-malformed-pool']);
  });
});

/**
 * A session broker that holds only the conversations it serves (`recent`, what the gateway
 * process runs: mirror.ts `RecentSessions`), against a real `magus_sessions`-shaped bucket: ready
 * without replaying the bucket however many entries it holds; an entry another replica wrote is
 * read on first use and then kept current by the watch of updates (a move, a delete); at most
 * `maxEntries` held, the least recently used leaving; with its watch down it reads the bucket
 * rather than trust what it holds; lease counts come from the pool's view plus its own picks.
 */
import type { KV, NatsConnection } from 'nats';
import type { PoolEntry, SessionEntry } from '../../../shared/serving';
import { isolation, natsConnect } from '../../../test/harness';
import { readyModel } from '../../../test/harness/gateway-app';
import { until } from '../../../test/harness/wait';
import { SessionCache } from './cache';
import type { AcquireRequest, FirstTurns } from './types';

const iso = isolation();
const bucket = `${iso.natsPrefix}_recent_sessions`;
const poolsBucket = `${iso.natsPrefix}_recent_pools`;
const model = readyModel('tiny');
const poolKey = `${model.namespace}.${model.name}`;
const enc = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));
const placed = (instance: string): SessionEntry => ({
  subject: `magus.req.tiny.${instance}`,
  pool: 'tiny',
  namespace: 'default',
  instance,
  expiresAt: Date.now() + 600_000,
  placedAt: Date.now(),
});

let nc: NatsConnection;
let kv: KV;
let pools: KV;
let cache: SessionCache | undefined;
let reads = 0;

beforeAll(async () => {
  nc = await natsConnect();
  kv = await nc.jetstream().views.kv(bucket);
  pools = await nc.jetstream().views.kv(poolsBucket);
  const view: PoolEntry = {
    instances: ['i1', 'i2'].map((instance) => ({ instance, subject: `magus.req.tiny.${instance}`, leases: 7 })),
    leasesPerInstance: 1000,
    updatedAt: Date.now() - 1000,
    scalesOn: 'load',
  };
  await pools.put(poolKey, enc(view));
});
afterEach(async () => {
  await cache?.close();
  cache = undefined;
});
afterAll(async () => {
  await (await nc.jetstreamManager()).streams.delete(`KV_${bucket}`);
  await (await nc.jetstreamManager()).streams.delete(`KV_${poolsBucket}`);
  await nc.drain();
});

const req = (conversationKey: string): AcquireRequest => ({ conversationKey, model, owner: 't', signal: new AbortController().signal });

async function start(maxEntries: number): Promise<SessionCache> {
  const c = new SessionCache({
    kv,
    pools,
    firstTurns: { sessions: kv, ttlMs: 600_000, adopt: () => Promise.resolve(), demand: () => Promise.resolve() } satisfies FirstTurns,
    coldStart: () => Promise.reject(new Error('unexpected cold start')),
    recent: {
      maxEntries,
      read: (key) => {
        reads++;
        return kv.get(key);
      },
    },
  });
  await c.ready;
  await until('the pool view mirrored', () => c.pools!.get(poolKey) !== undefined, 10_000);
  return c;
}

it('is ready at once over 5,000 entries, holds none of them, and reads one on first use; the watch keeps it current after', async () => {
  for (let k = 0; k < 5_000; k += 500) await Promise.all(Array.from({ length: 500 }, (_, j) => kv.put(`bulk-${k + j}`, enc(placed('i1')))));
  const t0 = performance.now();
  cache = await start(100);
  expect(performance.now() - t0).toBeLessThan(2_000);
  expect(cache.cache.size).toBe(0);

  // Another replica's conversation: read once, then warm from what is held.
  await kv.put('theirs', enc(placed('i1')));
  const r0 = reads;
  expect((await cache.acquire(req('theirs'))).instance).toBe('i1');
  expect((await cache.acquire(req('theirs'))).instance).toBe('i1');
  expect(reads - r0).toBe(1);
  expect(cache.stats().warmHits).toBe(2);

  // Moved by another replica: the watch brings the move; deleted: it is gone here too.
  await kv.put('theirs', enc(placed('i2')));
  await until('the move held', () => cache!.cache.get('theirs')?.instance === 'i2', 5_000);
  await kv.delete('theirs');
  await until('the delete held', () => cache!.cache.get('theirs') === undefined, 5_000);
  // Updates of conversations it does not hold are not kept.
  await kv.put('bulk-1', enc(placed('i2')));
  await kv.put('theirs-too', enc(placed('i2')));
  await until('the watch went past them', async () => (await cache!.acquire(req('theirs-too'))).instance === 'i2', 5_000);
  expect(cache.cache.get('bulk-1')).toBeUndefined();
});

it('holds at most maxEntries, the least recently used leaving; a first turn is placed and held', async () => {
  cache = await start(3);
  for (const k of ['a', 'b', 'c']) await kv.put(`lru-${k}`, enc(placed('i1')));
  for (const k of ['a', 'b', 'c']) await cache.acquire(req(`lru-${k}`));
  await cache.acquire(req('lru-a')); // a used again: b is now the oldest
  // b moved by another replica: the watch's update replaces it in place — an update is not a use.
  await kv.put('lru-b', enc(placed('i2')));
  await until('the update held', () => new Map(cache!.cache.entries()).get('lru-b')?.instance === 'i2', 5_000);
  const fresh = await cache.acquire(req('lru-new')); // a first turn: created, held
  expect(['i1', 'i2']).toContain(fresh.instance);
  expect([...cache.cache.entries()].map(([k]) => k).sort()).toEqual(['lru-a', 'lru-c', 'lru-new']);
  expect((await kv.get('lru-new'))?.operation).toBe('PUT');
});

it('counts leases from the pool’s view plus its own picks since; a watch re-opened (a reconnect) resumes after the last update it saw, and what it holds is answered meanwhile', async () => {
  cache = await start(100);
  const before = cache.leasesOn('default', 'tiny', 'i1') + cache.leasesOn('default', 'tiny', 'i2');
  expect(before).toBe(14); // the view's 7 + 7
  await cache.acquire(req('counted'));
  expect(cache.leasesOn('default', 'tiny', 'i1') + cache.leasesOn('default', 'tiny', 'i2')).toBe(15);

  await kv.put('held', enc(placed('i1')));
  await cache.acquire(req('held'));
  const r0 = reads;
  // Re-opened as after a reconnect, and written while the new watch is being opened (the write
  // reaches the server before its consumer does): the watch resumes after the last update it saw.
  cache.cache.reopen();
  await kv.put('held', enc(placed('i2')));
  expect(['i1', 'i2']).toContain((await cache.acquire(req('held'))).instance); // held: answered meanwhile, not read
  await until('the write made during the gap held', () => cache!.cache.live && cache!.cache.get('held')?.instance === 'i2', 5_000);
  expect(reads - r0).toBe(0); // never read again: the watch brought every change
});

it('a stream that started over (a server on ephemeral storage came back empty): what it held is forgotten and read again, not resumed past', async () => {
  cache = await start(100);
  await kv.put('before-wipe', enc(placed('i1')));
  expect((await cache.acquire(req('before-wipe'))).instance).toBe('i1');
  // The bucket's stream gone and made again: its sequence starts over, below what the watch saw.
  await (await nc.jetstreamManager()).streams.delete(`KV_${bucket}`);
  kv = await nc.jetstream().views.kv(bucket);
  await kv.put('before-wipe', enc(placed('i2')));
  cache.cache.reopen();
  await until('what it held forgotten', () => cache!.cache.live && cache!.cache.get('before-wipe') === undefined, 10_000);
  expect((await cache.acquire(req('before-wipe'))).instance).toBe('i2');
});

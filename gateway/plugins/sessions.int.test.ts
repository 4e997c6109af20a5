/**
 * The KV-backed session broker against a real `magus_sessions`-shaped bucket: warm hits from the
 * watch mirror, freshness margin, shared cold starts, abort accounting and debounced renewals.
 */
import type { KV, NatsConnection } from 'nats';
import type { SessionEntry } from '../../shared/serving';
import { isolation, natsConnect } from '../../test/harness';
import { readyModel } from '../test-support';
import { createSessionCache, type AcquireRequest, type SessionCache } from './sessions';

const iso = isolation();
const bucket = `${iso.natsPrefix}_sessions`;
const model = readyModel('tiny');
const enc = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));
const entry = (instance: string, ttlMs = 600_000): SessionEntry => ({ subject: `magus.req.p.${instance}`, pool: 'p', instance, expiresAt: Date.now() + ttlMs });

let nc: NatsConnection;
let kv: KV;
let cache: SessionCache | undefined;

beforeAll(async () => {
  nc = await natsConnect();
  kv = await nc.jetstream().views.kv(bucket);
});
afterEach(async () => {
  await cache?.close();
  cache = undefined;
});
afterAll(async () => {
  await (await nc.jetstreamManager()).streams.delete(`KV_${bucket}`);
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
  expect(cache.stats()).toEqual({ warmHits: 1, coldStarts: 1 });
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

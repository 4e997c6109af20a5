/** The KV mirror against a real bucket: what `reopen` (the gateway calls it after a reconnect) does. */
import type { KV, NatsConnection } from 'nats';
import { isolation, natsConnect } from '../test/harness';
import { until } from '../test/harness/wait';
import { watchKv } from './kv-mirror';

const iso = isolation();
const bucket = `${iso.natsPrefix}_mirror`;
const enc = (v: string) => new TextEncoder().encode(v);
let nc: NatsConnection;
let kv: KV;

beforeAll(async () => {
  nc = await natsConnect();
  kv = await nc.jetstream().views.kv(bucket);
});
afterAll(async () => {
  await (await nc.jetstreamManager()).streams.delete(`KV_${bucket}`);
  await nc.drain();
});

it('reopen: a new watch at once (no restart delay), the map rebuilt from the server, reads served meanwhile', async () => {
  await kv.put('a', enc('1'));
  const errors: unknown[] = [];
  // A restart delay no test would wait out: only reopen can bring the watch back in time.
  const cache = watchKv<string>(kv, { decode: (e) => e.string(), onError: (err) => errors.push(err), restartDelayMs: 600_000 });
  try {
    await cache.ready;
    cache.set('only-here', 'x'); // put ahead of the watch; the server never had it
    cache.reopen();
    expect(cache.live).toBe(false);
    expect(cache.get('a')).toBe('1'); // the old map serves until the new one is complete
    await until('the new watch live', () => cache.live);
    expect(cache.get('only-here')).toBeUndefined();
    expect(cache.get('a')).toBe('1');
    await kv.put('b', enc('2'));
    await until('b in the mirror', () => cache.get('b') === '2');
    expect(errors).toEqual([]);
  } finally {
    await cache.close();
  }
});

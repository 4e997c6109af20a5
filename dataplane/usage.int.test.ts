/**
 * dataplane/usage.ts against a real `magus_usage` bucket (the file's own data plane): declared on
 * file for 400 days; a record is written once per request id, by whichever of two writers (two
 * connections, as a bridge and its take-over) comes first, 32 times at once; read back by key, by
 * start time, and from an empty ledger; values that are not records are skipped; a request a
 * gateway gave up on reads as its client was told, whichever of gateway and bridge wrote first.
 */
import { StorageType, type KV, type StreamConfig } from 'nats';
import type { UsageRecord } from '../shared/usage';
import { isolation } from '../test/harness';
import { natsStack, TestStack } from '../test/harness/stack';
import { USAGE_RETENTION_MS } from './declare';
import { UsageLedger, usageKeyOf } from './usage';

const iso = isolation();
const stack = new TestStack();
let a: UsageLedger;
let b: UsageLedger;
let kv: KV;
let bucketConfig: StreamConfig;

beforeAll(async () => {
  const { nc, names } = await stack.open(natsStack(iso, { declare: true }));
  const { nc: other } = await stack.open(natsStack(iso));
  a = await UsageLedger.open(nc.jetstream(), names);
  b = await UsageLedger.open(other.jetstream(), names);
  kv = await nc.jetstream().views.kv(names.usageBucket, { bindOnly: true });
  ({ config: bucketConfig } = await (await nc.jetstreamManager()).streams.info(`KV_${names.usageBucket}`));
});
afterAll(() => stack.close());

const DAY = 24 * 3600_000;
const T0 = Date.UTC(2026, 10, 28, 23, 59, 0);
const record = (id: string, key: string, start: number, completion = 5): UsageRecord => ({
  id,
  key,
  model: 'default/demo',
  kind: 'chat',
  start,
  end: start + 1000,
  outcome: 'completed',
  tokens: { prompt: 10, cached: 2, completion, total: 10 + completion },
  reported: true,
});

it('ensureDataPlane declares the bucket: file, history 1, kept 400 days', () => {
  expect(bucketConfig).toMatchObject({ storage: StorageType.File, max_msgs_per_subject: 1, max_age: USAGE_RETENTION_MS * 1e6, num_replicas: 1 });
});

it('an empty ledger reads as no records (the read ends)', async () => {
  await expect(a.read()).resolves.toEqual([]);
  await expect(a.read({ key: 'nobody/at-all' })).resolves.toEqual([]);
});

it('a request id is recorded once: 32 writes at once from two writers, one written, the first value kept', async () => {
  const writes = Array.from({ length: 32 }, (_, i) => (i % 2 ? a : b).record(record('req-once', 'team-a/chat', T0, i)));
  const results = await Promise.all(writes);
  expect(results.filter((r) => r === 'written')).toHaveLength(1);
  expect(results.filter((r) => r === 'existed')).toHaveLength(31);
  const stored = await a.read({ key: 'team-a/chat' });
  expect(stored).toHaveLength(1);
  expect(stored[0]!.tokens.completion).toBe(results.indexOf('written'));
  // Later, another delivery of the same request writes nothing.
  await expect(b.record(record('req-once', 'team-a/chat', T0, 99))).resolves.toBe('existed');
});

it('read by key and by start time; keys with any characters stay apart', async () => {
  await a.record(record('req-2', 'team-a/chat', T0 + 90_000)); // the next UTC day
  await a.record(record('req-3', 'team-b/chat', T0));
  await a.record(record('req-4', 'config/a.b*c>', T0 + 2 * DAY));
  expect((await a.read({ key: 'team-a/chat' })).map((r) => r.id).sort()).toEqual(['req-2', 'req-once']);
  expect((await a.read({ key: 'team-a/chat', since: T0 + 1000 })).map((r) => r.id)).toEqual(['req-2']);
  expect((await a.read({ since: T0 + 1000, until: T0 + DAY })).map((r) => r.id)).toEqual(['req-2']);
  expect((await b.read({ key: 'config/a.b*c>' })).map((r) => r.id)).toEqual(['req-4']);
  expect((await b.read()).map((r) => r.id).sort()).toEqual(['req-2', 'req-3', 'req-4', 'req-once']);
  expect(usageKeyOf(record('req-2', 'team-a/chat', T0 + 90_000))).toBe(`${Buffer.from('team-a/chat').toString('base64url')}.2026-11-29.req-2`);
});

it('a value that is not a record is skipped by readers', async () => {
  await kv.put(`${Buffer.from('team-c/x').toString('base64url')}.2026-11-28.junk`, new TextEncoder().encode('{"id":"junk"}'));
  await a.record(record('req-5', 'team-c/x', T0));
  expect((await a.read({ key: 'team-c/x' })).map((r) => r.id)).toEqual(['req-5']);
});

describe('a request the gateway gave up on (recordRefusal): the ledger says what its client was told', () => {
  const refusal = (id: string): UsageRecord => ({
    ...record(id, 'team-d/chat', T0),
    outcome: 'failed',
    error: 'publish_failed',
    tokens: { prompt: 0, cached: 0, completion: 0, total: 0 },
    reported: false,
  });

  it('the gateway first: its record stands, the bridge writes none', async () => {
    await expect(a.recordRefusal(refusal('req-told-1'))).resolves.toBe('written');
    await expect(b.record(record('req-told-1', 'team-d/chat', T0))).resolves.toBe('existed');
    await expect(a.recordRefusal(refusal('req-told-1'))).resolves.toBe('existed'); // its own retry
  });

  it('the bridge first, completed: a correction beside it, once, read in its place', async () => {
    await b.record(record('req-told-2', 'team-d/chat', T0, 7));
    await expect(a.recordRefusal(refusal('req-told-2'))).resolves.toBe('corrected');
    await expect(a.recordRefusal(refusal('req-told-2'))).resolves.toBe('corrected'); // a retry writes no second one
    const read = (await b.read({ key: 'team-d/chat' })).filter((r) => r.id === 'req-told-2');
    expect(read).toHaveLength(1);
    expect(read[0]).toMatchObject({
      outcome: 'failed',
      error: 'publish_failed',
      tokens: { total: 0 },
      corrects: { outcome: 'completed', tokens: { completion: 7, total: 17 } },
    });
    expect(await kv.get(`${usageKeyOf(read[0]!)}.told`)).not.toBeNull();
  });

  it('the bridge first, cancelled with the tokens made before the gateway gave up (its cancel came mid-answer): corrected', async () => {
    await b.record({ ...record('req-told-3', 'team-d/chat', T0, 2), outcome: 'cancelled', error: 'client_closed' });
    await expect(a.recordRefusal(refusal('req-told-3'))).resolves.toBe('corrected');
    expect((await a.read({ key: 'team-d/chat' })).find((r) => r.id === 'req-told-3')).toMatchObject({
      outcome: 'failed',
      tokens: { total: 0 },
      corrects: { outcome: 'cancelled', tokens: { completion: 2, total: 12 } },
    });
  });

  it('the bridge first, failed with no tokens: it says what the client was told; nothing to correct', async () => {
    await b.record({ ...refusal('req-told-4'), error: 'no_instance' });
    await expect(a.recordRefusal(refusal('req-told-4'))).resolves.toBe('existed');
    expect(await kv.get(`${usageKeyOf(refusal('req-told-4'))}.told`)).toBeNull();
    expect((await a.read({ key: 'team-d/chat' })).find((r) => r.id === 'req-told-4')).toMatchObject({ outcome: 'failed', error: 'no_instance' });
  });
});

/**
 * The controller's checkpoint of the ledger's sums (usage-status.ts `UsageCheckpoint`, KV
 * `magus_usage_sums`) against a real nats-server: a restart reads the ledger from the cursor on
 * and counts each record once — after a clean stop, after a crash between writing a sum and the
 * cursor, and when two controllers write at once; a ledger made anew (the cursor past its last
 * record) is counted again from the month's start.
 */
import type { CustomObjectsApi } from '@kubernetes/client-node';
import type { KV, NatsConnection } from 'nats';
import type { DataPlaneNames } from '../dataplane';
import { UsageLedger } from '../dataplane/usage';
import type { UsageRecord } from '../shared/usage';
import { isolation, natsConnectAs } from '../test/harness';
import { natsStack, TestStack } from '../test/harness/stack';
import { startUsageStatus, type PeriodSums, type UsageStatus } from './usage-status';

const iso = isolation();
const stack = new TestStack();
let nc: NatsConnection;
/** The controller's connection (its role's user): what the usage writer runs on. */
let ctl: NatsConnection;
let names: DataPlaneNames;
let ledger: UsageLedger;
let sumsKv: KV;
const logs: string[] = [];

beforeAll(async () => {
  ({ nc, names } = await stack.open(natsStack(iso, { declare: true })));
  ledger = await UsageLedger.open(nc.jetstream(), names);
  sumsKv = await nc.jetstream().views.kv(names.usageSumsBucket, { bindOnly: true });
  ctl = await natsConnectAs('controller', names);
  stack.defer(() => ctl.drain());
});
afterAll(() => stack.close());

const NOW = Date.now();
const DAY = new Date(NOW).toISOString().slice(0, 10);
let n = 0;
const record = (key: string, total: number, model = 'default/demo'): UsageRecord => ({
  id: `r-${(n += 1)}`,
  key,
  model,
  kind: 'chat',
  start: NOW - 1000,
  end: NOW - 500,
  outcome: 'completed',
  tokens: { prompt: total - 1, cached: 0, completion: 1, total },
  reported: true,
});

/** A usage writer over the test's ledger that writes no ApiKey (none are listed): only the checkpoint. */
const start = (): Promise<UsageStatus> =>
  startUsageStatus({
    js: ctl.jetstream(),
    bucket: names.usageBucket,
    sumsBucket: names.usageSumsBucket,
    custom: {} as CustomObjectsApi,
    apikeys: () => [],
    intervalMs: 3_600_000, // flushed by the test
    log: (l) => logs.push(l),
  });

const stored = async (key: string, period = DAY): Promise<PeriodSums | undefined> => {
  const e = await sumsKv.get(`${Buffer.from(key).toString('base64url')}.${period}`);
  return e?.operation === 'PUT' ? e.json<PeriodSums>() : undefined;
};
const cursor = async (): Promise<number | undefined> => (await sumsKv.get('cursor'))?.json<{ seq: number }>().seq;
const lastSeq = async (): Promise<number> => (await (await nc.jetstreamManager()).streams.info(`KV_${names.usageBucket}`)).state.last_seq;

/** Flushes until the sums of `key` hold `requests` (the consumer reads the ledger in the background). */
async function settledAt(s: UsageStatus, key: string, requests: number): Promise<PeriodSums> {
  for (let i = 0; i < 200; i++) {
    await s.flush();
    const e = await stored(key);
    if (e?.all.requests === requests && (await cursor()) === (await lastSeq())) return e;
    await new Promise((r) => setTimeout(r, 25));
  }
  throw new Error(`the sums of ${key} never held ${requests} requests: ${JSON.stringify(await stored(key))}`);
}

test('a restart reads on from the cursor and counts each record once, a crash between a sum and the cursor too', async () => {
  for (const t of [10, 20, 30]) await ledger.record(record('team/a', t));
  await ledger.record(record('team/a', 5, 'team/phi'));
  let s = await start();
  const first = await settledAt(s, 'team/a', 4);
  expect(first.all.totalTokens).toBe(65);
  expect(first.models).toEqual({
    'default/demo': { requests: 3, promptTokens: 57, completionTokens: 3, totalTokens: 60 },
    'team/phi': { requests: 1, promptTokens: 4, completionTokens: 1, totalTokens: 5 },
  });
  expect((await stored('team/a', DAY.slice(0, 7)))?.all.requests).toBe(4);
  await s.stop();

  // Stopped cleanly; two more records; started again, from the cursor on: 5, not 4 and not 9.
  expect(logs).toContain("usage: reading the ledger from the month's start (" + `${DAY.slice(0, 7)}-01T00:00:00.000Z) on`);
  const stoppedAt = (await cursor())!;
  expect(stoppedAt).toBe(await lastSeq());
  await ledger.record(record('team/a', 1));
  await ledger.record(record('team/b', 7));
  s = await start();
  expect(logs.at(-1)).toBe(`usage: reading the ledger from record ${stoppedAt + 1} on (where the checkpoint of its sums left it)`);
  expect((await settledAt(s, 'team/a', 5)).all.totalTokens).toBe(66);
  expect((await stored('team/b'))?.all.totalTokens).toBe(7);
  await s.stop();

  // A crash after a sum was written and before the cursor: the sum holds a record the cursor does not.
  const before = (await cursor())!;
  await ledger.record(record('team/a', 100));
  const seq = await lastSeq();
  const crashed = (await stored('team/a'))!;
  const withIt: PeriodSums = {
    ...crashed,
    all: { ...crashed.all, requests: 6, promptTokens: crashed.all.promptTokens + 99, completionTokens: crashed.all.completionTokens + 1, totalTokens: 166 },
    seq,
  };
  await sumsKv.put(`${Buffer.from('team/a').toString('base64url')}.${DAY}`, JSON.stringify(withIt));
  expect(await cursor()).toBe(before);
  s = await start();
  const after = await settledAt(s, 'team/a', 6);
  expect(after.all.totalTokens).toBe(166); // not 266
  // The month's sum was not written before the crash: it takes the record from the ledger.
  expect((await stored('team/a', DAY.slice(0, 7)))?.all.totalTokens).toBe(166);
  await s.stop();
}, 60_000);

test('two controllers at once (a leader handing over): the sums only move forward', async () => {
  const a = await start();
  const b = await start();
  await ledger.record(record('team/c', 3));
  await ledger.record(record('team/c', 4));
  await settledAt(a, 'team/c', 2);
  await settledAt(b, 'team/c', 2);
  await ledger.record(record('team/c', 5));
  await settledAt(a, 'team/c', 3);
  // b, behind or level, never writes its older sums over a's.
  await b.flush();
  expect((await stored('team/c'))?.all.totalTokens).toBe(12);
  await a.stop();
  await b.stop();
}, 60_000);

test('a cursor past the ledger’s last record (the ledger made anew) is dropped: counted again from the month’s start', async () => {
  await sumsKv.put('cursor', JSON.stringify({ seq: (await lastSeq()) + 1000 }));
  await sumsKv.put(
    `${Buffer.from('team/z').toString('base64url')}.${DAY}`,
    JSON.stringify({ all: { requests: 99, promptTokens: 0, completionTokens: 0, totalTokens: 99 }, models: {}, last: 0, seq: 1 }),
  );
  const s = await start();
  expect(logs.some((l) => l.includes('is past the ledger’s last record') || l.includes("is past the ledger's last record"))).toBe(true);
  expect(await stored('team/z')).toBeUndefined();
  // Everything the ledger holds is counted again, once.
  expect((await settledAt(s, 'team/a', 6)).all.totalTokens).toBe(166);
  await s.stop();
}, 60_000);

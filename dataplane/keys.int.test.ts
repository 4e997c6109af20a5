/**
 * dataplane/keys.ts against a real `magus_tokens` bucket (the file's own data plane): a token id
 * is registered once — taken by a free `create`, then changed or deleted by its owner only
 * (identity and uid); another owner is refused with the holder named and nothing written, also
 * when 32 owners race for one id; an older magus's entry (no uid) is adopted only when `adopts`
 * says so. A key's limits (entryLimits: checked, in one order) are rewritten when they change and
 * only then.
 */
import type { KV, NatsConnection } from 'nats';
import type { TokenEntry } from '../shared/serving';
import { isolation } from '../test/harness';
import { natsStack, TestStack } from '../test/harness/stack';
import { conflictMessage, describeKeyLimits, entryLimits, listKeys, registerKey, unregisterKey, type KeyOwnerRef } from './keys';

const iso = isolation();
const stack = new TestStack();
let nc: NatsConnection;
let kv: KV;

beforeAll(async () => {
  let names;
  ({ nc, names } = await stack.open(natsStack(iso, { declare: true })));
  kv = await nc.jetstream().views.kv(names.tokensBucket, { bindOnly: true });
});
afterAll(() => stack.close());

const decoder = new TextDecoder();

/** An entry of key `key` (uid `uid`) with a digest of its own. */
const entryOf = (key: string, uid: string, extra: Partial<TokenEntry> = {}): TokenEntry & KeyOwnerRef => ({
  digest: Buffer.from(`${key}#${uid}`.padEnd(32, '.').slice(0, 32)).toString('hex'),
  name: key,
  key,
  uid,
  origin: `apikey/${key}`,
  ...extra,
});

/** What the bucket holds under `id`: its bytes as text and revision, or undefined when absent or deleted. */
async function stored(id: string): Promise<{ text: string; revision: number } | undefined> {
  const e = await kv.get(id);
  return e && e.operation === 'PUT' ? { text: decoder.decode(e.value), revision: e.revision } : undefined;
}

it('a free id is written; the same entry again writes nothing; its owner changes it', async () => {
  const id = 'free-1';
  const a = entryOf('team/a', 'uid-a');
  expect(await registerKey(kv, id, a)).toEqual({ ok: true, written: true });
  const first = await stored(id);
  expect(first?.text).toBe(JSON.stringify(a));

  expect(await registerKey(kv, id, { ...a })).toEqual({ ok: true, written: false });
  expect(await stored(id)).toEqual(first); // same revision: not written again

  const changed = { ...a, models: ['team/*'], suspended: true };
  expect(await registerKey(kv, id, changed)).toEqual({ ok: true, written: true });
  const second = await stored(id);
  expect(second?.text).toBe(JSON.stringify(changed));
  expect(second!.revision).toBeGreaterThan(first!.revision);
});

it('another owner presenting a taken id is refused, told the holder, and writes nothing', async () => {
  const id = 'taken-1';
  const a = entryOf('team/a', 'uid-a');
  expect(await registerKey(kv, id, a)).toEqual({ ok: true, written: true });
  const before = await stored(id);

  // Another key, and the same key declared again (a new uid): both are other owners.
  for (const other of [entryOf('team/b', 'uid-b'), entryOf('team/a', 'uid-a2'), { ...entryOf('team/b', 'uid-a'), digest: a.digest }]) {
    const adopts = jest.fn(() => true); // adoption is for entries without a uid only
    expect(await registerKey(kv, id, other, adopts)).toEqual({ ok: false, holder: { key: 'team/a', origin: 'apikey/team/a' } });
    expect(adopts).not.toHaveBeenCalled();
    expect(await stored(id)).toEqual(before); // byte for byte, same revision
  }
});

it('32 owners racing for one id: exactly one wins, 31 are refused, the winner’s entry is stored', async () => {
  const id = 'race-1';
  const contenders = Array.from({ length: 32 }, (_, i) => entryOf(`race/k${i}`, `uid-${i}`));
  const lastSeq = async () => (await kv.status()).streamInfo.state.last_seq;
  const seqBefore = await lastSeq();
  const results = await Promise.all(contenders.map((e) => registerKey(kv, id, e)));
  const winners = results.flatMap((r, i) => (r.ok ? [i] : []));
  expect(winners).toHaveLength(1);
  const w = winners[0]!;
  expect(results[w]).toEqual({ ok: true, written: true });
  for (const [i, r] of results.entries()) if (i !== w) expect(r).toEqual({ ok: false, holder: { key: `race/k${w}`, origin: `apikey/race/k${w}` } });
  expect((await stored(id))?.text).toBe(JSON.stringify(contenders[w]));
  // One write in all (the bucket keeps one revision per key: its stream's sequence tells).
  expect(await lastSeq()).toBe(seqBefore + 1);
  expect((await stored(id))?.revision).toBe(seqBefore + 1);
});

it('unregister: another owner cannot; the owner can; then the id is free for another owner', async () => {
  const id = 'unreg-1';
  const a = entryOf('team/a', 'uid-a');
  const b = entryOf('team/b', 'uid-b');
  expect(await unregisterKey(kv, id, a)).toBe(false); // nothing there
  await registerKey(kv, id, a);
  const before = await stored(id);
  expect(await unregisterKey(kv, id, b)).toBe(false);
  expect(await unregisterKey(kv, id, { key: 'team/a', uid: 'uid-other' })).toBe(false);
  expect(await stored(id)).toEqual(before);

  expect(await unregisterKey(kv, id, { key: a.key, uid: a.uid })).toBe(true);
  expect(await stored(id)).toBeUndefined();
  expect(await unregisterKey(kv, id, a)).toBe(false); // already gone

  // Taken again after a delete (create over the delete marker), by anyone.
  expect(await registerKey(kv, id, b)).toEqual({ ok: true, written: true });
  expect((await stored(id))?.text).toBe(JSON.stringify(b));
  expect(await registerKey(kv, id, a)).toMatchObject({ ok: false, holder: { key: 'team/b' } });
});

it('an entry an older magus wrote (no uid) is adopted only when adopts says so', async () => {
  const id = 'old-1';
  const old: TokenEntry = { digest: 'ab'.repeat(32), name: 'team a', origin: 'secret/ns/team-a' };
  await kv.put(id, JSON.stringify(old));
  const before = await stored(id);
  const mine = entryOf('ns/team-a', 'uid-1', { origin: 'secret/ns/team-a' });

  expect(await registerKey(kv, id, mine)).toEqual({ ok: false, holder: { origin: 'secret/ns/team-a' } }); // default: never adopted
  const declines = jest.fn((e: TokenEntry) => e.origin === 'secret/ns/other');
  expect(await registerKey(kv, id, mine, declines)).toEqual({ ok: false, holder: { origin: 'secret/ns/team-a' } });
  expect(declines).toHaveBeenCalledWith(old);
  expect(await stored(id)).toEqual(before);

  expect(await registerKey(kv, id, mine, (e) => e.origin === mine.origin)).toEqual({ ok: true, written: true });
  expect((await stored(id))?.text).toBe(JSON.stringify(mine));
  // Adopted, it has an owner: another key with an adopts that says yes is refused now.
  expect(await registerKey(kv, id, entryOf('ns/team-b', 'uid-2', { origin: 'secret/ns/team-a' }), () => true)).toEqual({
    ok: false,
    holder: { key: 'ns/team-a', origin: 'secret/ns/team-a' },
  });

  // An entry that is not JSON belongs to nobody who may write: refused, left alone.
  await kv.put('garbage-1', 'not json');
  expect(await registerKey(kv, 'garbage-1', mine, () => true)).toEqual({ ok: false, holder: {} });
  expect((await stored('garbage-1'))?.text).toBe('not json');
  expect(await unregisterKey(kv, 'garbage-1', mine)).toBe(false);
});

it('listKeys: every JSON entry with its id and revision, sorted; deleted and non-JSON ones left out', async () => {
  const listed = await listKeys(kv);
  const ids = listed.map((k) => k.id);
  expect(ids).toEqual([...ids].sort());
  expect(ids).toEqual(expect.arrayContaining(['free-1', 'taken-1', 'race-1', 'unreg-1', 'old-1']));
  expect(ids).not.toContain('garbage-1');
  for (const k of listed) expect(k.revision).toBe((await stored(k.id))!.revision);
  expect(listed.find((k) => k.id === 'unreg-1')?.entry).toMatchObject({ key: 'team/b', uid: 'uid-b' });
  await unregisterKey(kv, 'unreg-1', { key: 'team/b', uid: 'uid-b' });
  expect((await listKeys(kv)).map((k) => k.id)).not.toContain('unreg-1');
});

it('limits: a change rewrites the entry, the same limits in another order write nothing, none drops them', async () => {
  const id = 'limits-1';
  const limitsOf = (v: unknown) => {
    const r = entryLimits(v, 'spec.limits');
    if ('error' in r) throw new Error(r.error);
    return r.limits;
  };
  const a = entryOf('team/limited', 'uid-l', { limits: limitsOf({ requestsPerMinute: 5, budget: { tokens: 300, period: 'day' } }) });
  expect(await registerKey(kv, id, a)).toEqual({ ok: true, written: true });
  const first = await stored(id);
  expect(JSON.parse(first!.text)).toMatchObject({ limits: { requestsPerMinute: 5, budget: { tokens: 300, period: 'day' } } });

  // As an apiserver may hand them back: other key order, same limits.
  const reordered = entryOf('team/limited', 'uid-l', { limits: limitsOf({ budget: { period: 'day', tokens: 300 }, requestsPerMinute: 5 }) });
  expect(await registerKey(kv, id, reordered)).toEqual({ ok: true, written: false });
  expect(await stored(id)).toEqual(first);

  const raised = entryOf('team/limited', 'uid-l', { limits: limitsOf({ requestsPerMinute: 5, budget: { tokens: 600, period: 'day' } }) });
  expect(await registerKey(kv, id, raised)).toEqual({ ok: true, written: true });
  expect(JSON.parse((await stored(id))!.text)).toMatchObject({ limits: { budget: { tokens: 600 } } });

  // An empty object limits nothing: the entry has no limits.
  expect(limitsOf({})).toBeUndefined();
  // Models in one order, their limits too; a model with none is no limit.
  expect(
    JSON.stringify(limitsOf({ storageBytes: 9, models: { 'b/y': { concurrency: 1, requestsPerMinute: 2 }, 'a/x': { tokensPerMinute: 3 }, 'c/z': {} } })),
  ).toBe('{"models":{"a/x":{"tokensPerMinute":3},"b/y":{"requestsPerMinute":2,"concurrency":1}},"storageBytes":9}');
  expect(await registerKey(kv, id, entryOf('team/limited', 'uid-l', {}))).toEqual({ ok: true, written: true });
  expect(JSON.parse((await stored(id))!.text)).not.toHaveProperty('limits');
});

it('entryLimits names every field KeyLimits refuses, with why; describeKeyLimits says them in a few words', () => {
  const error = (v: unknown) => {
    const r = entryLimits(v, 'spec.limits');
    return 'error' in r ? r.error : undefined;
  };
  expect(error({ requestsPerMinute: 0 })).toBe('spec.limits.requestsPerMinute must be a whole number of requests per minute from 1 to 100000000000, got 0');
  expect(error({ concurrency: 1.5, tokensPerMinute: 'many' })).toBe(
    'spec.limits.tokensPerMinute must be a whole number of tokens per minute from 1 to 100000000000, got "many"; spec.limits.concurrency must be a whole number from 1 to 1000000, got 1.5',
  );
  expect(error({ budget: { tokens: 5 } })).toBe('spec.limits.budget.period is required');
  expect(error({ budget: { tokens: 5, period: 'week' } })).toBe('spec.limits.budget.period must be one of day, month, got "week"');
  expect(error({ rpm: 5 })).toBe('spec.limits.rpm is not a limit');
  expect(error('lots')).toBe('spec.limits: Expected object, got "lots"');
  expect(error({ models: { 'team/llama': { concurrency: 0 }, llama: {} } })).toBe(
    'spec.limits.models.team/llama.concurrency must be a whole number from 1 to 1000000, got 0; spec.limits.models.llama: a model is named namespace/name',
  );
  expect(error({ storageBytes: -1 })).toBe('spec.limits.storageBytes must be a whole number of bytes from 1 to 1000000000000000, got -1');
  expect(entryLimits(undefined, 'x')).toEqual({ limits: undefined });

  expect(describeKeyLimits(undefined)).toBe('unlimited');
  expect(describeKeyLimits({})).toBe('unlimited');
  expect(describeKeyLimits({ budget: { tokens: 300, period: 'day' }, requestsPerMinute: 60 })).toBe('rpm 60, budget 300/day');
  expect(describeKeyLimits({ requestsPerMinute: 60, tokensPerMinute: 10000, concurrency: 4, budget: { tokens: 1000000, period: 'month' } })).toBe(
    'rpm 60, tpm 10000, concurrency 4, budget 1000000/month',
  );
  expect(describeKeyLimits({ concurrency: 4, storageBytes: 1000, models: { 'team/llama': { requestsPerMinute: 5 } } })).toBe(
    'concurrency 4, storage 1000 bytes; team/llama: rpm 5',
  );
  expect(describeKeyLimits({ models: { 'team/llama': { requestsPerMinute: 5 } } })).toBe('team/llama: rpm 5');
});

it('conflictMessage names the holder only when it is visible to the reader', () => {
  const visible = conflictMessage('abc', { key: 'ns-a/key-1', origin: 'apikey/ns-a/key-1' }, (k) => k.startsWith('ns-a/'));
  expect(visible).toContain("token id 'abc' is already registered to key ns-a/key-1");
  const hidden = conflictMessage('abc', { key: 'ns-b/key-2', origin: 'apikey/ns-b/key-2' }, (k) => k.startsWith('ns-a/'));
  expect(hidden).toContain('registered to a key in another namespace');
  expect(hidden).not.toContain('ns-b');
  expect(hidden).not.toContain('key-2');
  expect(conflictMessage('abc', { origin: 'secret/ns-b/x' }, () => true)).toContain('registered to a key an older magus registered');
  for (const m of [visible, hidden]) expect(m).toContain('give this key a token with a new random id');
});

/** dataplane/meter.ts's signatures: what a change of any signed field, another key or a malformed signature does. */
import { randomBytes } from 'node:crypto';
import type { UsageRecord } from '../shared/usage';
import { meterSignature, signedBy, type MeterKey } from './meter';

const key: MeterKey = { id: 'k1', secret: randomBytes(32) };
const record: UsageRecord = {
  id: 'req-1',
  key: 'team/a',
  model: 'default/demo',
  kind: 'chat',
  start: 1_796_000_000_000,
  end: 1_796_000_001_000,
  outcome: 'completed',
  tokens: { prompt: 10, cached: 0, completion: 5, total: 15 },
  reported: true,
};

it('a record signed with the key verifies, whatever its tokens and outcome (the bridge reports those)', () => {
  const signed = { ...record, sig: meterSignature(key, record) };
  expect(signed.sig).toMatch(/^k1\.[A-Za-z0-9_-]{43}$/);
  expect(signedBy(key, signed)).toBe(true);
  expect(signedBy(key, { ...signed, tokens: { prompt: 1, cached: 0, completion: 1, total: 2 }, outcome: 'failed' } as UsageRecord)).toBe(true);
});

it.each([
  ['id', { id: 'req-2' }],
  ['key', { key: 'team/b' }],
  ['model', { model: 'default/other' }],
  ['kind', { kind: 'embeddings' as const }],
  ['start', { start: record.start + 1 }],
])('a record whose %s changed after signing does not', (_, change) => {
  expect(signedBy(key, { ...record, sig: meterSignature(key, record), ...change })).toBe(false);
});

it('nor one with no signature, a malformed one, another key’s, or when no key is known', () => {
  const other: MeterKey = { id: 'k2', secret: randomBytes(32) };
  const sig = meterSignature(key, record);
  expect(signedBy(key, record)).toBe(false);
  for (const bad of ['', 'k1', 'k1.', 'k1.AAAA', `k2.${sig.slice(3)}`, sig.replace('k1.', 'k1.x')]) expect(signedBy(key, { ...record, sig: bad })).toBe(false);
  expect(signedBy(key, { ...record, sig: meterSignature({ id: 'k1', secret: other.secret }, record) })).toBe(false);
  expect(signedBy(other, { ...record, sig })).toBe(false);
  expect(signedBy(undefined, { ...record, sig })).toBe(false);
});

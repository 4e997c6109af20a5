import type { UsageRecord } from '../shared/usage';
import { UsageSums } from './usage-status';

const at = (iso: string) => Date.parse(iso);
const record = (key: string, start: string, total: number, end = start): UsageRecord => ({
  id: `${key}-${start}-${total}`,
  key,
  model: 'default/demo',
  kind: 'chat',
  start: at(start),
  end: at(end),
  outcome: 'completed',
  tokens: { prompt: total - 1, cached: 0, completion: 1, total },
  reported: true,
});

describe('UsageSums', () => {
  const sums = new UsageSums();
  sums.add(record('team-a/chat', '2026-11-29T23:59:59Z', 10, '2026-11-30T00:00:01Z'));
  sums.add(record('team-a/chat', '2026-11-30T00:00:00Z', 5));
  sums.add(record('team-a/chat', '2026-12-01T00:00:00Z', 7));
  sums.add(record('team-b/chat', '2026-11-30T12:00:00Z', 100));

  it('sums per key, UTC day (of the start) and month', () => {
    expect(sums.of('team-a/chat', '2026-11-29')).toEqual({ requests: 1, promptTokens: 9, completionTokens: 1, totalTokens: 10 });
    expect(sums.of('team-a/chat', '2026-11-30')).toEqual({ requests: 1, promptTokens: 4, completionTokens: 1, totalTokens: 5 });
    expect(sums.of('team-a/chat', '2026-11')).toEqual({ requests: 2, promptTokens: 13, completionTokens: 2, totalTokens: 15 });
    expect(sums.of('team-a/chat', '2026-12')).toEqual({ requests: 1, promptTokens: 6, completionTokens: 1, totalTokens: 7 });
    expect(sums.of('team-b/chat', '2026-11')?.totalTokens).toBe(100);
    expect(sums.of('team-c/chat', '2026-11')).toBeUndefined();
  });

  it('sums per model too', () => {
    const m = new UsageSums();
    m.add(record('k/a', '2026-11-30T00:00:00Z', 5));
    m.add({ ...record('k/a', '2026-11-30T01:00:00Z', 7), model: 'team/phi' });
    m.add(record('k/a', '2026-11-30T02:00:00Z', 3));
    expect([...m.byModel('k/a', '2026-11-30')]).toEqual([
      ['default/demo', { requests: 2, promptTokens: 6, completionTokens: 2, totalTokens: 8 }],
      ['team/phi', { requests: 1, promptTokens: 6, completionTokens: 1, totalTokens: 7 }],
    ]);
    expect(m.of('k/a', '2026-11')?.totalTokens).toBe(15);
    expect(m.byModel('k/b', '2026-11').size).toBe(0);
  });

  it('a record at or below the sequence a period’s sums hold is in them already: counted once', () => {
    const m = new UsageSums();
    m.load('k/a', '2026-11-30', { all: { requests: 1, promptTokens: 4, completionTokens: 1, totalTokens: 5 }, models: {}, last: 0, seq: 10 });
    m.add(record('k/a', '2026-11-30T00:00:00Z', 5), 10); // in the day's sums; the month's (none loaded) takes it
    m.add(record('k/a', '2026-11-30T00:00:01Z', 7), 11);
    expect(m.of('k/a', '2026-11-30')?.requests).toBe(2);
    expect(m.of('k/a', '2026-11')?.requests).toBe(2);
    expect(m.takeChanged().map(([k, p, e]) => [k, p, e.seq])).toEqual(
      expect.arrayContaining([
        ['k/a', '2026-11-30', 11],
        ['k/a', '2026-11', 11],
      ]),
    );
    expect(m.takeChanged()).toEqual([]);
  });

  it('a gateway’s correction replaces what its request’s record added: one request, its tokens gone', () => {
    const m = new UsageSums();
    const served = record('k/a', '2026-11-30T00:00:00Z', 12);
    m.add(record('k/a', '2026-11-30T00:00:01Z', 5), 1);
    m.add(served, 2);
    const told: UsageRecord = {
      ...served,
      outcome: 'failed',
      error: 'publish_failed',
      tokens: { prompt: 0, cached: 0, completion: 0, total: 0 },
      reported: false,
      corrects: { outcome: 'completed', tokens: served.tokens },
    };
    m.add(told, 3);
    m.add(told, 3); // read again (at or below the sums' sequence): not twice
    expect(m.of('k/a', '2026-11-30')).toEqual({ requests: 2, promptTokens: 4, completionTokens: 1, totalTokens: 5 });
    expect(m.byModel('k/a', '2026-11').get('default/demo')).toEqual({ requests: 2, promptTokens: 4, completionTokens: 1, totalTokens: 5 });
  });

  it('the last use is the latest end, whatever the order records came in', () => {
    expect(sums.lastUsed('team-a/chat')).toBe(at('2026-12-01T00:00:00Z'));
    sums.add(record('team-b/chat', '2026-11-30T11:00:00Z', 1));
    expect(sums.lastUsed('team-b/chat')).toBe(at('2026-11-30T12:00:00Z'));
  });

  it('prune keeps only the current day and month', () => {
    sums.prune(at('2026-12-01T08:00:00Z'));
    expect(sums.of('team-a/chat', '2026-11-30')).toBeUndefined();
    expect(sums.of('team-a/chat', '2026-11')).toBeUndefined();
    expect(sums.of('team-a/chat', '2026-12-01')?.totalTokens).toBe(7);
    expect(sums.of('team-a/chat', '2026-12')?.totalTokens).toBe(7);
  });
});

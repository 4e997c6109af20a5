/**
 * The usage ledger's pure parts: the tokens read from an engine's `usage` (missing, cached, a
 * total never below its parts), records summed per key, model and UTC day or month (across a
 * midnight, incomplete ones counted, the last use), CSV quoting, and a stored value that is not a
 * record refused.
 */
import { aggregateUsage, flatRecord, parseUsageRecord, periodOf, RECORD_COLUMNS, toCsv, usageIn, type UsageRecord } from './usage';

describe('usageIn', () => {
  it('is undefined without a usage, or without its prompt tokens', () => {
    expect(usageIn(undefined)).toBeUndefined();
    expect(usageIn(null)).toBeUndefined();
    expect(usageIn({})).toBeUndefined();
    expect(usageIn({ usage: null })).toBeUndefined();
    expect(usageIn({ usage: { completion_tokens: 5, total_tokens: 5 } })).toBeUndefined();
    expect(usageIn({ usage: { prompt_tokens: '7' } })).toBeUndefined();
  });

  it("reads the engine's numbers, cached tokens included", () => {
    expect(usageIn({ usage: { prompt_tokens: 7, completion_tokens: 3, total_tokens: 10 } })).toEqual({ prompt: 7, cached: 0, completion: 3, total: 10 });
    expect(usageIn({ usage: { prompt_tokens: 7, completion_tokens: 3, total_tokens: 10, prompt_tokens_details: { cached_tokens: 4 } } })).toEqual({
      prompt: 7,
      cached: 4,
      completion: 3,
      total: 10,
    });
    // An embedding's usage: no completion.
    expect(usageIn({ usage: { prompt_tokens: 12, total_tokens: 12 } })).toEqual({ prompt: 12, cached: 0, completion: 0, total: 12 });
  });

  it('never has a total below prompt + completion (a larger one is kept)', () => {
    expect(usageIn({ usage: { prompt_tokens: 7, completion_tokens: 3, total_tokens: 2 } })?.total).toBe(10);
    expect(usageIn({ usage: { prompt_tokens: 7, completion_tokens: 3 } })?.total).toBe(10);
    expect(usageIn({ usage: { prompt_tokens: 7, completion_tokens: 3, total_tokens: 11 } })?.total).toBe(11);
  });
});

const record = (over: Partial<UsageRecord>): UsageRecord => ({
  id: 'req',
  key: 'team-a/chat',
  model: 'default/demo',
  kind: 'chat',
  start: Date.UTC(2026, 10, 30, 23, 59, 0),
  end: Date.UTC(2026, 10, 30, 23, 59, 30),
  outcome: 'completed',
  tokens: { prompt: 10, cached: 2, completion: 5, total: 15 },
  reported: true,
  ...over,
});

describe('aggregateUsage', () => {
  // 2026-11-30T23:59 and 2026-12-01T00:00:30: two UTC days, two months.
  const beforeMidnight = record({ id: 'a' });
  const afterMidnight = record({ id: 'b', start: Date.UTC(2026, 11, 1, 0, 0, 30), end: Date.UTC(2026, 11, 1, 0, 0, 40) });
  const sameDay = record({ id: 'c', start: Date.UTC(2026, 10, 30, 8), end: Date.UTC(2026, 10, 30, 8, 0, 1), outcome: 'failed', error: 'engine_error' });
  const cancelled = record({
    id: 'd',
    start: Date.UTC(2026, 10, 30, 9),
    end: Date.UTC(2026, 10, 30, 9, 0, 2),
    outcome: 'cancelled',
    tokens: { prompt: 0, cached: 0, completion: 3, total: 3 },
    reported: false,
  });
  const otherModel = record({ id: 'e', model: 'default/qwen3' });
  const otherKey = record({ id: 'f', key: 'local/team-b' });
  const all = [afterMidnight, otherModel, beforeMidnight, cancelled, otherKey, sameDay];

  it('a record falls in the UTC day and month it started in', () => {
    expect(periodOf(beforeMidnight.start, 'day')).toBe('2026-11-30');
    expect(periodOf(afterMidnight.start, 'day')).toBe('2026-12-01');
    expect(periodOf(afterMidnight.start, 'month')).toBe('2026-12');
  });

  it('by day: one row per key, model and UTC day, sorted; incomplete ones counted; the last end', () => {
    expect(aggregateUsage(all, 'day')).toEqual([
      {
        key: 'local/team-b',
        model: 'default/demo',
        period: '2026-11-30',
        requests: 1,
        incomplete: 0,
        promptTokens: 10,
        cachedTokens: 2,
        completionTokens: 5,
        totalTokens: 15,
        lastUsed: otherKey.end,
      },
      // beforeMidnight, sameDay (failed), cancelled: one day.
      {
        key: 'team-a/chat',
        model: 'default/demo',
        period: '2026-11-30',
        requests: 3,
        incomplete: 2,
        promptTokens: 20,
        cachedTokens: 4,
        completionTokens: 13,
        totalTokens: 33,
        lastUsed: beforeMidnight.end,
      },
      {
        key: 'team-a/chat',
        model: 'default/demo',
        period: '2026-12-01',
        requests: 1,
        incomplete: 0,
        promptTokens: 10,
        cachedTokens: 2,
        completionTokens: 5,
        totalTokens: 15,
        lastUsed: afterMidnight.end,
      },
      {
        key: 'team-a/chat',
        model: 'default/qwen3',
        period: '2026-11-30',
        requests: 1,
        incomplete: 0,
        promptTokens: 10,
        cachedTokens: 2,
        completionTokens: 5,
        totalTokens: 15,
        lastUsed: otherModel.end,
      },
    ]);
  });

  it('by month: the midnight between November and December still splits the rows', () => {
    const rows = aggregateUsage(all, 'month').filter((r) => r.key === 'team-a/chat' && r.model === 'default/demo');
    expect(rows.map((r) => [r.period, r.requests, r.incomplete, r.totalTokens, r.lastUsed])).toEqual([
      ['2026-11', 3, 2, 33, beforeMidnight.end],
      ['2026-12', 1, 0, 15, afterMidnight.end],
    ]);
    // Within one month the days are one row.
    const november = aggregateUsage([beforeMidnight, sameDay, record({ id: 'g', start: Date.UTC(2026, 10, 1), end: Date.UTC(2026, 10, 1, 0, 0, 1) })], 'month');
    expect(november).toHaveLength(1);
    expect(november[0]).toMatchObject({ period: '2026-11', requests: 3, incomplete: 1, lastUsed: beforeMidnight.end });
  });

  it('the last use is the latest end, whatever the order of the records', () => {
    const late = record({ id: 'h', start: Date.UTC(2026, 10, 30, 1), end: Date.UTC(2026, 10, 30, 23, 59, 59) }); // started early, ended last
    expect(aggregateUsage([late, beforeMidnight], 'day')[0]!.lastUsed).toBe(late.end);
    expect(aggregateUsage([beforeMidnight, late], 'day')[0]!.lastUsed).toBe(late.end);
  });

  it('no records: no rows', () => {
    expect(aggregateUsage([], 'day')).toEqual([]);
  });
});

describe('toCsv', () => {
  it('quotes a field with a comma, a quote or a line break, and only those', () => {
    const rows = [
      { a: 'plain', b: 'with,comma', c: 'say "hi"' },
      { a: 'two\nlines', b: 'cr\rhere', c: 7 },
      { a: '', b: undefined, c: true },
    ];
    expect(toCsv(rows, ['a', 'b', 'c'])).toBe('a,b,c\nplain,"with,comma","say ""hi"""\n"two\nlines","cr\rhere",7\n,,true\n');
  });

  it('no rows: the header alone; columns in the order given', () => {
    expect(toCsv([] as { x: number; y: number }[], ['y', 'x'])).toBe('y,x\n');
    expect(toCsv([{ x: 1, y: 2 }], ['y', 'x'])).toBe('y,x\n2,1\n');
  });

  it('a flattened record has every record column, its times in ISO 8601', () => {
    const r = record({ error: 'deadline_exceeded', outcome: 'failed' });
    expect(Object.keys(flatRecord(r)).sort()).toEqual([...RECORD_COLUMNS].sort());
    expect(toCsv([flatRecord(r)], RECORD_COLUMNS)).toBe(
      'id,key,model,kind,start,end,outcome,error,promptTokens,cachedTokens,completionTokens,totalTokens,reported\n' +
        'req,team-a/chat,default/demo,chat,2026-11-30T23:59:00.000Z,2026-11-30T23:59:30.000Z,failed,deadline_exceeded,10,2,5,15,true\n',
    );
  });
});

describe('parseUsageRecord', () => {
  it('accepts a record', () => {
    const r = record({});
    expect(parseUsageRecord(JSON.parse(JSON.stringify(r)))).toEqual(r);
  });

  it.each([
    ['null', null],
    ['a string', 'req'],
    ['no id', { ...record({}), id: undefined }],
    ['a numeric key', { ...record({}), key: 7 }],
    ['no model', { ...record({}), model: undefined }],
    ['no tokens', { ...record({}), tokens: undefined }],
    ['a token count that is a string', { ...record({}), tokens: { prompt: '10', cached: 0, completion: 5, total: 15 } }],
    ['a negative token count', { ...record({}), tokens: { prompt: -1, cached: 0, completion: 5, total: 15 } }],
    ['a token count missing', { ...record({}), tokens: { prompt: 10, completion: 5, total: 15 } }],
    ['an infinite token count', { ...record({}), tokens: { prompt: Infinity, cached: 0, completion: 5, total: 15 } }],
    ['a start that is a date string', { ...record({}), start: '2026-11-30T23:59:00Z' }],
    ['no end', { ...record({}), end: undefined }],
    ['an unknown outcome', { ...record({}), outcome: 'done' }],
  ])('refuses %s', (_, value) => {
    expect(parseUsageRecord(value)).toBeUndefined();
  });
});

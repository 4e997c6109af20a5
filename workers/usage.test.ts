/**
 * `magus usage`' command line (parseUsageArgs: every flag, the times it reads — dates, date-times,
 * times ago — and the usage error naming the flag otherwise) and what it prints without NATS: the
 * aligned table with its total line, the records' lines, JSON and the CSV export.
 */
import { toCsv, type UsageRecord, type UsageRow } from '../shared/usage';
import { formatUsage, formatUsageRecords, formatUsageTable, noUsageLine, parseTime, parseUsageArgs, USAGE_USAGE } from './usage';

const NOW = Date.UTC(2026, 10, 29, 12, 0, 0); // 2026-11-29T12:00:00Z
const HOUR = 3600_000;

/** The message of the UsageError `args` raise. */
function usageError(args: string[]): string {
  try {
    parseUsageArgs(args, NOW);
  } catch (err) {
    expect((err as Error).name).toBe('UsageError');
    return (err as Error).message;
  }
  throw new Error(`no UsageError for ${JSON.stringify(args)}`);
}

describe('parseUsageArgs', () => {
  it('has defaults: every key, all time, rows per day, a table', () => {
    expect(parseUsageArgs([], NOW)).toEqual({ by: 'day', records: false, format: 'table' });
  });

  it('reads every flag', () => {
    expect(parseUsageArgs(['--key', 'team-a/chat', '--since', '2026-11-01', '--until', '2026-11-29T06:30:00Z', '--by', 'month', '--csv'], NOW)).toEqual({
      key: 'team-a/chat',
      since: Date.UTC(2026, 10, 1),
      until: Date.UTC(2026, 10, 29, 6, 30),
      by: 'month',
      records: false,
      format: 'csv',
    });
    expect(parseUsageArgs(['--records', '--json'], NOW)).toEqual({ by: 'day', records: true, format: 'json' });
    expect(parseUsageArgs(['--json', '--by', 'day'], NOW)).toEqual({ by: 'day', records: false, format: 'json' });
    expect(parseUsageArgs(['--records', '--csv'], NOW)).toEqual({ by: 'day', records: true, format: 'csv' });
    expect(parseUsageArgs(['--records'], NOW)).toEqual({ by: 'day', records: true, format: 'table' });
  });

  it('a bare key name is the local key; an identity, config/ID and anonymous stay as they are', () => {
    expect(parseUsageArgs(['--key', 'team-a'], NOW).key).toBe('local/team-a');
    expect(parseUsageArgs(['--key', 'local/team-a'], NOW).key).toBe('local/team-a');
    expect(parseUsageArgs(['--key', 'team-a/chat'], NOW).key).toBe('team-a/chat');
    expect(parseUsageArgs(['--key', 'config/0123abcd'], NOW).key).toBe('config/0123abcd');
    expect(parseUsageArgs(['--key', 'anonymous'], NOW).key).toBe('anonymous');
    expect(USAGE_USAGE).toContain('bare NAME for the local key local/NAME');
  });

  it('--since and --until: times ago count back from now', () => {
    expect(parseUsageArgs(['--since', '24h'], NOW).since).toBe(NOW - 24 * HOUR);
    expect(parseUsageArgs(['--since', '7d'], NOW).since).toBe(NOW - 7 * 24 * HOUR);
    expect(parseUsageArgs(['--since', '30m'], NOW).since).toBe(NOW - 30 * 60_000);
    expect(parseUsageArgs(['--since', '2d', '--until', '1d'], NOW)).toMatchObject({ since: NOW - 48 * HOUR, until: NOW - 24 * HOUR });
  });

  it.each([
    [['--key'], '--key needs a value'],
    [['--since'], '--since needs a value'],
    [['--until', '--json'], '--until needs a value'],
    [['--by'], '--by needs a value'],
    [['--key', 'a', '--key', 'b'], '--key is given twice'],
    [['--since', '1d', '--since', '2d'], '--since is given twice'],
    [['--by', 'week'], '--by must be day or month, got "week"'],
    [['--json', '--csv'], '--json and --csv: give one or the other'],
    [['--records', '--by', 'month'], '--by groups the rows; --records lists each request: give one or the other'],
    [['--verbose'], 'unknown option --verbose'],
    [['--key=team-a'], 'unknown option --key=team-a'],
    [['team-a'], 'unexpected argument "team-a"'],
    [['--key', ''], `--key must be a key identity (NAMESPACE/NAME, local/NAME) or a local key's NAME, got ""`],
    [['--key', 'team-a/'], `--key must be a key identity (NAMESPACE/NAME, local/NAME) or a local key's NAME, got "team-a/"`],
    [['--since', 'yesterday'], '--since must be a date (2026-11-29), a date-time (2026-11-29T10:00:00Z) or a time ago (30m, 24h, 7d), got "yesterday"'],
    [['--until', '2026-02-30'], '--until must be a date (2026-11-29), a date-time (2026-11-29T10:00:00Z) or a time ago (30m, 24h, 7d), got "2026-02-30"'],
    [['--since', '24'], '--since must be a date (2026-11-29), a date-time (2026-11-29T10:00:00Z) or a time ago (30m, 24h, 7d), got "24"'],
    [['--since', '2026-11-29', '--until', '2026-11-29'], '--since (2026-11-29T00:00:00Z) must be before --until (2026-11-29T00:00:00Z)'],
    [['--since', '1h', '--until', '2h'], '--since (2026-11-29T11:00:00Z) must be before --until (2026-11-29T10:00:00Z)'],
  ])('%j is a usage error: %s', (args, message) => {
    expect(usageError(args)).toBe(message);
  });
});

describe('parseTime', () => {
  it('reads dates as UTC midnight, date-times with or without an offset (UTC), and times ago', () => {
    expect(parseTime('2026-11-29', NOW)).toBe(Date.UTC(2026, 10, 29));
    expect(parseTime('2028-02-29', NOW)).toBe(Date.UTC(2028, 1, 29)); // a leap day
    expect(parseTime('2026-11-29T10:00', NOW)).toBe(Date.UTC(2026, 10, 29, 10));
    expect(parseTime('2026-11-29T10:00:05', NOW)).toBe(Date.UTC(2026, 10, 29, 10, 0, 5));
    expect(parseTime('2026-11-29T10:00:05.250Z', NOW)).toBe(Date.UTC(2026, 10, 29, 10, 0, 5, 250));
    expect(parseTime('2026-11-29T10:00:00+02:00', NOW)).toBe(Date.UTC(2026, 10, 29, 8));
    expect(parseTime('2026-11-29T01:00:00-03:30', NOW)).toBe(Date.UTC(2026, 10, 29, 4, 30));
    expect(parseTime('0m', NOW)).toBe(NOW);
    expect(parseTime('90m', NOW)).toBe(NOW - 90 * 60_000);
  });

  it.each([
    '',
    'now',
    '2026-11',
    '2026-02-29',
    '2026-13-01',
    '2026-11-31',
    '2026-11-29T24:00Z',
    '2026-11-29T10:60Z',
    '2026-11-29T10:00:61Z',
    '2026-11-29 10:00',
    '1w',
    '-1d',
    '1.5h',
    '24H',
    '2026-11-29T10:00+0200',
  ])('%j is not a time', (v) => {
    expect(parseTime(v, NOW)).toBeUndefined();
  });
});

const row = (over: Partial<UsageRow>): UsageRow => ({
  key: 'local/team-a',
  model: 'default/demo',
  period: '2026-11-29',
  requests: 1,
  incomplete: 0,
  promptTokens: 10,
  cachedTokens: 0,
  completionTokens: 5,
  totalTokens: 15,
  lastUsed: Date.UTC(2026, 10, 29, 10, 0, 1, 500),
  ...over,
});

describe('formatUsageTable', () => {
  it('aligns the columns (numbers to the right) and ends with the total line', () => {
    const rows = [
      row({ requests: 2, incomplete: 1, promptTokens: 20, cachedTokens: 4, completionTokens: 10, totalTokens: 30 }),
      row({
        key: 'team-b/chat',
        model: 'ns/llama-3-8b',
        period: '2026-11-30',
        requests: 1234,
        promptTokens: 100000,
        completionTokens: 5,
        totalTokens: 100005,
        lastUsed: Date.UTC(2026, 10, 30, 23, 59, 59),
      }),
    ];
    expect(formatUsageTable(rows).split('\n')).toEqual([
      'KEY           MODEL          PERIOD      REQUESTS  INCOMPLETE  PROMPT  CACHED  COMPLETION   TOTAL  LAST USED',
      'local/team-a  default/demo   2026-11-29         2           1      20       4          10      30  2026-11-29T10:00:01Z',
      'team-b/chat   ns/llama-3-8b  2026-11-30      1234           0  100000       0           5  100005  2026-11-30T23:59:59Z',
      'total                                        1236           1  100020       4          15  100035  2026-11-30T23:59:59Z',
      '',
    ]);
  });

  it('without rows: the header and a zero total', () => {
    expect(formatUsageTable([])).toBe(
      'KEY    MODEL  PERIOD  REQUESTS  INCOMPLETE  PROMPT  CACHED  COMPLETION  TOTAL  LAST USED\n' +
        'total                        0           0       0       0           0      0\n',
    );
  });
});

const record = (over: Partial<UsageRecord>): UsageRecord => ({
  id: 'req-1',
  key: 'local/team-a',
  model: 'default/demo',
  kind: 'chat',
  start: Date.UTC(2026, 10, 29, 10, 0, 0),
  end: Date.UTC(2026, 10, 29, 10, 0, 1),
  outcome: 'completed',
  tokens: { prompt: 10, cached: 2, completion: 5, total: 15 },
  reported: true,
  ...over,
});

describe('records and exports', () => {
  const records = [
    record({ id: 'req-2', start: Date.UTC(2026, 10, 30, 0, 0, 1), end: Date.UTC(2026, 10, 30, 0, 0, 2) }),
    record({ id: 'req-1', outcome: 'cancelled', error: 'client_closed', tokens: { prompt: 0, cached: 0, completion: 3, total: 3 }, reported: false }),
    record({ id: 'req-3', key: 'team-b/chat', kind: 'embeddings', start: Date.UTC(2026, 9, 31, 23, 0), end: Date.UTC(2026, 9, 31, 23, 0, 1) }),
  ];

  it('--records: one line per record, in order of start, under a header', () => {
    expect(formatUsageRecords(records).split('\n')).toEqual([
      'START                 KEY           MODEL         KIND        OUTCOME                    PROMPT  CACHED  COMPLETION  TOTAL  ID',
      '2026-10-31T23:00:00Z  team-b/chat   default/demo  embeddings  completed                      10       2           5     15  req-3',
      '2026-11-29T10:00:00Z  local/team-a  default/demo  chat        cancelled (client_closed)       0       0           3      3  req-1',
      '2026-11-30T00:00:01Z  local/team-a  default/demo  chat        completed                      10       2           5     15  req-2',
      '',
    ]);
    expect(formatUsage(records, { by: 'day', records: true, format: 'table' })).toBe(formatUsageRecords(records));
  });

  it('--json: the rows aggregateUsage makes (by day or month), or the records in order of start', () => {
    const byDay = JSON.parse(formatUsage(records, { by: 'day', records: false, format: 'json' })) as UsageRow[];
    expect(byDay.map((r) => [r.key, r.period, r.requests, r.totalTokens])).toEqual([
      ['local/team-a', '2026-11-29', 1, 3],
      ['local/team-a', '2026-11-30', 1, 15],
      ['team-b/chat', '2026-10-31', 1, 15],
    ]);
    const byMonth = JSON.parse(formatUsage(records, { by: 'month', records: false, format: 'json' })) as UsageRow[];
    expect(byMonth.map((r) => [r.key, r.period, r.requests, r.incomplete, r.totalTokens])).toEqual([
      ['local/team-a', '2026-11', 2, 1, 18],
      ['team-b/chat', '2026-10', 1, 0, 15],
    ]);
    const listed = JSON.parse(formatUsage(records, { by: 'day', records: true, format: 'json' })) as UsageRecord[];
    expect(listed.map((r) => r.id)).toEqual(['req-3', 'req-1', 'req-2']);
    expect(listed[1]).toEqual(records[1]);
    expect(formatUsage([], { by: 'day', records: false, format: 'json' })).toBe('[]\n');
  });

  it('--csv: a header, then the rows or the flattened records', () => {
    expect(formatUsage(records, { by: 'month', records: false, format: 'csv' }).split('\n')).toEqual([
      'key,model,period,requests,incomplete,promptTokens,cachedTokens,completionTokens,totalTokens,lastUsed',
      `local/team-a,default/demo,2026-11,2,1,10,2,8,18,${Date.UTC(2026, 10, 30, 0, 0, 2)}`,
      `team-b/chat,default/demo,2026-10,1,0,10,2,5,15,${Date.UTC(2026, 9, 31, 23, 0, 1)}`,
      '',
    ]);
    expect(formatUsage(records, { by: 'day', records: true, format: 'csv' }).split('\n')).toEqual([
      'id,key,model,kind,start,end,outcome,error,promptTokens,cachedTokens,completionTokens,totalTokens,reported',
      'req-3,team-b/chat,default/demo,embeddings,2026-10-31T23:00:00.000Z,2026-10-31T23:00:01.000Z,completed,,10,2,5,15,true',
      'req-1,local/team-a,default/demo,chat,2026-11-29T10:00:00.000Z,2026-11-29T10:00:01.000Z,cancelled,client_closed,0,0,3,3,false',
      'req-2,local/team-a,default/demo,chat,2026-11-30T00:00:01.000Z,2026-11-30T00:00:02.000Z,completed,,10,2,5,15,true',
      '',
    ]);
    expect(formatUsage([], { by: 'day', records: false, format: 'csv' })).toBe(
      'key,model,period,requests,incomplete,promptTokens,cachedTokens,completionTokens,totalTokens,lastUsed\n',
    );
  });

  it('CSV quotes a field holding a comma, a quote or a line break (toCsv)', () => {
    const odd = [row({ key: 'a,b', model: 'say "hi"', period: 'x\ny' })];
    expect(toCsv(odd, ['key', 'model', 'period', 'requests'])).toBe('key,model,period,requests\n"a,b","say ""hi""","x\ny",1\n');
  });

  it('the line for an empty ledger names what was asked', () => {
    expect(noUsageLine({})).toBe('no usage is recorded\n');
    expect(noUsageLine({ key: 'local/team-a' })).toBe('no usage is recorded for local/team-a\n');
    expect(noUsageLine({ key: 'local/team-a', since: Date.UTC(2026, 10, 29), until: Date.UTC(2026, 10, 30, 6) })).toBe(
      'no usage is recorded for local/team-a since 2026-11-29T00:00:00Z before 2026-11-30T06:00:00Z\n',
    );
  });
});

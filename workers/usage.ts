/**
 * `magus usage [--key K] [--since T] [--until T] [--by day|month] [--records] [--json|--csv]`:
 * the usage ledger (`magus_usage`, dataplane/usage.ts), read back. By default a table of its
 * records summed per key, model and UTC day (or month) — requests, those that did not complete,
 * prompt/cached/completion/total tokens, when last used — with a total line; `--records` lists each
 * request instead. `--json` and `--csv` print the same rows (or records) for a program: the CSV is
 * the export a billing system reads (shared/usage.ts `toCsv`, `ROW_COLUMNS` / `RECORD_COLUMNS`).
 * A key is its identity (`team-a/chat`, `local/team-a`); a bare NAME is the local key `local/NAME`.
 * It only reads: nothing is declared or written.
 *
 * Where NATS is: `MAGUS_NATS_URL` (and `MAGUS_NATS_PREFIX`), else the running `magus dev`.
 */
import { MeterVerifier } from '../dataplane/meter';
import { UsageLedger } from '../dataplane/usage';
import { UsageError, usageFailure } from '../platform/cli';
import { aggregateUsage, isoSeconds, flatRecord, RECORD_COLUMNS, ROW_COLUMNS, toCsv, type UsageRecord, type UsageRow } from '../shared/usage';
import { alignedLines, onDataPlaneBucket } from './data-plane-cli';

export const USAGE_USAGE = [
  'usage: magus usage [--key K] [--since T] [--until T] [--by day|month] [--records] [--json | --csv]',
  '',
  'The usage ledger: one record per request, written by the bridge that ended it. By default a table',
  'of the requests and tokens per key, model and UTC day, with a total line.',
  '  --key K          one key: its identity (team-a/chat for an ApiKey, local/team-a, config/ID), or a',
  '                   bare NAME for the local key local/NAME (magus keys create NAME); anonymous: requests',
  '                   without a key',
  '  --since T        requests that started at or after T, and',
  '  --until T        before T. T: a date (2026-11-29, UTC midnight), a date-time (2026-11-29T10:00:00Z;',
  '                   without an offset it is UTC), or a time ago: 30m, 24h, 7d',
  '  --by day|month   a row per UTC day (the default) or UTC calendar month',
  '  --records        each request instead of the sums: start, key, model, kind, outcome, tokens, id',
  '  --json           the rows (or records) as a JSON array',
  '  --csv            the rows (or records) as CSV with a header line: the billing export',
  'NATS: MAGUS_NATS_URL and MAGUS_NATS_PREFIX, else the running magus dev (its connection.json).',
].join('\n');

export interface UsageArgs {
  /** A key identity (a bare name already made `local/<name>`); undefined: every key. */
  key?: string;
  /** Epoch ms: requests that started at or after this. */
  since?: number;
  /** Epoch ms: and before this. */
  until?: number;
  by: 'day' | 'month';
  /** Each record rather than rows. */
  records: boolean;
  format: 'table' | 'json' | 'csv';
}

const VALUE_FLAGS = ['--key', '--since', '--until', '--by'] as const;
type ValueFlag = (typeof VALUE_FLAGS)[number];
const SWITCHES = ['--records', '--json', '--csv'] as const;

const MINUTE = 60_000;
const UNITS: Record<string, number> = { m: MINUTE, h: 60 * MINUTE, d: 24 * 60 * MINUTE };
const TIME_FORMS = 'a date (2026-11-29), a date-time (2026-11-29T10:00:00Z) or a time ago (30m, 24h, 7d)';

/**
 * The epoch ms `value` means, `now` being the time: a date `YYYY-MM-DD` (UTC midnight), a
 * date-time `YYYY-MM-DDTHH:MM[:SS[.fff]][Z|±HH:MM]` (UTC without an offset), or a whole number of
 * minutes, hours or days ago (`30m`, `24h`, `7d`). Undefined when it is none of them.
 */
export function parseTime(value: string, now: number): number | undefined {
  const ago = /^([0-9]{1,9})([mhd])$/.exec(value);
  if (ago) return now - Number(ago[1]) * UNITS[ago[2]!]!;
  const m = /^([0-9]{4})-([0-9]{2})-([0-9]{2})(T([0-9]{2}):([0-9]{2})(:[0-9]{2}(\.[0-9]{1,3})?)?(Z|[+-][0-9]{2}:[0-9]{2})?)?$/.exec(value);
  if (!m) return undefined;
  const [year, month, day] = [Number(m[1]), Number(m[2]), Number(m[3])];
  // Date.parse rolls 2026-02-30 over into March: the day must exist.
  const midnight = new Date(Date.UTC(year, month - 1, day));
  if (midnight.getUTCFullYear() !== year || midnight.getUTCMonth() !== month - 1 || midnight.getUTCDate() !== day) return undefined;
  if (m[4] === undefined) return midnight.getTime();
  if (Number(m[5]) > 23 || Number(m[6]) > 59 || (m[7] !== undefined && Number(m[7].slice(1, 3)) > 59)) return undefined;
  const at = Date.parse(m[9] === undefined ? `${value}Z` : value);
  return Number.isNaN(at) ? undefined : at;
}

/** `magus usage`'s command line; `now` is what a time ago counts back from. A bad one is a UsageError. */
export function parseUsageArgs(argv: readonly string[], now: number = Date.now()): UsageArgs {
  const given = new Map<ValueFlag, string>();
  const switches = new Set<string>();
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    if ((VALUE_FLAGS as readonly string[]).includes(a)) {
      const v = argv[++i];
      if (v === undefined || v.startsWith('--')) throw new UsageError(`${a} needs a value`);
      if (given.has(a as ValueFlag)) throw new UsageError(`${a} is given twice`);
      given.set(a as ValueFlag, v);
    } else if ((SWITCHES as readonly string[]).includes(a)) switches.add(a);
    else throw new UsageError(a.startsWith('-') ? `unknown option ${a}` : `unexpected argument ${JSON.stringify(a)}`);
  }
  const time = (flag: '--since' | '--until'): number | undefined => {
    const v = given.get(flag);
    if (v === undefined) return undefined;
    const at = parseTime(v, now);
    if (at === undefined) throw new UsageError(`${flag} must be ${TIME_FORMS}, got ${JSON.stringify(v)}`);
    return at;
  };
  const since = time('--since');
  const until = time('--until');
  if (since !== undefined && until !== undefined && since >= until)
    throw new UsageError(`--since (${isoSeconds(since)}) must be before --until (${isoSeconds(until)})`);
  const by = given.get('--by');
  if (by !== undefined && by !== 'day' && by !== 'month') throw new UsageError(`--by must be day or month, got ${JSON.stringify(by)}`);
  const records = switches.has('--records');
  if (records && by !== undefined) throw new UsageError('--by groups the rows; --records lists each request: give one or the other');
  if (switches.has('--json') && switches.has('--csv')) throw new UsageError('--json and --csv: give one or the other');
  let key = given.get('--key');
  if (key !== undefined) {
    key = key.trim();
    if (key === '' || key.startsWith('/') || key.endsWith('/'))
      throw new UsageError(`--key must be a key identity (NAMESPACE/NAME, local/NAME) or a local key's NAME, got ${JSON.stringify(given.get('--key'))}`);
    if (!key.includes('/') && key !== 'anonymous') key = `local/${key}`;
  }
  return {
    ...(key !== undefined ? { key } : {}),
    ...(since !== undefined ? { since } : {}),
    ...(until !== undefined ? { until } : {}),
    by: by ?? 'day',
    records,
    format: switches.has('--json') ? 'json' : switches.has('--csv') ? 'csv' : 'table',
  };
}

/** The rows as a table with a header and a total line (requests and tokens summed, the latest use). */
export function formatUsageTable(rows: readonly UsageRow[]): string {
  const header = ['KEY', 'MODEL', 'PERIOD', 'REQUESTS', 'INCOMPLETE', 'PROMPT', 'CACHED', 'COMPLETION', 'TOTAL', 'LAST USED'];
  const sum = (f: (r: UsageRow) => number) => rows.reduce((n, r) => n + f(r), 0);
  const numbers = (r: Omit<UsageRow, 'key' | 'model' | 'period' | 'lastUsed'>) =>
    [r.requests, r.incomplete, r.promptTokens, r.cachedTokens, r.completionTokens, r.totalTokens].map(String);
  const total = {
    requests: sum((r) => r.requests),
    incomplete: sum((r) => r.incomplete),
    promptTokens: sum((r) => r.promptTokens),
    cachedTokens: sum((r) => r.cachedTokens),
    completionTokens: sum((r) => r.completionTokens),
    totalTokens: sum((r) => r.totalTokens),
  };
  const last = rows.length ? isoSeconds(Math.max(...rows.map((r) => r.lastUsed))) : '';
  return alignedLines(
    [header, ...rows.map((r) => [r.key, r.model, r.period, ...numbers(r), isoSeconds(r.lastUsed)]), ['total', '', '', ...numbers(total), last]],
    new Set([3, 4, 5, 6, 7, 8]),
  );
}

/** Records, one line each in order of their start, under a header: time, key, model, kind, outcome (and error), tokens, request id. */
export function formatUsageRecords(records: readonly UsageRecord[]): string {
  const header = ['START', 'KEY', 'MODEL', 'KIND', 'OUTCOME', 'PROMPT', 'CACHED', 'COMPLETION', 'TOTAL', 'ID'];
  const sorted = [...records].sort((a, b) => a.start - b.start || a.id.localeCompare(b.id));
  return alignedLines(
    [
      header,
      ...sorted.map((r) => [
        isoSeconds(r.start),
        r.key,
        r.model,
        r.kind,
        r.error ? `${r.outcome} (${r.error})` : r.outcome,
        ...[r.tokens.prompt, r.tokens.cached, r.tokens.completion, r.tokens.total].map(String),
        r.id,
      ]),
    ],
    new Set([5, 6, 7, 8]),
  );
}

/** The line saying nothing is recorded for what `q` asked. */
export function noUsageLine(q: Pick<UsageArgs, 'key' | 'since' | 'until'>): string {
  const scope = [
    q.key !== undefined ? `for ${q.key}` : '',
    q.since !== undefined ? `since ${isoSeconds(q.since)}` : '',
    q.until !== undefined ? `before ${isoSeconds(q.until)}` : '',
  ].filter(Boolean);
  return `no usage is recorded${scope.length ? ` ${scope.join(' ')}` : ''}\n`;
}

/** What `magus usage` prints on stdout for `records` as `args` asks (the empty case aside). */
export function formatUsage(records: readonly UsageRecord[], args: Pick<UsageArgs, 'by' | 'records' | 'format'>): string {
  if (args.records) {
    const sorted = [...records].sort((a, b) => a.start - b.start || a.id.localeCompare(b.id));
    if (args.format === 'json') return `${JSON.stringify(sorted, null, 2)}\n`;
    if (args.format === 'csv') return toCsv(sorted.map(flatRecord), RECORD_COLUMNS);
    return formatUsageRecords(sorted);
  }
  const rows = aggregateUsage(records, args.by);
  if (args.format === 'json') return `${JSON.stringify(rows, null, 2)}\n`;
  if (args.format === 'csv') return toCsv(rows, ROW_COLUMNS);
  return formatUsageTable(rows);
}

export async function usageCommand(args: string[]): Promise<number> {
  if (args.includes('--help') || args.includes('-h')) {
    process.stdout.write(`${USAGE_USAGE}\n`);
    return 0;
  }
  let parsed: UsageArgs;
  try {
    parsed = parseUsageArgs(args);
  } catch (err) {
    return usageFailure('magus usage', USAGE_USAGE, err);
  }
  const missing = 'no data plane there (magus dev, a worker, the controller or magus bridge declares it; is MAGUS_NATS_PREFIX right?)';
  return onDataPlaneBucket(
    'magus usage',
    (names) => names.usageBucket,
    missing,
    async (kv, { nc, names }) => {
      // Only records a gateway signed count (dataplane/meter.ts); the others are named on stderr.
      const verifier = new MeterVerifier(await nc.jetstream().views.kv(names.limitsBucket, { bindOnly: true }));
      const { records, unsigned } = await new UsageLedger(kv).readSigned(
        {
          ...(parsed.key !== undefined ? { key: parsed.key } : {}),
          ...(parsed.since !== undefined ? { since: parsed.since } : {}),
          ...(parsed.until !== undefined ? { until: parsed.until } : {}),
        },
        verifier,
      );
      if (unsigned > 0)
        process.stderr.write(
          `magus usage: left out ${unsigned} record(s) no gateway signed: they stand for no request a gateway took in (written by something else with the ledger's rights)\n`,
        );
      if (records.length === 0 && parsed.format === 'table') {
        process.stdout.write(noUsageLine(parsed));
        return 0;
      }
      // A program reading JSON or CSV gets `[]` or the header alone; the person running it, the line.
      if (records.length === 0) process.stderr.write(noUsageLine(parsed));
      process.stdout.write(formatUsage(records, parsed));
      return 0;
    },
  );
}

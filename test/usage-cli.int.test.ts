/**
 * `magus usage` as users run it — the built CLI (`npm run build`) as a child process — against
 * the file's data plane on the test NATS server, its ledger holding records written with
 * UsageLedger.record as bridges write them (signed as gateways sign their meters): the table's rows and total for one key (a bare name
 * being the local key), `--since`/`--until` with dates, date-times and times ago, `--by month`,
 * `--json` equal to aggregateUsage's rows, `--records --csv` line by line; an empty ledger, or
 * nothing for what was asked, is one line and exit 0; a bad command line, NATS away or no ledger
 * there is an exit 1 naming what is wrong; records no gateway signed (dataplane/meter.ts) are left
 * out, and counted on stderr.
 */
import { dataPlaneNames, type DataPlaneNames } from '../dataplane';
import { meterKeyOf, meterSignature, type MeterKey } from '../dataplane/meter';
import { UsageLedger } from '../dataplane/usage';
import { aggregateUsage, ROW_COLUMNS, toCsv, type UsageRecord, type UsageRow } from '../shared/usage';
import { endpoint, isolation, natsCredentialsEnv, natsRoleCredentials } from './harness';
import { runMagus, type MagusRun } from './harness/dev';
import { natsStack, tempDir, TestStack } from './harness/stack';

const iso = isolation();
const stack = new TestStack();
let names: DataPlaneNames;
let emptyNames: DataPlaneNames;
let forgedNames: DataPlaneNames;
let env: NodeJS.ProcessEnv;
const HOUR = 3600_000;
const NOW = Date.now();

const record = (id: string, key: string, start: string | number, over: Partial<UsageRecord> = {}): UsageRecord => {
  const at = typeof start === 'number' ? start : Date.parse(start);
  return {
    id: `${iso.id}-${id}`,
    key,
    model: 'default/demo',
    kind: 'chat',
    start: at,
    end: at + 1000,
    outcome: 'completed',
    tokens: { prompt: 10, cached: 2, completion: 5, total: 15 },
    reported: true,
    ...over,
  };
};
/** Around a UTC midnight and a month's end, a year ago; and two recent ones. */
const RECORDS = [
  record('r1', 'local/team-a', '2025-11-28T23:59:00Z'),
  record('r2', 'local/team-a', '2025-11-29T00:00:30Z', {
    end: Date.parse('2025-11-29T00:00:32Z'),
    tokens: { prompt: 20, cached: 0, completion: 7, total: 27 },
  }),
  record('r3', 'local/team-a', '2025-11-29T10:00:00Z', {
    outcome: 'cancelled',
    error: 'client_closed',
    tokens: { prompt: 0, cached: 0, completion: 3, total: 3 },
    reported: false,
  }),
  record('r4', 'local/team-a', '2025-12-01T08:00:00Z', {
    model: 'default/qwen3',
    kind: 'completions',
    tokens: { prompt: 5, cached: 0, completion: 5, total: 10 },
  }),
  record('r5', 'team-a/chat', '2025-11-29T12:00:00Z', { tokens: { prompt: 100, cached: 50, completion: 20, total: 120 } }),
  record('r6', 'local/team-recent', NOW - 2 * HOUR),
  record('r7', 'local/team-recent', NOW - 3 * 24 * HOUR),
];
const id = (r: string) => `${iso.id}-${r}`;

beforeAll(async () => {
  const { nc, names: n } = await stack.open(natsStack(iso, { declare: true }));
  names = n;
  ({ names: emptyNames } = await stack.open(natsStack(iso, { declare: true, suffix: '_EMPTY' })));
  const ledger = await UsageLedger.open(nc.jetstream(), names);
  // Signed as a gateway signs its requests' meters (dataplane/meter.ts): only such records count.
  const meterKey = async (n: DataPlaneNames): Promise<MeterKey> =>
    (await meterKeyOf(await nc.jetstream().views.kv(n.limitsBucket, { bindOnly: true }), { create: true }))!;
  const key = await meterKey(names);
  for (const r of RECORDS) expect(await ledger.record({ ...r, sig: meterSignature(key, r) })).toBe('written');
  // A ledger with one record a gateway signed, one with no signature and one signed by another data plane's key.
  ({ names: forgedNames } = await stack.open(natsStack(iso, { declare: true, suffix: '_FORGED' })));
  const forgedLedger = await UsageLedger.open(nc.jetstream(), forgedNames);
  const [signed, unsigned, foreign] = [
    record('f1', 'local/victim', NOW - HOUR),
    record('f2', 'local/victim', NOW - HOUR),
    record('f3', 'local/victim', NOW - HOUR),
  ];
  await forgedLedger.record({ ...signed, sig: meterSignature(await meterKey(forgedNames), signed) });
  await forgedLedger.record(unsigned);
  await forgedLedger.record({ ...foreign, sig: meterSignature(key, foreign) });
  // Only the test's NATS and prefix; an empty dev folder, so no running `magus dev` is picked up.
  const { dir } = stack.open(tempDir('magus-usage-cli-'));
  env = { ...process.env, MAGUS_NATS_URL: endpoint('nats').servers, MAGUS_NATS_PREFIX: names.prefix, MAGUS_DEV_DATA_DIR: dir };
  for (const name of Object.keys(env)) if (/^MAGUS_(?!NATS_URL$|NATS_PREFIX$|DEV_DATA_DIR$)|^AWS_/.test(name)) delete env[name];
}, 60_000);
afterAll(() => stack.close());

/** `magus usage <args>` (the built CLI) with the test's environment and `extra` over it, as the controller; killed after `timeoutMs`. */
async function usage(args: string[], extra: NodeJS.ProcessEnv = {}, timeoutMs = 20_000): Promise<MagusRun> {
  // As the controller (its role, as in production) of the data plane it reads.
  const credentials = await natsRoleCredentials('controller', dataPlaneNames(extra.MAGUS_NATS_PREFIX ?? env.MAGUS_NATS_PREFIX));
  return runMagus(['usage', ...args], { ...env, ...natsCredentialsEnv(credentials), ...extra }, timeoutMs);
}

/** Exit 0, nothing on stderr: its stdout. */
async function ok(args: string[]): Promise<string> {
  const r = await usage(args);
  expect({ args, code: r.code, stderr: r.stderr }).toEqual({ args, code: 0, stderr: '' });
  return r.stdout;
}

const TEAM_A_BY_DAY = [
  'KEY           MODEL          PERIOD      REQUESTS  INCOMPLETE  PROMPT  CACHED  COMPLETION  TOTAL  LAST USED',
  'local/team-a  default/demo   2025-11-28         1           0      10       2           5     15  2025-11-28T23:59:01Z',
  'local/team-a  default/demo   2025-11-29         2           1      20       0          10     30  2025-11-29T10:00:01Z',
  'local/team-a  default/qwen3  2025-12-01         1           0       5       0           5     10  2025-12-01T08:00:01Z',
  'total                                           4           1      35       2          20     55  2025-12-01T08:00:01Z',
  '',
].join('\n');

test('--key NAME: the local key local/NAME, its rows per model and UTC day and the total line', async () => {
  expect(await ok(['--key', 'team-a'])).toBe(TEAM_A_BY_DAY);
  expect(await ok(['--key', 'local/team-a'])).toBe(TEAM_A_BY_DAY);
  // An ApiKey's identity is namespace/name: another key altogether.
  expect(await ok(['--key', 'team-a/chat'])).toBe(
    [
      'KEY          MODEL         PERIOD      REQUESTS  INCOMPLETE  PROMPT  CACHED  COMPLETION  TOTAL  LAST USED',
      'team-a/chat  default/demo  2025-11-29         1           0     100      50          20    120  2025-11-29T12:00:01Z',
      'total                                         1           0     100      50          20    120  2025-11-29T12:00:01Z',
      '',
    ].join('\n'),
  );
});

test('--since and --until: dates (UTC midnight), date-times, and times ago', async () => {
  const day = await ok(['--key', 'team-a', '--since', '2025-11-29', '--until', '2025-12-01']);
  expect(day.split('\n').slice(1)).toEqual([
    'local/team-a  default/demo  2025-11-29         2           1      20       0          10     30  2025-11-29T10:00:01Z',
    'total                                          2           1      20       0          10     30  2025-11-29T10:00:01Z',
    '',
  ]);
  const records = async (args: string[]) => (JSON.parse(await ok([...args, '--records', '--json'])) as UsageRecord[]).map((r) => r.id);
  expect(await records(['--key', 'team-a', '--since', '2025-11-29T00:00:31Z'])).toEqual([id('r3'), id('r4')]);
  expect(await records(['--key', 'team-a', '--until', '2025-11-29T00:00:30Z'])).toEqual([id('r1')]);
  expect(await records(['--since', '2025-11-29T11:00:00+01:00', '--until', '2025-11-30'])).toEqual([id('r3'), id('r5')]);
  // Relative to now: the recent records only.
  expect(await records(['--since', '24h'])).toEqual([id('r6')]);
  expect(await records(['--since', '7d'])).toEqual([id('r7'), id('r6')]);
  expect(await records(['--key', 'team-recent', '--since', '4d', '--until', '1d'])).toEqual([id('r7')]);
});

test('--by month: November and December apart', async () => {
  expect(await ok(['--key', 'team-a', '--by', 'month'])).toBe(
    [
      'KEY           MODEL          PERIOD   REQUESTS  INCOMPLETE  PROMPT  CACHED  COMPLETION  TOTAL  LAST USED',
      'local/team-a  default/demo   2025-11         3           1      30       2          15     45  2025-11-29T10:00:01Z',
      'local/team-a  default/qwen3  2025-12         1           0       5       0           5     10  2025-12-01T08:00:01Z',
      'total                                        4           1      35       2          20     55  2025-12-01T08:00:01Z',
      '',
    ].join('\n'),
  );
});

test("--json: aggregateUsage's rows of every record, by day and by month", async () => {
  expect(JSON.parse(await ok(['--json'])) as UsageRow[]).toEqual(aggregateUsage(RECORDS, 'day'));
  expect(JSON.parse(await ok(['--json', '--by', 'month'])) as UsageRow[]).toEqual(aggregateUsage(RECORDS, 'month'));
  expect(JSON.parse(await ok(['--json', '--key', 'team-a/chat'])) as UsageRow[]).toEqual(aggregateUsage([RECORDS[4]!], 'day'));
});

test('--csv: the rows with a header; --records --csv: one line per request', async () => {
  // The README's billing export: every key, per month.
  expect(await ok(['--by', 'month', '--csv'])).toBe(toCsv(aggregateUsage(RECORDS, 'month'), ROW_COLUMNS));
  expect(await ok(['--csv', '--key', 'team-a', '--by', 'month'])).toBe(
    [
      'key,model,period,requests,incomplete,promptTokens,cachedTokens,completionTokens,totalTokens,lastUsed',
      `local/team-a,default/demo,2025-11,3,1,30,2,15,45,${Date.parse('2025-11-29T10:00:01Z')}`,
      `local/team-a,default/qwen3,2025-12,1,0,5,0,5,10,${Date.parse('2025-12-01T08:00:01Z')}`,
      '',
    ].join('\n'),
  );
  expect(await ok(['--records', '--csv', '--key', 'team-a'])).toBe(
    [
      'id,key,model,kind,start,end,outcome,error,promptTokens,cachedTokens,completionTokens,totalTokens,reported',
      `${id('r1')},local/team-a,default/demo,chat,2025-11-28T23:59:00.000Z,2025-11-28T23:59:01.000Z,completed,,10,2,5,15,true`,
      `${id('r2')},local/team-a,default/demo,chat,2025-11-29T00:00:30.000Z,2025-11-29T00:00:32.000Z,completed,,20,0,7,27,true`,
      `${id('r3')},local/team-a,default/demo,chat,2025-11-29T10:00:00.000Z,2025-11-29T10:00:01.000Z,cancelled,client_closed,0,0,3,3,false`,
      `${id('r4')},local/team-a,default/qwen3,completions,2025-12-01T08:00:00.000Z,2025-12-01T08:00:01.000Z,completed,,5,0,5,10,true`,
      '',
    ].join('\n'),
  );
  // Without --csv or --json: a line per record, under a header.
  expect((await ok(['--key', 'team-a/chat', '--records'])).split('\n')[1]).toMatch(
    new RegExp(`^2025-11-29T12:00:00Z  team-a/chat  default/demo  chat  completed  +100 +50 +20 +120  ${id('r5')}$`),
  );
  expect((await ok(['--records', '--key', 'team-a', '--until', '2025-11-29T10:00:01Z'])).split('\n')).toEqual([
    expect.stringMatching(/^START +KEY +MODEL +KIND +OUTCOME +PROMPT +CACHED +COMPLETION +TOTAL +ID$/) as string,
    expect.stringMatching(new RegExp(`^2025-11-28T23:59:00Z  local/team-a  default/demo  chat  completed +10 +2 +5 +15  ${id('r1')}$`)) as string,
    expect.stringMatching(new RegExp(`^2025-11-29T00:00:30Z  local/team-a  default/demo  chat  completed +20 +0 +7 +27  ${id('r2')}$`)) as string,
    expect.stringMatching(
      new RegExp(`^2025-11-29T10:00:00Z  local/team-a  default/demo  chat  cancelled \\(client_closed\\) +0 +0 +3 +3  ${id('r3')}$`),
    ) as string,
    '',
  ]);
});

test('nothing recorded: one line and exit 0 (JSON and CSV stay parseable, the line on stderr)', async () => {
  const empty = { MAGUS_NATS_PREFIX: emptyNames.prefix };
  expect(await usage([], empty)).toMatchObject({ code: 0, stdout: 'no usage is recorded\n', stderr: '' });
  expect(await usage(['--key', 'team-a'], empty)).toMatchObject({ code: 0, stdout: 'no usage is recorded for local/team-a\n', stderr: '' });
  expect(await usage(['--key', 'nobody', '--since', '2025-11-29'])).toMatchObject({
    code: 0,
    stdout: 'no usage is recorded for local/nobody since 2025-11-29T00:00:00Z\n',
    stderr: '',
  });
  expect(await usage(['--key', 'nobody', '--json'])).toMatchObject({ code: 0, stdout: '[]\n', stderr: 'no usage is recorded for local/nobody\n' });
  expect(await usage(['--key', 'nobody', '--csv'])).toMatchObject({
    code: 0,
    stdout: 'key,model,period,requests,incomplete,promptTokens,cachedTokens,completionTokens,totalTokens,lastUsed\n',
    stderr: 'no usage is recorded for local/nobody\n',
  });
});

test('a bad command line: exit 1 naming the flag, with the usage; --help: exit 0 with it', async () => {
  const bad = await usage(['--since', 'yesterday']);
  expect(bad).toMatchObject({ code: 1, stdout: '' });
  expect(bad.stderr).toMatch(
    /^magus usage: --since must be a date \(2026-11-29\), a date-time \(2026-11-29T10:00:00Z\) or a time ago \(30m, 24h, 7d\), got "yesterday"\nusage: magus usage /,
  );
  const both = await usage(['--json', '--csv']);
  expect(both).toMatchObject({ code: 1, stdout: '' });
  expect(both.stderr).toMatch(/^magus usage: --json and --csv: give one or the other\nusage: magus usage /);
  const unknown = await usage(['--team', 'a']);
  expect(unknown).toMatchObject({ code: 1, stdout: '' });
  expect(unknown.stderr).toMatch(/^magus usage: unknown option --team\nusage: magus usage /);
  const help = await usage(['--help']);
  expect(help).toMatchObject({ code: 0, stderr: '' });
  expect(help.stdout).toMatch(/^usage: magus usage \[--key K\]/);
  expect(help.stdout).toContain('bare NAME for the local key local/NAME');
});

test('NATS unreachable: exit 1 within seconds naming the address; no ledger there: exit 1 naming the bucket', async () => {
  const away = await usage([], { MAGUS_NATS_URL: 'nats://127.0.0.1:1' });
  expect(away).toMatchObject({ code: 1, stdout: '' });
  expect(away.stderr).toContain('magus usage: cannot reach NATS at nats://127.0.0.1:1');
  expect(away.ms).toBeLessThan(10_000);

  const missing = `${iso.natsPrefix}_NONE`;
  const none = await usage([], { MAGUS_NATS_PREFIX: missing });
  expect(none).toMatchObject({ code: 1, stdout: '' });
  expect(none.stderr).toBe(
    `magus usage: NATS at ${endpoint('nats').servers} has no ${dataPlaneNames(missing).usageBucket} bucket: no data plane there (magus dev, a worker, the controller or magus bridge declares it; is MAGUS_NATS_PREFIX right?)\n`,
  );
});

test('records no gateway signed are left out, and said so on stderr', async () => {
  const r = await usage(['--records', '--json'], { MAGUS_NATS_PREFIX: forgedNames.prefix });
  expect(r.code).toBe(0);
  expect((JSON.parse(r.stdout) as UsageRecord[]).map((x) => x.id)).toEqual([id('f1')]);
  expect(r.stderr).toMatch(/^magus usage: left out 2 record\(s\) no gateway signed/);
});

/**
 * The workflow import boundary, the room boundaries and no-floating-promises are lint errors: run the project's real
 * ESLint configuration over fixtures that break (and keep) the rules.
 */
import { execFile } from 'node:child_process';
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { promisify } from 'node:util';

const root = join(__dirname, '..');
const execFileP = promisify(execFile);

interface LintMessage {
  ruleId: string | null;
  message: string;
  line: number;
}
const fixtures = [
  'workflows/imports-fs.ts',
  'workflows/imports-node-fs.ts',
  'workflows/imports-nats.ts',
  'workflows/imports-activity-value.ts',
  'workflows/allowed.ts',
  'floating-promise.ts',
  'rooms/gateway/imports-workers.ts',
  'rooms/gateway/allowed.ts',
  'rooms/shared/imports-platform.ts',
  'rooms/dataplane/imports-gateway.ts',
  'rooms/activities/imports-test.ts',
  'rooms/activities/imports-workflows.ts',
  'rooms/kube/imports-activities.ts',
  'rooms/convert/imports-activities.ts',
  'rooms/convert/allowed.ts',
  'rooms/platform/imports-convert.ts',
];
let results: Map<string, LintMessage[]>;
let rooms: Record<string, string[]>;

// One ESLint run over every fixture (typed linting has a start-up cost of several seconds).
beforeAll(async () => {
  const eslint = join(root, 'node_modules', '.bin', 'eslint');
  const args = ['--no-ignore', '--format', 'json', ...fixtures.map((f) => join('test', 'lint-fixtures', f))];
  const out = await execFileP(eslint, args, { cwd: root, maxBuffer: 16 << 20 }).then(
    (r) => r.stdout,
    (err: { stdout?: string; code?: number }) => {
      if (err.code !== 1 || !err.stdout) throw err; // 1 = lint errors found; anything else is a crash
      return err.stdout;
    },
  );
  const parsed = JSON.parse(out) as { filePath: string; messages: LintMessage[] }[];
  results = new Map(parsed.map((r) => [r.filePath.slice(join(root, 'test', 'lint-fixtures').length + 1), r.messages]));
  expect([...results.keys()].sort()).toEqual([...fixtures].sort());
  rooms = ((await import(join(root, 'eslint.config.mjs'))) as { ROOMS_ABOVE: Record<string, string[]> }).ROOMS_ABOVE;
}, 120_000);

const lint = (fixture: string): LintMessage[] => results.get(fixture) ?? [];

const boundary = '@typescript-eslint/no-restricted-imports';

test.each([
  ['workflows/imports-fs.ts', /Node builtins/],
  ['workflows/imports-node-fs.ts', /Node builtins/],
  ['workflows/imports-nats.ts', /nats/],
  ['workflows/imports-activity-value.ts', /types only/],
])('workflow code importing %s fails lint', (fixture, why) => {
  const messages = lint(fixture);
  const hit = messages.find((m) => m.ruleId === boundary);
  expect(hit).toBeDefined();
  expect(hit?.message).toMatch(why);
});

test('workflow code using the SDK and type-only activity imports passes lint', () => {
  expect(lint('workflows/allowed.ts')).toEqual([]);
});

test('a floating promise is a lint error', () => {
  expect(lint('floating-promise.ts').map((m) => m.ruleId)).toContain('@typescript-eslint/no-floating-promises');
});

test.each([
  ['rooms/gateway/imports-workers.ts', /gateway\/ must not import workers\//],
  ['rooms/shared/imports-platform.ts', /shared\/ must not import platform\//],
  ['rooms/dataplane/imports-gateway.ts', /dataplane\/ must not import gateway\//],
  ['rooms/activities/imports-test.ts', /Product code must not import test\//],
  ['rooms/activities/imports-workflows.ts', /activities\/ must not import workflows\//],
  ['rooms/kube/imports-activities.ts', /kube\/ must not import activities\//],
  ['rooms/convert/imports-activities.ts', /convert\/ must not import activities\//],
  ['rooms/platform/imports-convert.ts', /platform\/ must not import convert\//],
])('a room importing a room above it (%s) fails lint', (fixture, why) => {
  const hit = lint(fixture).find((m) => m.ruleId === boundary);
  expect(hit).toBeDefined();
  expect(hit?.message).toMatch(why);
});

test.each(['rooms/gateway/allowed.ts', 'rooms/convert/allowed.ts'])('a room importing the rooms below it (%s) passes lint', (fixture) => {
  expect(lint(fixture)).toEqual([]);
});

test('every top-level folder of product code is a room with its boundary, and jest and tsc see every room', () => {
  const notRooms = new Set(['test', 'bench', 'scripts', 'node_modules', 'dist', 'bin', 'crds', 'charts', 'images', 'coverage', 'test-results']);
  const withTs = readdirSync(root, { withFileTypes: true })
    .filter((d) => d.isDirectory() && !d.name.startsWith('.') && !notRooms.has(d.name))
    .filter((d) => readdirSync(join(root, d.name), { recursive: true }).some((f) => String(f).endsWith('.ts')))
    .map((d) => d.name)
    .sort();
  expect(withTs).toEqual(Object.keys(rooms).sort());
  // A room jest does not search has its tests dropped without a word; one tsc leaves out, its tests unchecked.
  const jestConfig = jest.requireActual<{ projects: { roots: string[] }[] }>(join(root, 'jest.config.js'));
  for (const project of jestConfig.projects) expect(project.roots).toEqual(expect.arrayContaining(withTs.map((r) => `<rootDir>/${r}`)));
  const tsconfig = JSON.parse(readFileSync(join(root, 'tsconfig.json'), 'utf8')) as { include: string[] };
  expect(tsconfig.include).toEqual(expect.arrayContaining(withTs));
});

test("every suite under test/ is in test/README.md's map of where a file's tests are", () => {
  const readme = readFileSync(join(root, 'test', 'README.md'), 'utf8');
  const listed = new Set([...readme.matchAll(/^\| \[`([^`]+\.test\.ts)`\]/gm)].map((m) => m[1]!));
  const suites = ['', 'smoke/'].flatMap((dir) =>
    readdirSync(join(root, 'test', dir))
      .filter((f) => f.endsWith('.test.ts'))
      .map((f) => `${dir}${f}`),
  );
  expect(suites.filter((s) => !listed.has(s))).toEqual([]);
  expect([...listed].filter((s) => !suites.includes(s))).toEqual([]);
});

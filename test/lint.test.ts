/**
 * The workflow import boundary and no-floating-promises are lint errors: run the project's real
 * ESLint configuration over fixtures that break (and keep) the rules.
 */
import { execFile } from 'node:child_process';
import { join } from 'node:path';
import { promisify } from 'node:util';

const root = join(__dirname, '..');
const execFileP = promisify(execFile);

interface LintMessage { ruleId: string | null; message: string; line: number }
const fixtures = [
  'workflows/imports-fs.ts',
  'workflows/imports-node-fs.ts',
  'workflows/imports-nats.ts',
  'workflows/imports-activity-value.ts',
  'workflows/allowed.ts',
  'floating-promise.ts',
];
let results: Map<string, LintMessage[]>;

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

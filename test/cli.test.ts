/** The `magus` CLI as a user runs it (from the JavaScript `npm ci` builds). */
import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { MODES } from '../shared/constants';
import { writeTinyModel } from '../workers/dev/tiny-model';

const bin = join(__dirname, '..', 'bin', 'magus.js');
const run = (...args: string[]) => spawnSync(process.execPath, [bin, ...args], { encoding: 'utf8', timeout: 30_000 });

test('help lists every mode', () => {
  const r = run('--help');
  expect(r.status).toBe(0);
  for (const mode of MODES) expect(r.stdout).toMatch(new RegExp(`^  ${mode} `, 'm'));
});

describe('convert', () => {
  let dir: string;
  beforeAll(async () => {
    dir = mkdtempSync(join(tmpdir(), 'magus-cli-'));
    await writeTinyModel(join(dir, 'tiny'), { seed: 11 });
  });
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  test('writes a GGUF and reports progress as plain lines when not on a terminal', () => {
    const out = join(dir, 'tiny.gguf');
    const r = run('convert', join(dir, 'tiny'), '--format', 'gguf', '--weights', 'q40', '-o', out, '--threads', '2');
    expect(r.stderr).toMatch(/100\.0% .*21\/21 tensors/);
    expect(r.status).toBe(0);
    expect(r.stdout).toContain(out);
    expect(existsSync(out)).toBe(true);
  });

  test('writes model.m and tokenizer.t for distributed-llama', () => {
    const out = join(dir, 'dl');
    const r = run('convert', join(dir, 'tiny'), '--format', 'dllama', '--weights', 'q40', '-o', out);
    expect(r.status).toBe(0);
    expect(existsSync(join(out, 'model.m')) && existsSync(join(out, 'tokenizer.t'))).toBe(true);
  });

  test('refuses distributed-llama weights it cannot run, writing nothing', () => {
    const out = join(dir, 'dl-q80');
    const r = run('convert', join(dir, 'tiny'), '--format', 'dllama', '--weights', 'q80', '-o', out);
    expect(r.status).toBe(1);
    expect(r.stderr).toContain('distributed-llama cannot run q80 weights');
    expect(existsSync(out)).toBe(false);
  });

  test.each([
    [['--format', 'onnx', '--weights', 'q40'], /--format must be one of gguf, dllama/],
    [['--format', 'gguf', '--weights', 'q3'], /--weights must be one of q40, q80, f16, f32/],
    [['--format', 'gguf', '--weights', 'q40', '--threads', '0'], /--threads must be/],
  ])('rejects bad options %j', (opts, why) => {
    const r = run('convert', join(dir, 'tiny'), ...opts);
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(why);
  });

  test('a directory without a checkpoint is a clear error', () => {
    const r = run('convert', join(dir, 'nope'), '--format', 'gguf', '--weights', 'q40', '-o', join(dir, 'nope.gguf'));
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(/MissingFile: .*nope\/config\.json/);
  });
});

test('every mode answers --help with its usage and exit 0, starting nothing', () => {
  for (const mode of MODES) {
    // A mode that started its servers would not exit: spawnSync's timeout kills it, status null.
    const r = run(mode, '--help');
    expect([mode, r.status, r.stdout.startsWith(`usage: magus ${mode}`)]).toEqual([mode, 0, true]);
  }
});

test('dev --help describes every option magus --help gives it', () => {
  const summary = run('--help')
    .stdout.split('\n')
    .find((l) => l.startsWith('magus dev ['));
  const options = summary?.match(/--[a-z-]+/g) ?? [];
  expect(options).toContain('--demo');
  const help = run('dev', '--help').stdout;
  expect(options.filter((o) => !new RegExp(`^  ${o} `, 'm').test(help))).toEqual([]);
});

test('controller: --help prints usage and exits 0; without a cluster it says so and exits 1', () => {
  const help = run('controller', '--help');
  expect(help.status).toBe(0);
  expect(help.stdout).toMatch(/^usage: magus controller/);
  const env = { ...process.env, KUBECONFIG: '', KUBERNETES_SERVICE_HOST: '' };
  const r = spawnSync(process.execPath, [bin, 'controller'], { encoding: 'utf8', env, timeout: 20_000 });
  expect(r.status).toBe(1);
  expect(r.stderr).toMatch(/magus controller: no cluster: run it in a pod or set KUBECONFIG/);
  const bad = run('controller', '--cleanup-timeout', 'soon');
  expect(bad.status).toBe(1);
  expect(bad.stderr).toMatch(/--cleanup-timeout soon is not a duration/);
});

test('an unknown mode is a usage error', () => {
  const r = run('frobnicate');
  expect(r.status).toBe(1);
  expect(r.stderr).toMatch(/unknown mode 'frobnicate'/);
});

test('dev rejects an unknown service before starting anything', () => {
  const r = run('dev', '--services', 'nats,redis');
  expect(r.status).toBe(1);
  expect(r.stderr).toMatch(/unknown service 'redis'/);
});

test.each([
  [['--nodes', '2'], /--nodes is for distributed-llama topologies: give --engine dllama too/],
  [['--engine', 'dllama', '--nodes', '3'], /--nodes 3: the distributed-llama demo model splits into 1, 2, 4 nodes/],
  [['--engine', 'dllama', '--nodes', 'two'], /--nodes two: the distributed-llama demo model splits into 1, 2, 4 nodes/],
])('dev %j: refused before anything starts', (args, message) => {
  const r = run('dev', ...args);
  expect(r.status).toBe(1);
  expect(r.stderr).toMatch(message);
});

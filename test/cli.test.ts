/** The `magus` CLI as a user runs it (from the JavaScript `npm ci` builds). */
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';

const bin = join(__dirname, '..', 'bin', 'magus.js');
const run = (...args: string[]) => spawnSync(process.execPath, [bin, ...args], { encoding: 'utf8', timeout: 30_000 });

test('help lists every mode', () => {
  const r = run('--help');
  expect(r.status).toBe(0);
  for (const mode of ['dev', 'worker', 'controller', 'gateway', 'bridge', 'engine', 'convert']) expect(r.stdout).toMatch(new RegExp(`^  ${mode} `, 'm'));
});

test('a mode that is not built yet says so and exits 2', () => {
  const r = run('controller');
  expect(r.status).toBe(2);
  expect(r.stderr).toMatch(/magus controller: not yet available/);
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

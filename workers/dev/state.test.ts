import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, statSync, writeFileSync, existsSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isApiToken, keptSecret, LOCK_FILE, lockDataDir, newApiToken, removeDevConnection, wipeDataDir, writeDevConnection } from './state';
import type { DevConnection } from '../config';

let dir: string;
beforeEach(() => {
  dir = join(mkdtempSync(join(tmpdir(), 'magus-dev-state-')), 'dev');
});
afterEach(() => rmSync(join(dir, '..'), { recursive: true, force: true }));

test('one magus dev per data folder: the second is refused, naming the first; after release it is free', () => {
  const release = lockDataDir(dir);
  expect(statSync(dir).mode & 0o777).toBe(0o700);
  let err: unknown;
  try {
    lockDataDir(dir);
  } catch (e) {
    err = e;
  }
  expect((err as Error).name).toBe('DevDataDirLocked');
  expect((err as Error).message).toBe(
    `another magus dev (pid ${process.pid}) is using ${dir}; stop that one first, or give this one its own folder with --data-dir`,
  );
  release();
  expect(existsSync(join(dir, LOCK_FILE))).toBe(false);
  lockDataDir(dir)();
});

test('a lock left by a dev that is gone (killed), or by a pid now another process has, is taken over', () => {
  const gone = spawnSync(process.execPath, ['-e', 'process.stdout.write(String(process.pid))'], { encoding: 'utf8' });
  lockDataDir(dir)();
  writeFileSync(join(dir, LOCK_FILE), JSON.stringify({ pid: Number(gone.stdout), start: '1' }));
  lockDataDir(dir)();
  // Our own pid, but another start time: the pid was reused.
  writeFileSync(join(dir, LOCK_FILE), JSON.stringify({ pid: process.pid, start: '1' }));
  const release = lockDataDir(dir);
  expect((JSON.parse(readFileSync(join(dir, LOCK_FILE), 'utf8')) as { pid: number }).pid).toBe(process.pid);
  release();
});

test('--fresh empties the folder but for the lock', () => {
  const release = lockDataDir(dir);
  writeFileSync(join(dir, 'api-token'), 'x');
  wipeDataDir(dir);
  expect(existsSync(join(dir, 'api-token'))).toBe(false);
  expect(existsSync(join(dir, LOCK_FILE))).toBe(true);
  release();
});

test('a kept secret is made once (0600) and read back; a damaged one is replaced', () => {
  lockDataDir(dir)();
  const made = keptSecret(dir, 'api-token', newApiToken, isApiToken);
  expect(made.made).toBe(true);
  expect(isApiToken(made.value)).toBe(true);
  expect(statSync(made.file).mode & 0o777).toBe(0o600);
  expect(keptSecret(dir, 'api-token', newApiToken, isApiToken)).toEqual({ ...made, made: false });
  writeFileSync(made.file, 'garbage', { mode: 0o644 });
  const again = keptSecret(dir, 'api-token', newApiToken, isApiToken);
  expect([again.made, again.value === made.value, statSync(made.file).mode & 0o777]).toEqual([true, false, 0o600]);
});

test('the connection file is 0600 and removed only by the dev that wrote it', () => {
  lockDataDir(dir)();
  const connection = { pid: process.pid } as DevConnection;
  const file = writeDevConnection(dir, connection);
  expect(statSync(file).mode & 0o777).toBe(0o600);
  writeFileSync(file, JSON.stringify({ ...connection, pid: process.pid + 1 }));
  removeDevConnection(dir);
  expect(existsSync(file)).toBe(true);
  writeDevConnection(dir, connection);
  removeDevConnection(dir);
  expect(existsSync(file)).toBe(false);
});

/**
 * The folder `magus dev` keeps its state in (default {@link devDataDir}): one `magus dev` at a
 * time (a lock file with its pid), starting over (`--fresh`), the secrets that must outlive a
 * restart (the API token, the gateway's conversation-key secret), and the connection settings
 * every other `magus` command reads. The servers' own state (Temporal's database, the JetStream
 * store, the S3 data, etcd) is kept by `startServices({ dataDir })` in the same folder.
 */
import { randomBytes } from 'node:crypto';
import { chmodSync, mkdirSync, readdirSync, readFileSync, rmSync, unlinkSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { DEV_CONNECTION_FILE, type DevConnection } from '../config';

export const LOCK_FILE = 'magus-dev.lock';

/** Another `magus dev` runs on the folder. */
export class DevDataDirLocked extends Error {
  override readonly name = 'DevDataDirLocked';
  constructor(
    readonly dir: string,
    readonly pid: number,
  ) {
    super(`another magus dev (pid ${pid}) is using ${dir}; stop that one first, or give this one its own folder with --data-dir`);
  }
}

/** The kernel's start time of `pid` (clock ticks since boot), or undefined when it does not run. */
function startTime(pid: number): string | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    // Fields after the command (which may hold spaces and parentheses): state is 3rd, starttime 22nd.
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return fields[0] === 'Z' ? undefined : fields[19];
  } catch {
    return undefined;
  }
}

interface LockContent {
  pid: number;
  /** Its start time: a pid the kernel gave to another process since is not the locker. */
  start: string | undefined;
}

/** The folder's holder, if it still runs. */
function holder(file: string): number | undefined {
  let lock: LockContent;
  try {
    lock = JSON.parse(readFileSync(file, 'utf8')) as LockContent;
  } catch {
    return undefined; // none, or half-written by a start that died: stale either way
  }
  const now = startTime(lock.pid);
  return now !== undefined && (lock.start === undefined || now === lock.start) ? lock.pid : undefined;
}

/**
 * Takes the folder for this process (creating it, mode 0700) or throws {@link DevDataDirLocked}
 * naming the `magus dev` that holds it. A lock left by a dev that is gone (killed) is taken over.
 * Returns the release, which removes the lock if it is still this process's.
 */
export function lockDataDir(dir: string): () => void {
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  const file = join(dir, LOCK_FILE);
  const content = JSON.stringify({ pid: process.pid, start: startTime(process.pid) } satisfies LockContent);
  for (let i = 0; ; i++) {
    try {
      writeFileSync(file, content, { flag: 'wx', mode: 0o600 });
      break;
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== 'EEXIST' || i >= 3) throw err;
      const pid = holder(file);
      if (pid !== undefined) throw new DevDataDirLocked(dir, pid);
      // Stale: removed, then created exclusively again; of two starts racing here one wins.
      rmSync(file, { force: true });
    }
  }
  return () => {
    try {
      if (readFileSync(file, 'utf8') === content) unlinkSync(file);
    } catch {
      // already gone
    }
  };
}

/** Empties a locked data folder but for its lock: `magus dev --fresh`. */
export function wipeDataDir(dir: string): void {
  for (const entry of readdirSync(dir)) if (entry !== LOCK_FILE) rmSync(join(dir, entry), { recursive: true, force: true });
}

/**
 * The secret kept in `<dir>/<name>` (0600), made by `make` on first use. A file that does not
 * pass `valid` (edited, truncated) is replaced.
 */
export function keptSecret(dir: string, name: string, make: () => string, valid: (value: string) => boolean): { value: string; file: string; made: boolean } {
  const file = join(dir, name);
  try {
    const value = readFileSync(file, 'utf8').trim();
    if (valid(value)) {
      chmodSync(file, 0o600);
      return { value, file, made: false };
    }
  } catch {
    // not made yet
  }
  const value = make();
  writeFileSync(file, `${value}\n`, { mode: 0o600 });
  chmodSync(file, 0o600); // an existing file keeps its mode through writeFileSync
  return { value, file, made: true };
}

/** A dev API token: `mgs_dev_<48 hex>`. */
export const newApiToken = (): string => `mgs_dev_${randomBytes(24).toString('hex')}`;
export const isApiToken = (v: string): boolean => /^mgs_dev_[0-9a-f]{48}$/.test(v);

/** Writes `<dir>/connection.json` (0600: it holds the S3 keys); returns its path. */
export function writeDevConnection(dir: string, connection: DevConnection): string {
  const file = join(dir, DEV_CONNECTION_FILE);
  writeFileSync(file, `${JSON.stringify(connection, null, 2)}\n`, { mode: 0o600 });
  chmodSync(file, 0o600);
  return file;
}

/** Removes the connection file if this process wrote it: the settings end with the dev. */
export function removeDevConnection(dir: string): void {
  const file = join(dir, DEV_CONNECTION_FILE);
  try {
    if ((JSON.parse(readFileSync(file, 'utf8')) as DevConnection).pid === process.pid) unlinkSync(file);
  } catch {
    // gone, or another's
  }
}

/** Ports of this folder's own listeners (the gateway), remembered between starts in `dev.json`. */
export interface DevPorts {
  gateway?: number;
}

export function readDevPorts(dir: string): DevPorts {
  try {
    return JSON.parse(readFileSync(join(dir, 'dev.json'), 'utf8')) as DevPorts;
  } catch {
    return {};
  }
}

export function writeDevPorts(dir: string, ports: DevPorts): void {
  writeFileSync(join(dir, 'dev.json'), `${JSON.stringify(ports)}\n`, { mode: 0o600 });
}

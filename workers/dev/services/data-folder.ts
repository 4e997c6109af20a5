/**
 * The folder the servers keep their data and logs in: a kept one (`magus dev`'s, which remembers
 * in `services.json` the ports and credentials of the last start) or a throwaway one under a
 * root, removed on stop — and by the next start, if its owner died without stopping.
 */
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { ServerPorts } from './ports';
import type { S3Credentials } from './servers';

/** What `services.json` in a kept folder remembers between starts. */
export interface SavedServices {
  /** server → role → port. */
  ports?: ServerPorts;
  s3?: S3Credentials;
  kubernetes?: { token: string };
}

const SAVED_FILE = 'services.json';
const THROWAWAY_PREFIX = 'magus-services-';

export class DataFolder {
  /** `<path>/logs`: each server's output, the run before kept in `logs.previous`. */
  readonly logDir: string;
  /** What the last start on a kept folder remembered (nothing for a throwaway one). */
  readonly saved: SavedServices;

  private constructor(
    readonly path: string,
    readonly kept: boolean,
  ) {
    this.saved = kept ? readSaved(path) : {};
    this.logDir = join(path, 'logs');
    mkdirSync(this.logDir, { recursive: true });
  }

  /** `dataDir` kept across starts, or else a new throwaway folder under `dataRoot` (the OS temp dir). */
  static open(opts: { dataDir?: string; dataRoot?: string }): DataFolder {
    if (opts.dataDir !== undefined) {
      const dir = opts.dataDir;
      mkdirSync(dir, { recursive: true, mode: 0o700 });
      // The logs of the run before stay beside this run's, one run deep.
      rmSync(join(dir, 'logs.previous'), { recursive: true, force: true });
      if (existsSync(join(dir, 'logs'))) renameSync(join(dir, 'logs'), join(dir, 'logs.previous'));
      return new DataFolder(dir, true);
    }
    const root = opts.dataRoot ?? tmpdir();
    sweepStale(root);
    const dir = mkdtempSync(join(root, THROWAWAY_PREFIX));
    writeFileSync(join(dir, 'owner.pid'), String(process.pid));
    return new DataFolder(dir, false);
  }

  /** Writes `services.json` (0600: it holds credentials), on a kept folder only. */
  save(next: SavedServices): void {
    if (this.kept) writeFileSync(join(this.path, SAVED_FILE), `${JSON.stringify(next, null, 2)}\n`, { mode: 0o600 });
  }

  /** Removes a throwaway folder; a kept one stays. */
  release(): void {
    if (!this.kept) rmSync(this.path, { recursive: true, force: true });
  }
}

function readSaved(dir: string): SavedServices {
  try {
    return JSON.parse(readFileSync(join(dir, SAVED_FILE), 'utf8')) as SavedServices;
  } catch {
    return {};
  }
}

/** Removes throwaway folders of earlier runs whose owning process is gone (e.g. after a SIGKILL). */
function sweepStale(root: string): void {
  for (const entry of readdirSync(root)) {
    if (!entry.startsWith(THROWAWAY_PREFIX)) continue;
    const dir = join(root, entry);
    try {
      const pid = Number(readFileSync(join(dir, 'owner.pid'), 'utf8'));
      process.kill(pid, 0);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'EPERM') continue;
      rmSync(dir, { recursive: true, force: true });
    }
  }
}

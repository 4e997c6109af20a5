/**
 * An older commit of magus, built as users build it (tsc → dist/), for tests that run the code of
 * its day live and then switch to today's on the same state (test/protocol-upgrade.int.test.ts).
 * Taken from this clone's history (`git archive`), compiled against this checkout's node_modules
 * (the commit's dependencies must be the same), and kept in the cache: built once per machine.
 */
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, readlinkSync, renameSync, rmSync, symlinkSync } from 'node:fs';
import { homedir } from 'node:os';
import { join } from 'node:path';
import { REPO_ROOT } from './dev';

/** The path of `bin/magus.js` of `commit`'s build, building it first when the cache has none. */
export function oldMagusBin(commit: string): string {
  const root = join(homedir(), '.cache', 'magus', 'old-magus');
  const dir = join(root, commit);
  const bin = join(dir, 'bin', 'magus.js');
  const modules = join(REPO_ROOT, 'node_modules');
  if (existsSync(join(dir, 'dist', 'workers', 'magus.js'))) {
    // The cache outlives the clone that built it: its modules are this checkout's.
    if (readlinkSync(join(dir, 'node_modules')) !== modules) {
      rmSync(join(dir, 'node_modules'));
      symlinkSync(modules, join(dir, 'node_modules'));
    }
    return bin;
  }
  try {
    execFileSync('git', ['cat-file', '-e', `${commit}^{commit}`], { cwd: REPO_ROOT, stdio: 'ignore' });
  } catch {
    throw new Error(`commit ${commit} is not in this clone's history (a shallow clone?): the upgrade test runs that commit's code`);
  }
  // Built under a temporary name and renamed when complete: a build cut short is never taken.
  const tmp = `${dir}.tmp-${process.pid}`;
  rmSync(tmp, { recursive: true, force: true });
  mkdirSync(tmp, { recursive: true });
  try {
    execFileSync('sh', ['-c', `git archive ${commit} | tar -x -C "${tmp}"`], { cwd: REPO_ROOT, stdio: ['ignore', 'ignore', 'pipe'] });
    symlinkSync(modules, join(tmp, 'node_modules'));
    execFileSync(process.execPath, [join(REPO_ROOT, 'node_modules', 'typescript', 'bin', 'tsc'), '-p', 'tsconfig.build.json'], { cwd: tmp, stdio: ['ignore', 'pipe', 'pipe'], timeout: 600_000 });
    rmSync(dir, { recursive: true, force: true });
    renameSync(tmp, dir);
  } catch (err) {
    rmSync(tmp, { recursive: true, force: true });
    throw err;
  }
  return bin;
}

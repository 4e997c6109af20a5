/**
 * Where the server binaries come from: the one module that knows. Today every one is resolved by
 * `scripts/dev-services` (env var `MAGUS_<NAME>_BIN` → PATH → cache → a pinned release binary
 * fetched, or a pinned build), which knows the versions and how to get them; a change of where a
 * binary comes from is made here and in that script, and nowhere else.
 */
import { execFile, spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { createInterface } from 'node:readline';
import { promisify } from 'node:util';
import type { ServiceName } from './types';

/**
 * What `scripts/dev-services` resolves (`kwok-stages`, a folder of kwok's Stage YAMLs, comes with
 * `kwok`). `s3proxy` is a jar, run with `java`; `minio` serves only a folder MinIO wrote earlier.
 */
export type BinaryName =
  | 'temporal'
  | 'nats-server'
  | 's3proxy'
  | 'minio'
  | 'etcd'
  | 'kube-apiserver'
  | 'kube-controller-manager'
  | 'kube-scheduler'
  | 'kubelet'
  | 'kwok'
  | 'dllama'
  | 'dllama-api';
export type Binaries = Partial<Record<BinaryName | 'kwok-stages', string>>;

/** The binaries each service runs. */
export const BINARIES_OF: Readonly<Record<ServiceName, readonly BinaryName[]>> = {
  temporal: ['temporal'],
  nats: ['nats-server'],
  s3: ['s3proxy'],
  kubernetes: ['etcd', 'kube-apiserver'],
};

/** The checkout this module lives in, from sources (workers/dev/services) or from dist/workers/dev/services. */
export const REPO_ROOT = (() => {
  let dir = __dirname;
  while (!existsSync(join(dir, 'scripts', 'dev-services'))) {
    const up = dirname(dir);
    if (up === dir) throw new Error(`cannot find the magus checkout above ${__dirname}`);
    dir = up;
  }
  return dir;
})();

const SCRIPT = join(REPO_ROOT, 'scripts', 'dev-services');

/**
 * Resolves `names` (fetching or building what is missing). With `log`, the script's progress is
 * shown as it comes: one line per server fetched or built (a build takes minutes the first
 * time). On a terminal the script writes to it itself, so that its line is updated in place;
 * elsewhere each of its lines (one at the start of a build, one every 30 s, one at the end) goes
 * to `log`.
 */
export async function resolveBinaries(names: readonly BinaryName[], log?: (line: string) => void): Promise<Binaries> {
  const onTerminal = log !== undefined && process.stderr.isTTY === true;
  // Under setpriv too: a build takes minutes, and must not outlive a magus dev stopped meanwhile.
  const child = spawn('setpriv', ['--pdeathsig', 'KILL', '--', SCRIPT, '--json', ...names], {
    stdio: ['ignore', 'pipe', onTerminal ? 'inherit' : 'pipe'],
  });
  let stdout = '';
  let stderr = '';
  child.stdout!.on('data', (d: Buffer) => (stdout += d.toString()));
  if (child.stderr)
    createInterface({ input: child.stderr }).on('line', (line) => {
      stderr += `${line}\n`;
      log?.(line.replace(/^dev-services: /, ''));
    });
  const limit = setTimeout(() => child.kill('SIGKILL'), 60 * 60 * 1000);
  try {
    const code = await new Promise<number | null>((resolve, reject) => {
      child.once('error', reject);
      child.once('close', resolve);
    });
    if (code !== 0) throw new Error(`exit ${code}`);
    return JSON.parse(stdout.trim().split('\n').pop() ?? '{}') as Binaries;
  } catch (err) {
    // On a terminal the script has already shown why (a failed build's last lines and its log).
    throw new Error(
      `could not resolve ${names.join(', ')} (${(err as Error).message}); run 'scripts/dev-services' to build them.${stderr ? `\n${stderr}` : ''}`,
    );
  } finally {
    clearTimeout(limit);
  }
}

/** The path of `name` among `resolved`; throws when the script did not give one. */
export function binaryPath(resolved: Binaries, name: BinaryName | 'kwok-stages'): string {
  const path = resolved[name];
  if (!path) throw new Error(`scripts/dev-services did not resolve ${name}`);
  return path;
}

/** Whether `names` are at hand without a fetch or build (never starts one: a build takes minutes). */
export async function binariesBuilt(names: readonly BinaryName[]): Promise<boolean> {
  try {
    await promisify(execFile)(SCRIPT, ['--check', ...names], { timeout: 30_000 });
    return true;
  } catch {
    return false;
  }
}

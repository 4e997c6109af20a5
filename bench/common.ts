/**
 * What the benchmarks share: nearest-rank statistics over load results, their child processes
 * (forked under the same TypeScript loader, asked over IPC), and a process's CPU time.
 */
import { fork, spawn, type ChildProcess } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import type { LoadResult, LoadSpec } from './gateway-client';

export function quantile(values: readonly number[], q: number): number {
  if (values.length === 0) return NaN;
  const s = [...values].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil(q * s.length) - 1))]!;
}
export const p50 = (v: readonly number[]) => quantile(v, 0.5);
export const p99 = (v: readonly number[]) => quantile(v, 0.99);
export const fmt = (v: number, digits = 2) => (Number.isFinite(v) ? v.toFixed(digits) : '—');
export const signed = (v: number, digits = 2) => `${v >= 0 ? '+' : ''}${fmt(v, digits)}`;

/** Each streamed request's time to its first content chunk, ms. */
export const firstChunkMs = (r: LoadResult[]) => r.flatMap((x) => x.samples.map((s) => s.chunks![0]! - s.start));

/** Each request's latency (send → end), ms. */
export const latencies = (r: LoadResult[]) => r.flatMap((x) => x.samples.map((s) => s.end - s.start));

/** A `magus gateway` of this checkout, listening. */
export interface GatewayProcess {
  child: ChildProcess;
  url: string;
  exited: Promise<void>;
  /** From spawn to its `listening` line. */
  listeningMs: number;
}

/**
 * Spawns `magus gateway` (`bin/magus.js`, with `nodeArgs` before it) with `env` (the caller's
 * whole environment) and resolves once it says it listens; gone with this process (`setpriv
 * --pdeathsig`). Its stdout is piped when `stdout` is, for the caller to read (its log lines).
 */
export async function spawnGateway(env: NodeJS.ProcessEnv, opts: { stdout?: 'pipe' | 'ignore'; nodeArgs?: string[] } = {}): Promise<GatewayProcess> {
  const started = performance.now();
  const root = join(__dirname, '..');
  const child = spawn('setpriv', ['--pdeathsig', 'KILL', '--', process.execPath, ...(opts.nodeArgs ?? []), join(root, 'bin', 'magus.js'), 'gateway'], {
    cwd: root,
    env,
    stdio: ['ignore', opts.stdout ?? 'ignore', 'pipe'],
  });
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  let err = '';
  const url = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`magus gateway did not listen within 60 s:\n${err}`)), 60_000);
    child.stderr!.on('data', (d: Buffer) => {
      err += d.toString();
      const m = /magus gateway: listening on (http:\/\/\S+) /.exec(err);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]!);
      }
    });
    void exited.then(() => reject(new Error(`magus gateway exited before listening:\n${err}`)));
  });
  return { child, url, exited, listeningMs: performance.now() - started };
}

/** Forks a bench child (a file next to this one) under the same TypeScript loader as this process. */
export function child(file: string): ChildProcess {
  return fork(join(__dirname, file), [], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
}

/** Sends `msg` to a child and resolves with its reply; rejects on an `error` reply or when the child exits first. */
export function ask<T>(proc: ChildProcess, msg: object): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const onExit = (code: number | null) => reject(new Error(`bench child exited (${code}) while answering ${JSON.stringify(msg).slice(0, 80)}`));
    proc.once('exit', onExit);
    proc.once('message', (reply: T & { error?: string }) => {
      proc.off('exit', onExit);
      if (reply.error !== undefined) reject(new Error(reply.error));
      else resolve(reply);
    });
    proc.send(msg);
  });
}

/** Runs one load spec in the load client (bench/gateway-client.ts). */
export const load = async (client: ChildProcess, spec: LoadSpec) => (await ask<{ result: LoadResult }>(client, { spec })).result;

/** CPU seconds (user + system) a process has used so far, from /proc. */
/** A process's resident memory (MB). */
export const rssMb = (pid: number): number => Number(/VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))?.[1] ?? 0) / 1024;

export function cpuOf(pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  const f = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return (Number(f[11]) + Number(f[12])) / 100;
}

/** One turn of a rate-driven load: its HTTP status (or a client timeout), latency, error code and when it ended. */
export interface TurnResult {
  status: number | 'timeout';
  ms: number;
  code?: string;
  at: number;
}

/** `429 backlog_full`, `timeout`, …: how a turn that was not answered is counted. */
export const turnKind = (r: TurnResult): string => `${r.status}${r.code ? ` ${r.code}` : ''}`;

/**
 * The 30-s windows (by answer time, from `t0`) with an error or a p99 over 1 s, one line each:
 * where in a step things went wrong. `more(w)` adds to window `w`'s line.
 */
export function badWindows(results: readonly TurnResult[], t0: number, end: number, more?: (w: number) => string): string[] {
  const lines: string[] = [];
  for (let w = 0; w * 30_000 < end - t0; w++) {
    const inWindow = results.filter((r) => r.at - t0 >= w * 30_000 && r.at - t0 < (w + 1) * 30_000);
    const bad = new Map<string, number>();
    for (const r of inWindow) if (r.status !== 200) bad.set(turnKind(r), (bad.get(turnKind(r)) ?? 0) + 1);
    const wp99 = p99(inWindow.filter((r) => r.status === 200).map((r) => r.ms));
    if (bad.size > 0 || wp99 > 1000)
      lines.push(
        `    ${w * 30}-${(w + 1) * 30} s: ${inWindow.length} done, p99 ${fmt(wp99, 0)} ms, ${[...bad].map(([k, v]) => `${v}×${k}`).join(', ') || 'no error'}${more ? `; ${more(w)}` : ''}`,
      );
  }
  return lines;
}

/**
 * In-process CPU profiles for benchmarks: start V8's sampling profiler through `node:inspector`,
 * stop it, and summarise where the samples fell — by function (self time) and by package or
 * source folder — without writing a `.cpuprofile` anyone has to open.
 */
import { writeFileSync } from 'node:fs';
import { Session } from 'node:inspector';
import { join, relative, resolve } from 'node:path';

/** Self time in ms: the top functions and the top places (a package, a file of this repo, or native). */
export interface CpuSummary {
  totalMs: number;
  functions: [string, number][];
  places: [string, number][];
}

interface ProfileNode {
  id: number;
  callFrame: { functionName: string; url: string; lineNumber: number };
  hitCount?: number;
}

interface Profile {
  nodes: ProfileNode[];
  startTime: number;
  endTime: number;
  samples?: number[];
  timeDeltas?: number[];
}

const repoRoot = resolve(__dirname, '..');

function place(url: string): string {
  if (!url) return '(native / V8)';
  const path = url.replace(/^file:\/\//, '');
  const nm = path.lastIndexOf('node_modules/');
  if (nm >= 0) {
    const parts = path.slice(nm + 'node_modules/'.length).split('/');
    return parts[0]!.startsWith('@') ? `${parts[0]}/${parts[1]}` : parts[0]!;
  }
  if (path.startsWith('node:'))
    return path
      .split('/')
      .slice(0, path.startsWith('node:internal/deps/') ? 3 : 2)
      .join('/');
  const rel = relative(repoRoot, path);
  return rel.startsWith('..') ? path : rel;
}

/**
 * Starts sampling every `intervalUs`; the returned function stops and summarises. With
 * `BENCH_PROFILE_DIR` set, the raw profile is also written there as `<name>.cpuprofile` (open it
 * in Chrome DevTools or any flame-graph viewer to see callers).
 */
export async function startCpuProfile(name: string, intervalUs = 200): Promise<() => Promise<CpuSummary>> {
  const session = new Session();
  session.connect();
  const post = <T>(method: string, params?: object) =>
    new Promise<T>((resolve, reject) => session.post(method, params ?? {}, (err, res) => (err ? reject(err) : resolve(res as T))));
  await post('Profiler.enable');
  await post('Profiler.setSamplingInterval', { interval: intervalUs });
  await post('Profiler.start');
  return async () => {
    const { profile } = await post<{ profile: Profile }>('Profiler.stop');
    session.disconnect();
    const dir = process.env.BENCH_PROFILE_DIR;
    if (dir) writeFileSync(join(dir, `${name}.cpuprofile`), JSON.stringify(profile));
    // Time per sample from the sample deltas (µs); idle is left out of the total.
    const byNode = new Map<number, ProfileNode>(profile.nodes.map((n) => [n.id, n]));
    const self = new Map<number, number>();
    const samples = profile.samples ?? [];
    const deltas = profile.timeDeltas ?? [];
    for (let i = 0; i < samples.length; i++) self.set(samples[i]!, (self.get(samples[i]!) ?? 0) + (deltas[i + 1] ?? deltas[i] ?? 0) / 1000);
    const functions = new Map<string, number>();
    const places = new Map<string, number>();
    let totalMs = 0;
    for (const [id, ms] of self) {
      const { functionName, url, lineNumber } = byNode.get(id)!.callFrame;
      if (functionName === '(idle)') continue;
      totalMs += ms;
      const where = place(url);
      const fn = url
        ? `${functionName || '(anonymous)'} ${where.includes('/') || where.includes('.') ? `${where}:${lineNumber + 1}` : `(${where})`}`
        : functionName;
      functions.set(fn, (functions.get(fn) ?? 0) + ms);
      places.set(where, (places.get(where) ?? 0) + ms);
    }
    const top = (m: Map<string, number>, k: number) => [...m].sort((a, b) => b[1] - a[1]).slice(0, k);
    return { totalMs, functions: top(functions, 12), places: top(places, 10) };
  };
}

/**
 * A profile's summary as report lines: `label: <ms> ms/request`, then its top `places` places and
 * top 8 functions, each in ms of CPU per request (`requests` profiled), indented by `indent`.
 */
export function profileLines(label: string, p: CpuSummary, requests: number, indent: string, places: number): string[] {
  const per = (ms: number) => (Number.isFinite(ms / requests) ? (ms / requests).toFixed(3) : '—');
  const top = (list: readonly (readonly [string, number])[], n: number) =>
    list
      .slice(0, n)
      .map(([k, v]) => `${k} ${per(v)}`)
      .join(', ');
  return [
    `${indent}${label}: ${per(p.totalMs)} ms/request`,
    `${indent}  by place:    ${top(p.places, places)}`,
    `${indent}  by function: ${top(p.functions, 8)}`,
  ];
}

/**
 * Soak: mixed traffic for a while through `magus dev`'s own processes (Temporal, NATS, MinIO, the
 * worker with its engine, the gateway), watching for what only time shows — errors, memory and
 * handle growth, NATS consumers and KV keys left behind.
 *
 *   npm run soak                       # 10 minutes (the issue's full run)
 *   npm run soak -- --minutes 2 --concurrency 4 --new-per-sec 2
 *
 * Traffic, from `--concurrency` loops: new conversations (non-streamed, at most `--new-per-sec`,
 * default 2), warm turns on live ones
 * (streamed and not), and injected client disconnects (a streamed request aborted after its first
 * chunk); halfway, the demo model is re-pulled with a changed spec (a second artifact), so its
 * pipeline re-plans, converts and publishes while it is being served. Every `--sample-sec` it
 * samples the RSS and open file descriptors of every process of dev's tree, and NATS: consumers
 * per stream and the keys of `magus_sessions` / `magus_pools`.
 *
 * The report: requests by outcome (an error is anything but a 200 or an injected disconnect), p50 /
 * p99 latency per minute, each process's RSS and fd slope after warm-up (least squares, per
 * minute), and whether consumers and keys stay within what live conversations explain. Exit 1 when
 * an error or a leak is found. `test/soak.int.test.ts` runs a short variant in CI.
 */
import { spawn } from 'node:child_process';
import { cpSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { connect, type NatsConnection } from 'nats';
import { dataPlaneNames } from '../activities/nats/data-plane';
import type { DevConnection } from '../workers/config';
import { MAGUS_BIN, printed, processTree, startDev, type DevRun } from '../test/harness/dev';
import { fmt, p50, p99 } from './common';

export interface SoakOptions {
  durationMs: number;
  concurrency: number;
  /** New conversations a second, at most (the rest of the mix becomes warm turns): each one is a session workflow and a lease from its model's one pool workflow. */
  newPerSec: number;
  sampleMs: number;
  /** Samples before this share of the run are warm-up (left out of the slopes). */
  warmupShare: number;
  log: (line: string) => void;
}

type Kind = 'new' | 'warm' | 'warm-stream' | 'disconnect';
interface Outcome {
  at: number;
  kind: Kind;
  ms: number;
  /** 200, the HTTP status, or 0 when the request failed before an answer. */
  status: number;
  /** An error that was not injected. */
  error?: string;
}
interface ProcessSample {
  pid: number;
  name: string;
  rssMb: number;
  fds: number;
}
interface Sample {
  at: number;
  processes: ProcessSample[];
  consumers: Record<string, number>;
  sessionKeys: number;
  poolKeys: number;
  conversations: number;
}

export interface SoakReport {
  requests: Record<Kind, { ok: number; injected: number; errors: number }>;
  errors: string[];
  perMinute: { minute: number; n: number; p50: number; p99: number; max: number }[];
  /** Per process name (pids can change: an engine restarted is a new process): MB/min and fds/min after warm-up. */
  slopes: { name: string; rssMbPerMin: number; fdsPerMin: number; rssMb: [number, number]; fds: [number, number] }[];
  consumers: { first: Record<string, number>; last: Record<string, number> };
  sessionKeys: { last: number; conversations: number };
  repull: { ok: boolean; detail: string };
  leaks: string[];
  /** Where dev's logs were kept, when something went wrong. */
  logs?: string;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
/** Longer than any answer of the demo model should take, cold start included. */
const REQUEST_TIMEOUT_MS = 60_000;

/** `cmdline` as a short, stable name: the program and the magus mode, if any. */
function processName(pid: number): string {
  try {
    const argv = readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').filter(Boolean);
    const prog = (argv[0] ?? '?').split('/').pop()!;
    const mode = argv.find((a, i) => i > 0 && /^(dev|worker|gateway|engine|bridge|controller|server|start-dev)$/.test(a));
    if (prog === 'node' && argv.some((a) => a.endsWith('magus.js'))) return `magus ${mode ?? ''}`.trim();
    return mode ? `${prog} ${mode}` : prog;
  } catch {
    return '?';
  }
}

function sampleProcess(pid: number): ProcessSample | undefined {
  try {
    const status = readFileSync(`/proc/${pid}/status`, 'utf8');
    const rssKb = Number(/VmRSS:\s+(\d+)/.exec(status)?.[1] ?? 0);
    return { pid, name: processName(pid), rssMb: rssKb / 1024, fds: readdirSync(`/proc/${pid}/fd`).length };
  } catch {
    return undefined; // exited meanwhile
  }
}

/** Least-squares slope of `ys` over `xs` (per unit of x). */
function slope(xs: number[], ys: number[]): number {
  const n = xs.length;
  if (n < 2) return 0;
  const mx = xs.reduce((a, b) => a + b, 0) / n;
  const my = ys.reduce((a, b) => a + b, 0) / n;
  let num = 0;
  let den = 0;
  for (let i = 0; i < n; i++) {
    num += (xs[i]! - mx) * (ys[i]! - my);
    den += (xs[i]! - mx) ** 2;
  }
  return den === 0 ? 0 : num / den;
}

async function natsSample(nc: NatsConnection, names: ReturnType<typeof dataPlaneNames>): Promise<Pick<Sample, 'consumers' | 'sessionKeys' | 'poolKeys'>> {
  const jsm = await nc.jetstreamManager();
  const consumers: Record<string, number> = {};
  for await (const s of jsm.streams.list()) consumers[s.config.name] = s.state.consumer_count;
  const count = async (bucket: string) => {
    const kv = await nc.jetstream().views.kv(bucket);
    let n = 0;
    for await (const _ of await kv.keys()) n++;
    return n;
  };
  return { consumers, sessionKeys: await count(names.sessionsBucket), poolKeys: await count(names.poolsBucket) };
}

/** Runs the soak against a `magus dev` it starts (fresh, in a temporary folder) and stops. */
export async function runSoak(opts: SoakOptions): Promise<SoakReport> {
  const data = mkdtempSync(join(tmpdir(), 'magus-soak-'));
  const env = { ...process.env };
  for (const name of Object.keys(env)) if (/^MAGUS_|^AWS_/.test(name)) delete env[name];
  let dev: DevRun | undefined;
  let nc: NatsConnection | undefined;
  let keptLogs: string | undefined;
  try {
    dev = startDev('direct', ['--no-kube', '--data-dir', data], env);
    await dev.ready();
    const { gatewayUrl, tokenFile } = printed(dev.stdout());
    const token = readFileSync(tokenFile, 'utf8').trim();
    const connection = JSON.parse(readFileSync(join(data, 'connection.json'), 'utf8')) as DevConnection;
    nc = await connect({ servers: connection.nats.servers });
    const names = dataPlaneNames('');
    opts.log(`soak: magus dev ready (pid ${dev.child.pid}); ${opts.concurrency} loops for ${Math.round(opts.durationMs / 1000)} s`);

    const outcomes: Outcome[] = [];
    const conversations: string[] = [];
    let seq = 0;
    const t0 = Date.now();
    const until = t0 + opts.durationMs;

    const request = async (kind: Kind, conversation: string): Promise<void> => {
      const stream = kind === 'warm-stream' || kind === 'disconnect';
      const ctl = new AbortController();
      // A request that hangs is an error too (and must not stall its loop for the rest of the run).
      const hung = setTimeout(() => ctl.abort(new Error(`no answer within ${REQUEST_TIMEOUT_MS / 1000} s`)), REQUEST_TIMEOUT_MS);
      const started = performance.now();
      const at = Date.now();
      let status = 0;
      try {
        const res = await fetch(`${gatewayUrl}/v1/chat/completions`, {
          method: 'POST',
          signal: ctl.signal,
          headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json', 'x-session-id': conversation },
          body: JSON.stringify({ model: 'demo', messages: [{ role: 'user', content: `turn ${seq++}` }], max_tokens: 8, stream }),
        });
        status = res.status;
        if (kind === 'disconnect' && res.ok && res.body) {
          // The client goes away after the first chunk: the gateway cancels, the engine stops.
          const reader = res.body.getReader();
          await reader.read();
          ctl.abort();
          await reader.cancel().catch(() => undefined);
          outcomes.push({ at, kind, ms: performance.now() - started, status });
          return;
        }
        const body = await res.text();
        const complete = !stream || body.trimEnd().endsWith('data: [DONE]');
        outcomes.push({ at, kind, ms: performance.now() - started, status, ...(res.ok && complete ? {} : { error: `${status} ${body.slice(0, 200)}` }) });
      } catch (err) {
        const reason = ctl.signal.aborted && ctl.signal.reason instanceof Error ? ctl.signal.reason.message : (err as Error).message;
        outcomes.push({ at, kind, ms: performance.now() - started, status, error: reason });
      } finally {
        clearTimeout(hung);
      }
    };

    let nextNewAt = 0;
    const loop = async (n: number): Promise<void> => {
      for (let i = 0; Date.now() < until; i++) {
        const r = (i * 7 + n * 13) % 20; // a fixed mix: 4 new, 9 warm, 5 warm streamed, 2 disconnects in 20
        let kind: Kind = r < 4 || conversations.length < opts.concurrency ? 'new' : r < 13 ? 'warm' : r < 18 ? 'warm-stream' : 'disconnect';
        if (kind === 'new' && conversations.length >= opts.concurrency) {
          if (Date.now() < nextNewAt) kind = 'warm';
          else nextNewAt = Date.now() + 1000 / opts.newPerSec;
        }
        const conversation = kind === 'new' ? `soak-${n}-${i}-${Date.now().toString(36)}` : conversations[(i * 31 + n) % conversations.length]!;
        if (kind === 'new') conversations.push(conversation);
        await request(kind, conversation);
      }
    };

    // Halfway: the demo model re-pulled with a second artifact, while it is served.
    const repull = (async (): Promise<SoakReport['repull']> => {
      await sleep(opts.durationMs / 2);
      // Its own process, waited for without blocking this one (the traffic goes on meanwhile).
      const pull = spawn(process.execPath, [MAGUS_BIN, 'model', 'pull', 'magus-demo/tiny-llama', '--format', 'gguf:q40,gguf:q80', '--name', 'demo'], {
        env: { ...env, MAGUS_DEV_DATA_DIR: data },
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      let out = '';
      pull.stdout.on('data', (d: Buffer) => (out += d.toString()));
      pull.stderr.on('data', (d: Buffer) => (out += d.toString()));
      const killer = setTimeout(() => pull.kill('SIGKILL'), Math.max(60_000, opts.durationMs / 2));
      const code = await new Promise<number | null>((r) => pull.once('exit', r));
      clearTimeout(killer);
      const ok = code === 0 && out.includes('default/demo is ready');
      return { ok, detail: ok ? 'demo re-pulled with gguf:q40,gguf:q80 under traffic: ready' : `exit ${code}: ${out.slice(-400)}` };
    })();

    const samples: Sample[] = [];
    const sampler = (async () => {
      while (Date.now() < until) {
        const processes = processTree(dev.child.pid!)
          .map(sampleProcess)
          .filter((p): p is ProcessSample => p !== undefined);
        samples.push({ at: Date.now(), processes, ...(await natsSample(nc, names)), conversations: conversations.length });
        await sleep(opts.sampleMs);
      }
    })();

    await Promise.all([...Array.from({ length: opts.concurrency }, (_, n) => loop(n)), sampler]);
    const repulled = await repull;
    const last = await natsSample(nc, names);
    const r = report(outcomes, samples, { ...last, at: Date.now(), processes: [], conversations: conversations.length }, repulled, t0, opts);
    if (r.errors.length > 0 || r.leaks.length > 0 || !r.repull.ok) {
      // What dev's processes logged, for whoever looks into it.
      keptLogs = mkdtempSync(join(tmpdir(), 'magus-soak-logs-'));
      cpSync(join(data, 'logs'), keptLogs, { recursive: true });
      writeFileSync(join(keptLogs, 'magus-dev.out'), dev.stdout());
      writeFileSync(join(keptLogs, 'magus-dev.err'), dev.stderr());
      r.logs = keptLogs;
    }
    return r;
  } finally {
    await nc?.close().catch(() => undefined);
    if (dev) {
      dev.child.kill('SIGINT');
      await Promise.race([dev.exited, sleep(60_000)]);
      dev.killTree();
    }
    rmSync(data, { recursive: true, force: true });
  }
}

function report(outcomes: Outcome[], samples: Sample[], last: Sample, repull: SoakReport['repull'], t0: number, opts: SoakOptions): SoakReport {
  const kinds: Kind[] = ['new', 'warm', 'warm-stream', 'disconnect'];
  const requests = Object.fromEntries(kinds.map((k) => [k, { ok: 0, injected: 0, errors: 0 }])) as SoakReport['requests'];
  const errors: string[] = [];
  for (const o of outcomes) {
    if (o.error !== undefined) {
      requests[o.kind].errors++;
      if (errors.length < 20) errors.push(`${o.kind}: ${o.error}`);
    } else if (o.kind === 'disconnect') requests[o.kind].injected++;
    else requests[o.kind].ok++;
  }
  const perMinute: SoakReport['perMinute'] = [];
  const answered = outcomes.filter((o) => o.error === undefined && o.kind !== 'disconnect');
  for (let m = 0; m * 60_000 < opts.durationMs; m++) {
    const ms = answered.filter((o) => o.at - t0 >= m * 60_000 && o.at - t0 < (m + 1) * 60_000).map((o) => o.ms);
    if (ms.length > 0) perMinute.push({ minute: m + 1, n: ms.length, p50: p50(ms), p99: p99(ms), max: Math.max(...ms) });
  }
  const steady = samples.filter((s) => s.at - t0 >= opts.durationMs * opts.warmupShare);
  const byName = new Map<string, { t: number[]; rss: number[]; fds: number[] }>();
  for (const s of steady) {
    // Processes of one name summed (two engines are one "engine" line): growth is what matters.
    const sums = new Map<string, { rss: number; fds: number }>();
    for (const p of s.processes) {
      const v = sums.get(p.name) ?? { rss: 0, fds: 0 };
      sums.set(p.name, { rss: v.rss + p.rssMb, fds: v.fds + p.fds });
    }
    for (const [name, v] of sums) {
      const e = byName.get(name) ?? { t: [], rss: [], fds: [] };
      e.t.push((s.at - t0) / 60_000);
      e.rss.push(v.rss);
      e.fds.push(v.fds);
      byName.set(name, e);
    }
  }
  const slopes = [...byName].map(([name, e]) => ({
    name,
    rssMbPerMin: slope(e.t, e.rss),
    fdsPerMin: slope(e.t, e.fds),
    rssMb: [e.rss[0]!, e.rss[e.rss.length - 1]!] as [number, number],
    fds: [e.fds[0]!, e.fds[e.fds.length - 1]!] as [number, number],
  }));
  const first = steady[0] ?? samples[0];
  const leaks: string[] = [];
  for (const [stream, n] of Object.entries(last.consumers)) {
    const before = first?.consumers[stream] ?? 0;
    // Consumers belong to instances (one per bridge) and gateways (ordered watchers): a few may
    // come and go with a scale event, never one per request or conversation.
    if (n > before + 4) leaks.push(`stream ${stream}: ${before} → ${n} consumers`);
  }
  if (last.sessionKeys > last.conversations) leaks.push(`magus_sessions has ${last.sessionKeys} keys for ${last.conversations} conversations`);
  for (const s of slopes) if (s.fds[1] - s.fds[0] > 50) leaks.push(`${s.name}: ${s.fds[0]} → ${s.fds[1]} open files after warm-up`);
  return { requests, errors, perMinute, slopes, consumers: { first: first?.consumers ?? {}, last: last.consumers }, sessionKeys: { last: last.sessionKeys, conversations: last.conversations }, repull, leaks };
}

export function printReport(r: SoakReport, log: (line: string) => void): void {
  log('requests: ' + Object.entries(r.requests).map(([k, v]) => `${k} ${v.ok} ok${v.injected ? ` / ${v.injected} disconnected (injected)` : ''}${v.errors ? ` / ${v.errors} ERRORS` : ''}`).join('; '));
  for (const e of r.errors) log(`  error: ${e}`);
  log('latency per minute (answered requests, ms): ' + r.perMinute.map((m) => `${m.minute}: n ${m.n} p50 ${fmt(m.p50, 0)} p99 ${fmt(m.p99, 0)} max ${fmt(m.max, 0)}`).join(' | '));
  log('after warm-up, per process (summed by name): RSS MB first→last (slope MB/min), open fds first→last (slope /min)');
  for (const s of r.slopes) log(`  ${s.name.padEnd(24)} ${fmt(s.rssMb[0], 1)} → ${fmt(s.rssMb[1], 1)} (${fmt(s.rssMbPerMin, 2)}/min)   ${s.fds[0]} → ${s.fds[1]} (${fmt(s.fdsPerMin, 2)}/min)`);
  log(`NATS consumers first → last: ${Object.keys(r.consumers.last).map((k) => `${k} ${r.consumers.first[k] ?? 0}→${r.consumers.last[k]}`).join(', ')}`);
  log(`magus_sessions keys: ${r.sessionKeys.last} for ${r.sessionKeys.conversations} conversations (live: TTL 30 min)`);
  log(`re-pull: ${r.repull.detail}`);
  log(r.leaks.length === 0 ? 'no leak found' : `LEAKS: ${r.leaks.join('; ')}`);
  if (r.logs) log(`magus dev's logs: ${r.logs}`);
}

if (require.main === module) {
  const args = process.argv.slice(2);
  const arg = (name: string, fallback: number) => {
    const i = args.indexOf(`--${name}`);
    return i >= 0 ? Number(args[i + 1]) : fallback;
  };
  const minutes = arg('minutes', 10);
  const log = (line: string) => process.stdout.write(`${line}\n`);
  runSoak({ durationMs: minutes * 60_000, concurrency: arg('concurrency', 6), newPerSec: arg('new-per-sec', 2), sampleMs: arg('sample-sec', 10) * 1000, warmupShare: 0.2, log })
    .then((r) => {
      printReport(r, log);
      const errors = Object.values(r.requests).reduce((n, v) => n + v.errors, 0);
      process.exit(errors > 0 || r.leaks.length > 0 || !r.repull.ok ? 1 : 0);
    })
    .catch((err: unknown) => {
      process.stderr.write(`soak: ${(err as Error).stack ?? String(err)}\n`);
      process.exit(1);
    });
}

/**
 * `npm run bench:gateway`'s limits part (gateway.ts runs it after the warm measurements): what a
 * key's limits (gateway/serving/limits.ts: each request admitted by a compare-and-swap in KV
 * `magus_limits` before it is queued, settled after it ends — a settle held for the key's next
 * write, written alone only when none comes within the store's hold) add to the gateway path.
 * Two keys on the same path — the bench's key without limits, and a second one whose limits
 * ({@link BENCH_LIMITS}) are too generous ever to refuse — in alternating blocks (which key goes
 * first swaps each block), each on warm sessions of its own: latency at concurrency 1, throughput
 * at concurrency 8, the CPU of the gateway, the bridge and nats-server per request, and a CPU
 * profile of the gateway for each key at concurrency 8 (BENCH_PROFILE_DIR keeps them). A traced
 * block per key at concurrency 1 (not part of the figures) times each request in the gateway and,
 * for the limited key, its compare-and-swaps in `magus_limits` (core publishes to
 * `$KV.<bucket>.<key>`, acknowledged on an inbox: the admission's, which carries the previous
 * request's settle when it came within the store's hold, and the settles written alone): how long
 * the admission waited before its write went out, each write's round trip, and writes per
 * request. Checks: no request of the limited key was refused (429), every one was settled (its
 * budget charged its usage, no reservation left), and its answers carry the `x-ratelimit-*`
 * headers.
 */
import type { ChildProcess } from 'node:child_process';
import type { Server } from 'node:http';
import type { KV, NatsConnection } from 'nats';
import { limitKeyOf } from '../dataplane/limits';
import { decodeLimitState, type KeyLimits, type LimitState } from '../shared/limits';
import { fmt, latencies, load, p50, p99, signed } from './common';
import { profileLines, startCpuProfile, type CpuSummary } from './cpu-profile';
import type { LoadResult, LoadSpec } from './gateway-client';

/** Limits that never refuse this bench: every limit set, so each is checked and counted on every request. */
export const BENCH_LIMITS: KeyLimits = {
  requestsPerMinute: 1_000_000_000,
  tokensPerMinute: 100_000_000_000,
  concurrency: 1000,
  budget: { tokens: 1_000_000_000_000_000, period: 'month' },
};
/** The issue's targets: added p50 at concurrency 1, and throughput at concurrency 8 against the key without limits. */
export const ADDED_P50_TARGET_MS = 0.3;
export const THROUGHPUT_TARGET = 0.95;

/** One key's way through the gateway: its token and its warm sessions. */
export interface KeyPath {
  url: string;
  token: string;
  model: string;
  c1Sessions: string[];
  c8Sessions: string[];
}

type Key = 'off' | 'on';
type PerKey<T> = Record<Key, T>;

export interface LimitsResult {
  c1: PerKey<LoadResult[]>;
  cpu1: PerKey<number[]>;
  c8: PerKey<LoadResult[]>;
  cpu8: PerKey<number[]>;
  profiles: PerKey<CpuSummary>;
  profiledRequests: number;
  /** `magus_gateway_limit_refusals_total` over the whole bench (every code). */
  refusals: number;
  /** Requests of the limited key after its warm-up (c=1, c=8, profiled and traced blocks) and the budget they were charged. */
  measured: number;
  charged: number;
  /** Reservations left in the key's state once every answer had ended (0: all settled). */
  reservationsLeft: number;
  /** The `x-ratelimit-*` headers of one answer of the limited key. */
  headers: Record<string, string>;
  trace: AdmissionTrace;
  wallMs: number;
}

/** The traced blocks (concurrency 1), ms. */
export interface AdmissionTrace {
  requests: number;
  /** HTTP request in → response written, in the gateway, per key. */
  gateway: PerKey<number[]>;
  /**
   * Limited key: request in → its admission's write sent (the gateway's work before it, and any
   * wait behind a write in flight), of requests that arrived while a write of the key was still
   * in flight (`behind`) and of the others (`clear`).
   */
  admitWait: { behind: number[]; clear: number[] };
  /** Limited key: the admission's compare-and-swap, and the other writes' (settles written alone, renewals), sent → acknowledged. */
  admitRtt: number[];
  otherRtt: number[];
  /** Limited key: writes to its entry in the traced block. */
  writes: number;
  /** Limited key: requests with no write of the key while they were in the gateway (admitted from a slice). */
  fromSlice: number;
}

const now = (): number => performance.timeOrigin + performance.now();

/** The limited key's stored state (undefined: none yet). */
async function stateOf(kv: KV, scope: string): Promise<LimitState | undefined> {
  const e = await kv.get(limitKeyOf(scope));
  return e?.operation === 'PUT' ? decodeLimitState(new TextDecoder().decode(e.value)) : undefined;
}

/** The state once its settles (sent after each answer, not awaited by it) have landed: no reservation left, or 5 s passed. */
async function settledState(kv: KV, scope: string): Promise<LimitState | undefined> {
  const until = Date.now() + 5_000;
  for (;;) {
    const s = await stateOf(kv, scope);
    if (!s || Object.keys(s.reservations).length === 0 || Date.now() > until) return s;
    await new Promise((r) => setTimeout(r, 50));
  }
}

export async function measureLimits(ctx: {
  client: ChildProcess;
  /** The load spec of `target` (prompt, expected echo, …) with `over` applied. */
  spec: (target: { url: string; token: string; model: string }, over: Partial<LoadSpec>) => LoadSpec;
  off: KeyPath;
  on: KeyPath;
  /** The limited key's scope (its identity, `config/<token id>`) and the `magus_limits` bucket. */
  scope: string;
  kv: KV;
  scaled: (count: number) => number;
  /** Processes whose CPU is counted per block: gateway, bridge + stub, nats-server. */
  pids: number[];
  cpuMsOf: (pid: number) => number;
  refusals: () => Promise<number>;
  /** The gateway's NATS connection and HTTP server, and the `magus_limits` bucket's name, for the traced blocks. */
  gatewayNc: NatsConnection;
  server: Server;
  bucket: string;
}): Promise<LimitsResult> {
  const t0 = performance.now();
  const { client, spec, scaled: n } = ctx;
  const paths: PerKey<KeyPath> = { off: ctx.off, on: ctx.on };
  let measured = 0;
  const run = (key: Key, over: Partial<LoadSpec>) =>
    load(client, spec(paths[key], { ...over, sessionIds: (over.concurrency ?? 1) > 1 ? paths[key].c8Sessions : paths[key].c1Sessions }));

  /** `blocks` blocks per key, the keys alternating and the first of each block swapping. */
  const alternate = async (blocks: number, over: Partial<LoadSpec>, cpu: PerKey<number[]>) => {
    const out: PerKey<LoadResult[]> = { off: [], on: [] };
    for (let b = 0; b < blocks; b++) {
      for (const key of b % 2 === 0 ? (['off', 'on'] as const) : (['on', 'off'] as const)) {
        const before = ctx.pids.map(ctx.cpuMsOf);
        const r = await run(key, over);
        cpu[key].push(...ctx.pids.map((pid, i) => ctx.cpuMsOf(pid) - before[i]!));
        out[key].push(r);
        if (key === 'on') measured += r.samples.length;
      }
    }
    return out;
  };

  // Warm-up of the limits path (the rest of the path is warm): V8 optimises its functions after thousands of calls.
  await run('on', { requests: n(5000), concurrency: 8 });
  await alternate(2, { requests: n(300) }, { off: [], on: [] });
  const before = (await settledState(ctx.kv, ctx.scope))?.budget?.used ?? 0;
  measured = 0;

  const cpu1: PerKey<number[]> = { off: [], on: [] };
  const c1 = await alternate(10, { requests: n(300) }, cpu1);
  const cpu8: PerKey<number[]> = { off: [], on: [] };
  const c8 = await alternate(6, { requests: n(1000), concurrency: 8 }, cpu8);

  // CPU profiles of the gateway (this process) per key at concurrency 8; BENCH_PROFILE_DIR keeps the raw profiles.
  const profiledRequests = n(2000);
  const profiles = {} as PerKey<CpuSummary>;
  for (const key of ['off', 'on'] as const) {
    const stop = await startCpuProfile(`gateway-limits-${key}`);
    const r = await run(key, { requests: profiledRequests, concurrency: 8 });
    profiles[key] = await stop();
    if (key === 'on') measured += r.samples.length;
  }

  // Traced blocks at concurrency 1: the gateway's HTTP in → out per request and, for the limited key, its KV writes.
  const traceRequests = n(500);
  const http: PerKey<[number, number][]> = { off: [], on: [] };
  const kvCalls: [number, number][] = [];
  const kvPrefix = `$KV.${ctx.bucket}.`;
  const nc = ctx.gatewayNc;
  const publish = nc.publish.bind(nc);
  // The store's writes are core publishes whose acknowledgement comes to its inbox: a second
  // subscription on the gateway's connection sees each acknowledgement too.
  const sentAt = new Map<string, number>();
  const acks = nc.subscribe('_INBOX.>', {
    callback: (_err, msg) => {
      const t0 = sentAt.get(msg.subject);
      if (t0 === undefined) return;
      sentAt.delete(msg.subject);
      kvCalls.push([t0, now()]);
    },
  });
  await nc.flush();
  for (const key of ['off', 'on'] as const) {
    const onRequest = (_req: unknown, res: { once(e: 'finish', f: () => void): void }) => {
      const t0 = now();
      res.once('finish', () => http[key].push([t0, now()]));
    };
    ctx.server.prependListener('request', onRequest);
    nc.publish = (subject, data, opts) => {
      if (subject.startsWith(kvPrefix) && opts?.reply) sentAt.set(opts.reply, now());
      publish(subject, data, opts);
    };
    try {
      await run(key, { requests: traceRequests });
      if (key === 'on') measured += traceRequests;
    } finally {
      nc.publish = publish;
      ctx.server.off('request', onRequest);
    }
  }
  await new Promise((r) => setTimeout(r, 200)); // the last settle's hold, and its acknowledgement
  acks.unsubscribe();
  const trace = traceOf(http, kvCalls, traceRequests);

  const after = await settledState(ctx.kv, ctx.scope);
  const probe = await fetch(ctx.on.url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', authorization: `Bearer ${ctx.on.token}`, 'x-session-id': ctx.on.c1Sessions[0]! },
    body: JSON.stringify({ model: ctx.on.model, messages: [{ role: 'user', content: 'x' }] }),
  });
  await probe.arrayBuffer();
  const headers = Object.fromEntries([...probe.headers].filter(([k]) => k.startsWith('x-ratelimit-')));
  if (probe.status !== 200) throw new Error(`the limited key's probe: HTTP ${probe.status}`);
  return {
    c1,
    cpu1,
    c8,
    cpu8,
    profiles,
    profiledRequests,
    refusals: await ctx.refusals(),
    measured,
    charged: (after?.budget?.used ?? 0) - before,
    reservationsLeft: after ? Object.keys(after.reservations).length : -1,
    headers,
    trace,
    wallMs: performance.now() - t0,
  };
}

/**
 * Pairs each limited request with its admission's write: at concurrency 1, the first write sent
 * after it arrived and before its answer left (a lease renewal, every 10 s, may take one's place);
 * a request with none was admitted from a slice. Every other write is a slice leased ahead or given
 * back, a settle written alone (no admission came within its hold) or a renewal.
 */
function traceOf(http: PerKey<[number, number][]>, kvCalls: [number, number][], requests: number): AdmissionTrace {
  const kv = [...kvCalls].sort((a, b) => a[0] - b[0]);
  const on = [...http.on].sort((a, b) => a[0] - b[0]);
  const out: AdmissionTrace = {
    requests,
    gateway: { off: http.off.map(([a, b]) => b - a), on: on.map(([a, b]) => b - a) },
    admitWait: { behind: [], clear: [] },
    admitRtt: [],
    otherRtt: [],
    writes: kv.length,
    fromSlice: 0,
  };
  const admissions = new Set<number>();
  let k = 0;
  for (const [h0, h1] of on) {
    while (k < kv.length && kv[k]![0] < h0) k++;
    const admit = kv[k];
    // No write while it was in the gateway: admitted from a slice.
    if (!admit || admit[0] > h1) {
      out.fromSlice += 1;
      continue;
    }
    const behind = k > 0 && kv[k - 1]![1] > h0;
    out.admitWait[behind ? 'behind' : 'clear'].push(admit[0] - h0);
    out.admitRtt.push(admit[1] - admit[0]);
    admissions.add(k);
    k += 1;
  }
  kv.forEach(([a, b], i) => admissions.has(i) || out.otherRtt.push(b - a));
  return out;
}

const rate = (r: LoadResult[]) => r.reduce((a, x) => a + x.samples.length, 0) / (r.reduce((a, x) => a + x.wallMs, 0) / 1000);
const count = (r: LoadResult[]) => r.reduce((a, x) => a + x.samples.length, 0);

/** The section of the report: each key side by side, the differences against the targets, the profiles and the checks. */
export function limitsReport(r: LimitsResult): string[] {
  const out: string[] = [];
  const row = (label: string, off: number, on: number, tail = '') =>
    `  ${label.padEnd(34)}${fmt(off).padStart(9)}${fmt(on).padStart(10)}${signed(on - off).padStart(10)}${tail}`;
  const l = {
    c1: { off: latencies(r.c1.off), on: latencies(r.c1.on) },
    c8: { off: latencies(r.c8.off), on: latencies(r.c8.on) },
  };
  const added = p50(l.c1.on) - p50(l.c1.off);
  const blockAdded = r.c1.on.map((x, i) => p50(latencies([x])) - p50(latencies([r.c1.off[i]!]))).sort((a, b) => a - b);
  const ratio = rate(r.c8.on) / rate(r.c8.off);
  const cpuPer = (xs: number[], k: number, reqs: number) => xs.filter((_, i) => i % 3 === k).reduce((a, b) => a + b, 0) / reqs;
  const cpuRows = (cpu: PerKey<number[]>, res: PerKey<LoadResult[]>) =>
    (['CPU ms/request: gateway process', '  bridge + stub process', '  nats-server'] as const).map((label, k) => {
      const [off, on] = [cpuPer(cpu.off, k, count(res.off)), cpuPer(cpu.on, k, count(res.on))];
      return `  ${label.padEnd(34)}${fmt(off, 3).padStart(9)}${fmt(on, 3).padStart(10)}${signed(on - off, 3).padStart(10)}`;
    });
  out.push(
    `per-key limits: the gateway path with a key without limits against one with limits that never refuse (${JSON.stringify(BENCH_LIMITS)}), alternating blocks`,
  );
  out.push(`  ${'latency in ms'.padEnd(34)}${'no limits'.padStart(9)}${'limits'.padStart(10)}${'added'.padStart(10)}`);
  out.push(`non-stream, concurrency 1 (${count(r.c1.off)} + ${count(r.c1.on)} requests, ${r.c1.on.length} blocks each)`);
  out.push(row('p50', p50(l.c1.off), p50(l.c1.on), `   ≤ ${ADDED_P50_TARGET_MS} ms: ${added <= ADDED_P50_TARGET_MS ? 'met' : 'MISSED'}`));
  out.push(row('p99', p99(l.c1.off), p99(l.c1.on)));
  out.push(
    `  ${'added p50 per block pair'.padEnd(34)}median ${signed(p50(blockAdded))}, from ${signed(blockAdded[0]!)} to ${signed(blockAdded[blockAdded.length - 1]!)}`,
  );
  out.push(...cpuRows(r.cpu1, r.c1));
  out.push(`non-stream, concurrency 8 (${count(r.c8.off)} + ${count(r.c8.on)} requests, ${r.c8.on.length} blocks each)`);
  out.push(row('p50', p50(l.c8.off), p50(l.c8.on)));
  out.push(row('p99', p99(l.c8.off), p99(l.c8.on)));
  out.push(
    `  ${'requests/s'.padEnd(34)}${fmt(rate(r.c8.off), 0).padStart(9)}${fmt(rate(r.c8.on), 0).padStart(10)}${`${(ratio * 100).toFixed(1)} %`.padStart(10)}   ≥ ${THROUGHPUT_TARGET * 100} %: ${ratio >= THROUGHPUT_TARGET ? 'met' : 'MISSED'}`,
  );
  const blockRatio = r.c8.on.map((x, i) => rate([x]) / rate([r.c8.off[i]!])).sort((a, b) => a - b);
  out.push(
    `  ${'ratio per block pair'.padEnd(34)}median ${(p50(blockRatio) * 100).toFixed(1)} %, from ${(blockRatio[0]! * 100).toFixed(1)} to ${(blockRatio[blockRatio.length - 1]! * 100).toFixed(1)} %`,
  );
  out.push(...cpuRows(r.cpu8, r.c8));
  out.push(`  gateway CPU profile at concurrency 8 (${r.profiledRequests} requests per key; self time, ms of CPU per request):`);
  for (const key of ['off', 'on'] as const) {
    out.push(...profileLines(key === 'off' ? 'no limits' : 'limits', r.profiles[key], r.profiledRequests, '    ', 8));
  }
  const t = r.trace;
  out.push(`  traced blocks at concurrency 1 (${t.requests} requests per key, not part of the figures above; p50, ms):`);
  out.push(row('gateway: HTTP request in → out', p50(t.gateway.off), p50(t.gateway.on)));
  out.push(
    `    limits: ${fmt(t.writes / t.requests, 3)} writes per request; ${t.fromSlice} of ${t.requests} requests with no write while in the gateway (admitted from a slice); the others' admission compare-and-swap ${fmt(p50(t.admitRtt))} (p99 ${fmt(p99(t.admitRtt))}); ${t.otherRtt.length} other writes (settles written alone, renewals) ${t.otherRtt.length ? fmt(p50(t.otherRtt)) : '–'}; request in → admission sent ${fmt(p50(t.admitWait.clear))} (${t.admitWait.clear.length} requests), ${t.admitWait.behind.length ? fmt(p50(t.admitWait.behind)) : '–'} for the ${t.admitWait.behind.length} that arrived while a write of the key was in flight`,
  );
  const perRequest = r.measured > 0 ? r.charged / r.measured : NaN;
  out.push(
    `  checks: ${r.refusals} refused (429) in the whole run; ${r.measured} measured requests with limits charged ${r.charged} tokens of the budget (${fmt(perRequest)} each: the stub's usage), ${r.reservationsLeft} reservations left; an answer's headers: ${Object.entries(
      r.headers,
    )
      .map(([k, v]) => `${k}: ${v}`)
      .join(', ')}`,
  );
  out.push(`  this section took ${fmt(r.wallMs / 1000, 1)} s`);
  return out;
}

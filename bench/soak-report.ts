/**
 * The soak's report (soak.ts runs the traffic, soak-samples.ts samples): requests by outcome,
 * latency per minute, each process's RSS and fd slopes after warm-up (and after the first
 * sessions expired), a timeline per minute, and the leaks found — consumers beyond what instances
 * and gateways explain, session keys beyond the conversations with a turn within the TTL (plus
 * {@link EXPIRY_GRACE_MS}), fd growth, pool leases beyond the session workflows running.
 */
import { fmt, p50, p99 } from './common';
import type { PoolHistory, Sample } from './soak-samples';

/** Past its expiry (one TTL after its last turn), a session's key may linger this long: the timer fires, the workflow task runs, the delete activity runs. */
export const EXPIRY_GRACE_MS = 60_000;

export type Kind = 'new' | 'warm' | 'warm-stream' | 'disconnect';
/** One request of the traffic. */
export interface Outcome {
  at: number;
  kind: Kind;
  ms: number;
  /** 200, the HTTP status, or 0 when the request failed before an answer. */
  status: number;
  /** An error that was not injected. */
  error?: string;
}

export type Slope = {
  name: string;
  rssMbPerMin: number;
  fdsPerMin: number;
  rssMb: [number, number];
  fds: [number, number];
  heapMbPerMin?: number;
  heapMb?: [number, number];
};

export interface SoakReport {
  requests: Record<Kind, { ok: number; injected: number; errors: number }>;
  errors: string[];
  perMinute: { minute: number; n: number; p50: number; p99: number; max: number }[];
  /** Per process name (pids can change: an engine restarted is a new process): MB/min and fds/min after warm-up. */
  slopes: Slope[];
  /** The same over the samples after the first sessions expired (minute `fromMin` on); absent when the run ends before. */
  afterExpiry?: { fromMin: number; slopes: Slope[] };
  consumers: { first: Record<string, number>; last: Record<string, number> };
  sessionTtlMs: number;
  conversationMs: number;
  /** At the end: keys, conversations started, live ones (a turn within the TTL) and with the grace; the largest excess of keys over `liveWithGrace` at any sample. */
  sessionKeys: { last: number; conversations: number; live: number; liveWithGrace: number; worstExcess: number };
  /** One sample a minute (the first at or after each minute): what grows and what levels off. */
  timeline: {
    minute: number;
    conversations: number;
    live: number;
    sessionKeys: number;
    sessionMessages: number;
    sessionWorkflows?: number;
    temporalDbMb?: number;
    poolEvents?: number;
    poolRuns: number;
    poolLeases?: number;
    poolInstances?: string[];
    jetStreamMb: number;
    responsesMb: number;
    rssMb: Record<string, number>;
    devHeapMb?: number;
    devCachedWorkflows?: number;
  }[];
  repull: { ok: boolean; detail: string };
  /** The demo model's pool workflow over the run, from its histories: what a stalled or evicted pool shows. */
  pool?: PoolHistory;
  /** The pool's instances each time they changed (from the samples), with its last error. */
  poolChanges: string[];
  leaks: string[];
  /** Where dev's logs were kept, when something went wrong. */
  logs?: string;
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

/** What the run's outcomes and samples (`last`: the one at the end, without processes) say; `t0`: when traffic began. */
export function buildReport(
  outcomes: Outcome[],
  samples: Sample[],
  last: Sample,
  repull: SoakReport['repull'],
  t0: number,
  opts: { durationMs: number; warmupShare: number; sessionTtlMs: number; conversationMs: number },
): SoakReport {
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
  const warmupMs = opts.durationMs * opts.warmupShare;
  const steady = samples.filter((s) => s.at - t0 >= warmupMs);
  const slopes = slopesOf(steady, t0);
  // The first sessions expire one TTL after the first conversations' last turns; the warm-up is left out in any case.
  const expiryFromMs = Math.max(warmupMs, Math.min(opts.conversationMs, opts.durationMs)) + opts.sessionTtlMs;
  const expired = samples.filter((s) => s.at - t0 >= expiryFromMs);
  const afterExpiry = expired.length >= 3 ? { fromMin: expiryFromMs / 60_000, slopes: slopesOf(expired, t0) } : undefined;
  const first = steady[0] ?? samples[0];
  const leaks: string[] = [];
  for (const [stream, n] of Object.entries(last.consumers)) {
    const before = first?.consumers[stream] ?? 0;
    // Consumers belong to instances (one per bridge) and gateways (ordered watchers): a few may
    // come and go with a scale event, never one per request or conversation.
    if (n > before + 4) leaks.push(`stream ${stream}: ${before} → ${n} consumers`);
  }
  // Keys: at most one per conversation with a turn within the TTL (plus the grace for expiry), at every sample.
  let worst: Sample | undefined;
  for (const s of [...samples, last]) if (!worst || s.sessionKeys - s.liveWithGrace > worst.sessionKeys - worst.liveWithGrace) worst = s;
  const worstExcess = worst ? worst.sessionKeys - worst.liveWithGrace : 0;
  if (worst && worstExcess > 0) {
    leaks.push(
      `magus_sessions had ${worst.sessionKeys} keys at minute ${fmt((worst.at - t0) / 60_000, 1)} for ${worst.liveWithGrace} conversations with a turn within the TTL (${Math.round(opts.sessionTtlMs / 1000)} s) + ${EXPIRY_GRACE_MS / 1000} s`,
    );
  }
  for (const s of slopes) if (s.fds[1] - s.fds[0] > 50) leaks.push(`${s.name}: ${s.fds[0]} → ${s.fds[1]} open files after warm-up`);
  // The pool's leases: one per session workflow still running (a release may be on its way).
  if (last.pool && last.sessionWorkflows !== undefined && last.pool.leases > last.sessionWorkflows + Math.max(10, last.sessionWorkflows * 0.1)) {
    leaks.push(`the pool holds ${last.pool.leases} leases for ${last.sessionWorkflows} session workflows`);
  }
  const timeline: SoakReport['timeline'] = [];
  const poolRuns = new Set<string>();
  let seen = 0;
  for (let m = 0; m * 60_000 < opts.durationMs; m++) {
    const s = samples.find((x) => x.at - t0 >= m * 60_000);
    if (!s || timeline.some((t) => t.minute === Math.round((s.at - t0) / 60_000))) continue;
    const rssMb: Record<string, number> = {};
    for (const p of s.processes) rssMb[p.name] = (rssMb[p.name] ?? 0) + p.rssMb;
    // The pool's runs so far (continue-as-new starts one).
    for (; seen < samples.length && samples[seen]!.at <= s.at; seen++) if (samples[seen]!.pool) poolRuns.add(samples[seen]!.pool!.runId);
    timeline.push({
      minute: Math.round((s.at - t0) / 60_000),
      conversations: s.conversations,
      live: s.live,
      sessionKeys: s.sessionKeys,
      sessionMessages: s.sessionMessages,
      ...(s.sessionWorkflows === undefined ? {} : { sessionWorkflows: s.sessionWorkflows }),
      ...(s.temporalDbMb === undefined ? {} : { temporalDbMb: s.temporalDbMb }),
      ...(s.pool === undefined ? {} : { poolEvents: s.pool.events, poolLeases: s.pool.leases, poolInstances: s.pool.instances }),
      poolRuns: poolRuns.size,
      jetStreamMb: Object.values(s.streamsMb).reduce((a, b) => a + b, 0),
      responsesMb: s.streamsMb.MAGUS_RESPONSES ?? 0,
      rssMb,
      ...(s.devHeapMb === undefined ? {} : { devHeapMb: s.devHeapMb }),
      ...(s.devCachedWorkflows === undefined ? {} : { devCachedWorkflows: s.devCachedWorkflows }),
    });
  }
  return {
    requests,
    errors,
    perMinute,
    slopes,
    ...(afterExpiry ? { afterExpiry } : {}),
    consumers: { first: first?.consumers ?? {}, last: last.consumers },
    sessionTtlMs: opts.sessionTtlMs,
    conversationMs: opts.conversationMs,
    sessionKeys: { last: last.sessionKeys, conversations: last.conversations, live: last.live, liveWithGrace: last.liveWithGrace, worstExcess },
    timeline,
    repull,
    poolChanges: [],
    leaks,
  };
}

/** Per process name, over `samples`: RSS and fds first → last and their least-squares slopes per minute. */
function slopesOf(samples: Sample[], t0: number): Slope[] {
  const byName = new Map<string, { t: number[]; rss: number[]; fds: number[] }>();
  for (const s of samples) {
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
  // `magus dev`'s heap in use (sampled at any point of V8's collection cycle: noisy, but a leak climbs through it).
  const heap = samples.filter((s) => s.devHeapMb !== undefined);
  const heapOf = (name: string) =>
    name === 'magus dev' && heap.length >= 2
      ? {
          heapMbPerMin: slope(
            heap.map((s) => (s.at - t0) / 60_000),
            heap.map((s) => s.devHeapMb!),
          ),
          heapMb: [heap[0]!.devHeapMb!, heap[heap.length - 1]!.devHeapMb!] as [number, number],
        }
      : {};
  return [...byName].map(([name, e]) => ({
    name,
    rssMbPerMin: slope(e.t, e.rss),
    fdsPerMin: slope(e.t, e.fds),
    rssMb: [e.rss[0]!, e.rss[e.rss.length - 1]!] as [number, number],
    fds: [e.fds[0]!, e.fds[e.fds.length - 1]!] as [number, number],
    ...heapOf(name),
  }));
}

/** The report as lines for a person. */
export function printReport(r: SoakReport, log: (line: string) => void): void {
  const sec = (ms: number) => `${Math.round(ms / 1000)} s`;
  log(`session TTL ${sec(r.sessionTtlMs)} (MAGUS_SESSION_TTL_MS); a conversation got turns for ${sec(r.conversationMs)}, then was left to expire`);
  log(
    'requests: ' +
      Object.entries(r.requests)
        .map(([k, v]) => `${k} ${v.ok} ok${v.injected ? ` / ${v.injected} disconnected (injected)` : ''}${v.errors ? ` / ${v.errors} ERRORS` : ''}`)
        .join('; '),
  );
  for (const e of r.errors) log(`  error: ${e}`);
  log(
    'latency per minute (answered requests, ms): ' +
      r.perMinute.map((m) => `${m.minute}: n ${m.n} p50 ${fmt(m.p50, 0)} p99 ${fmt(m.p99, 0)} max ${fmt(m.max, 0)}`).join(' | '),
  );
  const slopeLines = (slopes: Slope[]) => {
    for (const s of slopes) {
      const heap = s.heapMb ? `   V8 heap in use ${fmt(s.heapMb[0], 1)} → ${fmt(s.heapMb[1], 1)} (${fmt(s.heapMbPerMin!, 2)}/min)` : '';
      log(
        `  ${s.name.padEnd(24)} ${fmt(s.rssMb[0], 1)} → ${fmt(s.rssMb[1], 1)} (${fmt(s.rssMbPerMin, 2)}/min)   ${s.fds[0]} → ${s.fds[1]} (${fmt(s.fdsPerMin, 2)}/min)${heap}`,
      );
    }
  };
  log('after warm-up, per process (summed by name): RSS MB first→last (slope MB/min), open fds first→last (slope /min)');
  slopeLines(r.slopes);
  if (r.afterExpiry) {
    log(`after the first sessions expired (minute ${fmt(r.afterExpiry.fromMin, 1)} on), the same:`);
    slopeLines(r.afterExpiry.slopes);
  } else log('no sample after the first sessions could expire (warm-up or a conversation, whichever is longer, + the TTL): no slope after expiry');
  log(
    'per minute: conversations started / live (a turn within the TTL) / magus_sessions keys (stream messages, delete markers included) / session workflows running / leases in the pool / pool workflow: history events (runs so far) / Temporal DB MB / JetStream MB (MAGUS_RESPONSES) / RSS MB (magus dev: its V8 heap in use, workflows its Temporal workers cache)',
  );
  for (const t of r.timeline) {
    const rss = Object.entries(t.rssMb)
      .sort(([a], [b]) => a.localeCompare(b))
      .map(
        ([name, mb]) =>
          `${name} ${fmt(mb, 0)}${name === 'magus dev' && t.devHeapMb !== undefined ? ` (heap ${fmt(t.devHeapMb, 0)}${t.devCachedWorkflows === undefined ? '' : `, ${t.devCachedWorkflows} workflows cached`})` : ''}`,
      )
      .join(', ');
    log(
      `  ${String(t.minute).padStart(3)}: ${t.conversations} / ${t.live} / ${t.sessionKeys} (${t.sessionMessages}) / ${t.sessionWorkflows ?? '—'} / ${t.poolLeases ?? '—'} / ${t.poolEvents ?? '—'} (${t.poolRuns}) / ${t.temporalDbMb === undefined ? '—' : fmt(t.temporalDbMb, 1)} / ${fmt(t.jetStreamMb, 1)} (${fmt(t.responsesMb, 1)}) / ${rss}`,
    );
  }
  log(
    `NATS consumers first → last: ${Object.keys(r.consumers.last)
      .map((k) => `${k} ${r.consumers.first[k] ?? 0}→${r.consumers.last[k]}`)
      .join(', ')}`,
  );
  const k = r.sessionKeys;
  log(
    `magus_sessions keys at the end: ${k.last} for ${k.live} live conversations (a turn within the TTL of ${sec(r.sessionTtlMs)}; ${k.liveWithGrace} within it + ${EXPIRY_GRACE_MS / 1000} s) of ${k.conversations} started; most keys above that at any sample: ${Math.max(0, k.worstExcess)}`,
  );
  log(`re-pull: ${r.repull.detail}`);
  for (const c of r.poolChanges) log(`pool instances from ${c}`);
  if (r.pool) {
    const p = r.pool;
    const list = (o: Record<string, number>) =>
      Object.entries(o)
        .map(([k, v]) => `${k} ${v}`)
        .join(', ') || 'none';
    log(
      `pool workflow: ${p.runs} runs, ${p.events} events; workflow tasks failed: ${list(p.taskFailures)}; timed out: ${p.taskTimeouts}; slowest task ${fmt(p.slowestTaskSec, 1)} s (scheduled → completed); activities: ${list(p.activities)}`,
    );
  }
  log(r.leaks.length === 0 ? 'no leak found' : `LEAKS: ${r.leaks.join('; ')}`);
  if (r.logs) log(`magus dev's logs: ${r.logs}`);
}

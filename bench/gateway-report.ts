/**
 * `npm run bench:gateway`'s report (gateway.ts measures): latency direct and through the gateway
 * side by side, the design's floor, streaming, the first turns on a warm pool, where the traced
 * block's time goes hop by hop, the CPU profiles, and the checks that the warm measurement placed
 * no conversation and the gateway logged nothing it should not.
 */
import { cpus } from 'node:os';
import { Writable } from 'node:stream';
import { seedFor } from '../dataplane/bridge';
import { firstChunkMs, fmt, latencies, p50, p99, signed } from './common';
import { profileLines, type CpuSummary } from './cpu-profile';
import type { LoadResult } from './gateway-client';
import { BURST_TARGET, BURSTS, type FirstTurnResult } from './gateway-first-turn';
import { limitsReport, type LimitsResult } from './gateway-limits';
import type { TraceEvent } from './gateway-serving';

const ttfc = firstChunkMs;
const gaps = (r: LoadResult[]) => r.flatMap((x) => x.samples.flatMap((s) => s.chunks!.slice(1).map((t, i) => t - s.chunks![i]!)));
const rate = (r: LoadResult[]) => r.reduce((a, x) => a + x.samples.length, 0) / (r.reduce((a, x) => a + x.wallMs, 0) / 1000);

/** Counts log lines; keeps those at warn level or above, and any that contain one of `secrets`. */
export class LogTally extends Writable {
  lines = 0;
  readonly notable: string[] = [];
  private readonly secrets: string[];
  constructor(...secrets: string[]) {
    super();
    this.secrets = secrets;
  }
  override _write(chunk: Buffer, _enc: BufferEncoding, cb: () => void): void {
    for (const line of chunk.toString('utf8').split('\n').filter(Boolean)) {
      this.lines++;
      // pino levels: 40 warn, 50 error, 60 fatal (a regex, not JSON.parse: this runs in the measured process).
      if (this.secrets.some((s) => line.includes(s)) || /"level":[456]0[,}]/.test(line)) this.notable.push(line.slice(0, 400));
    }
    cb();
  }
}

/** Everything one run measured, as {@link report} prints it. */
export interface GatewayBenchResults {
  c1: { direct: LoadResult[]; gateway: LoadResult[] };
  cpu1: { direct: number[]; gateway: number[] };
  floor: { direct: LoadResult[]; gateway: LoadResult[] };
  c8: { direct: LoadResult[]; gateway: LoadResult[] };
  cpu8: { direct: number[]; gateway: number[] };
  st: { direct: LoadResult[]; gateway: LoadResult[] };
  limits: LimitsResult;
  traced: LoadResult;
  servingTrace: TraceEvent[];
  gatewayProfile: CpuSummary;
  bridgeProfile: CpuSummary;
  pubTrace: Map<string, [number, number]>;
  frameTrace: Map<string, number>;
  httpTrace: Map<string, [number, number]>;
  warmStats: { warmHits: number; coldStarts: number; firstTurns: number };
  coldStartsSeeded: number;
  bridgeStats: unknown;
  firstTurn: FirstTurnResult;
  load0: number[];
  load1: number[];
  logs: LogTally;
  /** Requests of the profiled block (its CPU is shown per request of them). */
  profiledRequests: number;
  /** Chunks of each streamed answer. */
  chunks: number;
}

/** The figures side by side, the first turns, the traced block's hops and the CPU profiles, to stdout. */
export function report(r: GatewayBenchResults): void {
  const count = (x: LoadResult[]) => x.reduce((a, b) => a + b.samples.length, 0);
  const row = (label: string, d: number, g: number, target?: number) =>
    `  ${label.padEnd(34)}${fmt(d).padStart(9)}${fmt(g).padStart(10)}${signed(g - d).padStart(10)}${target === undefined ? '' : `   ≤ ${target} ms: ${g - d <= target ? 'met' : 'MISSED'}`}`;
  const out: string[] = [];
  out.push(
    `magus gateway benchmark — ${cpus().length} CPUs (${cpus()[0]?.model ?? '?'}), load average ${r.load0.map((x) => x.toFixed(2)).join(' ')} at start, ${r.load1.map((x) => x.toFixed(2)).join(' ')} at end`,
  );
  out.push('processes: load generator | gateway (measured) | bridge + stub engine (+ Temporal workers, llama.cpp engine) | nats-server, Temporal, MinIO');
  out.push('');
  out.push(`  ${'latency in ms'.padEnd(34)}${'direct'.padStart(9)}${'gateway'.padStart(10)}${'added'.padStart(10)}`);
  const l1d = latencies(r.c1.direct);
  const l1g = latencies(r.c1.gateway);
  out.push(`non-stream, concurrency 1 (${count(r.c1.direct)} + ${count(r.c1.gateway)} requests)`);
  out.push(row('p50', p50(l1d), p50(l1g), 1));
  out.push(row('p99', p99(l1d), p99(l1g), 5));
  const cpuPer = (xs: number[], k: number, reqs: number) => xs.filter((_, i) => i % 3 === k).reduce((a, b) => a + b, 0) / reqs;
  const cpuRows = (cpu: { direct: number[]; gateway: number[] }, rd: number, rg: number) =>
    (['CPU ms/request: gateway process', '  bridge + stub process', '  nats-server'] as const).map(
      (label, k) => `  ${label.padEnd(34)}${fmt(cpuPer(cpu.direct, k, rd), 3).padStart(9)}${fmt(cpuPer(cpu.gateway, k, rg), 3).padStart(10)}`,
    );
  out.push(...cpuRows(r.cpu1, count(r.c1.direct), count(r.c1.gateway)));
  const lfd = latencies(r.floor.direct);
  const lfg = latencies(r.floor.gateway);
  out.push(
    `the design's floor, concurrency 1 (${count(r.floor.direct)} + ${count(r.floor.gateway)}): a bare node:http server that only publishes and waits, a minimal bridge`,
  );
  out.push(row('  p50', p50(lfd), p50(lfg)));
  out.push(row('  p99', p99(lfd), p99(lfg)));
  const l8d = latencies(r.c8.direct);
  const l8g = latencies(r.c8.gateway);
  out.push(`non-stream, concurrency 8 (${count(r.c8.direct)} + ${count(r.c8.gateway)} requests)`);
  out.push(row('p50', p50(l8d), p50(l8g)));
  out.push(row('p99', p99(l8d), p99(l8g)));
  out.push(`  ${'requests/s'.padEnd(34)}${fmt(rate(r.c8.direct), 0).padStart(9)}${fmt(rate(r.c8.gateway), 0).padStart(10)}`);
  out.push(...cpuRows(r.cpu8, count(r.c8.direct), count(r.c8.gateway)));
  out.push(`stream, ${r.chunks} chunks, concurrency 1 (${count(r.st.direct)} + ${count(r.st.gateway)} requests)`);
  out.push(row('time to first chunk p50', p50(ttfc(r.st.direct)), p50(ttfc(r.st.gateway))));
  out.push(row('time to first chunk p99', p99(ttfc(r.st.direct)), p99(ttfc(r.st.gateway))));
  out.push(row('inter-chunk gap p50', p50(gaps(r.st.direct)), p50(gaps(r.st.gateway))));
  out.push(row('inter-chunk gap p99', p99(gaps(r.st.direct)), p99(gaps(r.st.gateway))));
  out.push(row('whole stream p50', p50(latencies(r.st.direct)), p50(latencies(r.st.gateway))));
  out.push(...limitsReport(r.limits));

  const f = r.firstTurn;
  const firstMs = latencies([f.first]);
  const warmMs = latencies([f.warm]);
  out.push(`first turn of a new conversation, warm pool (${f.n} conversations, tiny llama.cpp model, max_tokens 2)`);
  out.push(
    `  ${'first turn p50 / p99'.padEnd(34)}${`${fmt(p50(firstMs))} / ${fmt(p99(firstMs))}`.padStart(19)}   ≤ 30 ms p50: ${p50(firstMs) <= 30 ? 'met' : 'MISSED'}`,
  );
  out.push(`  ${'same conversation, next turn p50'.padEnd(34)}${fmt(p50(warmMs)).padStart(19)}   (warm path, same engine)`);
  out.push(
    `  ${'session workflow start (after the answer) p50'.padEnd(34)}${fmt(p50(f.adoptMs)).padStart(19)}   p99 ${fmt(p99(f.adoptMs))}   (no turn waited on the cold path)`,
  );
  for (const b of f.bursts) {
    const ratio = b.first.wallMs / b.warm.wallMs;
    out.push(
      `burst of ${b.n} new conversations at once (one instance, 8 leases preferred; ${b.fromPool} first turns from the pool, ${b.cold} through Temporal)`,
    );
    out.push(
      `  ${'all answered in (new / warm)'.padEnd(34)}${`${fmt(b.first.wallMs, 0)} / ${fmt(b.warm.wallMs, 0)} ms`.padStart(19)}   ${ratio.toFixed(2)}×, ≤ ${BURST_TARGET}×: ${ratio <= BURST_TARGET ? 'met' : 'MISSED'}`,
    );
    out.push(`  ${'per request p50 (new / warm)'.padEnd(34)}${`${fmt(p50(latencies([b.first])))} / ${fmt(p50(latencies([b.warm])))}`.padStart(19)}`);
  }
  out.push(
    `  the pool's current run: ${f.poolTasks.events} events, ${f.poolTasks.tasks} workflow tasks, for the ${f.n + BURSTS.reduce((a, b) => a + b, 0)}+ new conversations above (warm-up included)`,
  );

  // Hop breakdown of the traced block.
  out.push('');
  out.push(`where the gateway path's time goes (traced block, ${r.traced.samples.length} requests at concurrency 1; p50 per hop, ms):`);
  const byId = new Map<string, { claims: TraceEvent[]; frame?: number; fetch?: TraceEvent }>();
  const seedToId = new Map<string, string>();
  for (const s of r.traced.samples) {
    byId.set(s.requestId!, { claims: [] });
    seedToId.set(String(seedFor(s.requestId!)), s.requestId!);
  }
  const rtt = { read: [] as number[], write: [] as number[] };
  for (const ev of r.servingTrace) {
    const [kind, key, t0, t1] = ev;
    if (kind === 'fetch') {
      const id = seedToId.get(key);
      if (id) byId.get(id)!.fetch = ev;
      continue;
    }
    const id = (kind === 'publish' ? /\.res\.([A-Za-z0-9]+)$/ : /_claims\.([A-Za-z0-9]+)/).exec(key)?.[1];
    const rec = id === undefined ? undefined : byId.get(id);
    if (!rec) continue;
    if (kind === 'publish') rec.frame ??= t0;
    else {
      rec.claims.push(ev);
      (key.startsWith('$KV.') ? rtt.write : rtt.read).push(t1 - t0);
    }
  }
  const hops: [string, number[]][] = [
    ['client → gateway (HTTP request in)', []],
    ['gateway: auth, key, session → publish', []],
    ['NATS: publish → delivered to the bridge', []],
    ['engine call (bridge → stub → bridge)', []],
    ['bridge: engine answer → frame published', []],
    ['NATS: frame → gateway', []],
    ['gateway: frame → response written', []],
    ['gateway → client (HTTP response)', []],
  ];
  const totals: number[] = [];
  for (const [i, s] of r.traced.samples.entries()) {
    const id = s.requestId!;
    const rec = byId.get(id)!;
    const http = r.httpTrace.get(String(i));
    const pub = r.pubTrace.get(id);
    const frameIn = r.frameTrace.get(id);
    if (!http || !pub || frameIn === undefined || !rec.fetch || rec.frame === undefined) continue;
    // Delivered ≈ the engine call's start (a first delivery touches no claim before it).
    const points = [s.start, http[0], pub[0], rec.fetch[2], rec.fetch[3], rec.frame, frameIn, http[1], s.end];
    points.slice(1).forEach((t, i) => hops[i]![1].push(t - points[i]!));
    totals.push(s.end - s.start);
  }
  for (const [label, v] of hops) out.push(`  ${label.padEnd(46)}${fmt(p50(v)).padStart(7)}`);
  out.push(
    `  ${'sum of hop p50s / total p50'.padEnd(46)}${fmt(hops.reduce((a, [, v]) => a + p50(v), 0)).padStart(7)} / ${fmt(p50(totals))}  (${totals.length} requests joined)`,
  );
  const pubAck = r.traced.samples
    .map((s) => r.pubTrace.get(s.requestId!))
    .filter((x) => x !== undefined)
    .map(([a, b]) => b - a);
  const kv = (v: number[]) => (v.length ? `${fmt(p50(v))} (${v.length})` : 'none');
  out.push(
    `  round trips seen: JetStream publish → ack ${fmt(p50(pubAck))}; claims KV (a first delivery that answers writes none): writes ${kv(rtt.write)}, reads ${kv(rtt.read)} (p50)`,
  );
  out.push(`  direct baseline in the same run (c=1 p50): ${fmt(p50(l1d))}`);

  out.push('');
  out.push(`CPU profile of a gateway-path block at concurrency 8 (self time; ms of CPU per request):`);
  for (const [label, p] of [
    ['gateway process', r.gatewayProfile],
    ['bridge + stub engine process', r.bridgeProfile],
  ] as const) {
    out.push(...profileLines(label, p, r.profiledRequests, '  ', 6));
  }

  out.push('');
  out.push('session workflow timeline of a first turn (p50 ms since the workflow started, after the answer; it adopts the conversation’s entry, then sleeps):');
  for (const [label, v] of f.sessionTimeline) out.push(`  ${label.padEnd(56)}${fmt(v, 1).padStart(7)}`);

  out.push('');
  out.push(
    `checks: warm measurement placed no conversation (session cache: ${r.warmStats.warmHits} warm hits, ${r.warmStats.firstTurns} first turns = the ${r.coldStartsSeeded} seeding turns, ${r.warmStats.coldStarts} cold starts); bridge ${JSON.stringify(r.bridgeStats)}`,
  );
  out.push(
    `gateway log: ${r.logs.lines} lines at level info, ${r.logs.notable.length} at warn or above or containing the token${r.logs.notable.length ? `:\n    ${r.logs.notable.slice(0, 5).join('\n    ')}` : ''}`,
  );
  process.stdout.write(`${out.join('\n')}\n`);
}

/**
 * What a bridge counts and how it reports it: {@link BridgeStats} and {@link BridgeHealth}, and
 * their Prometheus text, one series per bridge — `magus bridge`'s `/metrics`, and the worker's
 * for the bridges of its local instances.
 */
import { UsageTotals } from '../../shared/usage';

/** Counters since start (a delivery is counted once under pulled and once under its resolution). */
export interface BridgeStats {
  pulled: number;
  acked: number;
  termed: number;
  nakked: number;
  /** Deliveries JetStream marked as redelivered. */
  redelivered: number;
  /** Unexpected failures (NATS/KV errors, bugs); each is logged. */
  errors: number;
  /** Take-overs that continued after frames an earlier attempt had published. */
  resumed: number;
  /** Of those, the ones whose engine continued the answer from its tokens (the rest generated it again and compared). */
  continued: number;
  /**
   * Take-overs that found frames of their request already gone from the response stream (aged
   * out, or evicted by a full `MAGUS_RESPONSES`) and ended the answer with `resume_failed`.
   */
  resumeFailed: number;
  /** Take-overs that found frames lost between stored ones and generated on from before the gap (generate.ts checks the frames after it). */
  resumedAcrossGap: number;
  /** Deliveries of an already finished request: its terminal frame re-published, nothing generated. */
  replayed: number;
  /** Attempts that found a later delivery owned their request and stopped without resolving it. */
  superseded: number;
  /** Deliveries of a request this bridge was serving then (the request consumer's leader changed, say): its attempt went on, and resolved them. */
  adopted: number;
  /** Answers handed back to their gateway to be continued elsewhere (the drain deadline passed, or the engine went away). */
  handedBack: number;
  /** Requests whose client went away (a gateway's cancel): the engine call stopped, or never made. */
  cancelled: number;
  heartbeatsMissed: number;
  /** Frames published again: not acknowledged as stored in time, refused by the stream, or sent when the connection broke. */
  framesResent: number;
  /** Frames still not acknowledged as stored when their request was resolved (a response stream without a leader that long). */
  framesUnstored: number;
  /** Usage records this bridge wrote to the ledger (a request whose record another attempt wrote is not counted). */
  usageRecorded: number;
  /** Requests left unresolved because their usage record could not be written in time (their next delivery writes it). */
  usageUnrecorded: number;
  inFlight: number;
}

export interface BridgeHealth {
  ok: boolean;
  problems: string[];
  inFlight: number;
  slots: number;
  /** What its beats say (shared/serving.ts `BridgeLoad`): undelivered requests while every slot is taken, and the 90th percentile of its last answers' service times (null: none yet). */
  queued?: number;
  serviceMs?: number | null;
}

/** What each {@link BridgeStats} counter means, as Prometheus help text. */
const STAT_HELP: Record<Exclude<keyof BridgeStats, 'inFlight'>, string> = {
  pulled: 'Deliveries pulled from the request consumer.',
  acked: 'Deliveries acknowledged (answered).',
  termed: 'Deliveries terminated: requests that can never succeed, or cancelled.',
  nakked: 'Deliveries handed back for a later retry.',
  redelivered: 'Deliveries JetStream marked as redelivered.',
  errors: 'Unexpected failures (NATS or KV errors); each is logged.',
  resumed: 'Take-overs that continued after frames an earlier attempt had published.',
  continued: 'Take-overs whose engine continued the answer from the tokens already sent, instead of generating it again.',
  resumeFailed:
    'Take-overs that found frames of their request already gone from the response stream (evicted or aged out) and could not hand the answer back: answer ended with resume_failed.',
  resumedAcrossGap: 'Take-overs that found frames lost between stored ones and generated on from before the gap, checked against the frames after it.',
  replayed: 'Deliveries of an already answered request: its last frame published again, nothing generated.',
  superseded: 'Attempts that found a later delivery owned their request.',
  adopted: 'Deliveries of a request this bridge was serving then (a new request consumer leader delivered it again): its attempt went on and resolved them.',
  handedBack:
    'Answers handed back to their gateway to be continued on another instance (the drain deadline passed, the engine went away, or a take-over found the frames stored of it gone).',
  cancelled: 'Requests whose client went away.',
  heartbeatsMissed: 'Times the request consumer missed its heartbeats.',
  framesResent: 'Response frames published again because the response stream had not acknowledged storing them.',
  framesUnstored: 'Response frames never acknowledged as stored by the time their request was resolved.',
  usageRecorded: 'Usage records written to the ledger.',
  usageUnrecorded: 'Requests left for their next delivery because their usage record could not be written in time.',
};

/** A Prometheus label value, escaped (a key identity is the user's to name). */
const labelValue = (v: string): string => v.replace(/\\/g, '\\\\').replace(/"/g, '\\"').replace(/\n/g, '\\n');

/** One bridge as {@link bridgeMetricsText} reports it. */
export interface BridgeSample {
  pool: string;
  instance: string;
  stats: Readonly<BridgeStats>;
  health: BridgeHealth;
}

/**
 * The tokens of the usage records this process's bridges wrote: one total per process, so a
 * series never goes down when one of its bridges stops (a counter that falls reads as a reset).
 */
export const processUsage = new UsageTotals();

/**
 * Bridges' counters and state in the Prometheus text format, one series per bridge (labels
 * `pool`, `instance`), and the tokens of `usage` (default: this process's), per key and model.
 */
export function bridgeMetricsText(bridges: readonly BridgeSample[], usage: UsageTotals = processUsage): string {
  const labels = (b: BridgeSample) => `{pool="${b.pool}",instance="${b.instance}"}`;
  const out: string[] = [];
  const family = (name: string, help: string, type: 'counter' | 'gauge', value: (b: BridgeSample) => number) => {
    out.push(`# HELP ${name} ${help}`, `# TYPE ${name} ${type}`);
    for (const b of bridges) out.push(`${name}${labels(b)} ${value(b)}`);
  };
  for (const [key, help] of Object.entries(STAT_HELP) as [keyof typeof STAT_HELP, string][]) {
    family(`magus_bridge_${key.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`)}_total`, help, 'counter', (b) => b.stats[key]);
  }
  family('magus_bridge_in_flight', 'Requests being served.', 'gauge', (b) => b.health.inFlight);
  family('magus_bridge_slots', 'Requests the engine serves at once.', 'gauge', (b) => b.health.slots);
  family(
    'magus_bridge_queued',
    'Requests waiting undelivered for the engine, as its beats say (read while every slot is taken; else 0).',
    'gauge',
    (b) => b.health.queued ?? 0,
  );
  family(
    'magus_bridge_service_seconds',
    'The 90th percentile of the time its last 32 deliveries took to serve (0 before the first): a gateway expects a queued request to wait (ahead + 1) × this / slots.',
    'gauge',
    (b) => (b.health.serviceMs ?? 0) / 1000,
  );
  family('magus_bridge_healthy', '1 when connected and consuming, else 0.', 'gauge', (b) => (b.health.ok ? 1 : 0));
  out.push(
    '# HELP magus_usage_tokens_total Tokens in the usage records this process wrote, per key, model and kind (cached: prompt tokens the engine had cached, part of prompt).',
    '# TYPE magus_usage_tokens_total counter',
  );
  for (const u of usage.entries()) {
    for (const kind of ['prompt', 'cached', 'completion'] as const)
      out.push(`magus_usage_tokens_total{key="${labelValue(u.key)}",model="${labelValue(u.model)}",kind="${kind}"} ${u[kind]}`);
  }
  return `${out.join('\n')}\n`;
}

/**
 * Prometheus metrics in the text exposition format (version 0.0.4), without a client library:
 * request counts by route and status, a latency histogram by route, requests in flight, the
 * session broker's warm hits and cold starts, and whether the response stream keeps frames as
 * long as take-overs need them. Recording is a few map updates per request.
 */
import type { FastifyReply, FastifyRequest } from 'fastify';
import type { ResponseStreamState } from '../../dataplane';
import { processMetricsText } from '../../platform/process-metrics';
import { servicePlugin } from './plugin';
import type { SessionStats } from '../serving/sessions';

const escapeLabel = (v: string): string => v.replace(/\\/g, '\\\\').replace(/\n/g, '\\n').replace(/"/g, '\\"');
const fmt = (n: number): string => (Number.isFinite(n) ? String(n) : n > 0 ? '+Inf' : n < 0 ? '-Inf' : 'NaN');

function labelText(names: readonly string[], values: readonly string[], extra = ''): string {
  const parts = names.map((n, i) => `${n}="${escapeLabel(values[i] ?? '')}"`);
  if (extra) parts.push(extra);
  return parts.length > 0 ? `{${parts.join(',')}}` : '';
}

interface Metric {
  render(): string;
}

export class Counter implements Metric {
  private readonly values = new Map<string, { labels: string[]; value: number }>();
  constructor(
    readonly name: string,
    readonly help: string,
    readonly labelNames: readonly string[] = [],
  ) {}
  inc(labels: readonly string[] = [], by = 1): void {
    const key = labels.join('\u0000');
    const v = this.values.get(key);
    if (v) v.value += by;
    else this.values.set(key, { labels: [...labels], value: by });
  }
  get(labels: readonly string[] = []): number {
    return this.values.get(labels.join('\u0000'))?.value ?? 0;
  }
  render(): string {
    const lines = [`# HELP ${this.name} ${this.help}`, `# TYPE ${this.name} counter`];
    for (const { labels, value } of this.values.values()) lines.push(`${this.name}${labelText(this.labelNames, labels)} ${fmt(value)}`);
    return lines.join('\n');
  }
}

export class Gauge implements Metric {
  value = 0;
  constructor(
    readonly name: string,
    readonly help: string,
  ) {}
  render(): string {
    return [`# HELP ${this.name} ${this.help}`, `# TYPE ${this.name} gauge`, `${this.name} ${fmt(this.value)}`].join('\n');
  }
}

/** A value read when scraped, of one Prometheus type; no sample while `read` gives undefined. */
abstract class ReadMetric implements Metric {
  protected abstract readonly type: 'gauge' | 'counter';
  constructor(
    readonly name: string,
    readonly help: string,
    private readonly read: () => number | undefined,
  ) {}
  render(): string {
    const v = this.read();
    return [`# HELP ${this.name} ${this.help}`, `# TYPE ${this.name} ${this.type}`, ...(v === undefined ? [] : [`${this.name} ${fmt(v)}`])].join('\n');
  }
}

/** A gauge whose value is read when scraped. */
export class GaugeFunc extends ReadMetric {
  protected readonly type = 'gauge';
}

/** A counter whose value is read from elsewhere when scraped (e.g. the session broker's stats). */
export class CounterFunc extends ReadMetric {
  protected readonly type = 'counter';
}

export class Histogram implements Metric {
  private readonly series = new Map<string, { labels: string[]; counts: number[]; sum: number; count: number }>();
  constructor(
    readonly name: string,
    readonly help: string,
    readonly labelNames: readonly string[],
    readonly buckets: readonly number[],
  ) {}
  observe(labels: readonly string[], value: number): void {
    const key = labels.join('\u0000');
    let s = this.series.get(key);
    if (!s) {
      s = { labels: [...labels], counts: new Array<number>(this.buckets.length).fill(0), sum: 0, count: 0 };
      this.series.set(key, s);
    }
    // Counts are stored per bucket and accumulated when rendered.
    let i = 0;
    while (i < this.buckets.length && value > this.buckets[i]!) i++;
    if (i < this.buckets.length) s.counts[i]!++;
    s.sum += value;
    s.count++;
  }
  render(): string {
    const lines = [`# HELP ${this.name} ${this.help}`, `# TYPE ${this.name} histogram`];
    for (const s of this.series.values()) {
      let cumulative = 0;
      this.buckets.forEach((b, i) => {
        cumulative += s.counts[i]!;
        lines.push(`${this.name}_bucket${labelText(this.labelNames, s.labels, `le="${fmt(b)}"`)} ${cumulative}`);
      });
      lines.push(`${this.name}_bucket${labelText(this.labelNames, s.labels, 'le="+Inf"')} ${s.count}`);
      lines.push(`${this.name}_sum${labelText(this.labelNames, s.labels)} ${fmt(s.sum)}`);
      lines.push(`${this.name}_count${labelText(this.labelNames, s.labels)} ${s.count}`);
    }
    return lines.join('\n');
  }
}

/** Seconds; LLM requests range from a cached 404 (µs) to a long generation (minutes). */
export const LATENCY_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300] as const;

/** The gateway's metrics. One instance per app; `render()` is the `/metrics` body. */
export class GatewayMetrics {
  readonly requests = new Counter('magus_gateway_requests_total', 'HTTP requests by route and status (499: the client went away first).', ['route', 'status']);
  readonly latency = new Histogram(
    'magus_gateway_request_duration_seconds',
    'HTTP request duration by route, until the last byte (streams included).',
    ['route'],
    LATENCY_BUCKETS,
  );
  readonly inFlight = new Gauge('magus_gateway_requests_in_flight', 'HTTP requests being served.');
  readonly promptTokens = new Counter(
    'magus_gateway_prompt_tokens_total',
    'Prompt tokens of answered chat completions, by model (namespace/name), as the engines counted them.',
    ['model'],
  );
  readonly cachedPromptTokens = new Counter(
    'magus_gateway_cached_prompt_tokens_total',
    'Prompt tokens of answered chat completions that the engine found in its slot KV cache (usage.prompt_tokens_details.cached_tokens), by model: the prefix cache hit rate is its rate over that of magus_gateway_prompt_tokens_total.',
    ['model'],
  );
  readonly upstreamErrors = new Counter('magus_gateway_upstream_errors_total', 'Inference requests that failed on the engine side, by reason.', ['reason']);
  readonly publishRetries = new Counter(
    'magus_gateway_publish_retries_total',
    'Requests of a committed stream whose publish failed (no stream leader, no acknowledgement) and was tried again.',
  );
  readonly placementRetries = new Counter(
    'magus_gateway_placement_retries_total',
    "Turns of a committed stream (its keep-alives sent) whose conversation's entry or new session was unavailable (the sessions bucket in an election, NATS, Temporal) and was tried again.",
  );
  readonly answersMoved = new Counter(
    'magus_gateway_answers_moved_total',
    'Streamed answers their bridge handed back (its instance stopping past its drain deadline, its engine gone) and that went on as a request continuing them, on another instance when the pool had one.',
  );
  readonly limitRefusals = new Counter(
    'magus_gateway_limit_refusals_total',
    "Requests a key's limits refused (429), by code: rate_limit_exceeded (a rate or concurrency), insufficient_quota (its token budget).",
    ['code'],
  );
  readonly natsReconnects = new Counter('magus_gateway_nats_reconnects_total', 'Times the NATS connection came back after it was lost.');
  readonly framesRecovered = new Counter(
    'magus_gateway_frames_recovered_total',
    'Response frames read back from the response stream after a reconnect and handed to waiting requests (duplicates included).',
  );
  readonly framesGone = new Counter(
    'magus_gateway_recovered_frames_gone_total',
    'Read-backs after a reconnect that found frames of their request already gone from the response stream (evicted or aged out).',
  );
  /** `MAGUS_RESPONSES` as last read (at the scrape); see {@link setResponseStream}. */
  private responseStream: ResponseStreamState | undefined;
  private readResponseStream: (() => Promise<ResponseStreamState>) | undefined;
  private readonly responseStreamGauges = [
    new GaugeFunc(
      'magus_gateway_response_stream_oldest_frame_age_seconds',
      'Age of the oldest frame in the response stream (MAGUS_RESPONSES). Below the required retention while the stream is full: frames a take-over may need are being evicted.',
      () => seconds(this.responseStream?.oldestFrameAgeMs),
    ),
    new GaugeFunc(
      'magus_gateway_response_stream_required_retention_seconds',
      'How long the response stream must keep frames: the longest a request may run, as declared.',
      () => seconds(this.responseStream?.requiredRetentionMs),
    ),
    new GaugeFunc('magus_gateway_response_stream_bytes', 'Bytes stored in the response stream.', () => this.responseStream?.bytes),
    new GaugeFunc(
      'magus_gateway_response_stream_max_bytes',
      'Byte limit of the response stream: beyond it the oldest frames are discarded.',
      () => this.responseStream?.maxBytes,
    ),
  ];
  /** Whether Temporal answers (gateway/temporal-health.ts), read when scraped; no samples without it. */
  private temporal: (() => { reachable: boolean; probeFailures: number }) | undefined;
  private readonly temporalReachable = new GaugeFunc(
    'magus_gateway_temporal_reachable',
    "Whether Temporal answered the last probe (1) or not (0). While 0, warm turns and first turns from pools' published instances are served; other first turns get 503 unavailable.",
    () => {
      const t = this.temporal?.();
      return t === undefined ? undefined : t.reachable ? 1 : 0;
    },
  );
  private readonly temporalProbeFailures = new CounterFunc(
    'magus_gateway_temporal_probe_failures_total',
    'Temporal probes (and calls) that found it unreachable: one probe every 2 s at most while it is away.',
    () => this.temporal?.().probeFailures,
  );
  private sessionStats: () => SessionStats | undefined = () => undefined;
  private readonly warmHits = new CounterFunc(
    'magus_gateway_session_warm_hits_total',
    'Turns served from the session cache (no Temporal call).',
    () => this.sessionStats()?.warmHits,
  );
  private readonly coldStarts = new CounterFunc(
    'magus_gateway_session_cold_starts_total',
    'Turns that waited for an instance with room (their pool told of the demand) or on a cold start.',
    () => this.sessionStats()?.coldStarts,
  );
  private readonly firstTurns = new CounterFunc(
    'magus_gateway_session_first_turns_total',
    'First turns served from a pool’s published instances (the session starts after the answer).',
    () => this.sessionStats()?.firstTurns,
  );
  private readonly moves = new CounterFunc(
    'magus_gateway_session_moves_total',
    'Conversations moved (compare-and-swap) off an instance their pool no longer publishes.',
    () => this.sessionStats()?.moves,
  );
  private readonly renewals = new CounterFunc(
    'magus_gateway_session_renewals_total',
    'Conversation entries renewed by this gateway (compare-and-swap; no Temporal call).',
    () => this.sessionStats()?.renewals,
  );
  private readonly givenBack = new CounterFunc(
    'magus_gateway_session_given_back_total',
    'Entries of first turns that were not answered (refused, failed, left by the client), deleted again.',
    () => this.sessionStats()?.givenBack,
  );
  private readonly pendingSessionStarts = new GaugeFunc(
    'magus_gateway_session_starts_pending',
    'Conversations answered whose session workflow has not started yet (bounded: MAGUS_GATEWAY_MAX_PENDING_SESSION_STARTS).',
    () => this.sessionStats()?.pendingSessionStarts,
  );
  private readonly refusedForPendingStarts = new CounterFunc(
    'magus_gateway_refused_pending_session_starts_total',
    'New conversations refused (503) because too many answered ones still wait for their session workflow to start.',
    () => this.sessionStats()?.refusedForPendingStarts,
  );
  private readonly queueMoves = new CounterFunc(
    'magus_gateway_queue_moves_total',
    "Warm conversations moved to another instance because their own one's queue would keep the turn waiting past MAGUS_MAX_QUEUE_WAIT.",
    () => this.sessionStats()?.queueMoves,
  );
  private readonly refusedForQueueWait = new CounterFunc(
    'magus_gateway_refused_queue_wait_total',
    'Turns refused (429 queue_full) because every instance of the model would keep them waiting past MAGUS_MAX_QUEUE_WAIT.',
    () => this.sessionStats()?.refusedForQueueWait,
  );
  private readonly orphansAdopted = new CounterFunc(
    'magus_gateway_orphans_adopted_total',
    'Conversations whose entry had no session workflow (its gateway died before starting one), given one at a warm turn.',
    () => this.sessionStats()?.orphansAdopted,
  );
  private readonly orphansSwept = new CounterFunc(
    'magus_gateway_orphans_swept_total',
    'magus_sessions entries still there 5 min after they expired (no session to delete them), deleted by this gateway.',
    () => this.sessionStats()?.orphansSwept,
  );
  private readonly staleViewPicks = new CounterFunc(
    'magus_gateway_stale_view_picks_total',
    'First turns placed from a view its pool had not rewritten in time (an overloaded Temporal), on an instance found consuming.',
    () => this.sessionStats()?.staleViewPicks,
  );

  /** How to read the response stream's state; read at each scrape ({@link collect}). */
  setResponseStream(read: () => Promise<ResponseStreamState>): void {
    this.readResponseStream = read;
  }

  /** Reads what is read at a scrape (the response stream), at most ~1 s: a scrape must answer while NATS is away. */
  async collect(): Promise<void> {
    if (!this.readResponseStream) return;
    let timer: NodeJS.Timeout | undefined;
    try {
      this.responseStream = await Promise.race([
        this.readResponseStream(),
        new Promise<undefined>((resolve) => (timer = setTimeout(() => resolve(undefined), 1000))),
      ]);
    } catch {
      this.responseStream = undefined; // no stream (yet), or NATS unreachable: no sample
    } finally {
      clearTimeout(timer);
    }
  }

  /** Where Temporal's reachability is read from at each scrape. */
  setTemporal(read: () => { reachable: boolean; probeFailures: number }): void {
    this.temporal = read;
  }

  /** Where warm-hit and cold-start counts come from (the session broker's `stats`). */
  setSessionStats(read: () => SessionStats | undefined): void {
    this.sessionStats = read;
  }

  /** More gauges of the process the gateway runs in, appended at each scrape (`magus dev`: its Temporal workers' cache). */
  setProcessExtras(read: () => string): void {
    this.processExtras = read;
  }

  private processExtras: () => string = () => '';

  render(): string {
    const all = [
      this.requests,
      this.latency,
      this.inFlight,
      this.upstreamErrors,
      this.publishRetries,
      this.placementRetries,
      this.answersMoved,
      this.limitRefusals,
      this.promptTokens,
      this.cachedPromptTokens,
      this.natsReconnects,
      this.framesRecovered,
      this.framesGone,
      ...this.responseStreamGauges,
      this.warmHits,
      this.coldStarts,
      this.firstTurns,
      this.moves,
      this.renewals,
      this.givenBack,
      this.staleViewPicks,
      this.pendingSessionStarts,
      this.refusedForPendingStarts,
      this.queueMoves,
      this.refusedForQueueWait,
      this.orphansAdopted,
      this.orphansSwept,
      this.temporalReachable,
      this.temporalProbeFailures,
    ];
    return `${all.map((m) => m.render()).join('\n')}\n${processMetricsText()}${this.processExtras()}`;
  }
}

const seconds = (ms: number | undefined): number | undefined => (ms === undefined ? undefined : ms / 1000);

export const PROMETHEUS_CONTENT_TYPE = 'text/plain; version=0.0.4; charset=utf-8';

declare module 'fastify' {
  interface FastifyInstance {
    metrics: GatewayMetrics;
  }
}

export interface MetricsPluginOptions {
  metrics?: GatewayMetrics;
}

/** Decorates `app.metrics` and records every request when its response closes (finished or aborted). */
export const metricsPlugin = servicePlugin<MetricsPluginOptions>(
  (app, opts, pluginDone) => {
    const metrics = opts.metrics ?? new GatewayMetrics();
    app.decorate('metrics', metrics);
    app.addHook('onRequest', (request: FastifyRequest, reply: FastifyReply, done) => {
      const started = performance.now();
      metrics.inFlight.value++;
      const res = reply.raw;
      res.once('close', () => {
        metrics.inFlight.value--;
        const route = request.routeOptions.url ?? 'unmatched';
        metrics.requests.inc([route, String(res.writableEnded ? res.statusCode : 499)]);
        metrics.latency.observe([route], (performance.now() - started) / 1000);
      });
      done();
    });
    pluginDone();
  },
  { name: 'magus-metrics' },
);

/**
 * The engine's Prometheus metrics, rendered in the text exposition format (0.0.4) by hand: a few
 * counters, gauges read at scrape time, and fixed-bucket histograms. Updating one is a couple of
 * additions, cheap enough for every token.
 */

import type { SnapshotStats } from './snapshots';

/** A histogram with fixed upper bounds (seconds), cumulative only when rendered. */
export class Histogram {
  private readonly counts: number[];
  private sum = 0;
  private count = 0;

  constructor(readonly bounds: readonly number[]) {
    this.counts = new Array<number>(bounds.length).fill(0);
  }

  observe(value: number): void {
    this.sum += value;
    this.count++;
    for (let i = 0; i < this.bounds.length; i++) {
      if (value <= this.bounds[i]!) {
        this.counts[i]!++;
        return;
      }
    }
  }

  get total(): number {
    return this.count;
  }

  get mean(): number {
    return this.count === 0 ? 0 : this.sum / this.count;
  }

  render(name: string, help: string): string {
    let out = `# HELP ${name} ${help}\n# TYPE ${name} histogram\n`;
    let cumulative = 0;
    for (let i = 0; i < this.bounds.length; i++) {
      cumulative += this.counts[i]!;
      out += `${name}_bucket{le="${this.bounds[i]}"} ${cumulative}\n`;
    }
    out += `${name}_bucket{le="+Inf"} ${this.count}\n${name}_sum ${this.sum}\n${name}_count ${this.count}\n`;
    return out;
  }
}

const TOKEN_BOUNDS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5];
const LATENCY_BOUNDS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120];

/** Gauges read when scraped. */
export interface EngineGauges {
  loaded: boolean;
  slots: number;
  busy: number;
  queued: number;
  /** What the backend saved of its slots' KV caches and loaded of them (engine/snapshots.ts), when it does. */
  snapshots?: SnapshotStats;
}

export class EngineMetrics {
  /** Chat-completion requests answered, by HTTP status (499: the client went away first). */
  readonly requestsByCode = new Map<number, number>();
  /** Failed requests by OpenAI error type (plus `client_closed`). */
  readonly errorsByType = new Map<string, number>();
  promptTokens = 0;
  /** Prompt tokens of answered requests that the slot's KV cache already held (not evaluated again). */
  cachedPromptTokens = 0;
  generatedTokens = 0;
  /** Embedding inputs answered, and their tokens. */
  embeddedInputs = 0;
  embeddedTokens = 0;
  readonly timeToFirstToken = new Histogram(LATENCY_BOUNDS);
  /** Per request: (end − first token) / (tokens − 1). */
  readonly timePerOutputToken = new Histogram(TOKEN_BOUNDS);
  readonly queueWait = new Histogram(LATENCY_BOUNDS);
  readonly requestDuration = new Histogram(LATENCY_BOUNDS);

  countRequest(code: number): void {
    this.requestsByCode.set(code, (this.requestsByCode.get(code) ?? 0) + 1);
  }

  countError(type: string): void {
    this.errorsByType.set(type, (this.errorsByType.get(type) ?? 0) + 1);
  }

  render(g: EngineGauges): string {
    const labelled = (name: string, help: string, label: string, values: Map<number | string, number>): string => {
      let out = `# HELP ${name} ${help}\n# TYPE ${name} counter\n`;
      for (const [k, v] of values) out += `${name}{${label}="${k}"} ${v}\n`;
      return out;
    };
    const single = (name: string, type: 'counter' | 'gauge', help: string, value: number): string =>
      `# HELP ${name} ${help}\n# TYPE ${name} ${type}\n${name} ${value}\n`;
    return [
      labelled('magus_engine_requests_total', 'Chat completion requests answered, by HTTP status (499: client closed).', 'code', this.requestsByCode),
      labelled('magus_engine_errors_total', 'Failed chat completion requests, by error type.', 'type', this.errorsByType),
      single('magus_engine_prompt_tokens_total', 'counter', 'Prompt tokens of accepted requests.', this.promptTokens),
      single(
        'magus_engine_cached_prompt_tokens_total',
        'counter',
        'Prompt tokens of answered requests found in their slot KV cache, not evaluated again (hit rate: its rate over that of magus_engine_prompt_tokens_total).',
        this.cachedPromptTokens,
      ),
      single('magus_engine_generated_tokens_total', 'counter', 'Tokens generated.', this.generatedTokens),
      single('magus_engine_embedded_inputs_total', 'counter', 'Inputs of answered embeddings requests (each one vector).', this.embeddedInputs),
      single('magus_engine_embedded_tokens_total', 'counter', 'Tokens of answered embeddings requests.', this.embeddedTokens),
      ...(g.snapshots
        ? [
            single('magus_engine_snapshots_saved_total', 'counter', "Saves of a slot's KV cache for the engine that follows (--snapshots).", g.snapshots.saves),
            single('magus_engine_snapshot_bytes_total', 'counter', 'Bytes of those saves.', g.snapshots.savedBytes),
            single(
              'magus_engine_snapshot_save_seconds_total',
              'counter',
              'Time those saves took (the slot saved waits as long, the others a batch).',
              g.snapshots.saveSeconds,
            ),
            single('magus_engine_snapshots_loaded_total', 'counter', 'Requests that loaded a snapshot into their slot.', g.snapshots.loads),
            single('magus_engine_snapshot_tokens_loaded_total', 'counter', 'Tokens those loads spared evaluating.', g.snapshots.loadedTokens),
            single('magus_engine_snapshot_load_seconds_total', 'counter', 'Time those loads took.', g.snapshots.loadSeconds),
            single('magus_engine_snapshot_failures_total', 'counter', 'Saves and loads that failed (the answer went on without).', g.snapshots.failures),
          ]
        : []),
      single('magus_engine_requests_in_flight', 'gauge', 'Requests generating in a slot.', g.busy),
      single('magus_engine_requests_queued', 'gauge', 'Requests waiting for a slot.', g.queued),
      single('magus_engine_slots', 'gauge', 'Generation slots.', Number.isFinite(g.slots) ? g.slots : -1),
      single('magus_engine_model_loaded', 'gauge', '1 once the model is loaded and requests are served.', g.loaded ? 1 : 0),
      this.timeToFirstToken.render('magus_engine_time_to_first_token_seconds', 'From arrival to the first generated text.'),
      this.timePerOutputToken.render('magus_engine_time_per_output_token_seconds', 'Mean time per generated token after the first, per request.'),
      this.queueWait.render('magus_engine_queue_wait_seconds', 'Time requests waited for a slot.'),
      this.requestDuration.render('magus_engine_request_duration_seconds', 'From arrival to the end of the answer.'),
    ].join('');
  }
}

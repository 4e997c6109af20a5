/**
 * The engine's serving state, independent of HTTP and of the model runtime: whether it serves
 * (loading → ready → stopping), its backend, slots and queue, metrics, and the generations in
 * flight (so shutdown can abort them).
 */
import { unavailable, type CompletionBackend } from './api';
import { EngineMetrics } from './metrics';
import { SlotPool } from './slots';

export type EngineStatus = 'loading' | 'ready' | 'stopping';

export interface EngineCoreOptions {
  /** `id` in `/v1/models` and `model` in every answer. */
  modelId: string;
  /** Concurrent generations (Infinity: unlimited, for stubs). */
  slots: number;
  /** Requests that may wait for a slot before the engine answers 429. */
  queue: number;
  /** Slots beside `slots` for resumed answers alone (slots.ts, "urgent"); default 0. */
  resumeSlots?: number;
}

export class EngineCore {
  private state: EngineStatus = 'loading';
  private served: CompletionBackend | undefined;
  readonly slots: SlotPool;
  readonly metrics = new EngineMetrics();
  readonly modelId: string;
  /** Unix seconds when the engine started (`created` of the model). */
  readonly created = Math.floor(Date.now() / 1000);
  private readonly inFlight = new Set<AbortController>();
  /** Its model was mapped before it listened (started from standby): while loading it only makes its context. */
  mapped = false;

  constructor(opts: EngineCoreOptions) {
    this.modelId = opts.modelId;
    this.slots = new SlotPool(opts.slots, opts.queue, undefined, opts.resumeSlots ?? 0);
  }

  get status(): EngineStatus {
    return this.state;
  }

  /** The backend, once ready and until stopping. */
  get backend(): CompletionBackend | undefined {
    return this.state === 'ready' ? this.served : undefined;
  }

  /** Starts serving with `backend` (ignored once stopping). */
  ready(backend: CompletionBackend): void {
    if (this.state !== 'loading') return;
    this.served = backend;
    this.state = 'ready';
  }

  /** Stops admitting requests and turns every queued one away with 503; running ones go on. */
  drain(): void {
    this.state = 'stopping';
    this.slots.rejectWaiting(unavailable('The engine is shutting down.'));
  }

  /** Aborts every generation in flight with `reason` (shutdown after the grace period). */
  abortInFlight(reason: unknown = unavailable('The engine is shutting down.')): void {
    for (const c of this.inFlight) c.abort(reason);
  }

  track(controller: AbortController): void {
    this.inFlight.add(controller);
  }

  untrack(controller: AbortController): void {
    this.inFlight.delete(controller);
  }

  /** A `Retry-After` for a refused request: about how long the queue ahead takes to drain. */
  retryAfterSeconds(): number {
    const perRequest = this.metrics.requestDuration.total > 0 ? this.metrics.requestDuration.mean : 1;
    const slots = Number.isFinite(this.slots.size) ? this.slots.size : 1;
    return Math.min(60, Math.max(1, Math.ceil((perRequest * (this.slots.queued + 1)) / slots)));
  }
}

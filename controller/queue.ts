/**
 * The controller's work queue: keys (`<kind>/<namespace>/<name>`), not events. A key queued
 * while it is already queued is queued once; a key being worked on is never worked on twice at
 * once (a change meanwhile queues it again after); failures come back with per-key exponential
 * backoff, capped, so a broken object is retried slowly and never in a hot loop.
 */
export interface WorkQueueOptions {
  concurrency: number;
  /** First retry delay after a failure; doubles per consecutive failure. */
  baseDelayMs?: number;
  maxDelayMs?: number;
  onError?: (key: string, err: unknown, attempt: number) => void;
}

/** What a handler may ask for: come back after a delay (e.g. waiting for a workflow to close). */
export interface Requeue {
  afterMs: number;
}

export class WorkQueue {
  private readonly pending = new Set<string>();
  private readonly order: string[] = [];
  private readonly active = new Set<string>();
  private readonly dirty = new Set<string>();
  private readonly failures = new Map<string, number>();
  private readonly timers = new Map<string, NodeJS.Timeout>();
  private stopped = false;
  private idle: (() => void)[] = [];
  /** Handled keys, failures and delayed re-queues, for `/metrics`. */
  readonly stats = { handled: 0, failed: 0, requeued: 0 };

  constructor(
    private readonly handle: (key: string) => Promise<Requeue | void>,
    private readonly opts: WorkQueueOptions,
  ) {}

  add(key: string): void {
    if (this.stopped) return;
    const timer = this.timers.get(key);
    if (timer) {
      clearTimeout(timer);
      this.timers.delete(key);
    }
    if (this.active.has(key)) {
      this.dirty.add(key);
      return;
    }
    if (this.pending.has(key)) return;
    this.pending.add(key);
    this.order.push(key);
    this.pump();
  }

  /** Queues `key` after `ms` (unless it is queued earlier by a change). */
  addAfter(key: string, ms: number): void {
    if (this.stopped || this.timers.has(key)) return;
    const t = setTimeout(() => {
      this.timers.delete(key);
      this.add(key);
    }, ms);
    t.unref();
    this.timers.set(key, t);
  }

  get length(): number {
    return this.pending.size + this.active.size;
  }

  /** Resolves when nothing is queued or running (delayed re-queues do not count). */
  drained(): Promise<void> {
    if (this.length === 0) return Promise.resolve();
    return new Promise((r) => this.idle.push(r));
  }

  stop(): void {
    this.stopped = true;
    for (const t of this.timers.values()) clearTimeout(t);
    this.timers.clear();
    this.pending.clear();
    this.order.length = 0;
  }

  private pump(): void {
    while (!this.stopped && this.active.size < this.opts.concurrency && this.order.length > 0) {
      const key = this.order.shift()!;
      this.pending.delete(key);
      this.active.add(key);
      void this.run(key);
    }
    if (this.length === 0) for (const r of this.idle.splice(0)) r();
  }

  private async run(key: string): Promise<void> {
    let retryIn: number | undefined;
    try {
      const result = await this.handle(key);
      this.stats.handled++;
      this.failures.delete(key);
      if (result) {
        this.stats.requeued++;
        retryIn = result.afterMs;
      }
    } catch (err) {
      this.stats.failed++;
      const attempt = (this.failures.get(key) ?? 0) + 1;
      this.failures.set(key, attempt);
      this.opts.onError?.(key, err, attempt);
      const base = this.opts.baseDelayMs ?? 500;
      retryIn = Math.min(this.opts.maxDelayMs ?? 60_000, base * 2 ** (attempt - 1)) * (0.8 + Math.random() * 0.4);
    } finally {
      this.active.delete(key);
    }
    if (this.dirty.delete(key)) this.add(key);
    else if (retryIn !== undefined) this.addAfter(key, retryIn);
    this.pump();
  }
}

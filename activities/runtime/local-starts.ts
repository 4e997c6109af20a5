/**
 * The local runtime's starts under way, one per instance id (`<pool>/<instance>`), shared by every
 * `create` of that id (local.ts `LocalRuntime.create` states the contract).
 *
 * Invariants: a start is aborted only by its owner (`destroy`, `stopAll`) or when the last caller
 * waiting for it has gone (its signal aborted) — never while a caller without a signal waits; a
 * caller whose signal aborts is answered at once while others still wait, except the last, which
 * is answered once the start has ended (so whatever the start began has stopped by then); and an
 * entry leaves the registry before anyone awaiting its `settled` resumes.
 */
import type { InstanceInfo } from './runtime';

/** A start under way, shared by every `create` of its id. */
export interface PendingStart {
  pool: string;
  instance: string;
  /** Aborts the start: `destroy`, `stopAll`, or the last waiting caller's signal. */
  abort: AbortController;
  /** Callers still waiting whose signal has not aborted (Infinity once one came without a signal). */
  waiting: number;
  result: Promise<InstanceInfo>;
  /** Resolves when the start has ended either way, an aborted one after stopping what it began. */
  settled: Promise<void>;
}

export class StartRegistry {
  private readonly starting = new Map<string, PendingStart>();

  /** The start of `key` under way, if any. */
  get(key: string): PendingStart | undefined {
    return this.starting.get(key);
  }

  /** Every start under way. */
  all(): PendingStart[] {
    return [...this.starting.values()];
  }

  /** Registers the start `run` of `pool/instance` under `key`, with no caller yet (see {@link StartRegistry.join}). */
  begin(key: string, pool: string, instance: string, run: (signal: AbortSignal) => Promise<InstanceInfo>): PendingStart {
    const abort = new AbortController();
    const result = run(abort.signal);
    const pending: PendingStart = {
      pool,
      instance,
      abort,
      waiting: 0,
      result,
      settled: result.then(
        () => undefined,
        () => undefined,
      ),
    };
    this.starting.set(key, pending);
    // Registered first, so whoever awaits `settled` finds the entry gone.
    void pending.settled.then(() => {
      if (this.starting.get(key) === pending) this.starting.delete(key);
    });
    return pending;
  }

  /** One more caller of `pending`, rejected with its own `signal`'s reason when that aborts (see the module comment). */
  join(pending: PendingStart, signal: AbortSignal | undefined): Promise<InstanceInfo> {
    if (!signal) {
      pending.waiting = Infinity;
      return pending.result;
    }
    pending.waiting += 1;
    return new Promise((ok, fail) => {
      const onAbort = () => {
        pending.waiting -= 1;
        if (pending.waiting > 0) return fail(signal.reason as Error);
        // Nobody waits for this start any more: it would only leave an engine nobody destroys.
        // Answered once it has ended: with what it began stopped, or with the instance if it
        // was registered before the abort (an aborted start never registers one).
        pending.abort.abort(signal.reason);
        pending.result.then(ok, () => fail(signal.reason as Error));
      };
      if (signal.aborted) return onAbort();
      signal.addEventListener('abort', onAbort, { once: true });
      pending.result.then(
        (info) => (signal.removeEventListener('abort', onAbort), ok(info)),
        (err: unknown) => (signal.removeEventListener('abort', onAbort), fail(err as Error)),
      );
    });
  }

  /** Aborts the start of `key` under way, if any, with `reason`, and waits for it to end. */
  async abort(key: string, reason: () => Error): Promise<void> {
    const pending = this.starting.get(key);
    if (!pending) return;
    pending.abort.abort(reason());
    await pending.settled;
  }
}

/** `p`, or `signal`'s reason as soon as it aborts. */
export function unlessAborted<T>(p: Promise<T>, signal: AbortSignal | undefined): Promise<T> {
  if (!signal) return p;
  return new Promise((ok, fail) => {
    const onAbort = () => fail(signal.reason as Error);
    if (signal.aborted) return onAbort();
    signal.addEventListener('abort', onAbort, { once: true });
    const done = () => signal.removeEventListener('abort', onAbort);
    p.then(
      (v) => (done(), ok(v)),
      (e: unknown) => (done(), fail(e as Error)),
    );
  });
}

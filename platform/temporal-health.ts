/**
 * Whether Temporal answers, as a process that only *sometimes* needs it sees it (the gateway: cold
 * first turns; the worker and controller: their health endpoints). A probe (`GetSystemInfo` under a
 * short deadline) runs every few seconds — more often while Temporal is away — so:
 * - a request that needs Temporal while it is away is refused at once (503 `unavailable` with
 *   `Retry-After`) instead of waiting out the client's retries (~20 s measured);
 * - `/readyz` and `/metrics` say so;
 * - the gRPC channel is asked to connect again every probe, so it is back within a probe interval
 *   of the server (with the channel's reconnect backoff capped below: grpc-js's default grows to
 *   2 minutes, and a call made while it waits fails without trying).
 * Nothing here retries a request: at most one probe RPC every {@link TemporalHealthOptions.downIntervalMs}.
 * A worker that starts while Temporal is away waits for it with {@link untilTemporalAnswers} (one
 * attempt, then 1 s, 2 s and every 3 s after it), showing {@link unreachableHealth} meanwhile.
 */
import { Connection, isGrpcServiceError, type ConnectionOptions } from '@temporalio/client';

/** The gRPC status codes used here (grpc-js's `status` enum). */
const GrpcStatus = { DEADLINE_EXCEEDED: 4, UNIMPLEMENTED: 12, UNAVAILABLE: 14 } as const;

/**
 * Channel options for every long-lived Temporal client connection: its reconnect backoff stays
 * short (grpc-js's default grows ×1.6 to 120 s: after a minute-long outage a gateway took up to
 * ~30 s more to notice the server back, measured), so one connection attempt every ≤ 3 s at most.
 */
export const TEMPORAL_CHANNEL_ARGS: NonNullable<ConnectionOptions['channelArgs']> = {
  'grpc.initial_reconnect_backoff_ms': 500,
  'grpc.max_reconnect_backoff_ms': 3_000,
};

/** RPC deadline of a short Temporal call a client waits on (a start, a signal): past it, Temporal counts as unreachable. */
export const TEMPORAL_CALL_DEADLINE_MS = 5_000;

export interface TemporalHealthOptions {
  /** Between probes while Temporal answers (default 5 s). */
  intervalMs?: number;
  /** Between probes while it does not (default 2 s). */
  downIntervalMs?: number;
  /** Deadline of one probe (default 2 s). */
  timeoutMs?: number;
  /** Told when reachability changes (first probe included). */
  onChange?: (reachable: boolean) => void;
  /**
   * Probe failures counted before this watch (a worker's attempts at its start while it waited
   * for Temporal: {@link untilTemporalAnswers}), so the failures counter never goes back.
   */
  failures?: number;
}

export interface TemporalHealth {
  /** The last probe's answer (true until a probe or a call says otherwise). */
  reachable(): boolean;
  /** A call failed as unreachable: counts as a failed probe and probes again soon. */
  markUnreachable(): void;
  /**
   * A signal that aborts when Temporal is found unreachable (a new one once it is back): calls
   * in flight under it end then, instead of riding out the client's own retries (~20 s).
   */
  whileReachable(): AbortSignal;
  /** Probes run so far, and how many failed. */
  stats(): { probes: number; failures: number; since: number | undefined };
  /** Stops probing; resolves once a probe under way has ended (close the connection only then: a call retried on a closed channel throws). */
  close(): Promise<void>;
}

/** Probes `connection` until closed; the first probe starts at once. */
export function watchTemporal(connection: Connection, opts: TemporalHealthOptions = {}): TemporalHealth {
  const intervalMs = opts.intervalMs ?? 5_000;
  const downIntervalMs = opts.downIntervalMs ?? 2_000;
  const timeoutMs = opts.timeoutMs ?? 2_000;
  let reachable = true;
  /** When it last became unreachable. */
  let since: number | undefined;
  let probes = 0;
  let failures = opts.failures ?? 0;
  let closed = false;
  let timer: NodeJS.Timeout | undefined;
  let inflight: Promise<void> | undefined;
  let known = false;
  let up = new AbortController();

  const set = (ok: boolean) => {
    const changed = !known || ok !== reachable;
    known = true;
    reachable = ok;
    since = ok ? undefined : (since ?? Date.now());
    if (!ok) up.abort(new Error('Temporal is unreachable'));
    else if (up.signal.aborted) up = new AbortController();
    if (changed) opts.onChange?.(ok);
  };
  const schedule = (ms: number) => {
    clearTimeout(timer);
    if (closed) return;
    timer = setTimeout(() => void probe(), ms);
    timer.unref();
  };
  const probe = (): Promise<void> => {
    if (inflight || closed) return inflight ?? Promise.resolve();
    probes++;
    inflight = (async () => {
      let ok: boolean;
      try {
        await connection.withDeadline(Date.now() + timeoutMs, () => connection.workflowService.getSystemInfo({}));
        ok = true;
      } catch (err) {
        // An old server without GetSystemInfo still answered.
        ok = isGrpcServiceError(err) && (err.code as number) === GrpcStatus.UNIMPLEMENTED;
      }
      inflight = undefined;
      if (closed) return;
      if (!ok) failures++;
      set(ok);
      schedule(ok ? intervalMs : downIntervalMs);
    })();
    return inflight;
  };
  void probe();
  return {
    reachable: () => reachable,
    markUnreachable() {
      if (closed) return;
      failures++;
      set(false);
      schedule(0);
    },
    stats: () => ({ probes, failures, since }),
    whileReachable: () => up.signal,
    async close() {
      closed = true;
      clearTimeout(timer);
      await inflight;
    },
  };
}

/** How long a start waits after its `failures`-th failed attempt to reach Temporal: 1 s, 2 s, then 3 s (the channel's reconnect cap above). */
export function temporalStartBackoffMs(failures: number): number {
  return Math.min(1_000 * 2 ** Math.max(0, failures - 1), 3_000);
}

export interface TemporalWaitOptions {
  /** Ends the wait: it rejects with the signal's reason. */
  signal?: AbortSignal;
  /** Deadline of one attempt (default 2 s, as a probe's). */
  timeoutMs?: number;
  /** Failed attempts before this wait: the numbering and the backoff carry on from them. */
  failures?: number;
  /** Told after each failed attempt: its number (1, 2, …), why (one line), and the delay before the next. */
  onFailure?: (attempt: number, reason: string, retryInMs: number) => void;
  /** The delay after the n-th failed attempt (default {@link temporalStartBackoffMs}). */
  backoffMs?: (failures: number) => number;
}

/**
 * Waits until Temporal at `address` answers, for a process that has nothing to do without it (a
 * worker at its start; see workers/worker.ts). Its own channel (without the client's retries,
 * closed once Temporal answers) connects at once and, after a failure, again 1 s later, then at
 * most every 3 s (gRPC's reconnect backoff: 1 s × 1.6 up to 3 s, jittered); an attempt — a
 * `GetSystemInfo` under a short deadline — follows 1 s after the first failed one, 2 s after the
 * second, then every 3 s, or as soon as the channel connects. So attempts are counted and bounded
 * by the time waited, never a hot loop, and Temporal is seen back within ~3 s. Only "unreachable"
 * (UNAVAILABLE, DEADLINE_EXCEEDED) is waited out: any other answer comes from a server, and what
 * the caller asks next says what is wrong (a namespace that does not exist, say). Resolves with
 * the number of failed attempts so far (`failures` included); rejects at once when the signal
 * aborts, whatever the attempt is waiting on (with its reason, as an Error).
 */
export async function untilTemporalAnswers(address: string, opts: TemporalWaitOptions = {}): Promise<number> {
  const timeoutMs = opts.timeoutMs ?? 2_000;
  const backoff = opts.backoffMs ?? temporalStartBackoffMs;
  const { signal } = opts;
  let failures = opts.failures ?? 0;
  if (signal?.aborted) throw stopped(signal);
  // `lazy` builds `new this(…)`: a ProbeConnection.
  const probe = ProbeConnection.lazy({
    address,
    channelArgs: { ...TEMPORAL_CHANNEL_ARGS, 'grpc.initial_reconnect_backoff_ms': 1_000 },
    interceptors: [],
  }) as ProbeConnection;
  let onAbort: (() => void) | undefined;
  const aborted = new Promise<never>((_, reject) => {
    onAbort = () => reject(stopped(signal!));
    signal?.addEventListener('abort', onAbort, { once: true });
  });
  aborted.catch(() => undefined); // raced below; nobody may be waiting on it when it rejects
  try {
    for (;;) {
      let reason: string | undefined;
      try {
        await Promise.race([probe.withDeadline(Date.now() + timeoutMs, () => probe.workflowService.getSystemInfo({})), aborted]);
      } catch (err) {
        if (signal?.aborted) throw stopped(signal);
        if (isTemporalUnreachable(err)) reason = unreachableReason(err, timeoutMs);
      }
      if (reason === undefined) return failures;
      failures++;
      const retryInMs = backoff(failures);
      opts.onFailure?.(failures, reason, retryInMs);
      // Until the next attempt, or until the channel, reconnecting by itself, is up.
      await Promise.race([probe.connected(Date.now() + retryInMs).catch(() => undefined), aborted]);
    }
  } finally {
    if (onAbort) signal?.removeEventListener('abort', onAbort);
    await probe.close();
  }
}

/** What a stopped wait rejects with: the signal's reason, made an Error if it is not one (a signal's name, say). */
function stopped(signal: AbortSignal): Error {
  const reason: unknown = signal.reason;
  return reason instanceof Error ? reason : new Error(`stopped (${String(reason)})`);
}

/** A client connection that can wait for its channel to connect (the SDK keeps that to itself). */
class ProbeConnection extends Connection {
  /** Resolves once the channel is connected; rejects at `deadline` if it is not. */
  connected(deadline: number): Promise<void> {
    return this.untilReady(deadline);
  }
}

/** One line saying why an attempt failed: gRPC's own words (`connect ECONNREFUSED …`, `Name resolution failed …`), or no answer in time. */
function unreachableReason(err: unknown, timeoutMs: number): string {
  const e = err as { code?: number; details?: string; message?: string };
  if (e.code === GrpcStatus.DEADLINE_EXCEEDED) return `no answer within ${timeoutMs / 1000} s`;
  const text = (e.details || e.message || String(err)).split('\n')[0]!;
  return text.replace(/\.?\s*Resolution note:\s*$/, '').replace('Last error: Error: ', 'Last error: ');
}

/**
 * The {@link TemporalHealth} of a process waiting for Temporal at its start: unreachable since
 * `state.since`, with `state.failures` failed attempts (both kept by the caller); it probes nothing.
 */
export function unreachableHealth(state: { readonly since: number; readonly failures: number }): TemporalHealth {
  const gone = new AbortController();
  gone.abort(new Error('Temporal is unreachable'));
  return {
    reachable: () => false,
    markUnreachable: () => undefined,
    whileReachable: () => gone.signal,
    stats: () => ({ probes: state.failures, failures: state.failures, since: state.since }),
    close: () => Promise.resolve(),
  };
}

/** gRPC codes of a server that cannot be reached or did not answer in time. */
const UNREACHABLE = new Set<number>([GrpcStatus.UNAVAILABLE, GrpcStatus.DEADLINE_EXCEEDED]);

/**
 * Whether `err` (a client call's failure, or its cause) says Temporal could not be reached: the
 * gRPC status UNAVAILABLE (no connection) or DEADLINE_EXCEEDED (our deadline passed).
 */
export function isTemporalUnreachable(err: unknown): boolean {
  for (let e = err, depth = 0; typeof e === 'object' && e !== null && depth < 4; e = (e as { cause?: unknown }).cause, depth++) {
    if (isGrpcServiceError(e) && UNREACHABLE.has(e.code)) return true;
  }
  return false;
}

/**
 * The `/readyz` body of a worker or controller while `health` watches its Temporal: `ok`, or
 * `degraded: Temporal unreachable for N s` — with status 200 either way: the process reconnects by
 * itself and has nothing to hand to another replica (they all share the one Temporal), so neither
 * a restart nor taking it out of rotation helps.
 */
export function temporalReadyText(health: TemporalHealth | undefined, now = Date.now()): string {
  const since = health?.stats().since;
  if (!health || health.reachable() || since === undefined) return 'ok\n';
  return `degraded: Temporal unreachable for ${Math.round((now - since) / 1000)} s\n`;
}

/** Prometheus text: `<prefix>_temporal_reachable` (1/0) and `<prefix>_temporal_probe_failures_total`. */
export function temporalMetricsText(prefix: string, health: TemporalHealth | undefined): string {
  if (!health) return '';
  return [
    `# HELP ${prefix}_temporal_reachable Whether Temporal answered the last probe (1) or not (0).`,
    `# TYPE ${prefix}_temporal_reachable gauge`,
    `${prefix}_temporal_reachable ${health.reachable() ? 1 : 0}`,
    `# HELP ${prefix}_temporal_probe_failures_total Temporal probes that found it unreachable: one every 2 s at most while it is away (a starting worker's connection attempts: 1 s, 2 s, then 3 s apart).`,
    `# TYPE ${prefix}_temporal_probe_failures_total counter`,
    `${prefix}_temporal_probe_failures_total ${health.stats().failures}`,
    '',
  ].join('\n');
}

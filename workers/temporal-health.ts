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
 */
import { isGrpcServiceError, type Connection, type ConnectionOptions } from '@temporalio/client';

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
  let failures = 0;
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
    `# HELP ${prefix}_temporal_probe_failures_total Temporal probes that found it unreachable (one every 2 s at most while it is away).`,
    `# TYPE ${prefix}_temporal_probe_failures_total counter`,
    `${prefix}_temporal_probe_failures_total ${health.stats().failures}`,
    '',
  ].join('\n');
}

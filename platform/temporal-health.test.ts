import { Connection } from '@temporalio/client';
import { createServer, type Server } from 'node:net';
import type { AddressInfo } from 'node:net';
import {
  isTemporalUnreachable,
  temporalMetricsText,
  temporalReadyText,
  temporalStartBackoffMs,
  unreachableHealth,
  untilTemporalAnswers,
  watchTemporal,
} from './temporal-health';
import { sleep, until } from '../test/harness/wait';

/** A port that refuses connections: a listener opened and closed. */
async function refusedPort(): Promise<number> {
  const s: Server = createServer();
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
  const { port } = s.address() as AddressInfo;
  await new Promise<void>((r) => s.close(() => r()));
  return port;
}

describe('watchTemporal', () => {
  it('a server that refuses: unreachable after the first probe, within its deadline, probed at the down interval only, and said so', async () => {
    const connection = Connection.lazy({ address: `127.0.0.1:${await refusedPort()}` });
    const changes: boolean[] = [];
    /** Probes made when it was first said unreachable. */
    let probesWhenDown: number | undefined;
    const t0 = Date.now();
    const health = watchTemporal(connection, {
      timeoutMs: 500,
      downIntervalMs: 300,
      onChange: (up) => {
        changes.push(up);
        if (!up) probesWhenDown ??= health.stats().probes;
      },
    });
    try {
      await until('unreachable', () => !health.reachable(), 60_000);
      // The first probe's failure says so: no second one awaited.
      expect(probesWhenDown).toBe(1);
      await sleep(1_500);
      const { probes, failures, since } = health.stats();
      // Every probe that ended failed (one may be under way).
      expect(failures).toBeGreaterThanOrEqual(Math.max(1, probes - 1));
      // One probe per down interval (plus each probe's own time): never a busy loop.
      expect(probes).toBeLessThanOrEqual(1 + Math.ceil((Date.now() - t0) / 300));
      expect(since).toBeGreaterThanOrEqual(t0);
      expect(changes).toEqual([false]);
      expect(temporalReadyText(health)).toMatch(/^degraded: Temporal unreachable for \d+ s\n$/);
      expect(temporalMetricsText('magus_worker', health)).toContain('magus_worker_temporal_reachable 0\n');
    } finally {
      await health.close();
      await connection.close();
    }
  });

  it('isTemporalUnreachable: UNAVAILABLE or DEADLINE_EXCEEDED, also as a cause; nothing else', () => {
    const grpc = (code: number) => Object.assign(new Error('x'), { code, details: 'x', metadata: {} });
    expect(isTemporalUnreachable(grpc(14))).toBe(true);
    expect(isTemporalUnreachable(new Error('Failed to start Workflow', { cause: grpc(4) }))).toBe(true);
    expect(isTemporalUnreachable(grpc(5))).toBe(false); // NOT_FOUND: it answered
    expect(isTemporalUnreachable(new Error('x'))).toBe(false);
    expect(temporalReadyText(undefined)).toBe('ok\n');
  });
});

describe('untilTemporalAnswers (a worker starting while Temporal is away)', () => {
  it('backs off 1 s, 2 s, then every 3 s', () => {
    expect([1, 2, 3, 4, 10].map(temporalStartBackoffMs)).toEqual([1_000, 2_000, 3_000, 3_000, 3_000]);
  });

  it('a server that refuses: one attempt per backoff step, each failure told once with its reason, and a stop ends the wait at once', async () => {
    const BACKOFF_MS = 1_000;
    /** The sleep after the last failure: were the stop not to end it, the test would time out. */
    const LAST_SLEEP_MS = 10 * 60_000;
    const port = await refusedPort();
    const stop = new AbortController();
    const failures: { attempt: number; reason: string; retryInMs: number; at: number }[] = [];
    const t0 = Date.now();
    const waiting = untilTemporalAnswers(`127.0.0.1:${port}`, {
      signal: stop.signal,
      failures: 2, // carries on from an earlier wait's count
      backoffMs: (attempt) => (attempt >= 6 ? LAST_SLEEP_MS : BACKOFF_MS),
      onFailure: (attempt, reason, retryInMs) => {
        failures.push({ attempt, reason, retryInMs, at: Date.now() - t0 });
        if (attempt === 6) setTimeout(() => stop.abort(new Error('stopped')), 50);
      },
    });
    // The stop (50 ms after the last failure) ends the 10-minute sleep: no further attempt.
    await expect(waiting).rejects.toThrow('stopped');
    expect(failures.map((f) => f.attempt)).toEqual([3, 4, 5, 6]);
    expect(failures.map((f) => f.retryInMs)).toEqual([BACKOFF_MS, BACKOFF_MS, BACKOFF_MS, LAST_SLEEP_MS]);
    // gRPC's own words, one line, no stack.
    expect(failures[0]!.reason).toMatch(new RegExp(`ECONNREFUSED 127\\.0\\.0\\.1:${port}$`));
    expect(failures[0]!.reason).not.toMatch(/\n|Resolution note|\s{4}at /);
    // Never sooner than the backoff: no hot loop.
    for (let i = 1; i < failures.length; i++) expect(failures[i]!.at - failures[i - 1]!.at).toBeGreaterThanOrEqual(BACKOFF_MS - 5);
  });

  it('unreachableHealth: what /readyz and /metrics say while the start waits; a watch after it keeps counting', async () => {
    const state = { since: Date.now() - 7_000, failures: 4 };
    const health = unreachableHealth(state);
    expect(health.reachable()).toBe(false);
    expect(health.whileReachable().aborted).toBe(true);
    expect(temporalReadyText(health)).toBe('degraded: Temporal unreachable for 7 s\n');
    expect(temporalMetricsText('magus_worker', health)).toContain('magus_worker_temporal_reachable 0\n');
    expect(temporalMetricsText('magus_worker', health)).toContain('magus_worker_temporal_probe_failures_total 4\n');
    const connection = Connection.lazy({ address: `127.0.0.1:${await refusedPort()}` });
    const watch = watchTemporal(connection, { failures: 4, timeoutMs: 300 });
    try {
      expect(watch.stats().failures).toBe(4);
    } finally {
      await watch.close();
      await connection.close();
    }
  });
});

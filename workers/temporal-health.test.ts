import { Connection } from '@temporalio/client';
import { createServer, type Server } from 'node:net';
import type { AddressInfo } from 'node:net';
import { isTemporalUnreachable, temporalMetricsText, temporalReadyText, watchTemporal } from './temporal-health';

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
    const t0 = Date.now();
    const health = watchTemporal(connection, { timeoutMs: 500, downIntervalMs: 300, onChange: (up) => changes.push(up) });
    try {
      while (health.reachable() && Date.now() - t0 < 5_000) await new Promise((r) => setTimeout(r, 20));
      expect(health.reachable()).toBe(false);
      expect(Date.now() - t0).toBeLessThan(3_000);
      await new Promise((r) => setTimeout(r, 1_500));
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

/**
 * The soak's CI variant (`npm run soak` is the full 10 minutes): 75 s of mixed traffic through a
 * fresh `magus dev`'s processes — new and warm conversations, streamed and not, injected client
 * disconnects, the demo model re-pulled with a changed spec halfway — with every process's RSS
 * and open fds, NATS consumers and session keys sampled. No error beyond the injected ones, the
 * re-pull ready under traffic, no consumer or key beyond what live conversations explain, no fd
 * growth after warm-up. The RSS slopes are printed (too short a run to judge memory by).
 */
import { runSoak } from '../bench/soak';
import { printReport } from '../bench/soak-report';

test('75 s of mixed traffic through magus dev: no error but the injected ones, nothing left behind', async () => {
  const lines: string[] = [];
  const report = await runSoak({ durationMs: 75_000, concurrency: 3, newPerSec: 2, sampleMs: 5000, warmupShare: 0.3, log: (l) => lines.push(l) });
  printReport(report, (l) => lines.push(l));
  process.stderr.write(`${lines.join('\n')}\n`);
  expect(report.errors).toEqual([]);
  expect(report.requests.new.ok).toBeGreaterThan(10);
  expect(report.requests['warm-stream'].ok).toBeGreaterThan(10);
  expect(report.requests.disconnect.injected).toBeGreaterThan(0);
  expect([report.repull.ok, report.repull.detail]).toEqual([true, 'demo re-pulled with gguf:q40,gguf:q80 under traffic: ready']);
  expect(report.leaks).toEqual([]);
}, 360_000);

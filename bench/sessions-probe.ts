/**
 * One process of `bench:sessions` (bench/sessions.ts starts it): the worker's or the controller's
 * part that reads `magus_sessions`, alone in a process, so its RSS and CPU are its own.
 *
 *   reconciler-count   a pool's reconciler (`watchLoad`) of a pool on load, counted by the server
 *   reconciler-index   the same for a pool on leases: this process's index of every entry
 *   orphan-scan        one read of the pool's entries, as the reconciler of a pool on load looks
 *                      for orphans (activities/serving.ts `scanOrphans`): its time is "ready"
 *   controller         the controller's Session mirror (cap 200; its Kubernetes API is unreachable:
 *                      what it holds is what is measured, not what it writes)
 *
 * Env: MAGUS_NATS_URL. Prints one JSON line once ready (`readyMs`), then stays until killed.
 */
import { MockActivityEnvironment } from '@temporalio/testing';
import { KubeConfig } from '@kubernetes/client-node';
import { connect } from 'nats';
import { createServingActivities, type LoadSummary, type WatchLoadInput } from '../activities/serving';
import type { Runtime } from '../activities/runtime/runtime';
import { startSessionMirror } from '../controller/sessions';
import { dataPlaneNames } from '../dataplane';
import { poolEntryCounter, poolKeyPrefix, scanPoolEntries } from '../dataplane/session-keys';
import { decodeSessionEntry } from '../shared/serving';

async function main(): Promise<void> {
  const mode = process.argv[2];
  const nc = await connect({ servers: process.env.MAGUS_NATS_URL!, name: `bench-sessions-${mode}` });
  const names = dataPlaneNames('');
  const sessions = await nc.jetstream().views.kv(names.sessionsBucket);
  const t0 = Date.now();
  let extra: Record<string, number> = {};
  if (mode === 'reconciler-count' || mode === 'reconciler-index') {
    const jsm = await nc.jetstreamManager();
    const serving = createServingActivities({
      runtime: {} as Runtime,
      sessions,
      pools: sessions,
      ...(mode === 'reconciler-count' ? { countEntries: poolEntryCounter(jsm, names.sessionsBucket) } : {}),
    });
    const input: WatchLoadInput = {
      namespace: 'default',
      model: 'bench',
      instances: ['bench-1-00000000'],
      leasesPerInstance: 4,
      known: null,
      minIntervalMs: 0,
      pressurePending: 4,
      ...(mode === 'reconciler-count' ? { scaleOn: 'load' as const } : {}),
    };
    const first: LoadSummary = await new MockActivityEnvironment().run((i: WatchLoadInput) => serving.watchLoad(i), input);
    extra = { counted: first.live ?? first.instances['bench-1-00000000']!.leases };
    // Then as a pool runs it: again and again, each waiting for a change (none comes), until killed.
    void (async () => {
      for (;;) {
        const env = new MockActivityEnvironment();
        const run = env.run((i: WatchLoadInput) => serving.watchLoad(i), { ...input, known: first, minIntervalMs: 2000, refreshMs: 3_600_000 });
        setTimeout(() => env.cancel(), 30_000);
        await run.catch(() => undefined);
      }
    })();
  } else if (mode === 'orphan-scan') {
    let read = 0;
    let decoded = 0;
    await scanPoolEntries(sessions, poolKeyPrefix('default', 'bench'), (e) => {
      read++;
      if (decodeSessionEntry(e.value)) decoded++;
    });
    extra = { counted: read, decoded };
  } else if (mode === 'controller') {
    const kc = new KubeConfig();
    kc.loadFromClusterAndUser({ name: 'none', server: 'https://127.0.0.1:1', skipTLSVerify: true }, { name: 'none' });
    const mirror = startSessionMirror({ kc, kv: sessions, cap: 200, intervalMs: 1000 });
    await mirror.replayed;
    extra = { held: mirror.stats.held };
  } else throw new Error(`unknown mode ${mode}`);
  console.log(JSON.stringify({ readyMs: Date.now() - t0, heapMb: process.memoryUsage().heapUsed / 1024 / 1024, ...extra }));
  // The heap as it is afterwards, every 5 s (the bench reads the last line).
  setInterval(() => console.log(JSON.stringify({ heapMb: process.memoryUsage().heapUsed / 1024 / 1024 })), 5_000);
}

main().catch((err: unknown) => {
  console.error(err);
  process.exit(1);
});

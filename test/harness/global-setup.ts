/**
 * Jest global setup for the `integration` project: starts every real server once per run and
 * hands connection info to test workers through a 0600 file named in MAGUS_TEST_ENDPOINTS.
 */
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { ALL_SERVICES, startServices, type RunningServices, type ServiceName } from '../../workers/dev/services';

declare global {
  var __magusServices: RunningServices | undefined;
}

export default async function globalSetup(): Promise<void> {
  const started = Date.now();
  // MAGUS_TEST_SERVICES=temporal,nats narrows the set for quick local runs; CI starts them all.
  const subset = process.env.MAGUS_TEST_SERVICES?.split(',').filter(Boolean) as ServiceName[] | undefined;
  const running = await startServices({ services: subset ?? ALL_SERVICES, readyTimeoutSec: 180 });
  globalThis.__magusServices = running;
  const file = join(running.dataDir, 'endpoints.json');
  writeFileSync(file, JSON.stringify(running.endpoints), { mode: 0o600 });
  process.env.MAGUS_TEST_ENDPOINTS = file;
  // A `magus dev` a test starts without --data-dir keeps its state in this run's throwaway folder,
  // never in the user's own (~/.local/share/magus/dev), which a running dev of theirs may hold.
  process.env.MAGUS_DEV_DATA_DIR = join(running.dataDir, 'magus-dev');
  // Ctrl-C: servers get the terminal's SIGINT themselves, and die with us in any case
  // (pdeathsig); stopping here also removes the data folder.
  for (const sig of ['SIGINT', 'SIGTERM'] as const) {
    process.once(sig, () => void running.stop().finally(() => process.exit(130)));
  }
  process.stderr.write(`\nmagus test services ready in ${((Date.now() - started) / 1000).toFixed(1)}s (${running.dataDir})\n`);
}

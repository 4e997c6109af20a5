/**
 * Jest global setup for the `integration` project: starts every real server once per run and
 * hands connection info to test workers through a 0600 file named in MAGUS_TEST_ENDPOINTS.
 *
 * nats-server runs with users per role (dataplane/roles.ts), as `magus dev` and the chart run it:
 * `magus nats-auth`'s folder is written first and recorded as `nats.credentialsDir`, from which
 * harness/index.ts gives each test the credentials of the role it exercises.
 * `MAGUS_TEST_NATS_AUTH=0` runs it without users (no `credentialsDir`: every test connects
 * anonymously).
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { dataPlaneNames } from '../../dataplane';
import { ALL_SERVICES, startServices, type RunningServices, type ServiceName } from '../../workers/dev/services';
import { writeNatsAuth } from '../../workers/nats-auth';
import type { TestEndpoints } from './index';

declare global {
  var __magusServices: RunningServices | undefined;
  var __magusNatsAuthDir: string | undefined;
}

export default async function globalSetup(): Promise<void> {
  const started = Date.now();
  // MAGUS_TEST_SERVICES=temporal,nats narrows the set for quick local runs; CI starts them all.
  const subset = process.env.MAGUS_TEST_SERVICES?.split(',').filter(Boolean) as ServiceName[] | undefined;
  const services = subset ?? ALL_SERVICES;
  // Outside the servers' data folder, which exists only once they start: the server reads its
  // configuration from here. Removed at teardown (global-teardown.ts).
  const natsAuth = services.includes('nats') && process.env.MAGUS_TEST_NATS_AUTH !== '0' ? mkdtempSync(join(tmpdir(), 'magus-test-nats-auth-')) : undefined;
  globalThis.__magusNatsAuthDir = natsAuth;
  if (natsAuth) await writeNatsAuth(natsAuth, dataPlaneNames());
  const running = await startServices({
    services,
    readyTimeoutSec: 180,
    ...(natsAuth ? { natsConfigFile: join(natsAuth, 'nats-auth.conf') } : {}),
  });
  globalThis.__magusServices = running;
  const endpoints: TestEndpoints = { ...running.endpoints };
  if (natsAuth && endpoints.nats) endpoints.nats = { ...endpoints.nats, credentialsDir: natsAuth };
  const file = join(running.dataDir, 'endpoints.json');
  writeFileSync(file, JSON.stringify(endpoints), { mode: 0o600 });
  process.env.MAGUS_TEST_ENDPOINTS = file;
  // Each test hands a process its role's credentials itself; one set in the shell running jest
  // would reach every process spawned with the test's environment (a `magus dev` among them).
  delete process.env.MAGUS_NATS_CREDENTIALS;
  // A `magus dev` a test starts without --data-dir keeps its state in this run's throwaway folder,
  // never in the user's own (~/.local/share/magus/dev), which a running dev of theirs may hold.
  process.env.MAGUS_DEV_DATA_DIR = join(running.dataDir, 'magus-dev');
  // Ctrl-C: servers get the terminal's SIGINT themselves, and die with us in any case
  // (pdeathsig); stopping here also removes the data folder.
  for (const sig of ['SIGINT', 'SIGTERM'] as const) {
    process.once(
      sig,
      () =>
        void running
          .stop()
          .finally(() => natsAuth && rmSync(natsAuth, { recursive: true, force: true }))
          .finally(() => process.exit(130)),
    );
  }
  process.stderr.write(
    `\nmagus test services ready in ${((Date.now() - started) / 1000).toFixed(1)}s (${running.dataDir}${natsAuth ? '; NATS with users per role' : ''})\n`,
  );
}

import { rmSync } from 'node:fs';

/** Jest global teardown: stops the servers started by global-setup and removes their data and NATS users. */
export default async function globalTeardown(): Promise<void> {
  await globalThis.__magusServices?.stop();
  if (globalThis.__magusNatsAuthDir) rmSync(globalThis.__magusNatsAuthDir, { recursive: true, force: true });
}

/** Jest global teardown: stops the servers started by global-setup and removes their data. */
export default async function globalTeardown(): Promise<void> {
  await globalThis.__magusServices?.stop();
}

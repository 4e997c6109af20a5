/**
 * The real servers on loopback ports, for `magus dev`, the jest global setup and the benches
 * (ARCHITECTURE.md, "Testing"). The files, by kind:
 * - `services.ts` — {@link startServices}: the `Services` class, one method per service;
 * - `servers.ts` — each server's spec (arguments, data, readiness) and {@link writeKubeconfig};
 * - `supervisor.ts` — runs specs: retries on lost ports, restarts on the same ports, stops in order;
 * - `supervision.ts` — one process: {@link launch}, {@link waitReady}, {@link end};
 * - `ports.ts` — free ports, the band they come from, {@link listenOnPort};
 * - `binaries.ts` — where the binaries come from ({@link resolveBinaries}, {@link REPO_ROOT});
 * - `data-folder.ts` — the kept or throwaway data folder and `services.json`;
 * - `probes.ts`, `types.ts`.
 */
export { ALL_SERVICES, startServices } from './services';
export { writeKubeconfig } from './servers';
export { alive, end, launch, NotReady, waitReady, within, type Proc } from './supervision';
export { ephemeralRange, freePort, listenOnPort, portFree, serverPortBand } from './ports';
export { binariesBuilt, binaryPath, REPO_ROOT, resolveBinaries, type BinaryName } from './binaries';
export type { PortRequest, RunningServices, ServerName, ServiceEndpoints, ServiceName, StartOptions } from './types';

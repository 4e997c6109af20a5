/**
 * The demo hub (hub.ts): a Hugging Face-compatible hub and CDN on loopback that `magus dev`
 * serves its demo models from. `repos.ts` holds the repositories, `protocol.ts` the hub's routes,
 * errors and ranges. The tests' hub, which adds access control, renames, request records and
 * faults, is test/fixtures/hub.ts.
 */
import { startDemoHub } from './hub';

export { DemoHub, startDemoHub, type DemoHubOptions, type HubServer, type ServedBytes } from './hub';
export { resolveUrl } from './protocol';
export type { AddRepoInput, HubCommit, HubFile } from './repos';

/**
 * @deprecated {@link startDemoHub}'s former name, kept only for bench/pipeline.ts and
 * bench/controller.ts (another change holds bench/ open); remove once they call startDemoHub.
 */
export const startFixtureHub = startDemoHub;

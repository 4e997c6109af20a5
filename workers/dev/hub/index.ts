/**
 * The demo hub (hub.ts): a Hugging Face-compatible hub and CDN on loopback that `magus dev`
 * serves its demo models from. `repos.ts` holds the repositories, `protocol.ts` the hub's routes,
 * errors and ranges. The tests' hub, which adds access control, renames, request records and
 * faults, is test/fixtures/hub.ts.
 */
export { DemoHub, startDemoHub, type DemoHubOptions, type HubServer, type ServedBytes } from './hub';
export { resolveUrl } from './protocol';
export type { AddRepoInput, HubCommit, HubFile } from './repos';

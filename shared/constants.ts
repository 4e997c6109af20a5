/**
 * Names shared by workflows, activities, workers and the gateway. Workflow-safe: no imports.
 */

/** Temporal task queues (ARCHITECTURE.md, "Processes": control work vs. heavy download/convert work). */
export const TaskQueue = {
  control: 'magus-control',
  pipeline: 'magus-pipeline',
} as const;

/**
 * The heavy-work queue paired with a control queue: `magus-control` → `magus-pipeline`, and
 * `<prefix>-control` → `<prefix>-pipeline` (tests run isolated pairs of queues).
 */
export function pipelineQueueFor(controlQueue: string): string {
  return controlQueue.endsWith('-control') ? `${controlQueue.slice(0, -'-control'.length)}-pipeline` : `${controlQueue}-pipeline`;
}

/**
 * The task queue of the pool workflows (and their activities): a queue of their own, so a pool's
 * task never waits behind thousands of session tasks on the control queue.
 */
export function poolQueueFor(controlQueue: string): string {
  return controlQueue.endsWith('-control') ? `${controlQueue.slice(0, -'-control'.length)}-pools` : `${controlQueue}-pools`;
}

/**
 * The task queue of one worker's own runtime activities (`watchInstance`, `destroyInstance`):
 * a local runtime's instances are processes of the worker that created them, so only that
 * worker can answer for them.
 */
export function runtimeQueueFor(controlQueue: string, workerId: string): string {
  return `${controlQueue}.runtime.${workerId}`;
}

/** The worker id a runtime queue of `controlQueue` names, or null when it is not one of its. */
export function workerOfRuntimeQueue(controlQueue: string, runtimeQueue: string): string | null {
  const prefix = runtimeQueueFor(controlQueue, '');
  return runtimeQueue.startsWith(prefix) && runtimeQueue.length > prefix.length ? runtimeQueue.slice(prefix.length) : null;
}

/**
 * Search attributes magus sets on its workflows (Keyword; registered by the worker at start, or
 * by an operator on a Temporal that refuses it): `MagusKind` (model, pool, session), `MagusModel`
 * (`<namespace>/<name>`), `MagusPhase` (the workflow's phase, kept current).
 */
export const SearchAttribute = { kind: 'MagusKind', model: 'MagusModel', phase: 'MagusPhase' } as const;

/** What the Temporal UI's list and each workflow's page say it is (its static summary, set at start). */
export const WorkflowSummary = {
  model: (namespace: string, name: string, repo: string): string => `Model ${namespace}/${name}: ${repo} to S3, converted and sized`,
  pool: (namespace: string, model: string): string => `Instances serving model ${namespace}/${model}`,
  session: (namespace: string, model: string): string => `A conversation on model ${namespace}/${model}`,
} as const;

/**
 * The oldest release whose workflow histories this code replays (ARCHITECTURE.md, "Versioning"):
 * moved forward only when the patches that kept older executions replayable are removed. `magus
 * dev` stamps its state with it and ends, at start, the executions of a state stamped otherwise.
 */
export const WORKFLOWS_REPLAY_FROM = 'v0.1.0';

/** Custom resources: group and version of Model, Dllama and Session. */
export const CRD_GROUP = 'magus.dev';
export const CRD_VERSION = 'v1alpha1';

/** NATS names (ARCHITECTURE.md, "Storage" and "Data plane"). */
export const Nats = {
  requestStream: 'MAGUS_REQUESTS',
  requestSubjectPrefix: 'magus.req',
  responseSubjectPrefix: 'magus.res',
  /** `magus.cancel.<pool>.<instance>`: a request whose client went away (payload `{"id"}`). */
  cancelSubjectPrefix: 'magus.cancel',
  /** `magus.beat.<pool>.<instance>`: a bridge says, every 250 ms, that it is alive (no payload); gateways notice one that stops. */
  beatSubjectPrefix: 'magus.beat',
  /** `magus.gw.<replica>`: held by each gateway replica while it runs; another asks there whether it is gone (NATS's "no responders"). */
  gatewayReplicaSubjectPrefix: 'magus.gw',
  modelsBucket: 'magus_models',
  tokensBucket: 'magus_tokens',
  sessionsBucket: 'magus_sessions',
  /** Pool → its ready instances and their leases (written by the pool workflow, read by gateways). */
  poolsBucket: 'magus_pools',
  /** Stored responses of the Responses API (`resp_<id>` → its record), written and read by gateways only. */
  responsesBucket: 'magus_responses',
  /** Per-key limit state (`shared/limits.ts`): reservations, buckets and budget use, changed by compare-and-swap by gateways. */
  limitsBucket: 'magus_limits',
  /** The usage ledger (`shared/usage.ts`): one record per request id, created once by the bridge that ended it. */
  usageBucket: 'magus_usage',
  /** The ledger's sums per key and period as the controller last folded them (its checkpoint: controller/usage-status.ts). */
  usageSumsBucket: 'magus_usage_sums',
} as const;

/** Processes the `magus` CLI can run (ARCHITECTURE.md, "Processes"). */
export const MODES = ['dev', 'worker', 'controller', 'gateway', 'bridge', 'engine', 'fetch', 'convert', 'model', 'keys', 'usage', 'nats-auth'] as const;
export type Mode = (typeof MODES)[number];

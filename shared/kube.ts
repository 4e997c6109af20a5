/**
 * The custom resources of magus (`magus.dev/v1alpha1`): one TypeScript definition per kind,
 * shared by the controller, the activities that write status, and the tests. The CRD YAML in
 * `crds/` is the schema the API server enforces; these types mirror it. Workflow-safe: no
 * imports, no I/O.
 */
import type { EngineKind } from './engines';
import type { KeyLimits } from './limits';
import { shortDigest, type ArtifactFormat, type GgufChoice } from './model';
import type { SamplingDefaults } from './sampling';
import type { ArtifactWeights } from './weights';

export const Kind = { model: 'Model', dllama: 'Dllama', session: 'Session', apiKey: 'ApiKey' } as const;
export const Plural = { model: 'models', dllama: 'dllamas', session: 'sessions', apiKey: 'apikeys' } as const;

/** The finalizer the controller puts on Models and Dllamas: cleanup runs before they go. */
export const FINALIZER = 'magus.dev/cleanup';
/**
 * Secrets with this label (value `true`) are API tokens mirrored into `magus_tokens`, each a key
 * of identity `<namespace>/<secret name>` confined to its namespace's models — the way keys were
 * declared before `ApiKey`, kept until the next release.
 */
export const TOKEN_SECRET_LABEL = 'magus.dev/api-token';
/**
 * A Secret an `ApiKey` names carries this label (value: the ApiKey's name) to have a change of
 * its token applied at once; without it the change is seen at the next resync (5 minutes).
 */
export const API_KEY_SECRET_LABEL = 'magus.dev/api-key';
/** Field managers: the controller's spec-side writes (finalizers) and status writes. */
export const FieldManager = { controller: 'magus-controller', status: 'magus-status', usage: 'magus-usage' } as const;

/** A condition as Kubernetes API conventions define it. */
export interface Condition {
  type: string;
  status: 'True' | 'False' | 'Unknown';
  reason: string;
  message: string;
  observedGeneration: number;
  lastTransitionTime: string;
}

export interface ObjectMeta {
  name: string;
  namespace: string;
  uid: string;
  generation: number;
  resourceVersion?: string;
  deletionTimestamp?: string;
  finalizers?: string[];
  labels?: Record<string, string>;
  annotations?: Record<string, string>;
  creationTimestamp?: string;
}

// ── Model ────────────────────────────────────────────────────────────────────────────────────

export interface ModelResourceSpec {
  source: {
    repo: string;
    revision?: string;
    hubUrl?: string;
    /** A Secret in the Model's namespace holding the hub token under `key` (default `token`). */
    tokenSecretRef?: { name: string; key?: string };
    /** A GGUF repository's file to take (shared/model.ts `GgufChoice`). */
    gguf?: GgufChoice;
  };
  artifacts: { format: ArtifactFormat; weights: ArtifactWeights }[];
  contextLength?: number;
  /** Change it to run the pipeline again with the same spec (e.g. after access was granted). */
  rerun?: string;
  /** What happens to the model's S3 objects when the Model is deleted. */
  deletionPolicy?: 'Retain' | 'Delete';
  /** Sampling defaults of requests that set none, over the repository's (shared/sampling.ts). */
  sampling?: SamplingDefaults;
}

export const ModelCondition = { downloaded: 'Downloaded', converted: 'Converted', sized: 'Sized', ready: 'Ready' } as const;

/**
 * A `Dllama`'s conditions: `Ready` and `Degraded` from its pool (kube/status.ts `dllamaStatus`),
 * `Splittable` from the controller: whether its model runs on the nodes it asks for
 * (`dllamaSplitCondition`).
 */
export const DllamaCondition = { ready: 'Ready', degraded: 'Degraded', progressing: 'Progressing', splittable: 'Splittable' } as const;

export interface ModelResourceStatus {
  observedGeneration?: number;
  phase?: string;
  progress?: {
    files: { done: number; total: number };
    bytes: { done: number; total: number };
    tensors: { done: number; total: number };
    percent: number;
    etaSeconds?: number;
    /** Human text for the printer column, e.g. `42% 1.2 GB/2.9 GB`. */
    summary: string;
  };
  /** The commit the revision resolved to. */
  revision?: string;
  artifacts?: { format: ArtifactFormat; weights: ArtifactWeights; uri: string; bytes: number; sha256: string }[];
  /** Human text for the printer column: the artifacts' total size. */
  size?: string;
  sizing?: { format: ArtifactFormat; weights: ArtifactWeights; contextLength: number; nodes: number; rootBytes: number; workerBytes?: number }[];
  /** The distributed-llama node counts an artifact does not run on, and why (the memory plans' `refused`). */
  refusedTopologies?: { format: ArtifactFormat; weights: ArtifactWeights; nodes: number; reason: string }[];
  workflowId?: string;
  conditions?: Condition[];
}

export interface ModelResource {
  apiVersion: 'magus.dev/v1alpha1';
  kind: 'Model';
  metadata: ObjectMeta;
  spec: ModelResourceSpec;
  status?: ModelResourceStatus;
}

// ── Dllama (a serving pool) ────────────────────────────────────────────────────────────────

export interface DllamaResourceSpec {
  /** Name of a Model in the same namespace. */
  model: string;
  /** shared/engines.ts; the CRD's enum lists the same kinds (a test holds them equal). */
  engine: EngineKind;
  /** Nodes per instance = 2^nodesPower (the root plus 2^n − 1 workers); 0 for a single-process engine. */
  nodesPower: number;
  /** Fit-first: the runtime picks the smallest 2^n whose per-node memory plan fits the cluster's nodes (nodesPower ignored). */
  autoNodes?: boolean;
  /** Desired instances (the scale subresource's `.spec.replicas`); the pool keeps min ≤ n ≤ max. */
  replicas: number;
  minReplicas: number;
  maxReplicas: number;
  leasesPerInstance: number;
  /**
   * llama.cpp sequences each instance keeps beside its slots for answers continued there after
   * their engine died (default 1: shared/engine-slots.ts `RESUME_SLOTS`); each costs a slot's
   * KV cache. `leasesPerInstance / (replicas − 1)` lets every answer of a dead engine go on at once.
   */
  resumeSlots?: number;
  /** An instance without leases for this long is stopped (down to minReplicas), e.g. `10m`. */
  idleTimeout: string;
  /**
   * How long an instance being replaced (a new model revision) or stopped (its pod deleted,
   * evicted, its node drained) may finish the answers it has in flight, e.g. `5m` (default; at
   * most 1h). Its pods' termination grace period is this plus 15 s.
   */
  drainTimeout?: string;
  resources?: { requests?: Record<string, string>; limits?: Record<string, string> };
  nodeSelector?: Record<string, string>;
  tolerations?: Record<string, unknown>[];
  images?: { magus?: string; dllama?: string };
}

export interface DllamaResourceStatus {
  observedGeneration?: number;
  phase?: string;
  replicas?: number;
  readyReplicas?: number;
  nodesPerInstance?: number;
  /** The label selector of this pool's pods, as a string (the scale subresource reads it). */
  selector?: string;
  instances?: { id: string; phase: string; leases: number; restarts?: number; lastRestart?: string; revision?: string; retiring?: string; inFlight?: number }[];
  /** The pool's live conversations when counted for the pool as a whole (its instances' `leases` are then 0). */
  conversations?: number;
  lastError?: string;
  workflowId?: string;
  conditions?: Condition[];
}

export interface DllamaResource {
  apiVersion: 'magus.dev/v1alpha1';
  kind: 'Dllama';
  metadata: ObjectMeta;
  spec: DllamaResourceSpec;
  status?: DllamaResourceStatus;
}

// ── Session (read-only mirror) ────────────────────────────────────────────────────────────

export interface SessionResourceSpec {
  /** The pool (Dllama / model name) serving it; immutable. */
  pool: string;
  model: string;
}

export interface SessionResourceStatus {
  instance?: string;
  turns?: number;
  expiresAt?: string;
}

export interface SessionResource {
  apiVersion: 'magus.dev/v1alpha1';
  kind: 'Session';
  metadata: ObjectMeta;
  spec: SessionResourceSpec;
  status?: SessionResourceStatus;
}

// ── ApiKey ───────────────────────────────────────────────────────────────────────────────

export interface ApiKeyResourceSpec {
  /** The Secret of the key's namespace holding the token under `key` (default `token`). */
  secretRef: { name: string; key?: string };
  /** `name`, `*`, `namespace/name`, `namespace/*` (crds/apikey.yaml); absent: the namespace's models. */
  models?: string[];
  suspended?: boolean;
  /**
   * Per key, across its models and every gateway replica (shared/limits.ts): requests and tokens
   * per minute, requests in flight, a token budget per UTC day or month. Absent or empty: none.
   */
  limits?: KeyLimits;
}

export const ApiKeyCondition = { ready: 'Ready' } as const;
/** Why a key is not Ready (its condition's reason), or that it is. */
export const ApiKeyReason = {
  registered: 'Registered',
  suspended: 'Suspended',
  idConflict: 'IdConflict',
  secretMissing: 'SecretMissing',
  secretInvalid: 'SecretInvalid',
  modelNotShared: 'ModelNotShared',
  limitsInvalid: 'LimitsInvalid',
} as const;

export interface ApiKeyResourceStatus {
  observedGeneration?: number;
  /** The token id registered for it (the `<id>` of `mgs_<id>_<secret>`; not a secret). */
  tokenId?: string;
  /** The models it may use as the gateway applies them (`namespace/name`, `namespace/*`). */
  models?: string[];
  modelsSummary?: string;
  /** What it used in the current period, from the usage ledger (controller/usage-status.ts). */
  usage?: ApiKeyUsageStatus;
  conditions?: Condition[];
}

/** An ApiKey's `status.usage`. */
export interface ApiKeyUsageStatus {
  /** The UTC day or month counted: its budget's period, else the month. */
  period: string;
  requests: number;
  promptTokens: number;
  completionTokens: number;
  totalTokens: number;
  /** Its budget less what is used and reserved (with a budget only). */
  remainingTokens?: number;
  /** Bytes its stored responses hold against its storage quota (with a quota only). */
  storedBytes?: number;
  /** The same per model (those with the most tokens first, at most 64), and what a model's own budget has left. */
  models?: (Omit<ApiKeyUsageStatus, 'period' | 'lastUsed' | 'models' | 'storedBytes'> & { model: string })[];
  /** RFC 3339: when its last recorded request ended. */
  lastUsed?: string;
}

export interface ApiKeyResource {
  apiVersion: 'magus.dev/v1alpha1';
  kind: 'ApiKey';
  metadata: ObjectMeta;
  spec: ApiKeyResourceSpec;
  status?: ApiKeyResourceStatus;
}

/** Label on everything magus creates for a pool (the Dllama's scale selector matches it). */
export const POOL_LABEL = 'magus.dev/pool';

/** A `Dllama`'s drain when its spec sets none (its CRD's default, `5m`), and the longest it may ask for (its CRD's rule). */
export const DEFAULT_DRAIN_SECONDS = 300;
export const MAX_DRAIN_SECONDS = 3600;

/** A `Dllama`'s `drainTimeout` in ms; null when it sets none (or none that parses). */
export function drainTimeoutMsOf(spec: Pick<DllamaResourceSpec, 'drainTimeout'>): number | null {
  return spec.drainTimeout === undefined ? null : parseDuration(spec.drainTimeout);
}

/**
 * What shapes a `Dllama`'s instances: the fields its runtime builds an instance's pods from
 * (engine, topology, slots, resources, placement, images) as one short digest, not those that
 * only size or time the pool (replicas, idle and drain timeouts); and the resource and generation
 * it was read from, so that of two the newer is known. An instance started under another digest
 * is replaced like one of an older model revision (workflows/pool/state.ts, "Rollout"): a new
 * image rolls out without cutting an answer.
 */
export interface InstanceSpec {
  digest: string;
  uid: string;
  generation: number;
}

/** A `Dllama`'s {@link InstanceSpec}. Keys are sorted: equal specs digest equal whatever order they were written in. */
export function instanceSpecOf(d: Pick<DllamaResource, 'metadata' | 'spec'>): InstanceSpec {
  const sorted = (v: unknown): unknown =>
    Array.isArray(v)
      ? v.map(sorted)
      : v !== null && typeof v === 'object'
        ? Object.fromEntries(
            Object.keys(v)
              .sort()
              .map((k) => [k, sorted((v as Record<string, unknown>)[k])]),
          )
        : v;
  // A field left unset is left out of the JSON: adding one to this list keeps every digest made before.
  const { engine, nodesPower, autoNodes, leasesPerInstance, resumeSlots, resources, nodeSelector, tolerations, images } = d.spec;
  return {
    digest: shortDigest(
      JSON.stringify(sorted({ engine, nodesPower, autoNodes, leasesPerInstance, resumeSlots, resources, nodeSelector, tolerations, images })),
    ),
    uid: d.metadata.uid,
    generation: d.metadata.generation,
  };
}

/** Parses a duration like `90s`, `10m`, `1h30m` into ms; null when malformed. */
export function parseDuration(text: string): number | null {
  const m = /^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$/.exec(text);
  if (!m || text === '') return null;
  return (Number(m[1] ?? 0) * 3600 + Number(m[2] ?? 0) * 60 + Number(m[3] ?? 0)) * 1000;
}

/** Bytes of a Kubernetes memory quantity (`4Gi`, `512M`, `1e9`, `1048576`). */
export function parseMemory(q: string): number {
  const m = /^([0-9.]+(?:[eE][0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P|m)?$/.exec(q.trim());
  if (!m) return NaN;
  const unit = { Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, Pi: 2 ** 50, k: 1e3, M: 1e6, G: 1e9, T: 1e12, P: 1e15, m: 1e-3 }[m[2] ?? ''] ?? 1;
  return Number(m[1]) * unit;
}

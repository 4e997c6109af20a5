/**
 * The model pipeline's vocabulary, shared by the `modelPipeline` workflow, its activities, the
 * `magus model pull` CLI and (later) the `Model` custom resource, whose spec maps onto
 * {@link ModelSpec} one to one. Workflow-safe: no imports, no I/O.
 */

/** Output weight encodings. `q40`/`q80` are 32-value block formats (ggml Q4_0/Q8_0 layout). */
export type WeightsFormat = 'f32' | 'f16' | 'q80' | 'q40';
export const WEIGHTS_FORMATS: readonly WeightsFormat[] = ['q40', 'q80', 'f16', 'f32'];

/** Artifact file formats: GGUF for llama.cpp, `.m` + `.t` for distributed-llama. */
export type ArtifactFormat = 'gguf' | 'dllama';
export const ARTIFACT_FORMATS: readonly ArtifactFormat[] = ['gguf', 'dllama'];

/**
 * Where a secret (a Hugging Face token) lives. Workflows carry only this reference; activities
 * resolve it. `env`/`file` are for local mode, `secret` for Kubernetes.
 */
export type SecretRef =
  | { env: string }
  | { file: string }
  | { secret: { name: string; key: string; namespace?: string } };

export interface ModelSource {
  /** Hugging Face repository, `org/name`. */
  repo: string;
  /** Branch, tag or commit; default `main`. Resolved to a commit sha once per pipeline run. */
  revision?: string;
  /** Hub base URL (self-hosted mirrors exist); default the public hub. */
  hubUrl?: string;
  /** Token for gated/private repositories. */
  tokenRef?: SecretRef;
}

export interface ArtifactRequest {
  format: ArtifactFormat;
  weights: WeightsFormat;
}

/** What a user asks for: the `Model` CR's spec. */
export interface ModelSpec {
  source: ModelSource;
  artifacts: ArtifactRequest[];
  /** Context length the memory table is computed for; default the model's own maximum. */
  contextLength?: number;
}

/** Input of the `modelPipeline` workflow (id `model/<namespace>/<name>`). */
export interface ModelPipelineInput {
  namespace: string;
  name: string;
  spec: ModelSpec;
}

/** One file of a source repository at a pinned commit. */
export interface SourceFile {
  path: string;
  size: number;
  /** sha256 of the content for LFS files (hex); null for small git-stored files. */
  sha256: string | null;
}

/** A repository revision resolved to a commit. */
export interface ResolvedSource {
  repo: string;
  revision: string;
  sha: string;
  files: SourceFile[];
}

/** An object written to S3. */
export interface StoredObject {
  key: string;
  bytes: number;
  sha256: string;
}

export interface Artifact extends ArtifactRequest {
  converterVersion: string;
  files: StoredObject[];
}

/** Memory one node needs, in bytes (see activities/size for how each term is derived). */
export interface NodeMemory {
  weights: number;
  kvCache: number;
  buffers: number;
  total: number;
}

/** Memory plan for one artifact: llama.cpp on one node, or distributed-llama on 2^n nodes. */
export interface MemoryPlan {
  format: ArtifactFormat;
  weights: WeightsFormat;
  contextLength: number;
  /** Per topology: `nodes` = 1, 2, 4, 8, 16 (dllama; only those the model can be split into). */
  topologies: { nodes: number; root: NodeMemory; worker: NodeMemory | null }[];
}

/** The registry entry in the `magus_models` KV bucket, keyed by `<namespace>.<name>`. */
export interface ReadyModel {
  namespace: string;
  name: string;
  source: { repo: string; revision: string; sha: string };
  artifacts: Artifact[];
  memory: MemoryPlan[];
  readyAt: string;
}

/** S3 key of a source file: `sources/<repo>/<sha>/<path>` (content-addressed by commit). */
export function sourceKey(repo: string, sha: string, path: string): string {
  return `sources/${repo}/${sha}/${path}`;
}

/** S3 key prefix of an artifact: `artifacts/<repo>/<sha>/<format>-<weights>/<converter-version>/`. */
export function artifactPrefix(repo: string, sha: string, a: ArtifactRequest, converterVersion: string): string {
  return `artifacts/${repo}/${sha}/${a.format}-${a.weights}/${converterVersion}/`;
}

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
  /** Changing it runs the plan again with an otherwise equal spec (the `Model` CR's `rerun`). */
  rerun?: string;
}

/** Input of the `modelPipeline` workflow (id `model/<namespace>/<name>`). */
export interface ModelPipelineInput {
  namespace: string;
  name: string;
  spec: ModelSpec;
  /**
   * The `Model` resource it was started for (by the controller): its status is written back while
   * the pipeline runs. Absent for pipelines started by `magus model pull` or `magus dev`.
   */
  resource?: { uid: string; generation: number };
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

const REPO_ID = /^[A-Za-z0-9][A-Za-z0-9._-]{0,95}\/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$/;
const REVISION = /^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$/;

/** Everything wrong with a spec, as `field: problem` strings (empty when valid). */
export function validateModelSpec(spec: unknown): string[] {
  const errors: string[] = [];
  const s = spec as Partial<ModelSpec> | null;
  if (typeof s !== 'object' || s === null) return ['spec: must be an object'];
  const src = s.source;
  if (typeof src !== 'object' || src === null) {
    errors.push('source: required');
  } else {
    if (typeof src.repo !== 'string' || !REPO_ID.test(src.repo) || src.repo.includes('..')) errors.push(`source.repo: ${JSON.stringify(src.repo)} is not an org/name repository id`);
    if (src.revision !== undefined && (typeof src.revision !== 'string' || !REVISION.test(src.revision) || src.revision.includes('..'))) {
      errors.push(`source.revision: ${JSON.stringify(src.revision)} is not a branch, tag or commit`);
    }
    if (src.hubUrl !== undefined && (typeof src.hubUrl !== 'string' || !/^https?:\/\/[^\s/]+(\/[^\s]*)?$/.test(src.hubUrl))) errors.push(`source.hubUrl: ${JSON.stringify(src.hubUrl)} is not an http(s) URL`);
    const ref = src.tokenRef as Record<string, unknown> | undefined;
    if (ref !== undefined) {
      const keys = typeof ref === 'object' && ref !== null ? Object.keys(ref) : [];
      const ok =
        keys.length === 1 &&
        ((keys[0] === 'env' && typeof ref.env === 'string' && ref.env !== '') ||
          (keys[0] === 'file' && typeof ref.file === 'string' && ref.file !== '') ||
          (keys[0] === 'secret' && typeof ref.secret === 'object' && ref.secret !== null && typeof (ref.secret as Record<string, unknown>).name === 'string' && typeof (ref.secret as Record<string, unknown>).key === 'string'));
      if (!ok) errors.push('source.tokenRef: must be one of {env}, {file} or {secret: {name, key}} (a reference, never the token itself)');
    }
  }
  if (!Array.isArray(s.artifacts) || s.artifacts.length === 0) {
    errors.push('artifacts: at least one {format, weights} is required');
  } else {
    const seen = new Set<string>();
    s.artifacts.forEach((a: Partial<ArtifactRequest>, i) => {
      if (!ARTIFACT_FORMATS.includes(a?.format as ArtifactFormat)) errors.push(`artifacts[${i}].format: ${JSON.stringify(a?.format)} is not one of ${ARTIFACT_FORMATS.join(', ')}`);
      if (!WEIGHTS_FORMATS.includes(a?.weights as WeightsFormat)) errors.push(`artifacts[${i}].weights: ${JSON.stringify(a?.weights)} is not one of ${WEIGHTS_FORMATS.join(', ')}`);
      const id = `${a?.format}:${a?.weights}`;
      if (seen.has(id)) errors.push(`artifacts[${i}]: ${id} is listed twice`);
      seen.add(id);
    });
  }
  if (s.rerun !== undefined && (typeof s.rerun !== 'string' || s.rerun.length > 63)) errors.push('rerun: must be a string of at most 63 characters');
  if (s.contextLength !== undefined && (!Number.isInteger(s.contextLength) || s.contextLength < 16 || s.contextLength > 10_000_000)) {
    errors.push(`contextLength: ${JSON.stringify(s.contextLength)} must be a whole number from 16 to 10000000`);
  }
  return errors;
}

/** The repository files a conversion needs: configs, tokenizer files and safetensors weights. */
export function isNeededSourceFile(path: string): boolean {
  if (path.includes('/')) return false; // sub-folders hold other variants (onnx/, original/ …)
  return (
    path.endsWith('.safetensors') ||
    ['config.json', 'model.safetensors.index.json', 'tokenizer.json', 'tokenizer_config.json', 'generation_config.json', 'special_tokens_map.json', 'chat_template.jinja'].includes(path)
  );
}

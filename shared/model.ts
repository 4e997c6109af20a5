/**
 * The model pipeline's vocabulary, shared by the `modelPipeline` workflow, its activities, the
 * `magus model pull` CLI and (later) the `Model` custom resource, whose spec maps onto
 * {@link ModelSpec} one to one. The weights formats are declared in weights.ts. Workflow-safe: no
 * I/O.
 */
import { checkSampling, type SamplingDefaults } from './sampling';
import { WEIGHTS_FORMATS, weightsFormat, type ArtifactWeights, type WeightsFormat } from './weights';

/** Artifact file formats: GGUF for llama.cpp, `.m` + `.t` for distributed-llama. */
export type ArtifactFormat = 'gguf' | 'dllama';
export const ARTIFACT_FORMATS: readonly ArtifactFormat[] = ['gguf', 'dllama'];

/**
 * Where a secret (a Hugging Face token) lives. Workflows carry only this reference; activities
 * resolve it. `env`/`file` are for local mode, `secret` for Kubernetes.
 */
export type SecretRef = { env: string } | { file: string } | { secret: { name: string; key: string; namespace?: string } };

export interface ModelSource {
  /** Hugging Face repository, `org/name`. */
  repo: string;
  /** Branch, tag or commit; default `main`. Resolved to a commit sha once per pipeline run. */
  revision?: string;
  /** Hub base URL (self-hosted mirrors exist); default the public hub. */
  hubUrl?: string;
  /** Token for gated/private repositories. */
  tokenRef?: SecretRef;
  /**
   * A GGUF repository: which file to take (exactly one of the two). Without it the repository
   * must hold safetensors weights and a `config.json`.
   */
  gguf?: GgufChoice;
}

/**
 * One GGUF of a repository that publishes several (one per quantization): `file`, a glob on the
 * file's path (`*` and `?`; matched against the name alone when it has no `/`), or
 * `quantization`, the type as file names spell it (`Q4_K_M`, case-insensitive). It must match
 * exactly one file, or the parts of one split GGUF (`…-00001-of-00003.gguf`), which are taken whole.
 */
export interface GgufChoice {
  file?: string;
  quantization?: string;
}

export interface ArtifactRequest {
  format: ArtifactFormat;
  weights: ArtifactWeights;
}

/** What a user asks for: the `Model` CR's spec. */
export interface ModelSpec {
  source: ModelSource;
  artifacts: ArtifactRequest[];
  /** Context length the memory table is computed for; default the model's own maximum. */
  contextLength?: number;
  /** Changing it runs the plan again with an otherwise equal spec (the `Model` CR's `rerun`). */
  rerun?: string;
  /**
   * Sampling defaults of requests that set none, over those the repository publishes (shared/sampling.ts);
   * published with the model (`ReadyModel.sampling`).
   */
  sampling?: SamplingDefaults;
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
  /** A split GGUF's parts in order (llama.cpp opens the first and finds the others beside it). */
  files: StoredObject[];
  /** `gguf:source`: the file's own type as llama.cpp names it (`general.file_type`), e.g. `Q4_K_M`. */
  sourceType?: string;
  /**
   * The sampling defaults its source publishes (`generation_config.json`, or a GGUF's
   * `general.sampling.*`; shared/sampling.ts), absent when it publishes none. Artifacts of one
   * model share their source, so they agree.
   */
  sampling?: SamplingDefaults;
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
  weights: ArtifactWeights;
  contextLength: number;
  /** Per topology: `nodes` = 1, 2, 4, 8, 16 (dllama; only those the model runs on). */
  topologies: { nodes: number; root: NodeMemory; worker: NodeMemory | null }[];
  /**
   * distributed-llama: the node counts of 1, 2, 4, 8, 16 it does not run the artifact on, each
   * with the reason, naming the dimension or the weights (shared/dllama-topology.ts). Absent
   * from GGUF plans and from plans published before it was recorded.
   */
  refused?: { nodes: number; reason: string }[];
}

/** The registry entry in the `magus_models` KV bucket, keyed by `<namespace>.<name>`. */
export interface ReadyModel {
  namespace: string;
  name: string;
  source: { repo: string; revision: string; sha: string };
  artifacts: Artifact[];
  memory: MemoryPlan[];
  readyAt: string;
  /** The `Model`'s `spec.sampling`: over the repository's defaults (`Artifact.sampling`) in a request that sets none (shared/sampling.ts `modelSampling`). */
  sampling?: SamplingDefaults;
}

/**
 * What an instance of the model serves, as one short string: the commit and every artifact's
 * files (by digest) and converter. Two publications of the same weights (a pipeline run again,
 * sampling defaults changed) have the same revision; new weights, another converter or another
 * artifact list have another, and the model's pool rolls its instances over to it
 * (workflows/pool/state.ts, "Rollout"). A {@link shortDigest}.
 */
export function modelRevision(ready: Pick<ReadyModel, 'source' | 'artifacts'>): string {
  return shortDigest(
    [ready.source.sha, ...ready.artifacts.map((a) => `${a.format}-${a.weights}/${a.converterVersion}:${a.files.map((f) => f.sha256).join(',')}`).sort()].join(
      '\n',
    ),
  );
}

/**
 * 16 hex digits of two FNV-1a hashes of `text`: workflow-safe (no Node builtin), and meant to
 * tell versions apart, not to resist forgery.
 */
export function shortDigest(text: string): string {
  const fnv = (seed: number): string => {
    let h = seed >>> 0;
    for (let i = 0; i < text.length; i++) {
      h ^= text.charCodeAt(i);
      h = Math.imul(h, 0x01000193) >>> 0;
    }
    return h.toString(16).padStart(8, '0');
  };
  return fnv(0x811c9dc5) + fnv(0x9747b28c);
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
    if (typeof src.repo !== 'string' || !REPO_ID.test(src.repo) || src.repo.includes('..'))
      errors.push(`source.repo: ${JSON.stringify(src.repo)} is not an org/name repository id`);
    if (src.revision !== undefined && (typeof src.revision !== 'string' || !REVISION.test(src.revision) || src.revision.includes('..'))) {
      errors.push(`source.revision: ${JSON.stringify(src.revision)} is not a branch, tag or commit`);
    }
    // Never echoed when it holds a user name or password: that would put a secret in the status.
    if (typeof src.hubUrl === 'string' && /^https?:\/\/[^/]*@/.test(src.hubUrl))
      errors.push('source.hubUrl holds a user name or password: give the hub token as a Secret (tokenSecretRef), never in the URL');
    else if (src.hubUrl !== undefined && (typeof src.hubUrl !== 'string' || !/^https?:\/\/[^\s/]+(\/[^\s]*)?$/.test(src.hubUrl)))
      errors.push(`source.hubUrl: ${JSON.stringify(src.hubUrl)} is not an http(s) URL`);
    const ref = src.tokenRef as Record<string, unknown> | undefined;
    if (ref !== undefined) {
      const keys = typeof ref === 'object' && ref !== null ? Object.keys(ref) : [];
      const ok =
        keys.length === 1 &&
        ((keys[0] === 'env' && typeof ref.env === 'string' && ref.env !== '') ||
          (keys[0] === 'file' && typeof ref.file === 'string' && ref.file !== '') ||
          (keys[0] === 'secret' &&
            typeof ref.secret === 'object' &&
            ref.secret !== null &&
            typeof (ref.secret as Record<string, unknown>).name === 'string' &&
            typeof (ref.secret as Record<string, unknown>).key === 'string'));
      if (!ok) errors.push('source.tokenRef: must be one of {env}, {file} or {secret: {name, key}} (a reference, never the token itself)');
    }
    if (src.gguf !== undefined) errors.push(...ggufChoiceErrors(src.gguf));
  }
  if (!Array.isArray(s.artifacts) || s.artifacts.length === 0) {
    errors.push('artifacts: at least one {format, weights} is required');
  } else {
    const seen = new Set<string>();
    s.artifacts.forEach((a: Partial<ArtifactRequest>, i) => {
      if (!ARTIFACT_FORMATS.includes(a?.format as ArtifactFormat))
        errors.push(`artifacts[${i}].format: ${JSON.stringify(a?.format)} is not one of ${ARTIFACT_FORMATS.join(', ')}`);
      if (a?.weights === 'source') {
        if (a.format !== 'gguf')
          errors.push(`artifacts[${i}]: ${a.format}:source does not exist; a distributed-llama artifact is converted to one of ${WEIGHTS_FORMATS.join(', ')}`);
        else if (src?.gguf === undefined)
          errors.push(
            `artifacts[${i}]: gguf:source takes a GGUF source's file as it is; this source has no source.gguf (ask for gguf:${WEIGHTS_FORMATS.join(', gguf:')})`,
          );
      } else if (!WEIGHTS_FORMATS.includes(a?.weights as WeightsFormat)) {
        errors.push(
          `artifacts[${i}].weights: ${JSON.stringify(a?.weights)} is not one of ${WEIGHTS_FORMATS.join(', ')}${src?.gguf !== undefined ? ' or source' : ''}`,
        );
      } else if (a?.format === 'dllama' && weightsFormat(a.weights as WeightsFormat).dllamaBuffer === null) {
        errors.push(
          `artifacts[${i}]: distributed-llama runs only q40 and f32 weights on a CPU (its matmuls stop at ${a.weights as string}): ask for dllama:q40 or dllama:f32`,
        );
      } else if (a?.format === 'gguf' && src?.gguf !== undefined) {
        errors.push(
          `artifacts[${i}]: a GGUF source is served as it is published: ask for gguf:source (re-quantizing a GGUF is not supported; dllama:q40 and dllama:f32 are)`,
        );
      }
      const id = `${a?.format}:${a?.weights}`;
      if (seen.has(id)) errors.push(`artifacts[${i}]: ${id} is listed twice`);
      seen.add(id);
    });
  }
  if (s.rerun !== undefined && (typeof s.rerun !== 'string' || s.rerun.length > 63)) errors.push('rerun: must be a string of at most 63 characters');
  if (s.contextLength !== undefined && (!Number.isInteger(s.contextLength) || s.contextLength < 16 || s.contextLength > 10_000_000)) {
    errors.push(`contextLength: ${JSON.stringify(s.contextLength)} must be a whole number from 16 to 10000000`);
  }
  errors.push(...checkSampling(s.sampling).problems);
  return errors;
}

/** The repository files a conversion needs: configs, tokenizer files and safetensors weights. */
export function isNeededSourceFile(path: string): boolean {
  if (path.includes('/')) return false; // sub-folders hold other variants (onnx/, original/ …)
  return (
    path.endsWith('.safetensors') ||
    [
      'config.json',
      'model.safetensors.index.json',
      'tokenizer.json',
      'tokenizer_config.json',
      'generation_config.json',
      'special_tokens_map.json',
      'chat_template.jinja',
    ].includes(path)
  );
}

/** The longest `source.gguf.file` glob accepted. */
const GGUF_GLOB_MAX = 200;
const GGUF_GLOB = /^[A-Za-z0-9._*?/-]+$/;
const GGUF_QUANTIZATION = /^[A-Za-z0-9_]{1,32}$/;

function ggufChoiceErrors(choice: unknown): string[] {
  if (typeof choice !== 'object' || choice === null || Array.isArray(choice)) return ['source.gguf: must be {file} or {quantization}'];
  const c = choice as Record<string, unknown>;
  const set = (['file', 'quantization'] as const).filter((k) => c[k] !== undefined);
  if (set.length !== 1)
    return [
      `source.gguf: name exactly one of file (a glob such as "*Q4_K_M.gguf") or quantization (such as "Q4_K_M"), not ${set.length === 0 ? 'neither' : 'both'}`,
    ];
  const others = Object.keys(c).filter((k) => k !== 'file' && k !== 'quantization');
  if (others.length > 0) return [`source.gguf: unknown field ${others.join(', ')}`];
  if (set[0] === 'file') {
    const f = c.file;
    if (typeof f !== 'string' || f === '' || f.length > GGUF_GLOB_MAX || !GGUF_GLOB.test(f) || f.includes('..') || f.startsWith('/')) {
      return [
        `source.gguf.file: ${JSON.stringify(f)} is not a file glob (letters, digits, . _ - / and the wildcards * ?; at most ${GGUF_GLOB_MAX} characters)`,
      ];
    }
    if (/^\**$/.test(f.replace(/\.gguf$/i, ''))) return [`source.gguf.file: ${JSON.stringify(f)} would match any GGUF; name the file (e.g. "*Q4_K_M.gguf")`];
  } else if (typeof c.quantization !== 'string' || !GGUF_QUANTIZATION.test(c.quantization)) {
    return [`source.gguf.quantization: ${JSON.stringify(c.quantization)} is not a quantization type such as Q4_K_M, Q8_0 or F16`];
  }
  return [];
}

/** A split GGUF's part: `<stem>-00001-of-00003.gguf`. */
const GGUF_SPLIT = /^(.*)-(\d{5})-of-(\d{5})\.gguf$/i;

/**
 * The files of a GGUF repository that `choice` takes: one file, or every part of one split GGUF
 * in order; or why none can be taken (nothing matches: the GGUF files that exist are named; more
 * than one: the matches are named; a split GGUF with a part missing).
 */
export function selectGgufFiles(files: readonly SourceFile[], choice: GgufChoice): { files: SourceFile[] } | { error: string } {
  const ggufs = files.filter((f) => /\.gguf$/i.test(f.path));
  const name = (p: string) => p.slice(p.lastIndexOf('/') + 1);
  let matches: SourceFile[];
  let wanted: string;
  if (choice.file !== undefined) {
    const glob = choice.file;
    const re = new RegExp(
      `^${glob
        .replace(/[.+^${}()|[\]\\]/g, '\\$&')
        .replace(/\*/g, '[^/]*')
        .replace(/\?/g, '[^/]')}$`,
      'i',
    );
    matches = ggufs.filter((f) => re.test(glob.includes('/') ? f.path : name(f.path)));
    wanted = `file ${JSON.stringify(glob)}`;
  } else {
    const q = (choice.quantization ?? '').toLowerCase();
    matches = ggufs.filter((f) => boundaryMatch(name(f.path), q));
    wanted = `quantization ${choice.quantization ?? ''}`;
  }
  const list = (fs: readonly SourceFile[], max = 20) =>
    `${fs
      .slice(0, max)
      .map((f) => f.path)
      .join(', ')}${fs.length > max ? ` and ${fs.length - max} more` : ''}`;
  if (matches.length === 0) {
    return {
      error:
        ggufs.length === 0
          ? `source.gguf: ${wanted} matches nothing: the repository has no .gguf file`
          : `source.gguf: ${wanted} matches none of the repository's GGUF files: ${list(ggufs)}`,
    };
  }
  // Matches that are parts of one split GGUF stand for all of its parts.
  const splits = new Set(
    matches.map((f) => {
      const m = GGUF_SPLIT.exec(f.path);
      return m ? `${m[1]!.toLowerCase()}|${m[3]}` : `file|${f.path}`;
    }),
  );
  if (splits.size > 1) return { error: `source.gguf: ${wanted} matches ${matches.length} files, not one: ${list(matches)}; name one of them` };
  const m = GGUF_SPLIT.exec(matches[0]!.path);
  if (!m) return { files: [matches[0]!] };
  const count = Number(m[3]);
  const parts: SourceFile[] = [];
  for (let k = 1; k <= count; k++) {
    const path = `${m[1]}-${String(k).padStart(5, '0')}-of-${m[3]}.gguf`;
    const part = ggufs.find((f) => f.path.toLowerCase() === path.toLowerCase());
    if (!part) return { error: `source.gguf: ${matches[0]!.path} is part of a split GGUF of ${count} parts, but part ${k} (${path}) is not in the repository` };
    parts.push(part);
  }
  return { files: parts };
}

/** Whether `q` appears in a file name as a whole word: after `-`, `.`, `_` or the start, before `-`, `.` or the end (`Q4_K` is not `Q4_K_M`). */
function boundaryMatch(fileName: string, q: string): boolean {
  const stem = fileName.toLowerCase().replace(/\.gguf$/, '');
  const escaped = q.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
  return new RegExp(`(^|[-._])${escaped}($|[-.])`).test(stem);
}

/**
 * The converter's {@link ModelSpec} from a GGUF file's metadata and tensor table, so that a model
 * published as GGUF can be sized and converted like a Hugging Face checkpoint.
 *
 * GGUF keeps what config.json says under `<arch>.*` keys (llama.cpp's `LLM_KV_*`), with floats
 * stored as float32; tensor names follow llama.cpp (`blk.N.attn_q.weight`) and shapes are in ggml
 * order (innermost dimension first). The tensor table is checked against the plan magus itself
 * writes ({@link planTensors} `gguf`): every tensor the architecture needs, with its shape, and
 * nothing else, because an extra tensor (a bias, a per-layer scale) means math the converter
 * would silently drop.
 *
 * Pure code: no I/O.
 */
import { type ArchName, type Llama3RopeScaling, llama3RopeFactors, type ModelSpec, planTensors } from './arch';
import { ConvertError } from './errors';
import type { GgufValue } from './gguf';
import type { GgufFile } from './gguf-reader';

const ARCHS: readonly ArchName[] = ['llama', 'qwen3'];

/** The runtime's rope theta when a model states none (llama.cpp and distributed-llama agree). */
const DEFAULT_ROPE_THETA = 10000;

/**
 * `<arch>.*` keys that change the forward pass, with the values that leave it the plain
 * Llama/Qwen3 math (the GGUF counterpart of arch.ts `DANGEROUS_CONFIG_KEYS`).
 */
const DANGEROUS_KEYS: Readonly<Record<string, (v: GgufValue) => boolean>> = {
  expert_count: (v) => isZero(v),
  expert_used_count: (v) => isZero(v),
  'attention.sliding_window': (v) => isZero(v),
  'attention.clamp_kqv': () => false,
  'attention.max_alibi_bias': (v) => isZero(v),
  'attention.causal': (v) => v.type === 'bool' && v.value,
  logit_scale: (v) => isNumber(v) && v.value === 1,
  attn_logit_softcapping: (v) => isZero(v),
  final_logit_softcapping: (v) => isZero(v),
  embedding_scale: (v) => isNumber(v) && v.value === 1,
  residual_scale: (v) => isNumber(v) && v.value === 1,
  attention_scale: () => false,
  'rope.scaling.factor': (v) => isNumber(v) && (v.value === 1 || v.value === 0),
  'rope.scaling.type': (v) => v.type === 'string' && v.value === 'none',
  'rope.scaling.attn_factor': (v) => isNumber(v) && v.value === 1,
  'attention.layer_norm_epsilon': () => false,
  'attention.q_lora_rank': () => false,
  'attention.kv_lora_rank': () => false,
  'rope.freq_scale': (v) => isNumber(v) && v.value === 1,
};

function isNumber(v: GgufValue): v is GgufValue & { value: number } {
  return typeof v.value === 'number';
}

function isZero(v: GgufValue): boolean {
  return (isNumber(v) && v.value === 0) || (typeof v.value === 'bigint' && v.value === 0n);
}

function show(v: GgufValue): string {
  if (v.type === 'array') return `[${v.itemType} array of ${v.value.length}]`;
  return typeof v.value === 'bigint' ? v.value.toString() : JSON.stringify(v.value);
}

function unsupported(key: string, why: string): ConvertError {
  return new ConvertError('UnsupportedConfig', `GGUF ${key}${why.startsWith('=') ? '' : ' '}${why}`);
}

/**
 * The shortest decimal that rounds to the same float32: GGUF stores `rms_norm_eps` 1e-5 as
 * 9.99999974738e-06, and distributed-llama's header (and every comparison with a config.json
 * spec) needs the value the model author wrote.
 */
export function decimalOfFloat32(v: number): number {
  for (let digits = 1; digits <= 9; digits++) {
    const candidate = Number(v.toPrecision(digits));
    if (Math.fround(candidate) === v) return candidate;
  }
  return v;
}

/** Reads typed `<arch>.*` metadata; every accessor refuses a value of the wrong type. */
function metadataReader(file: GgufFile, arch: string) {
  const get = (key: string): GgufValue | undefined => file.metadata.get(`${arch}.${key}`);
  const integer = (key: string, fallback?: number): number => {
    const v = get(key);
    if (v === undefined) {
      if (fallback !== undefined) return fallback;
      throw unsupported(`${arch}.${key}`, 'is missing');
    }
    const n = typeof v.value === 'bigint' ? Number(v.value) : v.value;
    if (v.type === 'array') throw unsupported(`${arch}.${key}`, `is a per-layer ${show(v)}; only one value for every layer is supported`);
    if (typeof n !== 'number' || !Number.isSafeInteger(n) || n <= 0 || v.type.startsWith('float')) {
      throw unsupported(`${arch}.${key}`, `=${show(v)} is not a positive integer`);
    }
    return n;
  };
  const float = (key: string): number | undefined => {
    const v = get(key);
    if (v === undefined) return undefined;
    if (!isNumber(v) || !Number.isFinite(v.value) || v.value <= 0) throw unsupported(`${arch}.${key}`, `=${show(v)} is not a positive number`);
    return v.type === 'float32' ? decimalOfFloat32(v.value) : v.value;
  };
  return { get, integer, float };
}

/** A token id key (`tokenizer.ggml.bos_token_id`, …), or null when absent. */
export function ggufTokenId(file: GgufFile, key: string): number | null {
  const v = file.metadata.get(key);
  if (v === undefined) return null;
  const n = typeof v.value === 'bigint' ? Number(v.value) : v.value;
  if (typeof n !== 'number' || !Number.isSafeInteger(n) || n < 0 || v.type.startsWith('float')) throw unsupported(key, `=${show(v)} is not a token id`);
  return n;
}

/**
 * Builds the converter's model spec from a GGUF header (see the module comment).
 *
 * `vocab` is the embedding's row count; `tieWordEmbeddings` is the absence of `output.weight`;
 * BOS/EOS come from `tokenizer.ggml.*` (EOS followed by EOT/EOM when the file names them, the
 * ids a chat turn may end with). `explicit` marks what distributed-llama must be told: a rope
 * theta other than its default (the GGUF always states one).
 *
 * Llama 3 rope scaling has no metadata in a GGUF: llama.cpp's converter keeps only its per-pair
 * factors, as the tensor `rope_freqs.weight`. Given those values (`options.ropeFreqs`, read by
 * gguf-dequant.ts `ggufRopeFreqs`), the scaling parameters are recovered
 * ({@link llama3ScalingFromFactors}); without them such a file is refused.
 * @throws ConvertError `UnsupportedArchitecture` naming any architecture but llama and qwen3;
 *   `UnsupportedConfig` for missing or malformed hyper-parameters, rope factors that are absent
 *   or match no Llama 3 scaling, keys that change the math, and unexpected tensors;
 *   `MissingTensor`/`ShapeMismatch` for the tensors the architecture needs.
 */
export function specFromGguf(file: GgufFile, options: { ropeFreqs?: Float32Array } = {}): ModelSpec {
  const archValue = file.metadata.get('general.architecture');
  if (archValue === undefined) throw unsupported('general.architecture', 'is missing');
  if (archValue.type !== 'string') throw unsupported('general.architecture', `=${show(archValue)} is not a string`);
  const arch = archValue.value;
  if (!(ARCHS as readonly string[]).includes(arch)) {
    throw new ConvertError('UnsupportedArchitecture', `GGUF architecture '${arch}' is not supported (supported: ${ARCHS.join(', ')})`);
  }
  const archName = arch as ArchName;
  const m = metadataReader(file, arch);
  for (const [key, implemented] of Object.entries(DANGEROUS_KEYS)) {
    const v = m.get(key);
    if (v !== undefined && !implemented(v)) throw unsupported(`${arch}.${key}`, `=${show(v)} is not supported`);
  }

  const hidden = m.integer('embedding_length');
  const heads = m.integer('attention.head_count');
  const kvHeads = m.integer('attention.head_count_kv', heads);
  if (heads % kvHeads !== 0) throw unsupported(`${arch}.attention.head_count_kv`, `=${kvHeads} does not divide head_count=${heads}`);
  const defaultHeadDim = hidden % heads === 0 ? hidden / heads : undefined;
  const headDim = m.integer('attention.key_length', defaultHeadDim);
  if (m.integer('attention.value_length', headDim) !== headDim) throw unsupported(`${arch}.attention.value_length`, `differs from key_length=${headDim}`);
  if (headDim % 2 !== 0) throw unsupported(`${arch}.attention.key_length`, `=${headDim} is not even`);
  if (m.integer('rope.dimension_count', headDim) !== headDim) {
    throw unsupported(`${arch}.rope.dimension_count`, `differs from the head size ${headDim}: partial rotary embeddings are not supported`);
  }

  const embedding = file.tensors.find((t) => t.name === 'token_embd.weight');
  if (!embedding) throw new ConvertError('MissingTensor', 'GGUF tensor token_embd.weight is missing');
  const vocab = embedding.dims[1] ?? 1;
  const statedVocab = m.get('vocab_size') === undefined ? vocab : m.integer('vocab_size');
  if (statedVocab !== vocab) throw unsupported(`${arch}.vocab_size`, `=${statedVocab} differs from token_embd.weight's ${vocab} rows`);

  const ropeTheta = m.float('rope.freq_base') ?? DEFAULT_ROPE_THETA;
  const eps = m.float('attention.layer_norm_rms_epsilon');
  if (eps === undefined) throw unsupported(`${arch}.attention.layer_norm_rms_epsilon`, 'is missing');
  const eosTokenIds = ['eos', 'eot', 'eom'].map((k) => ggufTokenId(file, `tokenizer.ggml.${k}_token_id`)).filter((id): id is number => id !== null);

  const spec: ModelSpec = {
    arch: archName,
    hidden,
    intermediate: m.integer('feed_forward_length'),
    layers: m.integer('block_count'),
    heads,
    kvHeads,
    headDim,
    vocab,
    ctx: m.integer('context_length'),
    rmsNormEps: eps,
    ropeTheta,
    ropeScaling: null,
    tieWordEmbeddings: !file.tensors.some((t) => t.name === 'output.weight'),
    bosTokenId: ggufTokenId(file, 'tokenizer.ggml.bos_token_id'),
    eosTokenIds: [...new Set(eosTokenIds)],
    hiddenAct: 'silu',
    explicit: { headDim: false, ropeTheta: ropeTheta !== DEFAULT_ROPE_THETA },
  };
  if (file.tensors.some((t) => t.name === ROPE_FREQS)) {
    if (archName !== 'llama') throw unsupported(`tensor ${ROPE_FREQS}`, `(rope scaling) is not supported for ${archName}`);
    if (!options.ropeFreqs) throw unsupported(`tensor ${ROPE_FREQS}`, '(Llama 3 rope scaling) is present: its values are needed to read the scaling');
    spec.ropeScaling = llama3ScalingFromFactors(spec, options.ropeFreqs);
  }
  checkTensorTable(file, spec);
  return spec;
}

const ROPE_FREQS = 'rope_freqs.weight';

/**
 * The Llama 3 rope scaling whose factors (computed as arch.ts `llama3RopeFactors`, in float32)
 * are exactly `factors`. `factor` is the largest factor; the others are searched over integers
 * (distributed-llama's header stores them as integers): low from 1, high above it, and the
 * original context a power of two. Scaling all three by the same k gives the same factors, so
 * the first match (the smallest low, 1 for every published Llama 3.x) stands for them all.
 * @throws ConvertError `UnsupportedConfig` when no such scaling reproduces the factors
 */
export function llama3ScalingFromFactors(spec: ModelSpec, factors: Float32Array): Llama3RopeScaling {
  if (factors.length !== spec.headDim / 2) throw unsupported(`tensor ${ROPE_FREQS}`, `has ${factors.length} values, not ${spec.headDim / 2}`);
  const factor = factors.reduce((a, b) => Math.max(a, b), 0);
  const matches = (s: Llama3RopeScaling): boolean => llama3RopeFactors({ ...spec, ropeScaling: s }).every((f, i) => f === factors[i]);
  if (Number.isInteger(factor) && factor > 0) {
    for (let lowFreqFactor = 1; lowFreqFactor <= 16; lowFreqFactor++) {
      for (let highFreqFactor = lowFreqFactor + 1; highFreqFactor <= 64; highFreqFactor++) {
        for (let bits = 0; bits <= 20; bits++) {
          const candidate: Llama3RopeScaling = { type: 'llama3', factor, lowFreqFactor, highFreqFactor, originalMaxPositionEmbeddings: 2 ** bits };
          if (matches(candidate)) return candidate;
        }
      }
    }
  }
  throw unsupported(
    `tensor ${ROPE_FREQS}`,
    'holds rope factors that match no Llama 3 scaling with integer parameters: convert the model from its safetensors repository instead',
  );
}

/** Every tensor the architecture needs, with the planned shape, and no other. */
function checkTensorTable(file: GgufFile, spec: ModelSpec): void {
  const present = new Map(file.tensors.map((t) => [t.name, t]));
  // Whether output.weight is expected was settled by the spec (tied when absent).
  const expected = planTensors(spec, 'gguf', 'f32', () => true);
  for (const t of expected) {
    const found = present.get(t.name);
    if (!found) throw new ConvertError('MissingTensor', `GGUF tensor ${t.name} is missing`);
    if (found.dims.length !== t.shape.length || found.dims.some((d, i) => d !== t.shape[i])) {
      throw new ConvertError('ShapeMismatch', `GGUF tensor ${t.name} has shape [${found.dims.join(', ')}], expected [${t.shape.join(', ')}]`);
    }
    present.delete(t.name);
  }
  const extra = [...present.keys()];
  if (extra.length > 0) {
    throw new ConvertError(
      'UnsupportedConfig',
      `GGUF tensor ${extra[0]} is not part of a plain ${spec.arch} model${extra.length > 1 ? ` (nor ${extra.length - 1} more)` : ''}; it is not supported`,
    );
  }
}

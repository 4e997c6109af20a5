/**
 * Model architecture: a validated {@link ModelSpec} from Hugging Face `config.json`, and the ordered
 * tensor plans of the two output formats (GGUF for llama.cpp, `.m` for distributed-llama).
 *
 * Config policy. A config key is in one of three groups:
 * - keys we read (structure, rope, epsilon, tokens ids);
 * - {@link DANGEROUS_CONFIG_KEYS}: keys that change the forward pass. Each has a predicate saying
 *   which values are still the plain Llama/Qwen3 math (e.g. `attention_bias: false`); any other
 *   value is rejected with `ConvertError('UnsupportedConfig')` naming the key and value, because a
 *   converted model that silently computes something else is worse than no model;
 * - {@link HARMLESS_CONFIG_KEYS}: bookkeeping, training-only and generation defaults, ignored.
 * Keys in none of the groups are ignored too (new transformers releases add harmless keys all the
 * time) but {@link unknownConfigKeys} lists them so the caller can log them.
 *
 * Pure code: no I/O.
 */
import { ConvertError } from './errors';
import { encodedSize } from './quant';
import type { WeightsFormat } from './types';
import { isBlockQuantized, weightsFormat, WEIGHTS_FORMATS } from '../shared/weights';

/** Architectures we convert, named as in `config.json` `model_type` (and in GGUF). */
export type ArchName = 'llama' | 'qwen3';

/** Llama 3.x frequency-dependent rope scaling (`rope_scaling.rope_type = "llama3"`). */
export interface Llama3RopeScaling {
  type: 'llama3';
  factor: number;
  lowFreqFactor: number;
  highFreqFactor: number;
  originalMaxPositionEmbeddings: number;
}

/** The validated shape and hyper-parameters of a model. */
export interface ModelSpec {
  arch: ArchName;
  /** `hidden_size` */
  hidden: number;
  /** `intermediate_size` */
  intermediate: number;
  /** `num_hidden_layers` */
  layers: number;
  /** `num_attention_heads` */
  heads: number;
  /** `num_key_value_heads` (defaults to `heads`) */
  kvHeads: number;
  /** `head_dim` (defaults: llama `hidden / heads`, qwen3 128 as in transformers' Qwen3Config) */
  headDim: number;
  /** `vocab_size`: rows of the embedding and output matrices. */
  vocab: number;
  /** `max_position_embeddings` */
  ctx: number;
  rmsNormEps: number;
  ropeTheta: number;
  ropeScaling: Llama3RopeScaling | null;
  tieWordEmbeddings: boolean;
  bosTokenId: number | null;
  eosTokenIds: number[];
  hiddenAct: 'silu';
  /**
   * Whether an optional value was present in config.json. distributed-llama's converter writes
   * `head_dim` and `rope_theta` only when present, and we reproduce its header byte for byte.
   */
  explicit: { headDim: boolean; ropeTheta: boolean };
}

type Json = Record<string, unknown>;

/** Keys that change the math; the predicate returns true for values we do implement. */
export const DANGEROUS_CONFIG_KEYS: Readonly<Record<string, (value: unknown, config: Json) => boolean>> = {
  attention_bias: (v) => v === false || v == null,
  mlp_bias: (v) => v === false || v == null,
  hidden_act: (v) => v === 'silu' || v == null,
  partial_rotary_factor: (v) => v == null || v === 1,
  // Qwen configs carry a `sliding_window` size that only applies when `use_sliding_window` is true.
  sliding_window: (v, c) => v == null || ('use_sliding_window' in c && c.use_sliding_window !== true),
  use_sliding_window: (v) => v === false || v == null,
  layer_types: (v) => v == null || (Array.isArray(v) && v.every((t) => t === 'full_attention')),
  quantization_config: (v) => v == null,
  num_experts: (v) => v == null || v === 0,
  num_local_experts: (v) => v == null || v === 0,
  n_routed_experts: (v) => v == null || v === 0,
  logit_scale: (v) => v == null || v === 1,
  logits_scaling: (v) => v == null || v === 1,
  embedding_multiplier: (v) => v == null || v === 1,
  residual_multiplier: (v) => v == null || v === 1,
  attention_multiplier: (v) => v == null,
  attn_logit_softcapping: (v) => v == null,
  final_logit_softcapping: (v) => v == null,
  query_pre_attn_scalar: (v) => v == null,
  no_rope_layers: (v) => v == null,
  no_rope_layer_interval: (v) => v == null,
  attention_chunk_size: (v) => v == null,
  use_qk_norm: (v) => v === false || v == null,
  is_causal: (v) => v === true || v == null,
  text_config: (v) => v == null,
  vision_config: (v) => v == null,
};

/** Keys known to have no effect on inference math (or that we read and validate ourselves). */
export const HARMLESS_CONFIG_KEYS: ReadonlySet<string> = new Set([
  // read by parseModelSpec
  'model_type',
  'hidden_size',
  'intermediate_size',
  'num_hidden_layers',
  'num_attention_heads',
  'num_key_value_heads',
  'head_dim',
  'vocab_size',
  'max_position_embeddings',
  'rms_norm_eps',
  'rope_theta',
  'rope_scaling',
  'rope_parameters',
  'tie_word_embeddings',
  'bos_token_id',
  'eos_token_id',
  // bookkeeping
  'architectures',
  'transformers_version',
  'torch_dtype',
  'dtype',
  '_name_or_path',
  'pad_token_id',
  'sep_token_id',
  'decoder_start_token_id',
  'id2label',
  'label2id',
  'problem_type',
  'tokenizer_class',
  'prefix',
  'task_specific_params',
  'finetuning_task',
  'model_max_length',
  'unsloth_fixed',
  'unsloth_version',
  // training-only
  'initializer_range',
  'attention_dropout',
  'pretraining_tp',
  'use_cache',
  'max_window_layers',
  'tie_encoder_decoder',
  'torchscript',
  'use_bfloat16',
  'tf_legacy_loss',
  'pruned_heads',
  'chunk_size_feed_forward',
  'is_encoder_decoder',
  'is_decoder',
  'add_cross_attention',
  'cross_attention_hidden_size',
  'output_attentions',
  'output_hidden_states',
  'return_dict',
  // generation defaults (they live in generation_config.json nowadays)
  'max_length',
  'min_length',
  'do_sample',
  'early_stopping',
  'num_beams',
  'num_beam_groups',
  'diversity_penalty',
  'temperature',
  'top_k',
  'top_p',
  'typical_p',
  'repetition_penalty',
  'length_penalty',
  'no_repeat_ngram_size',
  'encoder_no_repeat_ngram_size',
  'bad_words_ids',
  'num_return_sequences',
  'output_scores',
  'return_dict_in_generate',
  'forced_bos_token_id',
  'forced_eos_token_id',
  'remove_invalid_values',
  'exponential_decay_length_penalty',
  'suppress_tokens',
  'begin_suppress_tokens',
]);

const ARCHS: readonly ArchName[] = ['llama', 'qwen3'];

function isObject(v: unknown): v is Json {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

function show(v: unknown): string {
  return JSON.stringify(v) ?? String(v);
}

function unsupported(key: string, value: unknown, why?: string): ConvertError {
  return new ConvertError('UnsupportedConfig', `config.json ${key}=${show(value)} is not supported${why ? `: ${why}` : ''}`);
}

function positiveInt(config: Json, key: string, fallback?: number): number {
  const v = config[key] ?? fallback;
  if (v === undefined) throw new ConvertError('UnsupportedConfig', `config.json is missing ${key}`);
  if (typeof v !== 'number' || !Number.isSafeInteger(v) || v <= 0) throw unsupported(key, v, 'expected a positive integer');
  return v;
}

function positiveNumber(config: Json, key: string, fallback: number): number {
  const v = config[key] ?? fallback;
  if (typeof v !== 'number' || !Number.isFinite(v) || v <= 0) throw unsupported(key, v, 'expected a positive number');
  return v;
}

function tokenId(v: unknown, key: string): number | null {
  if (v == null) return null;
  if (typeof v !== 'number' || !Number.isSafeInteger(v) || v < 0) throw unsupported(key, v, 'expected a token id');
  return v;
}

function parseRope(config: Json, arch: ArchName): { theta: number; thetaExplicit: boolean; scaling: Llama3RopeScaling | null } {
  // transformers >= 5 folds rope_theta and the scaling into `rope_parameters`.
  const params = config.rope_parameters;
  if (params != null && !isObject(params)) throw unsupported('rope_parameters', params);
  const thetaValue = config.rope_theta ?? params?.rope_theta;
  const theta = positiveNumber({ rope_theta: thetaValue }, 'rope_theta', 10000);

  const scalingKey = config.rope_scaling != null ? 'rope_scaling' : 'rope_parameters';
  const scaling = config.rope_scaling ?? params;
  if (scaling == null) return { theta, thetaExplicit: thetaValue != null, scaling: null };
  if (!isObject(scaling)) throw unsupported(scalingKey, scaling);
  const type = scaling.rope_type ?? scaling.type;
  if (type == null || type === 'default') return { theta, thetaExplicit: thetaValue != null, scaling: null };
  if (type !== 'llama3') throw unsupported(`${scalingKey}.rope_type`, type, 'only llama3 rope scaling is implemented');
  // Neither llama.cpp nor distributed-llama applies llama3 scaling to Qwen3 (dllama forces its
  // "falcon" rope for qwen3), so converting would silently drop it.
  if (arch !== 'llama') throw unsupported(`${scalingKey}.rope_type`, type, `llama3 rope scaling is only supported for llama, not ${arch}`);
  const field = (name: string): number => {
    const v = scaling[name];
    if (typeof v !== 'number' || !Number.isFinite(v) || v <= 0) throw unsupported(`${scalingKey}.${name}`, v, 'expected a positive number');
    return v;
  };
  const result: Llama3RopeScaling = {
    type: 'llama3',
    factor: field('factor'),
    lowFreqFactor: field('low_freq_factor'),
    highFreqFactor: field('high_freq_factor'),
    originalMaxPositionEmbeddings: field('original_max_position_embeddings'),
  };
  if (result.lowFreqFactor === result.highFreqFactor) {
    throw unsupported(`${scalingKey}.high_freq_factor`, result.highFreqFactor, 'must differ from low_freq_factor');
  }
  return { theta, thetaExplicit: thetaValue != null, scaling: result };
}

/**
 * Validates a parsed `config.json` and returns the model spec.
 * @throws ConvertError `UnsupportedArchitecture` for other model types, `UnsupportedConfig` for
 *   missing structural keys and for dangerous keys with values we don't implement.
 */
export function parseModelSpec(config: unknown): ModelSpec {
  if (!isObject(config)) throw new ConvertError('UnsupportedConfig', 'config.json is not a JSON object');
  const arch = config.model_type;
  if (typeof arch !== 'string' || !(ARCHS as readonly string[]).includes(arch)) {
    throw new ConvertError('UnsupportedArchitecture', `model_type ${show(arch)} is not supported (supported: ${ARCHS.join(', ')})`);
  }
  const archName = arch as ArchName;

  for (const [key, implemented] of Object.entries(DANGEROUS_CONFIG_KEYS)) {
    if (key in config && !implemented(config[key], config)) throw unsupported(key, config[key]);
  }

  const hidden = positiveInt(config, 'hidden_size');
  const heads = positiveInt(config, 'num_attention_heads');
  const kvHeads = positiveInt(config, 'num_key_value_heads', heads);
  if (heads % kvHeads !== 0) throw unsupported('num_key_value_heads', kvHeads, `must divide num_attention_heads=${heads}`);
  const headDimExplicit = config.head_dim != null;
  let headDim: number;
  if (headDimExplicit) headDim = positiveInt(config, 'head_dim');
  else if (archName === 'qwen3') headDim = 128;
  else {
    if (hidden % heads !== 0) throw unsupported('hidden_size', hidden, `not divisible by num_attention_heads=${heads} and no head_dim given`);
    headDim = hidden / heads;
  }
  // Rotary embeddings rotate pairs of dimensions.
  if (headDim % 2 !== 0) throw unsupported('head_dim', headDim, 'must be even');

  const rope = parseRope(config, archName);
  const eos = config.eos_token_id;
  const eosTokenIds = (Array.isArray(eos) ? eos : [eos]).map((v) => tokenId(v, 'eos_token_id')).filter((v): v is number => v !== null);

  const tie = config.tie_word_embeddings ?? false;
  if (typeof tie !== 'boolean') throw unsupported('tie_word_embeddings', tie, 'expected a boolean');

  return {
    arch: archName,
    hidden,
    intermediate: positiveInt(config, 'intermediate_size'),
    layers: positiveInt(config, 'num_hidden_layers'),
    heads,
    kvHeads,
    headDim,
    vocab: positiveInt(config, 'vocab_size'),
    ctx: positiveInt(config, 'max_position_embeddings'),
    rmsNormEps: positiveNumber(config, 'rms_norm_eps', 1e-6),
    ropeTheta: rope.theta,
    ropeScaling: rope.scaling,
    tieWordEmbeddings: tie,
    bosTokenId: tokenId(config.bos_token_id, 'bos_token_id'),
    eosTokenIds,
    hiddenAct: 'silu',
    explicit: { headDim: headDimExplicit, ropeTheta: rope.thetaExplicit },
  };
}

/** Top-level config keys that are neither read, nor known harmless, nor known dangerous. */
export function unknownConfigKeys(config: Record<string, unknown>): string[] {
  return Object.keys(config).filter((k) => !HARMLESS_CONFIG_KEYS.has(k) && !(k in DANGEROUS_CONFIG_KEYS));
}

// ---------------------------------------------------------------------------------------------
// Q/K rotary permutation

/**
 * The source row that lands at `outRow` under {@link permuteQK}. Useful to permute while
 * streaming rows instead of holding the whole matrix.
 */
export function permutedSourceRow(outRow: number, rows: number, heads: number): number {
  const headRows = rows / heads;
  const half = headRows / 2;
  const head = Math.floor(outRow / headRows);
  const within = outRow % headRows;
  // out[h][i][j] = in[h][j][i] for the view (heads, half, 2) <- (heads, 2, half)
  const i = within >> 1;
  const j = within & 1;
  return head * headRows + j * half + i;
}

/**
 * Reorders the rows of a Llama `q_proj`/`k_proj` weight from Hugging Face's layout (each head's
 * rotary dimensions as two halves) to the interleaved pairs llama.cpp and distributed-llama rotate.
 * Both reference converters compute `w.reshape(heads, 2, rows/heads/2, cols).swapaxes(1, 2)`;
 * for K, `heads` is the number of KV heads. Qwen3 is not permuted (both runtimes use the
 * "neox"/"falcon" rope on the halves).
 * @param data row-major `rows x cols` matrix (of values, or of raw bytes with `cols` = bytes per row)
 * @returns a new array of the same type; `data` is not modified
 */
export function permuteQK<T extends Float32Array | Uint16Array | Uint8Array>(data: T, rows: number, cols: number, heads: number): T {
  if (data.length !== rows * cols) throw new RangeError(`permuteQK: ${data.length} values is not ${rows}x${cols}`);
  if (heads <= 0 || rows % (heads * 2) !== 0) throw new RangeError(`permuteQK: ${rows} rows cannot be split into ${heads} heads of pairs`);
  // Rows move whole, so any element type works, raw bytes included (cols = bytes per row).
  const out = new (data.constructor as new (n: number) => T)(data.length);
  for (let r = 0; r < rows; r++) {
    const src = permutedSourceRow(r, rows, heads);
    out.set(data.subarray(src * cols, (src + 1) * cols), r * cols);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Llama 3 rope frequency factors

/**
 * The `rope_freqs.weight` tensor llama.cpp expects for Llama 3 rope scaling: one factor per
 * rotary pair (`headDim / 2` values) that divides the base frequency, as in convert_hf_to_gguf.py
 * (LlamaModel.generate_extra_tensors) and transformers' `_compute_llama3_parameters`.
 * One deliberate difference: llama.cpp reads `original_max_position_embeddings` from the top level
 * of config.json (default 8192); we read it from `rope_scaling` as transformers does. The two
 * agree on every published Llama 3.x model (8192).
 */
export function llama3RopeFactors(spec: ModelSpec): Float32Array {
  const s = spec.ropeScaling;
  if (s === null) throw new RangeError('llama3RopeFactors: the model has no llama3 rope scaling');
  const dim = spec.headDim;
  const out = new Float32Array(dim / 2);
  const lowFreqWavelen = s.originalMaxPositionEmbeddings / s.lowFreqFactor;
  const highFreqWavelen = s.originalMaxPositionEmbeddings / s.highFreqFactor;
  for (let i = 0; i < dim / 2; i++) {
    // The reference computes the frequencies in float32; do the same to land on the same factors.
    const freq = Math.fround(1 / Math.fround(Math.pow(spec.ropeTheta, Math.fround((2 * i) / dim))));
    const wavelen = (2 * Math.PI) / freq;
    if (wavelen < highFreqWavelen) out[i] = 1;
    else if (wavelen > lowFreqWavelen) out[i] = s.factor;
    else {
      const smooth = (s.originalMaxPositionEmbeddings / wavelen - s.lowFreqFactor) / (s.highFreqFactor - s.lowFreqFactor);
      out[i] = 1 / ((1 - smooth) / s.factor + smooth);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Tensor plans

/** The two output formats. */
export type OutputFormat = 'gguf' | 'dllama';

/** One output tensor, in output order. */
export interface PlannedTensor {
  /** Name in the output (GGUF tensor name; for dllama, where names are not stored, the HF name). */
  name: string;
  /** HF tensor to read, or null for a generated tensor (then `generated` holds its data). */
  source: string | null;
  generated?: Float32Array;
  /** Shape the source must have, Hugging Face convention (`[rows, cols]`, outermost first). */
  sourceShape: readonly number[];
  /** Shape in the output's convention: GGUF `ne` order (innermost first); dllama as in HF. */
  shape: readonly number[];
  /** Llama Q/K rotary permutation over this many heads, or null. */
  permute: { heads: number } | null;
  /** Encoding of the data. Norms and generated tensors are always `f32`. */
  format: WeightsFormat;
  /** Bytes of the encoded data. */
  byteLength: number;
}

interface TensorDraft {
  name: string;
  source: string | null;
  generated?: Float32Array;
  /** HF convention */
  shape: number[];
  permute: { heads: number } | null;
  /** true: encode with the chosen weights format; false: always f32 */
  quantize: boolean;
}

const LM_HEAD = 'lm_head.weight';
const EMBED = 'model.embed_tokens.weight';

function layerDrafts(spec: ModelSpec, l: number, out: OutputFormat): TensorDraft[] {
  const p = `model.layers.${l}`;
  const qRows = spec.heads * spec.headDim;
  const kvRows = spec.kvHeads * spec.headDim;
  const llama = spec.arch === 'llama';
  const w = (name: string, source: string, shape: number[], permute: { heads: number } | null = null): TensorDraft => ({
    name,
    source,
    shape,
    permute,
    quantize: true,
  });
  const norm = (name: string, source: string, n: number): TensorDraft => ({ name, source, shape: [n], permute: null, quantize: false });
  const q = w(
    out === 'gguf' ? `blk.${l}.attn_q.weight` : `${p}.self_attn.q_proj.weight`,
    `${p}.self_attn.q_proj.weight`,
    [qRows, spec.hidden],
    llama ? { heads: spec.heads } : null,
  );
  const k = w(
    out === 'gguf' ? `blk.${l}.attn_k.weight` : `${p}.self_attn.k_proj.weight`,
    `${p}.self_attn.k_proj.weight`,
    [kvRows, spec.hidden],
    llama ? { heads: spec.kvHeads } : null,
  );
  const v = w(out === 'gguf' ? `blk.${l}.attn_v.weight` : `${p}.self_attn.v_proj.weight`, `${p}.self_attn.v_proj.weight`, [kvRows, spec.hidden]);
  const o = w(out === 'gguf' ? `blk.${l}.attn_output.weight` : `${p}.self_attn.o_proj.weight`, `${p}.self_attn.o_proj.weight`, [spec.hidden, qRows]);
  const gate = w(out === 'gguf' ? `blk.${l}.ffn_gate.weight` : `${p}.mlp.gate_proj.weight`, `${p}.mlp.gate_proj.weight`, [spec.intermediate, spec.hidden]);
  const down = w(out === 'gguf' ? `blk.${l}.ffn_down.weight` : `${p}.mlp.down_proj.weight`, `${p}.mlp.down_proj.weight`, [spec.hidden, spec.intermediate]);
  const up = w(out === 'gguf' ? `blk.${l}.ffn_up.weight` : `${p}.mlp.up_proj.weight`, `${p}.mlp.up_proj.weight`, [spec.intermediate, spec.hidden]);
  const qkNorms =
    spec.arch === 'qwen3'
      ? [
          norm(out === 'gguf' ? `blk.${l}.attn_q_norm.weight` : `${p}.self_attn.q_norm.weight`, `${p}.self_attn.q_norm.weight`, spec.headDim),
          norm(out === 'gguf' ? `blk.${l}.attn_k_norm.weight` : `${p}.self_attn.k_norm.weight`, `${p}.self_attn.k_norm.weight`, spec.headDim),
        ]
      : [];
  const attnNorm = norm(out === 'gguf' ? `blk.${l}.attn_norm.weight` : `${p}.input_layernorm.weight`, `${p}.input_layernorm.weight`, spec.hidden);
  const ffnNorm = norm(
    out === 'gguf' ? `blk.${l}.ffn_norm.weight` : `${p}.post_attention_layernorm.weight`,
    `${p}.post_attention_layernorm.weight`,
    spec.hidden,
  );
  if (out === 'gguf') return [attnNorm, q, k, v, o, ...qkNorms, ffnNorm, gate, up, down];
  // distributed-llama's loader reads exactly this order (convert-hf.py __preparePlan, llm.cpp loadLlmNetWeight).
  return [q, k, v, o, gate, down, up, ...qkNorms, attnNorm, ffnNorm];
}

/**
 * The ordered output tensors of `spec` in format `out`.
 *
 * - GGUF (as convert_hf_to_gguf.py): 1-D tensors (norms, `rope_freqs`) are F32, every matrix
 *   including `token_embd` and `output` uses `weights`. `output.weight` is omitted when the
 *   embeddings are tied or `lm_head.weight` is absent; llama.cpp then reuses `token_embd`.
 * - dllama (as convert-hf.py): the embedding and all norms are F32, every other matrix uses
 *   `weights`; the classifier is `lm_head.weight`, or `model.embed_tokens.weight` when absent.
 *
 * @param hasTensor whether the checkpoint contains a tensor of that name
 * @throws ConvertError `MissingTensor` when a required tensor is absent, `BadBlockSize` when a
 *   matrix row cannot be split into 32-value blocks for q40/q80.
 */
export function planTensors(spec: ModelSpec, out: OutputFormat, weights: WeightsFormat, hasTensor: (name: string) => boolean): PlannedTensor[] {
  const drafts: TensorDraft[] = [];
  const embedShape = [spec.vocab, spec.hidden];
  if (out === 'gguf') {
    if (spec.ropeScaling !== null) {
      drafts.push({ name: 'rope_freqs.weight', source: null, generated: llama3RopeFactors(spec), shape: [spec.headDim / 2], permute: null, quantize: false });
    }
    drafts.push({ name: 'token_embd.weight', source: EMBED, shape: embedShape, permute: null, quantize: true });
  } else {
    drafts.push({ name: EMBED, source: EMBED, shape: embedShape, permute: null, quantize: false });
  }
  for (let l = 0; l < spec.layers; l++) drafts.push(...layerDrafts(spec, l, out));
  drafts.push({
    name: out === 'gguf' ? 'output_norm.weight' : 'model.norm.weight',
    source: 'model.norm.weight',
    shape: [spec.hidden],
    permute: null,
    quantize: false,
  });
  const hasHead = hasTensor(LM_HEAD);
  if (out === 'gguf') {
    if (hasHead && !spec.tieWordEmbeddings) {
      drafts.push({ name: 'output.weight', source: LM_HEAD, shape: embedShape, permute: null, quantize: true });
    }
  } else {
    drafts.push({ name: LM_HEAD, source: hasHead ? LM_HEAD : EMBED, shape: embedShape, permute: null, quantize: true });
  }

  return drafts.map((d) => {
    if (d.source !== null && !hasTensor(d.source)) throw new ConvertError('MissingTensor', `tensor ${d.source} is missing from the checkpoint`);
    const format: WeightsFormat = d.quantize ? weights : 'f32';
    const cols = d.shape[d.shape.length - 1] ?? 0;
    const { blockQuantized, blockSize } = weightsFormat(format);
    if (blockQuantized && cols % blockSize !== 0) {
      // Checked from config.json before anything is read or written; the checkpoint's own name of
      // the tensor is what a user finds in the repository.
      const source = d.source !== null && d.source !== d.name ? ` (${d.source})` : '';
      const plain = WEIGHTS_FORMATS.filter((f) => !isBlockQuantized(f)).join(' or ');
      throw new ConvertError(
        'BadBlockSize',
        `tensor ${d.name}${source}: rows of ${cols} values cannot be split into ${blockSize}-value ${format} blocks; convert this model to ${plain}`,
      );
    }
    const elements = d.shape.reduce((a, b) => a * b, 1);
    const planned: PlannedTensor = {
      name: d.name,
      source: d.source,
      sourceShape: d.shape,
      shape: out === 'gguf' ? [...d.shape].reverse() : d.shape,
      permute: d.permute,
      format,
      byteLength: encodedSize(format, elements, d.name),
    };
    if (d.generated) planned.generated = d.generated;
    return planned;
  });
}

/**
 * Checks a source tensor's shape against the plan.
 * @throws ConvertError `ShapeMismatch`
 */
export function checkSourceShape(tensor: PlannedTensor, actual: readonly number[]): void {
  const expected = tensor.sourceShape;
  if (actual.length !== expected.length || actual.some((d, i) => d !== expected[i])) {
    throw new ConvertError('ShapeMismatch', `tensor ${tensor.source ?? tensor.name} has shape [${actual.join(', ')}], expected [${expected.join(', ')}]`);
  }
}

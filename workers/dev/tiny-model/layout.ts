/**
 * A tiny model's shape and weights: the options with their defaults, the tensors in Hugging Face
 * order, and each tensor's values — a pure function of (seed, tensor name), so a sharded and a
 * single-file model with the same seed hold identical tensors.
 */

/** What a tiny model is asked for; every field has a default. */
export interface TinyModelOptions {
  /** PRNG seed (default 1). */
  seed?: number;
  /** Element type of every tensor (default F16). */
  dtype?: 'F32' | 'F16' | 'BF16';
  /** Number of shards; 1 writes `model.safetensors` (default 1). */
  shards?: number;
  /** Tie the output matrix to the embeddings (no `lm_head.weight`); default false for llama, true for qwen3. */
  tied?: boolean;
  /** Add a llama3 `rope_scaling` block (llama only). */
  ropeScaling?: boolean;
  /** `llama` (LlamaForCausalLM, default) or `qwen3` (Qwen3ForCausalLM, q_norm/k_norm, explicit head_dim). */
  arch?: 'llama' | 'qwen3';
  hiddenSize?: number;
  intermediateSize?: number;
  numLayers?: number;
  numHeads?: number;
  numKvHeads?: number;
  /** Written as `head_dim`; llama default hidden/heads (omitted from config unless given), qwen3 default 32. */
  headDim?: number;
  /** Rows of the embedding; the tokenizer has exactly this many tokens (≥ 256 bytes + specials + 1). */
  vocabSize?: number;
  maxPositionEmbeddings?: number;
}

/** Options with defaults applied. */
export interface TinyModelLayout {
  seed: number;
  dtype: 'F32' | 'F16' | 'BF16';
  shards: number;
  tied: boolean;
  ropeScaling: boolean;
  arch: 'llama' | 'qwen3';
  hidden: number;
  intermediate: number;
  layers: number;
  heads: number;
  kvHeads: number;
  headDim: number;
  headDimExplicit: boolean;
  vocab: number;
  ctx: number;
}

export function tinyModelLayout(opts: TinyModelOptions = {}): TinyModelLayout {
  const arch = opts.arch ?? 'llama';
  const hidden = opts.hiddenSize ?? 64;
  const heads = opts.numHeads ?? 4;
  const layout: TinyModelLayout = {
    seed: opts.seed ?? 1,
    dtype: opts.dtype ?? 'F16',
    shards: opts.shards ?? 1,
    tied: opts.tied ?? arch === 'qwen3',
    ropeScaling: opts.ropeScaling ?? false,
    arch,
    hidden,
    intermediate: opts.intermediateSize ?? 256,
    layers: opts.numLayers ?? 2,
    heads,
    kvHeads: opts.numKvHeads ?? 2,
    headDim: opts.headDim ?? (arch === 'qwen3' ? 32 : hidden / heads),
    headDimExplicit: opts.headDim !== undefined || arch === 'qwen3',
    vocab: opts.vocabSize ?? 384,
    ctx: opts.maxPositionEmbeddings ?? 256,
  };
  if (!Number.isInteger(layout.headDim)) throw new Error(`hidden ${hidden} is not divisible by ${heads} heads`);
  if (layout.heads % layout.kvHeads !== 0) throw new Error(`${layout.heads} heads cannot share ${layout.kvHeads} kv heads`);
  if (layout.ropeScaling && arch !== 'llama') throw new Error('ropeScaling is for llama');
  if (!Number.isInteger(layout.shards) || layout.shards < 1) throw new Error(`bad shard count ${layout.shards}`);
  return layout;
}

/** Kind of tensor, which sets its value distribution. */
type TensorKind = 'norm' | 'matrix';

export interface TinyTensor {
  name: string;
  shape: number[];
  kind: TensorKind;
}

/** The model's tensors in Hugging Face order (embeddings, layers, final norm, lm_head). */
export function tinyModelTensors(l: TinyModelLayout): TinyTensor[] {
  const t: TinyTensor[] = [{ name: 'model.embed_tokens.weight', shape: [l.vocab, l.hidden], kind: 'matrix' }];
  const q = l.heads * l.headDim;
  const kv = l.kvHeads * l.headDim;
  for (let i = 0; i < l.layers; i++) {
    const p = `model.layers.${i}`;
    t.push(
      { name: `${p}.input_layernorm.weight`, shape: [l.hidden], kind: 'norm' },
      { name: `${p}.self_attn.q_proj.weight`, shape: [q, l.hidden], kind: 'matrix' },
      { name: `${p}.self_attn.k_proj.weight`, shape: [kv, l.hidden], kind: 'matrix' },
      { name: `${p}.self_attn.v_proj.weight`, shape: [kv, l.hidden], kind: 'matrix' },
      { name: `${p}.self_attn.o_proj.weight`, shape: [l.hidden, q], kind: 'matrix' },
    );
    if (l.arch === 'qwen3') {
      t.push(
        { name: `${p}.self_attn.q_norm.weight`, shape: [l.headDim], kind: 'norm' },
        { name: `${p}.self_attn.k_norm.weight`, shape: [l.headDim], kind: 'norm' },
      );
    }
    t.push(
      { name: `${p}.post_attention_layernorm.weight`, shape: [l.hidden], kind: 'norm' },
      { name: `${p}.mlp.gate_proj.weight`, shape: [l.intermediate, l.hidden], kind: 'matrix' },
      { name: `${p}.mlp.up_proj.weight`, shape: [l.intermediate, l.hidden], kind: 'matrix' },
      { name: `${p}.mlp.down_proj.weight`, shape: [l.hidden, l.intermediate], kind: 'matrix' },
    );
  }
  t.push({ name: 'model.norm.weight', shape: [l.hidden], kind: 'norm' });
  if (!l.tied) t.push({ name: 'lm_head.weight', shape: [l.vocab, l.hidden], kind: 'matrix' });
  return t;
}

/** mulberry32: a tiny, well-mixed 32-bit PRNG. Returns a function yielding uint32s. */
export function mulberry32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return (t ^ (t >>> 14)) >>> 0;
  };
}

function fnv1a(text: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) h = Math.imul(h ^ text.charCodeAt(i), 0x01000193);
  return h >>> 0;
}

const VALUE_CHUNK = 1 << 20;

/**
 * The float32 values of one tensor (before rounding to the model dtype), in chunks of up to 1M.
 * Norm weights are 1 ± 0.05, matrices uniform in ±0.08 (scaled by 1/√(fan-in/64) for wide inputs).
 */
export function* tinyTensorValues(seed: number, t: TinyTensor): Generator<Float32Array> {
  const next = mulberry32(fnv1a(t.name) ^ Math.imul(seed, 0x9e3779b9));
  const total = t.shape.reduce((a, b) => a * b, 1);
  const fanIn = t.shape[t.shape.length - 1] ?? 1;
  const [center, spread] = t.kind === 'norm' ? [1, 0.05] : [0, 0.08 * Math.min(1, Math.sqrt(64 / fanIn))];
  for (let at = 0; at < total; at += VALUE_CHUNK) {
    const n = Math.min(VALUE_CHUNK, total - at);
    const out = new Float32Array(n);
    for (let i = 0; i < n; i++) out[i] = center + spread * (next() / 2147483648 - 1);
    yield out;
  }
}

/** All values of one tensor as float32 (tests). */
export function tinyTensorData(seed: number, t: TinyTensor): Float32Array {
  const chunks = [...tinyTensorValues(seed, t)];
  const out = new Float32Array(chunks.reduce((n, c) => n + c.length, 0));
  let at = 0;
  for (const c of chunks) {
    out.set(c, at);
    at += c.length;
  }
  return out;
}

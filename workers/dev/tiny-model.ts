/**
 * Deterministic synthetic Hugging Face checkpoints for tests, benchmarks and `magus model tiny`
 * (a small model to try magus with), plus a small safetensors writer (also used to craft
 * malformed files).
 *
 * {@link writeTinyModel} writes what a real Llama 3 / Qwen3 repository holds: `config.json`,
 * `model.safetensors` (or shards + `model.safetensors.index.json`), a byte-level BPE
 * `tokenizer.json` in the tokenizers library format, `tokenizer_config.json` with a Jinja chat
 * template, and `generation_config.json`. Everything is a pure function of the options: the same
 * seed gives the same bytes, and each tensor's values depend only on (seed, tensor name), so a
 * sharded and a single-file model with the same seed hold identical tensors.
 */
import { mkdir, open, writeFile } from 'node:fs/promises';
import * as path from 'node:path';
import { f32Bits, f32ToF16 } from '../../convert/quant';

// ---------------------------------------------------------------------------------------------
// Safetensors writer

/** A tensor to write: its declared dtype may be any string (to craft unsupported files). */
export interface SafetensorsEntry {
  name: string;
  dtype: string;
  shape: number[];
  /** Bytes in the file; defaults to the size implied by dtype and shape (F32/F16/BF16/I64/I32/U8/...). */
  byteLength?: number;
}

const DTYPE_BYTES: Readonly<Record<string, number>> = { F64: 8, I64: 8, U64: 8, F32: 4, I32: 4, U32: 4, F16: 2, BF16: 2, I16: 2, U16: 2, I8: 1, U8: 1, BOOL: 1 };

function entryBytes(e: SafetensorsEntry): number {
  if (e.byteLength !== undefined) return e.byteLength;
  const size = DTYPE_BYTES[e.dtype];
  if (size === undefined) throw new Error(`give byteLength for dtype ${e.dtype}`);
  return e.shape.reduce((a, b) => a * b, 1) * size;
}

/**
 * The header bytes (8-byte length + JSON padded with spaces to a multiple of 8, as the
 * safetensors library writes it) for entries laid out back to back in the given order.
 * JSON keys are sorted by name, so header order differs from data order as in real files.
 */
export function encodeSafetensorsHeader(entries: readonly SafetensorsEntry[], metadata?: Record<string, string>): Uint8Array {
  const header: Record<string, unknown> = {};
  if (metadata) header.__metadata__ = metadata;
  let at = 0;
  const described = entries.map((e) => {
    const begin = at;
    at += entryBytes(e);
    return [e.name, { dtype: e.dtype, shape: e.shape, data_offsets: [begin, at] }] as const;
  });
  for (const [name, v] of [...described].sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0))) header[name] = v;
  return encodeRawHeader(JSON.stringify(header));
}

/** `json` as a safetensors header: u64 length prefix, space-padded to 8 bytes. `length` overrides the prefix. */
export function encodeRawHeader(json: string, length?: bigint): Uint8Array {
  let body = Buffer.from(json, 'utf8');
  const pad = (8 - (body.length % 8)) % 8;
  if (pad) body = Buffer.concat([body, Buffer.alloc(pad, 0x20)]);
  const out = new Uint8Array(8 + body.length);
  new DataView(out.buffer).setBigUint64(0, length ?? BigInt(body.length), true);
  out.set(body, 8);
  return out;
}

/** A whole safetensors file in memory. `data[i]` must have entry i's byte length. */
export function encodeSafetensors(entries: readonly (SafetensorsEntry & { data: Uint8Array })[], metadata?: Record<string, string>): Uint8Array {
  for (const e of entries) {
    if (e.data.length !== entryBytes(e)) throw new Error(`tensor ${e.name}: ${e.data.length} data bytes, header says ${entryBytes(e)}`);
  }
  return Buffer.concat([encodeSafetensorsHeader(entries, metadata), ...entries.map((e) => e.data)]);
}

/** Streams a safetensors file to disk: header, then each entry's chunks from `data` (checked against its size). */
export async function writeSafetensorsFile(
  filePath: string,
  entries: readonly SafetensorsEntry[],
  data: (entry: SafetensorsEntry, index: number) => Iterable<Uint8Array>,
  metadata?: Record<string, string>,
): Promise<number> {
  const fh = await open(filePath, 'w');
  try {
    const header = encodeSafetensorsHeader(entries, metadata);
    let total = header.length;
    await fh.write(header);
    for (const [i, e] of entries.entries()) {
      let n = 0;
      for (const chunk of data(e, i)) {
        n += chunk.length;
        await fh.write(chunk);
      }
      if (n !== entryBytes(e)) throw new Error(`tensor ${e.name}: wrote ${n} bytes, header says ${entryBytes(e)}`);
      total += n;
    }
    return total;
  } finally {
    await fh.close();
  }
}

/** float32 values → little-endian bytes of `dtype` (F16 and BF16 rounded to nearest, ties to even). */
export function encodeValues(values: Float32Array, dtype: 'F32' | 'F16' | 'BF16'): Uint8Array {
  if (dtype === 'F32') return new Uint8Array(values.buffer.slice(values.byteOffset, values.byteOffset + values.byteLength));
  const out = new Uint16Array(values.length);
  if (dtype === 'F16') {
    f32ToF16(values, out);
  } else {
    for (let i = 0; i < values.length; i++) {
      const u = f32Bits(values[i]!);
      out[i] = (u + 0x7fff + ((u >>> 16) & 1)) >>> 16;
    }
  }
  return new Uint8Array(out.buffer);
}

// ---------------------------------------------------------------------------------------------
// Deterministic numbers

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

// ---------------------------------------------------------------------------------------------
// Model layout

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

// ---------------------------------------------------------------------------------------------
// Tokenizer

/** GPT-2's `bytes_to_unicode`: byte → printable character, in GPT-2 vocabulary order. */
export function gpt2ByteChars(): { order: number[]; char: string[] } {
  const order: number[] = [];
  for (let b = 0x21; b <= 0x7e; b++) order.push(b);
  for (let b = 0xa1; b <= 0xac; b++) order.push(b);
  for (let b = 0xae; b <= 0xff; b++) order.push(b);
  const char: string[] = new Array<string>(256);
  for (const b of order) char[b] = String.fromCharCode(b);
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (char[b] === undefined) {
      order.push(b);
      char[b] = String.fromCharCode(256 + n++);
    }
  }
  return { order, char };
}

// The real Llama 3 and Qwen2 pre-tokenizer regexes (tokenizers syntax, `(?i:...)` included).
const LLAMA3_SPLIT =
  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2_SPLIT =
  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
// JavaScript has no inline `(?i:)`; close enough for training merges.
const TRAIN_SPLIT = /'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL]|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+/gu;

const CORPUS = [
  'The quick brown fox jumps over the lazy dog while the other dogs sleep in the sun.',
  'A model is converted from safetensors into GGUF and into the distributed format, then served.',
  'Tokens are learned from the most frequent pairs of bytes; the merges are applied in order.',
  'In the beginning there was the word, and the word was split into the smallest pieces there are.',
  'Workers read the weights, quantize them in blocks of thirty-two, and write the blocks to files.',
  "It's the 1st of May, 2025: they've said we'll meet at 10:30 and we're there, aren't we?",
  'Hello, world! Hello again, world. The world says hello back to everyone in the room.',
  'def main():\n    return sum(range(10)) * 2  # the answer is ninety\n',
].join('\n');

/** Learns merges on {@link CORPUS} (then synthesizes more) until `vocab` holds `size` tokens. */
function trainMerges(size: number, char: string[], vocab: Map<string, number>): [string, string][] {
  const words = new Map<string, number>();
  for (const w of CORPUS.match(TRAIN_SPLIT) ?? []) {
    const key = [...Buffer.from(w, 'utf8')].map((b) => char[b]!).join('\u0000');
    words.set(key, (words.get(key) ?? 0) + 1);
  }
  let pieces = [...words.entries()].map(([k, n]) => ({ parts: k.split('\u0000'), n }));
  const merges: [string, string][] = [];
  while (vocab.size < size) {
    const pairs = new Map<string, number>();
    for (const { parts, n } of pieces) {
      for (let i = 0; i + 1 < parts.length; i++) {
        const k = `${parts[i]}\u0000${parts[i + 1]}`;
        pairs.set(k, (pairs.get(k) ?? 0) + n);
      }
    }
    let best: string | undefined;
    let bestN = 1; // only pairs seen at least twice
    for (const [k, n] of pairs) {
      if (n > bestN || (n === bestN && best !== undefined && k < best)) {
        best = k;
        bestN = n;
      }
    }
    if (best === undefined) break;
    const [a, b] = best.split('\u0000') as [string, string];
    merges.push([a, b]);
    if (!vocab.has(a + b)) vocab.set(a + b, vocab.size); // two merge paths can spell the same token
    pieces = pieces.map(({ parts, n }) => {
      const merged: string[] = [];
      for (let i = 0; i < parts.length; i++) {
        if (i + 1 < parts.length && parts[i] === a && parts[i + 1] === b) {
          merged.push(a + b);
          i++;
        } else {
          merged.push(parts[i]!);
        }
      }
      return { parts: merged, n };
    });
  }
  // Past what the corpus supports, extend deterministically: token + byte pairs not yet present.
  const tokens = [...vocab.keys()];
  const bytes = tokens.slice(0, 256);
  for (let i = 0; vocab.size < size; i++) {
    const left = tokens[i % tokens.length]!;
    for (const right of bytes) {
      if (vocab.size >= size) break;
      if (vocab.has(left + right)) continue;
      merges.push([left, right]);
      vocab.set(left + right, vocab.size);
      tokens.push(left + right);
    }
  }
  return merges;
}

interface Specials {
  list: string[];
  bos: string;
  eos: string;
  /** config.json / generation_config.json eos ids, by name */
  eosList: string[];
}

function specialsFor(arch: 'llama' | 'qwen3'): Specials {
  return arch === 'llama'
    ? {
        list: ['<|begin_of_text|>', '<|end_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>'],
        bos: '<|begin_of_text|>',
        eos: '<|eot_id|>',
        eosList: ['<|end_of_text|>', '<|eot_id|>'],
      }
    : { list: ['<|endoftext|>', '<|im_start|>', '<|im_end|>'], bos: '<|endoftext|>', eos: '<|im_end|>', eosList: ['<|im_end|>', '<|endoftext|>'] };
}

const LLAMA3_TEMPLATE =
  "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";
const CHATML_TEMPLATE =
  "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

interface TokenizerFiles {
  tokenizer: Record<string, unknown>;
  tokenizerConfig: Record<string, unknown>;
  ids: Record<string, number>;
  specials: Specials;
}

function buildTokenizer(l: TinyModelLayout): TokenizerFiles {
  const specials = specialsFor(l.arch);
  const regular = l.vocab - specials.list.length;
  if (regular < 257) throw new Error(`vocabSize ${l.vocab} leaves no room for merges (256 bytes + ${specials.list.length} specials)`);
  const { order, char } = gpt2ByteChars();
  const vocab = new Map<string, number>();
  for (const b of order) vocab.set(char[b]!, vocab.size);
  const merges = trainMerges(regular, char, vocab);
  const ids: Record<string, number> = {};
  for (const s of specials.list) ids[s] = vocab.size + Object.keys(ids).length;
  const addedTokens = specials.list.map((content) => ({
    id: ids[content]!,
    content,
    single_word: false,
    lstrip: false,
    rstrip: false,
    normalized: false,
    special: true,
  }));
  const split = { type: 'Split', pattern: { Regex: l.arch === 'llama' ? LLAMA3_SPLIT : QWEN2_SPLIT }, behavior: 'Isolated', invert: false };
  const bos = specials.bos;
  const tokenizer: Record<string, unknown> = {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: addedTokens,
    normalizer: l.arch === 'qwen3' ? { type: 'NFC' } : null,
    pre_tokenizer: {
      type: 'Sequence',
      pretokenizers: [split, { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }],
    },
    post_processor:
      l.arch === 'llama'
        ? {
            type: 'TemplateProcessing',
            single: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
            pair: [
              { SpecialToken: { id: bos, type_id: 0 } },
              { Sequence: { id: 'A', type_id: 0 } },
              { SpecialToken: { id: bos, type_id: 1 } },
              { Sequence: { id: 'B', type_id: 1 } },
            ],
            special_tokens: { [bos]: { id: bos, ids: [ids[bos]], tokens: [bos] } },
          }
        : { type: 'ByteLevel', add_prefix_space: false, trim_offsets: false, use_regex: false },
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: {
      type: 'BPE',
      dropout: null,
      unk_token: null,
      continuing_subword_prefix: null,
      end_of_word_suffix: null,
      fuse_unk: false,
      byte_fallback: false,
      ignore_merges: l.arch === 'llama',
      vocab: Object.fromEntries(vocab),
      merges: merges.map(([a, b]) => `${a} ${b}`),
    },
  };
  const tokenizerConfig: Record<string, unknown> = {
    add_bos_token: l.arch === 'llama',
    add_prefix_space: false,
    added_tokens_decoder: Object.fromEntries(addedTokens.map(({ id, ...rest }) => [String(id), rest])),
    bos_token: l.arch === 'llama' ? bos : null,
    chat_template: l.arch === 'llama' ? LLAMA3_TEMPLATE : CHATML_TEMPLATE,
    clean_up_tokenization_spaces: l.arch === 'llama',
    eos_token: specials.eos,
    model_input_names: ['input_ids', 'attention_mask'],
    model_max_length: l.ctx,
    pad_token: l.arch === 'qwen3' ? '<|endoftext|>' : null,
    tokenizer_class: l.arch === 'llama' ? 'PreTrainedTokenizerFast' : 'Qwen2Tokenizer',
  };
  return { tokenizer, tokenizerConfig, ids, specials };
}

// ---------------------------------------------------------------------------------------------
// The model

/** What {@link writeTinyModel} wrote. */
export interface TinyModel {
  dir: string;
  layout: TinyModelLayout;
  config: Record<string, unknown>;
  tensors: TinyTensor[];
  /** Weight files relative to `dir`, in shard order. */
  weightFiles: string[];
  /** Special token ids by content. */
  specialIds: Record<string, number>;
  /** Total bytes of tensor data. */
  totalSize: number;
}

function configFor(l: TinyModelLayout, tok: TokenizerFiles): Record<string, unknown> {
  const id = (s: string): number => tok.ids[s]!;
  const eos = tok.specials.eosList.map(id);
  const torchDtype = { F32: 'float32', F16: 'float16', BF16: 'bfloat16' }[l.dtype];
  if (l.arch === 'qwen3') {
    return {
      architectures: ['Qwen3ForCausalLM'],
      attention_bias: false,
      attention_dropout: 0.0,
      bos_token_id: id('<|endoftext|>'),
      eos_token_id: id('<|im_end|>'),
      head_dim: l.headDim,
      hidden_act: 'silu',
      hidden_size: l.hidden,
      initializer_range: 0.02,
      intermediate_size: l.intermediate,
      max_position_embeddings: l.ctx,
      max_window_layers: l.layers,
      model_type: 'qwen3',
      num_attention_heads: l.heads,
      num_hidden_layers: l.layers,
      num_key_value_heads: l.kvHeads,
      rms_norm_eps: 1e-6,
      rope_scaling: null,
      rope_theta: 1000000.0,
      sliding_window: null,
      tie_word_embeddings: l.tied,
      torch_dtype: torchDtype,
      transformers_version: '4.51.0',
      use_cache: true,
      use_sliding_window: false,
      vocab_size: l.vocab,
    };
  }
  const config: Record<string, unknown> = {
    architectures: ['LlamaForCausalLM'],
    attention_bias: false,
    attention_dropout: 0.0,
    bos_token_id: id('<|begin_of_text|>'),
    eos_token_id: eos,
    ...(l.headDimExplicit ? { head_dim: l.headDim } : {}),
    hidden_act: 'silu',
    hidden_size: l.hidden,
    initializer_range: 0.02,
    intermediate_size: l.intermediate,
    max_position_embeddings: l.ctx,
    mlp_bias: false,
    model_type: 'llama',
    num_attention_heads: l.heads,
    num_hidden_layers: l.layers,
    num_key_value_heads: l.kvHeads,
    pretraining_tp: 1,
    rms_norm_eps: 1e-5,
    rope_scaling: l.ropeScaling
      ? { factor: 8.0, high_freq_factor: 4.0, low_freq_factor: 1.0, original_max_position_embeddings: Math.max(1, l.ctx / 4), rope_type: 'llama3' }
      : null,
    rope_theta: 500000.0,
    tie_word_embeddings: l.tied,
    torch_dtype: torchDtype,
    transformers_version: '4.45.0',
    use_cache: true,
    vocab_size: l.vocab,
  };
  return config;
}

function shardName(i: number, n: number): string {
  const pad = (k: number): string => String(k).padStart(5, '0');
  return `model-${pad(i + 1)}-of-${pad(n)}.safetensors`;
}

const json = (v: unknown): string => `${JSON.stringify(v, null, 2)}\n`;

/**
 * Writes a complete synthetic Hugging Face model directory (created if needed). Tensor data is
 * streamed, so large layouts (for benchmarks) need only a few MB of memory.
 */
export async function writeTinyModel(dir: string, opts: TinyModelOptions = {}): Promise<TinyModel> {
  const l = tinyModelLayout(opts);
  const tensors = tinyModelTensors(l);
  if (l.shards > tensors.length) throw new Error(`${l.shards} shards for ${tensors.length} tensors`);
  const tok = buildTokenizer(l);
  const config = configFor(l, tok);
  await mkdir(dir, { recursive: true });

  const elementBytes = l.dtype === 'F32' ? 4 : 2;
  const entries = tensors.map((t) => ({ name: t.name, dtype: l.dtype, shape: t.shape }));
  const perShard = Math.ceil(tensors.length / l.shards);
  const weightFiles: string[] = [];
  const weightMap: Record<string, string> = {};
  let totalSize = 0;
  for (let s = 0; s < l.shards; s++) {
    const file = l.shards === 1 ? 'model.safetensors' : shardName(s, l.shards);
    const slice = entries.slice(s * perShard, (s + 1) * perShard);
    const sliceTensors = tensors.slice(s * perShard, (s + 1) * perShard);
    await writeSafetensorsFile(
      path.join(dir, file),
      slice,
      function* (_e, i) {
        for (const chunk of tinyTensorValues(l.seed, sliceTensors[i]!)) yield encodeValues(chunk, l.dtype);
      },
      { format: 'pt' },
    );
    weightFiles.push(file);
    for (const e of slice) {
      weightMap[e.name] = file;
      totalSize += e.shape.reduce((a, b) => a * b, 1) * elementBytes;
    }
  }
  if (l.shards > 1) {
    const sorted = Object.fromEntries(Object.entries(weightMap).sort(([a], [b]) => (a < b ? -1 : 1)));
    await writeFile(path.join(dir, 'model.safetensors.index.json'), json({ metadata: { total_size: totalSize }, weight_map: sorted }));
  }

  const eosIds = tok.specials.eosList.map((s) => tok.ids[s]!);
  await writeFile(path.join(dir, 'config.json'), json(config));
  await writeFile(path.join(dir, 'tokenizer.json'), json(tok.tokenizer));
  await writeFile(path.join(dir, 'tokenizer_config.json'), json(tok.tokenizerConfig));
  await writeFile(
    path.join(dir, 'generation_config.json'),
    json({
      bos_token_id: tok.ids[tok.specials.bos],
      do_sample: true,
      eos_token_id: eosIds,
      temperature: 0.6,
      top_p: 0.9,
      transformers_version: config.transformers_version,
    }),
  );
  return { dir, layout: l, config, tensors, weightFiles, specialIds: tok.ids, totalSize };
}

/**
 * distributed-llama files, byte for byte as its reference converter writes them
 * (b4rtaz/distributed-llama converter/convert-hf.py + writer.py for the `.m` model,
 * converter/tokenizer-writer.py for the `.t` tokenizer) and as src/llm.cpp and src/tokenizer.cpp
 * read them. All integers are little-endian int32, scores float32.
 *
 * `.m`: magic 0x0A00ABCD | header size (bytes, including magic and size) | (key, value) int32
 *   pairs | tensors back to back, no padding, in {@link planTensors} order.
 * `.t`: magic 0x567124 | header size | (key, value) pairs | chat template bytes | eos ids |
 *   per token: score f32, byte length u32, bytes.
 */
import { type OutputTarget, type TensorData, writeFileAtomically, writeTensorData } from './atomic-file';
import { type ArchName, type ModelSpec, type PlannedTensor, planTensors } from './arch';
import { ConvertError } from './errors';
import { TokenType, type ParsedTokenizer } from './tokenizer';
import type { WeightsFormat } from './types';
import { DLLAMA_RUNNABLE_WEIGHTS, dllamaNodeCounts, dllamaSplitProblems, dllamaWeightsProblem } from '../shared/dllama-topology';
import { WEIGHTS, WEIGHTS_FORMATS } from '../shared/weights';

export const DLLAMA_MODEL_MAGIC = 0x0a00abcd;
export const DLLAMA_TOKENIZER_MAGIC = 0x567124;

/** `.m` header keys (writer.py `headerKeys`, llm.hpp `LlmHeaderKey`). */
export const DllamaHeaderKey = {
  version: 0,
  arch_type: 1,
  dim: 2,
  hidden_dim: 3,
  n_layers: 4,
  n_heads: 5,
  n_kv_heads: 6,
  n_experts: 7,
  n_active_experts: 8,
  vocab_size: 9,
  max_seq_len: 10,
  hidden_act: 11,
  rope_theta: 12,
  weights_float_type: 13,
  rope_scaling_factor: 14,
  rope_scaling_low_freq_factor: 15,
  rope_scaling_high_freq_factory: 16, // sic, as in writer.py
  rope_scaling_orig_max_seq_len: 17,
  rope_type: 18,
  head_dim: 19,
  norm_epsilon: 20,
  moe_hidden_dim: 21,
} as const;
export type DllamaHeaderKeyName = keyof typeof DllamaHeaderKey;

/** `.t` header keys (tokenizer-writer.py `headerKeys`, tokenizer.hpp `TokenizerHeaderKey`). */
export const DllamaTokenizerKey = {
  version: 0,
  vocab_size: 1,
  max_token_length: 2,
  bos_id: 3,
  chat_template: 7,
  n_eos_tokens: 9,
  add_bos: 10,
} as const;

/** The architectures distributed-llama runs, by their `.m` `arch_type` (llm.hpp `LlmArchType`; it also has qwen3_moe, which magus does not convert). */
export const DllamaArchType: Readonly<Partial<Record<ArchName, number>>> = { llama: 0xabcd00, qwen3: 0xabcd01 };
/** distributed-llama's `FloatType` of each weights format (shared/weights.ts). */
export const DllamaFloatType = Object.fromEntries(WEIGHTS_FORMATS.map((f) => [f, WEIGHTS[f].dllamaFloatType])) as Readonly<Record<WeightsFormat, number>>;
const HIDDEN_ACT_SILU = 1;
/** convert-hf.py `parseRopeType`: llama3 -> LLAMA3_1 */
const ROPE_TYPE_LLAMA3_1 = 2;

function int32(name: string, v: number): number {
  if (!Number.isInteger(v) || v < -0x80000000 || v > 0x7fffffff) {
    throw new ConvertError('UnsupportedConfig', `distributed-llama header ${name}=${v} is not an int32`);
  }
  return v;
}

/** An integral value the reference converter would truncate with `int()`: refuse instead. */
function integral(name: string, v: number): number {
  if (!Number.isInteger(v)) {
    throw new ConvertError('UnsupportedConfig', `distributed-llama stores ${name} as an integer; ${v} would be truncated`);
  }
  return int32(name, v);
}

/**
 * The `.m` header entries in the order convert-hf.py's `loadConfig` builds them (dict insertion
 * order). Like the reference, `rope_theta` and `head_dim` only appear when config.json has them
 * (the runtime defaults, 10000 and dim/heads, agree with transformers'); unlike it,
 * `norm_epsilon` is always written, because transformers' default (1e-6) is not the runtime's.
 * @throws ConvertError `UnsupportedConfig` for values the format cannot hold exactly
 */
export function dllamaHeaderEntries(spec: ModelSpec, weights: WeightsFormat): [DllamaHeaderKeyName, number][] {
  const entries: [DllamaHeaderKeyName, number][] = [
    ['version', 0],
    ['arch_type', dllamaArchType(spec.arch)],
    ['hidden_act', HIDDEN_ACT_SILU],
    ['dim', int32('dim', spec.hidden)],
    ['hidden_dim', int32('hidden_dim', spec.intermediate)],
    ['n_layers', int32('n_layers', spec.layers)],
    ['n_heads', int32('n_heads', spec.heads)],
    ['n_kv_heads', int32('n_kv_heads', spec.kvHeads)],
    ['weights_float_type', DllamaFloatType[weights]],
    ['max_seq_len', int32('max_seq_len', spec.ctx)],
    ['vocab_size', int32('vocab_size', spec.vocab)],
    ['n_experts', 0],
    ['n_active_experts', 0],
  ];
  if (spec.explicit.ropeTheta) entries.push(['rope_theta', integral('rope_theta', spec.ropeTheta)]);
  const s = spec.ropeScaling;
  if (s !== null) {
    entries.push(
      ['rope_scaling_factor', integral('rope_scaling.factor', s.factor)],
      ['rope_scaling_low_freq_factor', integral('rope_scaling.low_freq_factor', s.lowFreqFactor)],
      ['rope_scaling_high_freq_factory', integral('rope_scaling.high_freq_factor', s.highFreqFactor)],
      ['rope_scaling_orig_max_seq_len', integral('rope_scaling.original_max_position_embeddings', s.originalMaxPositionEmbeddings)],
      ['rope_type', ROPE_TYPE_LLAMA3_1],
    );
  }
  // The runtime derives head_dim = dim / n_heads when absent.
  if (spec.explicit.headDim || spec.headDim * spec.heads !== spec.hidden) entries.push(['head_dim', int32('head_dim', spec.headDim)]);
  entries.push(['norm_epsilon', normEpsilonCode(spec.rmsNormEps)]);
  return entries;
}

/** @throws ConvertError `UnsupportedArchitecture` for an architecture distributed-llama does not run */
function dllamaArchType(arch: ArchName): number {
  const type = DllamaArchType[arch];
  if (type === undefined) {
    throw new ConvertError('UnsupportedArchitecture', `distributed-llama does not run ${arch} models (it runs ${Object.keys(DllamaArchType).join(', ')})`);
  }
  return type;
}

/** convert-hf.py `parseRmsNormEpsilon`: the runtime knows only 1e-5 and 1e-6. */
function normEpsilonCode(eps: number): number {
  if (eps === 1e-5) return 5;
  if (eps === 1e-6) return 6;
  throw new ConvertError('UnsupportedConfig', `distributed-llama supports rms_norm_eps 1e-5 or 1e-6, not ${eps}`);
}

/** magic | header size | pairs. The size counts magic and itself (writer.py: `len(header) * 2 + len(data)`). */
function encodeKeyValueHeader(magic: number, pairs: readonly (readonly [number, number])[]): Uint8Array {
  const bytes = new Uint8Array(8 + pairs.length * 8);
  const view = new DataView(bytes.buffer);
  view.setInt32(0, magic, true);
  view.setInt32(4, bytes.length, true);
  pairs.forEach(([k, v], i) => {
    view.setInt32(8 + i * 8, k, true);
    view.setInt32(12 + i * 8, v, true);
  });
  return bytes;
}

/** A planned `.m` file. */
export interface DllamaModelPlan {
  headerBytes: Uint8Array;
  header: [DllamaHeaderKeyName, number][];
  /** In file order; each is written as `byteLength` bytes of `format` data, no padding. */
  tensors: PlannedTensor[];
  totalSize: number;
}

/**
 * Plans a distributed-llama model file.
 * @param hasTensor whether the checkpoint has a tensor (for the `lm_head` -> embedding fallback)
 */
export function planDllama(spec: ModelSpec, weights: WeightsFormat, hasTensor: (name: string) => boolean): DllamaModelPlan {
  const header = dllamaHeaderEntries(spec, weights);
  const headerBytes = encodeKeyValueHeader(
    DLLAMA_MODEL_MAGIC,
    header.map(([k, v]) => [DllamaHeaderKey[k], v] as const),
  );
  const tensors = planTensors(spec, 'dllama', weights, hasTensor);
  const totalSize = tensors.reduce((n, t) => n + t.byteLength, headerBytes.length);
  return { headerBytes, header, tensors, totalSize };
}

/**
 * Writes a `.m` file atomically: header, then `getData(i)` for each planned tensor in order.
 * Each tensor's bytes must be exactly its planned `byteLength`.
 */
export async function writeDllamaModel(
  path: string | OutputTarget,
  plan: DllamaModelPlan,
  getData: (index: number, tensor: PlannedTensor) => TensorData | Promise<TensorData>,
): Promise<void> {
  await writeFileAtomically(path, async (sink) => {
    await sink.write(plan.headerBytes);
    for (let i = 0; i < plan.tensors.length; i++) {
      const tensor = plan.tensors[i] as PlannedTensor;
      const n = await writeTensorData(sink, await getData(i, tensor));
      if (n !== tensor.byteLength) throw new RangeError(`tensor ${tensor.name}: got ${n} bytes, expected ${tensor.byteLength}`);
    }
    if (sink.bytesWritten !== plan.totalSize) throw new RangeError(`wrote ${sink.bytesWritten} bytes, planned ${plan.totalSize}`);
  });
}

// ---------------------------------------------------------------------------------------------
// Tokenizer

const utf8 = new TextEncoder();

/**
 * The `.t` file for a tokenizer, exactly as tokenizer-writer.py `writeTokenizer` lays it out.
 *
 * Content choices (the reference's convert-tokenizer-hf.py is the model): token bytes and scores
 * come from {@link ParsedTokenizer} (-id scores for BPE vocabularies), the EOS list is the
 * tokenizer's EOS followed by config.json's other EOS ids, and `add_bos` is false when neither
 * tokenizer_config.json nor the post-processor asks for a BOS (the reference defaults to true,
 * which would prepend Qwen's `<|endoftext|>` to every prompt).
 * @throws ConvertError `UnsupportedConfig` without a BOS or EOS token: the runtime needs both
 *   (it even splits regular from special tokens at the BOS id).
 */
export function encodeDllamaTokenizer(tok: ParsedTokenizer): Uint8Array {
  checkSpecialIds(tok);
  const template = tok.chatTemplate ? utf8.encode(tok.chatTemplate) : null;
  const maxTokenLength = tok.tokenBytes.reduce((m, b) => Math.max(m, b.length), 0);
  const pairs: [number, number][] = [
    [DllamaTokenizerKey.bos_id, tok.bosId as number],
    [DllamaTokenizerKey.version, 1],
    [DllamaTokenizerKey.vocab_size, tok.tokenBytes.length],
    [DllamaTokenizerKey.max_token_length, maxTokenLength],
  ];
  if (template) pairs.push([DllamaTokenizerKey.chat_template, template.length]);
  pairs.push([DllamaTokenizerKey.n_eos_tokens, tok.eosIds.length], [DllamaTokenizerKey.add_bos, tok.addBos === true ? 1 : 0]);
  const header = encodeKeyValueHeader(DLLAMA_TOKENIZER_MAGIC, pairs);

  const tokensBytes = tok.tokenBytes.reduce((n, b) => n + 8 + b.length, 0);
  const out = new Uint8Array(header.length + (template?.length ?? 0) + tok.eosIds.length * 4 + tokensBytes);
  const view = new DataView(out.buffer);
  out.set(header, 0);
  let at = header.length;
  if (template) {
    out.set(template, at);
    at += template.length;
  }
  for (const id of tok.eosIds) {
    view.setInt32(at, id, true);
    at += 4;
  }
  tok.tokenBytes.forEach((bytes, i) => {
    if (bytes.length === 0) throw new ConvertError('UnsupportedConfig', `token ${i} has no bytes`);
    view.setFloat32(at, tok.scores[i] ?? 0, true);
    view.setUint32(at + 4, bytes.length, true);
    out.set(bytes, at + 8);
    at += 8 + bytes.length;
  });
  return out;
}

/** Writes the `.t` file atomically; returns its size. */
export async function writeDllamaTokenizer(path: string | OutputTarget, tok: ParsedTokenizer): Promise<number> {
  const bytes = encodeDllamaTokenizer(tok);
  await writeFileAtomically(path, (sink) => sink.write(bytes));
  return bytes.length;
}

// ---------------------------------------------------------------------------------------------
// What distributed-llama can serve
//
// A `.m`/`.t` pair that distributed-llama 0.16.4 loads but cannot serve is worse than none: the
// pipeline would publish it and a pool would start it. These checks refuse such a conversion
// before any tensor is read or anything written, each with a ConvertError naming the reason.

/**
 * Refuses weights distributed-llama cannot run (f16, q80: shared/weights.ts `dllamaBuffer`).
 * @throws ConvertError `UnsupportedWeights`
 */
export function checkDllamaWeights(weights: WeightsFormat): void {
  const problem = dllamaWeightsProblem(weights);
  if (problem !== null) throw new ConvertError('UnsupportedWeights', `${problem}; convert to ${DLLAMA_RUNNABLE_WEIGHTS.join(' or ')}`);
}

/**
 * Refuses a model distributed-llama cannot run in `weights` on any number of nodes: weights it
 * cannot run, an architecture it does not know, and dimensions that split into no topology, not
 * even 1 node (shared/dllama-topology.ts; the message names each dimension, and the weights that
 * would run, if any).
 * @throws ConvertError `UnsupportedWeights`, `UnsupportedArchitecture`, `NoTopology`
 */
export function checkDllamaModel(spec: ModelSpec, weights: WeightsFormat): void {
  checkDllamaWeights(weights);
  dllamaArchType(spec.arch);
  // One node is the least any dimension asks of: what stops it stops every topology.
  const problems = dllamaSplitProblems(spec, weights, 1);
  if (problems.length === 0) return;
  const others = DLLAMA_RUNNABLE_WEIGHTS.filter((w) => w !== weights).flatMap((w) => {
    const nodes = dllamaNodeCounts(spec, w);
    return nodes.length > 0 ? [`${w} runs on ${nodes.join(', ')} node${nodes.length === 1 && nodes[0] === 1 ? '' : 's'}`] : [];
  });
  throw new ConvertError(
    'NoTopology',
    `distributed-llama cannot run this model in ${weights} on any number of nodes: ${problems.join('; ')}${others.length > 0 ? ` (${others.join('; ')})` : ''}`,
  );
}

/** The chat templates dllama-api 0.16.4 serves, in the order it looks for them (src/tokenizer.cpp `ChatTemplateGenerator`): the text it looks for in the tokenizer's template. */
export const DLLAMA_CHAT_TEMPLATES = [
  { kind: 'llama2', marker: '[INST]' },
  { kind: 'llama3', marker: '<|start_header_id|>' },
  { kind: 'deepSeek3', marker: '<\uff5cAssistant\uff5c>' },
  { kind: 'chatml', marker: '<|im_start|>' },
] as const;
export type DllamaChatTemplateKind = (typeof DLLAMA_CHAT_TEMPLATES)[number]['kind'];

/** The chat template dllama-api would take `template` for, or null when it recognizes none. */
export function dllamaChatTemplateKind(template: string): DllamaChatTemplateKind | null {
  return DLLAMA_CHAT_TEMPLATES.find((t) => template.includes(t.marker))?.kind ?? null;
}

/**
 * Refuses a tokenizer distributed-llama cannot serve chat with:
 * - no BOS or no EOS id (its tokenizer needs both);
 * - a byte-level BPE vocabulary with regular tokens at or above BOS. distributed-llama takes the
 *   ids below BOS as its regular vocabulary and merges only those (src/tokenizer.cpp:
 *   `regularVocabSize = bosId`); every id from BOS on is matched whole, lowest id first. Llama 3
 *   and Qwen put their special tokens, BOS among them, after the vocabulary, so this works; a
 *   GPT-2-style vocabulary puts them first (SmolLM2: BOS is id 1), and every prompt then reaches
 *   the model as single bytes, never merged (SmolLM2 answers "The capital of France is" with one
 *   token and stops). distributed-llama's own converter refuses those tokenizers
 *   (`GPT2Tokenizer`). A SentencePiece vocabulary (Llama 2: BOS is id 1) is split the same way,
 *   into its lowest-id pieces (its `<0xNN>` bytes); its own converter takes those
 *   (`LlamaTokenizer`), and so does this one;
 * - no chat template, or one dllama-api recognizes by none of {@link DLLAMA_CHAT_TEMPLATES}: it
 *   stops at start ("The tokenizer does not include chat template", "Not supported chat template").
 * @throws ConvertError `UnsupportedConfig` (BOS, EOS), `UnsupportedTokenizer`, `UnsupportedChatTemplate`
 */
export function checkDllamaTokenizer(tok: ParsedTokenizer): void {
  checkSpecialIds(tok);
  const bos = tok.bosId as number;
  if (tok.kind === 'byte-level-bpe') {
    let regular = 0;
    let above = 0;
    tok.types.forEach((type, id) => {
      if (type !== TokenType.normal) return;
      regular++;
      if (id >= bos) above++;
    });
    if (above > 0) {
      throw new ConvertError(
        'UnsupportedTokenizer',
        `distributed-llama takes the ids below BOS as its regular vocabulary and merges only those, and this byte-level BPE vocabulary has BOS (${JSON.stringify(tok.tokens[bos])}, id ${bos}) before ${above === regular ? 'all' : above} of its ${regular} regular tokens (special tokens first, GPT-2 style): every prompt would reach the model as single bytes; serve this model with llama.cpp (gguf)`,
      );
    }
  }
  const markers = DLLAMA_CHAT_TEMPLATES.map((t) => `${JSON.stringify(t.marker)} (${t.kind})`).join(', ');
  if (tok.chatTemplate === null) {
    throw new ConvertError(
      'UnsupportedChatTemplate',
      `distributed-llama's dllama-api serves chat only with a chat template it recognizes (${markers}), and the tokenizer has none (tokenizer_config.json chat_template, chat_template.jinja): it would stop at start with "The tokenizer does not include chat template"`,
    );
  }
  if (dllamaChatTemplateKind(tok.chatTemplate) === null) {
    throw new ConvertError(
      'UnsupportedChatTemplate',
      `distributed-llama's dllama-api recognizes a chat template by ${markers}, and the tokenizer's has none of them: it would stop at start with "Not supported chat template"`,
    );
  }
}

/** @throws ConvertError `UnsupportedConfig` without a BOS or EOS token: distributed-llama needs both */
function checkSpecialIds(tok: ParsedTokenizer): void {
  if (tok.bosId === null) throw new ConvertError('UnsupportedConfig', 'distributed-llama needs a BOS token id; the tokenizer has none');
  if (tok.eosIds.length === 0) throw new ConvertError('UnsupportedConfig', 'distributed-llama needs an EOS token id; the tokenizer has none');
}

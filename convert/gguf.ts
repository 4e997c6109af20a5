/**
 * GGUF v3 writer (the llama.cpp file format; spec: ggml docs/gguf.md, reference: gguf-py
 * gguf_writer.py). Layout, all little-endian:
 *
 *   magic "GGUF" | u32 version=3 | u64 n_tensors | u64 n_kv
 *   n_kv x (string key | u32 value type | value)
 *   n_tensors x (string name | u32 n_dims | u64 ne[n_dims] | u32 ggml type | u64 offset)
 *   zero padding to `general.alignment` (default 32)
 *   tensor data, each tensor padded to the alignment; offsets are relative to the data start
 *
 * Strings are u64 byte length + UTF-8 bytes; arrays are u32 item type + u64 count + items.
 * `ne[0]` is the innermost (contiguous) dimension: a PyTorch `[rows, cols]` matrix is `[cols, rows]`.
 *
 * Everything before the tensor data depends only on names, types and shapes, so {@link planGguf}
 * computes it up front and a converter streams the tensors in one pass.
 */
import { type OutputTarget, type TensorData, writeFileAtomically, writeTensorData } from './atomic-file';
import { type ModelSpec, type PlannedTensor, planTensors } from './arch';
import { ConvertError } from './errors';
import { type ParsedTokenizer, TokenType } from './tokenizer';
import type { WeightsFormat } from './types';
import { GGML_TYPES, ggmlLayout } from '../shared/ggml';
import { WEIGHTS, WEIGHTS_FORMATS, weightsFormat } from '../shared/weights';

export const GGUF_MAGIC = 0x46554747; // "GGUF" read as a little-endian u32
export const GGUF_VERSION = 3;
export const GGUF_DEFAULT_ALIGNMENT = 32;
/** ggml's quantization format version (GGML_QNT_VERSION) that llama.cpp's converter records. */
export const GGML_QUANT_VERSION = 2;

/** Metadata value type ids (gguf-py `GGUFValueType`). */
export const GgufValueTypeId = {
  uint8: 0,
  int8: 1,
  uint16: 2,
  int16: 3,
  uint32: 4,
  int32: 5,
  float32: 6,
  bool: 7,
  string: 8,
  array: 9,
  uint64: 10,
  int64: 11,
  float64: 12,
} as const;
export type GgufValueTypeName = keyof typeof GgufValueTypeId;

export type GgufNumberType = 'uint8' | 'int8' | 'uint16' | 'int16' | 'uint32' | 'int32' | 'float32' | 'float64';
export type GgufBigIntType = 'uint64' | 'int64';

/** An array value (items of one type; arrays may nest). */
export type GgufArray =
  | { type: 'array'; itemType: GgufNumberType; value: ArrayLike<number> }
  | { type: 'array'; itemType: GgufBigIntType; value: ArrayLike<bigint> }
  | { type: 'array'; itemType: 'bool'; value: readonly boolean[] }
  | { type: 'array'; itemType: 'string'; value: readonly string[] }
  | { type: 'array'; itemType: 'array'; value: readonly GgufArray[] };

/** A typed metadata value. 64-bit integers are bigints so that every value round-trips. */
export type GgufValue =
  | { type: GgufNumberType; value: number }
  | { type: GgufBigIntType; value: bigint }
  | { type: 'bool'; value: boolean }
  | { type: 'string'; value: string }
  | GgufArray;

/** A metadata key/value pair. */
export type GgufKv = { key: string } & GgufValue;

/** The ggml type names of the encodings we write: one per weights format (shared/weights.ts). */
type WrittenGgmlName = (typeof WEIGHTS)[WeightsFormat]['ggml'];
/** ggml tensor type ids of the encodings we write, by name (`GgmlType.Q4_0`). */
export const GgmlType = Object.fromEntries(WEIGHTS_FORMATS.map((f) => [WEIGHTS[f].ggml, GGML_TYPES[WEIGHTS[f].ggml].id])) as {
  readonly [N in WrittenGgmlName]: (typeof GGML_TYPES)[N]['id'];
};
export type GgmlTypeId = (typeof GgmlType)[keyof typeof GgmlType];

/** The ggml type holding a weights format (ggml Q4_0/Q8_0 blocks are the same bytes as dllama q40/q80). */
export function ggmlTypeOf(format: WeightsFormat): GgmlTypeId {
  return weightsFormat(format).ggmlType as GgmlTypeId;
}

/** `general.file_type` (llama.cpp `llama_ftype`) of a model whose matrices use `format`. */
export function llamaFileType(format: WeightsFormat): number {
  return WEIGHTS[format].llamaFileType;
}

/** A tensor as described in the GGUF header. */
export interface GgufTensorInfo {
  name: string;
  ggmlType: GgmlTypeId;
  /** ggml order: `dims[0]` is the innermost dimension. */
  dims: readonly number[];
}

/** Bytes of a tensor's data. @throws ConvertError `BadBlockSize` */
export function ggmlByteLength(ggmlType: GgmlTypeId, dims: readonly number[]): number {
  const layout = ggmlLayout(ggmlType);
  if (!layout) throw new RangeError(`unsupported ggml type ${String(ggmlType)}`);
  const { blockSize, typeSize } = layout;
  const inner = dims[0] ?? 1;
  if (inner % blockSize !== 0)
    throw new ConvertError('BadBlockSize', `ne[0]=${inner} is not a multiple of the ${blockSize}-value block of ggml type ${ggmlType}`);
  return (dims.reduce((a, b) => a * b, 1) / blockSize) * typeSize;
}

/** Rounds `n` up to a multiple of `alignment`. */
export function alignUp(n: number, alignment: number): number {
  return Math.ceil(n / alignment) * alignment;
}

// ---------------------------------------------------------------------------------------------
// Encoding

const INT_RANGES: Record<'uint8' | 'int8' | 'uint16' | 'int16' | 'uint32' | 'int32', readonly [number, number]> = {
  uint8: [0, 0xff],
  int8: [-0x80, 0x7f],
  uint16: [0, 0xffff],
  int16: [-0x8000, 0x7fff],
  uint32: [0, 0xffffffff],
  int32: [-0x80000000, 0x7fffffff],
};

type IntType = keyof typeof INT_RANGES;
const INT_WRITERS: Record<IntType, readonly [number, (view: DataView, at: number, v: number) => void]> = {
  uint8: [1, (d, at, v) => d.setUint8(at, v)],
  int8: [1, (d, at, v) => d.setInt8(at, v)],
  uint16: [2, (d, at, v) => d.setUint16(at, v, true)],
  int16: [2, (d, at, v) => d.setInt16(at, v, true)],
  uint32: [4, (d, at, v) => d.setUint32(at, v, true)],
  int32: [4, (d, at, v) => d.setInt32(at, v, true)],
};

/** Growable little-endian byte buffer. */
class ByteBuilder {
  private buf = Buffer.alloc(1 << 16);
  private view = new DataView(this.buf.buffer, this.buf.byteOffset, this.buf.length);
  length = 0;

  private reserve(n: number): void {
    if (this.length + n <= this.buf.length) return;
    let size = this.buf.length * 2;
    while (size < this.length + n) size *= 2;
    const next = Buffer.alloc(size);
    next.set(this.buf.subarray(0, this.length));
    this.buf = next;
    this.view = new DataView(next.buffer, next.byteOffset, next.length);
  }

  u8(v: number): void {
    this.reserve(1);
    this.view.setUint8(this.length, v);
    this.length += 1;
  }
  u32(v: number): void {
    this.reserve(4);
    this.view.setUint32(this.length, v, true);
    this.length += 4;
  }
  u64(v: number | bigint): void {
    this.reserve(8);
    this.view.setBigUint64(this.length, BigInt(v), true);
    this.length += 8;
  }
  bytes(b: Uint8Array): void {
    this.reserve(b.length);
    this.buf.set(b, this.length);
    this.length += b.length;
  }
  string(s: string): void {
    // UTF-8 straight into the buffer (as TextEncoder would: a lone surrogate becomes U+FFFD);
    // a tokenizer's vocabulary and merges are ~10^5 strings, so no array per string.
    this.reserve(8 + 3 * s.length);
    const n = this.buf.write(s, this.length + 8, 'utf8');
    this.view.setBigUint64(this.length, BigInt(n), true);
    this.length += 8 + n;
  }
  zeros(n: number): void {
    this.reserve(n);
    this.buf.fill(0, this.length, this.length + n);
    this.length += n;
  }
  number(type: GgufNumberType, v: number, where: string): void {
    if (type === 'float32' || type === 'float64') {
      if (typeof v !== 'number') throw new TypeError(`${where}: ${type} value must be a number`);
      this.reserve(8);
      if (type === 'float32') this.view.setFloat32(this.length, v, true);
      else this.view.setFloat64(this.length, v, true);
      this.length += type === 'float32' ? 4 : 8;
      return;
    }
    const [min, max] = INT_RANGES[type];
    if (!Number.isInteger(v) || v < min || v > max) throw new RangeError(`${where}: ${String(v)} is not a valid ${type}`);
    const [size, set] = INT_WRITERS[type];
    this.reserve(size);
    set(this.view, this.length, v);
    this.length += size;
  }
  bigint(type: GgufBigIntType, v: bigint, where: string): void {
    if (typeof v !== 'bigint') throw new TypeError(`${where}: ${type} value must be a bigint`);
    const fits = type === 'uint64' ? BigInt.asUintN(64, v) === v : BigInt.asIntN(64, v) === v;
    if (!fits) throw new RangeError(`${where}: ${v} is not a valid ${type}`);
    this.reserve(8);
    if (type === 'uint64') this.view.setBigUint64(this.length, v, true);
    else this.view.setBigInt64(this.length, v, true);
    this.length += 8;
  }
  result(): Uint8Array {
    return new Uint8Array(this.buf.subarray(0, this.length)); // a copy (Buffer#slice would be a view)
  }
}

function writeArrayBody(out: ByteBuilder, a: GgufArray, where: string): void {
  out.u32(GgufValueTypeId[a.itemType]);
  out.u64(a.value.length);
  switch (a.itemType) {
    case 'bool':
      for (const v of a.value) {
        if (typeof v !== 'boolean') throw new TypeError(`${where}: bool array holds a ${typeof v}`);
        out.u8(v ? 1 : 0);
      }
      return;
    case 'string':
      for (const v of a.value) {
        if (typeof v !== 'string') throw new TypeError(`${where}: string array holds a ${typeof v}`);
        out.string(v);
      }
      return;
    case 'array':
      a.value.forEach((inner, i) => writeArrayBody(out, inner, `${where}[${i}]`));
      return;
    case 'uint64':
    case 'int64':
      for (let i = 0; i < a.value.length; i++) out.bigint(a.itemType, a.value[i] as bigint, `${where}[${i}]`);
      return;
    default:
      for (let i = 0; i < a.value.length; i++) out.number(a.itemType, a.value[i] as number, `${where}[${i}]`);
  }
}

function writeValue(out: ByteBuilder, v: GgufValue, where: string): void {
  out.u32(GgufValueTypeId[v.type]);
  switch (v.type) {
    case 'bool':
      if (typeof v.value !== 'boolean') throw new TypeError(`${where}: bool value must be a boolean`);
      out.u8(v.value ? 1 : 0);
      return;
    case 'string':
      if (typeof v.value !== 'string') throw new TypeError(`${where}: string value must be a string`);
      out.string(v.value);
      return;
    case 'array':
      writeArrayBody(out, v, where);
      return;
    case 'uint64':
    case 'int64':
      out.bigint(v.type, v.value, where);
      return;
    default:
      out.number(v.type, v.value, where);
  }
}

// ---------------------------------------------------------------------------------------------
// Planning

/** Everything a streaming writer needs. */
export interface GgufPlan {
  /** Header, metadata, tensor infos and the zero padding up to the data section. */
  headerBytes: Uint8Array;
  alignment: number;
  /** Absolute offset of the data section (= `headerBytes.length`). */
  dataOffset: number;
  /** Offsets relative to the data section, as stored in the tensor infos. */
  tensorOffsets: number[];
  tensorByteLengths: number[];
  /** Size of the complete file. */
  totalSize: number;
  /** Zero bytes to write after tensor `i` (every tensor, the last included, ends aligned, as gguf-py does). */
  paddingAfter(i: number): number;
}

/**
 * Lays out a GGUF file. If `alignment` is not the default and `kvs` has no `general.alignment`,
 * that key is appended.
 * @throws RangeError/TypeError for malformed values, duplicate keys or tensor names;
 *   ConvertError `BadBlockSize` for shapes a block type cannot hold.
 */
export function planGguf(kvs: readonly GgufKv[], tensors: readonly GgufTensorInfo[], options: { alignment?: number } = {}): GgufPlan {
  const allKvs = [...kvs];
  const alignKv = allKvs.find((kv) => kv.key === 'general.alignment');
  let alignment = options.alignment ?? GGUF_DEFAULT_ALIGNMENT;
  if (alignKv) {
    if (alignKv.type !== 'uint32') throw new TypeError('general.alignment must be a uint32');
    if (options.alignment !== undefined && options.alignment !== alignKv.value) throw new RangeError('general.alignment disagrees with options.alignment');
    alignment = alignKv.value;
  } else if (alignment !== GGUF_DEFAULT_ALIGNMENT) {
    allKvs.push({ key: 'general.alignment', type: 'uint32', value: alignment });
  }
  if (!Number.isInteger(alignment) || alignment <= 0 || (alignment & (alignment - 1)) !== 0) {
    throw new RangeError(`alignment ${alignment} is not a power of two`);
  }
  const keys = new Set<string>();
  for (const kv of allKvs) {
    if (keys.has(kv.key)) throw new RangeError(`duplicate GGUF key ${kv.key}`);
    keys.add(kv.key);
  }

  const out = new ByteBuilder();
  out.u32(GGUF_MAGIC);
  out.u32(GGUF_VERSION);
  out.u64(tensors.length);
  out.u64(allKvs.length);
  for (const kv of allKvs) {
    out.string(kv.key);
    writeValue(out, kv, kv.key);
  }

  const names = new Set<string>();
  const tensorOffsets: number[] = [];
  const tensorByteLengths: number[] = [];
  let offset = 0;
  for (const t of tensors) {
    if (names.has(t.name)) throw new RangeError(`duplicate tensor name ${t.name}`);
    names.add(t.name);
    if (t.dims.length < 1 || t.dims.length > 4 || t.dims.some((d) => !Number.isSafeInteger(d) || d <= 0)) {
      throw new RangeError(`tensor ${t.name}: bad dims [${t.dims.join(', ')}]`);
    }
    const bytes = ggmlByteLength(t.ggmlType, t.dims);
    out.string(t.name);
    out.u32(t.dims.length);
    for (const d of t.dims) out.u64(d);
    out.u32(t.ggmlType);
    out.u64(offset);
    tensorOffsets.push(offset);
    tensorByteLengths.push(bytes);
    offset += alignUp(bytes, alignment);
  }
  out.zeros(alignUp(out.length, alignment) - out.length);
  const headerBytes = out.result();
  return {
    headerBytes,
    alignment,
    dataOffset: headerBytes.length,
    tensorOffsets,
    tensorByteLengths,
    totalSize: headerBytes.length + offset,
    paddingAfter(i: number): number {
      const n = tensorByteLengths[i];
      if (n === undefined) throw new RangeError(`no tensor ${i}`);
      return alignUp(n, alignment) - n;
    },
  };
}

/**
 * Writes a complete GGUF file at `path` in one pass (via a temporary name, then rename).
 * `getData(i)` is called once per tensor, in order; its bytes must match the planned length.
 * @returns the file's plan (sizes and offsets)
 */
export async function writeGgufFile(
  path: string | OutputTarget,
  kvs: readonly GgufKv[],
  tensors: readonly GgufTensorInfo[],
  getData: (index: number, tensor: GgufTensorInfo) => TensorData | Promise<TensorData>,
  options: { alignment?: number } = {},
): Promise<GgufPlan> {
  const plan = planGguf(kvs, tensors, options);
  await writeGgufPlanned(path, plan, tensors, getData);
  return plan;
}

/** {@link writeGgufFile} with the layout already planned (by {@link planGguf} of the same `tensors`). */
export async function writeGgufPlanned(
  path: string | OutputTarget,
  plan: GgufPlan,
  tensors: readonly GgufTensorInfo[],
  getData: (index: number, tensor: GgufTensorInfo) => TensorData | Promise<TensorData>,
): Promise<void> {
  if (plan.tensorByteLengths.length !== tensors.length) throw new RangeError(`the plan has ${plan.tensorByteLengths.length} tensors, not ${tensors.length}`);
  await writeFileAtomically(path, async (sink) => {
    await sink.write(plan.headerBytes);
    for (let i = 0; i < tensors.length; i++) {
      const tensor = tensors[i] as GgufTensorInfo;
      const n = await writeTensorData(sink, await getData(i, tensor));
      if (n !== plan.tensorByteLengths[i]) throw new RangeError(`tensor ${tensor.name}: got ${n} bytes, expected ${plan.tensorByteLengths[i]}`);
      await sink.write(new Uint8Array(plan.paddingAfter(i)));
    }
    if (sink.bytesWritten !== plan.totalSize) throw new RangeError(`wrote ${sink.bytesWritten} bytes, planned ${plan.totalSize}`);
  });
}

// ---------------------------------------------------------------------------------------------
// llama.cpp model metadata

/** Options of a GGUF model file. */
export interface GgufModelOptions {
  spec: ModelSpec;
  tokenizer: ParsedTokenizer;
  /** Encoding of the matrices. */
  weights: WeightsFormat;
  /** `general.name` */
  name: string;
}

/**
 * The metadata llama.cpp reads for `llama` and `qwen3` models, in the order convert_hf_to_gguf.py
 * writes it: general keys, hyper-parameters, file type, tokenizer.
 *
 * Differences from the reference converter, all harmless to llama.cpp's loader:
 * `rope.freq_base`, `attention.key_length`/`value_length`, `vocab_size` and `rope.dimension_count`
 * are always written (the reference writes some only when config.json has them, or only for
 * llama); no `general.*` model-card keys beyond the name.
 */
export function ggufModelMetadata({ spec, tokenizer, weights, name }: GgufModelOptions): GgufKv[] {
  const a = spec.arch;
  const u32 = (key: string, value: number): GgufKv => ({ key, type: 'uint32', value });
  const f32 = (key: string, value: number): GgufKv => ({ key, type: 'float32', value });
  const str = (key: string, value: string): GgufKv => ({ key, type: 'string', value });
  const kvs: GgufKv[] = [
    str('general.architecture', a),
    str('general.type', 'model'),
    str('general.name', name),
    u32(`${a}.block_count`, spec.layers),
    u32(`${a}.context_length`, spec.ctx),
    u32(`${a}.embedding_length`, spec.hidden),
    u32(`${a}.feed_forward_length`, spec.intermediate),
    u32(`${a}.attention.head_count`, spec.heads),
    u32(`${a}.attention.head_count_kv`, spec.kvHeads),
    f32(`${a}.rope.freq_base`, spec.ropeTheta),
    f32(`${a}.attention.layer_norm_rms_epsilon`, spec.rmsNormEps),
    u32(`${a}.attention.key_length`, spec.headDim),
    u32(`${a}.attention.value_length`, spec.headDim),
    u32('general.file_type', llamaFileType(weights)),
    u32(`${a}.vocab_size`, spec.vocab),
    u32(`${a}.rope.dimension_count`, spec.headDim),
    u32('general.quantization_version', GGML_QUANT_VERSION),
  ];
  kvs.push(...ggufTokenizerMetadata(tokenizer, spec.vocab));
  return kvs;
}

/**
 * `tokenizer.*` metadata. The token list is padded with `[PADn]` unused tokens up to the model's
 * vocabulary size, as llama.cpp's converter does (Qwen3's embedding has more rows than tokens).
 * @throws ConvertError `UnsupportedConfig` when the tokenizer has more tokens than the model.
 */
export function ggufTokenizerMetadata(tok: ParsedTokenizer, vocabSize: number): GgufKv[] {
  if (tok.tokens.length > vocabSize) {
    throw new ConvertError('UnsupportedConfig', `tokenizer has ${tok.tokens.length} tokens but the model's vocab_size is ${vocabSize}`);
  }
  const tokens = [...tok.tokens];
  const types: number[] = [...tok.types];
  const scores = Array.from(tok.scores);
  for (let i = tokens.length; i < vocabSize; i++) {
    tokens.push(`[PAD${i}]`);
    types.push(TokenType.unused);
    scores.push(-1000);
  }
  const kvs: GgufKv[] = [
    { key: 'tokenizer.ggml.model', type: 'string', value: tok.ggmlModel },
    { key: 'tokenizer.ggml.pre', type: 'string', value: tok.pre },
    { key: 'tokenizer.ggml.tokens', type: 'array', itemType: 'string', value: tokens },
  ];
  // gpt2 vocabularies carry no scores in llama.cpp's converter; SentencePiece ones need them.
  if (tok.ggmlModel === 'llama') kvs.push({ key: 'tokenizer.ggml.scores', type: 'array', itemType: 'float32', value: scores });
  kvs.push({ key: 'tokenizer.ggml.token_type', type: 'array', itemType: 'int32', value: types });
  if (tok.merges.length > 0) kvs.push({ key: 'tokenizer.ggml.merges', type: 'array', itemType: 'string', value: tok.merges });
  const id = (key: string, v: number | null): void => {
    if (v !== null) kvs.push({ key, type: 'uint32', value: v });
  };
  id('tokenizer.ggml.bos_token_id', tok.bosId);
  id('tokenizer.ggml.eos_token_id', tok.eosId);
  id('tokenizer.ggml.unknown_token_id', tok.unkId);
  id('tokenizer.ggml.padding_token_id', tok.padId);
  id('tokenizer.ggml.eot_token_id', tok.eotId);
  if (tok.addBos !== null) kvs.push({ key: 'tokenizer.ggml.add_bos_token', type: 'bool', value: tok.addBos });
  if (tok.addEos !== null) kvs.push({ key: 'tokenizer.ggml.add_eos_token', type: 'bool', value: tok.addEos });
  if (tok.addSpacePrefix !== null) kvs.push({ key: 'tokenizer.ggml.add_space_prefix', type: 'bool', value: tok.addSpacePrefix });
  if (tok.chatTemplate !== null) kvs.push({ key: 'tokenizer.chat_template', type: 'string', value: tok.chatTemplate });
  for (const t of tok.namedChatTemplates) kvs.push({ key: `tokenizer.chat_template.${t.name}`, type: 'string', value: t.template });
  if (tok.namedChatTemplates.length > 0) {
    kvs.push({ key: 'tokenizer.chat_templates', type: 'array', itemType: 'string', value: tok.namedChatTemplates.map((t) => t.name) });
  }
  return kvs;
}

/** The GGUF header description of planned tensors. */
export function ggufTensorInfos(plan: readonly PlannedTensor[]): GgufTensorInfo[] {
  return plan.map((t) => ({ name: t.name, ggmlType: ggmlTypeOf(t.format), dims: t.shape }));
}

/** A GGUF model file, planned: which tensors to stream in which order, and the header bytes. */
export interface GgufModelPlan {
  tensors: PlannedTensor[];
  kvs: GgufKv[];
  layout: GgufPlan;
}

/**
 * Plans a complete llama.cpp model file from a spec, tokenizer and the checkpoint's tensor names.
 * The caller writes `layout.headerBytes`, then each `tensors[i]` encoded as `tensors[i].format`
 * followed by `layout.paddingAfter(i)` zero bytes.
 */
export function planGgufModel(
  options: GgufModelOptions & {
    hasTensor: (name: string) => boolean;
    /** `planTensors(spec, 'gguf', weights, hasTensor)`, if the caller has it already. */
    tensors?: PlannedTensor[];
  },
): GgufModelPlan {
  const tensors = options.tensors ?? planTensors(options.spec, 'gguf', options.weights, options.hasTensor);
  const kvs = ggufModelMetadata(options);
  const layout = planGguf(kvs, ggufTensorInfos(tensors));
  layout.tensorByteLengths.forEach((n, i) => {
    if (n !== tensors[i]?.byteLength) throw new Error(`internal: GGUF size of ${tensors[i]?.name} disagrees with the plan`);
  });
  return { tensors, kvs, layout };
}

/**
 * GGUF tensor data as the converter's {@link SourceTensor}s: F32/F16/BF16 tensors as they are,
 * and the block-quantized Q8_0, Q4_0 and Q4_1 expanded to float32 as they are read (ggml's
 * `dequantize_row_*`), so the safetensors pipeline re-encodes them with the usual encoders.
 *
 * Every other ggml type (K-quants, IQ types, Q5_0/Q5_1, integer types) is refused by
 * {@link checkDequantizable}: their values are not worth re-deriving here, and the safetensors
 * repository a GGUF was made from gives better weights than a second quantization would.
 *
 * Block layouts (ggml-common.h), little-endian, 32 values per block:
 * - Q8_0 (34 bytes): fp16 d | 32 × int8 q;              x = q·d
 * - Q4_0 (18 bytes): fp16 d | 16 bytes of nibbles;      x = (q − 8)·d
 * - Q4_1 (20 bytes): fp16 d | fp16 m | 16 nibble bytes; x = q·d + m
 * Nibbles: byte j holds element j (low) and element j + 16 (high).
 * q·d is exact in float32 (at most 8 + 11 significant bits); Q4_1's `+ m` rounds once to float32.
 */
import { ConvertError } from './errors';
import type { GgufFile, GgufTensorEntry } from './gguf-reader';
import { decodeToF32, F16_TABLE, QK } from './quant';
import type { ByteSource, SourceDType, SourceTensor } from './types';
import { GGML_TYPES, ggmlTypeName } from '../shared/ggml';

/** The types read as they are: ggml id → the converter's element type (the same names). */
const PLAIN_TYPES: ReadonlyMap<number, SourceDType> = new Map((['F32', 'F16', 'BF16'] as const).map((t) => [GGML_TYPES[t].id, t]));

const Q8_0_BYTES = GGML_TYPES.Q8_0.typeSize;
const Q4_0_BYTES = GGML_TYPES.Q4_0.typeSize;
const Q4_1_BYTES = GGML_TYPES.Q4_1.typeSize;

/** A block-quantized type this module expands: bytes per 32-value block, and its kernel. */
interface BlockType {
  blockBytes: number;
  dequantize(bytes: Uint8Array, out: Float32Array): void;
}

/** ggml Q8_0 blocks → float32 values (`out.length` = 32 × blocks). */
export function dequantizeQ80(bytes: Uint8Array, out: Float32Array): void {
  const q = new Int8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  for (let b = 0, o = 0; o < out.length; b += Q8_0_BYTES, o += QK) {
    const d = F16_TABLE[bytes[b]! | (bytes[b + 1]! << 8)]!;
    for (let j = 0; j < QK; j++) out[o + j] = q[b + 2 + j]! * d;
  }
}

/** ggml Q4_0 blocks → float32 values. */
export function dequantizeQ40(bytes: Uint8Array, out: Float32Array): void {
  for (let b = 0, o = 0; o < out.length; b += Q4_0_BYTES, o += QK) {
    const d = F16_TABLE[bytes[b]! | (bytes[b + 1]! << 8)]!;
    for (let j = 0; j < QK / 2; j++) {
      const v = bytes[b + 2 + j]!;
      out[o + j] = ((v & 0xf) - 8) * d;
      out[o + j + 16] = ((v >>> 4) - 8) * d;
    }
  }
}

/** ggml Q4_1 blocks → float32 values. */
export function dequantizeQ41(bytes: Uint8Array, out: Float32Array): void {
  for (let b = 0, o = 0; o < out.length; b += Q4_1_BYTES, o += QK) {
    const d = F16_TABLE[bytes[b]! | (bytes[b + 1]! << 8)]!;
    const m = F16_TABLE[bytes[b + 2]! | (bytes[b + 3]! << 8)]!;
    for (let j = 0; j < QK / 2; j++) {
      const v = bytes[b + 4 + j]!;
      // The float32 store rounds the exact float64 sum once, as ggml's float `x0*d + m` does.
      out[o + j] = (v & 0xf) * d + m;
      out[o + j + 16] = (v >>> 4) * d + m;
    }
  }
}

const BLOCK_TYPES: ReadonlyMap<number, BlockType> = new Map([
  [GGML_TYPES.Q8_0.id, { blockBytes: Q8_0_BYTES, dequantize: dequantizeQ80 }],
  [GGML_TYPES.Q4_0.id, { blockBytes: Q4_0_BYTES, dequantize: dequantizeQ40 }],
  [GGML_TYPES.Q4_1.id, { blockBytes: Q4_1_BYTES, dequantize: dequantizeQ41 }],
]);

/** The ggml types {@link ggufSourceTensor} reads, by name (for messages and docs). */
export const DEQUANTIZABLE_TYPES: readonly string[] = [...PLAIN_TYPES.keys(), ...BLOCK_TYPES.keys()].map(ggmlTypeName);

/**
 * Refuses, before anything is read or written, a tensor whose type cannot be expanded here.
 * @throws ConvertError `UnsupportedDType` naming the tensor and its type
 */
export function checkDequantizable(t: GgufTensorEntry): void {
  if (PLAIN_TYPES.has(t.ggmlType) || BLOCK_TYPES.has(t.ggmlType)) return;
  throw new ConvertError(
    'UnsupportedDType',
    `GGUF tensor ${t.name} is ${ggmlTypeName(t.ggmlType)}, which cannot be converted to distributed-llama ` +
      `(only ${DEQUANTIZABLE_TYPES.join(', ')} can); convert the model from its safetensors repository instead`,
  );
}

/**
 * Tensor `t` of the GGUF in `file` as a source tensor of Hugging Face shape (ggml dims reversed):
 * plain types point into the file; quantized ones are an F32 view expanded on each read.
 * @throws ConvertError `UnsupportedDType` (see {@link checkDequantizable})
 */
export function ggufSourceTensor(file: ByteSource, t: GgufTensorEntry): SourceTensor {
  checkDequantizable(t);
  const shape = [...t.dims].reverse();
  const elements = t.dims.reduce((a, b) => a * b, 1);
  const plain = PLAIN_TYPES.get(t.ggmlType);
  if (plain !== undefined) return { name: t.name, dtype: plain, shape, source: file, offset: t.absoluteOffset, byteLength: t.byteLength ?? 0 };
  const block = BLOCK_TYPES.get(t.ggmlType) as BlockType;
  return { name: t.name, dtype: 'F32', shape, source: dequantizedSource(file, t, block), offset: 0, byteLength: elements * 4 };
}

/**
 * The float32 bytes of a block-quantized tensor. Reads must cover whole blocks (the converter
 * reads whole rows, and a GGUF row is a whole number of blocks).
 */
function dequantizedSource(file: ByteSource, t: GgufTensorEntry, block: BlockType): ByteSource {
  const blockF32Bytes = QK * 4;
  const size = (t.dims.reduce((a, b) => a * b, 1) / QK) * blockF32Bytes;
  return {
    name: `${file.name}: ${t.name} (${ggmlTypeName(t.ggmlType)} expanded to F32)`,
    size: () => Promise.resolve(size),
    async read(offset, length, into) {
      if (offset % blockF32Bytes !== 0 || length % blockF32Bytes !== 0 || offset + length > size) {
        throw new RangeError(`${t.name}: read of ${length} bytes at ${offset} is not whole ${ggmlTypeName(t.ggmlType)} blocks within ${size}`);
      }
      const blocks = length / blockF32Bytes;
      const raw = await file.read(t.absoluteOffset + (offset / blockF32Bytes) * block.blockBytes, blocks * block.blockBytes);
      const out = into ? into.subarray(0, length) : new Uint8Array(length);
      const aligned = out.byteOffset % 4 === 0;
      const values = aligned ? new Float32Array(out.buffer, out.byteOffset, length / 4) : new Float32Array(length / 4);
      block.dequantize(raw, values);
      if (!aligned) out.set(new Uint8Array(values.buffer));
      return out;
    },
  };
}

/**
 * The values of a GGUF's `rope_freqs.weight` (Llama 3 rope scaling factors, see gguf-spec.ts
 * `specFromGguf`), or undefined when it has none.
 * @throws ConvertError `UnsupportedDType`, `NonFinite`
 */
export async function ggufRopeFreqs(source: ByteSource, file: GgufFile): Promise<Float32Array | undefined> {
  const entry = file.tensors.find((t) => t.name === 'rope_freqs.weight');
  if (!entry) return undefined;
  const t = ggufSourceTensor(source, entry);
  return decodeToF32({ dtype: t.dtype, bytes: await t.source.read(t.offset, t.byteLength) }, undefined, { label: `${source.name}: tensor ${t.name}` });
}

/**
 * Every weights format magus converts to, declared once: what a `Model`'s artifact asks for
 * (`gguf:q40`, `dllama:f16`), how `magus convert --weights` names it, and what the files hold.
 * Each format is the bytes of one ggml type (ggml.ts): q40/q80 are ggml's Q4_0/Q8_0 blocks, which
 * distributed-llama's `.m` uses too, so the block size, the bytes per block and whether the format
 * is block-quantized all follow from that type. Everything else derives from this table: the
 * lists, the order runtimes prefer artifacts in, the GGUF and `.m` type fields, the converter's
 * block checks and sizes, the memory plans and the CLI's names.
 *
 * Adding a format: a row here, its encoder (convert/quant.ts `encodeChunk`) and the `weights`
 * enums of the `Model` CRD (README.md, "Where to add X").
 * Workflow-safe: no I/O.
 */
import { GGML_TYPES, type GgmlLayoutName } from './ggml';

export interface WeightsFormatDeclaration {
  /** The ggml type of the same bytes: GGUF tensors of this format have it, and its layout is the format's. */
  ggml: GgmlLayoutName;
  /** distributed-llama's `FloatType` (the `.m` header's `weights_float_type`, `--buffer-float-type`). */
  dllamaFloatType: number;
  /** llama.cpp's `llama_ftype` of a GGUF whose matrices are in this format (`general.file_type`). */
  llamaFileType: number;
  /**
   * The `--buffer-float-type` distributed-llama 0.16.4 runs these weights with on a CPU, or null
   * when it cannot run them at all: its CPU matmuls are F32 × F32 and Q40 × Q80 only (tried here:
   * F16 and Q80 weights stop at the first matmul with "Unsupported op quant", under any buffer
   * type, as F32 weights do with a q80 buffer).
   */
  dllamaBuffer: 'f32' | 'q80' | null;
}

/**
 * The formats, in the order runtimes prefer their artifacts: the most compact first (after a GGUF
 * source's own file, {@link WEIGHTS_PREFERENCE}).
 */
export const WEIGHTS = {
  q40: { ggml: 'Q4_0', dllamaFloatType: 2, llamaFileType: 2, dllamaBuffer: 'q80' },
  q80: { ggml: 'Q8_0', dllamaFloatType: 3, llamaFileType: 7, dllamaBuffer: null },
  f16: { ggml: 'F16', dllamaFloatType: 1, llamaFileType: 1, dllamaBuffer: null },
  f32: { ggml: 'F32', dllamaFloatType: 0, llamaFileType: 0, dllamaBuffer: 'f32' },
} as const satisfies Record<string, WeightsFormatDeclaration>;

/** Output weight encodings. */
export type WeightsFormat = keyof typeof WEIGHTS;
/** The formats in preference order (the table's). */
export const WEIGHTS_FORMATS = Object.keys(WEIGHTS) as readonly WeightsFormat[];

/**
 * The weights of an artifact: one of {@link WeightsFormat}, or `source` — a GGUF source's file as
 * published (its own quantization, e.g. Q4_K_M), served without conversion.
 */
export type ArtifactWeights = WeightsFormat | 'source';
/** Which artifact of a format a runtime serves when there are several: a GGUF source's own file first, then the most compact. */
export const WEIGHTS_PREFERENCE: readonly ArtifactWeights[] = ['source', ...WEIGHTS_FORMATS];

export function isWeightsFormat(name: string): name is WeightsFormat {
  return Object.hasOwn(WEIGHTS, name);
}

/** A format with what follows from its declaration. */
export interface WeightsFormatInfo extends WeightsFormatDeclaration {
  name: WeightsFormat;
  /** The ggml type's id. */
  ggmlType: number;
  /** Values per block: 1 for the plain formats. */
  blockSize: number;
  /** Bytes per block. */
  blockBytes: number;
  /** Whether values come in blocks sharing a scale (a tensor's rows must then be whole blocks). */
  blockQuantized: boolean;
  /** Bytes per value on average (q40: 18/32). */
  bytesPerValue: number;
  /** Bits per value on average (q40: 4.5). */
  bitsPerValue: number;
  /** Place in {@link WEIGHTS_FORMATS}: 0 is the most preferred. */
  rank: number;
}

const INFO = Object.fromEntries(
  WEIGHTS_FORMATS.map((name, rank): [WeightsFormat, WeightsFormatInfo] => {
    const declared: WeightsFormatDeclaration = WEIGHTS[name];
    const { id, blockSize, typeSize } = GGML_TYPES[declared.ggml];
    return [
      name,
      {
        ...declared,
        name,
        ggmlType: id,
        blockSize,
        blockBytes: typeSize,
        blockQuantized: blockSize > 1,
        bytesPerValue: typeSize / blockSize,
        bitsPerValue: (8 * typeSize) / blockSize,
        rank,
      },
    ];
  }),
) as Readonly<Record<WeightsFormat, WeightsFormatInfo>>;

/** Everything about `format`. */
export function weightsFormat(format: WeightsFormat): WeightsFormatInfo {
  return INFO[format];
}

/** Whether `format` stores values in blocks (q40, q80): tensors' rows must be whole blocks. */
export function isBlockQuantized(format: WeightsFormat): boolean {
  return INFO[format].blockQuantized;
}

/**
 * Errors raised by the conversion library. Every failure caused by the input model (a malformed
 * file, an unsupported layout, a non-finite weight) is a {@link ConvertError}: retrying cannot fix
 * it, so activities report it as a non-retryable failure of type `UnsupportedModel` whose message
 * starts with `code` (activities/pipeline.ts `classify`).
 *
 * Tests and callers match on `name` and `code`, never on `instanceof` (errors cross worker-thread
 * and activity boundaries, where class identity is lost).
 */

/** Stable, machine-readable reasons. Append new codes; never rename (they appear in workflow histories). */
export type ConvertErrorCode =
  /** The file ends before a structure it declares (header length prefix, header, tensor data). */
  | 'TruncatedFile'
  /** The safetensors header length is beyond the file or beyond the sanity cap. */
  | 'HeaderTooLarge'
  /** The safetensors header is not valid JSON or has the wrong structure. */
  | 'BadHeader'
  /** Tensor data offsets are out of order, overlap, leave gaps or exceed the data section. */
  | 'BadOffsets'
  /** A tensor's shape does not match its byte length, or the model config expects another shape. */
  | 'ShapeMismatch'
  /** A tensor named by the index or required by the architecture is absent. */
  | 'MissingTensor'
  /** A weight is NaN or ±Inf, or would overflow the output type. */
  | 'NonFinite'
  /** A tensor element type we cannot read (the message names it). */
  | 'UnsupportedDType'
  /** `config.json` names an architecture we cannot convert. */
  | 'UnsupportedArchitecture'
  /** A block-quantized tensor or chunk is not a whole number of 32-element blocks. */
  | 'BadBlockSize'
  /** `config.json` has a value we cannot represent in the output format. */
  | 'UnsupportedConfig'
  /** The sharded-model index (`model.safetensors.index.json`) is malformed or inconsistent. */
  | 'BadIndex'
  /** A file the model needs (weights, shard, config) does not exist. */
  | 'MissingFile'
  /** The output format's runtime cannot run these weights (distributed-llama: f16, q80). */
  | 'UnsupportedWeights'
  /** The output format's runtime cannot tokenize with this vocabulary as the model was trained (distributed-llama: GPT-2-style byte-level BPE). */
  | 'UnsupportedTokenizer'
  /** No chat template, or one the output format's server does not recognize (distributed-llama's dllama-api). */
  | 'UnsupportedChatTemplate'
  /** The model's dimensions split into no distributed-llama topology, not even 1 node (the message names the dimension). */
  | 'NoTopology';

/** The error `name` of every {@link ConvertError}; also its Temporal failure type. */
export const CONVERT_ERROR_NAME = 'ConvertError';

/** A permanent conversion failure. The message names the file and, where known, the tensor. */
export class ConvertError extends Error {
  override readonly name = CONVERT_ERROR_NAME;

  constructor(
    readonly code: ConvertErrorCode,
    message: string,
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }
}

/** True when `err` is a {@link ConvertError} (by name, so it works across realms), optionally with `code`. */
export function isConvertError(err: unknown, code?: ConvertErrorCode): err is ConvertError {
  if (typeof err !== 'object' || err === null) return false;
  const e = err as { name?: unknown; code?: unknown };
  return e.name === CONVERT_ERROR_NAME && typeof e.code === 'string' && (code === undefined || e.code === code);
}

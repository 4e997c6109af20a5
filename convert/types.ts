/**
 * Types shared by the pieces of the conversion library (reader, quantizers, writers).
 * The library is pure: no Temporal imports; I/O only through {@link ByteSource} and file sinks.
 */

/** Element types found in safetensors inputs. */
export type SourceDType = 'F32' | 'F16' | 'BF16';

/** Output weight encodings (declared in shared/weights.ts). */
export type { WeightsFormat } from '../shared/weights';

/**
 * Anything we can read byte ranges from: a local file, or an S3 object via ranged GETs.
 * `read` must return exactly `length` bytes or throw.
 */
export interface ByteSource {
  /** Human-readable name used in error messages (file path or s3 key). */
  readonly name: string;
  size(): Promise<number>;
  /**
   * `length` bytes at `offset`: in a fresh buffer, or, given `into` (at least `length` bytes
   * long), read into its first `length` bytes and returned as `into.subarray(0, length)` — so a
   * caller can reuse its buffers. Implementations must honour `into`.
   */
  read(offset: number, length: number, into?: Uint8Array): Promise<Uint8Array>;
  close?(): Promise<void>;
}

/** One tensor as declared in a safetensors header, with absolute offsets into its shard. */
export interface SourceTensor {
  name: string;
  dtype: SourceDType;
  shape: number[];
  /** The shard that holds it. */
  source: ByteSource;
  /** Absolute byte offset of the tensor data within the shard file. */
  offset: number;
  byteLength: number;
}

/**
 * Whose bytes a block quantizer reproduces: `ggml` = llama.cpp's `quantize_row_q{4,8}_0_ref`
 * (GGUF Q4_0/Q8_0), `dllama` = distributed-llama's `converter/writer.py` (its `.m` q40/q80).
 * The block layouts are identical; the rounding rules differ (see quant.ts).
 */
export type QuantFlavor = 'ggml' | 'dllama';

/**
 * Where a checkpoint's files come from: a local directory ({@link localCheckpoint} in
 * safetensors.ts) or S3 objects (activities/storage). Names are relative (`config.json`,
 * `model-00001-of-00002.safetensors`).
 */
export interface CheckpointFiles {
  /** Human-readable location for messages (a directory, or `s3://bucket/prefix`). */
  readonly location: string;
  /** A file's text, or null when the checkpoint has no such file. */
  readText(name: string): Promise<string | null>;
  /** A byte source for a file; throws ConvertError `MissingFile` when it does not exist. */
  open(name: string): Promise<ByteSource & { close(): Promise<void> }>;
}

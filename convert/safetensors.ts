/**
 * Streaming safetensors reader: parses and validates headers, resolves sharded checkpoints, and
 * reads tensors in bounded chunks (one chunk in memory at a time) as raw bytes or float32.
 *
 * Format (https://github.com/huggingface/safetensors): an unsigned little-endian u64 header
 * length N, N bytes of UTF-8 JSON `{name: {dtype, shape, data_offsets: [begin, end]}, ...}` with
 * an optional `__metadata__` string map, then the data section; offsets are relative to it.
 * Validation follows the reference library: the tensors must tile the data section exactly (no
 * overlap, no gap, no trailing bytes) and each byte length must equal shape × element size.
 */
import { open, readFile, type FileHandle } from 'node:fs/promises';
import * as path from 'node:path';
import { ConvertError } from './errors';
import { QK, decodeToF32, dtypeSize } from './quant';
import type { ByteSource, CheckpointFiles, SourceDType, SourceTensor } from './types';

/** Headers larger than this are rejected (the reference library's limit is 100 MB too). */
export const MAX_HEADER_BYTES = 100_000_000;

/** Default chunk size for streaming reads, in elements (4 MiB of float32). */
export const DEFAULT_CHUNK_ELEMENTS = 1 << 20;

/** Bits per element of every safetensors dtype; we read only F32/F16/BF16. */
const DTYPE_BITS: Readonly<Record<string, number>> = {
  BOOL: 8,
  U8: 8,
  I8: 8,
  F8_E5M2: 8,
  F8_E4M3: 8,
  F8_E8M0: 8,
  F4: 4,
  F6_E2M3: 6,
  F6_E3M2: 6,
  I16: 16,
  U16: 16,
  F16: 16,
  BF16: 16,
  I32: 32,
  U32: 32,
  F32: 32,
  F64: 64,
  I64: 64,
  U64: 64,
  C64: 64,
};

const READABLE: ReadonlySet<string> = new Set<SourceDType>(['F32', 'F16', 'BF16']);

/** A tensor declared in a header whose dtype we cannot convert (kept so errors can name it). */
export interface UnsupportedTensor {
  name: string;
  dtype: string;
  shape: number[];
}

/** One parsed safetensors file. */
export interface SafetensorsFile {
  source: ByteSource;
  /** Absolute offset of the data section (8 + header length). */
  dataOffset: number;
  metadata: Record<string, string>;
  /** Readable tensors in data order. */
  tensors: SourceTensor[];
  /** Tensors with other dtypes (integer, fp8, ...), in data order. */
  unsupported: UnsupportedTensor[];
}

// ---------------------------------------------------------------------------------------------
// Byte sources

/**
 * A {@link ByteSource} over a local file. The file is opened on first use and kept open (one
 * handle) until `close()`; reads are positional, so concurrent reads are safe.
 */
export function fileSource(filePath: string): ByteSource & { close(): Promise<void> } {
  let handle: Promise<FileHandle> | undefined;
  let size: number | undefined;
  const get = (): Promise<FileHandle> => (handle ??= open(filePath, 'r'));
  return {
    name: filePath,
    async size() {
      size ??= (await (await get()).stat()).size;
      return size;
    },
    async read(offset, length, into) {
      // The caller's buffer, or a fresh, unpooled, uninitialised one: it is filled below, and
      // owning its whole ArrayBuffer lets the worker pool transfer it instead of copying.
      const buf = into ? target(filePath, into, length) : Buffer.allocUnsafeSlow(length);
      const fh = await get();
      let done = 0;
      while (done < length) {
        const { bytesRead } = await fh.read(buf, done, length - done, offset + done);
        if (bytesRead === 0) {
          throw new ConvertError('TruncatedFile', `${filePath}: file ends at byte ${offset + done}, wanted ${length} bytes at offset ${offset}`);
        }
        done += bytesRead;
      }
      return buf;
    },
    async close() {
      const h = handle;
      handle = undefined;
      if (h) await (await h).close();
    },
  };
}

/**
 * The first `length` bytes of `into`, the buffer a {@link ByteSource.read} was asked to fill.
 * @throws RangeError if `into` is shorter than `length`
 */
export function target(name: string, into: Uint8Array, length: number): Uint8Array {
  if (into.length < length) throw new RangeError(`${name}: a read of ${length} bytes does not fit the ${into.length}-byte buffer given`);
  return into.subarray(0, length);
}

/** A {@link ByteSource} over bytes in memory (tests, small files). Reads return copies. */
export function bytesSource(name: string, bytes: Uint8Array): ByteSource {
  return {
    name,
    size: () => Promise.resolve(bytes.length),
    read(offset, length, into) {
      if (offset < 0 || length < 0 || offset + length > bytes.length) {
        return Promise.reject(new ConvertError('TruncatedFile', `${name}: file ends at byte ${bytes.length}, wanted ${length} bytes at offset ${offset}`));
      }
      if (!into) return Promise.resolve(bytes.slice(offset, offset + length));
      return Promise.resolve().then(() => {
        const out = target(name, into, length);
        out.set(bytes.subarray(offset, offset + length));
        return out;
      });
    },
  };
}

// ---------------------------------------------------------------------------------------------
// Header parsing

function isRecord(v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

function isCount(v: unknown): v is number {
  return typeof v === 'number' && Number.isSafeInteger(v) && v >= 0;
}

/**
 * Parses and validates a safetensors header.
 * @throws ConvertError `TruncatedFile` (shorter than 8 bytes, or data ends before the last
 *   tensor), `HeaderTooLarge`, `BadHeader` (not UTF-8 JSON of the right shape),
 *   `UnsupportedDType` (a dtype safetensors does not define), `ShapeMismatch` (shape × element
 *   size ≠ byte length), `BadOffsets` (overlap, gap, reversed range, trailing bytes).
 */
export async function openSafetensors(source: ByteSource): Promise<SafetensorsFile> {
  const file = source.name;
  const size = await source.size();
  if (size < 8) throw new ConvertError('TruncatedFile', `${file}: ${size} bytes is too short for a safetensors file (needs an 8-byte header length)`);
  const prefix = await source.read(0, 8);
  const headerLen = new DataView(prefix.buffer, prefix.byteOffset, 8).getBigUint64(0, true);
  if (headerLen > BigInt(MAX_HEADER_BYTES)) {
    throw new ConvertError('HeaderTooLarge', `${file}: header length ${headerLen} exceeds the ${MAX_HEADER_BYTES}-byte limit`);
  }
  const n = Number(headerLen);
  if (8 + n > size) throw new ConvertError('HeaderTooLarge', `${file}: header length ${n} runs past the end of the ${size}-byte file`);
  const dataOffset = 8 + n;
  const dataLength = size - dataOffset;

  let header: unknown;
  try {
    header = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(await source.read(8, n)));
  } catch (err) {
    if (err instanceof ConvertError) throw err;
    throw new ConvertError('BadHeader', `${file}: header is not valid UTF-8 JSON: ${(err as Error).message}`, { cause: err });
  }
  if (!isRecord(header)) throw new ConvertError('BadHeader', `${file}: header is not a JSON object`);

  const metadata: Record<string, string> = {};
  type Entry = { name: string; dtype: string; shape: number[]; begin: number; end: number };
  const entries: Entry[] = [];
  for (const [name, value] of Object.entries(header)) {
    if (name === '__metadata__') {
      if (!isRecord(value)) throw new ConvertError('BadHeader', `${file}: __metadata__ is not an object`);
      for (const [k, v] of Object.entries(value)) {
        if (typeof v !== 'string') throw new ConvertError('BadHeader', `${file}: __metadata__.${k} is not a string`);
        metadata[k] = v;
      }
      continue;
    }
    if (!isRecord(value)) throw new ConvertError('BadHeader', `${file}: tensor ${name}: entry is not an object`);
    const { dtype, shape, data_offsets: offsets } = value;
    if (typeof dtype !== 'string') throw new ConvertError('BadHeader', `${file}: tensor ${name}: dtype is not a string`);
    if (!Array.isArray(shape) || !shape.every(isCount)) {
      throw new ConvertError('BadHeader', `${file}: tensor ${name}: shape ${JSON.stringify(shape)} is not a list of non-negative integers`);
    }
    if (!Array.isArray(offsets) || offsets.length !== 2 || !offsets.every(isCount)) {
      throw new ConvertError('BadHeader', `${file}: tensor ${name}: data_offsets ${JSON.stringify(offsets)} is not a pair of non-negative integers`);
    }
    const [begin, end] = offsets as [number, number];
    if (end < begin) throw new ConvertError('BadOffsets', `${file}: tensor ${name}: data_offsets [${begin}, ${end}] end before they begin`);
    const bits = DTYPE_BITS[dtype];
    if (bits === undefined) throw new ConvertError('UnsupportedDType', `${file}: tensor ${name}: unknown dtype ${dtype}`);
    const elements = shape.reduce((a, b) => a * b, 1);
    const expected = (elements * bits) / 8;
    if (!Number.isSafeInteger(expected) || expected !== end - begin) {
      throw new ConvertError(
        'ShapeMismatch',
        `${file}: tensor ${name}: shape [${shape.join(', ')}] of ${dtype} needs ${expected} bytes but data_offsets span ${end - begin}`,
      );
    }
    entries.push({ name, dtype, shape, begin, end });
  }

  entries.sort((a, b) => a.begin - b.begin || a.end - b.end);
  let expectedBegin = 0;
  let previous = '';
  for (const e of entries) {
    if (e.begin < expectedBegin) {
      throw new ConvertError('BadOffsets', `${file}: tensor ${e.name} (bytes ${e.begin}..${e.end}) overlaps tensor ${previous} (ends at ${expectedBegin})`);
    }
    if (e.begin > expectedBegin) {
      throw new ConvertError('BadOffsets', `${file}: bytes ${expectedBegin}..${e.begin} of the data section before tensor ${e.name} belong to no tensor`);
    }
    expectedBegin = e.end;
    previous = e.name;
  }
  if (expectedBegin > dataLength) {
    throw new ConvertError(
      'TruncatedFile',
      `${file}: tensor ${previous} ends at data byte ${expectedBegin} but the file holds only ${dataLength} bytes of data (truncated download?)`,
    );
  }
  if (expectedBegin < dataLength) {
    throw new ConvertError('BadOffsets', `${file}: the last ${dataLength - expectedBegin} bytes of the data section belong to no tensor`);
  }

  const tensors: SourceTensor[] = [];
  const unsupported: UnsupportedTensor[] = [];
  for (const e of entries) {
    if (READABLE.has(e.dtype)) {
      tensors.push({ name: e.name, dtype: e.dtype as SourceDType, shape: e.shape, source, offset: dataOffset + e.begin, byteLength: e.end - e.begin });
    } else {
      unsupported.push({ name: e.name, dtype: e.dtype, shape: e.shape });
    }
  }
  return { source, dataOffset, metadata, tensors, unsupported };
}

// ---------------------------------------------------------------------------------------------
// Model directories

/** All tensors of a checkpoint, over one or more shards. */
export interface ModelWeights {
  /** The checkpoint's location (a directory or `s3://…`), for messages. */
  dir: string;
  /** One entry per shard, in index order (or the single file). */
  files: SafetensorsFile[];
  tensors: ReadonlyMap<string, SourceTensor>;
  unsupported: ReadonlyMap<string, UnsupportedTensor>;
  has(name: string): boolean;
  /** @throws ConvertError `MissingTensor`, or `UnsupportedDType` naming the tensor's dtype. */
  get(name: string): SourceTensor;
  /** Closes every shard. */
  close(): Promise<void>;
}

/** The single-file and sharded-index names Hugging Face uses. */
export const SINGLE_FILE = 'model.safetensors';
export const INDEX_FILE = 'model.safetensors.index.json';

/** A checkpoint in a local directory. */
export function localCheckpoint(dir: string): CheckpointFiles {
  return {
    location: dir,
    async readText(name) {
      try {
        return await readFile(path.join(dir, name), 'utf8');
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code === 'ENOENT') return null;
        throw err;
      }
    },
    async open(name) {
      const file = path.join(dir, name);
      const source = fileSource(file);
      try {
        await source.size();
      } catch (err) {
        await source.close().catch(() => undefined);
        if ((err as NodeJS.ErrnoException).code === 'ENOENT') throw new ConvertError('MissingFile', `${file} does not exist`, { cause: err });
        throw err;
      }
      return source;
    },
  };
}

/** {@link openModel} over a local directory. */
export function openModelDir(dir: string): Promise<ModelWeights> {
  return openModel(localCheckpoint(dir));
}

/**
 * Opens `model.safetensors`, or every shard named by `model.safetensors.index.json` (each shard
 * opened once). Every tensor the index's `weight_map` names must be in its shard.
 * @throws ConvertError `MissingFile`, `BadIndex`, `MissingTensor`, or any {@link openSafetensors} error.
 */
export async function openModel(checkpoint: CheckpointFiles): Promise<ModelWeights> {
  const dir = checkpoint.location;
  const indexPath = `${dir}/${INDEX_FILE}`;
  const indexText = (await checkpoint.readText(INDEX_FILE)) ?? undefined;

  let shardNames: string[];
  let weightMap: Map<string, string> | undefined;
  if (indexText === undefined) {
    shardNames = [SINGLE_FILE];
  } else {
    weightMap = parseIndex(indexPath, indexText);
    shardNames = [...new Set(weightMap.values())];
  }

  const files: SafetensorsFile[] = [];
  const sources: (ByteSource & { close(): Promise<void> })[] = [];
  const closeAll = async (): Promise<void> => {
    await Promise.allSettled(sources.map((s) => s.close()));
  };
  try {
    for (const shard of shardNames) {
      let source: ByteSource & { close(): Promise<void> };
      try {
        source = await checkpoint.open(shard);
      } catch (err) {
        if (err instanceof ConvertError && err.code === 'MissingFile') {
          const why = weightMap ? `named by ${INDEX_FILE}` : `(and no ${INDEX_FILE})`;
          throw new ConvertError('MissingFile', `${dir}/${shard} does not exist ${why}`, { cause: err });
        }
        throw err;
      }
      sources.push(source);
      files.push(await openSafetensors(source));
    }

    const tensors = new Map<string, SourceTensor>();
    const unsupported = new Map<string, UnsupportedTensor>();
    const owner = new Map<string, string>();
    files.forEach((f, i) => {
      const shard = shardNames[i]!;
      for (const t of [...f.tensors, ...f.unsupported]) {
        const other = owner.get(t.name);
        if (other !== undefined) throw new ConvertError('BadIndex', `${dir}: tensor ${t.name} is in both ${other} and ${shard}`);
        owner.set(t.name, shard);
      }
      for (const t of f.tensors) tensors.set(t.name, t);
      for (const t of f.unsupported) unsupported.set(t.name, t);
    });
    if (weightMap) {
      for (const [name, shard] of weightMap) {
        if (owner.get(name) !== shard) {
          throw new ConvertError(
            'MissingTensor',
            `${indexPath}: tensor ${name} should be in ${shard} but is ${owner.has(name) ? `in ${owner.get(name)}` : 'in no shard'}`,
          );
        }
      }
    }

    return {
      dir,
      files,
      tensors,
      unsupported,
      has: (name) => tensors.has(name),
      get(name) {
        const t = tensors.get(name);
        if (t) return t;
        const u = unsupported.get(name);
        if (u) throw new ConvertError('UnsupportedDType', `${dir}: tensor ${name} has dtype ${u.dtype}; only F32, F16 and BF16 can be converted`);
        throw new ConvertError('MissingTensor', `${dir}: tensor ${name} is not in the checkpoint`);
      },
      close: closeAll,
    };
  } catch (err) {
    await closeAll();
    throw err;
  }
}

function parseIndex(indexPath: string, text: string): Map<string, string> {
  let index: unknown;
  try {
    index = JSON.parse(text);
  } catch (err) {
    throw new ConvertError('BadIndex', `${indexPath} is not valid JSON: ${(err as Error).message}`, { cause: err });
  }
  const weightMap = isRecord(index) ? index.weight_map : undefined;
  if (!isRecord(weightMap)) throw new ConvertError('BadIndex', `${indexPath} has no weight_map object`);
  const map = new Map<string, string>();
  for (const [name, shard] of Object.entries(weightMap)) {
    // A shard is a file next to the index: reject paths so a hostile index cannot read elsewhere.
    if (typeof shard !== 'string' || shard === '' || shard !== path.basename(shard) || shard === '.' || shard === '..') {
      throw new ConvertError('BadIndex', `${indexPath}: weight_map.${name} is ${JSON.stringify(shard)}, not a file name`);
    }
    map.set(name, shard);
  }
  if (map.size === 0) throw new ConvertError('BadIndex', `${indexPath}: weight_map is empty`);
  return map;
}

// ---------------------------------------------------------------------------------------------
// Reading tensors

/** Number of elements of a shape (1 for a scalar). */
export function elementCount(shape: readonly number[]): number {
  return shape.reduce((a, b) => a * b, 1);
}

function gcd(a: number, b: number): number {
  while (b) [a, b] = [b, a % b];
  return a;
}

/**
 * The chunk length used for a tensor: at most `requested` elements and, where it fits, a whole
 * number of rows (last dimension) that is also a whole number of 32-value blocks; a row longer
 * than `requested` is split at block boundaries.
 */
export function chunkElementsFor(shape: readonly number[], requested = DEFAULT_CHUNK_ELEMENTS): number {
  if (!Number.isSafeInteger(requested) || requested < 1) throw new RangeError(`chunk size ${requested} is not a positive integer`);
  const row = shape.length > 0 ? shape[shape.length - 1]! : 1;
  let unit = row > 0 && row <= requested ? row : 1;
  const aligned = (unit / gcd(unit, QK)) * QK; // lcm(unit, 32)
  if (aligned <= requested) unit = aligned;
  return requested - (requested % unit);
}

/** Options of the streaming readers. */
export interface ReadOptions {
  /** Upper bound on elements per chunk (default {@link DEFAULT_CHUNK_ELEMENTS}). */
  chunkElements?: number;
  /**
   * Where to read each chunk: called with the chunk's byte length, returns a buffer at least that
   * long; the chunk's `bytes` is then a view of its start (so a caller can recycle its buffers).
   * Default: a fresh buffer per chunk.
   */
  buffer?: (byteLength: number) => Uint8Array;
}

/** A chunk of raw tensor bytes. */
export interface RawTensorChunk {
  dtype: SourceDType;
  bytes: Uint8Array;
  /** Index of the chunk's first element within the tensor. */
  elementOffset: number;
  elements: number;
}

/**
 * Streams a tensor's raw bytes, one chunk at a time (see {@link chunkElementsFor}). Each chunk is
 * a fresh buffer, or a view of the one `opts.buffer` gave for it.
 */
export async function* readTensorChunks(t: SourceTensor, opts?: ReadOptions): AsyncGenerator<RawTensorChunk> {
  const size = dtypeSize(t.dtype);
  const total = t.byteLength / size;
  if (total !== elementCount(t.shape)) {
    throw new ConvertError(
      'ShapeMismatch',
      `${t.source.name}: tensor ${t.name}: shape [${t.shape.join(', ')}] does not match ${t.byteLength} bytes of ${t.dtype}`,
    );
  }
  const chunk = chunkElementsFor(t.shape, opts?.chunkElements);
  for (let at = 0; at < total; at += chunk) {
    const elements = Math.min(chunk, total - at);
    const bytes = await t.source.read(t.offset + at * size, elements * size, opts?.buffer?.(elements * size));
    yield { dtype: t.dtype, bytes, elementOffset: at, elements };
  }
}

/** Options of the float32 readers. */
export interface ReadF32Options extends ReadOptions {
  /** Reject NaN/±Inf with `NonFinite` naming the tensor and element (default true). */
  checkFinite?: boolean;
}

/**
 * Streams a tensor as float32 chunks (F16/BF16 widened exactly). Memory is bounded by one chunk.
 * @throws ConvertError `NonFinite` naming the tensor and element, unless `checkFinite: false`.
 */
export async function* readTensorF32(t: SourceTensor, opts?: ReadF32Options): AsyncGenerator<Float32Array> {
  const check = opts?.checkFinite ?? true;
  for await (const c of readTensorChunks(t, opts)) {
    yield toF32(t, c, check);
  }
}

/** Reads a whole tensor as one Float32Array (meant for small tensors such as norms). */
export async function readTensorF32All(t: SourceTensor, opts?: Omit<ReadF32Options, 'chunkElements'>): Promise<Float32Array> {
  const check = opts?.checkFinite ?? true;
  const elements = elementCount(t.shape);
  if (elements * dtypeSize(t.dtype) !== t.byteLength) {
    throw new ConvertError(
      'ShapeMismatch',
      `${t.source.name}: tensor ${t.name}: shape [${t.shape.join(', ')}] does not match ${t.byteLength} bytes of ${t.dtype}`,
    );
  }
  const bytes = await t.source.read(t.offset, t.byteLength);
  return toF32(t, { dtype: t.dtype, bytes, elementOffset: 0, elements }, check);
}

function toF32(t: SourceTensor, c: RawTensorChunk, check: boolean): Float32Array {
  return decodeToF32(c, undefined, { label: `${t.source.name}: tensor ${t.name}`, elementOffset: c.elementOffset, allowNonFinite: !check });
}

export { assertFinite } from './quant';

/**
 * GGUF reader: header, every metadata value with its type, tensor infos and the data offset.
 * Used by tests to check the writer, and by activities to validate artifacts before publishing.
 * It reads only the header (growing a prefix window from the {@link ByteSource}), never tensor data.
 */
import { GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, type GgufArray, type GgufKv, type GgufValue, type GgufValueTypeName, alignUp } from './gguf';
import type { ByteSource } from './types';
import { ggmlLayout } from '../shared/ggml';

/** A tensor info as stored, with derived absolute offset and (for known types) size. */
export interface GgufTensorEntry {
  name: string;
  /** ggml type id (any, including ones the writer does not produce). */
  ggmlType: number;
  dims: number[];
  /** Offset relative to the data section, as stored. */
  offset: number;
  /** Absolute offset in the file. */
  absoluteOffset: number;
  /** Bytes of data, or null for a ggml type this reader does not know. */
  byteLength: number | null;
}

export interface GgufFile {
  version: number;
  /** Metadata in file order. */
  kvs: GgufKv[];
  /** Metadata by key. */
  metadata: Map<string, GgufValue>;
  tensors: GgufTensorEntry[];
  alignment: number;
  /** Absolute offset of the data section. */
  dataOffset: number;
  /** End of the last tensor's data (absolute). */
  dataEnd: number;
}

/** Thrown (internally) when the window ends before the header does. */
class NeedMoreBytes extends Error {
  constructor(readonly needed: number) {
    super(`GGUF header needs more than ${needed} bytes`);
  }
}

/** The error raised for malformed files. */
export class GgufFormatError extends Error {
  override name = 'GgufFormatError';
}

const TYPE_NAMES: readonly GgufValueTypeName[] = [
  'uint8',
  'int8',
  'uint16',
  'int16',
  'uint32',
  'int32',
  'float32',
  'bool',
  'string',
  'array',
  'uint64',
  'int64',
  'float64',
];

const decoder = new TextDecoder('utf-8', { fatal: true });

class Cursor {
  private readonly view: DataView;
  pos = 0;
  constructor(private readonly bytes: Uint8Array) {
    this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  }
  private need(n: number): number {
    const at = this.pos;
    if (at + n > this.bytes.length) throw new NeedMoreBytes(at + n);
    this.pos += n;
    return at;
  }
  u8(): number {
    return this.view.getUint8(this.need(1));
  }
  i8(): number {
    return this.view.getInt8(this.need(1));
  }
  u16(): number {
    return this.view.getUint16(this.need(2), true);
  }
  i16(): number {
    return this.view.getInt16(this.need(2), true);
  }
  u32(): number {
    return this.view.getUint32(this.need(4), true);
  }
  i32(): number {
    return this.view.getInt32(this.need(4), true);
  }
  f32(): number {
    return this.view.getFloat32(this.need(4), true);
  }
  f64(): number {
    return this.view.getFloat64(this.need(8), true);
  }
  u64(): bigint {
    return this.view.getBigUint64(this.need(8), true);
  }
  i64(): bigint {
    return this.view.getBigInt64(this.need(8), true);
  }
  /** A u64 that must fit a JS number (counts, lengths, offsets). */
  size(what: string): number {
    const v = this.u64();
    if (v > BigInt(Number.MAX_SAFE_INTEGER)) throw new GgufFormatError(`${what} ${v} is too large`);
    return Number(v);
  }
  string(what: string): string {
    const n = this.size(`${what} length`);
    const at = this.need(n);
    try {
      return decoder.decode(this.bytes.subarray(at, at + n));
    } catch {
      throw new GgufFormatError(`${what} is not valid UTF-8`);
    }
  }
}

function typeName(id: number, where: string): GgufValueTypeName {
  const name = TYPE_NAMES[id];
  if (name === undefined) throw new GgufFormatError(`${where}: unknown value type ${id}`);
  return name;
}

function readArray(c: Cursor, where: string, depth: number): GgufArray {
  if (depth > 8) throw new GgufFormatError(`${where}: arrays nested too deeply`);
  const itemType = typeName(c.u32(), where);
  const n = c.size(`${where} count`);
  switch (itemType) {
    case 'bool': {
      const value: boolean[] = [];
      for (let i = 0; i < n; i++) value.push(readBool(c, where));
      return { type: 'array', itemType, value };
    }
    case 'string': {
      const value: string[] = [];
      for (let i = 0; i < n; i++) value.push(c.string(`${where}[${i}]`));
      return { type: 'array', itemType, value };
    }
    case 'array': {
      const value: GgufArray[] = [];
      for (let i = 0; i < n; i++) value.push(readArray(c, `${where}[${i}]`, depth + 1));
      return { type: 'array', itemType, value };
    }
    case 'uint64':
    case 'int64': {
      const value: bigint[] = [];
      for (let i = 0; i < n; i++) value.push(itemType === 'uint64' ? c.u64() : c.i64());
      return { type: 'array', itemType, value };
    }
    default: {
      const read = NUMBER_READERS[itemType];
      const value: number[] = [];
      for (let i = 0; i < n; i++) value.push(read(c));
      return { type: 'array', itemType, value };
    }
  }
}

const NUMBER_READERS = {
  uint8: (c: Cursor) => c.u8(),
  int8: (c: Cursor) => c.i8(),
  uint16: (c: Cursor) => c.u16(),
  int16: (c: Cursor) => c.i16(),
  uint32: (c: Cursor) => c.u32(),
  int32: (c: Cursor) => c.i32(),
  float32: (c: Cursor) => c.f32(),
  float64: (c: Cursor) => c.f64(),
} as const;

function readBool(c: Cursor, where: string): boolean {
  const b = c.u8();
  if (b > 1) throw new GgufFormatError(`${where}: bool byte ${b}`);
  return b === 1;
}

function readValue(c: Cursor, where: string): GgufValue {
  const type = typeName(c.u32(), where);
  switch (type) {
    case 'bool':
      return { type, value: readBool(c, where) };
    case 'string':
      return { type, value: c.string(where) };
    case 'array':
      return readArray(c, where, 0);
    case 'uint64':
      return { type, value: c.u64() };
    case 'int64':
      return { type, value: c.i64() };
    default:
      return { type, value: NUMBER_READERS[type](c) };
  }
}

/**
 * Parses a GGUF header from the start of a file.
 * @throws GgufFormatError for malformed input; an internal NeedMoreBytes when `bytes` is a
 *   prefix that ends inside the header (see {@link readGguf}).
 */
function parse(bytes: Uint8Array, fileSize: number): GgufFile {
  const c = new Cursor(bytes);
  if (c.u32() !== GGUF_MAGIC) throw new GgufFormatError('not a GGUF file (bad magic)');
  const version = c.u32();
  if (version !== 2 && version !== 3) throw new GgufFormatError(`unsupported GGUF version ${version}`);
  const nTensors = c.size('tensor count');
  const nKv = c.size('metadata count');
  const kvs: GgufKv[] = [];
  const metadata = new Map<string, GgufValue>();
  for (let i = 0; i < nKv; i++) {
    const key = c.string(`key ${i}`);
    if (metadata.has(key)) throw new GgufFormatError(`duplicate key ${key}`);
    const value = readValue(c, key);
    kvs.push({ key, ...value });
    metadata.set(key, value);
  }
  const alignValue = metadata.get('general.alignment');
  let alignment = GGUF_DEFAULT_ALIGNMENT;
  if (alignValue !== undefined) {
    if (alignValue.type !== 'uint32' || alignValue.value <= 0 || (alignValue.value & (alignValue.value - 1)) !== 0) {
      throw new GgufFormatError('general.alignment is not a power-of-two uint32');
    }
    alignment = alignValue.value;
  }
  const raw: Omit<GgufTensorEntry, 'absoluteOffset'>[] = [];
  const names = new Set<string>();
  for (let i = 0; i < nTensors; i++) {
    const name = c.string(`tensor ${i} name`);
    if (names.has(name)) throw new GgufFormatError(`duplicate tensor ${name}`);
    names.add(name);
    const nDims = c.u32();
    if (nDims < 1 || nDims > 4) throw new GgufFormatError(`tensor ${name}: ${nDims} dimensions`);
    const dims: number[] = [];
    for (let d = 0; d < nDims; d++) dims.push(c.size(`tensor ${name} dim`));
    const ggmlType = c.u32();
    const offset = c.size(`tensor ${name} offset`);
    if (offset % alignment !== 0) throw new GgufFormatError(`tensor ${name}: offset ${offset} is not aligned to ${alignment}`);
    const layout = ggmlLayout(ggmlType);
    let byteLength: number | null = null;
    if (layout) {
      const { blockSize, typeSize } = layout;
      if ((dims[0] ?? 0) % blockSize !== 0) throw new GgufFormatError(`tensor ${name}: ne[0]=${dims[0]} is not a multiple of ${blockSize}`);
      byteLength = (dims.reduce((a, b) => a * b, 1) / blockSize) * typeSize;
    }
    raw.push({ name, ggmlType, dims, offset, byteLength });
  }
  const dataOffset = alignUp(c.pos, alignment);
  const tensors = raw.map((t) => ({ ...t, absoluteOffset: dataOffset + t.offset }));
  let dataEnd = dataOffset;
  const byOffset = [...tensors].sort((a, b) => a.offset - b.offset);
  for (const t of byOffset) {
    if (t.absoluteOffset < dataEnd) throw new GgufFormatError(`tensor ${t.name} overlaps the previous tensor`);
    dataEnd = t.absoluteOffset + (t.byteLength ?? 0);
  }
  if (dataEnd > fileSize) throw new GgufFormatError(`tensor data ends at ${dataEnd}, beyond the file size ${fileSize}`);
  return { version, kvs, metadata, tensors, alignment, dataOffset, dataEnd };
}

/**
 * Reads the header of a GGUF file from a byte source (ranged reads of a growing prefix) or from
 * an in-memory buffer: the whole file, or a prefix holding the header when `options.fileSize`
 * gives the size of the whole file.
 * @throws GgufFormatError for malformed or truncated files
 */
export async function readGguf(source: ByteSource | Uint8Array, options: { fileSize?: number } = {}): Promise<GgufFile> {
  if (source instanceof Uint8Array) return parseWhole(source, options.fileSize ?? source.length);
  const size = await source.size();
  let window = Math.min(size, 1 << 20);
  for (;;) {
    const bytes = await source.read(0, window);
    try {
      return parse(bytes, size);
    } catch (err) {
      if (!(err instanceof NeedMoreBytes)) throw err;
      if (window >= size) throw new GgufFormatError(`${source.name}: truncated GGUF header`);
      window = Math.min(size, Math.max(window * 2, err.needed));
    }
  }
}

function parseWhole(bytes: Uint8Array, fileSize: number): GgufFile {
  try {
    return parse(bytes, fileSize);
  } catch (err) {
    if (err instanceof NeedMoreBytes) throw new GgufFormatError('truncated GGUF header');
    throw err;
  }
}

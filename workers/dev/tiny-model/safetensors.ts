/**
 * A small safetensors writer: whole files in memory or streamed to disk, headers laid out as the
 * safetensors library writes them, and float32 → F32/F16/BF16 bytes. Any dtype string and any
 * header can be written, so tests also craft malformed and unsupported files with it.
 */
import { open } from 'node:fs/promises';
import { f32Bits, f32ToF16 } from '../../../convert/quant';

/** A tensor to write: its declared dtype may be any string (to craft unsupported files). */
export interface SafetensorsEntry {
  name: string;
  dtype: string;
  shape: number[];
  /** Bytes in the file; defaults to the size implied by dtype and shape (F32/F16/BF16/I64/I32/U8/...). */
  byteLength?: number;
}

const DTYPE_BYTES: Readonly<Record<string, number>> = {
  F64: 8,
  I64: 8,
  U64: 8,
  F32: 4,
  I32: 4,
  U32: 4,
  F16: 2,
  BF16: 2,
  I16: 2,
  U16: 2,
  I8: 1,
  U8: 1,
  BOOL: 1,
};

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

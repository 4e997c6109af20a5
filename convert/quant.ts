/**
 * The 32-element block quantizers Q4_0/Q8_0 (GGUF) and q40/q80 (distributed-llama), bit-exact
 * with the tools that normally write those files, and the one entry point that encodes raw tensor
 * bytes as any weights format ({@link encodeChunk}; the element conversions it uses for f32/f16
 * are elements.ts's, re-exported here).
 *
 * Exactness. JavaScript computes in float64; the references compute in float32. Every float32
 * operation is reproduced as `Math.fround(op in float64)`, which is exact because a float64
 * product of two float32 values is exact (24+24 < 53 bits) and, for + − × ÷, rounding first to
 * float64 then to float32 gives the same result as rounding once (53 ≥ 2·24+2). A `Math.fround`
 * is omitted only where the comment next to it proves the result cannot change.
 *
 * The two flavors ({@link QuantFlavor}), per block of 32 values x:
 *
 * ggml `quantize_row_q4_0_ref`: m = the first x with the largest |x| (+0 if all are zero);
 *   d = m / -8; id = d ? 1/d : 0; q = min(15, (int8)(x·id + 8.5)) (truncation), two nibbles per
 *   byte (element j low, j+16 high); the fp16 scale d comes first.
 * dllama q40 (`converter/writer.py`, numpy float32): m = min if −min > max else max. This equals
 *   ggml's m except (a) when +A and −A are both the largest magnitude, dllama takes +A and ggml the
 *   first one, and (b) in an all-zero block, where m is ±0 following numpy's max (the sign of the
 *   block's last element with numpy 1.23.5, the version dllama pins) and ggml's is +0, so only the
 *   sign bit of d differs. The rest (float32 x·id, + 8.5, clip to [0, 15], truncate) is the same
 *   math, so one kernel serves both.
 * ggml `quantize_row_q8_0_ref`: amax = max |x| (+0 if all zero); d = amax/127; q = roundf(x·id),
 *   i.e. halves round away from zero.
 * dllama q80: same d except its sign in all-zero blocks (as above), but `np.round` rounds halves
 *   to even: x·id = 2.5 gives 3 in ggml and 2 in dllama.
 *
 * Both references are sequences of plain float32 operations (ISO C semantics, no FMA contraction;
 * numpy never fuses). A ggml build that contracts `x·id + 8.5f` into an FMA (GCC with FMA-capable
 * `-march`, e.g. on aarch64) can differ in Q4_0 nibbles; measured: 6 of 64M random elements.
 *
 * Degenerate scales. When |d| is a float32 subnormal (all |x| below ~1e-37, which only F32/BF16
 * sources can hold) 1/d is inexact or overflows, x·id leaves [−8.5, 8.5], and the references
 * convert out-of-range floats to integers: ggml as x86-64 GCC does (cvttss2si, then the low byte:
 * NaN and ±Inf give 0, −3 wraps to 253), numpy by clipping first. {@link quantizeQ40} and friends
 * reproduce both on a per-block slow path. Scales beyond the fp16 range are written as ±Inf, as
 * the references do.
 *
 * Speed: hot loops read typed arrays only, allocate nothing, and take F16/BF16 input directly
 * through elements.ts's 64K-entry lookup tables (the largest |x| is found on the integer bit
 * patterns).
 */
import { ConvertError } from './errors';
import type { QuantFlavor, WeightsFormat } from './types';
import { weightsFormat } from '../shared/weights';
import {
  BF16_TABLE,
  decodeToF32,
  dtypeSize,
  F16_TABLE,
  f16FromF32Bits,
  f32ToF16,
  f32ToF16Bits,
  f32View,
  nonFinite,
  u16View,
  u32Of,
  type ElementOptions,
  type RawChunk,
} from './elements';

export {
  assertFinite,
  BF16_TABLE,
  bf16BitsToF32,
  bf16ToF32,
  decodeToF32,
  dtypeSize,
  F16_TABLE,
  f16BitsToF32,
  f16FromF32Bits,
  f16ToF32,
  f32Bits,
  f32ToF16,
  f32ToF16Bits,
  f32View,
  u16View,
  type ElementOptions,
  type RawChunk,
} from './elements';

/** Elements per quantization block (Q4_0, Q8_0, q40, q80: 32, the block the kernels below are written for). */
export const QK = weightsFormat('q40').blockSize;
/** Bytes per Q4_0/q40 block: fp16 scale + 16 bytes of nibbles. */
export const Q40_BLOCK_BYTES = weightsFormat('q40').blockBytes;
/** Bytes per Q8_0/q80 block: fp16 scale + 32 signed bytes. */
export const Q80_BLOCK_BYTES = weightsFormat('q80').blockBytes;

/** Options shared by the quantizers and encoders. */
export interface EncodeOptions extends ElementOptions {
  /** Whose rounding rules to follow for q40/q80 (default `ggml`). */
  flavor?: QuantFlavor;
  /** Byte offset in the output at which to start writing (default 0). */
  outOffset?: number;
}

// ---------------------------------------------------------------------------------------------
// Sizes

/** Bytes needed to encode `elements` values as `format`. Throws `BadBlockSize` for a block format (q40/q80) when not a whole number of blocks. */
export function encodedSize(format: WeightsFormat, elements: number, label?: string): number {
  const { blockQuantized, blockSize, blockBytes } = weightsFormat(format);
  if (blockQuantized) checkBlocks(elements, blockSize, label);
  return (elements / blockSize) * blockBytes;
}

function checkBlocks(elements: number, blockSize: number, label?: string): void {
  if (!Number.isInteger(elements) || elements < 0 || elements % blockSize !== 0) {
    throw new ConvertError('BadBlockSize', `${label ?? 'tensor'}: ${elements} values are not a whole number of ${blockSize}-value blocks`);
  }
}

// ---------------------------------------------------------------------------------------------
// Degenerate-scale helpers (slow path, see the file comment)

/** A float32 |d| below this is subnormal: 1/d may be inexact or overflow. */
const MIN_NORMAL_F32 = 2 ** -126;
/** 1.5·2^52: `v + RINT_MAGIC - RINT_MAGIC` is `v` rounded to an integer, ties to even (|v| < 2^51). */
const RINT_MAGIC = 6755399441055744;

/** `(uint8_t)MIN(15, (int8_t)s)` as x86-64 GCC evaluates it for any float s. */
function ggmlNibble(s: number): number {
  if (!(Math.abs(s) < 2147483648)) return 0; // NaN / out of int32 range: cvttss2si gives 0x80000000
  const t = (Math.trunc(s) << 24) >> 24; // the low byte, as int8
  return (t < 15 ? t : 15) & 0xff;
}

/** `np.clip(s, 0, 15).astype(int) & 0xF`, NaN casting to INT64_MIN (low bits 0). */
function dllamaNibble(s: number): number {
  if (s !== s) return 0;
  return Math.trunc(s < 0 ? 0 : s > 15 ? 15 : s) & 0xf;
}

/** A rounded float converted to an int8 byte as the references do on x86-64 (NaN/huge → 0, else the low byte). */
function toInt8Byte(r: number): number {
  return Math.abs(r) < 2147483648 ? r : 0; // stored into a Uint8Array, which keeps the low byte
}

function roundHalfAway(v: number): number {
  return Math.trunc(v + (v < 0 ? -0.5 : 0.5));
}

function roundHalfEven(v: number): number {
  const r = Math.round(v);
  return r - v === 0.5 && (r & 1) !== 0 ? r - 1 : r;
}

function writeScale(out: Uint8Array, o: number, d: number): void {
  const h = f32ToF16Bits(d);
  out[o] = h & 0xff;
  out[o + 1] = h >>> 8;
}

// ---------------------------------------------------------------------------------------------
// Q4_0 / q40

/** Q4_0 (ggml) or q40 (dllama) of float32 values into `out` (18 bytes per 32 values). */
export function quantizeQ40(x: Float32Array, out: Uint8Array, opts?: EncodeOptions): void {
  const n = x.length;
  checkBlocks(n, QK, opts?.label);
  const dllama = opts?.flavor === 'dllama';
  let o = opts?.outOffset ?? 0;
  checkOut(out, o, (n / QK) * Q40_BLOCK_BYTES);
  const bits = u32Of(x);
  for (let b = 0; b < n; b += QK, o += Q40_BLOCK_BYTES) {
    // Largest magnitude on the bit patterns (monotonic in |x| for non-NaN; NaN sorts above Inf).
    let amax = 0;
    let at = -1;
    let positive = false; // dllama: a +amax element exists
    for (let j = 0; j < QK; j++) {
      const u = bits[b + j]!;
      const a = u & 0x7fffffff;
      if (a > amax) {
        amax = a;
        at = j;
        positive = u === a;
      } else if (a === amax && u === a) {
        positive = true;
      }
    }
    if (amax >= 0x7f800000) throw nonFinite(x[b + at]!, b + at, opts);
    let m: number;
    if (at < 0)
      m = dllama ? x[b + QK - 1]! : 0; // all ±0 (see file comment)
    else if (dllama) m = positive ? Math.abs(x[b + at]!) : -Math.abs(x[b + at]!);
    else m = x[b + at]!;
    // m / -8 is exact in float64; fround matters only if the quotient is a float32 subnormal.
    const d = Math.fround(m / -8);
    const id = d !== 0 ? Math.fround(1 / d) : 0;
    writeScale(out, o, d);
    if (d !== 0 && Math.abs(d) < MIN_NORMAL_F32) {
      q40SlowBlock(x, b, id, out, o + 2, dllama);
      continue;
    }
    // Fast path: |x·id| ≤ 8·(1+2^-23), so s = x·id + 8.5 lies in [0.49, 16.6]: `| 0` truncates
    // like the int8 conversion and clip(s, 0, 15) equals min(15, trunc(s)). Both frounds are
    // needed (x·id and s may round across an integer boundary).
    for (let j = 0; j < QK / 2; j++) {
      let q0 = Math.fround(Math.fround(x[b + j]! * id) + 8.5) | 0;
      let q1 = Math.fround(Math.fround(x[b + j + 16]! * id) + 8.5) | 0;
      if (q0 > 15) q0 = 15;
      if (q1 > 15) q1 = 15;
      out[o + 2 + j] = q0 | (q1 << 4);
    }
  }
}

function q40SlowBlock(x: Float32Array, b: number, id: number, out: Uint8Array, o: number, dllama: boolean): void {
  for (let j = 0; j < QK / 2; j++) {
    const s0 = Math.fround(Math.fround(x[b + j]! * id) + 8.5);
    const s1 = Math.fround(Math.fround(x[b + j + 16]! * id) + 8.5);
    out[o + j] = dllama ? dllamaNibble(s0) | (dllamaNibble(s1) << 4) : ggmlNibble(s0) | (ggmlNibble(s1) << 4);
  }
}

/**
 * Q4_0/q40 of fp16 or bf16 bit patterns, without an intermediate float32 copy: the magnitude
 * search runs on the 15 magnitude bits (two values per 32-bit load), values come from the table.
 */
export function quantizeQ40Half(src: Uint16Array, dtype: 'F16' | 'BF16', out: Uint8Array, opts?: EncodeOptions): void {
  const n = src.length;
  const { dllama, lut, infBits, h, pairs } = halfInput(src, dtype, out, Q40_BLOCK_BYTES, opts);
  let o = opts?.outOffset ?? 0;
  for (let b = 0; b < n; b += QK, o += Q40_BLOCK_BYTES) {
    // First element with the largest magnitude (ggml's strict `amax < |v|` keeps the first).
    let amax = 0;
    let at = -1;
    for (let j = 0, p = b >>> 1; j < QK; j += 2, p++) {
      const w = pairs[p]!;
      const lo = w & 0x7fff;
      const hi = (w >>> 16) & 0x7fff;
      if (lo > amax) {
        amax = lo;
        at = j;
      }
      if (hi > amax) {
        amax = hi;
        at = j + 1;
      }
    }
    if (amax >= infBits) throw nonFinite(lut[h[b + at]!]!, b + at, opts);
    let m: number;
    if (at < 0) {
      m = dllama ? lut[h[b + QK - 1]!]! : 0; // all ±0 (see file comment)
    } else if (dllama) {
      // numpy picks +amax whenever it occurs, even after a −amax.
      let positive = h[b + at] === amax;
      for (let j = at + 1; !positive && j < QK; j++) positive = h[b + j] === amax;
      m = positive ? lut[amax]! : -lut[amax]!;
    } else {
      m = lut[h[b + at]!]!;
    }
    // m / -8 is exact in float64; fround matters only if the quotient is a float32 subnormal.
    const d = Math.fround(m / -8);
    const id = d !== 0 ? Math.fround(1 / d) : 0;
    writeScale(out, o, d);
    if (d !== 0 && Math.abs(d) < MIN_NORMAL_F32) {
      for (let j = 0; j < QK / 2; j++) {
        const s0 = Math.fround(Math.fround(lut[h[b + j]!]! * id) + 8.5);
        const s1 = Math.fround(Math.fround(lut[h[b + j + 16]!]! * id) + 8.5);
        out[o + 2 + j] = dllama ? dllamaNibble(s0) | (dllamaNibble(s1) << 4) : ggmlNibble(s0) | (ggmlNibble(s1) << 4);
      }
      continue;
    }
    // Fast path, as in quantizeQ40, reading values two at a time: pair k of the first half
    // holds elements 2k and 2k+1, which share bytes with elements 2k+16 and 2k+17.
    for (let k = 0, p = b >>> 1, q = o + 2; k < QK / 4; k++, p++, q += 2) {
      const lo = pairs[p]!;
      const hi = pairs[p + QK / 4]!;
      let a0 = Math.fround(Math.fround(lut[lo & 0xffff]! * id) + 8.5) | 0;
      let a1 = Math.fround(Math.fround(lut[lo >>> 16]! * id) + 8.5) | 0;
      let b0 = Math.fround(Math.fround(lut[hi & 0xffff]! * id) + 8.5) | 0;
      let b1 = Math.fround(Math.fround(lut[hi >>> 16]! * id) + 8.5) | 0;
      if (a0 > 15) a0 = 15;
      if (a1 > 15) a1 = 15;
      if (b0 > 15) b0 = 15;
      if (b1 > 15) b1 = 15;
      out[q] = a0 | (b0 << 4);
      out[q + 1] = a1 | (b1 << 4);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Q8_0 / q80

/** Q8_0 (ggml) or q80 (dllama) of float32 values into `out` (34 bytes per 32 values). */
export function quantizeQ80(x: Float32Array, out: Uint8Array, opts?: EncodeOptions): void {
  const n = x.length;
  checkBlocks(n, QK, opts?.label);
  const dllama = opts?.flavor === 'dllama';
  let o = opts?.outOffset ?? 0;
  checkOut(out, o, (n / QK) * Q80_BLOCK_BYTES);
  const bits = u32Of(x);
  for (let b = 0; b < n; b += QK, o += Q80_BLOCK_BYTES) {
    let amax = 0;
    let at = 0;
    for (let j = 0; j < QK; j++) {
      const a = bits[b + j]! & 0x7fffffff;
      if (a > amax) {
        amax = a;
        at = j;
      }
    }
    if (amax >= 0x7f800000) throw nonFinite(x[b + at]!, b + at, opts);
    // |x| as a value: clear the sign. amax = 0 means an all-zero block (dllama keeps the last sign).
    const absMax = amax === 0 ? (dllama ? x[b + QK - 1]! : 0) : Math.abs(x[b + at]!);
    const d = Math.fround(absMax / 127);
    const id = d !== 0 ? Math.fround(1 / d) : 0;
    writeScale(out, o, d);
    const q = o + 2;
    if (d !== 0 && d < MIN_NORMAL_F32 && d > -MIN_NORMAL_F32) {
      for (let j = 0; j < QK; j++) {
        const v = Math.fround(x[b + j]! * id);
        out[q + j] = toInt8Byte(dllama ? roundHalfEven(v) : roundHalfAway(v));
      }
      continue;
    }
    // Fast path: |x·id| ≤ 127·(1+2^-23), so the rounded value is a valid int8. Adding and
    // subtracting 1.5·2^52 rounds a float64 of magnitude < 2^51 to an integer, ties to even
    // (np.round); on an exact half v ± 0.5 is an integer, which gives roundf's away-from-zero.
    if (dllama) {
      for (let j = 0; j < QK; j++) {
        const v = Math.fround(x[b + j]! * id);
        out[q + j] = (v + RINT_MAGIC - RINT_MAGIC) | 0;
      }
    } else {
      for (let j = 0; j < QK; j++) {
        const v = Math.fround(x[b + j]! * id);
        const r = v + RINT_MAGIC - RINT_MAGIC;
        // rint and roundf differ only on exact halves; those are rare, so the branch predicts well.
        out[q + j] = (r - v === 0.5 || v - r === 0.5 ? v + (v < 0 ? -0.5 : 0.5) : r) | 0;
      }
    }
  }
}

/** Q8_0/q80 of fp16 or bf16 bit patterns, see {@link quantizeQ40Half}. */
export function quantizeQ80Half(src: Uint16Array, dtype: 'F16' | 'BF16', out: Uint8Array, opts?: EncodeOptions): void {
  const n = src.length;
  const { dllama, lut, infBits, h, pairs } = halfInput(src, dtype, out, Q80_BLOCK_BYTES, opts);
  let o = opts?.outOffset ?? 0;
  for (let b = 0; b < n; b += QK, o += Q80_BLOCK_BYTES) {
    let amax = 0;
    for (let p = b >>> 1, end = p + QK / 2; p < end; p++) {
      const w = pairs[p]!;
      const lo = w & 0x7fff;
      const hi = (w >>> 16) & 0x7fff;
      if (lo > amax) amax = lo;
      if (hi > amax) amax = hi;
    }
    if (amax >= infBits) {
      let at = 0;
      while ((h[b + at]! & 0x7fff) !== amax) at++;
      throw nonFinite(lut[h[b + at]!]!, b + at, opts);
    }
    // amax = 0 means an all-zero block (dllama keeps the last element's sign, see file comment).
    const absMax = amax === 0 ? (dllama ? lut[h[b + QK - 1]!]! : 0) : lut[amax]!;
    const d = Math.fround(absMax / 127);
    const id = d !== 0 ? Math.fround(1 / d) : 0;
    writeScale(out, o, d);
    const q = o + 2;
    if (d !== 0 && d < MIN_NORMAL_F32 && d > -MIN_NORMAL_F32) {
      for (let j = 0; j < QK; j++) {
        const v = Math.fround(lut[h[b + j]!]! * id);
        out[q + j] = toInt8Byte(dllama ? roundHalfEven(v) : roundHalfAway(v));
      }
      continue;
    }
    // Fast path, as in quantizeQ80, reading values two at a time.
    if (dllama) {
      for (let p = b >>> 1, end = p + QK / 2, k = q; p < end; p++, k += 2) {
        const w = pairs[p]!;
        out[k] = (Math.fround(lut[w & 0xffff]! * id) + RINT_MAGIC - RINT_MAGIC) | 0;
        out[k + 1] = (Math.fround(lut[w >>> 16]! * id) + RINT_MAGIC - RINT_MAGIC) | 0;
      }
    } else {
      for (let p = b >>> 1, end = p + QK / 2, k = q; p < end; p++, k += 2) {
        const w = pairs[p]!;
        const v0 = Math.fround(lut[w & 0xffff]! * id);
        const v1 = Math.fround(lut[w >>> 16]! * id);
        const r0 = v0 + RINT_MAGIC - RINT_MAGIC;
        const r1 = v1 + RINT_MAGIC - RINT_MAGIC;
        out[k] = (r0 - v0 === 0.5 || v0 - r0 === 0.5 ? v0 + (v0 < 0 ? -0.5 : 0.5) : r0) | 0;
        out[k + 1] = (r1 - v1 === 0.5 || v1 - r1 === 0.5 ? v1 + (v1 < 0 ? -0.5 : 0.5) : r1) | 0;
      }
    }
  }
}

/**
 * What both half-precision quantizers start from: checked sizes, the flavour, the value table and
 * infinity's bits for `dtype`, and the input (`h`, copied when it is not 4-aligned) also as 32-bit pairs.
 */
function halfInput(src: Uint16Array, dtype: 'F16' | 'BF16', out: Uint8Array, blockBytes: number, opts: EncodeOptions | undefined) {
  const n = src.length;
  checkBlocks(n, QK, opts?.label);
  checkOut(out, opts?.outOffset ?? 0, (n / QK) * blockBytes);
  const h = src.byteOffset % 4 === 0 ? src : src.slice();
  return {
    dllama: opts?.flavor === 'dllama',
    lut: dtype === 'F16' ? F16_TABLE : BF16_TABLE,
    infBits: dtype === 'F16' ? 0x7c00 : 0x7f80,
    h,
    pairs: new Uint32Array(h.buffer, h.byteOffset, n >>> 1),
  };
}

function checkOut(out: Uint8Array, offset: number, bytes: number): void {
  if (offset < 0 || offset + bytes > out.length) {
    throw new RangeError(`output buffer of ${out.length} bytes cannot hold ${bytes} bytes at offset ${offset}`);
  }
}

// ---------------------------------------------------------------------------------------------
// Generic entry point (used by the worker pool and the writers)

/**
 * Encodes raw source bytes as `format` into `out` at `opts.outOffset`; returns the bytes written
 * (always {@link encodedSize}). NaN/±Inf inputs, and values that overflow an f16 output, throw
 * `NonFinite`; q40/q80 need a multiple of 32 values (`BadBlockSize`).
 */
export function encodeChunk(src: RawChunk, format: WeightsFormat, out: Uint8Array, opts?: EncodeOptions): number {
  const elements = src.bytes.byteLength / dtypeSize(src.dtype);
  if (!Number.isInteger(elements)) {
    throw new ConvertError('ShapeMismatch', `${opts?.label ?? 'tensor'}: ${src.bytes.byteLength} bytes is not a whole number of ${src.dtype} values`);
  }
  const size = encodedSize(format, elements, opts?.label);
  const offset = opts?.outOffset ?? 0;
  checkOut(out, offset, size);
  switch (format) {
    case 'q40':
      if (src.dtype === 'F32') quantizeQ40(f32View(src.bytes), out, opts);
      else quantizeQ40Half(u16View(src.bytes), src.dtype, out, opts);
      return size;
    case 'q80':
      if (src.dtype === 'F32') quantizeQ80(f32View(src.bytes), out, opts);
      else quantizeQ80Half(u16View(src.bytes), src.dtype, out, opts);
      return size;
    case 'f32': {
      const aligned = (out.byteOffset + offset) % 4 === 0;
      const dst = aligned ? new Float32Array(out.buffer, out.byteOffset + offset, elements) : new Float32Array(elements);
      decodeToF32(src, dst, opts);
      if (!aligned) out.set(new Uint8Array(dst.buffer), offset);
      return size;
    }
    case 'f16': {
      const aligned = (out.byteOffset + offset) % 2 === 0;
      const dst = aligned ? new Uint16Array(out.buffer, out.byteOffset + offset, elements) : new Uint16Array(elements);
      if (src.dtype === 'F32') {
        f32ToF16(f32View(src.bytes), dst, opts);
      } else if (src.dtype === 'F16') {
        const h = u16View(src.bytes);
        for (let i = 0; i < elements; i++) {
          if ((h[i]! & 0x7c00) === 0x7c00) throw nonFinite(F16_TABLE[h[i]!]!, i, opts);
        }
        dst.set(h);
      } else {
        const h = u16View(src.bytes);
        for (let i = 0; i < elements; i++) {
          const u = h[i]! << 16;
          if ((u & 0x7fffffff) >= 0x477ff000) {
            throw nonFinite(BF16_TABLE[h[i]!]!, i, opts, (h[i]! & 0x7f80) === 0x7f80 ? 'is' : 'overflows f16:');
          }
          dst[i] = f16FromF32Bits(u);
        }
      }
      if (!aligned) out.set(new Uint8Array(dst.buffer), offset);
      return size;
    }
  }
}

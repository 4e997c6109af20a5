/**
 * Element conversions between F32, F16 and BF16, bit-exact with ggml's (`ggml_compute_fp32_to_fp16`
 * and its fp16/bf16 → fp32 tables), and what every encoder reads its input through: views over
 * raw little-endian bytes and the finiteness checks that name the tensor and element at fault.
 *
 * Exactness. JavaScript computes in float64; the references compute in float32. A float32 value
 * is reproduced exactly by a float64, and f16/bf16 → f32 is a table of exact values; f32 → f16
 * rounds on the bit pattern, as ggml does, so no float arithmetic is involved.
 *
 * Speed: the bulk conversions read typed arrays only and allocate nothing; F16/BF16 input goes
 * through 64K-entry lookup tables.
 */
import { ConvertError } from './errors';
import type { SourceDType } from './types';

if (new Uint8Array(new Uint16Array([1]).buffer)[0] !== 1) {
  // Typed-array views over file bytes assume the host byte order is the file's (little-endian).
  throw new Error('convert/elements.ts requires a little-endian host');
}

/** Where in a tensor a run of values sits, for error messages. */
export interface ElementOptions {
  /** Tensor name for error messages. */
  label?: string;
  /** Index of the chunk's first element within its tensor, for error messages. */
  elementOffset?: number;
}

/** A run of raw tensor bytes in its source element type (little-endian). */
export interface RawChunk {
  dtype: SourceDType;
  bytes: Uint8Array;
}

// ---------------------------------------------------------------------------------------------
// Scalar conversions and lookup tables

/**
 * fp16 bit pattern → value. Every value is exactly a float32; the table is float64 because V8
 * loads a Float64Array element about twice as fast as it loads and widens a Float32Array one.
 */
export const F16_TABLE: Float64Array = buildF16Table();
/** bf16 bit pattern → value (the bits are the top half of a float32); float64 as {@link F16_TABLE}. */
export const BF16_TABLE: Float64Array = buildBf16Table();

function buildF16Table(): Float64Array {
  const t = new Float64Array(65536);
  for (let h = 0; h < 65536; h++) {
    const exp = (h >>> 10) & 0x1f;
    const mant = h & 0x3ff;
    let v: number;
    if (exp === 0) v = mant * 2 ** -24;
    else if (exp === 31) v = mant === 0 ? Infinity : NaN;
    else v = (1024 + mant) * 2 ** (exp - 25);
    t[h] = h & 0x8000 ? -v : v;
  }
  return t;
}

function buildBf16Table(): Float64Array {
  const t = new Float32Array(65536);
  const bits = new Uint32Array(t.buffer);
  for (let h = 0; h < 65536; h++) bits[h] = h << 16;
  return Float64Array.from(t);
}

/**
 * float32 bit pattern → fp16 bit pattern, rounding to nearest, ties to even (IEEE 754), with
 * gradual underflow to fp16 subnormals; |x| ≥ 65520 gives ±Inf and NaN gives ±0x7E00, exactly
 * as ggml's `ggml_compute_fp32_to_fp16` (checked against it for all 2^32 non-NaN inputs).
 */
export function f16FromF32Bits(u: number): number {
  const sign = (u >>> 16) & 0x8000;
  const a = u & 0x7fffffff;
  if (a >= 0x477ff000) return a > 0x7f800000 ? sign | 0x7e00 : sign | 0x7c00;
  if (a >= 0x38800000) {
    // Normal fp16: re-bias the exponent (127 → 15) and round the 13 dropped mantissa bits;
    // a carry out of the mantissa correctly bumps the exponent.
    return sign | ((a - 0x38000000 + 0xfff + ((a >>> 13) & 1)) >>> 13);
  }
  if (a <= 0x33000000) return sign; // ≤ 2^-25: rounds to zero (2^-25 itself is a tie → even 0)
  // fp16 subnormal: value = m · 2^(e-150), result unit 2^-24, so shift right by 126 - e (14..24).
  const e = a >>> 23;
  const m = (a & 0x7fffff) | 0x800000;
  const shift = 126 - e;
  return sign | ((m + (1 << (shift - 1)) - 1 + ((m >>> shift) & 1)) >>> shift);
}

const scratchF32 = new Float32Array(1);
const scratchU32 = new Uint32Array(scratchF32.buffer);

/** The bit pattern of `Math.fround(x)`. */
export function f32Bits(x: number): number {
  scratchF32[0] = x;
  return scratchU32[0]!;
}

/** Value (rounded to float32 first) → fp16 bit pattern; see {@link f16FromF32Bits}. */
export function f32ToF16Bits(x: number): number {
  return f16FromF32Bits(f32Bits(x));
}

/** fp16 bit pattern → value. */
export function f16BitsToF32(h: number): number {
  return F16_TABLE[h & 0xffff]!;
}

/** bf16 bit pattern → value. */
export function bf16BitsToF32(h: number): number {
  return BF16_TABLE[h & 0xffff]!;
}

// ---------------------------------------------------------------------------------------------
// Sizes and views

/** Bytes per element of a source dtype. */
export function dtypeSize(dtype: SourceDType): number {
  return dtype === 'F32' ? 4 : 2;
}

/** A Uint16Array over `bytes`, copying only when `bytes` is not 2-byte aligned. */
export function u16View(bytes: Uint8Array): Uint16Array {
  if (bytes.byteOffset % 2 === 0) return new Uint16Array(bytes.buffer, bytes.byteOffset, bytes.byteLength >>> 1);
  return new Uint16Array(bytes.slice().buffer, 0, bytes.byteLength >>> 1);
}

/** A Float32Array over `bytes`, copying only when `bytes` is not 4-byte aligned. */
export function f32View(bytes: Uint8Array): Float32Array {
  if (bytes.byteOffset % 4 === 0) return new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength >>> 2);
  return new Float32Array(bytes.slice().buffer, 0, bytes.byteLength >>> 2);
}

/** A Uint32Array over a Float32Array's bits. */
export function u32Of(x: Float32Array): Uint32Array {
  return new Uint32Array(x.buffer, x.byteOffset, x.length);
}

/** `NonFinite` for the value at `index` of a run, naming its tensor and element. */
export function nonFinite(value: number, index: number, opts: ElementOptions | undefined, what = 'is'): ConvertError {
  const at = (opts?.elementOffset ?? 0) + index;
  return new ConvertError('NonFinite', `${opts?.label ?? 'tensor'}: element ${at} ${what} ${value}`);
}

// ---------------------------------------------------------------------------------------------
// Bulk element conversions

/** fp16 bits → float32. Throws `NonFinite` on ±Inf/NaN unless `allowNonFinite`. */
export function f16ToF32(src: Uint16Array, out: Float32Array, opts?: ElementOptions & { allowNonFinite?: boolean }): void {
  const n = src.length;
  const lut = F16_TABLE;
  const check = !opts?.allowNonFinite;
  for (let i = 0; i < n; i++) {
    const h = src[i]!;
    if (check && (h & 0x7c00) === 0x7c00) throw nonFinite(lut[h]!, i, opts);
    out[i] = lut[h]!;
  }
}

/** bf16 bits → float32. Throws `NonFinite` on ±Inf/NaN unless `allowNonFinite`. */
export function bf16ToF32(src: Uint16Array, out: Float32Array, opts?: ElementOptions & { allowNonFinite?: boolean }): void {
  const n = src.length;
  const bits = u32Of(out);
  for (let i = 0; i < n; i++) bits[i] = src[i]! << 16;
  if (!opts?.allowNonFinite) {
    for (let i = 0; i < n; i++) {
      if ((src[i]! & 0x7f80) === 0x7f80) throw nonFinite(out[i]!, i, opts);
    }
  }
}

/** float32 → fp16 bits (ties to even). Throws `NonFinite` for NaN/±Inf and for values that overflow fp16. */
export function f32ToF16(src: Float32Array, out: Uint16Array, opts?: ElementOptions): void {
  const n = src.length;
  const bits = u32Of(src);
  for (let i = 0; i < n; i++) {
    const u = bits[i]!;
    if ((u & 0x7fffffff) >= 0x477ff000) {
      throw nonFinite(src[i]!, i, opts, (u & 0x7f800000) === 0x7f800000 ? 'is' : 'overflows f16:');
    }
    out[i] = f16FromF32Bits(u);
  }
}

/** Throws `NonFinite` naming the tensor and element if `chunk` holds NaN or ±Inf. */
export function assertFinite(chunk: Float32Array, tensorName: string, elementOffset = 0): void {
  const bits = u32Of(chunk);
  const n = bits.length;
  for (let i = 0; i < n; i++) {
    if ((bits[i]! & 0x7f800000) === 0x7f800000) throw nonFinite(chunk[i]!, i, { label: tensorName, elementOffset });
  }
}

/** Decodes raw F32/F16/BF16 bytes to float32, rejecting NaN/±Inf with `NonFinite` unless `allowNonFinite`. */
export function decodeToF32(src: RawChunk, out?: Float32Array, opts?: ElementOptions & { allowNonFinite?: boolean }): Float32Array {
  const n = src.bytes.byteLength / dtypeSize(src.dtype);
  const dst = out ?? new Float32Array(n);
  if (dst.length < n) throw new RangeError(`output holds ${dst.length} values, need ${n}`);
  const target = dst.length === n ? dst : dst.subarray(0, n);
  if (src.dtype === 'F32') {
    target.set(f32View(src.bytes));
    if (!opts?.allowNonFinite) assertFinite(target, opts?.label ?? 'tensor', opts?.elementOffset);
  } else if (src.dtype === 'F16') {
    f16ToF32(u16View(src.bytes), target, opts);
  } else {
    bf16ToF32(u16View(src.bytes), target, opts);
  }
  return target;
}

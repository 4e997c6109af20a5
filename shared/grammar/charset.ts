/**
 * Sets of Unicode code points as sorted, disjoint, non-adjacent inclusive ranges: what a regex
 * class, a grammar's `[...]` and an automaton's edge hold. Every set the converter emits lies
 * within {@link SCALARS} (no surrogates, nothing above U+10FFFF): a well-formed string holds no
 * other code point, and llama.cpp, which decodes a token's bytes leniently, must not be offered one.
 */

/** Inclusive range of code points. */
export type CodeRange = readonly [number, number];
/** Sorted, disjoint, non-adjacent ranges. */
export type CharSet = readonly CodeRange[];

export const MAX_CODE_POINT = 0x10ffff;

/** The set of the given ranges (any order, overlapping or not). */
export function charSet(ranges: Iterable<CodeRange>): CharSet {
  const sorted = [...ranges].filter(([lo, hi]) => lo <= hi).sort((a, b) => a[0] - b[0]);
  const out: [number, number][] = [];
  for (const [lo, hi] of sorted) {
    const last = out[out.length - 1];
    if (last && lo <= last[1] + 1) last[1] = Math.max(last[1], hi);
    else out.push([lo, hi]);
  }
  return out;
}

export const single = (cp: number): CharSet => [[cp, cp]];
/** The code points of `chars` (a string). */
export const ofChars = (chars: string): CharSet => charSet(Array.from(chars, (c) => [c.codePointAt(0)!, c.codePointAt(0)!] as const));
export const union = (...sets: CharSet[]): CharSet => charSet(sets.flat());

export function intersect(a: CharSet, b: CharSet): CharSet {
  const out: [number, number][] = [];
  let i = 0;
  let j = 0;
  while (i < a.length && j < b.length) {
    const [alo, ahi] = a[i]!;
    const [blo, bhi] = b[j]!;
    const lo = Math.max(alo, blo);
    const hi = Math.min(ahi, bhi);
    if (lo <= hi) out.push([lo, hi]);
    if (ahi < bhi) i++;
    else j++;
  }
  return out;
}

/** Every code point 0..U+10FFFF not in `a`. */
export function complement(a: CharSet): CharSet {
  const out: [number, number][] = [];
  let next = 0;
  for (const [lo, hi] of a) {
    if (lo > next) out.push([next, lo - 1]);
    next = hi + 1;
  }
  if (next <= MAX_CODE_POINT) out.push([next, MAX_CODE_POINT]);
  return out;
}

export const subtract = (a: CharSet, b: CharSet): CharSet => intersect(a, complement(b));
export const isEmpty = (a: CharSet): boolean => a.length === 0;
export const has = (a: CharSet, cp: number): boolean => a.some(([lo, hi]) => lo <= cp && cp <= hi);
export const sameSet = (a: CharSet, b: CharSet): boolean => a.length === b.length && a.every(([lo, hi], i) => b[i]![0] === lo && b[i]![1] === hi);
export const setKey = (a: CharSet): string => a.map(([lo, hi]) => (lo === hi ? `${lo}` : `${lo}-${hi}`)).join(',');

/** Unicode scalar values: the code points a well-formed string can hold. */
export const SCALARS: CharSet = [
  [0, 0xd7ff],
  [0xe000, MAX_CODE_POINT],
];
export const DIGITS: CharSet = [[0x30, 0x39]];
/** `\w`: ASCII letters, digits and `_`. */
export const WORD: CharSet = charSet([
  [0x30, 0x39],
  [0x41, 0x5a],
  [0x5f, 0x5f],
  [0x61, 0x7a],
]);
/** ECMAScript's LineTerminator: what `.` does not match. */
export const LINE_TERMINATORS: CharSet = ofChars('\n\r\u2028\u2029');
/** `\s`: ECMAScript's WhiteSpace and LineTerminator. */
export const SPACE: CharSet = charSet([
  [0x09, 0x0d],
  [0x20, 0x20],
  [0xa0, 0xa0],
  [0x1680, 0x1680],
  [0x2000, 0x200a],
  [0x2028, 0x2029],
  [0x202f, 0x202f],
  [0x205f, 0x205f],
  [0x3000, 0x3000],
  [0xfeff, 0xfeff],
]);

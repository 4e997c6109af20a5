/**
 * Numbers and integers with bounds and `multipleOf`, as plain decimals (`-12.5`, never `1e3`).
 *
 * Why the bounds are exact against Ajv: Ajv compares the double `JSON.parse` makes of the text
 * with the bound (itself a double). Parsing rounds to nearest, ties to even, and is monotonic, so
 * "the double of x is ≥ m" holds exactly for the decimals x above the midpoint between m and the
 * double below it (or at it, when the tie rounds to m). Those midpoints are binary fractions,
 * computed here exactly with BigInt; then bounds are integers on the grid of the allowed fraction
 * digits. So `minimum: 0.1` admits `0.1` itself (the bound is always admitted) and
 * `exclusiveMaximum: 1e20` stops below the doubles that round to 1e20.
 *
 * The grid: a number has at most F fraction digits (16, or the digits of a bound written with
 * more; with `multipleOf` the digits of its step: multiples of 0.25 need 2), an integer none. A
 * value is then an integer N = x·10^F, and `multipleOf` c·10^-e (as written, e.g. 0.01 is 1·10^-2)
 * is N ≡ 0 (mod K). A side without a bound stops at ±(2^53 − 1), the integers a double holds
 * exactly (beyond them JavaScript and Python read a different value than was written); beside a
 * `multipleOf` that is a binary fraction p/2^k, at ±(2^53 − 1)/2^k, where its multiples stop being
 * doubles.
 *
 * `multipleOf` is decimal: 0.3 is a multiple of 0.1. Ajv with its default options divides doubles
 * (0.3 / 0.1 = 2.9999999999999996) and rejects some exact decimal multiples of a step that is not
 * a binary fraction; `multipleOfPrecision` or a decimal check agrees with this grammar. A step
 * that is a binary fraction (0.5, 0.25, integers) agrees with Ajv's default too. Validators that
 * divide doubles with a tolerance (Ajv's `multipleOfPrecision: 9`, pydantic's relative check)
 * misjudge exact multiples once the quotient is large (1234567.85 / 0.05 is off by 4e-9), so for
 * a step that is not a binary fraction a side without a bound stops at
 * {@link NUMBER_LIMITS.openDecimalSteps} steps from zero; bounds the schema gives are kept.
 *
 * The language of N in [lo, hi] with N ≡ 0 (mod K) is built per count of integer digits: the
 * digit strings between two bounds of equal length are a chain of "tight" positions (still equal
 * to a bound's prefix) branching into "free" suffixes; a free suffix of r digits that must be
 * ≡ need (mod K) is a rule per (r, need), shared by all lengths and both signs, created only when
 * reachable (for K = 1000 only the last three digits' states differ). The states are counted and
 * refused above {@link NUMBER_LIMITS}.
 */
import { charSet } from './charset';
import { alt, chars, EMPTY, type Grammar, lit, NEVER, type Node, opt, rep, seq } from './gbnf';
import { digit } from './json-text';
import { refuse } from './refusal';

export const NUMBER_LIMITS = {
  /** Digits of a number's integer and fraction parts together (1e308 has 309). */
  digits: 400,
  /** Free-suffix states of a `multipleOf` (a divisibility automaton over the digits). */
  divisibilityStates: 2_000,
  /** Fraction digits of a number without a `multipleOf`, when its bounds do not need more. */
  fractionDigits: 16,
  /** Steps from zero an unbounded side of a `multipleOf` that is not a binary fraction reaches (the quotient a double divides within 1e-9). */
  openDecimalSteps: 1_000_000n,
} as const;

const MAX_SAFE = 2n ** 53n - 1n;

export interface NumberKeywords {
  integer: boolean;
  minimum?: number;
  maximum?: number;
  exclusiveMinimum?: number;
  exclusiveMaximum?: number;
  multipleOf?: number;
}

/** x = num / 2^shift exactly. */
interface Dyadic {
  num: bigint;
  shift: number;
}

const bitsOf = (x: number): bigint => {
  const view = new DataView(new ArrayBuffer(8));
  view.setFloat64(0, x);
  return view.getBigUint64(0);
};
const fromBits = (bits: bigint): number => {
  const view = new DataView(new ArrayBuffer(8));
  view.setBigUint64(0, bits);
  return view.getFloat64(0);
};

/** The next double above x (Infinity above the largest). */
function nextUp(x: number): number {
  if (x === 0) return Number.MIN_VALUE;
  const bits = bitsOf(x);
  return fromBits(x > 0 ? bits + 1n : bits - 1n);
}
const nextDown = (x: number): number => -nextUp(-x);

/** The exact value of a double; ±Infinity stands for ±2^1024, where rounding overflows (the midpoint above MAX_VALUE). */
function dyadic(x: number): Dyadic {
  if (!Number.isFinite(x)) return { num: x > 0 ? 2n ** 1024n : -(2n ** 1024n), shift: 0 };
  const bits = bitsOf(Math.abs(x));
  const exp = Number(bits >> 52n);
  const frac = bits & ((1n << 52n) - 1n);
  const mant = exp === 0 ? frac : frac | (1n << 52n);
  const e = (exp === 0 ? 1 : exp) - 1075;
  const num = e >= 0 ? mant << BigInt(e) : mant;
  return { num: x < 0 ? -num : num, shift: e >= 0 ? 0 : -e };
}

/** Does x's significand end in 0 (where a tie rounds)? Zero and ±Infinity (2^1024) are even. */
const isEven = (x: number): boolean => !Number.isFinite(x) || (bitsOf(Math.abs(x)) & 1n) === 0n;

function midpoint(a: Dyadic, b: Dyadic): Dyadic {
  const shift = Math.max(a.shift, b.shift);
  return { num: (a.num << BigInt(shift - a.shift)) + (b.num << BigInt(shift - b.shift)), shift: shift + 1 };
}

const floorDiv = (a: bigint, b: bigint): bigint => (a >= 0n ? a / b : -((-a + b - 1n) / b));
const ceilDiv = (a: bigint, b: bigint): bigint => -floorDiv(-a, b);
const mod = (a: bigint, k: bigint): bigint => ((a % k) + k) % k;
const pow10 = (n: number): bigint => 10n ** BigInt(n);
const gcd = (a: bigint, b: bigint): bigint => (b === 0n ? a : gcd(b, a % b));

/** A double as the decimal it is written as (its shortest form): digits · 10^-scale. */
function decimalOf(x: number): { digits: bigint; scale: number } {
  const m = /^(-?)(\d+)(?:\.(\d+))?(?:e([+-]\d+))?$/.exec(String(x));
  if (!m) throw new Error(`not a finite number: ${x}`);
  const frac = m[3] ?? '';
  let digits = BigInt(m[2]! + frac);
  let scale = frac.length - Number(m[4] ?? 0);
  if (scale < 0) {
    digits *= pow10(-scale);
    scale = 0;
  }
  return { digits: m[1] ? -digits : digits, scale };
}

/**
 * The least N on the grid 10^-F whose decimal parses to a double ≥ `target`: above the midpoint
 * between `target` and the double below it, or at it if the tie rounds up to `target`.
 */
function leastAtOrAbove(target: number, F: number): bigint {
  const mid = midpoint(dyadic(nextDown(target)), dyadic(target));
  const scaled = mid.num * pow10(F);
  const den = 1n << BigInt(mid.shift);
  return isEven(target) ? ceilDiv(scaled, den) : floorDiv(scaled, den) + 1n;
}

/** The greatest N on the grid 10^-F whose decimal parses to a double ≤ `target`. */
function greatestAtOrBelow(target: number, F: number): bigint {
  const mid = midpoint(dyadic(target), dyadic(nextUp(target)));
  const scaled = mid.num * pow10(F);
  const den = 1n << BigInt(mid.shift);
  return isEven(target) ? floorDiv(scaled, den) : ceilDiv(scaled, den) - 1n;
}

const digitSet = (ds: number[]): Node => chars(charSet(ds.map((d) => [0x30 + d, 0x30 + d] as const)));
const digitCount = (n: bigint): number => (n < 0n ? -n : n).toString().length;

/** The grammar of the numbers (or integers) `kw` admits. Throws a Refusal if none or too large. */
export function numberGrammar(g: Grammar, kw: NumberKeywords, hint: string): Node {
  // The grid: F fraction digits, and N = x·10^F ≡ 0 (mod K).
  let F = 0;
  let K = 1n;
  const step = kw.multipleOf === undefined ? undefined : decimalOf(kw.multipleOf);
  if (step) {
    if (kw.integer) K = step.digits / gcd(step.digits, pow10(step.scale));
    else {
      F = step.scale;
      K = step.digits;
    }
  } else if (!kw.integer) {
    F = Math.max(
      NUMBER_LIMITS.fractionDigits,
      ...[kw.minimum, kw.maximum, kw.exclusiveMinimum, kw.exclusiveMaximum].map((b) => (b === undefined ? 0 : decimalOf(b).scale)),
    );
  }
  if (F > NUMBER_LIMITS.digits) refuse('multipleOf', `The keyword 'multipleOf' needs ${F} fraction digits (at most ${NUMBER_LIMITS.digits}).`);

  // Bounds on N, exact against the doubles Ajv compares (see the module comment).
  const lows: bigint[] = [];
  const highs: bigint[] = [];
  if (kw.minimum !== undefined) lows.push(leastAtOrAbove(kw.minimum, F));
  if (kw.exclusiveMinimum !== undefined) {
    const above = nextUp(kw.exclusiveMinimum);
    if (!Number.isFinite(above)) refuse('exclusiveMinimum', "No number is above the keyword 'exclusiveMinimum'.");
    lows.push(leastAtOrAbove(above, F));
  }
  if (kw.maximum !== undefined) highs.push(greatestAtOrBelow(kw.maximum, F));
  if (kw.exclusiveMaximum !== undefined) {
    const below = nextDown(kw.exclusiveMaximum);
    if (!Number.isFinite(below)) refuse('exclusiveMaximum', "No number is below the keyword 'exclusiveMaximum'.");
    highs.push(greatestAtOrBelow(below, F));
  }
  const implicit = MAX_SAFE * pow10(F);
  let lo = lows.length > 0 ? lows.reduce((a, b) => (a > b ? a : b)) : undefined;
  let hi = highs.length > 0 ? highs.reduce((a, b) => (a < b ? a : b)) : undefined;
  // A side without a bound stops at ±(2^53 − 1) — a million steps for a step that is not a binary
  // fraction (see the module comment) — or, beyond the other bound, one integer digit further.
  let open = implicit;
  if (step) {
    const denominator = pow10(step.scale) / gcd(step.digits, pow10(step.scale));
    if (denominator % 5n === 0n) {
      const steps = (NUMBER_LIMITS.openDecimalSteps * step.digits * pow10(F)) / pow10(step.scale);
      if (steps < open) open = steps;
    } else if (!kw.integer && denominator > 1n) {
      // A binary fraction p/2^k: its multiples are doubles exactly below 2^53/2^k (2.5's below 2^52;
      // 5262606177854832.5 reads as …832, no multiple).
      const exact = (MAX_SAFE * pow10(F)) / denominator;
      if (exact < open) open = exact;
    }
  }
  if (hi === undefined) hi = lo !== undefined && lo > open ? pow10(digitCount(floorDiv(lo, pow10(F))) + 1) * pow10(F) - 1n : open;
  if (lo === undefined) lo = hi < -open ? -(pow10(digitCount(floorDiv(-hi, pow10(F))) + 1) * pow10(F) - 1n) : -open;
  const lowKeyword = kw.exclusiveMinimum !== undefined && kw.minimum === undefined ? 'exclusiveMinimum' : 'minimum';
  const what = kw.integer ? 'integer' : `number with at most ${F} fraction digits`;
  if (lo > hi) refuse(lowKeyword, `No ${what} lies between the bounds (the keyword '${lowKeyword}' is above the upper bound).`);
  if (K > 1n) {
    if (floorDiv(hi, K) < ceilDiv(lo, K)) refuse('multipleOf', `No ${what} between the bounds is a multiple of the keyword 'multipleOf'.`);
    if (hi > implicit || lo < -implicit)
      refuse('multipleOf', "The keyword 'multipleOf' beside a bound beyond ±2^53 cannot be enforced: a double does not hold every multiple there.");
  }
  const P = Math.max(digitCount(lo), digitCount(hi), F + 1);
  if (P > NUMBER_LIMITS.digits) refuse(lowKeyword, `The bounds need ${P} digits (at most ${NUMBER_LIMITS.digits}).`);

  const digits = new Digits(g, F, K, hint);
  // x in [lo, hi]: "-" and a magnitude in [max(1, -hi), -lo], or a magnitude in [max(0, lo), hi].
  if (lo < 0n && -lo === hi) return seq(opt(lit('-')), digits.magnitudes(0n, hi));
  const negative = lo < 0n ? seq(lit('-'), digits.magnitudes(hi < 0n ? -hi : 1n, -lo)) : NEVER;
  const positive = hi >= 0n ? digits.magnitudes(lo > 0n ? lo : 0n, hi) : NEVER;
  return alt(negative, positive);
}

/** Decimal texts of magnitudes N·10^-F on one grid, sharing their free-suffix rules. */
class Digits {
  private readonly free = new Map<string, Node>();

  constructor(
    private readonly g: Grammar,
    private readonly F: number,
    private readonly K: bigint,
    private readonly hint: string,
  ) {}

  /** The optional fraction after an integer part, when every fraction is allowed (K = 1). */
  private fraction(): Node {
    return this.F === 0 ? EMPTY : this.g.define(`fraction-${this.F}`, alt(EMPTY, seq(lit('.'), digit(), this.digitsUpTo(this.F - 1))));
  }

  /** 0 to r digits, as a chain of shared rules (`d ::= "" | [0-9] d'`): r rules for every use, not r per use. */
  private digitsUpTo(r: number): Node {
    return r === 0 ? EMPTY : this.g.define(`digits-${r}`, alt(EMPTY, seq(digit(), this.digitsUpTo(r - 1))));
  }

  /** Canonical texts (no leading zeros; up to F fraction digits, trailing ones optional) of N in [a, b], a ≥ 0. */
  magnitudes(a: bigint, b: bigint): Node {
    const { F } = this;
    const scale = pow10(F);
    const branches: Node[] = [];
    let fullFrom = 0;
    let fullTo = 0;
    const flushFull = () => {
      if (fullFrom === 0) return;
      branches.push(seq(digit(1, 9), rep(digit(), fullFrom - 1, fullTo - 1), this.fraction()));
      fullFrom = 0;
    };
    for (let n = digitCount(a / scale); n <= digitCount(b / scale); n++) {
      const lowN = n === 1 ? 0n : pow10(n - 1) * scale;
      const highN = pow10(n) * scale - 1n;
      const from = a > lowN ? a : lowN;
      const to = b < highN ? b : highN;
      if (from > to) continue;
      // All n-digit integer parts, K = 1: one branch for a run of such lengths.
      if (this.K === 1n && from === lowN && to === highN && n > 1) {
        if (fullFrom === 0) fullFrom = n;
        fullTo = n;
        continue;
      }
      flushFull();
      const P = n + F;
      branches.push(this.tight(from.toString().padStart(P, '0'), to.toString().padStart(P, '0'), 0, true, true, 0n));
    }
    flushFull();
    return alt(...branches);
  }

  /**
   * Digit strings from position i of two equal-length bounds `a` ≤ `b`, still equal to a's prefix
   * (`low`) and/or b's (`high`), whose remaining value must be ≡ need (mod K). The point goes
   * before the last F digits; the fraction may stop early when the rest would be zeros.
   */
  private tight(a: string, b: string, i: number, lowBound: boolean, highBound: boolean, need: bigint): Node {
    const P = a.length;
    const r = P - i;
    if (r === 0) return need === 0n ? EMPTY : NEVER;
    // A bound whose rest is 00…0 (or 99…9) no longer constrains the rest.
    const low = lowBound && !/^0*$/.test(a.slice(i));
    const high = highBound && !/^9*$/.test(b.slice(i));
    if (!low && !high) return this.freeSuffix(r, need);
    const from = low ? Number(a[i]) : 0;
    const to = high ? Number(b[i]) : 9;
    const branches: Node[] = [];
    const freeGroups = new Map<bigint, number[]>();
    for (let d = from; d <= to; d++) {
      const low2 = low && d === Number(a[i]);
      const high2 = high && d === Number(b[i]);
      const need2 = mod(need - BigInt(d) * pow10(r - 1), this.K);
      if (low2 || high2) branches.push(seq(lit(String(d)), this.tight(a, b, i + 1, low2, high2, need2)));
      else freeGroups.set(need2, [...(freeGroups.get(need2) ?? []), d]);
    }
    for (const [need2, ds] of freeGroups) branches.push(seq(digitSet(ds), this.freeSuffix(r - 1, need2)));
    const stop = r <= this.F && need === 0n && !low ? EMPTY : NEVER;
    return this.withPoint(r, stop, alt(...branches));
  }

  /** The digits at r remaining positions, with the point (r = F) or an early stop (r ≤ F) around them. */
  private withPoint(r: number, stop: Node, digits: Node): Node {
    if (this.F > 0 && r === this.F) return alt(stop, seq(lit('.'), digits));
    return r < this.F ? alt(stop, digits) : digits;
  }

  /** Any r-digit suffix (with the point and early stop) whose value is ≡ need (mod K). */
  private freeSuffix(r: number, need: bigint): Node {
    if (r === 0) return need === 0n ? EMPTY : NEVER;
    if (need >= pow10(r)) return NEVER; // Its least value ≡ need is need itself: too many digits.
    if (this.K === 1n) return r > this.F ? seq(rep(digit(), r - this.F, r - this.F), this.fraction()) : r === this.F ? this.fraction() : this.digitsUpTo(r);
    const key = `${r}:${need}`;
    const known = this.free.get(key);
    if (known) return known;
    if (this.free.size >= NUMBER_LIMITS.divisibilityStates)
      refuse('multipleOf', `The keyword 'multipleOf' needs more than ${NUMBER_LIMITS.divisibilityStates} divisibility states over these digits.`);
    const groups = new Map<bigint, number[]>();
    for (let d = 0; d <= 9; d++) {
      const need2 = mod(need - BigInt(d) * pow10(r - 1), this.K);
      groups.set(need2, [...(groups.get(need2) ?? []), d]);
    }
    const branches = [...groups].map(([need2, ds]) => seq(digitSet(ds), this.freeSuffix(r - 1, need2)));
    const node = this.g.define(`${this.hint}-k${r}-${need}`, this.withPoint(r, need === 0n ? EMPTY : NEVER, alt(...branches)));
    this.free.set(key, node);
    return node;
  }
}

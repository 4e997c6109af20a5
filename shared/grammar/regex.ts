/**
 * A JSON Schema `pattern` (ECMA-262, compiled by Ajv with the `u` flag) as a tree of code-point
 * sets, sequences, choices, counted repetitions and the anchors `^`/`$`.
 *
 * Read: literals, `.` (any code point but a line terminator), classes `[...]`/`[^...]` with
 * ranges and escapes, `\d \w \s \D \W \S`, the escapes `\t \n \v \f \r \0 \cX \xHH \uHHHH
 * \u{H…}` (a `\uD83D\uDE00` pair is one code point) and escaped syntax characters, groups `(...)`,
 * `(?:...)`, `(?<name>...)`, alternation, `* + ? {n} {n,} {n,m}` and their lazy forms (the same
 * language), anchors `^ $` (no `m` flag: string start and end).
 * Refused, naming the construct: backreferences (`\1`, `\k<name>`) and lookaround (`(?=`,
 * `(?!`, `(?<=`, `(?<!`), which no context-free grammar expresses in general; word boundaries
 * (`\b`, `\B`) and Unicode property escapes (`\p{…}`), which would need Unicode's tables; inline
 * modifiers (`(?i:…)`). A pattern JavaScript itself rejects is refused as invalid.
 * Every set is cut to {@link SCALARS}: a string never holds a lone surrogate.
 */
import { type CharSet, charSet, complement, DIGITS, intersect, LINE_TERMINATORS, SCALARS, single, SPACE, union, WORD } from './charset';
import { refuse } from './refusal';

export type Regex =
  | { readonly k: 'set'; readonly set: CharSet }
  | { readonly k: 'seq'; readonly items: readonly Regex[] }
  | { readonly k: 'alt'; readonly items: readonly Regex[] }
  | { readonly k: 'rep'; readonly item: Regex; readonly min: number; readonly max: number | null }
  | { readonly k: 'start' }
  | { readonly k: 'end' };

/** Largest count in `{n,m}`. */
export const REGEX_MAX_COUNT = 10_000;

const CLASS_ESCAPES: Readonly<Record<string, CharSet>> = {
  d: DIGITS,
  D: complement(DIGITS),
  w: WORD,
  W: complement(WORD),
  s: SPACE,
  S: complement(SPACE),
};
const CONTROL_ESCAPES: Readonly<Record<string, number>> = { t: 9, n: 10, v: 11, f: 12, r: 13 };

/** Parses `source`, or throws a Refusal under `keyword` naming what cannot be enforced. */
export function parseRegex(source: string, keyword = 'pattern'): Regex {
  try {
    new RegExp(source, 'u');
  } catch (err) {
    refuse(keyword, `The keyword '${keyword}' is not a valid regular expression (ECMA-262 with the u flag, as Ajv compiles it): ${(err as Error).message}`);
  }
  const cps = Array.from(source);
  let pos = 0;
  const peek = (o = 0) => cps[pos + o];
  const unsupported = (construct: string, why: string): never =>
    refuse(keyword, `The keyword '${keyword}' uses ${construct}, which the grammar cannot enforce (${why}).`);

  const hexValue = (count: number): number => {
    const text = cps.slice(pos, pos + count).join('');
    pos += count;
    return parseInt(text, 16);
  };

  /** After a `\` (outside or inside a class): a set, a code point, or a refusal. */
  const escape = (inClass: boolean): CharSet => {
    const c = cps[pos++]!;
    if (c in CLASS_ESCAPES) return CLASS_ESCAPES[c]!;
    if (c in CONTROL_ESCAPES) return single(CONTROL_ESCAPES[c]!);
    if (c === 'p' || c === 'P') unsupported('a Unicode property escape (\\p{…})', 'it needs Unicode character tables');
    if (c === 'b') return inClass ? single(8) : unsupported('a word boundary (\\b)', 'an assertion on both neighbours');
    if (c === 'B') unsupported('a non-word boundary (\\B)', 'an assertion on both neighbours');
    if (c === 'k') unsupported('a named backreference (\\k<…>)', 'a backreference repeats text already matched, which no grammar can');
    if (/[1-9]/.test(c)) unsupported(`a backreference (\\${c})`, 'a backreference repeats text already matched, which no grammar can');
    if (c === '0') return single(0);
    if (c === 'c') return single(cps[pos++]!.codePointAt(0)! % 32);
    if (c === 'x') return single(hexValue(2));
    if (c === 'u') {
      if (peek() === '{') {
        pos++;
        const end = cps.indexOf('}', pos);
        const cp = parseInt(cps.slice(pos, end).join(''), 16);
        pos = end + 1;
        return single(cp);
      }
      const unit = hexValue(4);
      // A surrogate pair written as two escapes is one code point under the u flag.
      if (unit >= 0xd800 && unit <= 0xdbff && peek() === '\\' && peek(1) === 'u' && /^[0-9a-fA-F]{4}$/.test(cps.slice(pos + 2, pos + 6).join(''))) {
        const low = parseInt(cps.slice(pos + 2, pos + 6).join(''), 16);
        if (low >= 0xdc00 && low <= 0xdfff) {
          pos += 6;
          return single(0x10000 + ((unit - 0xd800) << 10) + (low - 0xdc00));
        }
      }
      return single(unit);
    }
    return single(c.codePointAt(0)!);
  };

  const characterClass = (): CharSet => {
    pos++; // [
    const negated = peek() === '^';
    if (negated) pos++;
    const parts: CharSet[] = [];
    const atom = (): CharSet => {
      const c = cps[pos++]!;
      return c === '\\' ? escape(true) : single(c.codePointAt(0)!);
    };
    while (peek() !== ']') {
      const from = atom();
      if (peek() === '-' && peek(1) !== ']' && peek(1) !== undefined) {
        pos++;
        const to = atom();
        // RegExp accepted the pattern, so both ends are single code points.
        parts.push(charSet([[from[0]![0], to[0]![0]]]));
      } else parts.push(from);
    }
    pos++; // ]
    const set = union(...parts);
    return negated ? complement(set) : set;
  };

  const disjunction = (): Regex => {
    const items = [alternative()];
    while (peek() === '|') {
      pos++;
      items.push(alternative());
    }
    return items.length === 1 ? items[0]! : { k: 'alt', items };
  };

  const alternative = (): Regex => {
    const items: Regex[] = [];
    while (pos < cps.length && peek() !== '|' && peek() !== ')') items.push(term());
    return items.length === 1 ? items[0]! : { k: 'seq', items };
  };

  const term = (): Regex => {
    const c = peek();
    if (c === '^') {
      pos++;
      return { k: 'start' };
    }
    if (c === '$') {
      pos++;
      return { k: 'end' };
    }
    const item = atom();
    return quantified(item);
  };

  const atom = (): Regex => {
    const c = cps[pos]!;
    if (c === '.') {
      pos++;
      return { k: 'set', set: complement(LINE_TERMINATORS) };
    }
    if (c === '[') return { k: 'set', set: characterClass() };
    if (c === '\\') {
      pos++;
      return { k: 'set', set: escape(false) };
    }
    if (c === '(') {
      pos++;
      if (peek() === '?') {
        const next = cps.slice(pos, pos + 3).join('');
        if (next.startsWith('?=') || next.startsWith('?!')) unsupported('a lookahead ((?=…) or (?!…))', 'no grammar can look ahead without consuming');
        if (next === '?<=' || next === '?<!') unsupported('a lookbehind ((?<=…) or (?<!…))', 'no grammar can look behind');
        if (next.startsWith('?:')) pos += 2;
        else if (next.startsWith('?<')) pos = cps.indexOf('>', pos) + 1;
        else unsupported('an inline modifier ((?i:…))', 'only the u flag is given to a pattern');
      }
      const inner = disjunction();
      pos++; // )
      return inner;
    }
    pos++;
    return { k: 'set', set: single(c.codePointAt(0)!) };
  };

  const quantified = (item: Regex): Regex => {
    let min: number;
    let max: number | null;
    const c = peek();
    if (c === '*') [min, max] = [0, null];
    else if (c === '+') [min, max] = [1, null];
    else if (c === '?') [min, max] = [0, 1];
    else if (c === '{') {
      const m = /^\{(\d+)(,(\d*))?\}/.exec(cps.slice(pos, pos + 40).join(''));
      if (!m) return item;
      min = Number(m[1]);
      max = m[2] === undefined ? min : m[3] === '' ? null : Number(m[3]);
      if (min > REGEX_MAX_COUNT || (max !== null && max > REGEX_MAX_COUNT))
        refuse(keyword, `The keyword '${keyword}' repeats a part more than ${REGEX_MAX_COUNT} times.`);
      pos += m[0].length - 1;
    } else return item;
    pos++;
    if (peek() === '?') pos++; // lazy: the same language
    return quantified({ k: 'rep', item, min, max });
  };

  const tree = disjunction();
  return restrict(tree);
}

/** Cuts every set to the code points a string can hold. */
function restrict(re: Regex): Regex {
  switch (re.k) {
    case 'set':
      return { k: 'set', set: intersect(re.set, SCALARS) };
    case 'seq':
    case 'alt':
      return { k: re.k, items: re.items.map(restrict) };
    case 'rep':
      return { ...re, item: restrict(re.item) };
    default:
      return re;
  }
}

/** Does the tree contain an anchor? */
export function hasAnchor(re: Regex): boolean {
  switch (re.k) {
    case 'start':
    case 'end':
      return true;
    case 'seq':
    case 'alt':
      return re.items.some(hasAnchor);
    case 'rep':
      return hasAnchor(re.item);
    default:
      return false;
  }
}

/** Shortest and longest length (in code points) of the strings a tree without anchors matches; max null: unbounded. */
export function lengthRange(re: Regex): { min: number; max: number | null } {
  switch (re.k) {
    case 'set':
      return { min: 1, max: 1 };
    case 'start':
    case 'end':
      return { min: 0, max: 0 };
    case 'seq': {
      let min = 0;
      let max: number | null = 0;
      for (const r of re.items.map(lengthRange)) {
        min += r.min;
        max = max === null || r.max === null ? null : max + r.max;
      }
      return { min, max };
    }
    case 'alt': {
      const rs = re.items.map(lengthRange);
      return { min: Math.min(...rs.map((r) => r.min)), max: rs.some((r) => r.max === null) ? null : Math.max(...rs.map((r) => r.max!)) };
    }
    case 'rep': {
      const r = lengthRange(re.item);
      return { min: r.min * re.min, max: r.max === 0 ? 0 : r.max === null || re.max === null ? null : r.max * re.max };
    }
  }
}

/**
 * JSON text: whitespace, strings and their escapes, the unconstrained number and integer, any
 * JSON value, literals. A string's content is counted and matched on the decoded string (what
 * Ajv sees), so the grammar must know how many characters an escape stands for:
 * - {@link Json.char} is one character of any string, in every form JSON allows but a lone
 *   surrogate: raw, `\"`-style, `\uXXXX` for a non-surrogate, and a `\uD8xx\uDCxx` pair (one
 *   character, as Ajv counts it).
 * - {@link Json.encode} writes each character of a set in exactly one way (JSON.stringify's: raw
 *   where JSON allows it, `\"` `\\` `\b` `\f` `\n` `\r` `\t`, `\u00xx` for the other controls), so
 *   a decoded string has one text: needed where a string is excluded (property names) and harmless
 *   elsewhere (a grammar may be stricter than the schema).
 * Whitespace: after `{`, `[`, `:` and `,` and before `}` and `]`, none, a space, or one or two
 * newlines and up to 20 spaces or tabs (bounded, so a small model cannot loop on it; the compact,
 * `json.dumps` and indented styles all fit: a model that writes `",\n  "` as one token is not
 * forced off its way of closing a string).
 */
import { type CharSet, charSet, DIGITS, has, intersect, ofChars, SCALARS, subtract } from './charset';
import { alt, chars, type Grammar, lit, type Node, opt, ref, rep, seq } from './gbnf';

/** Code points a JSON string may hold unescaped (no controls, `"`, `\`, surrogates). */
export const RAW: CharSet = subtract(
  SCALARS,
  charSet([
    [0, 0x1f],
    [0x22, 0x22],
    [0x5c, 0x5c],
  ]),
);
const HEX: CharSet = charSet([
  [0x30, 0x39],
  [0x41, 0x46],
  [0x61, 0x66],
]);
const SHORT_ESCAPES: Readonly<Record<number, string>> = { 0x08: 'b', 0x09: 't', 0x0a: 'n', 0x0c: 'f', 0x0d: 'r' };
/** Digits in a plain number without bounds: enough for any double's 17 significant digits. */
const PLAIN_INTEGER_DIGITS = 16;
const PLAIN_FRACTION_DIGITS = 16;

export const digit = (from = 0, to = 9): Node => chars([[0x30 + from, 0x30 + to]]);

/** The shared pieces of JSON text, defined once per grammar. */
export class Json {
  private cache = new Map<string, Node>();
  constructor(readonly g: Grammar) {}

  private once(name: string, make: () => Node): Node {
    let n = this.cache.get(name);
    if (!n) {
      n = this.g.define(name, make());
      this.cache.set(name, n);
    }
    return n;
  }

  /** Whitespace where JSON allows it (see the module comment): none, a space, or a line break and an indent. */
  get ws(): Node {
    return this.once('ws', () => opt(alt(lit(' '), seq(rep(lit('\n'), 1, 2), rep(chars(ofChars(' \t')), 0, 20)))));
  }

  /** `open` `body` `close` with whitespace inside both brackets (once, when the body is empty). */
  container(open: string, body: Node, close: string): Node {
    if (body.k === 'lit' && body.text === '') return seq(lit(open), this.ws, lit(close));
    if (body.k === 'rep' && body.min === 0 && body.max === 1) return seq(lit(open), this.ws, opt(seq(body.item, this.ws)), lit(close));
    return seq(lit(open), this.ws, body, this.ws, lit(close));
  }

  /** One character of a string, in any form (see the module comment). */
  get char(): Node {
    return this.once('char', () => {
      const hex = chars(HEX);
      const bmp = alt(seq(chars(subtract(HEX, ofChars('Dd'))), rep(hex, 3, 3)), seq(chars(ofChars('Dd')), digit(0, 7), rep(hex, 2, 2)));
      const high = seq(chars(ofChars('Dd')), chars(ofChars('89ABab')), rep(hex, 2, 2));
      const low = seq(chars(ofChars('Dd')), chars(ofChars('CDEFcdef')), rep(hex, 2, 2));
      return alt(chars(RAW), seq(lit('\\'), chars(ofChars('"\\/bfnrt'))), seq(lit('\\u'), bmp), seq(lit('\\u'), high, lit('\\u'), low));
    });
  }

  /** Any string. */
  get string(): Node {
    return this.once('string', () => seq(lit('"'), rep(this.char, 0, null), lit('"')));
  }

  get boolean(): Node {
    return this.once('boolean', () => alt(lit('true'), lit('false')));
  }

  get null(): Node {
    return lit('null');
  }

  /** An integer without bounds: at most 16 digits (a small model cannot write digits forever). */
  get integer(): Node {
    return this.once('integer', () => seq(opt(lit('-')), alt(lit('0'), seq(digit(1, 9), rep(digit(), 0, PLAIN_INTEGER_DIGITS - 1)))));
  }

  /** A number without bounds: 16 digits each side of the point, a two-digit exponent (always finite). */
  get number(): Node {
    return this.once('number', () =>
      seq(
        opt(lit('-')),
        alt(lit('0'), seq(digit(1, 9), rep(digit(), 0, PLAIN_INTEGER_DIGITS - 1))),
        opt(seq(lit('.'), rep(chars(DIGITS), 1, PLAIN_FRACTION_DIGITS))),
        opt(seq(chars(ofChars('eE')), opt(chars(ofChars('+-'))), rep(chars(DIGITS), 1, 2))),
      ),
    );
  }

  /** Any JSON value (recursive: `value`, with its `object` and `array`). */
  get value(): Node {
    const cached = this.cache.get('value');
    if (cached) return cached;
    const name = this.g.declare('value');
    const value = ref(name);
    this.cache.set('value', value);
    const member = seq(this.string, lit(':'), this.ws, value);
    const object = this.g.define('object', this.container('{', opt(seq(member, rep(seq(lit(','), this.ws, member), 0, null))), '}'));
    const array = this.g.define('array', this.container('[', opt(seq(value, rep(seq(lit(','), this.ws, value), 0, null))), ']'));
    this.g.set(name, alt(object, array, this.string, this.number, this.boolean, this.null));
    return value;
  }

  /**
   * `set`'s characters, each written one way (JSON.stringify's): the raw ones as a class, the
   * escaped ones as a shared rule (sets differ mostly in their raw part). Alternatives, so that
   * an automaton's edge is `[…] next | esc next` rather than a group per edge.
   */
  encode(set: CharSet): Node[] {
    const escaped = encodeEscaped(set);
    return [chars(intersect(set, RAW)), escaped.k === 'alt' ? this.g.define('esc', escaped) : escaped].filter((n) => n.k !== 'never');
  }
}

/** The characters of `set` JSON.stringify escapes, each written as it does: `\"`, `\\`, `\n`, `\u001f`. */
function encodeEscaped(set: CharSet): Node {
  const parts: Node[] = [];
  if (has(set, 0x22)) parts.push(lit('\\"'));
  if (has(set, 0x5c)) parts.push(lit('\\\\'));
  const controls = intersect(set, [[0, 0x1f]]);
  for (const [cp, letter] of Object.entries(SHORT_ESCAPES)) if (has(controls, Number(cp))) parts.push(lit(`\\${letter}`));
  for (const high of [0, 1]) {
    const lows: number[] = [];
    for (let low = 0; low < 16; low++) {
      const cp = high * 16 + low;
      if (has(controls, cp) && !(cp in SHORT_ESCAPES)) lows.push(low);
    }
    if (lows.length > 0) parts.push(seq(lit(`\\u00${high}`), chars(ofChars(lows.map((l) => l.toString(16)).join('')))));
  }
  return alt(...parts);
}

/** A JSON value as text (no whitespace). */
export const literal = (value: unknown): Node => lit(JSON.stringify(value));

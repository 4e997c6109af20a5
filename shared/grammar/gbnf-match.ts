/**
 * A GBNF reader that behaves as llama.cpp's (`src/llama-grammar.cpp`, as bundled with
 * node-llama-cpp 3.22.1), to check grammars without a model: {@link parseGbnf} builds the same
 * rules llama.cpp builds (repetitions expanded into generated rules, its limits applied),
 * {@link matches} runs llama.cpp's matcher (a set of pushdown stacks advanced one code point at
 * a time), {@link sample} draws random strings from a grammar. The tests hold the converter's
 * grammars to it, and it to llama.cpp's own matcher.
 *
 * One deliberate difference: llama.cpp silently drops an upper bound above 2000 (`x{0,2001}`
 * reads as `x*`); here it is an error, since a converter must never write one.
 */

const END = 0;
const ALT = 1;
const RULE_REF = 2;
const CHAR = 3;
const CHAR_NOT = 4;
const CHAR_RNG_UPPER = 5;
const CHAR_ALT = 6;
const CHAR_ANY = 7;
const MAX_REPETITION_THRESHOLD = 2000;

interface Element {
  type: number;
  value: number;
}

export interface ParsedGrammar {
  readonly rules: readonly (readonly Element[])[];
  readonly symbols: ReadonlyMap<string, number>;
  readonly root: number;
}

const isWordChar = (c: string | undefined) => c !== undefined && /^[a-zA-Z0-9-]$/.test(c);
const isDigit = (c: string | undefined) => c !== undefined && /^[0-9]$/.test(c);

/** Parses GBNF as llama.cpp does; throws what llama.cpp would refuse. */
export function parseGbnf(text: string, rootName = 'root'): ParsedGrammar {
  const src = Array.from(text);
  const symbols = new Map<string, number>();
  const rules: Element[][] = [];
  const symbolId = (name: string) => {
    if (!symbols.has(name)) symbols.set(name, symbols.size);
    return symbols.get(name)!;
  };
  const generateId = (base: string) => {
    const id = symbols.size;
    symbols.set(`${base}_${id}`, id);
    return id;
  };
  const addRule = (id: number, rule: Element[]) => {
    while (rules.length <= id) rules.push([]);
    rules[id] = rule;
  };
  const space = (pos: number, newlineOk: boolean) => {
    while (src[pos] === ' ' || src[pos] === '\t' || src[pos] === '#' || (newlineOk && (src[pos] === '\r' || src[pos] === '\n'))) {
      if (src[pos] === '#') while (pos < src.length && src[pos] !== '\r' && src[pos] !== '\n') pos++;
      else pos++;
    }
    return pos;
  };
  const name = (pos: number) => {
    let end = pos;
    while (isWordChar(src[end])) end++;
    if (end === pos) throw new Error(`expecting name at ${src.slice(pos, pos + 20).join('')}`);
    return end;
  };
  const hex = (pos: number, size: number): [number, number] => {
    const digits = src.slice(pos, pos + size).join('');
    if (!new RegExp(`^[0-9a-fA-F]{${size}}$`).test(digits)) throw new Error(`expecting ${size} hex chars at ${digits}`);
    return [parseInt(digits, 16), pos + size];
  };
  const char = (pos: number): [number, number] => {
    if (src[pos] === '\\') {
      const c = src[pos + 1];
      if (c === 'x') return hex(pos + 2, 2);
      if (c === 'u') return hex(pos + 2, 4);
      if (c === 'U') return hex(pos + 2, 8);
      if (c === 't') return [9, pos + 2];
      if (c === 'r') return [13, pos + 2];
      if (c === 'n') return [10, pos + 2];
      if (c === '\\' || c === '"' || c === '[' || c === ']' || c === '-') return [c.codePointAt(0)!, pos + 2];
      throw new Error(`unknown escape at ${src.slice(pos, pos + 10).join('')}`);
    }
    if (pos >= src.length) throw new Error('unexpected end of input');
    return [src[pos]!.codePointAt(0)!, pos + 1];
  };

  const sequence = (start: number, ruleName: string, rule: Element[], nested: boolean): number => {
    let lastSymStart = rule.length;
    let pos = start;
    let prevRules = 1;
    const repetitions = (min: number, max: number | null) => {
      if (lastSymStart === rule.length) throw new Error('expecting preceding item to */+/?/{');
      const prev = rule.slice(lastSymStart);
      const total = max !== null && max > 0 ? max : min > 0 ? min : 1;
      if (prevRules * total > MAX_REPETITION_THRESHOLD)
        throw new Error('number of rules that are going to be repeated multiplied by the new repetition exceeds sane defaults');
      if (min === 0) rule.length = lastSymStart;
      else for (let i = 1; i < min; i++) rule.push(...prev);
      let lastRecId = 0;
      const nOpt = max === null ? 1 : max - min;
      for (let i = 0; i < nOpt; i++) {
        const recId = generateId(ruleName);
        const rec = [...prev];
        if (i > 0 || max === null) rec.push({ type: RULE_REF, value: max === null ? recId : lastRecId });
        rec.push({ type: ALT, value: 0 }, { type: END, value: 0 });
        addRule(recId, rec);
        lastRecId = recId;
      }
      if (nOpt > 0) rule.push({ type: RULE_REF, value: lastRecId });
      prevRules *= total;
    };
    while (pos < src.length) {
      const c = src[pos];
      if (c === '"') {
        pos++;
        lastSymStart = rule.length;
        prevRules = 1;
        while (src[pos] !== '"') {
          if (pos >= src.length) throw new Error('unexpected end of input');
          const [cp, next] = char(pos);
          pos = next;
          rule.push({ type: CHAR, value: cp });
        }
        pos = space(pos + 1, nested);
      } else if (c === '[') {
        pos++;
        let startType = CHAR;
        if (src[pos] === '^') {
          pos++;
          startType = CHAR_NOT;
        }
        lastSymStart = rule.length;
        prevRules = 1;
        while (src[pos] !== ']') {
          if (pos >= src.length) throw new Error('unexpected end of input');
          const [cp, next] = char(pos);
          pos = next;
          rule.push({ type: lastSymStart < rule.length ? CHAR_ALT : startType, value: cp });
          if (src[pos] === '-' && src[pos + 1] !== ']') {
            if (pos + 1 >= src.length) throw new Error('unexpected end of input');
            const [end, after] = char(pos + 1);
            pos = after;
            rule.push({ type: CHAR_RNG_UPPER, value: end });
          }
        }
        pos = space(pos + 1, nested);
      } else if (isWordChar(c)) {
        const end = name(pos);
        const refId = symbolId(src.slice(pos, end).join(''));
        pos = space(end, nested);
        lastSymStart = rule.length;
        prevRules = 1;
        rule.push({ type: RULE_REF, value: refId });
      } else if (c === '(') {
        pos = space(pos + 1, true);
        const before = symbols.size;
        const subId = generateId(ruleName);
        pos = alternates(pos, ruleName, subId, true);
        prevRules = Math.max(1, symbols.size - before);
        lastSymStart = rule.length;
        rule.push({ type: RULE_REF, value: subId });
        if (src[pos] !== ')') throw new Error(`expecting ')' at ${src.slice(pos, pos + 20).join('')}`);
        pos = space(pos + 1, nested);
      } else if (c === '.') {
        lastSymStart = rule.length;
        prevRules = 1;
        rule.push({ type: CHAR_ANY, value: 0 });
        pos = space(pos + 1, nested);
      } else if (c === '*' || c === '+' || c === '?') {
        pos = space(pos + 1, nested);
        repetitions(c === '+' ? 1 : 0, c === '?' ? 1 : null);
      } else if (c === '{') {
        pos = space(pos + 1, nested);
        if (!isDigit(src[pos])) throw new Error('expecting an int');
        let end = pos;
        while (isDigit(src[end])) end++;
        const min = Number(src.slice(pos, end).join(''));
        pos = space(end, nested);
        let max: number | null = null;
        if (src[pos] === '}') {
          max = min;
          pos = space(pos + 1, nested);
        } else if (src[pos] === ',') {
          pos = space(pos + 1, nested);
          if (isDigit(src[pos])) {
            end = pos;
            while (isDigit(src[end])) end++;
            max = Number(src.slice(pos, end).join(''));
            pos = space(end, nested);
          }
          if (src[pos] !== '}') throw new Error("expecting '}'");
          pos = space(pos + 1, nested);
        } else throw new Error("expecting ','");
        if (min > MAX_REPETITION_THRESHOLD) throw new Error('number of repetitions exceeds sane defaults');
        if (max !== null && max > MAX_REPETITION_THRESHOLD) throw new Error(`upper bound ${max} above ${MAX_REPETITION_THRESHOLD}: llama.cpp would drop it`);
        repetitions(min, max);
      } else break;
    }
    return pos;
  };

  const alternates = (start: number, ruleName: string, ruleId: number, nested: boolean): number => {
    const rule: Element[] = [];
    let pos = sequence(start, ruleName, rule, nested);
    while (src[pos] === '|') {
      rule.push({ type: ALT, value: 0 });
      pos = space(pos + 1, true);
      pos = sequence(pos, ruleName, rule, nested);
    }
    rule.push({ type: END, value: 0 });
    addRule(ruleId, rule);
    return pos;
  };

  let pos = space(0, true);
  while (pos < src.length) {
    const end = name(pos);
    const ruleName = src.slice(pos, end).join('');
    const id = symbolId(ruleName);
    pos = space(end, false);
    if (src.slice(pos, pos + 3).join('') !== '::=') throw new Error(`expecting ::= at ${src.slice(pos, pos + 20).join('')}`);
    pos = alternates(space(pos + 3, true), ruleName, id, false);
    if (src[pos] === '\r') pos += src[pos + 1] === '\n' ? 2 : 1;
    else if (src[pos] === '\n') pos++;
    else if (pos < src.length) throw new Error(`expecting newline or end at ${src.slice(pos, pos + 20).join('')}`);
    pos = space(pos, true);
  }
  for (const [sym, id] of symbols) if (!rules[id] || rules[id].length === 0) throw new Error(`Undefined rule identifier '${sym}'`);
  if (!symbols.has(rootName)) throw new Error(`grammar does not contain a '${rootName}' symbol`);
  if (leftRecursive(rules)) throw new Error('left recursion');
  return { rules, symbols, root: symbols.get(rootName)! };
}

const isEndOfSequence = (e: Element | undefined) => e === undefined || e.type === END || e.type === ALT;

function leftRecursive(rules: readonly (readonly Element[])[]): boolean {
  const visited = new Array<boolean>(rules.length).fill(false);
  const inProgress = new Array<boolean>(rules.length).fill(false);
  const mayBeEmpty = new Array<boolean>(rules.length).fill(false);
  const detect = (i: number): boolean => {
    if (inProgress[i]) return true;
    inProgress[i] = true;
    const rule = rules[i]!;
    let atStart = true;
    for (const e of rule) {
      if (isEndOfSequence(e)) {
        if (atStart) {
          mayBeEmpty[i] = true;
          break;
        }
        atStart = true;
      } else atStart = false;
    }
    let recurse = true;
    for (const e of rule) {
      if (e.type === RULE_REF && recurse) {
        if (detect(e.value)) return true;
        if (!mayBeEmpty[e.value]) recurse = false;
      } else if (isEndOfSequence(e)) recurse = true;
      else recurse = false;
    }
    inProgress[i] = false;
    visited[i] = true;
    return false;
  };
  for (let i = 0; i < rules.length; i++) if (!visited[i] && detect(i)) return true;
  return false;
}

/** A stack of positions (rule · 2^20 + element), top last. */
type Stack = readonly number[];
const POS = 2 ** 20;

function advance(g: ParsedGrammar, stack: Stack, out: Map<string, Stack>): void {
  const todo: Stack[] = [stack];
  const seen = new Set<string>();
  while (todo.length > 0) {
    const cur = todo.pop()!;
    const key = cur.join(',');
    if (seen.has(key)) continue;
    seen.add(key);
    if (cur.length === 0) {
      out.set(key, cur);
      continue;
    }
    const top = cur[cur.length - 1]!;
    const r = Math.floor(top / POS);
    const e = top % POS;
    const elem = g.rules[r]![e]!;
    if (elem.type !== RULE_REF) {
      out.set(key, cur);
      continue;
    }
    const sub = g.rules[elem.value]!;
    let s = 0;
    for (;;) {
      const next = cur.slice(0, -1);
      if (!isEndOfSequence(g.rules[r]![e + 1])) next.push(top + 1);
      if (!isEndOfSequence(sub[s])) next.push(elem.value * POS + s);
      todo.push(next);
      while (!isEndOfSequence(sub[s])) s++;
      if (sub[s]!.type === ALT) s++;
      else break;
    }
  }
}

/** Does the character class at (r, e) match cp; and where does it end. */
function matchChar(g: ParsedGrammar, r: number, e: number, cp: number): [boolean, number] {
  const rule = g.rules[r]!;
  const positive = rule[e]!.type === CHAR || rule[e]!.type === CHAR_ANY;
  let found = false;
  do {
    if (rule[e + 1]?.type === CHAR_RNG_UPPER) {
      found ||= rule[e]!.value <= cp && cp <= rule[e + 1]!.value;
      e += 2;
    } else if (rule[e]!.type === CHAR_ANY) {
      found = true;
      e += 1;
    } else {
      found ||= rule[e]!.value === cp;
      e += 1;
    }
  } while (rule[e]?.type === CHAR_ALT);
  return [found === positive, e];
}

function initialStacks(g: ParsedGrammar): Stack[] {
  const out = new Map<string, Stack>();
  const rule = g.rules[g.root]!;
  let s = 0;
  for (;;) {
    advance(g, isEndOfSequence(rule[s]) ? [] : [g.root * POS + s], out);
    while (!isEndOfSequence(rule[s])) s++;
    if (rule[s]!.type === ALT) s++;
    else break;
  }
  return [...out.values()];
}

/** Does the grammar generate exactly `text` (matched code point by code point, as llama.cpp does)? */
export function matches(g: ParsedGrammar, text: string): boolean {
  let stacks = initialStacks(g);
  for (const ch of text) {
    const cp = ch.codePointAt(0)!;
    const out = new Map<string, Stack>();
    for (const stack of stacks) {
      if (stack.length === 0) continue;
      const top = stack[stack.length - 1]!;
      const [ok, after] = matchChar(g, Math.floor(top / POS), top % POS, cp);
      if (!ok) continue;
      const next = stack.slice(0, -1);
      if (!isEndOfSequence(g.rules[Math.floor(top / POS)]![after])) next.push(Math.floor(top / POS) * POS + after);
      advance(g, next, out);
    }
    stacks = [...out.values()];
    if (stacks.length === 0) return false;
  }
  return stacks.some((s) => s.length === 0);
}

/** Characters a negated class may be drawn from (ASCII, controls, a few beyond). */
const POOL = [...Array.from({ length: 128 }, (_, i) => i), 0xa0, 0xe9, 0x3b1, 0x2028, 0x4e2d, 0xfeff, 0x1f600];

/**
 * A random string of the grammar. Below `depth` nested rules each alternative is equally likely;
 * deeper, the alternative that ends soonest is taken, so every draw terminates.
 */
export function sample(g: ParsedGrammar, random: () => number, depth = 40): string {
  const alternatives = g.rules.map((rule) => {
    const alts: number[] = [0];
    rule.forEach((e, i) => {
      if (e.type === ALT) alts.push(i + 1);
    });
    return alts;
  });
  // Height: the fewest nested rules needed to finish a rule (or an alternative).
  const height = new Array<number>(g.rules.length).fill(Infinity);
  const altHeight = (r: number, s: number): number => {
    let h = 1;
    for (let e = s; !isEndOfSequence(g.rules[r]![e]); e++) {
      const el = g.rules[r]![e]!;
      if (el.type === RULE_REF) h = Math.max(h, 1 + height[el.value]!);
    }
    return h;
  };
  for (let changed = true; changed;) {
    changed = false;
    g.rules.forEach((_, r) => {
      const h = Math.min(...alternatives[r]!.map((s) => altHeight(r, s)));
      if (h < height[r]!) {
        height[r] = h;
        changed = true;
      }
    });
  }
  const out: number[] = [];
  const pick = <T>(xs: readonly T[]): T => xs[Math.floor(random() * xs.length)]!;
  const drawChar = (r: number, e: number): number => {
    const rule = g.rules[r]!;
    const ranges: [number, number][] = [];
    let i = e;
    do {
      if (rule[i + 1]?.type === CHAR_RNG_UPPER) {
        ranges.push([rule[i]!.value, rule[i + 1]!.value]);
        i += 2;
      } else {
        ranges.push([rule[i]!.value, rule[i]!.value]);
        i += 1;
      }
    } while (rule[i]?.type === CHAR_ALT);
    if (rule[e]!.type === CHAR_NOT || rule[e]!.type === CHAR_ANY) {
      const allowed = POOL.filter((cp) => matchChar(g, r, e, cp)[0]);
      if (allowed.length > 0) return pick(allowed);
      for (let cp = 0; cp <= 0x10ffff; cp++) if (matchChar(g, r, e, cp)[0]) return cp;
      throw new Error('a class that matches nothing');
    }
    const [lo, hi] = pick(ranges);
    // Mostly printable ASCII where a range offers it, so that strings stay readable.
    if (lo <= 0x7e && hi >= 0x20 && random() < 0.8) {
      const a = Math.max(lo, 0x20);
      const b = Math.min(hi, 0x7e);
      return a + Math.floor(random() * (b - a + 1));
    }
    return lo + Math.floor(random() * (hi - lo + 1));
  };
  const expand = (r: number, level: number): void => {
    const starts = alternatives[r]!;
    const s = level < depth ? pick(starts) : starts.reduce((best, x) => (altHeight(r, x) < altHeight(r, best) ? x : best));
    const rule = g.rules[r]!;
    for (let e = s; !isEndOfSequence(rule[e]);) {
      const el = rule[e]!;
      if (el.type === RULE_REF) {
        expand(el.value, level + 1);
        e++;
      } else {
        out.push(drawChar(r, e));
        e = matchChar(g, r, e, -1)[1];
      }
    }
  };
  expand(g.root, 0);
  return String.fromCodePoint(...out);
}

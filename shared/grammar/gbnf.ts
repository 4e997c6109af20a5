/**
 * Grammar expressions and the GBNF text llama.cpp's parser (`src/llama-grammar.cpp`) reads.
 *
 * What the printer guarantees, because llama.cpp's parser would otherwise misread or refuse:
 * - No empty class: llama.cpp reads `[]` as "nothing", i.e. the empty string. An empty set is
 *   {@link NEVER} here, which constructors remove and the printer never sees.
 * - A repeated item is one symbol (a literal, a class or a rule name): a repeated group is hoisted
 *   into a rule first. llama.cpp refuses a group whose own generated rules times the repetition
 *   exceed 2000, and silently drops an upper bound above 2000 (`x{0,2001}` means `x*`); bounds are
 *   kept far below that and large ones decomposed into blocks ({@link Grammar.repeat}).
 * - Every code point outside printable ASCII is written as an escape (`\xHH`, `\uHHHH`,
 *   `\UHHHHHHHH`), so the text is ASCII; in classes everything but letters and digits is, so `^`,
 *   `-`, `]` and `\` never need llama.cpp's context rules.
 * - Rules with the same body are one rule (the text stays small and deterministic: the same
 *   schema gives the same text, rule names derived from where they are used).
 * `expandedRules` counts the rules llama.cpp creates while parsing (each rule, each group, and
 * `max - min` per bounded repetition, one per unbounded one), the measure the size limit applies to.
 */
import { type CharSet, setKey, union } from './charset';

export type Node =
  | { readonly k: 'lit'; readonly text: string }
  | { readonly k: 'set'; readonly set: CharSet }
  | { readonly k: 'ref'; readonly name: string }
  | { readonly k: 'seq'; readonly items: readonly Node[] }
  | { readonly k: 'alt'; readonly items: readonly Node[] }
  | { readonly k: 'rep'; readonly item: Node; readonly min: number; readonly max: number | null }
  | { readonly k: 'never' };

/** The language with no string (an empty class, an impossible range). */
export const NEVER: Node = { k: 'never' };
/** The empty string. */
export const EMPTY: Node = { k: 'lit', text: '' };

export const lit = (text: string): Node => (text === '' ? EMPTY : { k: 'lit', text });
export const chars = (set: CharSet): Node => (set.length === 0 ? NEVER : { k: 'set', set });
export const ref = (name: string): Node => ({ k: 'ref', name });

/** A structural key: equal keys, equal languages (and equal printed text). */
export function nodeKey(n: Node): string {
  switch (n.k) {
    case 'lit':
      return `l${JSON.stringify(n.text)}`;
    case 'set':
      return `s[${setKey(n.set)}]`;
    case 'ref':
      return `r:${n.name}`;
    case 'seq':
      return `q(${n.items.map(nodeKey).join(' ')})`;
    case 'alt':
      return `a(${n.items.map(nodeKey).join('|')})`;
    case 'rep':
      return `p${n.min},${n.max ?? ''}(${nodeKey(n.item)})`;
    case 'never':
      return 'never';
  }
}

export function seq(...parts: Node[]): Node {
  const items: Node[] = [];
  for (const part of parts.flatMap((x) => (x.k === 'seq' ? x.items : [x]))) {
    // A one-character class is a literal, so neighbours merge: "0" "2" is "02".
    const p = part.k === 'set' && part.set.length === 1 && part.set[0]![0] === part.set[0]![1] ? lit(String.fromCodePoint(part.set[0]![0])) : part;
    if (p.k === 'never') return NEVER;
    if (p.k === 'lit' && p.text === '') continue;
    const last = items[items.length - 1];
    if (p.k === 'lit' && last?.k === 'lit') items[items.length - 1] = lit(last.text + p.text);
    else items.push(p);
  }
  return items.length === 0 ? EMPTY : items.length === 1 ? items[0]! : { k: 'seq', items };
}

/** A choice; single characters among the branches are merged into one class, duplicates dropped. */
export function alt(...parts: Node[]): Node {
  const items: Node[] = [];
  const seen = new Set<string>();
  let setAt = -1;
  for (const p of parts.flatMap((x) => (x.k === 'alt' ? x.items : [x]))) {
    if (p.k === 'never') continue;
    const asSet =
      p.k === 'set' ? p.set : p.k === 'lit' && [...p.text].length === 1 ? ([[p.text.codePointAt(0)!, p.text.codePointAt(0)!]] as CharSet) : undefined;
    if (asSet) {
      if (setAt < 0) {
        setAt = items.length;
        items.push({ k: 'set', set: asSet });
      } else {
        const merged = items[setAt] as { k: 'set'; set: CharSet };
        items[setAt] = { k: 'set', set: union(merged.set, asSet) };
      }
      continue;
    }
    const key = nodeKey(p);
    if (seen.has(key)) continue;
    seen.add(key);
    items.push(p);
  }
  return items.length === 0 ? NEVER : items.length === 1 ? items[0]! : { k: 'alt', items };
}

/** `item` repeated `min` to `max` times (`max` null: unbounded). Keep counts small; see {@link Grammar.repeat}. */
export function rep(item: Node, min: number, max: number | null): Node {
  if (max !== null && max < min) return NEVER;
  if (item.k === 'never') return min === 0 ? EMPTY : NEVER;
  if (max === 0 || (item.k === 'lit' && item.text === '')) return EMPTY;
  if (min === 1 && max === 1) return item;
  return { k: 'rep', item, min, max };
}
export const opt = (item: Node): Node => rep(item, 0, 1);

/** Largest count written as `x{n}` (llama.cpp inlines it: no rules, n symbols). */
const EXACT_DIRECT = 256;
/** Largest optional count written as `x{0,n}` (llama.cpp makes n rules of it). */
const UP_TO_DIRECT = 64;
/** Block size for larger counts: `x{0,n}` becomes blocks of `x{32}` and a remainder. */
const BLOCK = 32;

const isAtom = (n: Node): boolean => n.k === 'lit' || n.k === 'set' || n.k === 'ref';

function hex(cp: number): string {
  if (cp <= 0xff) return `\\x${cp.toString(16).toUpperCase().padStart(2, '0')}`;
  if (cp <= 0xffff) return `\\u${cp.toString(16).toUpperCase().padStart(4, '0')}`;
  return `\\U${cp.toString(16).toUpperCase().padStart(8, '0')}`;
}

function quote(text: string): string {
  let out = '"';
  for (const ch of text) {
    const cp = ch.codePointAt(0)!;
    if (ch === '"' || ch === '\\') out += `\\${ch}`;
    else if (cp >= 0x20 && cp <= 0x7e) out += ch;
    else out += hex(cp);
  }
  return `${out}"`;
}

const classChar = (cp: number): string => (/^[0-9A-Za-z]$/.test(String.fromCodePoint(cp)) ? String.fromCodePoint(cp) : hex(cp));

function printSet(set: CharSet): string {
  if (set.length === 1 && set[0]![0] === set[0]![1]) return quote(String.fromCodePoint(set[0]![0]));
  return `[${set.map(([lo, hi]) => (lo === hi ? classChar(lo) : hi === lo + 1 ? classChar(lo) + classChar(hi) : `${classChar(lo)}-${classChar(hi)}`)).join('')}]`;
}

interface Rule {
  body: Node;
  text: string;
  /** Rules llama.cpp creates for this one (itself, its groups, its repetitions). */
  cost: number;
  refs: Set<string>;
}

/** What {@link Grammar.build} returns. */
export interface GrammarText {
  gbnf: string;
  /** Rules written in the text. */
  rules: number;
  /** Rules llama.cpp creates when it parses the text (groups and repetitions included). */
  expandedRules: number;
}

/** Rules under construction; one per schema conversion. */
export class Grammar {
  private readonly rules = new Map<string, Rule>();
  private readonly byText = new Map<string, string>();
  private readonly taken = new Set<string>(['root']);
  private readonly pending = new Set<string>();

  /** A fresh rule name from a hint (llama.cpp names are `[A-Za-z0-9-]+`). */
  name(hint: string): string {
    const base =
      hint
        .replace(/[^A-Za-z0-9-]+/g, '-')
        .replace(/-+/g, '-')
        .replace(/^-|-$/g, '')
        .slice(0, 48) || 'r';
    let name = base;
    for (let i = 2; this.taken.has(name); i++) name = `${base}-${i}`;
    this.taken.add(name);
    return name;
  }

  /** A rule with `body` (an existing one if some rule has the same body), as a reference. */
  define(hint: string, body: Node): Node {
    if (body.k === 'ref' || body.k === 'never' || (body.k === 'lit' && body.text === '')) return body;
    const printed = this.print(body, hint);
    const existing = this.byText.get(printed.text);
    if (existing !== undefined) return ref(existing);
    const name = this.name(hint);
    this.rules.set(name, { body, ...printed });
    this.byText.set(printed.text, name);
    return ref(name);
  }

  /** A rule name to refer to before its body is known (recursive `$defs`); give the body with {@link set}. */
  declare(hint: string): string {
    const name = this.name(hint);
    this.pending.add(name);
    return name;
  }

  set(name: string, body: Node): void {
    this.pending.delete(name);
    const printed = this.print(body, name);
    this.rules.set(name, { body, ...printed });
    if (!this.byText.has(printed.text)) this.byText.set(printed.text, name);
  }

  /**
   * `item` repeated `min` to `max` times (`max` null: unbounded), written so that llama.cpp's
   * expansion stays small: a count above {@link UP_TO_DIRECT} becomes blocks of {@link BLOCK}
   * (`x{0,100}` is `B{0,2} x{0,31} | B{3} x{0,4}` with `B ::= x{32}`), about n/32 + 64 rules
   * instead of n. The decomposition is exact (each count has exactly one split).
   */
  repeat(item: Node, min: number, max: number | null, hint: string): Node {
    if (max !== null && max < min) return NEVER;
    const head = this.exactly(item, min, hint);
    return seq(head, max === null ? rep(item, 0, null) : this.upTo(item, max - min, hint));
  }

  private block(item: Node, hint: string): Node {
    return this.define(`${hint}-block`, rep(isAtom(item) ? item : this.define(`${hint}-item`, item), BLOCK, BLOCK));
  }

  private exactly(item: Node, n: number, hint: string): Node {
    if (n <= EXACT_DIRECT) return rep(item, n, n);
    return seq(this.exactly(this.block(item, hint), Math.floor(n / BLOCK), `${hint}-block`), rep(item, n % BLOCK, n % BLOCK));
  }

  private upTo(item: Node, n: number, hint: string): Node {
    if (n <= UP_TO_DIRECT) return rep(item, 0, n);
    const block = this.block(item, hint);
    const q = Math.floor(n / BLOCK);
    const r = n % BLOCK;
    return alt(seq(this.upTo(block, q - 1, `${hint}-block`), rep(item, 0, BLOCK - 1)), seq(this.exactly(block, q, `${hint}-block`), rep(item, 0, r)));
  }

  /**
   * The grammar text with `root ::= body`, the rules it reaches in the order they were defined.
   * Throws if a rule is still only declared.
   */
  build(body: Node): GrammarText {
    if (this.pending.size > 0) throw new Error(`rules declared but not defined: ${[...this.pending].join(', ')}`);
    let root = { body, ...this.print(body, 'root') };
    // `root ::= x` where nothing else uses x: x's body is root's.
    if (body.k === 'ref') {
      const only = this.rules.get(body.name)!;
      const usedElsewhere = [...this.rules].some(([name, rule]) => name !== body.name && rule.refs.has(body.name)) || only.refs.has(body.name);
      if (!usedElsewhere) {
        this.rules.delete(body.name);
        root = only;
      }
    }
    const reached = new Set<string>();
    const todo = [...root.refs];
    while (todo.length > 0) {
      const name = todo.pop()!;
      if (reached.has(name)) continue;
      reached.add(name);
      todo.push(...this.rules.get(name)!.refs);
    }
    const lines = [`root ::= ${root.text}`];
    let expanded = root.cost;
    for (const [name, rule] of this.rules) {
      if (!reached.has(name)) continue;
      lines.push(`${name} ::= ${rule.text}`);
      expanded += rule.cost;
    }
    return { gbnf: `${lines.join('\n')}\n`, rules: lines.length, expandedRules: expanded };
  }

  /**
   * A rule that can start with itself without consuming a character (llama.cpp refuses such a
   * grammar: left recursion), or undefined. Only references can cause it (every JSON value starts
   * with a character), e.g. `$defs` whose `$ref`s lead back to themselves.
   */
  leftRecursion(body: Node): string | undefined {
    const nullable = new Map<string, boolean>();
    const isNullable = (n: Node): boolean => {
      switch (n.k) {
        case 'lit':
          return n.text === '';
        case 'set':
        case 'never':
          return false;
        case 'ref':
          return nullable.get(n.name) ?? false;
        case 'seq':
          return n.items.every(isNullable);
        case 'alt':
          return n.items.some(isNullable);
        case 'rep':
          return n.min === 0 || isNullable(n.item);
      }
    };
    for (let changed = true; changed;) {
      changed = false;
      for (const [name, rule] of this.rules) {
        if (!nullable.get(name) && isNullable(rule.body)) {
          nullable.set(name, true);
          changed = true;
        }
      }
    }
    const leftRefs = (n: Node, out: Set<string>): void => {
      if (n.k === 'ref') out.add(n.name);
      else if (n.k === 'alt') n.items.forEach((i) => leftRefs(i, out));
      else if (n.k === 'rep') leftRefs(n.item, out);
      else if (n.k === 'seq') {
        for (const i of n.items) {
          leftRefs(i, out);
          if (!isNullable(i)) break;
        }
      }
    };
    const edges = new Map<string, Set<string>>();
    for (const [name, rule] of this.rules) {
      const out = new Set<string>();
      leftRefs(rule.body, out);
      edges.set(name, out);
    }
    const state = new Map<string, 'open' | 'done'>();
    const visit = (name: string): string | undefined => {
      if (state.get(name) === 'done') return undefined;
      if (state.get(name) === 'open') return name;
      state.set(name, 'open');
      for (const next of edges.get(name) ?? []) {
        const found = visit(next);
        if (found !== undefined) return found;
      }
      state.set(name, 'done');
      return undefined;
    };
    const rootRefs = new Set<string>();
    leftRefs(body, rootRefs);
    for (const name of [...rootRefs, ...this.rules.keys()]) {
      const found = visit(name);
      if (found !== undefined) return found;
    }
    return undefined;
  }

  private print(body: Node, hint: string): { text: string; cost: number; refs: Set<string> } {
    let cost = 1;
    const refs = new Set<string>();
    const go = (n: Node, ctx: 'top' | 'seq' | 'atom'): string => {
      switch (n.k) {
        case 'lit':
          return quote(n.text);
        case 'set':
          return printSet(n.set);
        case 'ref':
          refs.add(n.name);
          return n.name;
        case 'never':
          throw new Error('an empty language reached the printer');
        case 'seq': {
          const text = n.items.map((i) => go(i, 'seq')).join(' ');
          if (ctx !== 'atom') return text;
          cost++;
          return `(${text})`;
        }
        case 'alt': {
          const text = n.items.map((i) => go(i, 'top')).join(' | ');
          if (ctx === 'top') return text;
          cost++;
          return `(${text})`;
        }
        case 'rep': {
          let atom: string;
          if (isAtom(n.item)) atom = go(n.item, 'atom');
          else if (n.max === 1) atom = go(n.item, 'atom');
          else atom = go(this.define(`${hint}-item`, n.item), 'atom');
          const { min, max } = n;
          cost += max === null ? 1 : max - min;
          if (min === 0 && max === 1) return `${atom}?`;
          if (min === 0 && max === null) return `${atom}*`;
          if (min === 1 && max === null) return `${atom}+`;
          if (max === null) return `${atom}{${min},}`;
          if (min === max) return `${atom}{${min}}`;
          return `${atom}{${min},${max}}`;
        }
      }
    };
    const text = go(body, 'top');
    return { text, cost, refs };
  }
}

/**
 * Finite automata over code points, for what a tree of rules cannot say by itself: a pattern
 * intersected with a length or a format, anchors inside a pattern (`a|^b$`, `(^x)+`), and the
 * names an additional property may take (any but the declared ones: a trie of those).
 *
 * A regex becomes a Thompson NFA (counted repetitions expanded), then an automaton without
 * ε-edges whose states are "after a character": the anchors are resolved while closing over
 * ε-edges (`^` passable only before the first character, `$` only into a state that may end the
 * string). It stays nondeterministic — no subset construction, so no exponential blow-up; llama.cpp
 * follows the alternatives in parallel, one stack per live state. Products (with another
 * automaton, or with a length counter) keep only reachable states that can still accept, then
 * equivalent states are merged. Each step counts states and refuses above {@link AUTOMATON_LIMITS}.
 */
import { type CharSet, charSet, intersect, SCALARS, setKey, subtract, union } from './charset';
import { alt, type Grammar, lit, NEVER, type Node, ref, seq } from './gbnf';
import { type Json } from './json-text';
import { type Regex } from './regex';
import { refuse } from './refusal';

export const AUTOMATON_LIMITS = {
  /** States of a regex's NFA, with its counted repetitions expanded. */
  nfaStates: 4_000,
  /** States of an automaton (each becomes a rule). */
  states: 1_500,
  /** States that keep additional properties' names apart from the declared ones (a trie of those, merged). */
  names: 4_000,
} as const;

export interface Edge {
  readonly set: CharSet;
  readonly to: number;
}
export interface State {
  readonly accept: boolean;
  readonly edges: readonly Edge[];
}
/** Nondeterministic, without ε-edges; state 0 is the start. */
export interface Automaton {
  readonly states: readonly State[];
}

type NfaEdge = { kind: 'eps' | 'start' | 'end' } | { kind: 'set'; set: CharSet };

class Nfa {
  readonly edges: { edge: NfaEdge; to: number }[][] = [];

  constructor(private readonly keyword: string) {}

  state(): number {
    if (this.edges.length >= AUTOMATON_LIMITS.nfaStates)
      refuse(
        this.keyword,
        `The keyword '${this.keyword}' needs an automaton of more than ${AUTOMATON_LIMITS.nfaStates} states (counted repetitions expanded).`,
      );
    this.edges.push([]);
    return this.edges.length - 1;
  }

  add(from: number, edge: NfaEdge, to: number): void {
    this.edges[from]!.push({ edge, to });
  }

  /** Adds `re` between `from` and `to`; loops use fresh states, so no path leaks between siblings. */
  build(re: Regex, from: number, to: number): void {
    switch (re.k) {
      case 'set':
        if (re.set.length > 0) this.add(from, { kind: 'set', set: re.set }, to);
        return;
      case 'start':
      case 'end':
        this.add(from, { kind: re.k }, to);
        return;
      case 'seq': {
        let at = from;
        re.items.forEach((item, i) => {
          const next = i === re.items.length - 1 ? to : this.state();
          this.build(item, at, next);
          at = next;
        });
        if (re.items.length === 0) this.add(from, { kind: 'eps' }, to);
        return;
      }
      case 'alt':
        for (const item of re.items) {
          const a = this.state();
          const b = this.state();
          this.add(from, { kind: 'eps' }, a);
          this.build(item, a, b);
          this.add(b, { kind: 'eps' }, to);
        }
        return;
      case 'rep': {
        let at = from;
        for (let i = 0; i < re.min; i++) {
          const next = this.state();
          this.build(re.item, at, next);
          at = next;
        }
        if (re.max === null) {
          const loop = this.state();
          const back = this.state();
          this.add(at, { kind: 'eps' }, loop);
          this.build(re.item, loop, back);
          this.add(back, { kind: 'eps' }, loop);
          this.add(loop, { kind: 'eps' }, to);
          return;
        }
        this.add(at, { kind: 'eps' }, to);
        for (let i = re.min; i < re.max; i++) {
          const next = this.state();
          this.build(re.item, at, next);
          this.add(next, { kind: 'eps' }, to);
          at = next;
        }
        return;
      }
    }
  }
}

/** The strings (of code points) `re` matches somewhere (unanchored, as `RegExp.test`), or whole if `whole`. */
export function regexAutomaton(re: Regex, keyword: string, whole = false): Automaton {
  const nfa = new Nfa(keyword);
  const start = nfa.state();
  const final = nfa.state();
  if (whole) nfa.build(re, start, final);
  else {
    // Any prefix, the pattern, any suffix: `RegExp.test` finds a match anywhere.
    const before = nfa.state();
    const from = nfa.state();
    const until = nfa.state();
    const after = nfa.state();
    nfa.add(start, { kind: 'eps' }, before);
    nfa.add(before, { kind: 'set', set: SCALARS }, before);
    nfa.add(before, { kind: 'eps' }, from);
    nfa.build(re, from, until);
    nfa.add(until, { kind: 'eps' }, after);
    nfa.add(after, { kind: 'set', set: SCALARS }, after);
    nfa.add(after, { kind: 'eps' }, final);
  }
  return withoutEpsilon(nfa, start, final, keyword);
}

function withoutEpsilon(nfa: Nfa, start: number, final: number, keyword: string): Automaton {
  /** What is reachable from `q` without a character: can the string end here, and which character edges leave. */
  const close = (q: number, atStart: boolean): State => {
    const seen = new Set<string>();
    const todo: [number, boolean][] = [[q, false]];
    let accept = false;
    const edges: Edge[] = [];
    while (todo.length > 0) {
      const [s, endOnly] = todo.pop()!;
      const key = `${s}:${endOnly}`;
      if (seen.has(key)) continue;
      seen.add(key);
      if (s === final) accept = true;
      for (const { edge, to } of nfa.edges[s]!) {
        if (edge.kind === 'set') {
          if (!endOnly) edges.push({ set: edge.set, to });
        } else if (edge.kind === 'eps' || (edge.kind === 'start' && atStart)) todo.push([to, endOnly]);
        else if (edge.kind === 'end') todo.push([to, true]);
      }
    }
    return { accept, edges };
  };
  // State 0: before any character (where `^` holds); others: just after a character into NFA state q.
  const index = new Map<number, number>();
  const raw: State[] = [close(start, true)];
  for (let i = 0; i < raw.length; i++) {
    raw[i] = {
      accept: raw[i]!.accept,
      edges: raw[i]!.edges.map(({ set, to }) => {
        let j = index.get(to);
        if (j === undefined) {
          j = raw.length;
          if (j >= AUTOMATON_LIMITS.states * 4) refuse(keyword, `The keyword '${keyword}' needs more than ${AUTOMATON_LIMITS.states * 4} automaton states.`);
          index.set(to, j);
          raw.push(close(to, false));
        }
        return { set, to: j };
      }),
    };
  }
  return minimize(trim(raw.map((s) => ({ accept: s.accept, edges: mergeEdges(s.edges) }))), keyword);
}

/** One edge per target (their sets united). */
function mergeEdges(edges: readonly Edge[]): Edge[] {
  const byTarget = new Map<number, CharSet>();
  for (const e of edges) byTarget.set(e.to, byTarget.has(e.to) ? union(byTarget.get(e.to)!, e.set) : e.set);
  return [...byTarget].filter(([, set]) => set.length > 0).map(([to, set]) => ({ set, to }));
}

/** Keeps the states reachable from the start that can reach acceptance, renumbered; none if nothing is accepted. */
function trim(states: readonly State[]): Automaton {
  const reach = new Set<number>([0]);
  const todo = [0];
  while (todo.length > 0) {
    for (const e of states[todo.pop()!]!.edges) {
      if (reach.has(e.to)) continue;
      reach.add(e.to);
      todo.push(e.to);
    }
  }
  const live = new Set<number>(states.flatMap((s, i) => (s.accept && reach.has(i) ? [i] : [])));
  for (let changed = true; changed;) {
    changed = false;
    states.forEach((s, i) => {
      if (!live.has(i) && reach.has(i) && s.edges.some((e) => live.has(e.to))) {
        live.add(i);
        changed = true;
      }
    });
  }
  if (!live.has(0)) return { states: [] };
  const order = [...live].sort((a, b) => a - b);
  const renumber = new Map(order.map((old, i) => [old, i]));
  return {
    states: order.map((old) => ({
      accept: states[old]!.accept,
      edges: states[old]!.edges.filter((e) => live.has(e.to)).map((e) => ({ set: e.set, to: renumber.get(e.to)! })),
    })),
  };
}

/**
 * Merges states that behave alike (same acceptance, edges with the same sets to merged states):
 * a bisimulation, valid for nondeterministic automata, found by refining a partition.
 */
function minimize(a: Automaton, keyword: string, cap: number = AUTOMATON_LIMITS.states, what = 'automaton states'): Automaton {
  if (a.states.length === 0) return a;
  // Sets by number, so that a signature is short.
  const setIds = new Map<string, number>();
  const edgeSets = a.states.map((s) =>
    s.edges.map((e) => {
      const key = setKey(e.set);
      if (!setIds.has(key)) setIds.set(key, setIds.size);
      return setIds.get(key)!;
    }),
  );
  let block: number[] = a.states.map((s) => (s.accept ? 1 : 0));
  let count = new Set(block).size;
  for (;;) {
    const ids = new Map<string, number>();
    const next = a.states.map((s, i) => {
      const sig = `${block[i]}|${s.edges
        .map((e, j) => `${edgeSets[i]![j]}>${block[e.to]}`)
        .sort()
        .join(';')}`;
      if (!ids.has(sig)) ids.set(sig, ids.size);
      return ids.get(sig)!;
    });
    block = next;
    if (ids.size === count) break;
    count = ids.size;
  }
  // Renumber blocks so that the start's block is 0, in order of first appearance.
  const order = new Map<number, number>([[block[0]!, 0]]);
  const representative = [0];
  for (let k = 0; k < representative.length; k++) {
    for (const e of a.states[representative[k]!]!.edges) {
      const b = block[e.to]!;
      if (!order.has(b)) {
        order.set(b, order.size);
        representative.push(e.to);
      }
    }
  }
  if (representative.length > cap) refuse(keyword, `The keyword '${keyword}' needs more than ${cap} ${what}.`);
  return {
    states: representative.map((i) => {
      const s = a.states[i]!;
      return { accept: s.accept, edges: mergeEdges(s.edges.map((e) => ({ set: e.set, to: order.get(block[e.to]!)! }))) };
    }),
  };
}

/** Pairs of states of a and b reachable together: the strings both accept. */
export function intersection(a: Automaton, b: Automaton, keyword: string): Automaton {
  if (a.states.length === 0 || b.states.length === 0) return { states: [] };
  return product(
    (i, j) => a.states[i]!.accept && b.states[j]!.accept,
    (i, j) =>
      a.states[i]!.edges.flatMap((ea) =>
        b.states[j]!.edges.flatMap((eb) => {
          const set = intersect(ea.set, eb.set);
          return set.length > 0 ? [{ set, to: [ea.to, eb.to] as const }] : [];
        }),
      ),
    keyword,
  );
}

/** The strings of `a` whose length (in code points) is within [min, max]. */
export function withLength(a: Automaton, min: number, max: number | null, keyword: string): Automaton {
  if (a.states.length === 0) return a;
  const top = max ?? min;
  return product(
    (i, n) => a.states[i]!.accept && n >= min && (max === null || n <= max),
    (i, n) => (max !== null && n >= max ? [] : a.states[i]!.edges.map((e) => ({ set: e.set, to: [e.to, Math.min(n + 1, top)] as const }))),
    keyword,
  );
}

function product(
  accept: (x: number, y: number) => boolean,
  edges: (x: number, y: number) => { set: CharSet; to: readonly [number, number] }[],
  keyword: string,
): Automaton {
  const index = new Map<string, number>([['0,0', 0]]);
  const pairs: [number, number][] = [[0, 0]];
  const raw: State[] = [];
  for (let i = 0; i < pairs.length; i++) {
    const [x, y] = pairs[i]!;
    raw.push({
      accept: accept(x, y),
      edges: edges(x, y).map(({ set, to }) => {
        const key = `${to[0]},${to[1]}`;
        let j = index.get(key);
        if (j === undefined) {
          j = pairs.length;
          if (j >= AUTOMATON_LIMITS.states * 4)
            refuse(keyword, `The keyword '${keyword}' with the other string keywords needs more than ${AUTOMATON_LIMITS.states * 4} automaton states.`);
          index.set(key, j);
          pairs.push([to[0], to[1]]);
        }
        return { set, to: j };
      }),
    });
  }
  return minimize(trim(raw.map((s) => ({ accept: s.accept, edges: mergeEdges(s.edges) }))), keyword);
}

/** Every string but `names`: a trie of the names, leaving it at any other character. */
export function stringsExcept(names: readonly string[], keyword: string): Automaton {
  const trie: { accept: boolean; children: Map<number, number> }[] = [{ accept: true, children: new Map() }];
  const length = names.reduce((n, name) => n + [...name].length, 0);
  if (length > 5 * AUTOMATON_LIMITS.names)
    refuse(
      keyword,
      `The keyword '${keyword}' needs the declared names (${length} characters) kept apart from additional ones: at most ${5 * AUTOMATON_LIMITS.names}.`,
    );
  for (const name of names) {
    let at = 0;
    for (const ch of name) {
      const cp = ch.codePointAt(0)!;
      let next = trie[at]!.children.get(cp);
      if (next === undefined) {
        next = trie.length;
        trie.push({ accept: true, children: new Map() });
        trie[at]!.children.set(cp, next);
      }
      at = next;
    }
    trie[at]!.accept = false;
  }
  const elsewhere = trie.length;
  const states: State[] = trie.map((node) => ({
    accept: node.accept,
    edges: [
      ...[...node.children].map(([cp, to]) => ({ set: charSet([[cp, cp]]), to })),
      { set: subtract(SCALARS, charSet([...node.children.keys()].map((cp) => [cp, cp] as const))), to: elsewhere },
    ].filter((e) => e.set.length > 0),
  }));
  states.push({ accept: true, edges: [{ set: SCALARS, to: elsewhere }] });
  return minimize(trim(states), keyword, AUTOMATON_LIMITS.names, 'states to keep additional property names apart from the declared ones');
}

/** The JSON string (quotes included) of the automaton's strings, one rule per state; NEVER if it accepts nothing. */
export function automatonGrammar(json: Json, a: Automaton, hint: string): Node {
  if (a.states.length === 0) return NEVER;
  const g: Grammar = json.g;
  const names = a.states.map((_, i) => g.declare(`${hint}-s${i}`));
  a.states.forEach((s, i) => {
    const next = (e: Edge) => ref(names[e.to]!);
    // A set of many ranges (`.`, a negated class) is a rule of its own, shared by every state that uses it.
    const edges = s.edges.flatMap((e) => {
      const parts = json.encode(e.set);
      return e.set.length > 2 ? [seq(g.define('chars', alt(...parts)), next(e))] : parts.map((part) => seq(part, next(e)));
    });
    g.set(names[i]!, alt(s.accept ? lit('"') : NEVER, ...edges));
  });
  return seq(lit('"'), ref(names[0]!));
}

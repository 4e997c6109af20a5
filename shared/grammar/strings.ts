/**
 * A string schema (`minLength`, `maxLength`, `pattern`, `format`) as the JSON string text,
 * quotes included. Lengths count code points of the decoded string (Ajv's count: an escape is one
 * character, a surrogate pair escape too). The regex and formats constrain the decoded string;
 * their characters are written JSON-escaped (`"`, `\` and controls as escapes).
 *
 * Two ways, the same language:
 * - Rules after the regex's shape, when it is the only constraint (lengths absent or implied by
 *   it) and its anchors stand at the start/end of the pattern or of its top-level alternatives:
 *   counted repetitions stay `{m,n}` (small grammars for `[a-z]{1,100}`).
 * - Otherwise an automaton (./automaton.ts): the pattern (unanchored: it may match anywhere),
 *   the format and the length bounds intersected, one rule per state, refused when too large.
 */
import { type Automaton, automatonGrammar, intersection, regexAutomaton, withLength } from './automaton';
import { alt, EMPTY, lit, type Node, rep, seq } from './gbnf';
import { FORMATS, formatRegex } from './formats';
import { type Json } from './json-text';
import { hasAnchor, lengthRange, parseRegex, type Regex } from './regex';
import { refuse } from './refusal';

export interface StringKeywords {
  minLength?: number;
  maxLength?: number;
  pattern?: string;
  format?: string;
}

export function stringGrammar(json: Json, kw: StringKeywords, hint: string): Node {
  const { g } = json;
  const min = kw.minLength ?? 0;
  const max = kw.maxLength ?? null;
  if (max !== null && max < min) refuse('minLength', "No string satisfies the keyword 'minLength' above 'maxLength'.");
  const pattern = kw.pattern === undefined ? undefined : parseRegex(kw.pattern);
  if (kw.format !== undefined && !FORMATS.includes(kw.format))
    refuse('format', `The keyword 'format' is '${kw.format}'; the grammar knows ${FORMATS.join(', ')}.`);
  const format = kw.format === undefined ? undefined : formatRegex(kw.format);
  if (!pattern && !format) return min === 0 && max === null ? json.string : seq(lit('"'), g.repeat(json.char, min, max, `${hint}-chars`), lit('"'));

  const bounded = min > 0 || max !== null;
  const keyword = pattern ? 'pattern' : 'format';
  // One regex, its own length within the bounds, anchors only at its ends: rules after its shape.
  if (!(pattern && format)) {
    const re = (pattern ?? format)!;
    const shape = pattern ? topLevel(re) : [{ start: true, end: true, body: re }];
    if (shape) {
      const lengths = shape.map((a) => (a.start && a.end ? lengthRange(a.body) : { min: lengthRange(a.body).min, max: null }));
      const shortest = Math.min(...lengths.map((l) => l.min));
      const longest = lengths.some((l) => l.max === null) ? null : Math.max(...lengths.map((l) => l.max!));
      if (shortest >= min && (max === null || (longest !== null && longest <= max))) {
        const any = rep(json.char, 0, null);
        const node = alt(...shape.map((a) => seq(a.start ? EMPTY : any, regexNode(json, a.body, hint), a.end ? EMPTY : any)));
        if (node.k === 'never') refuse(keyword, `No string matches the keyword '${keyword}'.`);
        return seq(lit('"'), node, lit('"'));
      }
    }
  }

  let a: Automaton | undefined;
  if (pattern) a = regexAutomaton(pattern, 'pattern');
  if (format) {
    const f = regexAutomaton(format, 'format', true);
    a = a ? intersection(a, f, 'pattern') : f;
  }
  if (bounded) a = withLength(a!, min, max, pattern ? 'pattern' : 'format');
  const node = automatonGrammar(json, a!, `${hint}-str`);
  if (node.k === 'never') {
    const others = [pattern && 'pattern', format && 'format', kw.minLength !== undefined && 'minLength', kw.maxLength !== undefined && 'maxLength'].filter(
      Boolean,
    );
    refuse(keyword, `No string satisfies the keywords ${others.map((k) => `'${k}'`).join(', ')} together.`);
  }
  return node;
}

/** The top-level alternatives with their `^`/`$` stripped, or undefined if an anchor stands elsewhere. */
function topLevel(re: Regex): { start: boolean; end: boolean; body: Regex }[] | undefined {
  const alternatives = re.k === 'alt' ? re.items : [re];
  const out: { start: boolean; end: boolean; body: Regex }[] = [];
  for (const a of alternatives) {
    const items = a.k === 'seq' ? [...a.items] : [a];
    let start = false;
    let end = false;
    while (items[0]?.k === 'start') {
      items.shift();
      start = true;
    }
    while (items[items.length - 1]?.k === 'end') {
      items.pop();
      end = true;
    }
    const body: Regex = items.length === 1 ? items[0]! : { k: 'seq', items };
    if (hasAnchor(body)) return undefined;
    out.push({ start, end, body });
  }
  return out;
}

/** A regex without anchors as rules; its characters written JSON-escaped. */
function regexNode(json: Json, re: Regex, hint: string): Node {
  switch (re.k) {
    case 'set':
      return alt(...json.encode(re.set));
    case 'seq':
      return seq(...re.items.map((i) => regexNode(json, i, hint)));
    case 'alt':
      return alt(...re.items.map((i) => regexNode(json, i, hint)));
    case 'rep': {
      const node = json.g.repeat(regexNode(json, re.item, hint), re.min, re.max, `${hint}-rep`);
      // A long optional run costs llama.cpp a rule per count: as a rule of its own, every use of the same run shares them.
      return re.max === null || re.max - re.min <= 4 ? node : json.g.define(`${hint}-rep`, node);
    }
    case 'start':
    case 'end':
      throw new Error('an anchor inside a pattern reached the rule builder');
  }
}

/**
 * The walk over a JSON Schema: which keywords apply where, what each becomes, and the refusals
 * with their keyword and path. It accepts what shared/json-schema.ts `toGrammarSchema` accepts,
 * with the same meaning (see index.ts), and enforces the bounds, lengths, patterns and formats
 * that module refuses.
 */
import { SCHEMA_LIMITS } from '../json-schema';
import { automatonGrammar, stringsExcept } from './automaton';
import { alt, EMPTY, Grammar, lit, NEVER, type Node, opt, ref, seq } from './gbnf';
import { Json, literal } from './json-text';
import { numberGrammar } from './numbers';
import { Refusal } from './refusal';
import { stringGrammar } from './strings';

/** Keywords that say nothing about which values are valid. */
const ANNOTATIONS = new Set(['title', 'description', 'default', 'examples', '$schema', '$id', '$comment', 'readOnly', 'writeOnly', 'deprecated']);
const SCALAR_TYPES = new Set(['string', 'number', 'integer', 'boolean', 'null']);
const ALL_TYPES = new Set([...SCALAR_TYPES, 'object', 'array']);
const NUMBER_KEYWORDS = ['minimum', 'maximum', 'exclusiveMinimum', 'exclusiveMaximum', 'multipleOf'] as const;
const STRING_KEYWORDS = ['format', 'pattern', 'minLength', 'maxLength'] as const;
/** The keywords the grammar enforces, by type. */
const KEYWORDS_OF: Readonly<Record<string, readonly string[]>> = {
  string: STRING_KEYWORDS,
  number: NUMBER_KEYWORDS,
  integer: NUMBER_KEYWORDS,
  boolean: [],
  null: [],
  object: ['properties', 'required', 'additionalProperties', 'minProperties', 'maxProperties'],
  array: ['items', 'prefixItems', 'minItems', 'maxItems'],
};

/** Largest count (a length, a number of items or properties): the grammar stays small for any count (blocks), the answer would not. */
export const MAX_COUNT = 1_000_000;

/**
 * How deep a recursive definition nests in an answer, in references along its cycle: a tree's
 * `children` within `children` … this many times, then only its way out (`[]`, `null`). A model that keeps nesting (SmolLM2 did,
 * to `max_tokens`, in 28 of 300 generated schemas) is made to close; the language is a subset of
 * the schema's, never more.
 */
export const RECURSION_DEPTH = 10;

/** The definition a `$ref` names, when it is `#/$defs/<name>` (the only form followed). */
const defOf = (target: unknown): string | undefined =>
  typeof target === 'string' && /^#\/\$defs\/[^/]+$/.test(target) ? target.slice('#/$defs/'.length) : undefined;

/** The `#/$defs/<name>` references anywhere under `s` (a superset of those the walk follows). */
function refsIn(s: unknown, out = new Set<string>()): Set<string> {
  if (Array.isArray(s)) for (const x of s) refsIn(x, out);
  else if (isObject(s))
    for (const [k, v] of Object.entries(s)) {
      const name = k === '$ref' ? defOf(v) : undefined;
      if (name !== undefined) out.add(name);
      else refsIn(v, out);
    }
  return out;
}

/** The references `s` may be before any text of its own (through `$ref`, `anyOf`, `oneOf`). */
function headRefs(s: unknown): string[] {
  if (!isObject(s)) return [];
  const name = defOf(s.$ref);
  if (name !== undefined) return [name];
  return [s.anyOf, s.oneOf].flatMap((b) => (Array.isArray(b) ? b.flatMap(headRefs) : []));
}

/** For each name, the names reachable from it in one or more steps of `edges`. */
function reachable(names: string[], edges: (name: string) => Iterable<string>): Map<string, Set<string>> {
  const out = new Map<string, Set<string>>();
  for (const from of names) {
    const seen = new Set<string>();
    const stack = [...edges(from)];
    while (stack.length > 0) {
      const n = stack.pop()!;
      if (seen.has(n) || !names.includes(n)) continue;
      seen.add(n);
      stack.push(...edges(n));
    }
    out.set(from, seen);
  }
  return out;
}

const isObject = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);
const isCount = (v: unknown): v is number => typeof v === 'number' && Number.isInteger(v) && v >= 0;

/** The JSON types of a value (an integer is also a number). */
function typesOf(v: unknown): string[] {
  if (v === null) return ['null'];
  if (Array.isArray(v)) return ['array'];
  if (typeof v === 'number') return Number.isInteger(v) ? ['integer', 'number'] : ['number'];
  return [typeof v];
}

/** Converts `schema` found at `at`; throws a Refusal. */
export function convertSchema(schema: unknown, at: string): { grammar: Grammar; body: Node } {
  const g = new Grammar();
  const json = new Json(g);
  let nodes = 0;
  if (!isObject(schema)) throw new Refusal('schema', 'The schema must be a JSON object.', at);
  if ('definitions' in schema)
    throw new Refusal('definitions', "The keyword 'definitions' is not followed; use '$defs' and '#/$defs/<name>' references.", `${at}.definitions`);
  if (schema.$defs !== undefined && !isObject(schema.$defs)) throw new Refusal('$defs', "The keyword '$defs' must be an object of schemas.", `${at}.$defs`);
  const defs = isObject(schema.$defs) ? schema.$defs : {};
  const names = Object.keys(defs);
  const defNames = new Map(names.map((name) => [name, g.declare(`def-${name}`)]));
  // A definition that refers to itself before any text of its own has no finite value.
  const heads = reachable(names, (n) => headRefs(defs[n]));
  const loop = names.find((n) => heads.get(n)!.has(n));
  if (loop !== undefined) throw new Refusal('$ref', `The definition '${loop}' refers to itself without a value in between.`, `${at}.$defs.${loop}`);
  // Recursive definitions (on a cycle of references) are unrolled RECURSION_DEPTH levels deep: at
  // level L a reference to a definition on the same cycle goes to level L + 1, past the last to
  // nothing. Definitions off every cycle stay one rule each.
  const reach = reachable(names, (n) => refsIn(defs[n]));
  const recursive = new Set(names.filter((n) => reach.get(n)!.has(n)));
  const sameCycle = (a: string, b: string) => reach.get(a)!.has(b) && reach.get(b)!.has(a);
  /** Rules of recursive definitions by level (level 0 is `defNames`'); absent: that level allows no value. */
  const levels = new Map<string, (string | undefined)[]>([...recursive].map((n) => [n, [defNames.get(n)!]]));
  /** The recursive definition and level being walked. */
  let within: { name: string; level: number } | undefined;
  /** Subschemas are counted once: the walks of deeper levels repeat the first. */
  let counting = true;

  const refTo = (name: string): Node => {
    if (within === undefined || !recursive.has(name) || !sameCycle(within.name, name)) return ref(defNames.get(name)!);
    const rule = levels.get(name)![within.level + 1];
    return rule === undefined ? NEVER : ref(rule);
  };

  const walk = (s: unknown, path: string, depth: number, hint: string): Node => {
    if (counting && ++nodes > SCHEMA_LIMITS.nodes) throw new Refusal('schema', `The schema has more than ${SCHEMA_LIMITS.nodes} subschemas.`, at);
    if (depth > SCHEMA_LIMITS.depth) throw new Refusal('schema', `The schema nests deeper than ${SCHEMA_LIMITS.depth} levels.`, path);
    if (s === true || (isObject(s) && Object.keys(s).every((k) => ANNOTATIONS.has(k)))) return json.value;
    if (!isObject(s)) throw new Refusal('schema', 'Each schema must be a JSON object.', path);
    const keys = Object.keys(s).filter((k) => !ANNOTATIONS.has(k) && k !== '$defs');
    const has = (k: string) => keys.includes(k);
    const refuse = (keyword: string, why: string): never => {
      throw new Refusal(keyword, `The keyword '${keyword}' at ${path} cannot be enforced by the grammar ${why}.`, `${path}.${keyword}`);
    };
    /** A helper's refusal, placed at this schema. */
    const placed = <T>(make: () => T): T => {
      try {
        return make();
      } catch (err) {
        if (err instanceof Refusal && err.at === undefined) throw new Refusal(err.keyword, `At ${path}: ${err.message}`, `${path}.${err.keyword}`);
        throw err;
      }
    };

    if (has('$ref')) {
      const name = defOf(s.$ref);
      if (name === undefined || !defNames.has(name)) refuse('$ref', '(only references to "#/$defs/<name>" of the top-level schema are followed)');
      const others = keys.filter((k) => k !== '$ref');
      if (others.length > 0) refuse(others[0]!, 'beside $ref');
      return refTo(name!);
    }
    for (const combo of ['anyOf', 'oneOf'] as const) {
      if (!has(combo)) continue;
      const branches = s[combo];
      if (!Array.isArray(branches) || branches.length === 0) refuse(combo, '(it must be a non-empty list of schemas)');
      const others = keys.filter((k) => k !== combo);
      if (others.length > 0) refuse(others[0]!, `beside ${combo} (put it inside each branch)`);
      return alt(...(branches as unknown[]).map((b, i) => walk(b, `${path}.${combo}[${i}]`, depth + 1, `${hint}-${i}`)));
    }
    const declared = Array.isArray(s.type) ? (s.type as unknown[]) : s.type === undefined ? undefined : [s.type];
    // `type` beside `const`/`enum` filters their values (a value of another type would not validate).
    const typed = declared?.every((t) => typeof t === 'string' && ALL_TYPES.has(t)) ? declared : undefined;
    const fits = (v: unknown) => typed === undefined || typesOf(v).some((t) => typed.includes(t));
    for (const keyword of ['const', 'enum'] as const) {
      if (!has(keyword)) continue;
      const values = keyword === 'const' ? [s.const] : s.enum;
      if (!Array.isArray(values) || values.length === 0 || values.length > SCHEMA_LIMITS.enumValues)
        refuse('enum', `(a list of 1 to ${SCHEMA_LIMITS.enumValues} values)`);
      const others = keys.filter((k) => k !== keyword && k !== 'type');
      if (others.length > 0) refuse(others[0]!, `beside ${keyword}`);
      const allowed = (values as unknown[]).filter(fits);
      if (allowed.length === 0) refuse(keyword, '(no value it lists is of the type the schema names)');
      return alt(...allowed.map(literal));
    }
    if (!has('type')) refuse(keys[0] ?? 'type', keys.length ? 'without a `type`' : '(the schema names no `type`)');
    const types = declared!;
    if (types.length === 0 || !types.every((t) => typeof t === 'string' && ALL_TYPES.has(t)) || new Set(types).size !== types.length) {
      refuse('type', `(one of ${[...ALL_TYPES].join(', ')}, or a list of them)`);
    }
    if (types.length > 1) {
      // One branch per type, each with the keywords that apply to it; a keyword no type takes is refused.
      const stray = keys.find((k) => k !== 'type' && !types.some((t) => KEYWORDS_OF[t as string]!.includes(k)));
      if (stray !== undefined) refuse(stray, `on a value of type ${types.join(' or ')}`);
      return alt(
        ...types.map((t) =>
          walk(
            Object.fromEntries(
              Object.entries(s)
                .filter(([k]) => k === 'type' || KEYWORDS_OF[t as string]!.includes(k))
                .map(([k, v]) => [k, k === 'type' ? t : v]),
            ),
            path,
            depth,
            `${hint}-${t as string}`,
          ),
        ),
      );
    }
    const t = types[0] as string;
    for (const k of keys) if (k !== 'type' && !KEYWORDS_OF[t]!.includes(k)) refuse(k, `on a value of type ${t}`);

    const count = (k: string): number | undefined => {
      if (!has(k)) return undefined;
      if (!isCount(s[k])) refuse(k, '(it must be a non-negative integer)');
      if ((s[k] as number) > MAX_COUNT) refuse(k, `(at most ${MAX_COUNT})`);
      return s[k] as number;
    };

    switch (t) {
      case 'null':
        return json.null;
      case 'boolean':
        return json.boolean;
      case 'string': {
        for (const k of ['pattern', 'format'] as const) if (has(k) && typeof s[k] !== 'string') refuse(k, '(it must be a string)');
        const kw = {
          minLength: count('minLength'),
          maxLength: count('maxLength'),
          pattern: s.pattern as string | undefined,
          format: s.format as string | undefined,
        };
        if (Object.values(kw).every((v) => v === undefined)) return json.string;
        return g.define(
          hint,
          placed(() => stringGrammar(json, kw, hint)),
        );
      }
      case 'number':
      case 'integer': {
        for (const k of NUMBER_KEYWORDS) if (has(k) && !(typeof s[k] === 'number' && Number.isFinite(s[k]))) refuse(k, '(it must be a number)');
        if (has('multipleOf') && !((s.multipleOf as number) > 0)) refuse('multipleOf', '(it must be above 0)');
        if (!NUMBER_KEYWORDS.some(has)) return t === 'integer' ? json.integer : json.number;
        const kw = Object.fromEntries(NUMBER_KEYWORDS.filter(has).map((k) => [k, s[k] as number]));
        return g.define(
          hint,
          placed(() => numberGrammar(g, { integer: t === 'integer', ...kw }, hint)),
        );
      }
      case 'object': {
        const props = has('properties') ? s.properties : {};
        if (!isObject(props) || Object.keys(props).length > SCHEMA_LIMITS.properties)
          refuse('properties', `(an object of at most ${SCHEMA_LIMITS.properties} schemas)`);
        const names = Object.keys(props as object);
        const members = names.map((name) =>
          seq(
            lit(`${JSON.stringify(name)}:`),
            json.ws,
            walk((props as Record<string, unknown>)[name], `${path}.properties.${name}`, depth + 1, `${hint}-${name}`),
          ),
        );
        if (has('required')) {
          const req = s.required;
          if (!Array.isArray(req) || !req.every((r) => typeof r === 'string')) refuse('required', '(it must be a list of property names)');
          const missing = (req as string[]).find((r) => !names.includes(r));
          if (missing !== undefined) refuse('required', `(it names '${missing}', which is not among the properties)`);
        }
        const extra = has('additionalProperties') ? s.additionalProperties : false;
        const extraValue = extra === false ? NEVER : walk(extra, `${path}.additionalProperties`, depth + 1, `${hint}-extra`);
        const n = names.length;
        const minP = count('minProperties');
        const maxP = count('maxProperties');
        // All properties are generated, always: without additional ones the count is fixed.
        if (extra === false) {
          if (minP !== undefined && minP > n) refuse('minProperties', `(the object always has its ${n} properties)`);
          if (maxP !== undefined && maxP < n) refuse('maxProperties', `(the object always has its ${n} properties)`);
        } else if (maxP !== undefined && maxP < n) refuse('maxProperties', `(the object always has its ${n} properties)`);
        const sep = seq(lit(','), json.ws);
        let body = members.length > 0 ? seq(...members.flatMap((m, i) => (i === 0 ? [m] : [sep, m]))) : EMPTY;
        if (extraValue.k !== 'never') {
          // Additional properties after the declared ones, under names other than theirs (each name written one way).
          const key =
            n === 0
              ? json.string
              : g.define(
                  `${hint}-key`,
                  placed(() => automatonGrammar(json, stringsExcept(names, 'additionalProperties'), `${hint}-key`)),
                );
          const pair = g.define(`${hint}-pair`, seq(key, lit(':'), json.ws, extraValue));
          const lo = Math.max(0, (minP ?? 0) - n);
          const hi = maxP === undefined ? null : maxP - n;
          const more = (from: number, to: number | null) => g.repeat(seq(sep, pair), from, to, `${hint}-pairs`);
          if (n > 0) body = seq(body, more(lo, hi));
          else if (hi !== 0) body = lo === 0 ? opt(seq(pair, more(0, hi === null ? null : hi - 1))) : seq(pair, more(lo - 1, hi === null ? null : hi - 1));
        }
        return g.define(hint, json.container('{', body, '}'));
      }
      case 'array': {
        const minI = count('minItems') ?? 0;
        const maxI = count('maxItems') ?? null;
        if (has('prefixItems') && !Array.isArray(s.prefixItems)) refuse('prefixItems', '(it must be a list of schemas)');
        const prefix = ((s.prefixItems as unknown[] | undefined) ?? []).map((p, i) => walk(p, `${path}.prefixItems[${i}]`, depth + 1, `${hint}-${i}`));
        const item = !has('items') ? json.value : s.items === false ? NEVER : walk(s.items, `${path}.items`, depth + 1, `${hint}-item`);
        if (maxI !== null && maxI < minI) refuse('minItems', "(it is above 'maxItems')");
        // The prefix items are all generated (as far as maxItems allows), then the others.
        const k = Math.min(prefix.length, maxI ?? Infinity);
        const lo = Math.max(0, minI - k);
        const hi = maxI === null ? null : maxI - k;
        if (item.k === 'never' && lo > 0) refuse('minItems', "(no item may follow 'prefixItems')");
        const sep = seq(lit(','), json.ws);
        let body = seq(...prefix.slice(0, k).flatMap((p, i) => (i === 0 ? [p] : [sep, p])));
        if (item.k !== 'never' && hi !== 0) {
          const more = (from: number, to: number | null) => g.repeat(seq(sep, item), from, to, `${hint}-items`);
          if (k > 0) body = seq(body, more(lo, hi));
          else body = lo === 0 ? opt(seq(item, more(0, hi === null ? null : hi - 1))) : seq(item, more(lo - 1, hi === null ? null : hi - 1));
        }
        return g.define(hint, json.container('[', body, ']'));
      }
    }
    throw new Error(`unhandled type ${t}`);
  };

  const body = walk(schema, at, 0, 'root');
  for (const name of names.filter((n) => !recursive.has(n))) {
    const def = walk(defs[name], `${at}.$defs.${name}`, 1, `def-${name}`);
    if (def.k === 'never') throw new Refusal('schema', `The definition '${name}' allows no value.`, `${at}.$defs.${name}`);
    g.set(defNames.get(name)!, def);
  }
  // The deepest level first: each level refers to the one below it, already known.
  for (let level = RECURSION_DEPTH; level >= 0; level--) {
    for (const name of recursive) {
      within = { name, level };
      const def = walk(defs[name], `${at}.$defs.${name}`, 1, level === 0 ? `def-${name}` : `def-${name}-${level}`);
      within = undefined;
      if (level === 0) {
        if (def.k === 'never')
          throw new Refusal('schema', `The definition '${name}' allows no value within ${RECURSION_DEPTH} levels of its recursion.`, `${at}.$defs.${name}`);
        g.set(defNames.get(name)!, def);
      } else if (def.k === 'ref') levels.get(name)![level] = def.name;
      else if (def.k !== 'never') {
        const rule = g.declare(`def-${name}-${level}`);
        g.set(rule, def);
        levels.get(name)![level] = rule;
      }
    }
    counting = false;
  }
  if (body.k === 'never') throw new Refusal('schema', 'The schema allows no value.', at);
  const left = g.leftRecursion(body);
  if (left !== undefined) throw new Error(`left recursion through ${left}`); // ruled out above
  return { grammar: g, body };
}

/**
 * magus's converter from a JSON Schema (structured output's `response_format.json_schema.schema`:
 * what OpenAI's strict mode accepts, and more) to a grammar in llama.cpp's GBNF dialect whose
 * strings are JSON texts (the whole answer) valid under the schema — or a refusal naming the
 * keyword and where it is. Pure (no I/O, no Node builtins: workflow code may import it) and
 * deterministic (the same schema gives the same text, so it can be cached by digest).
 *
 * Contract: every string the grammar generates parses as JSON and validates against the schema
 * (Ajv, draft 2020-12, ajv-formats in full mode); where the grammar is stricter than the schema,
 * it says so below. A keyword that constrains a value is enforced or refused, never dropped.
 *
 * What `toGrammarSchema` (shared/json-schema.ts) accepts, with the same meaning:
 * - Objects: all `properties` are generated, in order (optional ones too), and no others unless
 *   `additionalProperties` (a schema, or `true`: any value) allows them: they follow, under names
 *   other than the declared ones, as many as `minProperties`/`maxProperties` leave room for. No
 *   grammar can keep two additional names apart: when `minProperties` needs additional
 *   properties, a repeated name (which JSON.parse folds into one) could leave too few.
 *   `required` must name declared properties.
 * - Arrays: the `prefixItems` are all generated (as far as `maxItems` allows), then `items`
 *   (absent: any value; `false`: none) within `minItems`/`maxItems`.
 * - `anyOf`/`oneOf`: a choice of branches (overlapping `oneOf` branches are not kept apart);
 *   a `type` list: a branch per type with the keywords that apply to it; `enum`/`const`: the
 *   values as JSON text (any JSON value; those not of a `type` beside them dropped); `$defs` and
 *   `#/$defs/<name>` references, recursive ones too (a cycle of references without a value in
 *   between is refused); `{}`, `true` or annotations only: any JSON value. Annotations dropped.
 * Enforced exactly, where `toGrammarSchema` refuses:
 * - `integer`/`number`: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` at any
 *   magnitude and sign, exact against the doubles Ajv compares (./numbers.ts); `multipleOf`
 *   in decimal arithmetic (0.3 is a multiple of 0.1; Ajv's default float division disagrees for
 *   steps that are not binary fractions). Such numbers are plain decimals: no exponent, at most
 *   16 fraction digits (more if a bound is written with more; a step's own digits with
 *   `multipleOf`); a side without a bound stops at ±(2^53 − 1). A number without keywords: at
 *   most 16 digits each side of the point and a 2-digit exponent.
 * - `string`: `minLength`/`maxLength` in code points of the decoded string (an escape is one
 *   character, a surrogate pair escape too); `pattern`, matched anywhere like `RegExp.test`
 *   (./regex.ts: literals, `.`, classes, `\d \w \s` and their negations, escapes, groups,
 *   alternation, `* + ? {n} {n,} {n,m}` lazy or not, `^ $`); a pattern with lengths, a format
 *   with lengths, a pattern with a format: intersected exactly (./strings.ts). `format`:
 *   date-time, date, time, duration, email, hostname, ipv4, ipv6, uuid (./formats.ts: where
 *   ajv-formats is laxer than the RFC, the RFC; long runs bounded).
 * - The JSON text: whitespace only inside brackets and after `,` and `:`, at most a space or two
 *   line breaks and 20 spaces or tabs (models indent; a bound keeps one from looping); no lone
 *   surrogate in a string; every run of digits bounded (a small model cannot write digits forever).
 * Refused, naming the construct: pattern backreferences and lookaround (no context-free grammar
 * expresses them), `\b`/`\B` and `\p{…}` (assertions on neighbours; Unicode tables), inline
 * modifiers; `allOf`, `not`, `if`, `uniqueItems`, `contains`, `patternProperties`,
 * `propertyNames`, `dependent*`, `unevaluated*`, `$ref` outside `#/$defs/`, `definitions`, other
 * formats; and anything no value satisfies (crossed bounds, a pattern nothing matches).
 * Stricter than the schema, never looser: an object's properties are all generated, in order; a
 * recursive definition nests at most `recursionDepth` references deep along its cycle (a small
 * model otherwise nests to `max_tokens`).
 *
 * Size ({@link GRAMMAR_LIMITS}): llama.cpp turns `x{m,n}` into n − m rules and reads an upper
 * bound above 2000 as none; counts here become blocks (a count of n costs about n/32 + 64
 * rules; no bound written is above 400), and every part is capped before it is built (counts, number
 * digits, divisibility states, automaton states, declared names to keep apart), then the whole
 * (rules llama.cpp creates, characters). A refusal names the cap.
 *
 * What the engine must add, because llama.cpp matches a token by the code points it decodes
 * leniently from the token's text: keep control tokens out while a grammar runs (their text,
 * e.g. `<|start_header_id|>`, matches; the detokenizer then drops it) — engine/llama.ts does; build
 * the answer from the tokens' bytes, not a detokenizer that cleans spaces (" !" becomes "!" for a
 * vocabulary whose GGUF sets `clean_spaces`, as the tiny test model's does; SmolLM2's does not);
 * and refuse a token that makes the bytes invalid UTF-8 (an overlong `E0 9D B5` is U+0775 to the
 * grammar and three U+FFFD to everyone else). The last two are open: node-llama-cpp gives the
 * engine no token's bytes. ./llama.test.ts samples a tiny model from the bytes.
 */
import { AUTOMATON_LIMITS } from './automaton';
import { SCHEMA_LIMITS } from '../json-schema';
import { NUMBER_LIMITS } from './numbers';
import { REGEX_MAX_COUNT } from './regex';
import { Refusal } from './refusal';
import { convertSchema, MAX_COUNT, RECURSION_DEPTH } from './schema';

/** Caps on a schema and on its grammar (checked per part while converting, then on the whole). */
export const GRAMMAR_LIMITS = {
  /** shared/json-schema.ts's: depth, subschemas, enum values, properties per object. */
  ...SCHEMA_LIMITS,
  /** Largest `minLength`, `maxLength`, `minItems`, `maxItems`, `minProperties`, `maxProperties`. */
  count: MAX_COUNT,
  /** Largest count in a pattern's `{n,m}`. */
  patternCount: REGEX_MAX_COUNT,
  /** Digits (integer and fraction) a bounded number may need. */
  numberDigits: NUMBER_LIMITS.digits,
  /** States of a `multipleOf` divisibility automaton. */
  divisibilityStates: NUMBER_LIMITS.divisibilityStates,
  /** States of a pattern's NFA with its counts expanded (intersections only). */
  patternNfaStates: AUTOMATON_LIMITS.nfaStates,
  /** States (rules) of one string automaton (a pattern with lengths or a format). */
  automatonStates: AUTOMATON_LIMITS.states,
  /** States (rules) keeping additional properties' names apart from the declared ones. */
  declaredNameStates: AUTOMATON_LIMITS.names,
  /** References deep a recursive definition nests along its cycle in an answer (then only its way out). */
  recursionDepth: RECURSION_DEPTH,
  /** Rules llama.cpp creates when it parses the whole grammar (groups and repetitions expanded). */
  expandedRules: 20_000,
  /** Characters of the grammar text. */
  chars: 1_000_000,
} as const;

export type GrammarConversion =
  | {
      ok: true;
      /** The grammar text (ASCII, one rule per line). */
      gbnf: string;
      /** The rule to start from. */
      root: 'root';
      /** Rules in the text. */
      rules: number;
      /** Rules llama.cpp creates when parsing it (the size that matters). */
      expandedRules: number;
    }
  | { ok: false; keyword: string; at: string; message: string };

/**
 * The GBNF grammar of the JSON texts valid under `schema` (found at `at`, e.g.
 * `response_format.json_schema.schema`), or which keyword it cannot enforce and why.
 */
export function schemaToGbnf(schema: unknown, at = 'schema'): GrammarConversion {
  try {
    const { grammar, body } = convertSchema(schema, at);
    const out = grammar.build(body);
    if (out.expandedRules > GRAMMAR_LIMITS.expandedRules)
      throw new Refusal('schema', `The grammar would make ${out.expandedRules} rules in llama.cpp (at most ${GRAMMAR_LIMITS.expandedRules}).`, at);
    if (out.gbnf.length > GRAMMAR_LIMITS.chars)
      throw new Refusal('schema', `The grammar would have ${out.gbnf.length} characters (at most ${GRAMMAR_LIMITS.chars}).`, at);
    return { ok: true, gbnf: out.gbnf, root: 'root', rules: out.rules, expandedRules: out.expandedRules };
  } catch (err) {
    if (err instanceof Refusal) return { ok: false, keyword: err.keyword, at: err.at ?? at, message: err.message };
    throw err;
  }
}

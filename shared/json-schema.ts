/**
 * The schemas of tools offered under `tool_choice: "auto"`, whose arguments node-llama-cpp's
 * function calling generates under its own grammar: which JSON Schema that grammar can enforce,
 * and the schema in the form its builder takes. (Response formats and forced calls take magus's
 * own grammar, ./grammar, which enforces more.) The gateway refuses a schema this cannot convert
 * before anything is queued (400 naming the keyword and where it is); the engine converts the
 * same schema again at its own boundary. Never silently unenforced: a keyword that constrains a
 * value is either turned into grammar or refused.
 *
 * What the grammar does with a converted schema, and why every answer still validates:
 * - An object's properties are always all generated, in order, and no others unless
 *   `additionalProperties` says so: stricter than JSON Schema (an optional property present,
 *   no extra ones), never looser. A `required` key that is not among `properties` is refused.
 * - `anyOf` becomes a choice of branches (a value from one branch satisfies `anyOf`); `oneOf`
 *   too, so overlapping `oneOf` branches could yield a value that matches two — the usual
 *   `oneOf` (pydantic's unions, `X | null`) has disjoint branches.
 * - `type: [..., "object"]` becomes a choice of one branch per type.
 * - String lengths (`minLength`, `maxLength`) are refused: node-llama-cpp's grammar let the tiny
 *   random model write a 9-character string under `maxLength: 6` (bytes that decode as U+FFFD).
 * - A schema that allows any value (`{}`, `true`, annotations only; an array's missing `items`)
 *   becomes a recursive definition of JSON (`$defs.magus_any_json`).
 * - Annotations (`title`, `description`, `default`, `examples`, `$schema`, `$id`, `$comment`,
 *   `readOnly`, `writeOnly`, `deprecated`) are dropped; `$defs` and `#/$defs/…` references are kept.
 * Workflow-safe: no I/O.
 */

/** Keywords that say nothing about which values are valid. */
const ANNOTATIONS = new Set(['title', 'description', 'default', 'examples', '$schema', '$id', '$comment', 'readOnly', 'writeOnly', 'deprecated']);
const SCALAR_TYPES = new Set(['string', 'number', 'integer', 'boolean', 'null']);
const ALL_TYPES = new Set([...SCALAR_TYPES, 'object', 'array']);
/** String formats the grammar generates exactly. */
const FORMATS = new Set(['date-time', 'date', 'time']);
/** The keywords the grammar enforces, by type. */
const KEYWORDS_OF: Readonly<Record<string, readonly string[]>> = {
  string: ['format'],
  number: [],
  integer: [],
  boolean: [],
  null: [],
  object: ['properties', 'required', 'additionalProperties', 'minProperties', 'maxProperties'],
  array: ['items', 'prefixItems', 'minItems', 'maxItems'],
};
/** The definition of "any JSON value" (a schema that allows anything: `{}`, `true`, an array without `items`). */
const ANY_DEF = 'magus_any_json';
const ANY_JSON: GrammarSchema = {
  oneOf: [
    { type: ['string', 'number', 'boolean', 'null'] },
    { type: 'array', items: { $ref: `#/$defs/${ANY_DEF}` } },
    { type: 'object', additionalProperties: { $ref: `#/$defs/${ANY_DEF}` } },
  ],
};
/** Bounds on a schema: it is compiled into a grammar per request. */
export const SCHEMA_LIMITS = { depth: 32, nodes: 2_000, enumValues: 512, properties: 256 } as const;

/** The converted schema (node-llama-cpp's `GbnfJsonSchema`). */
export type GrammarSchema = Record<string, unknown>;

export type SchemaConversion = { ok: true; schema: GrammarSchema } | { ok: false; keyword: string; at: string; message: string };

class Refused extends Error {
  constructor(
    readonly keyword: string,
    readonly at: string,
    message: string,
  ) {
    super(message);
  }
}

const isObject = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);
const isScalar = (v: unknown): v is string | number | boolean | null => v === null || ['string', 'number', 'boolean'].includes(typeof v);
const nonNegativeInt = (v: unknown): v is number => typeof v === 'number' && Number.isInteger(v) && v >= 0;

/**
 * Converts `schema` (found at `at`, e.g. `response_format.json_schema.schema`) to what the grammar
 * builder takes, or says which keyword it cannot enforce.
 */
export function toGrammarSchema(schema: unknown, at = 'schema'): SchemaConversion {
  let nodes = 0;
  let usesAny = false;
  const defs = isObject(schema) && isObject(schema.$defs) ? schema.$defs : {};

  const convert = (s: unknown, path: string, depth: number): GrammarSchema => {
    if (++nodes > SCHEMA_LIMITS.nodes) throw new Refused('schema', at, `The schema has more than ${SCHEMA_LIMITS.nodes} subschemas.`);
    if (depth > SCHEMA_LIMITS.depth) throw new Refused('schema', path, `The schema nests deeper than ${SCHEMA_LIMITS.depth} levels.`);
    // Any JSON value: a recursive definition of JSON, added to the root's $defs.
    if (s === true || (isObject(s) && Object.keys(s).every((k) => ANNOTATIONS.has(k)))) {
      usesAny = true;
      return { $ref: `#/$defs/${ANY_DEF}` };
    }
    if (!isObject(s)) throw new Refused('schema', path, 'Each schema must be a JSON object.');
    const out: GrammarSchema = {};
    const keys = Object.keys(s).filter((k) => !ANNOTATIONS.has(k) && k !== '$defs');
    const refuse = (keyword: string, why: string): never => {
      throw new Refused(keyword, `${path}.${keyword}`, `The keyword '${keyword}' at ${path} cannot be enforced by the grammar ${why}.`);
    };
    const has = (k: string) => keys.includes(k);

    if (has('$ref')) {
      const ref = s.$ref;
      if (typeof ref !== 'string' || !/^#\/\$defs\/[^/]+$/.test(ref) || !(ref.slice('#/$defs/'.length) in defs)) {
        refuse('$ref', '(only references to "#/$defs/<name>" of the top-level schema are followed)');
      }
      const others = keys.filter((k) => k !== '$ref');
      if (others.length > 0) refuse(others[0]!, 'beside $ref');
      return { $ref: ref };
    }
    for (const combo of ['anyOf', 'oneOf'] as const) {
      if (!has(combo)) continue;
      const branches = s[combo];
      if (!Array.isArray(branches) || branches.length === 0) refuse(combo, '(it must be a non-empty list of schemas)');
      const others = keys.filter((k) => k !== combo);
      if (others.length > 0) refuse(others[0]!, `beside ${combo} (put it inside each branch)`);
      return { oneOf: (branches as unknown[]).map((b, i) => convert(b, `${path}.${combo}[${i}]`, depth + 1)) };
    }
    if (has('const')) {
      if (!isScalar(s.const)) refuse('const', '(only a string, number, boolean or null)');
      const others = keys.filter((k) => k !== 'const' && k !== 'type');
      if (others.length > 0) refuse(others[0]!, 'beside const');
      return { const: s.const };
    }
    if (has('enum')) {
      const values = s.enum;
      if (!Array.isArray(values) || values.length === 0 || values.length > SCHEMA_LIMITS.enumValues || !values.every(isScalar)) {
        refuse('enum', `(a list of 1 to ${SCHEMA_LIMITS.enumValues} strings, numbers, booleans or nulls)`);
      }
      const others = keys.filter((k) => k !== 'enum' && k !== 'type');
      if (others.length > 0) refuse(others[0]!, 'beside enum');
      return { enum: values };
    }
    if (!has('type')) refuse(keys[0] ?? 'type', keys.length ? 'without a `type`' : '(the schema names no `type`)');
    const type = s.type;
    const types = Array.isArray(type) ? type : [type];
    if (types.length === 0 || !types.every((t) => typeof t === 'string' && ALL_TYPES.has(t)) || new Set(types).size !== types.length) {
      refuse('type', `(one of ${[...ALL_TYPES].join(', ')}, or a list of them)`);
    }
    if (types.length > 1) {
      if (types.every((t) => SCALAR_TYPES.has(t as string)) && keys.every((k) => k === 'type')) return { type: types };
      // One branch per type, each with the keywords that apply to it; a keyword no type takes is refused.
      const stray = keys.find((k) => k !== 'type' && !types.some((t) => KEYWORDS_OF[t as string]!.includes(k)));
      if (stray !== undefined) refuse(stray, `on a value of type ${types.join(' or ')}`);
      return {
        oneOf: types.map((t) =>
          convert(
            Object.fromEntries(
              Object.entries(s)
                .filter(([k]) => k === 'type' || KEYWORDS_OF[t as string]!.includes(k))
                .map(([k, v]) => [k, k === 'type' ? t : v]),
            ),
            path,
            depth,
          ),
        ),
      };
    }
    const t = types[0] as string;
    out.type = t;
    const allowed = KEYWORDS_OF;
    for (const k of keys) {
      if (k === 'type') continue;
      if (allowed[t]!.includes(k)) continue;
      if (k === 'minLength' || k === 'maxLength') refuse(k, '(measured: a model that emits bytes of characters that do not decode gets past it)');
      refuse(k, t === 'number' || t === 'integer' ? `(numbers are generated without bounds)` : `on a value of type ${t}`);
    }
    if (t === 'string') {
      if (has('format')) {
        if (typeof s.format !== 'string' || !FORMATS.has(s.format)) refuse('format', `(the grammar knows ${[...FORMATS].join(', ')})`);
        out.format = s.format;
      }
    } else if (t === 'object') {
      const props = has('properties') ? s.properties : {};
      if (!isObject(props) || Object.keys(props).length > SCHEMA_LIMITS.properties)
        refuse('properties', `(an object of at most ${SCHEMA_LIMITS.properties} schemas)`);
      const properties: Record<string, GrammarSchema> = {};
      for (const [name, sub] of Object.entries(props as Record<string, unknown>)) properties[name] = convert(sub, `${path}.properties.${name}`, depth + 1);
      out.properties = properties;
      if (has('required')) {
        const req = s.required;
        if (!Array.isArray(req) || !req.every((r) => typeof r === 'string')) refuse('required', '(it must be a list of property names)');
        const missing = (req as string[]).find((r) => !(r in properties));
        if (missing !== undefined) refuse('required', `(it names '${missing}', which is not among the properties)`);
      }
      const extra = has('additionalProperties') ? s.additionalProperties : false;
      if (extra === true || extra === false) out.additionalProperties = extra;
      else out.additionalProperties = convert(extra, `${path}.additionalProperties`, depth + 1);
      for (const k of ['minProperties', 'maxProperties'] as const) {
        if (!has(k)) continue;
        if (!nonNegativeInt(s[k])) refuse(k, '(it must be a non-negative integer)');
        if (out.additionalProperties === false) {
          // All properties are generated, always: the count is fixed.
          const n = Object.keys(properties).length;
          if ((k === 'minProperties' && n < (s[k] as number)) || (k === 'maxProperties' && n > (s[k] as number)))
            refuse(k, `(the object always has its ${n} properties)`);
        } else if (k === 'maxProperties' && (s[k] as number) < Object.keys(properties).length) {
          refuse(k, `(the object always has its ${Object.keys(properties).length} properties)`);
        } else out[k] = s[k];
      }
    } else if (t === 'array') {
      if (has('items')) {
        if (s.items === false) out.maxItems = 0;
        else out.items = convert(s.items, `${path}.items`, depth + 1);
      } else if (!has('prefixItems')) out.items = convert(true, `${path}.items`, depth + 1);
      if (has('prefixItems')) {
        if (!Array.isArray(s.prefixItems)) refuse('prefixItems', '(it must be a list of schemas)');
        out.prefixItems = (s.prefixItems as unknown[]).map((p, i) => convert(p, `${path}.prefixItems[${i}]`, depth + 1));
      }
      for (const k of ['minItems', 'maxItems'] as const) {
        if (!has(k)) continue;
        if (!nonNegativeInt(s[k])) refuse(k, '(it must be a non-negative integer)');
        out[k] = s[k];
      }
    }
    return out;
  };

  try {
    if (!isObject(schema)) throw new Refused('schema', at, 'The schema must be a JSON object.');
    const root = convert(schema, at, 0);
    const converted: Record<string, GrammarSchema> = {};
    if (isObject(schema.$defs)) {
      if (ANY_DEF in schema.$defs) throw new Refused('$defs', `${at}.$defs.${ANY_DEF}`, `The definition name '${ANY_DEF}' is magus's own.`);
      for (const [name, sub] of Object.entries(schema.$defs)) converted[name] = convert(sub, `${at}.$defs.${name}`, 1);
    } else if (schema.$defs !== undefined) throw new Refused('$defs', `${at}.$defs`, "The keyword '$defs' must be an object of schemas.");
    if (usesAny) converted[ANY_DEF] = ANY_JSON;
    if (Object.keys(converted).length > 0) root.$defs = converted;
    if ('definitions' in schema)
      throw new Refused('definitions', `${at}.definitions`, "The keyword 'definitions' is not followed; use '$defs' and '#/$defs/<name>' references.");
    return { ok: true, schema: root };
  } catch (err) {
    if (err instanceof Refused) return { ok: false, keyword: err.keyword, at: err.at, message: err.message };
    throw err;
  }
}

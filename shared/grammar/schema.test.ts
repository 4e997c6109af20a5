import { GRAMMAR_CASES, prng, validator } from '../../test/fixtures/grammar-schemas';
import { toGrammarSchema } from '../json-schema';
import { matches, parseGbnf, sample } from './gbnf-match';
import { GRAMMAR_LIMITS, schemaToGbnf } from './index';

const convert = (schema: unknown) => {
  const r = schemaToGbnf(schema);
  if (!r.ok) throw new Error(`${r.keyword} at ${r.at}: ${r.message}`);
  return r;
};
const refused = (schema: unknown) => {
  const r = schemaToGbnf(schema);
  if (r.ok) throw new Error(`converted:\n${r.gbnf.slice(0, 500)}`);
  return r;
};
const seedOf = (name: string) => [...name].reduce((h, c) => Math.imul(h ^ c.codePointAt(0)!, 16777619) >>> 0, 2166136261);

describe('schemaToGbnf: every answer validates', () => {
  const ajv = validator();
  const ajvDecimal = validator({ decimalStep: true });

  test.each(GRAMMAR_CASES.map((c) => [c.name, c] as const))('%s', (_, c) => {
    const r = convert(c.schema);
    const g = parseGbnf(r.gbnf);
    // The size the limit applies to is the size llama.cpp builds.
    expect(g.rules.length).toBe(r.expandedRules);
    const validate = (c.decimalStep ? ajvDecimal : ajv).compile(c.schema);
    const random = prng(seedOf(c.name));
    for (let i = 0; i < 100; i++) {
      const text = sample(g, random);
      if (i < 20) expect(matches(g, text)).toBe(true);
      let value: unknown;
      try {
        value = JSON.parse(text);
      } catch {
        throw new Error(`not JSON: ${text}`);
      }
      if (!validate(value)) throw new Error(`sampled ${text}: ${ajv.errorsText(validate.errors)}`);
    }
    for (const text of c.accept ?? []) {
      expect([text, validate(JSON.parse(text))]).toEqual([text, true]);
      expect([text, matches(g, text)]).toEqual([text, true]);
    }
    for (const text of c.reject ?? []) {
      let valid = false;
      try {
        valid = validate(JSON.parse(text));
      } catch {
        // Not JSON: rejected too.
      }
      expect([text, valid]).toEqual([text, false]);
      expect([text, matches(g, text)]).toEqual([text, false]);
    }
    for (const text of c.stricter ?? []) {
      expect([text, validate(JSON.parse(text))]).toEqual([text, true]);
      expect([text, matches(g, text)]).toEqual([text, false]);
    }
  });

  test('the same schema gives the same text', () => {
    for (const c of GRAMMAR_CASES) expect(convert(structuredClone(c.schema)).gbnf).toBe(convert(c.schema).gbnf);
  });

  test('additional properties take other names than the declared ones; two of them may share one (the documented limit)', () => {
    const schema = { type: 'object', properties: { a: { type: 'null' } }, additionalProperties: { type: 'string' }, minProperties: 3, maxProperties: 5 };
    expect(toGrammarSchema(schema).ok).toBe(true);
    const g = parseGbnf(convert(schema).gbnf);
    expect(matches(g, '{"a":null,"x":"1","y":"2"}')).toBe(true);
    expect(matches(g, '{"a":null,"x":"1","y":"2","z":"","w":""}')).toBe(true);
    for (const text of [
      '{"a":null,"a":"1","y":"2"}',
      '{"a":null,"\\u0061":"1","y":"2"}',
      '{"a":null,"x":"1"}',
      '{"a":null,"x":"1","y":"2","z":"","w":"","v":""}',
    ])
      expect([text, matches(g, text)]).toEqual([text, false]);
    // JSON.parse folds a repeated name into one property, which Ajv then counts once.
    expect(matches(g, '{"a":null,"x":"1","x":"2"}')).toBe(true);
    const validate = validator().compile(schema);
    const random = prng(3);
    for (let i = 0; i < 100; i++) {
      const text = sample(g, random);
      const names = [...text.matchAll(/[{,]\s*("(?:[^"\\]|\\.)*"):/g)].map((m) => JSON.parse(m[1]!) as string);
      if (new Set(names).size === names.length) expect([text, validate(JSON.parse(text))]).toEqual([text, true]);
    }
  });

  test('whitespace is bounded: a space, or one or two line breaks and up to 20 spaces or tabs, inside brackets and after , and :', () => {
    const g = parseGbnf(convert({ type: 'object', properties: { a: { type: 'array', items: { type: 'integer' } } } }).gbnf);
    for (const text of ['{"a": [1, 2]}', '{ "a":[1] }', '{\n  "a": [\n    1,\n    2\n  ]\n}', '{"a":[\n\n\t\t1]}', `{"a":\n${' '.repeat(20)}[]}`, '{"a":[ ]}'])
      expect([text, matches(g, text)]).toEqual([text, true]);
    for (const text of [
      '{"a":  [1]}',
      '{"a":[1]  }',
      ' {"a":[1]}',
      '{"a":[1]}\n',
      '{"a":[1 ,2]}',
      '{"a"\t:[1]}',
      '{"a":\n\n\n[1]}',
      `{"a":\n${' '.repeat(21)}[]}`,
      '{"a":[ \n]}',
    ])
      expect([text, matches(g, text)]).toEqual([text, false]);
  });
});

describe('schemaToGbnf accepts what toGrammarSchema accepts', () => {
  test.each([
    [{ type: ['string', 'null'] }],
    [{ type: ['object', 'null'], properties: { a: { type: 'boolean' } } }],
    [{ type: 'string', format: 'date' }],
    [{ type: 'array', prefixItems: [{ type: 'integer' }], items: false }],
    [{ description: 'anything' }],
    [{ type: 'object', properties: { x: {}, list: { type: 'array' } } }],
    [{ type: 'object', properties: { a: { type: 'null' }, b: { type: 'null' } }, additionalProperties: false, minProperties: 1, maxProperties: 2 }],
    [{ const: 'x', type: 'string' }],
    [{ enum: [1, 'a', null, true] }],
    [{ oneOf: [{ type: 'integer' }, { type: 'string' }] }],
    [
      {
        type: 'object',
        properties: { n: { $ref: '#/$defs/N' } },
        $defs: { N: { anyOf: [{ type: 'null' }, { $ref: '#/$defs/N2' }] }, N2: { type: 'array', items: { $ref: '#/$defs/N' } } },
      },
    ],
  ])('%j', (schema) => {
    expect(toGrammarSchema(schema).ok).toBe(true);
    const r = convert(schema);
    const g = parseGbnf(r.gbnf);
    const validate = validator().compile(schema);
    const random = prng(7);
    for (let i = 0; i < 50; i++) expect(validate(JSON.parse(sample(g, random)))).toBe(true);
  });
});

describe('recursive definitions', () => {
  const list = {
    $ref: '#/$defs/L',
    $defs: { L: { type: 'object', properties: { next: { anyOf: [{ type: 'null' }, { $ref: '#/$defs/L' }] } }, required: ['next'] } },
  };
  const nested = (k: number): string => (k === 0 ? 'null' : `{"next":${nested(k - 1)}}`);

  test(`nest at most ${GRAMMAR_LIMITS.recursionDepth} times inside themselves, then take their way out`, () => {
    const g = parseGbnf(convert(list).gbnf);
    expect(matches(g, nested(GRAMMAR_LIMITS.recursionDepth + 1))).toBe(true);
    expect(matches(g, nested(GRAMMAR_LIMITS.recursionDepth + 2))).toBe(false);
    // Every sample validates and stops: the deepest level has only the way out.
    const validate = validator().compile(list);
    const random = prng(11);
    for (let i = 0; i < 50; i++) expect(validate(JSON.parse(sample(g, random, 200)))).toBe(true);
  });

  test('a cycle of two definitions counts each reference along it; a definition off the cycle stays one rule', () => {
    const schema = {
      type: 'object',
      properties: { a: { $ref: '#/$defs/A' }, tag: { $ref: '#/$defs/Tag' } },
      required: ['a', 'tag'],
      $defs: {
        A: { type: 'object', properties: { b: { type: 'array', items: { $ref: '#/$defs/B' } } }, required: ['b'] },
        B: { type: 'object', properties: { a: { anyOf: [{ $ref: '#/$defs/A' }, { type: 'null' }] }, tag: { $ref: '#/$defs/Tag' } }, required: ['a', 'tag'] },
        Tag: { type: 'string', maxLength: 3 },
      },
    };
    const r = convert(schema);
    expect(r.gbnf.match(/char\{0,3\}/g)).toHaveLength(1); // Tag's string, once for every level
    const g = parseGbnf(r.gbnf);
    const chain = (k: number): string => (k === 0 ? '{"b":[]}' : `{"b":[{"a":${chain(k - 1)},"tag":"x"}]}`);
    // Each reference along the cycle is a level: A at 0, 2, … 10, B between, so A nests 5 times inside A.
    expect(matches(g, `{"a":${chain(GRAMMAR_LIMITS.recursionDepth / 2)},"tag":"t"}`)).toBe(true);
    expect(matches(g, `{"a":${chain(GRAMMAR_LIMITS.recursionDepth / 2 + 1)},"tag":"t"}`)).toBe(false);
  });

  test('a recursive definition with no value within the depth is refused', () => {
    const r = refused({
      $ref: '#/$defs/L',
      $defs: { L: { type: 'object', properties: { next: { $ref: '#/$defs/L' } }, required: ['next'] } },
    });
    expect([r.keyword, r.at]).toEqual(['schema', 'schema.$defs.L']);
    expect(r.message).toMatch(/no value within 10 levels/);
  });
});

describe('schemaToGbnf refuses, naming the keyword and where it is', () => {
  test.each([
    // What toGrammarSchema refuses too.
    [{ type: 'object', properties: {}, required: ['x'] }, 'required', 'schema.required', /'x'/],
    [{ allOf: [{ type: 'string' }] }, 'allOf', 'schema.allOf', /without a `type`/],
    [{ type: 'array', items: { type: 'string' }, uniqueItems: true }, 'uniqueItems', 'schema.uniqueItems', /array/],
    [{ type: 'object', patternProperties: { '^x': { type: 'string' } } }, 'patternProperties', 'schema.patternProperties', /object/],
    [{ $ref: 'https://example.com/x.json' }, '$ref', 'schema.$ref', /#\/\$defs/],
    [{ type: 'object', definitions: {} }, 'definitions', 'schema.definitions', /\$defs/],
    [{ not: { type: 'string' } }, 'not', 'schema.not', /without a `type`/],
    [{ type: 'date' }, 'type', 'schema.type', /one of/],
    [{ type: 'string', format: 'uri' }, 'format', 'schema.format', /date-time, date, time, duration, email, hostname, ipv4, ipv6, uuid/],
    [
      { type: 'object', properties: { a: { type: 'null' } }, additionalProperties: false, minProperties: 2 },
      'minProperties',
      'schema.minProperties',
      /always has its 1/,
    ],
    // Patterns: what no grammar expresses, and what would need Unicode tables.
    [{ type: 'string', pattern: '(a)\\1' }, 'pattern', 'schema.pattern', /backreference \(\\1\)/],
    [{ type: 'string', pattern: '(?<x>a)\\k<x>' }, 'pattern', 'schema.pattern', /named backreference/],
    [{ type: 'string', pattern: 'a(?=b)' }, 'pattern', 'schema.pattern', /lookahead/],
    [{ type: 'string', pattern: 'a(?!b)' }, 'pattern', 'schema.pattern', /lookahead/],
    [{ type: 'string', pattern: '(?<=a)b' }, 'pattern', 'schema.pattern', /lookbehind/],
    [{ type: 'string', pattern: '(?<!a)b' }, 'pattern', 'schema.pattern', /lookbehind/],
    [{ type: 'string', pattern: '\\bword\\b' }, 'pattern', 'schema.pattern', /word boundary/],
    [{ type: 'string', pattern: '\\Ba' }, 'pattern', 'schema.pattern', /non-word boundary/],
    [{ type: 'string', pattern: '\\p{L}+' }, 'pattern', 'schema.pattern', /Unicode property escape/],
    [{ type: 'string', pattern: '(?i:a)' }, 'pattern', 'schema.pattern', /inline modifier|not a valid/],
    [{ type: 'string', pattern: '[a' }, 'pattern', 'schema.pattern', /not a valid regular expression/],
    [{ type: 'string', pattern: 'a{1,20000}' }, 'pattern', 'schema.pattern', /more than 10000 times/],
    // Unsatisfiable.
    [{ type: 'integer', minimum: 5, maximum: 3 }, 'minimum', 'schema.minimum', /No integer lies between the bounds/],
    [{ type: 'integer', exclusiveMinimum: 3, exclusiveMaximum: 4 }, 'exclusiveMinimum', 'schema.exclusiveMinimum', /No integer/],
    [{ type: 'integer', multipleOf: 10, minimum: 1, maximum: 9 }, 'multipleOf', 'schema.multipleOf', /multiple/],
    [{ type: 'number', minimum: 0.1, maximum: 0.2, multipleOf: 0.3 }, 'multipleOf', 'schema.multipleOf', /multiple/],
    [{ type: 'number', minimum: 1e-20, maximum: 2e-20, multipleOf: 1e-19 }, 'minimum', 'schema.minimum', /at most 19 fraction digits/],
    [{ type: 'string', minLength: 5, maxLength: 4 }, 'minLength', 'schema.minLength', /above 'maxLength'/],
    [{ type: 'string', pattern: '^[]$' }, 'pattern', 'schema.pattern', /No string matches/],
    [{ type: 'string', pattern: '^a+$', maxLength: 0 }, 'pattern', 'schema.pattern', /together/],
    [{ type: 'string', enum: [1, 2] }, 'enum', 'schema.enum', /type/],
    [{ type: 'array', prefixItems: [{ type: 'null' }], items: false, minItems: 2 }, 'minItems', 'schema.minItems', /prefixItems/],
    [{ $defs: { a: { $ref: '#/$defs/b' }, b: { anyOf: [{ $ref: '#/$defs/a' }, { type: 'null' }] } }, $ref: '#/$defs/a' }, '$ref', 'schema.$defs.a', /itself/],
    // Caps.
    [{ type: 'string', maxLength: 1e7 }, 'maxLength', 'schema.maxLength', /at most 1000000/],
    [{ type: 'array', minItems: 2e6 }, 'minItems', 'schema.minItems', /at most 1000000/],
    [{ type: 'integer', multipleOf: 999983 }, 'multipleOf', 'schema.multipleOf', /divisibility states/],
    [{ type: 'integer', multipleOf: 3, maximum: 1e20 }, 'multipleOf', 'schema.multipleOf', /2\^53/],
    [{ type: 'number', multipleOf: 1e-500 }, 'multipleOf', 'schema.multipleOf', /above 0/],
    [{ type: 'string', pattern: '(a|b)*a(a|b){300}', maxLength: 400 }, 'pattern', 'schema.pattern', /automaton states/],
    [{ type: 'object', properties: { a: { type: 'string', format: 'hostname', maxLength: 200 } } }, 'format', 'schema.properties.a.format', /automaton states/],
    [
      {
        type: 'object',
        properties: Object.fromEntries(Array.from({ length: 256 }, (_, i) => [`p${i}`.padEnd(100, '_'), {}])),
        additionalProperties: true,
      },
      'additionalProperties',
      'schema.additionalProperties',
      /at most 20000/,
    ],
  ])('%j → %s at %s', (schema, keyword, at, message) => {
    const r = refused(schema);
    expect({ keyword: r.keyword, at: r.at }).toEqual({ keyword, at });
    expect(r.message).toMatch(message);
  });

  test('a grammar above the rule limit is refused whole', () => {
    const wide = {
      type: 'object',
      // 256 different runs of up to 64 and 64: 128 rules each.
      properties: Object.fromEntries(
        Array.from({ length: 256 }, (_, i) => [
          `p${i}`,
          { type: 'string', pattern: `^${String.fromCodePoint(0x100 + i)}{0,64}${String.fromCodePoint(0x300 + i)}{0,64}$` },
        ]),
      ),
    };
    const r = refused(wide);
    expect(r).toMatchObject({ keyword: 'schema', at: 'schema' });
    expect(r.message).toMatch(new RegExp(`at most ${GRAMMAR_LIMITS.expandedRules}`));
  });

  test('depth and size limits are shared/json-schema.ts’s', () => {
    let deep: Record<string, unknown> = { type: 'string' };
    for (let i = 0; i < 40; i++) deep = { type: 'array', items: deep };
    expect(refused(deep).message).toMatch(/deeper than 32/);
    const many = { type: 'object', properties: Object.fromEntries(Array.from({ length: 257 }, (_, i) => [`p${i}`, { type: 'null' }])) };
    expect(refused(many).keyword).toBe('properties');
  });
});

import { toGrammarSchema } from './json-schema';

const ok = (schema: unknown) => {
  const r = toGrammarSchema(schema, 'schema');
  if (!r.ok) throw new Error(r.message);
  return r.schema;
};
const refused = (schema: unknown) => {
  const r = toGrammarSchema(schema, 'schema');
  if (r.ok) throw new Error(`converted: ${JSON.stringify(r.schema).slice(0, 300)}`);
  return r;
};

describe('toGrammarSchema', () => {
  test('a pydantic model (titles, $defs, $ref, X | None as anyOf, required) converts, annotations dropped', () => {
    const pydantic = {
      title: 'Person',
      type: 'object',
      properties: {
        name: { title: 'Name', type: 'string' },
        age: { title: 'Age', type: 'integer' },
        nickname: { anyOf: [{ type: 'string' }, { type: 'null' }], default: null, title: 'Nickname' },
        address: { $ref: '#/$defs/Address' },
        tags: { type: 'array', items: { type: 'string', enum: ['a', 'b'] }, maxItems: 3 },
      },
      required: ['name', 'age', 'address'],
      additionalProperties: false,
      $defs: { Address: { title: 'Address', type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } },
    };
    expect(ok(pydantic)).toEqual({
      type: 'object',
      properties: {
        name: { type: 'string' },
        age: { type: 'integer' },
        nickname: { oneOf: [{ type: 'string' }, { type: 'null' }] },
        address: { $ref: '#/$defs/Address' },
        tags: { type: 'array', items: { enum: ['a', 'b'] }, maxItems: 3 },
      },
      additionalProperties: false,
      $defs: { Address: { type: 'object', properties: { city: { type: 'string' } }, additionalProperties: false } },
    });
  });

  test('type lists become one branch per type; scalar lists stay lists', () => {
    expect(ok({ type: ['string', 'null'] })).toEqual({ type: ['string', 'null'] });
    expect(refused({ type: ['string', 'null'], minimum: 1 }).keyword).toBe('minimum');
    expect(ok({ type: ['object', 'null'], properties: { a: { type: 'boolean' } } })).toEqual({
      oneOf: [{ type: 'object', properties: { a: { type: 'boolean' } }, additionalProperties: false }, { type: 'null' }],
    });
  });

  test('strings keep their known formats (lengths are refused); arrays their bounds and prefix items', () => {
    expect(refused({ type: 'string', minLength: 1 }).keyword).toBe('minLength');
    expect(refused({ type: 'string', maxLength: 5 }).message).toMatch(/'maxLength'.*do not decode/);
    expect(ok({ type: 'string', format: 'date' })).toEqual({ type: 'string', format: 'date' });
    expect(ok({ type: 'array', prefixItems: [{ type: 'integer' }], items: false })).toEqual({ type: 'array', prefixItems: [{ type: 'integer' }], maxItems: 0 });
  });

  test.each([
    [{ type: 'integer', minimum: 0 }, 'minimum', 'schema.minimum'],
    [{ type: 'string', pattern: '^a' }, 'pattern', 'schema.pattern'],
    [{ type: 'string', format: 'email' }, 'format', 'schema.format'],
    [{ type: 'object', properties: { a: { type: 'number', multipleOf: 2 } } }, 'multipleOf', 'schema.properties.a.multipleOf'],
    [{ type: 'object', properties: {}, required: ['x'] }, 'required', 'schema.required'],
    [{ allOf: [{ type: 'string' }] }, 'allOf', 'schema.allOf'],
    [{ type: 'array', items: { type: 'string' }, uniqueItems: true }, 'uniqueItems', 'schema.uniqueItems'],
    [{ type: 'object', patternProperties: { '^x': { type: 'string' } } }, 'patternProperties', 'schema.patternProperties'],
    [{ $ref: 'https://example.com/x.json' }, '$ref', 'schema.$ref'],
    [{ type: 'object', definitions: {} }, 'definitions', 'schema.definitions'],
    [{ not: { type: 'string' } }, 'not', 'schema.not'],
    [{ enum: [{ a: 1 }] }, 'enum', 'schema.enum'],
    [{ type: 'date' }, 'type', 'schema.type'],
  ])('%j is refused, naming %s at %s', (schema, keyword, at) => {
    const r = refused(schema);
    expect(r.keyword).toBe(keyword);
    expect(r.at).toBe(at);
    expect(r.message).toContain(`'${keyword}'`);
  });

  test('a schema that allows anything becomes a recursive definition of JSON', () => {
    const any = ok({ description: 'anything' });
    expect(any.$ref).toBe('#/$defs/magus_any_json');
    expect(JSON.stringify((any.$defs as Record<string, unknown>).magus_any_json)).toContain('#/$defs/magus_any_json');
    expect(ok({ type: 'object', properties: { x: {}, list: { type: 'array' } } })).toMatchObject({
      properties: { x: { $ref: '#/$defs/magus_any_json' }, list: { type: 'array', items: { $ref: '#/$defs/magus_any_json' } } },
      $defs: { magus_any_json: expect.any(Object) as unknown },
    });
    expect(refused({ type: 'object', properties: { a: { type: 'null' }, b: { type: 'null' } }, additionalProperties: true, maxProperties: 1 }).keyword).toBe(
      'maxProperties',
    );
  });

  test('bounds: depth and size', () => {
    let deep: Record<string, unknown> = { type: 'string' };
    for (let i = 0; i < 40; i++) deep = { type: 'array', items: deep };
    expect(refused(deep).message).toMatch(/deeper than 32/);
    const wide = {
      type: 'object',
      properties: Object.fromEntries(
        Array.from({ length: 250 }, (_, i) => [
          `p${i}`,
          {
            type: 'array',
            items: {
              type: 'array',
              items: {
                type: 'array',
                items: { type: 'array', items: { type: 'array', items: { type: 'array', items: { type: 'array', items: { type: 'string' } } } } },
              },
            },
          },
        ]),
      ),
    };
    expect(refused(wide).message).toMatch(/more than 2000 subschemas/);
  });
});

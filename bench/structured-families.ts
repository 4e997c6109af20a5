/**
 * bench:structured's keyword families (bench/structured.ts): one realistic `json_schema` per
 * family of keywords magus's grammar enforces (shared/grammar/index.ts), each with a prompt that
 * asks for such a record. Strings are bounded (a length, a pattern or a format) so that a greedy
 * answer ends within the bench's `max_tokens`.
 */

export interface KeywordFamily {
  /** The row's name in the table (and in `BENCH_FAMILIES`). */
  name: string;
  /** What the schema exercises (the README's row). */
  keywords: string;
  prompt: string;
  schema: Record<string, unknown>;
  /** A `multipleOf` that is not a binary fraction: validate with `multipleOfPrecision` (test/fixtures/grammar-schemas.ts). */
  decimalStep?: true;
}

const object = (properties: Record<string, unknown>, extra: Record<string, unknown> = {}) => ({
  type: 'object',
  properties,
  required: Object.keys(properties),
  additionalProperties: false,
  ...extra,
});

export const KEYWORD_FAMILIES: readonly KeywordFamily[] = [
  {
    name: 'numbers',
    keywords: 'integer/number: minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf',
    prompt: 'Give one line of a web shop order as JSON: the order number, quantity, unit price, discount, rating and weight.',
    schema: object({
      order_id: { type: 'integer', minimum: 1, maximum: 999999 },
      quantity: { type: 'integer', exclusiveMinimum: 0, maximum: 100 },
      pack_size: { type: 'integer', minimum: 5, maximum: 50, multipleOf: 5 },
      unit_price: { type: 'number', exclusiveMinimum: 0, maximum: 10000, multipleOf: 0.01 },
      discount: { type: 'number', minimum: 0, exclusiveMaximum: 1 },
      rating: { type: 'integer', minimum: 1, maximum: 5 },
      weight_kg: { type: 'number', minimum: 0.1, maximum: 50 },
    }),
    decimalStep: true,
  },
  {
    name: 'pattern',
    keywords: 'string pattern (anchored classes, counts, groups, alternation)',
    prompt: 'Give a parcel shipment as JSON: the product SKU, the postcode, a phone number, the box colour and the label software version.',
    schema: object({
      sku: { type: 'string', pattern: '^[A-Z]{3}-[0-9]{4}$' },
      postcode: { type: 'string', pattern: '^\\d{5}(?:-\\d{4})?$' },
      phone: { type: 'string', pattern: '^\\+[1-9][0-9]{6,11}$' },
      colour: { type: 'string', pattern: '^#[0-9a-fA-F]{6}$' },
      size: { type: 'string', pattern: '^(?:small|medium|large)(?:-(?:flat|tall))?$' },
      version: { type: 'string', pattern: '^v\\d{1,2}\\.\\d{1,2}\\.\\d{1,3}$' },
    }),
  },
  {
    name: 'format',
    keywords: 'string format: uuid, email, date-time, date, ipv4, hostname',
    prompt: "Give a user account's sign-up event as JSON: its id, the email, when it happened, the birthday, the client's IP address and the server.",
    schema: object({
      id: { type: 'string', format: 'uuid' },
      email: { type: 'string', format: 'email', maxLength: 32 },
      created_at: { type: 'string', format: 'date-time' },
      birthday: { type: 'string', format: 'date' },
      ip: { type: 'string', format: 'ipv4' },
      server: { type: 'string', format: 'hostname', maxLength: 24 },
    }),
  },
  {
    name: 'lengths',
    keywords: 'string minLength/maxLength',
    prompt: 'Give a person profile as JSON: a username, the display name, a short bio, the country code and a motto.',
    schema: object({
      username: { type: 'string', minLength: 3, maxLength: 16 },
      display_name: { type: 'string', minLength: 1, maxLength: 24 },
      bio: { type: 'string', minLength: 10, maxLength: 60 },
      country: { type: 'string', minLength: 2, maxLength: 2 },
      motto: { type: 'string', maxLength: 30 },
    }),
  },
  {
    name: 'arrays',
    keywords: 'array minItems/maxItems, prefixItems (a tuple), items',
    prompt: 'Give a hiking trip as JSON: its tags, three daily distances in km, the start as latitude and longitude, and up to two companions.',
    schema: object({
      tags: { type: 'array', items: { type: 'string', maxLength: 12 }, minItems: 1, maxItems: 4 },
      distances_km: { type: 'array', items: { type: 'integer', minimum: 0, maximum: 60 }, minItems: 3, maxItems: 3 },
      start: {
        type: 'array',
        prefixItems: [
          { type: 'number', minimum: -90, maximum: 90 },
          { type: 'number', minimum: -180, maximum: 180 },
        ],
        items: false,
      },
      companions: { type: 'array', items: { type: 'string', maxLength: 16 }, maxItems: 2 },
    }),
  },
  {
    name: 'anyOf/$defs',
    keywords: '$defs with #/$defs references, anyOf, a nullable property, enum',
    prompt: 'Give a web shop order as JSON: the customer, one or two items, how it was paid and an optional note.',
    schema: object(
      {
        customer: { $ref: '#/$defs/person' },
        items: { type: 'array', items: { $ref: '#/$defs/item' }, minItems: 1, maxItems: 2 },
        payment: { anyOf: [object({ card_last4: { type: 'string', pattern: '^\\d{4}$' } }), object({ method: { enum: ['cash', 'invoice'] } })] },
        note: { anyOf: [{ type: 'string', maxLength: 24 }, { type: 'null' }] },
      },
      {
        $defs: {
          person: object({ name: { type: 'string', maxLength: 20 }, vip: { type: 'boolean' } }),
          item: object({ sku: { type: 'string', maxLength: 8 }, qty: { type: 'integer', minimum: 1, maximum: 9 } }),
        },
      },
    ),
  },
];

/**
 * The property of structured output (issue 41), CI-sized: schemas generated within the subset
 * magus's grammar accepts (test/fixtures/schema-generator.ts), each answered at temperature 1.0
 * by the tiny random model in a real `magus engine` (a child process, as engine.test.ts runs it),
 * several sampling seeds each: every answer finishes and validates against its schema with Ajv and
 * its formats. The full run (300 schemas × 5 seeds, and SmolLM2) is `npm run
 * bench:structured-property`. MAGUS_PROPERTY_SCHEMAS and MAGUS_PROPERTY_SEEDS raise the counts.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startLlamaCppEngine, type LlamaCppEngine } from '../activities/runtime/llama-cpp';
import { schemaToGbnf } from '../shared/grammar';
import { coverage, FORMATS, generateSchema } from '../test/fixtures/schema-generator';
import { askUnderSchema, describeFailure, judge, tinyGguf } from '../test/fixtures/structured-property';

const SCHEMAS = Number(process.env.MAGUS_PROPERTY_SCHEMAS ?? '80');
const SEEDS = Number(process.env.MAGUS_PROPERTY_SEEDS ?? '2');
const generated = Array.from({ length: SCHEMAS }, (_, i) => generateSchema(i + 1));

let root: string;
let engine: LlamaCppEngine;

beforeAll(async () => {
  root = mkdtempSync(join(tmpdir(), 'magus-property-'));
  engine = await startLlamaCppEngine(await tinyGguf(root), {
    modelId: 'tiny',
    slots: 1,
    threads: 1,
    ctx: 2048,
    startTimeoutSec: 90,
    name: 'engine',
    log: () => undefined,
  });
}, 120_000);

afterAll(async () => {
  await engine?.process.stop(5000);
  rmSync(root, { recursive: true, force: true });
});

test('the generator keeps within the converter: every schema it makes converts', () => {
  const refused = generated.flatMap((g) => {
    const c = schemaToGbnf(g.schema);
    return c.ok ? [] : [{ seed: g.seed, keyword: c.keyword, at: c.at, message: c.message }];
  });
  expect(refused).toEqual([]);
});

test('the first 300 schemas cover every keyword, kind and format the property is about', () => {
  const seen = coverage(Array.from({ length: 300 }, (_, i) => generateSchema(i + 1).schema));
  const wanted = [
    ...['object', 'array', 'string', 'integer', 'number', 'boolean', 'null'].map((t) => `type: ${t}`),
    'type list',
    'properties',
    'required',
    'additionalProperties: false',
    'additionalProperties: true',
    'additionalProperties: schema',
    'minProperties',
    'maxProperties',
    'items',
    'prefixItems',
    'minItems',
    'maxItems',
    'anyOf',
    'oneOf',
    'enum',
    'const',
    '$defs',
    '$ref',
    '$ref (recursive)',
    'minimum',
    'maximum',
    'exclusiveMinimum',
    'exclusiveMaximum',
    'multipleOf (integer step)',
    'multipleOf (decimal step)',
    'minLength',
    'maxLength',
    'pattern',
    ...FORMATS.map((f) => `format: ${f}`),
  ];
  expect(wanted.filter((k) => !seen.has(k))).toEqual([]);
});

describe(`${SCHEMAS} generated schemas × ${SEEDS} seeds at temperature 1.0, tiny random model`, () => {
  test.each(generated)('schema $seed: every answer finishes and validates with Ajv and its formats', async (g) => {
    const failures: string[] = [];
    for (let seed = 1; seed <= SEEDS; seed++) {
      const answer = await askUnderSchema(engine.url, g, seed, { maxTokens: 1000 });
      const verdict = judge(g, answer);
      if (!verdict.valid || !verdict.finished) failures.push(describeFailure(g, seed, answer, verdict));
    }
    expect(failures).toEqual([]);
  });
});

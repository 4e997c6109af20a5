/**
 * The property of structured output (issue 41): schemas generated within the subset magus's
 * grammar accepts (test/fixtures/schema-generator.ts), each answered at temperature 1.0 in a real
 * `magus engine` (a child process, as engine.test.ts runs it): 300 schemas × 5 sampling seeds by
 * the tiny random model (~1.5 min), and the first 40 by SmolLM2-135M-Instruct with the schema in
 * its prompt (~1.5 min); every answer finishes and validates against its schema with Ajv and its
 * formats. SmolLM2 on all 300 is `npm run bench:structured-property` (11.5 min).
 * MAGUS_PROPERTY_SCHEMAS, MAGUS_PROPERTY_SEEDS and MAGUS_PROPERTY_SMOLLM2 change the counts.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startLlamaCppEngine, type LlamaCppEngine } from '../activities/runtime/llama-cpp';
import { schemaToGbnf } from '../shared/grammar';
import { coverage, FORMATS, generateSchema } from '../test/fixtures/schema-generator';
import { askUnderSchema, describeFailure, judge, tinyGguf } from '../test/fixtures/structured-property';
import { demoModelFile } from '../workers/dev/demo-model';

const SCHEMAS = Number(process.env.MAGUS_PROPERTY_SCHEMAS ?? '300');
const SEEDS = Number(process.env.MAGUS_PROPERTY_SEEDS ?? '5');
const SMOLLM2_SCHEMAS = Number(process.env.MAGUS_PROPERTY_SMOLLM2 ?? '40');
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
      // The random weights take every whitespace the grammar allows: room for it (the context is 2048).
      const answer = await askUnderSchema(engine.url, g, seed, { maxTokens: 1900 });
      const verdict = judge(g, answer);
      if (!verdict.valid || !verdict.finished) failures.push(describeFailure(g, seed, answer, verdict));
    }
    expect(failures).toEqual([]);
  });
});

describe(`the first ${SMOLLM2_SCHEMAS} generated schemas at temperature 1.0, SmolLM2-135M-Instruct (the schema in its prompt)`, () => {
  let smollm2: LlamaCppEngine;
  beforeAll(async () => {
    smollm2 = await startLlamaCppEngine(await demoModelFile(() => undefined), {
      modelId: 'smollm2',
      slots: 1,
      threads: 1,
      ctx: 4096,
      startTimeoutSec: 120,
      name: 'smollm2',
      log: () => undefined,
    });
  }, 600_000);
  afterAll(async () => {
    await smollm2?.process.stop(5000);
  });

  test.each(generated.slice(0, SMOLLM2_SCHEMAS))('schema $seed: the answer finishes and validates with Ajv and its formats', async (g) => {
    const answer = await askUnderSchema(smollm2.url, g, 1, { maxTokens: 1000, showSchema: true });
    const verdict = judge(g, answer);
    expect(verdict.valid && verdict.finished ? [] : [describeFailure(g, 1, answer, verdict)]).toEqual([]);
  });
});

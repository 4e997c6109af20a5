/**
 * `npm run bench:structured-property`: the full run of issue 41's property — schemas generated
 * within the subset magus's grammar accepts (test/fixtures/schema-generator.ts), each answered at
 * temperature 1.0 in `magus engine` (1 slot, as the local runtime starts it, called directly) by
 * the tiny random model (several sampling seeds) and by the demo model SmolLM2-135M-Instruct Q4_1
 * (the schema in its prompt): every answer must finish and validate against the schema with Ajv
 * and its formats (test/fixtures/structured-property.ts `judge`). Prints per model the answers,
 * how many validate and finish, tokens per answer p50, the time, and each failure with its schema
 * and text; exits 1 when any answer fails.
 *
 * Environment: PROPERTY_SCHEMAS (default 300), PROPERTY_TINY_SEEDS (default 5),
 * PROPERTY_SMOLLM2_SEEDS (default 1), PROPERTY_MODELS (`tiny,smollm2`), BENCH_THREADS (default 1),
 * PROPERTY_MAX_TOKENS (default 1000; the tiny model 1900, PROPERTY_TINY_MAX_TOKENS: at temperature 1
 * its random weights take every whitespace the grammar allows, and its context is 2048), PROPERTY_UNBOUNDED=1 (schemas with additional properties and
 * values of any JSON too: parts whose strings no keyword bounds, for the real model only — the
 * random one writes such a string to `max_tokens`).
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { startLlamaCppEngine } from '../activities/runtime/llama-cpp';
import { demoModelFile } from '../workers/dev/demo-model';
import { schemaToGbnf } from '../shared/grammar';
import { generateSchema } from '../test/fixtures/schema-generator';
import { askUnderSchema, describeFailure, judge, tinyGguf } from '../test/fixtures/structured-property';
import { fmt, p50 } from './common';

const SCHEMAS = Number(process.env.PROPERTY_SCHEMAS ?? '300');
const SEEDS: Record<string, number> = { tiny: Number(process.env.PROPERTY_TINY_SEEDS ?? '5'), smollm2: Number(process.env.PROPERTY_SMOLLM2_SEEDS ?? '1') };
const MODELS = (process.env.PROPERTY_MODELS ?? 'tiny,smollm2').split(',');
const THREADS = Number(process.env.BENCH_THREADS ?? '1');
const MAX_TOKENS: Record<string, number> = {
  tiny: Number(process.env.PROPERTY_TINY_MAX_TOKENS ?? '1900'),
  smollm2: Number(process.env.PROPERTY_MAX_TOKENS ?? '1000'),
};
const UNBOUNDED = process.env.PROPERTY_UNBOUNDED === '1';
const schemaOf = (i: number) => generateSchema(i, { unbounded: UNBOUNDED });

interface Run {
  model: string;
  answers: number;
  valid: number;
  finished: number;
  tokens: number[];
  seconds: number;
  failures: string[];
}

async function runModel(model: string, gguf: string, ctx: number): Promise<Run> {
  const engine = await startLlamaCppEngine(gguf, { modelId: model, slots: 1, threads: THREADS, ctx, startTimeoutSec: 120, name: model, log: () => undefined });
  const run: Run = { model, answers: 0, valid: 0, finished: 0, tokens: [], seconds: 0, failures: [] };
  const t0 = performance.now();
  try {
    for (let i = 1; i <= SCHEMAS; i++) {
      const generated = schemaOf(i);
      for (let seed = 1; seed <= SEEDS[model]!; seed++) {
        const answer = await askUnderSchema(engine.url, generated, seed, { maxTokens: MAX_TOKENS[model]!, showSchema: model !== 'tiny' });
        const verdict = judge(generated, answer);
        run.answers++;
        run.tokens.push(answer.tokens);
        if (verdict.valid) run.valid++;
        if (verdict.finished) run.finished++;
        if (!verdict.valid || !verdict.finished) {
          run.failures.push(describeFailure(generated, seed, answer, verdict));
          console.log(`${model}: FAILED ${run.failures.at(-1)}`);
        }
      }
      if (i % 25 === 0)
        console.log(
          `${model}: ${i}/${SCHEMAS} schemas, ${run.answers} answers, ${run.answers - run.valid} invalid, ${fmt((performance.now() - t0) / 1000, 0)} s`,
        );
    }
  } finally {
    run.seconds = (performance.now() - t0) / 1000;
    await engine.process.stop(5000);
  }
  return run;
}

async function main(): Promise<void> {
  const load0 = loadavg();
  // The generator's own property first: every schema converts.
  const refused = Array.from({ length: SCHEMAS }, (_, i) => schemaOf(i + 1)).filter((g) => !schemaToGbnf(g.schema).ok);
  for (const g of refused) console.log(`refused: schema seed ${g.seed}: ${JSON.stringify(schemaToGbnf(g.schema))}`);
  const dir = mkdtempSync(join(tmpdir(), 'magus-property-'));
  const runs: Run[] = [];
  try {
    for (const model of MODELS) {
      if (model === 'tiny') runs.push(await runModel('tiny', await tinyGguf(dir), 2048));
      else if (model === 'smollm2') runs.push(await runModel('smollm2', await demoModelFile((line) => console.log(line)), 4096));
      else throw new Error(`PROPERTY_MODELS: unknown model '${model}' (tiny, smollm2)`);
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
  const out = [
    `bench:structured-property: ${SCHEMAS} generated schemas${UNBOUNDED ? ' (unbounded)' : ''} (${refused.length} refused by the converter), temperature 1.0, max_tokens ${MODELS.map((m) => `${MAX_TOKENS[m]} (${m})`).join(', ')}, magus engine 1 slot ${THREADS} thread(s), ${cpus().length} cores, load ${load0.map((l) => l.toFixed(2)).join(' ')} → ${loadavg()
      .map((l) => l.toFixed(2))
      .join(' ')}`,
    '',
    '| model | answers (schemas × seeds) | valid (Ajv + formats) | finished (`stop`) | tokens per answer p50 | time |',
    '|---|---|---|---|---|---|',
    ...runs.map(
      (r) =>
        `| ${r.model} | ${r.answers} (${SCHEMAS} × ${SEEDS[r.model]}) | ${r.valid}/${r.answers} | ${r.finished}/${r.answers} | ${fmt(p50(r.tokens), 0)} | ${fmt(r.seconds / 60, 1)} min |`,
    ),
  ];
  for (const r of runs) if (r.failures.length > 0) out.push('', `${r.model}: ${r.failures.length} failure(s)`, ...r.failures);
  console.log(out.join('\n'));
  if (refused.length > 0 || runs.some((r) => r.failures.length > 0)) process.exitCode = 1;
}

main().then(
  () => process.exit(process.exitCode ?? 0),
  (err: unknown) => {
    console.error(err);
    process.exit(1);
  },
);

/**
 * `npm run bench:structured`: what grammar-constrained decoding costs (issue 27): tokens/s of
 * answers under a `json_schema` (and of forced tool calls, and of answers with log-probabilities,
 * which take magus's own token loop) against free answers of the same
 * length cap, on magus dev's demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) in `magus engine`
 * started as the local runtime starts it, 1 slot, called directly. Blocks of requests alternate
 * between the kinds so that drift in the machine's load hits them alike; each request's prompt
 * differs (its index appended), the rest of the prompt stays in the slot's cache (each block
 * starts with an uncounted one-token request of its kind that brings its prompt back).
 *
 * Issue 41: a row per keyword family of magus's grammar (bench/structured-families.ts: numbers,
 * pattern, format, lengths, arrays, anyOf/$defs), each a `json_schema` request for a realistic
 * record, in the same alternating blocks; each finished answer validated with Ajv 2020 and
 * ajv-formats (test/fixtures/grammar-schemas.ts `validator`), an invalid one printed with its text.
 * Then what a schema costs before its first token: for the generated schemas of
 * test/fixtures/schema-generator.ts, `schemaToGbnf`, llama.cpp's parse of the GBNF when the engine
 * compiles it (`llama.createGrammar`, no model needed), and the grammar state each answer creates
 * (parsed again, with the model's vocabulary: loaded vocabulary-only here), each p50/p99/max; and
 * the engine's first request with a never-seen schema against the same request again (its grammar
 * cached), 1 token each.
 *
 * Environment: BENCH_ROUNDS (alternating blocks per kind, default 4), BENCH_BLOCK (requests per
 * block, default 4), BENCH_FAMILY_BLOCK (requests per block of a family row, default BENCH_BLOCK),
 * BENCH_FAMILIES (comma-separated family names, default all; `none` for the four kinds only),
 * BENCH_MAX_TOKENS (default 96), BENCH_FAMILY_MAX_TOKENS (a family's answers, default 192: each
 * record ends before it), BENCH_THREADS (default 1), BENCH_COMPILE_SCHEMAS (generated
 * schemas timed, default 300; 0 skips), BENCH_FRESH_SCHEMAS (never-seen schemas asked of the
 * engine, default 20; 0 skips).
 */
import { cpus, loadavg } from 'node:os';
import type { ValidateFunction } from 'ajv';
import { startLlamaCppEngine } from '../activities/runtime/llama-cpp';
import { cpuLlama } from '../engine/llama';
import { schemaToGbnf } from '../shared/grammar';
import { validator } from '../test/fixtures/grammar-schemas';
import { generateSchema } from '../test/fixtures/schema-generator';
import { demoModelFile } from '../workers/dev/demo-model';
import { fmt, p50, p99 } from './common';
import { KEYWORD_FAMILIES, type KeywordFamily } from './structured-families';

const ROUNDS = Number(process.env.BENCH_ROUNDS ?? '4');
const BLOCK = Number(process.env.BENCH_BLOCK ?? '4');
const FAMILY_BLOCK = Number(process.env.BENCH_FAMILY_BLOCK ?? String(BLOCK));
const MAX_TOKENS = Number(process.env.BENCH_MAX_TOKENS ?? '96');
/** A family's record runs to ~150 tokens (SmolLM2 writes a digit per token): room to finish, so that it can be validated. */
const FAMILY_MAX_TOKENS = Number(process.env.BENCH_FAMILY_MAX_TOKENS ?? '192');
const THREADS = Number(process.env.BENCH_THREADS ?? '1');
const COMPILE_SCHEMAS = Number(process.env.BENCH_COMPILE_SCHEMAS ?? '300');
const FRESH_SCHEMAS = Number(process.env.BENCH_FRESH_SCHEMAS ?? '20');

const STORY = {
  type: 'object',
  properties: {
    title: { type: 'string' },
    characters: { type: 'array', items: { type: 'object', properties: { name: { type: 'string' }, role: { enum: ['hero', 'villain', 'friend'] } } } },
    story: { type: 'string' },
  },
  required: ['title', 'characters', 'story'],
};
const WEATHER = {
  type: 'function',
  function: {
    name: 'plan_trip',
    description: 'Plan a trip',
    parameters: {
      type: 'object',
      properties: { city: { type: 'string' }, days: { type: 'integer' }, activities: { type: 'array', items: { type: 'string' } } },
    },
  },
};
const PROMPT = 'Write a short story about a lighthouse keeper who finds a message in a bottle.';

function selectedFamilies(): readonly KeywordFamily[] {
  const wanted = process.env.BENCH_FAMILIES;
  if (wanted === undefined || wanted === '') return KEYWORD_FAMILIES;
  if (wanted === 'none') return [];
  return wanted.split(',').map((name) => {
    const family = KEYWORD_FAMILIES.find((f) => f.name === name.trim());
    if (!family) throw new Error(`BENCH_FAMILIES: unknown family '${name}' (${KEYWORD_FAMILIES.map((f) => f.name).join(', ')}, or none)`);
    return family;
  });
}

/** A row of the table: one of the four kinds of issue 27, or a keyword family's `json_schema`. */
interface Kind {
  name: string;
  prompt: string;
  extra: Record<string, unknown>;
  block: number;
  maxTokens: number;
  family?: KeywordFamily;
  /** The family's schema compiled by Ajv. */
  validate?: ValidateFunction;
}

interface Answer {
  choices: { message: { content: string | null; tool_calls?: unknown[] }; finish_reason: string; logprobs: { content: unknown[] } | null }[];
  usage: { completion_tokens: number };
}

interface Result {
  tokens: number;
  ms: number;
  valid: boolean;
  /** Ended by the model (`stop`, `tool_calls`), not by `max_tokens`. */
  finished: boolean;
}

interface CompileTimes {
  schemas: number;
  refused: number;
  convertMs: number[];
  createMs: number[];
  stateMs: number[];
  chars: number[];
  expandedRules: number[];
}

/**
 * What each generated schema costs before its first token, in this process: magus's converter, the
 * GBNF's parse by llama.cpp as the engine compiles it (`createGrammar`: no model), and the grammar
 * state every answer creates (`LlamaGrammarEvaluationState`: parsed again with the vocabulary).
 */
async function compileTimes(modelPath: string): Promise<CompileTimes> {
  const { lib, llama } = await cpuLlama(THREADS);
  const out: CompileTimes = { schemas: COMPILE_SCHEMAS, refused: 0, convertMs: [], createMs: [], stateMs: [], chars: [], expandedRules: [] };
  try {
    const model = await llama.loadModel({ modelPath, gpuLayers: 0, vocabOnly: true });
    const once = async (schema: unknown, record: boolean) => {
      const t0 = performance.now();
      const converted = schemaToGbnf(schema);
      const t1 = performance.now();
      if (!converted.ok) {
        if (record) out.refused++;
        return;
      }
      const grammar = await llama.createGrammar({ grammar: converted.gbnf });
      const t2 = performance.now();
      new lib.LlamaGrammarEvaluationState({ model, grammar });
      const t3 = performance.now();
      if (!record) return;
      out.convertMs.push(t1 - t0);
      out.createMs.push(t2 - t1);
      out.stateMs.push(t3 - t2);
      out.chars.push(converted.gbnf.length);
      out.expandedRules.push(converted.expandedRules);
    };
    // Untimed: the converter's code compiled by V8, as in an engine that has answered before.
    for (let i = 0; i < 20; i++) await once(generateSchema(COMPILE_SCHEMAS + 1 + i).schema, false);
    for (let i = 1; i <= COMPILE_SCHEMAS; i++) await once(generateSchema(i).schema, true);
    await model.dispose();
  } finally {
    await llama.dispose();
  }
  return out;
}

async function main(): Promise<void> {
  const load0 = loadavg();
  const model = await demoModelFile((line) => console.log(line));
  const kinds: Kind[] = [
    { name: 'free', prompt: PROMPT, extra: {}, block: BLOCK, maxTokens: MAX_TOKENS },
    {
      name: 'json_schema',
      prompt: PROMPT,
      extra: { response_format: { type: 'json_schema', json_schema: { name: 'story', schema: STORY } } },
      block: BLOCK,
      maxTokens: MAX_TOKENS,
    },
    { name: 'tool call', prompt: PROMPT, extra: { tools: [WEATHER], tool_choice: 'required' }, block: BLOCK, maxTokens: MAX_TOKENS },
    // magus's own token loop (engine/decode.ts), with the top 5 alternatives per token.
    { name: 'logprobs', prompt: PROMPT, extra: { logprobs: true, top_logprobs: 5 }, block: BLOCK, maxTokens: MAX_TOKENS },
    ...selectedFamilies().map((family) => ({
      name: family.name,
      prompt: family.prompt,
      extra: { response_format: { type: 'json_schema', json_schema: { name: family.name.replace(/\W/g, '_'), schema: family.schema } } },
      block: FAMILY_BLOCK,
      maxTokens: FAMILY_MAX_TOKENS,
      family,
      validate: validator({ decimalStep: family.decimalStep ?? false }).compile(family.schema),
    })),
  ];
  const compiled = COMPILE_SCHEMAS > 0 ? await compileTimes(model) : undefined;
  const engine = await startLlamaCppEngine(model, {
    modelId: 'smollm2',
    slots: 1,
    threads: THREADS,
    ctx: 4096,
    startTimeoutSec: 120,
    name: 'engine',
    log: () => undefined,
  });
  const invalid: string[] = [];
  let n = 0;
  const post = async (body: Record<string, unknown>, what: string): Promise<{ answer: Answer; ms: number }> => {
    const t0 = performance.now();
    const res = await fetch(`${engine.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'smollm2', temperature: 0, ...body }),
    });
    const answer = (await res.json()) as Answer;
    const ms = performance.now() - t0;
    if (res.status !== 200) throw new Error(`${what}: HTTP ${res.status} ${JSON.stringify(answer)}`);
    return { answer, ms };
  };
  const ask = async (kind: Kind): Promise<Result> => {
    const { answer, ms } = await post(
      { messages: [{ role: 'user', content: `${kind.prompt} (request ${n++})` }], max_tokens: kind.maxTokens, ...kind.extra },
      kind.name,
    );
    const choice = answer.choices[0]!;
    const finished = choice.finish_reason === 'stop' || choice.finish_reason === 'tool_calls';
    let valid = true;
    if (kind.name === 'json_schema' && choice.finish_reason === 'stop') valid = typeof JSON.parse(choice.message.content!) === 'object';
    if (kind.name === 'tool call') valid = choice.finish_reason === 'tool_calls' || choice.finish_reason === 'length';
    // One entry per returned token (the end-of-generation token, when sampled, returns no text).
    if (kind.name === 'logprobs') valid = (choice.logprobs?.content.length ?? 0) >= answer.usage.completion_tokens - 1 && answer.usage.completion_tokens > 0;
    if (kind.validate) {
      // A family's answer: well formed when it finished and Ajv (with formats) accepts it.
      const text = choice.message.content ?? '';
      let value: unknown;
      try {
        value = JSON.parse(text);
        valid = finished && kind.validate(value);
      } catch {
        valid = false;
      }
      if (finished && !valid) {
        invalid.push(`${kind.name}: INVALID ${JSON.stringify(text)}: ${JSON.stringify(kind.validate.errors ?? 'not JSON')}`);
        console.log(invalid.at(-1));
      }
    }
    return { tokens: answer.usage.completion_tokens, ms, valid, finished };
  };
  try {
    for (const k of kinds) await ask(k); // warm-up: grammars compiled, the prompt's prefix in the slot
    const results = new Map<Kind, Result[]>(kinds.map((k) => [k, []]));
    for (let round = 0; round < ROUNDS; round++) {
      const order = round % 2 === 0 ? kinds : [...kinds].reverse();
      for (const k of order) {
        // Uncounted: the kind's prompt brought back into the slot (one token), so each counted
        // request finds its prefix cached, as a conversation's next turn does; without it the
        // block's first request re-evaluates the whole prompt (the forced call's describes its
        // tools: 122 tokens against the others' ~30, ~0.5 s here).
        await post({ messages: [{ role: 'user', content: `${k.prompt} (request ${n++})` }], max_tokens: 1, ...k.extra }, `${k.name} prime`);
        for (let i = 0; i < k.block; i++) results.get(k)!.push(await ask(k));
      }
      console.log(`round ${round + 1}/${ROUNDS} done`);
    }
    // A never-seen schema's first request (converted, compiled) against the same request again.
    const fresh: { seed: number; first: number; again: number }[] = [];
    if (FRESH_SCHEMAS > 0) {
      const body = (schema: unknown) => ({
        messages: [{ role: 'user', content: 'Answer with a JSON value.' }],
        max_tokens: 1,
        response_format: { type: 'json_schema', json_schema: { name: 'generated', schema } },
      });
      await post({ messages: [{ role: 'user', content: 'Answer with a JSON value.' }], max_tokens: 1 }, 'fresh warm-up');
      // Seeds the compile-time loop above did not use (that was another process anyway).
      for (let i = 0; i < FRESH_SCHEMAS; i++) {
        const { seed, schema } = generateSchema(100_000 + i);
        const first = (await post(body(schema), 'fresh schema')).ms;
        const again = (await post(body(schema), 'cached schema')).ms;
        fresh.push({ seed, first, again });
      }
    }
    const rate = (r: Result[]) => r.reduce((a, x) => a + x.tokens, 0) / (r.reduce((a, x) => a + x.ms, 0) / 1000);
    const free = rate(results.get(kinds[0]!)!);
    const out = [
      `bench:structured: SmolLM2-135M-Instruct Q4_1 on magus engine (1 slot, ${THREADS} thread(s)), ${cpus().length} cores, load ${load0.map((l) => l.toFixed(2)).join(' ')} → ${loadavg()
        .map((l) => l.toFixed(2))
        .join(' ')}`,
      `${ROUNDS} alternating blocks of ${BLOCK} requests per kind${FAMILY_BLOCK !== BLOCK ? ` (${FAMILY_BLOCK} per family)` : ''}, greedy, max_tokens ${MAX_TOKENS} (${FAMILY_MAX_TOKENS} for a family)`,
      '',
      '| answer | tokens/s (whole request) | vs free | tokens per answer p50 | well formed |',
      '|---|---|---|---|---|',
    ];
    for (const k of kinds) {
      const r = results.get(k)!;
      const cut = r.filter((x) => !x.finished).length;
      // A family's well formed: finished and valid under Ajv; answers cut at max_tokens are counted apart.
      const formed = `${r.filter((x) => x.valid).length}/${r.length}${k.family && cut > 0 ? ` (${cut} cut at max_tokens)` : ''}`;
      out.push(`| ${k.name} | ${fmt(rate(r), 1)} | ${fmt(rate(r) / free, 3)}× | ${fmt(p50(r.map((x) => x.tokens)), 0)} | ${formed} |`);
    }
    if (compiled) {
      const row = (name: string, ms: number[]) =>
        `| ${name} | ${fmt(p50(ms), 3)} | ${fmt(p99(ms), 3)} | ${fmt(Math.max(...ms), 3)} | ${fmt(
          ms.reduce((a, x) => a + x, 0),
          1,
        )} |`;
      const sum = compiled.convertMs.map((x, i) => x + compiled.createMs[i]! + compiled.stateMs[i]!);
      out.push(
        '',
        `Grammar per schema: ${compiled.schemas} generated schemas (test/fixtures/schema-generator.ts, ${compiled.refused} refused), in the bench process; GBNF p50 ${fmt(p50(compiled.chars), 0)} chars (max ${Math.max(...compiled.chars)}), p50 ${fmt(p50(compiled.expandedRules), 0)} rules in llama.cpp (max ${Math.max(...compiled.expandedRules)})`,
        '',
        '| step | p50 ms | p99 ms | max ms | total ms |',
        '|---|---|---|---|---|',
        row('`schemaToGbnf` (magus)', compiled.convertMs),
        row('`llama.createGrammar` (GBNF parsed, once per schema)', compiled.createMs),
        row('grammar state per answer (parsed again with the vocabulary)', compiled.stateMs),
        row('the three', sum),
      );
    }
    if (fresh.length > 0) {
      const first = fresh.map((x) => x.first);
      const again = fresh.map((x) => x.again);
      const extraMs = fresh.map((x) => x.first - x.again);
      const worst = fresh[extraMs.indexOf(Math.max(...extraMs))]!;
      out.push(
        '',
        `A never-seen schema in the engine (${fresh.length} generated schemas, max_tokens 1, the same prompt): first request p50 ${fmt(p50(first), 1)} ms (max ${fmt(Math.max(...first), 1)}), the same again (grammar cached) p50 ${fmt(p50(again), 1)} ms; extra p50 ${fmt(p50(extraMs), 1)} ms, max ${fmt(Math.max(...extraMs), 1)} ms (generated seed ${worst.seed})`,
      );
    }
    if (invalid.length > 0) out.push('', `${invalid.length} finished answer(s) invalid under their schema:`, ...invalid);
    console.log(out.join('\n'));
    if (invalid.length > 0) process.exitCode = 1;
  } finally {
    await engine.process.stop(5000);
  }
}

main().then(
  () => process.exit(process.exitCode ?? 0),
  (err: unknown) => {
    console.error(err);
    process.exit(1);
  },
);

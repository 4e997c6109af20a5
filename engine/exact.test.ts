/**
 * The same bits however a token was evaluated, on the real engine (`magus engine`,
 * SmolLM2-135M-Instruct, dev's demo model): an answer continued from its tokens, and the same
 * prompt again from the prefix its slot kept, go on exactly as the undisturbed answer — the same
 * tokens and the same log-probabilities, to the last bit. llama.cpp's CPU flash attention
 * computes 64 or more rows of one sequence in tiles that round differently from a token evaluated
 * alone; the engine keeps its batches under that (engine/llama.ts `EXACT_BATCH`). Without it the
 * continuation (the prompt and 120 tokens said, evaluated as one batch) and the prompt read again
 * from what it left in its slot parted from the undisturbed answer.
 */
import { startLlamaCppEngine, type LlamaCppEngine } from '../activities/runtime/llama-cpp';
import { sseMessages } from '../test/harness/sse-stream';
import { demoModelFile } from '../workers/dev/demo-model';

let engine: LlamaCppEngine;

beforeAll(async () => {
  const gguf = await demoModelFile(() => undefined);
  engine = await startLlamaCppEngine(gguf, { modelId: 'smol', slots: 2, threads: 1, ctx: 1024, startTimeoutSec: 60, name: 'engine', log: () => undefined });
}, 120_000);

afterAll(async () => {
  await engine?.process.stop(1000);
});

interface Piece {
  text: string;
  tokens: number[];
  logprobs: unknown;
}

/** A streamed greedy answer with its tokens and log-probabilities, read as a bridge reads it. */
async function answer(content: string, resume?: { tokens: number[]; text: string }): Promise<Piece[]> {
  const res = await fetch(`${engine.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({
      messages: [{ role: 'user', content }],
      max_tokens: 200,
      temperature: 0,
      logprobs: true,
      top_logprobs: 3,
      stream: true,
      magus: { tokens: true, ...(resume ? { resume } : {}) },
    }),
  });
  expect(res.status).toBe(200);
  const pieces: Piece[] = [];
  for await (const e of sseMessages(res)) {
    if (e.data === '[DONE]') break;
    const event = JSON.parse(e.data) as { choices: { delta: { content?: string }; logprobs: unknown }[]; magus?: { tokens: number[] } };
    const c = event.choices[0];
    if (c?.delta.content) pieces.push({ text: c.delta.content, tokens: event.magus?.tokens ?? [], logprobs: c.logprobs });
  }
  return pieces;
}

const PROMPT = 'Tell me a story about a small boat.';

test('an answer continued from 120 tokens, and its prompt read again from what its slot kept, go on as the undisturbed answer to the bit', async () => {
  const whole = await answer(PROMPT);
  // Every piece says its tokens; the premise: long enough to be cut after 120 of them.
  const tokens = whole.flatMap((p) => p.tokens);
  expect(tokens.length).toBeGreaterThan(150);
  let cut = 0;
  for (let said = 0; said < 120; cut++) said += whole[cut]!.tokens.length;
  const sent = whole.slice(0, cut);
  const rest = await answer(PROMPT, { tokens: sent.flatMap((p) => p.tokens), text: sent.map((p) => p.text).join('') });
  // Log-probabilities as numbers: equal only if every logit was computed alike.
  expect(rest).toEqual(whole.slice(cut));
  // The slot that continued it is the one that holds the prompt now (evaluated with the 120 tokens, in one go before).
  const again = await answer(PROMPT);
  expect(again).toEqual(whole);
}, 120_000);

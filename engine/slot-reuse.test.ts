/**
 * A slot taken by another conversation while the engine's other slots generate, on the real
 * engine (`magus engine`, SmolLM2-135M-Instruct, dev's demo model): its answer starts while they
 * are still generating. What the slot held must be erased first, which needs node-llama-cpp's
 * context lock, and its batch loop keeps that lock for as long as any sequence has a decode
 * queued — with two sequences generating, to the end of their answers (engine/decode.ts
 * `Erasures`: 3.6–3.8 s of waiting for the first token on this machine, against ~50 ms now).
 */
import { startLlamaCppEngine, type LlamaCppEngine } from '../activities/runtime/llama-cpp';
import { sseMessages } from '../test/harness/sse-stream';
import { demoModelFile } from '../workers/dev/demo-model';

const SLOTS = 3;
const LONG = 300;
let engine: LlamaCppEngine;

beforeAll(async () => {
  const gguf = await demoModelFile(() => undefined);
  engine = await startLlamaCppEngine(gguf, { modelId: 'smol', slots: SLOTS, threads: 1, ctx: 1024, startTimeoutSec: 60, name: 'engine', log: () => undefined });
}, 120_000);

afterAll(async () => {
  await engine?.process.stop(1000);
});

/** Streams a greedy answer to `content`; `onPiece` hears the count of pieces with text so far. */
async function stream(content: string, maxTokens: number, onPiece?: (pieces: number) => void): Promise<number> {
  const res = await fetch(`${engine.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ messages: [{ role: 'user', content }], max_tokens: maxTokens, temperature: 0, stream: true }),
  });
  expect(res.status).toBe(200);
  let pieces = 0;
  for await (const e of sseMessages(res)) {
    if (e.data === '[DONE]') break;
    const content = (JSON.parse(e.data) as { choices: { delta: { content?: string } }[] }).choices[0]?.delta.content;
    if (content) onPiece?.(++pieces);
  }
  return pieces;
}

test('a conversation that takes a slot another one held starts while two others generate, not once they stop', async () => {
  // Every slot holds a conversation of its own: whichever the next one takes must be erased.
  await Promise.all(Array.from({ length: SLOTS }, (_, i) => stream(`Warm-up conversation number ${i}, about apples and pears.`, 4)));
  const said = [0, 0];
  let twentySaid!: () => void;
  const underway = new Promise<void>((resolve) => (twentySaid = resolve));
  const long = ['a boat', 'a horse'].map((about, i) =>
    stream(`Tell me a long story about ${about}.`, LONG, (n) => {
      said[i] = n;
      if (i === 0 && n === 20) twentySaid();
    }),
  );
  await underway;
  let saidThen: number[] = [];
  const other = await stream('Something else entirely: list some colours.', 8, (n) => {
    if (n === 1) saidThen = [...said];
  });
  const [a, b] = await Promise.all(long);
  expect(other).toBeGreaterThan(0);
  // The premise: both went on well past the moment (they did not stop at once on their own).
  expect(Math.min(a!, b!)).toBeGreaterThan(150);
  // Its first piece came while they were still early in their answers.
  expect(Math.max(...saidThen)).toBeLessThan(100);
}, 60_000);

/**
 * Streams a long answer and, once it is under way, has `prompts` other conversations' prompts of
 * ~800 tokens each (13 batches) evaluated beside it: the count of the answer's pieces meanwhile.
 * Each call's prompts are its own (they name `about`): none is cached in a slot.
 */
async function piecesBeside(prompts: number, about: string): Promise<number> {
  let said = 0;
  let twentySaid!: () => void;
  const underway = new Promise<void>((resolve) => (twentySaid = resolve));
  const long = stream(`Tell me a long story about ${about}.`, LONG, (n) => {
    said = n;
    if (n === 20) twentySaid();
  });
  try {
    await underway;
    const before = said;
    const answered = await Promise.all(
      Array.from({ length: prompts }, async (_, p) => {
        const words = Array.from({ length: 130 }, (_, i) => `w${(i + 7 * p) % 89}x${i}`).join(' ');
        const res = await fetch(`${engine.url}/v1/chat/completions`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify({ messages: [{ role: 'user', content: `Summarise (${about}, ${p}): ${words}` }], max_tokens: 1, temperature: 0 }),
        });
        const body = (await res.json()) as { usage: { prompt_tokens: number } };
        expect(res.status).toBe(200);
        return body.usage.prompt_tokens;
      }),
    );
    const after = said;
    for (const tokens of answered) expect(tokens).toBeGreaterThan(700);
    // The premise: it was still generating when the prompts' answers came.
    expect(after).toBeLessThan(LONG);
    return after - before;
  } finally {
    await long; // before the engine stops, however this ends
  }
}

test("an answer goes on while another conversation's long prompt is evaluated beside it, a token between each of the prompt's pieces", async () => {
  // One piece of the answer (at least) for most of the prompt's 13 pieces; with the prompt in
  // pieces of 512 it said 2–4 in all, silent for the whole evaluation.
  expect(await piecesBeside(1, 'a lighthouse')).toBeGreaterThanOrEqual(8);
}, 60_000);

test('beside two long prompts an answer takes a token in every batch, not every other one', async () => {
  // 26 batches of the two prompts: in each a piece of both (decode.ts `BatchShares`) and a token
  // of the answer. With pieces of a whole batch each, the answer got 13–14 (the batch after one
  // prompt's piece was the other's alone).
  expect(await piecesBeside(2, 'a windmill')).toBeGreaterThanOrEqual(20);
}, 90_000);

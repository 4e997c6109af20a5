/**
 * `npm run bench:prompts-beside`: how an answer streams while other conversations' long prompts
 * are evaluated beside it on the same engine (engine/decode.ts `BatchShares`). A real `magus
 * engine` (SmolLM2-135M-Instruct, dev's demo model; 6 slots, 2 threads) streams a greedy answer
 * of up to 400 tokens; once 20 of its pieces are out, 1, 2 and then 3 prompts of ~1,700 tokens
 * each are asked at once (each answered with one token). Reported per count: the prompts' times,
 * the answer's pieces while they were evaluated, and its longest silence between them.
 * `PROMPTS_BESIDE_WORDS` sets the prompts' length (260 words: ~1,700 tokens).
 */
import { startLlamaCppEngine, type LlamaCppEngine } from '../activities/runtime/llama-cpp';
import { sseMessages } from '../test/harness/sse-stream';
import { demoModelFile } from '../workers/dev/demo-model';

const WORDS = Number(process.env.PROMPTS_BESIDE_WORDS ?? 260);

/** The answer's piece times while `prompts` long prompts are evaluated beside it, and theirs. */
async function beside(engine: LlamaCppEngine, prompts: number): Promise<string> {
  const pieces: number[] = [];
  let underway!: () => void;
  const twenty = new Promise<void>((resolve) => (underway = resolve));
  const answer = (async () => {
    const res = await fetch(`${engine.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({
        messages: [{ role: 'user', content: 'Tell me a long story about a lighthouse.' }],
        max_tokens: 400,
        temperature: 0,
        stream: true,
      }),
    });
    for await (const e of sseMessages(res)) {
      if (e.data === '[DONE]') break;
      const content = (JSON.parse(e.data) as { choices: { delta: { content?: string } }[] }).choices[0]?.delta.content;
      if (!content) continue;
      pieces.push(Date.now());
      if (pieces.length === 20) underway();
    }
  })();
  await twenty;
  const from = Date.now();
  const asked = await Promise.all(
    Array.from({ length: prompts }, async (_, p) => {
      // Each prompt its own (the count and `p` in it): none is cached in a slot.
      const words = Array.from({ length: WORDS }, (_, i) => `w${(i * 7 + p) % 89}x${i}`).join(' ');
      const start = Date.now();
      const res = await fetch(`${engine.url}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ messages: [{ role: 'user', content: `Summarise (${prompts}, ${p}): ${words}` }], max_tokens: 1, temperature: 0 }),
      });
      if (res.status !== 200) throw new Error(`a prompt was refused: ${res.status} ${await res.text()}`);
      const body = (await res.json()) as { usage: { prompt_tokens: number } };
      return `${body.usage.prompt_tokens} tokens in ${((Date.now() - start) / 1000).toFixed(1)} s`;
    }),
  );
  const to = Date.now();
  await answer;
  const during = pieces.filter((t) => t >= from && t <= to);
  const times = [from, ...during, to];
  let longest = 0;
  for (let i = 1; i < times.length; i++) longest = Math.max(longest, times[i]! - times[i - 1]!);
  return `${prompts} prompt(s) beside the answer (${asked.join(', ')}): ${during.length} of its pieces meanwhile, longest silence ${(longest / 1000).toFixed(2)} s`;
}

async function main(): Promise<void> {
  const gguf = await demoModelFile((line) => console.log(line));
  const engine = await startLlamaCppEngine(gguf, {
    modelId: 'smol',
    slots: 6,
    threads: 2,
    ctx: 8192,
    startTimeoutSec: 60,
    name: 'engine',
    log: () => undefined,
  });
  try {
    for (const prompts of [1, 2, 3]) console.log(await beside(engine, prompts));
  } finally {
    await engine.process.stop(1000);
  }
}

main().catch((err: unknown) => {
  console.error(err);
  process.exit(1);
});

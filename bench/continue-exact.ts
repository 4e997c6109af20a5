/**
 * `npm run bench:continue-exact`: whether an answer continued from its tokens so far (`magus.resume`,
 * what a moved answer's new attempt asks: shared/continuation.ts) is the answer an undisturbed run
 * gives — alone on the engine, and beside others evaluated at the same time.
 *
 * One `magus engine` (SmolLM2-135M-Instruct Q4_1, the demo model; 4 slots + 2 resume sequences, 1
 * thread, as bench:chaos runs them). For each of bench:chaos's six prompts and each round: the
 * greedy answer of 64 tokens alone (the reference), then continuations of it after 10, 20, 40 and
 * 60 of its tokens — (a) one at a time, (b) the four at once — and (c) the six prompts' fresh
 * answers four at once. Reported: how many equal the reference, and where the others first differ.
 * Then what evaluating prompts exactly costs (engine/llama.ts `EXACT_BATCH`): a prompt of ~590
 * tokens answered cold, alone, each round another (one word differs): its time to the first piece
 * and the prompt's tokens per second. `BENCH_ROUNDS` (default 3), `BENCH_THREADS` (default 1).
 */
import { cpus, loadavg } from 'node:os';
import { startLlamaCppEngine } from '../activities/runtime/llama-cpp';
import { sseMessages } from '../test/harness/sse-stream';
import { commonPrefix } from '../test/harness/timed-stream';
import { demoModelFile } from '../workers/dev/demo-model';

const ROUNDS = Number(process.env.BENCH_ROUNDS ?? '3');
const THREADS = Number(process.env.BENCH_THREADS ?? '1');
const PROMPTS = ['a small boat', 'a red fox', 'the northern sea', 'an old lamp', 'the green hills', 'a quiet town'].map((p) => `Tell me a story about ${p}.`);
const CUTS = [10, 20, 40, 60];
const TOKENS = 64;

interface Streamed {
  text: string;
  /** The text each token began (the engine's pieces, one token each here, or the tokens they carry). */
  pieces: { text: string; tokens: number[] }[];
}

async function ask(url: string, prompt: string, resume?: { tokens: number[]; text: string }): Promise<Streamed> {
  const res = await fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({
      model: 'smollm2',
      messages: [{ role: 'user', content: prompt }],
      max_tokens: TOKENS,
      temperature: 0,
      stream: true,
      magus: { tokens: true, ...(resume ? { resume } : {}) },
    }),
  });
  if (res.status !== 200) throw new Error(`the engine answered ${res.status}: ${await res.text()}`);
  const out: Streamed = { text: '', pieces: [] };
  for await (const e of sseMessages(res)) {
    if (e.data === '[DONE]') continue;
    const chunk = JSON.parse(e.data) as {
      error?: unknown;
      choices?: { delta?: { content?: string } }[];
      magus?: { tokens?: number[] };
    };
    if (chunk.error) throw new Error(`an error event: ${JSON.stringify(chunk.error)}`);
    const text = chunk.choices?.[0]?.delta?.content ?? '';
    if (text === '' && !chunk.magus?.tokens) continue;
    out.text += text;
    out.pieces.push({ text, tokens: chunk.magus?.tokens ?? [] });
  }
  return out;
}

/** The reference's first `cut` tokens and the text the pieces carrying them said: what a move hands on. */
function said(reference: Streamed, cut: number): { tokens: number[]; text: string } {
  const tokens: number[] = [];
  let text = '';
  for (const p of reference.pieces) {
    if (tokens.length >= cut) break;
    tokens.push(...p.tokens);
    text += p.text;
  }
  return { tokens, text };
}

interface Tally {
  equal: number;
  all: number;
  differ: string[];
}
const tally = (): Tally => ({ equal: 0, all: 0, differ: [] });
function count(t: Tally, got: string, want: string, what: string): void {
  t.all++;
  if (got === want) t.equal++;
  else t.differ.push(`${what} at ${commonPrefix(got, want)}`);
}

/** A cold prompt of ~590 tokens (round `n`'s own, so no slot holds it): ms to its first piece, and its tokens. */
async function prefill(url: string, n: number): Promise<{ ms: number; tokens: number }> {
  const content = `${`The harbour master counted the fishing boats that came in with the evening tide, one by one, round ${n}. `.repeat(30)}Now tell me a story.`;
  const started = performance.now();
  const res = await fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({
      model: 'smollm2',
      messages: [{ role: 'user', content }],
      max_tokens: 1,
      temperature: 0,
      stream: true,
      stream_options: { include_usage: true },
    }),
  });
  if (res.status !== 200) throw new Error(`the engine answered ${res.status}: ${await res.text()}`);
  let ms: number | undefined;
  let tokens = 0;
  for await (const e of sseMessages(res)) {
    if (e.data === '[DONE]') continue;
    const chunk = JSON.parse(e.data) as { choices?: { delta?: { content?: string } }[]; usage?: { prompt_tokens: number } };
    if (ms === undefined && chunk.choices?.[0]?.delta?.content) ms = performance.now() - started;
    if (chunk.usage) tokens = chunk.usage.prompt_tokens;
  }
  return { ms: ms ?? performance.now() - started, tokens };
}

async function main(): Promise<void> {
  console.log(`bench:continue-exact: ${ROUNDS} rounds × ${PROMPTS.length} prompts, cuts ${CUTS.join('/')} of ${TOKENS} tokens; ${cpus().length} cores`);
  const model = await demoModelFile((line) => console.log(line));
  const engine = await startLlamaCppEngine(model, {
    modelId: 'smollm2',
    slots: 4,
    resumeSlots: 2,
    threads: THREADS,
    ctx: 4096,
    startTimeoutSec: 120,
    name: 'engine',
    log: () => undefined,
  });
  const alone = tally();
  const together = tally();
  const fresh = tally();
  const prefills: { ms: number; tokens: number }[] = [];
  try {
    for (let round = 0; round < ROUNDS; round++) {
      const references: Streamed[] = [];
      for (const prompt of PROMPTS) references.push(await ask(engine.url, prompt));
      for (const [p, prompt] of PROMPTS.entries()) {
        const ref = references[p]!;
        for (const cut of CUTS) {
          const s = said(ref, cut);
          count(alone, s.text + (await ask(engine.url, prompt, s)).text, ref.text, `p${p}/${cut}`);
        }
        const four = await Promise.all(
          CUTS.map(async (cut) => {
            const s = said(ref, cut);
            return { cut, s, got: await ask(engine.url, prompt, s) };
          }),
        );
        for (const { cut, s, got } of four) count(together, s.text + got.text, ref.text, `p${p}/${cut}`);
      }
      for (let first = 0; first < PROMPTS.length; first += 2) {
        const ps = [0, 1, 2, 3].map((i) => (first + i) % PROMPTS.length);
        const answers = await Promise.all(ps.map((p) => ask(engine.url, PROMPTS[p]!)));
        ps.forEach((p, i) => count(fresh, answers[i]!.text, references[p]!.text, `p${p}`));
      }
      prefills.push(await prefill(engine.url, round));
      console.log(
        `round ${round + 1}: continuations alone ${alone.equal}/${alone.all} equal, four at once ${together.equal}/${together.all}, fresh four at once ${fresh.equal}/${fresh.all}`,
      );
    }
  } finally {
    await engine.process.stop(5000);
  }
  const line = (what: string, t: Tally) =>
    `${what}: ${t.equal} of ${t.all} equal the undisturbed answer${t.differ.length ? ` (differ: ${t.differ.join(', ')})` : ''}`;
  console.log(
    `\nbench:continue-exact — ${cpus().length} cores, load average ${loadavg()
      .map((l) => l.toFixed(1))
      .join(' ')}, ${THREADS} thread(s)`,
  );
  console.log(line('continuations, one at a time', alone));
  console.log(line('continuations, four at once', together));
  console.log(line('fresh answers, four at once', fresh));
  const ms = prefills.map((p) => p.ms).sort((a, b) => a - b);
  const median = ms[Math.floor(ms.length / 2)]!;
  console.log(
    `a cold prompt of ${prefills[0]?.tokens} tokens: first piece after ${ms.map((m) => m.toFixed(0)).join(' / ')} ms (median ${median.toFixed(0)} ms, ${((prefills[0]!.tokens / median) * 1000).toFixed(0)} prompt tokens/s)`,
  );
}

main().then(
  () => process.exit(0),
  (err: unknown) => {
    console.error(err);
    process.exit(1);
  },
);

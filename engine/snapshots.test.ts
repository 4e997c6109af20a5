/**
 * An engine killed mid-answer, and the engine that follows it with the same `--snapshots`
 * directory (as a standby or a restarted container does): the answer's resume loads the dead
 * engine's snapshot of its slot — the prompt and the answer up to its last save — and evaluates
 * only the rest, and goes on exactly as the undisturbed answer (tokens and log-probabilities, to
 * the bit: engine/exact.test.ts says why they can).
 */
import { mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startLlamaCppEngine, type EngineStart, type LlamaCppEngine } from '../activities/runtime/llama-cpp';
import { sseMessages } from '../test/harness/sse-stream';
import { demoModelFile } from '../workers/dev/demo-model';
import { until } from '../test/harness/wait';
import { EVERY, MIN_GAIN, RESUME_MIN_GAIN, STOP_MIN } from './snapshots';

let gguf: string;
let dir: string;
const dirs: string[] = [];
const engines: LlamaCppEngine[] = [];

beforeAll(async () => {
  gguf = await demoModelFile(() => undefined);
  dir = mkdtempSync(join(tmpdir(), 'magus-snapshots-'));
}, 120_000);

afterAll(async () => {
  await Promise.all(engines.map((e) => e.process.stop(1000)));
  for (const d of [dir, ...dirs]) rmSync(d, { recursive: true, force: true });
});

const start = async (snapshots: string | undefined = dir, slots: Pick<EngineStart, 'slots' | 'resumeSlots'> = { slots: 2 }): Promise<LlamaCppEngine> => {
  const opts: EngineStart = {
    modelId: 'smol',
    ...slots,
    threads: 1,
    ctx: 1024,
    ...(snapshots ? { snapshots } : {}),
    startTimeoutSec: 60,
    name: 'engine',
    log: () => undefined,
  };
  const e = await startLlamaCppEngine(gguf, opts);
  engines.push(e);
  return e;
};

interface Piece {
  text: string;
  tokens: number[];
  logprobs: unknown;
}

interface Usage {
  prompt_tokens: number;
  prompt_tokens_details: { cached_tokens: number };
}

const PROMPT = 'Tell me a story about a small boat.';
/** Another conversation's, sharing with {@link PROMPT} fewer tokens than a snapshot's load asks for. */
const COLOURS = 'Name three colours.';

/** A streamed greedy answer, read as a bridge reads it; `each` sees every piece as it comes (and may stop the reading). */
async function answer(
  engine: LlamaCppEngine,
  resume?: { tokens: number[]; text: string },
  each?: (pieces: Piece[]) => boolean,
  prompt = PROMPT,
): Promise<{ pieces: Piece[]; usage?: Usage }> {
  const client = new AbortController();
  const res = await fetch(`${engine.url}/v1/chat/completions`, {
    signal: client.signal,
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({
      messages: [{ role: 'user', content: prompt }],
      max_tokens: 240,
      temperature: 0,
      logprobs: true,
      top_logprobs: 3,
      stream: true,
      stream_options: { include_usage: true },
      magus: { tokens: true, ...(resume ? { resume } : {}) },
    }),
  });
  expect(res.status).toBe(200);
  const pieces: Piece[] = [];
  let usage: Usage | undefined;
  try {
    for await (const e of sseMessages(res)) {
      if (e.data === '[DONE]') break;
      const event = JSON.parse(e.data) as { choices: { delta: { content?: string }; logprobs: unknown }[]; magus?: { tokens: number[] }; usage?: Usage };
      if (event.usage) usage = event.usage;
      const c = event.choices[0];
      if (c?.delta.content) {
        pieces.push({ text: c.delta.content, tokens: event.magus?.tokens ?? [], logprobs: c.logprobs });
        if (each?.(pieces) === false) {
          client.abort(); // the client gone: its engine stops the answer
          break;
        }
      }
    }
  } catch (err) {
    if (!each) throw err; // the engine killed under the reading
  }
  return { pieces, ...(usage ? { usage } : {}) };
}

async function metric(engine: LlamaCppEngine, name: string): Promise<number> {
  const text = await (await fetch(`${engine.url}/metrics`)).text();
  const line = text.split('\n').find((l) => l.startsWith(`${name} `));
  if (!line) throw new Error(`no ${name} in the engine's metrics`);
  return Number(line.split(' ')[1]);
}

const tokensOf = (pieces: Piece[]) => pieces.reduce((n, p) => n + p.tokens.length, 0);

test('an engine killed 120 tokens into an answer: the next one loads its snapshot, evaluates only what followed it, and goes on to the bit', async () => {
  // The undisturbed answer, from an engine that keeps no snapshots.
  const whole = await answer(await start(undefined));
  expect(tokensOf(whole.pieces)).toBeGreaterThan(180);
  const promptTokens = whole.usage!.prompt_tokens;

  // The same answer from one that does, SIGKILLed once 120 of its tokens are read.
  const first = await start();
  const cut = await answer(first, undefined, (pieces) => {
    if (tokensOf(pieces) < 120) return true;
    first.process.child.kill('SIGKILL');
    return false;
  });
  await first.process.exited;
  const sent = cut.pieces;
  expect(tokensOf(sent)).toBeGreaterThanOrEqual(120);
  // Its snapshots stay for the next engine, readable by this user alone (they hold the conversation).
  const files = readdirSync(dir, { recursive: true }).map(String);
  expect(files.some((f) => f.endsWith('.kv'))).toBe(true);
  const dirs = files.map((f) => statSync(join(dir, f))).filter((st) => st.isDirectory());
  expect(dirs.length).toBeGreaterThanOrEqual(2); // the model's, the process's
  for (const st of dirs) expect(st.mode & 0o077).toBe(0);

  const next = await start();
  const said = tokensOf(sent);
  const rest = await answer(next, { tokens: sent.flatMap((p) => p.tokens), text: sent.map((p) => p.text).join('') });
  // Exactly the undisturbed answer's rest: same tokens, same log-probabilities.
  expect(rest.pieces).toEqual(whole.pieces.slice(sent.length));
  expect(rest.usage?.prompt_tokens_details.cached_tokens).toBe(promptTokens);
  // What it loaded: the prompt and the answer up to the dead engine's last save before the cut (at most EVERY tokens, or a tenth, back).
  expect(await metric(next, 'magus_engine_snapshots_loaded_total')).toBe(1);
  const loaded = await metric(next, 'magus_engine_snapshot_tokens_loaded_total');
  expect(loaded).toBeGreaterThanOrEqual(promptTokens + said - EVERY);
  expect(loaded).toBeLessThanOrEqual(promptTokens + said - 1);
  expect(await metric(next, 'magus_engine_snapshot_failures_total')).toBe(0);
}, 180_000);

test('an answer its client cuts at 60 tokens (a drain handing it back) is saved as it stops, and another live engine sharing the directory goes on from it, to the bit', async () => {
  const whole = await answer(await start(undefined));
  const promptTokens = whole.usage!.prompt_tokens;
  // A directory of their own: the test above left the same answer's snapshots in its.
  const shared = mkdtempSync(join(tmpdir(), 'magus-snapshots-'));
  dirs.push(shared);
  const [draining, other] = [await start(shared), await start(shared)];
  const cut = await answer(draining, undefined, (pieces) => tokensOf(pieces) < 60);
  const sent = cut.pieces;
  const said = tokensOf(sent);
  // Its generation stopped (and was saved, before it ended).
  await until('the cut answer stopped', async () => (await metric(draining, 'magus_engine_requests_in_flight')) === 0);
  const rest = await answer(other, { tokens: sent.flatMap((p) => p.tokens), text: sent.map((p) => p.text).join('') });
  expect(rest.pieces).toEqual(whole.pieces.slice(sent.length));
  // The prompt and the tokens said, all but the last few at most (saved when the cut came, not up to EVERY before).
  expect(await metric(other, 'magus_engine_snapshots_loaded_total')).toBe(1);
  const loaded = await metric(other, 'magus_engine_snapshot_tokens_loaded_total');
  expect(loaded).toBeGreaterThanOrEqual(promptTokens + said - STOP_MIN);
  expect(loaded).toBeLessThanOrEqual(promptTokens + said - 1);
}, 180_000);

test("an answer resumed one token in, its prompt shorter than a fresh request's load asks, loads a snapshot sharing it all (what a standby taking a dead engine's answers meets)", async () => {
  const whole = await answer(await start(undefined));
  const promptTokens = whole.usage!.prompt_tokens;
  // The case: what the resume evaluates again is under MIN_GAIN, over RESUME_MIN_GAIN.
  expect(promptTokens).toBeLessThan(MIN_GAIN);
  expect(promptTokens).toBeGreaterThanOrEqual(RESUME_MIN_GAIN);
  const shared = mkdtempSync(join(tmpdir(), 'magus-snapshots-'));
  dirs.push(shared);
  // Another engine in the directory answered the same prompt (its slot saved as it generated).
  const [other, next] = [await start(shared), await start(shared)];
  expect((await answer(other)).pieces).toEqual(whole.pieces);
  const sent = whole.pieces.slice(0, 1);
  const rest = await answer(next, { tokens: sent.flatMap((p) => p.tokens), text: sent[0]!.text });
  expect(rest.pieces).toEqual(whole.pieces.slice(1));
  // It loaded the prompt and the token said but the last (whose logits choose the next), and evaluated only that one.
  expect(await metric(next, 'magus_engine_snapshots_loaded_total')).toBe(1);
  expect(await metric(next, 'magus_engine_snapshot_tokens_loaded_total')).toBe(promptTokens + tokensOf(sent) - 1);
  // A fresh request for the same prompt on a fresh engine does not: what it would spare is under MIN_GAIN.
  const fresh = await start(shared);
  expect((await answer(fresh)).pieces).toEqual(whole.pieces);
  expect(await metric(fresh, 'magus_engine_snapshots_loaded_total')).toBe(0);
}, 180_000);

test("a snapshot llama.cpp will not load (another version's) is not loaded over what the slot holds: the answer is evaluated again, right", async () => {
  const plain = await start(undefined);
  const whole = await answer(plain);
  const colours = await answer(plain, undefined, undefined, COLOURS);
  const shared = mkdtempSync(join(tmpdir(), 'magus-snapshots-'));
  dirs.push(shared);
  // An engine that answered, and died: its snapshots stay, and are then made another version's
  // (llama.cpp reads the version before anything else, and refuses the file there).
  const dead = await start(shared);
  await answer(dead);
  dead.process.child.kill('SIGKILL');
  await dead.process.exited;
  const files = readdirSync(shared, { recursive: true })
    .map(String)
    .filter((f) => f.endsWith('.kv'));
  expect(files.length).toBeGreaterThan(0);
  for (const f of files) {
    const bytes = readFileSync(join(shared, f));
    bytes.writeUInt32LE(bytes.readUInt32LE(4) + 100, 4);
    writeFileSync(join(shared, f), bytes);
  }
  // One slot, holding another conversation when the resume comes.
  const engine = await start(shared, { slots: 1, resumeSlots: 0 });
  expect((await answer(engine, undefined, undefined, COLOURS)).pieces).toEqual(colours.pieces);
  const resumeOf = (pieces: Piece[]) => ({ tokens: pieces.flatMap((p) => p.tokens), text: pieces.map((p) => p.text).join('') });
  // A load refused there once left the KV in place while the sequence counted none, and the
  // evaluation after it failed ("inconsistent sequence positions"), with it every answer in its batch.
  const sent = whole.pieces.slice(0, 60);
  const rest = await answer(engine, resumeOf(sent));
  expect(rest.pieces).toEqual(whole.pieces.slice(sent.length));
  expect(await metric(engine, 'magus_engine_snapshot_failures_total')).toBe(1);
  expect(await metric(engine, 'magus_engine_snapshots_loaded_total')).toBe(0);
}, 180_000);

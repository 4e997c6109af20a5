/**
 * magus's own token loop, for what node-llama-cpp's `LlamaChat` and `LlamaCompletion` keep to
 * themselves: each sampled token, its log-probability and its most likely alternatives. It serves
 * raw-text completions (always: their usage then counts exactly the tokens sampled), plain chat,
 * and chat with a response format (a grammar; with or without log-probabilities).
 *
 * Each step evaluates the last token (`controlledEvaluate`) and samples the next one natively.
 * With log-probabilities it asks instead for the model's own logits — before temperature, which
 * node-llama-cpp would apply to them — of the {@link SAMPLE_TOP_K} most likely tokens and the
 * softmax's normaliser, reports them as OpenAI does (whatever the sampling settings), and draws
 * the token itself from those candidates with the request's temperature and top-p, as llama.cpp's
 * default top-k sampling would.
 *
 * With a grammar and no log-probabilities each step samples natively with the grammar's state
 * (node-llama-cpp's `evaluate`, one token): llama.cpp draws from the whole vocabulary and keeps
 * the token if the grammar allows it, otherwise masks the vocabulary by the grammar and draws
 * again, and the grammar takes the token — a free answer's cost while the model keeps to it.
 * With log-probabilities too, every step asks for the model's logits of its {@link GRAMMAR_TOP}
 * most likely tokens (and the end-of-generation ones) and keeps, most likely first, those the
 * grammar allows next, until it has as many as the draw takes from (1 when greedy): the draw is
 * from the top-k of what the grammar allows. Only when none of them is allowed is the last token
 * evaluated again for the logits of the whole vocabulary. Log-probabilities are the model's before
 * the grammar's mask (a token the grammar forbade can be among the alternatives, as OpenAI
 * reports them).
 */
import { randomInt } from 'node:crypto';
import type { ControlledEvaluateInputItem, LlamaContextSequence, LlamaGrammarEvaluationState, LlamaModel, Token, TokenBias } from 'node-llama-cpp' with {
  'resolution-mode': 'import',
};
import type { TokenChoice, TokenLogprob } from './api';
import { sharedPrefix, type KvSnapshots } from './snapshots';

/** The fewest tokens of a prompt handed to the context at a time ({@link BatchShares.piece}). */
const MIN_PIECE = 8;
/** Candidates a token is drawn from when log-probabilities are wanted (llama.cpp's default top-k). */
export const SAMPLE_TOP_K = 40;
/** Tokens a grammar's step looks through before it asks for the whole vocabulary's logits. */
export const GRAMMAR_TOP = 64;

/**
 * A grammar's state over the answer's tokens (engine/llama.ts makes it from llama.cpp's): the state
 * node-llama-cpp samples with, whether a token may come next, and taking one. Partial UTF-8 across
 * tokens is the grammar's business.
 */
export interface TokenGrammar {
  state: LlamaGrammarEvaluationState;
  /** Tokens never drawn under the grammar (control tokens: their text would match it, and is then dropped from the answer). */
  bias?: TokenBias;
  allows(token: Token): boolean;
  accept(token: Token): void;
}

/**
 * The erasures of one context's sequences. Erasing part of a sequence's cache (a slot taken by
 * another conversation, a resume that differs from what the slot holds) needs node-llama-cpp's
 * context lock, which its batch loop keeps for as long as any sequence has a decode queued — and
 * with several sequences generating out of step one always has: under bench:chaos an erase
 * waited 1.8–2.3 s, and the answer with it. While an erasure waits, the other sequences hold
 * their next step ({@link beforeStep}): the loop ends with the batch it is decoding, the erasure
 * takes the lock, and they go on — a pause of one batch for them.
 */
export class Erasures {
  private waiting = 0;
  private done: Promise<void> | undefined;
  private release: (() => void) | undefined;

  /** Runs `erase` (which takes the context lock) with the other sequences held before their next step. */
  async run<T>(erase: () => Promise<T>): Promise<T> {
    if (this.waiting++ === 0) this.done = new Promise((resolve) => (this.release = resolve));
    try {
      return await erase();
    } finally {
      if (--this.waiting === 0) {
        this.release?.();
        this.done = undefined;
      }
    }
  }

  /** Before a sequence evaluates: resolves once no erasure waits (undefined: none waits now). */
  beforeStep(): Promise<void> | undefined {
    return this.done;
  }
}

/**
 * How one context's batches are shared between its sequences: a prompt goes to the context in
 * pieces (each a look at the request's abort signal) sized so that every prompt being evaluated
 * and one token of every generating sequence fit in one batch (llama.ts `EXACT_BATCH`).
 *
 * node-llama-cpp's batch loop goes on while any decode is queued, and a generating sequence
 * queues its next token only a few steps after the batch with its last one — after the loop has
 * looked for what comes next. So whenever the queued prompt tokens overflow a batch, the next
 * batch is theirs alone and the answers beside them skip it: with pieces of 512 tokens an answer
 * beside a 588-token prompt fell silent 2.9 s; with pieces of one batch (63) it took every other
 * batch beside two prompts, every third beside three (longest silence 1.29 and 2.51 s). With
 * shares nothing overflows: the batch ends, every sequence queues again, and the next batch takes
 * them all (0.91 and 1.02 s, the prompts as fast: `npm run bench:prompts-beside`).
 */
export class BatchShares {
  /** What each sequence with a request does now: evaluates a prompt (`resume`: a resumed answer's), or generates. */
  private readonly doing = new Map<LlamaContextSequence, Doing>();
  /** Prompts waiting for the resumed answers' prompts to be evaluated ({@link turn}). */
  private waiting: (() => void)[] = [];

  constructor(private readonly batch: number) {}

  /**
   * Tokens of a prompt's next piece: an even share of a batch after a token for each generating
   * sequence — among the resumed answers' prompts while there are any (the others wait: {@link turn}).
   */
  piece(): number {
    const prompts = this.count('resume') || this.count('prompt');
    return Math.max(MIN_PIECE, Math.floor((this.batch - this.count('generate')) / Math.max(1, prompts)));
  }

  /**
   * Before a prompt's next piece. While a resumed answer's prompt is evaluated (its client holds
   * part of the answer and hears nothing until it is: an instance was lost mid-answer), another
   * prompt waits, so the batches are the resumed ones' and the generating sequences' — a new
   * instance that took answers handed back at a drain beside first turns gave them their next
   * piece only after every prompt's, 2 s later. While any sequence generates: a turn of the event
   * loop, so the piece is queued after the batch loop has looked for more work and ended, and the
   * batch that takes it takes the generating sequences' next tokens too (queued meanwhile). Queued
   * at once, the piece kept the loop going without them.
   */
  turn(sequence: LlamaContextSequence): Promise<void> | undefined {
    if (this.doing.get(sequence) === 'prompt' && this.count('resume') > 0)
      return new Promise<void>((resolve) => this.waiting.push(resolve)).then(() => this.turn(sequence));
    return this.count('generate') > 0 ? new Promise((resolve) => setImmediate(resolve)) : undefined;
  }

  /** `sequence` evaluates its request's prompt (a resumed answer's: `resume`), or generates its answer, from now on. */
  now(sequence: LlamaContextSequence, what: Doing): void {
    this.doing.set(sequence, what);
    this.release();
  }

  /** `sequence`'s request ended. */
  end(sequence: LlamaContextSequence): void {
    this.doing.delete(sequence);
    this.release();
  }

  /** The prompts that wait go on once no resumed answer's prompt is evaluated. */
  private release(): void {
    if (this.waiting.length === 0 || this.count('resume') > 0) return;
    const waiting = this.waiting;
    this.waiting = [];
    for (const go of waiting) go();
  }

  private count(what: Doing): number {
    let n = 0;
    for (const w of this.doing.values()) if (w === what) n++;
    return n;
  }
}

type Doing = 'prompt' | 'resume' | 'generate';

export interface DecodeOptions {
  maxTokens: number;
  /** 0 = greedy. */
  temperature: number;
  topP: number;
  /** 0 = off; absent = node-llama-cpp's default (40). With log-probabilities at most {@link SAMPLE_TOP_K} candidates are drawn from. */
  topK?: number;
  /** 1 = off. */
  repetitionPenalty: number;
  /** Each step samples with a seed derived from this one: a request with a seed is repeatable. */
  seed?: number;
  frequencyPenalty: number;
  presencePenalty: number;
  /** Texts that end the answer; the first one found and what follows it are not returned. */
  stop: readonly string[];
  /** Token sequences that end it too (a chat template's end of turn), not returned. */
  stopTokens?: readonly (readonly Token[])[];
  /** Alternatives per token (0–20); absent = no log-probabilities. */
  topLogprobs?: number;
  signal: AbortSignal;
  /**
   * An earlier attempt's answer so far (shared/continuation.ts): its tokens are evaluated after the
   * prompt and sampling goes on from the next position, so with the same seed the answer is the
   * one an undisturbed run gives; of its text only what follows `text` is sent. The caller has
   * checked that the tokens' text begins with `text` (llama.ts `checkResume`).
   */
  resume?: { tokens: readonly Token[]; text: string };
  /** The answer keeps to this grammar (a response format); a resume's tokens are taken by it first. */
  grammar?: TokenGrammar;
  /** The erasures of the sequence's context ({@link Erasures}). */
  erasures: Erasures;
  /** How the sequence's context shares its batches ({@link BatchShares}). */
  shares: BatchShares;
  /** Where the context's sequences are saved and found again (engine/snapshots.ts); absent: nowhere. */
  snapshots?: KvSnapshots;
  /**
   * Each new piece of the answer, with the log-probabilities of the tokens it completes and the
   * ids of the tokens whose text begins in it (a token spanning two pieces goes with the first):
   * the tokens of the pieces sent, joined, are what a continuation resumes from.
   */
  onText(text: string, logprobs: TokenLogprob[] | undefined, tokens: Token[]): void;
}

export interface Decoded {
  text: string;
  finishReason: 'stop' | 'length';
  /** Tokens sampled, an end-of-generation token and stop texts included. */
  completionTokens: number;
  /** Prompt tokens the sequence already held (not evaluated again). */
  cachedPromptTokens: number;
  logprobs?: TokenLogprob[];
}

/** The index of the first stop text in `text` at or after `from`, or -1. */
function findStop(text: string, stops: readonly string[], from: number): number {
  let at = -1;
  for (const s of stops) {
    const i = text.indexOf(s, from);
    if (i >= 0 && (at < 0 || i < at)) at = i;
  }
  return at;
}

/** How many characters at the end of `text` could begin a stop text (held back until known). */
function stopPrefixAtEnd(text: string, stops: readonly string[]): number {
  let held = 0;
  for (const s of stops) {
    for (let n = Math.min(s.length - 1, text.length); n > held; n--) {
      if (text.endsWith(s.slice(0, n))) {
        held = n;
        break;
      }
    }
  }
  return held;
}

const endsWithTokens = (tokens: readonly Token[], tail: readonly Token[]): boolean =>
  tail.length > 0 && tail.length <= tokens.length && tail.every((t, i) => tokens[tokens.length - tail.length + i] === t);

/** Per-step seeds: one request's steps draw independently, and the same request draws the same. */
const stepSeed = (seed: number, step: number): number => (Math.imul(seed ^ 0x5bd1e995, 0x9e3779b1) + Math.imul(step + 1, 0x85ebca6b)) >>> 0;

/** A uniform draw in [0, 1) from a 32-bit seed (mulberry32's mixing). */
function uniform(seed: number): number {
  let t = (seed + 0x6d2b79f5) >>> 0;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}

/**
 * Draws a token from the first `topK` of `logits` (most likely first): greedy at temperature 0;
 * otherwise softmax at `temperature`, cut to the smallest set whose probability reaches `topP`, and
 * one draw `u`.
 */
export function drawToken(logits: ReadonlyMap<Token, number>, temperature: number, topP: number, u: number, topK = Infinity): Token {
  const entries = [...logits].slice(0, Math.max(1, topK));
  if (entries.length === 0) throw new Error('no candidate tokens');
  if (temperature <= 0) return entries[0]![0];
  const max = entries[0]![1];
  const weights = entries.map(([, l]) => Math.exp((l - max) / temperature));
  const total = weights.reduce((a, b) => a + b, 0);
  let kept = 0;
  let mass = 0;
  while (kept < weights.length && (kept === 0 || mass < topP * total)) mass += weights[kept++]!;
  let r = u * mass;
  for (let i = 0; i < kept; i++) {
    r -= weights[i]!;
    if (r < 0) return entries[i]![0];
  }
  return entries[kept - 1]![0];
}

/** Evaluates `input` and samples the next token with node-llama-cpp's own loop (one step of it). */
async function sampleOne(sequence: LlamaContextSequence, input: Token[], options: Parameters<LlamaContextSequence['evaluate']>[1]): Promise<Token | null> {
  const steps = sequence.evaluate(input, options);
  try {
    const first = await steps.next();
    return first.done ? null : first.value;
  } finally {
    await steps.return();
  }
}

/** Of `logits`, the `n` most likely the grammar allows next, most likely first. */
function allowedOf(logits: ReadonlyMap<Token, number>, grammar: TokenGrammar, n: number): Map<Token, number> {
  const allowed = new Map<Token, number>();
  for (const [t, l] of [...logits].sort((a, b) => b[1] - a[1])) {
    if (allowed.size >= n) break;
    if (grammar.allows(t)) allowed.set(t, l);
  }
  return allowed;
}

/**
 * Continues `prompt` (tokens, the model's BOS included when it takes one) in `sequence`: keeps
 * the longest prefix the sequence already holds, evaluates the rest, and samples until an
 * end-of-generation token, a stop, or `maxTokens`.
 */
export async function decode(model: LlamaModel, sequence: LlamaContextSequence, prompt: readonly Token[], o: DecodeOptions): Promise<Decoded> {
  try {
    return await decodeSteps(model, sequence, prompt, o);
  } finally {
    o.shares.end(sequence);
  }
}

async function decodeSteps(model: LlamaModel, sequence: LlamaContextSequence, prompt: readonly Token[], o: DecodeOptions): Promise<Decoded> {
  const resumed = o.resume?.tokens ?? [];
  const full = resumed.length > 0 ? [...prompt, ...resumed] : prompt;
  // At least the last token is evaluated again: its logits choose the next one.
  const prior = full.slice(0, full.length - 1);
  let keep = sharedPrefix(sequence.contextTokens, prior);
  // A resumed answer has the batches from now (BatchShares.turn): its snapshot's load waits for the context too.
  if (resumed.length > 0) o.shares.now(sequence, 'resume');
  if (o.snapshots && (await o.snapshots.restore(sequence, prior, keep, resumed.length > 0))) keep = sharedPrefix(sequence.contextTokens, prior);
  const { erasures } = o;
  const erase = (start: number) => erasures.run(() => sequence.eraseContextTokenRanges([{ start, end: sequence.nextTokenIndex }]));
  if (keep < sequence.nextTokenIndex) await erase(keep);

  const wantLogprobs = o.topLogprobs !== undefined;
  const grammar = o.grammar;
  if (grammar)
    for (const t of resumed) {
      if (!grammar.allows(t)) throw new Error('the answer to resume does not keep to the grammar');
      grammar.accept(t);
    }
  // Asked along with a grammar's top logits: an end of generation is allowed once the grammar is done.
  const eogTokens = grammar ? [model.tokens.eos, model.tokens.eot].filter((t): t is Token => t != null) : [];
  const describe = (token: Token, logprob: number): TokenChoice => {
    const text = model.detokenize([token], true);
    return { token: text, logprob, bytes: [...Buffer.from(text, 'utf8')] };
  };
  const penalties = o.frequencyPenalty !== 0 || o.presencePenalty !== 0 || o.repetitionPenalty !== 1;
  const longestStop = Math.max(0, ...o.stop.map((s) => s.length));
  // Greedy needs only the most likely token; a top-k below SAMPLE_TOP_K, that many.
  const candidates = o.temperature > 0 ? (o.topK !== undefined && o.topK > 0 ? Math.min(o.topK, SAMPLE_TOP_K) : SAMPLE_TOP_K) : 1;
  // Without a seed, a random one: the steps still draw independently.
  const requestSeed = o.seed ?? randomInt(2 ** 32);
  const sampled: Token[] = [...resumed];
  const answer: Token[] = [...resumed];
  /** Where each token of `answer` begins in `text`, and how many of them went out with a piece. */
  const starts: number[] = resumed.map(() => 0);
  let attached = resumed.length;
  /** Log-probabilities of tokens whose text is not sent yet, and of those sent. */
  let pending: TokenLogprob[] = [];
  const returned: TokenLogprob[] = [];
  let text = '';
  let sent = 0;
  if (o.resume) {
    text = model.detokenize(answer);
    sent = o.resume.text.length;
  }
  let input: Token[] = full.slice(keep);
  let finishReason: Decoded['finishReason'] = 'length';
  // Sends the text up to `upTo`. The tokens that begin before it share the piece: each token's
  // text is what it added to the answer (a character split over byte tokens goes to the token
  // that completes it), so the tokens' texts joined are the answer.
  const send = (upTo: number): void => {
    if (upTo <= sent) return;
    const piece = text.slice(sent, upTo);
    let done: TokenLogprob[] | undefined;
    if (wantLogprobs) {
      done = pending.filter((l) => l.offset < upTo);
      pending = pending.slice(done.length);
      done.forEach((l, i) => {
        const start = i === 0 ? sent : l.offset;
        const token = text.slice(start, done![i + 1]?.offset ?? upTo);
        Object.assign(l, { token, bytes: [...Buffer.from(token, 'utf8')], offset: start });
      });
      returned.push(...done);
    }
    sent = upTo;
    const begun = attached;
    while (attached < answer.length && starts[attached]! < upTo) attached++;
    o.onText(piece, done, answer.slice(begun, attached));
  };

  // A long prompt in pieces ({@link BatchShares}); a request whose client left stops between them.
  // The last piece goes with the first step, which asks for its last token's logits.
  o.shares.now(sequence, resumed.length > 0 ? 'resume' : 'prompt');
  for (;;) {
    if (o.signal.aborted) throw o.signal.reason;
    await erasures.beforeStep();
    await o.shares.turn(sequence);
    const n = o.shares.piece(); // (after the turn: the sequences sharing the batch may have changed)
    if (input.length <= n) break;
    await sequence.evaluateWithoutGeneratingNewTokens(input.slice(0, n));
    input = input.slice(n);
  }

  o.shares.now(sequence, 'generate');
  while (sampled.length < o.maxTokens) {
    if (o.signal.aborted) {
      // Handed back (a drain's deadline): where another engine on this machine finds it.
      if (o.snapshots?.worthSaving(sequence)) await o.snapshots.save(sequence);
      throw o.signal.reason;
    }
    const repeatPenalty = penalties
      ? { repeatPenalty: { punishTokens: sampled, penalty: o.repetitionPenalty, frequencyPenalty: o.frequencyPenalty, presencePenalty: o.presencePenalty } }
      : {};
    const seed = stepSeed(requestSeed, sampled.length);
    const sampling = { temperature: o.temperature, topP: o.topP, ...(o.topK !== undefined ? { topK: o.topK } : {}), seed, ...repeatPenalty };
    let out: { logits?: ReadonlyMap<Token, number>; totalLogitWeight?: number; token?: Token | null } | undefined;
    let token: Token | null | undefined;
    /** The chosen token's logit, when it is not among those asked for (found in the whole vocabulary's). */
    let chosenLogit: number | undefined;
    // Held while an erasure of another sequence waits for the context (awaited only then: per token).
    const held = erasures.beforeStep();
    if (held) await held;
    if (o.snapshots?.due(sequence)) await o.snapshots.save(sequence);
    if (grammar && !wantLogprobs) {
      // Natively, one token: the grammar's state masks only when the model's draw breaks it, and takes the token.
      token = await sampleOne(sequence, input, {
        ...sampling,
        grammarEvaluationState: grammar.state,
        ...(grammar.bias ? { tokenBias: grammar.bias } : {}),
        yieldEogToken: true,
      });
    } else {
      const next: ControlledEvaluateInputItem = [
        input.at(-1)!,
        {
          generateNext:
            wantLogprobs || grammar
              ? {
                  logits: { filter: { tokens: eogTokens, includeTop: Math.max(candidates, o.topLogprobs ?? 0, grammar ? GRAMMAR_TOP : 0) } },
                  ...(wantLogprobs ? { totalLogitWeight: true } : {}),
                  options: { temperature: 0, ...repeatPenalty },
                }
              : { token: true, options: sampling },
        },
      ];
      const evaluated = await sequence.controlledEvaluate([...input.slice(0, -1), next]);
      out = evaluated.at(-1)?.next;
      if (grammar && out?.logits) {
        let allowed = allowedOf(out.logits, grammar, candidates);
        if (allowed.size === 0) {
          // None of the most likely is allowed: the same position again, for every token's logit.
          await erase(sequence.nextTokenIndex - 1);
          const again = await sequence.controlledEvaluate([[input.at(-1)!, { generateNext: { logits: true, options: { temperature: 0, ...repeatPenalty } } }]]);
          allowed = allowedOf(again.at(-1)?.next?.logits ?? new Map<Token, number>(), grammar, candidates);
          if (allowed.size === 0) throw new Error('the grammar allows no token here');
        }
        token = drawToken(allowed, o.temperature, o.topP, uniform(seed), candidates);
        if (!out.logits.has(token)) chosenLogit = allowed.get(token);
        if (!model.isEogToken(token)) grammar.accept(token);
      } else token = wantLogprobs && out?.logits ? drawToken(out.logits, o.temperature, o.topP, uniform(seed), candidates) : out?.token;
    }
    if (token == null) throw new Error('the model sampled no token');
    sampled.push(token);
    if (model.isEogToken(token)) {
      finishReason = 'stop';
      break;
    }
    input = [token];
    answer.push(token);
    const stopTokens = o.stopTokens?.find((t) => endsWithTokens(answer, t));
    if (stopTokens) {
      answer.length -= stopTokens.length;
      text = model.detokenize(answer);
      finishReason = 'stop';
      break;
    }
    const before = text.length;
    text = model.detokenize(answer);
    starts.push(Math.max(starts.at(-1) ?? 0, Math.min(before, text.length)));
    if (wantLogprobs && out?.logits && out.totalLogitWeight !== undefined) {
      // log softmax: logit − max − ln Σ exp(logit − max) (the most likely first).
      const norm = Math.max(...out.logits.values()) + Math.log(out.totalLogitWeight);
      const lp = (t: Token): number => (out.logits!.get(t) ?? (t === token ? chosenLogit : undefined) ?? -Infinity) - norm;
      // The most likely first (the end-of-generation tokens a grammar adds are asked by id: sorted in).
      const top = [...out.logits]
        .sort((a, b) => b[1] - a[1])
        .slice(0, o.topLogprobs)
        .map(([t]) => describe(t, lp(t)));
      const offset = Math.max(pending.at(-1)?.offset ?? sent, Math.min(before, text.length));
      // Its text and bytes are what it adds to the answer, known when it is sent.
      pending.push({ token: '', bytes: [], logprob: lp(token), top, offset });
    }
    const stopAt = findStop(text, o.stop, Math.max(0, sent - longestStop));
    if (stopAt >= 0) {
      text = text.slice(0, stopAt);
      finishReason = 'stop';
      break;
    }
    // Hold back an unfinished UTF-8 character and what could begin a stop text.
    let safe = text.length;
    while (safe > sent && text.charCodeAt(safe - 1) === 0xfffd) safe--;
    safe -= stopPrefixAtEnd(text.slice(0, safe), o.stop);
    send(safe);
  }
  // An unfinished character at the end is not part of the answer (as LlamaChat returns it), nor
  // are the tokens of a stop text.
  text = text.replace(/\uFFFD+$/, '');
  send(text.length);
  return {
    text,
    finishReason,
    completionTokens: sampled.length,
    cachedPromptTokens: Math.min(keep, prompt.length),
    ...(wantLogprobs ? { logprobs: returned } : {}),
  };
}

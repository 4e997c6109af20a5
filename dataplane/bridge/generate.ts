/**
 * The engine call of one attempt (engine-client.ts does the HTTP): the request with its pinned
 * seed, the engine's chunks stamped so that attempts look alike and published as numbered frames
 * after those an earlier attempt published — checked against them, never mixed with another
 * generation — and how the call ended, as an {@link Outcome} for {@link Attempt.settle}.
 */
import { setTimeout as sleep } from 'node:timers/promises';
import type { ChatCompletionRequest } from '../../shared/chat';
import {
  CONTINUE_ELSEWHERE,
  DUE_HEADER,
  ENGINE_STARTING,
  joinedAnswer,
  REQUEUED_HEADER,
  RESUME_MISMATCH,
  resumedAnswer,
  type EngineExtension,
} from '../../shared/continuation';
import type { CompletionsRequest } from '../../shared/completions';
import type { EmbeddingsRequest } from '../../shared/embeddings';
import { requestKindOf } from '../../shared/request-kinds';
import { queueDueOf, type EmbeddingsInference, type ErrorFrame, type InferenceRequest, type ResponseFrame } from '../../shared/serving';
import type { AbortReason, Attempt, Outcome } from './attempt';
import type { EngineClient, EngineResponse } from './engine-client';
import { BridgeErrorCode, errorFrame } from './error-frames';
import { seedFor } from './requests';

/** The request a response answers, as {@link stamp} needs it. */
interface Answered {
  model: string;
  maxTokens: number | undefined;
}

/**
 * Makes engine output attempt-independent and OpenAI's: the response id is the request's (`prefix`
 * as OpenAI's ids of its kind), `created` the first claim's, `model` the name the client asked
 * for. `dllama-api` also answers with its own model name ("Distributed Model"), an uninitialized
 * choice `index` and an empty `finish_reason`: one choice is index 0, and an empty finish reason
 * is `length` when the answer used its `max_tokens`, else `stop` (a chunk's: null, not finished).
 */
function stamp(data: unknown, prefix: string, requestId: string, createdAt: number, answered: Answered, done: boolean): unknown {
  if (typeof data !== 'object' || data === null || Array.isArray(data)) return data;
  const out: Record<string, unknown> = { ...data, id: `${prefix}${requestId}`, created: Math.floor(createdAt / 1000), model: answered.model };
  const choices = out.choices;
  if (Array.isArray(choices)) {
    const used = (out.usage as { completion_tokens?: unknown } | undefined)?.completion_tokens;
    out.choices = choices.map((c: unknown, i) => {
      if (typeof c !== 'object' || c === null) return c;
      const choice = { ...(c as Record<string, unknown>) };
      if (choices.length === 1) choice.index = 0;
      else if (!Number.isInteger(choice.index)) choice.index = i;
      if (choice.finish_reason === '')
        choice.finish_reason = !done ? null : answered.maxTokens !== undefined && typeof used === 'number' && used >= answered.maxTokens ? 'length' : 'stop';
      return choice;
    });
  }
  return out;
}

/** What must be equal for two attempts' chunks to be "the same": the choices' deltas (not timings, ids …). */
function fingerprint(frame: ResponseFrame): string {
  if (frame.type !== 'chunk') return frame.type;
  const choices = (frame.data as { choices?: unknown } | null)?.choices;
  if (!Array.isArray(choices)) return 'no-choices';
  return JSON.stringify(
    // A chat chunk's choice has a `delta`, a text completion's its `text`.
    choices.map((c: { index?: unknown; delta?: unknown; text?: unknown; finish_reason?: unknown }) => [
      c.index ?? 0,
      c.delta ?? c.text ?? null,
      c.finish_reason ?? null,
    ]),
  );
}

async function engineErrorBody(res: EngineResponse): Promise<{ message: string; type?: string; code?: string | null; param?: string | null }> {
  const text = await res.text().catch(() => '');
  try {
    const e = (JSON.parse(text) as { error?: { message?: unknown; type?: unknown; code?: unknown; param?: unknown } | string }).error;
    if (typeof e === 'string') return { message: e };
    if (e && typeof e.message === 'string') {
      return {
        message: e.message,
        type: typeof e.type === 'string' ? e.type : undefined,
        code: typeof e.code === 'string' ? e.code : null,
        param: typeof e.param === 'string' ? e.param : null,
      };
    }
  } catch {
    // not JSON: use the text
  }
  return { message: text.slice(0, 500) || `HTTP ${res.status}` };
}

/** Statuses worth a retry: the engine is busy, loading or broken, not the request. */
const transientStatus = (s: number) => s === 408 || s === 429 || s >= 500;

/** Why an engine call was cut (preallocated: see generate). */
const ENGINE_TIMEOUT = Object.assign(new Error('engine call timed out'), { name: 'TimeoutError' });
const READ_NO_FURTHER = Object.assign(new Error('the bridge reads no further'), { name: 'AbortError' });

/** Whether a `chat.completion.chunk` (or a `text_completion` chunk) carries text (the role-only first chunk does not). */
export function carriesText(chunk: unknown): boolean {
  const choice = (chunk as { choices?: { delta?: { content?: unknown }; text?: unknown }[] } | null)?.choices?.[0];
  const content = choice?.delta?.content ?? choice?.text;
  return typeof content === 'string' && content.length > 0;
}

/** A chunk as the engine sent it, and the token ids it said (its `magus` field, which clients never see). */
function ownTokens(data: unknown): { data: unknown; tokens?: number[] } {
  if (typeof data !== 'object' || data === null || !('magus' in data)) return { data };
  const { magus, ...rest } = data as { magus?: { tokens?: unknown } | null };
  const tokens = magus?.tokens;
  return Array.isArray(tokens) && tokens.every((t) => Number.isInteger(t)) ? { data: rest, tokens: tokens as number[] } : { data: rest };
}

/** How often an attempt whose engine went away tries it again. */
const ENGINE_RETRY_EVERY_MS = 100;

/**
 * The answers of one engine that it lost with part of them said (their clients wait mid-answer),
 * until it takes them again. A call with nothing to resume waits while there is one: the engine
 * puts resumed answers before its queue, but takes whatever comes first while it has free slots,
 * and after a restart the answers that were queued there come back as fast as those that were
 * being said — four of them took a fresh engine's four slots and two resumed answers waited
 * 5–7 s for one under bench:chaos.
 */
export class LostAnswers {
  private readonly lost = new Set<Attempt>();
  private readonly waiting = new Set<() => void>();

  add(a: Attempt): void {
    this.lost.add(a);
  }

  delete(a: Attempt): void {
    if (!this.lost.delete(a) || this.lost.size > 0) return;
    for (const go of [...this.waiting]) go();
  }

  /** Resolves once the engine has taken every lost answer again, or when `signal` aborts (undefined: none is lost now). */
  none(signal: AbortSignal): Promise<void> | undefined {
    if (this.lost.size === 0 || signal.aborted) return undefined;
    return new Promise((resolve) => {
      const go = () => {
        this.waiting.delete(go);
        signal.removeEventListener('abort', go);
        resolve();
      };
      this.waiting.add(go);
      signal.addEventListener('abort', go, { once: true });
    });
  }
}

/** How {@link generate} calls the engine. */
export interface GenerateOptions {
  /** Upper bound of one engine call (the request's deadline bounds it too until its client has part of the answer: Attempt.cutsAt). */
  requestTimeoutMs: number;
  /** The engine continues answers from their tokens (shared/engines.ts `continues`). */
  continues: boolean;
  /**
   * How long an attempt whose engine went away (unreachable, died mid-answer, 503 while it starts
   * again) keeps trying it, every 100 ms, before the delivery is handed back: an engine restarted
   * in place picks the answer up where it stopped, without a redelivery. 0: hand it back at once.
   */
  engineWaitMs: number;
  /**
   * How long an attempt whose engine went away waits before it hands a streamed answer it can
   * continue back to its gateway (shared/continuation.ts `CONTINUE_ELSEWHERE`), which continues
   * it on another instance of the pool when there is one; until then, and for a request that may
   * not be handed back again (`continues.stay`), it waits for the engine as `engineWaitMs` says.
   * Absent: never handed back.
   */
  handBackAfterMs?: number;
  /**
   * How much longer than `handBackAfterMs` an attempt waits when its engine, since it went away,
   * said it starts from standby (shared/continuation.ts `ENGINE_STARTING`: restarted in place, it
   * serves within a second): there every slot is free, where another instance would put the
   * answer in its one resume sequence or behind the slots it is serving. Default 0.
   */
  startingWaitMs?: number;
  /** The bridge's answers its engine lost with part of them said (shared by all of its attempts). */
  lost?: LostAnswers;
}

/**
 * Whether `a`'s answer can be handed back to be continued elsewhere: a streamed chat or text
 * completion, on an engine that continues answers, whose frames so far say their tokens. One its
 * gateway sent back to the same instance (`continues.stay`: the pool had no other) waits for its
 * engine rather than move again, unless its instance is stopping (`stopping`).
 */
export function movable(a: Attempt, continues: boolean, stopping = false): boolean {
  const { req } = a;
  if (!continues || req.kind === 'embeddings' || req.body.stream !== true || (req.continues?.stay === true && !stopping)) return false;
  // Not before it said again what was lost (its client may have more than it said): a hand-back
  // names the frames said so far.
  if (a.saidUpTo > a.nextSeq) return false;
  return resumedAnswer(a.answer) !== undefined;
}

/**
 * The frame that hands `a`'s answer back to its gateway after the frames it has sent (`spread`:
 * `Attempt.handedBack`'s), with its request's place in a queue (`due`), which its continuation keeps.
 */
export function handBackFrame(a: Attempt, why: string, spread?: number): ErrorFrame {
  return { ...errorFrame(a.nextSeq, 503, 'server_error', CONTINUE_ELSEWHERE, why), ...(spread !== undefined ? { spread } : {}), due: queueDueOf(a.req) };
}

/**
 * Calls the engine for `a`, publishing chunk frames after those an earlier attempt published
 * (`prior`): an engine that `continues` answers resumes from them (shared/continuation.ts), any
 * other generates the answer again and its chunks are checked against them. An engine that goes
 * away meanwhile is tried again for `engineWaitMs`, from the frames sent so far.
 */
export async function generate(engine: EngineClient, a: Attempt, prior: readonly ResponseFrame[], o: GenerateOptions): Promise<Outcome> {
  const frames = [...prior];
  a.answer = frames;
  let lostAt: number | undefined;
  /** The engine said it starts from standby since it went away: it is coming back at once. */
  let starting = false;
  try {
    for (;;) {
      const outcome = await callEngine(engine, a, frames, o);
      if (outcome.kind !== 'retry' || !outcome.engineAway || a.signal.aborted) return outcome;
      if (o.continues && a.holdsPart) o.lost?.add(a);
      lostAt ??= Date.now();
      starting ||= outcome.engineStarting === true;
      const handBackAfter = o.handBackAfterMs === undefined ? undefined : o.handBackAfterMs + (starting ? (o.startingWaitMs ?? 0) : 0);
      if (handBackAfter !== undefined && Date.now() - lostAt >= handBackAfter && movable(a, o.continues)) {
        return { kind: 'finish', resolve: 'term', frame: handBackFrame(a, `its engine went away (${outcome.reason}): continue it elsewhere`, a.handedBack()) };
      }
      if (Date.now() + ENGINE_RETRY_EVERY_MS - lostAt > o.engineWaitMs || Date.now() + ENGINE_RETRY_EVERY_MS >= a.cutsAt()) return outcome;
      await sleep(ENGINE_RETRY_EVERY_MS, undefined, { signal: a.signal }).catch(() => undefined);
      if (a.signal.aborted) return { kind: 'aborted', reason: a.signal.reason as AbortReason };
    }
  } finally {
    o.lost?.delete(a);
  }
}

/** One engine call for `a` after `frames` (which it extends with the frames it sends). */
async function callEngine(engine: EngineClient, a: Attempt, frames: ResponseFrame[], o: GenerateOptions): Promise<Outcome> {
  const { requestTimeoutMs, continues } = o;
  const prior = frames;
  const { req } = a;
  // By kind (shared/request-kinds.ts): one that generates (chat, text completions) streams when
  // asked, with a pinned seed so a retry regenerates the same text; another (embeddings) is one
  // JSON answer, as the engine gives it (no seed; no stamp without an id prefix).
  const { path, idPrefix, generates } = requestKindOf(req);
  const generating = generates ? (req as Exclude<InferenceRequest, EmbeddingsInference>) : undefined;
  const stream = generating?.body.stream === true;
  // Nothing but a role chunk sent: generated again from the start (its role chunk compared). A
  // continuation of another request's answer resumes after what that one said, and its own frames.
  const carried = stream ? req.continues : undefined;
  // (With nothing said yet, any engine can answer it afresh.)
  if (carried && carried.resume.tokens.length > 0 && !continues)
    return {
      kind: 'finish',
      resolve: 'term',
      frame: errorFrame(a.nextSeq, 502, 'server_error', BridgeErrorCode.resumeFailed, 'this engine cannot continue an answer'),
    };
  const own = continues && stream && prior.length > 0 ? resumedAnswer(prior) : undefined;
  const said = carried ? (own ? joinedAnswer(carried.resume, own) : carried.resume) : own;
  const resume = said && said.tokens.length > 0 ? said : undefined;
  // The answer's own id, `created` and seed: a continuation's are those of the request it continues.
  const answerId = carried?.id ?? req.id;
  const createdAt = carried?.createdAt ?? a.claim.createdAt;
  // A client's own `magus` field never reaches the engine: this one replaces it.
  const magus: EngineExtension | undefined = stream ? { tokens: true, ...(resume ? { resume } : {}) } : undefined;
  const body: ((ChatCompletionRequest | CompletionsRequest) & { magus?: EngineExtension }) | EmbeddingsRequest = generating
    ? { ...generating.body, stream, seed: generating.body.seed ?? seedFor(answerId), magus }
    : req.body;
  // Resumed after its own frames, the engine's chunks follow them (it sends no role chunk);
  // otherwise they start from the first and must equal the prior ones.
  const base = resume && own ? prior.length : 0;
  const compared = resume && own ? [] : prior;
  // Nothing to resume: after the answers the engine lost mid-answer, which go first (LostAnswers).
  if (!resume && o.lost) {
    o.lost.delete(a); // (it is not one of them: an engine that cannot continue it generates it again)
    const after = o.lost.none(a.signal);
    if (after) await after;
    if (a.signal.aborted) return { kind: 'aborted', reason: a.signal.reason as AbortReason };
  }
  const answered: Answered = {
    model: (req.body as { model: string }).model,
    maxTokens: generating
      ? ((generating.body as { max_tokens?: number; max_completion_tokens?: number }).max_completion_tokens ?? generating.body.max_tokens)
      : undefined,
  };
  // One controller for the engine call: the attempt's abort, the timeout, and our own stop when
  // we read no further (divergence, errors). Reasons are preallocated: a DOMException per call
  // costs more than the rest of this function.
  const local = new AbortController();
  const signal = local.signal;
  const onAttemptAbort = () => local.abort(a.signal.reason);
  a.signal.addEventListener('abort', onAttemptAbort, { once: true });
  // The call ends at its bound, or at the request's deadline while its client has nothing of the
  // answer (Attempt.cutsAt): one begun by then goes on, to the call's bound.
  const callEnds = Date.now() + requestTimeoutMs;
  const endsAt = () => Math.min(callEnds, a.cutsAt(frames));
  // Armed for when it ends as things stand; at that time, armed again if the answer began meanwhile.
  const arm = (): NodeJS.Timeout =>
    setTimeout(() => (Date.now() >= endsAt() ? local.abort(ENGINE_TIMEOUT) : (timer = arm())), Math.max(1, endsAt() - Date.now()));
  let timer = arm();
  const aborted = (): Outcome | null => {
    if (a.signal.aborted) return { kind: 'aborted', reason: a.signal.reason as AbortReason };
    if (Date.now() >= a.cutsAt(frames))
      return {
        kind: 'finish',
        resolve: 'term',
        frame: errorFrame(a.nextSeq, 504, 'timeout', BridgeErrorCode.deadlineExceeded, 'the request deadline passed while the engine was generating'),
      };
    if (signal.aborted) return { kind: 'retry', reason: `engine call exceeded ${requestTimeoutMs} ms` };
    return null;
  };
  const diverged = (): Outcome => ({
    kind: 'finish',
    resolve: 'term',
    // After the frames stored beyond a lost one too: its client may have them.
    frame: errorFrame(a.saidUpTo, 502, 'server_error', BridgeErrorCode.generationDiverged, 'the answer was interrupted and could not be resumed identically'),
  });
  try {
    // Handed back by another instance with nothing said: it waited its turn there (its engine puts it
    // among its own queue by its place, which every call says: shared/serving.ts `queueDueOf`).
    const headers = { [DUE_HEADER]: String(Math.round(queueDueOf(req))), ...(carried && !resume ? { [REQUEUED_HEADER]: '1' } : {}) };
    const called = Date.now();
    const res = await engine.post(path, JSON.stringify(body), {
      accept: stream ? 'text/event-stream' : 'application/json',
      signal,
      headers,
    });
    if (res.status < 200 || res.status > 299) {
      const e = await engineErrorBody(res);
      if (resume && e.code === RESUME_MISMATCH) {
        // The engine cannot continue it (another model or build): generate it again and compare —
        // not a continuation, whose beginning is another request's and cannot be compared.
        if (carried)
          return {
            kind: 'finish',
            resolve: 'term',
            frame: errorFrame(a.nextSeq, 502, 'server_error', BridgeErrorCode.resumeFailed, `the engine cannot continue this answer: ${e.message}`),
          };
        clearTimeout(timer);
        return await callEngine(engine, a, frames, { ...o, continues: false });
      }
      if (transientStatus(res.status))
        return {
          kind: 'retry',
          reason: `engine ${res.status}: ${e.message}`,
          ...(res.status === 503 ? { engineAway: true, ...(e.code === ENGINE_STARTING ? { engineStarting: true } : {}) } : {}),
        };
      return {
        kind: 'finish',
        resolve: 'term',
        frame: errorFrame(a.nextSeq, res.status, e.type ?? 'invalid_request_error', e.code ?? null, e.message, e.param),
      };
    }
    /** When a resumed answer's engine answered (it does once a slot is the answer's). */
    const slotAt = resume ? Date.now() : 0;
    if (resume) {
      a.continued();
      o.lost?.delete(a);
    }
    if (!stream) {
      const completion: unknown = JSON.parse(await res.text());
      return {
        kind: 'finish',
        resolve: 'ack',
        frame: { seq: a.nextSeq, type: 'done', data: idPrefix ? stamp(completion, idPrefix, answerId, createdAt, answered, true) : completion },
      };
    }
    if (!res.contentType.includes('text/event-stream')) {
      res.cancel();
      return {
        kind: 'finish',
        resolve: 'term',
        frame: errorFrame(a.nextSeq, 502, 'server_error', BridgeErrorCode.engineProtocol, 'the engine did not stream (no text/event-stream)'),
      };
    }
    let seq = 0;
    let firstToken = false;
    // A batch is what one read of the engine's body completed: its frames are published in one
    // go, so NATS gets them in one write instead of one per event — except that the frames up
    // to the answer's first token go out ahead of the rest of their batch (time to first token).
    read: for await (const batch of res.eventBatches()) {
      for (const [i, event] of batch.entries()) {
        if (event.trim() === '[DONE]') break read;
        let data: unknown;
        try {
          data = JSON.parse(event);
        } catch {
          return {
            kind: 'finish',
            resolve: 'term',
            frame: errorFrame(a.nextSeq, 502, 'server_error', BridgeErrorCode.engineProtocol, 'the engine sent a malformed event'),
          };
        }
        const engineError = (data as { error?: { message?: string } } | null)?.error;
        if (engineError) {
          return {
            kind: 'finish',
            resolve: 'term',
            frame: errorFrame(a.nextSeq, 502, 'server_error', BridgeErrorCode.engineProtocol, `engine: ${engineError.message ?? 'error'}`),
          };
        }
        const ownChunk = ownTokens(data);
        const frame: ResponseFrame = {
          seq: base + seq,
          type: 'chunk',
          data: stamp(ownChunk.data, idPrefix ?? '', answerId, createdAt, answered, false),
          ...(ownChunk.tokens ? { tokens: ownChunk.tokens } : {}),
        };
        const before = compared[seq];
        if (before) {
          if (fingerprint(before) !== fingerprint(frame)) return diverged();
        } else {
          // Where an earlier attempt's frame was stored beyond a lost one, the same words again.
          const stored = a.beyondGap.get(frame.seq);
          if (stored && fingerprint(stored) !== fingerprint(frame)) return diverged();
          a.send(frame);
          frames.push(frame);
          a.nextSeq = base + seq + 1;
        }
        seq += 1;
        if (a.signal.aborted) break read;
        if (!firstToken && carriesText(data)) {
          firstToken = true;
          // How long its client waited at this engine: for a slot, then the prompt and what was said evaluated.
          if (resume)
            a.log(`continues ${answerId} after ${resume.tokens.length} tokens: a slot in ${slotAt - called} ms, its first piece in ${Date.now() - called} ms`);
          if (i < batch.length - 1) await new Promise<void>((resolve) => setImmediate(resolve)); // NATS flushes it now
          if (a.signal.aborted) break read;
        }
      }
    }
    const stopped = aborted();
    if (stopped) return stopped;
    if (base + seq < prior.length) return diverged();
    // Ended before a chunk an earlier attempt stored beyond a lost frame: its client may have it.
    for (const [s, f] of a.beyondGap) if (s >= a.nextSeq && f.type === 'chunk') return diverged();
    return { kind: 'finish', resolve: 'ack', frame: { seq: a.nextSeq, type: 'done' } };
  } catch (err) {
    // Aborted (ours, deadline, timeout) or the engine is unreachable / died mid-answer: a later
    // attempt resumes after the frames already sent, so a retry is safe.
    return (
      aborted() ?? { kind: 'retry', reason: `engine unreachable: ${(err as { cause?: Error }).cause?.message ?? (err as Error).message}`, engineAway: true }
    );
  } finally {
    clearTimeout(timer);
    a.signal.removeEventListener('abort', onAttemptAbort);
    local.abort(READ_NO_FURTHER);
  }
}

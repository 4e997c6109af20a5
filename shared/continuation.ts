/**
 * How an interrupted answer continues instead of being generated again (dataplane/README.md,
 * "Continuing an answer"): the bridge asks the engine to say, in each streamed chunk, the token
 * ids the chunk's text begins; a later attempt sends those ids back with the text the client
 * already has, and the engine evaluates them after the prompt and samples on from the next
 * position. Sampling is seeded per position, so a greedy or seeded answer continued this way is
 * the answer an undisturbed run gives.
 *
 * The `magus` field of an engine request body and of a streamed chunk carries it. A bridge sets
 * it; a client's own `magus` field never reaches an engine (the bridge replaces it).
 * Workflow-safe: no I/O.
 */
import { Type, type Static } from '@sinclair/typebox';
import type { ResponseFrame } from './serving';

/** Tokens an answer being continued may carry: a context's worth, and then some. */
export const MAX_RESUMED_TOKENS = 1 << 20;

/** The answer so far: its tokens (every chunk's `magus.tokens`, in order) and the text the client has of it (every chunk's text). */
const ResumedAnswerSchema = Type.Object(
  {
    tokens: Type.Array(Type.Integer({ minimum: 0 }), { maxItems: MAX_RESUMED_TOKENS }),
    text: Type.String(),
  },
  { additionalProperties: false },
);

/** What a bridge asks of an engine beyond OpenAI's fields. */
export const EngineExtension = Type.Object(
  {
    /** Each streamed chunk carries, as `magus.tokens`, the ids of the tokens its text begins. */
    tokens: Type.Optional(Type.Boolean()),
    /** The answer so far, to continue: only what follows its text is streamed. */
    resume: Type.Optional(ResumedAnswerSchema),
  },
  { additionalProperties: false },
);
export type EngineExtension = Static<typeof EngineExtension>;

/** The answer so far, as {@link EngineExtension} `resume` carries it. */
export type ResumedAnswer = NonNullable<EngineExtension['resume']>;

/** The `magus` field of a streamed chunk: the ids of the tokens its text begins. */
export interface ChunkTokens {
  tokens: number[];
}

/**
 * The error code of an engine's 503 while it starts from standby (its weights already mapped, it
 * makes its context: it serves within a second), where one loading its model from nothing says
 * `engine_unavailable`. A bridge whose engine went away mid-answer and then hears this waits for
 * it a little longer before handing the answer back (dataplane/bridge/generate.ts
 * `startingWaitMs`): the restarted engine has every slot free, where another instance has its own
 * queue and one resume sequence.
 */
export const ENGINE_STARTING = 'engine_starting';

/**
 * The request header (`1`) a bridge sends with a request another instance handed back before any
 * of it was said (dataplane/names.ts `LANES`, `requeued`): it waited its turn in that instance's
 * queue, so an engine puts it after the resumed answers and before the rest of its own queue
 * (engine/slots.ts, "first"). A header, not a `magus` field: an engine that does not know it
 * ignores it, where an unknown field would be refused.
 */
export const REQUEUED_HEADER = 'x-magus-requeued';

/**
 * The request header a bridge sends with every call: the request's deadline (epoch ms, its
 * `deadline`: when its client's gateway gives up). An engine places a request handed back
 * ({@link REQUEUED_HEADER}) among its own queue by it, earliest deadline first (engine/slots.ts),
 * rather than before all of it. A header for the same reason as that one.
 */
export const DUE_HEADER = 'x-magus-due';

/** The error code of an engine that cannot continue a request (another model, a request its resume does not fit). */
export const RESUME_MISMATCH = 'resume_mismatch';

/**
 * The error code of a bridge that hands an answer back to its gateway to be continued elsewhere
 * (its drain deadline passed, or its engine went away): a `503` error frame, after which no
 * attempt of that request publishes more. A gateway that can move answers sends the rest as a new
 * request that {@link Continues} it, on another instance when the pool has one; an older gateway
 * ends the answer with the error. The usage ledger records the answer once, from the request
 * that ends it.
 */
export const CONTINUE_ELSEWHERE = 'continue_elsewhere';

/**
 * What a request that continues another's answer carries (the envelope's `continues`): the
 * request whose answer it is (its chunks are stamped with that request's id and `created`, its
 * seed is that request's, and the usage ledger records it under that id), the answer so far, and
 * whether its bridge may hand it back again (`stay`: the pool had no other instance, so it waits
 * for its engine where it is).
 */
export const Continues = Type.Object(
  {
    id: Type.String({ minLength: 1, maxLength: 128, pattern: '^[A-Za-z0-9_-]+$' }),
    /** Epoch ms the answer's chunks say they were created (`created` × 1000). */
    createdAt: Type.Number(),
    resume: ResumedAnswerSchema,
    stay: Type.Optional(Type.Boolean()),
  },
  { additionalProperties: false },
);
export type Continues = Static<typeof Continues>;

/**
 * The answer so far, as an engine that continues answers resumes it, from its frames in order:
 * every chunk with text says its tokens, and none ended the choice. Undefined when they cannot
 * say it (another engine's frames, tool calls, several choices, a finished choice, an error):
 * the answer can then only be generated again and checked against them.
 */
export function resumedAnswer(frames: readonly ResponseFrame[]): ResumedAnswer | undefined {
  const said = new AnswerSoFar();
  for (const f of frames) said.add(f);
  return said.answer;
}

/**
 * {@link resumedAnswer} kept as frames come (a gateway relaying an answer it may have to move):
 * the tokens and text only, not the frames.
 */
export class AnswerSoFar {
  private readonly tokens: number[] = [];
  private text = '';
  private resumable = true;

  add(f: ResponseFrame): void {
    if (!this.resumable) return;
    if (f.type !== 'chunk') return void (this.resumable = false);
    const choices = (f.data as { choices?: unknown } | null)?.choices;
    if (!Array.isArray(choices) || choices.length !== 1) return void (this.resumable = false);
    const c = choices[0] as { delta?: { content?: unknown; tool_calls?: unknown }; text?: unknown; finish_reason?: unknown } | null;
    if (!c || c.finish_reason != null || c.delta?.tool_calls != null) return void (this.resumable = false);
    const piece = c.delta ? (c.delta.content ?? '') : (c.text ?? '');
    if (typeof piece !== 'string') return void (this.resumable = false);
    if (piece === '') return; // a chat stream's role chunk
    if (!Array.isArray(f.tokens)) return void (this.resumable = false);
    for (const t of f.tokens) this.tokens.push(t);
    this.text += piece;
  }

  /** Whether its frames say the answer so far. */
  get continuable(): boolean {
    return this.resumable;
  }

  /** The answer so far, or undefined when its frames cannot say it. */
  get answer(): ResumedAnswer | undefined {
    return this.resumable ? { tokens: [...this.tokens], text: this.text } : undefined;
  }
}

/**
 * Whether `resume` holds part of an answer its client already has (tokens said): such a
 * continuation goes to the moved answers of the instance it lands on (dataplane/names.ts
 * `requestSubjectFor`) and before its engine's queue (engine/slots.ts, "urgent").
 */
export const holdsPart = (resume: ResumedAnswer | undefined): boolean => (resume?.tokens.length ?? 0) > 0;

/** The answer so far `a`, then `b` (what a continuation said after what it was given). */
export const joinedAnswer = (a: ResumedAnswer, b: ResumedAnswer): ResumedAnswer => ({ tokens: [...a.tokens, ...b.tokens], text: a.text + b.text });

/**
 * A bridge says it is alive on `magus.beat.<pool>.<instance>` this often; a gateway that hears
 * none for {@link BRIDGE_SILENT_MS} while it waits for an answer of that instance continues the
 * answer elsewhere, as if it had been handed back.
 */
export const BEAT_EVERY_MS = 250;
export const BRIDGE_SILENT_MS = 1000;
/**
 * A bridge told to stop (SIGTERM: its pod deleted, its instance drained) says so in its beats
 * (shared/serving.ts `BridgeLoad.stopping`) and beats every {@link STOPPING_BEAT_EVERY_MS}; a
 * gateway calls it silent after {@link STOPPING_SILENT_MS}. Such a bridge finishes its answers if
 * it is let, but may be killed any time (a pod deleted with no grace gets the kubelet's 2 s): its
 * answers move sooner after its death. One of them merely stalled that long is continued elsewhere
 * all the same, whole — a cost a bridge on its way out may charge.
 */
export const STOPPING_BEAT_EVERY_MS = 100;
export const STOPPING_SILENT_MS = 400;

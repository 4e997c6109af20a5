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

/** Tokens an answer being continued may carry: a context's worth, and then some. */
export const MAX_RESUMED_TOKENS = 1 << 20;

/** What a bridge asks of an engine beyond OpenAI's fields. */
export const EngineExtension = Type.Object(
  {
    /** Each streamed chunk carries, as `magus.tokens`, the ids of the tokens its text begins. */
    tokens: Type.Optional(Type.Boolean()),
    /**
     * The answer so far, to continue: its tokens (every chunk's `magus.tokens`, in order) and the
     * text the client has of it (every chunk's text). Only what follows that text is streamed.
     */
    resume: Type.Optional(
      Type.Object(
        {
          tokens: Type.Array(Type.Integer({ minimum: 0 }), { maxItems: MAX_RESUMED_TOKENS }),
          text: Type.String(),
        },
        { additionalProperties: false },
      ),
    ),
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

/** The error code of an engine that cannot continue a request (another model, a request its resume does not fit). */
export const RESUME_MISMATCH = 'resume_mismatch';

/**
 * The embeddings request, declared once (TypeBox, types derived), as shared/chat.ts declares the
 * chat request:
 * - {@link EmbeddingsBody}: the OpenAI body `POST /v1/embeddings` accepts (its route schema);
 * - {@link EmbeddingsRequest}: what crosses NATS to an engine (`InferenceRequest.body` of kind
 *   `embeddings`), the body without `user`; the bridge checks it and the engine takes it as is.
 *
 * `input` is a string, a list of strings, a list of token ids or a list of such lists (OpenAI's
 * four forms), bounded in count and size so one request cannot hold an engine for long; every
 * item is embedded on its own and answered in order. `dimensions` is refused unless it is the
 * model's own embedding size: magus's engine does not shorten vectors (no model it serves is
 * trained for that).
 */
import { Type, type Static } from '@sinclair/typebox';
import { StringEnum } from './chat';
import { engineCan, engineOf, type EngineKind } from './engines';

/** Most inputs one request may embed (OpenAI's limit is 2,048; an engine embeds them one by one). */
export const MAX_EMBEDDING_INPUTS = 256;
/** Longest text input, in characters (an engine also refuses one with more tokens than its context). */
export const MAX_EMBEDDING_CHARS = 64 * 1024;
/** Longest token-id input. */
export const MAX_EMBEDDING_TOKENS = 16 * 1024;

const text = Type.String({ maxLength: MAX_EMBEDDING_CHARS });
const tokens = Type.Array(Type.Integer({ minimum: 0, maximum: 2 ** 31 - 1 }), { minItems: 1, maxItems: MAX_EMBEDDING_TOKENS });

const input = Type.Union(
  [text, Type.Array(text, { minItems: 1, maxItems: MAX_EMBEDDING_INPUTS }), tokens, Type.Array(tokens, { minItems: 1, maxItems: MAX_EMBEDDING_INPUTS })],
  {
    description: `a string, a list of up to ${MAX_EMBEDDING_INPUTS} strings (each at most ${MAX_EMBEDDING_CHARS} characters), a list of token ids, or a list of up to ${MAX_EMBEDDING_INPUTS} such lists`,
  },
);

const fields = {
  model: Type.String({ minLength: 1, maxLength: 256 }),
  input,
  encoding_format: Type.Optional(StringEnum(['float', 'base64'])),
  dimensions: Type.Optional(Type.Integer({ minimum: 1, maximum: 65_536 })),
};

/** `POST /v1/embeddings`: the body the gateway accepts. */
export const EmbeddingsBody = Type.Object(
  { ...fields, user: Type.Optional(Type.String({ maxLength: 256 })) },
  { examples: [{ model: 'demo', input: 'The capital of France is Paris.' }] },
);
export type EmbeddingsBody = Static<typeof EmbeddingsBody>;

/** What an engine gets (`InferenceRequest.body` of an `embeddings` request). */
export const EmbeddingsRequest = Type.Object(fields);
export type EmbeddingsRequest = Static<typeof EmbeddingsRequest>;

/** The request's inputs as a list, each a text or a list of token ids. */
export function embeddingInputs(body: Pick<EmbeddingsRequest, 'input'>): (string | number[])[] {
  const i = body.input;
  if (typeof i === 'string') return [i];
  if (i.length > 0 && typeof i[0] === 'number') return [i as number[]];
  return i as (string | number[])[];
}

/** OpenAI's answer. */
export interface EmbeddingsResponse {
  object: 'list';
  data: { object: 'embedding'; index: number; embedding: number[] | string }[];
  model: string;
  usage: { prompt_tokens: number; total_tokens: number };
}

/** Why `engine` cannot answer an embeddings request, if it cannot. */
export function embeddingsUnsupportedBy(engine: EngineKind): { field: string; message: string } | undefined {
  if (engineCan(engine, 'embeddings')) return undefined;
  return { field: 'model', message: `Embeddings are not supported by this model's engine, ${engineOf(engine).name}; it serves plain chat.` };
}

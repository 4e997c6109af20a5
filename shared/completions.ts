/**
 * The legacy text-completion request (`POST /v1/completions`), declared once as shared/chat.ts
 * declares the chat request:
 * - {@link CompletionsBody}: the OpenAI body the gateway accepts;
 * - {@link CompletionsRequest}: what crosses NATS to an engine (`InferenceRequest.body` of kind
 *   `completions`): the {@link COMPLETIONS_FORWARDED} fields as the client sent them, and
 *   `stream_options` as the gateway sets it.
 *
 * `prompt` is a string or a list of strings (one choice each, in order; at most
 * {@link MAX_PROMPTS}), continued as raw text: no chat template. Sampling fields are the chat
 * request's, with the same bounds; `logprobs` (0–20) asks for each token's log-probability and
 * that many alternatives. What asks for another kind of answer — `echo`, `suffix`, `n` or
 * `best_of` above 1 — accepts only its plain form.
 */
import { Type, type Static } from '@sinclair/typebox';
import { ChatCompletionBody, MAX_TOP_LOGPROBS, modelSamplingFields, topLogprobs, unsupported } from './chat';
import { engineCan, engineOf, type EngineKind } from './engines';

/** Most prompts one request may carry (each is a choice, generated one after another). */
export const MAX_PROMPTS = 16;
/** Longest prompt, in characters (the engine also refuses one with more tokens than its context). */
export const MAX_PROMPT_CHARS = 512 * 1024;

const text = Type.String({ maxLength: MAX_PROMPT_CHARS });

/** The fields the gateway forwards as the client sent them (and `logprobs`). */
export const COMPLETIONS_FORWARDED = [
  'model',
  'max_tokens',
  'temperature',
  'top_p',
  'seed',
  'stop',
  'frequency_penalty',
  'presence_penalty',
  'stream',
] as const;

const sampling = {
  ...Type.Pick(ChatCompletionBody, COMPLETIONS_FORWARDED).properties,
  /** The log-probabilities of each token and of this many most likely alternatives (completions' spelling of chat's `top_logprobs`). */
  logprobs: Type.Optional(Type.Union([Type.Null(), topLogprobs], { description: `an integer from 0 to ${MAX_TOP_LOGPROBS} or null` })),
};

/** `POST /v1/completions`: the body the gateway accepts. */
export const CompletionsBody = Type.Object(
  {
    ...sampling,
    prompt: Type.Union([text, Type.Array(text, { minItems: 1, maxItems: MAX_PROMPTS })], { description: `a string or a list of up to ${MAX_PROMPTS} strings` }),
    stream_options: Type.Optional(Type.Union([Type.Null(), Type.Object({ include_usage: Type.Optional(Type.Boolean()) })])),
    user: Type.Optional(Type.String({ maxLength: 256 })),
    n: Type.Optional(
      Type.Integer({
        minimum: 1,
        maximum: 1,
        ...unsupported('maximum', 'Only one choice per prompt is supported by this server; send `n: 1` or leave it out.'),
      }),
    ),
    best_of: Type.Optional(Type.Integer({ minimum: 1, maximum: 1, ...unsupported('maximum', '`best_of` above 1 is not supported by this server.') })),
    echo: Type.Optional(
      Type.Union([Type.Null(), Type.Literal(false, unsupported('const', 'Echoing the prompt is not supported by this server.'))], {
        description: 'null or false',
      }),
    ),
    suffix: Type.Optional(
      Type.Union([Type.Null(), Type.Literal('', unsupported('const', 'Insertion (`suffix`) is not supported by this server.'))], { description: 'null or ""' }),
    ),
  },
  { examples: [{ model: 'demo', prompt: 'Once upon a time', max_tokens: 16 }] },
);
export type CompletionsBody = Static<typeof CompletionsBody>;

/** What an engine gets (`InferenceRequest.body` of a `completions` request). */
export const CompletionsRequest = Type.Object({
  ...sampling,
  /** Set by the gateway from the model's defaults (shared/chat.ts). */
  ...modelSamplingFields,
  prompt: CompletionsBody.properties.prompt,
  /** Streams only: `include_usage` ends the stream with a chunk that carries `usage` (no choices). */
  stream_options: Type.Optional(Type.Object({ include_usage: Type.Optional(Type.Boolean()) })),
});
export type CompletionsRequest = Static<typeof CompletionsRequest>;

/** OpenAI's default `max_tokens` for completions (chat has none). */
export const COMPLETIONS_DEFAULT_MAX_TOKENS = 16;

/** The prompts as a list. */
export const promptsOf = (body: Pick<CompletionsRequest, 'prompt'>): string[] => (typeof body.prompt === 'string' ? [body.prompt] : body.prompt);

/** Why `engine` cannot answer a text-completion request, if it cannot. */
export function completionsUnsupportedBy(engine: EngineKind): { field: string; message: string } | undefined {
  if (engineCan(engine, 'completions')) return undefined;
  return { field: 'model', message: `Text completions are not supported by this model's engine, ${engineOf(engine).name}; it serves chat completions.` };
}

/**
 * The chat-completion request, declared once as JSON Schema (TypeBox) with its TypeScript types
 * derived from it, so a validator and a type cannot drift apart:
 * - {@link ChatCompletionBody}: the OpenAI body the gateway accepts (its fastify route schema, and
 *   the request body `/openapi.json` publishes as is);
 * - {@link ChatCompletionRequest}: the part of it that crosses NATS to an engine
 *   (`InferenceRequest.body`, shared/serving.ts) — the {@link FORWARDED_FIELDS} as the client sent
 *   them, messages flattened to text, `max_tokens` and `stream_options` as the gateway sets them.
 *   The bridge checks it at its trust boundary, and the engine's own body schema (engine/api.ts)
 *   widens it.
 *
 * Fields OpenAI defines that only tune sampling and that no engine reads (`logit_bias`, `user` …)
 * are accepted and ignored, so stock clients work; fields that ask for a different kind of answer
 * that magus does not give yet — tool calls, log-probabilities, several choices — accept only
 * their empty or plain form ({@link unsupported}). Structured output (`response_format`) is served
 * by engines that have it (shared/engines.ts).
 *
 * Two annotations are for the gateway's error handler (gateway/plugins/errors.ts) and readers of
 * the OpenAPI description: a `description` on a checked value completes the sentence
 * "<param> must be …" of its 400; `x-unsupported` names the message of a refused feature.
 */
import { Kind, Type, TypeRegistry, type Static, type TUnsafe } from '@sinclair/typebox';
import { engineCan, engineOf, type Capability, type EngineKind } from './engines';
import { schemaToGbnf } from './grammar';
import { toGrammarSchema, type GrammarSchema } from './json-schema';
import { MAX_TOP_K, SAMPLING_BOUNDS } from './sampling';

/** A string schema listing its values as JSON Schema `enum` (Ajv's `discriminator` and its errors need that; TypeBox's own unions are `anyOf` of `const`). */
export function StringEnum<const T extends string[]>(values: [...T], options: Record<string, unknown> = {}): TUnsafe<T[number]> {
  return Type.Unsafe<T[number]>({ ...options, [Kind]: 'StringEnum', type: 'string', enum: values });
}
// So TypeBox's own checker (the bridge's, dataplane/bridge/requests.ts) knows the kind too.
if (!TypeRegistry.Has('StringEnum'))
  TypeRegistry.Set<{ enum: string[] }>('StringEnum', (schema, value) => typeof value === 'string' && schema.enum.includes(value));

/**
 * Options of a field whose other values ask for an answer magus cannot give (a valid OpenAI
 * request, not a malformed value: OpenAI accepts any n ≥ 1, so clients read `unsupported_feature`
 * as "this server", not "my request"): failing `keyword` is a 400 `unsupported_feature` with
 * `message`; failing another (a wrong type) is `invalid_value`, as anywhere else.
 */
export const unsupported = (keyword: string, message: string) => ({ 'x-unsupported': { [keyword]: message } });

/** Most messages a request may carry. */
export const MAX_MESSAGES = 10_000;

const textPart = Type.Object({ type: StringEnum(['text']), text: Type.String() });
export type TextPart = Static<typeof textPart>;

/** A message's text: a string, or OpenAI's list of text parts (joined before forwarding). */
const text = [Type.String(), Type.Array(textPart, { maxItems: 1024 })] as const;
const name = Type.Optional(Type.String({ maxLength: 256 }));

/** Most tools a request may offer (and tool calls an assistant turn may carry). */
export const MAX_TOOLS = 128;
/** OpenAI's rule for a function's and a response format's name. */
export const toolName = Type.String({ pattern: '^[a-zA-Z0-9_-]{1,64}$', description: 'letters, digits, _ and -, at most 64' });
/** A tool call as an assistant turn carries it: `arguments` is the JSON text of the call's arguments. */
const toolCall = Type.Object({
  id: Type.String({ minLength: 1, maxLength: 256 }),
  type: StringEnum(['function']),
  function: Type.Object({ name: toolName, arguments: Type.String({ maxLength: 1_000_000 }) }),
});
export type ToolCall = Static<typeof toolCall>;

/** A tool's result, answering the call `tool_call_id` of an earlier assistant turn. */
const toolMessage = Type.Object({
  role: StringEnum(['tool']),
  content: Type.Union([...text], { description: 'a string or a list of text parts' }),
  tool_call_id: Type.String({ minLength: 1, maxLength: 256 }),
});

/** `system` and `user` messages: `content` is required and never null (OpenAI refuses null too). */
const promptMessage = Type.Object({
  role: StringEnum(['system', 'user']),
  content: Type.Union([...text], { description: 'a string or a list of text parts' }),
  name,
});

/**
 * The assistant's own earlier turns. OpenAI's rule: `content` may be null only beside `tool_calls`
 * (or the older `function_call`), the shape OpenAI clients replay a tool-calling turn in. The
 * tool calls are forwarded with the turn (its text `""` for null); `function_call` (functions are
 * {@link unsupported}) is accepted as history and not forwarded.
 */
const assistantMessage = Type.Object(
  {
    role: StringEnum(['assistant']),
    content: Type.Union([...text, Type.Null()], { description: 'a string, a list of text parts, or null beside tool_calls' }),
    name,
    tool_calls: Type.Optional(Type.Array(toolCall, { maxItems: MAX_TOOLS })),
    function_call: Type.Optional(Type.Object({})),
  },
  {
    // Text, or calls: a null content needs at least one tool call (or a function call) beside it.
    anyOf: [
      { properties: { content: { description: 'a string or a list of text parts (null only beside tool_calls or function_call)', not: { type: 'null' } } } },
      { required: ['tool_calls'], properties: { tool_calls: { type: 'array', minItems: 1 } } },
      { required: ['function_call'] },
    ],
  },
);

/**
 * One message, by its `role` (Ajv's `discriminator`: only the schema of the message's own role
 * is checked, so a 400 names what is wrong in it, not a mismatch with every role). TypeBox has no
 * `oneOf`, which `discriminator` needs: the schema is written out, its type derived from the two.
 */
const message = Type.Unsafe<Static<typeof promptMessage> | Static<typeof assistantMessage> | Static<typeof toolMessage>>({
  type: 'object',
  required: ['role'],
  discriminator: { propertyName: 'role' },
  oneOf: [promptMessage, assistantMessage, toolMessage],
});
/** A validated message of {@link ChatCompletionBody}. */
export type ChatCompletionMessage = Static<typeof message>;

export const maxTokens = Type.Integer({ minimum: 1, maximum: 1_000_000 });

/** A function's or a response format's description (for the model). */
export const describedBy = Type.Optional(Type.String({ maxLength: 4096 }));
/** A function's `parameters`, a response format's `schema`: checked further by shared/json-schema.ts (which keywords a grammar enforces) at the gateway and the engine. */
export const jsonSchemaObject = Type.Optional(Type.Record(Type.String(), Type.Unknown(), { description: 'a JSON Schema object' }));
/** Answers always follow the schema exactly (a grammar): `strict` changes nothing. */
export const strictFlag = Type.Optional(Type.Union([Type.Boolean(), Type.Null()]));

/**
 * A function the model may call: `parameters` is a JSON Schema its arguments are generated
 * against (grammar-constrained; shared/json-schema.ts decides which schemas, at the gateway and
 * the engine). No `parameters`: a call without arguments.
 */
const tool = Type.Object({
  type: StringEnum(['function']),
  function: Type.Object({ name: toolName, description: describedBy, parameters: jsonSchemaObject, strict: strictFlag }),
});
export type Tool = Static<typeof tool>;
/** `none`: answer in text; `auto`: text or calls; `required`: at least one call; a named function: a call of it. */
const toolChoice = Type.Union([
  StringEnum(['none', 'auto', 'required']),
  Type.Object({ type: StringEnum(['function']), function: Type.Object({ name: toolName }) }),
]);
export type ToolChoice = Static<typeof toolChoice>;

/** Largest JSON schema of structured output, serialized (it becomes a grammar per request). */
export const MAX_SCHEMA_BYTES = 64 * 1024;
const textFormat = Type.Object({ type: StringEnum(['text']) });
const jsonObjectFormat = Type.Object({ type: StringEnum(['json_object']) });
const jsonSchemaFormat = Type.Object({
  type: StringEnum(['json_schema']),
  json_schema: Type.Object({ name: toolName, description: describedBy, schema: jsonSchemaObject, strict: strictFlag }),
});
/**
 * `response_format`: `text`, `json_object` (any JSON object) or `json_schema` (JSON that validates
 * against the schema: grammar-constrained decoding, shared/json-schema.ts).
 */
const responseFormat = Type.Union([textFormat, jsonObjectFormat, jsonSchemaFormat]);
/** The same for the gateway's validator, by `type` (Ajv's `discriminator`: a 400 names what is wrong inside the chosen format). */
const responseFormatByType = Type.Unsafe<Static<typeof responseFormat>>({
  type: 'object',
  required: ['type'],
  discriminator: { propertyName: 'type' },
  oneOf: responseFormat.anyOf,
});
export type ResponseFormat = Static<typeof responseFormat>;
/** Most alternatives per token in log-probabilities (OpenAI's bound). */
export const MAX_TOP_LOGPROBS = 20;
export const topLogprobs = Type.Integer({ minimum: 0, maximum: MAX_TOP_LOGPROBS });
/** Streams: `include_usage` adds a last chunk with `usage` before `[DONE]`. */
const streamOptions = Type.Object({ include_usage: Type.Optional(Type.Boolean()) });

/** `POST /v1/chat/completions`: the body the gateway accepts. */
export const ChatCompletionBody = Type.Object(
  {
    model: Type.String({ minLength: 1, maxLength: 256 }),
    messages: Type.Array(message, { minItems: 1, maxItems: MAX_MESSAGES }),
    stream: Type.Optional(Type.Boolean()),
    max_tokens: Type.Optional(maxTokens),
    /** The newer name of `max_tokens` (OpenAI clients send either). */
    max_completion_tokens: Type.Optional(maxTokens),
    temperature: Type.Optional(Type.Number({ minimum: 0, maximum: 2 })),
    top_p: Type.Optional(Type.Number({ minimum: 0, maximum: 1 })),
    seed: Type.Optional(Type.Integer()),
    // Not empty: the engines refuse an empty stop text (engine/api.ts).
    stop: Type.Optional(
      Type.Union([Type.String({ minLength: 1 }), Type.Array(Type.String({ minLength: 1 }), { maxItems: 4 })], {
        description: 'a non-empty string or a list of up to 4',
      }),
    ),
    frequency_penalty: Type.Optional(Type.Number({ minimum: -2, maximum: 2 })),
    presence_penalty: Type.Optional(Type.Number({ minimum: -2, maximum: 2 })),
    /** Only one choice per request: more is {@link unsupported}. */
    n: Type.Optional(
      Type.Integer({
        minimum: 1,
        maximum: 1,
        ...unsupported('maximum', 'Only one choice per request is supported by this server; send `n: 1` or leave it out.'),
      }),
    ),
    stream_options: Type.Optional(Type.Union([Type.Null(), streamOptions])),
    user: Type.Optional(Type.String({ maxLength: 256 })),
    // What magus's engines do not offer: accepted only empty, plain or null.
    tools: Type.Optional(
      Type.Union([Type.Null(), Type.Array(tool, { maxItems: MAX_TOOLS })], { description: `null or a list of up to ${MAX_TOOLS} function tools` }),
    ),
    tool_choice: Type.Optional(
      Type.Union([Type.Null(), toolChoice], { description: '"none", "auto", "required" or {"type": "function", "function": {"name"}}' }),
    ),
    parallel_tool_calls: Type.Optional(Type.Union([Type.Null(), Type.Boolean()])),
    functions: Type.Optional(
      Type.Union(
        [
          Type.Null(),
          Type.Array(Type.Unknown(), {
            maxItems: 0,
            ...unsupported('maxItems', 'Function calls are not supported by this server; send the request without `functions`.'),
          }),
        ],
        {
          description: 'null or an empty list',
        },
      ),
    ),
    response_format: Type.Optional(
      Type.Union([Type.Null(), responseFormatByType], {
        description: 'null, {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema"}}',
      }),
    ),
    logprobs: Type.Optional(Type.Union([Type.Null(), Type.Boolean()], { description: 'a boolean or null' })),
    /** Alternatives per token, with `logprobs: true`. */
    top_logprobs: Type.Optional(Type.Union([Type.Null(), topLogprobs], { description: `an integer from 0 to ${MAX_TOP_LOGPROBS} or null` })),
  },
  // For readers of the OpenAPI description (and its fuzzer's first case): `magus dev`'s model.
  { examples: [{ model: 'demo', messages: [{ role: 'user', content: 'Hello' }] }] },
);
/** The validated body. */
export type ChatCompletionBody = Static<typeof ChatCompletionBody>;

/**
 * The fields of {@link ChatCompletionBody} the gateway forwards to the engine as the client sent
 * them: a field the engine honours is added here (and to the engine's `normalizeRequest`), and
 * the gateway, the bridge and the engine all take it from this list.
 */
export const FORWARDED_FIELDS = [
  'model',
  'temperature',
  'top_p',
  'seed',
  'stop',
  'frequency_penalty',
  'presence_penalty',
  'response_format',
  'tools',
  'tool_choice',
  'parallel_tool_calls',
  'logprobs',
  'top_logprobs',
] as const;
export type ForwardedField = (typeof FORWARDED_FIELDS)[number];

/** The {@link FORWARDED_FIELDS} `body` carries. */
export function forwardedFields(body: ChatCompletionBody): Pick<ChatCompletionBody, ForwardedField> {
  const out: Record<string, unknown> = {};
  for (const field of FORWARDED_FIELDS) if (body[field] !== undefined) out[field] = body[field];
  return out as Pick<ChatCompletionBody, ForwardedField>;
}

/** A message as engines take it: one string of content (the gateway joins text parts; an assistant's null is `""`). */
export const ChatMessage = Type.Object({
  role: StringEnum(['system', 'user', 'assistant', 'tool']),
  content: Type.String(),
  /** An assistant turn's calls. */
  tool_calls: Type.Optional(Type.Array(toolCall, { maxItems: MAX_TOOLS })),
  /** A tool result: the call it answers. */
  tool_call_id: Type.Optional(Type.String({ minLength: 1, maxLength: 256 })),
});
export type ChatMessage = Static<typeof ChatMessage>;

/**
 * Sampling fields that are not OpenAI's, in the spelling of llama.cpp's server and vLLM: the
 * gateway sets them from the model's defaults (shared/sampling.ts), a client's body has no such
 * fields. The llama.cpp engine honours them; dllama-api ignores them (it has no top-k).
 */
export const modelSamplingFields = {
  /** 0 = off. */
  top_k: Type.Optional(Type.Integer({ minimum: 0, maximum: MAX_TOP_K })),
  /** 1 = off; llama.cpp's repeat penalty over the last 64 tokens. */
  repetition_penalty: Type.Optional(Type.Number({ exclusiveMinimum: 0, maximum: SAMPLING_BOUNDS.repetition_penalty.maximum })),
};

/** The chat-completion request an engine gets (`InferenceRequest.body`). */
export const ChatCompletionRequest = Type.Object({
  ...Type.Pick(ChatCompletionBody, FORWARDED_FIELDS).properties,
  ...modelSamplingFields,
  messages: Type.Array(ChatMessage, { minItems: 1, maxItems: MAX_MESSAGES }),
  stream: Type.Optional(Type.Boolean()),
  /** `max_tokens` ?? `max_completion_tokens` of the body. */
  max_tokens: Type.Optional(maxTokens),
  /** Streams only: `include_usage` ends the stream with a chunk that carries `usage` (no choices). */
  stream_options: Type.Optional(streamOptions),
  /** As the client sent it (checked by the gateway); without the gateway's `discriminator`, which engines' validators do not know. */
  response_format: Type.Optional(Type.Union([Type.Null(), responseFormat])),
});
export type ChatCompletionRequest = Static<typeof ChatCompletionRequest>;

/** The fields of a request (the client's body or the engine's) that ask for more than plain chat. */
interface NeedsOf {
  logprobs?: boolean | null;
  response_format?: ResponseFormat | null;
  tools?: readonly unknown[] | null;
  messages?: readonly { role: string; tool_calls?: readonly unknown[] | null }[];
}

/** What a request needs beyond plain chat, each with the field that asks for it. */
export function neededCapabilities(body: NeedsOf): { capability: Capability; field: string }[] {
  const out: { capability: Capability; field: string }[] = [];
  if ((body.tools?.length ?? 0) > 0) out.push({ capability: 'tools', field: 'tools' });
  const toolTurn = body.messages?.findIndex((m) => m.role === 'tool' || ('tool_calls' in m && (m.tool_calls?.length ?? 0) > 0)) ?? -1;
  if (toolTurn >= 0) out.push({ capability: 'tools', field: `messages[${toolTurn}]` });
  const format = body.response_format?.type;
  if (format === 'json_object' || format === 'json_schema') out.push({ capability: 'json_schema', field: 'response_format' });
  if (body.logprobs === true) out.push({ capability: 'logprobs', field: 'logprobs' });
  return out;
}

/** The first need `engine` cannot serve, as the sentence of a 400 `unsupported_feature`, or undefined. */
export function unsupportedBy(engine: EngineKind, body: NeedsOf): { field: string; message: string } | undefined {
  const missing = neededCapabilities(body).find((n) => !engineCan(engine, n.capability));
  if (!missing) return undefined;
  return {
    field: missing.field,
    message: `\`${missing.field}\` (${missing.capability}) is not supported by this model's engine, ${engineOf(engine).name}; it serves plain chat.`,
  };
}

/**
 * A request refused by every engine a model may run on (each engine's refusal from `refusal`),
 * as the first engine's refusal; accepted when any engine serves it, or none is known (the
 * instance's bridge then decides).
 */
export function refusedOnEvery<R>(engines: readonly EngineKind[], refusal: (engine: EngineKind) => R | undefined): R | undefined {
  const refusals = engines.map(refusal);
  return refusals.length > 0 && refusals.every((r) => r !== undefined) ? refusals[0] : undefined;
}

/** A function the model may call, its parameters' schema as sent (checked: magus's grammar enforces it). */
export interface ToolSpec {
  name: string;
  description?: string;
  /** Absent: a call without arguments. */
  params?: GrammarSchema;
}

/** What a request's structure asks for, checked: {@link checkStructure}. */
export interface Structure {
  /** Structured output: any JSON object, or JSON valid against a schema; absent = text. */
  responseFormat?: { type: 'json_object' } | { type: 'json_schema'; schema: GrammarSchema };
  /** Every tool offered, in order, whatever `tool_choice` says. */
  tools: ToolSpec[];
}

/** A 400 a request's structure earns, naming its field (`param`) in OpenAI's spelling. */
export interface StructureProblem {
  message: string;
  param: string;
  code: 'unsupported_schema' | 'invalid_value' | 'unsupported_feature';
}

/** Schemas checked lately (a client sends the same one again and again): their text and where, to the converter's answer. */
const checkedSchemas = new Map<string, { ok: true } | { ok: false; at: string; message: string }>();
const CHECKED_SCHEMAS = 256;

/** Whether magus's grammar (shared/grammar) enforces `schema`: its converter's answer, kept for the last {@link CHECKED_SCHEMAS} schemas. */
function grammarCheck(schema: Record<string, unknown>, at: string): { ok: true } | { ok: false; at: string; message: string } {
  const key = `${at}\n${JSON.stringify(schema)}`;
  let answer = checkedSchemas.get(key);
  if (answer) checkedSchemas.delete(key);
  else {
    const converted = schemaToGbnf(schema, at);
    answer = converted.ok ? { ok: true } : { ok: false, at: converted.at, message: converted.message };
  }
  checkedSchemas.set(key, answer);
  if (checkedSchemas.size > CHECKED_SCHEMAS) checkedSchemas.delete(checkedSchemas.keys().next().value!);
  return answer;
}

/** The fields {@link checkStructure} reads, as the gateway's and the engine's bodies both have them. */
interface StructureOf {
  logprobs?: boolean | null;
  top_logprobs?: number | null;
  response_format?: ResponseFormat | null;
  tools?: readonly Tool[] | null;
  tool_choice?: ToolChoice | null;
  messages: readonly { role: string; tool_calls?: readonly { id: string }[] | null; tool_call_id?: string | null }[];
}

/**
 * The rules a request's structured output and tools must keep beyond what their schemas say,
 * as OpenAI states them, and the grammar schemas they become: the one check the gateway makes
 * before anything is queued and the engine makes at its own boundary, so both refuse the same
 * requests with the same words. Every schema (the response format's, each tool's parameters,
 * under `tool_choice: "none"` too) must be at most {@link MAX_SCHEMA_BYTES} and enforceable by
 * the grammar; tool names are unique; a named `tool_choice` names a tool; `required` needs one;
 * each `tool` message answers a call an earlier assistant message made; `top_logprobs` needs
 * `logprobs`, which tools may not come with.
 */
export function checkStructure(body: StructureOf): { ok: true; structure: Structure } | { ok: false; problem: StructureProblem } {
  const fail = (message: string, param: string, code: StructureProblem['code'] = 'invalid_value') => ({
    ok: false as const,
    problem: { message, param, code },
  });
  const convert = (schema: Record<string, unknown>, param: string): { ok: true; schema: GrammarSchema } | { ok: false; problem: StructureProblem } => {
    if (JSON.stringify(schema).length > MAX_SCHEMA_BYTES) return fail(`The schema is larger than ${MAX_SCHEMA_BYTES} bytes.`, param);
    const converted = grammarCheck(schema, param);
    return converted.ok ? { ok: true, schema } : fail(converted.message, converted.at, 'unsupported_schema');
  };
  const structure: Structure = { tools: [] };
  const format = body.response_format;
  if (format?.type === 'json_object' || (format?.type === 'json_schema' && format.json_schema.schema === undefined))
    structure.responseFormat = { type: 'json_object' };
  else if (format?.type === 'json_schema') {
    const converted = convert(format.json_schema.schema!, 'response_format.json_schema.schema');
    if (!converted.ok) return converted;
    structure.responseFormat = { type: 'json_schema', schema: converted.schema };
  }
  const names = new Set<string>();
  for (const [i, t] of (body.tools ?? []).entries()) {
    const { name, description, parameters } = t.function;
    if (names.has(name)) return fail(`Tool names must be unique: '${name}' is given twice.`, `tools[${i}].function.name`);
    names.add(name);
    const spec: ToolSpec = { name, ...(description ? { description } : {}) };
    if (parameters !== undefined) {
      const converted = convert(parameters, `tools[${i}].function.parameters`);
      if (!converted.ok) return converted;
      spec.params = converted.schema;
    }
    structure.tools.push(spec);
  }
  const choice = body.tool_choice;
  if (choice === 'required' && names.size === 0) return fail("tool_choice 'required' needs at least one tool in `tools`.", 'tool_choice');
  if (typeof choice === 'object' && choice !== null && !names.has(choice.function.name)) {
    return fail(`tool_choice names '${choice.function.name}', which is not among the tools.`, 'tool_choice.function.name');
  }
  // Under `auto` the model chooses whether to call with node-llama-cpp's function calling, whose
  // grammar is node-llama-cpp's: its arguments' schemas must be ones that grammar enforces
  // (shared/json-schema.ts); a forced call and a response format take magus's own (shared/grammar).
  if (structure.tools.length > 0 && (choice === undefined || choice === null || choice === 'auto')) {
    for (const [i, t] of structure.tools.entries()) {
      const converted = t.params && toGrammarSchema(t.params, `tools[${i}].function.parameters`);
      if (converted && !converted.ok)
        return fail(
          `${converted.message} With tool_choice 'auto' the arguments' grammar is node-llama-cpp's; with 'required' or a named function, magus's enforces it.`,
          converted.at,
          'unsupported_schema',
        );
    }
  }
  if (body.top_logprobs != null && body.logprobs !== true) return fail('`top_logprobs` needs `logprobs: true`.', 'top_logprobs');
  // Log-probabilities come from magus's own token loop (engine/decode.ts), which serves a response
  // format's grammar but not tool calls (node-llama-cpp's).
  if (body.logprobs === true && structure.tools.length > 0 && body.tool_choice !== 'none') {
    return fail('Log-probabilities with tools are not supported by this server; send one or the other.', 'logprobs', 'unsupported_feature');
  }
  const calls = new Set<string>();
  for (const [i, m] of body.messages.entries()) {
    if (m.role === 'assistant') for (const c of m.tool_calls ?? []) calls.add(c.id);
    if (m.role === 'tool' && (!m.tool_call_id || !calls.has(m.tool_call_id))) {
      return fail(`messages[${i}] answers tool call '${m.tool_call_id ?? ''}', which no earlier assistant message made.`, `messages[${i}].tool_call_id`);
    }
  }
  return { ok: true, structure };
}

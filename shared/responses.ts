/**
 * OpenAI's Responses API request, declared once (TypeBox, types derived), as shared/chat.ts
 * declares the chat request, and its translation into that chat request: the gateway serves a
 * response as a chat completion of the conversation the response's chain holds.
 *
 * - {@link ResponsesBody}: the body `POST /v1/responses` accepts (its route schema, published as
 *   is in `/openapi.json`). Its fields reuse chat's declarations and bounds; what asks for more
 *   than magus does (built-in tools, reasoning, included extras, conversation
 *   objects …) accepts only its empty or null form and is otherwise refused with a 400
 *   `unsupported_feature` naming the field (chat's `x-unsupported` annotation), never ignored.
 * - {@link toChatTurn}: input items → chat messages (consecutive `function_call` items become one
 *   assistant turn's `tool_calls`; `function_call_output` a `tool` message), `instructions` → a
 *   leading system message (this request's only: instructions are not inherited along a chain),
 *   `text.format` → `response_format`, function tools → chat tools, `max_output_tokens` →
 *   `max_tokens`; with {@link chatParamToResponses} a 400 that chat's checks give names the
 *   Responses field.
 */
import { Type, type Static, type TSchema } from '@sinclair/typebox';
import {
  ChatCompletionBody,
  describedBy,
  jsonSchemaObject,
  MAX_MESSAGES,
  MAX_TOOLS,
  maxTokens,
  strictFlag,
  StringEnum,
  toolName,
  topLogprobs,
  unsupported,
  type ChatCompletionRequest,
  type ChatMessage,
  type ResponseFormat,
  type Tool,
  type ToolCall,
  type ToolChoice,
} from './chat';

/** What `include` asks for log-probabilities with (each output text's `logprobs`); `top_logprobs` alternatives per token. */
export const LOGPROBS_INCLUDE = 'message.output_text.logprobs';

/** Longest text of one message, part, instruction or tool output, in characters. */
export const MAX_TEXT_CHARS = 4 * 1024 * 1024;
/** Longest id a client may quote (a response's, a call's, an item's). */
const MAX_ID_CHARS = 256;

const nullable = <T extends TSchema>(schema: T) => Type.Union([Type.Null(), schema]);

/**
 * Options that check an object's `type` before anything else: Ajv stops at the first failure and
 * checks `allOf` before `required` and `properties`, so an unsupported kind (a built-in tool has
 * no `name`, an image part no `text`) is refused as unsupported, not as a missing field.
 */
const typeFirst = (type: TSchema) => ({ allOf: [{ properties: { type } }] });
const text = Type.String({ maxLength: MAX_TEXT_CHARS });
const callId = Type.String({ minLength: 1, maxLength: MAX_ID_CHARS });

/** A text part of a message: what a client writes (`input_text`) or replays of an answer (`output_text`). */
const textPartType = StringEnum(
  ['input_text', 'output_text'],
  unsupported('enum', 'Only text content (`input_text`, `output_text`) is supported by this server.'),
);
const textPart = Type.Object({ type: textPartType, text }, typeFirst(textPartType));
/**
 * A message's or a tool output's content: a string, or a list of text parts (joined). The list
 * first: Ajv reports the branches' failures in order, so a 400 names what is wrong inside a list.
 */
const content = Type.Union([Type.Array(textPart, { maxItems: 1024 }), text], { description: 'a string or a list of input_text/output_text parts' });

const ITEM_TYPES = ['message', 'function_call', 'function_call_output'] as const;

/** An input item: a message, a function call the model made, or its output. */
export type ResponseInputItem =
  | { type?: 'message'; role: 'user' | 'system' | 'developer' | 'assistant'; content: string | Static<typeof textPart>[]; id?: string; status?: string }
  | { type: 'function_call'; call_id: string; name: string; arguments: string; id?: string; status?: string }
  | { type: 'function_call_output'; call_id: string; output: string | Static<typeof textPart>[]; id?: string; status?: string };

/**
 * One input item. A message's `type` may be left out (OpenAI's "easy" message), so the item is
 * not chosen by a discriminator: each kind's required fields are conditions on `type`, and a 400
 * names the missing field. Other item kinds (reasoning, item references, built-in tools' calls)
 * are {@link unsupported}.
 */
const itemType = StringEnum(
  [...ITEM_TYPES],
  unsupported('enum', 'Only input items of type `message`, `function_call` and `function_call_output` are supported by this server.'),
);
const inputItem = Type.Unsafe<ResponseInputItem>({
  type: 'object',
  properties: {
    type: itemType,
    role: StringEnum(['user', 'system', 'developer', 'assistant']),
    content,
    call_id: callId,
    name: toolName,
    arguments: Type.String({ maxLength: 1_000_000 }),
    output: content,
    id: Type.String({ maxLength: MAX_ID_CHARS }),
    status: Type.String({ maxLength: 64 }),
  },
  allOf: [
    ...typeFirst(itemType).allOf,
    { if: { required: ['type'], properties: { type: { const: 'function_call' } } }, then: { required: ['call_id', 'name', 'arguments'] } },
    { if: { required: ['type'], properties: { type: { const: 'function_call_output' } } }, then: { required: ['call_id', 'output'] } },
    { if: { required: ['type'], properties: { type: { enum: ['function_call', 'function_call_output'] } } }, else: { required: ['role', 'content'] } },
  ],
});

/** Most input items of one request: as many as chat's messages. */
export const MAX_INPUT_ITEMS = MAX_MESSAGES;

/** A function the model may call (Responses spell chat's `function` object flat). Built-in tools are {@link unsupported}. */
const toolType = StringEnum(
  ['function'],
  unsupported(
    'enum',
    'Only function tools are supported by this server: built-in tools (web search, file search, computer use, code interpreter, MCP …) are not.',
  ),
);
const functionTool = Type.Object(
  {
    type: toolType,
    name: toolName,
    description: Type.Optional(nullable(Type.String({ maxLength: 4096 }))),
    parameters: Type.Optional(nullable(Type.Record(Type.String(), Type.Unknown(), { description: 'a JSON Schema object' }))),
    strict: strictFlag,
  },
  typeFirst(toolType),
);
export type ResponsesTool = Static<typeof functionTool>;

const toolChoiceType = StringEnum(
  ['function'],
  unsupported('enum', 'tool_choice may name a function only: built-in tools and allowed-tools lists are not supported by this server.'),
);
const toolChoice = Type.Union([StringEnum(['none', 'auto', 'required']), Type.Object({ type: toolChoiceType, name: toolName }, typeFirst(toolChoiceType))], {
  description: '"none", "auto", "required" or {"type": "function", "name"}',
});

/** `text.format`, chosen by `type` (as chat's `response_format`): the json_schema fields are chat's. */
const textFormat = Type.Unsafe<
  | { type: 'text' }
  | { type: 'json_object' }
  | { type: 'json_schema'; name: string; schema?: Record<string, unknown>; description?: string; strict?: boolean | null }
>({
  type: 'object',
  required: ['type'],
  discriminator: { propertyName: 'type' },
  oneOf: [
    Type.Object({ type: StringEnum(['text']) }),
    Type.Object({ type: StringEnum(['json_object']) }),
    Type.Object({ type: StringEnum(['json_schema']), name: toolName, description: describedBy, schema: jsonSchemaObject, strict: strictFlag }),
  ],
});
export type ResponsesTextFormat = Static<typeof textFormat>;
const textConfig = Type.Object({ format: Type.Optional(textFormat), verbosity: Type.Optional(nullable(StringEnum(['low', 'medium', 'high']))) });

/** OpenAI's bound on `metadata`: 16 pairs, keys of at most 64 characters, values of at most 512. */
const metadata = Type.Record(Type.String({ maxLength: 64 }), Type.String({ maxLength: 512 }), {
  maxProperties: 16,
  description: 'at most 16 string pairs (keys ≤ 64, values ≤ 512 characters)',
});

/** Chat's own declarations of the fields both requests have. */
const { model, temperature, top_p, user } = Type.Required(Type.Pick(ChatCompletionBody, ['model', 'temperature', 'top_p', 'user'])).properties;

/** `POST /v1/responses`: the body the gateway accepts. */
export const ResponsesBody = Type.Object(
  {
    model,
    // The list first, as in `content`.
    input: Type.Union([Type.Array(inputItem, { minItems: 1, maxItems: MAX_INPUT_ITEMS }), text], {
      description: `a string, or a list of 1 to ${MAX_INPUT_ITEMS} input items`,
    }),
    instructions: Type.Optional(nullable(text)),
    max_output_tokens: Type.Optional(nullable(maxTokens)),
    temperature: Type.Optional(nullable(temperature)),
    top_p: Type.Optional(nullable(top_p)),
    tools: Type.Optional(Type.Array(functionTool, { maxItems: MAX_TOOLS })),
    tool_choice: Type.Optional(toolChoice),
    parallel_tool_calls: Type.Optional(nullable(Type.Boolean())),
    text: Type.Optional(textConfig),
    previous_response_id: Type.Optional(nullable(Type.String({ minLength: 1, maxLength: MAX_ID_CHARS }))),
    store: Type.Optional(nullable(Type.Boolean())),
    stream: Type.Optional(nullable(Type.Boolean())),
    stream_options: Type.Optional(nullable(Type.Object({ include_obfuscation: Type.Optional(Type.Boolean()) }))),
    metadata: Type.Optional(nullable(metadata)),
    user: Type.Optional(user),
    // Answered at once, run without the client (gateway/routes/background.ts).
    background: Type.Optional(nullable(Type.Boolean())),
    // What magus does not do: accepted only empty, plain or null.
    include: Type.Optional(
      nullable(
        Type.Array(
          StringEnum([LOGPROBS_INCLUDE], unsupported('enum', `Of the included extras (\`include\`), only ${LOGPROBS_INCLUDE} is supported by this server.`)),
          { maxItems: 8 },
        ),
      ),
    ),
    reasoning: Type.Optional(
      nullable(Type.Object({}, { maxProperties: 0, ...unsupported('maxProperties', 'Reasoning options are not supported by this server.') })),
    ),
    conversation: Type.Optional(
      Type.Null(unsupported('type', 'Conversation objects are not supported by this server; chain responses with `previous_response_id`.')),
    ),
    prompt: Type.Optional(Type.Null(unsupported('type', 'Prompt templates are not supported by this server.'))),
    top_logprobs: Type.Optional(nullable(topLogprobs)),
    truncation: Type.Optional(
      nullable(StringEnum(['disabled'], unsupported('enum', 'Truncation of the conversation (`auto`) is not supported by this server.'))),
    ),
  },
  { examples: [{ model: 'demo', input: 'Hello' }] },
);
export type ResponsesBody = Static<typeof ResponsesBody>;

/** What a turn sends the engine, and what of it is this request's own. */
export interface ChatTurn {
  /** The engine's request: the chain's history, this request's instructions and input. */
  request: ChatCompletionRequest;
  /** This request's input as messages (without its instructions): what a stored response keeps of it. */
  input: ChatMessage[];
  /** For each message of `request.messages`, the Responses field it came from (naming it in a 400). */
  origins: string[];
}

/** A message's or a tool output's text: parts joined, as chat joins them. */
const joined = (c: string | readonly { text: string }[]): string => (typeof c === 'string' ? c : c.map((p) => p.text).join(''));

/** The input items as chat messages, each with the item it came from. */
export function inputMessages(input: ResponsesBody['input']): { messages: ChatMessage[]; origins: string[] } {
  if (typeof input === 'string') return { messages: [{ role: 'user', content: input }], origins: ['input'] };
  const messages: ChatMessage[] = [];
  const origins: string[] = [];
  for (const [i, item] of input.entries()) {
    if (item.type === 'function_call') {
      const call: ToolCall = { id: item.call_id, type: 'function', function: { name: item.name, arguments: item.arguments } };
      // The calls of one answer are consecutive items (after its text, if any): one assistant turn.
      const last = messages.at(-1);
      if (last?.role === 'assistant') (last.tool_calls ??= []).push(call);
      else {
        messages.push({ role: 'assistant', content: '', tool_calls: [call] });
        origins.push(`input[${i}]`);
      }
    } else if (item.type === 'function_call_output') {
      messages.push({ role: 'tool', content: joined(item.output), tool_call_id: item.call_id });
      origins.push(`input[${i}]`);
    } else {
      messages.push({ role: item.role === 'developer' ? 'system' : item.role, content: joined(item.content) });
      origins.push(`input[${i}]`);
    }
  }
  return { messages, origins };
}

/** `text.format` as chat's `response_format` (absent: text). */
export function responseFormatOf(format: ResponsesTextFormat | undefined): ResponseFormat | undefined {
  if (format === undefined || format.type !== 'json_schema') return format;
  const { type: _type, ...json_schema } = format;
  return { type: 'json_schema', json_schema };
}

/** Function tools as chat's tools. */
export function chatTools(tools: readonly ResponsesTool[]): Tool[] {
  return tools.map((t) => ({
    type: 'function',
    function: {
      name: t.name,
      ...(t.description != null ? { description: t.description } : {}),
      ...(t.parameters != null ? { parameters: t.parameters } : {}),
      ...(t.strict != null ? { strict: t.strict } : {}),
    },
  }));
}

/** `tool_choice` as chat's. */
export function chatToolChoice(choice: NonNullable<ResponsesBody['tool_choice']>): ToolChoice {
  return typeof choice === 'string' ? choice : { type: 'function', function: { name: choice.name } };
}

/**
 * The chat request of a response: `history` (the chain's messages, oldest first) after this
 * request's instructions, then its input. `stream` is the engine's (the gateway streams from it
 * whatever the client asked, when it relays events).
 */
export function toChatTurn(body: ResponsesBody, history: readonly ChatMessage[], stream: boolean): ChatTurn {
  const own = inputMessages(body.input);
  const lead: ChatMessage[] = body.instructions != null ? [{ role: 'system', content: body.instructions }] : [];
  const request: ChatCompletionRequest = { model: body.model, messages: [...lead, ...history, ...own.messages], stream };
  if (body.temperature != null) request.temperature = body.temperature;
  if (body.top_p != null) request.top_p = body.top_p;
  if (body.max_output_tokens != null) request.max_tokens = body.max_output_tokens;
  const format = responseFormatOf(body.text?.format);
  if (format !== undefined) request.response_format = format;
  if (body.tools !== undefined && body.tools.length > 0) request.tools = chatTools(body.tools);
  if (body.tool_choice !== undefined) request.tool_choice = chatToolChoice(body.tool_choice);
  if (body.parallel_tool_calls != null) request.parallel_tool_calls = body.parallel_tool_calls;
  if (wantsLogprobs(body)) {
    request.logprobs = true;
    request.top_logprobs = body.top_logprobs ?? 0;
  }
  const origins = [...lead.map(() => 'instructions'), ...history.map(() => 'previous_response_id'), ...own.origins];
  return { request, input: own.messages, origins };
}

/** Whether a request asks for log-probabilities: `include` names them, or it says how many alternatives (`top_logprobs`). */
export const wantsLogprobs = (body: Pick<ResponsesBody, 'include' | 'top_logprobs'>): boolean =>
  (body.include ?? []).includes(LOGPROBS_INCLUDE) || body.top_logprobs != null;

/** Every field chat's checks name in `text` (a 400's message) as {@link chatParamToResponses} spells it. */
export function chatTextToResponses(text: string, origins: readonly string[]): string {
  return text.replace(/response_format(?:\.json_schema)?|tool_choice\.function|tools\[\d+\]\.function|messages\[\d+\](?:\.tool_call_id)?/g, (param) =>
    chatParamToResponses(param, origins),
  );
}

/**
 * A field chat's checks name (shared/chat.ts `unsupportedBy`, `checkStructure`) as the Responses
 * request spells it: `response_format.json_schema.schema.x` → `text.format.schema.x`,
 * `tools[0].function.parameters` → `tools[0].parameters`, `logprobs` → `include`, `messages[3]…` → the input item (or
 * `previous_response_id`, `instructions`) the message came from.
 */
export function chatParamToResponses(param: string, origins: readonly string[]): string {
  if (param === 'logprobs') return 'include';
  if (param.startsWith('response_format')) return param.replace(/^response_format(\.json_schema)?/, 'text.format');
  if (param.startsWith('tool_choice.function')) return param.replace('tool_choice.function', 'tool_choice');
  const tool = /^tools\[(\d+)\]\.function/.exec(param);
  if (tool) return param.replace(tool[0], `tools[${tool[1]}]`);
  const message = /^messages\[(\d+)\](.*)$/.exec(param);
  if (message) {
    const origin = origins[Number(message[1])] ?? 'input';
    // A tool message's `tool_call_id` is its item's `call_id`.
    return origin.startsWith('input[') ? `${origin}${message[2] === '.tool_call_id' ? '.call_id' : message[2]}` : origin;
  }
  return param;
}

/** A text part of an answer. */
export interface OutputText {
  type: 'output_text';
  text: string;
  annotations: never[];
  /** With `include: ["message.output_text.logprobs"]`: each token of `text`, as chat's `logprobs.content`. */
  logprobs?: { token: string; logprob: number; bytes: number[]; top_logprobs: { token: string; logprob: number; bytes: number[] }[] }[];
}

/** An item of a response's `output`: the assistant's text, or a call of one of the request's functions. */
export type OutputItem =
  | { type: 'message'; id: string; status: 'in_progress' | 'completed' | 'incomplete'; role: 'assistant'; content: OutputText[] }
  | { type: 'function_call'; id: string; call_id: string; name: string; arguments: string; status: 'in_progress' | 'completed' | 'incomplete' };

/** A response's token counts (chat's `usage` under the Responses API's names). */
export interface ResponseUsage {
  input_tokens: number;
  input_tokens_details: { cached_tokens: number };
  output_tokens: number;
  output_tokens_details: { reasoning_tokens: number };
  total_tokens: number;
}

/** OpenAI's response object: what `POST /v1/responses` and `GET /v1/responses/{id}` answer. */
export interface ResponseObject {
  id: string;
  object: 'response';
  created_at: number;
  status: 'queued' | 'in_progress' | 'completed' | 'incomplete' | 'failed' | 'cancelled';
  /** Run without the client (`background: true`): polled, streamed again or cancelled by id. */
  background: boolean;
  incomplete_details: { reason: 'max_output_tokens' } | null;
  model: string;
  output: OutputItem[];
  instructions: string | null;
  max_output_tokens: number | null;
  temperature: number | null;
  top_p: number | null;
  top_logprobs: number | null;
  tools: ResponsesTool[];
  tool_choice: NonNullable<ResponsesBody['tool_choice']>;
  parallel_tool_calls: boolean;
  text: { format: ResponsesTextFormat };
  previous_response_id: string | null;
  store: boolean;
  metadata: Record<string, string>;
  usage: ResponseUsage | null;
  error: { code: string; message: string } | null;
  user?: string;
}

/** Whether a response with `status` is still being answered (`queued` or `in_progress`). */
export const isAnswering = (status: ResponseObject['status']): boolean => status === 'queued' || status === 'in_progress';

/** The response `id` will become, before any of its answer: what the request asked, echoed. */
export function pendingResponse(id: string, body: ResponsesBody, createdAt: number): ResponseObject {
  return {
    id,
    object: 'response',
    created_at: createdAt,
    status: body.background === true ? 'queued' : 'in_progress',
    background: body.background === true,
    incomplete_details: null,
    model: body.model,
    output: [],
    instructions: body.instructions ?? null,
    max_output_tokens: body.max_output_tokens ?? null,
    temperature: body.temperature ?? null,
    top_p: body.top_p ?? null,
    top_logprobs: body.top_logprobs ?? null,
    tools: body.tools ?? [],
    tool_choice: body.tool_choice ?? 'auto',
    parallel_tool_calls: body.parallel_tool_calls ?? true,
    text: { format: body.text?.format ?? { type: 'text' } },
    previous_response_id: body.previous_response_id ?? null,
    store: body.store !== false,
    metadata: body.metadata ?? {},
    usage: null,
    error: null,
    ...(body.user !== undefined ? { user: body.user } : {}),
  };
}

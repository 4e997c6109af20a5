/**
 * The llama.cpp backend: node-llama-cpp's prebuilt CPU binary, one context with one sequence per
 * slot, and a `LlamaChat` per sequence. A sequence keeps its KV cache between requests and
 * node-llama-cpp re-evaluates only what differs from it, so the next turn of a conversation served
 * by the same slot costs only its new tokens (what dllama-api's "naive cache" does for its one
 * sequence); {@link LlamaBackend.affinity} steers a conversation back to the slot that holds it.
 *
 * The prompt is built by the chat wrapper node-llama-cpp resolves from the GGUF's
 * `tokenizer.chat_template`: a built-in wrapper when it renders the template identically,
 * otherwise the Jinja template itself; only when the template is missing or cannot be used does
 * it guess one from the model's name (logged at start).
 */
import type {
  ChatHistoryItem,
  ChatModelFunctions,
  ChatWrapper,
  LLamaContextualRepeatPenalty,
  Llama,
  LlamaChat,
  LlamaGrammar,
  LlamaContextSequence,
  LlamaEmbeddingContext,
  LlamaModel,
  Token,
} from 'node-llama-cpp' with { 'resolution-mode': 'import' };
import type * as NodeLlamaCppModule from 'node-llama-cpp' with { 'resolution-mode': 'import' };
import { createHash } from 'node:crypto';
import type { ChatMessage, ToolCall, ToolSpec } from '../shared/chat';
import {
  invalidRequest,
  type EmbeddingBackend,
  type TextRequest,
  type ChatRequest,
  type CompletionBackend,
  type GenerationIO,
  type GenerationResult,
  type PreparedCompletion,
} from './api';
import { RESUME_MISMATCH } from '../shared/continuation';
import { schemaToGbnf } from '../shared/grammar';
import { toGrammarSchema } from '../shared/json-schema';
import { BatchShares, decode, Erasures, type DecodeOptions, type TokenGrammar } from './decode';
import { KvSnapshots, modelKey, type SnapshotStats } from './snapshots';

type NodeLlamaCpp = typeof NodeLlamaCppModule;

/**
 * node-llama-cpp is ESM-only (with top-level await, so `require` cannot load it even where Node
 * supports require(esm)). tsc keeps `import()` in CommonJS output, but swc (jest, swc-node) turns
 * it into `require`; a function built at run time hides the `import()` from every compiler.
 */
// eslint-disable-next-line @typescript-eslint/no-implied-eval -- a constant string, see above
const importEsm = new Function('specifier', 'return import(specifier)') as (specifier: string) => Promise<unknown>;

/**
 * The most tokens one evaluation of the context takes (node-llama-cpp's `batchSize`, llama.cpp's
 * `n_batch` and `n_ubatch`): under 64, so a token's KV and logits do not depend on how it was
 * evaluated. llama.cpp's CPU flash attention computes 64 or more rows of one sequence in tiles
 * (`GGML_FA_TILE_Q`) that round differently from its row-by-row path, which a generated token
 * always takes: with bigger batches a prompt evaluated cold, the prefix a slot kept, an answer
 * continued from its tokens and the same prompt beside other sequences each held slightly other
 * numbers, and a greedy answer could part from the undisturbed one (engine/exact.test.ts).
 * Prompts evaluate ~1.7× slower (bench/README.md, "Continuations that equal the undisturbed answer"). Two of llama.cpp's
 * choices by batch shape remain (engine/README.md): a lone single-token step over 512 or more
 * cached tokens splits its attention across threads, and for Q8_0, Q4_0, F16 and F32 weights a
 * matrix times one row is a vector dot, times two or more llamafile's sgemm.
 */
export const EXACT_BATCH = 63;

/** node-llama-cpp and llama.cpp on the CPU with `threads`, its prebuilt binaries only (nothing downloaded or built); errors to `log`. */
export async function cpuLlama(threads: number, log: (line: string) => void = () => undefined): Promise<{ lib: NodeLlamaCpp; llama: Llama }> {
  const lib = (await importEsm('node-llama-cpp')) as NodeLlamaCpp;
  const llama = await lib.getLlama({
    gpu: false,
    build: 'never',
    usePrebuiltBinaries: true,
    skipDownload: true,
    progressLogs: false,
    maxThreads: threads,
    logLevel: lib.LlamaLogLevel.error,
    logger: (level, message) => log(`llama.cpp [${level}]: ${message.trimEnd()}`),
  });
  return { lib, llama };
}

export interface LlamaBackendOptions {
  modelPath: string;
  slots: number;
  /** CPU threads for evaluation. */
  threads: number;
  /** Tokens per slot; capped at the model's training context. */
  contextSize: number;
  /** Where the slots' KV caches are saved for the engine that follows this one (snapshots.ts), and what the files may take; absent: not saved. */
  snapshots?: { dir: string; maxBytes: number };
  log?: (message: string) => void;
}

/** How the prompt format was chosen (for logs and `/health`). */
export interface ChatTemplateInfo {
  /** node-llama-cpp's wrapper name, e.g. `Llama 3`, `JinjaTemplate`. */
  wrapper: string;
  /** `gguf`: renders the GGUF's template; `fallback`: the template was unusable; `guessed`: there was none. */
  source: 'gguf' | 'fallback' | 'guessed';
  note: string;
}

/** A call's arguments as the model's history holds them: parsed JSON, or the text when it is not JSON. */
function parsedArguments(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

/**
 * OpenAI messages as node-llama-cpp's history: an assistant turn's tool calls become function
 * calls of its response, each with the result the `tool` message answering it gave (the chat
 * wrapper renders calls and results in the model's format); the tool messages are consumed so.
 */
function toHistory(messages: readonly ChatMessage[]): ChatHistoryItem[] {
  const results = new Map<string, string>();
  for (const m of messages) if (m.role === 'tool' && m.tool_call_id) results.set(m.tool_call_id, m.content);
  const history: ChatHistoryItem[] = [];
  for (const m of messages) {
    if (m.role === 'system') history.push({ type: 'system', text: m.content });
    else if (m.role === 'user') history.push({ type: 'user', text: m.content });
    else if (m.role === 'assistant') {
      const calls = (m.tool_calls ?? []).map((c) => ({
        type: 'functionCall' as const,
        name: c.function.name,
        params: parsedArguments(c.function.arguments),
        result: results.get(c.id) ?? '',
      }));
      history.push({ type: 'model', response: [...(m.content ? [m.content] : []), ...calls] });
    }
  }
  // The answer to generate. After a trailing assistant message this continues that message
  // (node-llama-cpp merges consecutive model turns), i.e. it acts as a prefill; after tool
  // results, the model answers with them in view.
  const last = messages[messages.length - 1];
  if (last?.role !== 'assistant' || (last.tool_calls?.length ?? 0) > 0) history.push({ type: 'model', response: [] });
  return history;
}

/**
 * A call the model made, in OpenAI's shape, with an id that is the same on every attempt at the
 * request (the bridge pins its seed): the bridge's resume compares them.
 */
function toolCall(seed: number | undefined, index: number, name: string, args: unknown): ToolCall {
  const id = `call_${createHash('sha256')
    .update(`${seed ?? 'none'}:${index}:${name}`)
    .digest('hex')
    .slice(0, 24)}`;
  return { id, type: 'function', function: { name, arguments: JSON.stringify(args ?? {}) } };
}

/**
 * `tool_choice` `required` or a named function: the answer is one call, generated as JSON under
 * a grammar (`{"name": …, "arguments": …}`, the arguments by the function's schema), with the
 * tools described to the model in a system message. node-llama-cpp's own function calling
 * (`auto`) lets the model choose whether to call at all.
 */
function forcedCallGrammarSchema(tools: readonly ToolSpec[]): Record<string, unknown> {
  const branch = (t: ToolSpec) => ({ type: 'object', properties: { name: { const: t.name }, arguments: t.params ?? { type: 'object', properties: {} } } });
  const defs: Record<string, unknown> = {};
  for (const t of tools) Object.assign(defs, (t.params?.$defs as Record<string, unknown> | undefined) ?? {});
  const schema: Record<string, unknown> = tools.length === 1 ? branch(tools[0]!) : { oneOf: tools.map(branch) };
  if (Object.keys(defs).length > 0) schema.$defs = defs;
  return schema;
}

/** `tool_choice` `required` or a named function, with tools offered. */
const isForced = (req: ChatRequest): boolean => req.tools.length > 0 && req.toolChoice !== 'auto';

/** The tools a forced call may use: the named one, or all. */
function offeredTools(req: ChatRequest): ToolSpec[] {
  const choice = req.toolChoice;
  return typeof choice === 'object' ? req.tools.filter((t) => t.name === choice.name) : req.tools;
}

/** A schema in the form node-llama-cpp's function calling builds its grammar from (checked at the boundary: shared/chat.ts `checkStructure`). */
function nodeLlamaSchema(schema: Record<string, unknown>): Record<string, unknown> {
  const converted = toGrammarSchema(schema);
  if (!converted.ok) throw invalidRequest(converted.message, converted.at, 'unsupported_schema');
  return converted.schema;
}

/** The tools as node-llama-cpp's functions (the chat wrapper documents them to the model; their params become its grammar). */
function functionsOf(tools: readonly ToolSpec[]): ChatModelFunctions {
  return Object.fromEntries(
    tools.map((t) => [
      t.name,
      {
        ...(t.description ? { description: t.description } : {}),
        ...(t.params ? { params: nodeLlamaSchema(t.params) as ChatModelFunctions[string]['params'] } : {}),
      },
    ]),
  );
}

function describeTools(tools: readonly ToolSpec[]): string {
  const lines = tools.map(
    (t) => `- ${t.name}${t.description ? `: ${t.description}` : ''}${t.params ? `\n  arguments (JSON Schema): ${JSON.stringify(t.params)}` : ''}`,
  );
  return `You call a function to answer. Reply with JSON only: {"name": <function name>, "arguments": <its arguments>}.\nFunctions:\n${lines.join('\n')}`;
}

/**
 * Prompt tokens the sequence held before a generation and kept: what it holds after, less what the
 * generation decoded (node-llama-cpp's token meter counts every token it decodes, the prompt's
 * uncached part and each sampled token fed back). LlamaChat keeps the longest common prefix of
 * the sequence and the new prompt and evaluates the rest, so this is exactly the prompt's cached
 * part; clamped, because a context shift during a long answer drops tokens from the start.
 */
export function keptTokens(heldAfter: number, decoded: number, promptTokens: number): number {
  return Math.max(0, Math.min(promptTokens, heldAfter - decoded));
}

function samePrefix(a: readonly ChatMessage[], b: readonly ChatMessage[]): number {
  const n = Math.min(a.length, b.length);
  let i = 0;
  while (i < n && a[i]!.role === b[i]!.role && a[i]!.content === b[i]!.content) i++;
  return i;
}

/** How `prepare` rendered a request with tools under `auto`, for node-llama-cpp's function calling: the history it measured, and the functions offered. */
interface Plan {
  history: ChatHistoryItem[];
  functions: ChatModelFunctions;
}

/** What a request asks of magus's own token loop (its cancellation and output come from the generation's IO). */
type DecodeSettings = Omit<DecodeOptions, 'signal' | 'onText' | 'erasures' | 'shares' | 'snapshots'>;

/** How magus's own loop samples `req`'s answer of at most `maxTokens` (and continues it, when it is a resume). */
function decodeSettings(req: ChatRequest | TextRequest, maxTokens: number): DecodeSettings {
  const { resume, logprobs, ...sampling } = req;
  return {
    ...sampling,
    maxTokens,
    ...(logprobs !== undefined ? { topLogprobs: logprobs } : {}),
    ...(resume ? { resume: { tokens: resume.tokens as Token[], text: resume.text } } : {}),
  };
}

/** How many tokens the model's vocabulary has, as its GGUF lists them. */
function vocabularyOf(model: LlamaModel): number | undefined {
  const tokens = (model.fileInfo.metadata as unknown as { tokenizer?: { ggml?: { tokens?: unknown[] } } }).tokenizer?.ggml?.tokens;
  return Array.isArray(tokens) ? tokens.length : undefined;
}

/** A resume asked of an answer magus's own loop does not produce (tools, a response format). */
const resumeUnsupported = () => invalidRequest('Only a plain chat or text answer can be resumed.', 'magus.resume', RESUME_MISMATCH);

/** Grammars kept compiled, by their schema: a client sends the same schema again and again. */
const GRAMMAR_CACHE = 64;

export class LlamaBackend implements CompletionBackend {
  /** Per slot: the conversation its KV cache holds (the last request plus its answer). */
  private readonly cached: (ChatMessage[] | undefined)[];
  /** How many tokens the vocabulary has (read at the first resume). */
  private vocabulary: number | undefined;
  /** The control tokens kept out of answers under a grammar (found at the first). */
  private control: { tokens: ReadonlySet<Token>; bias?: NodeLlamaCppModule.TokenBias } | undefined;
  /** Structured output's grammars, least recently used first (`json` for json_object). */
  private readonly grammars = new Map<string, Promise<LlamaGrammar>>();
  private embedder: LlamaEmbedder | undefined;
  /** The erasures of the context's sequences (decode.ts): one waiting holds the others' next step. */
  private readonly erasures = new Erasures();
  /** How the context's batches are shared between its sequences (decode.ts): the size of a prompt's pieces. */
  private readonly shares = new BatchShares(EXACT_BATCH);
  /** The slots' KV snapshots, when they are kept. */
  private readonly saved: KvSnapshots | undefined;

  private constructor(
    private readonly lib: NodeLlamaCpp,
    private readonly llama: Llama,
    private readonly model: LlamaModel,
    private readonly chats: LlamaChat[],
    readonly chatWrapper: ChatWrapper,
    readonly template: ChatTemplateInfo,
    /** Tokens per slot. */
    readonly contextSize: number,
    private readonly threads: number,
    snapshots: { dir: string; maxBytes: number; model: string; log: (message: string) => void } | undefined,
  ) {
    this.cached = chats.map(() => undefined);
    const sequences = chats.map((c) => c.sequence);
    try {
      this.saved = snapshots && new KvSnapshots(snapshots.dir, snapshots.model, snapshots.maxBytes, sequences, this.erasures, snapshots.log);
    } catch (err) {
      // Answers are served without (a restart evaluates them again), said once.
      snapshots?.log(`KV snapshots off: ${(err as Error).message}`);
    }
  }

  get snapshots(): SnapshotStats | undefined {
    return this.saved?.stats;
  }

  /** Loads the model and creates one sequence per slot. Nothing is downloaded or built. */
  static async load(opts: LlamaBackendOptions): Promise<LlamaBackend> {
    return (await LlamaBackend.preload(opts)).finish();
  }

  /**
   * The part of {@link load} that a standby engine does before it is needed (server.ts): the
   * library, and the model's weights mapped. `finish` makes the context and its sequences (their
   * KV cache, which a warm standby makes ahead); `dispose` frees what it loaded, unfinished.
   */
  static async preload(opts: LlamaBackendOptions): Promise<{ finish(): Promise<LlamaBackend>; dispose(): Promise<void> }> {
    const log = opts.log ?? (() => undefined);
    const { lib, llama } = await cpuLlama(opts.threads, log);
    let model: LlamaModel;
    try {
      model = await llama.loadModel({ modelPath: opts.modelPath, gpuLayers: 0 });
    } catch (err) {
      await llama.dispose();
      throw err;
    }
    let wrapped: ReturnType<typeof resolveWrapper>;
    try {
      wrapped = resolveWrapper(lib, model, log);
    } catch (err) {
      await llama.dispose();
      throw err;
    }
    const { wrapper, info } = wrapped;
    return {
      dispose: () => llama.dispose(),
      finish: async () => {
        try {
          const contextSize = Math.min(opts.contextSize, model.trainContextSize);
          if (contextSize < opts.contextSize) log(`context capped at the model's training context: ${contextSize} tokens`);
          const context = await model.createContext({ contextSize, sequences: opts.slots, threads: opts.threads, batchSize: EXACT_BATCH });
          const sequences: LlamaContextSequence[] = [];
          for (let i = 0; i < opts.slots; i++) sequences.push(context.getSequence());
          const chats = sequences.map((contextSequence) => new lib.LlamaChat({ contextSequence, chatWrapper: wrapper }));
          const snapshots = opts.snapshots ? { ...opts.snapshots, model: await modelKey(opts.modelPath), log } : undefined;
          return new LlamaBackend(lib, llama, model, chats, wrapper, info, contextSize, opts.threads, snapshots);
        } catch (err) {
          await llama.dispose();
          throw err;
        }
      },
    };
  }

  prepare(req: ChatRequest): PreparedCompletion {
    const history = toHistory(req.messages);
    // The same rendering LlamaChat evaluates (it calls the wrapper with the same history, and the
    // functions it may call; a forced call adds its system message).
    const forced = isForced(req) ? offeredTools(req) : undefined;
    const rendered = forced ? [{ type: 'system' as const, text: describeTools(forced) }, ...history] : history;
    const availableFunctions = !forced && req.tools.length > 0 ? functionsOf(req.tools) : undefined;
    const state = this.chatWrapper.generateContextState({
      chatHistory: rendered,
      ...(availableFunctions ? { availableFunctions, documentFunctionParams: true } : {}),
    });
    const tokens = state.contextText.tokenize(this.model.tokenizer);
    const promptTokens = tokens.length;
    const room = this.roomAfter(promptTokens, 'messages', 'messages');
    const maxTokens = Math.min(req.maxTokens ?? room, room);
    // The template's end-of-turn texts, which end an answer of magus's own loop as they end LlamaChat's.
    const stopTokens = state.stopGenerationTriggers.map((t) => t.tokenize(this.model.tokenizer));
    if (!forced && !availableFunctions) {
      // Plain chat and a response format (with or without log-probabilities), in magus's own loop
      // (decode.ts): the rendered prompt, sampled with a seed per position, so an interrupted
      // answer can be continued (shared/continuation.ts); a response format's grammar masks each
      // step's candidates.
      this.checkResume(req.resume, maxTokens);
      const settings = { ...decodeSettings(req, maxTokens), stopTokens };
      return {
        promptTokens,
        generate: async (slot, io) => {
          const grammar = await this.grammarFor(req.responseFormat);
          return this.plainChat(slot, req, tokens, grammar ? { ...settings, grammar: this.tokenGrammar(grammar) } : settings, io);
        },
      };
    }
    if (req.resume) throw resumeUnsupported();
    if (forced) {
      // One call, generated whole under its grammar in magus's own loop (the rendered prompt
      // starts with the system message describing the tools) and returned as `tool_calls`: no
      // text streams, and stop texts do not apply to it.
      const settings = { ...decodeSettings(req, maxTokens), stop: [], stopTokens };
      return {
        promptTokens,
        generate: async (slot, io) => {
          const grammar = (await this.grammarFor({ type: 'json_schema', schema: forcedCallGrammarSchema(forced) }))!;
          const result = await this.decodeIn(slot, tokens, { ...settings, grammar: this.tokenGrammar(grammar) }, { ...io, onText: () => undefined });
          const call = parsedArguments(result.text) as { name?: string; arguments?: unknown } | string;
          const toolCalls =
            typeof call === 'object' && call !== null && typeof call.name === 'string' ? [toolCall(req.seed, 0, call.name, call.arguments)] : undefined;
          // Cut short (max_tokens): the partial JSON, finish_reason length.
          const text = toolCalls ? '' : result.text;
          this.cached[slot] = [...req.messages, { role: 'assistant', content: text, ...(toolCalls ? { tool_calls: toolCalls } : {}) }];
          return { ...result, text, ...(toolCalls ? { toolCalls, finishReason: 'tool_calls' as const } : {}) };
        },
      };
    }
    const plan: Plan = { history: rendered, functions: availableFunctions! }; // tools under `auto`: the cases above took the others
    return { promptTokens, generate: (slot, io) => this.callFunctions(slot, req, plan, promptTokens, maxTokens, io) };
  }

  /**
   * The tokens a slot has left for the answer to a prompt of `promptTokens`: like dllama-api, a
   * `max_tokens` beyond it is cut to what fits (finish_reason: length).
   * @throws EngineHttpError (400 `context_length_exceeded` naming `param`) when the prompt fills the context
   */
  private roomAfter(promptTokens: number, what: 'messages' | 'prompt', param: string): number {
    if (promptTokens >= this.contextSize) {
      throw invalidRequest(
        `This model's maximum context length is ${this.contextSize} tokens. However, your ${what} resulted in ${promptTokens} tokens.`,
        param,
        'context_length_exceeded',
      );
    }
    return this.contextSize - promptTokens;
  }

  /**
   * Refuses, before the request queues, a resume that is not an answer of this model to continue:
   * tokens beyond its vocabulary or its `max_tokens`, or whose text does not begin with the text
   * it says was sent.
   */
  private checkResume(resume: ChatRequest['resume'], maxTokens: number): void {
    if (!resume) return;
    const vocabulary = (this.vocabulary ??= vocabularyOf(this.model) ?? Infinity);
    let problem: string | undefined;
    if (resume.tokens.length >= maxTokens) problem = `it holds ${resume.tokens.length} tokens, and the answer may have ${maxTokens}`;
    else if (resume.tokens.some((t) => t >= vocabulary)) problem = `a token id is beyond the model's vocabulary of ${vocabulary} tokens`;
    else if (!this.model.detokenize(resume.tokens as Token[]).startsWith(resume.text)) problem = 'its tokens do not begin with the text it says was sent';
    if (problem) throw invalidRequest(`The answer to resume is not one this engine can continue: ${problem}.`, 'magus.resume', RESUME_MISMATCH);
  }

  affinity(slot: number, req: ChatRequest): number {
    const cached = this.cached[slot];
    return cached ? samePrefix(cached, req.messages) : 0;
  }

  /** The grammar of a structured-output request (compiled once per schema), or undefined for text. */
  private grammarFor(format: ChatRequest['responseFormat']): Promise<LlamaGrammar> | undefined {
    if (!format) return undefined;
    const key = format.type === 'json_object' ? 'json' : JSON.stringify(format.schema);
    let grammar = this.grammars.get(key);
    if (grammar) this.grammars.delete(key);
    else {
      // magus's own grammar (shared/grammar): a JSON object for json_object (any members).
      const converted = schemaToGbnf(format.type === 'json_object' ? { type: 'object', additionalProperties: true } : format.schema);
      if (!converted.ok) throw invalidRequest(converted.message, converted.at, 'unsupported_schema');
      grammar = this.llama.createGrammar({ grammar: converted.gbnf });
      grammar.catch(() => this.grammars.delete(key));
    }
    this.grammars.set(key, grammar);
    if (this.grammars.size > GRAMMAR_CACHE) this.grammars.delete(this.grammars.keys().next().value!);
    return grammar;
  }

  /**
   * The model's control tokens that do not end a generation (a chat template's markers): llama.cpp's
   * grammar matches them by their text, which the answer then leaves out, so under a grammar they
   * are never drawn. Found once, from the vocabulary's attributes.
   */
  private controlTokens(): { tokens: ReadonlySet<Token>; bias?: NodeLlamaCppModule.TokenBias } {
    if (this.control) return this.control;
    const tokens = new Set<Token>();
    const size = (this.vocabulary ??= vocabularyOf(this.model) ?? Infinity);
    for (let t = 0; t < (Number.isFinite(size) ? size : 0); t++) {
      const token = t as Token;
      if (this.model.getTokenAttributes(token).control && !this.model.isEogToken(token)) tokens.add(token);
    }
    const bias = tokens.size > 0 ? new this.lib.TokenBias(this.model.tokenizer) : undefined;
    for (const t of tokens) bias!.set(t, 'never');
    return (this.control = { tokens, ...(bias ? { bias } : {}) });
  }

  /**
   * A fresh state of `grammar` for one answer, as magus's token loop asks it: llama.cpp's grammar
   * applied to one candidate token, and taking the token chosen. These are the natives
   * node-llama-cpp's own sampler calls (its `LlamaSampler` internals, of the pinned version: a
   * change there fails `engine.test.ts`'s structured-output tests).
   */
  private tokenGrammar(grammar: LlamaGrammar): TokenGrammar {
    const state = new this.lib.LlamaGrammarEvaluationState({ model: this.model, grammar });
    type Natives = { canBeNextTokenForGrammarEvaluationState(s: unknown, t: Token): boolean; acceptGrammarEvaluationStateToken(s: unknown, t: Token): void };
    const natives = (this.llama as unknown as { _bindings: { AddonSampler: Natives } })._bindings.AddonSampler;
    const native = (state as unknown as { _state: unknown })._state;
    const control = this.controlTokens();
    return {
      state,
      ...(control.bias ? { bias: control.bias } : {}),
      allows: (t) => !control.tokens.has(t) && natives.canBeNextTokenForGrammarEvaluationState(native, t),
      accept: (t) => natives.acceptGrammarEvaluationStateToken(native, t),
    };
  }

  /** `auto` with tools: node-llama-cpp's function calling (the model chooses whether to call; a response format is not applied to its text). */
  private async callFunctions(
    slot: number,
    req: ChatRequest,
    plan: Plan,
    promptTokens: number,
    maxTokens: number,
    io: GenerationIO,
  ): Promise<GenerationResult> {
    const chat = this.chats[slot];
    if (!chat) throw new Error(`no slot ${slot}`);
    const meter = chat.sequence.tokenMeter;
    const before = meter.getState();
    const penalties = req.frequencyPenalty !== 0 || req.presencePenalty !== 0 || req.repetitionPenalty !== 1;
    const repeatPenalty: false | LLamaContextualRepeatPenalty = penalties
      ? { penalty: req.repetitionPenalty, frequencyPenalty: req.frequencyPenalty, presencePenalty: req.presencePenalty }
      : false;
    this.cached[slot] = undefined; // until we know what the sequence holds
    const { history, functions } = plan;
    const common = {
      maxTokens,
      temperature: req.temperature,
      topP: req.topP,
      ...(req.topK !== undefined ? { topK: req.topK } : {}),
      ...(req.seed !== undefined ? { seed: req.seed } : {}),
      ...(req.stop.length > 0 ? { customStopTriggers: req.stop } : {}),
      repeatPenalty,
      signal: io.signal,
    };
    const result = await chat.generateResponse(history, {
      ...common,
      functions,
      documentFunctionParams: true,
      ...(req.parallelToolCalls ? {} : { maxParallelFunctionCalls: 1 }),
      onTextChunk: (chunk) => io.onText(chunk),
    });
    const text = result.response;
    const stopReason = result.metadata.stopReason;
    const calls = (result as { functionCalls?: { functionName: string; params: unknown }[] }).functionCalls;
    const toolCalls = calls?.length ? calls.map((c, i) => toolCall(req.seed, i, c.functionName, c.params)) : undefined;
    this.cached[slot] = [...req.messages, { role: 'assistant', content: text, ...(toolCalls ? { tool_calls: toolCalls } : {}) }];
    const used = meter.diff(before);
    return {
      text,
      finishReason: toolCalls ? 'tool_calls' : stopReason === 'maxTokens' ? 'length' : 'stop',
      ...(toolCalls ? { toolCalls } : {}),
      // Every sampled token needed one row of logits: "output" tokens in node-llama-cpp's meter.
      completionTokens: used.usedOutputTokens,
      cachedPromptTokens: keptTokens(chat.sequence.contextTokens.length, used.usedInputTokens + used.usedOutputTokens, promptTokens),
    };
  }

  private async plainChat(slot: number, req: ChatRequest, prompt: readonly Token[], o: DecodeSettings, io: GenerationIO): Promise<GenerationResult> {
    const result = await this.decodeIn(slot, prompt, o, io);
    this.cached[slot] = [...req.messages, { role: 'assistant', content: result.text }];
    return result;
  }

  prepareText(prompt: string, req: TextRequest, param: string): PreparedCompletion {
    const tokens = this.model.tokenize(prompt, false);
    const { bos, shouldPrependBosToken } = this.model.tokens;
    if (shouldPrependBosToken && bos != null) tokens.unshift(bos);
    const promptTokens = tokens.length;
    const maxTokens = Math.min(req.maxTokens, this.roomAfter(promptTokens, 'prompt', param));
    this.checkResume(req.resume, maxTokens);
    return { promptTokens, generate: (slot, io) => this.decodeIn(slot, tokens, decodeSettings(req, maxTokens), io) };
  }

  /**
   * magus's own token loop (decode.ts) in `slot`'s sequence: raw text, and chat with
   * log-probabilities. The slot's chat cache record is dropped: the caller records what it holds.
   */
  private decodeIn(slot: number, prompt: readonly Token[], o: DecodeSettings, io: GenerationIO): Promise<GenerationResult> {
    const chat = this.chats[slot];
    if (!chat) throw new Error(`no slot ${slot}`);
    this.cached[slot] = undefined;
    return decode(this.model, chat.sequence, prompt, {
      ...o,
      erasures: this.erasures,
      shares: this.shares,
      ...(this.saved ? { snapshots: this.saved } : {}),
      signal: io.signal,
      onText: (text, logprobs, tokens) => io.onText(text, logprobs, tokens),
    });
  }

  /** Embeddings by an embedding context of the model, made at the first request (pooling as the GGUF says). */
  get embeddings(): EmbeddingBackend {
    return (this.embedder ??= new LlamaEmbedder(this.model, this.contextSize, this.threads));
  }

  async dispose(): Promise<void> {
    await this.llama.dispose();
  }
}

/** {@link EmbeddingBackend} of a loaded model: one embedding context (one sequence), inputs in turn. */
class LlamaEmbedder implements EmbeddingBackend {
  private context: Promise<LlamaEmbeddingContext> | undefined;
  /** Requests in turn: each embeds its inputs with nothing else between them. */
  private turn: Promise<unknown> = Promise.resolve();
  readonly dimensions: number;
  /** Token ids the model has (ids at or above it are refused, as llama.cpp would abort on them). */
  private readonly vocabulary: number | undefined;

  constructor(
    private readonly model: LlamaModel,
    private readonly contextSize: number,
    private readonly threads: number,
  ) {
    this.dimensions = model.embeddingVectorSize;
    this.vocabulary = vocabularyOf(model);
  }

  embed(inputs: readonly (string | readonly number[])[], signal: AbortSignal): Promise<{ vectors: number[][]; promptTokens: number }> {
    const run = this.turn.then(() => this.embedAll(inputs, signal));
    this.turn = run.catch(() => undefined);
    return run;
  }

  private async embedAll(inputs: readonly (string | readonly number[])[], signal: AbortSignal): Promise<{ vectors: number[][]; promptTokens: number }> {
    const context = await (this.context ??= this.model.createEmbeddingContext({ contextSize: this.contextSize, threads: this.threads }));
    // Every input is checked before any is computed: a bad one costs nothing.
    const tokenized = inputs.map((input, i) => {
      if (typeof input !== 'string' && this.vocabulary !== undefined) {
        const bad = input.find((t) => t >= this.vocabulary!);
        if (bad !== undefined)
          throw invalidRequest(`input[${i}] holds token id ${bad}; the model's vocabulary has ${this.vocabulary} tokens.`, 'input', 'invalid_value');
      }
      const tokens = typeof input === 'string' ? this.model.tokenize(input) : (input as Token[]);
      const length = context.calculateInputLength(tokens);
      if (length >= this.contextSize)
        throw invalidRequest(`input[${i}] has ${length} tokens; this model embeds at most ${this.contextSize - 1}.`, 'input', 'context_length_exceeded');
      return { tokens, length };
    });
    const vectors: number[][] = [];
    let promptTokens = 0;
    for (const { tokens, length } of tokenized) {
      signal.throwIfAborted();
      vectors.push([...(await context.getEmbeddingFor(tokens)).vector]);
      promptTokens += length;
    }
    return { vectors, promptTokens };
  }
}

function resolveWrapper(lib: NodeLlamaCpp, model: LlamaModel, log: (m: string) => void): { wrapper: ChatWrapper; info: ChatTemplateInfo } {
  const template = model.fileInfo.metadata.tokenizer?.chat_template;
  if (typeof template !== 'string' || template.trim() === '') {
    const wrapper = lib.resolveChatWrapper(model, { warningLogs: false });
    return {
      wrapper,
      info: {
        wrapper: wrapper.wrapperName,
        source: 'guessed',
        note: `the GGUF has no chat template; using ${wrapper.wrapperName}, chosen from the model's name`,
      },
    };
  }
  try {
    const wrapper = lib.resolveChatWrapper(model, { fallbackToOtherWrappersOnJinjaError: false, warningLogs: false });
    const how = wrapper instanceof lib.JinjaTemplateChatWrapper ? 'rendered with Jinja' : `as ${wrapper.wrapperName}, which renders it identically`;
    return { wrapper, info: { wrapper: wrapper.wrapperName, source: 'gguf', note: `the GGUF's chat template, ${how}` } };
  } catch (err) {
    const wrapper = lib.resolveChatWrapper(model, { noJinja: true, warningLogs: false });
    const note = `the GGUF's chat template cannot be used (${err instanceof Error ? err.message : String(err)}); falling back to ${wrapper.wrapperName}, chosen from the model's name`;
    log(note);
    return { wrapper, info: { wrapper: wrapper.wrapperName, source: 'fallback', note } };
  }
}

/**
 * A response taking shape from a chat answer: the engine's streamed chunks (or its whole
 * completion, fed as one) become the response's output items and the Responses API's stream
 * events, in OpenAI's order — `response.created`, `response.in_progress`, then per item
 * `output_item.added`, its content (`content_part.added`, `output_text.delta`…, or
 * `function_call_arguments.delta`), its `….done` events and `output_item.done`, and last
 * `response.completed` (`response.incomplete` when cut by `max_output_tokens`). Events carry no
 * `sequence_number`: the stream numbers what it writes.
 */
import { nuid } from 'nats';
import type { ChatMessage } from '../../shared/chat';
import type { CompletionUsage } from '../../shared/serving';
import { isAnswering, type OutputItem, type OutputText, type ResponseObject, type ResponseUsage } from '../../shared/responses';

/** One event of the Responses API's stream, without its sequence number. */
export interface ResponseEvent {
  type: string;
  [field: string]: unknown;
}

/** A tool call as a chat chunk's delta carries it (a first delta names it; later ones may add arguments). */
interface ToolCallDelta {
  index?: number;
  id?: string;
  function?: { name?: string; arguments?: string };
}

/** A token's log-probability as a chat answer carries it (`logprobs.content[]`), which is the Responses API's shape too. */
interface TokenLogprob {
  token: string;
  logprob: number;
  bytes: number[];
  top_logprobs: { token: string; logprob: number; bytes: number[] }[];
}

interface ChatChoice {
  logprobs?: { content?: TokenLogprob[] | null } | null;
  delta?: { content?: string | null; tool_calls?: ToolCallDelta[] | null };
  message?: { content?: string | null; tool_calls?: { id: string; function: { name: string; arguments: string } }[] | null };
  finish_reason?: string | null;
}

interface ChatAnswer {
  choices?: ChatChoice[];
  usage?: Partial<CompletionUsage> | null;
}

/** Chat's `usage` under the Responses API's names. */
export function responseUsage(usage: Partial<CompletionUsage> | null | undefined): ResponseUsage | null {
  if (typeof usage?.prompt_tokens !== 'number') return null;
  const output = typeof usage.completion_tokens === 'number' ? usage.completion_tokens : 0;
  return {
    input_tokens: usage.prompt_tokens,
    input_tokens_details: { cached_tokens: usage.prompt_tokens_details?.cached_tokens ?? 0 },
    output_tokens: output,
    output_tokens_details: { reasoning_tokens: 0 },
    total_tokens: typeof usage.total_tokens === 'number' ? usage.total_tokens : usage.prompt_tokens + output,
  };
}

export class ResponseDraft {
  private readonly response: ResponseObject;
  private started = false;
  /** The message item text is streamed into, while it is open. */
  private message: { index: number; item: Extract<OutputItem, { type: 'message' }>; part: OutputText } | undefined;
  /** Function-call items by the chat tool call's index. */
  private readonly calls = new Map<number, { index: number; item: Extract<OutputItem, { type: 'function_call' }> }>();
  private finishReason: string | null | undefined;
  private usage: ResponseUsage | null = null;

  /**
   * `withLogprobs`: the request asked for log-probabilities (`include: ["message.output_text.logprobs"]`),
   * so text parts carry them. `ids`: the ids of its items (and of calls the engine named none for),
   * by kind and item index; random unless given (a background response's are the same on every
   * replica that reads its frames).
   */
  constructor(
    pending: ResponseObject,
    private readonly withLogprobs = false,
    private readonly ids: (kind: 'msg' | 'fc' | 'call', index: number) => string = (kind) => `${kind}_${nuid.next()}`,
  ) {
    this.response = structuredClone(pending);
  }

  /** Whether it has ended ({@link finish} or {@link failed}). */
  get ended(): boolean {
    return !isAnswering(this.response.status);
  }

  /** The response as it stands: in progress, its output so far. */
  snapshot(): ResponseObject {
    const response = structuredClone(this.response);
    if (!this.ended) response.status = 'in_progress';
    return response;
  }

  /** The events of one streamed chat chunk. */
  chunk(chunk: unknown): ResponseEvent[] {
    const answer = chunk as ChatAnswer | null;
    const events = this.begin();
    if (answer?.usage) this.usage = responseUsage(answer.usage) ?? this.usage;
    const choice = answer?.choices?.[0];
    if (!choice) return events;
    if (typeof choice.delta?.content === 'string' && choice.delta.content !== '')
      events.push(...this.text(choice.delta.content, choice.logprobs?.content ?? []));
    for (const [i, call] of (choice.delta?.tool_calls ?? []).entries()) events.push(...this.toolCall(call.index ?? i, call));
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
    return events;
  }

  /** A whole (not streamed) chat completion, as if it had been streamed: then {@link finish}. */
  completion(completion: unknown): void {
    const answer = completion as ChatAnswer | null;
    const choice = answer?.choices?.[0];
    const message = choice?.message;
    if (typeof message?.content === 'string' && message.content !== '') this.text(message.content, choice?.logprobs?.content ?? []);
    for (const [i, call] of (message?.tool_calls ?? []).entries()) this.toolCall(i, call);
    this.finishReason = choice?.finish_reason ?? null;
    this.usage = responseUsage(answer?.usage);
  }

  /** The answer's last events, ending with `response.completed` (or `response.incomplete`), and the finished response. */
  finish(): { events: ResponseEvent[]; response: ResponseObject } {
    const events = this.begin();
    // An answer of no text and no call is an empty message, as OpenAI answers it.
    if (this.response.output.length === 0) events.push(...this.openMessage());
    const incomplete = this.finishReason === 'length';
    events.push(...this.closeMessage(incomplete), ...this.closeCalls(incomplete));
    this.response.status = incomplete ? 'incomplete' : 'completed';
    this.response.incomplete_details = incomplete ? { reason: 'max_output_tokens' } : null;
    this.response.usage = this.usage;
    const response = structuredClone(this.response);
    events.push({ type: incomplete ? 'response.incomplete' : 'response.completed', response });
    return { events, response };
  }

  /**
   * The response failed (or, `cancelled`, was cancelled) after its stream started: `response.failed`
   * with what it had (after `response.created`, which clients need first). The Responses API has no
   * event of its own for a cancel: its response says `cancelled`.
   */
  failed(code: string, message: string, cancelled = false): ResponseEvent[] {
    const events = this.begin();
    this.response.status = cancelled ? 'cancelled' : 'failed';
    this.response.error = { code, message };
    events.push({ type: 'response.failed', response: structuredClone(this.response) });
    return events;
  }

  /** The answer as the assistant's chat message, as a later turn of the chain sends it back. */
  assistantMessages(): ChatMessage[] {
    let content = '';
    const toolCalls: NonNullable<ChatMessage['tool_calls']> = [];
    for (const item of this.response.output) {
      if (item.type === 'message') content += item.content.map((p) => p.text).join('');
      else toolCalls.push({ id: item.call_id, type: 'function', function: { name: item.name, arguments: item.arguments } });
    }
    return [{ role: 'assistant', content, ...(toolCalls.length > 0 ? { tool_calls: toolCalls } : {}) }];
  }

  /** Its first events (`response.created`, `response.in_progress`), once: the first chunk, a finish or a failure begins it otherwise. */
  begin(): ResponseEvent[] {
    if (this.started) return [];
    this.started = true;
    // A background response is created `queued`; its answer is in progress once it streams.
    const created = structuredClone(this.response);
    this.response.status = 'in_progress';
    return [
      { type: 'response.created', response: created },
      { type: 'response.in_progress', response: structuredClone(this.response) },
    ];
  }

  /** A piece of the answer's text, with its tokens' log-probabilities (none unless the request asked for them). */
  private text(delta: string, logprobs: readonly TokenLogprob[]): ResponseEvent[] {
    const events = this.message ? [] : this.openMessage();
    const m = this.message!;
    m.part.text += delta;
    if (this.withLogprobs) m.part.logprobs!.push(...logprobs);
    events.push({ type: 'response.output_text.delta', item_id: m.item.id, output_index: m.index, content_index: 0, delta, logprobs: [...logprobs] });
    return events;
  }

  private openMessage(): ResponseEvent[] {
    const part: OutputText = { type: 'output_text', text: '', annotations: [], ...(this.withLogprobs ? { logprobs: [] } : {}) };
    const index = this.response.output.length;
    const item: Extract<OutputItem, { type: 'message' }> = {
      type: 'message',
      id: this.ids('msg', index),
      status: 'in_progress',
      role: 'assistant',
      content: [],
    };
    this.response.output.push(item);
    this.message = { index, item, part };
    const added = { type: 'response.output_item.added', output_index: index, item: structuredClone(item) };
    item.content.push(part);
    return [added, { type: 'response.content_part.added', item_id: item.id, output_index: index, content_index: 0, part: { ...part } }];
  }

  private closeMessage(incomplete: boolean): ResponseEvent[] {
    const m = this.message;
    if (!m) return [];
    this.message = undefined;
    m.item.status = incomplete ? 'incomplete' : 'completed';
    const at = { item_id: m.item.id, output_index: m.index, content_index: 0 };
    return [
      { type: 'response.output_text.done', ...at, text: m.part.text, logprobs: [...(m.part.logprobs ?? [])] },
      { type: 'response.content_part.done', ...at, part: structuredClone(m.part) },
      { type: 'response.output_item.done', output_index: m.index, item: structuredClone(m.item) },
    ];
  }

  private toolCall(key: number, call: ToolCallDelta): ResponseEvent[] {
    const events: ResponseEvent[] = [];
    let open = this.calls.get(key);
    if (!open) {
      // Text comes before calls: a call ends the message.
      events.push(...this.closeMessage(false));
      const index = this.response.output.length;
      const item: Extract<OutputItem, { type: 'function_call' }> = {
        type: 'function_call',
        id: this.ids('fc', index),
        call_id: call.id ?? this.ids('call', index),
        name: call.function?.name ?? '',
        arguments: '',
        status: 'in_progress',
      };
      this.response.output.push(item);
      open = { index, item };
      this.calls.set(key, open);
      events.push({ type: 'response.output_item.added', output_index: open.index, item: structuredClone(item) });
    }
    const delta = call.function?.arguments ?? '';
    if (delta !== '') {
      open.item.arguments += delta;
      events.push({ type: 'response.function_call_arguments.delta', item_id: open.item.id, output_index: open.index, delta });
    }
    return events;
  }

  private closeCalls(incomplete: boolean): ResponseEvent[] {
    const events: ResponseEvent[] = [];
    for (const { index, item } of this.calls.values()) {
      item.status = incomplete ? 'incomplete' : 'completed';
      events.push(
        { type: 'response.function_call_arguments.done', item_id: item.id, output_index: index, name: item.name, arguments: item.arguments },
        { type: 'response.output_item.done', output_index: index, item: structuredClone(item) },
      );
    }
    this.calls.clear();
    return events;
  }
}

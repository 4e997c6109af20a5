/**
 * A streamed chat answer as a client read it, with when each piece came: what the tests of
 * interrupted answers (an engine killed, a bridge cut off, an instance stopped) measure a
 * client's silence and what it had before a fault with.
 */
import type OpenAI from 'openai';

export interface TimedAnswer {
  /** The chunks' id (`chatcmpl-<request id>`). */
  id: string;
  text: string;
  /** Chunks with text. */
  pieces: number;
  finish: string | null | undefined;
  usage: OpenAI.CompletionUsage | undefined;
  /** Chunks that said the assistant's role. */
  roles: number;
  /** When each piece came (epoch ms), and the text so far at each. */
  times: number[];
  texts: string[];
}

/** Reads a chat stream to its end; `onPiece` sees the count of pieces so far, and the reading waits for what it returns. */
export async function readTimed(chunks: AsyncIterable<OpenAI.ChatCompletionChunk>, onPiece?: (pieces: number) => Promise<void> | void): Promise<TimedAnswer> {
  const out: TimedAnswer = { id: '', text: '', pieces: 0, finish: undefined, usage: undefined, roles: 0, times: [], texts: [] };
  for await (const c of chunks) {
    out.id = c.id;
    if (c.usage) out.usage = c.usage;
    const choice = c.choices[0];
    if (choice?.delta?.role) out.roles += 1;
    if (choice?.finish_reason) out.finish = choice.finish_reason;
    const piece = choice?.delta?.content ?? '';
    if (piece === '') continue;
    out.text += piece;
    out.pieces += 1;
    out.times.push(Date.now());
    out.texts.push(out.text);
    await onPiece?.(out.pieces);
  }
  return out;
}

/** The text the client had before `time`. */
export const textAt = (a: TimedAnswer, time: number): string => a.texts[a.times.filter((t) => t < time).length - 1] ?? '';

/** The longest wait for a piece after `time`: from it to the next piece, and between pieces. */
export function gapAfter(a: TimedAnswer, time: number): number {
  let gap = 0;
  let last = time;
  for (const t of a.times.filter((x) => x > time)) {
    gap = Math.max(gap, t - last);
    last = t;
  }
  return gap;
}

/** How many leading characters `a` and `b` share: where an answer that differs from its reference begins to. */
export function commonPrefix(a: string, b: string): number {
  let i = 0;
  while (i < a.length && a[i] === b[i]) i++;
  return i;
}

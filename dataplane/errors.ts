/**
 * What JetStream's errors mean to the data plane: the server's API error codes it tells apart,
 * and predicates over the errors nats.js throws (and the replies a stream sends to a core
 * publish with a reply subject, which nats.js does not parse).
 */
import type { Msg } from 'nats';
import { decodeJson } from './json';

/** nats-server's JetStream API error codes (`api_error.err_code`) the data plane tells apart. */
export const JsApiError = {
  streamNotFound: 10059,
  consumerNotFound: 10014,
  consumerExists: 10148,
  noMessage: 10037,
  /** KV create/update: the key's last revision is not the expected one. */
  wrongLastSequence: 10071,
  /** The stream's `max_bytes` does not fit in the memory (or storage) JetStream has left. */
  insufficientMemory: 10028,
} as const;

/** The JetStream API error code of `err`, if it is one. */
export function jsErrorCode(err: unknown): number | undefined {
  return (err as { api_error?: { err_code?: number } } | null)?.api_error?.err_code;
}

/** A KV `create` that found the key, or an `update` whose expected revision is not the last. */
export function isRevisionConflict(err: unknown): boolean {
  return jsErrorCode(err) === JsApiError.wrongLastSequence;
}

/**
 * A request publish refused because the instance's backlog (the per-subject limit) is full, or
 * all queued requests together reached the stream's byte limit.
 */
export function isBacklogFull(err: unknown): boolean {
  // nats.js: message "503", api_error { err_code: 10077 (stream store failed), description }.
  const api = (err as { api_error?: { err_code?: number; description?: string } } | null)?.api_error;
  return /maximum messages per subject exceeded|maximum bytes exceeded/i.test(api?.description ?? (err as Error | null)?.message ?? '');
}

/**
 * What a stream's reply to a publish says went wrong, or `undefined` for an acknowledgement
 * (`{"stream","seq"}`, also when it was a duplicate). Errors keep the server's `api_error`, as
 * nats.js does, so {@link isBacklogFull} recognises them.
 */
export function streamAckProblem(msg: Pick<Msg, 'data' | 'headers'>): Error | undefined {
  if (msg.data.length === 0) {
    const code = msg.headers?.code ?? 0;
    return new Error(code === 503 ? 'no stream stores this subject (no responders)' : `unexpected empty reply to a stream publish (status ${code})`);
  }
  let ack: { stream?: unknown; error?: { code?: number; err_code?: number; description?: string } };
  try {
    ack = decodeJson(msg.data) as typeof ack;
  } catch {
    return new Error('malformed reply to a stream publish');
  }
  if (ack.error) return Object.assign(new Error(ack.error.description ?? `stream publish failed (${ack.error.code ?? '?'})`), { api_error: ack.error });
  if (typeof ack.stream !== 'string') return new Error('malformed reply to a stream publish');
  return undefined;
}

/**
 * `p`, or a rejection saying `what` did not answer once `ms` pass first (`p` goes on, unheard):
 * for NATS answers that can go missing (a watch's first round, a direct get a replica drops).
 */
export async function within<T>(what: string, ms: number, p: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([
      p,
      new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`${what} did not answer within ${ms / 1000}s`)), ms))),
    ]);
  } finally {
    clearTimeout(timer);
  }
}

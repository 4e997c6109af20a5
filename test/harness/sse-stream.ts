/** A streamed response read as raw server-sent events, as a client that resumes with `Last-Event-ID` reads it. */

/** One event with data: its `id` when it has one. */
export interface RawEvent {
  id?: string;
  data: string;
}

/** One message of an SSE response as written (`raw`: its lines, comments included), with its `id:` and `data:` when it has them. */
export interface SseRecord {
  id?: string;
  data?: string;
  raw: string;
}

/**
 * Every message of an SSE response, as it comes — those with data, and those without (a comment; a
 * keep-alive that says an id, which an `EventSource` keeps as its last event id). The body stays
 * open while the caller holds the iterator without ending it.
 */
export async function* sseRecords(res: Response): AsyncGenerator<SseRecord> {
  let buffer = '';
  for await (const bytes of res.body!) {
    buffer += Buffer.from(bytes as Uint8Array).toString('utf8');
    for (let end = buffer.indexOf('\n\n'); end >= 0; end = buffer.indexOf('\n\n')) {
      const raw = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const lines = raw.split('\n');
      const id = lines.find((l) => l.startsWith('id: '))?.slice(4);
      const data = lines.find((l) => l.startsWith('data: '))?.slice(6);
      yield { ...(id !== undefined ? { id } : {}), ...(data !== undefined ? { data } : {}), raw };
    }
  }
}

/** The events of an SSE response with data (their `id:` when they have one), as they come; comments skipped. */
export async function* sseMessages(res: Response): AsyncGenerator<RawEvent> {
  for await (const { id, data } of sseRecords(res)) if (data !== undefined) yield { ...(id !== undefined ? { id } : {}), data };
}

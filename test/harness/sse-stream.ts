/** A streamed response read as raw server-sent events, as a client that resumes with `Last-Event-ID` reads it. */

/** One event with data: its `id` when it has one. */
export interface RawEvent {
  id?: string;
  data: string;
}

/** The events of an SSE response with data (their `id:` when they have one), as they come; comments skipped. */
export async function* sseMessages(res: Response): AsyncGenerator<RawEvent> {
  let buffer = '';
  for await (const bytes of res.body!) {
    buffer += Buffer.from(bytes as Uint8Array).toString('utf8');
    for (let end = buffer.indexOf('\n\n'); end >= 0; end = buffer.indexOf('\n\n')) {
      const lines = buffer.slice(0, end).split('\n');
      buffer = buffer.slice(end + 2);
      const id = lines.find((l) => l.startsWith('id: '))?.slice(4);
      const data = lines.find((l) => l.startsWith('data: '))?.slice(6);
      if (data !== undefined) yield { ...(id !== undefined ? { id } : {}), data };
    }
  }
}

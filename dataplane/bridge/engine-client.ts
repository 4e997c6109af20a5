/**
 * The bridge's HTTP client for an engine's OpenAI surface: `node:http` with a keep-alive agent
 * per engine. On this path `fetch` costs ~0.4 ms more per call (undici's streams and header
 * objects), which is most of the gateway's budget for a short answer.
 */
import { Agent, request, type IncomingMessage } from 'node:http';
import { Agent as HttpsAgent, request as httpsRequest } from 'node:https';

export interface EngineResponse {
  status: number;
  contentType: string;
  /** The whole body as text (for JSON answers and error bodies). */
  text(): Promise<string>;
  /**
   * The body's server-sent events' `data` payloads, in batches: each batch holds the events one
   * read of the body completed, so a caller handles a burst in one go (one NATS flush for all).
   */
  eventBatches(): AsyncGenerator<string[]>;
  /** Drops the rest of the body (and the connection when it is still streaming). */
  cancel(): void;
}

export interface EngineClient {
  /** `headers`: more request headers (shared/continuation.ts `REQUEUED_HEADER`). */
  post(path: string, body: string, opts: { accept: string; signal: AbortSignal; headers?: Record<string, string> }): Promise<EngineResponse>;
  get(path: string, opts: { signal: AbortSignal }): Promise<EngineResponse>;
  close(): void;
}

/**
 * Splits a body into SSE `data` payloads (multi-line data joined with `\n`; comments and other
 * fields skipped), one batch per chunk of the body: the events that chunk completed (empty
 * batches are skipped).
 */
export async function* sseEventBatches(body: AsyncIterable<Buffer | string> | Iterable<Buffer | string>): AsyncGenerator<string[]> {
  let buffer = '';
  let data: string[] = [];
  const line = (l: string, out: string[]) => {
    if (l === '') {
      if (data.length > 0) out.push(data.join('\n'));
      data = [];
    } else if (l.startsWith('data:')) {
      data.push(l.slice(5).replace(/^ /, ''));
    }
  };
  const take = (final: boolean): string[] => {
    const out: string[] = [];
    let start = 0;
    let nl: number;
    while ((nl = buffer.indexOf('\n', start)) >= 0) {
      line(buffer.slice(start, nl).replace(/\r$/, ''), out);
      start = nl + 1;
    }
    buffer = buffer.slice(start);
    if (final) {
      if (buffer) line(buffer, out);
      buffer = '';
      line('', out);
    }
    return out;
  };
  const decoder = new TextDecoder();
  for await (const chunk of body) {
    buffer += typeof chunk === 'string' ? chunk : decoder.decode(chunk, { stream: true });
    const batch = take(false);
    if (batch.length > 0) yield batch;
  }
  buffer += decoder.decode();
  const last = take(true);
  if (last.length > 0) yield last;
}

export function createEngineClient(baseUrl: string, opts: { maxSockets?: number } = {}): EngineClient {
  const base = new URL(baseUrl.replace(/\/+$/, '') + '/');
  const secure = base.protocol === 'https:';
  const agent = secure
    ? new HttpsAgent({ keepAlive: true, maxSockets: opts.maxSockets ?? 64 })
    : new Agent({ keepAlive: true, maxSockets: opts.maxSockets ?? 64 });
  const send = secure ? httpsRequest : request;
  const prefix = base.pathname.replace(/\/$/, '');

  const call = (method: 'GET' | 'POST', path: string, body: string | undefined, headers: Record<string, string>, signal: AbortSignal) =>
    new Promise<EngineResponse>((resolve, reject) => {
      if (signal.aborted) return reject(abortError(signal));
      const req = send({
        host: base.hostname,
        port: base.port || (secure ? 443 : 80),
        method,
        path: prefix + path,
        agent,
        headers: body === undefined ? headers : { ...headers, 'content-length': Buffer.byteLength(body) },
      });
      let res: IncomingMessage | undefined;
      const onAbort = () => {
        const err = abortError(signal);
        req.destroy(err);
        res?.destroy(err);
      };
      signal.addEventListener('abort', onAbort, { once: true });
      const done = () => signal.removeEventListener('abort', onAbort);
      req.once('error', (err) => {
        done();
        reject(err);
      });
      req.once('response', (r) => {
        res = r;
        // Once the body is complete, a late abort (the caller's cleanup) must not destroy the
        // socket the agent already took back for the next call.
        r.once('end', done);
        r.once('close', done);
        r.once('error', () => undefined); // surfaced to whoever reads the body
        resolve({
          status: r.statusCode ?? 0,
          contentType: String(r.headers['content-type'] ?? ''),
          text: () =>
            // Events, not `for await`: the async iterator costs a promise per chunk and more.
            new Promise<string>((resolveText, rejectText) => {
              r.setEncoding('utf8');
              let s = '';
              r.on('data', (c: string) => (s += c));
              r.once('end', () => {
                done();
                resolveText(s);
              });
              r.once('error', rejectText);
              r.once('close', () => {
                if (!r.complete) rejectText(new Error('the engine closed the connection before the body was complete'));
              });
            }),
          eventBatches: () => sseEventBatches(r),
          cancel: () => {
            if (!r.complete) r.destroy();
            else r.resume();
          },
        });
      });
      req.end(body);
    });

  return {
    post: (path, body, o) => call('POST', path, body, { ...o.headers, 'content-type': 'application/json', accept: o.accept }, o.signal),
    get: (path, o) => call('GET', path, undefined, {}, o.signal),
    close: () => agent.destroy(),
  };
}

function abortError(signal: AbortSignal): Error {
  const r: unknown = signal.reason;
  return r instanceof Error ? r : Object.assign(new Error(`aborted: ${String(r)}`), { name: 'AbortError' });
}

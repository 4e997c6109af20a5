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
  /** The body's server-sent events' `data` payloads, one string per event. */
  events(): AsyncGenerator<string>;
  /** Drops the rest of the body (and the connection when it is still streaming). */
  cancel(): void;
}

export interface EngineClient {
  post(path: string, body: string, opts: { accept: string; signal: AbortSignal }): Promise<EngineResponse>;
  get(path: string, opts: { signal: AbortSignal }): Promise<EngineResponse>;
  close(): void;
}

/** Splits a body into SSE `data` payloads (multi-line data joined with `\n`; comments and other fields skipped). */
export async function* sseEvents(body: AsyncIterable<Buffer | string> | Iterable<Buffer | string>): AsyncGenerator<string> {
  let buffer = '';
  let data: string[] = [];
  const take = function* (final: boolean): Generator<string> {
    let nl: number;
    while ((nl = buffer.indexOf('\n')) >= 0) {
      yield* line(buffer.slice(0, nl).replace(/\r$/, ''));
      buffer = buffer.slice(nl + 1);
    }
    if (final) {
      if (buffer) yield* line(buffer);
      buffer = '';
      yield* line('');
    }
  };
  const line = function* (l: string): Generator<string> {
    if (l === '') {
      if (data.length > 0) yield data.join('\n');
      data = [];
    } else if (l.startsWith('data:')) {
      data.push(l.slice(5).replace(/^ /, ''));
    }
  };
  const decoder = new TextDecoder();
  for await (const chunk of body) {
    buffer += typeof chunk === 'string' ? chunk : decoder.decode(chunk, { stream: true });
    yield* take(false);
  }
  buffer += decoder.decode();
  yield* take(true);
}

export function createEngineClient(baseUrl: string, opts: { maxSockets?: number } = {}): EngineClient {
  const base = new URL(baseUrl.replace(/\/+$/, '') + '/');
  const secure = base.protocol === 'https:';
  const agent = secure ? new HttpsAgent({ keepAlive: true, maxSockets: opts.maxSockets ?? 64 }) : new Agent({ keepAlive: true, maxSockets: opts.maxSockets ?? 64 });
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
          events: () => sseEvents(r),
          cancel: () => {
            if (!r.complete) r.destroy();
            else r.resume();
          },
        });
      });
      req.end(body);
    });

  return {
    post: (path, body, o) => call('POST', path, body, { 'content-type': 'application/json', accept: o.accept }, o.signal),
    get: (path, o) => call('GET', path, undefined, {}, o.signal),
    close: () => agent.destroy(),
  };
}

function abortError(signal: AbortSignal): Error {
  const r: unknown = signal.reason;
  return r instanceof Error ? r : Object.assign(new Error(`aborted: ${String(r)}`), { name: 'AbortError' });
}

/**
 * A server-sent-events response for a streamed answer: a chat completion's `data:` chunks ending
 * with `[DONE]`, or the Responses API's named events (`event: <type>`), which end with the
 * connection. Nothing is sent until the first
 * write, so a failure before then still gets a proper HTTP error; after that, failures become a
 * `data: {"error":…}` event and the stream closes (without `[DONE]`).
 *
 * Keep-alive: whenever a whole `keepAliveMs` (2 s by default) passes without a write — a cold
 * start, a queue, a slow prompt — a comment goes out saying what the answer waits for
 * (`: keep-alive: waiting for an instance of demo to start`), which also commits the response (200);
 * until its first chunk event, a resumable answer's keep-alive carries its id without a seq
 * (`id: <answer>.<mac>.`), which resumes it from before its first chunk.
 *
 * The first write goes out at once (time to first chunk); later events written in one turn of
 * the event loop (the frames of one NATS read: a burst from a fast engine) go out in one socket
 * write at the end of that turn, not one write each.
 */
import type { FastifyReply } from 'fastify';
import { errorBody, type GatewayError } from '../plugins/errors';

export class SseResponse {
  private committed = false;
  private wrote = false;
  private ended = false;
  /** Events written this turn, not yet handed to the socket. */
  private pending = '';
  private readonly timer: NodeJS.Timeout;
  /** What each chunk event's `id:` begins with (its seq follows), once the answer is resumable (serving/resume.ts). */
  private idPrefix: string | undefined;
  /** Whether an event with a seq in its id went out (a keep-alive then says no id: the client's last one stands). */
  private chunkSent = false;

  constructor(
    private readonly reply: FastifyReply,
    keepAliveMs: number,
    private readonly requestId: string,
  ) {
    this.timer = setInterval(() => {
      if (!this.wrote) {
        // Before its first chunk a resumable answer's keep-alive carries the answer's id without a
        // seq (no event: the data is empty), so a client cut off while it waits can come back for it.
        const id = this.idPrefix !== undefined && !this.chunkSent ? `id: ${this.idPrefix}\n` : '';
        this.write(`${id}${this.waitingFor ? `: keep-alive: ${this.waitingFor().replace(/[\r\n]+/g, ' ')}\n\n` : ': keep-alive\n\n'}`);
      }
      this.wrote = false;
    }, keepAliveMs);
  }

  /** What the answer waits for now, said by the keep-alive comments (one line; absent: none said). */
  private waitingFor: (() => string) | undefined;

  /** Says, in the keep-alive comments from now on, what the answer waits for (a function: asked at each comment). */
  waiting(what: string | (() => string) | undefined): void {
    this.waitingFor = what === undefined ? undefined : typeof what === 'string' ? () => what : what;
  }

  /** Whether the 200 and some bytes went out (errors must then be sent in-stream). */
  get started(): boolean {
    return this.committed;
  }

  /**
   * From now on chunk events carry `id: <prefix><seq>`, which a client sends back as `Last-Event-ID`
   * to resume; `had`, the seq of the last chunk the client has (a resumed stream's): its keep-alives
   * then say no id, the client's stands.
   */
  resumable(idPrefix: string, had = -1): void {
    this.idPrefix = idPrefix;
    if (had >= 0) this.chunkSent = true;
  }

  /** One `data:` event with a JSON payload (a `chat.completion.chunk`), with its id when it has a seq and the stream is resumable. */
  data(payload: unknown, seq?: number): void {
    const id = this.idPrefix !== undefined && seq !== undefined ? `id: ${this.idPrefix}${seq}\n` : '';
    if (id) this.chunkSent = true;
    this.write(`${id}data: ${JSON.stringify(payload)}\n\n`);
  }

  /** One named event (`event: <type>`) with a JSON payload: the Responses API's stream. */
  event(type: string, payload: unknown): void {
    this.write(`event: ${type}\ndata: ${JSON.stringify(payload)}\n\n`);
  }

  /** `data: [DONE]` and close. */
  done(): void {
    this.write('data: [DONE]\n\n');
    this.end();
  }

  /** An error event (OpenAI shape, 5xx details hidden) and close. */
  fail(err: GatewayError, requestId: string): void {
    this.write(`data: ${JSON.stringify(errorBody(err, requestId))}\n\n`);
    this.end();
  }

  /** Stops keep-alives; call in every outcome. */
  stop(): void {
    clearInterval(this.timer);
  }

  /** Closes the stream (after its last event). */
  end(): void {
    this.stop();
    if (this.ended) return;
    this.flush();
    this.ended = true;
    this.reply.raw.end();
  }

  private readonly flush = (): void => {
    if (this.pending === '') return;
    const text = this.pending;
    this.pending = '';
    if (!this.ended && !this.reply.raw.destroyed) this.reply.raw.write(text);
  };

  private write(text: string): void {
    if (this.ended || this.reply.raw.destroyed) return;
    let first = false;
    if (!this.committed) {
      this.committed = first = true;
      // From here on fastify does not send anything for this request; we own the response.
      this.reply.hijack();
      this.reply.raw.writeHead(200, {
        // What the route set on the reply (a limited key's x-ratelimit-* headers, say) goes out with the stream.
        ...(Object.fromEntries(Object.entries(this.reply.getHeaders()).filter(([, v]) => v !== undefined)) as Record<string, string | number | string[]>),
        'content-type': 'text/event-stream; charset=utf-8',
        'cache-control': 'no-cache',
        connection: 'keep-alive',
        'x-accel-buffering': 'no', // proxies (nginx) must not buffer the stream
        'x-request-id': this.requestId,
      });
    }
    this.wrote = true;
    if (first) {
      this.reply.raw.write(text);
      return;
    }
    if (this.pending === '') process.nextTick(this.flush);
    this.pending += text;
  }
}

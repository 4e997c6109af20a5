/**
 * A download's body as the hub client hands it out: an async iterable over the response stream
 * that skips the bytes a server ignoring `Range` sent before the offset, checks that exactly the
 * announced bytes arrive, fails when the network stalls, and says where a transfer stopped.
 */
import { HubError, isHubError } from './errors';
import { errorText } from './http';

/** The body of a download that starts at the end of its file. */
export async function* emptyBody(): AsyncGenerator<Uint8Array> {}

/**
 * The response body as an async iterable that skips `skip` leading bytes, checks that exactly
 * `expected` bytes arrive, fails when no chunk arrives for `idleMs`, and turns stream failures
 * into `Transient` errors that say where the transfer stopped (so the caller can resume there).
 */
export async function* streamBody(
  stream: ReadableStream<Uint8Array>,
  ctx: {
    skip: number;
    expected: number;
    offset: number;
    size: number;
    where: string;
    signal: AbortSignal | undefined;
    idleMs: number;
    abort: (reason: Error) => void;
    scrub: (s: string) => string;
  },
): AsyncGenerator<Uint8Array> {
  let toSkip = ctx.skip;
  let received = 0;
  let stalled = false;
  let finished = false;
  const stopped = (why: string, cause?: unknown): HubError =>
    new HubError('Transient', ctx.scrub(`download of ${ctx.where} stopped at byte ${ctx.offset + received} of ${ctx.size}: ${why}`), { cause });
  const reader = stream.getReader();
  try {
    for (;;) {
      // The idle timer runs only while waiting for the network, not while the consumer works.
      const timer = setTimeout(() => {
        stalled = true;
        ctx.abort(new Error('stalled'));
      }, ctx.idleMs);
      let next: Awaited<ReturnType<typeof reader.read>>;
      try {
        next = await reader.read();
      } finally {
        clearTimeout(timer);
      }
      if (next.done) break;
      let chunk = next.value;
      if (toSkip > 0) {
        const n = Math.min(toSkip, chunk.length);
        toSkip -= n;
        chunk = chunk.subarray(n);
        if (chunk.length === 0) continue;
      }
      received += chunk.length;
      if (received > ctx.expected) throw stopped(`the server sent more than the ${ctx.size} bytes it announced`);
      yield chunk;
    }
    finished = true;
  } catch (err) {
    if (isHubError(err)) throw err;
    if (ctx.signal?.aborted) throw ctx.signal.reason;
    if (stalled) throw stopped(`no data for ${ctx.idleMs} ms`);
    throw stopped(errorText(err), err);
  } finally {
    // Early exit (break, error): release the connection instead of leaving it half-read.
    if (!finished) await reader.cancel().catch(() => undefined);
  }
  if (received !== ctx.expected || toSkip > 0) throw stopped('the connection ended early');
}

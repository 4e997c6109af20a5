/**
 * A streamed answer picked up again (gateway/README.md, "Resuming a stream"): the same request
 * sent with `Last-Event-ID` (an event id this gateway or another replica issued to the same key's
 * scope, serving/resume.ts) gets the rest of that answer — the chunks after that event, then
 * `[DONE]` — read from `MAGUS_RESPONSES` and followed live on the subjects the answering bridge
 * publishes to, whichever replica published the request and whether it still runs. Nothing is
 * published, generated, reserved or metered again: the answer is the one already under way.
 */
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import type { InferenceRequest, ResponseFrame, SessionEntry } from '../../shared/serving';
import { errors, toGatewayError } from '../plugins/errors';
import { exchange, frameSubjectsOf, type ResponseRouter } from '../serving/exchange';
import { parseLastEventId, type ResumableAnswer, type ResumePoint } from '../serving/resume';
import type { SseResponse } from './sse';

/** The resume point a request's `Last-Event-ID` names, for the key's `scope`; 400 when it is not one this key was given. */
export function resumePointOf(app: FastifyInstance, request: FastifyRequest, scope: string, stream: boolean): ResumePoint | undefined {
  const header = request.headers['last-event-id'];
  if (header === undefined) return undefined;
  const given = Array.isArray(header) ? header[0]! : header;
  const point = stream ? parseLastEventId(app.gateway.settings.secret, scope, given) : undefined;
  if (!point) {
    throw errors.invalid(
      stream
        ? 'Last-Event-ID is not an event of a stream this key was sent: send the `id` of the last event received, with the same request.'
        : 'Last-Event-ID resumes a stream: send it with `stream: true`.',
      'Last-Event-ID',
      'invalid_last_event_id',
    );
  }
  return point;
}

/**
 * The request of the answer at `place` as it was published, as far as its frames go (its id, reply
 * subject, instance), and every subject they may be on; undefined when this gateway cannot name
 * another replica's reply subjects.
 */
export function publishedAs(
  app: FastifyInstance,
  place: ResumableAnswer,
): { req: Pick<InferenceRequest, 'id' | 'replyTo' | 'instanceFrames'>; entry: SessionEntry; subjects: string[] } | undefined {
  const { responses } = app.gateway;
  if (!responses.replySubjectOf) return undefined;
  const req = { id: place.requestId, replyTo: responses.replySubjectOf(place.replica, place.requestId), instanceFrames: true };
  const entry: SessionEntry = { subject: '', pool: place.pool, instance: place.instance, expiresAt: 0 };
  return { req, entry, subjects: frameSubjectsOf(req, entry) };
}

/**
 * Follows the answer at `place`, from its first frame: what `MAGUS_RESPONSES` holds of it, then
 * live on the subjects the answering bridge publishes to — whichever replica published the
 * request and whether it still runs — with the exchange's sequencing, gap read-backs and
 * timeouts. Each chunk goes to `onChunk` with its seq; resolves with the `done` frame's data.
 */
export async function followAnswer(
  app: FastifyInstance,
  place: ResumableAnswer,
  signal: AbortSignal,
  onChunk: (chunk: unknown, seq: number) => void,
): Promise<unknown> {
  const g = app.gateway;
  const s = g.settings;
  const { responses, readStored } = g;
  const published = publishedAs(app, place);
  if (!published || !responses.follow || !readStored) throw errors.unavailable(s.retryAfterSec, 'This gateway cannot follow answers.');
  const req = { ...published.req, deadline: Date.now() + s.requestTimeoutMs } as InferenceRequest;
  const { entry, subjects } = published;
  // "Listening" follows its subjects, "publishing" hands over what is stored of it so far.
  let deliver: ((frame: ResponseFrame) => void) | undefined;
  const router: ResponseRouter = {
    replySubject: () => req.replyTo,
    listen: (_id, onFrame) => {
      deliver = onFrame;
      return responses.follow!(subjects, onFrame);
    },
    recover: () => Promise.resolve(0),
    close: () => Promise.resolve(),
  };
  const readAll = async (): Promise<ResponseFrame[]> => (await Promise.all(subjects.map(readStored))).flat();
  return exchange(entry, req, {
    router,
    publish: async () => {
      for (const f of await readAll()) deliver?.(f);
    },
    readBack: readAll,
    requestTimeoutMs: s.requestTimeoutMs,
    gapTimeoutMs: s.gapTimeoutMs,
    retryAfterSec: s.retryAfterSec,
    signal,
    onChunk,
  });
}

/** Relays the rest of the answer at `point` as `sse`'s events; chunks go to `onChunk` with their seq. */
export async function serveResume(
  app: FastifyInstance,
  reply: FastifyReply,
  point: ResumePoint,
  sse: SseResponse,
  onChunk: (chunk: unknown, seq: number) => void,
): Promise<FastifyReply> {
  const s = app.gateway.settings;
  reply.header('x-request-id', point.requestId);
  sse.resumable(point.idPrefix);
  const ctl = new AbortController();
  const onClose = () => {
    if (!reply.raw.writableEnded) ctl.abort(new Error('the client closed the connection'));
  };
  reply.raw.once('close', onClose);
  try {
    await followAnswer(app, point, ctl.signal, (chunk, seq) => {
      if (seq > point.seq) onChunk(chunk, seq);
    });
    sse.done();
  } catch (err) {
    if (ctl.signal.aborted) {
      // Gone again: the answer goes on at the bridge, and the client may come back once more.
      if (!sse.started) reply.hijack();
      reply.raw.destroy();
      return reply;
    }
    if (!sse.started) throw err;
    sse.fail(toGatewayError(err, s.retryAfterSec), point.requestId);
  } finally {
    sse.stop();
    reply.raw.removeListener('close', onClose);
  }
  return reply;
}

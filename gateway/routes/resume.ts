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
import { exchange, frameSubjectsOf, type Moved, type ResponseRouter } from '../serving/exchange';
import { parseLastEventId, type MoveLog, type ResumableAnswer, type ResumePoint } from '../serving/resume';
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
  const replySubjectOf = (replica: string, id: string): string => responses.replySubjectOf!(replica, id);
  /** The subjects of request `id`'s frames on `pool`/`instance` (the first request's, or a continuation's). */
  const subjectsOf = (id: string, pool: string, instance: string) =>
    frameSubjectsOf({ id, replyTo: replySubjectOf(place.replica, id), instanceFrames: true }, { subject: '', pool, instance, expiresAt: 0 });
  // "Listening" follows a request's subjects, "publishing" hands over what is stored of it so far.
  let deliver: ((frame: ResponseFrame) => void) | undefined;
  const router: ResponseRouter = {
    replySubject: (id) => replySubjectOf(place.replica, id),
    listen: (id, onFrame, from) => {
      deliver = onFrame;
      return responses.follow!(from ? subjectsOf(id, from.pool, from.instance) : published.subjects, onFrame);
    },
    recover: () => Promise.resolve(0),
    close: () => Promise.resolve(),
  };
  const readAll = async (r: Pick<InferenceRequest, 'id' | 'replyTo' | 'instanceFrames'>, e: SessionEntry): Promise<ResponseFrame[]> =>
    (await Promise.all(frameSubjectsOf(r, e).map(readStored))).flat();
  let moves = 0;
  return exchange(published.entry, req, {
    router,
    publish: async (_subject, r, e) => {
      for (const f of await readAll(r, e)) deliver?.(f);
    },
    readBack: readAll,
    requestTimeoutMs: s.requestTimeoutMs,
    gapTimeoutMs: s.gapTimeoutMs,
    retryAfterSec: s.retryAfterSec,
    signal,
    onChunk,
    // Moved (handed back, or its bridge went silent): follow it where the replica serving it sent it.
    ...(g.moves ? { move: () => nextMove(g.moves!, place, ++moves, signal), ...(g.bridgeSilent ? { silent: movedAway(g.moves, g.bridgeSilent) } : {}) } : {}),
  });

  /**
   * Whether the request followed now was moved away from its silent bridge by the replica
   * serving it: while the bridge is silent, the move log is looked at (once a second at most) for
   * the next move, and true once it is there. (A bridge silent on a pool of one is not moved away
   * from: its request is delivered again, and its frames come on the same subjects.)
   */
  function movedAway(log: MoveLog, bridgeSilent: (s: SessionEntry) => boolean): (s: SessionEntry) => boolean {
    let lookedAt = 0;
    let found = 0;
    return (s) => {
      if (!bridgeSilent(s)) return false;
      const n = moves + 1;
      if (found === n) return true;
      if (Date.now() - lookedAt >= 1000) {
        lookedAt = Date.now();
        void log.find(place.requestId, n).then(
          (to) => {
            if (to) found = n;
          },
          () => undefined,
        );
      }
      return false;
    };
  }

  async function nextMove(log: MoveLog, first: ResumableAnswer, n: number, stop: AbortSignal): Promise<Moved | undefined> {
    // The replica that moved it records where before it publishes; give a slow write a moment.
    for (let waited = 0; waited <= MOVE_LOOKUP_MS && !stop.aborted; waited += 200) {
      const to = await log.find(first.requestId, n);
      if (to) {
        const entry: SessionEntry = { subject: '', pool: to.pool, instance: to.instance, expiresAt: 0 };
        return { session: entry, req: { ...req, id: to.requestId, replyTo: replySubjectOf(first.replica, to.requestId), instanceFrames: true } };
      }
      await new Promise((resolve) => setTimeout(resolve, 200));
    }
    return undefined;
  }
}

/** How long a resume looks for where a moved answer went (the replica moving it records that first). */
const MOVE_LOOKUP_MS = 3_000;

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

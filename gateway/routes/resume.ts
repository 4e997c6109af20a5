/**
 * A streamed answer picked up again (gateway/README.md, "Resuming a stream"): the same request
 * sent with `Last-Event-ID` (an event id this gateway or another replica issued to the same key's
 * scope, serving/resume.ts) gets the rest of that answer — the chunks after that event, then
 * `[DONE]` — read from `MAGUS_RESPONSES` and followed live on the subjects the answering bridge
 * publishes to, whichever replica published the request and whether it still runs. Nothing is
 * published, generated, reserved or metered again: the answer is the one already under way —
 * unless it has to move and the replica that published it is not there to move it: then this
 * replica claims the move and sends the rest on from the request sent again ({@link followAnswer}).
 */
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { nuid } from 'nats';
import type { ReadyModel } from '../../shared/model';
import type { InferenceRequest, ResponseFrame, SessionEntry } from '../../shared/serving';
import type { Principal } from '../plugins/auth';
import { errors, toGatewayError } from '../plugins/errors';
import type { ResumedAnswer } from '../../shared/continuation';
import { exchange, frameSubjectsOf, type Moved, type ResponseRouter } from '../serving/exchange';
import { continuationIdOf, parseLastEventId, type MoveLog, type ResumableAnswer, type ResumePoint } from '../serving/resume';
import { meterOf, withModelDefaults, type InferencePayload } from './inference';
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

/** An entry naming only `pool`'s `instance` (what an answer's frame subjects and a cancel need), no conversation's. */
export const instanceEntry = (pool: string, instance: string): SessionEntry => ({ subject: '', pool, instance, expiresAt: 0 });

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
  const entry = instanceEntry(place.pool, place.instance);
  return { req, entry, subjects: frameSubjectsOf(req, entry) };
}

/**
 * The request a resumed answer was asked with, sent again by its client (the same body): what a
 * replica resuming it publishes should the answer have to move with nobody else to move it (its
 * first replica gone).
 */
export interface AskedAgain {
  model: ReadyModel;
  payload: InferencePayload;
  principal: Principal;
}

/**
 * Follows the answer at `place`, from its first frame: what `MAGUS_RESPONSES` holds of it, then
 * live on the subjects the answering bridge publishes to — whichever replica published the
 * request and whether it still runs — with the exchange's sequencing, gap read-backs and
 * timeouts. Each chunk goes to `onChunk` with its seq; resolves with the `done` frame's data.
 *
 * When the answer moves (handed back by its bridge, or its bridge silent), the move the replica
 * that published it claimed is followed; with `asked` (the request sent again), a move nobody
 * claimed within {@link CLAIM_AFTER_MS} is claimed and continued here.
 */
export async function followAnswer(
  app: FastifyInstance,
  place: ResumableAnswer,
  signal: AbortSignal,
  onChunk: (chunk: unknown, seq: number) => void,
  asked?: AskedAgain,
): Promise<unknown> {
  const g = app.gateway;
  const s = g.settings;
  const { responses, readStored } = g;
  const published = publishedAs(app, place);
  if (!published || !responses.follow || !readStored) throw errors.unavailable(s.retryAfterSec, 'This gateway cannot follow answers.');
  const req = {
    ...(asked ? withModelDefaults(asked.payload, asked.model) : {}),
    ...published.req,
    deadline: Date.now() + s.requestTimeoutMs,
  } as InferenceRequest;
  /** Continuations this replica claimed: published, not only read back. */
  const claimed = new Set<string>();
  const replySubjectOf = (replica: string, id: string): string => responses.replySubjectOf!(replica, id);
  /** The subjects of request `id`'s frames on `pool`/`instance` (the first request's, or a continuation's). */
  const subjectsOf = (id: string, pool: string, instance: string) =>
    frameSubjectsOf({ id, replyTo: replySubjectOf(place.replica, id), instanceFrames: true }, instanceEntry(pool, instance));
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
    publish: async (subject, r, e) => {
      if (claimed.has(r.id)) return g.publish(subject, r, e);
      for (const f of await readAll(r, e)) deliver?.(f);
    },
    readBack: readAll,
    requestTimeoutMs: s.requestTimeoutMs,
    gapTimeoutMs: s.gapTimeoutMs,
    retryAfterSec: s.retryAfterSec,
    signal,
    onChunk,
    ...(g.bridgeRequeues ? { requeues: g.bridgeRequeues } : {}),
    // Moved (handed back, or its bridge went silent): follow it where the replica serving it sent it, or send it on.
    ...(g.moves
      ? {
          move: (said: ResumedAnswer, from: Moved, createdAt: number, spread?: number) => nextMove(g.moves!, ++moves, said, from, createdAt, spread),
          ...(g.bridgeSilent ? { silent: movedAway(g.moves, g.bridgeSilent), onMovedAway: (from: Moved) => g.cancel?.(from.session, from.req.id, true) } : {}),
        }
      : {}),
  });

  /** Continuation `n` as the replica at `to` published it. */
  function continuation(to: ResumableAnswer): Moved {
    return {
      session: instanceEntry(to.pool, to.instance),
      req: { ...req, id: to.requestId, replyTo: replySubjectOf(to.replica, to.requestId), instanceFrames: true },
    };
  }

  /**
   * Whether the request followed now is to be moved away from its silent bridge: once the replica
   * that published it recorded the move (the move log is looked at once a second at most), or —
   * when this replica may continue it itself — once the bridge stayed silent for
   * {@link CLAIM_AFTER_MS} with no move recorded. (A bridge silent on a pool of one is not moved
   * away from: its request is delivered again, and its frames come on the same subjects.)
   */
  function movedAway(log: MoveLog, bridgeSilent: (s: SessionEntry) => boolean): (s: SessionEntry) => boolean {
    let lookedAt = 0;
    let found = 0;
    let silentSince: number | undefined;
    return (at) => {
      if (!bridgeSilent(at)) {
        silentSince = undefined;
        return false;
      }
      const n = moves + 1;
      if (found === n) return true;
      silentSince ??= Date.now();
      if (asked && g.sessions.hasAnother?.(asked.model, at.instance) && Date.now() - silentSince >= CLAIM_AFTER_MS) return true;
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

  /**
   * Move `n` of the answer: the one the replica that published it recorded (it records before it
   * publishes; a slow write is given {@link MOVE_LOOKUP_MS}, or {@link CLAIM_AFTER_MS} when this
   * replica may move it itself), else — when the request was sent
   * again — claimed here and published on another instance (or, with none, the one it was on),
   * its metering the answer's key as this replica's client presents it.
   */
  async function nextMove(log: MoveLog, n: number, said: ResumedAnswer, from: Moved, createdAt: number, spread?: number): Promise<Moved | undefined> {
    for (let waited = 0, wait = asked ? CLAIM_AFTER_MS : MOVE_LOOKUP_MS; waited <= wait && !signal.aborted; waited += 200) {
      const to = await log.find(place.requestId, n);
      if (to) return continuation(to);
      await new Promise((resolve) => setTimeout(resolve, 200));
    }
    if (!asked || signal.aborted) return undefined;
    const to = g.sessions.another?.(asked.model, from.session.instance, spread) ?? from.session;
    const mine: ResumableAnswer = {
      replica: place.replica,
      pool: to.pool,
      instance: to.instance,
      requestId: continuationIdOf(place.requestId, n, () => nuid.next()),
    };
    const held = await log.claim(place.requestId, n, mine);
    if (held.requestId !== mine.requestId) return continuation(held);
    claimed.add(mine.requestId);
    const stay = to.instance === from.session.instance;
    app.metrics.answersMoved.inc();
    return {
      session: to,
      req: {
        ...continuation(mine).req,
        deadline: Date.now() + s.requestTimeoutMs,
        meter: meterOf(g.meterKey, {
          id: place.requestId,
          kind: req.kind ?? 'chat',
          key: asked.principal.key,
          model: `${asked.model.namespace}/${asked.model.name}`,
          start: createdAt,
        }),
        continues: { id: place.requestId, createdAt, resume: said, ...(stay ? { stay } : {}) },
      },
    };
  }
}

/** How long a resume looks for where a moved answer went (the replica moving it records that first). */
const MOVE_LOOKUP_MS = 3_000;
/**
 * How long a resume that may continue the answer itself leaves the move to the replica that
 * published it: that one claims it the moment it hears of it, if it runs — and should both claim,
 * the move log takes one (`MoveLog.claim`), so this only says who goes first.
 */
const CLAIM_AFTER_MS = 1_000;

/** Relays the rest of the answer at `point` as `sse`'s events; chunks go to `onChunk` with their seq. `asked` is the request sent again ({@link followAnswer}). */
export async function serveResume(
  app: FastifyInstance,
  reply: FastifyReply,
  point: ResumePoint,
  sse: SseResponse,
  onChunk: (chunk: unknown, seq: number) => void,
  asked: AskedAgain,
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
    await followAnswer(
      app,
      point,
      ctl.signal,
      (chunk, seq) => {
        if (seq > point.seq) onChunk(chunk, seq);
      },
      asked,
    );
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

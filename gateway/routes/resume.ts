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
import { exchange, frameSubjectsOf, type Moved, type MoveHow, type ResponseRouter } from '../serving/exchange';
import { continuationIdOf, parseLastEventId, type MoveLog, type MoveRecord, type ResumableAnswer, type ResumePoint } from '../serving/resume';
import { cancelUnlessResumed, meterOf, withModelDefaults, type InferencePayload } from './inference';
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
 * claimed within {@link CLAIM_AFTER_MS} — or at once when that replica is known gone
 * (serving/replicas.ts) — is claimed and continued here. `following` is told of
 * each request followed: the first, then each move's.
 */
export async function followAnswer(
  app: FastifyInstance,
  place: ResumableAnswer,
  signal: AbortSignal,
  onChunk: (chunk: unknown, seq: number) => void,
  asked?: AskedAgain,
  following?: (current: Moved) => void,
  /** Told when each step of the way to its first frame is done (serveResume's timing line). */
  mark?: (step: 'looked up' | 'read') => void,
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
  // Where the answer left its first request, if it did, is looked up while that request's frames
  // are read and followed (a herd of resumes on one replica waits one round trip less): they are
  // held until it is known, then go to the exchange, which drops those after it (`leftAt`).
  let firstMoveKnown = false;
  const heldFirst: ResponseFrame[] = [];
  const untilFirstMoveKnown = (id: string, onFrame: (frame: ResponseFrame) => void) =>
    id !== place.requestId ? onFrame : (frame: ResponseFrame) => (firstMoveKnown ? onFrame(frame) : heldFirst.push(frame));
  // "Listening" follows a request's subjects, "publishing" hands over what is stored of it so far —
  // to that request's listener, while it listens: a read that ends after the answer moved on
  // (the move known meanwhile, or handed back live) is not the next request's.
  const listeners = new Map<string, (frame: ResponseFrame) => void>();
  const router: ResponseRouter = {
    replySubject: (id) => replySubjectOf(place.replica, id),
    listen: (id, onFrame, from) => {
      const deliver = untilFirstMoveKnown(id, onFrame);
      listeners.set(id, deliver);
      const unfollow = responses.follow!(from ? subjectsOf(id, from.pool, from.instance) : published.subjects, deliver);
      return () => {
        if (listeners.get(id) === deliver) listeners.delete(id);
        unfollow();
      };
    },
    recover: () => Promise.resolve(0),
    close: () => Promise.resolve(),
  };
  const readAll = async (r: Pick<InferenceRequest, 'id' | 'replyTo' | 'instanceFrames'>, e: SessionEntry): Promise<ResponseFrame[]> => {
    const started = Date.now();
    const frames = (await Promise.all(frameSubjectsOf(r, e).map(readStored))).flat();
    mark?.('read');
    const took = Date.now() - started;
    if (took >= SLOW_READ_MS)
      app.log.info({ inferenceId: place.requestId, request: r.id, frames: frames.length, ms: took }, 'resumed stream: its stored frames read slowly');
    return frames;
  };
  let moves = 0;
  /** The answer's moves as recorded, by n (1: away from its first request), once found. */
  const recorded = new Map<number, MoveRecord>();
  const lookedAt = new Map<number, number>();
  const lookUp = async (n: number): Promise<MoveRecord | undefined> => {
    lookedAt.set(n, Date.now());
    const to = await g.moves?.find(place.requestId, n).catch(() => undefined);
    if (to) recorded.set(n, to);
    return to;
  };
  /** Move `n` if it is known to be recorded; when not, looked up again (in the background) a second after the last look. */
  const knownMove = (n: number): MoveRecord | undefined => {
    const to = recorded.get(n);
    if (!to && g.moves && Date.now() - (lookedAt.get(n) ?? 0) >= 1000) void lookUp(n);
    return to;
  };
  void lookUp(1).then(() => {
    mark?.('looked up');
    firstMoveKnown = true;
    // To the first request's listener if the exchange still listens to it (it may have moved on meanwhile).
    const deliver = listeners.get(place.requestId);
    for (const frame of heldFirst.splice(0)) deliver?.(frame);
  });
  following?.({ session: published.entry, req });
  return exchange(published.entry, req, {
    router,
    publish: async (subject, r, e) => {
      if (claimed.has(r.id)) return g.publish(subject, r, e);
      for (const f of await readAll(r, e)) listeners.get(r.id)?.(f);
    },
    readBack: readAll,
    requestTimeoutMs: s.requestTimeoutMs,
    gapTimeoutMs: s.gapTimeoutMs,
    retryAfterSec: s.retryAfterSec,
    signal,
    onChunk,
    trace: (what, fields) => app.log.info({ inferenceId: place.requestId, resumed: true, ...fields }, what),
    ...(following ? { onMoved: following } : {}),
    ...(g.bridgeRequeues ? { requeues: g.bridgeRequeues } : {}),
    // Moved (handed back, or its bridge went silent): follow it where the replica serving it sent it, or send it on.
    ...(g.moves
      ? {
          move: (said: ResumedAnswer, from: Moved, how: MoveHow) => nextMove(g.moves!, ++moves, said, from, how),
          // Moved elsewhere as recorded: the request's frames up to where the answer left it.
          leftAt: () => knownMove(moves + 1)?.at,
          ...(g.bridgeSilent ? { silent: movedAway(g.bridgeSilent), onMovedAway: (from: Moved, at: number) => g.cancel?.(from.session, from.req.id, at) } : {}),
        }
      : {}),
  });

  /** Continuation `n` as the replica at `to` published it, its seqs after the `at` frames of the request it continues. */
  function continuation(to: MoveRecord): Moved {
    return {
      session: instanceEntry(to.pool, to.instance),
      req: { ...req, id: to.requestId, replyTo: replySubjectOf(to.replica, to.requestId), instanceFrames: true },
      ...(to.at !== undefined ? { after: to.at } : {}),
    };
  }

  /** Recorded move `n`, to be followed (`why`, for the log): where the answer left that continuation, if it did, known before any of its frames is relayed. */
  async function followed(n: number, to: MoveRecord, why: string): Promise<Moved> {
    app.log.info({ inferenceId: place.requestId, move: n, continuedAs: to.requestId, instance: to.instance }, why);
    await lookUp(n + 1);
    return continuation(to);
  }

  /**
   * Whether the request followed now is to be moved away from its silent bridge here: when a move
   * recorded by a gateway from before moves did not say where it left the request (a recorded
   * move that says so is followed from there whatever the bridge does: `leftAt`), or — when this
   * replica may continue the answer itself — once the bridge stayed silent for
   * {@link CLAIM_AFTER_MS} with no move recorded. (A bridge silent on a pool of one is not moved
   * away from: its request is delivered again, and its frames come on the same subjects.)
   */
  function movedAway(bridgeSilent: (s: SessionEntry, since?: number) => boolean): (s: SessionEntry, since: number) => boolean {
    let silentSince: number | undefined;
    return (at, since) => {
      if (!bridgeSilent(at, since)) {
        silentSince = undefined;
        return false;
      }
      const to = knownMove(moves + 1);
      if (to) return to.at === undefined;
      silentSince ??= Date.now();
      return !!asked && g.sessions.hasAnother?.(asked.model, at.instance) === true && Date.now() - silentSince >= CLAIM_AFTER_MS;
    };
  }

  /**
   * Move `n` of the answer: the one the replica that published it recorded (it records before it
   * publishes; a slow write is given {@link MOVE_LOOKUP_MS}, or {@link CLAIM_AFTER_MS} when this
   * replica may move it itself), else — when the request was sent
   * again — claimed here and published on another instance (or, with none, the one it was on),
   * its metering the answer's key as this replica's client presents it.
   */
  async function nextMove(log: MoveLog, n: number, said: ResumedAnswer, from: Moved, how: MoveHow): Promise<Moved | undefined> {
    // `due`: its place in a queue, the request's it continues, not the later deadline this resume gives it.
    const { createdAt, at, due } = how;
    // The replica that published it, known gone (SIGKILLed, most often), will not claim it: no wait.
    let publisherGone = false;
    const whenGone = new Promise<void>((resolve) => {
      if (!asked || !g.replicaGone) return;
      g.replicaGone(place.replica).then(
        (gone) => {
          publisherGone = gone;
          if (gone) resolve();
        },
        () => {},
      );
    });
    for (let waited = 0, wait = asked ? CLAIM_AFTER_MS : MOVE_LOOKUP_MS; waited <= wait && !signal.aborted; waited += LOOKUP_EVERY_MS) {
      const to = recorded.get(n) ?? (await lookUp(n));
      if (to) return followed(n, to, 'resumed stream: following its move');
      if (publisherGone) break;
      await Promise.race([new Promise((resolve) => setTimeout(resolve, LOOKUP_EVERY_MS)), whenGone]);
    }
    if (!asked || signal.aborted) return undefined;
    const to = g.sessions.another?.(asked.model, from.session.instance, how) ?? from.session;
    const mine: ResumableAnswer = {
      replica: place.replica,
      pool: to.pool,
      instance: to.instance,
      requestId: continuationIdOf(place.requestId, n, () => nuid.next()),
    };
    const held = await log.claim(place.requestId, n, { ...mine, at });
    if (held.requestId !== mine.requestId) return followed(n, held, 'resumed stream: following its move (claimed by another replica)');
    app.log.info(
      { inferenceId: place.requestId, move: n, continuedAs: held.requestId, instance: held.instance, ...(publisherGone ? { publisherGone } : {}) },
      'resumed stream: its move claimed here, sent on',
    );
    claimed.add(mine.requestId);
    const stay = to.instance === from.session.instance;
    app.metrics.answersMoved.inc();
    return {
      session: to,
      req: {
        ...continuation(mine).req,
        deadline: Date.now() + s.requestTimeoutMs,
        ...(due !== undefined ? { due } : {}),
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

/** A read of an answer's stored frames that takes this long is logged (a stream without a leader, e.g.). */
const SLOW_READ_MS = 500;
/** A resumed stream whose first event comes this long after its request arrived logs when each step was done. */
const SLOW_FIRST_EVENT_MS = 1_000;
/** Resumed streams this replica relays now. */
let resumesUnderWay = 0;
/** How long a resume looks for where a moved answer went (the replica moving it records that first). */
const MOVE_LOOKUP_MS = 3_000;
/** How often a resume looks the move up meanwhile. */
const LOOKUP_EVERY_MS = 200;
/**
 * How long a resume that may continue the answer itself leaves the move to the replica that
 * published it: that one claims it the moment it hears of it, if it runs — and should both claim,
 * the move log takes one (`MoveLog.claim`), so this only says who goes first. Not waited when
 * NATS says that replica is gone (no wait for a claim that cannot come).
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
  // When each step to the first event was done, in ms from the request's arrival (a replica that
  // ~100 clients of a killed one come back to at once works through them): logged when that first
  // event took SLOW_FIRST_EVENT_MS or more, with how many other resumes were under way here.
  const alongside = resumesUnderWay++;
  const marks: Record<string, number> = { routed: Math.round(reply.elapsedTime) };
  const mark = (step: string) => (marks[step] ??= Math.round(reply.elapsedTime));
  // Told once: at its first event, or at its end when none came.
  const tell = (what: string) => {
    if (reply.elapsedTime < SLOW_FIRST_EVENT_MS) return;
    app.log.info({ inferenceId: point.requestId, after: point.seq, arrivedAt: Date.now() - Math.round(reply.elapsedTime), alongside, ...marks }, what);
  };
  reply.header('x-request-id', point.requestId);
  sse.resumable(point.idPrefix, point.seq);
  // Recorded (not waited for): the replica its client left does not cancel it at the end of its
  // hold; nor does this one, should this client leave too and come back again.
  const recorded = app.gateway.moves?.resumed?.(point.requestId) ?? Promise.resolve(0);
  recorded.catch((err: unknown) => app.log.warn({ err, inferenceId: point.requestId }, 'could not record a resume'));
  let current: Moved | undefined;
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
        if (seq <= point.seq) return;
        if (marks['first event'] === undefined) {
          mark('first event');
          tell('resumed stream: its first event came slowly');
        }
        onChunk(chunk, seq);
      },
      asked,
      (to) => (current = to),
      mark,
    );
    sse.done();
  } catch (err) {
    if (ctl.signal.aborted) {
      // Gone again: the answer goes on at the bridge for the client to come back once more, and
      // stops generating for nobody once the hold has passed without it.
      const at = current;
      if (at) cancelUnlessResumed(app, point.requestId, () => app.gateway.cancel?.(at.session, at.req.id), recorded);
      if (!sse.started) reply.hijack();
      reply.raw.destroy();
      return reply;
    }
    if (!sse.started) throw err;
    sse.fail(toGatewayError(err, s.retryAfterSec), point.requestId);
  } finally {
    resumesUnderWay--;
    if (marks['first event'] === undefined) {
      mark('ended');
      tell('resumed stream: ended slowly before a first event');
    }
    sse.stop();
    reply.raw.removeListener('close', onClose);
  }
  return reply;
}

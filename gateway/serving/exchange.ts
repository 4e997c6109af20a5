/**
 * The NATS side of one inference request: publish an {@link InferenceRequest} to the instance's
 * subject and collect the {@link ResponseFrame}s the bridge streams back on its `replyTo`,
 * `magus.res.<replica>.<id>`: each gateway replica has subjects of its own and subscribes to
 * them only, so a frame crosses the network to the one replica that waits for it (with one
 * `magus.res.>` subscription per replica, N replicas cost N× the frame traffic).
 *
 * Frames are decoded and put in order by the data plane's one codec and {@link FrameSequencer}
 * (dataplane/frames.ts), the rule a bridge that takes over a request reads frames back
 * with: strictly in `seq` order, each seq once (first arrival wins); a frame ahead of the next
 * seq is held, and a missing seq that does not arrive within {@link FIRST_GAP_READ_MS} is read back
 * from the response stream (bridges publish until their frames are stored); it fails the request
 * (502 `frames_lost`) only when {@link GAP_READ_BACKS} read-backs, then `gapTimeoutMs` apart, did not find it
 * (failed reads — a stream electing a leader — are retried until the request's deadline). The
 * first terminal frame relayed (`done` or `error`) ends the response.
 */
import { ackedPublisher } from '../../dataplane/acked-publish';
import { randomBytes } from 'node:crypto';
import { headers, type Msg, type NatsConnection, type Subscription } from 'nats';
import { Nats } from '../../shared/constants';
import type { InferenceRequest, ResponseFrame, SessionEntry } from '../../shared/serving';
import { instanceResponseSubjectOf, isBacklogFull, REPLICA_ID, requestSubjectFor, scopeSubject, streamAckProblem } from '../../dataplane';

export { streamAckProblem };
import { decodeFrame, FrameParts, FrameSequencer, MAX_JOINED_BYTES } from '../../dataplane/frames';
import { AnswerSoFar, CONTINUE_ELSEWHERE, holdsPart, STOPPING_BEAT_EVERY_MS, type ResumedAnswer } from '../../shared/continuation';
import { errors, GatewayError, OpenAIErrorType, retryAfter, SessionError, SessionErrorType, sessionErrorType, toGatewayError } from '../plugins/errors';

/**
 * Publishes one request to an instance subject (`session.subject`); resolves once the request
 * stream has it. `session` is there for publishers that address instances by pool and instance.
 */
export type PublishRequest = (subject: string, req: InferenceRequest, session: SessionEntry) => Promise<void>;

/** Where a request's frames come from: the instance it was published to. */
export interface FrameSource {
  pool: string;
  instance: string;
}

/**
 * Hands the frames of `magus.res.<replica>.<id>`, and of `magus.res.<replica>.<pool>.<instance>.<id>`
 * (the subject a bridge publishes to when the request says `instanceFrames`), to whoever waits for
 * request `<id>` on this replica.
 */
export interface ResponseRouter {
  /** Where the bridge must publish the frames of request `requestId` (the request's `replyTo`). */
  replySubject(requestId: string): string;
  /**
   * Starts listening; in effect before it returns, so the request may be published right after.
   * With `from`, also on that instance's subject for the request (only that instance's: a frame
   * for this id on another instance's subject is not this request's).
   */
  listen(requestId: string, onFrame: (frame: ResponseFrame) => void, from?: FrameSource): () => void;
  /**
   * After a reconnect: hands every request still waiting what `read` finds stored for its reply
   * subject (`MAGUS_RESPONSES` keeps every frame), since frames published while this process was
   * cut off never reached its subscription. The exchange's sequencer drops frames it already has.
   * A failed read goes to `onError`; that request then ends by its own timeouts, as before.
   * Resolves with the frames handed over.
   */
  recover(read: (subject: string) => Promise<ResponseFrame[]>, onError: (err: unknown, requestId: string) => void): Promise<number>;
  /** This replica's token in its response subjects. */
  readonly replica?: string;
  /** The reply subject of request `requestId` published by replica `replica` (another, perhaps gone). */
  replySubjectOf?(replica: string, requestId: string): string;
  /** Listens on `subjects` (a request another replica published: routes/resume.ts). */
  follow?(subjects: readonly string[], onFrame: (frame: ResponseFrame) => void): () => void;
  close(): Promise<void>;
}

/** Stored-frame reads at once while recovering. */
const RECOVER_CONCURRENCY = 8;

/** A failed read-back is tried again after this (doubling per failure), at most {@link READ_RETRY_MAX_MS}. */
const READ_RETRY_MS = 250;
const READ_RETRY_MAX_MS = 2_000;

async function recoverWaiting(
  waiting: ReadonlyMap<string, (frame: ResponseFrame) => void>,
  subjectOf: (requestId: string) => string,
  read: (subject: string) => Promise<ResponseFrame[]>,
  onError: (err: unknown, requestId: string) => void,
): Promise<number> {
  const ids = [...waiting.keys()];
  let next = 0;
  let handed = 0;
  const worker = async () => {
    for (let id = ids[next++]; id !== undefined; id = ids[next++]) {
      // A read fails while the stream has no leader (a cluster's election): try again for as long
      // as the request waits (it ends by its own timeouts), or its frames are lost to it.
      for (let failures = 0; waiting.has(id); failures++) {
        try {
          const frames = await read(subjectOf(id));
          const onFrame = waiting.get(id); // it may have finished meanwhile
          if (!onFrame) break;
          for (const f of frames) onFrame(f);
          handed += frames.length;
          break;
        } catch (err) {
          if (failures === 0) onError(err, id.slice(id.lastIndexOf('.') + 1)); // the key's last token is the request id
          await new Promise((resolve) => setTimeout(resolve, Math.min(READ_RETRY_MS * 2 ** failures, READ_RETRY_MAX_MS)));
        }
      }
    }
  };
  await Promise.all(Array.from({ length: Math.min(RECOVER_CONCURRENCY, ids.length) }, worker));
  return handed;
}

const encoder = new TextEncoder();

/** A stream publish that stays unacknowledged this long fails. */
const STREAM_ACK_TIMEOUT_MS = 5_000;

/** Why a publish failed while the gateway's NATS connection was down. */
export const NATS_UNREACHABLE = 'NATS is unreachable: the request was not queued';

/** The {@link streamPublisher}'s publish function and its teardown. */
export interface StreamPublisher {
  publish: PublishRequest;
  /** Stops listening for acknowledgements; publishes still waiting for one fail. */
  close(): Promise<void>;
}

/**
 * The gateway's {@link PublishRequest}: the same contract as a JetStream publish (`js.publish`
 * with `msgID`: resolves once the request stream stored the request, de-duplicated by
 * `Nats-Msg-Id` = request id; `BacklogFull` when the instance's backlog is full; fails when no
 * stream stores the subject or no acknowledgement comes within `timeoutMs`), built on one inbox
 * subscription for the whole process: each publish is a core publish whose reply subject is that
 * inbox plus a counter, and its acknowledgement settles an entry of a `Map`. A `js.publish` runs
 * a request per publish instead (its own timer and promise race, and an `Error` with a stack
 * built to cancel the finished request), which cost ~0.1 ms of every request's latency at
 * concurrency 1 (bench:gateway). Publish on `nc` only after this returns (the subscription is
 * then ahead of every request on the connection).
 *
 * While the connection is down a publish fails at once ({@link NATS_UNREACHABLE}), and one waiting
 * for its acknowledgement fails when the connection drops: nats.js discards what it buffered
 * when it dials again, and an acknowledgement sent to the old connection never arrives, so
 * waiting out the timeout would only hold the client.
 */
/** Bytes a request's headers take in its message (`NATS/1.0`, `Nats-Msg-Id: <id>`), with room to spare: a message's headers count toward max_payload. */
const PUBLISH_HEADER_ROOM = 512;

export function streamPublisher(nc: NatsConnection, timeoutMs = STREAM_ACK_TIMEOUT_MS): StreamPublisher {
  const acks = ackedPublisher(nc, timeoutMs, {
    unreachable: NATS_UNREACHABLE,
    disconnected: NATS_UNREACHABLE,
    timedOut: `the request stream did not acknowledge a publish within ${timeoutMs} ms`,
    closed: 'the gateway is closing',
  });
  return {
    publish: async (subject, req) => {
      const h = headers();
      h.set('Nats-Msg-Id', req.id);
      const data = encoder.encode(JSON.stringify(req));
      // A message over the servers' max_payload is refused by nats.js, every time: a 413, not "retry later".
      const max = nc.info?.max_payload;
      if (max !== undefined && data.length + PUBLISH_HEADER_ROOM > max) throw errors.tooLargeForBus(data.length, max);
      const problem = streamAckProblem(await acks.publish(subject, data, h));
      if (problem) throw isBacklogFull(problem) ? new SessionError(SessionErrorType.BacklogFull, 'the instance has too many queued requests') : problem;
    },
    close: () => acks.close(),
  };
}

export interface RouterOptions {
  /**
   * Prepended to response subjects (`<scope>.magus.res.<replica>.<id>`) when the data plane is
   * scoped, e.g. several installations or tests on one NATS account. Default none.
   */
  subjectScope?: string;
  /**
   * This replica's token in its response subjects ({@link REPLICA_ID}); unique per gateway
   * process, or a replica receives another's frames (and drops them). Default {@link newReplicaId}.
   */
  replica?: string;
  /** A message on a response subject that is not a frame. */
  onBadFrame?: (subject: string) => void;
}

/** A fresh replica id: `gw-` and 12 random hex digits. */
export const newReplicaId = (): string => `gw-${randomBytes(6).toString('hex')}`;

/** `[<scope>.]magus.res.<replica>.`: the replica's response subjects are this plus a request id. */
function replicaPrefix(opts: RouterOptions, replica: string): string {
  if (!REPLICA_ID.test(replica)) throw new Error(`replica '${replica}' must match ${String(REPLICA_ID)}`);
  return `${scopeSubject(opts.subjectScope, Nats.responseSubjectPrefix)}.${replica}.`;
}

/** What both routers answer of other replicas' requests: their reply subjects, and a subscription to their frames. */
function otherReplicas(nc: NatsConnection, opts: RouterOptions): Pick<ResponseRouter, 'replySubjectOf' | 'follow'> {
  return {
    replySubjectOf: (replica, requestId) => replicaPrefix(opts, replica) + requestId,
    follow(subjects, onFrame) {
      const subs = subjects.map((subject) =>
        nc.subscribe(subject, {
          callback: (err, msg) => {
            if (err) return;
            const frame = decodeFrame(msg.data);
            if (frame) onFrame(frame);
            else opts.onBadFrame?.(msg.subject);
          },
        }),
      );
      return () => subs.forEach((sub) => sub.unsubscribe());
    },
  };
}

/** What follows a replica's `prefix` on the subjects request `requestId`'s frames may come on: its id, and with `from` its instance's subject. */
const frameKeysOf = (prefix: string, requestId: string, from?: FrameSource): string[] =>
  from ? [requestId, instanceResponseSubjectOf(prefix + requestId, requestId, from.pool, from.instance).slice(prefix.length)] : [requestId];

/** The instance whose subject carries `req`'s frames, when `req` asks for that (`instanceFrames`): the one `session` names. */
const frameSourceOf = (req: Pick<InferenceRequest, 'instanceFrames'>, session: SessionEntry): FrameSource | undefined =>
  req.instanceFrames ? { pool: session.pool, instance: session.instance } : undefined;

/** Every subject `req`'s frames may be stored on: its reply subject, and with `instanceFrames` its instance's (a bridge from before it answers on the former). */
export function frameSubjectsOf(req: Pick<InferenceRequest, 'id' | 'replyTo' | 'instanceFrames'>, session: SessionEntry): string[] {
  const from = frameSourceOf(req, session);
  return from ? [req.replyTo, instanceResponseSubjectOf(req.replyTo, req.id, from.pool, from.instance)] : [req.replyTo];
}

/**
 * One wildcard subscription on this replica's `magus.res.<replica>.>` for the whole process,
 * dispatching by subject to a `Map` of waiting requests (keyed by what follows the prefix, both
 * forms): listening costs a map insert (no SUB/UNSUB per request), and the subscription is in
 * place long before any request is published, whichever connection publishes.
 */
export async function sharedResponseRouter(nc: NatsConnection, opts: RouterOptions = {}): Promise<ResponseRouter> {
  const replica = opts.replica ?? newReplicaId();
  const prefix = replicaPrefix(opts, replica);
  const waiting = new Map<string, (frame: ResponseFrame) => void>();
  const sub: Subscription = nc.subscribe(`${prefix}>`, {
    callback: (err, msg: Msg) => {
      if (err) return;
      const handler = waiting.get(msg.subject.slice(prefix.length));
      if (!handler) return; // a late frame of a finished request (or of a replica before us with our id)
      const frame = decodeFrame(msg.data);
      if (frame) handler(frame);
      else opts.onBadFrame?.(msg.subject);
    },
  });
  await nc.flush(); // the server has the subscription before the first request goes out
  return {
    replica,
    ...otherReplicas(nc, opts),
    replySubject: (requestId) => prefix + requestId,
    listen(requestId, onFrame, from) {
      const keys = frameKeysOf(prefix, requestId, from);
      for (const k of keys) waiting.set(k, onFrame);
      return () => keys.forEach((k) => waiting.delete(k));
    },
    recover: (read, onError) => recoverWaiting(waiting, (id) => prefix + id, read, onError),
    async close() {
      sub.unsubscribe();
      await sub.closed;
    },
  };
}

/**
 * One subscription per request. The server registers a SUB before it processes anything sent
 * after it on the same connection, so publish the request through `nc` itself (JetStream on the
 * same connection); on another connection, flush first.
 */
export function perRequestResponseRouter(nc: NatsConnection, opts: RouterOptions = {}): ResponseRouter {
  const replica = opts.replica ?? newReplicaId();
  const prefix = replicaPrefix(opts, replica);
  const waiting = new Map<string, (frame: ResponseFrame) => void>();
  return {
    replica,
    ...otherReplicas(nc, opts),
    replySubject: (requestId) => prefix + requestId,
    listen(requestId, onFrame, from) {
      const keys = frameKeysOf(prefix, requestId, from);
      const subs = keys.map((k) =>
        nc.subscribe(prefix + k, {
          callback: (err, msg) => {
            if (err) return;
            const frame = decodeFrame(msg.data);
            if (frame) onFrame(frame);
            else opts.onBadFrame?.(msg.subject);
          },
        }),
      );
      for (const k of keys) waiting.set(k, onFrame);
      return () => {
        for (const k of keys) waiting.delete(k);
        for (const sub of subs) sub.unsubscribe();
      };
    },
    recover: (read, onError) => recoverWaiting(waiting, (id) => prefix + id, read, onError),
    close: () => Promise.resolve(),
  };
}

/** The HTTP answer for an `error` frame: 4xx pass through (the client can fix them); 5xx are hidden. */
export function frameError(frame: Extract<ResponseFrame, { type: 'error' }>, retryAfterSec: number): GatewayError {
  const { status, message, type, code, param } = frame.error;
  if (Number.isInteger(status) && status >= 400 && status < 500) {
    const headers = status === 429 ? retryAfter(retryAfterSec) : {};
    return new GatewayError(
      status,
      typeof message === 'string' && message ? message : 'The request was rejected by the model.',
      typeof type === 'string' && type ? type : OpenAIErrorType.invalidRequest,
      code ?? null,
      typeof param === 'string' ? param : null,
      headers,
    );
  }
  // The bridge's deadline frame and the gateway's own timer say the same thing: one answer.
  if (status === 504) return errors.timeout();
  return errors.upstream(Number.isInteger(status) ? status : 502, 'engine_error');
}

export interface ExchangeOptions {
  router: ResponseRouter;
  publish: PublishRequest;
  /** Fails with 504 when no frame arrives for this long (from publish, then between frames). */
  requestTimeoutMs: number;
  /** How long a missing frame may be awaited before it is read back from the response stream. */
  gapTimeoutMs: number;
  /** Reads the frames of `req` (on `session`'s instance) as the response stream stores them; without it a gap fails at once. */
  readBack?: (req: InferenceRequest, session: SessionEntry) => Promise<ResponseFrame[]>;
  /**
   * Continues an answer its bridge handed back (an error frame with code `CONTINUE_ELSEWHERE`,
   * shared/continuation.ts): a new request that continues it (`continues`, with `said`, the
   * answer relayed so far, and `createdAt`, its chunks' creation time), and the instance it goes
   * to — another of the pool when there is one. Absent, or resolving undefined: the answer ends
   * with the bridge's error.
   */
  move?: (said: ResumedAnswer, from: Moved, how: MoveHow) => Promise<Moved | undefined>;
  /** The answer was moved: `to` is the request its frames come from now (metrics; whom a resumed stream's client leaving cancels). */
  onMoved?: (to: Moved) => void;
  /**
   * Whether the bridge of the instance a request waits on stopped beating since it was sent there
   * at `since` (gateway/server.ts; serving/beats.ts):
   * checked every `STOPPING_BEAT_EVERY_MS` (a stopping bridge is silent soonest); a silent one's answer is moved as if handed back, and
   * `onMovedAway` told of the request left behind and of how many of its frames were relayed (its
   * bridge, should it come back, must not go on).
   */
  silent?: (session: SessionEntry, since: number) => boolean;
  onMovedAway?: (from: Moved, at: number) => void;
  /**
   * Whether the bridge of `session`'s instance pulls the requests handed back to it
   * (dataplane/names.ts `requestSubjectFor`): a continuation with nothing said goes there, ahead
   * of the instance's queue. Absent, or false: to its requests.
   */
  requeues?: (session: SessionEntry) => boolean;
  /**
   * Where the answer left the request it waits on now, once that is known from elsewhere (a move
   * another replica recorded, routes/resume.ts): the request's frames from that seq on are not the
   * answer's, and once every frame before it is relayed the answer moves on as if handed back
   * there. Asked when a request begins to be followed, as its frames come, and every
   * `STOPPING_BEAT_EVERY_MS`.
   */
  leftAt?: (current: Moved) => number | undefined;
  retryAfterSec: number;
  signal: AbortSignal;
  /**
   * Whether the response is committed (an SSE stream whose 200 went out with a keep-alive), when a
   * refusal can no longer be a 503 the client retries: a publish that failed (no stream leader, no
   * acknowledgement, NATS away) is then tried again for {@link PUBLISH_RETRY_MS}, where one not
   * committed is tried for {@link PUBLISH_RETRY_UNCOMMITTED_MS} before its 503. Tried with the same
   * `Nats-Msg-Id`, so a publish that was stored after all is stored once.
   */
  committed?: () => boolean;
  /** Each `chunk` frame's data, in order (streaming), with its seq. */
  onChunk?: (data: unknown, seq: number) => void;
  /** An engine-side failure, for metrics (`timeout`, `frames_lost`, `engine_error`, `engine_rejected` (4xx), `publish_failed`). */
  onUpstreamError?: (reason: string) => void;
  /** A failed publish about to be tried again ({@link ExchangeOptions.committed}). */
  onPublishRetry?: () => void;
  /** What the exchange does about an answer that stalls (a gap read back, a move away from a silent bridge or as recorded elsewhere), for the log. */
  trace?: (what: string, fields: Record<string, unknown>) => void;
  /**
   * The gateway gave up on a request that may still be queued or running — no frame in time,
   * frames lost, or a publish whose acknowledgement never came (the stream may have stored it):
   * the caller cancels it at the bridge, so nobody's engine time goes to an answer nobody reads
   * (and a client's retry is not served twice). Not called when the bridge ended it (an error
   * frame) or the stream refused it (backlog full). `reason`: `timeout`, `frames_lost` or
   * `publish_failed`.
   */
  onAbandon?: (reason: string, current: Moved) => void;
}

/** How an answer moves on ({@link ExchangeOptions.move}). */
export interface MoveHow {
  /** When the answer's chunks say they were created (epoch ms). */
  createdAt: number;
  /** The frames of the request moved from that were relayed (a hand-back's seq, or the next seq awaited from a silent bridge). */
  at: number;
  /** The answer's place among those its bridge handed back together (`ResponseFrame` `spread`). */
  spread?: number;
  /** Nothing of the answer said yet (shared/continuation.ts `holdsPart`): it goes to the least full instance (sessions `another`). */
  byLoad: boolean;
  /**
   * The place in a queue of the request moved from — as its bridge said it (`ResponseFrame` `due`),
   * else the request's own `due` (none: its deadline is its place) — which the continuation keeps.
   */
  due?: number;
}

/** A request of the exchange and the instance it was published to: the first, or one that continues its answer. */
export interface Moved {
  session: SessionEntry;
  req: InferenceRequest;
  /**
   * The frames of the request it continues that the answer holds, when the move was recorded by
   * the replica that made it (routes/resume.ts): its seqs follow those, wherever this exchange
   * left that request. Absent: where this exchange left it.
   */
  after?: number;
}

/** A chat chunk that only says the assistant's role (a stream's first): a continuation's is not relayed again. */
export function roleOnly(data: unknown): boolean {
  const choices = (data as { choices?: unknown } | null)?.choices;
  if (!Array.isArray(choices) || choices.length !== 1) return false;
  const c = choices[0] as { delta?: { content?: unknown; tool_calls?: unknown }; finish_reason?: unknown } | null;
  return !!c?.delta && (c.delta.content ?? '') === '' && c.delta.tool_calls == null && c.finish_reason == null;
}

/**
 * Read-backs that must all miss a frame before its request fails with `frames_lost`: the first
 * {@link FIRST_GAP_READ_MS} into the gap, then `gapTimeoutMs` apart (16.3 s at the default 2 s):
 * a bridge that lost its connection holds its frames until it proves it still owns the request,
 * which waits for `magus_claims` to have a leader (a cluster's election takes 5–10 s).
 */
export const GAP_READ_BACKS = 9;

/**
 * How long a gap waits before its first read-back. A frame published before a replica listened
 * (a client resuming on it) but stored only after its first read of the stream is found there
 * by then, where at `gapTimeoutMs` (2 s) its client waited that long: the longest silences of
 * bench:chaos's clients of a killed gateway were 2.01–2.16 s. A frame not stored either comes
 * with its bridge's copy (after 500 ms: dataplane/bridge/stored-frames.ts).
 */
export const FIRST_GAP_READ_MS = 300;

/**
 * How long a committed response keeps trying to queue its request ({@link ExchangeOptions.committed}),
 * bounded also by the request's deadline: well inside the request stream's 5-minute duplicate
 * window, and longer than a cluster's election (5–10 s).
 */
export const PUBLISH_RETRY_MS = 30_000;

/**
 * How long a response not committed (a streamed one before its first keep-alive, a non-streamed
 * one) keeps trying to queue its request before it is refused 503 with `Retry-After`: a stream
 * leader's election (bench:chaos: 4–5 s from the kill on its 3-node cluster) is waited out here,
 * where a refusal costs the client its `Retry-After` and a request to send again. A replica cut
 * off from NATS ({@link NATS_UNREACHABLE}) refuses at once: another replica may not be. A
 * streamed response commits within it (its keep-alive) and then tries for {@link PUBLISH_RETRY_MS}.
 */
export const PUBLISH_RETRY_UNCOMMITTED_MS = 8_000;
const PUBLISH_RETRY_DELAYS_MS = [250, 500, 1_000, 2_000];

/** Failure reasons after which the request may still be queued or running at the bridge. */
const ABANDONED = new Set(['timeout', 'frames_lost', 'publish_failed']);

/**
 * Publishes `req` to the session's subject after listening for its frames, relays chunks, and
 * resolves with the `done` frame's data (the whole completion when not streaming). Rejects with a
 * {@link GatewayError} (error frame, timeout, lost frames, failed publish) or the signal's reason.
 */
export function exchange(session: SessionEntry, req: InferenceRequest, opts: ExchangeOptions): Promise<unknown> {
  return new Promise<unknown>((resolve, reject) => {
    let finished = false;
    let republish: NodeJS.Timeout | undefined;
    /** The request whose frames are relayed now: the first, or the last that continues its answer. */
    let current: Moved = { session, req };
    /** When the current request was sent (a bridge heard since may hold it: serving/beats.ts). */
    let sentAt = Date.now();
    /** Frames relayed before the current request's (earlier requests' of a moved answer): its seqs follow them. */
    let base = 0;
    /** What the chunks relayed so far say, what a move continues after, and how many there were. */
    const said = new AnswerSoFar();
    let relayedChunks = 0;
    /** When the answer's chunks say they were created (epoch ms), once one said it. */
    let createdAt: number | undefined;
    const fail = (reason: string, e: GatewayError, cause?: unknown) => {
      if (finished) return;
      opts.onUpstreamError?.(reason);
      if (ABANDONED.has(reason)) opts.onAbandon?.(reason, current);
      if (cause !== undefined) e.cause = cause;
      finish(e);
    };
    const finish = (err: Error | undefined, value?: unknown) => {
      if (finished) return;
      finished = true;
      clearTimeout(idle);
      clearTimeout(republish);
      clearInterval(watch);
      sequencer.stop();
      unlisten();
      opts.signal.removeEventListener('abort', onAbort);
      if (err !== undefined) reject(err);
      else resolve(value);
    };
    const onAbort = () => {
      const reason: unknown = opts.signal.reason;
      finish(reason instanceof Error ? reason : new Error('aborted'));
    };
    const idle = setTimeout(() => fail('timeout', errors.timeout()), opts.requestTimeoutMs);
    const lost = (missing: number) =>
      fail('frames_lost', errors.upstream(502, 'frames_lost'), new Error(`frame ${missing} of ${current.req.id} never arrived`));
    // A gap (a seq awaited while frames after it are held) that outlasts FIRST_GAP_READ_MS is read
    // back from the stream (the frame may have been published while this process or the stream's
    // leader was away, or, resuming, before this replica listened and stored after it read);
    // each read that misses it waits gapTimeoutMs again, and the last fails.
    let gapSeq = -1;
    let gapReads = 0;
    let reading = false;
    const readBack = (missing: number) => {
      if (finished || reading || !opts.readBack) return;
      if (missing !== gapSeq) {
        gapSeq = missing;
        gapReads = 0;
      }
      if (gapReads >= GAP_READ_BACKS) return sequencer.giveUp();
      opts.trace?.('exchange: a gap read back', { request: current.req.id, missing, reads: gapReads });
      reading = true;
      const reader = sequencer;
      opts.readBack(current.req, current.session).then(
        (stored) => {
          reading = false;
          if (reader !== sequencer) return; // moved meanwhile: those were the earlier request's
          gapReads += 1;
          for (const f of stored) deliver(f);
          sequencer.waitAgain();
        },
        () => {
          reading = false;
          if (finished || reader !== sequencer) return;
          if (Date.now() >= current.req.deadline) return sequencer.giveUp();
          sequencer.waitAgain(Math.min(READ_RETRY_MAX_MS, opts.gapTimeoutMs));
        },
      );
    };
    const newSequencer = () =>
      new FrameSequencer({
        gapTimeoutMs: opts.gapTimeoutMs,
        onGap: lost,
        ...(opts.readBack ? { onGapTimeout: readBack, firstGapTimeoutMs: FIRST_GAP_READ_MS } : {}),
      });
    let sequencer = newSequencer();
    /** A whole answer larger than a NATS message comes in parts before its `done` (dataplane/frames.ts `splitFrame`). */
    let parts = new FrameParts();
    /** Where the answer left the current request, once known ({@link ExchangeOptions.leftAt}). */
    let leftAt: number | undefined;
    /** {@link leftAt}, asked of `opts.leftAt` until it is known. */
    const knownLeftAt = (): number | undefined => (leftAt ??= opts.leftAt?.(current));
    /** Moves the answer on once it is known to have left the current request and every frame before that was relayed. */
    const leaveIfLeft = (): boolean => {
      if (finished || moving) return false;
      const at = knownLeftAt();
      if (at === undefined || sequencer.expected < at) return false;
      opts.trace?.('exchange: left the request where a move recorded elsewhere says', { request: current.req.id, at });
      moveOn(at);
      return true;
    };
    const deliver = (sent: ResponseFrame) => {
      // Its bridge could not know what this gateway relayed (the frames stored of the answer were
      // gone): it ends, or is handed back, after what was.
      const frame = sent.type === 'error' && sent.afterRelayed === true ? { ...sent, seq: sequencer.expected } : sent;
      // After the answer left it (a recorded move says where, asked as each frame comes): not the answer's.
      const at = knownLeftAt();
      if (at !== undefined && frame.seq >= at) return;
      for (const f of sequencer.push(frame)) {
        if (finished) return;
        if (f.type === 'part') {
          if (!parts.add(f))
            fail('answer_too_large', errors.upstream(502, 'answer_too_large'), new Error(`${current.req.id}'s answer is over ${MAX_JOINED_BYTES} bytes`));
        } else if (f.type === 'done') {
          const done = parts.join(f);
          if (done) finish(undefined, done.data);
          else fail('frames_lost', errors.upstream(502, 'frames_lost'), new Error(`the parts of ${current.req.id}'s answer do not join`));
        } else if (f.type === 'chunk') {
          if (current.req !== req && relayedChunks > 0 && roleOnly(f.data)) continue; // a continuation generated afresh: its role was said
          said.add(f);
          relayedChunks += 1;
          createdAt ??= createdOf(f.data);
          opts.onChunk?.(f.data, base + f.seq);
        } else if (f.error.code === CONTINUE_ELSEWHERE && opts.move) moveOn(f.seq, f.spread, f.due);
        else {
          const e = frameError(f, opts.retryAfterSec);
          fail(e.status < 500 ? 'engine_rejected' : 'engine_error', e, f.error);
        }
      }
      leaveIfLeft();
    };
    const listen = (at: Moved) =>
      opts.router.listen(
        at.req.id,
        (frame) => {
          idle.refresh(); // any frame, even early or duplicate, shows the engine is alive
          deliver(frame);
        },
        frameSourceOf(at.req, at.session),
      );
    let unlisten = listen(current);
    /** The bridge handed the answer back after `seq` frames of the current request: continue it as a new request. */
    const moveOn = (seq: number, spread?: number, due?: number) => {
      const answer = said.answer;
      const from = current;
      moving = true;
      sequencer.stop();
      unlisten();
      unlisten = () => undefined;
      if (!answer) return fail('engine_error', errors.upstream(503, 'engine_error'), new Error(`${from.req.id} was handed back but cannot be continued`));
      const how: MoveHow = { createdAt: createdAt ?? Date.now(), at: seq, byLoad: !holdsPart(answer), ...(spread !== undefined ? { spread } : {}) };
      const place = typeof due === 'number' && Number.isFinite(due) ? due : from.req.due;
      if (place !== undefined) how.due = place;
      opts.move!(answer, from, how).then(
        (to) => {
          moving = false;
          if (finished) return;
          if (!to) return fail('engine_error', errors.upstream(503, 'engine_error'), new Error(`no instance to continue ${from.req.id} on`));
          base += to.after ?? seq;
          current = to;
          sentAt = Date.now();
          sequencer = newSequencer();
          parts = new FrameParts();
          gapSeq = -1;
          leftAt = undefined;
          unlisten = listen(to);
          idle.refresh();
          opts.onMoved?.(to);
          attempt = 0;
          failingSince = undefined;
          if (!leaveIfLeft()) publish();
        },
        (err: unknown) => fail('engine_error', toGatewayError(err, opts.retryAfterSec), err),
      );
    };
    // A bridge that stops beating (killed, its node gone, cut off): its answer goes on elsewhere.
    let moving = false;
    const watch =
      (opts.silent || opts.leftAt) && opts.move
        ? setInterval(() => {
            if (leaveIfLeft() || finished || moving || !opts.silent?.(current.session, sentAt)) return;
            // One that cannot be continued (no tokens said, tool calls …) waits for its redelivery.
            if (!said.continuable) return;
            opts.trace?.('exchange: its bridge is silent; moving it on', { request: current.req.id, at: sequencer.expected });
            opts.onMovedAway?.(current, sequencer.expected);
            moveOn(sequencer.expected);
          }, STOPPING_BEAT_EVERY_MS)
        : undefined;
    if (opts.signal.aborted) return onAbort();
    opts.signal.addEventListener('abort', onAbort, { once: true });
    let failingSince: number | undefined; // the first failure of the current request's publish
    let attempt = 0;
    const publish = (): void => {
      const at = current;
      // A continuation: to one of the instance's lanes, ahead of its queue.
      opts.publish(requestSubjectFor(at.session.subject, at.req, opts.requeues?.(at.session) === true), at.req, at.session).catch((err: unknown) => {
        if (finished || at !== current) return;
        if (sessionErrorType(err) === SessionErrorType.BacklogFull) return fail('backlog_full', toGatewayError(err, opts.retryAfterSec), err);
        if (err instanceof GatewayError && err.status === 413) return fail('too_large', err);
        failingSince ??= Date.now();
        const delay = PUBLISH_RETRY_DELAYS_MS[Math.min(attempt, PUBLISH_RETRY_DELAYS_MS.length - 1)]!;
        // A continuation's answer is under way: its publish is tried as a committed one's.
        const committed = at.req !== req || opts.committed?.() === true;
        // Cut off from NATS, a replica not committed refuses at once: its client's retry may reach one that is not.
        const window = committed ? PUBLISH_RETRY_MS : (err as Error | null)?.message === NATS_UNREACHABLE ? 0 : PUBLISH_RETRY_UNCOMMITTED_MS;
        if (Date.now() + delay >= Math.min(at.req.deadline, failingSince + window)) return fail('publish_failed', errors.unavailable(opts.retryAfterSec), err);
        attempt += 1;
        opts.onPublishRetry?.();
        republish = setTimeout(publish, delay);
      });
    };
    // Known to have left the first request before any of it (a replay of a recorded move): on at once.
    if (!(opts.move && leaveIfLeft())) publish();
  });
}

/** A chunk's `created` (epoch s) as epoch ms, if it says one. */
function createdOf(data: unknown): number | undefined {
  const created = (data as { created?: unknown } | null)?.created;
  return typeof created === 'number' && Number.isFinite(created) ? created * 1000 : undefined;
}

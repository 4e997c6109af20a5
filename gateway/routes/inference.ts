/**
 * What the routes that publish an inference request share (chat, responses, completions,
 * embeddings): the model a request may use, why a request's controller was aborted by its client,
 * the {@link ExchangeOptions} every exchange takes from the gateway's services and settings, and
 * {@link serveTurn}, one request from its instance (a conversation's session, or any of the
 * pool's) to its answer.
 */
import type { FastifyBaseLogger, FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { nuid } from 'nats';
import type { ReadyModel } from '../../shared/model';
import { modelSampling, withSamplingDefaults } from '../../shared/sampling';
import type { ChatInference, CompletionsInference, EmbeddingsInference, InferenceRequest, SessionEntry } from '../../shared/serving';
import { meterSignature, type Metered, type MeterKey } from '../../dataplane/meter';
import { usageIn, usageRecordOf } from '../../shared/usage';
import { mayUse, type Principal } from '../plugins/auth';
import { errors, sessionErrorType, SessionErrorType, toGatewayError, type GatewayError } from '../plugins/errors';
import { setTimeout as sleep } from 'node:timers/promises';
import { exchange, frameSubjectsOf, type ExchangeOptions } from '../serving/exchange';
import { contextLengthOf, promptTokenBound, type LimitGrant } from '../serving/limits';
import { continuationIdOf, DEFAULT_RESUME_HOLD_MS, resumeIdPrefix } from '../serving/resume';
import type { ModelServing } from '../serving/sessions';
import type { SseResponse } from './sse';

/** Why a request's controller was aborted: the client left, or a background run was cancelled (the cold-start timeout aborts with a 503 of its own). */
export class ClientGone extends Error {
  override readonly name = 'ClientGone';
}

/**
 * The model `name` as `principal` may use it: 404 when it does not exist or is not the
 * principal's; 400 `model_not_servable` when no live runtime can run any of its artifacts (a cold
 * start could only fail, so say why at once; not a 503, whose reason is hidden and which invites
 * retries that cannot help).
 */
export async function servableModel(app: FastifyInstance, principal: Principal, name: string): Promise<ReadyModel> {
  const g = app.gateway;
  const model = await g.models.find(name, (ns, n) => mayUse(principal, ns, n));
  if (!model) throw errors.modelNotFound(name);
  const unservable = g.models.unservable(model);
  if (unservable) throw errors.invalid(unservable, 'model', 'model_not_servable');
  return model;
}

/** The options of an exchange of `req` on `entry`'s instance, aborted by `signal`; a route adds its own (chunks, publish retries). */
function exchangeOptions(app: FastifyInstance, entry: SessionEntry, req: InferenceRequest, signal: AbortSignal): ExchangeOptions {
  const g = app.gateway;
  const s = g.settings;
  return {
    router: g.responses,
    publish: g.publish,
    requestTimeoutMs: s.requestTimeoutMs,
    gapTimeoutMs: s.gapTimeoutMs,
    readBack: g.readStored && (async (r, e) => (await Promise.all(frameSubjectsOf(r, e).map(g.readStored!))).flat()),
    retryAfterSec: g.retryAfterAt?.(entry) ?? s.retryAfterSec,
    signal,
    onUpstreamError: (reason) => app.metrics.upstreamErrors.inc([reason]),
    onAbandon: (reason, current) => {
      g.cancel?.(current.session, current.req.id);
      // The ledger records what the client was told — no answer — unless the bridge recorded it first.
      const record = usageRecordOf(current.req, { outcome: 'failed', error: reason });
      if (record) g.recordUsage?.(record);
    },
  };
}

/**
 * Runs `cancel` (the request serving the answer first published as `first`: its client left)
 * unless a client comes back for the answer (a resume on any replica, routes/resume.ts, recorded
 * in the move log) within `resumeHoldMs`: a dropped connection is resumed, not cut; an answer
 * nobody comes back for stops generating then. `since`: the revision of the resume this client
 * came with, when it did (routes/resume.ts) — only a later one counts; a first client's counts any.
 * Without a move log or a hold, at once.
 */
export function cancelUnlessResumed(app: FastifyInstance, first: string, cancel: () => void, since: Promise<number> = Promise.resolve(0)): void {
  const g = app.gateway;
  const hold = g.settings.resumeHoldMs ?? DEFAULT_RESUME_HOLD_MS;
  const lastResumed = g.moves?.lastResumed?.bind(g.moves);
  if (!lastResumed || hold <= 0) return cancel();
  // Any later resume: this client left, so a resume is this client come back — perhaps before
  // this replica noticed it left (a connection that died without a word).
  setTimeout(() => {
    // A resume this replica could not record (0): any other one counts, as for a first client.
    void Promise.all([lastResumed(first), since.catch(() => 0)])
      .then(([last, mine]) => last > mine)
      .catch(() => false)
      .then((resumed) => {
        if (resumed) app.log.info({ inferenceId: first }, 'its client left and came back for it: not cancelled');
        else cancel();
      });
  }, hold).unref();
}

/**
 * What a limited key reserves for `payload` (gateway/serving/limits.ts): its prompt's bound plus
 * its `max_tokens`, or — without one — at least one output token and up to the model's context,
 * never more than the context holds (prompt and output together cannot exceed it).
 */
function reservationFor(payload: InferencePayload, model: ReadyModel): { tokens: number; upTo?: number; bound: number } {
  const bound = promptTokenBound(payload.body);
  const ctx = contextLengthOf(model) ?? Number.MAX_SAFE_INTEGER;
  if (payload.kind === 'embeddings') return { tokens: Math.min(bound, ctx), bound };
  const max = payload.body.max_tokens ?? undefined;
  if (typeof max === 'number') return { tokens: Math.min(bound + max, ctx), bound };
  return { tokens: Math.min(bound + 1, ctx), upTo: ctx === Number.MAX_SAFE_INTEGER ? bound + DEFAULT_OUTPUT_RESERVE : ctx, bound };
}

/** Bytes a queued request holds beyond its body (its envelope, headers and the model's sampling defaults), with room to spare. */
const MESSAGE_ROOM = 2048;

/** The output reserved for a request with no `max_tokens` of a model whose context length is unknown. */
const DEFAULT_OUTPUT_RESERVE = 4096;

/** `payload` with its output capped at `maxTokens` (what its key reserved for it). */
function capped(payload: InferencePayload, maxTokens: number): InferencePayload {
  return payload.kind === 'embeddings' ? payload : ({ ...payload, body: { ...payload.body, max_tokens: maxTokens } } as InferencePayload);
}

/** A stream's usage chunk: usage and no choices (OpenAI's `include_usage` shape). */
const isUsageChunk = (data: unknown): boolean => usageIn(data) !== undefined && ((data as { choices?: unknown[] }).choices ?? []).length === 0;

/** What an inference request carries beyond its envelope: its kind and the engine's body. */
export type InferencePayload =
  { kind?: 'chat'; body: ChatInference['body'] } | Pick<CompletionsInference, 'kind' | 'body'> | Pick<EmbeddingsInference, 'kind' | 'body'>;

/** Pauses between tries of a committed stream's placement that was unavailable (bounded by the cold-start deadline). */
const PLACEMENT_RETRY_MS = [250, 500, 1_000, 2_000];

/** One inference request — a turn of a conversation, or a request of none — as a route hands it to {@link serveTurn}. */
export interface Turn {
  /** The inference request's id (`x-request-id`). */
  id: string;
  model: ReadyModel;
  /**
   * Which session, and so which instance, serves it (serving/conversation.ts). Absent: the
   * request belongs to no conversation (text completions, embeddings) and goes to the least
   * loaded instance of the model's pool, with no entry and no session (`SessionCache.route`, serving/sessions/).
   */
  conversationKey?: string;
  /** What the engine gets. */
  payload: InferencePayload;
  /** Set when the answer will be stored (Responses): the bytes of the request it keeps, held to the key's storage quota. */
  storeBytes?: number;
  /** A streamed answer's response, when the client asked for a stream. */
  sse?: SseResponse;
  /** Each chunk of a streamed answer, usage chunks included (counted on /metrics first), with its seq. */
  onChunk?: (chunk: unknown, seq: number) => void;
  /** The answer's end: returns the JSON body of an answer not streamed, or writes a stream's last events. */
  onDone: (done: unknown) => unknown;
  /** A failure after the stream started: its last events. */
  onStreamError?: (e: GatewayError) => void;
  /** Its stream's chunk events carry ids a client can resume from (chat and text completions; routes/resume.ts). */
  resumable?: boolean;
  /** Called once its instance is known, before the request is published (a background response records where its frames go). */
  onPublish?: (entry: SessionEntry, req: InferenceRequest) => Promise<void> | void;
}

/** The meter of request `m.id` (shared/usage.ts): its key, model and start, signed with the data plane's meter key when there is one. */
export function meterOf(meterKey: MeterKey | undefined, m: Metered): NonNullable<InferenceRequest['meter']> {
  return { key: m.key, model: m.model, at: m.start, ...(meterKey ? { sig: meterSignature(meterKey, m) } : {}) };
}

/**
 * The engine's body of `payload` with the model's sampling defaults (shared/sampling.ts) in each
 * sampling field the request left out: every generating request (chat, the Responses API, text
 * completions) is turned into its engine request here, so the llama.cpp engine and dllama-api
 * get the same defaults. Embeddings sample nothing.
 */
export function withModelDefaults(payload: InferencePayload, model: ReadyModel): InferencePayload {
  if (payload.kind === 'embeddings') return payload;
  const defaults = modelSampling(model);
  return payload.kind === 'completions'
    ? { ...payload, body: withSamplingDefaults(payload.body, defaults) }
    : { ...payload, body: withSamplingDefaults(payload.body, defaults) };
}

/**
 * How chat and text completions answer: a stream's chunks relayed as they come (its usage chunk,
 * which every stream asks the engine for, only when the client asked for it), then `[DONE]`; an
 * answer not streamed, as the engine gave it.
 */
export function relayed(sse: SseResponse | undefined, clientWantsUsage: boolean): Pick<Turn, 'sse' | 'onChunk' | 'onDone'> {
  return {
    sse,
    onChunk: (chunk, seq) => {
      if (!isUsageChunk(chunk) || clientWantsUsage) sse!.data(chunk, seq);
    },
    onDone: (answer) => {
      if (!sse) return answer;
      sse.done();
      return undefined;
    },
  };
}

/** Who a turn is run for: the client's connection, or nobody's (a background response, routes/responses.ts). */
export interface TurnClient {
  principal: Principal;
  log: FastifyBaseLogger;
  /** The size its body declared (`content-length`): a body that may be too large for the bus is measured. */
  declaredBytes: number;
  /** Sets a response header (none for a background run: its answer was sent already). */
  header: (name: string, value: string) => void;
  /** Aborted with a {@link ClientGone} when the client goes away (or a background run is cancelled): the engine's work is cancelled. */
  gone: AbortSignal;
}

/**
 * Serves `turn` to the client of `request` (see {@link runTurn}): an error before a stream started
 * is thrown for the error handler; a client that goes away gets no answer.
 */
export async function serveTurn(app: FastifyInstance, request: FastifyRequest, reply: FastifyReply, turn: Turn): Promise<FastifyReply> {
  const gone = new AbortController();
  const onClose = () => {
    if (!reply.raw.writableEnded) gone.abort(new ClientGone('the client closed the connection'));
  };
  reply.raw.once('close', onClose);
  try {
    const body = await runTurn(
      app,
      {
        principal: request.principal!,
        log: request.log,
        declaredBytes: Number(request.headers['content-length'] ?? 0),
        header: (name, value) => void reply.header(name, value),
        gone: gone.signal,
      },
      turn,
    );
    return turn.sse ? reply : reply.send(body);
  } catch (err) {
    if (!(err instanceof ClientGone)) throw err;
    if (!turn.sse?.started) reply.hijack();
    reply.raw.destroy();
    return reply;
  } finally {
    reply.raw.removeListener('close', onClose);
  }
}

/**
 * Runs `turn` for `client`, unless the model's backlog is full (429): its session (warm: a map
 * read; cold: the broker's slow path, bounded by the cold-start timeout) → listen on
 * `magus.res.<replica>.<id>` → publish to the instance → relay frames to the route's handlers;
 * resolves with what `onDone` returned. A client gone (`client.gone`) cancels the engine's work and
 * rejects with its {@link ClientGone}; an error before a stream started is thrown, after it the
 * route's last events are written.
 */
export async function runTurn(app: FastifyInstance, client: TurnClient, turn: Turn): Promise<unknown> {
  const g = app.gateway;
  const s = g.settings;
  const { id, sse, model } = turn;
  const receivedAt = Date.now();
  // The model's backlog: a 429 before anything is queued (and, as before, without an x-request-id).
  const backlog = g.backlogFull?.(model);
  if (backlog) {
    sse?.stop();
    throw errors.backlogFull(backlog.retryAfterSec);
  }
  // Every instance would keep it queued past the wait budget (serving/queue-waits.ts): a 429 at
  // once, with when the shortest queue is within the budget again; its pool hears of the demand.
  const queue = g.sessions.queueAdmit?.(model, turn.conversationKey);
  if (queue) {
    sse?.stop();
    throw errors.queueFull(queue);
  }
  // Larger than a NATS message may be: a 413 before a conversation's entry or a key's reservation
  // is made (the publisher refuses it exactly too). The body is measured only when its size says it may be.
  const maxBytes = g.maxMessageBytes?.();
  if (maxBytes !== undefined && client.declaredBytes > maxBytes - MESSAGE_ROOM) {
    const bytes = Buffer.byteLength(JSON.stringify(turn.payload.body));
    if (bytes + MESSAGE_ROOM > maxBytes) {
      sse?.stop();
      throw errors.tooLargeForBus(bytes, maxBytes);
    }
  }
  client.header('x-request-id', id); // also on error responses; the error handler logs it
  const modelLabel = `${model.namespace}/${model.name}`;
  // A limited key's reservation (a 429 before anything is queued), settled when the turn ends.
  const { principal } = client;
  let grant: LimitGrant | undefined;
  let payload = turn.payload;
  if (principal.limits) {
    if (!g.limiter) {
      sse?.stop();
      throw errors.unavailable(s.retryAfterSec, "The key's limits cannot be checked now; retry later.");
    }
    const want = reservationFor(payload, model);
    grant = await g.limiter
      .admit(principal.key, principal.limits, id, { ...want, model: modelLabel, ...(turn.storeBytes !== undefined ? { storeBytes: turn.storeBytes } : {}) })
      .catch((err: unknown) => {
        sse?.stop();
        throw err;
      });
    if (want.upTo !== undefined) payload = capped(payload, Math.max(1, grant.tokens - want.bound));
    for (const [name, value] of Object.entries(grant.headers)) client.header(name, value);
  }
  let used: number | undefined;
  const ctl = new AbortController();
  const onGone = () => ctl.abort(client.gone.reason);
  if (client.gone.aborted) onGone();
  else client.gone.addEventListener('abort', onGone, { once: true });
  const countUsage = (data: unknown): void => {
    const usage = usageIn(data);
    if (!usage) return;
    used = usage.total;
    app.metrics.promptTokens.inc([modelLabel], usage.prompt);
    app.metrics.cachedPromptTokens.inc([modelLabel], usage.cached);
  };
  // A streamed engine answer (a client's stream, or a background response's) comes as chunks.
  const streamed = sse !== undefined || (payload.kind !== 'embeddings' && payload.body.stream === true);
  let published: SessionEntry | undefined;
  /** The request whose answer is relayed now: `id`, or one that continues it (moved). */
  let publishedId = id;
  /** Its client was given ids to resume it with (routes/resume.ts). */
  let resumable = false;
  let moves = 0;
  // Whether this turn was answered: a conversation it starts gets its session only then (serving/sessions/placement.ts).
  let settle!: (answered: boolean) => void;
  const answered = new Promise<boolean>((resolve) => (settle = resolve));
  try {
    // Out of time for an instance: come back when the pool's next one may serve (its starts' pace), if known.
    const retryCold = () => {
      const ms = g.sessions.nextInstanceMs?.(model);
      return ms === undefined ? s.retryAfterSec : Math.ceil(ms / 1000);
    };
    const coldStartTimer = setTimeout(() => ctl.abort(errors.noCapacity(retryCold())), s.coldStartTimeoutMs);
    // Said only if it takes a keep-alive's while (routes/sse.ts): a warm turn never shows it.
    sse?.waiting(() => waitingForInstance(g.sessions.serving?.(model), modelLabel));
    let entry: SessionEntry;
    try {
      for (let attempt = 0; ; attempt++) {
        try {
          entry =
            turn.conversationKey === undefined
              ? await g.sessions.route({ model, signal: ctl.signal })
              : await g.sessions.acquire({ conversationKey: turn.conversationKey, model, owner: principal.owner, signal: ctl.signal, answered });
          break;
        } catch (err) {
          // A stream already committed (its 200 and keep-alives went out) cannot be a 503 the client
          // retries: what was unavailable (the sessions bucket during an election, Temporal) is
          // tried again until the cold-start deadline ends it.
          if (!sse?.started || sessionErrorType(err) !== SessionErrorType.Unavailable || ctl.signal.aborted) throw err;
          app.metrics.placementRetries.inc();
          await sleep(PLACEMENT_RETRY_MS[Math.min(attempt, PLACEMENT_RETRY_MS.length - 1)], undefined, { signal: ctl.signal }).catch(() => undefined);
          if (ctl.signal.aborted) throw ctl.signal.reason;
        }
      }
    } finally {
      clearTimeout(coldStartTimer);
    }
    if (ctl.signal.aborted) throw ctl.signal.reason;
    const req: InferenceRequest = {
      id,
      replyTo: g.responses.replySubject(id),
      instanceFrames: true,
      deadline: Date.now() + s.requestTimeoutMs,
      meter: meterOf(g.meterKey, { id, kind: payload.kind ?? 'chat', key: principal.key, model: modelLabel, start: receivedAt }),
      ...withModelDefaults(payload, model),
    };
    published = entry;
    await turn.onPublish?.(entry, req);
    const queued = `queued at instance ${entry.instance} of ${modelLabel}: waiting for its engine to begin the answer`;
    sse?.waiting(queued);
    // Its chunks' ids let the client pick the answer up on any replica should this one die (routes/resume.ts).
    if (sse && g.responses.replica && turn.resumable) {
      resumable = true;
      sse.resumable(
        resumeIdPrefix(s.secret, principal.conversationScope, { replica: g.responses.replica, pool: entry.pool, instance: entry.instance, requestId: id }),
      );
    }
    const options = exchangeOptions(app, entry, req, ctl.signal);
    const done = await exchange(entry, req, {
      ...options,
      // A publish tried again (a stream electing its leader) says so in the keep-alives until it is queued.
      publish: sse ? (subject, r, e) => options.publish(subject, r, e).then(() => sse.waiting(queued)) : options.publish,
      onChunk: streamed
        ? (chunk, seq) => {
            if (isUsageChunk(chunk)) countUsage(chunk);
            turn.onChunk?.(chunk, seq);
          }
        : undefined,
      committed: sse && (() => sse.started),
      onPublishRetry: () => {
        app.metrics.publishRetries.inc();
        sse?.waiting(`not queued yet at instance ${entry.instance} of ${modelLabel} (its request stream elects a leader, or NATS is away): trying again`);
      },
      trace: (what, fields) => client.log.info({ inferenceId: id, ...fields }, what),
      // Handed back by its bridge (its instance stops, its engine went away): the rest on another instance, else where it was.
      move: streamed
        ? async (said, from, how) => {
            const { createdAt, at, due } = how;
            const to = g.sessions.another?.(model, from.session.instance, how) ?? from.session;
            moves += 1;
            const next = continuationIdOf(id, moves, () => nuid.next());
            const stay = to.instance === from.session.instance;
            // Where it goes, claimed before any of it is sent: a resume on any replica follows it
            // there. Claimed first by a replica resuming it (its client came back there): it is
            // that replica's to continue, not this one's.
            const replica = g.responses.replica;
            if (replica && g.moves) {
              const held = await g.moves.claim(id, moves, { replica, pool: to.pool, instance: to.instance, requestId: next, at }).catch((err: unknown) => {
                client.log.warn({ err, inferenceId: id }, 'could not record where the answer moved: a resume stops there');
                return undefined;
              });
              if (held && held.requestId !== next) throw errors.resumedElsewhere();
            }
            return {
              session: to,
              req: {
                ...from.req,
                id: next,
                replyTo: g.responses.replySubject(next),
                // Its place in a queue: the request's it continues (without one, that request's deadline, kept here).
                ...(due !== undefined ? { due } : {}),
                continues: { id, createdAt, resume: said, ...(stay ? { stay } : {}) },
              },
            };
          }
        : undefined,
      // A silent bridge's answer moves only where another instance serves: on a pool of one, the
      // request's redelivery (ack_wait) continues it on the bridge that comes back, as before.
      silent: g.bridgeSilent && ((s, since) => g.bridgeSilent!(s, since) && g.sessions.hasAnother?.(model, s.instance) === true),
      ...(g.bridgeRequeues ? { requeues: g.bridgeRequeues } : {}),
      onMovedAway: (from, at) => {
        client.log.warn({ inferenceId: id, instance: from.session.instance }, 'no beat of the bridge serving the answer; continuing it elsewhere');
        g.cancel?.(from.session, from.req.id, at);
      },
      onMoved: (to) => {
        app.metrics.answersMoved.inc();
        client.log.info({ inferenceId: id, continuedAs: to.req.id, instance: to.session.instance }, 'answer handed back by its bridge; continued elsewhere');
        published = to.session;
        publishedId = to.req.id;
      },
    });
    if (!streamed) {
      if (typeof done !== 'object' || done === null) throw errors.upstream(502, 'empty_response');
      countUsage(done);
    }
    const body = await turn.onDone(done);
    settle(true);
    return body;
  } catch (thrown) {
    // Part of a streamed answer reached the client: the conversation exists on its side.
    settle(sse?.started === true);
    // A cold-start timeout aborts the broker, which may reject with its own abort error.
    const err = ctl.signal.aborted ? (ctl.signal.reason as unknown) : thrown;
    if (err instanceof ClientGone) {
      client.log.info({ inferenceId: id }, err.message);
      // The engine stops generating for nobody — once its client, given ids to resume with, did not come back for it.
      if (published) {
        const [at, request] = [published, publishedId]; // as they are now: the hold ends later
        const cancel = () => g.cancel?.(at, request);
        if (resumable) cancelUnlessResumed(app, id, cancel);
        else cancel();
      }
      throw err;
    }
    if (!sse?.started) throw err; // the error handler answers (and logs 5xx with their cause)
    const e = toGatewayError(err, s.retryAfterSec);
    client.log[e.status >= 500 ? 'error' : 'info']({ err, inferenceId: id }, 'stream failed after it started');
    if (turn.onStreamError) turn.onStreamError(e);
    else sse.fail(e, id);
    return undefined;
  } finally {
    settle(false);
    // Nothing published: nothing generated. Published without a usage (failed, abandoned): all it reserved.
    grant?.settle(published ? used : 0);
    sse?.stop();
    client.gone.removeEventListener('abort', onGone);
  }
}

/** What a turn waiting for an instance is told, every keep-alive (routes/sse.ts), from its pool's view. */
export function waitingForInstance(s: ModelServing | undefined, model: string): string {
  if (s?.status === 'starting')
    return `engine starting: an instance of ${model} has been starting for ${s.startingForSec ?? 0} s; the answer begins once it serves`;
  if (s?.status === 'failing') return `no instance of ${model} starts (${s.failing ?? 'its starts fail'}); waiting for the next try`;
  if (s?.status === 'ready') return `waiting for room on an instance of ${model} (${s.instances} serve, all full)`;
  return `waiting for an instance of ${model} to take the request (one may be starting)`;
}

/**
 * OpenAI's Responses API over the chat path: `POST /v1/responses` rebuilds the conversation from
 * `previous_response_id`'s stored chain, translates it and the request into a chat completion
 * (shared/responses.ts), refuses what the model's engines cannot do as chat does, and serves it as
 * one turn (inference.ts `serveTurn`) whose session is the chain's (its first response's id is the
 * session id); the answer becomes a response object (response-draft.ts), streamed as the Responses
 * API's events when asked, and is stored (serving/response-store.ts) once complete unless `store`
 * is false. `GET` and `DELETE /v1/responses/{response_id}` read and remove a stored one of the
 * caller's key. A response belongs to its key's owner (identity and uid: auth.ts `Principal`), so
 * another key — of another namespace, or a new key under an old one's name — never reads it;
 * anonymous callers (`allowAnonymous`) share nothing: their responses are not stored.
 */
import type { FastifyPluginCallback } from 'fastify';
import { nuid } from 'nats';
import { checkStructure, refusedOnEvery, unsupportedBy } from '../../shared/chat';
import { chatParamToResponses, chatTextToResponses, pendingResponse, toChatTurn, wantsLogprobs, type ResponsesBody } from '../../shared/responses';
import type { Principal } from '../plugins/auth';
import { conversationKey } from '../serving/conversation';
import { errorBody, errors, type GatewayError } from '../plugins/errors';
import { chainOf, MAX_CHAIN_DEPTH, MAX_STORED_REQUEST_BYTES, type Chain, type StoredResponse } from '../serving/response-store';
import { SseResponse } from './sse';
import { cancelResponseSchema, createResponseSchema, deleteResponseSchema, getResponseSchema } from '../schemas/responses';
import { ClientGone, runTurn, servableModel, serveTurn, type Turn } from './inference';
import { setTimeout as sleep } from 'node:timers/promises';
import { ResponseDraft, type ResponseEvent } from './response-draft';
import { toGatewayError } from '../plugins/errors';
import { followAnswer, instanceEntry, type AskedAgain } from './resume';
import { endedBy, endedWithout, isRunning, lookIn, notBackground, placeOf, readBack, replayRecord, runDraft, settleRun } from './background';
import type { FastifyReply, FastifyRequest } from 'fastify';

/** How often a stream of a background response not yet queued reads its record again. */
const RECORD_POLL_MS = 200;
/** Beyond the cold-start timeout, how long a background response's request may take to be published (a limited key's admission, NATS). */
const PUBLISH_MARGIN_MS = 30_000;

export const responsesRoutes: FastifyPluginCallback = (app, _opts, done) => {
  const g = app.gateway;
  const s = g.settings;

  /** A call of the store: failing, it is a 503 (NATS away), which the client may retry. */
  const stored = <T>(call: Promise<T>): Promise<T> =>
    call.catch((err: unknown) => {
      const e = errors.unavailable(s.retryAfterSec, 'Stored responses cannot be reached right now; retry later.');
      e.cause = err;
      throw e;
    });

  /** The caller's stored response `id`, or a 404 that does not say whether another key has one. */
  const ownRecord = async (id: string, principal: Principal): Promise<StoredResponse> => {
    if (principal.anonymous) throw errors.responseNotFound(id, 'response_id');
    const record = await stored(g.storedResponses.get(id));
    if (record === undefined || record.owner !== principal.owner) throw errors.responseNotFound(id, 'response_id');
    return record;
  };

  /** The chain `previous_response_id` ends, as the caller may continue it. */
  const previousChain = async (id: string, principal: Principal): Promise<Chain> => {
    if (principal.anonymous) throw errors.responseNotFound(id, 'previous_response_id', 'previous_response_not_found');
    const chain = await stored(chainOf(g.storedResponses, id, principal.owner));
    if (!('problem' in chain)) return chain;
    if (chain.problem === 'too_long')
      throw errors.invalid(
        `The conversation of '${id}' holds ${MAX_CHAIN_DEPTH} responses, the most one chain may; start a new one.`,
        'previous_response_id',
        'invalid_value',
      );
    const message = chain.id === id ? undefined : `Response '${chain.id}', an earlier turn of '${id}', is no longer stored.`;
    throw errors.responseNotFound(chain.id, 'previous_response_id', 'previous_response_not_found', message);
  };

  /** Background runs this replica is answering, by response id: a cancel here aborts its run at once. */
  const runs = new Map<string, AbortController>();

  /** Runs `turn` for `record` without its client, and stores the response as it ends (routes/background.ts). */
  const startRun = (request: FastifyRequest, record: StoredResponse, turn: Omit<Turn, 'onDone'>): void => {
    const principal = request.principal!;
    const responseId = record.response.id;
    const draft = runDraft(record);
    const gone = new AbortController();
    runs.set(responseId, gone);
    const log = request.log.child({ responseId });
    runTurn(
      app,
      { principal, log, declaredBytes: Number(request.headers['content-length'] ?? 0), header: () => undefined, gone: gone.signal },
      {
        ...turn,
        onPublish: async (entry, req) => {
          const place = { replica: g.responses.replica, pool: entry.pool, instance: entry.instance, deadline: req.deadline };
          const r = await settleRun(app, principal, responseId, (rec) => ({ ...rec, run: { ...rec.run!, ...place } }));
          if (!r || !isRunning(r)) throw new ClientGone('the response was cancelled or deleted before its request was queued');
        },
        onChunk: (chunk) => void draft.chunk(chunk),
        onDone: async () => {
          const { response } = draft.finish();
          await settleRun(app, principal, responseId, (rec) => endedBy(rec, draft, response));
        },
      },
    )
      .catch(async (err: unknown) => {
        if (err instanceof ClientGone) return; // cancelled: the cancel wrote the record
        const e = toGatewayError(err, s.retryAfterSec);
        const error = errorBody(e, turn.id).error;
        log[e.status >= 500 ? 'error' : 'info']({ err, inferenceId: turn.id }, 'a background response failed');
        await settleRun(app, principal, responseId, (rec) => endedWithout(rec, draft, 'failed', error.code ?? 'server_error', error.message));
      })
      .catch((err: unknown) => log.warn({ err }, 'could not store how a background response ended (a later read of it will)'))
      .finally(() => runs.delete(responseId));
  };

  /**
   * What `record`'s run asks, as a replica that must send it on needs it; undefined for a record of
   * an older magus, or when this caller's key may no longer use the model (it is then only followed).
   */
  const askedOf = async (principal: Principal, record: StoredResponse): Promise<AskedAgain | undefined> => {
    const body = record.run?.body;
    const model = body && (await servableModel(app, principal, record.model).catch(() => undefined));
    return body && model && { model, payload: { body }, principal };
  };

  /**
   * Adopts `record`'s run, whose answer must move (lookIn's `onStalled`) and whose accepting
   * replica may be gone: followed here without a client from its first frame, a move nobody
   * claims within a second claimed and sent on from its stored request (resume.ts
   * `followAnswer`), and the response stored as it ends. Once per run per replica; should the
   * accepting replica still run, the move log lets one of them continue it, and both store the same end.
   */
  const adoptRun = (request: FastifyRequest, record: StoredResponse): void => {
    const principal = request.principal!;
    const responseId = record.response.id;
    const place = record.run && placeOf(record.run);
    if (!place || runs.has(responseId)) return;
    const gone = new AbortController();
    runs.set(responseId, gone);
    const log = request.log.child({ responseId });
    const draft = runDraft(record);
    void (async () => {
      const asked = await askedOf(principal, record);
      if (!asked) return; // an older record: nothing to send on with
      log.info({ instance: place.instance }, 'adopting a background response whose answer must move');
      await followAnswer(app, place, gone.signal, (chunk) => void draft.chunk(chunk), asked);
      const { response } = draft.finish();
      await settleRun(app, principal, responseId, (rec) => endedBy(rec, draft, response));
    })()
      .catch(async (err: unknown) => {
        if (gone.signal.aborted) return; // cancelled here: the cancel wrote the record
        const e = toGatewayError(err, s.retryAfterSec);
        // Only an end the engine said is stored; a timeout here says only that this replica heard nothing.
        if (e.code !== 'engine_error' && !(e.status >= 400 && e.status < 500))
          return log.warn({ err }, 'an adopted background response was not followed to its end');
        const error = errorBody(e, place.requestId).error;
        await settleRun(app, principal, responseId, (rec) => endedWithout(rec, draft, 'failed', error.code ?? 'server_error', error.message));
      })
      .catch((err: unknown) => log.warn({ err }, 'could not store how an adopted background response ended (a later read of it will)'))
      .finally(() => runs.delete(responseId));
  };

  /** Stops `record`'s run: aborted here, or its bridge told to stop. */
  const stopRun = (record: StoredResponse): void => {
    runs.get(record.response.id)?.abort(new ClientGone('the response was cancelled'));
    const place = record.run && placeOf(record.run);
    if (place) g.cancel?.(instanceEntry(place.pool, place.instance), place.requestId);
  };

  /** Stores `record` cancelled, with what its answer had (or as it ended, if it ended first), and stops its run. */
  const cancelRun = async (principal: Principal, record: StoredResponse): Promise<StoredResponse | undefined> => {
    const { draft } = await readBack(app, record);
    const done = await settleRun(app, principal, record.response.id, (rec) =>
      draft.ended ? endedBy(rec, draft, draft.snapshot()) : endedWithout(rec, draft, 'cancelled', 'cancelled', 'The response was cancelled.'),
    );
    stopRun(record);
    return done;
  };

  /**
   * Streams response `id`'s events after `startingAfter` (-1: all): what its frames hold, then
   * followed live while it runs; a response that ended, as its record or frames have it. The same
   * events with the same sequence numbers on every replica.
   */
  const streamRun = async (request: FastifyRequest, reply: FastifyReply, id: string, startingAfter: number): Promise<FastifyReply> => {
    const principal = request.principal!;
    let record = await ownRecord(id, principal);
    if (!record.response.background) {
      throw errors.invalid(
        `Response '${id}' was not created with \`background: true\`: only background responses can be streamed again.`,
        'stream',
        'invalid_value',
      );
    }
    const sse = new SseResponse(reply, s.keepAliveMs, record.run?.request ?? id);
    let sequence = 0;
    const emit = (events: ResponseEvent[]) => {
      for (const e of events) {
        const n = sequence++;
        if (n > startingAfter) sse.event(e.type, { ...e, sequence_number: n });
      }
    };
    const ctl = new AbortController();
    const onClose = () => {
      if (!reply.raw.writableEnded) ctl.abort(new ClientGone('the client closed the connection'));
    };
    reply.raw.once('close', onClose);
    try {
      // Until its request is published (a cold start may take a while), the record says where to look.
      sse.waiting('queued: waiting for an instance to take the request');
      while (isRunning(record) && !(record.run && placeOf(record.run)) && !ctl.signal.aborted) {
        if (record.run && Date.now() > record.run.publishBy) {
          record = await stored(lookIn(app, principal, record)); // never queued by its deadline: stored failed, so
          break;
        }
        await sleep(RECORD_POLL_MS);
        record = (await stored(g.storedResponses.get(id))) ?? record;
      }
      const place = record.run && placeOf(record.run);
      if (!isRunning(record) || !place) {
        // Ended: as its frames have it when they hold its whole answer, else as its record does.
        const { draft, events } = await stored(readBack(app, record));
        emit(draft.ended && draft.snapshot().status === record.response.status ? events : replayRecord(record));
        sse.end();
        return reply;
      }
      const draft = runDraft(record);
      sse.waiting(`queued at instance ${place.instance}: waiting for its engine to begin the answer`);
      emit(draft.begin());
      try {
        // With the request it asks: should its answer move with its accepting replica gone, this one sends it on.
        await followAnswer(app, place, ctl.signal, (chunk) => emit(draft.chunk(chunk)), await askedOf(principal, record));
        emit(draft.finish().events);
        await settleRun(app, principal, id, (rec) => endedBy(rec, draft, draft.snapshot())).catch(() => undefined);
      } catch (err) {
        if (ctl.signal.aborted) throw ctl.signal.reason;
        const e = toGatewayError(err, s.retryAfterSec);
        const error = errorBody(e, place.requestId).error;
        const cancelled = e.status === 499;
        emit(draft.failed(error.code ?? 'server_error', error.message, cancelled));
        // An answer the engine ended with an error ended so; a timeout here says only that this replica heard nothing.
        if (e.code === 'engine_error' || (e.status >= 400 && e.status < 500 && !cancelled))
          await settleRun(app, principal, id, (rec) => endedWithout(rec, draft, 'failed', error.code ?? 'server_error', error.message)).catch(() => undefined);
      }
      sse.end();
      return reply;
    } catch (err) {
      if (err instanceof ClientGone) {
        if (!sse.started) reply.hijack();
        reply.raw.destroy();
        return reply;
      }
      if (!sse.started) throw err;
      sse.fail(toGatewayError(err, s.retryAfterSec), record.run?.request ?? id);
      return reply;
    } finally {
      sse.stop();
      reply.raw.removeListener('close', onClose);
    }
  };

  app.post<{ Body: ResponsesBody }>(
    '/v1/responses',
    { schema: createResponseSchema, bodyLimit: s.bodyLimit, onRequest: app.authenticate },
    async (request, reply) => {
      const principal = request.principal!;
      // An anonymous caller's response is not stored: no other anonymous caller could be kept from it.
      const body = principal.anonymous ? { ...request.body, store: false } : request.body;
      if (body.background === true && (principal.anonymous || body.store === false))
        throw errors.invalid(
          principal.anonymous
            ? 'A background response is stored, and anonymous callers store nothing: send a key.'
            : 'A background response is stored so that it can be fetched: `store` must not be false.',
          principal.anonymous ? 'background' : 'store',
          'invalid_value',
        );
      const model = await servableModel(app, principal, body.model);
      const chain = body.previous_response_id != null ? await previousChain(body.previous_response_id, principal) : undefined;
      const stream = body.stream === true;
      const turn = toChatTurn(body, chain?.messages ?? [], stream);
      // Every stream asks for usage: the response's `usage`, and /metrics.
      if (stream) turn.request.stream_options = { include_usage: true };
      // Chat's refusals and checks, on the chat request the response becomes, naming the Responses field.
      const refusal = (message: string, param: string, code: string) =>
        errors.invalid(chatTextToResponses(message, turn.origins), chatParamToResponses(param, turn.origins), code);
      const refused = refusedOnEvery(g.models.engines(model), (e) => unsupportedBy(e, turn.request));
      if (refused) throw refusal(refused.message, refused.field, 'unsupported_feature');
      const checked = checkStructure(turn.request);
      if (!checked.ok) throw refusal(checked.problem.message, checked.problem.param, checked.problem.code);
      let storeBytes: number | undefined;
      if (body.store !== false) {
        const bytes = (storeBytes = Buffer.byteLength(JSON.stringify([turn.input, body.instructions, body.tools, body.metadata, body.text])));
        if (bytes > MAX_STORED_REQUEST_BYTES) {
          throw errors.invalid(
            `A stored response keeps its input, instructions and tools: these are ${bytes} bytes, more than the ${MAX_STORED_REQUEST_BYTES} a stored response may keep. Send less, or \`store: false\`.`,
            'input',
            'input_too_large',
          );
        }
      }

      const id = nuid.next();
      const responseId = `resp_${id}`;
      const modelLabel = `${model.namespace}/${model.name}`;
      const root = chain?.root ?? responseId;
      // Every turn of a chain is one conversation: its first response's id is the session id.
      const key = conversationKey(s.secret, { scope: principal.conversationScope, model: modelLabel, messages: [], sessionId: root });
      const draft = new ResponseDraft(pendingResponse(responseId, body, Math.floor(Date.now() / 1000)), wantsLogprobs(body));
      /** The record of this turn: its request's part, and `output` and `response`. */
      const recordOf = (output: StoredResponse['output'], response: StoredResponse['response']): StoredResponse => ({
        owner: principal.owner,
        model: modelLabel,
        root,
        previous: body.previous_response_id ?? null,
        depth: chain?.depth ?? 0,
        input: turn.input,
        output,
        response,
      });
      const keep = async (response: StoredResponse['response']): Promise<void> => {
        if (!response.store) return;
        const size = await stored(g.storedResponses.put(responseId, recordOf(draft.assistantMessages(), response)));
        if (principal.limits) await g.limiter?.stored(principal.key, principal.limits, size.bytes, size.storedAtMs);
      };
      if (body.background === true) {
        const record: StoredResponse = {
          ...recordOf([], pendingResponse(responseId, body, Math.floor(Date.now() / 1000))),
          run: { request: id, publishBy: Date.now() + s.coldStartTimeoutMs + PUBLISH_MARGIN_MS, logprobs: wantsLogprobs(body) },
        };
        // The engine streams, so the frames hold the answer as it grows.
        turn.request.stream = true;
        turn.request.stream_options = { include_usage: true };
        record.run!.body = turn.request;
        await stored(g.storedResponses.put(responseId, record));
        startRun(request, record, {
          id,
          model,
          ...(storeBytes !== undefined ? { storeBytes } : {}),
          conversationKey: key,
          payload: { body: turn.request },
        });
        reply.header('x-request-id', id);
        if (!stream) return record.response;
        return streamRun(request, reply, responseId, -1);
      }
      const sse = stream ? new SseResponse(reply, s.keepAliveMs, id) : undefined;
      let sequence = 0;
      const emit = (events: ResponseEvent[]) => {
        for (const e of events) sse!.event(e.type, { ...e, sequence_number: sequence++ });
      };
      return serveTurn(app, request, reply, {
        id,
        model,
        ...(storeBytes !== undefined ? { storeBytes } : {}),
        conversationKey: key,
        payload: { body: turn.request },
        sse,
        onChunk: (chunk) => emit(draft.chunk(chunk)),
        onDone: async (answer) => {
          if (!sse) draft.completion(answer);
          const { events, response } = draft.finish();
          // Stored before the client hears it is complete: a next turn may name it at once.
          await keep(response);
          if (!sse) return response;
          emit(events);
          sse.end();
          return undefined;
        },
        // `response.failed`, then the `error` event (with an `error` object, on which OpenAI's clients throw).
        onStreamError: (e: GatewayError) => {
          const error = errorBody(e, id).error;
          emit([
            ...draft.failed(error.code ?? 'server_error', error.message),
            { type: 'error', code: error.code, message: error.message, param: error.param, error },
          ]);
          sse!.end();
        },
      });
    },
  );

  app.get<{ Params: { response_id: string }; Querystring: { stream?: 'true' | 'false'; starting_after?: string } }>(
    '/v1/responses/:response_id',
    { schema: getResponseSchema, onRequest: app.authenticate },
    async (request, reply) => {
      const principal = request.principal!;
      const record = await ownRecord(request.params.response_id, principal);
      if (request.query.stream === 'true') return streamRun(request, reply, record.response.id, Number(request.query.starting_after ?? -1));
      return isRunning(record) ? (await stored(lookIn(app, principal, record, () => adoptRun(request, record)))).response : record.response;
    },
  );

  app.post<{ Params: { response_id: string } }>(
    '/v1/responses/:response_id/cancel',
    { schema: cancelResponseSchema, onRequest: app.authenticate },
    async (request) => {
      const principal = request.principal!;
      const record = await ownRecord(request.params.response_id, principal);
      if (!record.response.background) throw notBackground(record.response.id);
      if (!isRunning(record)) return record.response;
      const cancelled = await stored(cancelRun(principal, record));
      return cancelled?.response ?? record.response;
    },
  );

  app.delete<{ Params: { response_id: string } }>(
    '/v1/responses/:response_id',
    { schema: deleteResponseSchema, onRequest: app.authenticate },
    async (request) => {
      const id = request.params.response_id;
      const principal = request.principal!;
      const record = await ownRecord(id, principal);
      if (isRunning(record)) stopRun(record);
      const size = await stored(g.storedResponses.delete(id));
      if (size && principal.limits) await g.limiter?.stored(principal.key, principal.limits, size.bytes, size.storedAtMs, true);
      return { id, object: 'response', deleted: true };
    },
  );
  done();
};

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
import { createResponseSchema, deleteResponseSchema, getResponseSchema } from '../schemas/responses';
import { servableModel, serveTurn } from './inference';
import { ResponseDraft, type ResponseEvent } from './response-draft';

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

  app.post<{ Body: ResponsesBody }>(
    '/v1/responses',
    { schema: createResponseSchema, bodyLimit: s.bodyLimit, onRequest: app.authenticate },
    async (request, reply) => {
      const principal = request.principal!;
      // An anonymous caller's response is not stored: no other anonymous caller could be kept from it.
      const body = principal.anonymous ? { ...request.body, store: false } : request.body;
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
      const keep = async (response: StoredResponse['response']): Promise<void> => {
        if (!response.store) return;
        const record: StoredResponse = {
          owner: principal.owner,
          model: modelLabel,
          root,
          previous: body.previous_response_id ?? null,
          depth: chain?.depth ?? 0,
          input: turn.input,
          output: draft.assistantMessages(),
          response,
        };
        const size = await stored(g.storedResponses.put(responseId, record));
        if (principal.limits) await g.limiter?.stored(principal.key, principal.limits, size.bytes, size.storedAtMs);
      };
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

  app.get<{ Params: { response_id: string } }>('/v1/responses/:response_id', { schema: getResponseSchema, onRequest: app.authenticate }, async (request) => {
    const record = await ownRecord(request.params.response_id, request.principal!);
    return record.response;
  });

  app.delete<{ Params: { response_id: string } }>(
    '/v1/responses/:response_id',
    { schema: deleteResponseSchema, onRequest: app.authenticate },
    async (request) => {
      const id = request.params.response_id;
      const principal = request.principal!;
      await ownRecord(id, principal);
      const size = await stored(g.storedResponses.delete(id));
      if (size && principal.limits) await g.limiter?.stored(principal.key, principal.limits, size.bytes, size.storedAtMs, true);
      return { id, object: 'response', deleted: true };
    },
  );
  done();
};

/**
 * `POST /v1/completions` (legacy text completions): authenticate → find the model → refuse what
 * its engines cannot do → an instance of its pool (raw text belongs to no conversation: no entry,
 * no session, as for embeddings; sessions.ts `route`) → publish the request → relay its frames
 * (SSE when `stream`, one JSON body otherwise), as the chat route does.
 */
import type { FastifyPluginCallback } from 'fastify';
import { nuid } from 'nats';
import { refusedOnEvery } from '../../shared/chat';
import { COMPLETIONS_FORWARDED, completionsUnsupportedBy, type CompletionsBody, type CompletionsRequest } from '../../shared/completions';
import type { CompletionsInference, SessionEntry } from '../../shared/serving';
import { mayUse } from '../plugins/auth';
import { errors, toGatewayError } from '../plugins/errors';
import { exchange } from '../plugins/responses';
import { SseResponse } from '../plugins/sse';
import { completionsSchema } from '../schemas/completions';
import { ClientGone, exchangeOptions, isUsageChunk, usageCounter } from './inference';

/** What the engine gets: the forwarded fields as sent; every stream asks for usage (counted on /metrics; relayed only when the client asked). */
function toEngineRequest(body: CompletionsBody): CompletionsRequest {
  const out: Record<string, unknown> = { prompt: body.prompt };
  for (const field of COMPLETIONS_FORWARDED) if (body[field] !== undefined) out[field] = body[field];
  if (body.logprobs != null) out.logprobs = body.logprobs;
  if (body.stream === true) out.stream_options = { include_usage: true };
  return out as CompletionsRequest;
}

export const completionsRoutes: FastifyPluginCallback = (app, _opts, done) => {
  const g = app.gateway;
  const s = g.settings;

  app.post<{ Body: CompletionsBody }>('/v1/completions', { schema: completionsSchema, bodyLimit: s.bodyLimit, onRequest: app.authenticate }, async (request, reply) => {
    const body = request.body;
    const model = await g.models.find(body.model);
    if (!model || !mayUse(request.principal!, model.namespace, model.name)) throw errors.modelNotFound(body.model);
    const unservable = g.models.unservable(model);
    if (unservable) throw errors.invalid(unservable, 'model', 'model_not_servable');
    const refused = refusedOnEvery(g.models.engines(model), completionsUnsupportedBy);
    if (refused) throw errors.invalid(refused.message, refused.field, 'unsupported_feature');
    const backlog = g.backlogFull?.(model);
    if (backlog) throw errors.backlogFull(backlog.retryAfterSec);

    const id = nuid.next();
    reply.header('x-request-id', id);
    const ctl = new AbortController();
    const onClose = () => {
      if (!reply.raw.writableEnded) ctl.abort(new ClientGone('the client closed the connection'));
    };
    reply.raw.once('close', onClose);
    const sse = body.stream === true ? new SseResponse(reply, s.keepAliveMs, id) : undefined;
    const clientWantsUsage = body.stream === true && body.stream_options?.include_usage === true;
    const countUsage = usageCounter(app, `${model.namespace}/${model.name}`);
    let entry: SessionEntry | undefined;
    const coldStartTimer = setTimeout(() => ctl.abort(errors.noCapacity(s.retryAfterSec)), s.coldStartTimeoutMs);
    try {
      entry = await g.sessions.route({ model, signal: ctl.signal }).finally(() => clearTimeout(coldStartTimer));
      const req: CompletionsInference = { id, replyTo: g.responses.replySubject(id), deadline: Date.now() + s.requestTimeoutMs, kind: 'completions', body: toEngineRequest(body) };
      const answer = await exchange(entry, req, {
        ...exchangeOptions(app, entry, req, ctl.signal),
        onChunk: sse
          ? (chunk) => {
              if (isUsageChunk(chunk)) {
                countUsage(chunk);
                if (!clientWantsUsage) return;
              }
              sse.data(chunk);
            }
          : undefined,
        retryPublish: sse && (() => sse.started),
        onPublishRetry: () => app.metrics.publishRetries.inc(),
      });
      if (sse) {
        sse.done();
        return reply;
      }
      if (typeof answer !== 'object' || answer === null) throw errors.upstream(502, 'empty_response');
      countUsage(answer);
      return reply.send(answer);
    } catch (thrown) {
      // Aborted: the client left (nobody to answer), or the cold start took too long (503).
      const err = ctl.signal.aborted ? (ctl.signal.reason as unknown) : thrown;
      if (err instanceof ClientGone) {
        request.log.info({ inferenceId: id }, 'client went away');
        if (entry) g.cancel?.(entry, id); // the engine stops generating for nobody
        if (!sse?.started) reply.hijack();
        reply.raw.destroy();
        return reply;
      }
      if (!sse?.started) throw err;
      const e = toGatewayError(err, s.retryAfterSec);
      request.log[e.status >= 500 ? 'error' : 'info']({ err, inferenceId: id }, 'stream failed after it started');
      sse.fail(e, id);
      return reply;
    } finally {
      sse?.stop();
      reply.raw.removeListener('close', onClose);
    }
  });
  done();
};

/**
 * `POST /v1/embeddings`: authenticate → find the model → refuse what its engines cannot do → an
 * instance of its pool (no conversation: no entry, no session; sessions.ts `route`) → publish the
 * request → one `done` frame with the engine's answer.
 */
import type { FastifyPluginCallback } from 'fastify';
import { nuid } from 'nats';
import { refusedOnEvery } from '../../shared/chat';
import { embeddingsUnsupportedBy, type EmbeddingsBody, type EmbeddingsResponse } from '../../shared/embeddings';
import type { EmbeddingsInference } from '../../shared/serving';
import { errors } from '../plugins/errors';
import { exchange } from '../plugins/responses';
import { embeddingsSchema } from '../schemas/embeddings';
import { ClientGone, exchangeOptions, servableModel } from './inference';

export const embeddingsRoutes: FastifyPluginCallback = (app, _opts, done) => {
  const g = app.gateway;
  const s = g.settings;

  app.post<{ Body: EmbeddingsBody }>('/v1/embeddings', { schema: embeddingsSchema, bodyLimit: s.bodyLimit, onRequest: app.authenticate }, async (request, reply) => {
    const { user: _user, ...body } = request.body;
    const model = await servableModel(app, request.principal!, body.model);
    const refused = refusedOnEvery(g.models.engines(model), embeddingsUnsupportedBy);
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
    const coldStartTimer = setTimeout(() => ctl.abort(errors.noCapacity(s.retryAfterSec)), s.coldStartTimeoutMs);
    try {
      const entry = await g.sessions.route({ model, signal: ctl.signal }).finally(() => clearTimeout(coldStartTimer));
      const req: EmbeddingsInference = { id, replyTo: g.responses.replySubject(id), deadline: Date.now() + s.requestTimeoutMs, kind: 'embeddings', body };
      const answer = (await exchange(entry, req, exchangeOptions(app, entry, req, ctl.signal))) as EmbeddingsResponse | null;
      if (typeof answer !== 'object' || answer === null) throw errors.upstream(502, 'empty_response');
      app.metrics.promptTokens.inc([`${model.namespace}/${model.name}`], answer.usage?.prompt_tokens ?? 0);
      return reply.send(answer);
    } catch (thrown) {
      // Aborted: the client left (nobody to answer), or the cold start took too long (503).
      const err = ctl.signal.aborted ? (ctl.signal.reason as unknown) : thrown;
      if (!(err instanceof ClientGone)) throw err;
      reply.hijack();
      reply.raw.destroy();
      return reply;
    } finally {
      reply.raw.removeListener('close', onClose);
    }
  });
  done();
};

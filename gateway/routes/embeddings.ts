/**
 * `POST /v1/embeddings`: authenticate → find the model → refuse what its engines cannot do → the
 * request (inference.ts `serveTurn`) on an instance of its pool (no conversation: no entry, no
 * session) → one `done` frame with the engine's answer.
 */
import type { FastifyPluginCallback } from 'fastify';
import { nuid } from 'nats';
import { refusedOnEvery } from '../../shared/chat';
import { embeddingsUnsupportedBy, type EmbeddingsBody } from '../../shared/embeddings';
import { errors } from '../plugins/errors';
import { embeddingsSchema } from '../schemas/embeddings';
import { servableModel, serveTurn } from './inference';

export const embeddingsRoutes: FastifyPluginCallback = (app, _opts, done) => {
  const g = app.gateway;
  const s = g.settings;

  app.post<{ Body: EmbeddingsBody }>(
    '/v1/embeddings',
    { schema: embeddingsSchema, bodyLimit: s.bodyLimit, onRequest: app.authenticate },
    async (request, reply) => {
      const { user: _user, ...body } = request.body;
      const model = await servableModel(app, request.principal!, body.model);
      const refused = refusedOnEvery(g.models.engines(model), embeddingsUnsupportedBy);
      if (refused) throw errors.invalid(refused.message, refused.field, 'unsupported_feature');

      const id = nuid.next();
      return serveTurn(app, request, reply, { id, model, payload: { kind: 'embeddings', body }, onDone: (answer) => answer });
    },
  );
  done();
};

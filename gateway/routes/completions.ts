/**
 * `POST /v1/completions` (legacy text completions): authenticate → find the model → refuse what
 * its engines cannot do → the request (inference.ts `serveTurn`) on an instance of the model's
 * pool — raw text belongs to no conversation: no entry, no session, as for embeddings — relayed
 * as SSE chunks when `stream`, one JSON body otherwise.
 */
import type { FastifyPluginCallback } from 'fastify';
import { nuid } from 'nats';
import { refusedOnEvery } from '../../shared/chat';
import { COMPLETIONS_FORWARDED, completionsUnsupportedBy, type CompletionsBody, type CompletionsRequest } from '../../shared/completions';
import { errors } from '../plugins/errors';
import { SseResponse } from './sse';
import { completionsSchema } from '../schemas/completions';
import { relayed, servableModel, serveTurn } from './inference';
import { resumePointOf, serveResume } from './resume';

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

  app.post<{ Body: CompletionsBody }>(
    '/v1/completions',
    { schema: completionsSchema, bodyLimit: s.bodyLimit, onRequest: app.authenticate },
    async (request, reply) => {
      const body = request.body;
      const model = await servableModel(app, request.principal!, body.model);
      const refused = refusedOnEvery(g.models.engines(model), completionsUnsupportedBy);
      if (refused) throw errors.invalid(refused.message, refused.field, 'unsupported_feature');

      const resume = resumePointOf(app, request, request.principal!.conversationScope, body.stream === true);
      const id = resume?.requestId ?? nuid.next();
      const sse = body.stream === true ? new SseResponse(reply, s.keepAliveMs, id) : undefined;
      const relay = relayed(sse, body.stream_options?.include_usage === true);
      const payload = { kind: 'completions' as const, body: toEngineRequest(body) };
      if (resume) return serveResume(app, reply, resume, sse!, relay.onChunk!, { model, payload, principal: request.principal! });
      return serveTurn(app, request, reply, {
        id,
        model,
        payload,
        resumable: true,
        ...relay,
      });
    },
  );
  done();
};

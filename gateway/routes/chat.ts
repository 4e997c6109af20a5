/**
 * `POST /v1/chat/completions`: authenticate → find the model → refuse what its engines cannot do
 * → conversation key → the turn (inference.ts `serveTurn`: session, publish, relay) as SSE
 * chunks when `stream`, one JSON body otherwise.
 */
import type { FastifyPluginCallback } from 'fastify';
import { nuid } from 'nats';
import {
  checkStructure,
  forwardedFields,
  refusedOnEvery,
  unsupportedBy,
  type ChatCompletionBody,
  type ChatCompletionRequest,
  type ChatMessage,
} from '../../shared/chat';
import { conversationKey } from '../serving/conversation';
import { errors } from '../plugins/errors';
import { SseResponse } from './sse';
import { chatCompletionSchema } from '../schemas/chat';
import { relayed, servableModel, serveTurn } from './inference';
import { resumePointOf, serveResume } from './resume';

/**
 * Flattens OpenAI text parts; engines take one string per message (an assistant's `null` beside
 * its tool calls is empty). An assistant's tool calls and a tool result's call id go along.
 */
function toMessages(body: ChatCompletionBody): ChatMessage[] {
  return body.messages.map((m) => {
    const out: ChatMessage = {
      role: m.role,
      content: m.content === null ? '' : typeof m.content === 'string' ? m.content : m.content.map((p) => p.text).join(''),
    };
    if (m.role === 'assistant' && m.tool_calls?.length) out.tool_calls = m.tool_calls;
    if (m.role === 'tool') out.tool_call_id = m.tool_call_id;
    return out;
  });
}

/** Only the fields engines understand go over the wire (shared/chat.ts `FORWARDED_FIELDS`, and what the gateway sets). */
function toEngineRequest(body: ChatCompletionBody, messages: ChatMessage[]): ChatCompletionRequest {
  const out: ChatCompletionRequest = { ...forwardedFields(body), messages, stream: body.stream === true };
  const maxTokens = body.max_tokens ?? body.max_completion_tokens;
  if (maxTokens !== undefined) out.max_tokens = maxTokens;
  // Every stream asks for usage, so every answer is counted on /metrics; the usage chunk reaches
  // only clients that asked for it.
  if (out.stream) out.stream_options = { include_usage: true };
  return out;
}

export const chatRoutes: FastifyPluginCallback = (app, _opts, done) => {
  const g = app.gateway;
  const s = g.settings;

  app.post<{ Body: ChatCompletionBody; Headers: { 'x-session-id'?: string } }>(
    '/v1/chat/completions',
    { schema: chatCompletionSchema, bodyLimit: s.bodyLimit, onRequest: app.authenticate },
    async (request, reply) => {
      const body = request.body;
      const principal = request.principal!;
      const model = await servableModel(app, principal, body.model);
      // What no engine the model may run on can do: refused before anything is queued (and a
      // bridge refuses it too, should an instance run on such an engine after all).
      const refused = refusedOnEvery(g.models.engines(model), (e) => unsupportedBy(e, body));
      if (refused) throw errors.invalid(refused.message, refused.field, 'unsupported_feature');
      const checked = checkStructure(body);
      if (!checked.ok) throw errors.invalid(checked.problem.message, checked.problem.param, checked.problem.code);

      const messages = toMessages(body);
      const key = conversationKey(s.secret, {
        scope: principal.conversationScope,
        model: `${model.namespace}/${model.name}`,
        messages,
        sessionId: request.headers['x-session-id'],
      });
      const resume = resumePointOf(app, request, principal.conversationScope, body.stream === true);
      const id = resume?.requestId ?? nuid.next();
      const sse = body.stream === true ? new SseResponse(reply, s.keepAliveMs, id) : undefined;
      const relay = relayed(sse, body.stream_options?.include_usage === true);
      const payload = { body: toEngineRequest(body, messages) };
      if (resume) return serveResume(app, reply, resume, sse!, relay.onChunk!, { model, payload, principal });
      return serveTurn(app, request, reply, {
        id,
        model,
        conversationKey: key,
        payload,
        resumable: true,
        ...relay,
      });
    },
  );
  done();
};

/**
 * `POST /v1/chat/completions`: authenticate → find the model → conversation key → session
 * (warm: a map read; cold: the broker's slow path) → listen on `magus.res.<replica>.<id>` → publish the
 * request to the instance → relay frames (SSE when `stream`, one JSON body otherwise).
 */
import type { FastifyPluginCallback, FastifyReply } from 'fastify';
import { nuid } from 'nats';
import { checkStructure, forwardedFields, refusedOnEvery, unsupportedBy, type ChatCompletionBody, type ChatCompletionRequest, type ChatMessage } from '../../shared/chat';
import type { InferenceRequest, SessionEntry } from '../../shared/serving';
import { mayUse } from '../plugins/auth';
import { conversationKey } from '../plugins/conversation';
import { errors, toGatewayError } from '../plugins/errors';
import { exchange } from '../plugins/responses';
import { SseResponse } from '../plugins/sse';
import { chatCompletionSchema } from '../schemas/chat';
import { ClientGone, exchangeOptions, isUsageChunk, usageCounter } from './inference';

/**
 * Flattens OpenAI text parts; engines take one string per message (an assistant's `null` beside
 * its tool calls is empty). An assistant's tool calls and a tool result's call id go along.
 */
function toMessages(body: ChatCompletionBody): ChatMessage[] {
  return body.messages.map((m) => {
    const out: ChatMessage = { role: m.role, content: m.content === null ? '' : typeof m.content === 'string' ? m.content : m.content.map((p) => p.text).join('') };
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
    async (request, reply: FastifyReply) => {
      const body = request.body;
      const principal = request.principal!;
      const model = await g.models.find(body.model);
      if (!model || !mayUse(principal, model.namespace, model.name)) throw errors.modelNotFound(body.model);
      // No live runtime can run any of its artifacts: a cold start could only fail (`NoArtifact`),
      // so say why at once. 400, not 503: a 5xx hides its reason and invites retries that cannot help.
      const unservable = g.models.unservable(model);
      if (unservable) throw errors.invalid(unservable, 'model', 'model_not_servable');
      // What no engine the model may run on can do: refused before anything is queued (and a
      // bridge refuses it too, should an instance run on such an engine after all).
      const refused = refusedOnEvery(g.models.engines(model), (e) => unsupportedBy(e, body));
      if (refused) throw errors.invalid(refused.message, refused.field, 'unsupported_feature');
      const checked = checkStructure(body);
      if (!checked.ok) throw errors.invalid(checked.problem.message, checked.problem.param, checked.problem.code);
      const backlog = g.backlogFull?.(model);
      if (backlog) throw errors.backlogFull(backlog.retryAfterSec);

      const messages = toMessages(body);
      const key = conversationKey(s.secret, { tokenId: principal.tokenId, model: `${model.namespace}/${model.name}`, messages, sessionId: request.headers['x-session-id'] });
      const id = nuid.next();
      reply.header('x-request-id', id); // also on error responses; the error handler logs it
      const ctl = new AbortController();
      const onClose = () => {
        if (!reply.raw.writableEnded) ctl.abort(new ClientGone('the client closed the connection'));
      };
      reply.raw.once('close', onClose);
      const sse = body.stream === true ? new SseResponse(reply, s.keepAliveMs, id) : undefined;
      const clientWantsUsage = body.stream === true && body.stream_options?.include_usage === true;
      const countUsage = usageCounter(app, `${model.namespace}/${model.name}`);
      let entry: SessionEntry;
      let published: SessionEntry | undefined;
      // Whether this turn was answered: a conversation it starts gets its session only then (sessions.ts).
      let settle!: (answered: boolean) => void;
      const answered = new Promise<boolean>((resolve) => (settle = resolve));
      try {
        const coldStartTimer = setTimeout(() => ctl.abort(errors.noCapacity(s.retryAfterSec)), s.coldStartTimeoutMs);
        try {
          entry = await g.sessions.acquire({ conversationKey: key, model, tokenId: principal.tokenId, signal: ctl.signal, answered });
        } finally {
          clearTimeout(coldStartTimer);
        }
        if (ctl.signal.aborted) throw ctl.signal.reason;
        const req: InferenceRequest = { id, replyTo: g.responses.replySubject(id), deadline: Date.now() + s.requestTimeoutMs, body: toEngineRequest(body, messages) };
        published = entry;
        const done = await exchange(entry, req, {
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
          settle(true);
          sse.done();
          return reply;
        }
        if (typeof done !== 'object' || done === null) throw errors.upstream(502, 'empty_response');
        countUsage(done);
        settle(true);
        return reply.send(done);
      } catch (thrown) {
        // Part of a streamed answer reached the client: the conversation exists on its side.
        settle(sse?.started === true);
        // A cold-start timeout aborts the broker, which may reject with its own abort error.
        const err = ctl.signal.aborted ? (ctl.signal.reason as unknown) : thrown;
        if (err instanceof ClientGone) {
          request.log.info({ inferenceId: id }, 'client went away');
          if (published) g.cancel?.(published, id); // the engine stops generating for nobody
          if (!sse?.started) reply.hijack();
          reply.raw.destroy();
          return reply;
        }
        if (!sse?.started) throw err; // the error handler answers (and logs 5xx with their cause)
        const e = toGatewayError(err, s.retryAfterSec);
        request.log[e.status >= 500 ? 'error' : 'info']({ err, inferenceId: id }, 'stream failed after it started');
        sse.fail(e, id);
        return reply;
      } finally {
        settle(false);
        sse?.stop();
        reply.raw.removeListener('close', onClose);
      }
    },
  );
  done();
};

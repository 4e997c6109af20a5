/**
 * What the routes that publish an inference request share (chat, completions, embeddings): why a
 * request's controller was aborted by its client, the {@link ExchangeOptions} every exchange takes
 * from the gateway's services and settings, and how an answer's `usage` is read.
 */
import type { FastifyInstance } from 'fastify';
import type { CompletionUsage, InferenceRequest, SessionEntry } from '../../shared/serving';
import type { ExchangeOptions } from '../plugins/responses';

/** Why a request's controller was aborted: the client left (the cold-start timeout aborts with a 503 of its own). */
export class ClientGone extends Error {
  override readonly name = 'ClientGone';
}

/** The options of an exchange of `req` on `entry`'s instance, aborted by `signal`; a route adds its own (chunks, publish retries). */
export function exchangeOptions(app: FastifyInstance, entry: SessionEntry, req: InferenceRequest, signal: AbortSignal): ExchangeOptions {
  const g = app.gateway;
  const s = g.settings;
  return {
    router: g.responses,
    publish: g.publish,
    requestTimeoutMs: s.requestTimeoutMs,
    gapTimeoutMs: s.gapTimeoutMs,
    readBack: g.readStored && (() => g.readStored!(req.replyTo)),
    retryAfterSec: s.retryAfterSec,
    signal,
    onUpstreamError: (reason) => app.metrics.upstreamErrors.inc([reason]),
    onAbandon: () => g.cancel?.(entry, req.id),
  };
}

/** The `usage` an engine's answer or usage chunk carries, if any (engines are not trusted to send one). */
export function usageIn(data: unknown): { prompt: number; cached: number } | undefined {
  const usage = (data as { usage?: Partial<CompletionUsage> | null } | null)?.usage;
  if (typeof usage?.prompt_tokens !== 'number') return undefined;
  const cached = usage.prompt_tokens_details?.cached_tokens;
  return { prompt: usage.prompt_tokens, cached: typeof cached === 'number' ? cached : 0 };
}

/** A stream's usage chunk: usage and no choices (OpenAI's `include_usage` shape). */
export const isUsageChunk = (data: unknown): boolean => usageIn(data) !== undefined && ((data as { choices?: unknown[] }).choices ?? []).length === 0;

/** Counts the prompt tokens (and cached ones) of an answer or usage chunk on the gateway's metrics, under `model` (`namespace/name`). */
export function usageCounter(app: FastifyInstance, model: string): (data: unknown) => void {
  return (data) => {
    const usage = usageIn(data);
    if (!usage) return;
    app.metrics.promptTokens.inc([model], usage.prompt);
    app.metrics.cachedPromptTokens.inc([model], usage.cached);
  };
}

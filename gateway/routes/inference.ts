/**
 * What the routes that publish an inference request share (chat, embeddings): why a request's
 * controller was aborted by its client, and the {@link ExchangeOptions} every exchange takes from
 * the gateway's services and settings.
 */
import type { FastifyInstance } from 'fastify';
import type { InferenceRequest, SessionEntry } from '../../shared/serving';
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

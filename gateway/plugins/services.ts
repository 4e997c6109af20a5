/**
 * What the routes use, injected from outside the app (server.ts wires NATS-backed ones; tests wire
 * fakes of these interfaces): the model catalog, token source, session broker, request publisher,
 * response router and stored responses, plus the settings of the request path. Decorated as `app.gateway`.
 */
import type { UsageRecord } from '../../shared/usage';
import type { MeterKey } from '../../dataplane/meter';
import type { KeyLimiter } from '../serving/limits';
import type { ReadyModel } from '../../shared/model';
import type { ResponseFrame, SessionEntry } from '../../shared/serving';
import type { TokenSource } from './auth';
import type { ModelCatalog } from '../serving/model-catalog';
import { servicePlugin } from './plugin';
import type { ResponseStore } from '../serving/response-store';
import type { PublishRequest, ResponseRouter } from '../serving/exchange';
import type { SessionBroker } from '../serving/sessions';
import type { MoveLog } from '../serving/resume';

/**
 * Tells the instance's bridge that nobody waits for request `requestId` any more (fire and
 * forget); `movedAt`: its answer goes on elsewhere, having left the request after that many of its
 * frames (the bridge records nothing of it, and its claim is ended — dataplane/claims.ts
 * `endClaim` — so that no delivery serves it later, on a bridge that did not hear the cancel).
 */
export type CancelRequest = (session: SessionEntry, requestId: string, movedAt?: number) => void;

/** Synchronous backlog check before a request is queued: full → 429 with `Retry-After`. */
export type BacklogCheck = (model: ReadyModel) => { retryAfterSec: number } | undefined;

/**
 * One `/readyz` check; false or a throw (or no answer within 2 s) = not ready — or, for a check that
 * `degrades`, ready but degraded (routes/health.ts says why: some requests fail, the rest are served).
 */
export interface ReadinessCheck {
  name: string;
  check(): boolean | Promise<boolean>;
  /** Failing leaves the replica ready (`/readyz` 200 `degraded`): for a dependency every replica shares, which no routing can avoid. */
  degrades?: boolean;
  /** Failing now leaves the replica ready, degraded (e.g. within a grace: server.ts `graced`); asked only when the check fails. */
  degradesNow?: () => boolean;
}

/** Request-path settings (server.ts fills them from configuration). */
/**
 * Who may read `/openapi.json` (`MAGUS_GATEWAY_OPENAPI`): anyone; callers the API routes would
 * take (a valid API key, else 401 as they answer; anonymous ones too where
 * `MAGUS_GATEWAY_ALLOW_ANONYMOUS` lets them in); or nobody (no route: 404 `unknown_url`).
 */
export const OPENAPI_ACCESS = ['public', 'authenticated', 'off'] as const;
export type OpenApiAccess = (typeof OPENAPI_ACCESS)[number];

export interface GatewaySettings {
  /** HMAC key of conversation keys; the same on every replica. */
  secret: string;
  /** Requests without `Authorization` are served as `anonymous` (never the default). */
  allowAnonymous: boolean;
  /** Largest request body, bytes; checked from `content-length` before authentication. */
  bodyLimit: number;
  /** 504 when no frame arrives for this long (since publish, then between frames). */
  requestTimeoutMs: number;
  /** A missing frame not filled within this long is read back from the response stream; three reads that miss it fail the request (502). */
  gapTimeoutMs: number;
  /** SSE keep-alive comment interval while nothing else is sent. */
  keepAliveMs: number;
  /**
   * How long a resumable stream whose client left goes on for a resume before it is cancelled
   * (routes/inference.ts `cancelUnlessResumed`; default 10 s: serving/resume.ts `DEFAULT_RESUME_HOLD_MS`; 0: cancelled at once).
   */
  resumeHoldMs?: number;
  /** Longest wait for a session (a cold start); then 503 with `Retry-After`. */
  coldStartTimeoutMs: number;
  /** `Retry-After` seconds when the cause does not say. */
  retryAfterSec: number;
  /** Answered conversations that may wait for their session workflow to start; beyond it new ones get 503 (serving/sessions/starts.ts). */
  maxPendingSessionStarts?: number;
  /**
   * `MAGUS_GATEWAY_SESSION_CACHE`: hold the entries of at most this many conversations this
   * gateway serves, read from `magus_sessions` on first use (serving/sessions/mirror.ts
   * `RecentSessions`); 0: mirror every entry of the bucket (replayed at start and after every
   * reconnect). Default 50,000.
   */
  sessionCacheEntries?: number;
  /** Who may read `/openapi.json`; default `public`. */
  openApi?: OpenApiAccess;
  /**
   * `MAGUS_GATEWAY_NATS_GRACE_MS`: how long a replica cut off from NATS (or rebuilding a KV
   * mirror after a reconnect) stays ready, `degraded`, before `/readyz` fails. Default 30 s.
   */
  natsGraceMs?: number;
}

export interface GatewayServices {
  settings: GatewaySettings;
  models: ModelCatalog;
  tokens: TokenSource;
  sessions: SessionBroker;
  publish: PublishRequest;
  responses: ResponseRouter;
  /** Stored responses of the Responses API (`magus_responses`; in memory in tests). */
  storedResponses: ResponseStore;
  /** A reply subject's frames as the response stream stores them (read back when a frame is missing). */
  readStored?: (subject: string) => Promise<ResponseFrame[]>;
  backlogFull?: BacklogCheck;
  /** The most bytes a NATS message may hold (the servers' `max_payload`): a request beyond it is a 413 before it is placed. */
  maxMessageBytes?: () => number | undefined;
  /** Keys' limits across replicas (`magus_limits`); absent: a limited key's requests get 503 (never served unchecked). */
  limiter?: KeyLimiter;
  /** When a client goes away after its request was published: stop the engine's work on it. */
  cancel?: CancelRequest;
  /**
   * Whether the bridge of `session`'s instance stopped beating (serving/beats.ts): its answers are
   * continued elsewhere. With `since`, when a request was sent there: any start of that bridge
   * heard since counts, not only the newest. Absent: never.
   */
  bridgeSilent?: (session: SessionEntry, since?: number) => boolean;
  /** Whether the bridge of `session`'s instance, as last heard, pulls the requests handed back to it (serving/exchange.ts `requeues`). Absent: never. */
  bridgeRequeues?: (session: SessionEntry) => boolean;
  /** The `Retry-After` seconds of a request its instance's backlog refused: when its queue is within the wait budget again (serving/queue-waits.ts). */
  retryAfterAt?: (session: SessionEntry) => number;
  /** Where moved answers went, for resumes on any replica (serving/resume.ts); absent: a resume stops at a move. */
  moves?: MoveLog;
  /** Whether gateway replica `replica` is known gone (serving/replicas.ts): a resume then claims its answer's moves at once. Absent: never known. */
  replicaGone?: (replica: string) => Promise<boolean>;
  /**
   * Writes a usage record for a request the gateway gave up on (dataplane/usage.ts; create-once,
   * so a bridge that recorded it first keeps its record); best effort, never awaited.
   */
  recordUsage?: (record: UsageRecord) => void;
  /** The key each request's meter is signed with (dataplane/meter.ts); absent: meters go unsigned (readers then leave their records out). */
  meterKey?: MeterKey;
  readiness: ReadinessCheck[];
}

declare module 'fastify' {
  interface FastifyInstance {
    gateway: GatewayServices;
  }
}

export const servicesPlugin = servicePlugin<{ services: GatewayServices }>(
  (app, opts, done) => {
    app.decorate('gateway', opts.services);
    done();
  },
  { name: 'magus-services' },
);

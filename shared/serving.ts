/**
 * The serving data plane's wire contracts (ARCHITECTURE.md, "Data plane"): what the gateway
 * publishes to an instance's bridge over NATS JetStream, what the bridge streams back, and the KV
 * entries the gateway reads on the hot path. Workflow-safe: no I/O; the request is a TypeBox schema
 * (shared/chat.ts) that the bridge checks, its type derived from it.
 */
import type { KeyLimits } from './limits';
import { Type, type Static } from '@sinclair/typebox';
import { ChatCompletionRequest } from './chat';
import { CompletionsRequest } from './completions';
import { EmbeddingsRequest } from './embeddings';
import { Continues } from './continuation';

/**
 * OpenAI's `usage` as magus's engines send it: in a `chat.completion`, and in a stream's last
 * chunk (no choices) when `stream_options.include_usage` asks for it. `cached_tokens`: the prompt
 * tokens the engine's slot already held in its KV cache (not evaluated again). dllama-api sends
 * the first three fields only.
 */
export interface CompletionUsage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  prompt_tokens_details?: { cached_tokens: number };
}

/**
 * A request on `magus.req.<pool>.<instance>` (stream `MAGUS_REQUESTS`, work-queue retention),
 * published with header `Nats-Msg-Id: <id>` so a retried publish is de-duplicated.
 */
const envelope = {
  /** Unique request id (also the response subject's last token). */
  id: Type.String(),
  /**
   * Where the bridge streams the frames: `magus.res.<replica>.<id>`, a subject of the gateway
   * replica that waits for them (a redelivery answers there too). `magus.res.<id>` is the form of
   * gateways before replicas had subjects of their own; bridges still answer it.
   */
  replyTo: Type.String(),
  /**
   * The gateway also hears this request's frames on its instance's subject,
   * `<replyTo before the id>.<pool>.<instance>.<id>` (dataplane/names.ts
   * `instanceResponseSubjectOf`), and the bridge publishes them there: a bridge's NATS user may
   * publish and read back only its own instance's frames. Absent (gateways before it): frames go
   * to `replyTo` itself.
   */
  instanceFrames: Type.Optional(Type.Boolean()),
  /**
   * Epoch ms after which the gateway has given up waiting for the answer to begin: the bridge ends
   * it (`deadline_exceeded`) while its client has nothing of it — unstarted, or a stream before its
   * first piece, or an answer not streamed; a stream that has begun (a continuation with something
   * said included) goes on to its end (dataplane/bridge/attempt.ts `cutsAt`).
   */
  deadline: Type.Number(),
  /**
   * Epoch ms: where it stands in a queue (earliest first) when not at its `deadline` — a
   * continuation keeps the place of the request it continues ({@link queueDueOf}): a resume gives
   * the answer it moves on a later deadline (its client is waiting again), not a later turn.
   * Absent (gateways before it, a first request): its deadline.
   */
  due: Type.Optional(Type.Number()),
  /**
   * It continues another request's answer, handed back by that request's bridge
   * (shared/continuation.ts `CONTINUE_ELSEWHERE`): a streamed chat or text completion whose engine
   * resumes after the answer so far. Its frames are numbered from 0 on its own subjects.
   */
  continues: Type.Optional(Continues),
  /**
   * Who the usage ledger charges (shared/usage.ts `UsageMeter`): the key's identity, the model
   * and when the gateway took the request in. Gateways before the ledger send none; the bridge
   * then writes no record.
   */
  meter: Type.Optional(
    Type.Object({
      key: Type.String({ minLength: 1, maxLength: 512 }),
      model: Type.String({ minLength: 1, maxLength: 512 }),
      at: Type.Number(),
      /** The gateway's signature (dataplane/meter.ts), copied into the record; absent from gateways before it. */
      sig: Type.Optional(Type.String({ maxLength: 128 })),
    }),
  ),
};
/** A chat completion (`kind` absent: what every gateway sent before there were other kinds). */
export const ChatInference = Type.Object({ ...envelope, kind: Type.Optional(Type.Literal('chat')), body: ChatCompletionRequest });
/** Embeddings (`POST /v1/embeddings`): answered with one `done` frame, never streamed. */
export const EmbeddingsInference = Type.Object({ ...envelope, kind: Type.Literal('embeddings'), body: EmbeddingsRequest });
/** Text completions (`POST /v1/completions`): streamed as chat is, in `text_completion` chunks. */
export const CompletionsInference = Type.Object({ ...envelope, kind: Type.Literal('completions'), body: CompletionsRequest });
export const InferenceRequest = Type.Union([ChatInference, EmbeddingsInference, CompletionsInference]);
export type ChatInference = Static<typeof ChatInference>;
export type EmbeddingsInference = Static<typeof EmbeddingsInference>;
export type CompletionsInference = Static<typeof CompletionsInference>;
export type InferenceRequest = ChatInference | EmbeddingsInference | CompletionsInference;

/** Where `req` stands in a queue, earliest first (epoch ms): its `due`, else its deadline. */
export const queueDueOf = (req: Pick<InferenceRequest, 'due' | 'deadline'>): number => req.due ?? req.deadline;

/**
 * One message on a request's `replyTo`, numbered from 0 so the gateway can detect gaps and
 * duplicates. Streaming: `chunk`* then `done`; non-streaming: a single `done` carrying the whole
 * completion (or, when that is larger than a NATS message may be, `part`s then a `done` that says
 * how many); failure at any point: `error` (terminal).
 */
export type ResponseFrame =
  | {
      seq: number;
      type: 'chunk';
      /** An OpenAI `chat.completion.chunk` (or `text_completion` chunk). */
      data: unknown;
      /** The ids of the tokens its text begins, from an engine that can continue an answer (shared/continuation.ts); not relayed to clients. */
      tokens?: number[];
    }
  | {
      seq: number;
      type: 'done';
      /** The `chat.completion` (or other whole answer) when not streaming. */
      data?: unknown;
      /**
       * Instead of `data`: it was larger than a NATS message may be, and is the last `parts` frames
       * before this one (`part`), joined (dataplane/frames.ts `splitFrame`, `FrameParts`).
       */
      parts?: number;
    }
  | {
      seq: number;
      /** A slice of the next `done` frame's data (its JSON as UTF-8, base64): never relayed by itself. */
      type: 'part';
      piece: string;
    }
  | {
      seq: number;
      type: 'error';
      /**
       * An answer handed back to be continued elsewhere (`CONTINUE_ELSEWHERE`): its place among
       * those its bridge handed back together (from 0). Every gateway sends the n-th to the n-th
       * of the pool's other instances (by name), so a lost instance's answers spread evenly over
       * the others whichever gateway moves each (frames of older bridges lack it).
       */
      spread?: number;
      /**
       * An answer handed back: its request's place in a queue ({@link queueDueOf}), which the
       * request that continues it keeps (frames of older bridges lack it).
       */
      due?: number;
      /**
       * Its bridge could not know how much of the answer its client has (a take-over that found
       * the frames stored of it gone: `resume_failed`, or a hand-back): a gateway takes it at the
       * seq it expects next, whatever its `seq` (the seq after the highest stored, for readers of
       * the stream), and a hand-back continues after what that gateway relayed. Older gateways
       * take it at its `seq`.
       */
      afterRelayed?: true;
      error: {
        status: number;
        message: string;
        type: string;
        code: string | null;
        /** The request field at fault (4xx; frames of older bridges lack it). */ param?: string | null;
      };
    };

/** A frame that ends an answer with an error (or hands it back). */
export type ErrorFrame = Extract<ResponseFrame, { type: 'error' }>;

/**
 * A `magus_sessions` key's conversation token: its last (keys are `<namespace>.<model>.<HMAC>`;
 * keys written before they carried their pool are the HMAC alone).
 */
export const conversationOf = (key: string): string => key.slice(key.lastIndexOf('.') + 1);

/** `magus_sessions` KV: conversation key → the instance serving it (with expiry). */
export interface SessionEntry {
  /** The subject requests for this conversation go to: `magus.req.<pool>.<instance>`. */
  subject: string;
  pool: string;
  /** The model's namespace (entries written before it was added lack it: `default`). */
  namespace?: string;
  instance: string;
  /** Epoch ms when the session's lease ends unless extended. */
  expiresAt: number;
  /**
   * Epoch ms when a gateway put the entry on its instance (gateways create, renew and move
   * entries; the session only deletes an expired one): a pool view newer than this that no longer
   * lists the instance moves the conversation. An entry without it is pinned (written by a test or
   * a tool): never moved.
   */
  placedAt?: number;
  /**
   * Set by the conversation's session workflow the first time it looks at the entry (at its first
   * expiry; activities/serving.ts `expireSession`), and kept by every later write: an entry placed
   * more than a TTL ago without it has no session (its gateway died before starting one), and the
   * next warm turn starts one (gateway/serving/sessions/placement.ts `adoptOrphan`).
   */
  watched?: true;
}

/**
 * `magus_pools` KV, key `<namespace>.<model>`: the instances a pool can lease right now, written
 * by the pool workflow whenever they change. A gateway serves a conversation's first turn from it
 * (it picks an instance with room, writes the session entry, and starts the session workflow
 * afterwards), so a first turn on a warm pool waits on no workflow.
 */
export interface PoolEntry {
  /** Ready instances only (not starting, draining or stopping). */
  instances: { instance: string; subject: string; leases: number }[];
  /** Leases an instance takes before the pool prefers another (a soft limit). */
  leasesPerInstance: number;
  /** Epoch ms of the write; a pool with instances rewrites it at least every minute. */
  updatedAt: number;
  /**
   * False when the pool runs its maximum of instances: a new lease can only share one of these,
   * so a gateway gives a first turn the least-loaded one even when all are full, as the pool
   * would. Absent (pools before this field): treated as growable.
   */
  growable?: boolean;
  /** Why no instance serves or starts now (failed starts): a first turn waiting for room is refused with it. */
  failing?: string;
  /** With `failing`: when the pool may try to start again, and when its last start failed (epoch ms). */
  nextStartAt?: number;
  failedAt?: number;
  /** Instances being started, and since when (epoch ms): what a first turn waits for, `/v1/models` shows. Absent: none, or a pool before it. */
  starting?: { instance: string; since: number }[];
  /**
   * `load`: the pool scales on requests in flight or queued (workflows/pool/state.ts, "Scaling"),
   * so a gateway places a conversation by its instances' load with no lease limit. Absent: on
   * leases — `leasesPerInstance` is the soft limit.
   */
  scalesOn?: 'load';
}

/** A `magus_sessions` value, checked; `undefined` (ignored) when malformed. */
export function decodeSessionEntry(value: Uint8Array): SessionEntry | undefined {
  const e = JSON.parse(new TextDecoder().decode(value)) as Partial<SessionEntry> | null;
  if (typeof e !== 'object' || e === null) return undefined;
  if (typeof e.subject !== 'string' || e.subject === '' || typeof e.expiresAt !== 'number' || typeof e.pool !== 'string' || typeof e.instance !== 'string')
    return undefined;
  return {
    subject: e.subject,
    pool: e.pool,
    ...(typeof e.namespace === 'string' ? { namespace: e.namespace } : {}),
    instance: e.instance,
    expiresAt: e.expiresAt,
    ...(typeof e.placedAt === 'number' ? { placedAt: e.placedAt } : {}),
    ...(e.watched === true ? { watched: true } : {}),
  };
}

/** A `magus_pools` value, checked; `undefined` (ignored) when malformed. */
export function decodePoolEntry(value: Uint8Array): PoolEntry | undefined {
  const e = JSON.parse(new TextDecoder().decode(value)) as Partial<PoolEntry> | null;
  if (typeof e !== 'object' || e === null || !Array.isArray(e.instances) || !Number.isInteger(e.leasesPerInstance) || (e.leasesPerInstance as number) < 1)
    return undefined;
  const instances = e.instances.filter(
    (i): i is PoolEntry['instances'][number] =>
      typeof i === 'object' &&
      i !== null &&
      typeof i.instance === 'string' &&
      i.instance !== '' &&
      typeof i.subject === 'string' &&
      i.subject !== '' &&
      Number.isInteger(i.leases) &&
      i.leases >= 0,
  );
  return {
    instances,
    leasesPerInstance: e.leasesPerInstance as number,
    updatedAt: typeof e.updatedAt === 'number' ? e.updatedAt : 0,
    ...(typeof e.growable === 'boolean' ? { growable: e.growable } : {}),
    ...(typeof e.failing === 'string'
      ? {
          failing: e.failing,
          ...(typeof e.nextStartAt === 'number' ? { nextStartAt: e.nextStartAt } : {}),
          ...(typeof e.failedAt === 'number' ? { failedAt: e.failedAt } : {}),
        }
      : {}),
    ...(Array.isArray(e.starting)
      ? {
          starting: e.starting.filter(
            (i): i is { instance: string; since: number } =>
              typeof i === 'object' && i !== null && typeof i.instance === 'string' && typeof i.since === 'number',
          ),
        }
      : {}),
    ...(e.scalesOn === 'load' ? { scalesOn: 'load' as const } : {}),
  };
}

/**
 * An entry still in `magus_sessions` this long after it expired has no session to delete it (its
 * gateway died before starting one): the sweeps delete it — the pools' reconcilers, over every
 * entry of their pool, and each gateway over those it holds.
 */
export const ORPHAN_SWEEP_GRACE_MS = 5 * 60_000;

/** A `magus_pools` entry older than this belongs to a pool that is gone: gateways do not pick from it. */
export const POOL_ENTRY_MAX_AGE_MS = 3 * 60_000;

/**
 * `magus_tokens` KV: token id → the key it belongs to. Tokens look like `mgs_<id>_<secret>`; the
 * gateway looks up the entry by id and compares `sha256(token)` with `digest` in constant time.
 * The token itself is never stored. An id is registered once (dataplane/keys.ts `registerKey`:
 * KV `create`, then compare-and-swap by its owner only): a second key presenting an id that is
 * taken is refused, never written over.
 */
export interface TokenEntry {
  /** hex sha256 of the whole token string. */
  digest: string;
  /** A display name (for logs and `magus keys list`; never the token). */
  name: string;
  /**
   * The key's identity, where it was declared: `<namespace>/<name>` of its `ApiKey` (or of a
   * labelled Secret, until the next release), `local/<name>` of a `magus keys` key. Absent only
   * in entries an older magus wrote.
   */
  key?: string;
  /**
   * The declaring object's uid: a key deleted and declared again under the same identity is a new
   * owner, which never reads what the old one stored.
   */
  uid?: string;
  /**
   * Models it may use: `*` (every model), `<namespace>/*`, `<namespace>/<name>`, or a bare
   * `<name>` (that name in any namespace). Empty or absent = all.
   */
  models?: string[];
  /** Suspended: the token is known and refused (403 `key_suspended`). */
  suspended?: boolean;
  /**
   * The key's limits (shared/limits.ts: requests and tokens per minute, concurrent requests, a
   * token budget per day or month), held across gateway replicas in `magus_limits`. Absent: none.
   */
  limits?: KeyLimits;
  /**
   * Where it came from: `apikey/<namespace>/<name>`, `secret/<namespace>/<name>` (the controller
   * prunes these two), `local` (`magus keys`).
   */
  origin?: string;
}

/** Who owns what a key stores (responses, conversations): its identity and its declaring object. */
export const keyOwner = (key: string, uid: string): string => `${key}#${uid}`;

export const requestSubject = (pool: string, instance: string): string => `magus.req.${pool}.${instance}`;
/** `magus.res.<replica>.<id>`, or without a replica the older `magus.res.<id>` (see {@link InferenceRequest.replyTo}). */
export const responseSubject = (requestId: string, replica?: string): string => (replica ? `magus.res.${replica}.${requestId}` : `magus.res.${requestId}`);
/** Core NATS, gateway → the instance's bridge: `{"id": requestId}` of a request nobody waits for any more. */
export const cancelSubject = (pool: string, instance: string): string => `magus.cancel.${pool}.${instance}`;
/** Where an instance's bridge says it is alive (dataplane/README.md, "Handing an answer back"). */
export const beatSubject = (pool: string, instance: string): string => `magus.beat.${pool}.${instance}`;

/**
 * What a bridge's beat carries (JSON on {@link beatSubject}; an empty beat — a bridge from before
 * it — says nothing of its load): what its engine is doing and how fast it drains, so that a
 * gateway can tell how long one more request would wait there (gateway/serving/queue-waits.ts).
 */
export interface BridgeLoad {
  /** Requests and moved answers being served now. */
  running: number;
  /** How many its engine serves at once (its consumers' `max_ack_pending`). */
  slots: number;
  /** Requests and moved answers queued for it and not delivered yet (read only while every slot is taken; else 0). */
  queued: number;
  /** An answer's time in the engine: the 90th percentile of the recent ones (null: none answered yet). */
  serviceMs: number | null;
  /** How long ago `queued` was read (a slow read leaves an older one): requests sent since are not in it. */
  queuedAgeMs?: number;
  /**
   * It pulls the requests handed back to its instance (dataplane/names.ts `LANES`, `requeued`):
   * gateways send one there, ahead of the instance's queue. Absent (a bridge from before, or one
   * whose NATS user may not pull that lane): to its requests, where nobody misses it.
   */
  requeued?: true;
  /** It was told to stop: it beats faster, and is silent sooner (shared/continuation.ts `STOPPING_SILENT_MS`). */
  stopping?: true;
  /**
   * Which start of the instance's bridge beats (an id made at its start): a pod made again under
   * the same instance (a StatefulSet's, after a forced delete) beats while the one before still
   * dies, and a gateway judges each apart (gateway/serving/beats.ts). Absent: a bridge from before.
   */
  boot?: string;
}

const BOOT = /^[A-Za-z0-9_-]{1,64}$/;

const count = (v: unknown): v is number => typeof v === 'number' && Number.isInteger(v) && v >= 0;

/** A beat's payload as {@link BridgeLoad}, or undefined when it carries none (or one this version cannot read). */
export function bridgeLoadOf(payload: Uint8Array | string): BridgeLoad | undefined {
  const text = typeof payload === 'string' ? payload : new TextDecoder().decode(payload);
  if (text.length === 0) return undefined;
  let v: unknown;
  try {
    v = JSON.parse(text);
  } catch {
    return undefined;
  }
  if (typeof v !== 'object' || v === null) return undefined;
  const o = v as Record<string, unknown>;
  const serviceMs = o.serviceMs === null ? null : typeof o.serviceMs === 'number' && Number.isFinite(o.serviceMs) && o.serviceMs >= 0 ? o.serviceMs : undefined;
  if (!count(o.running) || !count(o.slots) || o.slots < 1 || !count(o.queued) || serviceMs === undefined) return undefined;
  return {
    running: o.running,
    slots: o.slots,
    queued: o.queued,
    serviceMs,
    ...(count(o.queuedAgeMs) ? { queuedAgeMs: o.queuedAgeMs } : {}),
    ...(o.requeued === true ? { requeued: true as const } : {}),
    ...(o.stopping === true ? { stopping: true as const } : {}),
    ...(typeof o.boot === 'string' && BOOT.test(o.boot) ? { boot: o.boot } : {}),
  };
}

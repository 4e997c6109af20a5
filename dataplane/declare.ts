/**
 * Declaring the serving data plane on NATS JetStream (ARCHITECTURE.md, "Data plane"; wire
 * contracts in shared/serving.ts). This module declares the streams and KV buckets, consumers.ts the
 * per-instance consumers; the gateway and the bridges only *get* them, through one
 * {@link DataPlaneNames} value (names.ts), so a test (or a second installation) can rename
 * everything with a prefix.
 *
 * - `MAGUS_REQUESTS` (`magus.req.<pool>.<instance>`, work queue, file): requests, published with
 *   `Nats-Msg-Id` = request id; one durable pull consumer per instance. On file although a file
 *   work queue that drains creates and deletes a block file for every request (nats-server
 *   replaces an emptied last block; ~0.2 ms of every request at concurrency 1, measured): a
 *   single nats-server forgets a memory stream altogether when it restarts — not only the queued
 *   requests but the stream and its consumers — and nothing would serve until they were declared
 *   again.
 * - `MAGUS_RESPONSES` (`magus.res.>`, memory, limits): captures the frames bridges publish with
 *   core NATS to a request's `replyTo`, `magus.res.<replica>.<id>` (each gateway replica
 *   subscribes to its own `magus.res.<replica>.*` only). Nobody consumes it on the hot path; a
 *   bridge that takes over a redelivered request reads it to learn exactly what the client may
 *   already have received, so it must keep every frame for as long as a request may run: its
 *   size is peak frame throughput × that time ({@link responseStreamLimits}), not a fixed cap.
 *   In memory (every frame is stored): a single nats-server that restarts forgets it; the
 *   processes that declare the data plane do so again after they reconnect
 *   ({@link declareOnReconnect}), and meanwhile answers still flow, on core NATS.
 * - KV `magus_sessions` (keys `<namespace>.<model>.<conversation>`, deletes leaving markers that
 *   expire: session-keys.ts), `magus_tokens` (shared/serving.ts entry types), `magus_claims` (one
 *   `RequestClaim` per request id, claims.ts: who owns the current attempt, and the outcome),
 *   `magus_pools`, `magus_limits` (one per-key limit state per key, limits.ts), and
 *   `magus_models` (the registry, created by registry.ts).
 *
 * The exactly-one-answer protocol built on these is described in README.md next to this file.
 */
import {
  DiscardPolicy,
  Events,
  type JetStreamClient,
  type JetStreamManager,
  type KV,
  type NatsConnection,
  RetentionPolicy,
  StorageType,
  type StreamConfig,
  type StreamInfo,
  nanos,
} from 'nats';
import { Nats } from '../shared/constants';
import { JsApiError, jsErrorCode } from './errors';
import { dataPlaneNames, scopedSubject, type DataPlaneNames } from './names';
import { REGISTRY_HISTORY } from './registry';
import { markerSettings } from './session-keys';

export interface DataPlaneOptions {
  prefix?: string;
  /**
   * Replicas of every stream and bucket of the data plane (instance consumers inherit them):
   * 1 on a single server, 3 on a cluster of three or more (survives the loss of one server).
   * Declaring with another value than the existing streams have scales them to it, so every
   * process that declares must use the same (`MAGUS_NATS_REPLICAS`). Default 1.
   */
  replicas?: number;
  /** How long an unconsumed request may wait; every deadline is far shorter. Default 1 h. */
  requestMaxAgeMs?: number;
  /** `Nats-Msg-Id` de-duplication window of the request stream. Default 5 min. */
  duplicateWindowMs?: number;
  /**
   * Requests one instance may hold, queued and in flight (the stream's per-subject limit, with
   * new messages refused): a publish beyond it fails with `isBacklogFull` (errors.ts), which the
   * gateway answers with 429. Default 256.
   */
  instanceBacklog?: number;
  /** Bytes all queued requests may take; a publish beyond it is refused like a full backlog. Default 512 MiB. */
  requestMaxBytes?: number;
  /**
   * Peak bytes per second of response frames, all gateways and bridges together, counted as the
   * stream stores them (payload + subject + 16 B each; a streamed token's frame is ~300 B). Sizes
   * `MAGUS_RESPONSES` with {@link responseRetentionMs}. Default 512 KiB/s.
   */
  responsePeakBytesPerSec?: number;
  /**
   * How long a request's frames must stay readable: the longest a request may run, from its
   * publish to its deadline (at least the gateway's request timeout), since a take-over reads back
   * everything its request published. Default 10 min.
   */
  responseRetentionMs?: number;
  /** Frames older than this are dropped; at least {@link responseRetentionMs}. Default 30 min. */
  responseMaxAgeMs?: number;
  /** An exact byte cap for `MAGUS_RESPONSES` instead of the computed one (no floor; tests). */
  responseMaxBytes?: number;
  /** Bucket max age of `magus_sessions`: garbage collection of abandoned entries (their `expiresAt` rules). Default 24 h. */
  sessionMaxAgeMs?: number;
  /** Bucket max age of `magus_claims`: longer than any request can be delivered. Default 2 h. */
  claimMaxAgeMs?: number;
  /** How long the usage ledger keeps a record (`magus_usage`). Default {@link USAGE_RETENTION_MS}. */
  usageRetentionMs?: number;
}

/** JetStream's most replicas per stream. */
export const MAX_REPLICAS = 5;

const MINUTE = 60_000;
const HOUR = 60 * MINUTE;

export const DEFAULT_INSTANCE_BACKLOG = 256;

/** How long the controller's sums of the ledger are kept (`magus_usage_sums`): a month's outlive it. */
export const USAGE_SUMS_MAX_AGE_MS = 62 * 24 * HOUR;

/** How long the usage ledger keeps a record by default: 400 days, a year's billing and its audit. */
export const USAGE_RETENTION_MS = 400 * 24 * HOUR;

export const DEFAULT_RESPONSE_PEAK_BYTES_PER_SEC = 512 * 1024;
export const DEFAULT_RESPONSE_RETENTION_MS = 10 * MINUTE;
/** The computed size never goes below this: a stream too small for a burst would evict at once. */
export const MIN_RESPONSE_MAX_BYTES = 16 * 1024 * 1024;
/** Stream metadata keys recording what the size was computed from, for whoever reports on it. */
export const ResponseStreamMetadata = {
  retentionMs: 'magus.dev/required-retention-ms',
  peakBytesPerSec: 'magus.dev/peak-bytes-per-sec',
} as const;

/**
 * `MAGUS_RESPONSES`'s limits. It discards the oldest frames when full, and a take-over needs all
 * of its request's frames for as long as the request may run, so it must hold peak throughput ×
 * that time: `maxBytes = max(MIN_RESPONSE_MAX_BYTES, peak × retention)` (defaults: 512 KiB/s × 10
 * min = 300 MiB). A memory stream reserves its `max_bytes` from JetStream's `max_memory` when it
 * is declared, so a size beyond what the server has left fails the declaration, by name.
 */
export function responseStreamLimits(
  opts: Pick<DataPlaneOptions, 'responsePeakBytesPerSec' | 'responseRetentionMs' | 'responseMaxAgeMs' | 'responseMaxBytes'> = {},
): {
  maxBytes: number;
  maxAgeMs: number;
  retentionMs: number;
  peakBytesPerSec: number;
} {
  const peakBytesPerSec = opts.responsePeakBytesPerSec ?? DEFAULT_RESPONSE_PEAK_BYTES_PER_SEC;
  const retentionMs = opts.responseRetentionMs ?? DEFAULT_RESPONSE_RETENTION_MS;
  for (const [what, v] of [
    ['responsePeakBytesPerSec', peakBytesPerSec],
    ['responseRetentionMs', retentionMs],
  ] as const) {
    if (!Number.isFinite(v) || v <= 0) throw new Error(`${what} must be a positive number, got ${v}`);
  }
  const maxBytes = opts.responseMaxBytes ?? Math.max(MIN_RESPONSE_MAX_BYTES, Math.ceil((peakBytesPerSec * retentionMs) / 1000));
  return { maxBytes, maxAgeMs: Math.max(opts.responseMaxAgeMs ?? 30 * MINUTE, retentionMs), retentionMs, peakBytesPerSec };
}

async function ensureStream(jsm: JetStreamManager, cfg: Partial<StreamConfig> & { name: string }): Promise<StreamInfo> {
  try {
    await jsm.streams.info(cfg.name);
  } catch (err) {
    if (jsErrorCode(err) !== JsApiError.streamNotFound) throw err;
    try {
      return await jsm.streams.add(cfg);
    } catch (addErr) {
      // Another process created it between our info and add: fall through to the update.
      if (!/already in use|already exists/i.test((addErr as Error).message)) throw addErr;
    }
  }
  // Storage is fixed at creation: an existing stream keeps its own.
  const { name, storage: _storage, ...rest } = cfg;
  return jsm.streams.update(name, rest);
}

/**
 * Creates a KV bucket, or brings an existing one's history, max age and replicas to the given
 * values (storage is fixed at creation: an existing bucket keeps its own). nats.js only *binds*
 * an existing bucket, whatever the options say, so a bucket a gateway or the registry created
 * first (one replica) is scaled here.
 */
async function ensureBucket(
  js: JetStreamClient,
  jsm: JetStreamManager,
  bucket: string,
  opts: { history: number; maxAgeMs: number; replicas: number; storage?: StorageType; markers?: boolean },
): Promise<void> {
  await js.views.kv(bucket, { history: opts.history, ttl: opts.maxAgeMs, replicas: opts.replicas, storage: opts.storage ?? StorageType.File });
  const stream = `KV_${bucket}`;
  const { config } = await jsm.streams.info(stream);
  // Markers that expire (session-keys.ts) can be turned on in an existing stream, never off again.
  const markers = opts.markers ? markerSettings : {};
  const has = config as StreamConfig & Partial<typeof markerSettings>;
  if (
    config.max_age !== nanos(opts.maxAgeMs) ||
    config.max_msgs_per_subject !== opts.history ||
    config.num_replicas !== opts.replicas ||
    (opts.markers && has.allow_msg_ttl !== true)
  ) {
    await jsm.streams.update(stream, { max_age: nanos(opts.maxAgeMs), max_msgs_per_subject: opts.history, num_replicas: opts.replicas, ...markers });
  }
}

/** Default max age of `magus_responses`: a stored response (and so a chain whose first response it is) lives 30 days. */
export const DEFAULT_RESPONSES_MAX_AGE_MS = 30 * 24 * HOUR;

/**
 * The bucket of stored responses (`magus_responses`), created or brought to `maxAgeMs` and
 * `replicas`: declared by the gateways, its only writers and readers, whose configuration holds
 * the TTL (every replica must be given the same values). On file: a stored response outlives a
 * restart of NATS.
 */
export async function ensureResponsesBucket(nc: NatsConnection, bucket: string, opts: { maxAgeMs: number; replicas?: number }): Promise<KV> {
  const js = nc.jetstream();
  await ensureBucket(js, await nc.jetstreamManager(), bucket, { history: 1, maxAgeMs: opts.maxAgeMs, replicas: opts.replicas ?? 1 });
  return js.views.kv(bucket);
}

/**
 * Declares the data plane (idempotent: creates what is missing, updates limits of what exists)
 * and returns its names. Run at start-up by whatever process owns the NATS account's layout
 * (`magus bridge` and the worker's runtime do; tests do with a prefix).
 */
export async function ensureDataPlane(nc: NatsConnection, opts: DataPlaneOptions = {}): Promise<DataPlaneNames> {
  const names = dataPlaneNames(opts.prefix);
  const js = nc.jetstream();
  const jsm = await nc.jetstreamManager();
  const replicas = opts.replicas ?? 1;
  if (!Number.isInteger(replicas) || replicas < 1 || replicas > MAX_REPLICAS)
    throw new Error(`replicas must be an integer from 1 to ${MAX_REPLICAS}, got ${replicas}`);
  const requestMaxAge = opts.requestMaxAgeMs ?? HOUR;
  const duplicateWindow = Math.min(opts.duplicateWindowMs ?? 5 * MINUTE, requestMaxAge);
  await ensureStream(jsm, {
    name: names.requestStream,
    description: 'magus inference requests, one subject per topology instance',
    subjects: [scopedSubject(names, `${Nats.requestSubjectPrefix}.>`)],
    retention: RetentionPolicy.Workqueue,
    storage: StorageType.File,
    discard: DiscardPolicy.New,
    discard_new_per_subject: true,
    max_msgs_per_subject: opts.instanceBacklog ?? DEFAULT_INSTANCE_BACKLOG,
    max_bytes: opts.requestMaxBytes ?? 512 * 1024 * 1024,
    max_age: nanos(requestMaxAge),
    duplicate_window: nanos(duplicateWindow),
    num_replicas: replicas,
  });
  const responses = responseStreamLimits(opts);
  try {
    await ensureStream(jsm, {
      name: names.responseStream,
      description: 'magus response frames (core-published), read back by a bridge that takes over a request',
      // Both forms: magus.res.<replica>.<id> and the older magus.res.<id>.
      subjects: [scopedSubject(names, `${Nats.responseSubjectPrefix}.>`)],
      retention: RetentionPolicy.Limits,
      storage: StorageType.Memory,
      discard: DiscardPolicy.Old,
      // Direct gets name the subject in the request's subject: a bridge may read back only its own instance's frames (roles.ts).
      allow_direct: true,
      max_age: nanos(responses.maxAgeMs),
      max_bytes: responses.maxBytes,
      num_replicas: replicas,
      metadata: {
        [ResponseStreamMetadata.retentionMs]: String(responses.retentionMs),
        [ResponseStreamMetadata.peakBytesPerSec]: String(responses.peakBytesPerSec),
      },
    });
  } catch (err) {
    if (jsErrorCode(err) !== JsApiError.insufficientMemory) throw err;
    const mib = (responses.maxBytes / 2 ** 20).toFixed(0);
    throw new Error(
      `${names.responseStream}: JetStream has less memory left than the ${mib} MiB it must hold (peak ${responses.peakBytesPerSec} B/s × ${responses.retentionMs / 1000} s): lower the peak or retention, or raise the server's max_memory`,
      { cause: err },
    );
  }
  await ensureBucket(js, jsm, names.sessionsBucket, { history: 1, maxAgeMs: opts.sessionMaxAgeMs ?? 24 * HOUR, replicas, markers: true });
  await ensureBucket(js, jsm, names.tokensBucket, { history: 1, maxAgeMs: 0, replicas });
  // On file: only redeliveries write claims (a first delivery that answers writes none), and a
  // single nats-server that restarts forgets memory buckets altogether.
  await ensureBucket(js, jsm, names.claimsBucket, { history: 1, maxAgeMs: opts.claimMaxAgeMs ?? 2 * HOUR, replicas });
  await ensureBucket(js, jsm, names.poolsBucket, { history: 1, maxAgeMs: 0, replicas });
  // No max age: an entry holds a budget's use for its whole period.
  await ensureBucket(js, jsm, names.limitsBucket, { history: 1, maxAgeMs: 0, replicas });
  // The ledger: a record per request, kept `usageRetentionMs` (default 400 days) for billing exports.
  await ensureBucket(js, jsm, names.usageBucket, { history: 1, maxAgeMs: opts.usageRetentionMs ?? USAGE_RETENTION_MS, replicas });
  // The controller's checkpoint of the ledger's sums (a day's and a month's per key): needed only until the month is over.
  await ensureBucket(js, jsm, names.usageSumsBucket, { history: 1, maxAgeMs: USAGE_SUMS_MAX_AGE_MS, replicas });
  // The registry (registry.ts) opens it too, with one replica when it is the first.
  await ensureBucket(js, jsm, names.modelsBucket, { history: REGISTRY_HISTORY, maxAgeMs: 0, replicas });
  return names;
}

/**
 * Runs `declare` now and again after every reconnect, until the connection closes. A single
 * nats-server that restarts forgets every memory stream (`MAGUS_RESPONSES`), and one on
 * ephemeral storage forgets everything; declaring is idempotent, so the processes that declare
 * the data plane do it again whenever they reconnect. The first run's error is thrown; a failed
 * re-declaration is logged and retried with backoff (1 s doubling to 30 s) until it succeeds,
 * the next reconnect supersedes it, or `isDone()` says the caller is stopping.
 */
export async function declareOnReconnect<T>(
  nc: NatsConnection,
  declare: () => Promise<T>,
  opts: { what: string; log: (line: string) => void; isDone?: () => boolean },
): Promise<T> {
  const first = await declare();
  let generation = 0;
  const again = async (mine: number) => {
    for (let delayMs = 1000; !nc.isClosed() && !opts.isDone?.() && mine === generation; delayMs = Math.min(delayMs * 2, 30_000)) {
      try {
        await declare();
        opts.log(`${opts.what}: in place after a reconnect`);
        return;
      } catch (err) {
        opts.log(`${opts.what}: declaring again failed (${(err as Error).message}); retrying in ${delayMs / 1000} s`);
        await new Promise((resolve) => setTimeout(resolve, delayMs).unref());
      }
    }
  };
  void (async () => {
    for await (const s of nc.status()) {
      if (opts.isDone?.()) break;
      if (s.type === Events.Reconnect) void again(++generation);
    }
  })().catch(() => undefined);
  return first;
}

/**
 * The serving data plane on NATS JetStream (DESIGN.md, "Data plane"; wire contracts in
 * shared/serving.ts). This one module declares the streams, KV buckets and per-instance
 * consumers; the gateway and the bridges only *get* them, through one {@link DataPlaneNames}
 * value, so a test (or a second installation) can rename everything with a prefix.
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
 * - KV `magus_sessions`, `magus_tokens` (shared/serving.ts entry types), `magus_claims` (one
 *   {@link RequestClaim} per request id: who owns the current attempt, and the outcome), and
 *   `magus_models` (the registry, created by registry.ts).
 *
 * The exactly-one-answer protocol built on these is described in README.md next to this file.
 */
import {
  AckPolicy,
  DeliverPolicy,
  DiscardPolicy,
  Events,
  type ConsumerConfig,
  type ConsumerInfo,
  type JetStreamClient,
  type JetStreamManager,
  type KV,
  type Msg,
  type NatsConnection,
  RetentionPolicy,
  StorageType,
  type StreamConfig,
  type StreamInfo,
  nanos,
} from 'nats';
import { Nats } from '../shared/constants';
import { cancelSubject, requestSubject, responseSubject, type InferenceRequest, type ResponseFrame } from '../shared/serving';
import { decodeFrame, FrameSequencer } from './frames';
import { REGISTRY_HISTORY } from './registry';

/** Names this module adds to shared/constants `Nats` (proposed there; see README.md). */
export const RESPONSE_STREAM = 'MAGUS_RESPONSES';
export const CLAIMS_BUCKET = 'magus_claims';

/**
 * Every NATS name of one data plane. Plain data (it may cross a Temporal boundary); subjects are
 * built with {@link requestSubjectOf} / {@link responseSubjectOf}.
 */
export interface DataPlaneNames {
  /** `''` in production; e.g. `T_X` in a test. */
  prefix: string;
  requestStream: string;
  /** Subject scope prepended to shared/serving subjects: `''` or e.g. `t_x`. */
  subjectScope: string;
  responseStream: string;
  sessionsBucket: string;
  tokensBucket: string;
  modelsBucket: string;
  claimsBucket: string;
  poolsBucket: string;
}

const NAME = /^[A-Za-z0-9_-]+$/;
/** Pool and instance names: DNS-label-like, and without `_` so `<pool>_<instance>` is unambiguous. */
const TOKEN = /^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$/;
/** Request ids: one subject token and one KV key. */
export const REQUEST_ID = /^[A-Za-z0-9_-]{1,128}$/;
/** Gateway replica ids: one subject token. */
export const REPLICA_ID = /^[A-Za-z0-9_-]{1,64}$/;

/** The names of the data plane, optionally renamed by `prefix` for isolation. */
export function dataPlaneNames(prefix = ''): DataPlaneNames {
  if (prefix && !NAME.test(prefix)) throw new Error(`data-plane prefix '${prefix}' must match ${String(NAME)}`);
  const p = prefix ? `${prefix}_` : '';
  return {
    prefix,
    requestStream: `${p}${Nats.requestStream}`,
    subjectScope: prefix.toLowerCase(),
    responseStream: `${p}${RESPONSE_STREAM}`,
    sessionsBucket: `${p}${Nats.sessionsBucket}`,
    tokensBucket: `${p}${Nats.tokensBucket}`,
    modelsBucket: `${p}${Nats.modelsBucket}`,
    claimsBucket: `${p}${CLAIMS_BUCKET}`,
    poolsBucket: `${p}${Nats.poolsBucket}`,
  };
}

/** `subject` inside a data plane's subject scope (`''`: unscoped). */
export const scopeSubject = (scope: string | undefined, subject: string): string => (scope ? `${scope}.${subject}` : subject);
const scoped = (names: DataPlaneNames, subject: string) => scopeSubject(names.subjectScope, subject);

function checkToken(what: string, value: string): void {
  if (!TOKEN.test(value)) throw new Error(`${what} '${value}' is not a valid name (letters, digits and '-', at most 63)`);
}

/** `magus.req.<pool>.<instance>` in this data plane. */
export function requestSubjectOf(names: DataPlaneNames, pool: string, instance: string): string {
  checkToken('pool', pool);
  checkToken('instance', instance);
  return scoped(names, requestSubject(pool, instance));
}

/** `magus.cancel.<pool>.<instance>` in this data plane: where a gateway says a request's client went away. */
export function cancelSubjectOf(names: DataPlaneNames, pool: string, instance: string): string {
  checkToken('pool', pool);
  checkToken('instance', instance);
  return scoped(names, cancelSubject(pool, instance));
}

/**
 * Where the frames of request `requestId` go in this data plane: `magus.res.<replica>.<id>`, the
 * subject of the gateway replica that waits for them; without a replica the older
 * `magus.res.<id>` (requests queued by gateways from before per-replica subjects).
 */
export function responseSubjectOf(names: DataPlaneNames, requestId: string, replica?: string): string {
  if (!REQUEST_ID.test(requestId)) throw new Error(`request id '${requestId}' must match ${String(REQUEST_ID)}`);
  if (replica !== undefined && !REPLICA_ID.test(replica)) throw new Error(`replica '${replica}' must match ${String(REPLICA_ID)}`);
  return scoped(names, responseSubject(requestId, replica));
}

/** Whether `subject` is a `replyTo` a bridge may answer request `requestId` on: one of {@link responseSubjectOf}'s two forms. */
export function isResponseSubjectOf(names: DataPlaneNames, subject: string, requestId: string): boolean {
  const prefix = `${scoped(names, Nats.responseSubjectPrefix)}.`;
  if (!subject.startsWith(prefix) || !subject.endsWith(requestId)) return false;
  const rest = subject.slice(prefix.length, subject.length - requestId.length);
  return rest === '' || (rest.endsWith('.') && REPLICA_ID.test(rest.slice(0, -1)));
}

/** The durable consumer of one instance (consumers live in the stream, which is already prefixed). */
export function consumerNameOf(pool: string, instance: string): string {
  checkToken('pool', pool);
  checkToken('instance', instance);
  return `${pool}_${instance}`;
}

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
   * new messages refused): a publish beyond it fails with {@link isBacklogFull}, which the
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
}

/** JetStream's most replicas per stream. */
export const MAX_REPLICAS = 5;

const MINUTE = 60_000;
const HOUR = 60 * MINUTE;

/** The JetStream API error code of `err`, if it is one. */
export function jsErrorCode(err: unknown): number | undefined {
  return (err as { api_error?: { err_code?: number } } | null)?.api_error?.err_code;
}
const STREAM_NOT_FOUND = 10059;
const CONSUMER_NOT_FOUND = 10014;
const CONSUMER_EXISTS = 10148;
const NO_MESSAGE = 10037;
/** KV create/update: the key's last revision is not the expected one. */
const WRONG_LAST_SEQUENCE = 10071;

/** A KV `create` that found the key, or an `update` whose expected revision is not the last. */
export function isRevisionConflict(err: unknown): boolean {
  return jsErrorCode(err) === WRONG_LAST_SEQUENCE;
}
export const DEFAULT_INSTANCE_BACKLOG = 256;
/** nats-server: the stream's `max_bytes` does not fit in the memory (or storage) JetStream has left. */
const INSUFFICIENT_MEMORY = 10028;

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
export function responseStreamLimits(opts: Pick<DataPlaneOptions, 'responsePeakBytesPerSec' | 'responseRetentionMs' | 'responseMaxAgeMs' | 'responseMaxBytes'> = {}): {
  maxBytes: number;
  maxAgeMs: number;
  retentionMs: number;
  peakBytesPerSec: number;
} {
  const peakBytesPerSec = opts.responsePeakBytesPerSec ?? DEFAULT_RESPONSE_PEAK_BYTES_PER_SEC;
  const retentionMs = opts.responseRetentionMs ?? DEFAULT_RESPONSE_RETENTION_MS;
  for (const [what, v] of [['responsePeakBytesPerSec', peakBytesPerSec], ['responseRetentionMs', retentionMs]] as const) {
    if (!Number.isFinite(v) || v <= 0) throw new Error(`${what} must be a positive number, got ${v}`);
  }
  const maxBytes = opts.responseMaxBytes ?? Math.max(MIN_RESPONSE_MAX_BYTES, Math.ceil((peakBytesPerSec * retentionMs) / 1000));
  return { maxBytes, maxAgeMs: Math.max(opts.responseMaxAgeMs ?? 30 * MINUTE, retentionMs), retentionMs, peakBytesPerSec };
}

/**
 * A request publish refused because the instance's backlog (the per-subject limit) is full, or
 * all queued requests together reached the stream's byte limit.
 */
export function isBacklogFull(err: unknown): boolean {
  // nats.js: message "503", api_error { err_code: 10077 (stream store failed), description }.
  const api = (err as { api_error?: { err_code?: number; description?: string } } | null)?.api_error;
  return /maximum messages per subject exceeded|maximum bytes exceeded/i.test(api?.description ?? (err as Error | null)?.message ?? '');
}

async function ensureStream(jsm: JetStreamManager, cfg: Partial<StreamConfig> & { name: string }): Promise<StreamInfo> {
  try {
    await jsm.streams.info(cfg.name);
  } catch (err) {
    if (jsErrorCode(err) !== STREAM_NOT_FOUND) throw err;
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
  opts: { history: number; maxAgeMs: number; replicas: number; storage?: StorageType },
): Promise<void> {
  await js.views.kv(bucket, { history: opts.history, ttl: opts.maxAgeMs, replicas: opts.replicas, storage: opts.storage ?? StorageType.File });
  const stream = `KV_${bucket}`;
  const { config } = await jsm.streams.info(stream);
  if (config.max_age !== nanos(opts.maxAgeMs) || config.max_msgs_per_subject !== opts.history || config.num_replicas !== opts.replicas) {
    await jsm.streams.update(stream, { max_age: nanos(opts.maxAgeMs), max_msgs_per_subject: opts.history, num_replicas: opts.replicas });
  }
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
  if (!Number.isInteger(replicas) || replicas < 1 || replicas > MAX_REPLICAS) throw new Error(`replicas must be an integer from 1 to ${MAX_REPLICAS}, got ${replicas}`);
  const requestMaxAge = opts.requestMaxAgeMs ?? HOUR;
  const duplicateWindow = Math.min(opts.duplicateWindowMs ?? 5 * MINUTE, requestMaxAge);
  await ensureStream(jsm, {
    name: names.requestStream,
    description: 'magus inference requests, one subject per topology instance',
    subjects: [scoped(names, `${Nats.requestSubjectPrefix}.>`)],
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
      subjects: [scoped(names, `${Nats.responseSubjectPrefix}.>`)],
      retention: RetentionPolicy.Limits,
      storage: StorageType.Memory,
      discard: DiscardPolicy.Old,
      max_age: nanos(responses.maxAgeMs),
      max_bytes: responses.maxBytes,
      num_replicas: replicas,
      metadata: { [ResponseStreamMetadata.retentionMs]: String(responses.retentionMs), [ResponseStreamMetadata.peakBytesPerSec]: String(responses.peakBytesPerSec) },
    });
  } catch (err) {
    if (jsErrorCode(err) !== INSUFFICIENT_MEMORY) throw err;
    const mib = (responses.maxBytes / 2 ** 20).toFixed(0);
    throw new Error(
      `${names.responseStream}: JetStream has less memory left than the ${mib} MiB it must hold (peak ${responses.peakBytesPerSec} B/s × ${responses.retentionMs / 1000} s): lower the peak or retention, or raise the server's max_memory`,
      { cause: err },
    );
  }
  await ensureBucket(js, jsm, names.sessionsBucket, { history: 1, maxAgeMs: opts.sessionMaxAgeMs ?? 24 * HOUR, replicas });
  await ensureBucket(js, jsm, names.tokensBucket, { history: 1, maxAgeMs: 0, replicas });
  // On file: only redeliveries write claims (a first delivery that answers writes none), and a
  // single nats-server that restarts forgets memory buckets altogether.
  await ensureBucket(js, jsm, names.claimsBucket, { history: 1, maxAgeMs: opts.claimMaxAgeMs ?? 2 * HOUR, replicas });
  await ensureBucket(js, jsm, names.poolsBucket, { history: 1, maxAgeMs: 0, replicas });
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

/**
 * Creates an instance's consumer again with the configuration it had (`config`, as read from
 * its info) when the server no longer has it; true when it was missing. The stream must exist.
 */
export async function restoreConsumer(jsm: JetStreamManager, stream: string, config: ConsumerConfig): Promise<boolean> {
  try {
    await jsm.consumers.info(stream, config.durable_name ?? '');
    return false;
  } catch (err) {
    if (jsErrorCode(err) !== CONSUMER_NOT_FOUND) throw err;
  }
  try {
    await jsm.consumers.add(stream, config);
  } catch (err) {
    if (jsErrorCode(err) !== CONSUMER_EXISTS) throw err;
  }
  return true;
}

export interface InstanceConsumerOptions {
  pool: string;
  instance: string;
  /** Requests the engine serves at once: the consumer's `max_ack_pending`. */
  slots: number;
  /**
   * Redelivery after this long without `ack`/`working()`. Bridges call `working()` every third
   * of it, so it need not cover a slow first token; it bounds how long a crashed bridge's request
   * waits before another bridge takes it over. Default 30 s.
   */
  ackWaitMs?: number;
  /** Deliveries before JetStream gives up; the bridge answers with an error on the last one. Default 5. */
  maxDeliver?: number;
}

/**
 * Whether an instance's bridge consumes its requests: its durable consumer has a pull request
 * waiting (a bridge keeps one open, busy or not; a dead bridge's expire within the pull's 30 s).
 * False when the consumer does not exist.
 */
export async function instanceConsuming(nc: NatsConnection, requestStream: string, pool: string, instance: string): Promise<boolean> {
  try {
    const info = await (await nc.jetstreamManager({ checkAPI: false })).consumers.info(requestStream, consumerNameOf(pool, instance));
    return info.num_waiting > 0;
  } catch (err) {
    if (jsErrorCode(err) === CONSUMER_NOT_FOUND) return false;
    throw err;
  }
}

/** Declares (or updates) the durable pull consumer of one instance. */
export async function ensureInstanceConsumer(jsm: JetStreamManager, names: DataPlaneNames, opts: InstanceConsumerOptions): Promise<ConsumerInfo> {
  if (!Number.isInteger(opts.slots) || opts.slots < 1) throw new Error(`slots must be a positive integer, got ${opts.slots}`);
  const name = consumerNameOf(opts.pool, opts.instance);
  const changeable = {
    description: `bridge of ${opts.pool}/${opts.instance}`,
    filter_subject: requestSubjectOf(names, opts.pool, opts.instance),
    max_ack_pending: opts.slots,
    ack_wait: nanos(opts.ackWaitMs ?? 30_000),
    max_deliver: opts.maxDeliver ?? 5,
  } satisfies Partial<ConsumerConfig>;
  const cfg: Partial<ConsumerConfig> = {
    ...changeable,
    durable_name: name,
    ack_policy: AckPolicy.Explicit,
    deliver_policy: DeliverPolicy.All,
  };
  try {
    return await jsm.consumers.add(names.requestStream, cfg);
  } catch (err) {
    if (jsErrorCode(err) !== CONSUMER_EXISTS) throw err;
    return jsm.consumers.update(names.requestStream, name, changeable);
  }
}

/** Deletes an instance's consumer; false when there was none. Unconsumed requests stay until max age. */
export async function deleteInstanceConsumer(jsm: JetStreamManager, names: DataPlaneNames, opts: { pool: string; instance: string }): Promise<boolean> {
  try {
    return await jsm.consumers.delete(names.requestStream, consumerNameOf(opts.pool, opts.instance));
  } catch (err) {
    if (jsErrorCode(err) === CONSUMER_NOT_FOUND) return false;
    throw err;
  }
}

const encoder = new TextEncoder();
const decoder = new TextDecoder();
export const encodeJson = (value: unknown): Uint8Array => encoder.encode(JSON.stringify(value));
export const decodeJson = (bytes: Uint8Array): unknown => JSON.parse(decoder.decode(bytes));

/**
 * Publishes a request to its instance with `Nats-Msg-Id` = `req.id`, so a retried publish
 * within the duplicate window is stored once.
 */
export async function publishRequest(
  js: JetStreamClient,
  names: DataPlaneNames,
  to: { pool: string; instance: string },
  req: InferenceRequest,
): Promise<{ duplicate: boolean; seq: number }> {
  if (!REQUEST_ID.test(req.id)) throw new Error(`request id '${req.id}' must match ${String(REQUEST_ID)}`);
  const ack = await js.publish(requestSubjectOf(names, to.pool, to.instance), encodeJson(req), {
    msgID: req.id,
    expect: { streamName: names.requestStream },
  });
  return { duplicate: ack.duplicate, seq: ack.seq };
}

/** What {@link readStoredFrames} found of one response subject. */
export interface StoredFrames {
  /** Frames 0..k in order, each seq once: what a {@link FrameSequencer} would have relayed. */
  frames: ResponseFrame[];
  /** Frames stored beyond a missing seq, in seq order: a reader that has the missing ones (a gateway back from an outage) can still use them. */
  beyondGap: ResponseFrame[];
  /** The highest seq stored (−1: none). */
  highestSeq: number;
  /**
   * False when frames of the subject are gone (aged out, or evicted by a full stream: a missing
   * seq, or with `since`, nothing left although the stream dropped frames published after it):
   * then what was sent cannot be known, and the prefix cannot be trusted.
   */
  complete: boolean;
}

/**
 * The frames of `subject` that reached the server, read from the response stream `stream`
 * (`names.responseStream`). `since` (epoch ms, server time: e.g. when the request was stored)
 * says no frame of the subject is older: finding none then proves nothing was sent only if the
 * stream has dropped nothing younger since — a stream that evicts under pressure can have lost
 * every frame of a request, and a take-over that took that for "nothing sent" would restart an
 * answer the client already has part of. (A stream declared again after it was lost, e.g. a
 * restarted server, has dropped nothing: what it holds is what there is.) A read that does not
 * reach the subject's last stored frame within `timeoutMs` (a stream leader still catching up
 * after an election) throws: frames it did not get are not frames that are gone.
 */
export async function readStoredFrames(
  js: JetStreamClient,
  jsm: JetStreamManager,
  stream: string,
  subject: string,
  opts: { since?: number; timeoutMs?: number } = {},
): Promise<StoredFrames> {
  let lastSeq: number;
  try {
    lastSeq = (await jsm.streams.getMessage(stream, { last_by_subj: subject })).seq;
  } catch (err) {
    if (jsErrorCode(err) !== NO_MESSAGE) throw err;
    const dropped = opts.since !== undefined && (await droppedSince(jsm, stream, opts.since));
    return { frames: [], beyondGap: [], highestSeq: -1, complete: !dropped };
  }
  const sequencer = new FrameSequencer();
  const frames: ResponseFrame[] = [];
  let highestSeq = -1;
  let malformed = false;
  const consumer = await js.consumers.get(stream, { filterSubjects: [subject] });
  const messages = await consumer.consume({ max_messages: 256 });
  const timer = setTimeout(() => void messages.close(), opts.timeoutMs ?? 10_000);
  let reachedEnd = false;
  try {
    for await (const m of messages) {
      const frame = decodeFrame(m.data);
      if (frame) {
        frames.push(...sequencer.push(frame));
        highestSeq = Math.max(highestSeq, frame.seq);
      } else malformed = true;
      if (m.seq >= lastSeq) {
        reachedEnd = true;
        break;
      }
    }
  } finally {
    clearTimeout(timer);
    await messages.close();
  }
  // Not gone, unread (an election's new leader can take longer than the timeout to deliver):
  // the caller retries rather than end an answer it cannot see (the cluster test saw a
  // take-over end a live answer with resume_failed at seq 0 this way).
  if (!reachedEnd) throw new Error(`reading ${subject} from ${stream} stopped before its last stored frame (stream seq ${lastSeq})`);
  return { frames, beyondGap: sequencer.waiting(), highestSeq, complete: !malformed && !sequencer.hasGap };
}

/** Whether `stream`, declared before `since`, has dropped messages stored after it (its oldest is younger). */
async function droppedSince(jsm: JetStreamManager, stream: string, since: number): Promise<boolean> {
  const { created, state } = await jsm.streams.info(stream);
  return Date.parse(created) <= since && state.messages > 0 && Date.parse(state.first_ts) > since;
}

/** What {@link responseStreamState} reports of `MAGUS_RESPONSES`: whether it keeps frames as long as take-overs need them. */
export interface ResponseStreamState {
  /** Age of the oldest stored frame (undefined: none stored). */
  oldestFrameAgeMs: number | undefined;
  /** How long frames must stay (`responseRetentionMs` as declared; undefined for a stream declared without it). */
  requiredRetentionMs: number | undefined;
  bytes: number;
  maxBytes: number;
}

/**
 * The response stream's retention as it is now. A full stream (`bytes` near `maxBytes`) whose
 * oldest frame is younger than the required retention is evicting frames a take-over may still
 * need: the stream is too small for the traffic.
 */
export async function responseStreamState(jsm: JetStreamManager, stream: string): Promise<ResponseStreamState> {
  const { config, state } = await jsm.streams.info(stream);
  const required = Number(config.metadata?.[ResponseStreamMetadata.retentionMs]);
  return {
    oldestFrameAgeMs: state.messages > 0 ? Math.max(0, Date.now() - Date.parse(state.first_ts)) : undefined,
    requiredRetentionMs: Number.isFinite(required) && required > 0 ? required : undefined,
    bytes: state.bytes,
    maxBytes: config.max_bytes,
  };
}

/**
 * `magus_claims` entry: which delivery of a request owns it, and how it ended. Created by the
 * first delivery (KV create = CAS), taken over by every later delivery (CAS on the revision), and
 * finished (CAS) by the owner *before* it publishes the terminal frame, which it records here so
 * a later delivery can re-publish exactly that frame.
 */
export interface RequestClaim {
  attempt: number;
  /** Bridge process that owns the current attempt (for logs). */
  owner: string;
  /** Epoch ms of the first claim: every attempt stamps chunks with it, so attempts look alike. */
  createdAt: number;
  state: 'running' | 'finished';
  terminal?: ResponseFrame;
}

export type ClaimResult =
  | { kind: 'fresh' | 'takeover'; claim: RequestClaim; revision: number }
  | { kind: 'finished'; claim: RequestClaim; revision: number };

export interface RequestClaims {
  /** Claims request `id` for this delivery: fresh, taken over from an earlier delivery, or already finished. */
  acquire(id: string, owner: string): Promise<ClaimResult>;
  /**
   * Marks the attempt holding `revision` finished with `terminal`; false when a later delivery
   * has taken the request over (the caller must then publish nothing more). Revision 0: a first
   * delivery that wrote no claim while it ran — the claim is created, already finished, and any
   * claim found instead means it was taken over. Safe to retry after an error (a lost reply): a
   * retry recognises its own earlier write.
   */
  finish(id: string, claim: RequestClaim, revision: number, terminal: ResponseFrame): Promise<boolean>;
  /** The claim's current revision (null when absent): an owner compares it with its own. */
  revision(id: string): Promise<number | null>;
}

/** Binds the claims bucket (declared by {@link ensureDataPlane}). */
export async function openRequestClaims(js: JetStreamClient, names: DataPlaneNames): Promise<RequestClaims> {
  const kv: KV = await js.views.kv(names.claimsBucket, { bindOnly: true });
  const read = async (id: string) => {
    const e = await kv.get(id);
    return e && e.operation === 'PUT' ? { claim: decodeJson(e.value) as RequestClaim, revision: e.revision } : null;
  };
  return {
    async acquire(id, owner) {
      const fresh: RequestClaim = { attempt: 1, owner, createdAt: Date.now(), state: 'running' };
      // A few rounds: a conflict means another party moved the claim in between (e.g. the
      // superseded owner finishing at the same moment); re-read and decide again.
      for (let round = 0; round < 5; round += 1) {
        const current = await read(id);
        try {
          if (!current) return { kind: 'fresh', claim: fresh, revision: await kv.create(id, encodeJson(fresh)) };
          if (current.claim.state === 'finished') return { kind: 'finished', ...current };
          const next: RequestClaim = { ...current.claim, attempt: current.claim.attempt + 1, owner };
          return { kind: 'takeover', claim: next, revision: await kv.update(id, encodeJson(next), current.revision) };
        } catch (err) {
          if (!isRevisionConflict(err)) throw err;
        }
      }
      throw new Error(`request ${id}: could not claim it (the claim kept changing)`);
    },
    async finish(id, claim, revision, terminal) {
      const finished: RequestClaim = { ...claim, state: 'finished', terminal };
      try {
        if (revision === 0) await kv.create(id, encodeJson(finished));
        else await kv.update(id, encodeJson(finished), revision);
        return true;
      } catch (err) {
        if (!isRevisionConflict(err)) throw err;
        // Either superseded, or this is a retry of a finish whose reply was lost: only the
        // latter leaves exactly our value behind.
        const current = await read(id);
        return current !== null && JSON.stringify(current.claim) === JSON.stringify(finished);
      }
    },
    async revision(id) {
      return (await read(id))?.revision ?? null;
    },
  };
}

/**
 * What a stream's reply to a publish says went wrong, or `undefined` for an acknowledgement
 * (`{"stream","seq"}`, also when it was a duplicate). Errors keep the server's `api_error`, as
 * nats.js does, so {@link isBacklogFull} recognises them.
 */
export function streamAckProblem(msg: Pick<Msg, 'data' | 'headers'>): Error | undefined {
  if (msg.data.length === 0) {
    const code = msg.headers?.code ?? 0;
    return new Error(code === 503 ? 'no stream stores this subject (no responders)' : `unexpected empty reply to a stream publish (status ${code})`);
  }
  let ack: { stream?: unknown; error?: { code?: number; err_code?: number; description?: string } };
  try {
    ack = JSON.parse(decoder.decode(msg.data)) as typeof ack;
  } catch {
    return new Error('malformed reply to a stream publish');
  }
  if (ack.error) return Object.assign(new Error(ack.error.description ?? `stream publish failed (${ack.error.code ?? '?'})`), { api_error: ack.error });
  if (typeof ack.stream !== 'string') return new Error('malformed reply to a stream publish');
  return undefined;
}

/**
 * What the NATS server does for `magus_sessions` so that no process keeps a copy of every entry:
 *
 * - **Keys carry their pool**: `<namespace>.<model>.<conversation>` (`gateway/serving/conversation.ts`),
 *   so one pool's entries are one subject filter, `$KV.<bucket>.<namespace>.<model>.*` (a model
 *   name with dots is more tokens, and `*` matches the conversation's one token only).
 * - **Counts the server keeps**: a pull consumer on that filter that nobody pulls from. Its
 *   `num_pending` is the number of the pool's entries the stream holds, maintained by the server
 *   as entries are written and removed, read with one consumer-info request ({@link poolEntryCounter}).
 * - **Deletes whose markers go away**: a delete leaves a marker (watchers learn of it) that the
 *   server removes after {@link SESSION_MARKER_TTL_MS} (a per-message TTL), so a count is the live
 *   entries plus the deletes of the last few seconds, never a day of them. (Not
 *   `subject_delete_marker_ttl`: the server would put a second marker in the place of each that
 *   expires, doubling the time; entries left to the bucket's max age are swept long before it.)
 */
import { createHash } from 'node:crypto';
import { AckPolicy, DeliverPolicy, Empty, headers, nanos, type JetStreamClient, type JetStreamManager, type KV, type KvEntry } from 'nats';
import { isRevisionConflict, jsErrorCode, JsApiError } from './errors';

/** How long the marker of a deleted entry stays in `magus_sessions`: a watcher cut off for less sees every delete. */
export const SESSION_MARKER_TTL_MS = 10_000;

/** The key of `<namespace>/<model>`'s entries, less their conversation token: `<namespace>.<model>`. */
export const poolKeyPrefix = (namespace: string, model: string): string => `${namespace}.${model}`;

/** `JSMessageTTLDisabledErr`: the stream was declared before markers had a TTL (no worker of this version has declared it yet). */
const TTL_DISABLED = 10166;

/**
 * Deletes `key` of `bucket` with a marker that expires (compare-and-swap on `previousSeq` when
 * given: a revision conflict is thrown as `kv.delete` throws it). On a bucket not yet declared
 * with per-message TTLs, a plain delete.
 */
export async function deleteEntry(js: JetStreamClient, bucket: string, key: string, opts: { previousSeq?: number } = {}): Promise<void> {
  const marked = (ttl: boolean) => {
    const h = headers();
    h.set('KV-Operation', 'DEL');
    if (ttl) h.set('Nats-TTL', `${Math.ceil(SESSION_MARKER_TTL_MS / 1000)}s`);
    if (opts.previousSeq !== undefined) h.set('Nats-Expected-Last-Subject-Sequence', `${opts.previousSeq}`);
    return js.publish(`$KV.${bucket}.${key}`, Empty, { headers: h });
  };
  try {
    await marked(true);
  } catch (err) {
    if (jsErrorCode(err) !== TTL_DISABLED) throw err;
    await marked(false);
  }
}

/**
 * The key of the claim on a pool prefix's read for orphans: outside every pool's keys (a namespace
 * never starts with `_`), so no count or scan of a pool sees it.
 */
export const orphanReadClaimKey = (prefix: string): string => `_orphans.${prefix}`;

/**
 * Claims the next read of a pool prefix's entries for orphans, for every process of the deployment:
 * an entry created only if absent that expires by itself after `forMs`. True: this process reads
 * them now; false: another did within `forMs`. On a bucket not yet declared with per-message TTLs
 * an entry could not expire, so nothing is written and every process reads on its own (true).
 */
export async function claimOrphanRead(js: JetStreamClient, bucket: string, prefix: string, forMs: number, by = ''): Promise<boolean> {
  const h = headers();
  h.set('Nats-Expected-Last-Subject-Sequence', '0');
  h.set('Nats-TTL', `${Math.max(1, Math.ceil(forMs / 1000))}s`);
  try {
    await js.publish(`$KV.${bucket}.${orphanReadClaimKey(prefix)}`, new TextEncoder().encode(JSON.stringify({ by, at: new Date().toISOString() })), {
      headers: h,
    });
    return true;
  } catch (err) {
    if (isRevisionConflict(err)) return false; // the subject has a message: someone else holds the claim
    if (jsErrorCode(err) === TTL_DISABLED) return true;
    throw err;
  }
}

/** The stream setting {@link deleteEntry}'s markers need (`ensureBucket`'s `markers`). */
export const markerSettings = { allow_msg_ttl: true } as const;

/**
 * How long a counting consumer lives without a pull (an info request is no activity to the server,
 * so it is made again this often while counted): a pool that is gone leaves nothing behind.
 */
const COUNTER_INACTIVE_MS = 10 * 60_000;

/** The counting consumer of a pool prefix: one name for every process that counts it (a consumer name holds no dot). */
export const counterNameOf = (prefix: string): string => `count_${createHash('sha256').update(prefix).digest('hex').slice(0, 24)}`;

/**
 * How many entries of a pool `bucket` holds (live, expired but not yet deleted, and markers
 * younger than {@link SESSION_MARKER_TTL_MS}), counted by the server: one consumer per pool
 * prefix, shared by every worker that counts it (created again by whichever asks once the server
 * removed it, unused for {@link COUNTER_INACTIVE_MS}).
 */
export function poolEntryCounter(jsm: JetStreamManager, bucket: string): (prefix: string) => Promise<number> {
  const stream = `KV_${bucket}`;
  return async (prefix) => {
    const name = counterNameOf(prefix);
    try {
      return (await jsm.consumers.info(stream, name)).num_pending;
    } catch (err) {
      if (jsErrorCode(err) !== JsApiError.consumerNotFound) throw err;
    }
    // Created with the same configuration by any worker: the server answers each with the one consumer.
    const info = await jsm.consumers.add(stream, {
      name,
      filter_subject: `$KV.${bucket}.${prefix}.*`,
      ack_policy: AckPolicy.None,
      deliver_policy: DeliverPolicy.All,
      inactive_threshold: nanos(COUNTER_INACTIVE_MS),
      mem_storage: true,
      num_replicas: 1,
    });
    return info.num_pending;
  };
}

/**
 * Reads every entry of a pool prefix once (a watch of its filter, stopped when it has replayed
 * what the stream holds), calling `each` with each; what `each` keeps is the caller's business.
 */
export async function scanPoolEntries(kv: KV, prefix: string, each: (e: KvEntry) => void): Promise<void> {
  let replayed = false;
  let stop: () => void = () => void (replayed = true);
  const w = await kv.watch({ key: `${prefix}.*`, initializedFn: () => stop() });
  stop = () => w.stop();
  if (replayed) w.stop(); // nothing to replay: initialized before the watch was returned
  for await (const e of w) if (e.operation === 'PUT') each(e);
}

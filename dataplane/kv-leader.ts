/**
 * Reads of a replicated bucket that must see the last write: `kv.get` on a bucket with
 * `allow_direct` (JetStream's default) is a DIRECT.GET, which any replica may answer — a follower
 * a little behind included. The entry-lease protocol reads after a lost compare-and-swap (to use
 * the winner's entry) and in a session's expiry (renewed, expired or gone?); a stale answer there
 * costs a compare-and-swap that fails again, or a session that ends beside a live entry. Reading
 * the stream's leader (STREAM.MSG.GET, which only the leader answers) sees every acknowledged write.
 */
import { ErrorCode, type JetStreamManager, type KvEntry } from 'nats';

/** `bucket`'s entry `key` as its stream's leader has it (null: never written). */
export async function leaderGet(jsm: JetStreamManager, bucket: string, key: string): Promise<KvEntry | null> {
  try {
    const sm = await jsm.streams.getMessage(`KV_${bucket}`, { last_by_subj: `$KV.${bucket}.${key}` });
    const operation = (sm.header?.get('KV-Operation') || 'PUT') as KvEntry['operation'];
    return {
      bucket,
      key,
      value: sm.data,
      created: sm.time,
      revision: sm.seq,
      operation,
      length: sm.data.length,
      json: <T>() => sm.json<T>(),
      string: () => sm.string(),
    };
  } catch (err) {
    if ((err as { code?: string }).code === ErrorCode.JetStream404NoMessages) return null;
    throw err;
  }
}

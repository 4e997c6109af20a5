/**
 * This gateway's writes to `magus_sessions`, the entry-lease protocol's (ARCHITECTURE.md, "Data
 * plane", "The entry-lease protocol"): an entry is created with KV `create` (one per conversation
 * across replicas), changed only by compare-and-swap on the revision it was read at (a renewal or
 * a move: one replica's write wins, the others read and use it), and given back by a delete on
 * its revision (a later renewal or move wins over it). Each write leaves the mirror holding what
 * the bucket now holds, before the watch brings it.
 */
import { isRevisionConflict } from '../../../dataplane';
import { SessionError, SessionErrorType } from '../../plugins/errors';
import { decodeSessionEntry, type SessionEntry } from '../../../shared/serving';
import type { SessionMirror } from './mirror';
import type { CachedEntry, SessionWriter } from './types';

/**
 * A write or read the bucket did not answer (NATS unreachable, no acknowledgement in time, the
 * stream without a leader): the turn is answered 503 with a `Retry-After`, not 500 — nothing was
 * wrong with the request.
 */
export function unavailable(err: unknown, what: string): SessionError {
  const e = new SessionError(SessionErrorType.Unavailable, `${what}: ${(err as Error)?.message ?? String(err)}`);
  return Object.assign(e, { cause: err });
}

/** A write's outcome: ours, or the entry another write left (none: deleted). */
export type Written = { won: true; entry: CachedEntry } | { won: false; entry: CachedEntry | undefined };

const encode = (e: SessionEntry): Uint8Array => new TextEncoder().encode(JSON.stringify(e));

/** An entry as written to the bucket (the revision is the bucket's, not part of the value). */
export function withoutRevision(e: CachedEntry): SessionEntry {
  const { revision: _revision, ...entry } = e;
  return entry;
}

export class SessionEntries {
  constructor(
    private readonly bucket: SessionWriter,
    private readonly mirror: SessionMirror,
  ) {}

  /** Creates the conversation's entry; lost when the key exists (another turn, on any replica, created it first). */
  async create(key: string, next: SessionEntry): Promise<Written> {
    try {
      const revision = await this.bucket.create(key, encode(next));
      const written = { ...next, revision };
      this.mirror.set(key, written);
      return { won: true, entry: written };
    } catch (err) {
      if (!isRevisionConflict(err)) throw unavailable(err, "the conversation's entry could not be created");
      return { won: false, entry: await this.read(key) };
    }
  }

  /** Writes `next` over `entry` (compare-and-swap on its revision). */
  async swap(key: string, entry: CachedEntry, next: SessionEntry): Promise<Written> {
    try {
      const revision = await this.bucket.update(key, encode(next), entry.revision);
      const written = { ...next, revision };
      this.mirror.set(key, written);
      return { won: true, entry: written };
    } catch (err) {
      if (!isRevisionConflict(err)) throw unavailable(err, "the conversation's entry could not be renewed");
      return { won: false, entry: await this.read(key) };
    }
  }

  /** The entry in the bucket now, mirrored. */
  async read(key: string): Promise<CachedEntry | undefined> {
    const theirs = await this.bucket.get(key).catch((err: unknown) => {
      throw unavailable(err, "the conversation's entry could not be read");
    });
    const e = theirs && theirs.operation === 'PUT' ? decodeSessionEntry(theirs.value) : undefined;
    const cached = e && { ...e, revision: theirs!.revision };
    if (cached) this.mirror.set(key, cached);
    else this.mirror.delete(key);
    return cached;
  }

  /**
   * Deletes the entry written at `revision`, unless it changed since (a later turn renewed or
   * moved it: the conversation lives on, and the delete is not made). The watch removes it from
   * the mirror, and with it its count. Whether it was deleted.
   */
  async giveBack(key: string, revision: number): Promise<boolean> {
    try {
      await this.bucket.delete(key, { previousSeq: revision });
      return true;
    } catch (err) {
      if (!isRevisionConflict(err)) throw err;
      return false;
    }
  }
}

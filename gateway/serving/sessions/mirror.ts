/**
 * The gateway's copy of `magus_sessions`: a watch-backed mirror of every replica's entries, and
 * the live entries it counts per instance, kept in step with the mirror on every change and
 * rebuilt with it when the watch is reopened. Invariant: `leasesOn` is the number of entries in
 * the mirror naming that instance, whatever order changes arrive in. Or (`RecentSessions`, what
 * the gateway process runs) only the entries of the conversations this gateway serves, read from
 * the bucket on first use and kept current by a watch of updates: bounded memory, no replay.
 */
import type { KvEntry } from 'nats';
import { watchKv, type KvCache, type WatchableKv } from '../../../dataplane/kv-mirror';
import { decodeSessionEntry, type SessionEntry } from '../../../shared/serving';
import type { CachedEntry } from './types';

/** The key an instance's count is kept under: `<namespace>/<pool>/<instance>`. */
export const instanceKey = (namespace: string | undefined, pool: string, instance: string): string => `${namespace ?? 'default'}/${pool}/${instance}`;

/** A mirror of the conversations this gateway uses only (bounded), read from the bucket when not held. */
export interface RecentSessions {
  /** At most this many entries held (~0.4 KB each); the least recently used leave first. */
  maxEntries: number;
  /** Reads one entry from the bucket (its leader). */
  read: (key: string) => Promise<KvEntry | null>;
}

export class SessionMirror {
  /** The mirror itself (the gateway reopens it after a reconnect and reports whether it is live). */
  readonly cache: KvCache<CachedEntry>;
  /** Live entries per instance ({@link instanceKey}); kept only when the mirror holds every entry ({@link counts}). */
  private readonly load = new Map<string, number>();
  /** Reads under way (a recent mirror), so that concurrent turns of one conversation share one. */
  private readonly reads = new Map<string, Promise<CachedEntry | undefined>>();

  /**
   * Every entry of the bucket (a watch replaying it at start and after every reconnect; counts
   * per instance), or with `recent` only those this gateway uses, read on demand: a gateway then
   * starts and reconnects without replaying the bucket, and holds a bounded number of entries
   * whatever the number of live conversations.
   */
  constructor(
    kv: WatchableKv,
    onError?: (err: unknown) => void,
    private readonly recent?: RecentSessions,
  ) {
    const decode = (e: KvEntry): CachedEntry | undefined => {
      const entry = decodeSessionEntry(e.value);
      return entry && { ...entry, revision: e.revision };
    };
    this.cache = watchKv<CachedEntry>(kv, {
      decode,
      onError,
      ...(recent
        ? { recent: { maxSize: recent.maxEntries, wanted: (key: string) => this.reads.has(key) } }
        : {
            onChange: (_key: string, before: CachedEntry | undefined, after: CachedEntry | undefined) => {
              this.count(before, -1);
              this.count(after, 1);
            },
            onReset: (map: ReadonlyMap<string, CachedEntry>) => {
              this.load.clear();
              for (const e of map.values()) this.count(e, 1);
            },
          }),
    });
  }

  /** Whether it holds every entry of the bucket, and so counts them per instance ({@link leasesOn}). */
  get counts(): boolean {
    return this.recent === undefined;
  }

  /**
   * The entry as held. While the watch is down (a reconnect) held entries are still answered, as
   * a mirror being rebuilt answers from its old map: every write is a compare-and-swap, so an
   * entry another replica changed meanwhile is read again at the write that finds it changed.
   */
  get(key: string): CachedEntry | undefined {
    return this.cache.get(key);
  }

  /** The entry as held, or (a recent mirror) as the bucket has it now, then held. */
  lookup(key: string): Promise<CachedEntry | undefined> {
    const held = this.get(key);
    if (held || !this.recent) return Promise.resolve(held);
    let read = this.reads.get(key);
    if (!read) {
      const recent = this.recent;
      read = recent.read(key).then(
        (e) => {
          this.reads.delete(key);
          const theirs = e && e.operation === 'PUT' ? decodeSessionEntry(e.value) : undefined;
          const found = theirs && { ...theirs, revision: e!.revision };
          // An update the watch brought while the read was under way is newer than what it read.
          const meanwhile = this.cache.get(key);
          if (meanwhile && (!found || meanwhile.revision >= found.revision)) return meanwhile;
          if (found) this.cache.set(key, found);
          return found;
        },
        (err: unknown) => {
          this.reads.delete(key);
          throw err;
        },
      );
      this.reads.set(key, read);
    }
    return read;
  }

  /** Records what this gateway wrote or read (the watch delivers the same a little later). */
  set(key: string, entry: CachedEntry): void {
    this.cache.set(key, entry);
  }

  delete(key: string): void {
    this.cache.delete(key);
  }

  /** Live entries on an instance, every replica's as the watch delivered them (a mirror that {@link counts} only). */
  leasesOn(namespace: string | undefined, pool: string, instance: string): number {
    return this.load.get(instanceKey(namespace, pool, instance)) ?? 0;
  }

  /**
   * Drops entries expired `graceMs` before `now` — a conversation's session deletes its entry,
   * but one whose delete this replica missed, or one with no session, would stay — and returns
   * them with their revisions (an entry with no session is then deleted: placement.ts `sweepOrphans`).
   * A recent mirror sweeps what it holds.
   */
  sweep(now: number, graceMs: number): [key: string, revision: number][] {
    const dropped: [string, number][] = [];
    for (const [key, e] of [...this.cache.entries()])
      if (e.expiresAt <= now - graceMs) {
        this.cache.delete(key);
        dropped.push([key, e.revision]);
      }
    return dropped;
  }

  private count(e: SessionEntry | undefined, by: number): void {
    if (!e) return;
    const k = instanceKey(e.namespace, e.pool, e.instance);
    const n = (this.load.get(k) ?? 0) + by;
    if (n > 0) this.load.set(k, n);
    else this.load.delete(k);
  }
}

/**
 * The gateway's copy of `magus_sessions`: a watch-backed mirror of every replica's entries, and
 * the live entries it counts per instance, kept in step with the mirror on every change and
 * rebuilt with it when the watch is reopened. Invariant: `leasesOn` is the number of entries in
 * the mirror naming that instance, whatever order changes arrive in.
 */
import type { KvEntry } from 'nats';
import { watchKv, type KvCache, type WatchableKv } from '../../../dataplane/kv-mirror';
import { decodeSessionEntry, type SessionEntry } from '../../../shared/serving';
import type { CachedEntry } from './types';

/** The key an instance's count is kept under: `<namespace>/<pool>/<instance>`. */
export const instanceKey = (namespace: string | undefined, pool: string, instance: string): string => `${namespace ?? 'default'}/${pool}/${instance}`;

export class SessionMirror {
  /** The mirror itself (the gateway reopens it after a reconnect and reports whether it is live). */
  readonly cache: KvCache<CachedEntry>;
  /** Live entries per instance ({@link instanceKey}). */
  private readonly load = new Map<string, number>();

  constructor(kv: WatchableKv, onError?: (err: unknown) => void) {
    this.cache = watchKv<CachedEntry>(kv, {
      decode: (e: KvEntry) => {
        const entry = decodeSessionEntry(e.value);
        return entry && { ...entry, revision: e.revision };
      },
      onError,
      onChange: (_key, before, after) => {
        this.count(before, -1);
        this.count(after, 1);
      },
      onReset: (map) => {
        this.load.clear();
        for (const e of map.values()) this.count(e, 1);
      },
    });
  }

  get(key: string): CachedEntry | undefined {
    return this.cache.get(key);
  }

  /** Records what this gateway wrote or read (the watch delivers the same a little later). */
  set(key: string, entry: CachedEntry): void {
    this.cache.set(key, entry);
  }

  delete(key: string): void {
    this.cache.delete(key);
  }

  /** Live entries on an instance, every replica's as the watch delivered them. */
  leasesOn(namespace: string | undefined, pool: string, instance: string): number {
    return this.load.get(instanceKey(namespace, pool, instance)) ?? 0;
  }

  /**
   * Drops entries expired `graceMs` before `now` — a conversation's session deletes its entry,
   * but one whose delete this replica missed, or one with no session, would stay — and returns
   * them with their revisions (an entry with no session is then deleted: placement.ts `sweepOrphans`).
   */
  sweep(now: number, graceMs: number): [key: string, revision: number][] {
    const dropped: [string, number][] = [];
    for (const [key, e] of this.cache.entries())
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

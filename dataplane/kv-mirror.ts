/**
 * A JetStream KV bucket mirrored into memory through a watch, so the hot path reads a `Map`
 * instead of asking the server. The watch delivers every key's last value, then live updates;
 * if it ends (connection lost, consumer reset) it is re-opened and the map rebuilt from scratch,
 * so keys deleted meanwhile do not linger.
 *
 * Or, with `recent`, only the keys its owner puts in it (read elsewhere, or written), at most
 * `maxSize` of them, the least recently used leaving first: the watch delivers updates only (no
 * replay of the bucket: it is live as soon as it opens), and those of keys held or being read
 * are applied. A re-opened watch resumes after the last update it delivered, so what changed
 * while it was down reaches the keys held (which are read on meanwhile, as a rebuilt mirror's old
 * map is).
 */
import { KvWatchInclude, type KvEntry, type KvWatchOptions, type QueuedIterator } from 'nats';

/** The part of a nats.js `KV` the cache needs. */
export interface WatchableKv {
  watch(opts?: KvWatchOptions): Promise<QueuedIterator<KvEntry>>;
  /** The bucket's stream state (a recent mirror checks the stream did not start over before it resumes). */
  status?(): Promise<{ streamInfo: { state: { last_seq: number } } }>;
}

export interface KvCache<T> {
  get(key: string): T | undefined;
  /** Puts a value ahead of the watch (e.g. a session just acquired); the next update for the key wins. */
  set(key: string, value: T): void;
  delete(key: string): void;
  entries(): IterableIterator<[string, T]>;
  readonly size: number;
  /** True once the initial values are loaded and while the watch is running. */
  readonly live: boolean;
  /** Resolves when the initial values are loaded. */
  readonly ready: Promise<void>;
  /**
   * Opens a new watch at once, rebuilding the map (reads keep the old one until it is rebuilt):
   * after a reconnect, since a restarted server has forgotten the watch's consumer, and the old
   * watch would only notice when its heartbeats went missing, seconds later.
   */
  reopen(): void;
  close(): Promise<void>;
}

export interface KvCacheOptions<T> {
  /** The value to keep for a `PUT`, or `undefined` to treat it as absent (e.g. malformed). */
  decode: (entry: KvEntry) => T | undefined;
  onError?: (err: unknown) => void;
  /** Pause before re-opening a watch that ended. */
  restartDelayMs?: number;
  /** Told of every change of the map readers see: the watch's updates, `set` and `delete` (an index kept beside the map). */
  onChange?: (key: string, before: T | undefined, after: T | undefined) => void;
  /** Told when a rebuilt map replaces the one readers saw (an index is rebuilt from it). */
  onReset?: (map: ReadonlyMap<string, T>) => void;
  /** Only keys the owner puts in (module comment): the watch's updates of others are dropped. */
  recent?: {
    /** At most this many keys; beyond it the least recently read or written leaves. */
    maxSize: number;
    /** Keys whose updates are kept though not held (reads under way: an update during one must not be lost). */
    wanted: (key: string) => boolean;
  };
}

export function watchKv<T>(kv: WatchableKv, opts: KvCacheOptions<T>): KvCache<T> {
  let current = new Map<string, T>();
  let live = false;
  let stopped = false;
  let iter: QueuedIterator<KvEntry> | undefined;
  let markReady!: () => void;
  const ready = new Promise<void>((resolve) => (markReady = resolve));
  let wake: (() => void) | undefined;
  let reopening = false;

  const recent = opts.recent;
  /** The stream sequence of the last update the watch delivered (a recent mirror resumes after it). */
  let lastSeq = 0;
  /** `used`: the owner read or wrote it (to the end of the order); an update the watch brought keeps its place. */
  const change = (target: Map<string, T>, key: string, after: T | undefined, used: boolean): void => {
    const before = target.get(key);
    if (after === undefined) target.delete(key);
    else {
      if (recent && used) target.delete(key); // to the end of the order: the most recently used
      target.set(key, after);
    }
    if (target === current && (before !== undefined || after !== undefined)) opts.onChange?.(key, before, after);
    if (recent && target.size > recent.maxSize) {
      const [oldest, value] = target.entries().next().value!;
      target.delete(oldest);
      if (target === current) opts.onChange?.(oldest, value, undefined);
    }
  };
  const apply = (target: Map<string, T>, e: KvEntry): void => {
    if (recent) {
      lastSeq = Math.max(lastSeq, e.revision);
      if (!target.has(e.key) && !recent.wanted(e.key)) return; // a key nobody here uses
    }
    if (e.operation !== 'PUT') {
      change(target, e.key, undefined, false);
      return;
    }
    let v: T | undefined;
    try {
      v = opts.decode(e);
    } catch (err) {
      opts.onError?.(err);
    }
    change(target, e.key, v, false);
  };

  const run = async (): Promise<void> => {
    while (!stopped) {
      // A recent mirror keeps what it holds across watches: the new one resumes where the last
      // stopped — unless the stream started over (a server on ephemeral storage came back empty):
      // what it holds is then forgotten, and read again.
      if (recent && lastSeq > 0 && kv.status) {
        const last = await kv.status().then(
          (s) => s.streamInfo.state.last_seq,
          () => undefined,
        );
        if (last !== undefined && last < lastSeq) {
          for (const key of [...current.keys()]) change(current, key, undefined, false);
          lastSeq = 0;
        }
      }
      const next = recent ? current : new Map<string, T>();
      let initialized = false;
      try {
        iter = await kv.watch({
          ...(recent ? { include: KvWatchInclude.UpdatesOnly, ...(lastSeq > 0 ? { resumeFromRevision: lastSeq + 1 } : {}) } : {}),
          // Called in order after the last initial value; swap the rebuilt map in at once.
          initializedFn: () => {
            current = next;
            opts.onReset?.(current);
            initialized = true;
            live = true;
            markReady();
          },
        });
        for await (const e of iter) apply(initialized ? current : next, e);
      } catch (err) {
        if (!stopped) opts.onError?.(err);
      }
      live = false;
      iter = undefined;
      if (reopening) reopening = false;
      else if (!stopped)
        await new Promise<void>((resolve) => {
          const t = setTimeout(resolve, opts.restartDelayMs ?? 1000);
          t.unref(); // a mirror nobody closed does not hold the process open
          wake = () => {
            clearTimeout(t);
            resolve();
          };
        });
    }
  };
  const running = run();

  return {
    get: (key) => {
      const v = current.get(key);
      if (recent && v !== undefined) {
        current.delete(key); // to the end of the order: the most recently used
        current.set(key, v);
      }
      return v;
    },
    set: (key, value) => change(current, key, value, true),
    delete: (key) => change(current, key, undefined, true),
    entries: () => current.entries(),
    get size() {
      return current.size;
    },
    get live() {
      return live;
    },
    ready,
    reopen() {
      if (stopped) return;
      live = false;
      if (iter) {
        reopening = true;
        iter.stop();
      } else wake?.();
    },
    async close() {
      stopped = true;
      iter?.stop();
      wake?.();
      await running;
    },
  };
}

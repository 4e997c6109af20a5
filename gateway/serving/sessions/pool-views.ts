/**
 * The pools' published views (`magus_pools`, key `<namespace>.<model>`), mirrored through a KV
 * watch, as placement may use them. A view its pool rewrites in time is used as written. One not
 * rewritten for `POOL_ENTRY_MAX_AGE_MS` is used only for its instances found consuming (a probe
 * per instance, at most once per {@link PROBE_INTERVAL_MS}, its answer used for
 * {@link PROBE_TTL_MS}): a pool that is gone is not told apart from one an overloaded Temporal is
 * too slow to run, and the instances still consuming are what both can serve.
 */
import type { KvEntry } from 'nats';
import { watchKv, type KvCache, type WatchableKv } from '../../../dataplane/kv-mirror';
import type { ReadyModel } from '../../../shared/model';
import { decodePoolEntry, POOL_ENTRY_MAX_AGE_MS, type PoolEntry, type SessionEntry } from '../../../shared/serving';
import type { FirstTurns } from './types';

/** Start durations kept per pool: the median of the last few says how long the next one takes. */
const STARTS_KEPT = 5;
/** A start observed to take longer than this is not a start (a view missed in between): not kept. */
const MAX_START_MS = 60 * 60_000;

/** A stale view's instances are looked at again at most this often, and what was found is used this long. */
const PROBE_INTERVAL_MS = 5_000;
const PROBE_TTL_MS = 15_000;

/** What a look at a stale view found: the instances consuming, for the view written at `updatedAt`. */
interface Probe {
  at: number;
  updatedAt: number;
  alive: Set<string>;
  looking?: Promise<void>;
}

export class PoolViews {
  /** The mirror (absent without a `magus_pools` bucket: no view, so nothing is placed from one). */
  readonly cache: KvCache<PoolEntry> | undefined;
  /** Per view key, the last look at its instances while the view is stale. */
  private readonly probes = new Map<string, Probe>();
  /** Per view key: its instances being started and since when, and how long its last starts took (ms). */
  private readonly starts = new Map<string, { starting: Map<string, number>; took: number[] }>();

  constructor(
    kv: WatchableKv | undefined,
    /** Asked whether an instance is consuming (`alive`; absent: a stale view is not used). */
    private readonly first: FirstTurns | undefined,
    private readonly now: () => number,
    onError?: (err: unknown) => void,
  ) {
    this.cache = kv
      ? watchKv<PoolEntry>(kv, { decode: (e: KvEntry) => decodePoolEntry(e.value), onError, onChange: (key, _before, after) => this.observe(key, after) })
      : undefined;
  }

  /**
   * Learns how long the pool's starts take: an instance a view listed as starting since T, then
   * ready in a view written at T2, took T2 − T (to within the pool's view writes).
   */
  private observe(key: string, view: PoolEntry | undefined): void {
    if (!view) return void this.starts.delete(key);
    let s = this.starts.get(key);
    if (!s) this.starts.set(key, (s = { starting: new Map(), took: [] }));
    for (const i of view.instances) {
      const since = s.starting.get(i.instance);
      if (since === undefined) continue;
      const took = view.updatedAt - since;
      if (took > 0 && took < MAX_START_MS) s.took = [...s.took, took].slice(-STARTS_KEPT);
    }
    s.starting = new Map((view.starting ?? []).map((i) => [i.instance, i.since]));
  }

  /**
   * How long until the pool may serve one more instance (ms, at least a second): the soonest of
   * those it is starting, by how long its last starts took; with none starting, a whole start
   * (one a refusal asks for). Undefined before any start was seen, or when the pool cannot grow.
   */
  nextInstanceMs(namespace: string, model: string): number | undefined {
    const key = `${namespace}.${model}`;
    const s = this.starts.get(key);
    if (!s || s.took.length === 0) return undefined;
    const typical = [...s.took].sort((a, b) => a - b)[Math.floor(s.took.length / 2)]!;
    const now = this.now();
    const starting = [...s.starting.values()].map((since) => since + typical - now);
    if (starting.length === 0 && this.cache?.get(key)?.growable === false) return undefined;
    return Math.max(1_000, Math.round(starting.length > 0 ? Math.min(...starting) : typical));
  }

  /** Not rewritten by its pool for `POOL_ENTRY_MAX_AGE_MS`: not used as written. */
  stale(entry: PoolEntry): boolean {
    return this.now() - entry.updatedAt > POOL_ENTRY_MAX_AGE_MS;
  }

  /** The model's published view: as written while its pool rewrites it, else only its instances found consuming. */
  viewOf(namespace: string, model: string): PoolEntry | undefined {
    const key = `${namespace}.${model}`;
    const entry = this.cache?.get(key);
    if (!entry) return undefined;
    if (!this.stale(entry)) {
      this.probes.delete(key);
      return entry;
    }
    void this.probe(namespace, model, entry);
    const p = this.probes.get(key);
    if (!p || p.updatedAt !== entry.updatedAt || this.now() - p.at > PROBE_TTL_MS || p.alive.size === 0) return undefined;
    return { ...entry, instances: entry.instances.filter((i) => p.alive.has(i.instance)) };
  }

  /** Waits for a look at the model's stale view, if one is due or under way. */
  async probed(model: ReadyModel): Promise<void> {
    const entry = this.cache?.get(`${model.namespace}.${model.name}`);
    if (entry && this.stale(entry)) await this.probe(model.namespace, model.name, entry);
  }

  /** The pool no longer publishes the entry's instance (its view is newer than the entry's placement; an entry without `placedAt` is pinned, never moved). */
  gone(e: SessionEntry): boolean {
    if (e.placedAt === undefined) return false;
    const view = this.viewOf(e.namespace ?? 'default', e.pool);
    return view !== undefined && view.updatedAt > e.placedAt && !view.instances.some((i) => i.instance === e.instance);
  }

  close(): Promise<void> {
    return this.cache?.close() ?? Promise.resolve();
  }

  /** Looks at a stale view's instances (at most once per interval); the look under way, if any. */
  private probe(namespace: string, model: string, entry: PoolEntry): Promise<void> | undefined {
    const f = this.first;
    if (!f?.alive) return undefined;
    const key = `${namespace}.${model}`;
    const known = this.probes.get(key);
    if (known?.looking) return known.looking;
    if (known && known.updatedAt === entry.updatedAt && this.now() - known.at < PROBE_INTERVAL_MS) return undefined;
    const record = known ?? { at: 0, updatedAt: entry.updatedAt, alive: new Set<string>() };
    record.looking = Promise.all(
      entry.instances.map(async (i) => ((await f.alive!(namespace, model, i.instance).catch(() => false)) ? i.instance : undefined)),
    ).then((ids) => {
      this.probes.set(key, { at: this.now(), updatedAt: entry.updatedAt, alive: new Set(ids.filter((id): id is string => id !== undefined)) });
    });
    this.probes.set(key, record);
    return record.looking;
  }
}

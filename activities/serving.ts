/**
 * Activities of the serving workflows (`dllamaPool`, `session`): instances through a
 * {@link Runtime}, the pools' published views (`magus_pools`) and the expiry of the
 * conversations' `magus_sessions` entries.
 */
import { ApplicationFailure, heartbeat, Context } from '@temporalio/activity';
import type { KV, KvEntry } from 'nats';
import { isRevisionConflict } from '../dataplane';
import { watchKv, type KvCache, type WatchableKv } from '../dataplane/kv-mirror';
import { poolKeyPrefix, scanPoolEntries } from '../dataplane/session-keys';
import { decodeSessionEntry, ORPHAN_SWEEP_GRACE_MS, type PoolEntry, type SessionEntry } from '../shared/serving';
import { RUNTIME_ADVERT_STALE_MS, type RuntimeAdvert } from '../shared/runtimes';
import { PERMANENT_RUNTIME_ERRORS } from '../shared/errors';
import { restartChange, type WatchInstanceInput, type WatchInstanceResult } from '../shared/status';
import type { InstanceInfo, InstanceRequest, Runtime } from './runtime/runtime';

const HEARTBEAT_EVERY_MS = 5000;

/** The `magus_pools` key of a model's pool. */
export const poolKey = (namespace: string, model: string): string => `${namespace}.${model}`;

export interface ServingDeps {
  runtime: Runtime;
  sessions: KV;
  /** How a session's expiry reads its entry: the stream's leader (dataplane/kv-leader.ts), not any replica; default `sessions.get`. */
  readSession?: (key: string) => Promise<KvEntry | null>;
  pools: KV;
  /** This worker's own queue, when its runtime's instances are its processes (named in each `InstanceInfo`). */
  runtimeQueue?: string;
  /**
   * The runtime advert of the worker a runtime queue belongs to (null: none, or not a runtime
   * queue of this deployment). Without it `workerGone` has no evidence and says gone.
   */
  advertOf?: (runtimeQueue: string) => Promise<RuntimeAdvert | null>;
  /** An instance's request backlog: its consumer's `num_pending` and `num_ack_pending` (null: no consumer). */
  backlog?: (pool: string, instance: string) => Promise<{ pending: number; ackPending: number } | null>;
  /**
   * How many entries a pool prefix (`<namespace>.<model>`) holds, counted by the server
   * (dataplane/session-keys.ts `poolEntryCounter`). With it a pool that scales on load is reported
   * on without a copy of any entry; without it, from this process's index of the whole bucket.
   */
  countEntries?: (prefix: string) => Promise<number>;
  /** Deletes an entry (compare-and-swap on `previousSeq`) leaving a marker that expires (session-keys.ts `deleteEntry`); default `sessions.delete`. */
  deleteSession?: (key: string, previousSeq: number) => Promise<void>;
  /** How often a pool on load's entries are read for orphans, at least (default {@link ORPHAN_SCAN_EVERY_MS}; tests shorten it). */
  orphanScanEveryMs?: number;
  /**
   * Claims a pool prefix's read for orphans for `forMs` across every worker (session-keys.ts
   * `claimOrphanRead`): false, another process read it lately. Without it each process reads on its own.
   */
  claimOrphanRead?: (prefix: string, forMs: number) => Promise<boolean>;
}

/** What `watchLoad` reports: per instance, live entries and backlog (see workflows/pool/state.ts `LoadReport`). */
export interface LoadSummary {
  instances: Record<string, { leases: number; pending: number; ackPending: number }>;
  /**
   * The pool's entries as the server counts them (live ones, and those ended in the last seconds),
   * when counted for the pool as a whole: each instance's `leases` is then 0, not counted.
   */
  live?: number;
}

export interface WatchLoadInput {
  namespace: string;
  /** The model (and data-plane pool) whose conversations are counted. */
  model: string;
  /** The instances to report on (the pool's serving ones). */
  instances: string[];
  leasesPerInstance: number;
  /** The pool's maximum: leases beyond what fills it change no decision, and are not reported. */
  maxInstances?: number;
  /** What the pool knows already: the activity completes once the load differs from it in a way that matters. */
  known: LoadSummary | null;
  /** The earliest the activity completes after it starts (default 2 s): at most one report per interval. */
  minIntervalMs?: number;
  /** How often the backlog is read and the counts looked at (default 1 s). */
  pollMs?: number;
  /** Counts that changed without changing a decision are reported after this long (default 60 s): the status the UI shows stays current. */
  refreshMs?: number;
  /** Requests queued on an instance at which it counts as pressed (the pool's scale-up by backlog). */
  pressurePending: number;
  /** Instances being replaced: the pool stops each once nothing is in flight on it, so that is reported whatever its leases. */
  draining?: string[];
  /** The pool scales on load (workflows/pool/state.ts, "Scaling"): what it decides on is requests in flight or queued, not leases. */
  scaleOn?: 'load';
}

/**
 * What of a load summary the pool's decisions depend on: which instances are idle and which
 * pressed (a queue), and how many instances the load fills. Scaling on leases, an instance with a
 * conversation is busy and the leases fill the count; on load (`onLoad`), only requests in
 * flight or queued make an instance busy and fill the count, and of the leases only whether there
 * are any matters. A report is sent only when this changes, so the pool's history grows with
 * changes of decision, never with the number of conversations.
 */
export function loadSignature(
  s: LoadSummary,
  instances: readonly string[],
  o: { leasesPerInstance: number; pressurePending: number; maxInstances?: number; draining?: readonly string[]; onLoad?: boolean },
): string {
  let leases = s.live ?? 0;
  let busy = 0;
  const per = instances.map((id) => {
    const i = s.instances[id] ?? { leases: 0, pending: 0, ackPending: 0 };
    leases += i.leases;
    busy += i.pending + i.ackPending;
    const flight = o.draining?.includes(id) && i.pending + i.ackPending > 0 ? ':flight' : '';
    const idle = (o.onLoad || i.leases === 0) && i.pending === 0 && i.ackPending === 0;
    return `${id}:${idle ? 'idle' : 'busy'}${i.pending >= o.pressurePending ? ':pressed' : ''}${flight}`;
  });
  const fills = Math.min(o.maxInstances ?? Infinity, Math.ceil((o.onLoad ? busy : leases) / o.leasesPerInstance));
  return `${per.join(',')}|${fills}${o.onLoad ? `|${leases > 0 ? 'held' : 'none'}` : ''}`;
}

/** The live `magus_sessions` entries of each pool, as the reconcilers of one process read them. */
export interface SessionIndex {
  /** True once the bucket's entries are loaded and while its watch runs. */
  readonly live: boolean;
  entriesOf(namespace: string, model: string): Iterable<SessionEntry>;
  countOf(namespace: string, model: string): number;
  /** The pool's entries with their keys and the revisions they were read at (for a compare-and-swap delete). */
  keyedOf(namespace: string, model: string): Iterable<[key: string, entry: IndexedEntry]>;
  release(): void;
}

/** An indexed entry and the revision it was read at. */
type IndexedEntry = SessionEntry & { revision: number };

/** A reconciler sweeps its pool's orphaned entries at most this often, at most {@link ORPHANS_PER_SWEEP} a time. */
const ORPHAN_SWEEP_EVERY_MS = 60_000;
/**
 * A process reads a pool's entries from the server for orphans at most this often (a pool's
 * reconcilers count without holding them), and at most once per millisecond per entry: a read of
 * a million takes 6.3 s (`bench:sessions`), so every 17 min then.
 */
const ORPHAN_SCAN_EVERY_MS = 5 * 60_000;
const ORPHAN_SCAN_MS_PER_ENTRY = 1;
const ORPHANS_PER_SWEEP = 1_000;

/** How long a session index outlives its last reader: a pool restarts its reconciler a task later. */
const INDEX_LINGER_MS = 5_000;

/**
 * One watch of `magus_sessions` per process, shared by every `watchLoad` running in it and kept
 * indexed by pool. A watch replays every entry of the bucket when it opens: opened per report,
 * as it was, a pool with 27,000 live conversations replayed them all every few seconds in the
 * worker's process. Opened on first use, closed {@link INDEX_LINGER_MS} after the last reader.
 */
function sessionIndexes(kv: WatchableKv): () => SessionIndex {
  let mirror: KvCache<IndexedEntry> | undefined;
  let readers = 0;
  let closing: NodeJS.Timeout | undefined;
  const byPool = new Map<string, Map<string, IndexedEntry>>();
  const poolOf = (e: SessionEntry) => `${e.namespace ?? 'default'}/${e.pool}`;
  const index = (key: string, e: IndexedEntry | undefined, add: boolean) => {
    if (!e) return;
    const p = poolOf(e);
    let m = byPool.get(p);
    if (add) {
      if (!m) byPool.set(p, (m = new Map<string, IndexedEntry>()));
      m.set(key, e);
    } else if (m) {
      m.delete(key);
      if (m.size === 0) byPool.delete(p);
    }
  };
  const open = (): KvCache<IndexedEntry> =>
    watchKv<IndexedEntry>(kv, {
      decode: (e) => {
        const entry = decodeEntry(e);
        return entry && { ...entry, revision: e.revision };
      },
      onError: () => undefined, // the watch re-opens by itself; a reconciler waits while it is not live
      onChange: (key, before, after) => {
        index(key, before, false);
        index(key, after, true);
      },
      onReset: (map) => {
        byPool.clear();
        for (const [key, e] of map) index(key, e, true);
      },
    });
  return () => {
    clearTimeout(closing);
    readers++;
    const m = (mirror ??= open());
    let released = false;
    return {
      get live() {
        return m.live;
      },
      entriesOf: (namespace, model) => byPool.get(`${namespace}/${model}`)?.values() ?? [],
      countOf: (namespace, model) => byPool.get(`${namespace}/${model}`)?.size ?? 0,
      keyedOf: (namespace, model) => byPool.get(`${namespace}/${model}`)?.entries() ?? [],
      release() {
        if (released) return;
        released = true;
        if (--readers > 0) return;
        closing = setTimeout(() => {
          if (readers > 0 || mirror !== m) return;
          mirror = undefined;
          byPool.clear();
          void m.close();
        }, INDEX_LINGER_MS);
        closing.unref();
      },
    };
  };
}

export function createServingActivities(deps: ServingDeps) {
  const encode = (e: SessionEntry | PoolEntry) => new TextEncoder().encode(JSON.stringify(e));
  const sessionIndex = sessionIndexes(deps.sessions);
  const deleteSession = deps.deleteSession ?? ((key: string, previousSeq: number) => deps.sessions.delete(key, { previousSeq }));
  /** When this process last scanned each pool prefix for orphans (Infinity: under way). */
  const scanned = new Map<string, number>();
  return {
    /**
     * Starts an instance and waits until it serves (heartbeating: a cold start can take minutes).
     * The SDK delivers a cancel only through heartbeats, so they also bring one in: the
     * workflow's, or the server's answer that the activity timed out (`NOT_FOUND`, `TIMED_OUT`).
     * The runtime then aborts the start (unless a retry of this activity has joined it), and this
     * fails with the `CancelledFailure` once everything the start began has stopped.
     */
    async createInstance(input: InstanceRequest): Promise<InstanceInfo> {
      const ctx = Context.current();
      const timer = setInterval(() => heartbeat({ instance: input.instance, phase: 'starting' }), HEARTBEAT_EVERY_MS);
      try {
        const info = await deps.runtime.create(input, ctx.cancellationSignal);
        return deps.runtimeQueue ? { ...info, runtimeQueue: deps.runtimeQueue } : info;
      } catch (err) {
        // No retry can fix these (the model is not published, or has nothing this runtime can
        // serve): fail at once, typed, and let the pool decide when to try again.
        const name = (err as Error).name;
        if (PERMANENT_RUNTIME_ERRORS.includes(name)) throw ApplicationFailure.nonRetryable((err as Error).message, name);
        throw err;
      } finally {
        clearInterval(timer);
      }
    },
    /**
     * Watches one instance for as long as it serves, heartbeating (the pool's liveness check of
     * this worker), and completes with the reason once it does not: the pool then replaces it.
     * Runs for the instance's whole life; the pool cancels it when it stops the instance. How
     * the instance is watched is this activity's business: changing it changes no workflow
     * history (a probe loop in the pool workflow would write events for every probe).
     */
    async watchInstance(input: WatchInstanceInput): Promise<WatchInstanceResult> {
      const ctx = Context.current();
      const alive = () => heartbeat({ instance: input.instance, phase: input.known?.recovering ? 'restarting' : 'serving' });
      if (deps.runtime.watch) return { reason: await deps.runtime.watch(input.pool, input.instance, ctx.cancellationSignal, alive) };
      for (;;) {
        alive();
        const info = await deps.runtime.describe(input.pool, input.instance);
        if (!info) return { reason: `instance ${input.instance} is gone` };
        if (!info.healthy) return { reason: `instance ${input.instance} stopped serving${info.restarts?.last ? ` (${info.restarts.last})` : ''}` };
        const change = input.known && info.restarts ? restartChange(input.known, info.restarts) : null;
        if (change) return change;
        await ctx.sleep(input.intervalMs); // a cancel (the pool stopped it) ends the sleep with CancelledFailure
      }
    },
    async destroyInstance(input: { pool: string; instance: string }): Promise<void> {
      await deps.runtime.destroy(input.pool, input.instance);
    },
    /**
     * Whether the worker owning `runtimeQueue` has stopped: its runtime advert withdrawn (a clean
     * stop) or not refreshed for {@link RUNTIME_ADVERT_STALE_MS} (killed). The pool asks before
     * dropping that worker's instances when nobody took an activity from its queue in time: under
     * load Temporal can be slower than that timeout with the worker alive and serving.
     */
    async workerGone(input: { runtimeQueue: string }): Promise<{ gone: boolean; reason: string }> {
      if (!deps.advertOf) return { gone: true, reason: 'no runtime adverts to check' };
      const advert = await deps.advertOf(input.runtimeQueue);
      if (!advert) return { gone: true, reason: 'its runtime advert is withdrawn' };
      const age = Date.now() - advert.at;
      return age > RUNTIME_ADVERT_STALE_MS
        ? { gone: true, reason: `its runtime advert is ${Math.round(age / 1000)} s old` }
        : { gone: false, reason: `its runtime advert is ${Math.round(age / 1000)} s old` };
    },
    /**
     * A session's look at its lease (`magus_sessions` entry) when its expiry has come: renewed
     * (a later `expiresAt`: the session sleeps again), gone (someone else ended it), or expired —
     * then deleted with compare-and-swap on the revision read, so a renewal landing meanwhile wins
     * (the delete fails, the entry is read again). A renewed entry is marked `watched` the first
     * time (shared/serving.ts: how a gateway tells an entry with no session). Run as a local
     * activity: one marker event.
     */
    async expireSession(input: { key: string }): Promise<{ ended: 'expired' | 'gone' } | { expiresAt: number }> {
      const read = deps.readSession ?? ((key: string) => deps.sessions.get(key));
      for (;;) {
        const e = await read(input.key);
        const entry = e && e.operation === 'PUT' ? decodeEntry(e) : undefined;
        if (!e || !entry) return { ended: 'gone' };
        if (entry.expiresAt > Date.now()) {
          // Renewed: marked as having its session, once (a write meanwhile wins; the next look marks it).
          if (!entry.watched)
            await deps.sessions.update(input.key, encode({ ...entry, watched: true }), e.revision).catch((err: unknown) => {
              if (!isRevisionConflict(err)) throw err;
            });
          return { expiresAt: entry.expiresAt };
        }
        try {
          await deleteSession(input.key, e.revision);
          return { ended: 'expired' };
        } catch (err) {
          if (!isRevisionConflict(err)) throw err; // renewed (or moved) meanwhile: look again
        }
      }
    },
    /**
     * The pool's reconciler: counts the live `magus_sessions` entries on each of the pool's
     * instances (a watch of the bucket) and reads each instance's request backlog, and completes
     * with the summary once what the pool decides on ({@link loadSignature}) differs from what it
     * knows — at the earliest `minIntervalMs` after it started, so a pool gets at most one report
     * per interval however many conversations come and go. Heartbeats while it watches; the pool
     * starts it again with what it reported.
     */
    async watchLoad(input: WatchLoadInput): Promise<LoadSummary> {
      const ctx = Context.current();
      const started = Date.now();
      const minInterval = input.minIntervalMs ?? 2000;
      const poll = input.pollMs ?? 1000;
      // A pool on load needs its entries counted, not per instance: the server counts them, and
      // this process holds none. Otherwise (a pool on leases) its index of the whole bucket.
      const count = input.scaleOn === 'load' ? deps.countEntries : undefined;
      const prefix = poolKeyPrefix(input.namespace, input.model);
      const sessions = count ? undefined : sessionIndex();
      let entries = sessions?.countOf(input.namespace, input.model) ?? 0;
      let swept = 0;
      const signature = (s: LoadSummary) =>
        loadSignature(s, input.instances, {
          leasesPerInstance: input.leasesPerInstance,
          pressurePending: input.pressurePending,
          ...(input.maxInstances !== undefined ? { maxInstances: input.maxInstances } : {}),
          ...(input.draining ? { draining: input.draining } : {}),
          onLoad: input.scaleOn === 'load',
        });
      const known = input.known ? signature(input.known) : null;
      // An instance the pool has no report on yet (just started): reported at the first look, not after the interval.
      const news = input.instances.some((id) => !input.known?.instances[id]);
      try {
        for (;;) {
          heartbeat({ instances: input.instances.length, entries });
          if (sessions?.live && Date.now() - swept >= ORPHAN_SWEEP_EVERY_MS) {
            swept = Date.now();
            // A sweep that fails (NATS away) is tried again in a minute; the counts go on meanwhile.
            await sweepOrphans(deleteSession, sessions.keyedOf(input.namespace, input.model), swept).catch(() => 0);
          }
          const live = count ? await count(prefix).catch(() => undefined) : undefined; // undefined: not counted now (NATS away)
          if (live !== undefined) entries = live;
          // The first scan of a prefix in this process comes at a random point of the interval (a
          // restart does not read every entry at once, and workers spread theirs); each in the
          // background: a million entries take longer to read than a heartbeat may wait.
          const every = Math.max(deps.orphanScanEveryMs ?? ORPHAN_SCAN_EVERY_MS, entries * ORPHAN_SCAN_MS_PER_ENTRY);
          if (count && !scanned.has(prefix)) scanned.set(prefix, Date.now() - Math.random() * every);
          if (count && Date.now() - scanned.get(prefix)! >= every) {
            scanned.set(prefix, Infinity); // one scan of a prefix at a time in this process
            // …and one in the deployment per interval: whichever worker claims it reads (a claim
            // that cannot be asked, NATS away, is tried again an interval later).
            const claim = deps.claimOrphanRead ? deps.claimOrphanRead(prefix, every).catch(() => false) : Promise.resolve(true);
            void claim
              .then((mine) => (mine ? scanOrphans(deps.sessions, deleteSession, prefix) : 0))
              .catch(() => 0)
              .finally(() => scanned.set(prefix, Date.now()));
          }
          const ready = count ? live !== undefined : sessions!.live;
          if (ready && (news || Date.now() - started >= minInterval)) {
            const summary: LoadSummary = { instances: {} };
            for (const id of input.instances) summary.instances[id] = { leases: 0, pending: 0, ackPending: 0 };
            if (live !== undefined) summary.live = live;
            else {
              const now = Date.now();
              for (const entry of sessions!.entriesOf(input.namespace, input.model)) {
                const i = summary.instances[entry.instance];
                if (i && entry.expiresAt > now) i.leases++;
              }
              entries = sessions!.countOf(input.namespace, input.model);
            }
            if (deps.backlog) {
              const backlogs = await Promise.all(input.instances.map((id) => deps.backlog!(input.model, id).catch(() => null)));
              input.instances.forEach((id, k) => Object.assign(summary.instances[id]!, backlogs[k] ?? {}));
            }
            // A new instance is reported as it is, even idle (the pool holds it busy until it hears).
            if (news || signature(summary) !== known) return summary;
            if (
              Date.now() - started >= (input.refreshMs ?? 60_000) &&
              (summary.live !== input.known?.live || input.instances.some((id) => summary.instances[id]!.leases !== input.known?.instances[id]?.leases))
            )
              return summary;
          }
          await ctx.sleep(poll); // a cancel (the pool closing its run) ends the sleep with CancelledFailure
        }
      } finally {
        sessions?.release();
      }
    },
    /** Publishes the pool's leasable instances for gateways (`updatedAt` is stamped here). */
    async writePool(input: {
      namespace: string;
      model: string;
      instances: PoolEntry['instances'];
      leasesPerInstance: number;
      growable?: boolean;
      failing?: string;
      nextStartAt?: number;
      failedAt?: number;
      starting?: PoolEntry['starting'];
      scalesOn?: 'load';
    }): Promise<void> {
      const entry: PoolEntry = {
        instances: input.instances,
        leasesPerInstance: input.leasesPerInstance,
        updatedAt: Date.now(),
        ...(input.growable === undefined ? {} : { growable: input.growable }),
        ...(input.failing === undefined ? {} : { failing: input.failing, nextStartAt: input.nextStartAt, failedAt: input.failedAt }),
        ...(input.starting && input.starting.length > 0 ? { starting: input.starting } : {}),
        ...(input.scalesOn ? { scalesOn: input.scalesOn } : {}),
      };
      await deps.pools.put(poolKey(input.namespace, input.model), encode(entry));
    },
  };
}

/**
 * Deletes (compare-and-swap on the revision indexed) the pool's entries still there
 * {@link ORPHAN_SWEEP_GRACE_MS} after they expired, at most {@link ORPHANS_PER_SWEEP}: no session
 * will (a conversation's session deletes its expired entry; this one's gateway died before
 * starting it). Gateways that hold only their recent conversations never see such an entry.
 */
async function sweepOrphans(del: (key: string, previousSeq: number) => Promise<void>, entries: Iterable<[string, IndexedEntry]>, now: number): Promise<number> {
  const orphans: [string, number][] = [];
  for (const [key, e] of entries) {
    if (e.expiresAt > now - ORPHAN_SWEEP_GRACE_MS) continue;
    orphans.push([key, e.revision]);
    if (orphans.length >= ORPHANS_PER_SWEEP) break;
  }
  let deleted = 0;
  for (const [key, revision] of orphans) {
    try {
      await del(key, revision);
      deleted++;
    } catch (err) {
      if (!isRevisionConflict(err)) throw err; // renewed or moved meanwhile: it lives
    }
  }
  return deleted;
}

/**
 * The same sweep for a pool whose entries nobody holds: its entries read once from the server
 * (its key prefix's filter), keeping only the orphans found, at most {@link ORPHANS_PER_SWEEP}.
 */
async function scanOrphans(kv: KV, del: (key: string, previousSeq: number) => Promise<void>, prefix: string): Promise<number> {
  const now = Date.now();
  const orphans: [string, IndexedEntry][] = [];
  await scanPoolEntries(kv, prefix, (e) => {
    if (orphans.length >= ORPHANS_PER_SWEEP) return;
    const entry = decodeEntry(e);
    if (entry && entry.expiresAt <= now - ORPHAN_SWEEP_GRACE_MS) orphans.push([e.key, { ...entry, revision: e.revision }]);
  });
  return sweepOrphans(del, orphans, now);
}

/** A `magus_sessions` entry, or undefined when malformed. */
function decodeEntry(e: KvEntry): SessionEntry | undefined {
  try {
    return decodeSessionEntry(e.value);
  } catch {
    return undefined;
  }
}

export type ServingActivities = ReturnType<typeof createServingActivities>;

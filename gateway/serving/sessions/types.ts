/**
 * The session broker's interfaces: what the routes ask ({@link SessionBroker}), what the gateway
 * process injects into the KV-backed one ({@link SessionCacheOptions}, {@link FirstTurns}) and
 * what it reports ({@link SessionStats}). Interfaces only; the classes are beside them (index.ts).
 */
import type { KvEntry } from 'nats';
import type { WatchableKv } from '../../../dataplane/kv-mirror';
import type { ReadyModel } from '../../../shared/model';
import type { PoolEntry, SessionEntry } from '../../../shared/serving';
import type { RecentSessions } from './mirror';

export interface AcquireRequest {
  /** The conversation key (serving/conversation.ts): stable across the turns of one conversation. */
  conversationKey: string;
  model: ReadyModel;
  /** The calling key's owner (plugins/auth.ts `Principal.owner`). */
  owner: string;
  /** Aborted when the client goes away or the gateway gives up waiting. */
  signal: AbortSignal;
  /**
   * Settles once the turn that asked is over: true when it was answered. A conversation this turn
   * created gets its session workflow only then; a first turn refused (a full backlog), failed or
   * left by its client gives its entry back (deleted with compare-and-swap), so it leaves nothing
   * behind: no lease counted, no workflow. Absent: the session starts at once.
   */
  answered?: Promise<boolean>;
}

/**
 * Finds (or starts) the instance for a conversation. Throws errors whose `type` is a
 * `SessionErrorType` (plugins/errors.ts: `BacklogFull` → 429, `NoCapacity` → 503) when it cannot.
 */
export interface SessionBroker {
  acquire(req: AcquireRequest): Promise<SessionEntry>;
  /**
   * An instance for a request that belongs to no conversation (embeddings): the least loaded
   * one the pool publishes, whether or not it has room for another conversation (such a request
   * takes no lease; the instance's queue bounds it); none serving — the cold path, as a first
   * turn waits. Nothing is written and no session starts. The entry answered expires at once.
   */
  route(req: { model: ReadyModel; signal: AbortSignal }): Promise<SessionEntry>;
  /**
   * Another instance the pool publishes than `instance`, the least loaded, to continue an answer
   * on (its bridge handed it back); none when the view lists no other. `place` is the move's
   * (gateway/serving/exchange.ts `MoveHow`). With `spread` (the answer's place among those its
   * bridge handed back together, `ResponseFrame`'s `spread`): the `spread`-th of the others by
   * name, unless its queue is over the wait budget. With `byLoad` (an answer of which nothing was
   * said, which goes before the target's own queue, in its place: shared/serving.ts `queueDueOf`),
   * the least full first (in flight and queued per slot, as its bridge last said, with what this
   * gateway sent there since), then as without. Nothing is written.
   */
  another?(model: ReadyModel, instance: string, place?: { spread?: number; byLoad?: boolean }): SessionEntry | undefined;
  /** Whether {@link another} would find one, without counting a move to it. */
  hasAnother?(model: ReadyModel, instance: string): boolean;
  /**
   * Whether a turn of `model` (of the conversation `conversationKey`: a warm one) may be queued:
   * undefined — counted at once at the instance it is expected to go to — unless it would wait
   * longer than the budget wherever it may go (a first turn is placed, a warm one moved, where its
   * wait is within it); then its refusal.
   */
  queueAdmit?(model: ReadyModel, conversationKey: string | undefined): QueueRefusal | undefined;
  /** Counters for /metrics, when the broker keeps them. */
  stats?(): SessionStats;
  /** Whether the model's pool serves, starts or fails now, from its published view (absent: the broker cannot tell). */
  serving?(model: Pick<ReadyModel, 'namespace' | 'name'>): ModelServing;
  /** How long until the model's pool may serve one more instance, by how long its starts take (ms; undefined: unknown). */
  nextInstanceMs?(model: Pick<ReadyModel, 'namespace' | 'name'>): number | undefined;
}

/** A model's pool as its published view shows it (`/v1/models`' `serving`, what a waiting turn is told). */
export interface ModelServing {
  /** `ready`: an instance serves; `starting`: none does, one starts; `idle`: none serves or starts (a request starts one); `failing`: starts fail. */
  status: 'ready' | 'starting' | 'idle' | 'failing';
  /** Instances that serve. */
  instances: number;
  /** Instances being started, and how long the oldest start has taken so far (whole seconds). */
  starting: number;
  startingForSec?: number;
  /** With `failing`: why. */
  failing?: string;
}

export interface SessionStats {
  /** Turns answered from the session cache. */
  warmHits: number;
  /** Conversations moved off an instance the pool no longer publishes. */
  moves?: number;
  /** Entries renewed by this gateway (compare-and-swap). */
  renewals?: number;
  /** Entries of first turns that were not answered (refused, failed, left), deleted again. */
  givenBack?: number;
  /** Turns that waited: for an instance with room (telling the pool of the demand), or on the {@link ColdStart}. */
  coldStarts: number;
  /** First turns served from a pool's published instances (the session workflow confirms later). */
  firstTurns: number;
  /** Of those, picks from a view its pool had not rewritten in time, among its instances found consuming. */
  staleViewPicks?: number;
  /** Conversations answered whose session workflow has not started yet (a gauge). */
  pendingSessionStarts?: number;
  /** New conversations refused because too many wait for their session to start. */
  refusedForPendingStarts?: number;
  /** Warm conversations moved off an instance whose queue was over the wait budget (counted in `moves` too). */
  queueMoves?: number;
  /** Turns refused (429 `queue_full`) because every instance's queue was over the wait budget. */
  refusedForQueueWait?: number;
  /** Conversations whose entry had no session workflow (its gateway died first), given one by a warm turn. */
  orphansAdopted?: number;
  /** Entries long expired that no session deleted, deleted by this gateway's sweep. */
  orphansSwept?: number;
}

/** How a broker without {@link FirstTurns} places a conversation with no fresh entry, resolving to its entry. */
export type ColdStart = (req: AcquireRequest) => Promise<SessionEntry>;

/** What the `magus_sessions` bucket must offer: an atomic create, a compare-and-swap update, and a read after losing either. */
export interface SessionWriter {
  create(key: string, value: Uint8Array): Promise<number>;
  update(key: string, value: Uint8Array, version: number): Promise<number>;
  get(key: string): Promise<KvEntry | null>;
  delete(key: string, opts?: { previousSeq?: number }): Promise<void>;
}

/**
 * First turns without a workflow on the client's path (the entry-lease protocol). The entry is
 * created with KV `create`, so concurrent first turns of one conversation (on any replica) agree
 * on the winner's instance; `adopt` then starts the conversation's session workflow.
 */
export interface FirstTurns {
  sessions: SessionWriter;
  /** Lifetime of an entry after its last renewal (the session's TTL). */
  ttlMs: number;
  /** Starts the session workflow of an entry this gateway created (or revived); not awaited by the request. */
  adopt(req: Omit<AcquireRequest, 'signal'>, entry: SessionEntry): Promise<void>;
  /**
   * Tells the model's pool that this replica holds `waiting` first turns for want of an instance
   * with room (signal-with-start: it starts the pool too). Called at most once a second per model.
   * Absent: first turns wait for room without telling anyone (a pool sized by its resource).
   */
  demand?(model: ReadyModel, waiting: number): Promise<void>;
  /** Whether the pools can be told (Temporal answers): a first turn without room is refused at once (503) when not. */
  reachable?(): boolean;
  /**
   * Whether an instance's bridge is consuming its requests (its consumer has a pull waiting).
   * Asked only about the instances of a view older than `POOL_ENTRY_MAX_AGE_MS` (shared/serving.ts): a pool
   * whose workflow is too slow to rewrite its view (an overloaded Temporal) still serves new
   * conversations on the instances found alive, instead of sending every first turn to the pool
   * that cannot answer. Absent: a view that old is not used.
   */
  alive?(namespace: string, pool: string, instance: string): Promise<boolean>;
}

export interface SessionCacheOptions {
  /** The `magus_sessions` bucket (key = conversation key). */
  kv: WatchableKv;
  /** Places conversations when there are no {@link SessionCacheOptions.firstTurns}. Default: 503 `NoCapacity`. */
  coldStart?: ColdStart;
  /** Serve first turns from pools' published instances; without it every turn with no fresh entry takes `coldStart`. */
  firstTurns?: FirstTurns;
  /**
   * The `magus_pools` bucket (key `<namespace>.<model>`): the pools' published views, which first
   * turns (`firstTurns`) and requests of no conversation (`route`) are placed by.
   */
  pools?: WatchableKv;
  /** A lease ending sooner than this is not used as it is: the turn renews it (first turns) or takes `coldStart`. */
  freshnessMarginMs?: number;
  /**
   * With first turns, a warm hit whose entry has less than `renewWithinMs` left renews it (a
   * compare-and-swap, not awaited), at most once per `renewIntervalMs` per conversation: renewing
   * only once part of the entry is used spares the bucket a write per interval for every live
   * conversation.
   */
  renewIntervalMs?: number;
  /**
   * Default: every warm hit may renew. The gateway sets TTL − max(30 s, TTL/10): a session ends
   * between that much and TTL after its last turn, and a live conversation costs at most ten
   * renewals per TTL (one per 3 min at the default 30 min) instead of one per 30 s.
   */
  renewWithinMs?: number;
  /**
   * At most this many conversations answered by this gateway may wait for their session workflow
   * to start (Temporal slower than new conversations arrive, or away); beyond it a new
   * conversation is refused (503 with `Retry-After`) until they drain. Default
   * `MAX_PENDING_SESSION_STARTS` (starts.ts).
   */
  maxPendingSessionStarts?: number;
  /** Instances' expected queue waits (serving/queue-waits.ts): turns go where theirs is within the budget. */
  waits?: QueueWaitsView;
  /** Whether an instance's bridge went silent (serving/beats.ts `silent`): turns and moved answers go elsewhere while another serves. */
  silent?: (pool: string, instance: string) => boolean;
  /** Whether an instance's bridge says it stops (serving/beats.ts `stopping`): turns and moved answers go there only before a silent one. */
  stopping?: (pool: string, instance: string) => boolean;
  /**
   * Hold only the entries of conversations this gateway serves (mirror.ts `RecentSessions`): no
   * replay of the bucket at start or after a reconnect, a bounded number held. Default: every
   * entry, counted per instance.
   */
  recent?: RecentSessions;
  now?: () => number;
  onError?: (err: unknown) => void;
}

/** A mirrored entry with the revision it was read at (for compare-and-swap). */
export type CachedEntry = SessionEntry & { revision: number };

/** One instance of a pool's published view: what a conversation is placed on. */
export type PublishedInstance = PoolEntry['instances'][number];

/** A turn refused for its queue wait: when to retry, the shortest expected wait, and the budget it exceeds. */
export interface QueueRefusal {
  retryAfterMs: number;
  waitMs: number;
  budgetMs: number;
}

/** What placement asks of instances' queue waits (serving/queue-waits.ts `QueueWaits`). */
export interface QueueWaitsView {
  readonly budgetMs: number;
  published(pool: string, instance: string): void;
  waitMs(pool: string, instance: string): number | undefined;
  occupancy(pool: string, instance: string): number | undefined;
  overBudget(pool: string, instance: string): boolean;
  retryAfterMs(pool: string, instance: string): number | undefined;
}

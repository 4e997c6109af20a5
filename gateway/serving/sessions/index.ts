/**
 * Sessions: which instance serves a conversation. The gateway asks a {@link SessionBroker}; the
 * one here ({@link SessionCache}) answers warm turns from memory: the entries of the conversations
 * this gateway served lately (`recent`, what the gateway process runs: each read from the
 * `magus_sessions` KV bucket at its first turn here, then kept current by a watch of the bucket's
 * updates), or a watch-backed mirror of every entry (no Temporal call, no KV read per request).
 *
 * The entry-lease protocol (ARCHITECTURE.md, "Data plane", "The entry-lease protocol"): a
 * conversation's entry **is** its lease.
 * A first turn picks an instance with room from the pool's published instances (`magus_pools`),
 * counting the entries on each instance in the mirror of every entry (every replica's, as the
 * watch delivers them; holding recent ones only, the view's counts plus its own picks since) plus
 * its own picks not yet written, and creates the entry (KV create: one per
 * conversation across replicas); the conversation's session workflow is started afterwards, off
 * the client's path. Warm turns renew the entry's expiry themselves (compare-and-swap, at most
 * once per `renewIntervalMs` and only once part of the TTL is used): no Temporal call. An entry
 * whose instance the pool no longer publishes is moved (compare-and-swap: one replica wins, the
 * others use its choice). With no instance with room, the turn tells the pool there is demand
 * (`demand`, at most once a second per model) and waits on the view, bounded by its signal.
 *
 * The files: `types.ts` (the interfaces), `cache.ts` (the broker, composing the rest), `mirror.ts`,
 * `pool-views.ts`, `picker.ts`, `entries.ts` (every write to the bucket), `placement.ts`,
 * `demand.ts`, `starts.ts`, `shared-calls.ts`, `stats.ts`.
 */
export { SessionCache } from './cache';
export { MAX_PENDING_SESSION_STARTS } from './starts';
export type {
  AcquireRequest,
  CachedEntry,
  ColdStart,
  FirstTurns,
  ModelServing,
  SessionBroker,
  SessionCacheOptions,
  SessionStats,
  SessionWriter,
} from './types';
export { servingOf } from './cache';

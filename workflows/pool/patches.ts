/**
 * The `patched()` ids of `dllamaPool` (workflows/README.md, "Changing workflow code"), each with
 * the change it guards. An id is recorded as a marker in the histories of the executions that took
 * it: its string never changes, and it is removed only after `deprecatePatch` has run for a release.
 *
 * The old protocol (`pool.ts`, kept for the runs started under it) first, then the entry-lease
 * protocol (`entry-pool.ts`).
 */

/**
 * Instances' own activities go to the task queue of the worker that runs them (a local
 * runtime's processes), and an owner that no longer polls it means the instance is gone.
 * Executions started before this was patched in keep sending them to the shared queue.
 */
export const OWNER_QUEUE_PATCH = 'instance-owner-queue';
/**
 * Failed starts back off: the n-th failure in a row waits base × 2^(n−1), capped, before the
 * next start (without it a model that can never start is retried every few seconds for ever).
 * A spec change (its resource) clears it; executions started before this replay without it.
 */
export const START_BACKOFF_PATCH = 'pool-start-backoff';
/** Executions started before `Dllama` resources existed replay without the status mirror. */
export const RESOURCE_STATUS_PATCH = 'pool-resource-status';
/**
 * The published view says whether the pool can still grow: when it cannot (at max), gateways
 * spread first turns over the published instances themselves, as the pool would, instead of
 * sending each through Temporal. Executions started before this replay without it.
 */
export const PUBLISH_GROWABLE_PATCH = 'pool-publish-growable';
/** A release from a session still waiting takes it off the waiting list (a withdrawn request). */
export const RELEASE_WITHDRAWS_PATCH = 'pool-release-withdraws';
/**
 * Each ready instance is watched by a long-running heartbeating activity (`watchInstance`) that
 * completes when the instance stops serving; the workflow awaits nothing inline and records no
 * periodic probes. Executions started before this keep their probe loop.
 */
export const WATCH_PATCH = 'pool-watch-instances';
/** The pool's state is a search attribute (`MagusPhase`: idle, starting, serving, failing), upserted as it changes. */
export const PHASE_ATTRIBUTE_PATCH = 'pool-phase-search-attribute';
/**
 * Instances carried over continue-as-new are watched like any other (their watcher reports one
 * that died meanwhile), instead of each being described inline before the pool answers anything:
 * that inline check held every signal up while Temporal was slow, and read a slow Temporal as a
 * dead worker, dropping the instance without stopping it or moving its sessions. Executions
 * started before this replay the inline check.
 */
export const CARRIED_WATCH_PATCH = 'pool-carried-watch';
/**
 * A watcher that nobody took from its owner's queue in time proves only that Temporal was slow
 * or the worker is gone: the pool asks (`workerGone`, any worker: the owner's runtime advert in
 * NATS) before dropping the instance, and watches it again when its worker lives. Executions
 * started before this drop it on the timeout alone.
 */
export const OWNER_CONFIRM_PATCH = 'pool-owner-confirm';
/**
 * A change of lease counts alone is published at most every `LEASE_VIEW_MIN_MS` (`pool.ts`; each
 * write is an activity in this history, and one per lease made the pool's history the busiest in
 * the system); instances added or removed, an instance becoming full or not, and `growable` are
 * published at once. Executions started before this publish every change.
 */
export const VIEW_THROTTLE_PATCH = 'pool-view-throttle';
/**
 * Runs continue-as-new after `POOL_RUN_MAX_EVENTS` events (`options.ts`) rather than at the
 * server's suggestion (4,000 by default): a busy pool's run is replayed whole whenever its worker's
 * cache loses it, and a shorter one is replayed faster. Executions started before this run to the suggestion.
 */
export const SHORTER_RUNS_PATCH = 'pool-shorter-runs';
/**
 * A run continues as new only once the lease grants it signalled have been delivered: a signal
 * still in flight when the run closes is dropped by the server, and its session waited for a
 * grant that never came (seen as soon as runs got short). Executions started before this
 * continue with grants in flight.
 */
export const GRANTS_SETTLE_PATCH = 'pool-grants-before-continue';
/**
 * A run due to close starts no scaling and no view write, and once only grants are in flight it
 * grants nothing more: lease requests wait for the next run (grants for instances it holds are
 * carried as `PoolCarry.grants`, the rest as `waiting`), so what is in flight settles and the run
 * closes. Without it a request in every workflow task kept a grant in flight at every look, and
 * a busy pool never closed its run (26,000 events in a soak, tasks timing out). Executions
 * started before this grant at once.
 */
export const QUIESCE_PATCH = 'pool-quiesce-before-continue';
/**
 * The entry-lease protocol (`entry-pool.ts`, DESIGN.md "Control plane"): a conversation's lease
 * is its `magus_sessions` entry, the pool keeps instances only and records no event per
 * conversation. A pool's new execution, or a new run of an old one, takes it; runs started
 * before replay the old protocol. (A pool of the old protocol carried every live lease into its
 * next run: it stopped serving new conversations at 20/s and walls at ~7,000 live ones.)
 */
export const ENTRY_LEASES_PATCH = 'pool-entry-leases';
/**
 * A run of the old protocol that new code picks up closes as soon as what it has in flight
 * settles (the quiesce), and continues as new under the entry-lease protocol on the pools' own
 * task queue, carrying its instances, its waiting sessions and the grants it had not sent.
 */
export const ENTRY_LEASES_SWITCH_PATCH = 'pool-entry-leases-switch';

/**
 * Old-protocol sessions hold their lease on an instance until the pool grants them another;
 * without a record of which instance each held, when one was lost (e.g. with the worker of an
 * upgrade) their conversations' turns went to it until their TTL ran out (found by
 * test/protocol-upgrade.int.test.ts). With this patch those sessions are granted another
 * instance, as the old pool did.
 */
export const LEGACY_REGRANT_PATCH = 'pool-legacy-regrant';
/**
 * Instances are started with the pool's leases per instance (`InstanceRequest.leases`): without
 * it the local runtime sizes a llama.cpp engine's slots from memory (16) whatever a `Dllama`
 * asks for, so a pool of 32 leases put two conversations on each slot, evicting each other's
 * cached prefix.
 */
export const INSTANCE_LEASES_PATCH = 'pool-instance-leases';

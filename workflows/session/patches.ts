/**
 * The `patched()` ids of `session` (workflows/README.md, "Changing workflow code"), each with the
 * change it guards. An id is recorded as a marker in the histories of the executions that took
 * it: its string never changes. Sessions of the entry-lease protocol take none (their input says
 * which protocol they speak: session.ts `entrySession`).
 */

/** A retried acquire forgets the failure of the request before it (issue: serving control loop, finding 1). */
export const RETRY_CLEARS_FAILURE_PATCH = 'session-retry-clears-failure';
/**
 * An acquire whose caller went away (`withdraw`) stops waiting; when none is left waiting the
 * request is withdrawn from the pool (and a lease granted after that is handed back); and every
 * acquire waits at most `acquireTimeoutMs`. Executions started before this replay without it.
 */
export const WITHDRAW_PATCH = 'session-withdraw';
/** The session's kind, model and phase are search attributes (`MagusPhase`: waiting, serving, idle, ended). */
export const SEARCH_ATTRIBUTES_PATCH = 'session-search-attributes';
/**
 * A session whose first turn a gateway served from the published view waits for the pool's
 * confirmation; with this patch it asks again every `reaskMs` (without it a grant lost, or a pool
 * that ended meanwhile, leaves it waiting for ever, its entry never removed), ends once the pool
 * is gone, and ends (handing its place back) once its TTL passes without a turn. Executions
 * started before this replay without it.
 */
export const PREFERRED_REASK_PATCH = 'session-preferred-reask';

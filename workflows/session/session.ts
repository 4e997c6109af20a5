/**
 * `session`: one per conversation. The gateway starts it with update-with-start (`acquire`);
 * the session asks its model's pool for a lease, and the update returns the instance's subject
 * once the lease is granted (a cold start can take minutes). Every turn of the conversation then
 * goes to that instance, so the engine's KV cache is reused. The entry in `magus_sessions` lets
 * warm turns skip Temporal entirely. Touches extend the TTL; on expiry the lease is released and
 * the KV entry removed. Continue-as-new keeps the history short for long conversations.
 */
import {
  ApplicationFailure,
  allHandlersFinished,
  condition,
  continueAsNew,
  currentUpdateInfo,
  getExternalWorkflowHandle,
  patched,
  proxyActivities,
  proxyLocalActivities,
  setCurrentDetails,
  setHandler,
  sleep,
  upsertSearchAttributes,
  workflowInfo,
} from '@temporalio/workflow';
import type { ServingActivities } from '../../activities/serving';
import { ServingErrorType } from '../../shared/errors';
import type { SessionEntry } from '../../shared/serving';
import { leaseGrantedSignal, leaseReleasedSignal, leaseRequestedSignal, poolWorkflowId } from '../pool/definitions';
import { at, visibility } from '../visibility';
import { acquireUpdate, touchSignal, withdrawSignal, type SessionInput, type SessionPhase } from './definitions';
import { PREFERRED_REASK_PATCH, RETRY_CLEARS_FAILURE_PATCH, SEARCH_ATTRIBUTES_PATCH, WITHDRAW_PATCH } from './patches';

/** The lease a session holds, carried over continue-as-new. */
export interface SessionCarry {
  instance: string;
  subject: string;
  expiresAt: number;
}

/** How long an `acquire` waits for the pool's answer unless its input says ({@link WITHDRAW_PATCH}). */
const DEFAULT_ACQUIRE_TIMEOUT_MS = 10 * 60_000;
/** How often a session with a `preferred` instance asks the pool again ({@link PREFERRED_REASK_PATCH}). */
const DEFAULT_REASK_MS = 60_000;

export async function session(input: SessionInput, carry?: SessionCarry): Promise<void> {
  if (input.entry) return entrySession(input, input.entry.expiresAt);
  const { writeSession, deleteSession } = proxyActivities<ServingActivities>({ startToCloseTimeout: '30s', retry: { maximumInterval: '10s' } });
  const sessionId = input.key;
  const pool = getExternalWorkflowHandle(poolWorkflowId(input.namespace, input.model));
  let lease: { instance: string; subject: string } | null = carry ? { instance: carry.instance, subject: carry.subject } : null;
  let failure: string | null = null;
  let requested = lease !== null;
  let expiresAt = carry?.expiresAt ?? Date.now() + input.ttlMs;
  let touched = false;
  /** The instance the `magus_sessions` entry names (null before the first write). */
  let written: string | null = carry?.instance ?? input.preferred?.instance ?? null;
  /** The pool moved the lease (its instance stopped serving): the entry must follow. */
  const moved = () => lease !== null && written !== null && lease.instance !== written;

  // The namespace rides along in the activity's input only (no new command): replay-safe.
  const entry = (): SessionEntry => ({ subject: lease!.subject, pool: input.model, namespace: input.namespace, instance: lease!.instance, expiresAt });

  /** Update ids of the acquires waiting for the pool's answer (with the withdraw patch). */
  const waiters = new Set<string>();
  /** A lease the pool granted after the request was withdrawn: handed back by the main loop. */
  let unwanted: { instance: string; subject: string } | null = null;
  let withdrawPending = false;
  /** The request was withdrawn and nobody asked again since: a grant arriving now is nobody's. */
  let withdrawnState = false;
  const withdrawn = () => withdrawnState && !requested && lease === null;
  let ended = false;
  const searchable = patched(SEARCH_ATTRIBUTES_PATCH);
  if (searchable) upsertSearchAttributes({ MagusKind: ['session'], MagusModel: [`${input.namespace}/${input.model}`] });
  const phase = (): SessionPhase => (ended ? 'ended' : lease ? 'serving' : requested ? 'waiting' : 'idle');
  const shown = visibility({
    phase,
    details: () => {
      const p = phase();
      const where = lease ? ` · instance \`${lease.instance}\`` : requested ? ` · waiting for a lease from \`pool/${input.namespace}/${input.model}\`` : '';
      const lines = [`**${p}** · a conversation on model \`${input.namespace}/${input.model}\`${where}`];
      if (!ended) lines.push(`expires ${at(expiresAt)} unless a turn comes first (TTL ${Math.round(input.ttlMs / 1000)} s)`);
      if (failure && !lease) lines.push(`the pool answered: ${failure}`);
      return lines.join('  \n');
    },
    upsertPhase: searchable,
  });
  setHandler(leaseGrantedSignal, (g) => {
    if ('error' in g) failure = g.error;
    else if (withdrawn()) unwanted = g;
    else {
      lease = g;
      failure = null;
    }
    shown.refresh();
  });
  /** Withdrawals that arrived before their acquire (the two can cross): that acquire fails at once. */
  const early = new Set<string>();
  setHandler(withdrawSignal, ({ updateId }) => {
    if (!waiters.delete(updateId)) {
      early.add(updateId);
      if (early.size > 64) early.delete(early.values().next().value!);
      return;
    }
    if (waiters.size > 0 || lease !== null || !requested) return;
    requested = false; // the next acquire asks again
    withdrawnState = true;
    withdrawPending = true;
    shown.refresh();
  });
  setHandler(touchSignal, () => {
    expiresAt = Date.now() + input.ttlMs;
    touched = true;
    shown.refresh();
  });
  setHandler(
    acquireUpdate,
    async (): Promise<SessionEntry> => {
      const withdrawable = patched(WITHDRAW_PATCH);
      const updateId = currentUpdateInfo()?.id ?? '';
      if (withdrawable && early.delete(updateId)) throw ApplicationFailure.nonRetryable('the request was withdrawn: its caller went away', ServingErrorType.Withdrawn);
      if (withdrawable) waiters.add(updateId);
      // Asked again before the withdrawal reached the pool: nothing to give back after all.
      withdrawPending = false;
      if (unwanted) {
        lease = unwanted;
        unwanted = null;
        requested = true;
        failure = null;
      }
      try {
        if (!lease && !requested) {
          requested = true;
          withdrawnState = false;
          // A new request waits for a new answer: the failure of the last one says nothing of it
          // (before this patch a retry after NoCapacity was refused at once with the old reason).
          if (patched(RETRY_CLEARS_FAILURE_PATCH)) failure = null;
          await pool.signal(leaseRequestedSignal, { sessionId, sessionWorkflowId: workflowInfo().workflowId });
        }
        if (!withdrawable) await condition(() => lease !== null || failure !== null);
        else if (!(await condition(() => lease !== null || failure !== null || !waiters.has(updateId), input.acquireTimeoutMs ?? DEFAULT_ACQUIRE_TIMEOUT_MS))) {
          // Nobody answered in time (e.g. a gateway that died without withdrawing): give up the request.
          if (waiters.size === 1 && lease === null && requested) {
            requested = false;
            withdrawnState = true;
            withdrawPending = true;
          }
          throw ApplicationFailure.nonRetryable(`no instance of ${input.model} was leased within ${Math.round((input.acquireTimeoutMs ?? DEFAULT_ACQUIRE_TIMEOUT_MS) / 1000)}s`, ServingErrorType.NoCapacity);
        } else if (!waiters.has(updateId) && lease === null) {
          throw ApplicationFailure.nonRetryable('the request was withdrawn: its caller went away', ServingErrorType.Withdrawn);
        }
      } finally {
        waiters.delete(updateId);
        shown.refresh();
      }
      if (!lease) {
        requested = false; // the next acquire asks again
        throw ApplicationFailure.nonRetryable(`no instance of ${input.model} can be started: ${failure}`, ServingErrorType.NoCapacity);
      }
      expiresAt = Date.now() + input.ttlMs;
      shown.refresh();
      const e = entry();
      await writeSession({ key: input.key, entry: e });
      written = e.instance;
      return e;
    },
    {
      validator: ({ model }) => {
        if (model !== input.model) throw new Error(`session ${input.key} serves ${input.model}, not ${model}`);
      },
    },
  );

  shown.refresh();
  // A gateway served the first turn already (from `magus_pools`) and wrote the entry: confirm
  // the lease with the pool; rewrite the entry only if the pool chose another instance.
  if (!carry && input.preferred) {
    const preferred = input.preferred;
    requested = true;
    shown.refresh();
    let pooled = true;
    try {
      await pool.signal(leaseRequestedSignal, { sessionId, sessionWorkflowId: workflowInfo().workflowId, preferred: preferred.instance });
    } catch {
      pooled = false; // no pool (it ended): nothing can confirm the lease
    }
    if (pooled && patched(PREFERRED_REASK_PATCH)) {
      const every = Math.max(1000, input.reaskMs ?? DEFAULT_REASK_MS);
      for (;;) {
        const expiresIn = expiresAt - Date.now();
        if (await condition(() => lease !== null || failure !== null, Math.max(1, Math.min(every, expiresIn)))) break;
        if (expiresAt <= Date.now()) {
          // No turn for a whole TTL and still no lease: nobody needs one. Leave the waiting list
          // (a grant already under way is refused by the closed session, and the pool takes it back).
          await pool.signal(leaseReleasedSignal, { sessionId }).catch(() => undefined);
          break;
        }
        try {
          await pool.signal(leaseRequestedSignal, { sessionId, sessionWorkflowId: workflowInfo().workflowId, preferred: preferred.instance });
        } catch {
          break; // the pool has ended: nothing will confirm the lease
        }
      }
    } else if (pooled) await condition(() => lease !== null || failure !== null);
    if (!lease) {
      // The entry points at an instance nobody leased: remove it so the next turn takes the cold
      // path (which starts the pool if needed).
      await condition(allHandlersFinished);
      await deleteSession({ key: input.key });
      ended = true;
      shown.refresh();
      return;
    }
    if (lease.instance !== preferred.instance || lease.subject !== preferred.subject) {
      await writeSession({ key: input.key, entry: entry() });
      written = lease.instance;
    }
  }

  /** Tells the pool that this session wants no lease now (the release also takes it off the waiting list). */
  const giveBack = async (): Promise<void> => {
    if (withdrawPending) {
      withdrawPending = false;
      await pool.signal(leaseReleasedSignal, { sessionId }).catch(() => undefined);
    }
    if (unwanted) {
      unwanted = null;
      await pool.signal(leaseReleasedSignal, { sessionId }).catch(() => undefined);
    }
  };

  // Expiry: a timer that every touch pushes back.
  for (;;) {
    const remaining = expiresAt - Date.now();
    if (remaining <= 0) break;
    await condition(() => touched || moved() || withdrawPending || unwanted !== null, remaining);
    await giveBack();
    if ((touched || moved()) && lease) {
      touched = false;
      // The gateway's cache sees the new expiry, or the instance the pool moved the lease to.
      const e = entry();
      await writeSession({ key: input.key, entry: e });
      written = e.instance;
    }
    touched = false;
    shown.refresh();
    if (workflowInfo().continueAsNewSuggested) {
      await condition(allHandlersFinished);
      if (lease) await continueAsNew<typeof session>(input, { ...lease, expiresAt });
    }
  }
  await condition(allHandlersFinished);
  await deleteSession({ key: input.key });
  if (lease) await pool.signal(leaseReleasedSignal, { sessionId }).catch(() => undefined);
  ended = true;
  shown.refresh();
}

/**
 * A session of the entry-lease protocol ({@link SessionInput.entry}): one per conversation, so the
 * Temporal UI lists every conversation (its kind, model and phase come as search attributes in
 * the gateway's start request: no upsert), and no work per turn. It sleeps until the entry's
 * expiry and looks (a local activity): renewed, it sleeps again; expired, it is deleted with
 * compare-and-swap (a renewal landing first wins) and the session ends; gone (moved away or
 * removed by someone else), it ends. A conversation that lives one TTL costs 12 history events,
 * each further TTL 6 (`test/session-entry.int.test.ts` counts them).
 *
 * Which protocol a session speaks is in its input, decided by the gateway that starts it: an
 * execution's input never changes, so each replays its own protocol (a `patched` marker would
 * cost every conversation one more event).
 */
async function entrySession(input: SessionInput, firstExpiry: number): Promise<void> {
  const { expireSession } = proxyLocalActivities<ServingActivities>({ startToCloseTimeout: '30s', retry: { initialInterval: '1s', maximumInterval: '10s' } });
  const model = `${input.namespace}/${input.model}`;
  let expiresAt = firstExpiry;
  const show = (what: string) => setCurrentDetails(`**${what}** · a conversation on model \`${model}\`  \n${what === 'ended' ? '' : `looks at its lease at ${at(expiresAt)} (TTL ${Math.round(input.ttlMs / 1000)} s after the last renewal)`}`);
  show('serving');
  for (;;) {
    const wait = expiresAt - Date.now();
    if (wait > 0) await sleep(wait);
    const r = await expireSession({ key: input.key });
    if ('ended' in r) break;
    expiresAt = r.expiresAt;
    show('serving');
    // A conversation alive for thousands of TTLs: a new run (6 events per TTL).
    if (workflowInfo().continueAsNewSuggested) await continueAsNew<typeof session>({ ...input, entry: { expiresAt } });
  }
  upsertSearchAttributes({ MagusPhase: ['ended'] });
  show('ended');
}

/** Messages of the `session` workflow (id `session/<namespace>/<model>/<conversation HMAC>`), one per conversation. */
import { SearchAttribute, WorkflowSummary } from '../../shared/constants';
import { conversationOf } from '../../shared/serving';

export interface SessionInput {
  /** The conversation key (HMAC from the gateway, or the client's X-Session-Id). */
  key: string;
  namespace: string;
  model: string;
  /** The entry's lifetime after its last renewal (shown in the UI; gateways renew with it). */
  ttlMs: number;
  /**
   * The conversation's `magus_sessions` entry as the gateway wrote it before starting the session
   * (its lease: ARCHITECTURE.md, "Data plane", "The entry-lease protocol"): the session first looks
   * at it at `expiresAt` (or the expiry carried over continue-as-new).
   */
  entry: { expiresAt: number };
}

/**
 * A session's workflow id names its model, so the Temporal UI's list says which model each
 * conversation is on; then the key's conversation token (its last: a key carries its pool,
 * `<namespace>.<model>.<HMAC>`), an HMAC, which reveals nothing of the conversation.
 */
export const sessionWorkflowId = (namespace: string, model: string, key: string): string => `session/${namespace}/${model}/${conversationOf(key)}`;

/**
 * How a gateway starts a conversation's session, once its entry is written (`expiresAt`, at `now`).
 * Delayed until the entry's expiry (`startDelay`): the session's first task is its first look at
 * the lease, with no task and timer before it — a conversation of one TTL costs Temporal one
 * workflow task and 6 history events, not two and 12, which is what bounds new conversations a
 * second. Listed at once all the same, with its kind, model and phase (search attributes) and what
 * it is (its static summary and details).
 */
export function sessionStart(o: { taskQueue: string; namespace: string; model: string; key: string; ttlMs: number; expiresAt: number; now: number }) {
  const input: SessionInput = { key: o.key, namespace: o.namespace, model: o.model, ttlMs: o.ttlMs, entry: { expiresAt: o.expiresAt } };
  return {
    workflowId: sessionWorkflowId(o.namespace, o.model, o.key),
    taskQueue: o.taskQueue,
    args: [input] as [SessionInput],
    // A session still running (the conversation's entry revived before it ended) keeps watching the entry.
    workflowIdConflictPolicy: 'USE_EXISTING' as const,
    searchAttributes: { [SearchAttribute.kind]: ['session'], [SearchAttribute.model]: [`${o.namespace}/${o.model}`], [SearchAttribute.phase]: ['serving'] },
    staticSummary: WorkflowSummary.session(o.namespace, o.model),
    staticDetails: `Its first look at its lease comes when the lease ends unless renewed, ${Math.round(o.ttlMs / 1000)} s after the conversation's last turn; it sleeps until then.`,
    startDelay: Math.max(0, o.expiresAt - o.now),
  };
}

/** A session as the `MagusPhase` search attribute shows it: set to `serving` by the gateway's start, `ended` by the session. */
export type SessionPhase = 'serving' | 'ended';

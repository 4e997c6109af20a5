/** Messages of the `session` workflow (id `session/<namespace>/<model>/<conversation key>`), one per conversation. */

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
 * conversation is on; the key is an HMAC, which reveals nothing of the conversation.
 */
export const sessionWorkflowId = (namespace: string, model: string, key: string): string => `session/${namespace}/${model}/${key}`;

/** A session as the `MagusPhase` search attribute shows it: set to `serving` by the gateway's start, `ended` by the session. */
export type SessionPhase = 'serving' | 'ended';

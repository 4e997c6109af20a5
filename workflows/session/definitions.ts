/** Messages of the `session` workflow (id `session/<namespace>/<model>/<conversation key>`), one per conversation. */
import { defineSignal, defineUpdate } from '@temporalio/workflow';
import type { SessionEntry } from '../../shared/serving';

export interface SessionInput {
  /** The conversation key (HMAC from the gateway, or the client's X-Session-Id). */
  key: string;
  namespace: string;
  model: string;
  /** The session ends this long after its last touch. */
  ttlMs: number;
  /** How long an `acquire` waits for the pool's answer before it is refused (default 10 min). */
  acquireTimeoutMs?: number;
  /**
   * The instance a gateway already sent the first turn to (from `magus_pools`; it wrote the
   * session entry too): the session asks the pool for a lease on it at once, and rewrites the
   * entry only if the pool grants another.
   */
  preferred?: { instance: string; subject: string };
  /**
   * With `preferred`: how often the session asks the pool again while its lease is not confirmed
   * (default 60 s; at least 1 s). The pool answers a repeated request once: it keeps one place per session.
   */
  reaskMs?: number;
  /**
   * Present: a session of the entry-lease protocol (DESIGN.md, "Control plane"). Its lease is the
   * conversation's `magus_sessions` entry, which the gateway created before starting it and renews
   * and moves itself; the session only sleeps until the entry's expiry (`expiresAt` when it was
   * started, or carried over continue-as-new), looks at the entry, and deletes it once expired.
   * It never signals the pool and takes no signal or update. Absent: the old protocol (acquire,
   * touch, the pool's grants), kept for executions started by older gateways.
   */
  entry?: { expiresAt: number };
}

/**
 * The gateway's update-with-start: resolves with the instance serving this conversation once
 * the pool has granted a lease (a cold start can take minutes). Validated: the model must match.
 */
export const acquireUpdate = defineUpdate<SessionEntry, [{ model: string }]>('acquire');
/**
 * From the gateway: the caller of the `acquire` update with this update id has gone (its client
 * left, or the gateway gave up waiting). When no acquire is left waiting and no lease was granted
 * yet, the session withdraws its request from the pool, so an abandoned cold start is no demand.
 */
export const withdrawSignal = defineSignal<[{ updateId: string }]>('withdraw');
/** Extends the TTL (the gateway debounces it: at most one per conversation every few seconds). */
export const touchSignal = defineSignal('touch');

/**
 * A session's workflow id names its model, so the Temporal UI's list says which model each
 * conversation is on; the key is an HMAC, which reveals nothing of the conversation.
 */
export const sessionWorkflowId = (namespace: string, model: string, key: string): string => `session/${namespace}/${model}/${key}`;
/** The id sessions had before they named their model: those still running keep it until they expire. */
export const legacySessionWorkflowId = (key: string): string => `session/${key}`;

/** A session as the `MagusPhase` search attribute shows it. */
export type SessionPhase = 'waiting' | 'serving' | 'idle' | 'ended';

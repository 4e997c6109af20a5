/**
 * The gateway's Temporal side — touched only on a conversation's first turn (or after its
 * session expired) and, debounced, to extend a session's TTL; warm turns never call it.
 * First turn on a warm pool (plugins/sessions.ts picked an instance from `magus_pools` and created
 * the session entry): start the session workflow with that instance as its preferred lease, after
 * the answer is on its way. Cold path: make sure the model's pool exists (signal-with-start), then
 * update-with-start the conversation's session, whose `acquire` update returns the instance once
 * the pool has leased one (the caller's signal aborts the wait, e.g. when the client goes away).
 */
import { WithStartWorkflowOperation, WorkflowNotFoundError, WorkflowUpdateFailedError, type Client } from '@temporalio/client';
import { randomUUID } from 'node:crypto';
import { ApplicationFailure } from '@temporalio/common';
import { WorkflowSummary } from '../shared/constants';
import type { SessionEntry } from '../shared/serving';
import { ensurePoolSignal, poolWorkflowId, type PoolInput } from '../workflows/pool/definitions';
import type { dllamaPool } from '../workflows/pool/pool';
import { acquireUpdate, legacySessionWorkflowId, sessionWorkflowId, touchSignal, withdrawSignal } from '../workflows/session/definitions';
import type { session } from '../workflows/session/session';
import type { AcquireRequest, ColdStart, FirstTurns, RenewSession } from './plugins/sessions';
import { isTemporalUnreachable, TEMPORAL_CALL_DEADLINE_MS } from '../workers/temporal-health';

export interface TemporalSessionOptions {
  client: Client;
  /** The control task queue the workers poll. */
  taskQueue: string;
  /** Sizes of pools started for a model (a `Dllama` resource overrides them later). */
  pool: Omit<PoolInput, 'namespace' | 'model'>;
  /** Session TTL after the last turn. */
  sessionTtlMs: number;
}

/** The error types the gateway maps to HTTP statuses (plugins/errors.ts). */
class BrokerError extends Error {
  constructor(
    readonly type: 'NoCapacity' | 'BacklogFull' | 'Unavailable',
    message: string,
    /** Unset: the gateway's configured Retry-After applies. */
    readonly retryAfterSec?: number,
  ) {
    super(message);
  }
}

/** `err` as the gateway's 503 `unavailable` when it says Temporal could not be reached (the original as `cause`, for the log). */
function unreachable(err: unknown): BrokerError | undefined {
  if (!isTemporalUnreachable(err)) return undefined;
  const e = new BrokerError('Unavailable', 'Temporal is unreachable');
  e.cause = err;
  return e;
}

export function temporalSessions(opts: TemporalSessionOptions): { coldStart: ColdStart; renew: RenewSession; firstTurns: Pick<FirstTurns, 'ttlMs' | 'adopt'> } {
  const { client, taskQueue } = opts;
  // Every call runs under the request's signal (the client left, or the gateway gave up
  // waiting): the RPC, the update's long poll included, is cancelled at once.
  const coldStart = async (req: AcquireRequest): Promise<SessionEntry> => {
    const { namespace, name } = req.model;
    // A short call under a deadline: Temporal unreachable is a prompt 503, not the client's ~20 s of retries.
    await client
      .withAbortSignal(req.signal, () =>
        client.withDeadline(Date.now() + TEMPORAL_CALL_DEADLINE_MS, () =>
          client.workflow.signalWithStart<typeof dllamaPool, []>('dllamaPool', {
            workflowId: poolWorkflowId(namespace, name),
            taskQueue,
            args: [{ namespace, model: name, ...opts.pool }],
            signal: ensurePoolSignal,
            signalArgs: [],
            staticSummary: WorkflowSummary.pool(namespace, name),
          }),
        ),
      )
      .catch((err: unknown) => {
        throw unreachable(err) ?? err;
      });
    const workflowId = sessionWorkflowId(namespace, name, req.conversationKey);
    const start = new WithStartWorkflowOperation<typeof session>('session', {
      workflowId,
      taskQueue,
      args: [{ key: req.conversationKey, namespace, model: name, ttlMs: opts.sessionTtlMs }],
      workflowIdConflictPolicy: 'USE_EXISTING',
      staticSummary: WorkflowSummary.session(namespace, name),
    });
    const updateId = randomUUID();
    try {
      return await client.withAbortSignal(req.signal, () => client.workflow.executeUpdateWithStart(acquireUpdate, { args: [{ model: name }], updateId, startWorkflowOperation: start }));
    } catch (err) {
      if (req.signal.aborted) {
        // Nobody waits for this acquire any more: the session stops waiting for it and, when it
        // was the last, withdraws its request from the pool (no phantom demand).
        void client.workflow
          .getHandle(workflowId)
          .signal(withdrawSignal, { updateId })
          .catch(() => undefined);
      }
      const cause = err instanceof WorkflowUpdateFailedError ? err.cause : undefined;
      if (cause instanceof ApplicationFailure && cause.type === 'NoCapacity') throw new BrokerError('NoCapacity', cause.message);
      throw (!req.signal.aborted && unreachable(err)) || err;
    }
  };
  const renew: RenewSession = async (req) => {
    try {
      await client.workflow.getHandle(sessionWorkflowId(req.model.namespace, req.model.name, req.conversationKey)).signal(touchSignal);
    } catch (err) {
      // A conversation whose session started before ids named their model: it keeps the old id until it expires.
      if (!(err instanceof WorkflowNotFoundError)) throw err;
      await client.workflow.getHandle(legacySessionWorkflowId(req.conversationKey)).signal(touchSignal);
    }
  };
  const adopt: FirstTurns['adopt'] = async (req, entry) => {
    const { namespace, name } = req.model;
    await client.workflow.start<typeof session>('session', {
      workflowId: sessionWorkflowId(namespace, name, req.conversationKey),
      taskQueue,
      args: [{ key: req.conversationKey, namespace, model: name, ttlMs: opts.sessionTtlMs, preferred: { instance: entry.instance, subject: entry.subject } }],
      workflowIdConflictPolicy: 'USE_EXISTING',
      staticSummary: WorkflowSummary.session(namespace, name),
    });
  };
  return { coldStart, renew, firstTurns: { ttlMs: opts.sessionTtlMs, adopt } };
}


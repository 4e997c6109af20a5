/**
 * The gateway's Temporal side — never on a warm turn, and never on the client's path of a first
 * turn that finds room (ARCHITECTURE.md, "Data plane", "The entry-lease protocol";
 * serving/sessions/): after a first turn created its conversation's `magus_sessions` entry,
 * `adopt` starts the conversation's session workflow (its search attributes and summary in the
 * start request); a first turn that finds no instance with room has `demand` tell the model's pool
 * (signal-with-start, which starts the pool too).
 */
import type { Client } from '@temporalio/client';
import { randomUUID } from 'node:crypto';
import { setMaxListeners } from 'node:events';
import { poolQueueFor, WorkflowSummary } from '../shared/constants';
import type { ReadyModel } from '../shared/model';
import { demandSignal, poolWorkflowId, type PoolInput } from '../workflows/pool/definitions';
import type { dllamaPool } from '../workflows/pool/pool';
import { sessionStart } from '../workflows/session/definitions';
import type { session } from '../workflows/session/session';
import { SessionError, SessionErrorType } from './plugins/errors';
import type { FirstTurns } from './serving/sessions';
import { isTemporalUnreachable, TEMPORAL_CALL_DEADLINE_MS } from '../platform/temporal-health';

export interface TemporalSessionOptions {
  client: Client;
  /** The control task queue the workers poll. */
  taskQueue: string;
  /**
   * Sizes of pools started for a model (a `Dllama` resource overrides them later); leases per
   * instance may depend on the model (its engines' slots: shared/engine-slots.ts `leasesPerInstance`).
   */
  pool: Omit<PoolInput, 'namespace' | 'model' | 'leasesPerInstance'> & { leasesPerInstance: number | ((model: ReadyModel) => number) };
  /** Session TTL after the last turn. */
  sessionTtlMs: number;
  /** This gateway replica's id: its demand is counted apart from other replicas' (default: one of its own). */
  replica?: string;
}

/**
 * `call` under a signal of its own that `parent` aborts, its listener on `parent` removed when the
 * call ends. Not under `parent` itself when that lives long: the client adds an abort listener to
 * the signal of every call and never removes it, so one process-long signal kept every session
 * start ever made, and its whole gRPC call, alive (11,570 of them, most of dev's heap, four minutes
 * into a 45/s hold; the garbage collector's pauses grew with them).
 */
export async function underOwnSignal<T>(client: Pick<Client, 'withAbortSignal'>, parent: AbortSignal, call: () => Promise<T>): Promise<T> {
  const own = new AbortController();
  const stop = () => own.abort(parent.reason);
  if (parent.aborted) stop();
  else parent.addEventListener('abort', stop, { once: true });
  try {
    return await client.withAbortSignal(own.signal, call);
  } finally {
    parent.removeEventListener('abort', stop);
  }
}

/** `err` as the gateway's 503 `unavailable` when it says Temporal could not be reached (the original as `cause`, for the log). */
function unreachable(err: unknown): SessionError | undefined {
  if (!isTemporalUnreachable(err)) return undefined;
  const e = new SessionError(SessionErrorType.Unavailable, 'Temporal is unreachable');
  e.cause = err;
  return e;
}

export function temporalSessions(opts: TemporalSessionOptions): { firstTurns: Pick<FirstTurns, 'ttlMs' | 'adopt' | 'demand'>; close: () => Promise<void> } {
  const { client, taskQueue } = opts;
  /**
   * Every call in flight, so that `close` can end them before the connection closes: a call whose
   * retry timer fired on a closed channel threw "Channel has been shut down" out of a timer,
   * uncaught, and a gateway stopped under load crashed instead of exiting.
   */
  const stopping = new AbortController();
  // One listener per call in flight, removed when it ends (unlessStopping).
  setMaxListeners(0, stopping.signal);
  const inflight = new Set<Promise<unknown>>();
  const tracked =
    <A extends unknown[], T>(call: (...args: A) => Promise<T>) =>
    (...args: A): Promise<T> => {
      if (stopping.signal.aborted) return Promise.reject(new SessionError(SessionErrorType.Unavailable, 'the gateway is stopping'));
      const p = call(...args);
      inflight.add(p);
      const forget = () => void inflight.delete(p);
      p.then(forget, forget);
      return p;
    };
  const unlessStopping = <T>(call: () => Promise<T>): Promise<T> => underOwnSignal(client, stopping.signal, call);
  /** Pools run on a task queue of their own (constants.ts `poolQueueFor`). */
  const poolQueue = poolQueueFor(taskQueue);
  const replica = opts.replica ?? `gateway-${randomUUID().slice(0, 8)}`;
  /** The input of `model`'s pool, should this call start it. */
  const poolInput = (model: ReadyModel): PoolInput => {
    const { leasesPerInstance, ...sizes } = opts.pool;
    return {
      namespace: model.namespace,
      model: model.name,
      ...sizes,
      leasesPerInstance: typeof leasesPerInstance === 'function' ? leasesPerInstance(model) : leasesPerInstance,
    };
  };
  const adopt: FirstTurns['adopt'] = tracked(async (req, entry) => {
    const { namespace, name } = req.model;
    await unlessStopping(() =>
      client.workflow.start<typeof session>(
        'session',
        sessionStart({ taskQueue, namespace, model: name, key: req.conversationKey, ttlMs: opts.sessionTtlMs, expiresAt: entry.expiresAt, now: Date.now() }),
      ),
    );
  });
  const demand: NonNullable<FirstTurns['demand']> = tracked(async (model, waiting) => {
    const { namespace, name } = model;
    const told = unlessStopping(() =>
      client.withDeadline(Date.now() + TEMPORAL_CALL_DEADLINE_MS, () =>
        client.workflow.signalWithStart<typeof dllamaPool, [{ replica: string; waiting: number }]>('dllamaPool', {
          workflowId: poolWorkflowId(namespace, name),
          taskQueue: poolQueue,
          args: [poolInput(model)],
          signal: demandSignal,
          signalArgs: [{ replica, waiting }],
          staticSummary: WorkflowSummary.pool(namespace, name),
        }),
      ),
    );
    await told.catch((err: unknown) => {
      throw unreachable(err) ?? err;
    });
  });
  /** Ends the calls in flight (waiting at most 5 s for them): call before closing the client's connection. */
  const close = async (): Promise<void> => {
    stopping.abort(new Error('the gateway is stopping'));
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([Promise.allSettled([...inflight]), new Promise((r) => (timer = setTimeout(r, 5000)))]);
    clearTimeout(timer);
  };
  return { firstTurns: { ttlMs: opts.sessionTtlMs, adopt, demand }, close };
}

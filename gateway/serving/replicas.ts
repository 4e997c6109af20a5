/**
 * Whether another gateway replica runs: each replica holds a subscription on
 * `<scope>.magus.gw.<replica>` for as long as it is connected, and a replica that wants to know
 * asks there. NATS answers "no responders" at once when no connection in the cluster has that
 * subscription — a replica SIGKILLed is gone from the servers' interest as soon as its socket
 * closes — while a live replica does not answer, so the question then times out.
 *
 * Only "gone" is certain. A replica that is reconnecting (its NATS server died) is briefly without
 * its subscription too: whatever is decided on "gone" must stay safe when the replica is in fact
 * alive (routes/resume.ts claims a move in the move log, which one claimant wins).
 */
import { Empty, ErrorCode, type NatsConnection } from 'nats';
import { Nats } from '../../shared/constants';
import { scopeSubject } from '../../dataplane/names';

/** How long a question about a replica waits before it takes the silence as "not known gone". */
export const REPLICA_ASK_MS = 250;

/** The subject replica `replica` listens on while it runs. */
export const replicaSubjectOf = (scope: string | undefined, replica: string): string => scopeSubject(scope, `${Nats.gatewayReplicaSubjectPrefix}.${replica}`);

/** Holds this replica's subscription (nats.js puts it back after each reconnect); the returned function drops it. */
export async function listenAsReplica(nc: NatsConnection, scope: string | undefined, replica: string): Promise<() => void> {
  const sub = nc.subscribe(replicaSubjectOf(scope, replica), { callback: () => {} });
  await nc.flush();
  return () => sub.unsubscribe();
}

/** Whether replica `replica` is known gone: true only on NATS's "no responders"; false when it may run (or NATS did not say). */
export async function replicaGone(nc: NatsConnection, scope: string | undefined, replica: string, timeoutMs = REPLICA_ASK_MS): Promise<boolean> {
  try {
    await nc.request(replicaSubjectOf(scope, replica), Empty, { timeout: timeoutMs });
    return false;
  } catch (err) {
    return (err as { code?: string } | null)?.code === ErrorCode.NoResponders;
  }
}

/**
 * Leader election on a `coordination.k8s.io/v1` Lease, so that of several controller replicas
 * exactly one reconciles. A candidate takes the Lease when it is free or its holder stopped
 * renewing it for `leaseDurationSeconds`; the holder renews it every `renewEveryMs`. Writes use
 * the Lease's resourceVersion (optimistic concurrency), so two candidates never both win. A
 * leader that cannot renew in time steps down (`onStoppedLeading`) before anyone else may take
 * over: it stops at `leaseDuration − renewEvery` at the latest.
 */
import { CoordinationV1Api, type KubeConfig, type V1Lease } from '@kubernetes/client-node';

export interface LeaderElectionOptions {
  kc: KubeConfig;
  namespace: string;
  name: string;
  identity: string;
  leaseDurationSeconds?: number;
  renewEveryMs?: number;
  onStartedLeading: () => void;
  onStoppedLeading: () => void;
  log?: (line: string) => void;
}

export interface LeaderElection {
  isLeader(): boolean;
  stop(): Promise<void>;
}

const code = (err: unknown): number | undefined => (err as { code?: number }).code;

export function startLeaderElection(opts: LeaderElectionOptions): LeaderElection {
  const api = opts.kc.makeApiClient(CoordinationV1Api);
  const duration = opts.leaseDurationSeconds ?? 15;
  const renewEvery = opts.renewEveryMs ?? 5000;
  let leader = false;
  let lastRenew = 0;
  let stopped = false;
  let timer: NodeJS.Timeout | undefined;
  let running: Promise<void> = Promise.resolve();

  // client-node 1.3 passes MicroTime fields through as they are (its serializer does not know the
  // type), and the API server wants RFC 3339 with microseconds: send that string.
  const micro = (d: Date) => d.toISOString().replace(/\.(\d{3})Z$/, '.$1000Z') as unknown as Date;
  const spec = (now: Date, transitions: number, acquired?: Date) => ({
    holderIdentity: opts.identity,
    leaseDurationSeconds: duration,
    acquireTime: micro(acquired ?? now),
    renewTime: micro(now),
    leaseTransitions: transitions,
  });

  async function attempt(): Promise<boolean> {
    const now = new Date();
    let lease: V1Lease;
    try {
      lease = await api.readNamespacedLease({ namespace: opts.namespace, name: opts.name });
    } catch (err) {
      if (code(err) !== 404) throw err;
      try {
        await api.createNamespacedLease({ namespace: opts.namespace, body: { metadata: { name: opts.name, namespace: opts.namespace }, spec: spec(now, 0) } });
        return true;
      } catch (e) {
        if (code(e) === 409) return false;
        throw e;
      }
    }
    const s = lease.spec ?? {};
    const renewed = s.renewTime ? new Date(s.renewTime).getTime() : 0;
    const mine = s.holderIdentity === opts.identity;
    const expired = !s.holderIdentity || Date.now() - renewed > (s.leaseDurationSeconds ?? duration) * 1000;
    if (!mine && !expired) return false;
    const acquired = mine && s.acquireTime ? new Date(s.acquireTime) : undefined;
    try {
      await api.replaceNamespacedLease({
        namespace: opts.namespace,
        name: opts.name,
        body: { ...lease, spec: spec(now, (s.leaseTransitions ?? 0) + (mine ? 0 : 1), acquired) },
      });
      return true;
    } catch (err) {
      if (code(err) === 409) return false; // someone else wrote it first
      throw err;
    }
  }

  async function tick(): Promise<void> {
    // true: holds the lease; false: someone else does; undefined: the API could not be asked.
    let won: boolean | undefined;
    try {
      won = await attempt();
    } catch (err) {
      opts.log?.(`leader election: ${(err as Error).message}`);
    }
    if (stopped) return;
    if (won) {
      lastRenew = Date.now();
      if (!leader) {
        leader = true;
        opts.log?.(`leader election: ${opts.identity} leads (${opts.namespace}/${opts.name})`);
        opts.onStartedLeading();
      }
    } else if (leader && (won === false || Date.now() - lastRenew > duration * 1000 - renewEvery)) {
      leader = false;
      opts.log?.(`leader election: ${opts.identity} lost the lease`);
      opts.onStoppedLeading();
    }
    timer = setTimeout(
      () => {
        running = tick();
      },
      leader ? renewEvery : Math.max(1000, renewEvery / 2),
    );
  }

  running = tick();
  return {
    isLeader: () => leader,
    async stop() {
      stopped = true;
      if (timer) clearTimeout(timer);
      await running;
      if (leader) {
        leader = false;
        // Hand over at once: a released lease (no holder) can be taken without waiting it out.
        try {
          const lease = await api.readNamespacedLease({ namespace: opts.namespace, name: opts.name });
          if (lease.spec?.holderIdentity === opts.identity)
            await api.replaceNamespacedLease({
              namespace: opts.namespace,
              name: opts.name,
              body: { ...lease, spec: { ...lease.spec, holderIdentity: undefined } },
            });
        } catch {
          // it expires by itself
        }
      }
    },
  };
}

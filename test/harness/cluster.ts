/**
 * A private Kubernetes cluster for one test file: its own etcd + kube-apiserver (not the global
 * test servers), kube-controller-manager, kube-scheduler and kwok with fake Nodes
 * (workers/dev/cluster.ts). Deployments, StatefulSets and Jobs get Pods that are scheduled and
 * become Ready with IPs; nothing runs in them. Call it in `beforeAll` (allow ~1 min on a busy
 * 2-core machine) and `stop()` in `afterAll`:
 *
 *     let cluster: TestCluster;
 *     beforeAll(async () => { cluster = await startTestCluster(); }, 180_000);
 *     afterAll(() => cluster?.stop(), 60_000);
 */
import { CoreV1Api, KubeConfig } from '@kubernetes/client-node';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { startClusterComponents, type ClusterComponent, type ClusterOptions } from '../../workers/dev/cluster';
import { startServices } from '../../workers/dev/services';
import { until } from './wait';

export interface TestCluster {
  /** Admin access (bearer token; the self-signed certificate is not verified). */
  kubeConfig: KubeConfig;
  server: string;
  token: string;
  nodeNames: string[];
  /** Every server process of this cluster: etcd, kube-apiserver and the three components. */
  pids: number[];
  /** The components by name, with their pids. */
  processes: { name: string; pid: number }[];
  /** Milliseconds until each part was ready. */
  startMs: Record<ClusterComponent | 'etcd + kube-apiserver', number>;
  /** Creates a namespace and waits (bounded) for its `default` ServiceAccount, without which a Pod is refused. */
  createNamespace(name: string): Promise<void>;
  /** Stops the components, then kube-apiserver and etcd, and removes the data folder. */
  stop(): Promise<void>;
}

/** The process's command name (etcd, kube-apiserver), from /proc. */
function commandName(pid: number): string {
  try {
    return readFileSync(`/proc/${pid}/comm`, 'utf8').trim();
  } catch {
    return `pid ${pid}`;
  }
}

/** Alive and not a zombie (one that has exited and waits to be reaped). */
function isRunning(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2, stat.lastIndexOf(')') + 3) !== 'Z';
  } catch {
    return false;
  }
}

export async function startTestCluster(opts: Pick<ClusterOptions, 'nodes' | 'nodeResources' | 'readyTimeoutSec'> = {}): Promise<TestCluster> {
  const begun = Date.now();
  const services = await startServices({ services: ['kubernetes'], readyTimeoutSec: opts.readyTimeoutSec ?? 180 });
  const apiMs = Date.now() - begun;
  const kubernetes = services.endpoints.kubernetes;
  if (!kubernetes) {
    await services.stop();
    throw new Error('startServices did not start kubernetes');
  }
  const apiPids = services.pids;
  let components: Awaited<ReturnType<typeof startClusterComponents>>;
  try {
    components = await startClusterComponents({
      server: kubernetes.server,
      token: kubernetes.token,
      dataDir: join(services.dataDir, 'cluster'),
      logDir: join(services.dataDir, 'logs'),
      readyTimeoutSec: opts.readyTimeoutSec ?? 180,
      ...opts,
    });
  } catch (err) {
    await services.stop();
    throw err;
  }

  const kubeConfig = new KubeConfig();
  kubeConfig.loadFromOptions({
    clusters: [{ name: 'magus-test-cluster', server: kubernetes.server, skipTLSVerify: true }],
    users: [{ name: 'magus-admin', token: kubernetes.token }],
    contexts: [{ name: 'magus-test-cluster', cluster: 'magus-test-cluster', user: 'magus-admin' }],
    currentContext: 'magus-test-cluster',
  });
  const core = kubeConfig.makeApiClient(CoreV1Api);
  let stopped = false;
  return {
    kubeConfig,
    server: kubernetes.server,
    token: kubernetes.token,
    nodeNames: components.nodeNames,
    get pids() {
      return [...apiPids, ...components.pids];
    },
    processes: [...apiPids.map((pid) => ({ name: commandName(pid), pid })), ...components.processes],
    startMs: { 'etcd + kube-apiserver': apiMs, ...components.startMs },
    async createNamespace(name: string) {
      await core.createNamespace({ body: { metadata: { name } } });
      await until(
        `the ServiceAccount ${name}/default`,
        async () => {
          try {
            await core.readNamespacedServiceAccount({ name: 'default', namespace: name });
            return true;
          } catch {
            return false;
          }
        },
        30_000,
      );
    },
    async stop() {
      if (stopped) return;
      stopped = true;
      try {
        await components.stop();
        // kube-apiserver before etcd: signalled together (as services.stop does), the API server
        // may lose etcd first and then take more than 10 s to exit (measured); alone it takes ~50 ms.
        const api = apiPids.find((pid) => commandName(pid) === 'kube-apiserver');
        if (api !== undefined) {
          process.kill(api, 'SIGTERM');
          await until('kube-apiserver to exit', () => !isRunning(api), 10_000).catch(() => undefined);
        }
      } finally {
        await services.stop();
      }
    },
  };
}

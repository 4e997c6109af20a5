/**
 * A private control plane (etcd + kube-apiserver + kube-controller-manager + kube-scheduler +
 * kwok with 2 fake Nodes, see workers/dev/cluster.ts) runs workloads end to end: Pods are
 * scheduled onto the fake Nodes and become Ready with IPs, EndpointSlices fill, owner references
 * cascade, and what fits no Node stays Pending. The global test servers are not used.
 */
import { readFileSync } from 'node:fs';
import { AppsV1Api, BatchV1Api, CoreV1Api, DiscoveryV1Api, type V1Pod } from '@kubernetes/client-node';
import { startTestCluster, type TestCluster } from '../harness/cluster';
import { eventually, processRunning, until } from '../harness/wait';

function rssMiB(pid: number): number {
  const kb = /VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))?.[1];
  return Math.round(Number(kb ?? 0) / 1024);
}

const ns = 'workloads';
/** Never pulled: nothing runs in a kwok Pod. */
const image = 'registry.invalid/magus/stub:1';
const small = { requests: { cpu: '100m', memory: '128Mi' } };

let cluster: TestCluster;
let core: CoreV1Api;
let apps: AppsV1Api;
let batch: BatchV1Api;
let discovery: DiscoveryV1Api;

beforeAll(async () => {
  cluster = await startTestCluster();
  core = cluster.kubeConfig.makeApiClient(CoreV1Api);
  apps = cluster.kubeConfig.makeApiClient(AppsV1Api);
  batch = cluster.kubeConfig.makeApiClient(BatchV1Api);
  discovery = cluster.kubeConfig.makeApiClient(DiscoveryV1Api);
  await cluster.createNamespace(ns);
}, 300_000);

afterAll(async () => {
  await cluster?.stop();
}, 60_000);

const isReady = (p: V1Pod) => p.status?.conditions?.some((c) => c.type === 'Ready' && c.status === 'True') ?? false;

async function pods(selector: string): Promise<V1Pod[]> {
  return (await core.listNamespacedPod({ namespace: ns, labelSelector: selector })).items;
}

/** Every Pod is on a fake Node, Running, Ready, with a pod IP. */
function expectRunningOnFakeNodes(list: V1Pod[]): void {
  for (const p of list) {
    expect(cluster.nodeNames).toContain(p.spec?.nodeName);
    expect(p.status?.phase).toBe('Running');
    expect(isReady(p)).toBe(true);
    expect(p.status?.podIP).toMatch(/^\d+\.\d+\.\d+\.\d+$/);
  }
}

test('the fake Nodes are Ready and have the allocatable capacity they were given', async () => {
  const nodes = (await core.listNode({})).items;
  expect(nodes.map((n) => n.metadata?.name).sort()).toEqual([...cluster.nodeNames].sort());
  for (const n of nodes) {
    expect(n.metadata?.annotations?.['kwok.x-k8s.io/node']).toBe('fake');
    expect(n.status?.allocatable).toMatchObject({ cpu: '8', memory: '32Gi', pods: '110' });
    expect(n.status?.conditions?.find((c) => c.type === 'Ready')?.status).toBe('True');
  }
});

test('a Deployment of 2 gets 2 Pods scheduled onto the fake Nodes, Running and Ready with IPs; a headless Service gets 2 ready endpoints', async () => {
  const labels = { app: 'web' };
  await apps.createNamespacedDeployment({
    namespace: ns,
    body: {
      metadata: { name: 'web', labels },
      spec: {
        replicas: 2,
        selector: { matchLabels: labels },
        template: { metadata: { labels }, spec: { containers: [{ name: 'web', image, ports: [{ containerPort: 8080 }], resources: small }] } },
      },
    },
  });
  await core.createNamespacedService({
    namespace: ns,
    body: { metadata: { name: 'web' }, spec: { clusterIP: 'None', selector: labels, ports: [{ name: 'http', port: 8080 }] } },
  });

  const ready = await eventually(async () => {
    const list = await pods('app=web');
    expect(list).toHaveLength(2);
    expectRunningOnFakeNodes(list);
    return list;
  }, 60_000);
  await eventually(async () => expect((await apps.readNamespacedDeployment({ name: 'web', namespace: ns })).status?.readyReplicas).toBe(2), 30_000);

  const podIPs = ready.map((p) => p.status?.podIP).sort();
  await eventually(async () => {
    const slices = (await discovery.listNamespacedEndpointSlice({ namespace: ns, labelSelector: 'kubernetes.io/service-name=web' })).items;
    const endpoints = slices.flatMap((s) => s.endpoints ?? []);
    expect(endpoints.filter((e) => e.conditions?.ready === true)).toHaveLength(2);
    expect(endpoints.flatMap((e) => e.addresses).sort()).toEqual(podIPs);
    expect(slices.flatMap((s) => s.ports ?? []).map((p) => p.port)).toContain(8080);
  }, 60_000);
});

test('a StatefulSet of 3 gets Pods db-0, db-1 and db-2, all Running and Ready', async () => {
  const labels = { app: 'db' };
  await core.createNamespacedService({
    namespace: ns,
    body: { metadata: { name: 'db' }, spec: { clusterIP: 'None', selector: labels, ports: [{ port: 5432 }] } },
  });
  await apps.createNamespacedStatefulSet({
    namespace: ns,
    body: {
      metadata: { name: 'db' },
      spec: {
        replicas: 3,
        serviceName: 'db',
        selector: { matchLabels: labels },
        template: { metadata: { labels }, spec: { containers: [{ name: 'db', image, resources: small }] } },
      },
    },
  });
  await eventually(async () => {
    const list = await pods('app=db');
    expect(list.map((p) => p.metadata?.name).sort()).toEqual(['db-0', 'db-1', 'db-2']);
    expectRunningOnFakeNodes(list);
  }, 90_000);
  await eventually(async () => expect((await apps.readNamespacedStatefulSet({ name: 'db', namespace: ns })).status?.readyReplicas).toBe(3), 30_000);
});

test('a Job runs to completion (its Pod Succeeded)', async () => {
  await batch.createNamespacedJob({
    namespace: ns,
    body: {
      metadata: { name: 'once' },
      spec: { backoffLimit: 0, template: { spec: { restartPolicy: 'Never', containers: [{ name: 'once', image, resources: small }] } } },
    },
  });
  await eventually(async () => {
    const job = await batch.readNamespacedJob({ name: 'once', namespace: ns });
    expect(job.status?.succeeded).toBe(1);
    expect(job.status?.conditions?.find((c) => c.type === 'Complete')?.status).toBe('True');
  }, 60_000);
  const list = await pods('job-name=once');
  expect(list.map((p) => p.status?.phase)).toEqual(['Succeeded']);
});

test('deleting the Deployment garbage-collects its ReplicaSet and Pods through their owner references', async () => {
  const deployment = await apps.readNamespacedDeployment({ name: 'web', namespace: ns });
  const replicaSets = (await apps.listNamespacedReplicaSet({ namespace: ns, labelSelector: 'app=web' })).items;
  expect(replicaSets).toHaveLength(1);
  expect(replicaSets[0]?.metadata?.ownerReferences?.[0]).toMatchObject({ kind: 'Deployment', name: 'web', uid: deployment.metadata?.uid, controller: true });
  for (const p of await pods('app=web')) expect(p.metadata?.ownerReferences?.[0]).toMatchObject({ kind: 'ReplicaSet', uid: replicaSets[0]?.metadata?.uid });

  // The default propagation for apps/v1 is background: the API server deletes the Deployment at
  // once and the garbage collector (in kube-controller-manager) deletes what it owned.
  await apps.deleteNamespacedDeployment({ name: 'web', namespace: ns });
  await until(
    'the ReplicaSet of web to be collected',
    async () => (await apps.listNamespacedReplicaSet({ namespace: ns, labelSelector: 'app=web' })).items.length === 0,
    60_000,
  );
  await until('the Pods of web to be collected', async () => (await pods('app=web')).length === 0, 60_000);
  // What nothing owned is left alone.
  expect((await pods('app=db')).length).toBe(3);
});

test('a Pod that asks for more memory than any Node has stays Pending: Unschedulable, with a FailedScheduling event', async () => {
  await core.createNamespacedPod({
    namespace: ns,
    body: { metadata: { name: 'too-big' }, spec: { containers: [{ name: 'big', image, resources: { requests: { cpu: '100m', memory: '64Gi' } } }] } },
  });
  await eventually(async () => {
    const pod = await core.readNamespacedPod({ name: 'too-big', namespace: ns });
    const scheduled = pod.status?.conditions?.find((c) => c.type === 'PodScheduled');
    expect(scheduled).toMatchObject({ status: 'False', reason: 'Unschedulable' });
    expect(scheduled?.message).toMatch(/Insufficient memory/);
  }, 60_000);
  await eventually(async () => {
    const events = (await core.listNamespacedEvent({ namespace: ns, fieldSelector: 'involvedObject.kind=Pod,involvedObject.name=too-big' })).items;
    expect(events.map((e) => e.reason)).toContain('FailedScheduling');
  }, 30_000);
  const pod = await core.readNamespacedPod({ name: 'too-big', namespace: ns });
  expect(pod.status?.phase).toBe('Pending');
  expect(pod.spec?.nodeName).toBeUndefined();
});

test('stop() leaves no process of the cluster running', async () => {
  const pids = cluster.pids;
  expect(pids).toHaveLength(5); // etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok
  for (const pid of pids) expect(processRunning(pid)).toBe(true);
  const report = cluster.processes.map((p) => `${p.name} (pid ${p.pid}): ${rssMiB(p.pid)} MiB RSS`).join(', ');
  const starts = Object.entries(cluster.startMs)
    .map(([name, ms]) => `${name} ${(ms / 1000).toFixed(1)} s`)
    .join(', ');
  process.stderr.write(`cluster: ready in ${starts}; after the workloads: ${report}\n`);

  await cluster.stop();
  await until('every process of the cluster to exit', () => !pids.some(processRunning), 15_000);
  expect(pids.filter(processRunning)).toEqual([]);
}, 60_000);

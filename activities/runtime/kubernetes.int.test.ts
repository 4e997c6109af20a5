/**
 * The `kubernetes` runtime against a real control plane (etcd + kube-apiserver +
 * kube-controller-manager + kube-scheduler, kwok as the kubelet: Pods become Ready on fake Nodes
 * without running containers) and a real nats-server for the registry: the objects and command
 * lines of a distributed-llama topology for n = 0..3 and of a llama.cpp instance, readiness from
 * a pod watch, garbage collection through the owner chain, an unschedulable pool, fit-first
 * topologies, and a lost pod seen by `watch`.
 */
import { AppsV1Api, CoreV1Api, CustomObjectsApi, NetworkingV1Api, type KubeConfig, type V1StatefulSet } from '@kubernetes/client-node';
import type { NatsConnection } from 'nats';
import { installCrds } from '../../kube/crds';
import { dataPlaneNames } from '../../dataplane';
import { openModelRegistry, type ModelRegistry } from '../../dataplane/registry';
import { CRD_GROUP, CRD_VERSION } from '../../shared/constants';
import { instanceSpecOf, type DllamaResource, type DllamaResourceSpec } from '../../shared/kube';
import { modelRevision, type ReadyModel } from '../../shared/model';
import { isolation } from '../../test/harness';
import { natsStack, tempDir, temporalStack, TestStack, workersStack } from '../../test/harness/stack';
import type { MagusConfig } from '../../workers/config';
import type { Client } from '@temporalio/client';
import { startController } from '../../controller/controller';
import { execFile } from 'node:child_process';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { bridgeInboxPrefixOf, newNatsAuthority, parseCredentialsFile, signerFileText } from '../../dataplane/roles';
import { promisify } from 'node:util';
import { podReady } from './kubernetes';
import { CONNECT_ATTEMPTS, CONNECT_ATTEMPTS_ENV, NETWORK_KEY_ENV } from './dllama';
import { temporalSessions } from '../../gateway/temporal';
import { SessionCache } from '../../gateway/serving/sessions';
import type { SessionEntry } from '../../shared/serving';
import { poolStatusQuery, poolWorkflowId, type PoolStatus } from '../../workflows/pool/definitions';
import { startTestCluster, type TestCluster } from '../../test/harness/cluster';
import { eventually, sleep } from '../../test/harness/wait';
import { createKubernetesRuntime, type KubernetesRuntime } from './kubernetes';
import { instanceBase } from './kubernetes-manifests';
import { runtimeConfig } from '.';
import { kubernetes } from './kubernetes-entry';
import { installRbacRoles, serviceAccountKubeConfig } from '../../test/harness/kube';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
/** The runtime's namespace in the cluster, and so in its pools' workflow ids (`pool/<namespace>/<model>`): the file's own. */
const NS = iso.namespace;
const GIB = 2 ** 30;
const sha = (c: string) => c.repeat(64);
/** The bridge role's credentials the runtime hands each instance (a file, as the chart mounts it). */
const bridgeSignerFile = join(mkdtempSync(join(tmpdir(), 'magus-k8s-creds-')), 'bridge-signer.nk');

let cluster: TestCluster;
let nc: NatsConnection;
let registry: ModelRegistry;
let runtime: KubernetesRuntime;
let core: CoreV1Api;
let apps: AppsV1Api;
let custom: CustomObjectsApi;
let networking: NetworkingV1Api;
const stack = new TestStack();

/** A model with distributed-llama q40 artifacts for 1–8 nodes and a GGUF; `perNode(n)` bytes per node. */
function model(name: string, perNode: (nodes: number) => number): ReadyModel {
  return {
    namespace: NS,
    name,
    source: { repo: `org/${name}`, revision: 'main', sha: 'b'.repeat(40) },
    artifacts: [
      {
        format: 'dllama',
        weights: 'q40',
        files: [
          { key: `artifacts/${name}/model.m`, bytes: 1000, sha256: sha('1') },
          { key: `artifacts/${name}/tokenizer.t`, bytes: 10, sha256: sha('2') },
        ],
      },
      { format: 'gguf', weights: 'q40', files: [{ key: `artifacts/${name}/model.gguf`, bytes: 1000, sha256: sha('3') }] },
    ],
    memory: [
      {
        format: 'dllama',
        weights: 'q40',
        contextLength: 2048,
        topologies: [1, 2, 4, 8].map((nodes) => ({ nodes, root: { total: perNode(nodes) }, worker: nodes > 1 ? { total: perNode(nodes) } : null })),
      },
    ],
    readyAt: new Date().toISOString(),
  } as ReadyModel;
}

async function applyDllama(name: string, spec: Partial<DllamaResourceSpec>): Promise<void> {
  const body = {
    apiVersion: `${CRD_GROUP}/${CRD_VERSION}`,
    kind: 'Dllama',
    metadata: { name, namespace: NS },
    // No drain: kwok holds a deleted pod for its whole grace (the drain plus 15 s), and the fake nodes' memory with it.
    spec: {
      model: name,
      engine: 'dllama',
      nodesPower: 0,
      replicas: 1,
      minReplicas: 0,
      maxReplicas: 2,
      leasesPerInstance: 2,
      idleTimeout: '10m',
      drainTimeout: '0s',
      ...spec,
    },
  };
  await custom.createNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: NS, plural: 'dllamas', body });
}

const sts = (name: string): Promise<V1StatefulSet | undefined> => apps.readNamespacedStatefulSet({ name, namespace: NS }).catch(() => undefined);
const podsOf = async (instance: string) => (await core.listNamespacedPod({ namespace: NS, labelSelector: `magus.dev/instance=${instance}` })).items;

beforeAll(async () => {
  writeFileSync(bridgeSignerFile, signerFileText(await newNatsAuthority()));
  cluster = await startTestCluster({ nodes: 4, nodeResources: { cpu: '8', memory: '8Gi' } });
  stack.defer(() => cluster.stop());
  core = cluster.kubeConfig.makeApiClient(CoreV1Api);
  apps = cluster.kubeConfig.makeApiClient(AppsV1Api);
  custom = cluster.kubeConfig.makeApiClient(CustomObjectsApi);
  networking = cluster.kubeConfig.makeApiClient(NetworkingV1Api);
  await installCrds(cluster.kubeConfig);
  await cluster.createNamespace(NS);
  ({ nc } = await stack.open(natsStack(iso, { declare: true })));
  registry = await openModelRegistry(nc, names.modelsBucket);
  runtime = createKubernetesRuntime(runtimeOptions(cluster.kubeConfig));
}, 600_000);

/** The runtime's options in these tests, acting with `kc`'s rights. */
const runtimeOptions = (kc: KubeConfig) => ({
  kc,
  registry,
  nc,
  names,
  images: { magus: 'magus:test', dllama: 'magus-dllama:test' },
  natsUrl: 'nats://nats.magus.svc:4222',
  bridgeSigner: bridgeSignerFile,
  s3: { endpoint: 'http://s3.magus.svc:9000', region: 'us-east-1', bucket: 'models', secret: 'magus-s3' },
  unschedulableAfterMs: 2000,
  startTimeoutMs: 90_000,
  // No drain: kwok holds a deleted pod for its whole grace, and the fake nodes' memory with it.
  drainSeconds: 0,
});

afterAll(() => stack.close(), 120_000);

test.each([0, 1, 2, 3])(
  'distributed-llama on 2^%i nodes: the objects, command lines and pods; Ready; deleting the Dllama collects everything',
  async (power) => {
    const name = `topo${power}`;
    const nodes = 2 ** power;
    await registry.put(model(name, () => GIB));
    await applyDllama(name, { nodesPower: power });
    const instance = `${name}-1`;
    const base = instanceBase(instance);
    const info = await runtime.create({ namespace: NS, model: name, pool: name, instance }, new AbortController().signal);
    const dllama = (await custom.getNamespacedCustomObject({
      group: CRD_GROUP,
      version: CRD_VERSION,
      namespace: NS,
      plural: 'dllamas',
      name,
    })) as DllamaResource;
    expect(info).toEqual({
      instance,
      subject: `${names.subjectScope ? `${names.subjectScope}.` : ''}magus.req.${name}.${instance}`,
      healthy: true,
      revision: modelRevision((await registry.get(NS, name))!),
      // What it was built from: its Dllama at this generation (the pool replaces it once that changes).
      spec: instanceSpecOf(dllama),
    });
    expect(await runtime.describe(name, instance)).toMatchObject({ spec: instanceSpecOf(dllama) });
    expect((await podsOf(instance)).filter((p) => p.status?.conditions?.some((c) => c.type === 'Ready' && c.status === 'True'))).toHaveLength(nodes);

    const root = (await sts(base))!;
    const pod = root.spec!.template.spec!;
    const engine = pod.containers.find((c) => c.name === 'engine')!;
    const workers = Array.from({ length: nodes - 1 }, (_, k) => `${base}-w-${k}.${base}-w.${NS}.svc:9998`);
    expect(engine.command).toBeUndefined(); // the image's entrypoint (tini) stays
    expect(engine.args).toEqual([
      'dllama-api',
      '--host',
      '0.0.0.0',
      '--port',
      '8080',
      '--model',
      '/models/model.m',
      '--tokenizer',
      '/models/tokenizer.t',
      '--buffer-float-type',
      'q80',
      '--nthreads',
      '1',
      '--max-seq-len',
      '2048',
      ...(workers.length ? ['--workers', ...workers] : []),
    ]);
    expect(engine.image).toBe('magus-dllama:test');
    expect(engine.readinessProbe?.httpGet?.path).toBe('/v1/models');
    expect(engine.securityContext).toMatchObject({
      runAsNonRoot: true,
      readOnlyRootFilesystem: true,
      allowPrivilegeEscalation: false,
      capabilities: { drop: ['ALL'] },
      seccompProfile: { type: 'RuntimeDefault' },
    });
    // Requests: the plan's 1 GiB + 10 % + 256 MiB.
    expect(engine.resources?.requests?.memory).toBe(`${Math.ceil((GIB * 1.1 + 256 * 2 ** 20) / 2 ** 20)}Mi`);
    const fetch = pod.initContainers!.find((c) => c.name === 'fetch')!;
    expect(fetch.args).toEqual([
      'fetch',
      '--dir',
      '/models',
      '--file',
      `artifacts/${name}/model.m=${sha('1')}=model.m`,
      '--file',
      `artifacts/${name}/tokenizer.t=${sha('2')}=tokenizer.t`,
    ]);
    expect(fetch.envFrom).toEqual([{ secretRef: { name: 'magus-s3' } }]);
    const bridge = pod.containers.find((c) => c.name === 'bridge')!;
    expect(bridge.args).toEqual([
      'bridge',
      '--pool',
      name,
      '--instance',
      instance,
      '--engine',
      'http://127.0.0.1:8080',
      '--engine-kind',
      'dllama',
      '--slots',
      '1',
      '--health-port',
      '9467',
      '--drain-timeout-ms',
      '0',
      '--prefix',
      iso.natsPrefix,
    ]);
    // The engine outlives the bridge's drain; the grace is the Dllama's drainTimeout (0s here) plus 15 s.
    expect(pod.terminationGracePeriodSeconds).toBe(15);
    expect(pod.containers[0]!.lifecycle).toMatchObject({ preStop: { httpGet: { path: '/drained', port: 9467 } } });
    expect(bridge.env).toContainEqual({ name: 'MAGUS_NATS_URL', value: 'nats://nats.magus.svc:4222' });
    // Its NATS user: one of its own, made with the signer, from a Secret of the instance.
    expect(bridge.env).toContainEqual({ name: 'MAGUS_NATS_CREDENTIALS', value: '/etc/magus/nats/creds' });
    expect(bridge.volumeMounts).toContainEqual({ name: 'nats-credentials', mountPath: '/etc/magus/nats', readOnly: true });
    expect(pod.volumes?.find((v) => v.name === 'nats-credentials')?.secret?.secretName).toBe(`${base}-nats`);
    const natsSecret = await core.readNamespacedSecret({ name: `${base}-nats`, namespace: NS });
    const creds = parseCredentialsFile(Buffer.from(natsSecret.data!.creds!, 'base64').toString());
    expect(creds).toMatchObject({ role: 'bridge', inboxPrefix: bridgeInboxPrefixOf(name, instance) });
    expect(natsSecret.metadata?.ownerReferences).toMatchObject([{ kind: 'ConfigMap', name: base, controller: true }]);
    // The topology's network key: a Secret of its own, created once (a start tried again keeps it), owned by the instance.
    const keyRef = { name: NETWORK_KEY_ENV, valueFrom: { secretKeyRef: { name: `${base}-network`, key: 'key' } } };
    expect(engine.env).toEqual([keyRef, { name: CONNECT_ATTEMPTS_ENV, value: String(CONNECT_ATTEMPTS) }]);
    const secret = await core.readNamespacedSecret({ name: `${base}-network`, namespace: NS });
    const key = Buffer.from(secret.data!.key!, 'base64').toString();
    expect(key).toMatch(/^[0-9a-f]{64}$/);
    expect(secret.metadata?.ownerReferences).toMatchObject([{ kind: 'ConfigMap', name: base, controller: true }]);
    await runtime.create({ namespace: NS, model: name, pool: name, instance }, new AbortController().signal);
    expect(Buffer.from((await core.readNamespacedSecret({ name: `${base}-network`, namespace: NS })).data!.key!, 'base64').toString()).toBe(key);
    if (nodes > 1) {
      const w = (await sts(`${base}-w`))!;
      expect(w.spec!.replicas).toBe(nodes - 1);
      expect(w.spec!.template.spec!.containers[0]!.args).toEqual(['dllama', 'worker', '--host', '0.0.0.0', '--port', '9998', '--nthreads', '1']);
      expect(w.spec!.template.spec!.containers[0]!.env).toEqual([keyRef]);
      // Ready = listening, read from the kernel's table (never a connection, which a worker takes for its root).
      expect(w.spec!.template.spec!.containers[0]!.readinessProbe?.exec?.command).toEqual(['grep', '-q', ': 00000000:270E 00000000:0000 0A ', '/proc/net/tcp']);
      // The root only after every worker was Ready: a root that cannot reach a worker exits at once.
      const workerReady = (await podsOf(instance))
        .filter((p) => p.metadata?.labels?.['magus.dev/role'] === 'worker')
        .map((p) => new Date(p.status!.conditions!.find((c) => c.type === 'Ready')!.lastTransitionTime!).getTime());
      expect(workerReady).toHaveLength(nodes - 1);
      expect(new Date(root.metadata!.creationTimestamp!).getTime()).toBeGreaterThanOrEqual(Math.max(...workerReady));
      const svc = await core.readNamespacedService({ name: `${base}-w`, namespace: NS });
      expect(svc.spec?.clusterIP).toBe('None');
    } else {
      expect(await sts(`${base}-w`)).toBeUndefined();
    }
    expect(await runtime.describe(name, instance)).toMatchObject({ healthy: true });
    // Its NetworkPolicy (stored; kwok enforces none): workers answer only their root, the engine no one but probes.
    const policy = await networking.readNamespacedNetworkPolicy({ name: base, namespace: NS });
    expect(policy.metadata?.ownerReferences).toMatchObject([{ kind: 'ConfigMap', name: base, controller: true }]);
    expect(policy.spec?.podSelector.matchLabels).toEqual({ 'magus.dev/instance': instance });
    expect(policy.spec?.policyTypes).toEqual(['Ingress']);
    const rules = policy.spec?.ingress?.map((r) => ({
      from: r._from?.map((p) => p.podSelector?.matchLabels),
      ports: r.ports?.map((p) => `${p.protocol}/${p.port}`),
    }));
    expect(rules).toEqual([
      ...(nodes > 1 ? [{ from: [{ 'magus.dev/instance': instance, 'magus.dev/role': 'root' }], ports: ['TCP/9998'] }] : []),
      { from: undefined, ports: ['TCP/9467'] },
    ]);

    await custom.deleteNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: NS, plural: 'dllamas', name });
    await eventually(async () => {
      expect(await sts(base)).toBeUndefined();
      expect(await sts(`${base}-w`)).toBeUndefined();
      expect(await podsOf(instance)).toHaveLength(0);
      await expect(core.readNamespacedSecret({ name: `${base}-network`, namespace: NS })).rejects.toMatchObject({ code: 404 });
      await expect(networking.readNamespacedNetworkPolicy({ name: base, namespace: NS })).rejects.toMatchObject({ code: 404 });
    }, 60_000);
    expect(await runtime.describe(name, instance)).toBeNull();
  },
  180_000,
);

test('llama.cpp: one pod with `magus engine` and the bridge; destroy is idempotent and takes everything', async () => {
  const name = 'cpp';
  await registry.put(model(name, () => GIB));
  await applyDllama(name, { engine: 'llamacpp', nodesPower: 0 });
  const instance = `${name}-1`;
  await runtime.create({ namespace: NS, model: name, pool: name, instance }, new AbortController().signal);
  const pod = (await sts(instanceBase(instance)))!.spec!.template.spec!;
  const engine = pod.containers.find((c) => c.name === 'engine')!;
  expect(engine.image).toBe('magus:test');
  // One slot per lease of the Dllama (2): a conversation keeps its prefix cached on its instance.
  expect(engine.args).toEqual([
    'engine',
    '--model',
    '/models/model.gguf',
    '--model-id',
    name,
    '--host',
    '0.0.0.0',
    '--port',
    '8080',
    '--json',
    '--slots',
    '2',
    '--threads',
    '1',
    '--snapshots',
    '/tmp/magus-kv',
  ]);
  await runtime.destroy(name, instance);
  await runtime.destroy(name, instance); // again: nothing to do
  await eventually(async () => expect(await podsOf(instance)).toHaveLength(0), 60_000);
  expect(await runtime.describe(name, instance)).toBeNull();
}, 120_000);

test('a pod that can never be scheduled fails the start, typed, and leaves nothing behind', async () => {
  const name = 'huge';
  await registry.put(model(name, () => GIB));
  await applyDllama(name, { nodesPower: 1, resources: { requests: { memory: '100Gi' } } });
  const instance = `${name}-1`;
  const err = await runtime.create({ namespace: NS, model: name, pool: name, instance }, new AbortController().signal).then(
    () => undefined,
    (e: unknown) => e as Error,
  );
  expect(err?.name).toBe('Unschedulable');
  expect(err?.message).toMatch(/cannot be scheduled: .*Insufficient memory/);
  await eventually(async () => expect(await podsOf(instance)).toHaveLength(0), 60_000);
}, 120_000);

test('fit-first: the smallest topology whose nodes fit, said in the status; none fits → NoFit and no pods', async () => {
  // 8 GiB nodes: 1 node needs 20 GiB, 2 need 10 each, 4 need 5 each → 4.
  await registry.put(model('fits', (nodes) => (20 * GIB) / nodes));
  await applyDllama('fits', { autoNodes: true });
  await runtime.create({ namespace: NS, model: 'fits', pool: 'fits', instance: 'fits-1' }, new AbortController().signal);
  expect(await podsOf('fits-1')).toHaveLength(4);
  const d = (await custom.getNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: NS, plural: 'dllamas', name: 'fits' })) as {
    status?: { conditions?: { type: string; status: string; message: string }[] };
  };
  const chosen = d.status?.conditions?.find((c) => c.type === 'TopologyChosen');
  expect(chosen).toMatchObject({ status: 'True' });
  expect(chosen?.message).toMatch(/^chose 4 nodes \(q40\)/);

  await registry.put(model('nofit', () => 100 * GIB));
  await applyDllama('nofit', { autoNodes: true });
  const err = await runtime.create({ namespace: NS, model: 'nofit', pool: 'nofit', instance: 'nofit-1' }, new AbortController().signal).then(
    () => undefined,
    (e: unknown) => e as Error,
  );
  expect(err?.name).toBe('NoFit');
  expect(err?.message).toMatch(/no topology fits the cluster's 4 schedulable nodes/);
  expect(await podsOf('nofit-1')).toHaveLength(0);
}, 180_000);

test('a namespaced worker (crds/rbac.yaml magus-runtime as a Role in its namespace, MAGUS_K8S_NAMESPACES): no Nodes → nodesPower, said once; instances found without cluster-wide lists; a model elsewhere refused at once', async () => {
  await installRbacRoles(cluster.kubeConfig);
  // A RoleBinding grants nothing cluster-scoped: no Nodes, no list of ConfigMaps in all namespaces.
  const kc = await serviceAccountKubeConfig(cluster.kubeConfig, NS, 'namespaced-runtime', [], ['magus-runtime']);
  const lines: string[] = [];
  const options = runtimeOptions(kc);
  const confined = createKubernetesRuntime({ ...options, namespaces: [NS], log: (l) => lines.push(l) });
  // 1 GiB per node: fit-first would choose 1 node; without Nodes the Dllama's nodesPower (2 nodes) holds.
  await registry.put(model('confined', () => GIB));
  await applyDllama('confined', { autoNodes: true, nodesPower: 1 });
  await confined.create({ namespace: NS, model: 'confined', pool: 'confined', instance: 'confined-1' }, new AbortController().signal);
  await confined.create({ namespace: NS, model: 'confined', pool: 'confined', instance: 'confined-2' }, new AbortController().signal);
  expect((await podsOf('confined-1')).length).toBe(2);
  expect(lines.filter((l) => l.includes('may not list Nodes'))).toEqual([
    "this worker may not list Nodes (HTTP 403): autoNodes takes each Dllama's nodesPower",
  ]);
  const d = (await custom.getNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: NS, plural: 'dllamas', name: 'confined' })) as {
    status?: { conditions?: { type: string; status: string; reason: string }[] };
  };
  expect(d.status?.conditions?.find((c) => c.type === 'TopologyChosen')).toMatchObject({ status: 'False', reason: 'NodesUnreadable' });
  // describe and destroy find the instance by listing its namespaces; the same account listing the cluster is refused.
  expect(await confined.describe('confined', 'confined-1')).toMatchObject({ instance: 'confined-1', healthy: true });
  await expect(createKubernetesRuntime(options).describe('confined', 'confined-1')).rejects.toMatchObject({ code: 403 });
  await confined.destroy('confined', 'confined-1');
  await confined.destroy('confined', 'confined-2');
  expect(await confined.describe('confined', 'confined-1')).toBeNull();
  await eventually(async () => expect(await podsOf('confined-2')).toHaveLength(0), 60_000);

  const elsewhere = await confined
    .create({ namespace: 'elsewhere', model: 'confined', pool: 'confined', instance: 'elsewhere-1' }, new AbortController().signal)
    .then(
      () => undefined,
      (e: unknown) => e as Error,
    );
  expect({ name: elsewhere?.name, message: elsewhere?.message }).toEqual({
    name: 'NamespaceNotServed',
    message: `namespace elsewhere is not one this worker places instances in (MAGUS_K8S_NAMESPACES: ${NS}; the chart's rbac.namespaces)`,
  });
}, 180_000);

test('watch: a pod of the instance that goes away ends the watch with the reason', async () => {
  const name = 'watched';
  await registry.put(model(name, () => GIB));
  await applyDllama(name, { nodesPower: 1 });
  const instance = `${name}-1`;
  await runtime.create({ namespace: NS, model: name, pool: name, instance }, new AbortController().signal);
  let beats = 0;
  const watching = runtime.watch!(name, instance, new AbortController().signal, () => beats++);
  await sleep(500);
  const worker = (await podsOf(instance)).find((p) => p.metadata?.labels?.['magus.dev/role'] === 'worker')!;
  await core.deleteNamespacedPod({ name: worker.metadata!.name!, namespace: NS, gracePeriodSeconds: 0 });
  await expect(watching).resolves.toMatch(new RegExp(`pod ${worker.metadata!.name}.* of instance ${instance}`));
  expect(beats).toBeGreaterThanOrEqual(1);
  await runtime.destroy(name, instance);
}, 120_000);

/** Real workers on the Kubernetes runtime and a Temporal client for `body`, all stopped afterwards. */
async function withKubeWorkers(unschedulableAfterMs: number, body: (w: { cfg: MagusConfig; client: Client; dir: string }) => Promise<void>): Promise<void> {
  const pieces = new TestStack();
  try {
    const { dir } = pieces.open(tempDir('magus-k8s-'));
    const runtime = runtimeConfig(kubernetes, {
      images: { magus: 'magus:test', dllama: 'magus-dllama:test' },
      natsUrl: 'nats://nats.magus.svc:4222',
      defaultNodes: 1,
      unschedulableAfterMs,
    });
    const { cfg } = await pieces.open(workersStack(iso, dir, { runtime }, { kube: cluster.kubeConfig }));
    const { client } = await pieces.open(temporalStack());
    await body({ cfg, client, dir });
  } finally {
    await pieces.close();
  }
}

/** The controller over this file's cluster, and kubectl on it in the test's namespace: the kubectl door, for a test inside {@link withKubeWorkers}. */
function kubectlDoor({ cfg, client, dir }: { cfg: MagusConfig; client: Client; dir: string }) {
  const controller = startController({ kc: cluster.kubeConfig, temporal: { client, namespace: 'default', taskQueue: cfg.taskQueue }, namespaces: [NS] });
  const kubeconfig = join(dir, 'kubeconfig');
  writeFileSync(kubeconfig, cluster.kubeConfig.exportConfig());
  const kubectl = (...args: string[]) => promisify(execFile)('kubectl', ['--kubeconfig', kubeconfig, '-n', NS, ...args], { timeout: 60_000 });
  return { controller, kubectl };
}

test('a pool whose pods can never be scheduled: one typed failure, backing off, and the reason in the Dllama status', async () => {
  const name = 'toobig';
  await registry.put(model(name, () => GIB));
  await applyDllama(name, { engine: 'llamacpp', resources: { requests: { memory: '200Gi' } } });
  const d = (await custom.getNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: NS, plural: 'dllamas', name })) as {
    metadata: { uid: string; generation: number };
  };
  await withKubeWorkers(2000, async ({ cfg, client }) => {
    const resource = {
      name,
      uid: d.metadata.uid,
      generation: d.metadata.generation,
      minInstances: 1,
      maxInstances: 1,
      leasesPerInstance: 2,
      idleTimeoutMs: 600_000,
      nodesPerInstance: 1,
    };
    const pool = await client.workflow.start('dllamaPool', {
      workflowId: poolWorkflowId(NS, name),
      taskQueue: cfg.taskQueue,
      args: [{ namespace: NS, model: name, minInstances: 1, maxInstances: 1, leasesPerInstance: 2, idleTimeoutMs: 600_000, resource }],
    });
    await eventually(async () => {
      const s = await pool.query(poolStatusQuery);
      expect(s.startFailures).toBeGreaterThanOrEqual(1);
      expect(s.lastError).toMatch(/cannot be scheduled: .*Insufficient memory/);
    }, 60_000);
    // One attempt per start (non-retryable), and the next one waits for the backoff.
    const attempts = ((await pool.fetchHistory()).events ?? []).filter(
      (e) => e.activityTaskStartedEventAttributes && e.activityTaskStartedEventAttributes.attempt === 2,
    );
    expect(attempts).toHaveLength(0);
    await eventually(async () => {
      const got = (await custom.getNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: NS, plural: 'dllamas', name })) as {
        status?: { lastError?: string; phase?: string };
      };
      expect(got.status?.lastError).toMatch(/cannot be scheduled/);
      expect(got.status?.phase).toBe('Degraded');
    }, 30_000);
    expect(await podsOf(`${name}-1`)).toHaveLength(0);
    await pool.terminate();
  });
}, 180_000);

test('a pool on the Kubernetes runtime: its instance is pods, watched from the cluster; a lost pod gets the instance replaced', async () => {
  const name = 'pooled';
  await registry.put(model(name, () => GIB));
  await applyDllama(name, { nodesPower: 1 });
  await withKubeWorkers(5000, async ({ cfg, client }) => {
    const pool = await client.workflow.start('dllamaPool', {
      workflowId: poolWorkflowId(NS, name),
      taskQueue: cfg.taskQueue,
      args: [{ namespace: NS, model: name, minInstances: 1, maxInstances: 1, leasesPerInstance: 2, idleTimeoutMs: 600_000, healthCheckMs: 1000 }],
    });
    const ready = (s: PoolStatus) => s.instances.filter((i) => i.phase === 'ready').map((i) => i.id);
    let status = await pool.query(poolStatusQuery);
    await eventually(async () => expect(ready((status = await pool.query(poolStatusQuery)))).toHaveLength(1), 60_000);
    const first = ready(status)[0]!;
    expect(await podsOf(first)).toHaveLength(2);
    // Any worker answers for it: no runtime queue; its watcher runs on the shared control queue.
    await eventually(async () => {
      const pending = (await pool.describe()).raw.pendingActivities ?? [];
      expect(pending.some((a) => a.activityType?.name === 'watchInstance' && a.heartbeatDetails != null)).toBe(true);
    }, 30_000);

    const worker = (await podsOf(first)).find((p) => p.metadata?.labels?.['magus.dev/role'] === 'worker')!;
    await core.deleteNamespacedPod({ name: worker.metadata!.name!, namespace: NS, gracePeriodSeconds: 0 });
    await eventually(async () => {
      const ids = ready((status = await pool.query(poolStatusQuery)));
      expect(ids).toHaveLength(1);
      expect(ids[0]).not.toBe(first);
    }, 60_000);
    // The watcher completed with the reason (the new instance's start cleared lastError since).
    const results = ((await pool.fetchHistory()).events ?? [])
      .map((e) => e.activityTaskCompletedEventAttributes?.result?.payloads?.[0]?.data)
      .filter((d): d is Uint8Array => d != null);
    expect(results.map((d) => Buffer.from(d).toString('utf8')).some((r) => r.includes(`pod ${worker.metadata!.name!}`))).toBe(true);
    const second = ready(status)[0]!;
    expect(await podsOf(second)).toHaveLength(2);
    // The lost instance's objects are gone (the pool destroyed it; the collector took its pods).
    await eventually(async () => expect(await podsOf(first)).toHaveLength(0), 60_000);
    await pool.terminate();
  });
}, 240_000);

test('a Dllama scaled 1 → 3 → 0 → 1 with kubectl: the controller sizes the pool, the runtime adds and removes instances as pods', async () => {
  const name = 'scaled';
  await registry.put(model(name, () => GIB));
  await withKubeWorkers(5000, async (w) => {
    const { client } = w;
    const { controller, kubectl } = kubectlDoor(w);
    const roots = async () =>
      (await core.listNamespacedPod({ namespace: NS, labelSelector: `magus.dev/pool=${name},magus.dev/role=root` })).items.filter(podReady).length;
    try {
      await controller.synced;
      await applyDllama(name, { engine: 'llamacpp', replicas: 1, minReplicas: 0, maxReplicas: 3, idleTimeout: '30s' });
      await eventually(async () => expect(await roots()).toBe(1), 60_000);
      await kubectl('scale', `dllama/${name}`, '--replicas=3');
      await eventually(async () => expect(await roots()).toBe(3), 60_000);
      // To zero: nothing holds a lease, so each instance goes once idle for 30 s (and the drain grace).
      await kubectl('scale', `dllama/${name}`, '--replicas=0');
      await eventually(async () => expect(await roots()).toBe(0), 120_000);
      await kubectl('scale', `dllama/${name}`, '--replicas=1');
      await eventually(async () => expect(await roots()).toBe(1), 60_000);
      await kubectl('delete', `dllama/${name}`, '--timeout=60s');
      await eventually(
        async () => expect((await core.listNamespacedPod({ namespace: NS, labelSelector: `magus.dev/pool=${name}` })).items).toHaveLength(0),
        60_000,
      );
    } finally {
      await controller.stop();
      await client.workflow
        .getHandle(poolWorkflowId(NS, name))
        .terminate()
        .catch(() => undefined);
    }
  });
}, 400_000);

test("a Dllama's image changed with kubectl: an instance built from it starts beside the old one, which is then stopped; a change that only sizes the pool replaces nothing", async () => {
  const name = 'reimaged';
  await registry.put(model(name, () => GIB));
  await withKubeWorkers(5000, async (w) => {
    const { client } = w;
    const { controller, kubectl } = kubectlDoor(w);
    const pool = client.workflow.getHandle(poolWorkflowId(NS, name));
    /** Ready root pods: their instance and the image of their engine container. */
    const roots = async () =>
      (await core.listNamespacedPod({ namespace: NS, labelSelector: `magus.dev/pool=${name},magus.dev/role=root` })).items
        .filter(podReady)
        .map((p) => `${p.metadata!.labels!['magus.dev/instance']} ${p.spec!.containers.find((c) => c.name === 'engine')!.image}`);
    const observed = async (generation: number) =>
      eventually(async () => {
        const d = (await custom.getNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: NS, plural: 'dllamas', name })) as {
          status?: { observedGeneration?: number };
        };
        expect(d.status?.observedGeneration).toBe(generation);
      }, 60_000);
    try {
      await controller.synced;
      // A drain of 5 s, so the status shows the old instance retired for a while.
      await applyDllama(name, { engine: 'llamacpp', replicas: 1, minReplicas: 0, maxReplicas: 2, drainTimeout: '5s' });
      let first: string[] = [];
      await eventually(async () => expect((first = await roots())).toHaveLength(1), 60_000);
      expect(first[0]).toMatch(/ magus:test$/);
      // Only the pool's sizes: generation 2 is applied and the instance stays.
      await kubectl('patch', `dllama/${name}`, '--type=merge', '-p', '{"spec":{"idleTimeout":"20m"}}');
      await observed(2);
      await sleep(2000);
      expect(await roots()).toEqual(first);
      expect((await pool.query(poolStatusQuery)).instances.map((i) => `${i.id}:${i.phase}`)).toEqual([`${first[0]!.split(' ')[0]}:ready`]);
      // A new image: an instance built from it serves, then the old one is retired and goes.
      await kubectl('patch', `dllama/${name}`, '--type=merge', '-p', '{"spec":{"images":{"magus":"magus:v2"}}}');
      const old = first[0]!.split(' ')[0]!;
      // What the status said of the old instance, polled until it is gone.
      const seen = new Set<string>();
      await eventually(async () => {
        const s = await pool.query(poolStatusQuery);
        const o = s.instances.find((i) => i.id === old);
        if (o) seen.add(`${o.phase}${o.retiring ? `: ${o.retiring}` : ''}`);
        expect(s.instances.map((i) => i.phase)).toEqual(['ready']);
        expect(s.instances[0]!.id).not.toBe(old);
        expect(await roots()).toEqual([`${s.instances[0]!.id} magus:v2`]);
      }, 90_000);
      // Retired with its reason, then stopped.
      const why = 'built from Dllama generation 1, replaced by instances of generation 3';
      expect([...seen].filter((x) => x !== 'ready').sort()).toEqual(expect.arrayContaining([`draining: ${why}`]));
      expect([...seen].filter((x) => !['ready', `draining: ${why}`, `stopping: ${why}`].includes(x))).toEqual([]);
    } finally {
      await controller.stop();
      await pool.terminate().catch(() => undefined);
    }
  });
}, 300_000);

test('a node that goes away: the pool notices, replaces the instance, and the conversation moves to the new one on its next turn', async () => {
  const name = 'nodeloss';
  await registry.put(model(name, () => GIB));
  await applyDllama(name, { engine: 'llamacpp' });
  await withKubeWorkers(5000, async ({ cfg, client }) => {
    const t = temporalSessions({
      client,
      taskQueue: cfg.taskQueue,
      pool: { minInstances: 1, maxInstances: 1, leasesPerInstance: 4, idleTimeoutMs: 600_000, healthCheckMs: 1000 },
      sessionTtlMs: 600_000,
    });
    const js = nc.jetstream();
    const kv = await js.views.kv(names.sessionsBucket);
    const cache = new SessionCache({ kv, pools: await js.views.kv(names.poolsBucket), firstTurns: { ...t.firstTurns, sessions: kv } });
    await cache.ready;
    try {
      const key = `conv-${iso.id}`;
      const turn = async () =>
        cache.acquire({ conversationKey: key, model: (await registry.get(NS, name))!, owner: 't', signal: AbortSignal.timeout(150_000) });
      const first = await turn();
      const [root] = await podsOf(first.instance);
      const node = root!.spec!.nodeName!;
      await core.deleteNode({ name: node });
      // The pod on the gone node is removed (pod garbage collection), the watcher reports it, and
      // the pool drops the instance from its view and starts another (its minimum).
      const pool = client.workflow.getHandle(poolWorkflowId(NS, name));
      await eventually(async () => {
        const s = await pool.query(poolStatusQuery);
        expect(s.instances.map((i) => i.id)).not.toContain(first.instance);
        expect(s.instances.some((i) => i.phase === 'ready')).toBe(true);
        expect(cache.pools?.get(`${NS}.${name}`)?.instances.map((i) => i.instance)).not.toContain(first.instance);
      }, 150_000);
      // The conversation's next turn moves its entry (compare-and-swap) to the new instance.
      const moved = await turn();
      expect(moved.instance).not.toBe(first.instance);
      expect((JSON.parse(new TextDecoder().decode((await kv.get(key))!.value)) as SessionEntry).instance).toBe(moved.instance);
      const [newRoot] = await podsOf(moved.instance);
      expect(newRoot?.spec?.nodeName).not.toBe(node);
      await pool.terminate();
    } finally {
      await cache.close();
      await t.close();
    }
  });
}, 240_000);

/**
 * The objects of one instance of the `kubernetes` runtime, built as plain manifests (pure: no
 * I/O, unit-tested; kubernetes.ts applies them). Per instance, all applied under one field
 * manager and owned, through one ConfigMap, by the `Dllama` (or by the pool's own ConfigMap when
 * no `Dllama` sizes the pool), so deleting either garbage-collects everything:
 *
 * - ConfigMap `<base>`: what the instance is (pool, model, engine, nodes); owner of the rest.
 * - NetworkPolicy `<base>` ({@link instanceNetworkPolicy}): its workers answer only its root, its
 *   engine no one but the kubelet.
 * - distributed-llama with n > 1 nodes: headless Service `<base>-w` (stable DNS names for the
 *   root's `--workers`) and StatefulSet `<base>-w` of n − 1 `dllama worker` pods. A worker's
 *   readiness is read from the kernel ({@link workerListening}), never by connecting: a
 *   distributed-llama worker takes the first connection for its root, so a TCP probe would end
 *   it. They need no model file (the root sends each its slice of the weights), and they come
 *   first: kubernetes.ts creates the root once every worker is Ready.
 * - StatefulSet `<base>` of one root pod: the init container `magus fetch` (S3 → emptyDir, sha256
 *   verified), the engine (its launcher's container, engines.ts: `dllama-api`, or `magus engine`
 *   for llama.cpp) on 0.0.0.0 so the
 *   kubelet's probes reach it (startup probe for slow loads, readiness `GET /v1/models`), and the
 *   `magus bridge` sidecar that pulls the instance's requests from NATS and calls the engine on
 *   loopback.
 *
 * Every container runs non-root with a read-only root filesystem, no capabilities and the
 * runtime's default seccomp profile; scratch space is an emptyDir. Pods request the memory plan's
 * per-node figure plus headroom; workers of an instance prefer distinct nodes.
 */
import { createHash } from 'node:crypto';
import type { DllamaResourceSpec, InstanceSpec } from '../../shared/kube';
import { DEFAULT_DRAIN_SECONDS, POOL_LABEL } from '../../shared/kube';
import type { StoredObject } from '../../shared/model';
import { concurrentRequests, isDistributed, type EngineKind } from '../../shared/engines';

export const RUNTIME_FIELD_MANAGER = 'magus-runtime';
/** Where an instance's bridge finds its NATS credentials. */
const NATS_CREDENTIALS_DIR = '/etc/magus/nats';
export const INSTANCE_LABEL = 'magus.dev/instance';
export const ROLE_LABEL = 'magus.dev/role';
/** The ports of an instance's containers (each pod has its own network; a test running the pods on one host network picks free ones). */
export interface InstancePorts {
  /** The engine's HTTP port in the root pod; the bridge calls it on loopback. */
  engine: number;
  worker: number;
  bridgeHealth: number;
}
export const DEFAULT_PORTS: InstancePorts = { engine: 8080, worker: 9998, bridgeHealth: 9467 };
const MODELS_DIR = '/models';

/** Where the root pod's engine finds the model file `name` (the fetch init container puts it there). */
export const modelPath = (name: string): string => `${MODELS_DIR}/${name}`;

/** The `host:port` of each of an instance's `workers` worker pods: their stable names under the headless Service `<base>-w`. */
export function workerAddresses(instance: string, namespace: string, workers: number, port: number): string[] {
  const base = instanceBase(instance);
  return Array.from({ length: workers }, (_, k) => `${base}-w-${k}.${base}-w.${namespace}.svc:${port}`);
}
/** Non-root uid/gid of every container (the images' user). */
const UID = 65532;

export interface KubeObject {
  apiVersion: string;
  kind: string;
  metadata: { name: string; namespace: string; labels?: Record<string, string>; annotations?: Record<string, string>; ownerReferences?: OwnerReference[] };
  [field: string]: unknown;
}

export interface OwnerReference {
  apiVersion: string;
  kind: string;
  name: string;
  uid: string;
  controller?: boolean;
  blockOwnerDeletion?: boolean;
}

/** A container of an instance's pod, less what every container of it shares. */
export interface EngineContainer {
  name: string;
  image: string;
  args: string[];
  env?: ({ name: string; value: string } | { name: string; valueFrom: { secretKeyRef: { name: string; key: string } } })[];
}

/** The owner of an instance's objects: its ConfigMap (of uid `uid`), so deleting it collects them all. */
const ownedByInstance = (instance: string, uid: string): OwnerReference[] => [
  { apiVersion: 'v1', kind: 'ConfigMap', name: instanceBase(instance), uid, controller: true, blockOwnerDeletion: true },
];

/**
 * The Secret of a distributed topology's network key (images/dllama/patches/0003: its root and
 * workers prove it to each other, so a worker serves only its own root), under {@link NETWORK_KEY_FIELD}.
 * kubernetes.ts *creates* it once per instance, owned by the instance's ConfigMap, and never
 * applies it again: a new key under running pods would part them.
 */
export const networkKeySecretName = (instance: string): string => `${instanceBase(instance)}-network`;
export const NETWORK_KEY_FIELD = 'key';

/** The network key's Secret of `plan`'s instance, holding `key`, owned by the ConfigMap of uid `owner`. */
export function networkKeySecret(plan: Pick<InstancePlan, 'namespace' | 'pool' | 'instance'>, owner: string, key: string): KubeObject {
  return {
    apiVersion: 'v1',
    kind: 'Secret',
    metadata: {
      name: networkKeySecretName(plan.instance),
      namespace: plan.namespace,
      labels: instanceLabels(plan),
      ownerReferences: ownedByInstance(plan.instance, owner),
    },
    type: 'Opaque',
    immutable: true,
    stringData: { [NETWORK_KEY_FIELD]: key },
  };
}

/** The Secret of an instance's copy of the bridge's NATS credentials (kubernetes.ts creates it once, owned by the instance). */
export const natsCredentialsSecretName = (instance: string): string => `${instanceBase(instance)}-nats`;

/** The bridge's NATS credentials (`text`, a `magus nats-auth` file) for `plan`'s instance, owned by the ConfigMap of uid `owner`. */
export function natsCredentialsSecret(plan: Pick<InstancePlan, 'namespace' | 'pool' | 'instance'>, owner: string, text: string): KubeObject {
  return {
    apiVersion: 'v1',
    kind: 'Secret',
    metadata: {
      name: natsCredentialsSecretName(plan.instance),
      namespace: plan.namespace,
      labels: instanceLabels(plan),
      ownerReferences: ownedByInstance(plan.instance, owner),
    },
    type: 'Opaque',
    immutable: true,
    stringData: { creds: text },
  };
}

/** What one instance runs, decided by kubernetes.ts from the registry, the Dllama and the cluster. */
export interface InstancePlan {
  namespace: string;
  pool: string;
  instance: string;
  model: string;
  /** The model revision it serves (shared/model.ts `modelRevision`), kept in its ConfigMap. */
  revision?: string;
  /** What shapes it: the Dllama it was built from (shared/kube.ts `instanceSpecOf`), kept in its ConfigMap. */
  shape?: InstanceSpec;
  /** Owner of the instance's ConfigMap: the Dllama, or the pool's ConfigMap. */
  owner: OwnerReference;
  engine: EngineKind;
  /** Its engine's containers (its launcher's, engines.ts): the root pod's engine, and the worker pods' if it has workers. */
  containers: { engine: EngineContainer; worker?: EngineContainer };
  /** Nodes of the topology (1 for a single-process engine). */
  nodes: number;
  /** Files the root needs, with the name the engine is given (`model.gguf` or a split GGUF's parts, the first first; `model.m`, `tokenizer.t`). */
  files: (StoredObject & { name: string })[];
  /** distributed-llama's `--max-seq-len`. */
  maxSeqLen: number;
  /** distributed-llama's `--buffer-float-type` (the weights decide it). */
  dllamaBuffer?: 'f32' | 'q80';
  threads: number;
  /** Slots the engine was sized for (shared/engines.ts `concurrentRequests`: distributed-llama serves one request at a time). */
  slots: number;
  /** llama.cpp tokens per slot (default: the engine's). */
  ctx?: number;
  /** llama.cpp sequences for resumed answers beside the slots (default: the engine's). */
  resumeSlots?: number;
  /** Bytes each pod requests: the memory plan's figure plus headroom. */
  memory: { root: number; worker: number | null };
  images: { magus: string; dllama: string };
  /** `env`: the bridge's data-plane declaration settings, the worker's own (replicas, response stream size). */
  /** `credentialsSecret`: the instance's Secret with the bridge's NATS credentials ({@link natsCredentialsSecret}), mounted into its bridge. */
  nats: { url: string; prefix: string; env?: Record<string, string>; credentialsSecret?: string };
  s3: { endpoint?: string; region: string; bucket: string; secret?: string };
  serviceAccount?: string;
  spec?: Pick<DllamaResourceSpec, 'resources' | 'nodeSelector' | 'tolerations'>;
  /** Startup probe budget: how long the engine may take to load its model. */
  startupSeconds: number;
  /**
   * How long its answers in flight may finish when its pods stop (deleted, evicted, node
   * drained): the bridge's drain timeout; the pods' termination grace is this plus
   * {@link DRAIN_MARGIN_SECONDS}. Default {@link DEFAULT_DRAIN_SECONDS}, the `Dllama`'s `drainTimeout`.
   */
  drainSeconds?: number;
  ports?: InstancePorts;
}

/** Object names of an instance: `<base>`, `<base>-w`; a DNS label with room for pod suffixes. */
export function instanceBase(instance: string): string {
  const base = `mg-${instance}`.toLowerCase();
  // A StatefulSet's pods add `-<ordinal>` and its revision label a hash: stay within 47.
  if (base.length <= 40 && /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/.test(base)) return base;
  const hash = createHash('sha256').update(instance).digest('hex').slice(0, 8);
  return `${base
    .replace(/[^a-z0-9-]/g, '-')
    .slice(0, 31)
    .replace(/-+$/, '')}-${hash}`;
}

export function instanceLabels(plan: Pick<InstancePlan, 'pool' | 'instance'>): Record<string, string> {
  return {
    'app.kubernetes.io/part-of': 'magus',
    'app.kubernetes.io/component': 'instance',
    'app.kubernetes.io/managed-by': 'magus',
    [POOL_LABEL]: plan.pool,
    [INSTANCE_LABEL]: plan.instance,
  };
}

/** The label selector of an instance's pods. */
export const instanceSelector = (instance: string): string => `${INSTANCE_LABEL}=${instance}`;

const mib = (bytes: number): string => `${Math.ceil(bytes / 2 ** 20)}Mi`;

const hardened = {
  runAsNonRoot: true,
  runAsUser: UID,
  runAsGroup: UID,
  readOnlyRootFilesystem: true,
  allowPrivilegeEscalation: false,
  capabilities: { drop: ['ALL'] },
  seccompProfile: { type: 'RuntimeDefault' },
};

function resources(plan: InstancePlan, bytes: number | null): Record<string, unknown> {
  const requests: Record<string, string> = { ...(plan.spec?.resources?.requests ?? {}) };
  if (bytes !== null && requests.memory === undefined) requests.memory = mib(bytes);
  const limits = plan.spec?.resources?.limits;
  return { requests, ...(limits && Object.keys(limits).length > 0 ? { limits } : {}) };
}

/** Beyond the drain: the bridge hands back what did not finish, the engine and NATS connections close. */
export const DRAIN_MARGIN_SECONDS = 15;

function podBasics(plan: InstancePlan, labels: Record<string, string>): Record<string, unknown> {
  return {
    automountServiceAccountToken: false,
    ...(plan.serviceAccount ? { serviceAccountName: plan.serviceAccount } : {}),
    securityContext: { runAsNonRoot: true, runAsUser: UID, runAsGroup: UID, fsGroup: UID, seccompProfile: { type: 'RuntimeDefault' } },
    enableServiceLinks: false,
    terminationGracePeriodSeconds: (plan.drainSeconds ?? DEFAULT_DRAIN_SECONDS) + DRAIN_MARGIN_SECONDS,
    ...(plan.spec?.nodeSelector ? { nodeSelector: plan.spec.nodeSelector } : {}),
    ...(plan.spec?.tolerations ? { tolerations: plan.spec.tolerations } : {}),
    // The nodes of one instance on distinct machines where the cluster has them (the point of
    // distributed-llama); preferred, so a small cluster still runs it.
    affinity: {
      podAntiAffinity: {
        preferredDuringSchedulingIgnoredDuringExecution: [
          {
            weight: 100,
            podAffinityTerm: { topologyKey: 'kubernetes.io/hostname', labelSelector: { matchLabels: { [INSTANCE_LABEL]: labels[INSTANCE_LABEL] } } },
          },
        ],
      },
    },
  };
}

const tmpVolume = { name: 'tmp', emptyDir: {} };
const tmpMount = { name: 'tmp', mountPath: '/tmp' };

/** Every object of the instance, the ConfigMap (their owner) first. */
/**
 * A distributed-llama worker's readiness: it listens on `port`, read from the kernel's table of
 * its network namespace (`/proc/net/tcp`: a LISTEN socket, state 0A, on 0.0.0.0:port). Never a
 * connection: a worker takes the first one for its root and dies when it closes early. The root is
 * created only once every worker is Ready (kubernetes.ts), since `dllama-api` exits at once when a
 * worker refuses it.
 */
export function workerListening(port: number): { exec: { command: string[] }; periodSeconds: number } {
  const local = `00000000:${port.toString(16).toUpperCase().padStart(4, '0')}`;
  return { exec: { command: ['grep', '-q', `: ${local} 00000000:0000 0A `, '/proc/net/tcp'] }, periodSeconds: 1 };
}

export function instanceManifests(plan: InstancePlan): KubeObject[] {
  const { engine: ENGINE_PORT, worker: WORKER_PORT, bridgeHealth: BRIDGE_HEALTH_PORT } = plan.ports ?? DEFAULT_PORTS;
  const base = instanceBase(plan.instance);
  const labels = instanceLabels(plan);
  const ns = plan.namespace;
  const configMap: KubeObject = {
    apiVersion: 'v1',
    kind: 'ConfigMap',
    metadata: { name: base, namespace: ns, labels, ownerReferences: [{ ...plan.owner, controller: true, blockOwnerDeletion: true }] },
    data: {
      pool: plan.pool,
      instance: plan.instance,
      model: plan.model,
      engine: plan.engine,
      nodes: String(plan.nodes),
      ...(plan.revision ? { revision: plan.revision } : {}),
      ...(plan.shape ? { spec: JSON.stringify(plan.shape) } : {}),
    },
  };
  // Owned by the ConfigMap, whose uid is known only once it exists: kubernetes.ts fills it in.
  const ownedBy = (uid: string): OwnerReference[] => ownedByInstance(plan.instance, uid);
  const objects: KubeObject[] = [configMap];
  const workers = isDistributed(plan.engine) ? plan.nodes - 1 : 0;
  objects.push(instanceNetworkPolicy(plan, { worker: WORKER_PORT, bridgeHealth: BRIDGE_HEALTH_PORT }, workers > 0, ownedBy('')));
  const { containers } = plan;
  if (workers > 0 && containers.worker) {
    const workerLabels = { ...labels, [ROLE_LABEL]: 'worker' };
    objects.push({
      apiVersion: 'v1',
      kind: 'Service',
      metadata: { name: `${base}-w`, namespace: ns, labels, ownerReferences: ownedBy('') },
      spec: {
        clusterIP: 'None',
        // The root resolves its workers while they start: names must exist before readiness.
        publishNotReadyAddresses: true,
        selector: { [INSTANCE_LABEL]: plan.instance, [ROLE_LABEL]: 'worker' },
        ports: [{ name: 'dllama', port: WORKER_PORT, targetPort: WORKER_PORT }],
      },
    });
    objects.push({
      apiVersion: 'apps/v1',
      kind: 'StatefulSet',
      metadata: { name: `${base}-w`, namespace: ns, labels, ownerReferences: ownedBy('') },
      spec: {
        serviceName: `${base}-w`,
        replicas: workers,
        podManagementPolicy: 'Parallel',
        selector: { matchLabels: { [INSTANCE_LABEL]: plan.instance, [ROLE_LABEL]: 'worker' } },
        template: {
          metadata: { labels: workerLabels },
          spec: {
            ...podBasics(plan, workerLabels),
            containers: [
              {
                ...containers.worker,
                ports: [{ name: 'dllama', containerPort: WORKER_PORT }],
                readinessProbe: workerListening(WORKER_PORT),
                resources: resources(plan, plan.memory.worker),
                securityContext: hardened,
                volumeMounts: [tmpMount],
              },
            ],
            volumes: [tmpVolume],
          },
        },
      },
    });
  }

  const rootLabels = { ...labels, [ROLE_LABEL]: 'root' };
  const engine = containers.engine;
  const probe = { httpGet: { path: '/v1/models', port: ENGINE_PORT }, periodSeconds: 5, timeoutSeconds: 3 };
  const s3Env = [
    ...(plan.s3.endpoint ? [{ name: 'MAGUS_S3_ENDPOINT', value: plan.s3.endpoint }] : []),
    { name: 'MAGUS_S3_REGION', value: plan.s3.region },
    { name: 'MAGUS_S3_BUCKET', value: plan.s3.bucket },
    { name: 'HOME', value: '/tmp' },
  ];
  objects.push({
    apiVersion: 'apps/v1',
    kind: 'StatefulSet',
    metadata: { name: base, namespace: ns, labels, ownerReferences: ownedBy('') },
    spec: {
      serviceName: base,
      replicas: 1,
      podManagementPolicy: 'Parallel',
      selector: { matchLabels: { [INSTANCE_LABEL]: plan.instance, [ROLE_LABEL]: 'root' } },
      template: {
        metadata: { labels: rootLabels },
        spec: {
          ...podBasics(plan, rootLabels),
          initContainers: [
            {
              name: 'fetch',
              image: plan.images.magus,
              args: ['fetch', '--dir', MODELS_DIR, ...plan.files.flatMap((f) => ['--file', `${f.key}=${f.sha256}=${f.name}`])],
              env: s3Env,
              ...(plan.s3.secret ? { envFrom: [{ secretRef: { name: plan.s3.secret } }] } : {}),
              securityContext: hardened,
              volumeMounts: [{ name: 'models', mountPath: MODELS_DIR }, tmpMount],
              terminationMessagePolicy: 'FallbackToLogsOnError',
            },
          ],
          containers: [
            {
              ...engine,
              ports: [{ name: 'http', containerPort: ENGINE_PORT }],
              resources: resources(plan, plan.memory.root),
              securityContext: hardened,
              volumeMounts: [{ name: 'models', mountPath: MODELS_DIR, readOnly: true }, tmpMount],
              startupProbe: { ...probe, failureThreshold: Math.max(1, Math.ceil(plan.startupSeconds / 5)) },
              readinessProbe: probe,
              // Stopped only once the bridge beside it has finished the answers in flight (or handed
              // them back at its drain timeout): the kubelet signals every container at once.
              lifecycle: { preStop: { httpGet: { path: '/drained', port: BRIDGE_HEALTH_PORT } } },
              terminationMessagePolicy: 'FallbackToLogsOnError',
            },
            {
              name: 'bridge',
              image: plan.images.magus,
              args: [
                'bridge',
                '--pool',
                plan.pool,
                '--instance',
                plan.instance,
                '--engine',
                `http://127.0.0.1:${ENGINE_PORT}`,
                '--engine-kind',
                plan.engine,
                '--slots',
                String(concurrentRequests(plan.engine, plan.slots)),
                '--health-port',
                String(BRIDGE_HEALTH_PORT),
                '--drain-timeout-ms',
                String((plan.drainSeconds ?? DEFAULT_DRAIN_SECONDS) * 1000),
                ...(plan.nats.prefix ? ['--prefix', plan.nats.prefix] : []),
              ],
              env: [
                { name: 'MAGUS_NATS_URL', value: plan.nats.url },
                ...(plan.nats.credentialsSecret ? [{ name: 'MAGUS_NATS_CREDENTIALS', value: `${NATS_CREDENTIALS_DIR}/creds` }] : []),
                ...Object.entries(plan.nats.env ?? {}).map(([name, value]) => ({ name, value })),
                { name: 'HOME', value: '/tmp' },
              ],
              ports: [{ name: 'bridge-health', containerPort: BRIDGE_HEALTH_PORT }],
              resources: { requests: { memory: '96Mi', cpu: '50m' } },
              securityContext: hardened,
              volumeMounts: [tmpMount, ...(plan.nats.credentialsSecret ? [{ name: 'nats-credentials', mountPath: NATS_CREDENTIALS_DIR, readOnly: true }] : [])],
              terminationMessagePolicy: 'FallbackToLogsOnError',
            },
          ],
          volumes: [
            { name: 'models', emptyDir: {} },
            tmpVolume,
            ...(plan.nats.credentialsSecret ? [{ name: 'nats-credentials', secret: { secretName: plan.nats.credentialsSecret, defaultMode: 0o400 } }] : []),
          ],
        },
      },
    },
  });
  return objects;
}

/**
 * What may reach an instance's pods: its workers (distributed-llama) only from its own root, on
 * the worker port; its root's bridge health port (`/health`, `/ready`, `/metrics`) from anywhere,
 * for probes and scrapes; nothing else — the engine listens on 0.0.0.0 for the kubelet's probes,
 * and answers no one else (the bridge calls it on loopback). Probes come from the node, which
 * CNIs that enforce policies (Calico, Cilium) let reach its own pods. Egress is not limited here:
 * the chart's policies (networkPolicy.enabled) say where instance pods may connect.
 */
export function instanceNetworkPolicy(
  plan: Pick<InstancePlan, 'namespace' | 'pool' | 'instance'>,
  ports: Pick<InstancePorts, 'worker' | 'bridgeHealth'>,
  hasWorkers: boolean,
  ownerReferences: OwnerReference[],
): KubeObject {
  return {
    apiVersion: 'networking.k8s.io/v1',
    kind: 'NetworkPolicy',
    metadata: { name: instanceBase(plan.instance), namespace: plan.namespace, labels: instanceLabels(plan), ownerReferences },
    spec: {
      podSelector: { matchLabels: { [INSTANCE_LABEL]: plan.instance } },
      policyTypes: ['Ingress'],
      ingress: [
        {
          // `_from`: client-node's model of the field `from` (its serializer drops a `from` it does not know).
          _from: [{ podSelector: { matchLabels: { [INSTANCE_LABEL]: plan.instance, [ROLE_LABEL]: 'root' } } }],
          ports: [{ protocol: 'TCP', port: ports.worker }],
        },
        { ports: [{ protocol: 'TCP', port: ports.bridgeHealth }] },
      ].filter((_, i) => i > 0 || hasWorkers),
    },
  };
}

/** The pool's own ConfigMap: owner of its instances when no `Dllama` sizes the pool. */
export function poolOwnerManifest(namespace: string, pool: string): KubeObject {
  return {
    apiVersion: 'v1',
    kind: 'ConfigMap',
    metadata: {
      name: `mg-pool-${pool}`.slice(0, 63).replace(/-+$/, ''),
      namespace,
      labels: { 'app.kubernetes.io/part-of': 'magus', 'app.kubernetes.io/managed-by': 'magus', [POOL_LABEL]: pool },
    },
    data: { pool },
  };
}

/**
 * The `kubernetes` runtime (ARCHITECTURE.md, "Runtimes and engines"): an instance is a set of
 * objects in the model's namespace (kubernetes-manifests.ts), applied with server-side apply under
 * one field manager. It answers from the cluster, so any worker can describe, watch or destroy any
 * instance (no per-worker runtime queue).
 *
 * - `create` decides the plan (the registry's artifacts and memory plan, the model's `Dllama`
 *   if one sizes the pool, the cluster's Nodes for `autoNodes` — a worker that may not list
 *   Nodes, as in a namespaced install, takes the Dllama's `nodesPower` instead and says so once),
 *   applies the objects and resolves
 *   once every pod of the instance is Ready, from a pod watch. A pod that cannot be scheduled for
 *   `unschedulableAfterMs` fails the start with the scheduler's reason (`Unschedulable`,
 *   non-retryable: the pool backs off and its `Dllama` status says why); no topology that fits
 *   fails with `NoFit` and creates nothing. Any failure or abort deletes what it applied.
 * - `describe` reads the instance's ConfigMap and pods; `watch` follows its pods and resolves with
 *   the reason once one is not Ready, is deleted, or its node goes away.
 * - `destroy` deletes the instance's ConfigMap (the garbage collector takes the rest) and its
 *   request consumer; idempotent.
 *
 * With `namespaces` (a namespaced install, whose roles are Roles in those namespaces only) an
 * instance of a model elsewhere is refused at once (`NamespaceNotServed`, non-retryable: the
 * pool's status says why) instead of failing on 403s, and instances are looked up in those
 * namespaces only (no cluster-wide list).
 */
import { bridgeCredentialsText, readNatsSigner } from '../../dataplane/roles';
import {
  CoreV1Api,
  CustomObjectsApi,
  KubernetesObjectApi,
  PatchStrategy,
  setHeaderOptions,
  type KubeConfig,
  type KubernetesObject,
  type V1Node,
  type V1Pod,
} from '@kubernetes/client-node';
import { randomBytes } from 'node:crypto';
import type { NatsConnection } from 'nats';
import { CRD_GROUP, CRD_VERSION } from '../../shared/constants';
import { watchResource } from '../../kube/watch';
import { drainTimeoutMsOf, instanceSpecOf, MAX_DRAIN_SECONDS, parseMemory, Plural, type DllamaResource, type InstanceSpec } from '../../shared/kube';
import { DEFAULT_INSTANCE_MEMORY_BYTES } from '../../shared/engine-slots';
import { engineOf, isDistributed, type EngineKind } from '../../shared/engines';
import { modelRevision, type ReadyModel } from '../../shared/model';
import { WEIGHTS_PREFERENCE } from '../../shared/weights';
import { RuntimeErrorType, runtimeError } from '../../shared/errors';
import { deleteInstanceConsumer, requestSubjectOf, type DataPlaneNames } from '../../dataplane';
import type { ModelRegistry } from '../../dataplane/registry';
import type { InstanceInfo, InstanceRequest, WorkerRuntime } from './runtime';
import { kubernetesEngines, kubernetesLauncherOf } from './engines';
import {
  DEFAULT_PORTS,
  instanceBase,
  instanceManifests,
  instanceSelector,
  DRAIN_MARGIN_SECONDS,
  modelPath,
  networkKeySecret,
  poolOwnerManifest,
  ROLE_LABEL,
  RUNTIME_FIELD_MANAGER,
  workerAddresses,
  type InstancePlan,
  natsCredentialsSecret,
  natsCredentialsSecretName,
  type InstancePorts,
  type KubeObject,
  type OwnerReference,
} from './kubernetes-manifests';

export interface KubernetesRuntimeOptions {
  kc: KubeConfig;
  registry: ModelRegistry;
  nc: NatsConnection;
  names: DataPlaneNames;
  images: { magus: string; dllama: string };
  /** NATS as the instance pods reach it. */
  natsUrl: string;
  /** The signer file (dataplane/roles.ts, `magus nats-auth`): each instance's bridge connects as a user of its own made with it, from a Secret of the instance. */
  bridgeSigner?: string;
  /**
   * Environment of each pod's bridge for declaring the data plane as this worker does
   * (`MAGUS_NATS_REPLICAS`, `MAGUS_RESPONSES_*`; workers/config.ts `dataPlaneEnv`).
   */
  dataPlaneEnv?: Record<string, string>;
  s3: {
    endpoint?: string;
    region: string;
    bucket: string;
    /** Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in each model namespace. */ secret?: string;
  };
  serviceAccount?: string;
  /** Without a `Dllama`: llama.cpp, or distributed-llama on this many nodes when the model has an artifact for it. */
  defaultNodes?: number;
  threads?: number;
  /**
   * llama.cpp engine slots, fixed; unset: the leases the instance's pool gives it
   * (`InstanceRequest.leases`), else a `Dllama`'s `leasesPerInstance`, else sized from the model's
   * memory plan within `instanceMemory` (shared/engine-slots.ts), as the gateway sizes a pool's
   * leases per instance.
   */
  slots?: number;
  /** Memory budget of one llama.cpp instance in bytes (default {@link DEFAULT_INSTANCE_MEMORY_BYTES}). */
  instanceMemory?: number;
  /** Requests = plan × (1 + fraction) + bytes (default 10 % + 256 MiB). */
  headroom?: { fraction: number; bytes: number };
  /** A pod unschedulable this long fails the start (default 30 s). */
  unschedulableAfterMs?: number;
  /** How long a start may take in all (default 30 min). */
  startTimeoutMs?: number;
  /** The drain of instances whose `Dllama` sets no `drainTimeout` (or that have none), in seconds (default 300). */
  drainSeconds?: number;
  /** Container ports (default 8080, 9998, 9467). */
  ports?: InstancePorts;
  /** The only namespaces instances may be in (the worker's Roles are there); absent or empty: any. */
  namespaces?: readonly string[];
  log?: (line: string) => void;
}

const code = (err: unknown): number | undefined => (err as { code?: number }).code;
const applyHeaders = setHeaderOptions('Content-Type', PatchStrategy.ServerSideApply);
const GIB = 2 ** 30;

/** An instance ConfigMap's `spec` (what shaped it), if it holds a well-formed one. */
function specOf(text: string | undefined): { spec?: InstanceSpec } {
  if (!text) return {};
  try {
    const s = JSON.parse(text) as Partial<InstanceSpec>;
    return typeof s.digest === 'string' && typeof s.uid === 'string' && Number.isSafeInteger(s.generation)
      ? { spec: { digest: s.digest, uid: s.uid, generation: s.generation! } }
      : {};
  } catch {
    return {};
  }
}
const gib = (n: number) => `${(n / GIB).toFixed(1)} GiB`;

/** Ready = the pod's Ready condition is True and it is not being deleted. */
export function podReady(p: V1Pod): boolean {
  return !p.metadata?.deletionTimestamp && (p.status?.conditions ?? []).some((c) => c.type === 'Ready' && c.status === 'True');
}

/** Why a pod cannot start, when that is final enough to stop waiting (a crash loop, a failed fetch); else undefined. */
function podFailure(p: V1Pod): string | undefined {
  if (p.status?.phase === 'Failed') return `pod ${p.metadata?.name} failed: ${p.status.message ?? p.status.reason ?? 'no reason given'}`;
  for (const s of [...(p.status?.initContainerStatuses ?? []), ...(p.status?.containerStatuses ?? [])]) {
    const last = s.lastState?.terminated ?? s.state?.terminated;
    if (last && last.exitCode !== 0 && (s.restartCount ?? 0) >= 2)
      return `container ${s.name} of pod ${p.metadata?.name} keeps failing (exit ${last.exitCode}): ${(last.message ?? last.reason ?? '').trim().split('\n').slice(-3).join(' ')}`;
  }
  return undefined;
}

/** The scheduler's reason when the pod cannot be placed. */
function unschedulable(p: V1Pod): string | undefined {
  const c = (p.status?.conditions ?? []).find((x) => x.type === 'PodScheduled' && x.status === 'False' && x.reason === 'Unschedulable');
  return c ? (c.message ?? 'unschedulable') : undefined;
}

export interface FitChoice {
  nodes: number;
  weights: string;
  reason: string;
}

/**
 * Fit-first: the smallest topology (over the model's distributed-llama artifacts, most compact
 * weights first) whose root and workers each fit a distinct schedulable node's allocatable
 * memory, with headroom. A string when none fits: what each size would need.
 */
export function chooseFit(
  ready: ReadyModel,
  nodes: readonly V1Node[],
  need: (bytes: number) => number,
  placement: { nodeSelector?: Record<string, string>; tolerations?: Record<string, unknown>[] } = {},
): FitChoice | string {
  const tolerated = (t: { key?: string; value?: string; effect?: string }) =>
    (placement.tolerations ?? []).some(
      (o) => (o.key === undefined || o.key === t.key) && (o.operator === 'Exists' || o.value === t.value) && (o.effect === undefined || o.effect === t.effect),
    );
  const schedulable = nodes.filter(
    (n) =>
      !n.spec?.unschedulable &&
      (n.status?.conditions ?? []).some((c) => c.type === 'Ready' && c.status === 'True') &&
      !(n.spec?.taints ?? []).some((t) => (t.effect === 'NoSchedule' || t.effect === 'NoExecute') && !tolerated(t)) &&
      Object.entries(placement.nodeSelector ?? {}).every(([k, v]) => n.metadata?.labels?.[k] === v),
  );
  const alloc = schedulable
    .map((n) => parseMemory(n.status?.allocatable?.memory ?? '0'))
    .filter((b) => b > 0)
    .sort((a, b) => b - a);
  const tried: string[] = [];
  const order = WEIGHTS_PREFERENCE;
  const plans = ready.memory
    .filter((m) => m.format === 'dllama' && ready.artifacts.some((a) => a.format === 'dllama' && a.weights === m.weights))
    .sort((a, b) => order.indexOf(a.weights) - order.indexOf(b.weights));
  for (const plan of plans) {
    for (const t of [...plan.topologies].sort((a, b) => a.nodes - b.nodes)) {
      const root = need(t.root.total);
      const worker = t.worker ? need(t.worker.total) : 0;
      // The root takes the largest node; each worker another one.
      const fits = alloc.length >= t.nodes && alloc[0]! >= root && alloc.slice(1).filter((b) => b >= worker).length >= t.nodes - 1;
      const what = `${t.nodes} node${t.nodes > 1 ? 's' : ''} (${plan.weights}): root ${gib(root)}${t.nodes > 1 ? `, ${t.nodes - 1} × worker ${gib(worker)}` : ''}`;
      if (fits)
        return {
          nodes: t.nodes,
          weights: plan.weights,
          reason: `chose ${what}: the smallest topology that fits ${alloc.length} schedulable node${alloc.length === 1 ? '' : 's'} (largest allocatable ${gib(alloc[0]!)})`,
        };
      tried.push(what);
    }
  }
  if (tried.length === 0) return `model ${ready.namespace}/${ready.name} has no distributed-llama memory plan to fit`;
  return `no topology fits the cluster's ${alloc.length} schedulable node${alloc.length === 1 ? '' : 's'} (allocatable ${alloc.map(gib).join(', ') || 'none'}); needed: ${tried.join('; ')}`;
}

export interface KubernetesRuntime extends WorkerRuntime {
  /** Apiserver requests made, by verb (for the benchmark and /metrics). */
  requests(): Record<string, number>;
}

export function createKubernetesRuntime(opts: KubernetesRuntimeOptions): KubernetesRuntime {
  const objects = KubernetesObjectApi.makeApiClient(opts.kc);
  const core = opts.kc.makeApiClient(CoreV1Api);
  const custom = opts.kc.makeApiClient(CustomObjectsApi);
  const log = opts.log ?? (() => undefined);
  const headroom = opts.headroom ?? { fraction: 0.1, bytes: 256 * 2 ** 20 };
  const need = (bytes: number) => Math.ceil(bytes * (1 + headroom.fraction) + headroom.bytes);
  const counts: Record<string, number> = {};
  const count = (verb: string) => (counts[verb] = (counts[verb] ?? 0) + 1);
  const served = opts.namespaces?.length ? opts.namespaces : undefined;
  let nodesUnreadable = false;

  /**
   * The cluster's Nodes for fit-first, or null when this worker may not list them (401/403: a
   * namespaced install grants no cluster-scoped reads), said once.
   */
  async function listNodes(): Promise<V1Node[] | null> {
    if (nodesUnreadable) return null;
    count('list');
    try {
      return (await core.listNode()).items;
    } catch (err) {
      if (code(err) !== 403 && code(err) !== 401) throw err;
      nodesUnreadable = true;
      log(`this worker may not list Nodes (HTTP ${code(err)}): autoNodes takes each Dllama's nodesPower`);
      return null;
    }
  }

  const apply = async <T extends KubeObject>(obj: T): Promise<KubernetesObject> => {
    count('apply');
    return objects.patch(obj, undefined, undefined, RUNTIME_FIELD_MANAGER, true, PatchStrategy.ServerSideApply);
  };

  /** The `Dllama` that sizes the pool of `model` in `namespace`, if any. */
  async function dllamaOf(namespace: string, model: string): Promise<DllamaResource | undefined> {
    count('list');
    const list = (await custom.listNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace, plural: Plural.dllama })) as {
      items: DllamaResource[];
    };
    return list.items.find((d) => d.spec.model === model && !d.metadata.deletionTimestamp);
  }

  /** Says on the `Dllama` what the fit-first choice was (its own condition, beside the pool's). */
  async function reportTopology(d: DllamaResource, status: 'True' | 'False', reason: string, message: string): Promise<void> {
    count('status');
    const body = {
      apiVersion: `${CRD_GROUP}/${CRD_VERSION}`,
      kind: 'Dllama',
      metadata: { name: d.metadata.name, namespace: d.metadata.namespace, uid: d.metadata.uid },
      status: {
        conditions: [
          { type: 'TopologyChosen', status, reason, message, observedGeneration: d.metadata.generation, lastTransitionTime: new Date().toISOString() },
        ],
      },
    };
    await custom
      .patchNamespacedCustomObjectStatus(
        {
          group: CRD_GROUP,
          version: CRD_VERSION,
          namespace: d.metadata.namespace,
          plural: Plural.dllama,
          name: d.metadata.name,
          body,
          fieldManager: RUNTIME_FIELD_MANAGER,
          force: true,
        },
        applyHeaders,
      )
      .catch((err: unknown) => log(`could not record the topology on Dllama ${d.metadata.namespace}/${d.metadata.name}: ${(err as Error).message}`));
  }

  async function plan(req: InstanceRequest): Promise<InstancePlan> {
    if (served && !served.includes(req.namespace))
      throw runtimeError(
        RuntimeErrorType.NamespaceNotServed,
        `namespace ${req.namespace} is not one this worker places instances in (MAGUS_K8S_NAMESPACES: ${served.join(', ')}; the chart's rbac.namespaces)`,
      );
    const ready = await opts.registry.get(req.namespace, req.model);
    if (!ready) throw runtimeError(RuntimeErrorType.ModelNotReady, `model ${req.namespace}/${req.model} is not in the registry`);
    const d = await dllamaOf(req.namespace, req.model);
    let owner: OwnerReference;
    if (d) owner = { apiVersion: `${CRD_GROUP}/${CRD_VERSION}`, kind: 'Dllama', name: d.metadata.name, uid: d.metadata.uid };
    else {
      const cm = await apply(poolOwnerManifest(req.namespace, req.pool));
      owner = { apiVersion: 'v1', kind: 'ConfigMap', name: cm.metadata!.name!, uid: cm.metadata!.uid! };
    }
    const engine = d ? d.spec.engine : defaultEngine(ready);
    const drainMs = (d ? drainTimeoutMsOf(d.spec) : null) ?? (opts.drainSeconds !== undefined ? opts.drainSeconds * 1000 : null);
    const distributed = isDistributed(engine);
    let nodes = distributed ? (d ? 2 ** (d.spec.nodesPower ?? 0) : (opts.defaultNodes ?? 1)) : 1;
    const clusterNodes = distributed && d?.spec.autoNodes ? await listNodes() : null;
    if (distributed && d?.spec.autoNodes && !clusterNodes)
      await reportTopology(d, 'False', 'NodesUnreadable', `the worker may not list Nodes: ${nodes} node(s) from nodesPower`);
    else if (distributed && d?.spec.autoNodes && clusterNodes) {
      const fit = chooseFit(ready, clusterNodes, need, { nodeSelector: d.spec.nodeSelector, tolerations: d.spec.tolerations });
      if (typeof fit === 'string') {
        await reportTopology(d, 'False', 'NoFit', fit);
        throw runtimeError(RuntimeErrorType.NoFit, fit);
      }
      await reportTopology(d, 'True', 'Fits', fit.reason);
      nodes = fit.nodes;
    }
    const launcher = kubernetesLauncherOf(engine);
    const planned = launcher.plan({
      ready,
      nodes,
      fixedSlots: opts.slots ?? req.leases ?? d?.spec.leasesPerInstance,
      resumeSlots: d?.spec.resumeSlots,
      instanceMemory: opts.instanceMemory ?? DEFAULT_INSTANCE_MEMORY_BYTES,
    });
    const ports = opts.ports ?? DEFAULT_PORTS;
    const plan = {
      namespace: req.namespace,
      pool: req.pool,
      instance: req.instance,
      model: req.model,
      revision: modelRevision(ready),
      ...(d ? { shape: instanceSpecOf(d) } : {}),
      owner,
      engine,
      threads: opts.threads ?? 1,
      images: { magus: d?.spec.images?.magus ?? opts.images.magus, dllama: d?.spec.images?.dllama ?? opts.images.dllama },
      nats: {
        url: opts.natsUrl,
        prefix: opts.names.prefix,
        ...(opts.dataPlaneEnv ? { env: opts.dataPlaneEnv } : {}),
        ...(opts.bridgeSigner ? { credentialsSecret: natsCredentialsSecretName(req.instance) } : {}),
      },
      s3: opts.s3,
      ...(opts.serviceAccount ? { serviceAccount: opts.serviceAccount } : {}),
      ...(d ? { spec: { resources: d.spec.resources, nodeSelector: d.spec.nodeSelector, tolerations: d.spec.tolerations } } : {}),
      startupSeconds: Math.ceil((opts.startTimeoutMs ?? 30 * 60_000) / 1000),
      ...(drainMs !== null ? { drainSeconds: Math.ceil(drainMs / 1000) } : {}),
      ...(opts.ports ? { ports: opts.ports } : {}),
      ...planned,
      memory: { root: need(planned.memory.root), worker: planned.memory.worker === null ? null : need(planned.memory.worker) },
    };
    const workers = distributed ? planned.nodes - 1 : 0;
    return { ...plan, containers: launcher.containers(plan, ports, modelPath, workerAddresses(req.instance, req.namespace, workers, ports.worker)) };
  }

  /**
   * The engine of a pool no `Dllama` sizes: a distributed one when the runtime's default
   * topology has several nodes and the model has its artifact, else the first whose artifact the
   * model has.
   */
  function defaultEngine(ready: ReadyModel): EngineKind {
    const has = (e: EngineKind) => ready.artifacts.some((a) => a.format === engineOf(e).format);
    const engines = kubernetesEngines();
    const wanted = (opts.defaultNodes ?? 1) > 1 ? engines.find((e) => isDistributed(e) && has(e)) : undefined;
    return wanted ?? engines.find((e) => !isDistributed(e) && has(e)) ?? engines.find(has) ?? 'llamacpp';
  }

  /** Applies the instance's objects: the ConfigMap first, then the rest owned by it. */
  /**
   * The instance's objects, in distributed-llama's order: its workers first, and the root only
   * once every worker pod is Ready (listening: `workerListening`), since a root that cannot reach
   * a worker exits at once and would crash-loop while a slow worker pod starts.
   */
  async function applyInstance(p: InstancePlan, signal: AbortSignal): Promise<void> {
    const [configMap, ...rest] = instanceManifests(p);
    const cm = await apply(configMap!);
    if (isDistributed(p.engine)) await createNetworkKey(p, cm.metadata!.uid!);
    if (opts.bridgeSigner) await createNatsCredentials(p, cm.metadata!.uid!);
    const owned = (o: KubeObject) => ({
      ...o,
      metadata: { ...o.metadata, ownerReferences: o.metadata.ownerReferences!.map((r) => ({ ...r, uid: cm.metadata!.uid! })) },
    });
    // Its NetworkPolicy before any pod: no pod of it is reachable before it holds.
    const policies = rest.filter((o) => o.kind === 'NetworkPolicy');
    for (const o of policies) await apply(owned(o));
    const workerObjects = rest.filter((o) => o.metadata.name === `${instanceBase(p.instance)}-w`);
    for (const o of workerObjects) await apply(owned(o));
    if (workerObjects.length > 0) await podsReady(p.namespace, p.instance, p.nodes - 1, signal, 'worker');
    for (const o of rest.filter((x) => !workerObjects.includes(x) && !policies.includes(x))) await apply(owned(o));
  }

  /**
   * Creates the instance's network key (a random 256-bit secret) unless it exists: a start tried
   * again keeps the key its pods may already hold. Only `create` is needed: the worker never reads
   * a Secret back.
   */
  async function createNetworkKey(p: InstancePlan, owner: string): Promise<void> {
    count('create');
    await core.createNamespacedSecret({ namespace: p.namespace, body: networkKeySecret(p, owner, randomBytes(32).toString('hex')) }).catch((err: unknown) => {
      if (code(err) !== 409) throw err;
    });
  }

  /**
   * Creates the NATS user of the instance's bridge unless its Secret exists (a start tried again
   * keeps the user its pods may already hold): a JWT allowed its own instance's requests only
   * (dataplane/roles.ts bridgePermissions), signed with the signer file (read at each start: a
   * rotated file reaches instances started after it). Only `create`: never read back.
   */
  async function createNatsCredentials(p: InstancePlan, owner: string): Promise<void> {
    count('create');
    const text = await bridgeCredentialsText(readNatsSigner(opts.bridgeSigner!), opts.names, p.pool, p.instance);
    await core.createNamespacedSecret({ namespace: p.namespace, body: natsCredentialsSecret(p, owner, text) }).catch((err: unknown) => {
      if (code(err) !== 409) throw err;
    });
  }

  /**
   * Resolves once `expected` pods of the instance are Ready; rejects with the reason when one
   * fails for good, cannot be scheduled for long, the deadline passes, or `signal` aborts.
   */
  function podsReady(namespace: string, instance: string, expected: number, signal: AbortSignal, role?: 'worker'): Promise<void> {
    return new Promise((resolve, reject) => {
      const unschedulableSince = new Map<string, number>();
      const after = opts.unschedulableAfterMs ?? 30_000;
      let settled = false;
      count('watch');
      const finish = (err?: Error) => {
        if (settled) return;
        settled = true;
        clearTimeout(deadline);
        clearInterval(tick);
        signal.removeEventListener('abort', onAbort);
        void w.stop().then(() => (err ? reject(err) : resolve()));
      };
      const check = () => {
        const pods = w.list();
        for (const p of pods) {
          const failure = podFailure(p);
          if (failure) return finish(runtimeError(RuntimeErrorType.InstanceFailed, failure));
          const why = unschedulable(p);
          const name = p.metadata!.name!;
          if (!why) unschedulableSince.delete(name);
          else {
            const since = unschedulableSince.get(name) ?? Date.now();
            unschedulableSince.set(name, since);
            if (Date.now() - since >= after) return finish(runtimeError(RuntimeErrorType.Unschedulable, `pod ${name} cannot be scheduled: ${why}`));
          }
        }
        if (pods.filter(podReady).length >= expected) finish();
      };
      const w = watchResource<V1Pod>(opts.kc, {
        path: `/api/v1/namespaces/${namespace}/pods`,
        labelSelector: role ? `${instanceSelector(instance)},${ROLE_LABEL}=${role}` : instanceSelector(instance),
        onEvent: check,
        onSynced: check,
        log,
      });
      // Unschedulable for long is a matter of time passing, not of events.
      const tick = setInterval(check, 1000);
      const deadline = setTimeout(
        () =>
          finish(
            runtimeError(
              RuntimeErrorType.StartTimedOut,
              `instance ${instance}: not every pod was Ready within ${Math.round((opts.startTimeoutMs ?? 30 * 60_000) / 1000)}s`,
            ),
          ),
        opts.startTimeoutMs ?? 30 * 60_000,
      );
      const onAbort = () => finish(signal.reason instanceof Error ? signal.reason : new Error('aborted'));
      if (signal.aborted) onAbort();
      else signal.addEventListener('abort', onAbort, { once: true });
    });
  }

  async function destroy(pool: string, instance: string, namespace?: string): Promise<void> {
    const base = instanceBase(instance);
    const namespaces = namespace ? [namespace] : await namespacesOf(instance);
    for (const ns of namespaces) {
      count('delete');
      await core.deleteNamespacedConfigMap({ name: base, namespace: ns, propagationPolicy: 'Background' }).catch((err: unknown) => {
        if (code(err) !== 404) throw err;
      });
    }
    // Its pods drain first (README.md, "Draining": the bridge serves what the consumer holds and
    // acks what it finishes): the consumer goes once they are gone, in the background.
    void consumerAfterPods(pool, instance, namespaces);
  }

  /** Deletes the instance's consumer once none of its pods is left (looked at every 2 s, for at most the longest drain). */
  async function consumerAfterPods(pool: string, instance: string, namespaces: string[]): Promise<void> {
    const until = Date.now() + (MAX_DRAIN_SECONDS + DRAIN_MARGIN_SECONDS + 30) * 1000;
    for (;;) {
      const left = await Promise.all(
        namespaces.map((namespace) =>
          core.listNamespacedPod({ namespace, labelSelector: instanceSelector(instance) }).then(
            (l) => l.items.length,
            () => 0,
          ),
        ),
      );
      if (left.every((n) => n === 0) || Date.now() > until || opts.nc.isClosed()) break;
      await new Promise((r) => setTimeout(r, 2000).unref()); // the worker's stop does not wait for it
    }
    // Best effort: the worker may be stopping (NATS draining); a consumer left behind holds nothing.
    await opts.nc
      .jetstreamManager()
      .then((jsm) => deleteInstanceConsumer(jsm, opts.names, { pool, instance }))
      .catch(() => false);
  }

  /** The namespaces holding an instance's ConfigMap (the Runtime interface names no namespace for destroy and describe). */
  async function namespacesOf(instance: string): Promise<string[]> {
    const labelSelector = instanceSelector(instance);
    const list = async (namespace: string | undefined) => {
      count('list');
      const l = namespace ? await core.listNamespacedConfigMap({ namespace, labelSelector }) : await core.listConfigMapForAllNamespaces({ labelSelector });
      return l.items;
    };
    // Namespaced: only where this worker may look (its Roles); else one list over the cluster.
    const items = (await Promise.all((served ?? [undefined]).map(list))).flat();
    return items.filter((c) => c.metadata?.name === instanceBase(instance)).map((c) => c.metadata!.namespace!);
  }

  async function describe(pool: string, instance: string): Promise<InstanceInfo | null> {
    const [ns] = await namespacesOf(instance);
    if (!ns) return null;
    count('list');
    const cm = await core.readNamespacedConfigMap({ name: instanceBase(instance), namespace: ns });
    const expected = Number(cm.data?.nodes ?? '1');
    const pods = (await core.listNamespacedPod({ namespace: ns, labelSelector: instanceSelector(instance) })).items;
    return {
      instance,
      subject: requestSubjectOf(opts.names, pool, instance),
      healthy: pods.filter(podReady).length >= expected && pods.every(podReady),
      ...(cm.data?.revision ? { revision: cm.data.revision } : {}),
      ...specOf(cm.data?.spec),
    };
  }

  return {
    async create(req: InstanceRequest, signal: AbortSignal): Promise<InstanceInfo> {
      const p = await plan(req);
      signal.throwIfAborted();
      log(
        `instance ${req.pool}/${req.instance}: ${p.engine} on ${p.nodes} node(s) in ${p.namespace} (requests ${gib(p.memory.root)} root${p.memory.worker ? `, ${gib(p.memory.worker)} per worker` : ''})`,
      );
      try {
        await applyInstance(p, signal);
        await podsReady(p.namespace, req.instance, p.nodes, signal);
      } catch (err) {
        await destroy(req.pool, req.instance, p.namespace).catch((e: unknown) =>
          log(`instance ${req.pool}/${req.instance}: cleanup after a failed start: ${(e as Error).message}`),
        );
        throw err;
      }
      log(`instance ${req.pool}/${req.instance} is ready`);
      return {
        instance: req.instance,
        subject: requestSubjectOf(opts.names, req.pool, req.instance),
        healthy: true,
        ...(p.revision ? { revision: p.revision } : {}),
        ...(p.shape ? { spec: p.shape } : {}),
      };
    },
    destroy: (pool, instance) => destroy(pool, instance),
    describe,
    async watch(pool: string, instance: string, signal: AbortSignal, alive: () => void): Promise<string> {
      const [ns] = await namespacesOf(instance);
      if (!ns) return `instance ${instance} is gone`;
      const cm = await core.readNamespacedConfigMap({ name: instanceBase(instance), namespace: ns });
      const expected = Number(cm.data?.nodes ?? '1');
      return new Promise<string>((resolve, reject) => {
        let done = false;
        let synced = false;
        count('watch');
        const finish = (reason: string | Error) => {
          if (done) return;
          done = true;
          clearInterval(beat);
          signal.removeEventListener('abort', onAbort);
          void w.stop().then(() => (typeof reason === 'string' ? resolve(reason) : reject(reason)));
        };
        const check = () => {
          if (!synced) return;
          const pods = w.list();
          const bad = pods.find((p) => !podReady(p));
          if (bad) return finish(`pod ${bad.metadata?.name} of instance ${instance} is not ready${bad.metadata?.deletionTimestamp ? ' (being deleted)' : ''}`);
          if (pods.length < expected) return finish(`instance ${instance} has ${pods.length} of ${expected} pods`);
        };
        const w = watchResource<V1Pod>(opts.kc, {
          path: `/api/v1/namespaces/${ns}/pods`,
          labelSelector: instanceSelector(instance),
          onEvent: (type, p) => (type === 'DELETED' ? finish(`pod ${p.metadata?.name} of instance ${instance} was deleted`) : check()),
          onSynced: () => {
            synced = true;
            check();
          },
          log,
        });
        const beat = setInterval(alive, 2000);
        alive();
        const onAbort = () => finish(signal.reason instanceof Error ? signal.reason : new Error('cancelled'));
        if (signal.aborted) onAbort();
        else signal.addEventListener('abort', onAbort, { once: true });
      });
    },
    requests: () => ({ ...counts }),
    // The instances are the cluster's: their bridges run in their pods, and they outlive the worker.
    bridges: () => [],
    stopAll: () => Promise.resolve(),
  };
}

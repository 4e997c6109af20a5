/**
 * `magus controller`'s core: it watches `Model` and `Dllama` resources and API-token Secrets and
 * turns what it sees into the entity workflows' inputs. It does no work itself: downloads,
 * conversions, pools and status writes happen in workflows and their activities.
 *
 * - A spec change (`metadata.generation` above the status's `observedGeneration`) becomes one
 *   signal-with-start of `model/<ns>/<name>` (or the model's pool) with the request id
 *   `<uid>/<generation>`: Temporal de-duplicates a repeat of it, and the workflow ignores a
 *   generation it has applied, so a restarted controller, or a second replica, starts nothing twice.
 * - Deletion goes through the `magus.dev/cleanup` finalizer: the workflow is told to stop (and,
 *   for a Model, to forget it and, with `deletionPolicy: Delete`, remove its S3 objects); once
 *   it has closed the finalizer goes. A cleanup that does not finish within `cleanupTimeoutMs`
 *   of the deletion is ended (the workflow terminated), reported by a Warning Event, and the
 *   finalizer removed: deletion never hangs for ever.
 * - API keys (`ApiKey` resources, and Secrets labelled `magus.dev/api-token=true` until the next
 *   release) become `magus_tokens` entries, each token id registered once (keys.ts).
 */
import { CoreV1Api, CustomObjectsApi, PatchStrategy, setHeaderOptions, type KubeConfig } from '@kubernetes/client-node';
import { WorkflowNotFoundError, type Client } from '@temporalio/client';
import { defaultPayloadConverter } from '@temporalio/common';
import { temporal } from '@temporalio/proto';
import type { KV } from 'nats';
import { recordEvent } from '../kube/events';
import { watchResource, type ResourceWatch } from '../kube/watch';
import { CRD_GROUP, CRD_VERSION, poolQueueFor, WorkflowSummary } from '../shared/constants';
import { engineOf } from '../shared/engines';
import { FieldManager, FINALIZER, Kind, parseDuration, Plural, type DllamaResource, type ModelResource } from '../shared/kube';
import type { ModelPipelineInput, ModelSpec } from '../shared/model';
import { cancelSignal, modelWorkflowId, type ResourceChange } from '../workflows/model/definitions';
import { poolResourceSignal, poolWorkflowId, type PoolInput, type PoolResource } from '../workflows/pool/definitions';
import { startKeys, type Keys } from './keys';
import { WorkQueue, type Requeue } from './queue';
import { startSessionMirror, type SessionMirror } from './sessions';

export interface ControllerOptions {
  kc: KubeConfig;
  temporal: { client: Client; namespace: string; taskQueue: string };
  /** The `magus_tokens` bucket; without it ApiKeys and token Secrets are not watched. */
  tokens?: KV;
  /** Namespaces whose models an ApiKey of any namespace may name (default: none). */
  sharedModelNamespaces?: readonly string[];
  /** The `magus_sessions` bucket and how many Sessions to mirror at most (0: none). */
  sessions?: { kv: KV; cap: number };
  /** Only this namespace (default: all namespaces). */
  namespace?: string;
  /** Reconciles at once (default 16). */
  concurrency?: number;
  /** How long after a deletion its cleanup may take before it is cut short (default 2 min). */
  cleanupTimeoutMs?: number;
  log?: (line: string) => void;
}

export interface ControllerMetrics {
  signals: number;
  reconciles: number;
  failures: number;
  finalizersRemoved: number;
  cleanupsTimedOut: number;
  tokensWritten: number;
  tokensRemoved: number;
  /** Keys refused because another key holds their token id. */
  tokenConflicts: number;
  watches: Record<string, ResourceWatch<unknown>['stats']>;
  sessions?: SessionMirror['stats'];
}

export interface Controller {
  /** Resolves once every watch has delivered its first list. */
  readonly synced: Promise<void>;
  metrics(): ControllerMetrics;
  /** Nothing queued or running (tests and the bench wait on it). */
  idle(): Promise<void>;
  /** The Session mirror has made a complete pass after this call. */
  sessionsSettled(): Promise<void>;
  stop(): Promise<void>;
}

const applyHeaders = setHeaderOptions('Content-Type', PatchStrategy.ServerSideApply);
const jsonPatchHeaders = setHeaderOptions('Content-Type', PatchStrategy.JsonPatch);
const { WorkflowIdConflictPolicy, WorkflowIdReusePolicy, TaskQueueKind } = temporal.api.enums.v1;

/** A `Model`'s spec as the pipeline takes it: the token becomes a reference to the Secret. */
export function modelSpecOf(m: ModelResource): ModelSpec {
  const { source, artifacts, contextLength, rerun } = m.spec;
  const tokenRef = source.tokenSecretRef ? { secret: { name: source.tokenSecretRef.name, key: source.tokenSecretRef.key ?? 'token', namespace: m.metadata.namespace } } : undefined;
  return {
    source: {
      repo: source.repo,
      ...(source.revision ? { revision: source.revision } : {}),
      ...(source.hubUrl ? { hubUrl: source.hubUrl } : {}),
      ...(tokenRef ? { tokenRef } : {}),
      ...(source.gguf ? { gguf: { ...(source.gguf.file !== undefined ? { file: source.gguf.file } : {}), ...(source.gguf.quantization !== undefined ? { quantization: source.gguf.quantization } : {}) } } : {}),
    },
    artifacts: artifacts.map((a) => ({ format: a.format, weights: a.weights })),
    ...(contextLength !== undefined ? { contextLength } : {}),
    ...(rerun ? { rerun } : {}),
  };
}

/** A `Dllama` as its pool takes it: `replicas` instances kept, up to `maxReplicas` on demand. */
export function poolResourceOf(d: DllamaResource): PoolResource {
  return {
    name: d.metadata.name,
    uid: d.metadata.uid,
    generation: d.metadata.generation,
    minInstances: d.spec.replicas,
    maxInstances: d.spec.maxReplicas,
    leasesPerInstance: d.spec.leasesPerInstance,
    idleTimeoutMs: parseDuration(d.spec.idleTimeout) ?? 600_000,
    nodesPerInstance: engineOf(d.spec.engine).topology === 'single' ? 1 : 2 ** d.spec.nodesPower,
  };
}

const errCode = (err: unknown): number | undefined => (err as { code?: number }).code;

export function startController(opts: ControllerOptions): Controller {
  const log = opts.log ?? (() => undefined);
  const custom = opts.kc.makeApiClient(CustomObjectsApi);
  const core = opts.kc.makeApiClient(CoreV1Api);
  const { client, taskQueue } = opts.temporal;
  const cleanupTimeoutMs = opts.cleanupTimeoutMs ?? 120_000;
  const m = { signals: 0, reconciles: 0, failures: 0, finalizersRemoved: 0, cleanupsTimedOut: 0 };
  /** uid → the last generation signalled (a status that has not caught up yet does not re-signal). */
  const signalled = new Map<string, number>();
  /** uid of resources whose workflow was told to stop. */
  const cancelled = new Set<string>();
  /** uid → generation of a Dllama refused because another one serves its model (reported once). */
  const conflicts = new Map<string, number>();

  const queue = new WorkQueue((key) => reconcile(key), {
    concurrency: opts.concurrency ?? 64,
    onError: (key, err, attempt) => {
      m.failures++;
      log(`${key}: ${(err as Error).message} (attempt ${attempt}; retrying with backoff)`);
    },
  });
  const scope = opts.namespace ? `/namespaces/${opts.namespace}` : '';
  const keyOf = (kind: string, o: { metadata?: { namespace?: string; name?: string } }) => `${kind}/${o.metadata?.namespace}/${o.metadata?.name}`;
  // An API server restart takes seconds: come back within a few seconds of it, not half a minute.
  const backoff = { initialMs: 250, maxMs: 5000 };

  const models = watchResource<ModelResource>(opts.kc, {
    path: `/apis/${CRD_GROUP}/${CRD_VERSION}${scope}/${Plural.model}`,
    onEvent: (type, o) => {
      if (type !== 'DELETED') return queue.add(keyOf(Kind.model, o));
      // Gone without our finalizer (deleted before it landed, or removed by hand): its pipeline
      // is stopped and forgotten all the same, best effort.
      if (!o.metadata.finalizers?.includes(FINALIZER) && !cancelled.has(o.metadata.uid)) {
        void client.workflow
          .getHandle(modelWorkflowId(o.metadata.namespace, o.metadata.name))
          .signal(cancelSignal, { forget: true, deleteObjects: o.spec.deletionPolicy === 'Delete', uid: o.metadata.uid })
          .catch(() => undefined);
      }
      signalled.delete(o.metadata.uid);
      cancelled.delete(o.metadata.uid);
    },
    log: (l) => log(`watch models: ${l}`),
    backoff,
  });
  const dllamas = watchResource<DllamaResource>(opts.kc, {
    path: `/apis/${CRD_GROUP}/${CRD_VERSION}${scope}/${Plural.dllama}`,
    onEvent: (type, o) => {
      if (type !== 'DELETED') queue.add(keyOf(Kind.dllama, o));
      // A refused Dllama of the same model may take over once this one is going or gone.
      if (type === 'DELETED' || o.metadata.deletionTimestamp) {
        for (const x of dllamas.list()) if (x.metadata.namespace === o.metadata.namespace && x.spec.model === o.spec.model && x.metadata.uid !== o.metadata.uid) queue.add(keyOf(Kind.dllama, x));
      }
    },
    log: (l) => log(`watch dllamas: ${l}`),
    backoff,
  });
  const watches: Record<string, ResourceWatch<unknown>> = { models, dllamas };

  const keys: Keys | undefined = opts.tokens
    ? startKeys({ kc: opts.kc, core, custom, kv: opts.tokens, namespace: opts.namespace, sharedModelNamespaces: opts.sharedModelNamespaces, backoff, log })
    : undefined;
  if (keys) Object.assign(watches, keys.watches);

  /** One signal-with-start with a request id of our own (the SDK's is random), so a repeat is de-duplicated. */
  async function signalWithStart(workflowType: string, workflowId: string, input: unknown, signalName: string, signal: unknown, requestId: string, summary: string): Promise<void> {
    m.signals++;
    await client.workflowService.signalWithStartWorkflowExecution({
      namespace: opts.temporal.namespace,
      identity: 'magus-controller',
      requestId,
      workflowId,
      workflowType: { name: workflowType },
      // Pools run on a task queue of their own (a pool already running keeps its queue).
      taskQueue: { name: workflowType === 'dllamaPool' ? poolQueueFor(taskQueue) : taskQueue, kind: TaskQueueKind.TASK_QUEUE_KIND_NORMAL },
      input: { payloads: [defaultPayloadConverter.toPayload(input)] },
      signalName,
      signalInput: { payloads: [defaultPayloadConverter.toPayload(signal)] },
      workflowIdReusePolicy: WorkflowIdReusePolicy.WORKFLOW_ID_REUSE_POLICY_ALLOW_DUPLICATE,
      workflowIdConflictPolicy: WorkflowIdConflictPolicy.WORKFLOW_ID_CONFLICT_POLICY_USE_EXISTING,
      // The Temporal UI's summary of the workflow (kept from its first start).
      userMetadata: { summary: defaultPayloadConverter.toPayload(summary) },
    });
  }

  async function addFinalizer(plural: string, kind: string, o: ModelResource | DllamaResource): Promise<void> {
    const body = { apiVersion: `${CRD_GROUP}/${CRD_VERSION}`, kind, metadata: { name: o.metadata.name, namespace: o.metadata.namespace, uid: o.metadata.uid, finalizers: [FINALIZER] } };
    await custom.patchNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: o.metadata.namespace, plural, name: o.metadata.name, body, fieldManager: FieldManager.controller, force: true }, applyHeaders);
  }

  async function removeFinalizer(plural: string, o: ModelResource | DllamaResource): Promise<void> {
    const finalizers = o.metadata.finalizers ?? [];
    // `test` makes the patch fail (and the key retry) if someone changed the list meanwhile.
    const body = [
      { op: 'test', path: '/metadata/finalizers', value: finalizers },
      { op: 'replace', path: '/metadata/finalizers', value: finalizers.filter((f) => f !== FINALIZER) },
    ];
    try {
      await custom.patchNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: o.metadata.namespace, plural, name: o.metadata.name, body }, jsonPatchHeaders);
      m.finalizersRemoved++;
    } catch (err) {
      if (errCode(err) !== 404) throw err;
    }
  }

  /** Whether the workflow still runs (false when it never existed or has closed). */
  async function running(workflowId: string): Promise<boolean> {
    try {
      return (await client.workflow.getHandle(workflowId).describe()).status.name === 'RUNNING';
    } catch (err) {
      if (err instanceof WorkflowNotFoundError) return false;
      throw err;
    }
  }

  async function reconcile(key: string): Promise<Requeue | void> {
    m.reconciles++;
    const [kind, namespace, name] = key.split('/') as [string, string, string];
    if (kind === Kind.model) {
      const o = models.get(namespace, name);
      return o ? reconcileModel(o) : undefined;
    }
    const o = dllamas.get(namespace, name);
    return o ? reconcileDllama(o) : undefined;
  }

  async function reconcileModel(o: ModelResource): Promise<Requeue | void> {
    const { namespace, name, uid, generation } = o.metadata;
    const workflowId = modelWorkflowId(namespace, name);
    if (o.metadata.deletionTimestamp) {
      if (!o.metadata.finalizers?.includes(FINALIZER)) return;
      if (await running(workflowId)) {
        if (!cancelled.has(uid)) {
          await client.workflow.getHandle(workflowId).signal(cancelSignal, { forget: true, deleteObjects: o.spec.deletionPolicy === 'Delete', uid });
          cancelled.add(uid);
        }
        if (Date.now() - Date.parse(o.metadata.deletionTimestamp) < cleanupTimeoutMs) return { afterMs: 1000 };
        await client.workflow.getHandle(workflowId).terminate(`cleanup of Model ${namespace}/${name} did not finish within ${cleanupTimeoutMs / 1000}s`);
        m.cleanupsTimedOut++;
        await recordEvent(core, Kind.model, o.metadata, 'Warning', 'CleanupTimedOut', `the pipeline did not stop within ${cleanupTimeoutMs / 1000}s of the deletion; it was terminated (partial uploads and S3 objects may remain)`);
      }
      await removeFinalizer(Plural.model, o);
      // Marked done for the DELETED event that follows, which then has nothing left to do.
      cancelled.add(uid);
      signalled.delete(uid);
      return;
    }
    const finalizer = o.metadata.finalizers?.includes(FINALIZER) ? undefined : addFinalizer(Plural.model, Kind.model, o);
    if (generation > (o.status?.observedGeneration ?? 0) && generation > (signalled.get(uid) ?? 0)) {
      const spec = modelSpecOf(o);
      const input: ModelPipelineInput = { namespace, name, spec, resource: { uid, generation } };
      const change: ResourceChange = { uid, generation, spec };
      // The signal does not wait for the finalizer (both are needed; a failure of either retries
      // the key). A Model deleted before its finalizer landed is cancelled from its DELETED event.
      await Promise.all([signalWithStart('modelPipeline', workflowId, input, 'resourceChanged', change, `${uid}/${generation}`, WorkflowSummary.model(namespace, name, spec.source.repo)), finalizer]);
      signalled.set(uid, generation);
    } else await finalizer;
  }

  async function reconcileDllama(d: DllamaResource): Promise<Requeue | void> {
    const { namespace, uid, generation } = d.metadata;
    const workflowId = poolWorkflowId(namespace, d.spec.model);
    const resource = poolResourceOf(d);
    if (d.metadata.deletionTimestamp) {
      if (!d.metadata.finalizers?.includes(FINALIZER)) return;
      // The pool serves the model for whoever asks; without its resource it may scale to zero.
      if (await running(workflowId)) await client.workflow.getHandle(workflowId).signal(poolResourceSignal, { ...resource, deleted: true });
      await removeFinalizer(Plural.dllama, d);
      signalled.delete(uid);
      return;
    }
    if (!d.metadata.finalizers?.includes(FINALIZER)) await addFinalizer(Plural.dllama, Kind.dllama, d);
    // One pool per model: the oldest Dllama of a model sizes it; a later one is refused, visibly.
    const owner = dllamas
      .list()
      .filter((x) => x.metadata.namespace === namespace && x.spec.model === d.spec.model && !x.metadata.deletionTimestamp)
      .sort((a, b) => (a.metadata.creationTimestamp ?? '').localeCompare(b.metadata.creationTimestamp ?? '') || a.metadata.name.localeCompare(b.metadata.name))[0];
    if (owner && owner.metadata.uid !== uid) {
      if (conflicts.get(uid) !== generation) {
        conflicts.set(uid, generation);
        await recordEvent(core, Kind.dllama, d.metadata, 'Warning', 'PoolConflict', `Dllama ${owner.metadata.name} already serves model ${d.spec.model} in ${namespace}; this one is ignored until it is gone`);
      }
      return;
    }
    conflicts.delete(uid);
    if (generation <= (d.status?.observedGeneration ?? 0) || generation <= (signalled.get(uid) ?? 0)) return;
    const input: PoolInput = { namespace, model: d.spec.model, minInstances: resource.minInstances, maxInstances: resource.maxInstances, leasesPerInstance: resource.leasesPerInstance, idleTimeoutMs: resource.idleTimeoutMs, resource };
    await signalWithStart('dllamaPool', workflowId, input, 'resourceChanged', resource, `${uid}/${generation}`, WorkflowSummary.pool(namespace, d.spec.model));
    signalled.set(uid, generation);
  }

  const sessionMirror = opts.sessions && opts.sessions.cap > 0 ? startSessionMirror({ kc: opts.kc, kv: opts.sessions.kv, cap: opts.sessions.cap, namespace: opts.namespace, log }) : undefined;

  const synced = Promise.all(Object.values(watches).map((w) => w.synced)).then(() => undefined);
  return {
    synced,
    metrics: () => ({ ...m, tokensWritten: keys?.metrics.tokensWritten ?? 0, tokensRemoved: keys?.metrics.tokensRemoved ?? 0, tokenConflicts: keys?.metrics.tokenConflicts ?? 0, watches: Object.fromEntries(Object.entries(watches).map(([k, w]) => [k, w.stats])), ...(sessionMirror ? { sessions: { ...sessionMirror.stats } } : {}) }),
    sessionsSettled: () => sessionMirror?.settled() ?? Promise.resolve(),
    async idle() {
      await synced;
      await queue.drained();
      await keys?.drained();
    },
    async stop() {
      queue.stop();
      await sessionMirror?.stop();
      await keys?.stop();
      await Promise.all(Object.values(watches).map((w) => w.stop()));
    },
  };
}

/**
 * A `Dllama` → the `dllamaPool` workflow of its model (`pool/<ns>/<model>`).
 *
 * - One pool per model: the oldest Dllama of a model (by creation, then name) sizes it; a later
 *   one is refused, visibly (a `PoolConflict` Warning Event, once per generation), and takes over
 *   once the owner is being deleted or gone.
 * - A spec change of the owner is one signal-with-start of `resourceChanged` with request id
 *   `<uid>/<generation>`, as for a Model.
 * - Deletion waits on the finalizer: the pool is told its resource is gone (it keeps serving the
 *   model for whoever asks, and may scale to zero), then the finalizer goes.
 * - A distributed-llama Dllama's `Splittable` condition says whether its model runs on the nodes
 *   it asks for, naming the dimension when not (kube/status.ts `dllamaSplitCondition`, from the
 *   Model's status): written by server-side apply of that one condition under the controller's
 *   field manager (the pool's status writes own the others), when it changes — the Dllama's own
 *   changes and its Model's both bring it here — with a `CannotSplit` Warning Event when it turns
 *   False.
 */
import { PatchStrategy, setHeaderOptions, type CoreV1Api, type CustomObjectsApi } from '@kubernetes/client-node';
import { recordEvent } from '../kube/events';
import { dllamaSplitCondition, mergeConditions } from '../kube/status';
import type { WatchEventType } from '../kube/watch';
import { CRD_GROUP, CRD_VERSION, WorkflowSummary } from '../shared/constants';
import { isDistributed } from '../shared/engines';
import {
  DllamaCondition,
  drainTimeoutMsOf,
  instanceSpecOf,
  FieldManager,
  Kind,
  parseDuration,
  Plural,
  type DllamaResource,
  type ModelResource,
} from '../shared/kube';
import { poolResourceSignal, poolWorkflowId, type PoolInput, type PoolResource } from '../workflows/pool/definitions';
import { Finalizers } from './finalizers';
import type { Requeue } from './queue';
import type { WorkflowSignals } from './signals';

/** A `Dllama` as its pool takes it: `replicas` instances kept, up to `maxReplicas` on demand. */
export function poolResourceOf(d: DllamaResource): PoolResource {
  const drainTimeoutMs = drainTimeoutMsOf(d.spec);
  return {
    name: d.metadata.name,
    uid: d.metadata.uid,
    generation: d.metadata.generation,
    minInstances: d.spec.replicas,
    maxInstances: d.spec.maxReplicas,
    leasesPerInstance: d.spec.leasesPerInstance,
    idleTimeoutMs: parseDuration(d.spec.idleTimeout) ?? 600_000,
    nodesPerInstance: isDistributed(d.spec.engine) ? 2 ** d.spec.nodesPower : 1,
    ...(drainTimeoutMs !== null ? { drainTimeoutMs } : {}),
    instanceSpec: instanceSpecOf(d).digest,
  };
}

export interface DllamaReconcilerDeps {
  workflows: WorkflowSignals;
  finalizers: Finalizers;
  core: CoreV1Api;
  /** Writes the `Splittable` condition (the status subresource). */
  custom: CustomObjectsApi;
  /** Every Dllama the controller sees (its watch's cache). */
  dllamas: () => readonly DllamaResource[];
  /** A Model as the controller's watch holds it. */
  model: (namespace: string, name: string) => ModelResource | undefined;
}

const applyHeaders = setHeaderOptions('Content-Type', PatchStrategy.ServerSideApply);
const errCode = (err: unknown): number | undefined => (err as { code?: number }).code;

export class DllamaReconciler {
  /** uid → the last generation signalled (a status that has not caught up yet does not re-signal). */
  private readonly signalled = new Map<string, number>();
  /** uid → generation of a Dllama refused because another one serves its model (reported once). */
  private readonly conflicts = new Map<string, number>();
  /**
   * uids whose pool was told they are being deleted: a copy that still holds the finalizer,
   * reconciled again before its removal shows (the pool's own status write brings one), does not
   * tell it twice.
   */
  private readonly deletionSent = new Set<string>();

  constructor(private readonly deps: DllamaReconcilerDeps) {}

  /** The Dllamas of a Model (to reconcile when it changes: their `Splittable` condition follows its status). */
  servingModel(m: ModelResource): DllamaResource[] {
    return this.deps.dllamas().filter((x) => x.metadata.namespace === m.metadata.namespace && x.spec.model === m.metadata.name);
  }

  /** The other Dllamas of `d`'s model, which may take its pool over now that `d` is going or gone (none otherwise). */
  rivalsFreedBy(type: WatchEventType, d: DllamaResource): DllamaResource[] {
    if (type !== 'DELETED' && !d.metadata.deletionTimestamp) return [];
    return this.deps
      .dllamas()
      .filter((x) => x.metadata.namespace === d.metadata.namespace && x.spec.model === d.spec.model && x.metadata.uid !== d.metadata.uid);
  }

  /** `d` is gone from the API (its DELETED event): nothing more is kept of it. */
  deleted(d: DllamaResource): void {
    const { uid } = d.metadata;
    this.deletionSent.delete(uid);
    this.signalled.delete(uid);
    this.conflicts.delete(uid);
  }

  async reconcile(d: DllamaResource): Promise<Requeue | void> {
    const { namespace, uid, generation } = d.metadata;
    const { workflows, finalizers, core } = this.deps;
    const workflowId = poolWorkflowId(namespace, d.spec.model);
    const resource = poolResourceOf(d);
    if (d.metadata.deletionTimestamp) {
      if (!Finalizers.held(d)) return;
      // The pool serves the model for whoever asks; without its resource it may scale to zero.
      if (!this.deletionSent.has(uid) && (await workflows.running(workflowId))) {
        await workflows.handle(workflowId).signal(poolResourceSignal, { ...resource, deleted: true });
        this.deletionSent.add(uid);
      }
      await finalizers.remove(Plural.dllama, d);
      this.signalled.delete(uid);
      return;
    }
    if (!Finalizers.held(d)) await finalizers.add(Plural.dllama, Kind.dllama, d);
    const owner = this.ownerOf(d);
    if (owner && owner.metadata.uid !== uid) {
      if (this.conflicts.get(uid) !== generation) {
        this.conflicts.set(uid, generation);
        await recordEvent(
          core,
          Kind.dllama,
          d.metadata,
          'Warning',
          'PoolConflict',
          `Dllama ${owner.metadata.name} already serves model ${d.spec.model} in ${namespace}; this one is ignored until it is gone`,
        );
      }
      return;
    }
    this.conflicts.delete(uid);
    await this.writeSplittable(d);
    if (generation <= (d.status?.observedGeneration ?? 0) || generation <= (this.signalled.get(uid) ?? 0)) return;
    const input: PoolInput = {
      namespace,
      model: d.spec.model,
      minInstances: resource.minInstances,
      maxInstances: resource.maxInstances,
      leasesPerInstance: resource.leasesPerInstance,
      idleTimeoutMs: resource.idleTimeoutMs,
      ...(resource.drainTimeoutMs !== undefined ? { drainTimeoutMs: resource.drainTimeoutMs } : {}),
      // Sized on requests in flight or queued, not on live conversations (workflows/pool/state.ts, "Scaling").
      scaleOn: 'load',
      resource,
    };
    await workflows.signalWithStart({
      workflowType: 'dllamaPool',
      workflowId,
      input,
      signalName: 'resourceChanged',
      signal: resource,
      requestId: `${uid}/${generation}`,
      summary: WorkflowSummary.pool(namespace, d.spec.model),
    });
    this.signalled.set(uid, generation);
  }

  /** Applies `d`'s `Splittable` condition when it differs from the one it has (see the module comment). */
  private async writeSplittable(d: DllamaResource): Promise<void> {
    const { namespace, name, uid, generation } = d.metadata;
    const next = dllamaSplitCondition(d, this.deps.model(namespace, d.spec.model));
    if (!next) return;
    const previous = d.status?.conditions ?? [];
    const now = previous.find((c) => c.type === DllamaCondition.splittable);
    if (now && now.status === next.status && now.reason === next.reason && now.message === next.message && now.observedGeneration === next.observedGeneration)
      return;
    const [condition] = mergeConditions([next], previous, new Date().toISOString().replace(/\.\d{3}Z$/, 'Z'));
    try {
      await this.deps.custom.patchNamespacedCustomObjectStatus(
        {
          group: CRD_GROUP,
          version: CRD_VERSION,
          namespace,
          plural: Plural.dllama,
          name,
          fieldManager: FieldManager.controller,
          force: true,
          body: { apiVersion: `${CRD_GROUP}/${CRD_VERSION}`, kind: Kind.dllama, metadata: { name, namespace, uid }, status: { conditions: [condition] } },
        },
        applyHeaders,
      );
    } catch (err) {
      // Deleted meanwhile (or re-created: the uid does not match): its events take over.
      if (errCode(err) === 404 || errCode(err) === 409) return;
      throw err;
    }
    if (next.status === 'False' && (now?.status !== 'False' || now.message !== next.message || now.observedGeneration !== generation)) {
      await recordEvent(this.deps.core, Kind.dllama, d.metadata, 'Warning', next.reason, next.message);
    }
  }

  /** The Dllama that sizes the pool of `d`'s model: the oldest not being deleted. */
  private ownerOf(d: DllamaResource): DllamaResource | undefined {
    return this.deps
      .dllamas()
      .filter((x) => x.metadata.namespace === d.metadata.namespace && x.spec.model === d.spec.model && !x.metadata.deletionTimestamp)
      .sort(
        (a, b) => (a.metadata.creationTimestamp ?? '').localeCompare(b.metadata.creationTimestamp ?? '') || a.metadata.name.localeCompare(b.metadata.name),
      )[0];
  }
}

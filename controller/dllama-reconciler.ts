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
 */
import type { CoreV1Api } from '@kubernetes/client-node';
import { recordEvent } from '../kube/events';
import type { WatchEventType } from '../kube/watch';
import { WorkflowSummary } from '../shared/constants';
import { isDistributed } from '../shared/engines';
import { Kind, parseDuration, Plural, type DllamaResource } from '../shared/kube';
import { poolResourceSignal, poolWorkflowId, type PoolInput, type PoolResource } from '../workflows/pool/definitions';
import { Finalizers } from './finalizers';
import type { Requeue } from './queue';
import type { WorkflowSignals } from './signals';

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
    nodesPerInstance: isDistributed(d.spec.engine) ? 2 ** d.spec.nodesPower : 1,
  };
}

export interface DllamaReconcilerDeps {
  workflows: WorkflowSignals;
  finalizers: Finalizers;
  core: CoreV1Api;
  /** Every Dllama the controller sees (its watch's cache). */
  dllamas: () => readonly DllamaResource[];
}

export class DllamaReconciler {
  /** uid → the last generation signalled (a status that has not caught up yet does not re-signal). */
  private readonly signalled = new Map<string, number>();
  /** uid → generation of a Dllama refused because another one serves its model (reported once). */
  private readonly conflicts = new Map<string, number>();

  constructor(private readonly deps: DllamaReconcilerDeps) {}

  /** The other Dllamas of `d`'s model, which may take its pool over now that `d` is going or gone (none otherwise). */
  rivalsFreedBy(type: WatchEventType, d: DllamaResource): DllamaResource[] {
    if (type !== 'DELETED' && !d.metadata.deletionTimestamp) return [];
    return this.deps
      .dllamas()
      .filter((x) => x.metadata.namespace === d.metadata.namespace && x.spec.model === d.spec.model && x.metadata.uid !== d.metadata.uid);
  }

  async reconcile(d: DllamaResource): Promise<Requeue | void> {
    const { namespace, uid, generation } = d.metadata;
    const { workflows, finalizers, core } = this.deps;
    const workflowId = poolWorkflowId(namespace, d.spec.model);
    const resource = poolResourceOf(d);
    if (d.metadata.deletionTimestamp) {
      if (!Finalizers.held(d)) return;
      // The pool serves the model for whoever asks; without its resource it may scale to zero.
      if (await workflows.running(workflowId)) await workflows.handle(workflowId).signal(poolResourceSignal, { ...resource, deleted: true });
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
    if (generation <= (d.status?.observedGeneration ?? 0) || generation <= (this.signalled.get(uid) ?? 0)) return;
    const input: PoolInput = {
      namespace,
      model: d.spec.model,
      minInstances: resource.minInstances,
      maxInstances: resource.maxInstances,
      leasesPerInstance: resource.leasesPerInstance,
      idleTimeoutMs: resource.idleTimeoutMs,
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

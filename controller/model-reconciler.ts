/**
 * A `Model` → its `modelPipeline` workflow (`model/<ns>/<name>`).
 *
 * - A spec change (`metadata.generation` above the status's `observedGeneration`, and above the
 *   generation this process signalled last, since the status catches up later) is one
 *   signal-with-start of `resourceChanged` with request id `<uid>/<generation>`; the pipeline
 *   ignores a generation it has applied.
 * - Deletion waits on the finalizer: the pipeline is told to stop and forget the model (and,
 *   with `deletionPolicy: Delete`, to remove its S3 objects); once it has closed the finalizer
 *   goes. A cleanup still running `cleanupTimeoutMs` after the deletion is ended (the workflow
 *   terminated), reported by a Warning Event, and the finalizer removed: deletion never hangs.
 * - A Model gone without the finalizer (deleted before it landed, or removed by hand) has its
 *   pipeline stopped and forgotten all the same, best effort, from its DELETED event.
 */
import type { CoreV1Api } from '@kubernetes/client-node';
import { recordEvent } from '../kube/events';
import { WorkflowSummary } from '../shared/constants';
import { Kind, Plural, type ModelResource } from '../shared/kube';
import type { ModelPipelineInput, ModelSpec } from '../shared/model';
import { SAMPLING_FIELDS } from '../shared/sampling';
import { cancelSignal, modelWorkflowId, type ResourceChange } from '../workflows/model/definitions';
import { Finalizers } from './finalizers';
import type { Requeue } from './queue';
import type { WorkflowSignals } from './signals';

/** A `Model`'s spec as the pipeline takes it: the token becomes a reference to the Secret. */
export function modelSpecOf(m: ModelResource): ModelSpec {
  const { source, artifacts, contextLength, rerun, sampling } = m.spec;
  const tokenRef = source.tokenSecretRef
    ? { secret: { name: source.tokenSecretRef.name, key: source.tokenSecretRef.key ?? 'token', namespace: m.metadata.namespace } }
    : undefined;
  // The fields the CRD declares, in one order: the pipeline compares specs as JSON.
  const defaults = SAMPLING_FIELDS.filter((f) => sampling?.[f] !== undefined).map((f) => [f, sampling![f]!] as const);
  return {
    source: {
      repo: source.repo,
      ...(source.revision ? { revision: source.revision } : {}),
      ...(source.hubUrl ? { hubUrl: source.hubUrl } : {}),
      ...(tokenRef ? { tokenRef } : {}),
      ...(source.gguf
        ? {
            gguf: {
              ...(source.gguf.file !== undefined ? { file: source.gguf.file } : {}),
              ...(source.gguf.quantization !== undefined ? { quantization: source.gguf.quantization } : {}),
            },
          }
        : {}),
    },
    artifacts: artifacts.map((a) => ({ format: a.format, weights: a.weights })),
    ...(contextLength !== undefined ? { contextLength } : {}),
    ...(rerun ? { rerun } : {}),
    ...(defaults.length > 0 ? { sampling: Object.fromEntries(defaults) } : {}),
  };
}

export interface ModelReconcilerDeps {
  workflows: WorkflowSignals;
  finalizers: Finalizers;
  core: CoreV1Api;
  /** How long after a deletion its cleanup may take before it is cut short. */
  cleanupTimeoutMs: number;
}

export class ModelReconciler {
  /** Cleanups cut short (the pipeline terminated). */
  cleanupsTimedOut = 0;
  /** uid → the last generation signalled (a status that has not caught up yet does not re-signal). */
  private readonly signalled = new Map<string, number>();
  /** uid of Models whose pipeline was told to stop. */
  private readonly cancelled = new Set<string>();

  constructor(private readonly deps: ModelReconcilerDeps) {}

  /** `o` is gone from the API (its DELETED event). */
  deleted(o: ModelResource): void {
    const { uid } = o.metadata;
    if (!Finalizers.held(o) && !this.cancelled.has(uid)) {
      void this.deps.workflows
        .handle(modelWorkflowId(o.metadata.namespace, o.metadata.name))
        .signal(cancelSignal, { forget: true, deleteObjects: o.spec.deletionPolicy === 'Delete', uid })
        .catch(() => undefined);
    }
    this.signalled.delete(uid);
    this.cancelled.delete(uid);
  }

  async reconcile(o: ModelResource): Promise<Requeue | void> {
    if (o.metadata.deletionTimestamp) return this.finalize(o, o.metadata.deletionTimestamp);
    const { namespace, name, uid, generation } = o.metadata;
    const { workflows, finalizers } = this.deps;
    const finalizer = Finalizers.held(o) ? undefined : finalizers.add(Plural.model, Kind.model, o);
    if (generation > (o.status?.observedGeneration ?? 0) && generation > (this.signalled.get(uid) ?? 0)) {
      const spec = modelSpecOf(o);
      const input: ModelPipelineInput = { namespace, name, spec, resource: { uid, generation } };
      const change: ResourceChange = { uid, generation, spec };
      // The signal does not wait for the finalizer (both are needed; a failure of either retries
      // the key). A Model deleted before its finalizer landed is cancelled from its DELETED event.
      await Promise.all([
        workflows.signalWithStart({
          workflowType: 'modelPipeline',
          workflowId: modelWorkflowId(namespace, name),
          input,
          signalName: 'resourceChanged',
          signal: change,
          requestId: `${uid}/${generation}`,
          summary: WorkflowSummary.model(namespace, name, spec.source.repo),
        }),
        finalizer,
      ]);
      this.signalled.set(uid, generation);
    } else await finalizer;
  }

  /** A Model being deleted: its pipeline stopped (or cut short), then the finalizer removed. */
  private async finalize(o: ModelResource, deletionTimestamp: string): Promise<Requeue | void> {
    if (!Finalizers.held(o)) return;
    const { namespace, name, uid } = o.metadata;
    const { workflows, finalizers, core, cleanupTimeoutMs } = this.deps;
    const workflowId = modelWorkflowId(namespace, name);
    if (await workflows.running(workflowId)) {
      if (!this.cancelled.has(uid)) {
        await workflows.handle(workflowId).signal(cancelSignal, { forget: true, deleteObjects: o.spec.deletionPolicy === 'Delete', uid });
        this.cancelled.add(uid);
      }
      if (Date.now() - Date.parse(deletionTimestamp) < cleanupTimeoutMs) return { afterMs: 1000 };
      await workflows.handle(workflowId).terminate(`cleanup of Model ${namespace}/${name} did not finish within ${cleanupTimeoutMs / 1000}s`);
      this.cleanupsTimedOut++;
      await recordEvent(
        core,
        Kind.model,
        o.metadata,
        'Warning',
        'CleanupTimedOut',
        `the pipeline did not stop within ${cleanupTimeoutMs / 1000}s of the deletion; it was terminated (partial uploads and S3 objects may remain)`,
      );
    }
    await finalizers.remove(Plural.model, o);
    // Marked done for the DELETED event that follows, which then has nothing left to do.
    this.cancelled.add(uid);
    this.signalled.delete(uid);
  }
}

/**
 * Activities that write what workflows know back to their custom resources: `status` by
 * server-side apply on the status subresource under the `magus-status` field manager (always
 * with `observedGeneration`), and an Event on every phase change so `kubectl describe` tells
 * the story. Idempotent: applying the same status twice changes nothing.
 */
import { ApplicationFailure } from '@temporalio/activity';
import { CoreV1Api, CustomObjectsApi, PatchStrategy, setHeaderOptions, type KubeConfig } from '@kubernetes/client-node';
import { CRD_GROUP, CRD_VERSION } from '../../shared/constants';
import { RESOURCE_GONE } from '../../shared/errors';
import { FieldManager, Kind, Plural, POOL_LABEL, type Condition } from '../../shared/kube';
import type { ReadyModel } from '../../shared/model';
import type { PipelineProgress, PoolStatus } from '../../shared/status';
import { recordEvent, type EventTarget } from '../../kube/events';
import { dllamaStatus, modelStatus } from '../../kube/status';

export interface KubernetesDeps {
  kc: KubeConfig;
  /** The S3 bucket artifacts live in (for the `s3://` URIs in a Model's status). */
  bucket: string;
  /** Counts API requests (tests and `bench:controller` report requests per object). */
  onRequest?: (what: string) => void;
}

export interface WriteModelStatusInput {
  namespace: string;
  name: string;
  /** The resource the workflow serves: a write to another object of the same name is refused. */
  uid: string;
  workflowId: string;
  progress: PipelineProgress;
  ready: ReadyModel | null;
  /** What the last write showed: its phase (an Event marks a change) and conditions (their transition times carry over). */
  previous: { phase: string | null; conditions: Condition[] };
}

export interface WriteDllamaStatusInput {
  namespace: string;
  name: string;
  uid: string;
  workflowId: string;
  observedGeneration: number;
  nodesPerInstance: number;
  pool: PoolStatus;
  previous: { phase: string | null; conditions: Condition[] };
}

const code = (err: unknown): number | undefined => (err as { code?: number }).code;
const applyHeaders = setHeaderOptions('Content-Type', PatchStrategy.ServerSideApply);

export function createKubernetesActivities(deps: KubernetesDeps) {
  const custom = deps.kc.makeApiClient(CustomObjectsApi);
  const core = deps.kc.makeApiClient(CoreV1Api);
  const count = (what: string) => deps.onRequest?.(what);

  async function applyStatus(kind: string, plural: string, ref: { namespace: string; name: string; uid: string }, status: object): Promise<void> {
    // The uid in the applied object is a precondition: the API server refuses (409) a write to a
    // different object that took the name.
    const body = { apiVersion: `${CRD_GROUP}/${CRD_VERSION}`, kind, metadata: { name: ref.name, namespace: ref.namespace, uid: ref.uid }, status };
    try {
      count(`status:${plural}`);
      await custom.patchNamespacedCustomObjectStatus(
        { group: CRD_GROUP, version: CRD_VERSION, namespace: ref.namespace, plural, name: ref.name, body, fieldManager: FieldManager.status, force: true },
        applyHeaders,
      );
    } catch (err) {
      if (code(err) === 404 || code(err) === 409)
        throw ApplicationFailure.nonRetryable(`${kind} ${ref.namespace}/${ref.name} (uid ${ref.uid}) is gone`, RESOURCE_GONE);
      throw err;
    }
  }

  const event = (kind: string, ref: EventTarget, type: 'Normal' | 'Warning', reason: string, message: string): Promise<void> => {
    count('event');
    return recordEvent(core, kind, ref, type, reason, message);
  };

  return {
    /** Writes a `Model`'s status from its pipeline; returns the conditions written (for the next write). */
    async writeModelStatus(input: WriteModelStatusInput): Promise<{ conditions: Condition[] }> {
      const status = modelStatus({
        progress: input.progress,
        ready: input.ready,
        workflowId: input.workflowId,
        bucket: deps.bucket,
        previous: input.previous.conditions,
        now: new Date().toISOString(),
      });
      await applyStatus(Kind.model, Plural.model, input, status);
      const p = input.progress;
      if (p.phase !== input.previous.phase) {
        if (p.phase === 'failed') await event(Kind.model, input, 'Warning', p.failure?.type ?? 'Failed', p.failure?.message ?? 'the pipeline failed');
        else
          await event(
            Kind.model,
            input,
            'Normal',
            status.phase ?? p.phase,
            p.phase === 'ready' ? `${p.repo}@${p.sha ?? ''} is ready (${status.size ?? ''})` : `${p.phase} ${p.repo}${p.sha ? `@${p.sha}` : ''}`,
          );
      }
      return { conditions: status.conditions ?? [] };
    },

    /** Writes a `Dllama`'s status from its pool; returns the phase and conditions written. */
    async writeDllamaStatus(input: WriteDllamaStatusInput): Promise<{ phase: string; conditions: Condition[] }> {
      const status = dllamaStatus({
        pool: input.pool,
        observedGeneration: input.observedGeneration,
        nodesPerInstance: input.nodesPerInstance,
        selector: `${POOL_LABEL}=${input.name}`,
        workflowId: input.workflowId,
        previous: input.previous.conditions,
        now: new Date().toISOString(),
      });
      await applyStatus(Kind.dllama, Plural.dllama, input, status);
      const phase = status.phase ?? '';
      if (phase !== input.previous.phase) {
        await event(
          Kind.dllama,
          input,
          phase === 'Degraded' ? 'Warning' : 'Normal',
          phase,
          input.pool.lastError ?? `${status.readyReplicas ?? 0}/${status.replicas ?? 0} instances ready`,
        );
      }
      return { phase, conditions: status.conditions ?? [] };
    },
  };
}

export type KubernetesActivities = ReturnType<typeof createKubernetesActivities>;

/** Messages of the `modelPipeline` workflow (workflow id `model/<namespace>/<name>`). */
import { defineQuery, defineSignal } from '@temporalio/workflow';
import type { ModelSpec } from '../../shared/model';
import type { ActivityProgress, ActivityRetry, PipelineProgress } from '../../shared/status';

export type { ActivityProgress, ActivityRetry, PipelinePhase, PipelineProgress } from '../../shared/status';

export const progressQuery = defineQuery<PipelineProgress>('progress');
/** A new spec: the pipeline re-plans from what already exists (content-addressed, so nothing is redone). */
export const specChangedSignal = defineSignal<[ModelSpec]>('specChanged');
/**
 * Stop: in-flight work is cancelled and partial uploads are cleaned up. From the controller (its
 * `Model` is being deleted): `forget` also removes the model from the registry, and
 * `deleteObjects` (deletion policy `Delete`) its S3 objects that no other model uses.
 */
export const cancelSignal = defineSignal<[CancelOptions?]>('cancel');
export interface CancelOptions {
  forget?: boolean;
  deleteObjects?: boolean;
  /** Only if the pipeline serves this resource (a late cancel must not stop its successor). */
  uid?: string;
}

/**
 * The `Model` custom resource this pipeline serves, as the controller sees it at one generation.
 * Sent with signal-with-start once per generation; a generation already applied is ignored, and a
 * new `uid` (the resource deleted and created again under the same name) starts over.
 */
export interface ResourceChange {
  uid: string;
  generation: number;
  spec: ModelSpec;
}
export const resourceChangedSignal = defineSignal<[ResourceChange]>('resourceChanged');
export const activityProgressSignal = defineSignal<[ActivityProgress]>('activityProgress');
/** An attempt failed and will be retried: the `progress` query (and the `Model`'s status, the UI) name the error. */
export const activityFailedSignal = defineSignal<[ActivityRetry]>('activityFailed');

export const modelWorkflowId = (namespace: string, name: string): string => `model/${namespace}/${name}`;

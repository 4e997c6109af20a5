/** Messages of the `modelPipeline` workflow (workflow id `model/<namespace>/<name>`). */
import { defineQuery, defineSignal } from '@temporalio/workflow';
import type { ModelSpec } from '../../shared/model';

export type PipelinePhase = 'resolving' | 'transferring' | 'converting' | 'sizing' | 'publishing' | 'ready' | 'failed' | 'cancelled';

/** What the `progress` query returns (and `magus model pull` draws). */
export interface PipelineProgress {
  phase: PipelinePhase;
  /** Bumped by every accepted spec change; the CR's `observedGeneration` maps onto it. */
  generation: number;
  repo: string;
  /** Commit the revision resolved to, once known. */
  sha: string | null;
  files: { done: number; total: number };
  /** Source bytes transferred (including bytes found already in S3). */
  bytes: { done: number; total: number };
  /** Tensors converted over the artifacts whose conversion started. */
  tensors: { done: number; total: number };
  /** The same per artifact (`format:weights`), in the order they started (the query only). */
  artifacts?: { key: string; done: number; total: number }[];
  /** Seconds to the end of the current phase at the recent rate, when it can be estimated. */
  etaSeconds: number | null;
  /** Set in phase `failed`: the typed reason (an ErrorType) and message. */
  failure: { type: string; message: string; /** The phase it failed in. */ during?: PipelinePhase } | null;
  /** The `Model` resource's generation the pipeline has taken in (absent without a resource). */
  observedGeneration?: number;
  /**
   * A step of the current phase whose last attempt failed and is being retried (transient errors
   * retry forever, with backoff): which one, how many attempts failed, and the last error. Cleared
   * when the step completes or the phase changes. Absent in answers of older workers.
   */
  retrying?: ActivityRetry;
}

/** Sent by a pipeline activity whose attempt failed with an error that will be retried. */
export interface ActivityRetry {
  /** The activity, e.g. `resolveSource`. */
  activity: string;
  /** Which one of its kind (a file's path, an artifact's `format:weights`), when several run. */
  key?: string;
  /** The attempt that failed (1 = the first). */
  attempt: number;
  /** Its error, as Temporal records it (never a secret: errors carry references only). */
  message: string;
  /** When it failed (ISO-8601, the worker's clock). */
  at: string;
}

/** Sent by long activities, throttled, so the `progress` query can show bytes and tensors. */
export interface ActivityProgress {
  /** Distinguishes concurrent activities (e.g. the file path or artifact). */
  key: string;
  kind: 'transfer' | 'convert';
  done: number;
  total: number;
}

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

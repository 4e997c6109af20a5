/**
 * `modelPipeline`: a model reference → artifacts in S3 → an entry in the model registry.
 * resolve (pin the revision to a commit) → transfer every needed file (parallel, resumable) →
 * convert to each requested format → size → publish. Then it waits for a spec change or a
 * cancel; it never re-runs by itself. A permanent failure (repo not found, unauthorized,
 * unsupported model, checksum mismatch after a re-download, invalid spec) is recorded with its
 * typed reason and the workflow waits for a new spec instead of retrying.
 */
import {
  ActivityCancellationType,
  ActivityFailure,
  ApplicationFailure,
  CancellationScope,
  condition,
  continueAsNew,
  getExternalWorkflowHandle,
  isCancellation,
  proxyActivities,
  setHandler,
  upsertSearchAttributes,
  workflowInfo,
  allHandlersFinished,
  type ActivityOptions,
  type RetryPolicy,
} from '@temporalio/workflow';
import type { PipelineActivities } from '../../activities/pipeline';
import { pipelineQueueFor } from '../../shared/constants';
import { ErrorType, PERMANENT_ERROR_TYPES } from '../../shared/errors';
import {
  isNeededSourceFile,
  modelRevision,
  selectGgufFiles,
  validateModelSpec,
  type ModelPipelineInput,
  type ModelSpec,
  type ReadyModel,
  type SourceFile,
  type StoredObject,
} from '../../shared/model';
import { modelPublishedSignal, poolWorkflowId } from '../pool/definitions';
import { mirrorStatus, statusWrite, type StatusView } from '../resource-status';
import { STATUS_ACTIVITY_PATCH } from './patches';
import { activityFailedSignal, activityProgressSignal, cancelSignal, progressQuery, resourceChangedSignal, specChangedSignal } from './definitions';
import { PipelineState } from './state';
import { visibility } from '../visibility';
import { formatBytes } from '../../shared/format';
import type { PipelineProgress } from './definitions';

/** Transient failures retry with capped exponential backoff, forever; permanent ones never. */
const retry: RetryPolicy = { initialInterval: '1s', backoffCoefficient: 2, maximumInterval: '1m', nonRetryableErrorTypes: [...PERMANENT_ERROR_TYPES] };

const shortCall: ActivityOptions = { startToCloseTimeout: '2m', retry };
/**
 * Transfers and conversions heartbeat; a dead worker is noticed within the heartbeat timeout.
 * On cancel the workflow waits until they have stopped, so the cleanup after them is final.
 */
const longWork: ActivityOptions = {
  startToCloseTimeout: '24h',
  heartbeatTimeout: '10s',
  retry,
  cancellationType: ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
};

// Heavy I/O and CPU run on the pipeline queue paired with this workflow's (control) queue;
// publishing to the registry is a control-plane call. (Activity proxies are Proxies: pick
// functions from them, never spread them.)
function activities() {
  const taskQueue = pipelineQueueFor(workflowInfo().taskQueue);
  const short = proxyActivities<PipelineActivities>({ ...shortCall, taskQueue });
  const long = proxyActivities<PipelineActivities>({ ...longWork, taskQueue });
  const control = proxyActivities<PipelineActivities>(shortCall);
  return {
    resolveSource: short.resolveSource,
    sizeArtifacts: short.sizeArtifacts,
    abortUploads: short.abortUploads,
    forgetModel: short.forgetModel,
    transferFile: long.transferFile,
    convertArtifact: long.convertArtifact,
    publishModel: control.publishModel,
  };
}

/** Files transferred at once. */
const TRANSFER_CONCURRENCY = 4;

/**
 * Status of the `Model` resource: written by an activity on the workflow's queue (its workers
 * have the Kubernetes client), at most once per {@link STATUS_MIN_INTERVAL_MS}, and only when
 * what it shows changed. A write that keeps failing is retried with capped backoff; the pipeline
 * never waits for it.
 */
const writeModelStatus = statusWrite('writeModelStatus', STATUS_ACTIVITY_PATCH);

export async function modelPipeline(input: ModelPipelineInput): Promise<void> {
  const { abortUploads, forgetModel } = activities();
  const state = new PipelineState(input);
  setHandler(progressQuery, () => state.query());
  setHandler(specChangedSignal, (spec: ModelSpec) => state.changeSpec(spec));
  setHandler(cancelSignal, (options) => state.cancel(options));
  setHandler(activityProgressSignal, (p) => state.onActivityProgress(p));
  setHandler(resourceChangedSignal, (change) => state.applyResource(change));
  setHandler(activityFailedSignal, (f) => state.onActivityFailed(f));
  upsertSearchAttributes({ MagusKind: ['model'], MagusModel: [`${input.namespace}/${input.name}`] });
  const shown = visibility({ phase: () => state.progress().phase, details: () => pipelineDetails(state.query()) });
  state.onChange = () => shown.refresh();
  shown.refresh();
  void mirrorStatus(modelStatusView(state));

  for (;;) {
    const generation = state.generation;
    // One run of the plan, cancelled as soon as the spec changes or a cancel arrives.
    const run = new CancellationScope();
    void condition(() => state.generation !== generation || state.cancelled).then(() => run.cancel());
    try {
      await run.run(() => runPlan(state));
    } catch (err) {
      if (!isCancellation(err)) {
        const failure = permanentFailure(err);
        if (!failure) throw err;
        state.fail(failure.type, failure.message);
      }
    }

    await condition(() => state.generation !== generation || state.cancelled);
    if (state.cancelled) {
      // Partial multipart uploads of this model are removed even though the workflow is stopping.
      await CancellationScope.nonCancellable(async () => {
        if (state.sha)
          await abortUploads({ prefixes: [`sources/${state.spec.source.repo}/${state.sha}/`, `artifacts/${state.spec.source.repo}/${state.sha}/`] });
        const { forget, deleteObjects } = state.cancelOptions;
        if (forget)
          await forgetModel({
            namespace: state.namespace,
            name: state.name,
            repo: state.spec.source.repo,
            sha: state.sha,
            deleteObjects: deleteObjects === true,
          });
      });
      state.markCancelled();
      await condition(allHandlersFinished);
      return;
    }
    if (workflowInfo().continueAsNewSuggested) {
      await condition(allHandlersFinished);
      await continueAsNew<typeof modelPipeline>({ ...input, spec: state.spec, ...(state.resource ? { resource: state.resource } : {}) });
    }
  }
}

async function runPlan(state: PipelineState): Promise<void> {
  const { resolveSource, transferFile, convertArtifact, sizeArtifacts, publishModel } = activities();
  const spec = state.spec;
  const errors = validateModelSpec(spec);
  if (errors.length > 0) throw ApplicationFailure.nonRetryable(`invalid spec: ${errors.join('; ')}`, ErrorType.InvalidSpec);

  state.enter('resolving');
  const resolved = await resolveSource({ source: spec.source });
  // A GGUF repository as a source (`source.gguf`): its chosen file is transferred and published as it is.
  const files = spec.source.gguf ? chosenGguf(resolved.files, spec.source.gguf) : resolved.files.filter((f) => isNeededSourceFile(f.path));
  if (!spec.source.gguf && !files.some((f) => f.path === 'config.json')) {
    throw ApplicationFailure.nonRetryable(
      `${resolved.repo}@${resolved.sha} has no config.json${resolved.files.some((f) => f.path.endsWith('.gguf')) ? ' (it holds GGUF files: choose one with source.gguf)' : ''}`,
      ErrorType.UnsupportedModel,
    );
  }
  state.planned(resolved.sha, files);

  state.enter('transferring');
  const stored: StoredObject[] = new Array<StoredObject>(files.length);
  let next = 0;
  const lane = async (): Promise<void> => {
    while (next < files.length) {
      const i = next++;
      const file = files[i]!;
      stored[i] = await transferFile({ source: spec.source, sha: resolved.sha, file });
      state.fileDone(file);
    }
  };
  await Promise.all(Array.from({ length: Math.min(TRANSFER_CONCURRENCY, files.length) }, lane));

  state.enter('converting');
  const sources = files.map((f, i) => ({ path: f.path, object: stored[i]! }));
  const artifacts = [];
  for (const request of spec.artifacts) {
    artifacts.push(await convertArtifact({ repo: resolved.repo, sha: resolved.sha, name: state.name, sources, request }));
    state.stepDone(`${request.format}:${request.weights}`);
  }

  state.enter('sizing');
  const memory = await sizeArtifacts({ sources, artifacts, contextLength: spec.contextLength });

  state.enter('publishing');
  const ready: ReadyModel = {
    namespace: state.namespace,
    name: state.name,
    source: { repo: resolved.repo, revision: resolved.revision, sha: resolved.sha },
    artifacts,
    memory,
    readyAt: new Date().toISOString(), // workflow-safe: the SDK makes Date deterministic
    // The activity's input only (no command changes): histories from before it replay as they are.
    ...(spec.sampling ? { sampling: spec.sampling } : {}),
  };
  await publishModel(ready);
  // Its pool, if one runs, may be backing off failed starts that wanted this model: try now; and
  // its instances of another revision are replaced (the signal's input only: no command changes).
  await getExternalWorkflowHandle(poolWorkflowId(state.namespace, state.name))
    .signal(modelPublishedSignal, { revision: modelRevision(ready) })
    .catch(() => undefined);
  state.ready = ready;
  state.enter('ready');
}

/** The file(s) of a GGUF repository the spec chooses; a permanent failure naming what exists when it chooses none, or several. */
function chosenGguf(files: SourceFile[], choice: NonNullable<ModelSpec['source']['gguf']>): SourceFile[] {
  const chosen = selectGgufFiles(files, choice);
  if ('error' in chosen) throw ApplicationFailure.nonRetryable(chosen.error, ErrorType.NoSuchFile);
  return chosen.files;
}

/** The `Model`'s view of the pipeline for the status mirror (the ETA alone never triggers a write). */
function modelStatusView(state: PipelineState): StatusView {
  const { workflowId } = workflowInfo();
  return {
    attached: () => state.resource !== null,
    shown: () => {
      const { etaSeconds: _eta, ...rest } = state.progress();
      return JSON.stringify({ rest, ready: state.ready?.readyAt ?? null, resource: state.resource });
    },
    async write(previous) {
      const resource = state.resource!;
      const progress = state.progress();
      const result = await writeModelStatus({
        namespace: state.namespace,
        name: state.name,
        uid: resource.uid,
        workflowId,
        progress,
        ready: state.ready,
        previous,
      });
      return { phase: progress.phase, conditions: result.conditions };
    },
  };
}

/** The pipeline's state in words, for the Temporal UI's "Current Details" (Markdown). */
export function pipelineDetails(p: PipelineProgress): string {
  const source = `\`${p.repo}\`${p.sha ? ` @ \`${p.sha.slice(0, 12)}\`` : ''}`;
  const lines = [`**${p.phase}** · ${source} · generation ${p.generation}`];
  if (p.files.total > 0) lines.push(`${p.files.done} of ${p.files.total} files · ${formatBytes(p.bytes.done)} of ${formatBytes(p.bytes.total)}`);
  for (const a of p.artifacts ?? []) lines.push(`${a.key}: ${a.done} of ${a.total} tensors`);
  if (p.retrying) {
    const r = p.retrying;
    lines.push(`retrying ${r.activity}${r.key ? ` (${r.key})` : ''}: attempt ${r.attempt} failed at ${r.at}: ${r.message}`);
  }
  if (p.failure)
    lines.push(
      `failed during ${p.failure.during ?? 'an unknown phase'}: ${p.failure.type}: ${p.failure.message} — apply a new spec (or the same one) to retry`,
    );
  if (p.phase === 'ready') lines.push('published: the model can be served');
  return lines.join('  \n');
}

/** The typed permanent failure behind `err`, if it is one. */
function permanentFailure(err: unknown): { type: string; message: string } | null {
  let e: unknown = err;
  if (e instanceof ActivityFailure) e = e.cause;
  if (e instanceof ApplicationFailure && e.type && PERMANENT_ERROR_TYPES.includes(e.type)) return { type: e.type, message: e.message };
  return null;
}

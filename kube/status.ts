/**
 * Pure builders of the status magus writes to its custom resources: what `kubectl get`,
 * `kubectl wait --for=condition=Ready` and `kubectl describe` show. No I/O; unit-tested.
 */
import { isDistributed } from '../shared/engines';
import {
  DllamaCondition,
  ModelCondition,
  type Condition,
  type DllamaResource,
  type DllamaResourceStatus,
  type ModelResource,
  type ModelResourceStatus,
} from '../shared/kube';
import type { ReadyModel } from '../shared/model';
import type { PipelinePhase, PipelineProgress, PoolStatus } from '../shared/status';

/** Bytes as people read them: `1.2 GB`, `830 MB`, `12 kB` (SI, as `kubectl` users expect of sizes). */
export function humanBytes(n: number): string {
  const units = ['B', 'kB', 'MB', 'GB', 'TB'];
  let v = n;
  let u = 0;
  while (v >= 1000 && u < units.length - 1) {
    v /= 1000;
    u++;
  }
  return u === 0 ? `${n} B` : `${v >= 100 ? v.toFixed(0) : v.toFixed(1)} ${units[u]}`;
}

/**
 * Carries `lastTransitionTime` over from the previous condition of the same type when its status
 * did not change (API conventions: the time the status last flipped, not the time of the write).
 */
export function mergeConditions(next: Omit<Condition, 'lastTransitionTime'>[], previous: readonly Condition[], now: string): Condition[] {
  return next.map((c) => {
    const before = previous.find((p) => p.type === c.type);
    return { ...c, lastTransitionTime: before && before.status === c.status ? before.lastTransitionTime : now };
  });
}

/** The stages a pipeline goes through, each with a condition, and the phases it is worked on in. */
const ORDER: PipelinePhase[] = ['resolving', 'transferring', 'converting', 'sizing', 'publishing', 'ready'];
const STAGES: { type: string; last: PipelinePhase; active: Partial<Record<PipelinePhase, string>>; done: string }[] = [
  { type: ModelCondition.downloaded, last: 'transferring', active: { resolving: 'Resolving', transferring: 'Downloading' }, done: 'Downloaded' },
  { type: ModelCondition.converted, last: 'converting', active: { converting: 'Converting' }, done: 'Converted' },
  { type: ModelCondition.sized, last: 'sizing', active: { sizing: 'Sizing' }, done: 'Sized' },
];

/**
 * The `Model` conditions for a pipeline's progress. A failure marks the stage it happened in
 * False with the failure's type as reason (e.g. `RepoNotFound`), and Ready False with the same.
 */
export function modelConditions(p: PipelineProgress, observedGeneration: number): Omit<Condition, 'lastTransitionTime'>[] {
  const failed = p.phase === 'failed' ? p.failure : null;
  // Failed or cancelled: the stage reached is the one it failed in (cancelled: nothing claimed).
  const at: PipelinePhase = failed ? (failed.during ?? 'resolving') : p.phase === 'cancelled' ? 'resolving' : p.phase;
  const reached = ORDER.indexOf(at);
  // A step retrying after failed attempts says so where a user looks (`kubectl describe model`).
  const r = p.phase === 'failed' ? undefined : p.retrying;
  const retrying = r ? `retrying: attempt ${r.attempt} of ${r.activity}${r.key ? ` (${r.key})` : ''} failed: ${r.message}` : null;
  const c = (type: string, status: Condition['status'], reason: string, message = ''): Omit<Condition, 'lastTransitionTime'> => ({
    type,
    status,
    reason,
    message,
    observedGeneration,
  });
  const out = STAGES.map((s) => {
    if (reached > ORDER.indexOf(s.last)) return c(s.type, 'True', s.done);
    if (failed && s.active[at] !== undefined) return c(s.type, 'False', failed.type, failed.message);
    if (retrying && s.active[at] !== undefined) return c(s.type, 'False', s.active[at], retrying);
    return c(s.type, 'False', s.active[at] ?? 'Pending');
  });
  if (p.phase === 'ready') out.push(c(ModelCondition.ready, 'True', 'Ready', `${p.repo}@${p.sha ?? ''} is ready to serve`));
  else if (failed) out.push(c(ModelCondition.ready, 'False', failed.type, failed.message));
  else if (p.phase === 'cancelled') out.push(c(ModelCondition.ready, 'False', 'Cancelled', 'the pipeline was cancelled'));
  else out.push(c(ModelCondition.ready, 'False', capitalize(p.phase), retrying ? `${p.phase} ${p.repo}; ${retrying}` : `${p.phase} ${p.repo}`));
  return out;
}

const capitalize = (s: string): string => s.charAt(0).toUpperCase() + s.slice(1);

/** Percent of the current phase's work done, over bytes while transferring and tensors while converting. */
function percent(p: PipelineProgress): number {
  if (p.phase === 'ready') return 100;
  const active = p.phase === 'converting' ? p.tensors : p.bytes;
  if (p.phase !== 'transferring' && p.phase !== 'converting') return p.bytes.total > 0 && p.bytes.done >= p.bytes.total ? 100 : 0;
  return active.total > 0 ? Math.min(100, Math.floor((active.done / active.total) * 100)) : 0;
}

function progressSummary(p: PipelineProgress): string {
  const pct = `${percent(p)}%`;
  if (p.phase === 'transferring') return `${pct} ${humanBytes(p.bytes.done)}/${humanBytes(p.bytes.total)}`;
  if (p.phase === 'converting') return `${pct} ${p.tensors.done}/${p.tensors.total} tensors`;
  return pct;
}

export interface ModelStatusInput {
  progress: PipelineProgress;
  ready: ReadyModel | null;
  workflowId: string;
  /** The bucket the artifacts are in (their `s3://` URIs). */
  bucket: string;
  /** The conditions last written (their transition times carry over). */
  previous: readonly Condition[];
  now: string;
}

/** The whole `status` of a `Model` for one moment of its pipeline. */
export function modelStatus(input: ModelStatusInput): ModelResourceStatus {
  const { progress: p, ready } = input;
  const observedGeneration = p.observedGeneration ?? 0;
  const status: ModelResourceStatus = {
    observedGeneration,
    phase: capitalize(p.phase),
    progress: {
      files: p.files,
      bytes: p.bytes,
      tensors: p.tensors,
      percent: percent(p),
      ...(p.etaSeconds !== null ? { etaSeconds: p.etaSeconds } : {}),
      summary: progressSummary(p),
    },
    ...(p.sha ? { revision: p.sha } : {}),
    workflowId: input.workflowId,
    conditions: mergeConditions(modelConditions(p, observedGeneration), input.previous, input.now),
  };
  if (ready) {
    status.artifacts = ready.artifacts.map((a) => {
      const bytes = a.files.reduce((n, f) => n + f.bytes, 0);
      const main = a.files[0]!;
      return { format: a.format, weights: a.weights, uri: `s3://${input.bucket}/${main.key}`, bytes, sha256: main.sha256 };
    });
    status.size = humanBytes(status.artifacts.reduce((n, a) => n + a.bytes, 0));
    status.sizing = ready.memory.flatMap((m) =>
      m.topologies.map((t) => ({
        format: m.format,
        weights: m.weights,
        contextLength: m.contextLength,
        nodes: t.nodes,
        rootBytes: t.root.total,
        ...(t.worker ? { workerBytes: t.worker.total } : {}),
      })),
    );
    const refused = ready.memory.flatMap((m) => (m.refused ?? []).map((r) => ({ format: m.format, weights: m.weights, nodes: r.nodes, reason: r.reason })));
    if (refused.length > 0) status.refusedTopologies = refused;
  }
  return status;
}

export interface DllamaStatusInput {
  pool: PoolStatus;
  observedGeneration: number;
  nodesPerInstance: number;
  /** The label selector of the pool's pods (the scale subresource reports it to an HPA). */
  selector: string;
  workflowId: string;
  previous: readonly Condition[];
  now: string;
}

/** The `status` of a `Dllama` from its pool's state. */
export function dllamaStatus(input: DllamaStatusInput): DllamaResourceStatus {
  const instances = input.pool.instances.map((i) => ({
    id: i.id,
    // An instance restarting in place serves nothing meanwhile.
    phase: i.restarting ? 'restarting' : i.phase,
    leases: i.leases,
    ...(i.restarts ? { restarts: i.restarts } : {}),
    ...(i.lastRestart ? { lastRestart: i.lastRestart } : {}),
    ...(i.revision ? { revision: i.revision } : {}),
    ...(i.retiring ? { retiring: i.retiring } : {}),
    ...(i.inFlight !== undefined ? { inFlight: i.inFlight } : {}),
  }));
  // Instances being replaced answer only what they have in flight: not replicas of the pool any more.
  const retiring = input.pool.instances.filter((i) => i.retiring && i.phase === 'draining');
  const counted = instances.filter((i) => !i.retiring);
  const ready = counted.filter((i) => i.phase === 'ready' || i.phase === 'draining').length;
  const live = counted.filter((i) => i.phase !== 'stopping').length;
  const restarting = input.pool.instances.filter((i) => i.restarting);
  const phase = (input.pool.lastError || restarting.length > 0) && ready === 0 ? 'Degraded' : live === 0 ? 'Idle' : ready < live ? 'Scaling' : 'Serving';
  const g = input.observedGeneration;
  const conditions: Omit<Condition, 'lastTransitionTime'>[] = [
    ready > 0
      ? { type: 'Ready', status: 'True', reason: 'InstancesReady', message: `${ready} of ${live} instances serve`, observedGeneration: g }
      : {
          type: 'Ready',
          status: 'False',
          reason: live > 0 ? 'InstancesStarting' : 'NoInstances',
          message: live > 0 ? `${live} instances starting` : 'scaled to zero; the first request starts one',
          observedGeneration: g,
        },
    restarting.length > 0
      ? {
          type: 'Degraded',
          status: 'True',
          reason: 'InstanceRestarting',
          message: restarting.map((i) => `instance ${i.id} is restarting in place: ${i.restarting}`).join('; '),
          observedGeneration: g,
        }
      : input.pool.lastError
        ? { type: 'Degraded', status: 'True', reason: 'InstanceFailed', message: input.pool.lastError, observedGeneration: g }
        : { type: 'Degraded', status: 'False', reason: 'AsExpected', message: '', observedGeneration: g },
    retiring.length > 0
      ? {
          type: 'Progressing',
          status: 'True',
          reason: 'RollingOut',
          message: `${retiring.length} instance(s) being replaced draining, ${retiring.reduce((n, i) => n + (i.inFlight ?? 0), 0)} answer(s) in flight on them (${retiring[0]!.retiring})`,
          observedGeneration: g,
        }
      : { type: 'Progressing', status: 'False', reason: 'AsExpected', message: '', observedGeneration: g },
  ];
  return {
    observedGeneration: g,
    phase,
    replicas: live,
    readyReplicas: ready,
    nodesPerInstance: input.nodesPerInstance,
    selector: input.selector,
    instances,
    ...(input.pool.live !== undefined ? { conversations: input.pool.live } : {}),
    ...(input.pool.lastError ? { lastError: input.pool.lastError } : {}),
    workflowId: input.workflowId,
    conditions: mergeConditions(conditions, input.previous, input.now),
  };
}

const nodesText = (n: number): string => `${n} node${n === 1 ? '' : 's'}`;

/**
 * A distributed-llama `Dllama`'s `Splittable` condition: whether its model runs on the nodes it
 * asks for (2^`nodesPower`), from the `Model`'s status — `sizing` lists the topologies its
 * distributed-llama artifacts run on, `refusedTopologies` why not the others (the dimension or the
 * weights). Unknown while the model has no memory plans (absent, or not sized yet); null for a
 * single-node engine, where there is nothing to split. With `autoNodes` it is True when any
 * topology runs. The admission rule says the rest: `nodesPower` 0–4 is a power of two up to 16.
 */
export function dllamaSplitCondition(d: DllamaResource, model: ModelResource | undefined): Omit<Condition, 'lastTransitionTime'> | null {
  if (!isDistributed(d.spec.engine)) return null;
  const c = (status: Condition['status'], reason: string, message: string): Omit<Condition, 'lastTransitionTime'> => ({
    type: DllamaCondition.splittable,
    status,
    reason,
    message,
    observedGeneration: d.metadata.generation,
  });
  const name = d.spec.model;
  if (!model) return c('Unknown', 'ModelNotFound', `model ${name} does not exist in ${d.metadata.namespace}`);
  const s = model.status;
  if (!s?.artifacts || !s.sizing) {
    const ready = s?.conditions?.find((x) => x.type === ModelCondition.ready);
    const why = ready && ready.status !== 'True' ? ` (Ready: ${ready.reason}${ready.message ? `: ${ready.message}` : ''})` : '';
    return c('Unknown', 'ModelNotSized', `model ${name} has no memory plans yet${why}`);
  }
  const weights = s.artifacts.filter((a) => a.format === 'dllama').map((a) => a.weights);
  if (weights.length === 0) {
    const have = s.artifacts.map((a) => `${a.format}:${a.weights}`).join(', ');
    return c('False', 'NoDllamaArtifact', `model ${name} has no distributed-llama artifact${have ? ` (it has ${have})` : ''}`);
  }
  const runs = (w: string) => s.sizing!.filter((t) => t.format === 'dllama' && t.weights === w).map((t) => t.nodes);
  const refused = (w: string, n: number) => s.refusedTopologies?.find((r) => r.format === 'dllama' && r.weights === w && r.nodes === n)?.reason;
  if (d.spec.autoNodes) {
    const options = weights.filter((w) => runs(w).length > 0).map((w) => `${w} on ${runs(w).join(', ')}`);
    if (options.length > 0) return c('True', 'AutoNodes', `the runtime picks the smallest topology that fits: model ${name} runs ${options.join('; ')} nodes`);
    const why = weights.map((w) => `${w}: ${refused(w, 1) ?? 'no topology in its memory plan'}`);
    return c('False', 'CannotSplit', `model ${name} runs on no number of nodes (${why.join('; ')})`);
  }
  const nodes = 2 ** d.spec.nodesPower;
  const fits = weights.filter((w) => runs(w).includes(nodes));
  if (fits.length > 0) return c('True', 'Splits', `model ${name} runs on ${nodesText(nodes)} in ${fits.join(', ')}`);
  const why = weights.map((w) => {
    const listed = runs(w);
    const planned = listed.length > 0 ? `runs on ${listed.join(', ')} only` : 'runs on no number of nodes';
    return `${w}: ${refused(w, nodes) ?? planned}`;
  });
  return c('False', 'CannotSplit', `model ${name} cannot run on ${nodesText(nodes)} (${why.join('; ')})`);
}

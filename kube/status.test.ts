import { planMemory } from '../activities/size/memory';
import { parseModelSpec } from '../convert/arch';
import type { DllamaResource, ModelResource } from '../shared/kube';
import type { ReadyModel } from '../shared/model';
import type { PipelineProgress } from '../shared/status';
import { dllamaSplitCondition, dllamaStatus, humanBytes, mergeConditions, modelConditions, modelStatus } from './status';

const progress = (over: Partial<PipelineProgress>): PipelineProgress => ({
  phase: 'transferring',
  generation: 1,
  repo: 'org/m',
  sha: 'a'.repeat(40),
  files: { done: 2, total: 5 },
  bytes: { done: 1_500_000, total: 6_000_000 },
  tensors: { done: 0, total: 0 },
  etaSeconds: 12,
  failure: null,
  observedGeneration: 3,
  ...over,
});

const summary = (cs: { type: string; status: string; reason: string }[]) => cs.map((c) => `${c.type}=${c.status}/${c.reason}`);

test('sizes read like kubectl users expect', () => {
  expect([0, 999, 1000, 1_234_567, 12_345_678_901].map(humanBytes)).toEqual(['0 B', '999 B', '1.0 kB', '1.2 MB', '12.3 GB']);
});

test('conditions follow the stages of the pipeline', () => {
  expect(summary(modelConditions(progress({ phase: 'resolving' }), 3))).toEqual([
    'Downloaded=False/Resolving',
    'Converted=False/Pending',
    'Sized=False/Pending',
    'Ready=False/Resolving',
  ]);
  expect(summary(modelConditions(progress({ phase: 'converting' }), 3))).toEqual([
    'Downloaded=True/Downloaded',
    'Converted=False/Converting',
    'Sized=False/Pending',
    'Ready=False/Converting',
  ]);
  expect(summary(modelConditions(progress({ phase: 'ready' }), 3))).toEqual([
    'Downloaded=True/Downloaded',
    'Converted=True/Converted',
    'Sized=True/Sized',
    'Ready=True/Ready',
  ]);
  for (const c of modelConditions(progress({ phase: 'ready' }), 3)) expect(c.observedGeneration).toBe(3);
});

test('a failure marks the stage it happened in with its typed reason, and Ready the same', () => {
  const failed = progress({ phase: 'failed', failure: { type: 'UnsupportedModel', message: 'mixtral is not supported', during: 'converting' } });
  expect(summary(modelConditions(failed, 3))).toEqual([
    'Downloaded=True/Downloaded',
    'Converted=False/UnsupportedModel',
    'Sized=False/Pending',
    'Ready=False/UnsupportedModel',
  ]);
  const early = progress({ phase: 'failed', failure: { type: 'RepoNotFound', message: '404', during: 'resolving' } });
  expect(summary(modelConditions(early, 3))).toEqual([
    'Downloaded=False/RepoNotFound',
    'Converted=False/Pending',
    'Sized=False/Pending',
    'Ready=False/RepoNotFound',
  ]);
});

test('lastTransitionTime moves only when a condition flips', () => {
  const first = mergeConditions([{ type: 'Ready', status: 'False', reason: 'Converting', message: '', observedGeneration: 1 }], [], 't1');
  const same = mergeConditions([{ type: 'Ready', status: 'False', reason: 'Sizing', message: '', observedGeneration: 1 }], first, 't2');
  const flipped = mergeConditions([{ type: 'Ready', status: 'True', reason: 'Ready', message: '', observedGeneration: 1 }], same, 't3');
  expect([first[0]!.lastTransitionTime, same[0]!.lastTransitionTime, flipped[0]!.lastTransitionTime]).toEqual(['t1', 't1', 't3']);
});

test('a Model status while transferring shows progress in words and numbers', () => {
  const s = modelStatus({ progress: progress({}), ready: null, workflowId: 'model/ns/m', bucket: 'b', previous: [], now: 't' });
  expect(s).toMatchObject({
    observedGeneration: 3,
    phase: 'Transferring',
    revision: 'a'.repeat(40),
    workflowId: 'model/ns/m',
    progress: { percent: 25, etaSeconds: 12, summary: '25% 1.5 MB/6.0 MB' },
  });
  expect(s.artifacts).toBeUndefined();
});

test('a ready Model lists its artifacts as s3 URIs with sizes, and its sizing per node count', () => {
  const ready = {
    namespace: 'ns',
    name: 'm',
    source: { repo: 'org/m', revision: 'main', sha: 'a'.repeat(40) },
    artifacts: [
      {
        format: 'gguf' as const,
        weights: 'q40' as const,
        converterVersion: '1',
        files: [{ key: 'artifacts/org/m/x/model.gguf', bytes: 2_000_000, sha256: 'f'.repeat(64) }],
      },
    ],
    memory: [
      {
        format: 'gguf' as const,
        weights: 'q40' as const,
        contextLength: 128,
        topologies: [{ nodes: 1, root: { weights: 1, kvCache: 1, buffers: 1, total: 3 }, worker: null }],
      },
    ],
    readyAt: 't',
  };
  const s = modelStatus({ progress: progress({ phase: 'ready' }), ready, workflowId: 'w', bucket: 'models', previous: [], now: 't' });
  expect(s.artifacts).toEqual([{ format: 'gguf', weights: 'q40', uri: 's3://models/artifacts/org/m/x/model.gguf', bytes: 2_000_000, sha256: 'f'.repeat(64) }]);
  expect(s.size).toBe('2.0 MB');
  expect(s.sizing).toEqual([{ format: 'gguf', weights: 'q40', contextLength: 128, nodes: 1, rootBytes: 3 }]);
  expect(s.progress?.percent).toBe(100);
});

test('a Dllama status counts ready instances and reports a failing pool as Degraded', () => {
  const base = { observedGeneration: 2, nodesPerInstance: 2, selector: 'magus.dev/pool=p', workflowId: 'pool/ns/m', previous: [], now: 't' };
  const serving = dllamaStatus({
    ...base,
    pool: {
      instances: [
        { id: 'm-1', phase: 'ready', subject: 's', leases: 3 },
        { id: 'm-2', phase: 'starting', subject: null, leases: 0 },
      ],
      waiting: 0,
      lastError: null,
    },
  });
  expect(serving).toMatchObject({ phase: 'Scaling', replicas: 2, readyReplicas: 1, nodesPerInstance: 2, selector: 'magus.dev/pool=p' });
  expect(summary(serving.conditions!)).toEqual(['Ready=True/InstancesReady', 'Degraded=False/AsExpected', 'Progressing=False/AsExpected']);
  const failing = dllamaStatus({ ...base, pool: { instances: [], waiting: 1, lastError: 'ModelNotReady: no GGUF' } });
  expect(failing).toMatchObject({ phase: 'Degraded', replicas: 0, readyReplicas: 0, lastError: 'ModelNotReady: no GGUF' });
  expect(summary(failing.conditions!)).toEqual(['Ready=False/NoInstances', 'Degraded=True/InstanceFailed', 'Progressing=False/AsExpected']);
});

test('a Dllama status shows an instance restarting in place as Degraded, then counts its restarts', () => {
  const base = { observedGeneration: 2, nodesPerInstance: 2, selector: 'magus.dev/pool=p', workflowId: 'pool/ns/m', previous: [], now: 't' };
  const how = 'node 1 (worker) killed by SIGKILL';
  const restarting = dllamaStatus({
    ...base,
    pool: { instances: [{ id: 'm-1', phase: 'ready', subject: 's', leases: 1, restarting: how, restarts: 1, lastRestart: how }], waiting: 0, lastError: null },
  });
  expect(restarting).toMatchObject({
    phase: 'Degraded',
    replicas: 1,
    readyReplicas: 0,
    instances: [{ id: 'm-1', phase: 'restarting', restarts: 1, lastRestart: how }],
  });
  expect(summary(restarting.conditions!)).toEqual(['Ready=False/InstancesStarting', 'Degraded=True/InstanceRestarting', 'Progressing=False/AsExpected']);
  expect(restarting.conditions!.find((c) => c.type === 'Degraded')!.message).toBe(`instance m-1 is restarting in place: ${how}`);
  const back = dllamaStatus({
    ...base,
    previous: restarting.conditions!,
    pool: { instances: [{ id: 'm-1', phase: 'ready', subject: 's', leases: 1, restarts: 1, lastRestart: how }], waiting: 0, lastError: null },
  });
  expect(back).toMatchObject({ phase: 'Serving', readyReplicas: 1, instances: [{ id: 'm-1', phase: 'ready', restarts: 1, lastRestart: how }] });
  expect(summary(back.conditions!)).toEqual(['Ready=True/InstancesReady', 'Degraded=False/AsExpected', 'Progressing=False/AsExpected']);
});

test('a Dllama status shows a rollout: the old instance draining with its answers in flight, not counted as a replica', () => {
  const status = dllamaStatus({
    observedGeneration: 1,
    nodesPerInstance: 1,
    selector: 'magus.dev/pool=p',
    workflowId: 'pool/ns/m',
    previous: [],
    now: 't',
    pool: {
      instances: [
        { id: 'm-1', phase: 'draining', subject: 's1', leases: 2, revision: 'r1', retiring: 'revision r1 is replaced by r2', inFlight: 2 },
        { id: 'm-2', phase: 'ready', subject: 's2', leases: 0, revision: 'r2' },
      ],
      waiting: 0,
      lastError: null,
    },
  });
  expect(status).toMatchObject({ phase: 'Serving', replicas: 1, readyReplicas: 1 });
  expect(status.instances![0]).toEqual({ id: 'm-1', phase: 'draining', leases: 2, revision: 'r1', retiring: 'revision r1 is replaced by r2', inFlight: 2 });
  expect(summary(status.conditions!)).toEqual(['Ready=True/InstancesReady', 'Degraded=False/AsExpected', 'Progressing=True/RollingOut']);
  expect(status.conditions!.find((c) => c.type === 'Progressing')!.message).toBe(
    '1 instance(s) being replaced draining, 2 answer(s) in flight on them (revision r1 is replaced by r2)',
  );
});

test('a step retrying after failed attempts is named in its stage and in Ready; a failure replaces it', () => {
  const retrying = { activity: 'resolveSource', attempt: 3, message: 'HubError: connect ECONNREFUSED 127.0.0.1:1', at: '2026-11-24T10:00:00.000Z' };
  const cs = modelConditions(progress({ phase: 'resolving', retrying }), 3);
  expect(summary(cs)).toEqual(['Downloaded=False/Resolving', 'Converted=False/Pending', 'Sized=False/Pending', 'Ready=False/Resolving']);
  expect(cs[0]!.message).toBe('retrying: attempt 3 of resolveSource failed: HubError: connect ECONNREFUSED 127.0.0.1:1');
  expect(cs[3]!.message).toBe('resolving org/m; retrying: attempt 3 of resolveSource failed: HubError: connect ECONNREFUSED 127.0.0.1:1');
  expect(cs[1]!.message).toBe('');
});

describe("a distributed-llama Dllama's Splittable condition, from its Model's memory plans", () => {
  // The padded stories260K's shape: 8 heads of 8, 4 KV heads, FFN 192.
  const spec = parseModelSpec({
    model_type: 'llama',
    hidden_size: 64,
    intermediate_size: 192,
    num_attention_heads: 8,
    num_key_value_heads: 4,
    num_hidden_layers: 5,
    vocab_size: 512,
    max_position_embeddings: 512,
    rms_norm_eps: 1e-5,
  });
  const file = { key: 'k', bytes: 1, sha256: 'f'.repeat(64) };
  const ready: ReadyModel = {
    namespace: 'ns',
    name: 'stories',
    source: { repo: 'org/stories', revision: 'main', sha: 'a'.repeat(40) },
    artifacts: [
      { format: 'dllama', weights: 'q40', converterVersion: '1', files: [file] },
      { format: 'dllama', weights: 'f32', converterVersion: '1', files: [file] },
    ],
    memory: [planMemory(spec, 'dllama', 'q40', 256, 1), planMemory(spec, 'dllama', 'f32', 256, 1)],
    readyAt: 't',
  };
  const model = (r: ReadyModel | null, over: Partial<PipelineProgress> = { phase: 'ready' }): ModelResource => ({
    apiVersion: 'magus.dev/v1alpha1',
    kind: 'Model',
    metadata: { name: 'stories', namespace: 'ns', uid: 'u', generation: 1 },
    spec: { source: { repo: 'org/stories' }, artifacts: [] },
    status: modelStatus({ progress: progress(over), ready: r, workflowId: 'w', bucket: 'b', previous: [], now: 't' }),
  });
  const dllama = (spec: Partial<DllamaResource['spec']>): DllamaResource => ({
    apiVersion: 'magus.dev/v1alpha1',
    kind: 'Dllama',
    metadata: { name: 'pool', namespace: 'ns', uid: 'd', generation: 3 },
    spec: { model: 'stories', engine: 'dllama', nodesPower: 0, replicas: 1, minReplicas: 0, maxReplicas: 1, leasesPerInstance: 1, idleTimeout: '10m', ...spec },
  });
  const of = (c: ReturnType<typeof dllamaSplitCondition>) => c && { status: c.status, reason: c.reason, message: c.message };

  test("the Model's status lists the topologies refused, with their reasons", () => {
    const s = model(ready).status!;
    expect(s.sizing?.map((t) => `${t.weights}:${t.nodes}`)).toEqual(['q40:1', 'q40:2', 'f32:1', 'f32:2', 'f32:4']);
    expect(s.refusedTopologies?.map((t) => `${t.weights}:${t.nodes}`)).toEqual(['q40:4', 'q40:8', 'q40:16', 'f32:8', 'f32:16']);
    expect(s.refusedTopologies?.[0]).toEqual({ format: 'dllama', weights: 'q40', nodes: 4, reason: ready.memory[0]!.refused![0]!.reason });
  });

  test('True on nodes a weights format runs on, naming which', () => {
    expect(of(dllamaSplitCondition(dllama({ nodesPower: 1 }), model(ready)))).toEqual({
      status: 'True',
      reason: 'Splits',
      message: 'model stories runs on 2 nodes in q40, f32',
    });
    expect(of(dllamaSplitCondition(dllama({ nodesPower: 2 }), model(ready)))).toEqual({
      status: 'True',
      reason: 'Splits',
      message: 'model stories runs on 4 nodes in f32',
    });
    expect(dllamaSplitCondition(dllama({ nodesPower: 2 }), model(ready))).toMatchObject({ type: 'Splittable', observedGeneration: 3 });
  });

  test('False on nodes none runs on, naming the dimension of each', () => {
    expect(of(dllamaSplitCondition(dllama({ nodesPower: 3 }), model(ready)))).toEqual({
      status: 'False',
      reason: 'CannotSplit',
      message:
        'model stories cannot run on 8 nodes (q40: num_key_value_heads 4 / 8 nodes is not a whole number of KV heads per node; num_attention_heads × head_dim 64 / 8 nodes = 8 values per node, not a whole number of 32-value q40 blocks (Q40 matmul); intermediate_size 192 / 8 nodes = 24 values per node, not a whole number of 32-value q40 blocks (Q40 matmul); f32: num_key_value_heads 4 / 8 nodes is not a whole number of KV heads per node)',
    });
    // A plan published before the reasons were recorded: what it lists.
    const old = { ...ready, memory: ready.memory.map(({ refused: _, ...m }) => m) };
    expect(of(dllamaSplitCondition(dllama({ nodesPower: 3 }), model(old)))?.message).toBe(
      'model stories cannot run on 8 nodes (q40: runs on 1, 2 only; f32: runs on 1, 2, 4 only)',
    );
  });

  test('autoNodes: True while any topology runs', () => {
    expect(of(dllamaSplitCondition(dllama({ autoNodes: true, nodesPower: 4 }), model(ready)))).toEqual({
      status: 'True',
      reason: 'AutoNodes',
      message: 'the runtime picks the smallest topology that fits: model stories runs q40 on 1, 2; f32 on 1, 2, 4 nodes',
    });
  });

  test('Unknown until the Model is sized, or while it is missing; False without a distributed-llama artifact; none for llama.cpp', () => {
    expect(of(dllamaSplitCondition(dllama({}), undefined))).toEqual({
      status: 'Unknown',
      reason: 'ModelNotFound',
      message: 'model stories does not exist in ns',
    });
    expect(of(dllamaSplitCondition(dllama({}), model(null, {})))).toEqual({
      status: 'Unknown',
      reason: 'ModelNotSized',
      message: 'model stories has no memory plans yet (Ready: Transferring: transferring org/m)',
    });
    const failed = model(null, { phase: 'failed', failure: { type: 'UnsupportedModel', message: 'NoTopology: …', during: 'converting' } });
    expect(of(dllamaSplitCondition(dllama({}), failed))?.message).toBe('model stories has no memory plans yet (Ready: UnsupportedModel: NoTopology: …)');
    const gguf: ReadyModel = {
      ...ready,
      artifacts: [{ format: 'gguf', weights: 'q40', converterVersion: '1', files: [file] }],
      memory: [planMemory(spec, 'gguf', 'q40', 256, 1)],
    };
    expect(of(dllamaSplitCondition(dllama({}), model(gguf)))).toEqual({
      status: 'False',
      reason: 'NoDllamaArtifact',
      message: 'model stories has no distributed-llama artifact (it has gguf:q40)',
    });
    expect(dllamaSplitCondition(dllama({ engine: 'llamacpp' }), model(ready))).toBeNull();
  });
});

import type { PipelineProgress } from '../shared/status';
import { dllamaStatus, humanBytes, mergeConditions, modelConditions, modelStatus } from './status';

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
  expect(summary(serving.conditions!)).toEqual(['Ready=True/InstancesReady', 'Degraded=False/AsExpected']);
  const failing = dllamaStatus({ ...base, pool: { instances: [], waiting: 1, lastError: 'ModelNotReady: no GGUF' } });
  expect(failing).toMatchObject({ phase: 'Degraded', replicas: 0, readyReplicas: 0, lastError: 'ModelNotReady: no GGUF' });
  expect(summary(failing.conditions!)).toEqual(['Ready=False/NoInstances', 'Degraded=True/InstanceFailed']);
});

test('a step retrying after failed attempts is named in its stage and in Ready; a failure replaces it', () => {
  const retrying = { activity: 'resolveSource', attempt: 3, message: 'HubError: connect ECONNREFUSED 127.0.0.1:1', at: '2026-11-24T10:00:00.000Z' };
  const cs = modelConditions(progress({ phase: 'resolving', retrying }), 3);
  expect(summary(cs)).toEqual(['Downloaded=False/Resolving', 'Converted=False/Pending', 'Sized=False/Pending', 'Ready=False/Resolving']);
  expect(cs[0]!.message).toBe('retrying: attempt 3 of resolveSource failed: HubError: connect ECONNREFUSED 127.0.0.1:1');
  expect(cs[3]!.message).toBe('resolving org/m; retrying: attempt 3 of resolveSource failed: HubError: connect ECONNREFUSED 127.0.0.1:1');
  expect(cs[1]!.message).toBe('');
});

import type { ModelSpec } from '../../shared/model';
import { PipelineState } from './state';

const spec = (repo = 'org/m'): ModelSpec => ({ source: { repo }, artifacts: [{ format: 'gguf', weights: 'q40' }] });

test('a resource generation is taken in once; an equal spec does not re-plan, a new one does', () => {
  const s = new PipelineState({ namespace: 'ns', name: 'm', spec: spec(), resource: { uid: 'A', generation: 1 } });
  s.applyResource({ uid: 'A', generation: 1, spec: spec('org/other') }); // a repeat of generation 1: ignored
  expect([s.generation, s.spec.source.repo, s.progress().observedGeneration]).toEqual([1, 'org/m', 1]);
  s.applyResource({ uid: 'A', generation: 2, spec: spec() }); // e.g. only the deletion policy changed
  expect([s.generation, s.progress().observedGeneration]).toEqual([1, 2]);
  s.applyResource({ uid: 'A', generation: 3, spec: spec('org/other') });
  expect([s.generation, s.spec.source.repo, s.progress().observedGeneration]).toEqual([2, 'org/other', 3]);
  s.applyResource({ uid: 'A', generation: 2, spec: spec('org/stale') }); // late and old: ignored
  expect([s.generation, s.spec.source.repo]).toEqual([2, 'org/other']);
});

test('a new uid under the same name starts over, even with the same spec', () => {
  const s = new PipelineState({ namespace: 'ns', name: 'm', spec: spec(), resource: { uid: 'A', generation: 5 } });
  s.applyResource({ uid: 'B', generation: 1, spec: spec() });
  expect([s.generation, s.resource, s.progress().observedGeneration]).toEqual([2, { uid: 'B', generation: 1 }, 1]);
});

test('a pipeline started without a resource adopts one without re-planning an equal spec', () => {
  const s = new PipelineState({ namespace: 'ns', name: 'm', spec: spec() });
  expect(s.progress().observedGeneration).toBeUndefined();
  s.applyResource({ uid: 'A', generation: 1, spec: spec() });
  expect([s.generation, s.progress().observedGeneration]).toEqual([1, 1]);
});

test('the rerun nonce re-plans an otherwise equal spec', () => {
  const s = new PipelineState({ namespace: 'ns', name: 'm', spec: spec(), resource: { uid: 'A', generation: 1 } });
  s.applyResource({ uid: 'A', generation: 2, spec: { ...spec(), rerun: 'x' } });
  expect(s.generation).toBe(2);
});

test('a cancel for another resource of the same name is ignored', () => {
  const s = new PipelineState({ namespace: 'ns', name: 'm', spec: spec(), resource: { uid: 'B', generation: 1 } });
  s.cancel({ forget: true, uid: 'A' });
  expect(s.cancelled).toBe(false);
  s.cancel({ forget: true, uid: 'B' });
  expect([s.cancelled, s.cancelOptions.forget]).toEqual([true, true]);
});

test('a failed attempt being retried is shown until its step completes or the phase changes; older reports never replace newer ones', () => {
  const s = new PipelineState({ namespace: 'ns', name: 'm', spec: spec() });
  let changes = 0;
  s.onChange = () => changes++;
  s.enter('resolving');
  const fail = (attempt: number, key?: string, activity = 'resolveSource') => ({
    activity,
    ...(key ? { key } : {}),
    attempt,
    message: `HubError: cannot reach the hub (${attempt})`,
    at: '2026-11-24T10:00:00.000Z',
  });
  s.onActivityFailed(fail(2));
  s.onActivityFailed(fail(1)); // a late report of an earlier attempt
  expect(s.progress().retrying).toEqual(fail(2));
  expect(changes).toBe(2); // enter, the report; the stale one changed nothing
  s.planned('a'.repeat(40), [{ path: 'config.json', size: 10, sha256: null }]);
  s.enter('transferring');
  expect(s.progress().retrying).toBeUndefined();
  s.onActivityFailed(fail(1, 'config.json', 'transferFile'));
  s.fileDone({ path: 'other.json', size: 1, sha256: null });
  expect(s.progress().retrying?.key).toBe('config.json');
  s.fileDone({ path: 'config.json', size: 10, sha256: null });
  expect(s.progress().retrying).toBeUndefined();
  s.enter('converting');
  s.onActivityFailed(fail(3, 'gguf:q40', 'convertArtifact'));
  s.stepDone('dllama:q40');
  expect(s.progress().retrying?.attempt).toBe(3);
  s.stepDone('gguf:q40');
  expect(s.progress().retrying).toBeUndefined();
  s.onActivityFailed(fail(4, 'gguf:q40', 'convertArtifact'));
  s.fail('UnsupportedModel', 'no');
  expect(s.progress().retrying).toBeUndefined();
  s.onActivityFailed(fail(5, 'gguf:q40', 'convertArtifact')); // after the failure: nothing is retrying
  expect(s.progress().retrying).toBeUndefined();
});

test('a transfer report that arrives after its file is done counts nowhere (not as tensors)', () => {
  const s = new PipelineState({ namespace: 'ns', name: 'm', spec: spec() });
  s.planned('a'.repeat(40), [{ path: 'model.safetensors', size: 100, sha256: 'b'.repeat(64) }]);
  s.enter('transferring');
  s.fileDone({ path: 'model.safetensors', size: 100, sha256: 'b'.repeat(64) });
  s.enter('converting');
  s.onActivityProgress({ key: 'model.safetensors', kind: 'transfer', done: 90, total: 100 });
  s.onActivityProgress({ key: 'gguf:q40', kind: 'convert', done: 3, total: 21 });
  expect([s.progress().bytes, s.progress().tensors]).toEqual([
    { done: 100, total: 100 },
    { done: 3, total: 21 },
  ]);
});

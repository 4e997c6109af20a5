import type { CoreV1Api, CustomObjectsApi } from '@kubernetes/client-node';
import type { DllamaResource } from '../shared/kube';
import { FINALIZER } from '../shared/kube';
import { DllamaReconciler } from './dllama-reconciler';
import type { Finalizers } from './finalizers';
import type { WorkflowSignals } from './signals';

/** A Dllama being deleted, its finalizer still on: the copy a watch holds. */
const deleting = (): DllamaResource => ({
  apiVersion: 'magus.dev/v1alpha1',
  kind: 'Dllama',
  metadata: {
    name: 'tiny-pool',
    namespace: 'team',
    uid: 'uid-1',
    generation: 3,
    finalizers: [FINALIZER],
    deletionTimestamp: '1970-01-01T00:00:00Z',
    creationTimestamp: '1970-01-01T00:00:00Z',
  },
  spec: { model: 'tiny', engine: 'llamacpp', nodesPower: 0, replicas: 0, minReplicas: 0, maxReplicas: 2, leasesPerInstance: 4, idleTimeout: '10m' },
});

function reconciler() {
  const signals: unknown[] = [];
  const removed: string[] = [];
  const workflows = {
    running: () => Promise.resolve(true),
    handle: () => ({ signal: (_name: unknown, arg: unknown) => Promise.resolve(void signals.push(arg)) }),
  } as unknown as WorkflowSignals;
  const finalizers = { remove: (_plural: string, d: DllamaResource) => Promise.resolve(void removed.push(d.metadata.uid)) } as unknown as Finalizers;
  const r = new DllamaReconciler({
    workflows,
    finalizers,
    core: {} as CoreV1Api,
    custom: {} as CustomObjectsApi,
    dllamas: () => [],
    model: () => undefined,
  });
  return { r, signals, removed };
}

test('a deletion is told to the pool once, however often a stale copy that still holds the finalizer is reconciled', async () => {
  const { r, signals, removed } = reconciler();
  const d = deleting();
  await r.reconcile(d);
  // The pool's status write brings the same copy back before the finalizer's removal shows.
  await r.reconcile(deleting());
  expect(signals).toEqual([expect.objectContaining({ name: 'tiny-pool', uid: 'uid-1', deleted: true })]);
  expect(removed).toEqual(['uid-1', 'uid-1']);
  // Gone (its DELETED event): nothing is kept of it; a Dllama of that uid is not seen again.
  r.deleted(d);
  await r.reconcile(deleting());
  expect(signals).toHaveLength(2);
});

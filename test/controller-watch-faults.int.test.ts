/**
 * The controller when the API server goes away: restarted (kube-apiserver stopped and started
 * again on the same port, etcd kept), and cut off from the controller for a while. Changes made
 * meanwhile are all seen afterwards. And a cleanup that can never finish (no worker runs the
 * workflow) does not hold a deletion for ever: it is cut short, reported, and the object goes.
 * The API server here is this file's own (restarting the shared one would disturb other files).
 */
import { CoreV1Api, CustomObjectsApi, KubeConfig } from '@kubernetes/client-node';
import type { Client } from '@temporalio/client';
import { temporal } from '@temporalio/proto';
import { installCrds } from '../kube/crds';
import { CRD_GROUP, CRD_VERSION } from '../shared/constants';
import { startController, type Controller } from '../controller/controller';
import { startServices, type RunningServices } from '../workers/dev/services';
import { isolation } from './harness';
import { temporalStack, TestStack } from './harness/stack';
import { startTcpProxy, type TcpProxy } from './harness/tcp-proxy';
import { eventually, sleep } from './harness/wait';

const EventType = temporal.api.enums.v1.EventType;
const iso = isolation();
const ns = iso.namespace;

let services: RunningServices;
let proxy: TcpProxy;
let admin: KubeConfig;
let client: Client;
let controller: Controller;
const log: string[] = [];
const stack = new TestStack();

const kubeConfigFor = (server: string, token: string): KubeConfig => {
  const kc = new KubeConfig();
  kc.loadFromOptions({
    clusters: [{ name: 't', server, skipTLSVerify: true }],
    users: [{ name: 't', token }],
    contexts: [{ name: 't', cluster: 't', user: 't' }],
    currentContext: 't',
  });
  return kc;
};
const custom = () => admin.makeApiClient(CustomObjectsApi);
const model = (name: string, revision = 'main') => ({
  apiVersion: `${CRD_GROUP}/${CRD_VERSION}`,
  kind: 'Model',
  metadata: { name, namespace: ns },
  spec: { source: { repo: 'magus-test/tiny-llama', revision, hubUrl: 'http://127.0.0.1:9' }, artifacts: [{ format: 'gguf', weights: 'q40' }] },
});
const create = (name: string) =>
  custom().createNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: ns, plural: 'models', body: model(name) });
const setRevision = (name: string, revision: string) =>
  custom().patchNamespacedCustomObject({
    group: CRD_GROUP,
    version: CRD_VERSION,
    namespace: ns,
    plural: 'models',
    name,
    body: [{ op: 'replace', path: '/spec/source/revision', value: revision }],
  });

async function signals(name: string): Promise<number> {
  try {
    const history = await client.workflow.getHandle(`model/${ns}/${name}`).fetchHistory();
    return (history.events ?? []).filter(
      (e) => e.eventType === EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED && e.workflowExecutionSignaledEventAttributes?.signalName === 'resourceChanged',
    ).length;
  } catch {
    return 0;
  }
}

beforeAll(async () => {
  services = await startServices({ services: ['kubernetes'], log: () => undefined });
  stack.defer(() => services.stop());
  const k = services.endpoints.kubernetes!;
  admin = kubeConfigFor(k.server, k.token);
  await installCrds(admin);
  await admin.makeApiClient(CoreV1Api).createNamespace({ body: { metadata: { name: ns } } });
  // The controller reaches the API server through a proxy this test can cut.
  const url = new URL(k.server);
  proxy = stack.open(await startTcpProxy({ host: url.hostname, port: Number(url.port) }));
  ({ client } = await stack.open(temporalStack()));
  controller = startController({
    kc: kubeConfigFor(`https://${proxy.address}`, k.token),
    // No worker polls this queue: workflows start (server-side) but never run.
    temporal: { client, namespace: 'default', taskQueue: `${iso.id}-control` },
    namespaces: [ns],
    cleanupTimeoutMs: 3000,
    log: (l) => log.push(l),
  });
  stack.defer(() => controller.stop());
  await controller.synced;
}, 180_000);

afterAll(() => stack.close());

test('changes made across an API server restart are all seen', async () => {
  await create('a');
  await eventually(async () => expect(await signals('a')).toBe(1), 30_000);
  await services.restartKubernetes();
  // Right after it is back, before the controller's watch has come back.
  await setRevision('a', 'v2');
  await create('b');
  await eventually(async () => {
    expect(await signals('a')).toBe(2);
    expect(await signals('b')).toBe(1);
  }, 60_000);
  expect(controller.metrics().watches.models!.errors).toBeGreaterThan(0);
}, 120_000);

test('changes made while the controller is cut off are all seen once it is back', async () => {
  proxy.cut();
  await create('c');
  await setRevision('b', 'v2');
  await sleep(1500);
  expect(await signals('c')).toBe(0);
  proxy.restore();
  await eventually(async () => {
    expect(await signals('c')).toBe(1);
    expect(await signals('b')).toBe(2);
  }, 60_000);
}, 120_000);

test('a cleanup that cannot finish is cut short after the timeout, reported, and the Model goes', async () => {
  const t0 = Date.now();
  await custom().deleteNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: ns, plural: 'models', name: 'c' });
  await eventually(
    async () =>
      expect(custom().getNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: ns, plural: 'models', name: 'c' })).rejects.toMatchObject({
        code: 404,
      }),
    30_000,
  );
  // Measured from deletionTimestamp, which has whole seconds: at least 2 s after the request.
  expect(Date.now() - t0).toBeGreaterThanOrEqual(2000);
  expect((await client.workflow.getHandle(`model/${ns}/c`).describe()).status.name).toBe('TERMINATED');
  const events = await admin.makeApiClient(CoreV1Api).listNamespacedEvent({ namespace: ns, fieldSelector: 'involvedObject.name=c,type=Warning' });
  expect(events.items.map((e) => e.reason)).toEqual(['CleanupTimedOut']);
  expect(controller.metrics().cleanupsTimedOut).toBe(1);
}, 60_000);

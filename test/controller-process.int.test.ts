/**
 * `magus controller` as an operator runs it: two replicas of the real process against the test
 * kube-apiserver, Temporal and NATS. One leads (the Lease), both answer health checks, the
 * leader's SIGTERM hands over to the other, and a resource seen by both replicas, and reconciled
 * again after the hand-over, reaches its workflow as one signal.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { join } from 'node:path';
import { CoordinationV1Api, CoreV1Api, CustomObjectsApi } from '@kubernetes/client-node';
import type { Client } from '@temporalio/client';
import { temporal } from '@temporalio/proto';
import { dataPlaneNames } from '../dataplane';
import { installCrds } from '../kube/crds';
import { freePort, writeKubeconfig } from '../workers/dev/services';
import { CRD_GROUP, CRD_VERSION } from '../shared/constants';
import { endpoint, isolation, natsCredentialsEnv, natsRoleCredentials } from './harness';
import { kubeConfig } from './harness/kube';
import { natsStack, tempDir, temporalStack, TestStack } from './harness/stack';
import { eventually, until } from './harness/wait';

const EventType = temporal.api.enums.v1.EventType;
const iso = isolation();
const ns = iso.namespace;
const bin = join(__dirname, '..', 'bin', 'magus.js');

interface Replica {
  child: ChildProcess;
  health: string;
  output: string[];
  exit: Promise<number | null>;
}

let dir: string;
let kubeconfigFile: string;
let client: Client;
const replicas: Replica[] = [];
const stack = new TestStack();

async function startReplica(): Promise<Replica> {
  const port = await freePort();
  const child = spawn(process.execPath, [bin, 'controller', '--namespace', ns, '--health-address', `127.0.0.1:${port}`], {
    env: {
      ...process.env,
      KUBECONFIG: kubeconfigFile,
      MAGUS_TEMPORAL_ADDRESS: endpoint('temporal').address,
      MAGUS_NATS_URL: endpoint('nats').servers,
      ...natsCredentialsEnv(await natsRoleCredentials('controller', dataPlaneNames(iso.natsPrefix))),
      MAGUS_NATS_PREFIX: iso.natsPrefix,
      MAGUS_TASK_QUEUE: `${iso.id}-control`,
    },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  const output: string[] = [];
  child.stdout.on('data', (d: Buffer) => output.push(d.toString()));
  child.stderr.on('data', (d: Buffer) => output.push(d.toString()));
  const exit = new Promise<number | null>((r) => child.once('exit', (code) => r(code)));
  const r = { child, health: `http://127.0.0.1:${port}`, output, exit };
  replicas.push(r);
  return r;
}

const get = (r: Replica, path: string) =>
  fetch(`${r.health}${path}`)
    .then(async (res) => ({ status: res.status, text: await res.text() }))
    .catch(() => ({ status: 0, text: '' }));
const isLeader = async (r: Replica) => /^magus_controller_leader 1$/m.test((await get(r, '/metrics')).text);

async function signals(workflowId: string): Promise<number> {
  const history = await client.workflow.getHandle(workflowId).fetchHistory();
  return (history.events ?? []).filter((e) => e.eventType === EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED).length;
}

async function applyModel(name: string): Promise<void> {
  const custom = kubeConfig().makeApiClient(CustomObjectsApi);
  await custom.createNamespacedCustomObject({
    group: CRD_GROUP,
    version: CRD_VERSION,
    namespace: ns,
    plural: 'models',
    body: {
      apiVersion: `${CRD_GROUP}/${CRD_VERSION}`,
      kind: 'Model',
      metadata: { name },
      spec: { source: { repo: 'magus-test/tiny-llama', hubUrl: 'http://127.0.0.1:9' }, artifacts: [{ format: 'gguf', weights: 'q40' }] },
    },
  });
}

beforeAll(async () => {
  ({ dir } = stack.open(tempDir('magus-controller-process-')));
  const k = endpoint('kubernetes');
  kubeconfigFile = join(dir, 'kubeconfig');
  writeKubeconfig(kubeconfigFile, k, ns);
  const kc = kubeConfig();
  await installCrds(kc);
  await kc.makeApiClient(CoreV1Api).createNamespace({ body: { metadata: { name: ns } } });
  ({ client } = await stack.open(temporalStack()));
  // The data plane, declared as the worker declares it: the controller's user may only use it.
  await stack.open(natsStack(iso, { declare: true }));
}, 120_000);

afterAll(async () => {
  for (const r of replicas) if (r.child.exitCode === null) r.child.kill('SIGKILL');
  await stack.close();
});

test('two replicas: one leads, both are healthy; the leader’s SIGTERM hands over; nothing is signalled twice', async () => {
  const [a, b] = [await startReplica(), await startReplica()];
  await until('both replicas answer /healthz', async () => (await get(a, '/healthz')).status === 200 && (await get(b, '/healthz')).status === 200, 60_000);
  await until('one replica leads', async () => (await isLeader(a)) !== (await isLeader(b)), 30_000);
  await until(
    'both are ready (the leader synced, the other standing by)',
    async () => (await get(a, '/readyz')).status === 200 && (await get(b, '/readyz')).status === 200,
    30_000,
  );
  const lease = await kubeConfig().makeApiClient(CoordinationV1Api).readNamespacedLease({ namespace: ns, name: 'magus-controller' });
  expect(lease.spec?.holderIdentity).toMatch(/-\d+$/);

  await applyModel('first');
  const first = `model/${ns}/first`;
  await eventually(async () => expect(await signals(first)).toBe(1), 30_000);

  const [leader, standby] = (await isLeader(a)) ? [a, b] : [b, a];
  const t0 = Date.now();
  leader.child.kill('SIGTERM');
  const code = await leader.exit;
  expect([code, code === 0 ? '' : leader.output.join('')]).toEqual([0, '']); // its log says why, if not
  expect(Date.now() - t0).toBeLessThan(10_000);
  await until('the standby takes over', () => isLeader(standby), 20_000);
  const takeover = Date.now() - t0;

  // The new leader reconciles `first` again (its status never caught up: no worker runs here):
  // the same uid/generation request id, which Temporal de-duplicates.
  await applyModel('second');
  await eventually(async () => expect(await signals(`model/${ns}/second`)).toBe(1), 30_000);
  expect(await signals(first)).toBe(1);
  const metrics = (await get(standby, '/metrics')).text;
  // It did signal `first` again (and `second`): two signal-with-starts, one signal in history.
  expect(metrics).toMatch(/^magus_controller_signals_total 2$/m);
  expect(metrics).toMatch(/^magus_controller_watch_errors_total\{resource="models"\} 0$/m);

  standby.child.kill('SIGINT');
  expect(await standby.exit).toBe(0);
  process.stderr.write(`controller hand-over after SIGTERM: ${takeover} ms\n`);
}, 120_000);

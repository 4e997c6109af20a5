/**
 * `npm run bench:runtime`: the Kubernetes runtime's own cost on a control plane without a real
 * kubelet (etcd + kube-apiserver + kube-controller-manager + kube-scheduler, kwok marking Pods
 * Ready at once): time from `create` to every pod Ready for distributed-llama on n = 0..3
 * (2^n nodes), and the apiserver requests the runtime makes per instance create and destroy
 * (counted by the runtime; list/watch of the ready wait included). What is measured is the
 * control-plane path only: scheduling, StatefulSet controllers, the pod watch. Target: ≤ 2 s
 * create → ready at n = 3.
 *
 * Environment: BENCH_ROUNDS (default 5) instances per n.
 */
import { connect } from 'nats';
import { installCrds } from '../kube/crds';
import { ensureDataPlane } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import { createKubernetesRuntime } from '../activities/runtime/kubernetes';
import type { ReadyModel } from '../shared/model';
import { startTestCluster } from '../test/harness/cluster';
import { createDllama } from '../test/harness/kube';
import { startServices } from '../workers/dev/services';
import { fmt, p50 } from './common';

const ROUNDS = Number(process.env.BENCH_ROUNDS ?? '5');
const NS = 'bench';
const TARGET_MS = 2000;

async function main(): Promise<void> {
  const services = await startServices({ services: ['nats'] });
  const cluster = await startTestCluster({ nodes: 8, nodeResources: { cpu: '16', memory: '64Gi' } });
  const nc = await connect({ servers: services.endpoints.nats!.servers });
  try {
    await installCrds(cluster.kubeConfig);
    await cluster.createNamespace(NS);
    const names = await ensureDataPlane(nc, { prefix: 'BENCH_RT' });
    const registry = await openModelRegistry(nc, names.modelsBucket);
    const runtime = createKubernetesRuntime({
      kc: cluster.kubeConfig,
      registry,
      nc,
      names,
      images: { magus: 'magus:bench', dllama: 'magus-dllama:bench' },
      natsUrl: 'nats://nats:4222',
      s3: { region: 'us-east-1', bucket: 'bench' },
    });
    const rows: string[] = [];
    let missed = false;
    for (const power of [0, 1, 2, 3]) {
      const name = `bench${power}`;
      const m: ReadyModel = {
        namespace: NS,
        name,
        source: { repo: `org/${name}`, revision: 'main', sha: 'c'.repeat(40) },
        artifacts: [
          {
            format: 'dllama',
            weights: 'q40',
            files: [
              { key: `a/${name}.m`, bytes: 1, sha256: '1'.repeat(64) },
              { key: `a/${name}.t`, bytes: 1, sha256: '2'.repeat(64) },
            ],
          },
        ],
        memory: [
          {
            format: 'dllama',
            weights: 'q40',
            contextLength: 2048,
            topologies: [1, 2, 4, 8].map((nodes) => ({ nodes, root: { total: 2 ** 30 }, worker: nodes > 1 ? { total: 2 ** 30 } : null })),
          },
        ],
        readyAt: new Date().toISOString(),
      } as ReadyModel;
      await registry.put(m);
      await createDllama(cluster.kubeConfig, NS, name, {
        model: name,
        engine: 'dllama',
        nodesPower: power,
        replicas: 1,
        minReplicas: 0,
        maxReplicas: 64,
        leasesPerInstance: 1,
        idleTimeout: '1h',
      });
      const createMs: number[] = [];
      const destroyMs: number[] = [];
      const perCreate: Record<string, number>[] = [];
      const perDestroy: Record<string, number>[] = [];
      // One instance not measured: the first object of a kind warms the discovery cache and the controllers.
      for (let round = -1; round < ROUNDS; round++) {
        const instance = `${name}-${round + 2}`;
        const c0 = runtime.requests();
        const t0 = performance.now();
        await runtime.create({ namespace: NS, model: name, pool: name, instance }, new AbortController().signal);
        const t1 = performance.now();
        const c1 = runtime.requests();
        await runtime.destroy(name, instance);
        const t2 = performance.now();
        const c2 = runtime.requests();
        if (round < 0) continue;
        createMs.push(t1 - t0);
        destroyMs.push(t2 - t1);
        perCreate.push(diff(c0, c1));
        perDestroy.push(diff(c1, c2));
      }
      const med = p50(createMs);
      if (power === 3 && med > TARGET_MS) missed = true;
      rows.push(
        `  n=${power} (${String(2 ** power).padStart(2)} pods)  create → ready p50 ${fmt(med, 0).padStart(6)} ms  max ${fmt(Math.max(...createMs), 0).padStart(6)} ms   destroy p50 ${fmt(p50(destroyMs), 0).padStart(4)} ms   requests/create ${show(perCreate[0]!)}   requests/destroy ${show(perDestroy[0]!)}`,
      );
    }
    process.stdout.write(
      `magus Kubernetes runtime benchmark — ${ROUNDS} instances per size, kwok (8 fake nodes), apiserver + controller-manager + scheduler v1.34\n`,
    );
    process.stdout.write(`${rows.join('\n')}\n`);
    process.stdout.write(`target: create → ready ≤ ${TARGET_MS} ms at n=3: ${missed ? 'MISSED' : 'met'}\n`);
  } finally {
    await nc.drain().catch(() => undefined);
    await cluster.stop();
    await services.stop();
  }
}

const diff = (a: Record<string, number>, b: Record<string, number>): Record<string, number> =>
  Object.fromEntries(
    Object.keys(b)
      .map((k): [string, number] => [k, (b[k] ?? 0) - (a[k] ?? 0)])
      .filter(([, v]) => v > 0),
  );
const show = (c: Record<string, number>): string =>
  `${Object.values(c).reduce((a, b) => a + b, 0)} (${Object.entries(c)
    .map(([k, v]) => `${k} ${v}`)
    .join(', ')})`;

main().then(
  () => process.exit(0),
  (err) => {
    console.error(err);
    process.exit(1);
  },
);

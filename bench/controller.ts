/**
 * `npm run bench:controller`: the control plane under a burst of resources, on real servers
 * (kube-apiserver + etcd, Temporal, NATS, MinIO) and the real `magus controller` process.
 *
 * 1. Start-up latency, for each N in BENCH_CONTROLLER_N (default `100,500`): N `Model`s created
 *    at once (50 requests in flight), no worker polling: the time from each create request to its
 *    workflow's start (Temporal's own start time), p50/p99; the apiserver requests the controller
 *    made per Model; its CPU seconds and peak RSS.
 * 2. Whole pipelines, BENCH_CONTROLLER_FULL (default 50) Models of the tiny fixture model with a
 *    worker: time until all are Ready, apiserver requests per Model by verb and resource, status
 *    writes per phase change, and the most status writes one Model got in any one second.
 *
 * Figures go to stdout as a table; nothing is asserted (the tests do that).
 */
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { spawn } from 'node:child_process';
import { request as httpsRequest } from 'node:https';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { CreateBucketCommand, S3Client } from '@aws-sdk/client-s3';
import { CoreV1Api, CustomObjectsApi, KubeConfig } from '@kubernetes/client-node';
import { Client, Connection } from '@temporalio/client';
import { DefaultLogger, Runtime } from '@temporalio/worker';
import { installCrds } from '../kube/crds';
import { watchResource } from '../kube/watch';
import { CRD_GROUP, CRD_VERSION } from '../shared/constants';
import type { ModelResource } from '../shared/kube';
import { startDemoHub } from '../workers/dev/hub';
import { writeTinyModel } from '../workers/dev/tiny-model';
import type { MagusConfig } from '../workers/config';
import { freePort, startServices, writeKubeconfig } from '../workers/dev/services';
import { startWorkers } from '../workers/worker';
import { cpuOf, fmt, p50, p99 } from './common';

const REPO = 'bench/tiny-llama';

const peakRssMb = (pid: number) => Number(/VmHWM:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))?.[1] ?? 0) / 1024;

/** `apiserver_request_total` summed by `verb resource[/subresource]`, for our group and Events. */
function apiserverRequests(server: string, token: string): Promise<Map<string, number>> {
  return new Promise((ok, fail) => {
    httpsRequest(`${server}/metrics`, { rejectUnauthorized: false, headers: { authorization: `Bearer ${token}` } }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (d: string) => (body += d));
      res.on('end', () => {
        const out = new Map<string, number>();
        for (const line of body.split('\n')) {
          if (!line.startsWith('apiserver_request_total{')) continue;
          const label = (k: string) => new RegExp(`${k}="([^"]*)"`).exec(line)?.[1] ?? '';
          if (label('group') !== CRD_GROUP && label('resource') !== 'events') continue;
          const key = `${label('verb')} ${label('resource')}${label('subresource') ? `/${label('subresource')}` : ''}`;
          out.set(key, (out.get(key) ?? 0) + Number(line.slice(line.lastIndexOf(' ') + 1)));
        }
        ok(out);
      });
    })
      .on('error', fail)
      .end();
  });
}
const diff = (after: Map<string, number>, before: Map<string, number>) =>
  new Map([...after].map(([k, v]) => [k, v - (before.get(k) ?? 0)] as const).filter(([, v]) => v > 0));

async function inParallel<T>(items: T[], width: number, fn: (item: T) => Promise<void>): Promise<void> {
  let next = 0;
  await Promise.all(
    Array.from({ length: width }, async () => {
      while (next < items.length) await fn(items[next++]!);
    }),
  );
}

async function main(): Promise<void> {
  Runtime.install({ logger: new DefaultLogger('WARN') });
  const sizes = (process.env.BENCH_CONTROLLER_N ?? '100,500')
    .split(',')
    .map(Number)
    .filter((n) => n > 0);
  const full = Number(process.env.BENCH_CONTROLLER_FULL ?? '50');
  const dir = mkdtempSync(join(tmpdir(), 'magus-bench-controller-'));
  const services = await startServices({ services: ['temporal', 'nats', 's3', 'kubernetes'] });
  const e = services.endpoints;
  const k = e.kubernetes!;
  const kc = new KubeConfig();
  kc.loadFromOptions({
    clusters: [{ name: 'b', server: k.server, skipTLSVerify: true }],
    users: [{ name: 'b', token: k.token }],
    contexts: [{ name: 'b', cluster: 'b', user: 'b' }],
    currentContext: 'b',
  });
  const kubeconfigFile = join(dir, 'kubeconfig');
  writeKubeconfig(kubeconfigFile, k);
  await installCrds(kc);
  const custom = kc.makeApiClient(CustomObjectsApi);
  const core = kc.makeApiClient(CoreV1Api);
  const connection = await Connection.connect({ address: e.temporal!.address });
  const client = new Client({ connection });
  const hub = await startDemoHub();
  await writeTinyModel(join(dir, 'tiny'), { seed: 5 });
  await hub.addRepo({ id: REPO, dir: join(dir, 'tiny') });
  const model = (ns: string, name: string) => ({
    apiVersion: `${CRD_GROUP}/${CRD_VERSION}`,
    kind: 'Model',
    metadata: { name, namespace: ns },
    spec: { source: { repo: REPO, hubUrl: hub.url }, artifacts: [{ format: 'gguf', weights: 'q40' }], contextLength: 128 },
  });

  /** The controller process, watching `ns`, on task queue `queue`. */
  async function controller(ns: string, queue: string) {
    const port = await freePort();
    const child = spawn(
      process.execPath,
      [join(__dirname, '..', 'bin', 'magus.js'), 'controller', '--namespace', ns, '--health-address', `127.0.0.1:${port}`, '--no-leader-elect'],
      {
        env: {
          ...process.env,
          KUBECONFIG: kubeconfigFile,
          MAGUS_TEMPORAL_ADDRESS: e.temporal!.address,
          MAGUS_NATS_URL: e.nats!.servers,
          MAGUS_TASK_QUEUE: queue,
          MAGUS_NATS_PREFIX: ns.replace(/-/g, '_').toUpperCase(),
        },
        stdio: ['ignore', 'ignore', 'inherit'],
      },
    );
    const ready = async () => (await fetch(`http://127.0.0.1:${port}/readyz`).catch(() => null))?.status === 200;
    for (let i = 0; !(await ready()); i++) {
      if (i > 600) throw new Error('the controller did not become ready');
      await new Promise((r) => setTimeout(r, 100));
    }
    return { pid: child.pid!, stop: () => new Promise<void>((r) => (child.once('exit', () => r()), child.kill('SIGTERM'))) };
  }

  const rows: string[] = [];
  try {
    for (const n of sizes) {
      const ns = `bench-start-${n}`;
      await core.createNamespace({ body: { metadata: { name: ns } } });
      const queue = `${ns}-control`;
      const c = await controller(ns, queue);
      const cpu0 = cpuOf(c.pid);
      const before = await apiserverRequests(k.server, k.token);
      const requestedAt = new Map<string, number>();
      const createdAt = new Map<string, number>();
      const names = Array.from({ length: n }, (_, i) => `m${i}`);
      const t0 = Date.now();
      await inParallel(names, 50, async (name) => {
        requestedAt.set(name, Date.now());
        await custom.createNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: ns, plural: 'models', body: model(ns, name) });
        createdAt.set(name, Date.now());
      });
      const createSeconds = (Date.now() - t0) / 1000;
      const started = new Map<string, number>();
      while (started.size < n) {
        await inParallel(
          names.filter((x) => !started.has(x)),
          20,
          async (name) => {
            try {
              const d = await client.workflow.getHandle(`model/${ns}/${name}`).describe();
              started.set(name, d.startTime.getTime());
            } catch {
              // not started yet
            }
          },
        );
        if (Date.now() - t0 > 300_000) throw new Error(`only ${started.size} of ${n} workflows started in 5 min`);
      }
      // From the API server's answer to the create (the object exists) to the workflow's start.
      const latencies = names.map((x) => started.get(x)! - createdAt.get(x)!);
      const fromRequest = names.map((x) => started.get(x)! - requestedAt.get(x)!);
      // Let the finalizer patches land before counting.
      await new Promise((r) => setTimeout(r, 2000));
      const requests = diff(await apiserverRequests(k.server, k.token), before);
      const byController = [...requests].filter(([key]) => !key.startsWith('POST models')).reduce((s, [, v]) => s + v, 0);
      rows.push(
        `| ${n} Models created at once (50 creates in flight; all created in ${fmt(createSeconds, 1)} s) → workflow started | created → started p50 ${fmt(p50(latencies), 0)} ms, p99 ${fmt(p99(latencies), 0)} ms, max ${fmt(Math.max(...latencies), 0)} ms; create sent → started p50 ${fmt(p50(fromRequest), 0)}, p99 ${fmt(p99(fromRequest), 0)} ms | controller: ${fmt(byController / n, 2)} apiserver requests per Model (${[...requests].map(([kk, v]) => `${kk} ${v}`).join(', ')}); CPU ${fmt(cpuOf(c.pid) - cpu0, 2)} s; peak RSS ${fmt(peakRssMb(c.pid), 0)} MB |`,
      );
      process.stderr.write(`${rows.at(-1)}\n`);
      await c.stop();
      const terminate = names.map((x) =>
        client.workflow
          .getHandle(`model/${ns}/${x}`)
          .terminate('bench over')
          .catch(() => undefined),
      );
      await Promise.all(terminate);
    }

    if (full > 0) {
      const ns = 'bench-full';
      await core.createNamespace({ body: { metadata: { name: ns } } });
      const s3 = new S3Client({
        endpoint: e.s3!.endpoint,
        region: e.s3!.region,
        forcePathStyle: true,
        credentials: { accessKeyId: e.s3!.accessKeyId, secretAccessKey: e.s3!.secretAccessKey },
      });
      await s3.send(new CreateBucketCommand({ Bucket: 'bench-full' }));
      process.env.AWS_ACCESS_KEY_ID = e.s3!.accessKeyId;
      process.env.AWS_SECRET_ACCESS_KEY = e.s3!.secretAccessKey;
      const cfg: MagusConfig = {
        temporal: { address: e.temporal!.address, namespace: 'default' },
        taskQueue: `${ns}-control`,
        nats: { servers: e.nats!.servers },
        s3: { endpoint: e.s3!.endpoint, region: e.s3!.region, bucket: 'bench-full', forcePathStyle: true },
        natsPrefix: 'BENCH_FULL',
        modelCacheDir: join(dir, 'models'),
        convertThreads: 1,
        transferPartSize: undefined,
        s3TraceFile: undefined,
        // The bench's hub and its CDN, on loopback.
        hubAllowNetworks: [new URL(hub.url).hostname, new URL(hub.cdnUrl).hostname],
      };
      const workers = await startWorkers(cfg, { kube: kc });
      const c = await controller(ns, cfg.taskQueue);
      // Status writes per Model per second, from a watch (each MODIFIED with a new status).
      const writesPerSecond = new Map<string, number>();
      const lastStatus = new Map<string, string>();
      const ready = new Set<string>();
      const w = watchResource<ModelResource>(kc, {
        path: `/apis/${CRD_GROUP}/${CRD_VERSION}/namespaces/${ns}/models`,
        onEvent: (_t, m) => {
          const status = JSON.stringify(m.status ?? null);
          if (status !== lastStatus.get(m.metadata.name)) {
            lastStatus.set(m.metadata.name, status);
            const key = `${m.metadata.name}@${Math.floor(Date.now() / 1000)}`;
            writesPerSecond.set(key, (writesPerSecond.get(key) ?? 0) + 1);
          }
          if (m.status?.conditions?.some((x) => x.type === 'Ready' && x.status === 'True')) ready.add(m.metadata.name);
        },
      });
      await w.synced;
      const before = await apiserverRequests(k.server, k.token);
      const cpu0 = cpuOf(c.pid);
      const t0 = Date.now();
      await inParallel(
        Array.from({ length: full }, (_, i) => `m${i}`),
        50,
        async (name) => {
          await custom.createNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: ns, plural: 'models', body: model(ns, name) });
        },
      );
      while (ready.size < full) {
        if (Date.now() - t0 > 600_000) throw new Error(`only ${ready.size} of ${full} Models Ready in 10 min`);
        await new Promise((r) => setTimeout(r, 250));
      }
      const elapsed = (Date.now() - t0) / 1000;
      await new Promise((r) => setTimeout(r, 3000));
      const requests = diff(await apiserverRequests(k.server, k.token), before);
      const statusWrites = requests.get('APPLY models/status') ?? 0;
      const perSecondMax = Math.max(...writesPerSecond.values());
      // resolving → transferring → converting → sizing → publishing → ready: 6 phases.
      rows.push(
        `| ${full} Models through the whole pipeline (worker + controller) | all Ready in ${fmt(elapsed, 1)} s | ${fmt([...requests.values()].reduce((a, b) => a + b, 0) / full, 1)} apiserver requests per Model (${[...requests].map(([kk, v]) => `${kk} ${v}`).join(', ')}); ${fmt(statusWrites / full / 6, 2)} status writes per phase change; at most ${perSecondMax} status changes of one Model seen in one second; controller CPU ${fmt(cpuOf(c.pid) - cpu0, 2)} s |`,
      );
      process.stderr.write(`${rows.at(-1)}\n`);
      await w.stop();
      await c.stop();
      await workers.shutdown();
      s3.destroy();
    }
  } finally {
    await hub.stop();
    await connection.close();
    await services.stop();
    rmSync(dir, { recursive: true, force: true });
  }
  process.stdout.write(`\n| run | result | details |\n|---|---|---|\n${rows.join('\n')}\n`);
}

main().catch((err: unknown) => {
  process.stderr.write(`${(err as Error).stack ?? String(err)}\n`);
  process.exit(1);
});

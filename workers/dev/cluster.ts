/**
 * # A control plane with workload controllers and fake nodes, for tests
 *
 * Given a running kube-apiserver (from `startServices({ services: ['kubernetes'] })`: its URL and
 * admin bearer token), {@link startClusterComponents} adds what turns it into a cluster that runs
 * workloads, without a kubelet or a container runtime:
 * - **kube-controller-manager** v1.34.4 (`--controllers=*,-serviceaccount-token
 *   --use-service-account-credentials=false --leader-elect=false`): Deployments → ReplicaSets →
 *   Pods, StatefulSets, Jobs, EndpointSlices, the garbage collector (owner-reference cascades), the
 *   namespace's `default` ServiceAccount, node lifecycle;
 * - **kube-scheduler** v1.34.4 (`--leader-elect=false`): binds Pods to Nodes, or leaves them Pending
 *   with `PodScheduled=False` reason `Unschedulable` and a `FailedScheduling` event;
 * - **kwok** v0.8.0 (sigs.k8s.io/kwok) as the kubelet of `nodes` fake Nodes annotated
 *   `kwok.x-k8s.io/node: fake` (only those: `--manage-nodes-with-annotation-selector`), with its
 *   node-fast, node-heartbeat-with-lease and pod-fast Stages: Nodes become Ready and keep their
 *   Leases, Pods bound to them become Running and Ready with a pod IP at once (10.0.0.0/24).
 *
 * Binaries and kwok's Stage YAMLs come from `scripts/dev-services --json kube-controller-manager
 * kube-scheduler kwok` (pinned builds in ~/.cache/magus/bin; the stages in its `kwok-stages`
 * folder). Each component talks to the API server through a kubeconfig written to
 * `<dataDir>/kubeconfig` (the admin token; the self-signed serving certificate is not verified:
 * loopback, tests only), serves its health on a free loopback port, logs to
 * `<logDir>/<component>.log`, and runs under `setpriv --pdeathsig KILL`, so it dies with the process
 * that started it however that one dies. Every wait is bounded by `readyTimeoutSec`.
 *
 * The process helpers (launch, bounded readiness, "address already in use" → start again on new
 * ports) are services/supervision.ts's. kube-controller-manager and kube-scheduler print `"command failed" err="failed to create
 * listener: failed to listen on 127.0.0.1:N: … bind: address already in use"` and exit 1 when
 * their port is taken; kwok logs `Failed to run server … address already in use` and exits 1.
 *
 * Measured on the 2-core dev VM (2026-11-24): the three are ready 0.5–1.8 s after launch (started
 * side by side; kwok's time includes its 2 Nodes becoming Ready), after etcd + kube-apiserver's
 * 3.5–5.6 s. RSS after a Deployment, a StatefulSet and a Job: kube-controller-manager ~110 MiB,
 * kube-scheduler ~68 MiB, kwok ~65 MiB (kube-apiserver ~265 MiB, etcd ~48 MiB). Each stops on
 * SIGTERM in ~50 ms. Builds (scripts/dev-services), from an empty Go build cache with the module
 * sources already downloaded, load 4.5–8: kube-controller-manager 10.6 min, kube-scheduler
 * 5.4 min, kwok 4.2 min; after kube-apiserver's build has warmed the cache: 2.5 min, 15 s, 2.3 min.
 */
import { mkdirSync, readdirSync, writeFileSync } from 'node:fs';
import { request as httpsRequest } from 'node:https';
import { join } from 'node:path';
import { binaryPath, resolveBinaries } from './services/binaries';
import { freePort } from './services/ports';
import { alive, end, launch, NotReady, waitReady, within, type Proc as ServerProc } from './services/supervision';

type Proc = ServerProc<ClusterComponent>;

export type ClusterComponent = 'kube-controller-manager' | 'kube-scheduler' | 'kwok';

export interface ClusterOptions {
  /** The API server's URL, e.g. `https://127.0.0.1:6443` (self-signed TLS). */
  server: string;
  /** A bearer token of a `system:masters` user. */
  token: string;
  /** Where the kubeconfig and the components' generated serving certificates go (must exist or be creatable). */
  dataDir: string;
  /** Where `<component>.log` go; defaults to `<dataDir>/logs`. */
  logDir?: string;
  /** How many fake Nodes to create (default 2), named `kwok-node-0`, `kwok-node-1`, … */
  nodes?: number;
  /** Allocatable (= capacity) of every fake Node; default cpu 8, memory 32Gi (and always pods 110). */
  nodeResources?: { cpu: string; memory: string };
  /** Bound of each wait (a component's health, the Nodes becoming Ready); default 120 s. */
  readyTimeoutSec?: number;
  /** Notes about the start; defaults to stderr. */
  log?: (line: string) => void;
}

export interface ClusterComponents {
  /** Pids of the component processes (for tests that prove nothing is left behind). */
  pids: number[];
  /** The components by name, with their pids. */
  processes: { name: ClusterComponent; pid: number }[];
  /** The fake Nodes, Ready and schedulable. */
  nodeNames: string[];
  /** The kubeconfig the components use (admin token). */
  kubeconfigPath: string;
  /**
   * The loopback port each one serves its health on: HTTPS for kube-controller-manager and
   * kube-scheduler (`/healthz` open, `/metrics` with the admin token), HTTP for kwok (`/healthz`, `/metrics`).
   */
  ports: Record<ClusterComponent, number>;
  /** Milliseconds from each component's launch until it was ready (kwok: until its Nodes were Ready). */
  startMs: Record<ClusterComponent, number>;
  /** SIGTERM to every component, SIGKILL after 10 s; resolves once all have exited. Idempotent. */
  stop(): Promise<void>;
}

/** Binaries of the components and kwok's Stage folder (binaries.ts: built if missing). */
async function resolveComponents(): Promise<Record<ClusterComponent | 'kwok-stages', string>> {
  const out = await resolveBinaries(['kube-controller-manager', 'kube-scheduler', 'kwok']);
  return {
    'kube-controller-manager': binaryPath(out, 'kube-controller-manager'),
    'kube-scheduler': binaryPath(out, 'kube-scheduler'),
    kwok: binaryPath(out, 'kwok'),
    'kwok-stages': binaryPath(out, 'kwok-stages'),
  };
}

/** GET over HTTPS without verifying the (self-signed) certificate; the status code, 0 when unreachable. */
function httpsStatus(url: string, token?: string): Promise<number> {
  return new Promise((ok) => {
    const headers: Record<string, string> = token ? { authorization: `Bearer ${token}` } : {};
    const req = httpsRequest(url, { rejectUnauthorized: false, headers, timeout: 2000 }, (res) => {
      res.resume();
      ok(res.statusCode ?? 0);
    });
    req.on('error', () => ok(0));
    req.on('timeout', () => req.destroy());
    req.end();
  });
}

/** One request to the API server as the admin; the parsed body (undefined when empty). */
function kubeApi(server: string, token: string, method: string, path: string, body?: unknown): Promise<{ status: number; body: unknown }> {
  return new Promise((ok, fail) => {
    const payload = body === undefined ? undefined : JSON.stringify(body);
    const req = httpsRequest(
      new URL(path, server),
      {
        method,
        rejectUnauthorized: false,
        timeout: 10_000,
        headers: { authorization: `Bearer ${token}`, accept: 'application/json', ...(payload ? { 'content-type': 'application/json' } : {}) },
      },
      (res) => {
        let text = '';
        res.setEncoding('utf8');
        res.on('data', (c: string) => (text += c));
        res.on('end', () => {
          let parsed: unknown;
          try {
            parsed = text ? JSON.parse(text) : undefined;
          } catch {
            parsed = text;
          }
          ok({ status: res.statusCode ?? 0, body: parsed });
        });
      },
    );
    req.on('error', fail);
    req.on('timeout', () => req.destroy(new Error(`${method} ${path}: no answer within 10s`)));
    req.end(payload);
  });
}

interface NodeLike {
  status?: { conditions?: { type: string; status: string }[] };
  spec?: { taints?: { key: string }[]; unschedulable?: boolean };
}

/** Ready, and without the taints a new or lost node carries (the scheduler would skip it). */
function schedulable(node: NodeLike): boolean {
  const ready = node.status?.conditions?.some((c) => c.type === 'Ready' && c.status === 'True') ?? false;
  const tainted = node.spec?.taints?.some((t) => t.key === 'node.kubernetes.io/not-ready' || t.key === 'node.kubernetes.io/unreachable') ?? false;
  return ready && !tainted && !node.spec?.unschedulable;
}

function fakeNode(name: string, resources: { cpu: string; memory: string }): unknown {
  const capacity = { cpu: resources.cpu, memory: resources.memory, pods: '110' };
  return {
    apiVersion: 'v1',
    kind: 'Node',
    metadata: {
      name,
      annotations: { 'kwok.x-k8s.io/node': 'fake', 'node.alpha.kubernetes.io/ttl': '0' },
      labels: {
        'kubernetes.io/arch': 'amd64',
        'kubernetes.io/os': 'linux',
        'kubernetes.io/hostname': name,
        'node-role.kubernetes.io/agent': '',
        type: 'kwok',
      },
    },
    status: {
      allocatable: capacity,
      capacity,
      nodeInfo: { architecture: 'amd64', operatingSystem: 'linux', kubeletVersion: 'fake', kubeProxyVersion: 'fake' },
      phase: 'Running',
    },
  };
}

/** Writes (mode 0600) a kubeconfig for `server` as its admin (bearer `token`; the self-signed certificate not verified). */
export function writeAdminKubeconfig(path: string, server: string, token: string): void {
  const kubeconfig = {
    apiVersion: 'v1',
    kind: 'Config',
    clusters: [{ name: 'magus', cluster: { server, 'insecure-skip-tls-verify': true } }],
    users: [{ name: 'magus-admin', user: { token } }],
    contexts: [{ name: 'magus', context: { cluster: 'magus', user: 'magus-admin' } }],
    'current-context': 'magus',
  };
  writeFileSync(path, `${JSON.stringify(kubeconfig, null, 2)}\n`, { mode: 0o600 });
}

/** Starts kube-controller-manager, kube-scheduler and kwok against `opts.server`; resolves once Nodes are Ready. */
export async function startClusterComponents(opts: ClusterOptions): Promise<ClusterComponents> {
  const timeout = opts.readyTimeoutSec ?? 120;
  const say = opts.log ?? ((line: string) => void process.stderr.write(`magus cluster: ${line}\n`));
  const nodeCount = opts.nodes ?? 2;
  const resources = opts.nodeResources ?? { cpu: '8', memory: '32Gi' };
  const logDir = opts.logDir ?? join(opts.dataDir, 'logs');
  mkdirSync(logDir, { recursive: true });
  mkdirSync(opts.dataDir, { recursive: true });

  const kubeconfigPath = join(opts.dataDir, 'kubeconfig');
  writeAdminKubeconfig(kubeconfigPath, opts.server, opts.token);

  const bins = await resolveComponents();
  const stages = readdirSync(bins['kwok-stages'])
    .filter((f) => f.endsWith('.yaml'))
    .sort()
    .map((f) => join(bins['kwok-stages'], f));
  if (stages.length === 0) throw new Error(`no kwok Stage YAMLs in ${bins['kwok-stages']}; run 'scripts/dev-services kwok'`);

  const procs: Proc[] = [];
  let stopped = false;
  const stop = async () => {
    if (stopped) return;
    stopped = true;
    for (const p of [...procs].reverse()) if (alive(p)) p.child.kill('SIGTERM');
    await within(Promise.all(procs.map((p) => p.exited)), 10_000);
    for (const p of procs) if (alive(p)) p.child.kill('SIGKILL');
    await Promise.all(procs.map((p) => p.exited));
    await within(Promise.all(procs.map((p) => p.closed)), 2000);
  };

  /** Starts a component on a fresh port until `ready` holds; on new ports again (3 starts) while its port turns out taken. */
  const start = async (
    name: ClusterComponent,
    args: (port: number) => string[],
    what: string,
    ready: (port: number) => () => Promise<boolean>,
  ): Promise<{ ms: number; port: number }> => {
    const begun = Date.now();
    for (let attempt = 1; ; attempt++) {
      const port = await freePort();
      if (stopped) throw new Error('the cluster components were stopped');
      const p = launch(name, bins[name], args(port), logDir, {}, `attempt ${attempt}, port ${port}`);
      procs.push(p);
      try {
        await waitReady(p, timeout, ready(port), what);
        return { ms: Date.now() - begun, port };
      } catch (err) {
        await end(p, 0);
        procs.splice(procs.indexOf(p), 1);
        if (!(err instanceof NotReady) || err.inUse === undefined || attempt >= 3) throw err;
        say(`${name}: port ${port} was taken by another process before it could bind it; starting it again on a new port`);
      }
    }
  };

  const api = (method: string, path: string, body?: unknown) => kubeApi(opts.server, opts.token, method, path, body);
  const certDir = (name: string) => join(opts.dataDir, `${name}-certs`);
  /** What kube-controller-manager and kube-scheduler both take: the cluster, their secure port, no leader election. */
  const controlPlaneFlags = (name: ClusterComponent, port: number): string[] => [
    `--kubeconfig=${kubeconfigPath}`,
    // Bearer tokens on its port are checked with the API server (/metrics with the admin
    // token); /healthz, /readyz and /livez stay open (--authorization-always-allow-paths).
    `--authentication-kubeconfig=${kubeconfigPath}`,
    `--authorization-kubeconfig=${kubeconfigPath}`,
    '--leader-elect=false',
    '--bind-address=127.0.0.1',
    `--secure-port=${port}`,
    `--cert-dir=${certDir(name)}`,
    '-v=1',
  ];
  const nodeNames = Array.from({ length: nodeCount }, (_, i) => `kwok-node-${i}`);

  try {
    const started = await Promise.allSettled([
      start(
        'kube-controller-manager',
        (port) => [...controlPlaneFlags('kube-controller-manager', port), '--controllers=*,-serviceaccount-token', '--use-service-account-credentials=false'],
        '/healthz answering ok and the ServiceAccount default/default existing',
        (port) => async () =>
          (await httpsStatus(`https://127.0.0.1:${port}/healthz`)) === 200 &&
          (await api('GET', '/api/v1/namespaces/default/serviceaccounts/default')).status === 200,
      ),
      start(
        'kube-scheduler',
        (port) => controlPlaneFlags('kube-scheduler', port),
        '/healthz answering ok',
        (port) => async () => (await httpsStatus(`https://127.0.0.1:${port}/healthz`)) === 200,
      ),
      start(
        'kwok',
        (port) => [
          `--kubeconfig=${kubeconfigPath}`,
          '--manage-all-nodes=false',
          '--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake',
          `--server-address=127.0.0.1:${port}`,
          '--node-lease-duration-seconds=40',
          ...stages.map((s) => `--config=${s}`),
        ],
        '/healthz answering ok',
        (port) => async () => (await fetch(`http://127.0.0.1:${port}/healthz`, { signal: AbortSignal.timeout(2000) })).ok,
      ),
    ]);
    const failed = started.filter((r): r is PromiseRejectedResult => r.status === 'rejected');
    if (failed.length > 0) throw new Error(failed.map((f) => (f.reason instanceof Error ? f.reason.message : String(f.reason))).join('\n\n'));
    const [kcm, scheduler, kwokStart] = started.map((r) => (r.status === 'fulfilled' ? r.value : { ms: 0, port: 0 })) as [
      { ms: number; port: number },
      { ms: number; port: number },
      { ms: number; port: number },
    ];

    // The fake Nodes (an existing one, from an earlier start against the same API server, is kept).
    const begun = Date.now();
    for (const name of nodeNames) {
      const res = await api('POST', '/api/v1/nodes', fakeNode(name, resources));
      if (res.status !== 201 && res.status !== 409) throw new Error(`could not create Node ${name}: HTTP ${res.status} ${JSON.stringify(res.body)}`);
    }
    const kwok = procs.find((p) => p.name === 'kwok');
    if (!kwok) throw new Error('kwok is not running');
    const nodesReady = async () => {
      for (const name of nodeNames) {
        const res = await api('GET', `/api/v1/nodes/${name}`);
        if (res.status !== 200 || !schedulable(res.body as NodeLike)) return false;
      }
      return true;
    };
    await waitReady(kwok, timeout, nodesReady, `Nodes ${nodeNames.join(', ')} becoming Ready and untainted`);
    const startMs = { 'kube-controller-manager': kcm.ms, 'kube-scheduler': scheduler.ms, kwok: kwokStart.ms + (Date.now() - begun) };
    const ports = { 'kube-controller-manager': kcm.port, 'kube-scheduler': scheduler.port, kwok: kwokStart.port };
    say(`ready: kube-controller-manager in ${kcm.ms} ms, kube-scheduler in ${scheduler.ms} ms, kwok (with ${nodeCount} Ready Nodes) in ${startMs.kwok} ms`);
    const processes = procs.map((p) => ({ name: p.name, pid: p.child.pid })).filter((p): p is { name: ClusterComponent; pid: number } => p.pid !== undefined);
    return {
      get pids() {
        return procs.map((p) => p.child.pid).filter((pid): pid is number => pid !== undefined);
      },
      processes,
      nodeNames,
      kubeconfigPath,
      ports,
      startMs,
      stop,
    };
  } catch (err) {
    await stop();
    throw err;
  }
}

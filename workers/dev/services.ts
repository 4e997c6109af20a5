/**
 * Starts the real servers magus runs against — Temporal dev server, nats-server (JetStream),
 * MinIO (S3) and etcd + kube-apiserver — on free loopback ports with throwaway data folders.
 * Used by `magus dev` and by the jest global setup, so tests run against exactly what users run.
 *
 * No orphans: every server is exec'd through `setpriv --pdeathsig KILL`, so the kernel kills it
 * when the process that started it dies, however it dies (SIGKILL included).
 */
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { randomBytes, generateKeyPairSync } from 'node:crypto';
import { createWriteStream, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { connect, createServer } from 'node:net';
import { cpus, tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { request as httpsRequest } from 'node:https';
import { promisify } from 'node:util';

export type ServiceName = 'temporal' | 'nats' | 's3' | 'kubernetes';
export const ALL_SERVICES: readonly ServiceName[] = ['temporal', 'nats', 's3', 'kubernetes'];

/** Connection details of running servers. Written to a file for test workers; never logged. */
export interface ServiceEndpoints {
  temporal?: { address: string; namespace: string; uiUrl: string };
  nats?: { servers: string; monitorUrl: string };
  s3?: { endpoint: string; region: string; accessKeyId: string; secretAccessKey: string };
  kubernetes?: { server: string; token: string; etcdUrl: string };
}

export interface RunningServices {
  endpoints: ServiceEndpoints;
  /** Pids of every server process now (for tests that prove nothing is left behind). */
  readonly pids: number[];
  dataDir: string;
  /**
   * Stops nats-server and starts it again on the same ports, as an upgrade or a rescheduled pod
   * would; `wipe` also deletes its JetStream store first (a server on ephemeral storage). Only
   * when `nats` was started.
   */
  restartNats(opts?: { wipe?: boolean }): Promise<void>;
  stop(): Promise<void>;
}

export interface StartOptions {
  services?: readonly ServiceName[];
  /** Parent of the throwaway data folder; defaults to the OS temp dir. */
  dataRoot?: string;
  /** Where server logs go; defaults to `<dataDir>/logs`. */
  log?: (line: string) => void;
  /** Seconds to wait for each server to become ready. */
  readyTimeoutSec?: number;
}

type BinaryName = 'temporal' | 'nats-server' | 'minio' | 'etcd' | 'kube-apiserver';
type Binaries = Partial<Record<BinaryName, string>>;

const BINARIES_OF: Record<ServiceName, BinaryName[]> = {
  temporal: ['temporal'],
  nats: ['nats-server'],
  s3: ['minio'],
  kubernetes: ['etcd', 'kube-apiserver'],
};

const execFileP = promisify(execFile);
/** The checkout this module lives in, from sources (workers/dev) or from dist/workers/dev. */
export const REPO_ROOT = (() => {
  let dir = __dirname;
  while (!existsSync(join(dir, 'scripts', 'dev-services'))) {
    const up = dirname(dir);
    if (up === dir) throw new Error(`cannot find the magus checkout above ${__dirname}`);
    dir = up;
  }
  return dir;
})();
const DATA_PREFIX = 'magus-services-';

/**
 * Resolves every server binary through `scripts/dev-services --json` (env var → PATH → cache →
 * build). The script is the one place that knows versions and how to build them.
 */
export async function resolveBinaries(names: BinaryName[]): Promise<Binaries> {
  const script = join(REPO_ROOT, 'scripts', 'dev-services');
  try {
    const { stdout } = await execFileP(script, ['--json', ...names], { maxBuffer: 1 << 20, timeout: 60 * 60 * 1000 });
    return JSON.parse(stdout.trim().split('\n').pop() ?? '{}') as Binaries;
  } catch (err) {
    const stderr = (err as { stderr?: string }).stderr ?? '';
    throw new Error(`could not resolve the server binaries; run 'scripts/dev-services' to build them.\n${stderr}`);
  }
}

/** Free loopback TCP port, chosen by the kernel. */
export async function freePort(): Promise<number> {
  return new Promise((ok, fail) => {
    const srv = createServer();
    srv.unref();
    srv.on('error', fail);
    srv.listen(0, '127.0.0.1', () => {
      const addr = srv.address();
      srv.close(() => (addr && typeof addr === 'object' ? ok(addr.port) : fail(new Error('no port'))));
    });
  });
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Removes data folders of earlier runs whose owning process is gone (e.g. after a SIGKILL). */
function sweepStaleDataDirs(root: string): void {
  for (const entry of readdirSync(root)) {
    if (!entry.startsWith(DATA_PREFIX)) continue;
    const dir = join(root, entry);
    try {
      const pid = Number(readFileSync(join(dir, 'owner.pid'), 'utf8'));
      process.kill(pid, 0);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'EPERM') continue;
      rmSync(dir, { recursive: true, force: true });
    }
  }
}

interface Proc {
  name: string;
  child: ChildProcess;
  exited: Promise<void>;
}

/**
 * Go threads for nats-server: half the CPUs. It shares this machine with Temporal, MinIO and the
 * node processes, and a message hops between several goroutines (client read loop, consumer,
 * writer); on a small machine those hand-offs cost less on fewer threads. Measured on 2 CPUs,
 * warm request path at concurrency 1 (npm run bench:gateway): nats-server CPU per request 0.59 → 0.42 ms,
 * added latency −0.15 ms, and higher throughput at concurrency 8.
 */
function natsProcs(): number {
  return Math.max(1, Math.floor(cpus().length / 2));
}

function launch(name: string, bin: string, args: string[], logDir: string, env: NodeJS.ProcessEnv = {}): Proc {
  const out = createWriteStream(join(logDir, `${name}.log`));
  const child = spawn('setpriv', ['--pdeathsig', 'KILL', '--', bin, ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, ...env },
  });
  child.stdout?.pipe(out);
  child.stderr?.pipe(out);
  const exited = new Promise<void>((r) => child.once('exit', () => r()));
  return { name, child, exited };
}

/** Polls `probe` until it resolves true; fails early if the process exits. */
async function waitReady(p: Proc, logDir: string, timeoutSec: number, probe: () => Promise<boolean>): Promise<void> {
  const deadline = Date.now() + timeoutSec * 1000;
  let exited = false;
  void p.exited.then(() => (exited = true));
  while (Date.now() < deadline) {
    if (exited) break;
    try {
      if (await probe()) return;
    } catch {
      // not up yet
    }
    await sleep(150);
  }
  const logFile = join(logDir, `${p.name}.log`);
  const tail = existsSync(logFile) ? readFileSync(logFile, 'utf8').split('\n').slice(-25).join('\n') : '';
  throw new Error(`${p.name} did not become ready${exited ? ' (it exited)' : ` within ${timeoutSec}s`}; log tail:\n${tail}`);
}

async function httpOk(url: string): Promise<boolean> {
  const res = await fetch(url, { signal: AbortSignal.timeout(2000) });
  return res.ok;
}

function httpsOkInsecure(url: string, token: string): Promise<boolean> {
  return new Promise((ok) => {
    const req = httpsRequest(url, { rejectUnauthorized: false, headers: { authorization: `Bearer ${token}` }, timeout: 2000 }, (res) => {
      res.resume();
      ok(res.statusCode === 200);
    });
    req.on('error', () => ok(false));
    req.on('timeout', () => req.destroy());
    req.end();
  });
}

function tcpAccepts(port: number): Promise<boolean> {
  return new Promise((ok) => {
    const s = connect(port, '127.0.0.1');
    s.once('connect', () => {
      s.destroy();
      ok(true);
    });
    s.once('error', () => ok(false));
  });
}

/** Starts the requested servers concurrently and resolves once every one of them is ready. */
export async function startServices(opts: StartOptions = {}): Promise<RunningServices> {
  const wanted = new Set(opts.services ?? ALL_SERVICES);
  const root = opts.dataRoot ?? tmpdir();
  const timeout = opts.readyTimeoutSec ?? 120;
  sweepStaleDataDirs(root);
  const dataDir = mkdtempSync(join(root, DATA_PREFIX));
  writeFileSync(join(dataDir, 'owner.pid'), String(process.pid));
  const logDir = join(dataDir, 'logs');
  mkdirSync(logDir);

  const resolved = await resolveBinaries([...wanted].flatMap((s) => BINARIES_OF[s]));
  const bins = (name: BinaryName): string => {
    const path = resolved[name];
    if (!path) throw new Error(`scripts/dev-services did not resolve ${name}`);
    return path;
  };
  const procs: Proc[] = [];
  const endpoints: ServiceEndpoints = {};
  let stopped = false;

  const stop = async () => {
    if (stopped) return;
    stopped = true;
    // Reverse order: the API server goes before its etcd.
    for (const p of [...procs].reverse()) {
      if (p.child.exitCode === null && p.child.signalCode === null) p.child.kill('SIGTERM');
    }
    await Promise.race([Promise.all(procs.map((p) => p.exited)), sleep(10_000)]);
    for (const p of procs) if (p.child.exitCode === null && p.child.signalCode === null) p.child.kill('SIGKILL');
    await Promise.all(procs.map((p) => p.exited));
    rmSync(dataDir, { recursive: true, force: true });
  };

  const starters: Promise<void>[] = [];

  if (wanted.has('temporal')) {
    starters.push(
      (async () => {
        const [port, uiPort] = [await freePort(), await freePort()];
        const p = launch('temporal', bins('temporal'), [
          'server', 'start-dev',
          '--ip', '127.0.0.1', '--port', String(port), '--ui-port', String(uiPort),
          '--db-filename', join(dataDir, 'temporal.db'),
          '--log-level', 'warn', '--log-format', 'json',
          '--dynamic-config-value', 'frontend.enableUpdateWorkflowExecution=true',
          '--dynamic-config-value', 'frontend.enableExecuteMultiOperation=true',
          '--search-attribute', 'MagusModel=Keyword',
          '--search-attribute', 'MagusKind=Keyword',
        ], logDir);
        procs.push(p);
        await waitReady(p, logDir, timeout, async () => (await tcpAccepts(port)) && (await httpOk(`http://127.0.0.1:${uiPort}/`)));
        endpoints.temporal = { address: `127.0.0.1:${port}`, namespace: 'default', uiUrl: `http://127.0.0.1:${uiPort}` };
      })(),
    );
  }

  let restartNats: RunningServices['restartNats'] = () => Promise.reject(new Error('nats-server was not started'));
  if (wanted.has('nats')) {
    starters.push(
      (async () => {
        const [port, monitor] = [await freePort(), await freePort()];
        const store = join(dataDir, 'jetstream');
        const start = async () => {
          const p = launch('nats', bins('nats-server'), [
            '-a', '127.0.0.1', '-p', String(port), '-m', String(monitor),
            '-js', '-sd', store, '--server_name', 'magus-dev',
          ], logDir, { GOMAXPROCS: process.env.GOMAXPROCS ?? String(natsProcs()) });
          procs.push(p);
          await waitReady(p, logDir, timeout, () => httpOk(`http://127.0.0.1:${monitor}/healthz?js-enabled-only=true`));
          return p;
        };
        let current = await start();
        restartNats = async ({ wipe = false } = {}) => {
          if (stopped) throw new Error('the services were stopped');
          current.child.kill('SIGTERM');
          await current.exited;
          procs.splice(procs.indexOf(current), 1);
          if (wipe) rmSync(store, { recursive: true, force: true });
          current = await start();
        };
        endpoints.nats = { servers: `nats://127.0.0.1:${port}`, monitorUrl: `http://127.0.0.1:${monitor}` };
      })(),
    );
  }

  if (wanted.has('s3')) {
    starters.push(
      (async () => {
        const [port, consolePort] = [await freePort(), await freePort()];
        const accessKeyId = `magus${randomBytes(6).toString('hex')}`;
        const secretAccessKey = randomBytes(24).toString('base64url');
        const p = launch('minio', bins('minio'), [
          'server', join(dataDir, 's3'),
          '--address', `127.0.0.1:${port}`, '--console-address', `127.0.0.1:${consolePort}`, '--quiet',
        ], logDir, { MINIO_ROOT_USER: accessKeyId, MINIO_ROOT_PASSWORD: secretAccessKey, MINIO_BROWSER: 'off', MINIO_UPDATE: 'off' });
        procs.push(p);
        await waitReady(p, logDir, timeout, () => httpOk(`http://127.0.0.1:${port}/minio/health/ready`));
        endpoints.s3 = { endpoint: `http://127.0.0.1:${port}`, region: 'us-east-1', accessKeyId, secretAccessKey };
      })(),
    );
  }

  if (wanted.has('kubernetes')) {
    starters.push(
      (async () => {
        const [clientPort, peerPort, apiPort] = [await freePort(), await freePort(), await freePort()];
        const etcdUrl = `http://127.0.0.1:${clientPort}`;
        const peerUrl = `http://127.0.0.1:${peerPort}`;
        const etcd = launch('etcd', bins('etcd'), [
          '--name', 'magus', '--data-dir', join(dataDir, 'etcd'),
          '--listen-client-urls', etcdUrl, '--advertise-client-urls', etcdUrl,
          '--listen-peer-urls', peerUrl, '--initial-advertise-peer-urls', peerUrl,
          '--initial-cluster', `magus=${peerUrl}`, '--log-level', 'warn',
          '--unsafe-no-fsync',
        ], logDir);
        procs.push(etcd);
        await waitReady(etcd, logDir, timeout, () => httpOk(`${etcdUrl}/health`));

        const kubeDir = join(dataDir, 'kube');
        mkdirSync(kubeDir);
        const token = randomBytes(24).toString('hex');
        writeFileSync(join(kubeDir, 'tokens.csv'), `${token},magus-admin,magus-admin,"system:masters"\n`, { mode: 0o600 });
        const { privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
        writeFileSync(join(kubeDir, 'sa.key'), privateKey.export({ type: 'pkcs8', format: 'pem' }), { mode: 0o600 });
        const api = launch('kube-apiserver', bins('kube-apiserver'), [
          `--etcd-servers=${etcdUrl}`,
          '--bind-address=127.0.0.1', '--advertise-address=127.0.0.1', `--secure-port=${apiPort}`,
          `--cert-dir=${join(kubeDir, 'certs')}`,
          `--token-auth-file=${join(kubeDir, 'tokens.csv')}`,
          '--authorization-mode=RBAC',
          '--service-account-issuer=https://kubernetes.default.svc.cluster.local',
          `--service-account-key-file=${join(kubeDir, 'sa.key')}`,
          `--service-account-signing-key-file=${join(kubeDir, 'sa.key')}`,
          '--service-cluster-ip-range=10.96.0.0/24',
          '--enable-priority-and-fairness=false',
          '--watch-cache=false',
          '-v=0',
        ], logDir);
        procs.push(api);
        const server = `https://127.0.0.1:${apiPort}`;
        await waitReady(api, logDir, timeout, () => httpsOkInsecure(`${server}/readyz`, token));
        endpoints.kubernetes = { server, token, etcdUrl };
      })(),
    );
  }

  const results = await Promise.allSettled(starters);
  const failures = results.filter((r): r is PromiseRejectedResult => r.status === 'rejected');
  if (failures.length > 0) {
    await stop();
    throw new Error(failures.map((f) => (f.reason instanceof Error ? f.reason.message : String(f.reason))).join('\n\n'));
  }
  return {
    endpoints,
    get pids() {
      return procs.map((p) => p.child.pid).filter((pid): pid is number => pid !== undefined);
    },
    dataDir,
    restartNats: (opts) => restartNats(opts),
    stop,
  };
}

/**
 * Starts the real servers magus runs against — Temporal dev server, nats-server (JetStream),
 * MinIO (S3) and etcd + kube-apiserver — on free loopback ports, with throwaway data folders or
 * (`dataDir`) one folder they keep their state in across starts.
 * Used by `magus dev` and by the jest global setup, so tests run against exactly what users run.
 *
 * No orphans: every server is exec'd through `setpriv --pdeathsig KILL`, so the kernel kills it
 * when the process that started it dies, however it dies (SIGKILL included). Each runs in a
 * session of its own: a terminal's Ctrl-C (SIGINT to the whole foreground process group) or a
 * signal to the starter's group reaches only the starter, which stops the servers in order —
 * a server that stopped by itself meanwhile would pull the ground from under the clients still
 * stopping (a NATS drain that ends in TIMEOUT, a Temporal worker that cannot finish).
 *
 * Ports: a free port is chosen, released, and bound by the server a moment later, so another
 * process can take it in between. A server that then fails with "address already in use" before
 * it is ready is started again on newly chosen ports (at most `portAttempts` times, each from a
 * clean data path); only then does the start fail, naming the server and the port.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes, generateKeyPairSync } from 'node:crypto';
import { createWriteStream, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { connect, createServer } from 'node:net';
import { cpus, tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { request as httpsRequest } from 'node:https';
import { createInterface } from 'node:readline';

export type ServiceName = 'temporal' | 'nats' | 's3' | 'kubernetes';
export const ALL_SERVICES: readonly ServiceName[] = ['temporal', 'nats', 's3', 'kubernetes'];

/** Connection details of running servers. Written to a file for test workers; never logged. */
export interface ServiceEndpoints {
  temporal?: { address: string; namespace: string; uiUrl: string };
  nats?: { servers: string; monitorUrl: string };
  s3?: { endpoint: string; region: string; accessKeyId: string; secretAccessKey: string };
  kubernetes?: { server: string; token: string; etcdUrl: string };
}

/** The server processes (and the names of their logs in `<dataDir>/logs/<name>.log`). */
export type ServerName = 'temporal' | 'nats' | 'minio' | 'etcd' | 'kube-apiserver';

export interface RunningServices {
  endpoints: ServiceEndpoints;
  /** Pids of every server process now (for tests that prove nothing is left behind). */
  readonly pids: number[];
  dataDir: string;
  /** How many times each server was started again on new ports because one was taken. */
  readonly retries: Readonly<Partial<Record<ServerName, number>>>;
  /**
   * Stops nats-server and starts it again on the same ports, as an upgrade or a rescheduled pod
   * would; `wipe` also deletes its JetStream store first (a server on ephemeral storage). Only
   * when `nats` was started. Fails, naming the port, if another process took one meanwhile.
   */
  restartNats(opts?: { wipe?: boolean }): Promise<void>;
  /**
   * Stops kube-apiserver (SIGTERM, waits for it to exit) and starts it again on the same port with
   * the same token, certificates and etcd (which keeps running), once `/readyz` answers. Only when
   * `kubernetes` was started. Fails, naming the port, if another process took it meanwhile.
   */
  restartKubernetes(): Promise<void>;
  /**
   * SIGKILLs the Temporal dev server, as a crash would (its database file stays); resolves once it
   * has exited. Only when `temporal` was started. {@link restartTemporal} brings it back.
   */
  killTemporal(): Promise<void>;
  /** Stops Temporal (if it runs) and starts it again on the same ports and database, once it answers. */
  restartTemporal(): Promise<void>;
  stop(): Promise<void>;
}

/** One port a server is about to be started on: what it is for, and the how-manyth start this is. */
export interface PortRequest {
  server: ServerName;
  /** temporal: frontend, ui; nats: client, monitor; minio: api; etcd: client, peer; kube-apiserver: api. */
  role: string;
  /** 1 for the first start, 2 for the first retry after a port was taken, … */
  attempt: number;
}

export interface StartOptions {
  services?: readonly ServiceName[];
  /** Parent of the throwaway data folder; defaults to the OS temp dir. Unused with `dataDir`. */
  dataRoot?: string;
  /**
   * A folder the servers keep their state in across starts (created when missing; `stop` leaves
   * it): Temporal's database, the JetStream store, MinIO's data, etcd and the API server's keys,
   * and in `services.json` (0600) the S3 credentials, the API server's token and every port. A
   * start on it comes back with all of that, on the same ports where they are free (new ones
   * where another process holds one). Never two starts on one folder at once: the caller
   * guarantees it (`magus dev` holds a lock). Without it: a throwaway folder under `dataRoot`.
   */
  dataDir?: string;
  /**
   * Notes about the start (a server started again on new ports); defaults to stderr. Server
   * output always goes to `<dataDir>/logs/<server>.log`.
   */
  log?: (line: string) => void;
  /** Seconds to wait for each server to become ready. */
  readyTimeoutSec?: number;
  /** Starts of one server on fresh ports before "address already in use" is final (default 5). */
  portAttempts?: number;
  /**
   * Chooses each port a server is started on; defaults to the port it had last time (with
   * `dataDir`, on the first start attempt, when it is free) or else {@link freePort}. A seam for tests.
   */
  portPicker?: (request: PortRequest) => Promise<number>;
}

/** What `services.json` in a kept `dataDir` remembers between starts. */
interface SavedServices {
  /** server → role → port. */
  ports?: Partial<Record<ServerName, Record<string, number>>>;
  s3?: { accessKeyId: string; secretAccessKey: string };
  kubernetes?: { token: string };
}
const SAVED_FILE = 'services.json';

function readSaved(dir: string): SavedServices {
  try {
    return JSON.parse(readFileSync(join(dir, SAVED_FILE), 'utf8')) as SavedServices;
  } catch {
    return {};
  }
}

type BinaryName = 'temporal' | 'nats-server' | 'minio' | 'etcd' | 'kube-apiserver';
type Binaries = Partial<Record<BinaryName, string>>;

const BINARIES_OF: Record<ServiceName, BinaryName[]> = {
  temporal: ['temporal'],
  nats: ['nats-server'],
  s3: ['minio'],
  kubernetes: ['etcd', 'kube-apiserver'],
};

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

/** How often a build that is still running says so (with how long it has taken). */
const BUILD_NOTE_EVERY_MS = 30_000;

/**
 * Resolves every server binary through `scripts/dev-services --json` (env var → PATH → cache →
 * build). The script is the one place that knows versions and how to build them. With `log`, what
 * it says (which server it builds, that it happens once) is passed on as it comes, and a build
 * still running is noted every 30 s with its time so far: a first start builds for minutes.
 */
export async function resolveBinaries(names: BinaryName[], log?: (line: string) => void): Promise<Binaries> {
  const script = join(REPO_ROOT, 'scripts', 'dev-services');
  // Under setpriv too: a build takes minutes, and must not outlive a magus dev stopped meanwhile.
  const child = spawn('setpriv', ['--pdeathsig', 'KILL', '--', script, '--json', ...names], { stdio: ['ignore', 'pipe', 'pipe'] });
  let stdout = '';
  let stderr = '';
  let building: { what: string; since: number } | undefined;
  child.stdout.on('data', (d: Buffer) => (stdout += d.toString()));
  createInterface({ input: child.stderr }).on('line', (line) => {
    stderr += `${line}\n`;
    const b = /^dev-services: building (\S+)/.exec(line);
    if (b) building = { what: b[1]!, since: Date.now() };
    log?.(line.replace(/^dev-services: /, ''));
  });
  const note = log && setInterval(() => building && log(`still building ${building.what} (${Math.round((Date.now() - building.since) / 1000)} s so far)`), BUILD_NOTE_EVERY_MS);
  const limit = setTimeout(() => child.kill('SIGKILL'), 60 * 60 * 1000);
  try {
    const code = await new Promise<number | null>((resolve, reject) => {
      child.once('error', reject);
      child.once('close', resolve);
    });
    if (code !== 0) throw new Error(`exit ${code}`);
    return JSON.parse(stdout.trim().split('\n').pop() ?? '{}') as Binaries;
  } catch (err) {
    throw new Error(`could not resolve the server binaries (${(err as Error).message}); run 'scripts/dev-services' to build them.\n${stderr}`);
  } finally {
    clearInterval(note);
    clearTimeout(limit);
  }
}

/**
 * Writes a kubeconfig (mode 0600) for the API server `startServices` ran: its admin token, its
 * self-signed certificate not verified. For `magus dev`, the tests and the benches.
 */
export function writeKubeconfig(file: string, api: { server: string; token: string }, namespace = 'default'): void {
  const yaml = [
    'apiVersion: v1',
    'kind: Config',
    `clusters: [{name: magus, cluster: {server: "${api.server}", insecure-skip-tls-verify: true}}]`,
    `users: [{name: magus-admin, user: {token: "${api.token}"}}]`,
    `contexts: [{name: magus, context: {cluster: magus, user: magus-admin, namespace: ${namespace}}}]`,
    'current-context: magus',
  ];
  writeFileSync(file, `${yaml.join('\n')}\n`, { mode: 0o600 });
}

/** Whether nothing listens on loopback `port` now (a moment later another process may). */
export function portFree(port: number): Promise<boolean> {
  return new Promise((ok) => {
    const srv = createServer();
    srv.unref();
    srv.once('error', () => ok(false));
    srv.listen(port, '127.0.0.1', () => srv.close(() => ok(true)));
  });
}

/** The kernel's range of ephemeral ports (`ip_local_port_range`); Linux's default when unreadable. */
export function ephemeralRange(read: () => string = () => readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8')): [number, number] {
  try {
    const [low, high] = read().trim().split(/\s+/).map(Number);
    if (Number.isInteger(low) && Number.isInteger(high) && low! >= 1 && low! <= high! && high! <= 65_535) return [low!, high!];
  } catch {
    // not Linux, or no /proc: the default below
  }
  return [32_768, 60_999];
}

/**
 * The band servers' ports are drawn from: the larger stretch of 10000–65535 outside the ephemeral
 * range. A port from the ephemeral range (what the kernel gives for port 0) can be taken as the
 * source port of any outgoing connection while its server is stopped for a restart, and the
 * server must come back on the same port (seen in CI: Temporal's UI port, taken between its kill
 * and its restart). Ports outside it are only ever taken by a process binding them on purpose.
 */
export function serverPortBand([low, high]: [number, number] = ephemeralRange()): [number, number] {
  const below: [number, number] = [10_000, low - 1];
  const above: [number, number] = [high + 1, 65_535];
  const size = ([a, b]: [number, number]) => b - a + 1;
  const band = size(below) >= size(above) ? below : above;
  return size(band) >= 1_000 ? band : [0, 0];
}

/** The kernel's choice of a free loopback port (from its ephemeral range). */
function kernelPort(): Promise<number> {
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

/**
 * A free loopback TCP port for a server: a random one from {@link serverPortBand}, free when
 * asked; the kernel's choice only where no such band exists (an ephemeral range over nearly all
 * ports).
 */
export async function freePort(): Promise<number> {
  const [low, high] = serverPortBand();
  if (low > 0) {
    for (let i = 0; i < 50; i++) {
      const port = low + Math.floor(Math.random() * (high - low + 1));
      if (await portFree(port)) return port;
    }
  }
  return kernelPort();
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
/**
 * `p`, or after `ms` whatever it is then. The timer is cleared when `p` settles first: a bound's
 * timer left pending kept its process alive for the whole bound (jest waited 10 s after every
 * run for stop()'s, "Jest did not exit one second after the test run has completed").
 */
export async function within(p: Promise<unknown>, ms: number): Promise<void> {
  let timer: NodeJS.Timeout | undefined;
  try {
    await Promise.race([p, new Promise((r) => (timer = setTimeout(r, ms)))]);
  } finally {
    clearTimeout(timer);
  }
}

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

/**
 * What each server prints when a port it was given is taken, found by starting each one on a port
 * another process listens on (each then exits with status 1):
 * - temporal: `can't set frontend port N: listen tcp 127.0.0.1:N: bind: address already in use`
 *   (`can't set UI port N: …` for the UI port); it checks its ports before it binds them, and a
 *   port lost after that check ends in the same `bind: address already in use`.
 * - nats-server: `[FTL] Error listening on port: 127.0.0.1:N, "listen tcp 127.0.0.1:N: bind: address
 *   already in use"`, and for the monitor port `[FTL] Can't start monitoring: can't listen to the
 *   monitor port: listen tcp 127.0.0.1:N: bind: address already in use`.
 * - minio: `FATAL Unable to start the server: Specified port is already in use` (no port named).
 * - etcd: `"msg":"discovery failed","error":"listen tcp 127.0.0.1:N: bind: address already in use"`
 *   (client and peer port alike).
 * - kube-apiserver: `"command failed" err="failed to create listener: failed to listen on
 *   127.0.0.1:N: listen tcp 127.0.0.1:N: bind: address already in use"`.
 */
const ADDRESS_IN_USE = /address already in use|port is already in use/i;

/** The line of `output` saying a port was taken, if there is one. */
function addressInUse(output: string): string | undefined {
  const line = output.split('\n').find((l) => ADDRESS_IN_USE.test(l))?.trim();
  return line && line.length > 400 ? `${line.slice(0, 400)}…` : line; // etcd's come with a stack trace
}

/**
 * The port `line` says is taken: one of `ports` (`port 4222 (client)`), or one the server chose
 * itself (Temporal picks ports for its internal services); MinIO names none: then it is `ports`.
 */
function takenPort(line: string, ports: Readonly<Record<string, number>>): string {
  const all = Object.entries(ports).map(([role, port]) => `${port} (${role})`);
  const named = Object.entries(ports).filter(([, port]) => new RegExp(`[: ]${port}(?!\\d)`).test(line));
  if (named.length > 0) return `port ${named.map(([role, port]) => `${port} (${role})`).join(', ')}`;
  const own = /(?:127\.0\.0\.1|\[::1\]|localhost):(\d+)/.exec(line)?.[1];
  if (own) return `port ${own} (one it chose itself)`;
  return all.length === 1 ? `port ${all[0]}` : `one of its ports ${all.join(', ')}`;
}

/** A server process started by {@link launch} (also used by `cluster.ts`). */
export interface Proc<N extends string = ServerName> {
  name: N;
  child: ChildProcess;
  exited: Promise<void>;
  /** Its stdout and stderr are read to the end (shortly after it exits). */
  closed: Promise<void>;
  /** The last 64 KiB this run of the server printed (its log file also holds earlier runs). */
  output(): string;
}

export const alive = (p: Proc<string>): boolean => p.child.exitCode === null && p.child.signalCode === null;

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

/**
 * Starts `bin` under `setpriv --pdeathsig KILL` (it dies with this process, however this process
 * dies) in a session of its own (signals meant for this process group do not reach it: it is
 * stopped by whoever started it), appending its output to `<logDir>/<name>.log` after a line
 * saying which start it is.
 */
export function launch<N extends string>(name: N, bin: string, args: string[], logDir: string, env: NodeJS.ProcessEnv, note: string): Proc<N> {
  // Appended: the log keeps the output of a run that lost a port, for whoever wonders about a retry.
  const out = createWriteStream(join(logDir, `${name}.log`), { flags: 'a' });
  out.write(`--- magus: ${new Date().toISOString()} starting ${name}: ${note} ---\n`);
  const child = spawn('setpriv', ['--pdeathsig', 'KILL', '--', bin, ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, ...env },
    detached: true,
  });
  let recent = '';
  for (const stream of [child.stdout, child.stderr]) {
    stream?.on('data', (chunk: Buffer) => {
      recent = (recent + chunk.toString('utf8')).slice(-65_536);
      out.write(chunk);
    });
  }
  const exited = new Promise<void>((r) => child.once('exit', () => r()));
  const closed = new Promise<void>((r) =>
    child.once('close', () => {
      out.end();
      r();
    }),
  );
  return { name, child, exited, closed, output: () => recent };
}

/** A process that did not become ready; `inUse` is its "address already in use" line, if it printed one. */
export class NotReady extends Error {
  constructor(
    message: string,
    readonly inUse: string | undefined,
  ) {
    super(message);
  }
}

/**
 * Polls `probe` until it resolves true; fails early if the process exits or says a port of its is
 * taken (Temporal's UI, for one, only logs that and runs on without it). `what` names what is
 * awaited in the error when it is more than the process becoming ready (kwok's Nodes, cluster.ts).
 */
export async function waitReady(p: Proc<string>, timeoutSec: number, probe: () => Promise<boolean>, what?: string): Promise<void> {
  const deadline = Date.now() + timeoutSec * 1000;
  let exited = false;
  void p.exited.then(() => (exited = true));
  while (Date.now() < deadline && !exited && !addressInUse(p.output())) {
    try {
      // Ready only if it still runs and is not on its way out over a lost port.
      if ((await probe()) && alive(p) && !addressInUse(p.output())) return;
    } catch {
      // not up yet
    }
    await sleep(150);
  }
  if (exited) await within(p.closed, 1000); // its last words
  const output = p.output();
  const inUse = addressInUse(output);
  const tail = output.split('\n').slice(-25).join('\n');
  const why = exited ? ' (it exited)' : inUse ? ' (a port of its is taken)' : ` within ${timeoutSec}s`;
  throw new NotReady(`${p.name}${what === undefined ? ' did not become ready' : `: ${what} did not happen`}${why}; log tail:\n${tail}`, inUse);
}

/** SIGTERM, then SIGKILL after `graceMs` (at once when 0); resolves when it has exited. */
export async function end(p: Proc<string>, graceMs: number): Promise<void> {
  if (alive(p)) p.child.kill(graceMs > 0 ? 'SIGTERM' : 'SIGKILL');
  if (graceMs > 0) await within(p.exited, graceMs);
  if (alive(p)) p.child.kill('SIGKILL');
  await p.exited;
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

/** How to run one server on ports of given roles. */
interface ServerSpec<R extends string> {
  name: ServerName;
  bin: string;
  roles: readonly R[];
  args: (ports: Record<R, number>) => string[];
  env?: NodeJS.ProcessEnv;
  /** What a run writes before it is ready (data dirs, generated certs): removed after a failed start. */
  scratch: readonly string[];
  ready: (ports: Record<R, number>) => () => Promise<boolean>;
}

/** A started server: its current process and the ports it keeps across restarts. */
interface Started<R extends string> {
  proc: Proc;
  ports: Record<R, number>;
}

/**
 * Starts something that listens on a port, with no check-then-listen gap: on `port` when the user
 * gave one (if it is taken, the error names it and `flag`), else on the first of `preferred` that
 * is free, or where the kernel puts it (port 0) when every one is taken. `start` must fail with
 * code EADDRINUSE when its port is taken, as `listen` does.
 */
export async function listenOnPort<T>(what: string, start: (port: number) => Promise<T>, opts: { port?: number; preferred: number | readonly (number | undefined)[]; flag?: string }): Promise<T> {
  const taken = (err: unknown) => (err as NodeJS.ErrnoException | undefined)?.code === 'EADDRINUSE';
  if (opts.port !== undefined) {
    try {
      return await start(opts.port);
    } catch (err) {
      if (!taken(err)) throw err;
      throw new Error(`${what} cannot listen on port ${opts.port}: another process already uses it; choose another port${opts.flag ? ` with ${opts.flag}` : ''}`);
    }
  }
  const preferred = typeof opts.preferred === 'number' ? [opts.preferred] : opts.preferred;
  for (const port of new Set(preferred.filter((p): p is number => p !== undefined && p > 0))) {
    try {
      return await start(port);
    } catch (err) {
      if (!taken(err)) throw err;
    }
  }
  return start(0);
}

/** Starts the requested servers concurrently and resolves once every one of them is ready. */
export async function startServices(opts: StartOptions = {}): Promise<RunningServices> {
  const wanted = new Set(opts.services ?? ALL_SERVICES);
  const root = opts.dataRoot ?? tmpdir();
  const timeout = opts.readyTimeoutSec ?? 120;
  const attempts = Math.max(1, opts.portAttempts ?? 5);
  const say = opts.log ?? ((line: string) => void process.stderr.write(`magus services: ${line}\n`));
  const kept = opts.dataDir !== undefined;
  let dataDir: string;
  if (opts.dataDir !== undefined) {
    dataDir = opts.dataDir;
    mkdirSync(dataDir, { recursive: true, mode: 0o700 });
    // The logs of the run before stay beside this run's, one run deep.
    rmSync(join(dataDir, 'logs.previous'), { recursive: true, force: true });
    if (existsSync(join(dataDir, 'logs'))) renameSync(join(dataDir, 'logs'), join(dataDir, 'logs.previous'));
  } else {
    sweepStaleDataDirs(root);
    dataDir = mkdtempSync(join(root, DATA_PREFIX));
    writeFileSync(join(dataDir, 'owner.pid'), String(process.pid));
  }
  const saved: SavedServices = kept ? readSaved(dataDir) : {};
  const logDir = join(dataDir, 'logs');
  mkdirSync(logDir, { recursive: true });

  const resolved = await resolveBinaries([...wanted].flatMap((s) => BINARIES_OF[s]), say);
  const bins = (name: BinaryName): string => {
    const path = resolved[name];
    if (!path) throw new Error(`scripts/dev-services did not resolve ${name}`);
    return path;
  };
  const procs: Proc[] = [];
  const endpoints: ServiceEndpoints = {};
  const retries: Partial<Record<ServerName, number>> = {};
  let stopped = false;

  const stop = async () => {
    if (stopped) return;
    stopped = true;
    // The API server goes first, and alone: told to stop together with its etcd, it sometimes
    // loses etcd mid-shutdown and hangs until killed (measured: > 10 s; alone: ~50 ms).
    const api = procs.filter((p) => p.name === 'kube-apiserver' && alive(p));
    for (const p of api) p.child.kill('SIGTERM');
    await within(Promise.all(api.map((p) => p.exited)), 5_000);
    for (const p of [...procs].reverse()) if (alive(p)) p.child.kill('SIGTERM');
    await within(Promise.all(procs.map((p) => p.exited)), 10_000);
    for (const p of procs) if (alive(p)) p.child.kill('SIGKILL');
    await Promise.all(procs.map((p) => p.exited));
    if (!kept) rmSync(dataDir, { recursive: true, force: true });
  };

  /** Ports handed out by this start: servers started side by side never get the same one. */
  const handedOut = new Set<number>();
  /** Last time's port on a first attempt when it is free (and not handed out already), else a fresh one. */
  const pick =
    opts.portPicker ??
    (async ({ server, role, attempt }: PortRequest): Promise<number> => {
      const before = attempt === 1 ? saved.ports?.[server]?.[role] : undefined;
      if (before !== undefined && !handedOut.has(before) && (await portFree(before))) return before;
      return freePort();
    });
  /** The ports each server runs on now, for `services.json`. */
  const portsNow: Partial<Record<ServerName, Record<string, number>>> = {};
  const pickPorts = async <R extends string>(server: ServerName, roles: readonly R[], attempt: number): Promise<Record<R, number>> => {
    const ports = {} as Record<R, number>;
    for (const role of roles) {
      let port = await pick({ server, role, attempt });
      for (let i = 0; handedOut.has(port) && i < 20; i++) port = await pick({ server, role, attempt });
      handedOut.add(port);
      ports[role] = port;
    }
    return ports;
  };

  /** One run of `spec` on `ports` until it is ready; if it is not, it is gone when this throws. */
  const run = async <R extends string>(spec: ServerSpec<R>, ports: Record<R, number>, note: string): Promise<Proc> => {
    if (stopped) throw new Error('the services were stopped');
    const p = launch(spec.name, spec.bin, spec.args(ports), logDir, spec.env ?? {}, note);
    procs.push(p);
    try {
      await waitReady(p, timeout, spec.ready(ports));
      return p;
    } catch (err) {
      await end(p, 0);
      procs.splice(procs.indexOf(p), 1);
      throw err;
    }
  };

  /** Starts `spec` on fresh ports, again on new ones while a port turns out to be taken. */
  const start = async <R extends string>(spec: ServerSpec<R>): Promise<Started<R>> => {
    // State from earlier runs is never what a failed start leaves behind: it stays.
    const earlier = new Set(spec.scratch.filter((path) => existsSync(path)));
    for (let attempt = 1; ; attempt++) {
      const ports = await pickPorts(spec.name, spec.roles, attempt);
      const described = Object.entries(ports).map(([role, port]) => `${role} ${String(port)}`).join(', ');
      try {
        const proc = await run(spec, ports, `attempt ${attempt} of ${attempts}, ports ${described}`);
        portsNow[spec.name] = ports;
        return { proc, ports };
      } catch (err) {
        if (!(err instanceof NotReady) || err.inUse === undefined) throw err;
        const which = takenPort(err.inUse, ports);
        if (attempt >= attempts) {
          throw new Error(
            `${spec.name} could not start: on each of its ${attempts} starts another process took a port chosen for it before it could bind it ` +
              `(last: ${which}); last error: ${err.inUse}\n${err.message}`,
          );
        }
        retries[spec.name] = (retries[spec.name] ?? 0) + 1;
        say(`${spec.name}: ${which} was taken by another process before ${spec.name} could bind it; starting it again on new ports (start ${attempt + 1} of ${attempts})`);
        // A run that failed may have begun its data (etcd's member dir, Temporal's db): start clean.
        for (const path of spec.scratch) if (!earlier.has(path)) rmSync(path, { recursive: true, force: true });
      }
    }
  };

  /** Stops a started server and starts it again on the same ports: clients know them. */
  const restart = async <R extends string>(spec: ServerSpec<R>, started: Started<R>, before?: () => void): Promise<void> => {
    if (stopped) throw new Error('the services were stopped');
    const old = started.proc;
    // kube-apiserver holds a SIGTERM for ~30 s while a client keeps a watch open (measured);
    // a restart does not need to wait that out.
    await end(old, 5_000);
    if (procs.includes(old)) procs.splice(procs.indexOf(old), 1);
    before?.();
    try {
      started.proc = await run(spec, started.ports, 'restart on the same ports');
    } catch (err) {
      if (!(err instanceof NotReady) || err.inUse === undefined) throw err;
      throw new Error(
        `${spec.name} could not start again: ${takenPort(err.inUse, started.ports)} was taken by another process while it was stopped, ` +
          `and it must come back on the same port; last error: ${err.inUse}\n${err.message}`,
      );
    }
  };

  const starters: Promise<void>[] = [];

  let killTemporal: RunningServices['killTemporal'] = () => Promise.reject(new Error('Temporal was not started'));
  let restartTemporal: RunningServices['restartTemporal'] = killTemporal;
  if (wanted.has('temporal')) {
    const db = join(dataDir, 'temporal.db');
    starters.push(
      (async () => {
        const spec: ServerSpec<'frontend' | 'ui'> = {
          name: 'temporal',
          bin: bins('temporal'),
          roles: ['frontend', 'ui'],
          args: ({ frontend, ui }) => [
            'server', 'start-dev',
            '--ip', '127.0.0.1', '--port', String(frontend), '--ui-port', String(ui),
            '--db-filename', db,
            '--log-level', 'warn', '--log-format', 'json',
            '--dynamic-config-value', 'frontend.enableUpdateWorkflowExecution=true',
            '--dynamic-config-value', 'frontend.enableExecuteMultiOperation=true',
            '--search-attribute', 'MagusModel=Keyword',
            '--search-attribute', 'MagusKind=Keyword',
          ],
          scratch: ['', '-wal', '-shm', '-journal'].map((suffix) => db + suffix),
          ready: ({ frontend, ui }) => async () => (await tcpAccepts(frontend)) && (await httpOk(`http://127.0.0.1:${ui}/`)),
        };
        const started = await start(spec);
        const { ports } = started;
        killTemporal = () => end(started.proc, 0);
        restartTemporal = () => restart(spec, started);
        endpoints.temporal = { address: `127.0.0.1:${ports.frontend}`, namespace: 'default', uiUrl: `http://127.0.0.1:${ports.ui}` };
      })(),
    );
  }

  let restartNats: RunningServices['restartNats'] = () => Promise.reject(new Error('nats-server was not started'));
  if (wanted.has('nats')) {
    const store = join(dataDir, 'jetstream');
    const spec: ServerSpec<'client' | 'monitor'> = {
      name: 'nats',
      bin: bins('nats-server'),
      roles: ['client', 'monitor'],
      args: ({ client, monitor }) => ['-a', '127.0.0.1', '-p', String(client), '-m', String(monitor), '-js', '-sd', store, '--server_name', 'magus-dev'],
      env: { GOMAXPROCS: process.env.GOMAXPROCS ?? String(natsProcs()) },
      scratch: [store],
      ready: ({ monitor }) => () => httpOk(`http://127.0.0.1:${monitor}/healthz?js-enabled-only=true`),
    };
    starters.push(
      (async () => {
        const started = await start(spec);
        restartNats = ({ wipe = false } = {}) => restart(spec, started, wipe ? () => rmSync(store, { recursive: true, force: true }) : undefined);
        endpoints.nats = { servers: `nats://127.0.0.1:${started.ports.client}`, monitorUrl: `http://127.0.0.1:${started.ports.monitor}` };
      })(),
    );
  }

  if (wanted.has('s3')) {
    // MinIO's data is bound to its root credentials: a kept folder keeps them.
    const accessKeyId = saved.s3?.accessKeyId ?? `magus${randomBytes(6).toString('hex')}`;
    const secretAccessKey = saved.s3?.secretAccessKey ?? randomBytes(24).toString('base64url');
    const data = join(dataDir, 's3');
    starters.push(
      (async () => {
        // With MINIO_BROWSER=off MinIO binds no console port (it starts even when the one given with
        // --console-address is taken), so it gets none: one port less to lose.
        const { ports } = await start({
          name: 'minio',
          bin: bins('minio'),
          roles: ['api'],
          args: ({ api }) => ['server', data, '--address', `127.0.0.1:${api}`, '--quiet'],
          env: { MINIO_ROOT_USER: accessKeyId, MINIO_ROOT_PASSWORD: secretAccessKey, MINIO_BROWSER: 'off', MINIO_UPDATE: 'off' },
          scratch: [data],
          ready: ({ api }) => () => httpOk(`http://127.0.0.1:${api}/minio/health/ready`),
        });
        endpoints.s3 = { endpoint: `http://127.0.0.1:${ports.api}`, region: 'us-east-1', accessKeyId, secretAccessKey };
      })(),
    );
  }

  let restartKubernetes: RunningServices['restartKubernetes'] = () => Promise.reject(new Error('kube-apiserver was not started'));
  if (wanted.has('kubernetes')) {
    starters.push(
      (async () => {
        const etcdData = join(dataDir, 'etcd');
        const etcd = await start({
          name: 'etcd',
          bin: bins('etcd'),
          roles: ['client', 'peer'],
          args: ({ client, peer }) => [
            '--name', 'magus', '--data-dir', etcdData,
            '--listen-client-urls', `http://127.0.0.1:${client}`, '--advertise-client-urls', `http://127.0.0.1:${client}`,
            '--listen-peer-urls', `http://127.0.0.1:${peer}`, '--initial-advertise-peer-urls', `http://127.0.0.1:${peer}`,
            '--initial-cluster', `magus=http://127.0.0.1:${peer}`, '--log-level', 'warn',
            '--unsafe-no-fsync',
          ],
          // Its member dir records the peer URL: a retry on other ports must not find the old one.
          scratch: [etcdData],
          ready: ({ client }) => () => httpOk(`http://127.0.0.1:${client}/health`),
        });
        const etcdUrl = `http://127.0.0.1:${etcd.ports.client}`;

        const kubeDir = join(dataDir, 'kube');
        mkdirSync(kubeDir, { recursive: true });
        const token = saved.kubernetes?.token ?? randomBytes(24).toString('hex');
        writeFileSync(join(kubeDir, 'tokens.csv'), `${token},magus-admin,magus-admin,"system:masters"\n`, { mode: 0o600 });
        // A kept signing key keeps the ServiceAccount tokens it signed valid.
        if (!existsSync(join(kubeDir, 'sa.key'))) {
          const { privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
          writeFileSync(join(kubeDir, 'sa.key'), privateKey.export({ type: 'pkcs8', format: 'pem' }), { mode: 0o600 });
        }
        const certs = join(kubeDir, 'certs');
        const apiSpec: ServerSpec<'api'> = {
          name: 'kube-apiserver',
          bin: bins('kube-apiserver'),
          roles: ['api'],
          args: ({ api }) => [
            `--etcd-servers=${etcdUrl}`,
            '--bind-address=127.0.0.1', '--advertise-address=127.0.0.1', `--secure-port=${api}`,
            `--cert-dir=${certs}`,
            `--token-auth-file=${join(kubeDir, 'tokens.csv')}`,
            '--authorization-mode=RBAC',
            '--service-account-issuer=https://kubernetes.default.svc.cluster.local',
            `--service-account-key-file=${join(kubeDir, 'sa.key')}`,
            `--service-account-signing-key-file=${join(kubeDir, 'sa.key')}`,
            '--service-cluster-ip-range=10.96.0.0/24',
            '--enable-priority-and-fairness=false',
            '--watch-cache=false',
            '-v=0',
          ],
          // Its self-signed serving cert, generated on first start and kept by restarts.
          scratch: [certs],
          ready: ({ api }) => () => httpsOkInsecure(`https://127.0.0.1:${api}/readyz`, token),
        };
        const api = await start(apiSpec);
        restartKubernetes = () => restart(apiSpec, api);
        endpoints.kubernetes = { server: `https://127.0.0.1:${api.ports.api}`, token, etcdUrl };
      })(),
    );
  }

  const results = await Promise.allSettled(starters);
  const failures = results.filter((r): r is PromiseRejectedResult => r.status === 'rejected');
  if (failures.length > 0) {
    await stop();
    throw new Error(failures.map((f) => (f.reason instanceof Error ? f.reason.message : String(f.reason))).join('\n\n'));
  }
  if (kept) {
    const next: SavedServices = {
      ports: { ...saved.ports, ...portsNow },
      ...(endpoints.s3 ? { s3: { accessKeyId: endpoints.s3.accessKeyId, secretAccessKey: endpoints.s3.secretAccessKey } } : saved.s3 ? { s3: saved.s3 } : {}),
      ...(endpoints.kubernetes ? { kubernetes: { token: endpoints.kubernetes.token } } : saved.kubernetes ? { kubernetes: saved.kubernetes } : {}),
    };
    writeFileSync(join(dataDir, SAVED_FILE), `${JSON.stringify(next, null, 2)}\n`, { mode: 0o600 });
  }
  return {
    endpoints,
    get pids() {
      return procs.map((p) => p.child.pid).filter((pid): pid is number => pid !== undefined);
    },
    dataDir,
    retries,
    restartNats: (opts) => restartNats(opts),
    restartKubernetes: () => restartKubernetes(),
    killTemporal: () => killTemporal(),
    restartTemporal: () => restartTemporal(),
    stop,
  };
}

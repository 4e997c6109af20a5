/**
 * Server processes: started, awaited until ready, ended — for the services here, `cluster.ts`'s
 * components and the tests' NATS cluster.
 *
 * No orphans: every server is exec'd through `setpriv --pdeathsig KILL`, so the kernel kills it
 * when the process that started it dies, however it dies (SIGKILL included). Each runs in a
 * session of its own: a terminal's Ctrl-C (SIGINT to the whole foreground process group) or a
 * signal to the starter's group reaches only the starter, which stops the servers in order —
 * a server that stopped by itself meanwhile would pull the ground from under the clients still
 * stopping (a NATS drain that ends in TIMEOUT, a Temporal worker that cannot finish).
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { createWriteStream } from 'node:fs';
import { join } from 'node:path';
import type { ServerName } from './types';

/** A server process started by {@link launch}. */
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

export const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

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

/**
 * What each server prints when a port it was given is taken, found by starting each one on a port
 * another process listens on (each then exits with status 1):
 * - temporal: `can't set frontend port N: listen tcp 127.0.0.1:N: bind: address already in use`
 *   (`can't set UI port N: …` for the UI port); it checks its ports before it binds them, and a
 *   port lost after that check ends in the same `bind: address already in use`.
 * - nats-server: `[FTL] Error listening on port: 127.0.0.1:N, "listen tcp 127.0.0.1:N: bind: address
 *   already in use"`, and for the monitor port `[FTL] Can't start monitoring: can't listen to the
 *   monitor port: listen tcp 127.0.0.1:N: bind: address already in use`.
 * - s3proxy: `Main:320 |::] Failed to bind to /127.0.0.1:N` (Jetty's words; the cause, the JVM's
 *   `BindException: Address already in use`, is not printed).
 * - minio: `FATAL Unable to start the server: Specified port is already in use` (no port named).
 * - etcd: `"msg":"discovery failed","error":"listen tcp 127.0.0.1:N: bind: address already in use"`
 *   (client and peer port alike).
 * - kube-apiserver: `"command failed" err="failed to create listener: failed to listen on
 *   127.0.0.1:N: listen tcp 127.0.0.1:N: bind: address already in use"`.
 */
const ADDRESS_IN_USE = /address already in use|port is already in use|failed to bind to \/127\.0\.0\.1:\d/i;

/** The line of `output` saying a port was taken, if there is one. */
function addressInUse(output: string): string | undefined {
  const line = output
    .split('\n')
    .find((l) => ADDRESS_IN_USE.test(l))
    ?.trim();
  return line && line.length > 400 ? `${line.slice(0, 400)}…` : line; // etcd's come with a stack trace
}

/**
 * The port `line` says is taken: one of `ports` (`port 4222 (client)`), or one the server chose
 * itself (Temporal picks ports for its internal services); MinIO names none: then it is `ports`.
 */
export function takenPort(line: string, ports: Readonly<Record<string, number>>): string {
  const all = Object.entries(ports).map(([role, port]) => `${port} (${role})`);
  const named = Object.entries(ports).filter(([, port]) => new RegExp(`[: ]${port}(?!\\d)`).test(line));
  if (named.length > 0) return `port ${named.map(([role, port]) => `${port} (${role})`).join(', ')}`;
  const own = /(?:127\.0\.0\.1|\[::1\]|localhost):(\d+)/.exec(line)?.[1];
  if (own) return `port ${own} (one it chose itself)`;
  return all.length === 1 ? `port ${all[0]}` : `one of its ports ${all.join(', ')}`;
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

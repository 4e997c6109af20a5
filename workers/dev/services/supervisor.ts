/**
 * Runs server specs: each until it is ready, again on new ports while a port turns out to be
 * taken, again on the same ports for a restart, and all of them stopped in order.
 *
 * Ports: a free port is chosen, released, and bound by the server a moment later, so another
 * process can take it in between. A server that then fails with "address already in use" before
 * it is ready is started again on newly chosen ports (at most `attempts` times, each from a clean
 * data path); only then does the start fail, naming the server and the port. A restart must come
 * back on the same ports (clients know them): a port lost meanwhile fails it, named.
 */
import { existsSync, rmSync } from 'node:fs';
import type { PortAllocator } from './ports';
import type { ServerSpec } from './servers';
import { alive, end, launch, NotReady, takenPort, waitReady, within, type Proc } from './supervision';
import type { ServerName } from './types';

/** A started server: its current process and the ports it keeps across restarts. */
export interface Started<R extends string> {
  readonly spec: ServerSpec<R>;
  proc: Proc;
  readonly ports: Record<R, number>;
}

export interface SupervisorOptions {
  /** Where each server's log goes (`<logDir>/<server>.log`). */
  logDir: string;
  /** Seconds to wait for each server to become ready. */
  readyTimeoutSec: number;
  /** Starts of one server on fresh ports before "address already in use" is final. */
  attempts: number;
  ports: PortAllocator;
  say: (line: string) => void;
}

export class Supervisor {
  /** How many times each server was started again on new ports because one was taken. */
  readonly retries: Partial<Record<ServerName, number>> = {};
  /** Every server process running now, in the order they were started. */
  private readonly procs: Proc[] = [];
  private stopped = false;

  constructor(private readonly opts: SupervisorOptions) {}

  get pids(): number[] {
    return this.procs.map((p) => p.child.pid).filter((pid): pid is number => pid !== undefined);
  }

  /** Starts `spec` on fresh ports, again on new ones while a port turns out to be taken. */
  async start<R extends string>(spec: ServerSpec<R>): Promise<Started<R>> {
    const { attempts, ports: allocator, say } = this.opts;
    // State from earlier runs is never what a failed start leaves behind: it stays.
    const earlier = new Set(spec.scratch.filter((path) => existsSync(path)));
    for (let attempt = 1; ; attempt++) {
      const ports = await allocator.forStart(spec.name, spec.roles, attempt);
      const described = Object.entries(ports)
        .map(([role, port]) => `${role} ${String(port)}`)
        .join(', ');
      try {
        const proc = await this.run(spec, ports, `attempt ${attempt} of ${attempts}, ports ${described}`);
        allocator.running(spec.name, ports);
        return { spec, proc, ports };
      } catch (err) {
        if (!(err instanceof NotReady) || err.inUse === undefined) throw err;
        const which = takenPort(err.inUse, ports);
        if (attempt >= attempts) {
          throw new Error(
            `${spec.name} could not start: on each of its ${attempts} starts another process took a port chosen for it before it could bind it ` +
              `(last: ${which}); last error: ${err.inUse}\n${err.message}`,
          );
        }
        this.retries[spec.name] = (this.retries[spec.name] ?? 0) + 1;
        say(
          `${spec.name}: ${which} was taken by another process before ${spec.name} could bind it; starting it again on new ports (start ${attempt + 1} of ${attempts})`,
        );
        // A run that failed may have begun its data (etcd's member dir, Temporal's db): start clean.
        for (const path of spec.scratch) if (!earlier.has(path)) rmSync(path, { recursive: true, force: true });
      }
    }
  }

  /** Stops a started server and starts it again on the same ports; `before` runs in between. */
  async restart<R extends string>(started: Started<R>, before?: () => void): Promise<void> {
    if (this.stopped) throw new Error('the services were stopped');
    const old = started.proc;
    // kube-apiserver holds a SIGTERM for ~30 s while a client keeps a watch open (measured);
    // a restart does not need to wait that out.
    await end(old, 5_000);
    this.forget(old);
    before?.();
    try {
      started.proc = await this.run(started.spec, started.ports, 'restart on the same ports');
    } catch (err) {
      if (!(err instanceof NotReady) || err.inUse === undefined) throw err;
      throw new Error(
        `${started.spec.name} could not start again: ${takenPort(err.inUse, started.ports)} was taken by another process while it was stopped, ` +
          `and it must come back on the same port; last error: ${err.inUse}\n${err.message}`,
      );
    }
  }

  /** SIGKILLs a started server, as a crash would; resolves once it has exited. */
  kill(started: Started<string>): Promise<void> {
    return end(started.proc, 0);
  }

  /** Stops every server, the last started first; idempotent. */
  async stopAll(): Promise<void> {
    if (this.stopped) return;
    this.stopped = true;
    const procs = this.procs;
    // The API server goes first, and alone: told to stop together with its etcd, it sometimes
    // loses etcd mid-shutdown and hangs until killed (measured: > 10 s; alone: ~50 ms).
    const api = procs.filter((p) => p.name === 'kube-apiserver' && alive(p));
    for (const p of api) p.child.kill('SIGTERM');
    await within(Promise.all(api.map((p) => p.exited)), 5_000);
    for (const p of [...procs].reverse()) if (alive(p)) p.child.kill('SIGTERM');
    await within(Promise.all(procs.map((p) => p.exited)), 10_000);
    for (const p of procs) if (alive(p)) p.child.kill('SIGKILL');
    await Promise.all(procs.map((p) => p.exited));
  }

  /** One run of `spec` on `ports` until it is ready; if it is not, it is gone when this throws. */
  private async run<R extends string>(spec: ServerSpec<R>, ports: Record<R, number>, note: string): Promise<Proc> {
    if (this.stopped) throw new Error('the services were stopped');
    const p = launch(spec.name, spec.bin, spec.args(ports), this.opts.logDir, spec.env ?? {}, note);
    this.procs.push(p);
    try {
      await waitReady(p, this.opts.readyTimeoutSec, spec.ready(ports));
      return p;
    } catch (err) {
      await end(p, 0);
      this.forget(p);
      throw err;
    }
  }

  private forget(p: Proc): void {
    const at = this.procs.indexOf(p);
    if (at >= 0) this.procs.splice(at, 1);
  }
}

/**
 * Loopback ports for servers: which are free, the band they are drawn from, and the ports one
 * start of the services hands out.
 *
 * A free port is chosen, released, and bound by the server a moment later, so another process can
 * take it in between; the supervisor starts a server again on new ports when that happens
 * (supervisor.ts). Something started in this process listens with no such gap
 * ({@link listenOnPort}).
 */
import { readFileSync } from 'node:fs';
import { createServer } from 'node:net';
import type { PortRequest, ServerName } from './types';

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

/**
 * Starts something that listens on a port, with no check-then-listen gap: on `port` when the user
 * gave one (if it is taken, the error names it and `flag`), else on the first of `preferred` that
 * is free, or where the kernel puts it (port 0) when every one is taken. `start` must fail with
 * code EADDRINUSE when its port is taken, as `listen` does.
 */
export async function listenOnPort<T>(
  what: string,
  start: (port: number) => Promise<T>,
  opts: { port?: number; preferred: number | readonly (number | undefined)[]; flag?: string },
): Promise<T> {
  const taken = (err: unknown) => (err as NodeJS.ErrnoException | undefined)?.code === 'EADDRINUSE';
  if (opts.port !== undefined) {
    try {
      return await start(opts.port);
    } catch (err) {
      if (!taken(err)) throw err;
      throw new Error(
        `${what} cannot listen on port ${opts.port}: another process already uses it; choose another port${opts.flag ? ` with ${opts.flag}` : ''}`,
      );
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

/** Ports by server, then by role (`services.json`'s `ports`). */
export type ServerPorts = Partial<Record<ServerName, Record<string, number>>>;

/**
 * The ports of one start of the services. Servers started side by side never get the same one;
 * a first attempt takes the port the server had last time when it is free, any later one a
 * fresh port (or whatever `picker` chooses); {@link PortAllocator.now} is what runs now.
 */
export class PortAllocator {
  /** The ports each server runs on now, for `services.json`. */
  readonly now: ServerPorts = {};
  /** Ports handed out by this start. */
  private readonly handedOut = new Set<number>();
  private readonly pick: (request: PortRequest) => Promise<number>;

  constructor(before: ServerPorts = {}, picker?: (request: PortRequest) => Promise<number>) {
    this.pick =
      picker ??
      (async ({ server, role, attempt }) => {
        const last = attempt === 1 ? before[server]?.[role] : undefined;
        if (last !== undefined && !this.handedOut.has(last) && (await portFree(last))) return last;
        return freePort();
      });
  }

  /** A port for each of `roles` of `server`'s `attempt`-th start, none handed out before. */
  async forStart<R extends string>(server: ServerName, roles: readonly R[], attempt: number): Promise<Record<R, number>> {
    const ports = {} as Record<R, number>;
    for (const role of roles) {
      let port = await this.pick({ server, role, attempt });
      for (let i = 0; this.handedOut.has(port) && i < 20; i++) port = await this.pick({ server, role, attempt });
      this.handedOut.add(port);
      ports[role] = port;
    }
    return ports;
  }

  /** `server` runs on `ports` now. */
  running(server: ServerName, ports: Record<string, number>): void {
    this.now[server] = ports;
  }
}

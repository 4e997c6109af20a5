/**
 * A TCP proxy on loopback that a test can cut: a network fault between one client and a real
 * server (here: one process's NATS connection), while the server and every other client carry on.
 */
import { createConnection, createServer, type Socket } from 'node:net';
import type { AddressInfo } from 'node:net';

export interface TcpProxy {
  /** `host:port` to connect to instead of the target. */
  address: string;
  /** Cuts every open connection and refuses new ones until {@link restore}. */
  cut(): void;
  restore(): void;
  close(): Promise<void>;
}

/**
 * `listenHost`: where it listens (default loopback; a container network's gateway lets containers
 * reach a loopback server). `holdAnswerAfter`: pass only that many bytes of each answer and hold
 * the rest (a download stuck midway).
 */
export async function startTcpProxy(target: { host: string; port: number }, listenHost = '127.0.0.1', opts: { holdAnswerAfter?: number } = {}): Promise<TcpProxy> {
  const open = new Set<Socket>();
  let refusing = false;
  const server = createServer((client) => {
    if (refusing) return void client.destroy();
    const upstream = createConnection(target);
    for (const s of [client, upstream]) {
      open.add(s);
      s.on('close', () => open.delete(s));
      s.on('error', () => undefined);
    }
    client.on('close', () => upstream.destroy());
    upstream.on('close', () => client.destroy());
    client.pipe(upstream);
    const limit = opts.holdAnswerAfter;
    if (limit === undefined) return void upstream.pipe(client);
    let passed = 0;
    upstream.on('data', (chunk: Buffer) => {
      const room = limit - passed;
      if (room > 0) client.write(chunk.subarray(0, room));
      passed += Math.min(room, chunk.length);
      if (passed >= limit) upstream.pause();
    });
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(0, listenHost, resolve);
  });
  return {
    address: `${listenHost}:${(server.address() as AddressInfo).port}`,
    cut() {
      refusing = true;
      for (const s of open) s.destroy();
    },
    restore() {
      refusing = false;
    },
    async close() {
      for (const s of open) s.destroy();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}

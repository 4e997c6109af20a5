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
  /** Passes answers (server → client) at most this fast from now on, on open connections too; `undefined` lifts it. */
  throttleAnswers(bytesPerSecond: number | undefined): void;
  close(): Promise<void>;
}

/**
 * `listenHost`: where it listens (default loopback; a container network's gateway lets containers
 * reach a loopback server). `holdAnswerAfter`: pass only that many bytes of each answer and hold
 * the rest (a download stuck midway). {@link TcpProxy.throttleAnswers} slows answers instead (a
 * slow read, so a test can be sure to act while one is under way).
 */
export async function startTcpProxy(
  target: { host: string; port: number },
  listenHost = '127.0.0.1',
  opts: { holdAnswerAfter?: number } = {},
): Promise<TcpProxy> {
  const open = new Set<Socket>();
  let refusing = false;
  let answerRate: number | undefined;
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
    let passed = 0;
    upstream.on('end', () => client.end());
    upstream.on('data', (chunk: Buffer) => {
      if (limit !== undefined) {
        const room = limit - passed;
        if (room > 0) client.write(chunk.subarray(0, room));
        passed += Math.min(room, chunk.length);
        if (passed >= limit) upstream.pause();
        return;
      }
      const drained = client.write(chunk);
      if (answerRate === undefined && drained) return;
      upstream.pause();
      const resume = () => (client.writableNeedDrain ? client.once('drain', () => upstream.resume()) : upstream.resume());
      if (answerRate === undefined) resume();
      else setTimeout(resume, (chunk.length / answerRate) * 1000);
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
    throttleAnswers(bytesPerSecond) {
      answerRate = bytesPerSecond;
    },
    async close() {
      for (const s of open) s.destroy();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}

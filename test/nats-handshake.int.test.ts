/**
 * The NATS server `magus dev` and the tests start (workers/dev/services/servers.ts) lets a client
 * authenticate up to NATS_AUTH_TIMEOUT_SEC after its INFO, not nats-server's default 2 s: a Node
 * process held that long between the two (a loaded machine) would be closed without a word, and
 * nats.js would wait out its whole connect timeout before failing with `TIMEOUT` (CI saw suites'
 * setups fail so). Spoken at the protocol level on a raw socket, so the pause is exactly where
 * the server's timer runs, whatever the client library does.
 */
import { connect as tcpConnect, type Socket } from 'node:net';
import { natsAuthOptions, readNatsCredentials } from '../dataplane/roles';
import { NATS_AUTH_TIMEOUT_SEC } from '../workers/dev/services/servers';
import { endpoint, natsCredentialsFile } from './harness';
import { sleep } from './harness/wait';

/** A raw client connection: the lines the server has sent so far, and the next one awaited. */
function rawClient(port: number): Promise<{ socket: Socket; line: (timeoutMs: number) => Promise<string> }> {
  return new Promise((ok, fail) => {
    const socket = tcpConnect(port, '127.0.0.1');
    let buffered = '';
    let closed = false;
    const waiting: (() => void)[] = [];
    socket.setEncoding('utf8');
    socket.on('data', (text: string) => {
      buffered += text;
      waiting.splice(0).forEach((wake) => wake());
    });
    socket.on('close', () => {
      closed = true;
      waiting.splice(0).forEach((wake) => wake());
    });
    socket.once('error', fail);
    const line = async (timeoutMs: number): Promise<string> => {
      const deadline = Date.now() + timeoutMs;
      for (;;) {
        const end = buffered.indexOf('\r\n');
        if (end >= 0) {
          const first = buffered.slice(0, end);
          buffered = buffered.slice(end + 2);
          return first;
        }
        if (closed) return '(closed)';
        if (Date.now() >= deadline) return '(nothing)';
        await new Promise<void>((wake) => {
          waiting.push(wake);
          setTimeout(wake, deadline - Date.now()).unref();
        });
      }
    };
    socket.once('connect', () => ok({ socket, line }));
  });
}

const credentials = natsCredentialsFile('worker');

(credentials ? test : test.skip)(
  'a client that sends CONNECT 3 s after the INFO is let in (nats-server alone would close it at 2 s)',
  async () => {
    expect(NATS_AUTH_TIMEOUT_SEC).toBeGreaterThan(3);
    const { port } = new URL(endpoint('nats').servers);
    const { socket, line } = await rawClient(Number(port));
    try {
      const info = await line(5_000);
      expect(info).toMatch(/^INFO \{/);
      const { nonce } = JSON.parse(info.slice('INFO '.length)) as { nonce: string };
      await sleep(3_000);
      const auth = natsAuthOptions(readNatsCredentials(credentials!)).authenticator!(nonce);
      socket.write(`CONNECT ${JSON.stringify({ ...auth, verbose: false, pedantic: false, protocol: 1, lang: 'test' })}\r\nPING\r\n`);
      // Closed at 2 s, the server's last words would be -ERR 'Authentication Timeout'.
      expect(await line(5_000)).toBe('PONG');
    } finally {
      socket.destroy();
    }
  },
  20_000,
);

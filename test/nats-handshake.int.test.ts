/**
 * The NATS servers magus configures (`magus nats-auth`'s nats-auth.conf, which `magus dev` and the
 * tests start nats-server with, and its nats-values.yaml for the official chart) let a client
 * authenticate up to NATS_AUTH_TIMEOUT_SEC after its INFO, not nats-server's default 2 s: a Node
 * process held that long between the two (a loaded machine) would be closed without a word, and
 * nats.js would wait out its whole connect timeout before failing with `TIMEOUT` (CI saw suites'
 * setups fail so). Spoken at the protocol level on a raw socket, so the pause is exactly where
 * the server's timer runs, whatever the client library does.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { connect as tcpConnect, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { dataPlaneNames } from '../dataplane';
import { NATS_AUTH_TIMEOUT_SEC, natsAuthOptions, readNatsCredentials } from '../dataplane/roles';
import { writeNatsAuth } from '../workers/nats-auth';
import { endpoint, natsCredentialsFile } from './harness';
import { chartMergedConfig, startNatsCluster } from './harness/nats-cluster';
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

/** Whether a client that sends its CONNECT (as the user of `credentials`) 3 s after the INFO gets its PONG. */
async function connectsAfterPause(port: number, credentials: string): Promise<string> {
  expect(NATS_AUTH_TIMEOUT_SEC).toBeGreaterThan(3);
  const { socket, line } = await rawClient(port);
  try {
    const info = await line(5_000);
    expect(info).toMatch(/^INFO \{/);
    const { nonce } = JSON.parse(info.slice('INFO '.length)) as { nonce: string };
    await sleep(3_000);
    const auth = natsAuthOptions(readNatsCredentials(credentials)).authenticator!(nonce);
    socket.write(`CONNECT ${JSON.stringify({ ...auth, verbose: false, pedantic: false, protocol: 1, lang: 'test' })}\r\nPING\r\n`);
    // Closed at 2 s, the server's last words would be -ERR 'Authentication Timeout'.
    return await line(5_000);
  } finally {
    socket.destroy();
  }
}

const credentials = natsCredentialsFile('worker');

(credentials ? test : test.skip)(
  "nats-auth.conf (the tests' server): a client that sends CONNECT 3 s after the INFO is let in (nats-server alone would close it at 2 s)",
  async () => {
    expect(await connectsAfterPause(Number(new URL(endpoint('nats').servers).port), credentials!)).toBe('PONG');
  },
  20_000,
);

test('nats-values.yaml (the official chart merges it into the configuration): the same', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'magus-nats-handshake-'));
  try {
    await writeNatsAuth(dir, dataPlaneNames(''));
    const cluster = await startNatsCluster({ size: 1, extraConfig: chartMergedConfig(join(dir, 'nats-values.yaml')) });
    try {
      expect(await connectsAfterPause(Number(new URL(cluster.servers[0]!).port), join(dir, 'worker.creds'))).toBe('PONG');
    } finally {
      await cluster.stop();
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}, 120_000);

/**
 * An instance's pod stopping (deleted, evicted, its node drained) with an answer in flight: the
 * kubelet runs the engine container's preStop — `GET /drained` on the bridge's health port — and
 * sends SIGTERM to the bridge at the same time. The bridge stops taking requests and finishes the
 * answer; `/drained` answers only then, so the engine (signalled after its preStop) outlives it.
 * Here the kubelet's part is played by the test: `magus bridge` as its own process (its instance's
 * NATS user), a stub engine streaming slowly, the real gateway and the official client.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import type OpenAI from 'openai';
import { consumerNameOf, type DataPlaneNames } from '../dataplane';
import { freePort } from '../workers/dev/services';
import { MAGUS_BIN } from './harness/dev';
import { endpoint, isolation, natsBridgeCredentials, natsCredentialsEnv } from './harness';
import { natsStack, pinnedGatewayStack, stubEngineStack, TestStack } from './harness/stack';
import { until } from './harness/wait';
import type { NatsConnection } from 'nats';

const iso = isolation();
const POOL = 'drained';
const INSTANCE = 'i1';
const SESSION = `drain-${iso.id}`;
const PIECES = 12;
const PIECE_MS = 250;
const REPLY = Array.from({ length: PIECES }, (_, i) => `piece${i} `).join('');

let nc: NatsConnection;
let names: DataPlaneNames;
let openai: OpenAI;
let engineUrl: string;
const coldStarts: string[] = [];
const stack = new TestStack();

beforeAll(async () => {
  ({ nc, names } = await stack.open(natsStack(iso, { declare: true })));
  const { engine } = await stack.open(stubEngineStack({ modelId: POOL, chunks: PIECES, chunkDelayMs: PIECE_MS, reply: () => REPLY }));
  engineUrl = engine.url;
  ({ openai } = await stack.open(
    pinnedGatewayStack(nc, names, { pool: POOL, instance: INSTANCE, sessionId: SESSION, coldStarts, why: 'cold start in the drain test' }),
  ));
}, 120_000);

afterAll(() => stack.close(), 60_000);

/** `magus bridge` as the pod's sidecar runs it, on the test's NATS as its instance's user; resolves once its consumer exists. */
async function bridgeProcess(healthPort: number): Promise<{ child: ChildProcess; stderr: () => string }> {
  const creds = await natsBridgeCredentials(names, POOL, INSTANCE);
  const child = spawn(
    'setpriv',
    [
      '--pdeathsig',
      'KILL',
      '--',
      process.execPath,
      MAGUS_BIN,
      'bridge',
      ...['--pool', POOL, '--instance', INSTANCE, '--engine', engineUrl, '--nats', endpoint('nats').servers],
      ...['--prefix', names.prefix, '--health-port', String(healthPort), '--drain-timeout-ms', '20000'],
    ],
    { env: { ...process.env, ...natsCredentialsEnv(creds) }, stdio: ['ignore', 'ignore', 'pipe'] },
  );
  let stderr = '';
  child.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
  stack.defer(async () => {
    if (child.exitCode === null) child.kill('SIGKILL');
    if (child.exitCode === null) await new Promise((r) => child.once('close', r));
  });
  const jsm = await nc.jetstreamManager();
  await until('the bridge serves', async () => {
    if (child.exitCode !== null) throw new Error(`magus bridge exited: ${stderr}`);
    return (await jsm.consumers.info(names.requestStream, consumerNameOf(POOL, INSTANCE)).catch(() => null)) !== null && stderr.includes('serving');
  });
  return { child, stderr: () => stderr };
}

/** A streamed answer through the gateway: its text, finish reason and when its last piece came. */
async function streamed(onPiece?: (pieces: number) => void): Promise<{ text: string; finish: string | null | undefined; lastPieceAt: number }> {
  const stream = await openai.chat.completions.create(
    { model: POOL, messages: [{ role: 'user', content: 'a slow answer' }], stream: true },
    { headers: { 'x-session-id': SESSION } },
  );
  let text = '';
  let pieces = 0;
  let lastPieceAt = 0;
  let finish: string | null | undefined;
  for await (const c of stream) {
    const piece = c.choices[0]?.delta?.content ?? '';
    if (piece) {
      text += piece;
      pieces++;
      lastPieceAt = Date.now();
      onPiece?.(pieces);
    }
    finish = c.choices[0]?.finish_reason ?? finish;
  }
  return { text, finish, lastPieceAt };
}

test('SIGTERM mid-answer with two more queued (one slot): the bridge serves all three, /drained answers only after the last piece, and the bridge exits cleanly', async () => {
  const port = await freePort();
  const { child, stderr } = await bridgeProcess(port);

  // Not stopping: /drained says so after its 2 s wait for a SIGTERM (an engine container restarted alone).
  const idle = await fetch(`http://127.0.0.1:${port}/drained`);
  expect(idle.status).toBe(200);
  expect(await idle.json()).toMatchObject({ drained: false });

  const exited = new Promise<number | null>((r) => child.once('exit', (code) => r(code)));
  let drained: Promise<{ at: number; body: unknown }> | undefined;
  let queue: Promise<Awaited<ReturnType<typeof streamed>>[]> | undefined;
  const first = streamed((pieces) => {
    if (pieces !== 2 || drained) return;
    // Two more requests for the instance, queued behind the one its slot serves.
    queue = Promise.all([streamed(), streamed()]);
    // The pod is deleted once they are queued: the engine's preStop asks /drained, the bridge gets SIGTERM.
    void until('two requests queued', async () => {
      const info = await (await nc.jetstreamManager()).consumers.info(names.requestStream, consumerNameOf(POOL, INSTANCE));
      return info.num_pending === 2;
    }).then(() => {
      drained = fetch(`http://127.0.0.1:${port}/drained`).then(async (r) => ({ at: Date.now(), body: await r.json() }));
      child.kill('SIGTERM');
    });
  });
  const answers = [await first, ...(await until('the queue was sent', () => queue !== undefined).then(() => queue!))];
  for (const a of answers) {
    expect(a.text).toBe(REPLY); // whole: no piece lost to the stop, none left in the consumer
    expect(a.finish).toBe('stop');
  }
  await until('/drained was asked', () => drained !== undefined);
  const answer = await drained!;
  expect(answer.body).toMatchObject({ drained: true });
  // The engine would have been stopped only now: not before the last piece. The two come by
  // different paths (the piece through NATS and the gateway, the answer from the bridge), a
  // millisecond or so apart either way; pieces come 250 ms apart, so an early answer shows.
  expect(answer.at).toBeGreaterThanOrEqual(Math.max(...answers.map((a) => a.lastPieceAt)) - 50);
  expect(await exited).toBe(0);
  expect(stderr()).toContain('serving the 2 request(s) queued for this instance first');
  expect(coldStarts).toEqual([]);
}, 60_000);

/**
 * A bridge process killed (SIGKILL) after it pulled a request and before it acked it, seen from
 * the official `openai` client through the real gateway and nats-server: JetStream redelivers
 * the request to a second bridge process, and the client gets exactly one complete answer — no
 * piece missing, none twice — while the engine saw the request twice; the usage ledger holds one
 * record of it, with the tokens the client was told.
 *
 * Deterministic: the bridges run as `magus bridge` processes (the TS sources under the swc
 * loader) with a 1 s ack wait; the stub engine holds the first attempt at a chosen point
 * (`pause`) and the test kills the bridge only once the engine holds it (and, mid-stream, once the
 * client has the pieces sent before the hold). The conversation is pinned to the bridges'
 * instance by a `magus_sessions` entry the test writes, as the session workflow would.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import type OpenAI from 'openai';
import { consumerNameOf, dataPlaneNames } from '../dataplane';
import { UsageLedger } from '../dataplane/usage';
import { splitText, type StubEngine } from './fixtures/stub-engine';
import { endpoint, isolation, natsBridgeCredentials, natsCredentialsEnv } from './harness';
import { natsStack, pinnedGatewayStack, stubEngineStack, TestStack } from './harness/stack';
import { freePort } from '../workers/dev/services';
import { until } from './harness/wait';

const iso = isolation();
const POOL = 'stub-kill';
const INSTANCE = 'i1';
const CHUNKS = 8;
const ACK_WAIT_MS = 1000;
const TOKEN_ID = 'kill';
const SESSION = `kill-${iso.id}`;
const ROOT = join(__dirname, '..');

let nc: NatsConnection;
let engine: StubEngine;
let openai: OpenAI;
const coldStarts: string[] = [];
const processes = new Set<BridgeProcess>();
const stack = new TestStack();

/** The next generation the stub starts is held after this many pieces; the test learns when. */
let holdNext: { afterChunks: number; reached: () => void } | undefined;

interface BridgeProcess {
  child: ChildProcess;
  stderr: string[];
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
}

/** `magus bridge` for the test's instance, from the TS sources; resolves once it serves. */
async function startBridgeProcess(healthPort?: number): Promise<BridgeProcess> {
  const code = `require(${JSON.stringify(join(ROOT, 'workers', 'bridge'))}).bridgeCommand(process.argv.slice(1)).then((c) => process.exit(c))`;
  const args = [
    '--nats',
    endpoint('nats').servers,
    '--prefix',
    iso.natsPrefix,
    '--pool',
    POOL,
    '--instance',
    INSTANCE,
    '--engine',
    engine.url,
    '--slots',
    '1',
    '--ack-wait-ms',
    String(ACK_WAIT_MS),
  ];
  if (healthPort !== undefined) args.push('--health-port', String(healthPort));
  // pdeathsig: the bridge dies with this test process, whatever happens to it.
  const child = spawn('setpriv', ['--pdeathsig', 'KILL', '--', process.execPath, '-r', require.resolve('@swc-node/register'), '-e', code, '--', ...args], {
    cwd: ROOT,
    // As its instance's own bridge user, as the Kubernetes runtime starts one.
    env: { ...process.env, ...natsCredentialsEnv(await natsBridgeCredentials(dataPlaneNames(iso.natsPrefix), POOL, INSTANCE)) },
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  const p: BridgeProcess = {
    child,
    stderr: [],
    exited: new Promise((resolve) => child.once('exit', (c, signal) => resolve({ code: c, signal }))),
  };
  processes.add(p);
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`magus bridge did not start within 60 s:\n${p.stderr.join('')}`)), 60_000);
    child.stderr.on('data', (d: Buffer) => {
      p.stderr.push(d.toString());
      if (p.stderr.join('').includes('magus bridge: serving')) {
        clearTimeout(timer);
        resolve();
      }
    });
    void p.exited.then(({ code: c, signal }) => {
      clearTimeout(timer);
      reject(new Error(`magus bridge exited (${c ?? signal}) before serving:\n${p.stderr.join('')}`));
    });
  });
  return p;
}

async function kill(p: BridgeProcess): Promise<void> {
  p.child.kill('SIGKILL');
  expect(await p.exited).toEqual({ code: null, signal: 'SIGKILL' });
  processes.delete(p);
}

async function stop(p: BridgeProcess): Promise<void> {
  p.child.kill('SIGTERM');
  const exit = await p.exited;
  processes.delete(p);
  expect(exit).toEqual({ code: 0, signal: null });
}

/** Holds the next generation after `afterChunks` pieces; resolves when the stub holds it. */
function holdNextAnswer(afterChunks: number): Promise<void> {
  return new Promise<void>((resolve) => (holdNext = { afterChunks, reached: resolve }));
}

/** True once the instance's consumer has nothing pending or unacknowledged. */
async function consumerIdle(): Promise<boolean> {
  const jsm = await nc.jetstreamManager();
  const info = await jsm.consumers.info(dataPlaneNames(iso.natsPrefix).requestStream, consumerNameOf(POOL, INSTANCE));
  return info.num_ack_pending === 0 && info.num_pending === 0;
}

beforeAll(async () => {
  const nats = await stack.open(natsStack(iso, { declare: true }));
  const { names } = nats;
  nc = nats.nc;
  ({ engine } = await stack.open(
    stubEngineStack({
      modelId: POOL,
      chunks: CHUNKS,
      pause: () => {
        const h = holdNext;
        holdNext = undefined;
        // Never released: the held attempt ends when its bridge dies and the connection closes.
        return h && { afterChunks: h.afterChunks, until: new Promise<never>(() => undefined), reached: h.reached };
      },
    }),
  ));
  ({ openai } = await stack.open(
    pinnedGatewayStack(nc, names, {
      tokenId: TOKEN_ID,
      pool: POOL,
      instance: INSTANCE,
      sessionId: SESSION,
      coldStarts,
      why: 'cold start in the bridge kill test',
      // Far longer than a bridge takes to start: the client waits for the second bridge.
      env: { MAGUS_GATEWAY_REQUEST_TIMEOUT_MS: '90000' },
    }),
  ));
  stack.defer(async () => {
    for (const p of processes) p.child.kill('SIGKILL');
    await Promise.all([...processes].map((p) => p.exited));
  });
}, 60_000);

afterAll(() => stack.close(), 60_000);

afterEach(() => {
  expect(coldStarts).toEqual([]);
});

const headers = { 'x-session-id': SESSION };
const prompt = (what: string) => `${what}: tell me about bridges ${randomBytes(8).toString('hex')}`;

/** The two engine calls of one request: the killed attempt's and the redelivery's, alike. */
function expectTwoAttempts(before: number): void {
  const calls = engine.requests.slice(before);
  expect(calls).toHaveLength(2);
  // The same request both times, with the seed the bridge pinned so a take-over repeats itself.
  expect(calls[1]!.body).toEqual(calls[0]!.body);
  expect((calls[0]!.body as { seed?: unknown }).seed).toEqual(expect.any(Number));
}

/** Ledger records already checked. */
const recorded = new Set<string>();

/** The ledger holds exactly one new record, for this request's key: completed, with `completion` tokens. */
async function expectOneRecord(completion: number): Promise<void> {
  const ledger = await UsageLedger.open(nc.jetstream(), dataPlaneNames(iso.natsPrefix));
  const fresh = (await ledger.read({ key: `config/${TOKEN_ID}` })).filter((r) => !recorded.has(r.id));
  expect(fresh).toHaveLength(1);
  expect(fresh[0]).toMatchObject({ model: `default/${POOL}`, kind: 'chat', outcome: 'completed', reported: true, tokens: { completion } });
  recorded.add(fresh[0]!.id);
}

/** The second bridge's /metrics tells the story: one redelivery, answered and acked, its usage recorded. */
async function expectOneTakeOverIn(healthPort: number): Promise<void> {
  const metrics = await (await fetch(`http://127.0.0.1:${healthPort}/metrics`)).text();
  const of = (name: string) => new RegExp(`^${name}\\{pool="${POOL}",instance="${INSTANCE}"\\} (\\d+)$`, 'm').exec(metrics)?.[1];
  expect({
    pulled: of('magus_bridge_pulled_total'),
    redelivered: of('magus_bridge_redelivered_total'),
    acked: of('magus_bridge_acked_total'),
    healthy: of('magus_bridge_healthy'),
    recorded: of('magus_bridge_usage_recorded_total'),
  }).toEqual({
    pulled: '1',
    redelivered: '1',
    acked: '1',
    healthy: '1',
    recorded: '1',
  });
  expect(metrics).toContain(`magus_usage_tokens_total{key="config/${TOKEN_ID}",model="default/${POOL}",kind="completion"} ${CHUNKS}`);
}

test('non-stream: the bridge dies holding the request; the next bridge answers it, once', async () => {
  const before = engine.requests.length;
  const held = holdNextAnswer(0);
  const first = await startBridgeProcess();
  const content = prompt('non-stream');
  const answer = openai.chat.completions.create({ model: POOL, messages: [{ role: 'user', content }] }, { headers });
  await held;
  await kill(first);

  const healthPort = await freePort();
  const second = await startBridgeProcess(healthPort);
  const completion = await answer;
  expect(completion.choices).toHaveLength(1);
  expect(completion.choices[0]).toMatchObject({ message: { role: 'assistant', content }, finish_reason: 'stop' });
  expect(completion.usage?.completion_tokens).toBe(CHUNKS);
  expectTwoAttempts(before);

  // The second bridge acked it: nothing is redelivered again, the engine is not called a third time.
  await until('the request acked', consumerIdle);
  expect(engine.requests.length - before).toBe(2);
  await expectOneTakeOverIn(healthPort);
  await expectOneRecord(completion.usage!.completion_tokens);
  await stop(second);
}, 180_000);

interface Streamed {
  id: string;
  role: string | undefined;
  deltas: string[];
  finishReasons: (string | null)[];
}

async function* chunksOf(stream: AsyncIterable<OpenAI.ChatCompletionChunk>, into: Streamed): AsyncGenerator<void> {
  for await (const c of stream) {
    expect(c.choices).toHaveLength(1);
    into.id ||= c.id;
    expect(c.id).toBe(into.id);
    const choice = c.choices[0]!;
    if (choice.delta.role) {
      expect(into.role).toBeUndefined();
      into.role = choice.delta.role;
    }
    if (choice.delta.content) into.deltas.push(choice.delta.content);
    if (choice.finish_reason) into.finishReasons.push(choice.finish_reason);
    yield;
  }
}

test.each([
  ['before the first piece', 0],
  ['mid-answer, after the client got 3 pieces', 3],
])(
  'stream: the bridge dies %s; the next bridge completes it, no piece missing or twice',
  async (_what, afterChunks) => {
    const before = engine.requests.length;
    const held = holdNextAnswer(afterChunks);
    const first = await startBridgeProcess();
    const content = prompt(`stream-${afterChunks}`);
    const stream = await openai.chat.completions.create({ model: POOL, messages: [{ role: 'user', content }], stream: true }, { headers });
    const got: Streamed = { id: '', role: undefined, deltas: [], finishReasons: [] };
    const reading = chunksOf(stream, got);
    // The stream is committed with the role chunk; read until the client holds the pieces sent
    // before the hold.
    await held;
    while (got.deltas.length < afterChunks) {
      const r = await reading.next();
      expect(r.done).toBe(false);
    }
    expect(got.deltas).toEqual(splitText(content, CHUNKS).slice(0, afterChunks));
    await kill(first);

    const healthPort = await freePort();
    const second = await startBridgeProcess(healthPort);
    for (let r = await reading.next(); !r.done; r = await reading.next());
    expect(got.role).toBe('assistant');
    expect(got.deltas).toEqual(splitText(content, CHUNKS));
    expect(got.deltas.join('')).toBe(content);
    expect(got.finishReasons).toEqual(['stop']);
    expectTwoAttempts(before);

    await until('the request acked', consumerIdle);
    expect(engine.requests.length - before).toBe(2);
    await expectOneTakeOverIn(healthPort);
    await expectOneRecord(CHUNKS);
    await stop(second);
  },
  180_000,
);

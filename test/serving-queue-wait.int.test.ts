/**
 * The queue's wait is bounded (issue 39, "Waiting is bounded"), through the real gateway,
 * nats-server and a real bridge in front of a stub engine of one slot whose answers take a known
 * time: the bridge's beats say its load and its measured service time, and a burst of turns far
 * beyond what the engine can begin within `MAGUS_MAX_QUEUE_WAIT` has its excess refused at once
 * with 429 `queue_full` and a `Retry-After` (and `retry-after-ms`) computed from that queue — no
 * entry, no publish —, while what was admitted is answered within the budget plus one answer's
 * service time; a turn sent again after its `retry-after-ms` is answered.
 */
import type { NatsConnection } from 'nats';
import type { DataPlaneNames } from '../dataplane';
import type { RunningGateway } from '../gateway/server';
import { isolation } from './harness';
import { publishPoolView } from './harness/gateway';
import { natsStack, pinnedGatewayStack, stubInstanceStack, TestStack } from './harness/stack';
import type { StubEngine } from './fixtures/stub-engine';

const iso = isolation();
const POOL = 'queued';
const SESSION = `queue-${iso.id}`;
/** Each answer takes this long in the engine (one slot): the instance begins about two a second. */
const SERVICE_MS = 500;
const BUDGET_MS = 1_200;
const BURST = 12;

let nc: NatsConnection;
let names: DataPlaneNames;
let gateway: RunningGateway;
let engine: StubEngine;
let token: string;
const coldStarts: string[] = [];
const stack = new TestStack();

beforeAll(async () => {
  ({ nc, names } = await stack.open(natsStack(iso, { declare: true })));
  ({ engine } = await stack.open(stubInstanceStack(nc, names, { pool: POOL, instance: 'i1', slots: 1, engine: { delayMs: SERVICE_MS, slots: 1, queue: 64 } })));
  const pinned = await stack.open(
    pinnedGatewayStack(nc, names, {
      pool: POOL,
      instance: 'i1',
      sessionId: SESSION,
      coldStarts,
      why: 'cold start in the queue-wait test',
      env: { MAGUS_MAX_QUEUE_WAIT: `${BUDGET_MS}ms` },
    }),
  );
  gateway = pinned.gateway;
  token = pinned.openai.apiKey!;
  await publishPoolView(nc, names, POOL, ['i1']);
}, 60_000);

afterAll(() => stack.close(), 60_000);

interface Outcome {
  status: number;
  code?: string;
  retryAfter: string | null;
  retryAfterMs: number;
  ms: number;
}

async function turn(content: string): Promise<Outcome> {
  const t0 = performance.now();
  const res = await fetch(`${gateway.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json', 'x-session-id': SESSION },
    body: JSON.stringify({ model: POOL, messages: [{ role: 'user', content }], max_tokens: 8 }),
  });
  const body = (await res.json()) as { error?: { code?: string } };
  return {
    status: res.status,
    ...(body.error?.code ? { code: body.error.code } : {}),
    retryAfter: res.headers.get('retry-after'),
    retryAfterMs: Number(res.headers.get('retry-after-ms') ?? NaN),
    ms: performance.now() - t0,
  };
}

const refusals = async (): Promise<number> => {
  const text = await (await fetch(`${gateway.url}/metrics`)).text();
  return Number(/^magus_gateway_refused_queue_wait_total (\d+)$/m.exec(text)?.[1] ?? NaN);
};

test(`a burst of ${BURST} turns on an engine that begins two a second: the excess refused at once with a computed Retry-After, the rest answered within the budget plus a service time`, async () => {
  // The bridge learns its service time from answers (none yet: nothing is bounded).
  for (const k of [0, 1]) expect((await turn(`warm ${k}`)).status).toBe(200);
  await new Promise((resolve) => setTimeout(resolve, 600)); // a beat or two carries it
  const before = await refusals();
  const served = engine.requests.length;

  const outcomes = await Promise.all(Array.from({ length: BURST }, (_, k) => turn(`burst ${k}`)));
  const answered = outcomes.filter((o) => o.status === 200);
  const refused = outcomes.filter((o) => o.status !== 200);
  process.stderr.write(
    `serving-queue-wait: ${answered.length} answered (slowest ${Math.round(Math.max(...answered.map((o) => o.ms)))} ms), ${refused.length} refused ` +
      `(slowest ${Math.round(Math.max(...refused.map((o) => o.ms)))} ms; retry-after-ms ${refused.map((o) => o.retryAfterMs).join(' ')})\n`,
  );
  // What one slot begins within the budget: the one free now and those 0.5 s, 1 s after it — a beat may shift it by one.
  expect(answered.length).toBeGreaterThanOrEqual(2);
  expect(answered.length).toBeLessThanOrEqual(5);
  for (const o of refused) {
    expect([o.status, o.code]).toEqual([429, 'queue_full']);
    expect(o.retryAfter).toMatch(/^[1-9]\d*$/);
    // When the queue is within the budget again: at least a second, at most what the whole burst would take.
    expect(o.retryAfterMs).toBeGreaterThanOrEqual(1_000);
    expect(o.retryAfterMs).toBeLessThanOrEqual(BURST * SERVICE_MS);
    expect(Number(o.retryAfter)).toBe(Math.ceil(o.retryAfterMs / 1000));
    expect(o.ms).toBeLessThan(1_000); // at once, not after a wait (bench/README has the figure)
  }
  // Refused ones never reached the engine, and the gateway counts them.
  expect(engine.requests.length - served).toBe(answered.length);
  expect((await refusals()) - before).toBe(refused.length);
  // Admitted ones began within the budget: answered within it plus one answer's service time (and a margin for this machine).
  for (const o of answered) expect(o.ms).toBeLessThan(BUDGET_MS + SERVICE_MS + 1_000);

  // Sent again as told: answered.
  await new Promise((resolve) => setTimeout(resolve, Math.max(...refused.map((o) => o.retryAfterMs))));
  const again = await turn('again');
  expect([again.status, again.code]).toEqual([200, undefined]);
  expect(coldStarts).toEqual([]);
}, 60_000);

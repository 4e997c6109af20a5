/**
 * A stream resumed with `Last-Event-ID` after its gateway died, when the answer had moved before
 * anything of it was said — away from a bridge that went silent, then handed back — and the
 * request it left behind was answered later after all (a bridge of that instance that never heard
 * the cancel: restarted, or cut off when it went out). The order of events behind bench:chaos's
 * one repeated answer (bench/README.md, "Streams under faults").
 *
 * Two real gateways (one killed: its NATS connection closed) on a real nats-server; the test is
 * the bridges of instances i1 … i3: it beats for them, reads the requests the gateways publish
 * and publishes their frames, so each step happens when the test says.
 *
 * The replica resuming must follow the moves as the one that made them recorded them — each from
 * where the answer left its request (serving/resume.ts `MoveRecord.at`), not from what that
 * request's bridge published later — and number the rest as the live stream did: the client
 * gets the rest once, not the left request's late answer, and no piece twice.
 */
import type { NatsConnection, Subscription } from 'nats';
import { randomBytes } from 'node:crypto';
import { beatSubjectOf, ensureInstanceConsumer, instanceResponseSubjectOf, scopedSubject, type DataPlaneNames } from '../dataplane';
import { claimKeyOf } from '../dataplane/claims';
import { encodeFrame } from '../dataplane/frames';
import { decodeJson } from '../dataplane/json';
import { CONTINUE_ELSEWHERE } from '../shared/continuation';
import type { InferenceRequest, ResponseFrame } from '../shared/serving';
import { isolation, natsConnectAs } from './harness';
import { pinnedConversation, publishPoolView, refusedColdStart } from './harness/gateway';
import { gatewayStack, natsStack, TestStack } from './harness/stack';
import { sseMessages, type RawEvent } from './harness/sse-stream';
import { until } from './harness/wait';

const iso = isolation();
const POOL = `resumemoves${iso.id}`.toLowerCase().replace(/[^a-z0-9]/g, '');
const INSTANCES = ['i1', 'i2', 'i3'];
const TOKEN_ID = 'resumer';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(16).toString('hex')}`;
const SECRET = randomBytes(32).toString('hex');
const SESSION = `resume-moves-${iso.id}`;

let nc: NatsConnection;
let names: DataPlaneNames;
const stack = new TestStack();
const coldStarts: string[] = [];
/** The gateway clients come back to. */
let survivor: { url: string };
/** Instances the test beats for now. */
const beating = new Set(INSTANCES);
/** Requests published to the pool, by id, with the instance each went to. */
const published = new Map<string, { req: InferenceRequest; instance: string }>();
let requests: Subscription;

const env = { MAGUS_LOG_LEVEL: 'silent', MAGUS_MAX_QUEUE_WAIT: '0' };

beforeAll(async () => {
  ({ nc, names } = await stack.open(natsStack(iso, { declare: true })));
  const jsm = await nc.jetstreamManager();
  for (const instance of INSTANCES) await ensureInstanceConsumer(jsm, names, { pool: POOL, instance, slots: 1 });
  await pinnedConversation(nc, names, { pool: POOL, instance: 'i1', secret: SECRET, scope: TOKEN_ID, sessionId: SESSION });
  await publishPoolView(nc, names, POOL, INSTANCES);
  // The bridges' side: requests as they are published (to an instance's subject or one of its lanes), and beats.
  requests = nc.subscribe(scopedSubject(names, `magus.req.${POOL}.>`), {
    callback: (err, msg) => {
      if (err) return;
      const req = decodeJson(msg.data) as InferenceRequest;
      published.set(req.id, { req, instance: msg.subject.split('.')[msg.subject.split('.').indexOf(POOL) + 1]! });
    },
  });
  stack.defer(() => Promise.resolve(requests.unsubscribe()));
  const beat = setInterval(() => {
    for (const instance of beating) nc.publish(beatSubjectOf(names, POOL, instance), JSON.stringify({ running: 0, slots: 1, queued: 0, serviceMs: null }));
  }, 200);
  stack.defer(() => Promise.resolve(clearInterval(beat)));
  await nc.flush();
  ({ gateway: survivor } = await stack.open(
    gatewayStack(names, { secret: SECRET, tokens: { [TOKEN_ID]: TOKEN }, env, deps: { coldStart: refusedColdStart(coldStarts, 'no cold start here') } }),
  ));
}, 60_000);

afterAll(() => stack.close(), 30_000);

/** Publishes `frames` of request `id` as its instance's bridge does (on the instance's subject for it), stored by the response stream. */
async function say(id: string, ...frames: ResponseFrame[]): Promise<void> {
  const { req, instance } = published.get(id)!;
  for (const f of frames) await nc.jetstream().publish(instanceResponseSubjectOf(req.replyTo, req.id, POOL, instance), encodeFrame(f));
}
const role = (seq: number): ResponseFrame => ({ seq, type: 'chunk', data: chunk({ role: 'assistant', content: '' }) });
const text = (seq: number, content: string, token: number): ResponseFrame => ({ seq, type: 'chunk', data: chunk({ content }), tokens: [token] });
const handedBack = (seq: number): ResponseFrame => ({
  seq,
  type: 'error',
  error: { status: 503, type: 'server_error', code: CONTINUE_ELSEWHERE, message: 'its engine went away: continue it elsewhere' },
});
const done = (seq: number): ResponseFrame => ({ seq, type: 'done' });
function chunk(delta: Record<string, string>): unknown {
  return { id: 'chatcmpl-x', object: 'chat.completion.chunk', created: 1_700_000_000, model: POOL, choices: [{ index: 0, delta, finish_reason: null }] };
}

/** The conversation's streamed turn through `url`, resumed after `lastEventId` if given; each data event as it comes to `onEvent` (true: the client goes away). */
async function turn(
  url: string,
  o: { lastEventId?: string; onEvent?: (events: RawEvent[]) => boolean | Promise<boolean> } = {},
): Promise<{ events: RawEvent[]; done: boolean }> {
  const ctl = new AbortController();
  const res = await fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: {
      authorization: `Bearer ${TOKEN}`,
      'content-type': 'application/json',
      'x-session-id': SESSION,
      ...(o.lastEventId ? { 'last-event-id': o.lastEventId } : {}),
    },
    body: JSON.stringify({ model: POOL, messages: [{ role: 'user', content: 'Tell me a story.' }], max_tokens: 50, stream: true }),
    signal: ctl.signal,
  });
  expect(res.status).toBe(200);
  const events: RawEvent[] = [];
  try {
    for await (const e of sseMessages(res)) {
      if (e.data === '[DONE]') return { events, done: true };
      events.push(e);
      if (await o.onEvent?.(events)) {
        ctl.abort();
        return { events, done: false };
      }
    }
  } catch (err) {
    if (!ctl.signal.aborted) throw err;
  }
  return { events, done: false };
}

const contentOf = (events: RawEvent[]) =>
  events.map((e) => (JSON.parse(e.data) as { choices?: { delta?: { content?: string } }[] }).choices?.[0]?.delta?.content ?? '').join('');
const seqOf = (e: RawEvent) => Number(e.id!.split('.')[2]);

/** A gateway replica on a NATS connection of its own (`client`): closing it kills the replica as far as the data plane can tell. */
async function doomedGateway(client: string) {
  const doomedNc = await natsConnectAs('gateway', names, client);
  const doomed = await gatewayStack(names, {
    nc: doomedNc,
    secret: SECRET,
    tokens: { [TOKEN_ID]: TOKEN },
    env,
    deps: { coldStart: refusedColdStart(coldStarts, 'no cold start here') },
  });
  return { doomedNc, doomed };
}

test('moved away from a silent bridge after its role, handed back after a role, cut after "The story"; the left request answered later after all: a resume gets " of a fox" once, numbered on', async () => {
  const { doomedNc, doomed } = await doomedGateway('magus-test-doomed-gateway');
  const live = turn(doomed.gateway.url, {
    onEvent: async (events) => {
      if (events.length < 3) return false;
      // "The story" said: the gateway dies (its NATS connection before its client's: it cancels nothing).
      await doomedNc.close();
      return true;
    },
  });
  // i1's bridge begins the answer (its role), then goes silent.
  await until('the turn reaches i1', () => [...published.values()].some((p) => p.instance === 'i1'));
  const first = [...published.values()].find((p) => p.instance === 'i1')!.req.id;
  await say(first, role(0));
  beating.delete('i1');
  // Its gateway moves it (nothing said yet); where it goes, the engine goes away before it says anything.
  await until('moved away from i1', () => published.has(`${first}-m1`), 10_000);
  await say(`${first}-m1`, role(0), handedBack(1));
  await until('moved again', () => published.has(`${first}-m2`), 10_000);
  await say(`${first}-m2`, role(0), text(1, 'The', 1), text(2, ' story', 2));
  const cut = await live;
  await Promise.resolve(doomed.close()).catch(() => undefined);
  expect(contentOf(cut.events)).toBe('The story');
  // i1 beats again, and the request the answer left there is answered after all (a bridge that never heard the cancel).
  beating.add('i1');
  await say(first, text(1, 'Another', 9), text(2, ' answer', 9), text(3, ' from', 9), text(4, ' the', 9), text(5, ' left', 9), text(6, ' one', 9), done(7));
  // Part of the rest was said before the client came back, part after.
  await say(`${first}-m2`, text(3, ' of', 3));
  const rest = turn(survivor.url, { lastEventId: cut.events.at(-1)!.id! });
  await new Promise((resolve) => setTimeout(resolve, 500));
  await say(`${first}-m2`, text(4, ' a', 4), text(5, ' fox', 5), done(6));
  const resumed = await rest;
  expect(resumed.done).toBe(true);
  expect(contentOf(resumed.events)).toBe(' of a fox');
  // Numbered on from the live stream's, each once: R's role 0, m1's role and m2's role not relayed (1 and 2 are theirs), "The" 3, " story" 4.
  expect(cut.events.map(seqOf)).toEqual([0, 3, 4]);
  expect(resumed.events.map(seqOf)).toEqual([5, 6, 7]);
  // The left request's claim was ended where the answer left it: no bridge of i1 that pulls it later serves it.
  const claims = await nc.jetstream().views.kv(names.claimsBucket, { bindOnly: true });
  expect((await claims.get(claimKeyOf({ pool: POOL, instance: 'i1' }, first)))?.json()).toMatchObject({
    owner: 'gateway',
    state: 'finished',
    terminal: { seq: 1, type: 'error', error: { code: CONTINUE_ELSEWHERE } },
  });
  expect(coldStarts).toEqual([]);
}, 60_000);

test('a turn whose gateway died before any of it was said, handed back by its bridge: the resume moves it on in its first place in the queues, under a deadline of its own', async () => {
  const { doomedNc, doomed } = await doomedGateway('magus-test-doomed-gateway-2');
  const before = new Set(published.keys());
  const newTurn = () => [...published.values()].find((p) => !before.has(p.req.id) && p.instance === 'i1');
  const live = turn(doomed.gateway.url, {
    onEvent: async () => {
      // Its role said (nothing of the answer): the gateway dies, its NATS connection before its client's.
      await doomedNc.close();
      return true;
    },
  });
  await until('the turn reaches i1', () => newTurn() !== undefined);
  const first = newTurn()!.req;
  await say(first.id, role(0));
  const cut = await live;
  await Promise.resolve(doomed.close()).catch(() => undefined);
  // Its bridge hands it back (a drain deadline, its engine gone), saying the request's place: nobody moves it yet.
  await say(first.id, { ...handedBack(1), due: first.deadline } as ResponseFrame);
  const rest = turn(survivor.url, { lastEventId: cut.events.at(-1)!.id! });
  await until('moved on by the resume', () => published.has(`${first.id}-m1`), 15_000);
  const moved = published.get(`${first.id}-m1`)!;
  // Its place in a queue is the first request's (it waited its turn there); its deadline counts from the resume.
  expect(moved.req.due).toBe(first.deadline);
  expect(moved.req.deadline).toBeGreaterThan(first.deadline);
  await say(moved.req.id, role(0), text(1, 'Fresh', 1), done(2));
  const resumed = await rest;
  expect(resumed.done).toBe(true);
  expect(contentOf(resumed.events)).toBe('Fresh');
}, 60_000);

/**
 * NATS outages under a serving data plane, on a nats-server of this file's own:
 * - the server restarts, with its store (an upgrade) and without it (a pod on ephemeral
 *   storage): the processes that declare the data plane declare it again after they reconnect
 *   (declareOnReconnect), each bridge puts back its own consumer, the gateway reopens its
 *   watches, so requests are served again without restarting anything; a request in flight
 *   across the restart is answered once;
 * - the gateway alone is cut off (a TCP proxy between it and the server) while a bridge answers:
 *   once back, it reads what it missed from the response stream, and the client gets the whole
 *   answer, each piece once.
 */
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { PassThrough } from 'node:stream';
import { connect, Events, type NatsConnection } from 'nats';
import {
  consumerNameOf,
  dataPlaneNames,
  declareOnReconnect,
  ensureDataPlane,
  ensureInstanceConsumer,
  jsErrorCode,
  responseSubjectOf,
  type DataPlaneNames,
} from '../dataplane';
import { decodeFrame } from '../dataplane/frames';
import type { ResponseFrame } from '../shared/serving';
import { startServices, type RunningServices } from '../workers/dev/services';
import { startBridge, type Bridge } from '../dataplane/bridge';
import { startWorkers } from '../workers/worker';
import { openModelRegistry } from '../dataplane/registry';
import { startGateway } from '../gateway/server';
import { makeToken, readyModel, TEST_SECRET } from './harness/gateway-app';
import { isolation, workerConfig } from './harness';
import { gatewayConfigFor, pinConversation } from './harness/gateway';
import { startTcpProxy } from './harness/tcp-proxy';
import { eventually, sleep } from './harness/wait';
import { askInstance } from './harness/data-plane';
import { startStubEngine, type StubEngine } from './fixtures/stub-engine';

const POOL = 'restarts';

/** Resolves on the connection's next disconnect. */
async function disconnected(nc: NatsConnection): Promise<void> {
  for await (const s of nc.status()) if (s.type === Events.Disconnect) break;
}

/** Resolves on the connection's next reconnect, then makes sure the server has its subscriptions. */
async function reconnected(nc: NatsConnection): Promise<void> {
  for await (const s of nc.status()) if (s.type === Events.Reconnect) break;
  await nc.flush();
}

describe('NATS outages', () => {
  let services: RunningServices;
  /** The worker's connection: it declares the data plane and runs the bridges. */
  let worker: NatsConnection;
  /** The gateway's. */
  let gateway: NatsConnection;
  let names: DataPlaneNames;
  let engine: StubEngine;
  const bridges: Bridge[] = [];
  const logs: string[] = [];
  /** Every frame seen on any response subject, by request id. */
  const seen = new Map<string, ResponseFrame[]>();
  let release: () => void = () => undefined;
  let reached: Promise<void> = Promise.resolve();

  const connectTo = (name: string) =>
    connect({ servers: services.endpoints.nats!.servers, name, maxReconnectAttempts: -1, reconnectTimeWait: 100, noAsyncTraces: true });

  const bridge = async (instance: string) => {
    await ensureInstanceConsumer(await worker.jetstreamManager(), names, { pool: POOL, instance, slots: 2 });
    const b = await startBridge({ nc: worker, names, pool: POOL, instance, engineUrl: engine.url, slots: 2, log: (line) => logs.push(`${instance}: ${line}`) });
    bridges.push(b);
    return b;
  };

  /** A request whose answer the stub holds until `release()`; `reached` resolves once it is held. */
  const holdNext = (afterChunks = 0) => {
    const gate = new Promise<void>((resolve) => (release = resolve));
    reached = new Promise<void>((resolve) => (holding = { afterChunks, until: gate, reached: resolve }));
  };
  let holding: { afterChunks: number; until: Promise<void>; reached: () => void } | undefined;

  beforeAll(async () => {
    services = await startServices({ services: ['nats'] });
    worker = await connectTo('worker');
    gateway = await connectTo('gateway');
    const prefix = `R${randomBytes(3).toString('hex').toUpperCase()}`;
    names = await declareOnReconnect(worker, () => ensureDataPlane(worker, { prefix }), { what: 'data plane', log: (line) => logs.push(line) });
    engine = await startStubEngine({
      modelId: POOL,
      pause: () => {
        const h = holding;
        holding = undefined;
        return h;
      },
    });
    const all = gateway.subscribe(responseSubjectOf(names, 'x').replace(/x$/, '>')); // both forms: magus.res.[<replica>.]<id>
    void (async () => {
      for await (const m of all) {
        const id = m.subject.slice(m.subject.lastIndexOf('.') + 1);
        const f = decodeFrame(m.data);
        if (f) seen.set(id, [...(seen.get(id) ?? []), f]);
      }
    })();
    await bridge('i1');
  });

  afterAll(async () => {
    for (const b of bridges) await b.stop();
    await engine?.stop();
    await worker?.close();
    await gateway?.close();
    await services?.stop();
  });

  it('with its store: the response stream is declared again and an answer in flight arrives once', async () => {
    expect((await askInstance(gateway, names, POOL, 'i1', { messages: [{ role: 'user', content: 'before' }] })).text).toBe('before');

    holdNext();
    const asked = askInstance(gateway, names, POOL, 'i1', { messages: [{ role: 'user', content: 'across' }] }, 60_000);
    await reached;
    const back = Promise.all([reconnected(worker), reconnected(gateway)]);
    await services.restartNats();
    await back;
    const jsm = await gateway.jetstreamManager();
    // MAGUS_RESPONSES is in memory: gone with the old process, then declared again by the worker.
    await eventually(() => jsm.streams.info(names.responseStream));
    release();
    const answer = await asked;
    expect(answer.text).toBe('across');

    // Everything the bridge published for that request: one generation, one terminal frame.
    await sleep(300);
    const id = [...seen.entries()].find(([, frames]) => frames.some((f) => f.type === 'done' && JSON.stringify(f).includes('across')))![0];
    const terminal = seen.get(id)!.filter((f) => f.type !== 'chunk');
    expect(new Set(terminal.map((f) => JSON.stringify(f))).size).toBe(1);
    expect(terminal[0]!.type).toBe('done');

    expect((await askInstance(gateway, names, POOL, 'i1', { messages: [{ role: 'user', content: 'after' }] })).text).toBe('after');
    expect(logs).toContain('data plane: in place after a reconnect');
  }, 90_000);

  /** A gateway on `nc` (alice's token; conversations pinned to i1) and a client for it. */
  const gatewayOn = async (nc: NatsConnection, env: Record<string, string> = {}) => {
    await (await openModelRegistry(worker, names.modelsBucket)).put(readyModel(POOL));
    const gw = await startGateway(
      gatewayConfigFor(names.prefix, {
        secret: TEST_SECRET,
        tokens: {},
        env: { MAGUS_NATS_URL: services.endpoints.nats!.servers, MAGUS_GATEWAY_TOKENS: JSON.stringify({ alice: alice.entry }), ...env },
      }),
      { nc, coldStart: (req) => pinConversation(worker, names, req.conversationKey, POOL, 'i1'), logStream: new PassThrough().resume() },
    );
    const post = (content: string, bearer: string, stream: boolean, signal?: AbortSignal) =>
      fetch(`${gw.url}/v1/chat/completions`, {
        method: 'POST',
        signal,
        headers: { authorization: `Bearer ${bearer}`, 'content-type': 'application/json', 'x-session-id': 'across-outages' },
        body: JSON.stringify({ model: POOL, messages: [{ role: 'user', content }], stream }),
      });
    const turn = async (content: string, bearer = alice.token) => {
      const res = await post(content, bearer, false);
      return { status: res.status, text: ((await res.json()) as { choices?: { message: { content: string } }[] }).choices?.[0]?.message.content };
    };
    /** A streamed turn: the text of its chunks, and whether it ended with `[DONE]`. */
    const streamTurn = async (content: string) => {
      const res = await post(content, alice.token, true);
      const events = (await res.text())
        .split('\n\n')
        .map((e) => e.split('\n').find((line) => line.startsWith('data: '))) // after the event's `id:` line
        .filter((d): d is string => d !== undefined)
        .map((d) => d.slice(6));
      const text = events
        .filter((e) => e !== '[DONE]')
        .map((e) => (JSON.parse(e) as { choices?: { delta?: { content?: string } }[] }).choices?.[0]?.delta?.content ?? '')
        .join('');
      return { status: res.status, text, done: events.at(-1) === '[DONE]' };
    };
    return { gw, post, turn, streamTurn };
  };
  const alice = makeToken('alice');

  /** A gateway whose NATS connection runs through a TCP proxy the test can cut and restore. */
  const cuttableGateway = async (env: Record<string, string> = {}) => {
    const target = new URL(services.endpoints.nats!.servers);
    const proxy = await startTcpProxy({ host: target.hostname, port: Number(target.port) });
    const nc = await connect({ servers: proxy.address, name: 'cut-off gateway', maxReconnectAttempts: -1, reconnectTimeWait: 100, noAsyncTraces: true });
    const client = await gatewayOn(nc, env);
    return {
      ...client,
      /** Cuts it off; resolves once its connection noticed. */
      async cut() {
        const down = disconnected(nc);
        proxy.cut();
        await down;
      },
      /** Lets it back; resolves once it reconnected. */
      async restore() {
        const back = reconnected(nc);
        proxy.restore();
        await back;
      },
      async close() {
        await client.gw.close();
        await nc.close();
        await proxy.close();
      },
    };
  };

  it('the gateway carries on across a restart with its store: warm turns, and KV updates seen at once', async () => {
    const { gw, turn } = await gatewayOn(gateway);
    try {
      expect(await turn('first')).toEqual({ status: 200, text: 'first' });
      const back = Promise.all([reconnected(worker), reconnected(gateway)]);
      await services.restartNats();
      await back;
      // Ready again once its KV watches have reopened on the new server (a moment: JetStream
      // restores its streams after the server accepts connections).
      await eventually(async () => expect(await (await fetch(`${gw.url}/readyz`)).json()).toMatchObject({ status: 'ok' }), 10_000);
      expect(await turn('second')).toEqual({ status: 200, text: 'second' });
      // A token added now works within moments: the gateway's KV watches reopened on the reconnect.
      // (Their old consumers died with the server; they would notice only when heartbeats went missing.)
      const bob = makeToken('bob');
      await (await worker.jetstream().views.kv(names.tokensBucket)).put('bob', new TextEncoder().encode(JSON.stringify(bob.entry)));
      await eventually(async () => expect(await turn('bob here', bob.token)).toEqual({ status: 200, text: 'bob here' }), 3_000);
      expect(gw.sessionCache?.stats().coldStarts).toBe(2); // alice's conversation, then bob's
    } finally {
      await gw.close();
    }
  }, 90_000);

  it('a gateway cut off from NATS mid-answer reads what it missed from the response stream: the whole answer, each piece once', async () => {
    // Without the read-back, the answer published while it was away would never come: a 504 after this.
    const cut = await cuttableGateway({ MAGUS_GATEWAY_REQUEST_TIMEOUT_MS: '15000' });
    const { gw, turn, streamTurn } = cut;
    const served = bridges[0]!;
    try {
      for (const stream of [false, true]) {
        // Streamed: two pieces reach the client first; the other two and the end come while it is away.
        holdNext(stream ? 2 : 0);
        const acked = served.stats.acked;
        const answer = stream ? streamTurn('one two three four') : turn('one two three four');
        await reached;
        await cut.cut();
        release();
        await eventually(() => Promise.resolve(expect(served.stats.acked).toBe(acked + 1))); // answered while the gateway was away
        await cut.restore();
        expect(await answer).toEqual(stream ? { status: 200, text: 'one two three four', done: true } : { status: 200, text: 'one two three four' });
      }
      const metrics = await (await fetch(`${gw.url}/metrics`)).text();
      expect(metrics).toMatch(/^magus_gateway_nats_reconnects_total 2$/m);
      expect(Number(/^magus_gateway_frames_recovered_total (\d+)$/m.exec(metrics)?.[1])).toBeGreaterThanOrEqual(2); // at least each answer's end
    } finally {
      await cut.close();
    }
  }, 90_000);

  it('a gateway cut off from NATS answers 503 with Retry-After at once, is degraded, then not ready after its grace; nothing it tried is served later', async () => {
    const cut = await cuttableGateway({ MAGUS_GATEWAY_NATS_GRACE_MS: '3000' });
    const { gw, post, turn } = cut;
    const served = bridges[0]!;
    const calls = engine.requests.length;
    const pulled = served.stats.pulled;
    try {
      // Taken before the cut: `cut()` resolves once the connection noticed, which a loaded machine
      // may tell this test well after the gateway's own check saw it (CI: 2.43 s from then to not ready).
      const cutAt = Date.now();
      await cut.cut();
      // Within its grace: still in its Service, degraded (a NATS restart reconnects every replica at once).
      const during = await fetch(`${gw.url}/readyz`);
      expect([during.status, ((await during.json()) as { status: string; checks: { nats: boolean } }).checks.nats]).toEqual([200, false]);
      // At once, not after the 5 s a stream acknowledgement may take: nothing can be queued now.
      const started = Date.now();
      const res = await post('while away', alice.token, false);
      expect(Date.now() - started).toBeLessThan(2_000);
      expect(res.status).toBe(503);
      expect(res.headers.get('retry-after')).toMatch(/^[1-9][0-9]*$/);
      expect(((await res.json()) as { error: { code: string } }).error.code).toBe('unavailable');
      // Cut off for the whole grace: this replica alone, so it leaves its Service.
      await eventually(async () => expect((await fetch(`${gw.url}/readyz`)).status).toBe(503), 10_000);
      // The grace counts from the check's last pass, sampled every 250 ms: that much before the cut
      // was noticed, more when the sampler runs late (a loaded CI run: 2.37 s from the cut to not
      // ready). Without the grace it would be at once.
      expect(Date.now() - cutAt).toBeGreaterThanOrEqual(3_000 - 1_000);
      await cut.restore();
      await eventually(async () => expect((await fetch(`${gw.url}/readyz`)).status).toBe(200), 10_000);
      expect(await turn('back again')).toEqual({ status: 200, text: 'back again' });
      // The request it gave up on never reached the stream (nats.js drops what it held when it dials again).
      expect(served.stats.pulled).toBe(pulled + 1);
      expect(
        engine.requests
          .slice(calls)
          .map((r) => JSON.stringify(r.body))
          .filter((b) => b.includes('while away')),
      ).toEqual([]);
    } finally {
      await cut.close();
    }
  }, 90_000);

  it('a client that leaves while its gateway is cut off: the cancel is held, sent once NATS is back, and the engine stops', async () => {
    const cut = await cuttableGateway();
    const { gw, post } = cut;
    const served = bridges[0]!;
    const cancelled = served.stats.cancelled;
    try {
      holdNext();
      const client = new AbortController();
      const asked = post('never mind', alice.token, false, client.signal).catch((err: unknown) => err);
      await reached;
      await cut.cut();
      client.abort();
      expect(await asked).toMatchObject({ name: 'AbortError' });
      await eventually(async () =>
        expect(await (await fetch(`${gw.url}/metrics`)).text()).toMatch(/^magus_gateway_requests_total\{route="\/v1\/chat\/completions",status="499"\} 1$/m),
      );
      expect(served.stats.cancelled).toBe(cancelled); // not sent: the gateway is cut off
      await cut.restore();
      await eventually(() => Promise.resolve(expect(served.stats.cancelled).toBe(cancelled + 1)));
      await eventually(() => Promise.resolve(expect(served.stats.inFlight).toBe(0)));
    } finally {
      release();
      await cut.close();
    }
  }, 90_000);

  it("without its store: streams, buckets and running bridges' consumers come back; a stopped bridge's does not", async () => {
    const gone = await bridge('i2');
    await gone.stop();
    const back = Promise.all([reconnected(worker), reconnected(gateway)]);
    await services.restartNats({ wipe: true });
    await back;
    const jsm = await gateway.jetstreamManager();
    await eventually(async () => {
      for (const s of [
        names.requestStream,
        names.responseStream,
        `KV_${names.sessionsBucket}`,
        `KV_${names.tokensBucket}`,
        `KV_${names.claimsBucket}`,
        `KV_${names.poolsBucket}`,
      ]) {
        await jsm.streams.info(s);
      }
    });
    await eventually(() => jsm.consumers.info(names.requestStream, consumerNameOf(POOL, 'i1')));
    // Within seconds: the bridge pulls through a new consume() (the old one would wait ~30 s for missed heartbeats).
    expect((await askInstance(gateway, names, POOL, 'i1', { messages: [{ role: 'user', content: 'from scratch' }] }, 10_000)).text).toBe('from scratch');
    expect(logs).toContain('i1: request consumer was missing: created again');

    const missing = await jsm.consumers.info(names.requestStream, consumerNameOf(POOL, 'i2')).then(
      () => undefined,
      (err: unknown) => jsErrorCode(err),
    );
    expect(missing).toBe(10014); // consumer not found
    expect(bridges[0]!.health()).toEqual(expect.objectContaining({ ok: true }));
  }, 90_000);

  it('a worker declares the data plane and the model registry again after it reconnects', async () => {
    const iso = isolation();
    const dir = mkdtempSync(join(tmpdir(), 'magus-restart-'));
    const workers = await startWorkers(workerConfig(iso, dir, { nats: { servers: services.endpoints.nats!.servers } }));
    try {
      const mine = dataPlaneNames(iso.natsPrefix);
      const jsm = await gateway.jetstreamManager();
      const back = reconnected(gateway);
      await services.restartNats({ wipe: true });
      await back;
      await eventually(async () => {
        for (const s of [mine.requestStream, mine.responseStream, `KV_${mine.sessionsBucket}`, `KV_${mine.modelsBucket}`]) await jsm.streams.info(s);
      });
    } finally {
      await workers.shutdown();
      rmSync(dir, { recursive: true, force: true });
    }
  }, 90_000);
});

/**
 * The data plane on a three-node NATS cluster (a private one: test/harness/nats-cluster.ts,
 * `sync_interval: always`), streams and buckets at replicas 3, under steady load: clients stream
 * requests through a real gateway to a bridge and a stub engine, each on its own connection to the
 * cluster (all three URLs, as `MAGUS_NATS_URL` gives them), while
 * (a) the leader of `MAGUS_REQUESTS` is SIGKILLed, and restarted after a while, then
 * (b) a follower is SIGKILLed and restarted.
 * Every request the gateway accepted (200) is answered completely, exactly once; the only other
 * outcome allowed is a 503 with `Retry-After` (the gateway could not get the request stored and
 * says so: nothing of it is served to anyone). The usage ledger holds one record per accepted
 * request and none for a refused one. The longest pause a client saw during each outage is
 * printed (README.md, "A NATS cluster").
 */
import { randomBytes } from 'node:crypto';
import { PassThrough } from 'node:stream';
import { connect, type JetStreamManager, type NatsConnection } from 'nats';
import { startBridge, type Bridge } from '../dataplane/bridge';
import {
  consumerNameOf,
  dataPlaneNames,
  declareOnReconnect,
  ensureDataPlane,
  ensureInstanceConsumer,
  responseSubjectOf,
  type DataPlaneNames,
} from '../dataplane';
import { decodeFrame } from '../dataplane/frames';
import { leaderGet } from '../dataplane/kv-leader';
import { openModelRegistry } from '../dataplane/registry';
import { UsageLedger } from '../dataplane/usage';
import { startGateway, type RunningGateway } from '../gateway/server';
import { makeToken, readyModel, TEST_SECRET } from './harness/gateway-app';
import type { ResponseFrame } from '../shared/serving';
import { startStubEngine, type StubEngine } from './fixtures/stub-engine';
import { gatewayConfigFor, pinConversation } from './harness/gateway';
import { startNatsCluster, type TestNatsCluster } from './harness/nats-cluster';
import { sleep, until } from './harness/wait';

const POOL = 'clustered';
const CLIENTS = 8;
/** Load before, during and after each outage. */
const OUTAGE_MS = 8_000;
const SETTLE_MS = 3_000;

/** One request as its client saw it. */
interface Outcome {
  client: number;
  /** The gateway's `x-request-id`. */
  id: string | null;
  content: string;
  startedAt: number;
  endedAt: number;
  status: number | 'network-error';
  retryAfter: string | null;
  text: string;
  /** `data: [DONE]` events: exactly one for a complete answer. */
  dones: number;
  /** `data:` events carrying an `error` object. */
  errors: string[];
  /** When each content-carrying event arrived. */
  eventTimes: number[];
}

describe('the data plane on a three-node NATS cluster', () => {
  let cluster: TestNatsCluster;
  const connections: NatsConnection[] = [];
  let worker: NatsConnection;
  let names: DataPlaneNames;
  let engine: StubEngine;
  let bridge: Bridge;
  let gw: RunningGateway;
  let gatewayNc: NatsConnection;
  const logs: string[] = [];
  const stamp = (line: string) => `${new Date().toISOString().slice(11, 23)} ${line}`;
  /** Every frame an observer saw on the response subjects, by request id (an observer may miss some while it reconnects). */
  const frames = new Map<string, ResponseFrame[]>();
  const alice = makeToken('alice');

  /** `first`: connect to the first server (then the others in order), not to a random one. */
  const connectTo = async (name: string, first = false) => {
    const nc = await connect({ servers: cluster.servers, name, maxReconnectAttempts: -1, reconnectTimeWait: 250, noAsyncTraces: true, noRandomize: first });
    connections.push(nc);
    return nc;
  };

  beforeAll(async () => {
    cluster = await startNatsCluster({ syncInterval: 'always' });
    worker = await connectTo('worker');
    const prefix = `C${randomBytes(3).toString('hex').toUpperCase()}`;
    // A small response stream: each of the three nodes reserves its max_bytes in memory.
    names = await declareOnReconnect(worker, () => ensureDataPlane(worker, { prefix, replicas: 3, responseMaxBytes: 64 * 2 ** 20 }), {
      what: 'data plane',
      log: (line) => logs.push(stamp(`worker: ${line}`)),
    });
    engine = await startStubEngine({ modelId: POOL, chunks: 6, chunkDelayMs: 30 });
    // The gateway and the bridge on n1, which (a) kills with the leaders on it: their connections
    // break together with the leaders they talk to (in production which server a process reaches
    // is random; this is the worst draw).
    const bridgeNc = await connectTo('bridge', true);
    await ensureInstanceConsumer(await worker.jetstreamManager(), names, { pool: POOL, instance: 'i1', slots: CLIENTS * 2 });
    bridge = await startBridge({
      nc: bridgeNc,
      names,
      pool: POOL,
      instance: 'i1',
      engineUrl: engine.url,
      slots: CLIENTS * 2,
      log: (line) => logs.push(stamp(`bridge: ${line}`)),
    });
    await (await openModelRegistry(worker, names.modelsBucket)).put(readyModel(POOL));
    gatewayNc = await connectTo('gateway', true);
    // Its warnings and errors, with the bridge's and the worker's lines, for the report.
    const gatewayLog = new PassThrough();
    gatewayLog.on('data', (chunk: Buffer) => {
      for (const line of chunk.toString('utf8').split('\n').filter(Boolean)) {
        const entry = JSON.parse(line) as { level?: number; time?: number; msg?: string; reason?: string; err?: { message?: string } };
        if ((entry.level ?? 0) >= 40)
          logs.push(
            `${new Date(entry.time ?? Date.now()).toISOString().slice(11, 23)} gateway: ${entry.msg ?? ''} ${entry.reason ?? ''} ${entry.err?.message ?? ''}`.trim(),
          );
      }
    });
    gw = await startGateway(
      gatewayConfigFor(names.prefix, {
        secret: TEST_SECRET,
        tokens: {},
        env: {
          MAGUS_NATS_URL: cluster.servers.join(','),
          MAGUS_GATEWAY_TOKENS: JSON.stringify({ alice: alice.entry }),
          MAGUS_GATEWAY_REQUEST_TIMEOUT_MS: '90000',
        },
      }),
      { nc: gatewayNc, coldStart: (req) => pinConversation(worker, names, req.conversationKey, POOL, 'i1'), logStream: gatewayLog },
    );
    const observer = await connectTo('observer');
    const all = observer.subscribe(responseSubjectOf(names, 'x').replace(/x$/, '>'));
    void (async () => {
      for await (const m of all) {
        const id = m.subject.slice(m.subject.lastIndexOf('.') + 1);
        const f = decodeFrame(m.data);
        if (f) frames.set(id, [...(frames.get(id) ?? []), f]);
      }
    })();
  }, 180_000);

  afterAll(async () => {
    await gw?.close();
    await bridge?.stop();
    await engine?.stop();
    for (const nc of connections) await nc.close().catch(() => undefined);
    await cluster?.stop();
  }, 60_000);

  /** One streamed turn of conversation `client`. */
  const ask = async (client: number, content: string): Promise<Outcome> => {
    const o: Outcome = {
      client,
      id: null,
      content,
      startedAt: Date.now(),
      endedAt: 0,
      status: 'network-error',
      retryAfter: null,
      text: '',
      dones: 0,
      errors: [],
      eventTimes: [],
    };
    try {
      const res = await fetch(`${gw.url}/v1/chat/completions`, {
        method: 'POST',
        headers: { authorization: `Bearer ${alice.token}`, 'content-type': 'application/json', 'x-session-id': `client-${client}` },
        body: JSON.stringify({ model: POOL, messages: [{ role: 'user', content }], stream: true }),
      });
      o.status = res.status;
      o.id = res.headers.get('x-request-id');
      o.retryAfter = res.headers.get('retry-after');
      if (res.status !== 200) {
        // The error's code, for answers refused before their stream started (e.g. 502 `frames_lost`).
        const body = await res.text();
        const code = (JSON.parse(body || '{}') as { error?: { code?: string } }).error?.code;
        if (code) o.errors.push(code);
        return o;
      }
      const decoder = new TextDecoder();
      let buffered = '';
      for await (const piece of res.body!) {
        buffered += decoder.decode(piece as Uint8Array, { stream: true });
        const events = buffered.split('\n\n');
        buffered = events.pop()!;
        const data = events.map((x) => x.split('\n').find((line) => line.startsWith('data: '))).filter((d): d is string => d !== undefined); // after each event's `id:` line
        for (const e of data.map((x) => x.slice(6))) {
          if (e === '[DONE]') {
            o.dones += 1;
            continue;
          }
          const parsed = JSON.parse(e) as { choices?: { delta?: { content?: string } }[]; error?: { code?: string; message?: string } };
          if (parsed.error) o.errors.push(parsed.error.code ?? parsed.error.message ?? 'error');
          const delta = parsed.choices?.[0]?.delta?.content;
          if (delta) {
            o.text += delta;
            o.eventTimes.push(Date.now());
          }
        }
      }
    } catch (err) {
      o.errors.push(`${(err as Error).name}: ${(err as Error).message}`);
    } finally {
      o.endedAt = Date.now();
    }
    return o;
  };

  /** Clients asking in a loop until `stop()`; each request's content is unique. */
  const load = () => {
    const outcomes: Outcome[] = [];
    /** Start times of the requests under way. */
    const underWay = new Set<{ at: number }>();
    let running = true;
    const loops = Array.from({ length: CLIENTS }, async (_, client) => {
      for (let n = 0; running; n++) {
        const asking = { at: Date.now() };
        underWay.add(asking);
        const o = await ask(client, `c${client} r${n} alpha beta gamma delta epsilon`);
        underWay.delete(asking);
        outcomes.push(o);
        if (o.status !== 200) await sleep(Number(o.retryAfter ?? 1) * 100); // a tenth of Retry-After: keep the pressure on
      }
    });
    return {
      outcomes,
      /** Until every request asked before now has ended (none is still held up by what came before). */
      async caughtUp() {
        const now = Date.now();
        await until('the requests under way to end', () => [...underWay].every((r) => r.at > now), 90_000);
      },
      async stop() {
        running = false;
        await Promise.all(loops);
      },
    };
  };

  /**
   * The longest a client went without progress between `from` and `to`: per client, the largest
   * gap between successive pieces of answers it was given (a refused request is no progress: a
   * client refused for 5 s saw a 5 s pause, however many times it asked meanwhile).
   */
  const longestPause = (outcomes: Outcome[], from: number, to: number): number => {
    let longest = 0;
    for (let client = 0; client < CLIENTS; client++) {
      const times = outcomes
        .filter((o) => o.client === client && o.status === 200)
        .flatMap((o) => [...o.eventTimes, o.endedAt])
        .sort((a, b) => a - b);
      const inWindow = [from, ...times.filter((t) => t > from && t < to), to];
      for (let i = 1; i < inWindow.length; i++) longest = Math.max(longest, inWindow[i]! - inWindow[i - 1]!);
    }
    return longest;
  };

  const streamState = async (jsm: JetStreamManager, stream: string) => {
    const info = await jsm.streams.info(stream);
    return {
      leader: info.cluster?.leader,
      replicas: (info.cluster?.replicas ?? []).map((r) => ({ name: r.name, current: r.current, offline: r.offline ?? false })),
      config: info.config.num_replicas,
    };
  };

  /**
   * Makes `node` the leader of the request stream and of the instance's consumer (a step-down
   * that prefers it; nats-server ≥ 2.11), so killing it takes both at once.
   */
  const leadOn = async (node: string) => {
    const consumer = consumerNameOf(POOL, 'i1');
    const stepDown = async (subject: string) => {
      const reply = JSON.parse(
        new TextDecoder().decode((await worker.request(subject, JSON.stringify({ placement: { preferred: node } }), { timeout: 10_000 })).data),
      ) as { error?: { description?: string } };
      if (reply.error) throw new Error(`${subject}: ${reply.error.description}`);
    };
    const jsm = await worker.jetstreamManager();
    if ((await streamState(jsm, names.requestStream)).leader !== node) await stepDown(`$JS.API.STREAM.LEADER.STEPDOWN.${names.requestStream}`);
    await until(
      `${node} to lead ${names.requestStream}`,
      async () => (await streamState(jsm, names.requestStream).catch(() => undefined))?.leader === node,
      30_000,
    );
    if ((await jsm.consumers.info(names.requestStream, consumer)).cluster?.leader !== node)
      await stepDown(`$JS.API.CONSUMER.LEADER.STEPDOWN.${names.requestStream}.${consumer}`);
    await until(
      `${node} to lead the consumer`,
      async () => (await jsm.consumers.info(names.requestStream, consumer).catch(() => undefined))?.cluster?.leader === node,
      30_000,
    );
  };

  /** Until every replica of every data-plane stream is back and current. */
  const allCurrent = async (jsm: JetStreamManager) => {
    const streams = [
      names.requestStream,
      names.responseStream,
      ...[names.sessionsBucket, names.tokensBucket, names.claimsBucket, names.poolsBucket, names.modelsBucket].map((b) => `KV_${b}`),
    ];
    await until(
      'every replica current',
      async () => {
        try {
          for (const s of streams) {
            const st = await streamState(jsm, s);
            if (!st.leader || st.replicas.length !== 2 || st.replicas.some((r) => !r.current || r.offline)) return false;
          }
          return true;
        } catch {
          return false;
        }
      },
      60_000,
    );
  };

  it('declares every stream and bucket, and the instance consumer, at replicas 3', async () => {
    const jsm = await worker.jetstreamManager();
    const streams = [
      names.requestStream,
      names.responseStream,
      ...[names.sessionsBucket, names.tokensBucket, names.claimsBucket, names.poolsBucket, names.modelsBucket].map((b) => `KV_${b}`),
    ];
    const replicas = await Promise.all(
      streams.map(async (s) => [s, (await jsm.streams.info(s)).config.num_replicas, (await jsm.streams.info(s)).cluster?.replicas?.length] as const),
    );
    expect(replicas).toEqual(streams.map((s) => [s, 3, 2]));
    const consumer = await jsm.consumers.info(names.requestStream, consumerNameOf(POOL, 'i1'));
    expect(consumer.cluster?.replicas?.length).toBe(2); // inherited from the stream: a leader and two followers

    // A bucket someone created with one replica first (a gateway opens the ones it reads) is brought to three.
    const other = dataPlaneNames(`${names.prefix}X`);
    await worker.jetstream().views.kv(other.tokensBucket);
    expect((await jsm.streams.info(`KV_${other.tokensBucket}`)).config.num_replicas).toBe(1);
    await ensureDataPlane(worker, { prefix: other.prefix, replicas: 3, responseMaxBytes: 16 * 2 ** 20 });
    expect((await jsm.streams.info(`KV_${other.tokensBucket}`)).config.num_replicas).toBe(3);
    for (const s of [
      other.requestStream,
      other.responseStream,
      ...[other.sessionsBucket, other.tokensBucket, other.claimsBucket, other.poolsBucket, other.modelsBucket].map((b) => `KV_${b}`),
    ]) {
      await jsm.streams.delete(s);
    }
  }, 60_000);

  it("reads after a compare-and-swap, from any node, see it: the entry-lease protocol's reads go to the stream's leader", async () => {
    const key = `cas-${randomBytes(4).toString('hex')}`;
    const writer = await worker.jetstream().views.kv(names.sessionsBucket);
    let revision = await writer.create(key, new TextEncoder().encode('0'));
    let stale = 0;
    for (const [n, server] of cluster.servers.entries()) {
      const nc = await connect({ servers: [server], name: `reader-${n}`, noAsyncTraces: true });
      connections.push(nc);
      const jsm = await nc.jetstreamManager();
      const direct = await nc.jetstream().views.kv(names.sessionsBucket);
      for (let k = 1; k <= 100; k++) {
        revision = await writer.update(key, new TextEncoder().encode(String(k)), revision);
        // What a gateway reads after losing a compare-and-swap, and a session at its expiry: the last write, always.
        const read = await leaderGet(jsm, names.sessionsBucket, key);
        expect([read?.revision, read?.operation, read?.string()]).toEqual([revision, 'PUT', String(k)]);
        // Any replica's answer (DIRECT.GET) may be a write behind, or (a replica that has not yet
        // seen the create) nothing: counted, for the report.
        if ((await direct.get(key))?.revision !== revision) stale++;
      }
    }
    await writer.delete(key);
    expect((await leaderGet(await worker.jetstreamManager(), names.sessionsBucket, key))?.operation).toBe('DEL');
    expect(await leaderGet(await worker.jetstreamManager(), names.sessionsBucket, `never-${key}`)).toBeNull();
    process.stderr.write(`nats-cluster: 300 reads from the leader after a compare-and-swap, all current; ${stale} of 300 direct gets were a write behind\n`);
  }, 60_000);

  it('the leader of MAGUS_REQUESTS, then a follower, SIGKILLed under load: every accepted request answered once and whole', async () => {
    const jsm = await worker.jetstreamManager();
    const running = load();
    const report: string[] = [];
    const faults: { what: string; node: string; from: number; to: number }[] = [];
    try {
      await sleep(SETTLE_MS);
      const baseline = longestPause(running.outcomes, Date.now() - SETTLE_MS + 500, Date.now());

      // (a) The request stream's leader, which also leads the consumer the bridge pulls from and
      // holds the gateway's and the bridge's connections.
      const leader = 'n1';
      await leadOn(leader);
      await sleep(1_000);
      const roles = {
        meta: await cluster.metaLeader(),
        responses: (await streamState(jsm, names.responseStream)).leader,
        consumer: (await jsm.consumers.info(names.requestStream, consumerNameOf(POOL, 'i1'))).cluster?.leader,
      };
      report.push(
        `before (a): ${names.requestStream} leader ${leader}; meta leader ${roles.meta}, ${names.responseStream} leader ${roles.responses}, consumer leader ${roles.consumer}; connections (worker, bridge, gateway, observer): ${connections.map((c) => c.info?.server_name ?? '?').join(' ')}`,
      );
      let from = Date.now();
      logs.push(stamp(`killing ${leader}`));
      await cluster.kill(leader);
      await until(
        'a new leader of the request stream',
        async () => {
          const st = await streamState(jsm, names.requestStream).catch(() => undefined);
          return st?.leader !== undefined && st.leader !== leader;
        },
        60_000,
      );
      report.push(`(a) new ${names.requestStream} leader after ${Date.now() - from} ms: ${(await streamState(jsm, names.requestStream)).leader}`);
      await sleep(OUTAGE_MS);
      await cluster.restart(leader);
      await allCurrent(jsm);
      report.push(`(a) ${leader} back and every replica current ${Date.now() - from} ms after the kill`);
      await running.caughtUp();
      await sleep(SETTLE_MS);
      faults.push({ what: '(a) leader', node: leader, from, to: Date.now() });

      // (b) A follower of the request stream: the one the gateway is connected to now, if it is one.
      const now = await streamState(jsm, names.requestStream);
      const meta = await cluster.metaLeader();
      const followers = now.replicas.map((r) => r.name);
      const follower = followers.find((n) => n === gatewayNc.info?.server_name) ?? followers.find((n) => n !== meta) ?? followers[0]!;
      report.push(
        `before (b): ${names.requestStream} leader ${now.leader}, meta leader ${meta}; connections (worker, bridge, gateway, observer): ${connections.map((c) => c.info?.server_name ?? '?').join(' ')}; killing follower ${follower}`,
      );
      from = Date.now();
      logs.push(stamp(`killing ${follower}`));
      await cluster.kill(follower);
      await sleep(OUTAGE_MS);
      await cluster.restart(follower);
      await allCurrent(jsm);
      report.push(`(b) ${follower} back and every replica current ${Date.now() - from} ms after the kill`);
      await sleep(SETTLE_MS);
      faults.push({ what: '(b) follower', node: follower, from, to: Date.now() });

      await running.stop();
      const outcomes = running.outcomes;
      const accepted = outcomes.filter((o) => o.status === 200);
      const refused = outcomes.filter((o) => o.status === 503);
      const others = outcomes.filter((o) => o.status !== 200 && o.status !== 503);
      for (const f of faults) {
        const inFault = outcomes.filter((o) => o.startedAt >= f.from && o.startedAt < f.to);
        const slowest = Math.max(...outcomes.filter((o) => o.status === 200 && o.endedAt >= f.from && o.startedAt < f.to).map((o) => o.endedAt - o.startedAt));
        const refusedAt = inFault.filter((o) => o.status === 503).map((o) => o.startedAt - f.from);
        const refusals =
          refusedAt.length > 0
            ? `${refusedAt.length} refused with 503 from ${Math.min(...refusedAt)} to ${Math.max(...refusedAt)} ms after the kill`
            : 'none refused';
        const slow = outcomes.filter((o) => o.status === 200 && o.endedAt >= f.from && o.startedAt < f.to && o.endedAt - o.startedAt > 2_000);
        for (const o of slow.slice(0, 10)) {
          report.push(
            `  slow: ${o.content}: asked ${o.startedAt - f.from} ms after the kill, pieces at ${o.eventTimes.map((t) => t - f.from).join(', ')}, ended ${o.endedAt - f.from}`,
          );
        }
        report.push(
          `${f.what} ${f.node}: longest client pause ${longestPause(outcomes, f.from, f.to)} ms (before the outages ${baseline} ms), slowest accepted request ${slowest} ms, ` +
            `${inFault.filter((o) => o.status === 200).length} accepted, ${refusals}`,
        );
      }
      const engineCalls = new Map<string, number>();
      for (const r of engine.requests) {
        const content = (r.body as { messages: { content: string }[] }).messages.at(-1)!.content;
        engineCalls.set(content, (engineCalls.get(content) ?? 0) + 1);
      }
      report.push(
        `${outcomes.length} requests: ${accepted.length} accepted, ${refused.length} refused (503), ${others.length} other; ` +
          `engine called more than once for ${[...engineCalls.values()].filter((n) => n > 1).length}; bridge ${JSON.stringify(bridge.stats)}`,
      );
      process.stdout.write(`nats cluster outages:\n  ${report.join('\n  ')}\n  logs:\n    ${logs.slice(-60).join('\n    ')}\n`);

      expect(accepted.length).toBeGreaterThan(100);
      // Accepted: the whole answer, once. (Before frames were published with the stream's
      // acknowledgement, 0.1–0.4 % of the answers streaming through the killed node ended with
      // `frames_lost`: README.md, "A NATS cluster".)
      const wrong = accepted.filter((o) => o.text !== o.content || o.dones !== 1 || o.errors.length > 0);
      expect(wrong.map((o) => ({ content: o.content, text: o.text, dones: o.dones, errors: o.errors }))).toEqual([]);
      // Refused: a 503 that says when to retry; nothing else (no 502 `frames_lost` either).
      expect(others.map((o) => ({ content: o.content, status: o.status, errors: o.errors }))).toEqual([]);
      expect(refused.filter((o) => !/^[1-9][0-9]*$/.test(o.retryAfter ?? ''))).toEqual([]);
      // On the wire: one generation per request. A chunk seq never carries two different
      // frames; a terminal seq may (dataplane/README.md, rule 2: an attempt superseded
      // without noticing — here the first delivery, whose delivery the new consumer leader did not
      // know of and handed out again — publishes its terminal frame before its CAS fails; the
      // gateway relays the first to arrive, and the client's answer above is whole and single).
      const conflicts = [...frames.entries()].flatMap(([id, fs]) => {
        const bySeq = new Map<number, Set<string>>();
        for (const f of fs) bySeq.set(f.seq, (bySeq.get(f.seq) ?? new Set()).add(JSON.stringify(f)));
        return [...bySeq.entries()].filter(([, v]) => v.size > 1).map(([seq, v]) => ({ id, seq, frames: [...v] }));
      });
      const terminalOnly = conflicts.filter((c) => c.frames.every((f) => (JSON.parse(f) as ResponseFrame).type !== 'chunk'));
      if (conflicts.length > 0)
        process.stdout.write(
          `frames differing at one seq: ${conflicts.length} (${terminalOnly.length} terminal); e.g. ${JSON.stringify(conflicts[0]).slice(0, 1500)}\n`,
        );
      expect(conflicts.filter((c) => !terminalOnly.includes(c))).toEqual([]);
      // Every frame was stored before its request was resolved, so a request whose ack died with the
      // leader, delivered again after `ack_wait`, replays its stored terminal frame and is not
      // generated again (before, it was: the same chunks at the same seqs with another `created`,
      // which the check above now refuses). (The engine may still be called twice for a request
      // whose delivery a new consumer leader handed out again while the first was running: the
      // take-over resumes after the stored frames — one answer on the wire.)
      expect(bridge.stats.framesUnstored).toBe(0);
      // The usage ledger through both outages: exactly one record per accepted request, completed;
      // a refused one (a 503) none, or the gateway's own record of giving up (failed, no tokens) —
      // never one with tokens, though its publish may have been stored and served (its cancel lost
      // while the bridge reconnected, or heard after the first tokens): the gateway's record, written
      // when it answered 503, comes first, or — when the bridge's came first (both waited for the
      // ledger's new leader; seen in CI, `completed` once, `cancelled` with 2 tokens once) — the
      // gateway's correction stands in its place (dataplane/usage.ts, recordRefusal).
      const ledger = await UsageLedger.open(worker.jetstream(), names);
      const byId = async () => new Map((await ledger.read()).map((r) => [r.id, r]));
      let records = await byId();
      const settled = () =>
        accepted.every((o) => records.has(o.id!)) &&
        refused.every((o) => {
          const r = records.get(o.id!);
          return r === undefined || (r.outcome === 'failed' && r.tokens.total === 0);
        });
      for (let i = 0; !settled() && i < 100; i++) {
        await sleep(100);
        records = await byId();
      }
      const refusedRecords = refused.map((o) => records.get(o.id!)).filter((r) => r !== undefined);
      process.stdout.write(
        `ledger: ${records.size} records for ${accepted.length} accepted requests (bridge recorded ${bridge.stats.usageRecorded}); ` +
          `of ${refused.length} refused, ${refusedRecords.length} recorded, ${refusedRecords.filter((r) => r.outcome === 'failed' && r.tokens.total === 0).length} of them failed with no tokens ` +
          `(${refusedRecords.filter((r) => r.corrects).length} correcting a bridge's record)\n`,
      );
      expect(accepted.filter((o) => records.get(o.id!)?.outcome !== 'completed' || !records.get(o.id!)?.reported)).toEqual([]);
      expect(refusedRecords.filter((r) => r.outcome !== 'failed' || r.tokens.total !== 0)).toEqual([]);
      expect(records.size).toBe(accepted.length + refusedRecords.length);
      expect(bridge.stats.usageUnrecorded).toBe(0);
    } finally {
      await running.stop();
    }
  }, 240_000);
});

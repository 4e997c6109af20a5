/**
 * `npm run bench:gateway`: what the gateway adds to a request. One run, side by side, against a
 * stub engine that answers at once:
 *   (a) direct: client → stub engine over HTTP;
 *   (b) gateway: client → gateway → NATS JetStream → bridge → stub engine, and back, on a warm
 *       session (seeded by one cold turn each; the gateway may not take the cold path while
 *       measuring — asserted).
 * Beside them, the design's floor at concurrency 1: the same NATS path through a bare node:http
 * server and a minimal bridge (measureFloor), i.e. what is left once magus's features are gone.
 * Then per-key limits (gateway-limits.ts): the gateway path with the bench's key against a second
 * key whose limits never refuse, in alternating blocks. Then the first turn of a new conversation
 * on a warm pool: gateway → the pool's published instance (its session workflow started after the
 * answer) → NATS → bridge → a real llama.cpp engine.
 *
 * Processes: this one runs the gateway (the one measured) and orchestrates; the load comes from
 * a child (bench/gateway-client.ts); the bridge, the stub engine and the Temporal workers (with
 * the local runtime's engine) run in another (bench/gateway-serving.ts); nats-server, Temporal
 * and MinIO are the real servers of workers/dev/services/. The two paths run in alternating
 * blocks so that drift in machine load hits both alike. A traced block (not part of the figures
 * above it) then breaks the gateway path down by hop from timestamps taken in every process.
 *
 * The first turns are measured by gateway-first-turn.ts, the figures printed by gateway-report.ts.
 *
 * Environment: BENCH_SCALE (default 1) multiplies every sample count.
 *
 * `--real`: a real model's tokens/s and time to first token through magus against its engine
 * instead (bench/gateway-real.ts).
 */
import type { ChildProcess } from 'node:child_process';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Connection } from '@temporalio/client';
import { connect, nuid, type KV, type NatsConnection } from 'nats';
import { ensureDataPlane, type DataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import { loadGatewayConfig } from '../gateway/config';
import { tokenDigest } from '../gateway/plugins/auth';
import { exchange, sharedResponseRouter, streamPublisher, type PublishRequest } from '../gateway/serving/exchange';
import type { ColdStart, FirstTurns } from '../gateway/serving/sessions';
import { startGateway } from '../gateway/server';
import type { temporalSessions } from '../gateway/temporal';
import type { ReadyModel } from '../shared/model';
import type { ChatInference, PoolEntry, SessionEntry } from '../shared/serving';
import { startServices } from '../workers/dev/services';
import { benchGatewayReal } from './gateway-real';
import { ask, child, load } from './common';
import { startCpuProfile } from './cpu-profile';
import type { LoadResult, LoadSpec } from './gateway-client';
import { measureFirstTurn } from './gateway-first-turn';
import { BENCH_LIMITS, measureLimits } from './gateway-limits';
import { LogTally, report } from './gateway-report';
import type { ServingCommand, ServingReply } from './gateway-serving';

const SCALE = Number(process.env.BENCH_SCALE ?? '1');
const n = (count: number) => Math.max(1, Math.round(count * SCALE));
const PREFIX = 'BENCH';
const STUB = 'stub';
const CHUNKS = 64;
/** Requests per path at concurrency 8 before anything is measured (see the warm-up below). */
const WARM_UP = 20_000;
/** 128 characters: the stub splits its echo into {@link CHUNKS} pieces of 2. */
const PROMPT = 'The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump!!'.padEnd(128, '.');
const TOKEN_ID = 'bench';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(24).toString('hex')}`;
/** A second key, with limits that never refuse (gateway-limits.ts); a configured token's key is `config/<id>`. */
const LIMITED_ID = 'bench-limited';
const LIMITED_TOKEN = `mgs_${LIMITED_ID}_${randomBytes(24).toString('hex')}`;
const SECRET = randomBytes(32).toString('hex');

const now = (): number => performance.timeOrigin + performance.now();

/** CPU ms (user + system) of a process, from /proc. */
function cpuMsOf(pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  const f = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return ((Number(f[11]) + Number(f[12])) * 1000) / 100;
}

const serve = <R extends ServingReply>(proc: ChildProcess, cmd: ServingCommand) => ask<R>(proc, cmd);

async function main(): Promise<void> {
  const load0 = loadavg();
  const dir = mkdtempSync(join(tmpdir(), 'magus-bench-gateway-'));
  const services = await startServices({ services: ['nats', 'temporal', 's3'] });
  const e = services.endpoints;
  const natsPid = services.pids.find((pid) => readFileSync(`/proc/${pid}/cmdline`, 'utf8').includes('nats-server'));
  const serving = child('gateway-serving.ts');
  const client = child('gateway-client.ts');
  let nc: NatsConnection | undefined;
  let gwNc: NatsConnection | undefined;
  let temporalConnection: Connection | undefined;
  try {
    nc = await connect({ servers: e.nats!.servers, name: 'bench' });
    const names = await ensureDataPlane(nc, { prefix: PREFIX });
    const registry = await openModelRegistry(nc, names.modelsBucket);
    const stubModel: ReadyModel = {
      namespace: 'default',
      name: STUB,
      source: { repo: 'bench/stub', revision: 'main', sha: '0'.repeat(40) },
      artifacts: [],
      memory: [],
      readyAt: new Date().toISOString(),
    };
    await registry.put(stubModel);
    const stub = await serve<Extract<ServingReply, { re: 'stub' }>>(serving, {
      type: 'stub',
      nats: e.nats!.servers,
      prefix: PREFIX,
      pool: STUB,
      instance: 'i1',
      slots: 16,
      chunks: CHUNKS,
    });
    // The stub's pool view, as a pool at its maximum publishes it (the pool workflow rewrites it every minute): first turns
    // of the stub are placed on it by the gateway itself (the entry-lease protocol), no Temporal involved.
    const poolsKv: KV = await nc.jetstream().views.kv(names.poolsBucket);
    const publishStubView = () =>
      poolsKv.put(
        `default.${STUB}`,
        new TextEncoder().encode(
          JSON.stringify({
            instances: [{ instance: 'i1', subject: stub.subject, leases: 0 }],
            leasesPerInstance: 1000,
            updatedAt: Date.now(),
            growable: false,
          } satisfies PoolEntry),
        ),
      );
    await publishStubView();
    const stubViewTimer = setInterval(() => void publishStubView().catch(() => undefined), 60_000);
    stubViewTimer.unref();

    // --- The gateway: the stub's first turns placed from its view; `tiny`'s from its pool's, which demand starts.
    let coldStartsWhileWarm = 0;
    let temporalPath: ReturnType<typeof temporalSessions> | undefined;
    const adoptMs: number[] = [];
    const adoptFailures: unknown[] = [];
    // First turns of `tiny` from its pool's published instances: the session workflow starts after the answer.
    const firstTurns: Pick<FirstTurns, 'ttlMs' | 'adopt' | 'demand'> = {
      ttlMs: 600_000,
      // No room for `tiny` yet: its pool is told (signal-with-start starts it), as a gateway does.
      demand: (model, waiting) => (temporalPath?.firstTurns.demand ? temporalPath.firstTurns.demand(model, waiting) : Promise.resolve()),
      adopt: async (req, entry) => {
        if (req.model.name === STUB) return; // no session workflow for the stub's conversations
        const t0 = performance.now();
        try {
          await temporalPath!.firstTurns.adopt(req, entry);
          adoptMs.push(performance.now() - t0);
        } catch (err) {
          adoptFailures.push(err);
          throw err;
        }
      },
    };
    // Never taken with first turns: the gateway places every conversation from its pool's view.
    const coldStart: ColdStart = (req) => {
      coldStartsWhileWarm++;
      return Promise.reject(new Error(`a cold start of ${req.model.name}: its first turns are placed from its pool view`));
    };

    // Tracing hooks (off while measuring): publish → ack, HTTP in → out, and (below) the first response frame.
    let tracing = false;
    const pubTrace = new Map<string, [number, number]>();
    const frameTrace = new Map<string, number>();
    const httpTrace = new Map<string, [number, number]>();
    gwNc = await connect({ servers: e.nats!.servers, name: 'bench-gateway', noAsyncTraces: true });
    const jsPublish = streamPublisher(gwNc).publish;
    const publish: PublishRequest = async (subject, req, session) => {
      if (!tracing) return jsPublish(subject, req, session);
      const t0 = now();
      await jsPublish(subject, req, session);
      pubTrace.set(req.id, [t0, now()]);
    };
    const resPrefix = `${names.subjectScope}.magus.res.`;
    const logs = new LogTally(TOKEN.slice(`mgs_${TOKEN_ID}_`.length), LIMITED_TOKEN.slice(`mgs_${LIMITED_ID}_`.length));
    const config = loadGatewayConfig({
      MAGUS_GATEWAY_HOST: '127.0.0.1',
      MAGUS_GATEWAY_PORT: '0',
      MAGUS_NATS_URL: e.nats!.servers,
      MAGUS_NATS_PREFIX: PREFIX, // the data plane's names, as ensureDataPlane declared them
      MAGUS_GATEWAY_SECRET: SECRET,
      MAGUS_GATEWAY_TOKENS: JSON.stringify({
        [TOKEN_ID]: { digest: tokenDigest(TOKEN), name: 'bench' },
        [LIMITED_ID]: { digest: tokenDigest(LIMITED_TOKEN), name: 'bench-limited', limits: BENCH_LIMITS },
      }),
      MAGUS_GATEWAY_COLD_START_TIMEOUT_MS: '180000',
      MAGUS_LOG_LEVEL: 'info', // the default: one access-log line per request, as in production
    });
    const gateway = await startGateway(config, { nc: gwNc, coldStart, firstTurns, publish, logStream: logs });
    // Keyed by the client's `x-bench-seq` (the sample's index): fastify's headers are not readable here.
    gateway.app.server.prependListener('request', (req, res) => {
      if (!tracing) return;
      const t0 = now();
      res.once('finish', () => httpTrace.set(String(req.headers['x-bench-seq']), [t0, now()]));
    });

    const direct = { url: `${stub.url}/v1/chat/completions`, token: TOKEN, model: STUB };
    const viaGateway = { url: `${gateway.url}/v1/chat/completions`, token: TOKEN, model: STUB };
    const c1Session = ['bench-c1'];
    const c8Sessions = Array.from({ length: 8 }, (_, i) => `bench-c8-${i}`);
    const viaGatewayLimited = { ...viaGateway, token: LIMITED_TOKEN };
    const limitedC1 = ['bench-limited-c1'];
    const limitedC8 = Array.from({ length: 8 }, (_, i) => `bench-limited-c8-${i}`);
    const spec = (target: typeof direct, over: Partial<LoadSpec>): LoadSpec => ({
      ...target,
      concurrency: 1,
      requests: 1,
      sessionIds: c1Session,
      stream: false,
      prompt: PROMPT,
      expectText: PROMPT,
      ...over,
    });

    // --- Seed the warm sessions (one first turn each, placed from the stub's view), each key's own.
    for (const sid of [...c1Session, ...c8Sessions]) await load(client, spec(viaGateway, { sessionIds: [sid] }));
    for (const sid of [...limitedC1, ...limitedC8]) await load(client, spec(viaGatewayLimited, { sessionIds: [sid] }));
    const seeded = gateway.sessionCache!.stats();
    if (seeded.firstTurns !== 2 * (1 + c8Sessions.length) || seeded.coldStarts !== 0)
      throw new Error(`seeding took ${seeded.firstTurns} first turns and ${seeded.coldStarts} cold starts`);
    const coldStartsSeeded = seeded.firstTurns;

    /** Runs both paths in alternating blocks; returns each path's block results. */
    const sideBySide = async (blocks: number, over: Partial<LoadSpec>, cpu?: { direct: number[]; gateway: number[] }) => {
      const out = { direct: [] as LoadResult[], gateway: [] as LoadResult[] };
      for (let b = 0; b < blocks; b++) {
        for (const [name, target] of [
          ['direct', direct],
          ['gateway', viaGateway],
        ] as const) {
          const pids = [process.pid, serving.pid!, natsPid ?? process.pid];
          const before = pids.map(cpuMsOf);
          out[name].push(await load(client, spec(target, over)));
          cpu?.[name].push(...pids.map((pid, i) => cpuMsOf(pid) - before[i]!));
        }
      }
      return out;
    };

    // --- Warm-up, not measured: connections, JetStream consumers, and the JIT. A gateway serves
    // millions of requests; V8 optimises the many small functions of a request's path only after
    // thousands of calls, and with a few hundred the gateway and bridge processes still spent
    // ~1 ms of CPU per request instead of ~0.6 (measured). So: steady state first.
    await sideBySide(1, { requests: n(WARM_UP), concurrency: 8, sessionIds: c8Sessions });
    await sideBySide(2, { requests: n(300) });
    await sideBySide(1, { requests: n(200), stream: true });

    const cpu1 = { direct: [] as number[], gateway: [] as number[] };
    const c1 = await sideBySide(8, { requests: n(250) }, cpu1);
    const floor = await measureFloor({ serving, client, gwNc, names, stubUrl: stub.url, warmUp: n(WARM_UP / 4), blocks: 4, requests: n(250) });
    const cpu8 = { direct: [] as number[], gateway: [] as number[] };
    const c8 = await sideBySide(4, { requests: n(1000), concurrency: 8, sessionIds: c8Sessions }, cpu8);
    const st = await sideBySide(5, { requests: n(100), stream: true });
    const limits = await measureLimits({
      client,
      spec,
      off: { ...viaGateway, c1Sessions: c1Session, c8Sessions },
      on: { ...viaGatewayLimited, c1Sessions: limitedC1, c8Sessions: limitedC8 },
      scope: `config/${LIMITED_ID}`,
      kv: await nc.jetstream().views.kv(names.limitsBucket, { bindOnly: true }),
      scaled: n,
      pids: [process.pid, serving.pid!, natsPid ?? process.pid],
      cpuMsOf,
      gatewayNc: gwNc,
      server: gateway.app.server,
      bucket: names.limitsBucket,
      // magus_gateway_limit_refusals_total, every code, from /metrics.
      refusals: async () =>
        [...(await gateway.app.inject({ method: 'GET', url: '/metrics' })).body.matchAll(/^magus_gateway_limit_refusals_total(?:\{[^}]*\})? (\d+)$/gm)].reduce(
          (sum, m) => sum + Number(m[1]),
          0,
        ),
    });

    // --- A traced block (gateway path, c=1): where the added time goes.
    // A second subscription on the gateway's connection sees each frame as the gateway's router
    // does (same socket, same parse); it exists only now, as it doubles the frames delivered.
    const tap = gwNc.subscribe(`${resPrefix}>`, {
      callback: (_err, m) => {
        const id = m.subject.slice(m.subject.lastIndexOf('.') + 1); // magus.res.<replica>.<id>
        if (!frameTrace.has(id)) frameTrace.set(id, now());
      },
    });
    await gwNc.flush();
    tracing = true;
    await serve(serving, { type: 'trace', on: true });
    const traced = await load(client, spec(viaGateway, { requests: n(500) }));
    const servingTrace = (await serve<Extract<ServingReply, { re: 'trace' }>>(serving, { type: 'trace', on: false })).events;
    tracing = false;
    tap.unsubscribe();

    // --- A profiled block (gateway path, c=8): where the CPU goes in the gateway and the bridge.
    await serve(serving, { type: 'profile', on: true });
    const stopGatewayProfile = await startCpuProfile('gateway');
    await load(client, spec(viaGateway, { requests: n(2000), concurrency: 8, sessionIds: c8Sessions }));
    const gatewayProfile = await stopGatewayProfile();
    const bridgeProfile = (await serve<Extract<ServingReply, { re: 'profile' }>>(serving, { type: 'profile', on: false })).summary!;

    const warmStats = gateway.sessionCache!.stats();
    const bridgeStats = (await serve<Extract<ServingReply, { re: 'stats' }>>(serving, { type: 'stats' })).bridge;
    if (coldStartsWhileWarm !== 0 || warmStats.coldStarts !== 0 || warmStats.firstTurns !== coldStartsSeeded)
      throw new Error(
        `the gateway placed or started ${warmStats.firstTurns - coldStartsSeeded + warmStats.coldStarts} conversations while measuring warm turns`,
      );

    // --- First turn of a new conversation on a warm pool (Temporal).
    const firstTurn = await measureFirstTurn({
      prefix: PREFIX,
      auth: { token: TOKEN, tokenId: TOKEN_ID, secret: SECRET },
      scaled: n,
      dir,
      e,
      serving,
      client,
      registry,
      names,
      setTemporalPath: (p) => (temporalPath = p),
      viaGateway,
      adoptMs,
      adoptFailures,
      stats: () => gateway.sessionCache!.stats(),
      onConnection: (c) => (temporalConnection = c),
    });

    const load1 = loadavg();
    report({
      c1,
      cpu1,
      floor,
      c8,
      cpu8,
      st,
      limits,
      traced,
      servingTrace,
      gatewayProfile,
      bridgeProfile,
      pubTrace,
      frameTrace,
      httpTrace,
      warmStats,
      coldStartsSeeded,
      bridgeStats,
      firstTurn,
      load0,
      load1,
      logs,
      profiledRequests: n(2000),
      chunks: CHUNKS,
    });
    await gateway.close();
    await serve(serving, { type: 'stop' }).catch(() => undefined);
  } finally {
    client.kill();
    serving.kill();
    await gwNc?.drain().catch(() => undefined);
    await nc?.drain().catch(() => undefined);
    await temporalConnection?.close().catch(() => undefined);
    await services.stop();
    rmSync(dir, { recursive: true, force: true });
  }
}

/**
 * The same NATS path with nothing of magus around it: a bare `node:http` server in this process
 * (no fastify, auth, conversation key, session cache, logging or metrics) that publishes each
 * request to a second instance of the stub and answers with its frame, and a minimal bridge
 * (pull, engine call, publish, ack: no exactly-once, cancel, retry or limits). Alternating
 * blocks with the direct path, after a warm-up of its own. What magus adds on top of this floor
 * is the cost of its features; what this floor adds over direct is the cost of the design here.
 */
async function measureFloor(o: {
  serving: ChildProcess;
  client: ChildProcess;
  gwNc: NatsConnection;
  names: DataPlaneNames;
  stubUrl: string;
  warmUp: number;
  blocks: number;
  requests: number;
}) {
  const pool = 'floor';
  const { subject } = await serve<Extract<ServingReply, { re: 'floor' }>>(o.serving, { type: 'floor', prefix: PREFIX, pool, instance: 'i1', slots: 16 });
  const entry: SessionEntry = { subject, pool, instance: 'i1', expiresAt: Date.now() + 3_600_000 };
  const router = await sharedResponseRouter(o.gwNc, { subjectScope: o.names.subjectScope });
  const publisher = streamPublisher(o.gwNc);
  const signal = new AbortController().signal;
  const server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      const body = JSON.parse(Buffer.concat(chunks).toString('utf8')) as ChatInference['body'];
      const id = nuid.next();
      const request: ChatInference = {
        id,
        replyTo: router.replySubject(id),
        deadline: Date.now() + 60_000,
        body: { model: body.model, messages: body.messages, stream: false },
      };
      exchange(entry, request, { router, publish: publisher.publish, requestTimeoutMs: 60_000, gapTimeoutMs: 5_000, retryAfterSec: 1, signal }).then(
        (done) => {
          const text = JSON.stringify(done);
          res.writeHead(200, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) });
          res.end(text);
        },
        () => res.writeHead(502).end(),
      );
    });
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/v1/chat/completions`;
  const spec = (target: string, requests: number, concurrency = 1): LoadSpec => ({
    url: target,
    token: TOKEN,
    model: STUB,
    concurrency,
    requests,
    sessionIds: Array.from({ length: concurrency }, (_, i) => `floor-${i}`),
    stream: false,
    prompt: PROMPT,
    expectText: PROMPT,
  });
  try {
    await load(o.client, spec(url, o.warmUp, 8));
    const out = { direct: [] as LoadResult[], gateway: [] as LoadResult[] };
    for (let b = 0; b < o.blocks; b++) {
      out.direct.push(await load(o.client, spec(`${o.stubUrl}/v1/chat/completions`, o.requests)));
      out.gateway.push(await load(o.client, spec(url, o.requests)));
    }
    return out;
  } finally {
    server.close();
    await publisher.close();
    await router.close();
  }
}

(process.argv.includes('--real') ? benchGatewayReal() : main()).then(
  () => process.exit(0),
  (err) => {
    console.error(err);
    process.exit(1);
  },
);

/**
 * `npm run bench:gateway`: what the gateway adds to a request. One run, side by side, against a
 * stub engine that answers at once:
 *   (a) direct: client → stub engine over HTTP;
 *   (b) gateway: client → gateway → NATS JetStream → bridge → stub engine, and back, on a warm
 *       session (seeded by one cold turn each; the gateway may not take the cold path while
 *       measuring — asserted).
 * Beside them, the design's floor at concurrency 1: the same NATS path through a bare node:http
 * server and a minimal bridge (measureFloor), i.e. what is left once magus's features are gone.
 * Then the first turn of a new conversation on a warm pool: gateway → the pool's published instance
 * (its session workflow started after the answer) → NATS → bridge → a real llama.cpp engine.
 *
 * Processes: this one runs the gateway (the one measured) and orchestrates; the load comes from
 * a child (bench/gateway-client.ts); the bridge, the stub engine and the Temporal workers (with
 * the local runtime's engine) run in another (bench/gateway-serving.ts); nats-server, Temporal
 * and MinIO are the real servers of workers/dev/services.ts. The two paths run in alternating
 * blocks so that drift in machine load hits both alike. A traced block (not part of the figures
 * above it) then breaks the gateway path down by hop from timestamps taken in every process.
 *
 * Environment: BENCH_SCALE (default 1) multiplies every sample count.
 *
 * `--real`: a real model's tokens/s and time to first token through magus against its engine
 * instead (bench/gateway-real.ts).
 */
import { CreateBucketCommand, S3Client } from '@aws-sdk/client-s3';
import { Client, Connection } from '@temporalio/client';
import { temporal } from '@temporalio/proto';
import type { ChildProcess } from 'node:child_process';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { Writable } from 'node:stream';
import { connect, nuid, type KV, type NatsConnection } from 'nats';
import { ensureDataPlane, type DataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import { loadGatewayConfig } from '../gateway/config';
import { tokenDigest } from '../gateway/plugins/auth';
import { conversationKey } from '../gateway/serving/conversation';
import { exchange, sharedResponseRouter, streamPublisher, type PublishRequest } from '../gateway/serving/exchange';
import type { ColdStart, FirstTurns, SessionStats } from '../gateway/serving/sessions';
import { startGateway } from '../gateway/server';
import { temporalSessions } from '../gateway/temporal';
import type { ReadyModel } from '../shared/model';
import type { ChatInference, PoolEntry, SessionEntry } from '../shared/serving';
import { publishTinyGguf } from '../test/fixtures/tiny-gguf';
import { seedFor } from '../dataplane/bridge';
import { startServices } from '../workers/dev/services';
import { poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import { sessionWorkflowId } from '../workflows/session/definitions';
import { benchGatewayReal } from './gateway-real';
import { ask, child, firstChunkMs, fmt, latencies, load, p50, p99, signed } from './common';
import { startCpuProfile, type CpuSummary } from './cpu-profile';
import type { LoadResult, LoadSpec } from './gateway-client';
import type { ServingCommand, ServingReply, TraceEvent } from './gateway-serving';

const SCALE = Number(process.env.BENCH_SCALE ?? '1');
const n = (count: number) => Math.max(1, Math.round(count * SCALE));
const PREFIX = 'BENCH';
const STUB = 'stub';
const TINY = 'tiny';
const CHUNKS = 64;
/** Bursts of new conversations measured against the same requests on warm sessions (target ≤ 1.5×). */
const BURSTS = [50, 200];
const BURST_TARGET = 1.5;
/** Requests per path at concurrency 8 before anything is measured (see the warm-up below). */
const WARM_UP = 20_000;
/** 128 characters: the stub splits its echo into {@link CHUNKS} pieces of 2. */
const PROMPT = 'The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump!!'.padEnd(128, '.');
const TOKEN_ID = 'bench';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(24).toString('hex')}`;
const SECRET = randomBytes(32).toString('hex');
const EventType = temporal.api.enums.v1.EventType;

const now = (): number => performance.timeOrigin + performance.now();

// ---------------------------------------------------------------------------------------------
// Statistics

const ttfc = firstChunkMs;
const gaps = (r: LoadResult[]) => r.flatMap((x) => x.samples.flatMap((s) => s.chunks!.slice(1).map((t, i) => t - s.chunks![i]!)));
const rate = (r: LoadResult[]) => r.reduce((a, x) => a + x.samples.length, 0) / (r.reduce((a, x) => a + x.wallMs, 0) / 1000);

/** CPU ms (user + system) of a process, from /proc. */
function cpuMsOf(pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  const f = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return ((Number(f[11]) + Number(f[12])) * 1000) / 100;
}

// ---------------------------------------------------------------------------------------------
// Child processes

const serve = <R extends ServingReply>(proc: ChildProcess, cmd: ServingCommand) => ask<R>(proc, cmd);

/** Counts log lines; keeps those at warn level or above, and any that contain `secret`. */
class LogTally extends Writable {
  lines = 0;
  readonly notable: string[] = [];
  constructor(private readonly secret: string) {
    super();
  }
  override _write(chunk: Buffer, _enc: BufferEncoding, cb: () => void): void {
    for (const line of chunk.toString('utf8').split('\n').filter(Boolean)) {
      this.lines++;
      // pino levels: 40 warn, 50 error, 60 fatal (a regex, not JSON.parse: this runs in the measured process).
      if (line.includes(this.secret) || /"level":[456]0[,}]/.test(line)) this.notable.push(line.slice(0, 400));
    }
    cb();
  }
}

// ---------------------------------------------------------------------------------------------

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
    const stubModel: ReadyModel = { namespace: 'default', name: STUB, source: { repo: 'bench/stub', revision: 'main', sha: '0'.repeat(40) }, artifacts: [], memory: [], readyAt: new Date().toISOString() };
    await registry.put(stubModel);
    const stub = await serve<Extract<ServingReply, { re: 'stub' }>>(serving, { type: 'stub', nats: e.nats!.servers, prefix: PREFIX, pool: STUB, instance: 'i1', slots: 16, chunks: CHUNKS });
    // The stub's pool view, as a pool at its maximum publishes it (the pool workflow rewrites it every minute): first turns
    // of the stub are placed on it by the gateway itself (the entry-lease protocol), no Temporal involved.
    const poolsKv: KV = await nc.jetstream().views.kv(names.poolsBucket);
    const publishStubView = () =>
      poolsKv.put(`default.${STUB}`, new TextEncoder().encode(JSON.stringify({ instances: [{ instance: 'i1', subject: stub.subject, leases: 0 }], leasesPerInstance: 1000, updatedAt: Date.now(), growable: false } satisfies PoolEntry)));
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
    const logs = new LogTally(TOKEN.slice(`mgs_${TOKEN_ID}_`.length));
    const config = loadGatewayConfig({
      MAGUS_GATEWAY_HOST: '127.0.0.1',
      MAGUS_GATEWAY_PORT: '0',
      MAGUS_NATS_URL: e.nats!.servers,
      MAGUS_NATS_PREFIX: PREFIX, // the data plane's names, as ensureDataPlane declared them
      MAGUS_GATEWAY_SECRET: SECRET,
      MAGUS_GATEWAY_TOKENS: JSON.stringify({ [TOKEN_ID]: { digest: tokenDigest(TOKEN), name: 'bench' } }),
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
    const spec = (target: typeof direct, over: Partial<LoadSpec>): LoadSpec => ({ ...target, concurrency: 1, requests: 1, sessionIds: c1Session, stream: false, prompt: PROMPT, expectText: PROMPT, ...over });

    // --- Seed the warm sessions (one first turn each, placed from the stub's view).
    for (const sid of [...c1Session, ...c8Sessions]) await load(client, spec(viaGateway, { sessionIds: [sid] }));
    const seeded = gateway.sessionCache!.stats();
    if (seeded.firstTurns !== 1 + c8Sessions.length || seeded.coldStarts !== 0) throw new Error(`seeding took ${seeded.firstTurns} first turns and ${seeded.coldStarts} cold starts`);
    const coldStartsSeeded = seeded.firstTurns;

    /** Runs both paths in alternating blocks; returns each path's block results. */
    const sideBySide = async (blocks: number, over: Partial<LoadSpec>, cpu?: { direct: number[]; gateway: number[] }) => {
      const out = { direct: [] as LoadResult[], gateway: [] as LoadResult[] };
      for (let b = 0; b < blocks; b++) {
        for (const [name, target] of [['direct', direct], ['gateway', viaGateway]] as const) {
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
    if (coldStartsWhileWarm !== 0 || warmStats.coldStarts !== 0 || warmStats.firstTurns !== coldStartsSeeded) throw new Error(`the gateway placed or started ${warmStats.firstTurns - coldStartsSeeded + warmStats.coldStarts} conversations while measuring warm turns`);

    // --- First turn of a new conversation on a warm pool (Temporal).
    const firstTurn = await measureFirstTurn({ dir, e, serving, client, registry, names, setTemporalPath: (p) => (temporalPath = p), viaGateway, adoptMs, adoptFailures, stats: () => gateway.sessionCache!.stats(), onConnection: (c) => (temporalConnection = c) });

    const load1 = loadavg();
    report({ c1, cpu1, floor, c8, cpu8, st, traced, servingTrace, gatewayProfile, bridgeProfile, pubTrace, frameTrace, httpTrace, warmStats, coldStartsSeeded, bridgeStats, firstTurn, load0, load1, logs });
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

// ---------------------------------------------------------------------------------------------
// First turn on a warm pool

interface FirstTurnResult {
  first: LoadResult;
  warm: LoadResult;
  /** The gateway's background `adopt` (start the session workflow) per first turn. */
  adoptMs: number[];
  signalWithStartMs: number[];
  /** Median ms from a session workflow's start to the first event of each type, in history order. */
  sessionTimeline: [string, number][];
  n: number;
  bursts: BurstResult[];
  /** The pool's current run: its events and workflow tasks completed. */
  poolTasks: { tasks: number; events: number };
}

/** N new conversations at once, then the same N conversations' next turn at once (warm sessions). */
interface BurstResult {
  n: number;
  first: LoadResult;
  warm: LoadResult;
  /** First turns served from the pool's published instances / sent through Temporal. */
  fromPool: number;
  cold: number;
}

async function measureFirstTurn(ctx: {
  dir: string;
  e: Awaited<ReturnType<typeof startServices>>['endpoints'];
  serving: ChildProcess;
  client: ChildProcess;
  registry: Awaited<ReturnType<typeof openModelRegistry>>;
  names: Awaited<ReturnType<typeof ensureDataPlane>>;
  setTemporalPath: (p: ReturnType<typeof temporalSessions>) => void;
  viaGateway: { url: string; token: string; model: string };
  adoptMs: number[];
  adoptFailures: unknown[];
  stats: () => SessionStats;
  onConnection: (c: Connection) => void;
}): Promise<FirstTurnResult> {
  const { dir, e } = ctx;
  // The tiny synthetic Llama as GGUF, in S3 and the registry (as test/serving.int.test.ts does).
  const bucket = 'bench-gateway';
  const s3 = new S3Client({ endpoint: e.s3!.endpoint, region: e.s3!.region, forcePathStyle: true, credentials: { accessKeyId: e.s3!.accessKeyId, secretAccessKey: e.s3!.secretAccessKey } });
  await s3.send(new CreateBucketCommand({ Bucket: bucket }));
  await publishTinyGguf({ dir, s3, bucket, registry: ctx.registry, name: TINY });
  s3.destroy();
  // The gateway's catalog re-reads the registry on a miss at most once a second: wait until it has the model.
  const models = ctx.viaGateway.url.replace(/chat\/completions$/, 'models');
  while (!(await (await fetch(models, { headers: { authorization: `Bearer ${TOKEN}` } })).text()).includes(`"${TINY}"`)) await new Promise((r) => setTimeout(r, 200));

  const taskQueue = 'bench-gateway-control';
  await serve(ctx.serving, {
    type: 'workers',
    env: { AWS_ACCESS_KEY_ID: e.s3!.accessKeyId, AWS_SECRET_ACCESS_KEY: e.s3!.secretAccessKey },
    cfg: {
      temporal: { address: e.temporal!.address, namespace: 'default' },
      taskQueue,
      nats: { servers: e.nats!.servers },
      s3: { endpoint: e.s3!.endpoint, region: e.s3!.region, bucket, forcePathStyle: true },
      natsPrefix: PREFIX,
      modelCacheDir: join(dir, 'models'),
      convertThreads: 1,
      transferPartSize: undefined,
      s3TraceFile: undefined,
    },
  });
  const connection = await Connection.connect({ address: e.temporal!.address });
  ctx.onConnection(connection);
  const client = new Client({ connection, namespace: 'default' });
  // The gateway's signal-with-start calls (demand, which starts the pool), timed.
  const signalWithStartMs: number[] = [];
  const wf = client.workflow;
  const timed = <F extends (...args: never[]) => Promise<unknown>>(f: F, into: number[]): F =>
    (async (...args: Parameters<F>) => {
      const t0 = performance.now();
      try {
        return await f(...args);
      } finally {
        into.push(performance.now() - t0);
      }
    }) as F;
  wf.signalWithStart = timed(wf.signalWithStart.bind(wf), signalWithStartMs);
  // `magus dev`'s pool: one instance (it cannot grow) that prefers 8 leases; beyond them first
  // turns share it, as the pool itself would grant, without waiting on Temporal.
  ctx.setTemporalPath(temporalSessions({ client, taskQueue, pool: { minInstances: 1, maxInstances: 1, leasesPerInstance: 8, idleTimeoutMs: 3_600_000 }, sessionTtlMs: 600_000 }));

  const run = randomBytes(3).toString('hex');
  const turn = (over: Partial<LoadSpec>): LoadSpec => ({ ...ctx.viaGateway, model: TINY, concurrency: 1, requests: 1, stream: false, prompt: 'hello there', maxTokens: 2, ...over });
  // Warm the pool (the engine starts here) and Temporal's caches, with conversations not measured.
  await load(ctx.client, turn({ sessionPrefix: `warm-${run}` }));
  await load(ctx.client, turn({ sessionPrefix: `warm2-${run}`, requests: n(20) }));
  const measured = n(100);
  ctx.adoptMs.length = 0;
  const stats0 = ctx.stats();
  signalWithStartMs.length = 0;
  const first = await load(ctx.client, turn({ sessionPrefix: `new-${run}`, requests: measured }));
  const stats1 = ctx.stats();
  const swsMs = [...signalWithStartMs];
  // The same conversations' next turn: warm, for reference (the same request, the same engine).
  const warm = await load(ctx.client, turn({ sessionPrefix: `new-${run}`, requests: measured }));
  // Every measured first turn came from the pool's published instance, none waited on Temporal.
  if (stats1.firstTurns - stats0.firstTurns !== measured || stats1.coldStarts !== stats0.coldStarts) {
    throw new Error(`first turns: ${stats1.firstTurns - stats0.firstTurns} from the pool, ${stats1.coldStarts - stats0.coldStarts} cold, of ${measured}`);
  }
  if (ctx.adoptFailures.length > 0) throw new Error(`a session workflow could not be started: ${String(ctx.adoptFailures[0])}`);
  const pool = await client.workflow.getHandle(poolWorkflowId('default', TINY)).query(poolStatusQuery);
  if (pool.instances.length !== 1) throw new Error(`the pool started more instances: ${JSON.stringify(pool.instances)}`);

  // Server-side timeline of some of the measured sessions, from their histories.
  const byType = new Map<string, number[]>();
  const order: string[] = [];
  for (let i = 0; i < Math.min(measured, 30); i++) {
    const key = conversationKey(SECRET, { scope: TOKEN_ID, model: `default/${TINY}`, messages: [], sessionId: `new-${run}-${i}` });
    // The workflow starts after the answer: wait until it has run its first task (it then sleeps until the entry's expiry).
    const granted = (evs: typeof events) => evs.some((ev) => ev.eventType === EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED);
    let events = (await client.workflow.getHandle(sessionWorkflowId('default', TINY, key)).fetchHistory().catch(() => undefined))?.events ?? [];
    for (let tries = 0; !granted(events) && tries < 300; tries++) {
      await new Promise((r) => setTimeout(r, 100));
      events = (await client.workflow.getHandle(sessionWorkflowId('default', TINY, key)).fetchHistory().catch(() => undefined))?.events ?? [];
    }
    if (!granted(events)) throw new Error(`session ${i}: its workflow never ran its first task`);
    const ms = (t?: { seconds?: unknown; nanos?: number | null } | null) => Number(t?.seconds ?? 0) * 1000 + (t?.nanos ?? 0) / 1e6;
    const t0 = ms(events[0]?.eventTime);
    const seen = new Set<string>();
    for (const ev of events) {
      let name = EventType[ev.eventType ?? 0]?.replace(/^EVENT_TYPE_/, '').toLowerCase() ?? String(ev.eventType);
      if (ev.eventType === EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED) name += ` (${ev.workflowExecutionSignaledEventAttributes?.signalName ?? ''})`;
      // Repeated types (workflow tasks) are numbered, so the timeline keeps each.
      let label = name;
      for (let k = 2; seen.has(label); k++) label = `${name} #${k}`;
      seen.add(label);
      if (!byType.has(label)) {
        byType.set(label, []);
        order.push(label);
      }
      byType.get(label)!.push(ms(ev.eventTime) - t0);
      if (ev.eventType === EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED) break;
    }
  }
  if (!order.includes('workflow_task_completed')) throw new Error('no session ran its first task');

  // Bursts of new conversations, all at once, then the same conversations again (warm): the
  // first turns must not queue behind one another on Temporal. Fixed sizes (not scaled).
  const bursts: BurstResult[] = [];
  for (const size of BURSTS) {
    const s0 = ctx.stats();
    const burstFirst = await load(ctx.client, turn({ sessionPrefix: `burst${size}-${run}`, requests: size, concurrency: size }));
    const s1 = ctx.stats();
    const burstWarm = await load(ctx.client, turn({ sessionPrefix: `burst${size}-${run}`, requests: size, concurrency: size }));
    bursts.push({ n: size, first: burstFirst, warm: burstWarm, fromPool: s1.firstTurns - s0.firstTurns, cold: s1.coldStarts - s0.coldStarts });
  }
  // The pool's run while it served them: its events and workflow tasks.
  await new Promise((r) => setTimeout(r, 3000));
  const poolEvents = (await client.workflow.getHandle(poolWorkflowId('default', TINY)).fetchHistory()).events ?? [];
  // The entry-lease protocol: the pool takes no event per conversation.
  const poolTasks = { tasks: 0, events: poolEvents.length };
  for (const ev of poolEvents) if (ev.eventType === EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED) poolTasks.tasks++;
  return { first, warm, adoptMs: [...ctx.adoptMs], signalWithStartMs: swsMs, sessionTimeline: order.map((l) => [l, p50(byType.get(l)!)]), n: measured, bursts, poolTasks };
}

// ---------------------------------------------------------------------------------------------
// Report

/**
 * The same NATS path with nothing of magus around it: a bare `node:http` server in this process
 * (no fastify, auth, conversation key, session cache, logging or metrics) that publishes each
 * request to a second instance of the stub and answers with its frame, and a minimal bridge
 * (pull, engine call, publish, ack: no exactly-once, cancel, retry or limits). Alternating
 * blocks with the direct path, after a warm-up of its own. What magus adds on top of this floor
 * is the cost of its features; what this floor adds over direct is the cost of the design here.
 */
async function measureFloor(o: { serving: ChildProcess; client: ChildProcess; gwNc: NatsConnection; names: DataPlaneNames; stubUrl: string; warmUp: number; blocks: number; requests: number }) {
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
      const request: ChatInference = { id, replyTo: router.replySubject(id), deadline: Date.now() + 60_000, body: { model: body.model, messages: body.messages, stream: false } };
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
  const spec = (target: string, requests: number, concurrency = 1): LoadSpec => ({ url: target, token: TOKEN, model: STUB, concurrency, requests, sessionIds: Array.from({ length: concurrency }, (_, i) => `floor-${i}`), stream: false, prompt: PROMPT, expectText: PROMPT });
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

function report(r: {
  c1: { direct: LoadResult[]; gateway: LoadResult[] };
  cpu1: { direct: number[]; gateway: number[] };
  floor: { direct: LoadResult[]; gateway: LoadResult[] };
  c8: { direct: LoadResult[]; gateway: LoadResult[] };
  cpu8: { direct: number[]; gateway: number[] };
  st: { direct: LoadResult[]; gateway: LoadResult[] };
  traced: LoadResult;
  servingTrace: TraceEvent[];
  gatewayProfile: CpuSummary;
  bridgeProfile: CpuSummary;
  pubTrace: Map<string, [number, number]>;
  frameTrace: Map<string, number>;
  httpTrace: Map<string, [number, number]>;
  warmStats: { warmHits: number; coldStarts: number; firstTurns: number };
  coldStartsSeeded: number;
  bridgeStats: unknown;
  firstTurn: FirstTurnResult;
  load0: number[];
  load1: number[];
  logs: LogTally;
}): void {
  const count = (x: LoadResult[]) => x.reduce((a, b) => a + b.samples.length, 0);
  const row = (label: string, d: number, g: number, target?: number) =>
    `  ${label.padEnd(34)}${fmt(d).padStart(9)}${fmt(g).padStart(10)}${signed(g - d).padStart(10)}${target === undefined ? '' : `   ≤ ${target} ms: ${g - d <= target ? 'met' : 'MISSED'}`}`;
  const out: string[] = [];
  out.push(`magus gateway benchmark — ${cpus().length} CPUs (${cpus()[0]?.model ?? '?'}), load average ${r.load0.map((x) => x.toFixed(2)).join(' ')} at start, ${r.load1.map((x) => x.toFixed(2)).join(' ')} at end`);
  out.push('processes: load generator | gateway (measured) | bridge + stub engine (+ Temporal workers, llama.cpp engine) | nats-server, Temporal, MinIO');
  out.push('');
  out.push(`  ${'latency in ms'.padEnd(34)}${'direct'.padStart(9)}${'gateway'.padStart(10)}${'added'.padStart(10)}`);
  const l1d = latencies(r.c1.direct);
  const l1g = latencies(r.c1.gateway);
  out.push(`non-stream, concurrency 1 (${count(r.c1.direct)} + ${count(r.c1.gateway)} requests)`);
  out.push(row('p50', p50(l1d), p50(l1g), 1));
  out.push(row('p99', p99(l1d), p99(l1g), 5));
  const cpuPer = (xs: number[], k: number, reqs: number) => xs.filter((_, i) => i % 3 === k).reduce((a, b) => a + b, 0) / reqs;
  const cpuRows = (cpu: { direct: number[]; gateway: number[] }, rd: number, rg: number) =>
    (['CPU ms/request: gateway process', '  bridge + stub process', '  nats-server'] as const).map(
      (label, k) => `  ${label.padEnd(34)}${fmt(cpuPer(cpu.direct, k, rd), 3).padStart(9)}${fmt(cpuPer(cpu.gateway, k, rg), 3).padStart(10)}`,
    );
  out.push(...cpuRows(r.cpu1, count(r.c1.direct), count(r.c1.gateway)));
  const lfd = latencies(r.floor.direct);
  const lfg = latencies(r.floor.gateway);
  out.push(`the design's floor, concurrency 1 (${count(r.floor.direct)} + ${count(r.floor.gateway)}): a bare node:http server that only publishes and waits, a minimal bridge`);
  out.push(row('  p50', p50(lfd), p50(lfg)));
  out.push(row('  p99', p99(lfd), p99(lfg)));
  const l8d = latencies(r.c8.direct);
  const l8g = latencies(r.c8.gateway);
  out.push(`non-stream, concurrency 8 (${count(r.c8.direct)} + ${count(r.c8.gateway)} requests)`);
  out.push(row('p50', p50(l8d), p50(l8g)));
  out.push(row('p99', p99(l8d), p99(l8g)));
  out.push(`  ${'requests/s'.padEnd(34)}${fmt(rate(r.c8.direct), 0).padStart(9)}${fmt(rate(r.c8.gateway), 0).padStart(10)}`);
  out.push(...cpuRows(r.cpu8, count(r.c8.direct), count(r.c8.gateway)));
  out.push(`stream, ${CHUNKS} chunks, concurrency 1 (${count(r.st.direct)} + ${count(r.st.gateway)} requests)`);
  out.push(row('time to first chunk p50', p50(ttfc(r.st.direct)), p50(ttfc(r.st.gateway))));
  out.push(row('time to first chunk p99', p99(ttfc(r.st.direct)), p99(ttfc(r.st.gateway))));
  out.push(row('inter-chunk gap p50', p50(gaps(r.st.direct)), p50(gaps(r.st.gateway))));
  out.push(row('inter-chunk gap p99', p99(gaps(r.st.direct)), p99(gaps(r.st.gateway))));
  out.push(row('whole stream p50', p50(latencies(r.st.direct)), p50(latencies(r.st.gateway))));

  const f = r.firstTurn;
  const firstMs = latencies([f.first]);
  const warmMs = latencies([f.warm]);
  out.push(`first turn of a new conversation, warm pool (${f.n} conversations, tiny llama.cpp model, max_tokens 2)`);
  out.push(`  ${'first turn p50 / p99'.padEnd(34)}${`${fmt(p50(firstMs))} / ${fmt(p99(firstMs))}`.padStart(19)}   ≤ 30 ms p50: ${p50(firstMs) <= 30 ? 'met' : 'MISSED'}`);
  out.push(`  ${'same conversation, next turn p50'.padEnd(34)}${fmt(p50(warmMs)).padStart(19)}   (warm path, same engine)`);
  out.push(`  ${'session workflow start (after the answer) p50'.padEnd(34)}${fmt(p50(f.adoptMs)).padStart(19)}   p99 ${fmt(p99(f.adoptMs))}   (no turn waited on the cold path)`);
  for (const b of f.bursts) {
    const ratio = b.first.wallMs / b.warm.wallMs;
    out.push(`burst of ${b.n} new conversations at once (one instance, 8 leases preferred; ${b.fromPool} first turns from the pool, ${b.cold} through Temporal)`);
    out.push(`  ${'all answered in (new / warm)'.padEnd(34)}${`${fmt(b.first.wallMs, 0)} / ${fmt(b.warm.wallMs, 0)} ms`.padStart(19)}   ${ratio.toFixed(2)}×, ≤ ${BURST_TARGET}×: ${ratio <= BURST_TARGET ? 'met' : 'MISSED'}`);
    out.push(`  ${'per request p50 (new / warm)'.padEnd(34)}${`${fmt(p50(latencies([b.first])))} / ${fmt(p50(latencies([b.warm])))}`.padStart(19)}`);
  }
  out.push(`  the pool's current run: ${f.poolTasks.events} events, ${f.poolTasks.tasks} workflow tasks, for the ${f.n + BURSTS.reduce((a, b) => a + b, 0)}+ new conversations above (warm-up included)`);

  // Hop breakdown of the traced block.
  out.push('');
  out.push(`where the gateway path's time goes (traced block, ${r.traced.samples.length} requests at concurrency 1; p50 per hop, ms):`);
  const byId = new Map<string, { claims: TraceEvent[]; frame?: number; fetch?: TraceEvent }>();
  const seedToId = new Map<string, string>();
  for (const s of r.traced.samples) {
    byId.set(s.requestId!, { claims: [] });
    seedToId.set(String(seedFor(s.requestId!)), s.requestId!);
  }
  const rtt = { read: [] as number[], write: [] as number[] };
  for (const ev of r.servingTrace) {
    const [kind, key, t0, t1] = ev;
    if (kind === 'fetch') {
      const id = seedToId.get(key);
      if (id) byId.get(id)!.fetch = ev;
      continue;
    }
    const id = (kind === 'publish' ? /\.res\.([A-Za-z0-9]+)$/ : /_claims\.([A-Za-z0-9]+)/).exec(key)?.[1];
    const rec = id === undefined ? undefined : byId.get(id);
    if (!rec) continue;
    if (kind === 'publish') rec.frame ??= t0;
    else {
      rec.claims.push(ev);
      (key.startsWith('$KV.') ? rtt.write : rtt.read).push(t1 - t0);
    }
  }
  const hops: [string, number[]][] = [
    ['client → gateway (HTTP request in)', []],
    ['gateway: auth, key, session → publish', []],
    ['NATS: publish → delivered to the bridge', []],
    ['engine call (bridge → stub → bridge)', []],
    ['bridge: engine answer → frame published', []],
    ['NATS: frame → gateway', []],
    ['gateway: frame → response written', []],
    ['gateway → client (HTTP response)', []],
  ];
  const totals: number[] = [];
  for (const [i, s] of r.traced.samples.entries()) {
    const id = s.requestId!;
    const rec = byId.get(id)!;
    const http = r.httpTrace.get(String(i));
    const pub = r.pubTrace.get(id);
    const frameIn = r.frameTrace.get(id);
    if (!http || !pub || frameIn === undefined || !rec.fetch || rec.frame === undefined) continue;
    // Delivered ≈ the engine call's start (a first delivery touches no claim before it).
    const points = [s.start, http[0], pub[0], rec.fetch[2], rec.fetch[3], rec.frame, frameIn, http[1], s.end];
    points.slice(1).forEach((t, i) => hops[i]![1].push(t - points[i]!));
    totals.push(s.end - s.start);
  }
  for (const [label, v] of hops) out.push(`  ${label.padEnd(46)}${fmt(p50(v)).padStart(7)}`);
  out.push(`  ${'sum of hop p50s / total p50'.padEnd(46)}${fmt(hops.reduce((a, [, v]) => a + p50(v), 0)).padStart(7)} / ${fmt(p50(totals))}  (${totals.length} requests joined)`);
  const pubAck = r.traced.samples.map((s) => r.pubTrace.get(s.requestId!)).filter((x) => x !== undefined).map(([a, b]) => b - a);
  const kv = (v: number[]) => (v.length ? `${fmt(p50(v))} (${v.length})` : 'none');
  out.push(`  round trips seen: JetStream publish → ack ${fmt(p50(pubAck))}; claims KV (a first delivery that answers writes none): writes ${kv(rtt.write)}, reads ${kv(rtt.read)} (p50)`);
  out.push(`  direct baseline in the same run (c=1 p50): ${fmt(p50(l1d))}`);

  out.push('');
  out.push(`CPU profile of a gateway-path block at concurrency 8 (self time; ms of CPU per request):`);
  for (const [label, p] of [['gateway process', r.gatewayProfile], ['bridge + stub engine process', r.bridgeProfile]] as const) {
    const per = (ms: number) => fmt(ms / n(2000), 3);
    out.push(`  ${label}: ${per(p.totalMs)} ms/request`);
    out.push(`    by place:    ${p.places.slice(0, 6).map(([k, v]) => `${k} ${per(v)}`).join(', ')}`);
    out.push(`    by function: ${p.functions.slice(0, 8).map(([k, v]) => `${k} ${per(v)}`).join(', ')}`);
  }

  out.push('');
  out.push('session workflow timeline of a first turn (p50 ms since the workflow started, after the answer; it adopts the conversation’s entry, then sleeps):');
  for (const [label, v] of f.sessionTimeline) out.push(`  ${label.padEnd(56)}${fmt(v, 1).padStart(7)}`);

  out.push('');
  out.push(`checks: warm measurement placed no conversation (session cache: ${r.warmStats.warmHits} warm hits, ${r.warmStats.firstTurns} first turns = the ${r.coldStartsSeeded} seeding turns, ${r.warmStats.coldStarts} cold starts); bridge ${JSON.stringify(r.bridgeStats)}`);
  out.push(`gateway log: ${r.logs.lines} lines at level info, ${r.logs.notable.length} at warn or above or containing the token${r.logs.notable.length ? `:\n    ${r.logs.notable.slice(0, 5).join('\n    ')}` : ''}`);
  process.stdout.write(`${out.join('\n')}\n`);
}

(process.argv.includes('--real') ? benchGatewayReal() : main()).then(
  () => process.exit(0),
  (err) => {
    console.error(err);
    process.exit(1);
  },
);

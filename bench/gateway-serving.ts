/**
 * The serving side of `npm run bench:gateway`, forked by bench/gateway.ts: what runs next to an
 * engine, in a process of its own so that neither it nor the load shares the gateway's event
 * loop. On request (IPC) it starts
 * - a stub engine that answers at once and a real bridge consuming its instance's requests,
 * - a minimal bridge on a second instance of the same stub (the design's floor), and
 * - the Temporal workers (workflows + local runtime: a real llama.cpp engine and its bridge), or
 * - for the real-model mode (bench/gateway-real.ts), a real model's engine and a real bridge, or
 * - a real bridge alone, for an engine the parent started (bench/dllama.ts: a distributed-llama
 *   root or a llama.cpp engine), stopped again by `unbridge`.
 *
 * While tracing is on it records, with epoch-ms timestamps, what the bridge does on this NATS
 * connection (`request`: claim reads and writes; `publish`: response frames) and its engine calls
 * (`fetch`), so the parent can break a request's time down by hop; and it CPU-profiles itself on request.
 */
import { Runtime, DefaultLogger } from '@temporalio/worker';
import { connect, type NatsConnection } from 'nats';
import { consumerNameOf, ensureDataPlane, ensureInstanceConsumer, requestSubjectOf } from '../dataplane';
import type { EngineKind } from '../shared/engines';
import type { InferenceRequest } from '../shared/serving';
import { startBridge, type Bridge, type BridgeStats } from '../dataplane/bridge';
import { startLlamaCppEngine, type LlamaCppEngine } from '../activities/runtime/llama-cpp';
import { createEngineClient, sseEventBatches, type EngineClient, type EngineResponse } from '../dataplane/bridge/engine-client';
import type { MagusConfig } from '../workers/config';
import { startWorkers, type RunningWorkers } from '../workers/worker';
import { startStubEngine, type StubEngine } from '../test/fixtures/stub-engine';
import type { FastifyInstance } from 'fastify';
import { startEngine, type RunningEngine } from '../engine/server';
import { startCpuProfile, type CpuSummary } from './cpu-profile';

/** Parent → child. */
export type ServingCommand =
  | { type: 'stub'; nats: string; prefix: string; pool: string; instance: string; slots: number; chunks: number }
  | { type: 'floor'; prefix: string; pool: string; instance: string; slots: number }
  | { type: 'workers'; cfg: MagusConfig; env: Record<string, string> }
  /** A real llama.cpp engine (`magus engine`, as the local runtime starts it) and a real bridge consuming its instance's requests. */
  | { type: 'engine'; nats: string; prefix: string; pool: string; instance: string; slots: number; model: string; threads: number; ctx: number }
  /** A real bridge consuming its instance's requests for an engine already serving at `engineUrl`, its calls traced as the `engine` mode's. */
  | { type: 'bridge'; nats: string; prefix: string; pool: string; instance: string; slots: number; engineUrl: string; engineKind: EngineKind }
  /** Stops the bridge `bridge` started (its engine is the parent's). */
  | { type: 'unbridge' }
  | { type: 'trace'; on: boolean }
  | { type: 'profile'; on: boolean }
  | { type: 'stats' }
  | { type: 'stop' };

/** Child → parent (`re` names the command answered). */
export type ServingReply =
  | { re: 'stub'; url: string; subject: string }
  | { re: 'floor'; subject: string }
  | { re: 'workers' }
  | { re: 'engine'; url: string; subject: string; pid: number }
  | { re: 'bridge'; subject: string }
  | { re: 'unbridge' }
  | { re: 'trace'; events: TraceEvent[] }
  | { re: 'profile'; summary?: CpuSummary }
  | { re: 'stats'; bridge: BridgeStats | undefined }
  | { re: 'stop' }
  | { re: string; error: string };

/**
 * `[what, subject (+ payload of small requests) or engine seed, start, end]` (epoch ms); for
 * `engine` (a real engine's call): the prompt's `(request N)` mark, the POST, and for a streamed
 * call the arrival of the first chunk carrying text — the engine's time to first token as the
 * bridge sees it —, for one not streamed the whole answer's.
 */
export type TraceEvent = [kind: 'request' | 'publish' | 'fetch' | 'engine', key: string, start: number, end: number];

const now = (): number => performance.timeOrigin + performance.now();
/** A signal that never aborts. */
const FOREVER = new AbortController().signal;

let nc: NatsConnection | undefined;
let engine: StubEngine | undefined;
let llamaCpp: LlamaCppEngine | undefined;
let inProcess: RunningEngine | undefined;
let bridge: Bridge | undefined;
let workers: RunningWorkers | undefined;
let tracing = false;
let trace: TraceEvent[] = [];
let stopProfile: (() => Promise<CpuSummary>) | undefined;

/** Wraps the bridge's connection and `fetch` so that, while tracing, every call leaves an event. */
function instrument(conn: NatsConnection): void {
  const request = conn.request.bind(conn);
  conn.request = async (subject, data, opts) => {
    if (!tracing) return request(subject, data, opts);
    const t0 = now();
    const m = await request(subject, data, opts);
    // A KV read names its key in the payload (`last_by_subj`), not in the subject.
    trace.push(['request', data && data.length < 512 ? `${subject} ${typeof data === 'string' ? data : new TextDecoder().decode(data)}` : subject, t0, now()]);
    return m;
  };
  const publish = conn.publish.bind(conn);
  conn.publish = (subject, data, opts) => {
    if (tracing) trace.push(['publish', subject, now(), 0]);
    publish(subject, data, opts);
  };
}

/** An engine in this process, called without a socket (fastify's `inject`, streamed): `BENCH_INJECT`. */
function injectClient(app: FastifyInstance): EngineClient {
  const call = async (
    method: 'GET' | 'POST',
    url: string,
    body: string | undefined,
    headers: Record<string, string>,
    signal: AbortSignal,
  ): Promise<EngineResponse> => {
    const res = await app.inject({ method, url, payload: body, headers, payloadAsStream: true, signal });
    const stream = res.stream();
    return {
      status: res.statusCode,
      contentType: String(res.headers['content-type'] ?? ''),
      text: async () => {
        let s = '';
        for await (const c of stream) s += String(c);
        return s;
      },
      eventBatches: () => sseEventBatches(stream as AsyncIterable<Buffer>),
      cancel: () => {
        (res.raw.res as unknown as { destroy(): void }).destroy();
      },
    };
  };
  return {
    post: (path, body, o) => call('POST', path, body, { 'content-type': 'application/json', accept: o.accept }, o.signal),
    get: (path, o) => call('GET', path, undefined, {}, o.signal),
    close: () => undefined,
  };
}

/** The bridge's engine client (`given`, else HTTP to `url`) whose calls, while tracing, go through `traced` (given the call's start). */
function tracingEngineClient(
  url: string,
  traced: (inner: EngineClient, t0: number, ...call: Parameters<EngineClient['post']>) => Promise<EngineResponse>,
  given?: EngineClient,
): EngineClient {
  const inner = given ?? createEngineClient(url);
  return { ...inner, post: (path, body, opts) => (tracing ? traced(inner, now(), path, body, opts) : inner.post(path, body, opts)) };
}

/** For a stub engine: a `fetch` event per engine call (the answer read whole). */
const tracedEngineClient = (url: string): EngineClient =>
  tracingEngineClient(url, async (inner, t0, path, body, opts) => {
    const res = await inner.post(path, body, opts);
    const text = await res.text();
    trace.push(['fetch', String((JSON.parse(body) as { seed?: number }).seed), t0, now()]);
    return { ...res, text: () => Promise.resolve(text), eventBatches: () => sseEventBatches([text]) };
  });

/** For a real engine: an `engine` event per call (a streamed one's first token, else its whole answer), the answer untouched. */
const firstTokenTracingClient = (url: string, given?: EngineClient): EngineClient =>
  tracingEngineClient(
    url,
    async (inner, t0, path, body, opts) => {
      const request = JSON.parse(body) as { messages?: { content?: unknown }[]; stream?: boolean };
      const last = request.messages?.at(-1)?.content;
      const mark = typeof last === 'string' ? (/\(request \d+\)$/.exec(last)?.[0] ?? '') : '';
      const res = await inner.post(path, body, opts);
      return {
        ...res,
        async text() {
          const text = await res.text();
          if (request.stream !== true) trace.push(['engine', mark, t0, now()]);
          return text;
        },
        async *eventBatches() {
          let seen = false;
          for await (const batch of res.eventBatches()) {
            if (!seen && batch.some((e) => /"content":"[^"]/.test(e))) {
              seen = true;
              trace.push(['engine', mark, t0, now()]);
            }
            yield batch;
          }
        },
      };
    },
    given,
  );

async function handle(cmd: ServingCommand): Promise<ServingReply> {
  switch (cmd.type) {
    case 'stub': {
      nc = await connect({ servers: cmd.nats, name: 'bench-bridge', noAsyncTraces: true });
      instrument(nc);
      const names = await ensureDataPlane(nc, { prefix: cmd.prefix });
      await ensureInstanceConsumer(await nc.jetstreamManager(), names, { pool: cmd.pool, instance: cmd.instance, slots: cmd.slots });
      engine = await startStubEngine({ modelId: cmd.pool, chunks: cmd.chunks });
      bridge = await startBridge({
        nc,
        names,
        pool: cmd.pool,
        instance: cmd.instance,
        engineUrl: engine.url,
        engineClient: tracedEngineClient(engine.url),
        slots: cmd.slots,
      });
      return { re: 'stub', url: engine.url, subject: requestSubjectOf(names, cmd.pool, cmd.instance) };
    }
    case 'floor': {
      // The design's floor: the least a bridge can do — pull, call the engine, publish the answer,
      // ack — with none of magus's exactly-once, cancel, retry, deadline or limits (after `stub`).
      const names = await ensureDataPlane(nc!, { prefix: cmd.prefix });
      await ensureInstanceConsumer(await nc!.jetstreamManager(), names, { pool: cmd.pool, instance: cmd.instance, slots: cmd.slots });
      const client = createEngineClient(engine!.url);
      const messages = await (
        await nc!.jetstream().consumers.get(names.requestStream, consumerNameOf(cmd.pool, cmd.instance))
      ).consume({ max_messages: cmd.slots });
      void (async () => {
        for await (const m of messages) {
          void (async () => {
            const req = JSON.parse(new TextDecoder().decode(m.data)) as InferenceRequest;
            const res = await client.post('/v1/chat/completions', JSON.stringify(req.body), { accept: 'application/json', signal: FOREVER });
            nc!.publish(req.replyTo, JSON.stringify({ seq: 0, type: 'done', data: JSON.parse(await res.text()) as unknown }));
            m.ack();
          })().catch(() => m.term());
        }
      })();
      return { re: 'floor', subject: requestSubjectOf(names, cmd.pool, cmd.instance) };
    }
    case 'engine': {
      nc ??= await connect({ servers: cmd.nats, name: 'bench-bridge', noAsyncTraces: true });
      const names = await ensureDataPlane(nc, { prefix: cmd.prefix });
      await ensureInstanceConsumer(await nc.jetstreamManager(), names, { pool: cmd.pool, instance: cmd.instance, slots: cmd.slots });
      if (process.env.BENCH_IN_PROCESS === '1') {
        const e = await startEngine(
          {
            model: cmd.model,
            host: '127.0.0.1',
            port: 0,
            slots: cmd.slots,
            resumeSlots: 0,
            queue: 16,
            threads: cmd.threads,
            ctx: cmd.ctx,
            modelId: cmd.pool,
            graceMs: 1000,
            json: false,
            standby: false,
            warm: false,
          },
          () => undefined,
        );
        await e.loaded;
        inProcess = e;
        bridge = await startBridge({
          nc,
          names,
          pool: cmd.pool,
          instance: cmd.instance,
          engineUrl: e.url,
          engineClient: firstTokenTracingClient(e.url, process.env.BENCH_INJECT === '1' ? injectClient(e.app) : undefined),
          slots: cmd.slots,
        });
        return { re: 'engine', url: e.url, subject: requestSubjectOf(names, cmd.pool, cmd.instance), pid: process.pid };
      }
      llamaCpp = await startLlamaCppEngine(cmd.model, {
        modelId: cmd.pool,
        slots: cmd.slots,
        threads: cmd.threads,
        ctx: cmd.ctx,
        startTimeoutSec: 300,
        name: 'bench-engine',
        log: () => undefined,
      });
      bridge = await startBridge({
        nc,
        names,
        pool: cmd.pool,
        instance: cmd.instance,
        engineUrl: llamaCpp.url,
        engineClient: firstTokenTracingClient(llamaCpp.url),
        slots: cmd.slots,
      });
      return { re: 'engine', url: llamaCpp.url, subject: requestSubjectOf(names, cmd.pool, cmd.instance), pid: llamaCpp.process.child.pid ?? 0 };
    }
    case 'bridge': {
      nc ??= await connect({ servers: cmd.nats, name: 'bench-bridge', noAsyncTraces: true });
      const names = await ensureDataPlane(nc, { prefix: cmd.prefix });
      await ensureInstanceConsumer(await nc.jetstreamManager(), names, { pool: cmd.pool, instance: cmd.instance, slots: cmd.slots });
      bridge = await startBridge({
        nc,
        names,
        pool: cmd.pool,
        instance: cmd.instance,
        engineUrl: cmd.engineUrl,
        engineKind: cmd.engineKind,
        engineClient: firstTokenTracingClient(cmd.engineUrl),
        slots: cmd.slots,
      });
      return { re: 'bridge', subject: requestSubjectOf(names, cmd.pool, cmd.instance) };
    }
    case 'unbridge':
      await bridge?.stop();
      bridge = undefined;
      return { re: 'unbridge' };
    case 'workers':
      Object.assign(process.env, cmd.env);
      Runtime.install({ logger: new DefaultLogger('WARN') });
      workers = await startWorkers(cmd.cfg);
      return { re: 'workers' };
    case 'trace': {
      tracing = cmd.on;
      const events = cmd.on ? [] : trace;
      trace = [];
      return { re: 'trace', events };
    }
    case 'profile':
      if (cmd.on) {
        stopProfile = await startCpuProfile('bridge-and-stub');
        return { re: 'profile' };
      }
      return { re: 'profile', summary: await stopProfile?.() };
    case 'stats':
      return { re: 'stats', bridge: bridge ? { ...bridge.stats } : undefined };
    case 'stop':
      await bridge?.stop();
      await engine?.stop();
      await llamaCpp?.process.stop(5_000);
      await inProcess?.stop();
      await nc?.drain();
      await workers?.shutdown();
      return { re: 'stop' };
  }
}

if (require.main === module) {
  process.on('message', (cmd: ServingCommand) => {
    handle(cmd).then(
      (reply) => process.send!(reply),
      (err: unknown) => process.send!({ re: cmd.type, error: (err as Error).stack ?? String(err) }),
    );
  });
  process.on('disconnect', () => process.exit(0));
}

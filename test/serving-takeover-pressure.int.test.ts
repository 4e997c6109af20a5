/**
 * A take-over under pressure, seen from the `openai` client through the real gateway, nats-server,
 * in-process bridges and the stub engine. The first bridge streams part of an answer; other
 * requests' frames (512 KiB) then pass through `MAGUS_RESPONSES`; the bridge streams a few more
 * pieces and is cut off (its NATS connection closed, no ack); a second bridge takes the request
 * over after ack_wait and reads back what the first one published.
 *
 * - Sized from throughput × the longest request (32 KiB/s × 10 min = 18.75 MiB): the early frames
 *   are still there, and the client gets the whole answer, each piece once.
 * - A fixed cap the traffic outgrows (the old fixed 256 MiB, scaled down to 256 KiB; the stream
 *   discards the oldest): the early frames were evicted, the later ones are there; the take-over
 *   generates the answer again and requires it to say what those say (a gap crossed:
 *   `magus_bridge_resumed_across_gap_total`), and the gateway's response stream gauges say the
 *   stream is too small (full, its oldest frame far younger than the retention requests need).
 */
import { randomBytes } from 'node:crypto';
import type { NatsConnection } from 'nats';
import OpenAI from 'openai';
import { ensureInstanceConsumer, responseSubjectOf, type DataPlaneNames, type DataPlaneOptions } from '../dataplane';
import { encodeFrame } from '../dataplane/frames';
import { openModelRegistry } from '../dataplane/registry';
import { bridgeMetricsText, startBridge, type Bridge } from '../dataplane/bridge';
import { conversationKey } from '../gateway/serving/conversation';
import type { RunningGateway } from '../gateway/server';
import { readyModel } from './harness/gateway-app';
import { splitText, type StubEngine } from './fixtures/stub-engine';
import { pinConversation } from './harness/gateway';
import { isolation, natsConnectAsBridge } from './harness';
import { gatewayStack, natsStack, stubEngineStack, TestStack } from './harness/stack';
import { until } from './harness/wait';

const iso = isolation();
const POOL = 'pressure';
const INSTANCE = 'i1';
const CHUNKS = 40;
const TOKEN_ID = 'pressure';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(16).toString('hex')}`;
const SECRET = randomBytes(32).toString('hex');
const KiB = 1024;
/** Other requests' frames while the request runs: twice the undersized cap. */
const TRAFFIC_BYTES = 512 * KiB;

interface Plane {
  names: DataPlaneNames;
  nc: NatsConnection;
  engine: StubEngine;
  gateway: RunningGateway;
  openai: OpenAI;
  /** Holds the next answer after this many pieces until `release`; `reached` resolves when it holds. */
  holdNext(afterChunks: number): { reached: Promise<void>; release: () => void };
  bridge(nc: NatsConnection): Promise<Bridge>;
  close(): Promise<void>;
}

/** A data plane of its own (`responses` sizes MAGUS_RESPONSES), a stub engine, a gateway, one pinned conversation. */
async function plane(suffix: string, responses: DataPlaneOptions): Promise<Plane> {
  const pieces = new TestStack();
  const { nc, names } = await pieces.open(natsStack(iso, { suffix, declare: responses }));
  await ensureInstanceConsumer(await nc.jetstreamManager(), names, { pool: POOL, instance: INSTANCE, slots: 1, ackWaitMs: 1000 });
  let hold: { afterChunks: number; until: Promise<void>; reached: () => void } | undefined;
  const { engine } = await pieces.open(
    stubEngineStack({
      modelId: POOL,
      chunks: CHUNKS,
      chunkDelayMs: 40,
      pause: () => {
        const h = hold;
        hold = undefined;
        return h;
      },
    }),
  );
  await (await openModelRegistry(nc, names.modelsBucket)).put(readyModel(POOL));
  const session = `pressure-${suffix}`;
  await pinConversation(nc, names, conversationKey(SECRET, { scope: TOKEN_ID, model: `default/${POOL}`, messages: [], sessionId: session }), POOL, INSTANCE);
  const env = { MAGUS_GATEWAY_REQUEST_TIMEOUT_MS: '60000', MAGUS_LOG_LEVEL: 'silent' };
  const { gateway } = await pieces.open(
    gatewayStack(names, {
      secret: SECRET,
      tokens: { [TOKEN_ID]: TOKEN },
      env,
      deps: { coldStart: () => Promise.reject(new Error('no cold start in this test')) },
    }),
  );
  const openai = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: TOKEN, maxRetries: 0, defaultHeaders: { 'x-session-id': session } });
  return {
    names,
    nc,
    engine,
    gateway,
    openai,
    holdNext(afterChunks) {
      let release!: () => void;
      const until = new Promise<void>((resolve) => (release = resolve));
      const reached = new Promise<void>((resolve) => (hold = { afterChunks, until, reached: resolve }));
      return { reached, release };
    },
    async bridge(conn) {
      const b = await startBridge({
        nc: conn,
        names,
        pool: POOL,
        instance: INSTANCE,
        engineUrl: engine.url,
        slots: 1,
        retryDelayMs: 100,
        log: () => undefined,
      });
      pieces.defer(async () => {
        await b.stop();
        await conn.close();
      });
      return b;
    },
    close: () => pieces.close(),
  };
}

/** Other requests' frames, as other replicas' answers would put them in the stream. */
async function traffic(p: Plane): Promise<void> {
  const frame = encodeFrame({ seq: 0, type: 'done', data: 'x'.repeat(1000) });
  for (let i = 0; i < TRAFFIC_BYTES / KiB; i += 1) p.nc.publish(responseSubjectOf(p.names, `other-${i}`, 'gw-other'), frame);
  await p.nc.flush();
}

interface Run {
  content: string;
  /** Content pieces the client received, in order. */
  deltas: string[];
  /** How the stream ended: `[DONE]`, or the error event's message. */
  end: 'done' | { error: string; status: number | undefined };
  heir: Bridge;
}

/**
 * One streamed request: the first bridge holds it after 3 pieces, the traffic passes, the bridge
 * streams on and is cut off after the client has 8 pieces; a second bridge takes it over.
 */
async function takeOverUnderPressure(p: Plane): Promise<Run> {
  const doomedNc = await natsConnectAsBridge(p.names, POOL, INSTANCE);
  await p.bridge(doomedNc);
  const hold = p.holdNext(3);
  const content = `under pressure ${randomBytes(24).toString('hex')}`;
  const stream = await p.openai.chat.completions.create({ model: POOL, messages: [{ role: 'user', content }], stream: true });
  const deltas: string[] = [];
  let end: Run['end'] | undefined;
  const reading = (async () => {
    try {
      for await (const c of stream) if (c.choices[0]?.delta.content) deltas.push(c.choices[0].delta.content);
      end = 'done';
    } catch (err) {
      end = { error: (err as Error).message, status: (err as { status?: number }).status };
    }
  })();
  await hold.reached;
  await until('the client has the first 3 pieces', () => deltas.length === 3);
  await traffic(p);
  hold.release();
  await until('the client has 8 pieces', () => deltas.length >= 8);
  // Cut off mid-answer: no ack, no nak; JetStream redelivers after ack_wait (1 s).
  await doomedNc.close();
  const heir = await p.bridge(await natsConnectAsBridge(p.names, POOL, INSTANCE));
  await reading;
  return { content, deltas, end: end!, heir };
}

/** `name{…} value` or `name value` from a Prometheus text body. */
const sample = (metrics: string, name: string): number | undefined => {
  const m = new RegExp(`^${name}(?:\\{[^}]*\\})? (\\S+)$`, 'm').exec(metrics);
  return m ? Number(m[1]) : undefined;
};

test('sized from throughput × the longest request: the take-over finds every frame and the client gets the whole answer once', async () => {
  const p = await plane('SIZED', { responsePeakBytesPerSec: 32 * KiB, responseRetentionMs: 10 * 60_000 });
  try {
    const run = await takeOverUnderPressure(p);
    expect(run.end).toBe('done');
    expect(run.deltas).toEqual(splitText(run.content, CHUNKS));
    await until('the take-over acked', () => run.heir.stats.acked === 1); // once its frames are stored, just after the client has them
    expect(run.heir.stats).toMatchObject({ redelivered: 1, resumed: 1, resumeFailed: 0, acked: 1, errors: 0 });
    expect(bridgeMetricsText([{ pool: POOL, instance: INSTANCE, stats: run.heir.stats, health: run.heir.health() }])).toContain(
      `magus_bridge_resume_failed_total{pool="${POOL}",instance="${INSTANCE}"} 0`,
    );
    const metrics = await (await fetch(`${p.gateway.url}/metrics`)).text();
    expect(sample(metrics, 'magus_gateway_response_stream_max_bytes')).toBe(32 * KiB * 600);
    expect(sample(metrics, 'magus_gateway_response_stream_required_retention_seconds')).toBe(600);
    expect(sample(metrics, 'magus_gateway_response_stream_bytes')).toBeLessThan(0.5 * 32 * KiB * 600); // not full: nothing evicted
  } finally {
    await p.close();
  }
}, 120_000);

test('undersized (a fixed cap the traffic outgrows): the early frames are evicted, the take-over generates the answer again checked against the frames still stored, and the metrics report the stream too small', async () => {
  const p = await plane('FIXED', { responseMaxBytes: 256 * KiB });
  try {
    const run = await takeOverUnderPressure(p);
    // The client has a prefix the stream no longer holds; the frames after it are still there,
    // and the take-over's answer says the same words (dataplane/README.md, "Resume, do not restart").
    expect(run.end).toBe('done');
    expect(run.deltas).toEqual(splitText(run.content, CHUNKS));
    await until('the take-over acked', () => run.heir.stats.acked === 1);
    expect(run.heir.stats).toMatchObject({ redelivered: 1, resumedAcrossGap: 1, resumeFailed: 0, termed: 0 });
    expect(bridgeMetricsText([{ pool: POOL, instance: INSTANCE, stats: run.heir.stats, health: run.heir.health() }])).toContain(
      `magus_bridge_resumed_across_gap_total{pool="${POOL}",instance="${INSTANCE}"} 1`,
    );
    expect(p.engine.requests).toHaveLength(2); // generated again from its first token: the stream kept none of the beginning
    // Full, and its oldest frame younger than the 10 min a request may need its frames for.
    const metrics = await (await fetch(`${p.gateway.url}/metrics`)).text();
    const max = sample(metrics, 'magus_gateway_response_stream_max_bytes')!;
    expect(max).toBe(256 * KiB);
    expect(sample(metrics, 'magus_gateway_response_stream_bytes')).toBeGreaterThan(0.9 * max);
    expect(sample(metrics, 'magus_gateway_response_stream_oldest_frame_age_seconds')).toBeLessThan(
      sample(metrics, 'magus_gateway_response_stream_required_retention_seconds')!,
    );
  } finally {
    await p.close();
  }
}, 120_000);

/**
 * `npm run bench:gateway`'s first-turn part (gateway.ts runs it after the warm measurements): new
 * conversations on a warm pool of a real llama.cpp engine, placed by the gateway from the pool's
 * published instance (the entry-lease protocol), their session workflows started after the answer.
 */
import { CreateBucketCommand, S3Client } from '@aws-sdk/client-s3';
import { Client, Connection } from '@temporalio/client';
import { temporal } from '@temporalio/proto';
import type { ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import type { ensureDataPlane } from '../dataplane';
import type { openModelRegistry } from '../dataplane/registry';
import { conversationKey } from '../gateway/serving/conversation';
import type { SessionStats } from '../gateway/serving/sessions';
import { temporalSessions } from '../gateway/temporal';
import { publishTinyGguf } from '../test/fixtures/tiny-gguf';
import type { startServices } from '../workers/dev/services';
import { poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import { sessionWorkflowId } from '../workflows/session/definitions';
import { ask, load, p50 } from './common';
import type { LoadResult, LoadSpec } from './gateway-client';
import type { ServingCommand } from './gateway-serving';

/** The model the first turns are measured on. */
export const TINY = 'tiny';
/** Bursts of new conversations measured against the same requests on warm sessions (target ≤ 1.5×). */
export const BURSTS = [50, 200];
export const BURST_TARGET = 1.5;
const EventType = temporal.api.enums.v1.EventType;

export interface FirstTurnResult {
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
export interface BurstResult {
  n: number;
  first: LoadResult;
  warm: LoadResult;
  /** First turns served from the pool's published instances / sent through Temporal. */
  fromPool: number;
  cold: number;
}

/**
 * The first turn of new conversations on a warm pool, measured through the gateway: `tiny` (the
 * synthetic Llama as GGUF) published, Temporal workers with the local runtime started in the
 * serving child, the pool warmed; then {@link FirstTurnResult}'s figures, the session workflows'
 * timelines from their histories, and bursts of new conversations against the same ones warm.
 */
export async function measureFirstTurn(ctx: {
  /** The data plane's prefix (`MAGUS_NATS_PREFIX`). */
  prefix: string;
  /** The bench's token, its id, and the gateway's conversation-key secret. */
  auth: { token: string; tokenId: string; secret: string };
  /** A sample count scaled by BENCH_SCALE. */
  scaled: (count: number) => number;
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
  const s3 = new S3Client({
    endpoint: e.s3!.endpoint,
    region: e.s3!.region,
    forcePathStyle: true,
    credentials: { accessKeyId: e.s3!.accessKeyId, secretAccessKey: e.s3!.secretAccessKey },
  });
  await s3.send(new CreateBucketCommand({ Bucket: bucket }));
  await publishTinyGguf({ dir, s3, bucket, registry: ctx.registry, name: TINY });
  s3.destroy();
  // The gateway's catalog re-reads the registry on a miss at most once a second: wait until it has the model.
  const models = ctx.viaGateway.url.replace(/chat\/completions$/, 'models');
  while (!(await (await fetch(models, { headers: { authorization: `Bearer ${ctx.auth.token}` } })).text()).includes(`"${TINY}"`))
    await new Promise((r) => setTimeout(r, 200));

  const taskQueue = 'bench-gateway-control';
  await ask(ctx.serving, {
    type: 'workers',
    env: { AWS_ACCESS_KEY_ID: e.s3!.accessKeyId, AWS_SECRET_ACCESS_KEY: e.s3!.secretAccessKey },
    cfg: {
      temporal: { address: e.temporal!.address, namespace: 'default' },
      taskQueue,
      nats: { servers: e.nats!.servers },
      s3: { endpoint: e.s3!.endpoint, region: e.s3!.region, bucket, forcePathStyle: true },
      natsPrefix: ctx.prefix,
      modelCacheDir: join(dir, 'models'),
      convertThreads: 1,
      transferPartSize: undefined,
      s3TraceFile: undefined,
    },
  } satisfies ServingCommand);
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
  ctx.setTemporalPath(
    temporalSessions({ client, taskQueue, pool: { minInstances: 1, maxInstances: 1, leasesPerInstance: 8, idleTimeoutMs: 3_600_000 }, sessionTtlMs: 600_000 }),
  );

  const run = randomBytes(3).toString('hex');
  const turn = (over: Partial<LoadSpec>): LoadSpec => ({
    ...ctx.viaGateway,
    model: TINY,
    concurrency: 1,
    requests: 1,
    stream: false,
    prompt: 'hello there',
    maxTokens: 2,
    ...over,
  });
  // Warm the pool (the engine starts here) and Temporal's caches, with conversations not measured.
  await load(ctx.client, turn({ sessionPrefix: `warm-${run}` }));
  await load(ctx.client, turn({ sessionPrefix: `warm2-${run}`, requests: ctx.scaled(20) }));
  const measured = ctx.scaled(100);
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
    const key = conversationKey(ctx.auth.secret, { scope: ctx.auth.tokenId, model: `default/${TINY}`, messages: [], sessionId: `new-${run}-${i}` });
    // The workflow starts after the answer: wait until it has run its first task (it then sleeps until the entry's expiry).
    const granted = (evs: typeof events) => evs.some((ev) => ev.eventType === EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED);
    let events =
      (
        await client.workflow
          .getHandle(sessionWorkflowId('default', TINY, key))
          .fetchHistory()
          .catch(() => undefined)
      )?.events ?? [];
    for (let tries = 0; !granted(events) && tries < 300; tries++) {
      await new Promise((r) => setTimeout(r, 100));
      events =
        (
          await client.workflow
            .getHandle(sessionWorkflowId('default', TINY, key))
            .fetchHistory()
            .catch(() => undefined)
        )?.events ?? [];
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
  return {
    first,
    warm,
    adoptMs: [...ctx.adoptMs],
    signalWithStartMs: swsMs,
    sessionTimeline: order.map((l) => [l, p50(byType.get(l)!)]),
    n: measured,
    bursts,
    poolTasks,
  };
}

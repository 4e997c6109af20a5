/**
 * What the soak samples while traffic runs (soak.ts): every process of `magus dev`'s tree (RSS,
 * open file descriptors), NATS (consumers per stream, the keys of `magus_sessions` and
 * `magus_pools`, the sessions bucket's messages, every stream's bytes), Temporal (its database's
 * size, the session workflows running, the demo model's pool and, at the end, its histories) and
 * `magus dev`'s own gauges.
 */
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import type { WorkflowClient } from '@temporalio/client';
import { temporal as proto } from '@temporalio/proto';
import type { NatsConnection } from 'nats';
import type { dataPlaneNames } from '../dataplane';
import { poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';

export interface ProcessSample {
  pid: number;
  name: string;
  rssMb: number;
  fds: number;
}
export interface Sample {
  at: number;
  processes: ProcessSample[];
  consumers: Record<string, number>;
  sessionKeys: number;
  poolKeys: number;
  /** Messages in the sessions bucket's stream: live entries and delete markers of ended sessions. */
  sessionMessages: number;
  /** What each JetStream stream stores, MB. */
  streamsMb: Record<string, number>;
  /** Conversations started so far. */
  conversations: number;
  /** Conversations with a turn within the TTL (their sessions should run) … */
  live: number;
  /** … and within the TTL plus soak-report.ts's `EXPIRY_GRACE_MS` (at most this many may still have a key). */
  liveWithGrace: number;
  /** Session workflows running (Temporal's count; undefined when it would not answer). */
  sessionWorkflows?: number;
  /** Temporal's SQLite database with its WAL, MB. */
  temporalDbMb?: number;
  /** `magus dev`'s V8 heap in use, MB (its gateway's `/metrics`: `nodejs_heap_size_used_bytes`). */
  devHeapMb?: number;
  /** Workflows its Temporal workers keep cached (`magus_worker_cached_workflows`): their state is in the workflow threads, which RSS counts and the heap gauge does not. */
  devCachedWorkflows?: number;
  /** The demo model's pool workflow: its run (a new one after each continue-as-new), that run's history length, its instances with their leases, sessions waiting, its last error. */
  pool?: { runId: string; events: number; instances: string[]; leases: number; waiting: number; lastError: string | null };
}

export interface PoolHistory {
  /** Runs (each continue-as-new starts one) and their events in all. */
  runs: number;
  events: number;
  /** Workflow tasks that failed (by cause: e.g. UNHANDLED_COMMAND, a completion refused because signals came meanwhile) or timed out. */
  taskFailures: Record<string, number>;
  taskTimeouts: number;
  /** The longest a workflow task waited and ran, from scheduled to completed (s). */
  slowestTaskSec: number;
  /** Activities scheduled, by type. */
  activities: Record<string, number>;
}

/** `cmdline` as a short, stable name: the program and the magus mode, if any. */
function processName(pid: number): string {
  try {
    const argv = readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').filter(Boolean);
    const prog = (argv[0] ?? '?').split('/').pop()!;
    const mode = argv.find((a, i) => i > 0 && /^(dev|worker|gateway|engine|bridge|controller|server|start-dev)$/.test(a));
    if (prog === 'node' && argv.some((a) => a.endsWith('magus.js'))) return `magus ${mode ?? ''}`.trim();
    return mode ? `${prog} ${mode}` : prog;
  } catch {
    return '?';
  }
}

/** RSS and open fds of a process; undefined once it has exited. */
export function sampleProcess(pid: number): ProcessSample | undefined {
  try {
    const status = readFileSync(`/proc/${pid}/status`, 'utf8');
    const rssKb = Number(/VmRSS:\s+(\d+)/.exec(status)?.[1] ?? 0);
    return { pid, name: processName(pid), rssMb: rssKb / 1024, fds: readdirSync(`/proc/${pid}/fd`).length };
  } catch {
    return undefined; // exited meanwhile
  }
}

/** NATS: consumers and bytes per stream, the keys of the sessions and pools buckets, the sessions bucket's messages. */
export async function natsSample(
  nc: NatsConnection,
  names: ReturnType<typeof dataPlaneNames>,
): Promise<Pick<Sample, 'consumers' | 'sessionKeys' | 'poolKeys' | 'sessionMessages' | 'streamsMb'>> {
  const jsm = await nc.jetstreamManager();
  const consumers: Record<string, number> = {};
  const streamsMb: Record<string, number> = {};
  let sessionMessages = 0;
  for await (const s of jsm.streams.list()) {
    consumers[s.config.name] = s.state.consumer_count;
    streamsMb[s.config.name] = s.state.bytes / 2 ** 20;
    if (s.config.name === `KV_${names.sessionsBucket}`) sessionMessages = s.state.messages;
  }
  const count = async (bucket: string, counted: (key: string) => boolean = () => true) => {
    const kv = await nc.jetstream().views.kv(bucket);
    // A key written again while the listing runs comes twice (its new value is delivered too).
    const keys = new Set<string>();
    for await (const k of await kv.keys()) if (counted(k)) keys.add(k);
    return keys.size;
  };
  // Conversations' entries only: not a pool's claim of its read for orphans (`_orphans.…`, which
  // lives one reconcile interval; dataplane/session-keys.ts), whose key no namespace begins like.
  const entry = (key: string) => !key.startsWith('_');
  return { consumers, sessionKeys: await count(names.sessionsBucket, entry), poolKeys: await count(names.poolsBucket), sessionMessages, streamsMb };
}

/** Every run of the pool workflow `workflowId`, walked back from the latest through continue-as-new, summed up. */
export async function poolHistory(workflows: WorkflowClient, workflowId: string): Promise<PoolHistory | undefined> {
  const out: PoolHistory = { runs: 0, events: 0, taskFailures: {}, taskTimeouts: 0, slowestTaskSec: 0, activities: {} };
  const ms = (e: proto.api.history.v1.IHistoryEvent) => Number(e.eventTime?.seconds ?? 0) * 1000 + (e.eventTime?.nanos ?? 0) / 1e6;
  try {
    let runId: string | undefined = (await workflows.getHandle(workflowId).describe()).runId;
    while (runId) {
      const events: proto.api.history.v1.IHistoryEvent[] = (await workflows.getHandle(workflowId, runId).fetchHistory()).events ?? [];
      out.runs++;
      out.events += events.length;
      let scheduled = 0;
      for (const e of events) {
        if (e.workflowTaskScheduledEventAttributes) scheduled = ms(e);
        else if (e.workflowTaskCompletedEventAttributes) out.slowestTaskSec = Math.max(out.slowestTaskSec, (ms(e) - scheduled) / 1000);
        else if (e.workflowTaskFailedEventAttributes) {
          const cause =
            proto.api.enums.v1.WorkflowTaskFailedCause[e.workflowTaskFailedEventAttributes.cause ?? 0]?.replace('WORKFLOW_TASK_FAILED_CAUSE_', '') ?? '?';
          out.taskFailures[cause] = (out.taskFailures[cause] ?? 0) + 1;
        } else if (e.workflowTaskTimedOutEventAttributes) out.taskTimeouts++;
        else if (e.activityTaskScheduledEventAttributes) {
          const type = e.activityTaskScheduledEventAttributes.activityType?.name ?? '?';
          out.activities[type] = (out.activities[type] ?? 0) + 1;
        }
      }
      runId = events[0]?.workflowExecutionStartedEventAttributes?.continuedExecutionRunId || undefined;
    }
    return out;
  } catch {
    return out.runs > 0 ? out : undefined;
  }
}

/** Temporal's database (SQLite, with its write-ahead log) in dev's data folder, MB. */
export function temporalDbMb(data: string): number | undefined {
  let bytes = 0;
  for (const suffix of ['', '-wal']) {
    try {
      bytes += statSync(join(data, `temporal.db${suffix}`)).size;
    } catch {
      // none (yet)
    }
  }
  return bytes > 0 ? bytes / 2 ** 20 : undefined;
}

/** Session workflows running (Temporal's count; undefined when it would not answer). */
export async function sessionWorkflows(workflows: WorkflowClient): Promise<number | undefined> {
  try {
    return (await workflows.count('WorkflowType = "session" AND ExecutionStatus = "Running"')).count;
  } catch {
    return undefined;
  }
}

/** The demo model's pool workflow now: its run, history length, instances, leases, waiting sessions, last error. */
export async function demoPool(workflows: WorkflowClient): Promise<Sample['pool']> {
  try {
    const handle = workflows.getHandle(poolWorkflowId('default', 'demo'));
    const d = await handle.describe();
    const status = await handle.query(poolStatusQuery);
    return {
      runId: d.runId,
      events: d.historyLength,
      instances: status.instances.map((i) => `${i.id} ${i.phase}`),
      leases: status.instances.reduce((n, i) => n + i.leases, 0),
      waiting: status.waiting,
      lastError: status.lastError,
    };
  } catch {
    return undefined;
  }
}

/** `magus dev` is one process (gateway, workers, bridges): its heap and workflow cache, from its gateway's gauges. */
export async function devGauges(gatewayUrl: string): Promise<{ devHeapMb?: number; devCachedWorkflows?: number }> {
  try {
    const text = await (await fetch(`${gatewayUrl}/metrics`, { signal: AbortSignal.timeout(5000) })).text();
    const read = (name: string) => Number(new RegExp(`^${name} (\\S+)$`, 'm').exec(text)?.[1]);
    const bytes = read('nodejs_heap_size_used_bytes');
    const cached = read('magus_worker_cached_workflows');
    return { ...(Number.isFinite(bytes) ? { devHeapMb: bytes / 2 ** 20 } : {}), ...(Number.isFinite(cached) ? { devCachedWorkflows: cached } : {}) };
  } catch {
    return {};
  }
}

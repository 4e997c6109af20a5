/**
 * Soak: mixed traffic for a while through `magus dev`'s own processes (Temporal, NATS, MinIO, the
 * worker with its engine, the gateway), watching for what only time shows — errors, memory and
 * handle growth, NATS consumers and KV keys left behind.
 *
 *   npm run soak                       # 10 minutes (the issue's full run)
 *   npm run soak -- --minutes 2 --concurrency 4 --new-per-sec 2
 *   npm run soak -- --minutes 12 --session-ttl-sec 180   # longer than the session TTL
 *
 * Traffic, from `--concurrency` loops: new conversations (non-streamed, at most `--new-per-sec`,
 * default 2), warm turns on active ones (streamed and not), and injected client disconnects (a
 * streamed request aborted after its first chunk). A conversation gets turns for
 * `--conversation-sec` after its first (default: one session TTL), then none: its session expires
 * one TTL after its last turn. `--session-ttl-sec` is the TTL `magus dev` is started with
 * (`MAGUS_SESSION_TTL_MS`; default its own, 30 min). Halfway, the demo model is re-pulled with a
 * changed spec (a second artifact), so its pipeline re-plans, converts and publishes while it is
 * being served. Every `--sample-sec` it samples the RSS and open file descriptors of every process
 * of dev's tree; NATS: consumers per stream, the keys of `magus_sessions` / `magus_pools`, the
 * messages of the sessions bucket's stream (delete markers included) and every stream's bytes;
 * Temporal: its database's size, the session workflows running, and the demo model's pool (its
 * instances, leases, history length and runs; at the end its histories' failed and slow workflow
 * tasks).
 *
 * The report: requests by outcome (an error is anything but a 200 or an injected disconnect), p50 /
 * p99 latency per minute, each process's RSS and fd slope (least squares, per minute) after
 * warm-up and, when the run is long enough, after the first sessions expired (warm-up or a
 * conversation's turns, whichever is longer, plus one TTL), and whether consumers and keys stay
 * within what live conversations explain (keys: conversations with a turn within the TTL, plus a
 * grace for expiry timers, at every sample; the pool's leases: the session workflows running).
 * Exit 1 when an error or a leak is found.
 * `test/soak.int.test.ts` runs a short variant in CI.
 */
import { spawn } from 'node:child_process';
import { cpSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Client, Connection, type WorkflowClient } from '@temporalio/client';
import { temporal as proto } from '@temporalio/proto';
import { connect, type NatsConnection } from 'nats';
import { dataPlaneNames } from '../dataplane';
import { SESSION_TTL_MS, sessionTtlFrom } from '../gateway/config';
import { poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import type { DevConnection } from '../workers/config';
import { MAGUS_BIN, printed, processTree, startDev, type DevRun } from '../test/harness/dev';
import { fmt, p50, p99 } from './common';
import { within } from '../workers/dev/services';

export interface SoakOptions {
  durationMs: number;
  concurrency: number;
  /** New conversations a second, at most (the rest of the mix becomes warm turns): each one is a session workflow and a lease from its model's one pool workflow. */
  newPerSec: number;
  sampleMs: number;
  /** Samples before this share of the run are warm-up (left out of the slopes). */
  warmupShare: number;
  /** `MAGUS_SESSION_TTL_MS` for the `magus dev` it starts; unset: dev's default (30 min). */
  sessionTtlMs?: number;
  /** How long a conversation gets turns after its first; then it is left to expire. Default: one session TTL. */
  conversationMs?: number;
  log: (line: string) => void;
}

/** Past its expiry (one TTL after its last turn), a session's key may linger this long: the timer fires, the workflow task runs, the delete activity runs. */
const EXPIRY_GRACE_MS = 60_000;

type Kind = 'new' | 'warm' | 'warm-stream' | 'disconnect';
interface Outcome {
  at: number;
  kind: Kind;
  ms: number;
  /** 200, the HTTP status, or 0 when the request failed before an answer. */
  status: number;
  /** An error that was not injected. */
  error?: string;
}
interface ProcessSample {
  pid: number;
  name: string;
  rssMb: number;
  fds: number;
}
interface Sample {
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
  /** … and within the TTL plus {@link EXPIRY_GRACE_MS} (at most this many may still have a key). */
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

interface Conversation {
  id: string;
  startedAt: number;
  lastTurnAt: number;
}

interface PoolHistory {
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

type Slope = { name: string; rssMbPerMin: number; fdsPerMin: number; rssMb: [number, number]; fds: [number, number]; heapMbPerMin?: number; heapMb?: [number, number] };

export interface SoakReport {
  requests: Record<Kind, { ok: number; injected: number; errors: number }>;
  errors: string[];
  perMinute: { minute: number; n: number; p50: number; p99: number; max: number }[];
  /** Per process name (pids can change: an engine restarted is a new process): MB/min and fds/min after warm-up. */
  slopes: Slope[];
  /** The same over the samples after the first sessions expired (minute `fromMin` on); absent when the run ends before. */
  afterExpiry?: { fromMin: number; slopes: Slope[] };
  consumers: { first: Record<string, number>; last: Record<string, number> };
  sessionTtlMs: number;
  conversationMs: number;
  /** At the end: keys, conversations started, live ones (a turn within the TTL) and with the grace; the largest excess of keys over `liveWithGrace` at any sample. */
  sessionKeys: { last: number; conversations: number; live: number; liveWithGrace: number; worstExcess: number };
  /** One sample a minute (the first at or after each minute): what grows and what levels off. */
  timeline: { minute: number; conversations: number; live: number; sessionKeys: number; sessionMessages: number; sessionWorkflows?: number; temporalDbMb?: number; poolEvents?: number; poolRuns: number; poolLeases?: number; poolInstances?: string[]; jetStreamMb: number; responsesMb: number; rssMb: Record<string, number>; devHeapMb?: number; devCachedWorkflows?: number }[];
  repull: { ok: boolean; detail: string };
  /** The demo model's pool workflow over the run, from its histories: what a stalled or evicted pool shows. */
  pool?: PoolHistory;
  /** The pool's instances each time they changed (from the samples), with its last error. */
  poolChanges: string[];
  leaks: string[];
  /** Where dev's logs were kept, when something went wrong. */
  logs?: string;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
/** Longer than any answer of the demo model should take, cold start included. */
const REQUEST_TIMEOUT_MS = 60_000;

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

function sampleProcess(pid: number): ProcessSample | undefined {
  try {
    const status = readFileSync(`/proc/${pid}/status`, 'utf8');
    const rssKb = Number(/VmRSS:\s+(\d+)/.exec(status)?.[1] ?? 0);
    return { pid, name: processName(pid), rssMb: rssKb / 1024, fds: readdirSync(`/proc/${pid}/fd`).length };
  } catch {
    return undefined; // exited meanwhile
  }
}

/** Least-squares slope of `ys` over `xs` (per unit of x). */
function slope(xs: number[], ys: number[]): number {
  const n = xs.length;
  if (n < 2) return 0;
  const mx = xs.reduce((a, b) => a + b, 0) / n;
  const my = ys.reduce((a, b) => a + b, 0) / n;
  let num = 0;
  let den = 0;
  for (let i = 0; i < n; i++) {
    num += (xs[i]! - mx) * (ys[i]! - my);
    den += (xs[i]! - mx) ** 2;
  }
  return den === 0 ? 0 : num / den;
}

async function natsSample(nc: NatsConnection, names: ReturnType<typeof dataPlaneNames>): Promise<Pick<Sample, 'consumers' | 'sessionKeys' | 'poolKeys' | 'sessionMessages' | 'streamsMb'>> {
  const jsm = await nc.jetstreamManager();
  const consumers: Record<string, number> = {};
  const streamsMb: Record<string, number> = {};
  let sessionMessages = 0;
  for await (const s of jsm.streams.list()) {
    consumers[s.config.name] = s.state.consumer_count;
    streamsMb[s.config.name] = s.state.bytes / 2 ** 20;
    if (s.config.name === `KV_${names.sessionsBucket}`) sessionMessages = s.state.messages;
  }
  const count = async (bucket: string) => {
    const kv = await nc.jetstream().views.kv(bucket);
    // A key written again while the listing runs comes twice (its new value is delivered too).
    const keys = new Set<string>();
    for await (const k of await kv.keys()) keys.add(k);
    return keys.size;
  };
  return { consumers, sessionKeys: await count(names.sessionsBucket), poolKeys: await count(names.poolsBucket), sessionMessages, streamsMb };
}

/** Every run of the pool workflow `workflowId`, walked back from the latest through continue-as-new, summed up. */
async function poolHistory(workflows: WorkflowClient, workflowId: string): Promise<PoolHistory | undefined> {
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
          const cause = proto.api.enums.v1.WorkflowTaskFailedCause[e.workflowTaskFailedEventAttributes.cause ?? 0]?.replace('WORKFLOW_TASK_FAILED_CAUSE_', '') ?? '?';
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
function temporalDbMb(data: string): number | undefined {
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

/** Runs the soak against a `magus dev` it starts (fresh, in a temporary folder) and stops. */
export async function runSoak(opts: SoakOptions): Promise<SoakReport> {
  const data = mkdtempSync(join(tmpdir(), 'magus-soak-'));
  const env = { ...process.env };
  for (const name of Object.keys(env)) if (/^MAGUS_|^AWS_/.test(name)) delete env[name];
  if (opts.sessionTtlMs !== undefined) env.MAGUS_SESSION_TTL_MS = String(opts.sessionTtlMs);
  const ttlMs = opts.sessionTtlMs ?? SESSION_TTL_MS.default;
  const conversationMs = opts.conversationMs ?? ttlMs;
  let dev: DevRun | undefined;
  let nc: NatsConnection | undefined;
  let temporal: Connection | undefined;
  let keptLogs: string | undefined;
  try {
    dev = startDev('direct', ['--no-kube', '--demo', 'tiny', '--data-dir', data], env);
    await dev.ready();
    const { gatewayUrl, tokenFile } = printed(dev.stdout());
    const token = readFileSync(tokenFile, 'utf8').trim();
    const connection = JSON.parse(readFileSync(join(data, 'connection.json'), 'utf8')) as DevConnection;
    nc = await connect({ servers: connection.nats.servers });
    const names = dataPlaneNames('');
    temporal = await Connection.connect({ address: connection.temporal.address });
    const workflows = new Client({ connection: temporal, namespace: connection.temporal.namespace }).workflow;
    opts.log(
      `soak: magus dev ready (pid ${dev.child.pid}); ${opts.concurrency} loops for ${Math.round(opts.durationMs / 1000)} s; session TTL ${Math.round(ttlMs / 1000)} s, a conversation gets turns for ${Math.round(conversationMs / 1000)} s`,
    );

    const outcomes: Outcome[] = [];
    /** In start order; those before `activeFrom` get no more turns. */
    const conversations: Conversation[] = [];
    let activeFrom = 0;
    let seq = 0;
    const t0 = Date.now();
    const until = t0 + opts.durationMs;

    const request = async (kind: Kind, conversation: string): Promise<void> => {
      const stream = kind === 'warm-stream' || kind === 'disconnect';
      const ctl = new AbortController();
      // A request that hangs is an error too (and must not stall its loop for the rest of the run).
      const hung = setTimeout(() => ctl.abort(new Error(`no answer within ${REQUEST_TIMEOUT_MS / 1000} s`)), REQUEST_TIMEOUT_MS);
      const started = performance.now();
      const at = Date.now();
      let status = 0;
      try {
        const res = await fetch(`${gatewayUrl}/v1/chat/completions`, {
          method: 'POST',
          signal: ctl.signal,
          headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json', 'x-session-id': conversation },
          body: JSON.stringify({ model: 'demo', messages: [{ role: 'user', content: `turn ${seq++}` }], max_tokens: 8, stream }),
        });
        status = res.status;
        if (kind === 'disconnect' && res.ok && res.body) {
          // The client goes away after the first chunk: the gateway cancels, the engine stops.
          const reader = res.body.getReader();
          await reader.read();
          ctl.abort();
          await reader.cancel().catch(() => undefined);
          outcomes.push({ at, kind, ms: performance.now() - started, status });
          return;
        }
        const body = await res.text();
        const complete = !stream || body.trimEnd().endsWith('data: [DONE]');
        outcomes.push({ at, kind, ms: performance.now() - started, status, ...(res.ok && complete ? {} : { error: `${status} ${body.slice(0, 200)}` }) });
      } catch (err) {
        const reason = ctl.signal.aborted && ctl.signal.reason instanceof Error ? ctl.signal.reason.message : (err as Error).message;
        outcomes.push({ at, kind, ms: performance.now() - started, status, error: reason });
      } finally {
        clearTimeout(hung);
      }
    };

    let nextNewAt = 0;
    const loop = async (n: number): Promise<void> => {
      for (let i = 0; Date.now() < until; i++) {
        const now = Date.now();
        // Conversations past their turns are left alone: their sessions expire one TTL later.
        while (activeFrom < conversations.length && now - conversations[activeFrom]!.startedAt >= conversationMs) activeFrom++;
        const active = conversations.length - activeFrom;
        const r = (i * 7 + n * 13) % 20; // a fixed mix: 4 new, 9 warm, 5 warm streamed, 2 disconnects in 20
        let kind: Kind = r < 4 || active < opts.concurrency ? 'new' : r < 13 ? 'warm' : r < 18 ? 'warm-stream' : 'disconnect';
        if (kind === 'new' && active >= opts.concurrency) {
          if (now < nextNewAt) kind = 'warm';
          else nextNewAt = now + 1000 / opts.newPerSec;
        }
        let conversation: Conversation;
        if (kind === 'new') conversations.push((conversation = { id: `soak-${n}-${i}-${now.toString(36)}`, startedAt: now, lastTurnAt: now }));
        else conversation = conversations[activeFrom + ((i * 31 + n) % active)]!;
        conversation.lastTurnAt = now;
        await request(kind, conversation.id);
      }
    };
    /** Conversations with a turn since `since`. */
    const turnedSince = (since: number) => conversations.reduce((k, c) => k + (c.lastTurnAt >= since ? 1 : 0), 0);
    const sessionWorkflows = async (): Promise<number | undefined> => {
      try {
        return (await workflows.count('WorkflowType = "session" AND ExecutionStatus = "Running"')).count;
      } catch {
        return undefined;
      }
    };
    const pool = async (): Promise<Sample['pool']> => {
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
    };

    // Halfway: the demo model re-pulled with a second artifact, while it is served.
    const repull = (async (): Promise<SoakReport['repull']> => {
      await sleep(opts.durationMs / 2);
      // Its own process, waited for without blocking this one (the traffic goes on meanwhile).
      const pull = spawn(process.execPath, [MAGUS_BIN, 'model', 'pull', 'magus-demo/tiny-llama', '--format', 'gguf:q40,gguf:q80', '--name', 'demo'], {
        env: { ...env, MAGUS_DEV_DATA_DIR: data },
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      let out = '';
      pull.stdout.on('data', (d: Buffer) => (out += d.toString()));
      pull.stderr.on('data', (d: Buffer) => (out += d.toString()));
      const killer = setTimeout(() => pull.kill('SIGKILL'), Math.max(60_000, opts.durationMs / 2));
      const code = await new Promise<number | null>((r) => pull.once('exit', r));
      clearTimeout(killer);
      const ok = code === 0 && out.includes('default/demo is ready');
      return { ok, detail: ok ? 'demo re-pulled with gguf:q40,gguf:q80 under traffic: ready' : `exit ${code}: ${out.slice(-400)}` };
    })();

    /** `magus dev` is one process (gateway, workers, bridges): its heap and workflow cache, from its gateway's gauges. */
    const devGauges = async (): Promise<{ devHeapMb?: number; devCachedWorkflows?: number }> => {
      try {
        const text = await (await fetch(`${gatewayUrl}/metrics`, { signal: AbortSignal.timeout(5000) })).text();
        const read = (name: string) => Number(new RegExp(`^${name} (\\S+)$`, 'm').exec(text)?.[1]);
        const bytes = read('nodejs_heap_size_used_bytes');
        const cached = read('magus_worker_cached_workflows');
        return { ...(Number.isFinite(bytes) ? { devHeapMb: bytes / 2 ** 20 } : {}), ...(Number.isFinite(cached) ? { devCachedWorkflows: cached } : {}) };
      } catch {
        return {};
      }
    };
    const samples: Sample[] = [];
    const sampler = (async () => {
      while (Date.now() < until) {
        const processes = processTree(dev.child.pid!)
          .map(sampleProcess)
          .filter((p): p is ProcessSample => p !== undefined);
        const nats = await natsSample(nc, names);
        // Counted after the keys were: a key listed is never one of a conversation counted as gone.
        const at = Date.now();
        samples.push({ at, processes, ...nats, conversations: conversations.length, live: turnedSince(at - ttlMs), liveWithGrace: turnedSince(at - ttlMs - EXPIRY_GRACE_MS), sessionWorkflows: await sessionWorkflows(), temporalDbMb: temporalDbMb(data), ...(await devGauges()), pool: await pool() });
        await sleep(opts.sampleMs);
      }
    })();

    await Promise.all([...Array.from({ length: opts.concurrency }, (_, n) => loop(n)), sampler]);
    const repulled = await repull;
    const last = await natsSample(nc, names);
    const lastAt = Date.now();
    const end: Sample = {
      ...last,
      at: lastAt,
      processes: [],
      conversations: conversations.length,
      live: turnedSince(lastAt - ttlMs),
      liveWithGrace: turnedSince(lastAt - ttlMs - EXPIRY_GRACE_MS),
      sessionWorkflows: await sessionWorkflows(),
      pool: await pool(),
    };
    const r = report(
      outcomes,
      samples,
      end,
      repulled,
      t0,
      { ...opts, sessionTtlMs: ttlMs, conversationMs },
    );
    const history = await poolHistory(workflows, poolWorkflowId('default', 'demo'));
    if (history) r.pool = history;
    // When the pool's instances changed, and why (its last error), from the samples.
    let before = '';
    for (const s of [...samples, end]) {
      const now = s.pool?.instances.join(', ');
      if (now === undefined || now === before) continue;
      r.poolChanges.push(`minute ${fmt((s.at - t0) / 60_000, 1)}: ${now || 'no instance'}${s.pool?.lastError ? ` (last error: ${s.pool.lastError})` : ''}`);
      before = now;
    }
    if (r.errors.length > 0 || r.leaks.length > 0 || !r.repull.ok) {
      // What dev's processes logged, for whoever looks into it.
      keptLogs = mkdtempSync(join(tmpdir(), 'magus-soak-logs-'));
      cpSync(join(data, 'logs'), keptLogs, { recursive: true });
      writeFileSync(join(keptLogs, 'magus-dev.out'), dev.stdout());
      writeFileSync(join(keptLogs, 'magus-dev.err'), dev.stderr());
      r.logs = keptLogs;
    }
    return r;
  } finally {
    await nc?.close().catch(() => undefined);
    await temporal?.close().catch(() => undefined);
    if (dev) {
      dev.child.kill('SIGINT');
      await within(dev.exited, 60_000);
      dev.killTree();
    }
    rmSync(data, { recursive: true, force: true });
  }
}

function report(outcomes: Outcome[], samples: Sample[], last: Sample, repull: SoakReport['repull'], t0: number, opts: SoakOptions & { sessionTtlMs: number; conversationMs: number }): SoakReport {
  const kinds: Kind[] = ['new', 'warm', 'warm-stream', 'disconnect'];
  const requests = Object.fromEntries(kinds.map((k) => [k, { ok: 0, injected: 0, errors: 0 }])) as SoakReport['requests'];
  const errors: string[] = [];
  for (const o of outcomes) {
    if (o.error !== undefined) {
      requests[o.kind].errors++;
      if (errors.length < 20) errors.push(`${o.kind}: ${o.error}`);
    } else if (o.kind === 'disconnect') requests[o.kind].injected++;
    else requests[o.kind].ok++;
  }
  const perMinute: SoakReport['perMinute'] = [];
  const answered = outcomes.filter((o) => o.error === undefined && o.kind !== 'disconnect');
  for (let m = 0; m * 60_000 < opts.durationMs; m++) {
    const ms = answered.filter((o) => o.at - t0 >= m * 60_000 && o.at - t0 < (m + 1) * 60_000).map((o) => o.ms);
    if (ms.length > 0) perMinute.push({ minute: m + 1, n: ms.length, p50: p50(ms), p99: p99(ms), max: Math.max(...ms) });
  }
  const warmupMs = opts.durationMs * opts.warmupShare;
  const steady = samples.filter((s) => s.at - t0 >= warmupMs);
  const slopes = slopesOf(steady, t0);
  // The first sessions expire one TTL after the first conversations' last turns; the warm-up is left out in any case.
  const expiryFromMs = Math.max(warmupMs, Math.min(opts.conversationMs, opts.durationMs)) + opts.sessionTtlMs;
  const expired = samples.filter((s) => s.at - t0 >= expiryFromMs);
  const afterExpiry = expired.length >= 3 ? { fromMin: expiryFromMs / 60_000, slopes: slopesOf(expired, t0) } : undefined;
  const first = steady[0] ?? samples[0];
  const leaks: string[] = [];
  for (const [stream, n] of Object.entries(last.consumers)) {
    const before = first?.consumers[stream] ?? 0;
    // Consumers belong to instances (one per bridge) and gateways (ordered watchers): a few may
    // come and go with a scale event, never one per request or conversation.
    if (n > before + 4) leaks.push(`stream ${stream}: ${before} → ${n} consumers`);
  }
  // Keys: at most one per conversation with a turn within the TTL (plus the grace for expiry), at every sample.
  let worst: Sample | undefined;
  for (const s of [...samples, last]) if (!worst || s.sessionKeys - s.liveWithGrace > worst.sessionKeys - worst.liveWithGrace) worst = s;
  const worstExcess = worst ? worst.sessionKeys - worst.liveWithGrace : 0;
  if (worst && worstExcess > 0) {
    leaks.push(`magus_sessions had ${worst.sessionKeys} keys at minute ${fmt((worst.at - t0) / 60_000, 1)} for ${worst.liveWithGrace} conversations with a turn within the TTL (${Math.round(opts.sessionTtlMs / 1000)} s) + ${EXPIRY_GRACE_MS / 1000} s`);
  }
  for (const s of slopes) if (s.fds[1] - s.fds[0] > 50) leaks.push(`${s.name}: ${s.fds[0]} → ${s.fds[1]} open files after warm-up`);
  // The pool's leases: one per session workflow still running (a release may be on its way).
  if (last.pool && last.sessionWorkflows !== undefined && last.pool.leases > last.sessionWorkflows + Math.max(10, last.sessionWorkflows * 0.1)) {
    leaks.push(`the pool holds ${last.pool.leases} leases for ${last.sessionWorkflows} session workflows`);
  }
  const timeline: SoakReport['timeline'] = [];
  const poolRuns = new Set<string>();
  let seen = 0;
  for (let m = 0; m * 60_000 < opts.durationMs; m++) {
    const s = samples.find((x) => x.at - t0 >= m * 60_000);
    if (!s || timeline.some((t) => t.minute === Math.round((s.at - t0) / 60_000))) continue;
    const rssMb: Record<string, number> = {};
    for (const p of s.processes) rssMb[p.name] = (rssMb[p.name] ?? 0) + p.rssMb;
    // The pool's runs so far (continue-as-new starts one).
    for (; seen < samples.length && samples[seen]!.at <= s.at; seen++) if (samples[seen]!.pool) poolRuns.add(samples[seen]!.pool!.runId);
    timeline.push({
      minute: Math.round((s.at - t0) / 60_000),
      conversations: s.conversations,
      live: s.live,
      sessionKeys: s.sessionKeys,
      sessionMessages: s.sessionMessages,
      ...(s.sessionWorkflows === undefined ? {} : { sessionWorkflows: s.sessionWorkflows }),
      ...(s.temporalDbMb === undefined ? {} : { temporalDbMb: s.temporalDbMb }),
      ...(s.pool === undefined ? {} : { poolEvents: s.pool.events, poolLeases: s.pool.leases, poolInstances: s.pool.instances }),
      poolRuns: poolRuns.size,
      jetStreamMb: Object.values(s.streamsMb).reduce((a, b) => a + b, 0),
      responsesMb: s.streamsMb.MAGUS_RESPONSES ?? 0,
      rssMb,
      ...(s.devHeapMb === undefined ? {} : { devHeapMb: s.devHeapMb }),
      ...(s.devCachedWorkflows === undefined ? {} : { devCachedWorkflows: s.devCachedWorkflows }),
    });
  }
  return {
    requests,
    errors,
    perMinute,
    slopes,
    ...(afterExpiry ? { afterExpiry } : {}),
    consumers: { first: first?.consumers ?? {}, last: last.consumers },
    sessionTtlMs: opts.sessionTtlMs,
    conversationMs: opts.conversationMs,
    sessionKeys: { last: last.sessionKeys, conversations: last.conversations, live: last.live, liveWithGrace: last.liveWithGrace, worstExcess },
    timeline,
    repull,
    poolChanges: [],
    leaks,
  };
}

/** Per process name, over `samples`: RSS and fds first → last and their least-squares slopes per minute. */
function slopesOf(samples: Sample[], t0: number): Slope[] {
  const byName = new Map<string, { t: number[]; rss: number[]; fds: number[] }>();
  for (const s of samples) {
    // Processes of one name summed (two engines are one "engine" line): growth is what matters.
    const sums = new Map<string, { rss: number; fds: number }>();
    for (const p of s.processes) {
      const v = sums.get(p.name) ?? { rss: 0, fds: 0 };
      sums.set(p.name, { rss: v.rss + p.rssMb, fds: v.fds + p.fds });
    }
    for (const [name, v] of sums) {
      const e = byName.get(name) ?? { t: [], rss: [], fds: [] };
      e.t.push((s.at - t0) / 60_000);
      e.rss.push(v.rss);
      e.fds.push(v.fds);
      byName.set(name, e);
    }
  }
  // `magus dev`'s heap in use (sampled at any point of V8's collection cycle: noisy, but a leak climbs through it).
  const heap = samples.filter((s) => s.devHeapMb !== undefined);
  const heapOf = (name: string) =>
    name === 'magus dev' && heap.length >= 2
      ? { heapMbPerMin: slope(heap.map((s) => (s.at - t0) / 60_000), heap.map((s) => s.devHeapMb!)), heapMb: [heap[0]!.devHeapMb!, heap[heap.length - 1]!.devHeapMb!] as [number, number] }
      : {};
  return [...byName].map(([name, e]) => ({
    name,
    rssMbPerMin: slope(e.t, e.rss),
    fdsPerMin: slope(e.t, e.fds),
    rssMb: [e.rss[0]!, e.rss[e.rss.length - 1]!] as [number, number],
    fds: [e.fds[0]!, e.fds[e.fds.length - 1]!] as [number, number],
    ...heapOf(name),
  }));
}

export function printReport(r: SoakReport, log: (line: string) => void): void {
  const sec = (ms: number) => `${Math.round(ms / 1000)} s`;
  log(`session TTL ${sec(r.sessionTtlMs)} (MAGUS_SESSION_TTL_MS); a conversation got turns for ${sec(r.conversationMs)}, then was left to expire`);
  log('requests: ' + Object.entries(r.requests).map(([k, v]) => `${k} ${v.ok} ok${v.injected ? ` / ${v.injected} disconnected (injected)` : ''}${v.errors ? ` / ${v.errors} ERRORS` : ''}`).join('; '));
  for (const e of r.errors) log(`  error: ${e}`);
  log('latency per minute (answered requests, ms): ' + r.perMinute.map((m) => `${m.minute}: n ${m.n} p50 ${fmt(m.p50, 0)} p99 ${fmt(m.p99, 0)} max ${fmt(m.max, 0)}`).join(' | '));
  const slopeLines = (slopes: Slope[]) => {
    for (const s of slopes) {
      const heap = s.heapMb ? `   V8 heap in use ${fmt(s.heapMb[0], 1)} → ${fmt(s.heapMb[1], 1)} (${fmt(s.heapMbPerMin!, 2)}/min)` : '';
      log(`  ${s.name.padEnd(24)} ${fmt(s.rssMb[0], 1)} → ${fmt(s.rssMb[1], 1)} (${fmt(s.rssMbPerMin, 2)}/min)   ${s.fds[0]} → ${s.fds[1]} (${fmt(s.fdsPerMin, 2)}/min)${heap}`);
    }
  };
  log('after warm-up, per process (summed by name): RSS MB first→last (slope MB/min), open fds first→last (slope /min)');
  slopeLines(r.slopes);
  if (r.afterExpiry) {
    log(`after the first sessions expired (minute ${fmt(r.afterExpiry.fromMin, 1)} on), the same:`);
    slopeLines(r.afterExpiry.slopes);
  } else log('no sample after the first sessions could expire (warm-up or a conversation, whichever is longer, + the TTL): no slope after expiry');
  log('per minute: conversations started / live (a turn within the TTL) / magus_sessions keys (stream messages, delete markers included) / session workflows running / leases in the pool / pool workflow: history events (runs so far) / Temporal DB MB / JetStream MB (MAGUS_RESPONSES) / RSS MB (magus dev: its V8 heap in use, workflows its Temporal workers cache)');
  for (const t of r.timeline) {
    const rss = Object.entries(t.rssMb)
      .sort(([a], [b]) => a.localeCompare(b))
      .map(([name, mb]) => `${name} ${fmt(mb, 0)}${name === 'magus dev' && t.devHeapMb !== undefined ? ` (heap ${fmt(t.devHeapMb, 0)}${t.devCachedWorkflows === undefined ? '' : `, ${t.devCachedWorkflows} workflows cached`})` : ''}`)
      .join(', ');
    log(`  ${String(t.minute).padStart(3)}: ${t.conversations} / ${t.live} / ${t.sessionKeys} (${t.sessionMessages}) / ${t.sessionWorkflows ?? '—'} / ${t.poolLeases ?? '—'} / ${t.poolEvents ?? '—'} (${t.poolRuns}) / ${t.temporalDbMb === undefined ? '—' : fmt(t.temporalDbMb, 1)} / ${fmt(t.jetStreamMb, 1)} (${fmt(t.responsesMb, 1)}) / ${rss}`);
  }
  log(`NATS consumers first → last: ${Object.keys(r.consumers.last).map((k) => `${k} ${r.consumers.first[k] ?? 0}→${r.consumers.last[k]}`).join(', ')}`);
  const k = r.sessionKeys;
  log(`magus_sessions keys at the end: ${k.last} for ${k.live} live conversations (a turn within the TTL of ${sec(r.sessionTtlMs)}; ${k.liveWithGrace} within it + ${EXPIRY_GRACE_MS / 1000} s) of ${k.conversations} started; most keys above that at any sample: ${Math.max(0, k.worstExcess)}`);
  log(`re-pull: ${r.repull.detail}`);
  for (const c of r.poolChanges) log(`pool instances from ${c}`);
  if (r.pool) {
    const p = r.pool;
    const list = (o: Record<string, number>) => Object.entries(o).map(([k, v]) => `${k} ${v}`).join(', ') || 'none';
    log(`pool workflow: ${p.runs} runs, ${p.events} events; workflow tasks failed: ${list(p.taskFailures)}; timed out: ${p.taskTimeouts}; slowest task ${fmt(p.slowestTaskSec, 1)} s (scheduled → completed); activities: ${list(p.activities)}`);
  }
  log(r.leaks.length === 0 ? 'no leak found' : `LEAKS: ${r.leaks.join('; ')}`);
  if (r.logs) log(`magus dev's logs: ${r.logs}`);
}

if (require.main === module) {
  const args = process.argv.slice(2);
  const arg = (name: string, fallback: number) => {
    const i = args.indexOf(`--${name}`);
    return i >= 0 ? Number(args[i + 1]) : fallback;
  };
  const minutes = arg('minutes', 10);
  const log = (line: string) => process.stdout.write(`${line}\n`);
  const ttlSec = arg('session-ttl-sec', NaN);
  const conversationSec = arg('conversation-sec', NaN);
  const sessionTtlMs = Number.isNaN(ttlSec) ? undefined : ttlSec * 1000;
  if (sessionTtlMs !== undefined) {
    // What `magus dev` would refuse, refused before it starts.
    const { problem } = sessionTtlFrom({ MAGUS_SESSION_TTL_MS: String(sessionTtlMs) });
    if (problem !== undefined) {
      process.stderr.write(`soak: --session-ttl-sec ${args[args.indexOf('--session-ttl-sec') + 1]}: ${problem}\n`);
      process.exit(2);
    }
  }
  if (!Number.isNaN(conversationSec) && !(conversationSec > 0)) {
    process.stderr.write('soak: --conversation-sec must be a number of seconds above 0\n');
    process.exit(2);
  }
  runSoak({
    durationMs: minutes * 60_000,
    concurrency: arg('concurrency', 6),
    newPerSec: arg('new-per-sec', 2),
    sampleMs: arg('sample-sec', 10) * 1000,
    warmupShare: 0.2,
    ...(sessionTtlMs === undefined ? {} : { sessionTtlMs }),
    ...(Number.isNaN(conversationSec) ? {} : { conversationMs: conversationSec * 1000 }),
    log,
  })
    .then((r) => {
      printReport(r, log);
      const errors = Object.values(r.requests).reduce((n, v) => n + v.errors, 0);
      process.exit(errors > 0 || r.leaks.length > 0 || !r.repull.ok ? 1 : 0);
    })
    .catch((err: unknown) => {
      process.stderr.write(`soak: ${(err as Error).stack ?? String(err)}\n`);
      process.exit(1);
    });
}

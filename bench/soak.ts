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
import { cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { connect, type NatsConnection } from 'nats';
import { dataPlaneNames } from '../dataplane';
import { SESSION_TTL_MS, sessionTtlFrom } from '../gateway/config';
import { poolWorkflowId } from '../workflows/pool/definitions';
import { devNatsAuth, type DevConnection } from '../workers/config';
import { MAGUS_BIN, printed, processTree, startDev, type DevRun } from '../test/harness/dev';
import { fmt } from './common';
import { buildReport, EXPIRY_GRACE_MS, printReport, type Kind, type Outcome, type SoakReport } from './soak-report';
import { demoPool, devGauges, natsSample, poolHistory, sampleProcess, sessionWorkflows, temporalDbMb, type ProcessSample, type Sample } from './soak-samples';
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

interface Conversation {
  id: string;
  startedAt: number;
  lastTurnAt: number;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
/** Longer than any answer of the demo model should take, cold start included. */
const REQUEST_TIMEOUT_MS = 60_000;

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
    nc = await connect({ servers: connection.nats.servers, ...devNatsAuth(connection) });
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

    const samples: Sample[] = [];
    const sampler = (async () => {
      while (Date.now() < until) {
        const processes = processTree(dev.child.pid!)
          .map(sampleProcess)
          .filter((p): p is ProcessSample => p !== undefined);
        const nats = await natsSample(nc, names);
        // Counted after the keys were: a key listed is never one of a conversation counted as gone.
        const at = Date.now();
        samples.push({
          at,
          processes,
          ...nats,
          conversations: conversations.length,
          live: turnedSince(at - ttlMs),
          liveWithGrace: turnedSince(at - ttlMs - EXPIRY_GRACE_MS),
          sessionWorkflows: await sessionWorkflows(workflows),
          temporalDbMb: temporalDbMb(data),
          ...(await devGauges(gatewayUrl)),
          pool: await demoPool(workflows),
        });
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
      sessionWorkflows: await sessionWorkflows(workflows),
      pool: await demoPool(workflows),
    };
    const r = buildReport(outcomes, samples, end, repulled, t0, { ...opts, sessionTtlMs: ttlMs, conversationMs });
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

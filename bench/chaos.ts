/**
 * `npm run bench:chaos`: live streams through magus while something breaks every few seconds
 * (issue "Streams that never break", §6), and what their clients saw.
 *
 * The system: a three-node NATS cluster (JetStream, streams and buckets at replicas 3), three
 * instances of one pool — each a real `magus engine` (llama.cpp, SmolLM2-135M-Instruct, the demo
 * model) under its supervisor and a bridge on a NATS connection of its own, all in this process —
 * and two `magus gateway` processes. Conversations are pinned to the instances round-robin (as
 * their sessions would place them; no Temporal: every turn is warm).
 *
 * The load: `CHAOS_STREAMS` clients (default 200), each streaming greedy answers of up to
 * `CHAOS_TOKENS` tokens (default 64) one after the other, to one of a few prompts, through one of
 * the gateways, with plain `fetch` and an SSE reader that does what the gateway's README asks of a
 * client that loses its stream: the same request again, to any gateway, with `Last-Event-ID`. The
 * clients run in a process of their own (chaos-clients.ts), apart from the bridges and the
 * engines' supervisors, as a worker's are from its clients: a late turn of one event loop neither
 * delays the other's work nor what the clients record (both loops' lateness is reported).
 * `CHAOS_CLIENT_PROCESSES` (default 1) shares the clients among that many processes: a client
 * then waits less on the others' work in its event loop (~100 of them lose their streams at once
 * at a gateway kill), as clients on their own machines would.
 *
 * Two phases of `CHAOS_MINUTES` each (default 10): undisturbed, then with a fault every
 * `CHAOS_FAULT_EVERY_S` seconds (default 10), in turn:
 * - an engine SIGKILLed (its supervisor starts it again; its answers are handed back and continued
 *   on another instance);
 * - an instance drained: unpublished from the pool's view, its bridge stopped with a 2 s drain
 *   deadline (what is in flight then is handed back), and started again;
 * - a gateway SIGKILLed (a new one is started; its clients resume on the other with `Last-Event-ID`);
 * - the NATS server leading the request stream SIGKILLed, started again 5 s later;
 * - the same for the response stream's leader;
 * - a revision rolled, as the pool workflow rolls one (without Temporal, which this bench does not
 *   run): a new instance (engine, standby, consumer, bridge) started and published in one's
 *   place, the old one drained (2 s deadline), stopped and its consumers deleted; its
 *   conversations move at their next turn (pinned to the new instance, as their session
 *   workflows would move them: left pinned to the old one, each turn went there and on a second
 *   later, and the requests left behind filled its subject until every turn was refused
 *   `backlog_full`). The same weights, so every answer is
 *   still compared with one reference (`test/serving-rollout.int.test.ts` rolls a real new
 *   revision under 50 live streams, through the workflow).
 *
 * Each engine has one on standby beside it, warm (its context made), as a worker's local runtime
 * keeps by default when the memory allows; `CHAOS_STANDBY=mapped`: its model mapped only (a start
 * makes its context); `0`: none (a killed engine is started again from nothing).
 * `CHAOS_MAX_QUEUE_WAIT` sets the gateways' bound on a turn's wait in its queue (a duration as
 * `MAGUS_MAX_QUEUE_WAIT` takes it, e.g. `5s`; default 0: none, so the streams queue as deep as
 * they come — 200 clients on 12 slots wait ~2 minutes each, and the unlucky ones past the
 * gateways' 5-minute deadline; production's default is 5 s, and the turns over it are then
 * refused 429 and retried by the client after its `Retry-After`, counted apart. A bound here also
 * moves warm turns off long queues, which asks Temporal, and this bench runs none).
 * `CHAOS_FAULTS` (comma-separated: engine, drain, gateway, requests-leader, responses-leader, roll)
 * limits the faults to those kinds; `CHAOS_BASELINE=0` skips the undisturbed phase; with
 * `CHAOS_VERBOSE`, `CHAOS_SILENCE_SHOWN_MS` (default 2000) is the silence over which a client's is logged with its reconnects;
 * `CHAOS_ANSWERS=<file>` appends every answer of each phase to that file, one JSON line each (its
 * times, reconnects and the instances its event ids named). Reported per phase: answers, streams broken (ended without their whole answer: an error, or given
 * up after 20 reconnects), texts differing from the undisturbed reference (each prompt answered
 * alone before the phases), pieces more or fewer than the reference's (repeated or missing
 * tokens), the longest silence a client saw between two pieces of an answer (p99 and max over
 * answers), reconnects, completion tokens/s, and the wait for an answer's first piece (verbose:
 * apart for the answers moved before it, from the gateways' logs).
 */
import { fork, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { appendFileSync, mkdtempSync, rmSync } from 'node:fs';
import { cpus, loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { connect, type NatsConnection } from 'nats';
import { startSupervisedEngine, type LlamaCppEngine } from '../activities/runtime/llama-cpp';
import type { Supervised } from '../activities/runtime/supervise';
import { declareOnReconnect, deleteInstanceConsumer, ensureDataPlane, ensureInstanceConsumer, type DataPlaneNames } from '../dataplane';
import { startBridge, type Bridge } from '../dataplane/bridge';
import { openModelRegistry } from '../dataplane/registry';
import { tokenDigest } from '../gateway/plugins/auth';
import { conversationKey } from '../gateway/serving/conversation';
import { demoModelFile } from '../workers/dev/demo-model';
import { freePort } from '../workers/dev/services';
import { pinConversation, publishPoolView } from '../test/harness/gateway';
import { readyModel } from '../test/harness/gateway-app';
import { startNatsCluster, type TestNatsCluster } from '../test/harness/nats-cluster';
import { commonPrefix } from '../test/harness/timed-stream';
import { eventually, sleep } from '../test/harness/wait';
import { answer, watchLoop, type Answer, type ClientContext, type FromClients, type ToClients } from './chaos-clients';
import { fmt, p50, p99, quantile, spawnGateway, type GatewayProcess } from './common';

const env = (name: string, fallback: number) => (process.env[name] !== undefined ? Number(process.env[name]) : fallback);
const STREAMS = env('CHAOS_STREAMS', 200);
const TOKENS = env('CHAOS_TOKENS', 64);
const MINUTES = env('CHAOS_MINUTES', 10);
const FAULT_EVERY_S = env('CHAOS_FAULT_EVERY_S', 10);
const SLOTS = env('CHAOS_SLOTS', 4);
/** The clients' processes, the streams shared among them (`CHAOS_CLIENT_PROCESSES`, default 1: every client in one event loop). */
const CLIENT_PROCESSES = Math.max(1, env('CHAOS_CLIENT_PROCESSES', 1));
const INSTANCES = ['i1', 'i2', 'i3'];
/** The instances the pool publishes now: {@link INSTANCES}, each replaced by a new one at a roll. */
let instances = [...INSTANCES];
/** How long a conversation's pin lasts (the whole bench). */
const PIN_TTL_MS = 4 * 3_600_000;
/** Each conversation's key and the instance it is pinned to. */
const pins = new Map<string, string>();
/** Instances a roll started so far (the next is `i${INSTANCES.length + rolled + 1}`). */
let rolled = 0;
/**
 * The engines' `--resume-slots`: by default what crds/README.md recommends for a pool of this
 * shape (`leasesPerInstance / (replicas − 1)`: a lost instance's answers all go on at once on the others).
 */
const RESUME_SLOTS = env('CHAOS_RESUME_SLOTS', Math.ceil(SLOTS / (INSTANCES.length - 1)));
/** The engines' standby (`CHAOS_STANDBY`, the file comment). */
const STANDBY = process.env.CHAOS_STANDBY === '0' ? 'none' : process.env.CHAOS_STANDBY === 'mapped' ? 'mapped' : 'warm';
/** The engines keep KV snapshots (engine/snapshots.ts) unless `CHAOS_SNAPSHOTS=0`. */
const SNAPSHOTS = process.env.CHAOS_SNAPSHOTS !== '0';
/** The gateways' bound on a turn's expected wait in its queue (`MAGUS_MAX_QUEUE_WAIT`; above). */
const QUEUE_WAIT = process.env.CHAOS_MAX_QUEUE_WAIT ?? '0';
/** Their directory, all instances' (removed at the end). */
const KV_DIR = mkdtempSync(join(tmpdir(), 'magus-chaos-kv-'));
const POOL = 'chaos';
const TOKEN_ID = 'chaos';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(16).toString('hex')}`;
const SECRET = randomBytes(32).toString('hex');
const PROMPTS = ['a small boat', 'a red fox', 'the northern sea', 'an old lamp', 'the green hills', 'a quiet town'].map((p) => `Tell me a story about ${p}.`);
/** Reconnects before a client gives an answer up as broken. */
const MAX_RECONNECTS = 20;

const log = (line: string) => console.log(`${new Date().toISOString().slice(11, 23)} ${line}`);

let cluster: TestNatsCluster;
let worker: NatsConnection;
let names: DataPlaneNames;
const engines: Record<string, Supervised<LlamaCppEngine>> = {};
/** The demo model's file, every engine's. */
let gguf: string;
const bridges: Record<string, { bridge: Bridge; nc: NatsConnection }> = {};
let gateways: GatewayProcess[] = [];
/** The clients' processes (chaos-clients.ts): `CHAOS_CLIENT_PROCESSES`, each with a share of the streams. */
let clients: ChildProcess[] = [];
/** Tells the clients' processes the gateways there are now. */
const gatewaysChanged = () => {
  for (const c of clients) c.send({ type: 'gateways', gateways: gateways.map((g) => g.url) } satisfies ToClients);
};
/** Each fault: what, of which kind, and when it began. */
/** Verbose: when each answer (by its id) was first moved to another instance, as its gateway logged it. */
const firstMoves = new Map<string, number>();
/** What a gateway logs when it moves an answer (routes/inference.ts: handed back, or its bridge silent). */
const MOVED = /continued elsewhere|continuing it elsewhere/;
/** A gateway's log lines shown with CHAOS_VERBOSE besides warnings: moves, and frames read back after a reconnect. */
const SHOWN = /continued elsewhere|continuing it elsewhere|stored while NATS was unreachable|resumed stream|exchange: /;

/** Verbose: silences longer than this (ms, `CHAOS_SILENCE_SHOWN_MS`; default the 2-s target) are logged with their reconnects. */
const SILENCE_SHOWN_MS = Number(process.env.CHAOS_SILENCE_SHOWN_MS ?? 2_000);

/** Each fault: when it began (`at`) and when it was done (`end`: a drain's comes after its deadline). */
const faults: { what: string; kind: string; at: number; end: number }[] = [];

/** When each gateway (by URL) began to listen: a resume's line says whether it went to one just started. */
const gatewayListening = new Map<string, number>();

async function startGateway(): Promise<GatewayProcess> {
  const gateway = await spawnGateway(
    {
      ...process.env,
      MAGUS_NATS_URL: cluster.servers.join(','),
      MAGUS_NATS_PREFIX: names.prefix,
      MAGUS_GATEWAY_HOST: '127.0.0.1',
      MAGUS_GATEWAY_PORT: '0',
      MAGUS_GATEWAY_SECRET: SECRET,
      MAGUS_GATEWAY_TOKENS: JSON.stringify({ [TOKEN_ID]: { digest: tokenDigest(TOKEN), name: 'bench:chaos' } }),
      MAGUS_GATEWAY_REQUEST_TIMEOUT_MS: String(5 * 60_000),
      // Its streams queue at their instances by design (~65 each): no bound on the wait, or most
      // turns would be refused (429 queue_full) and retried, and the run would measure that
      // (`CHAOS_MAX_QUEUE_WAIT`: the gateways' bound, a duration, as production sets it).
      MAGUS_MAX_QUEUE_WAIT: QUEUE_WAIT,
      // Warm turns only: Temporal is never asked.
      MAGUS_TEMPORAL_ADDRESS: `127.0.0.1:${await freePort()}`,
      MAGUS_LOG_LEVEL: process.env.CHAOS_VERBOSE ? 'info' : 'warn',
    },
    { stdout: process.env.CHAOS_VERBOSE ? 'pipe' : 'ignore' },
  );
  // Verbose: the gateway's moves and warnings (what it wrote before it listened is still buffered).
  const { child } = gateway;
  let partial = '';
  child.stdout?.on('data', (d: Buffer) => {
    const lines = (partial + d.toString()).split('\n');
    partial = lines.pop()!;
    for (const line of lines)
      if (SHOWN.test(line) || /"level":[45]0/.test(line)) {
        const { time, msg, instance, inferenceId, ...rest } = JSON.parse(line) as Record<string, unknown> & {
          time: number;
          msg: string;
          instance?: string;
          inferenceId?: string;
        };
        for (const k of ['level', 'pid', 'hostname']) delete rest[k]; // pino's own
        if (inferenceId && MOVED.test(msg) && !firstMoves.has(inferenceId)) firstMoves.set(inferenceId, time);
        const more = Object.keys(rest).length > 0 ? ` ${JSON.stringify(rest)}` : '';
        log(`gateway ${child.pid}: ${new Date(time).toISOString().slice(11, 23)} ${msg} ${inferenceId ?? ''} → ${instance ?? ''}${more}`);
      }
  });
  gatewayListening.set(gateway.url, Date.now());
  return gateway;
}

async function startInstanceBridge(instance: string): Promise<void> {
  const nc = await connect({ servers: cluster.servers, name: `bridge-${instance}`, maxReconnectAttempts: -1, reconnectTimeWait: 250 });
  const bridge = await startBridge({
    nc,
    names,
    pool: POOL,
    instance,
    engineUrl: engines[instance]!.current.url,
    slots: SLOTS,
    drainTimeoutMs: 2000,
    log: process.env.CHAOS_VERBOSE ? (line) => log(`bridge ${instance}: ${line}`) : () => undefined,
  });
  bridges[instance] = { bridge, nc };
}

/** Starts an instance: its engine (with its standby), its consumers and its bridge. */
async function startInstance(instance: string): Promise<void> {
  engines[instance] = await startSupervisedEngine(gguf, {
    modelId: POOL,
    slots: SLOTS,
    resumeSlots: RESUME_SLOTS,
    threads: 1,
    ctx: 4096,
    startTimeoutSec: 120,
    name: `engine-${instance}`,
    log: process.env.CHAOS_VERBOSE ? (line) => log(`engine ${instance}: ${line}`) : () => undefined,
    ...(process.env.CHAOS_VERBOSE ? { output: (line: string) => /"level":5|error|KV snapshot/i.test(line) && log(`engine ${instance}: ${line}`) } : {}),
    stopGraceMs: 1000,
    restart: { maxRestarts: 1000, backoffMs: 0 },
    // An engine on standby beside each, as a worker's runtime keeps (MAGUS_ENGINE_STANDBY).
    ...(STANDBY !== 'none' ? { standby: STANDBY } : {}),
    // KV snapshots in one directory for all, as the local runtime gives its engines.
    ...(SNAPSHOTS ? { snapshots: KV_DIR } : {}),
  });
  await ensureInstanceConsumer(await worker.jetstreamManager(), names, { pool: POOL, instance, slots: SLOTS });
  await startInstanceBridge(instance);
}

/** `measure` of the answers first published on each instance (their first event id names it), by instance. */
function byInstance(answers: Answer[], measure: (of: Answer[]) => string): string {
  const by = new Map<string, Answer[]>();
  for (const a of answers) by.set(a.instance ?? '?', [...(by.get(a.instance ?? '?') ?? []), a]);
  return [...by]
    .sort(([x], [y]) => x.localeCompare(y))
    .map(([i, of]) => `${i} (${of.length}) ${measure(of)}`)
    .join('; ');
}

const longestGap = (a: Answer) => a.times.slice(1).reduce((m, t, i) => Math.max(m, t - a.times[i]!), 0);

/** The reconnects of `a` between `from` and `to`: each's times after `from` (stream lost, asked again, its request written, the answer's headers, first event). */
function resumesIn(a: Answer, from: number, to: number): string {
  const at = (t?: number) => (t === undefined ? '-' : `${t >= from ? '+' : ''}${fmt((t - from) / 1000)}`);
  const within = a.resumes.filter((r) => r.lost >= from && r.lost <= to);
  return within.length === 0
    ? ''
    : `; reconnects (lost, asked, written, headers, first event, in s; on the gateway listening since): ${within
        .map((r) =>
          [...[r.lost, r.asked, r.written, r.headers, r.event].map(at), at(r.gateway === undefined ? undefined : gatewayListening.get(r.gateway))].join(' '),
        )
        .join('; ')}`;
}

/** The longest silence between two pieces of any answer after each kind of fault: the gap is the last fault's that began before it ended. */
function gapsByFault(answers: Answer[]): Map<string, number> {
  const out = new Map<string, number>();
  for (const a of answers)
    for (let i = 1; i < a.times.length; i++) {
      const gap = a.times[i]! - a.times[i - 1]!;
      const cause = faults.find((f) => f.end > a.times[i - 1]! - 2_000 && f.at < a.times[i]!);
      const kind = cause?.kind ?? 'none';
      if (gap > SILENCE_SHOWN_MS && process.env.CHAOS_VERBOSE)
        log(
          `silence of ${fmt(gap / 1000)} s from ${new Date(a.times[i - 1]!).toISOString().slice(11, 23)} (${a.id}, ${a.reconnects} reconnects): after ${cause?.what ?? 'no fault'}${resumesIn(a, a.times[i - 1]!, a.times[i]!)}`,
        );
      out.set(kind, Math.max(out.get(kind) ?? 0, gap));
    }
  return out;
}

/**
 * The reconnects of answers under way (a piece received) that a gateway kill cut — lost within 2 s
 * after one — all of them: how long each client took to ask again, and the replica it asked to
 * send the headers (with the first event, for an answer under way) — a distribution, where the
 * longest silence is one stream's tail. Answers still queued resume too, but have no piece to wait for.
 */
function resumesAfterGatewayKills(answers: Answer[]): string[] {
  const kills = faults.filter((f) => f.kind === 'gateway');
  if (kills.length === 0) return [];
  const resumes = answers.flatMap((a) =>
    a.resumes.filter(
      (r) =>
        r.asked !== undefined &&
        r.headers !== undefined &&
        a.times[0] !== undefined &&
        a.times[0] < r.lost &&
        kills.some((f) => r.lost >= f.at && r.lost <= f.end + 2_000),
    ),
  );
  const of = (ms: number[]) => `p50 ${fmt(p50(ms) / 1000)} / p90 ${fmt(quantile(ms, 0.9) / 1000)} / max ${fmt(Math.max(0, ...ms) / 1000)} s`;
  const written = resumes.filter((r) => r.written !== undefined);
  return [
    `  answers under way resumed after gateway kills (${resumes.length}): lost → asked ${of(resumes.map((r) => r.asked! - r.lost))}; ` +
      `asked → written ${of(written.map((r) => r.written! - r.asked!))}; ` +
      `written → headers ${of(written.map((r) => r.headers! - r.written!))}; lost → headers ${of(resumes.map((r) => r.headers! - r.lost))}`,
  ];
}

async function phase(name: string, reference: Answer[], sessions: string[], withFaults: boolean): Promise<string> {
  const until = Date.now() + MINUTES * 60_000;
  const answers: Answer[] = [];
  const started = Date.now();
  let stop = false;
  // Faults for the phase's minutes; the answers still running then end without.
  const faulting = withFaults ? faultLoop(() => stop || Date.now() >= until) : Promise.resolve();
  // This process's event loop (its bridges and engine supervisors): a late turn delays what they
  // do — hearing an engine's death, relaying its frames. The clients' own is measured there.
  const watched = watchLoop();
  const progress = setInterval(() => {
    const tokens = answers.reduce((n, a) => n + (a.completionTokens ?? 0), 0);
    log(`${name}: ${answers.length} answers, ${tokens} tokens, ${fmt(Math.max(0, until - Date.now()) / 60_000, 1)} min left`);
  }, 30_000);
  // The clients, in their processes: every answer as it ends, until each client's last turn has.
  const share = Math.ceil(sessions.length / clients.length);
  const clientsDone = await Promise.all(
    clients.map(
      (proc, n) =>
        new Promise<Extract<FromClients, { type: 'phase-done' }>>((resolve, reject) => {
          const onMessage = (m: FromClients) => {
            if (m.type === 'answer') answers.push(m.answer);
            else {
              proc.off('message', onMessage).off('exit', onExit);
              resolve(m);
            }
          };
          const onExit = (code: number | null) => reject(new Error(`a clients' process exited (${code}) mid-phase`));
          proc.on('message', onMessage).once('exit', onExit);
          proc.send({ type: 'phase', sessions: sessions.slice(n * share, (n + 1) * share), first: n * share, until } satisfies ToClients);
        }),
    ),
  );
  clearInterval(progress);
  // Every answer of the phase, one JSON line each, for a closer look than the report's.
  if (process.env.CHAOS_ANSWERS) appendFileSync(process.env.CHAOS_ANSWERS, answers.map((a) => `${JSON.stringify({ phase: name, ...a })}\n`).join(''));
  // The clients' processes' together: the worst p99 and max, every late turn.
  const clientsLate = clientsDone.map((d) => d.lateness);
  const lateness = {
    bridges: watched(),
    clients: {
      p99Ms: Math.max(...clientsLate.map((l) => l.p99Ms)),
      maxMs: Math.max(...clientsLate.map((l) => l.maxMs)),
      late: clientsLate.flatMap((l) => l.late),
    },
  };
  if (process.env.CHAOS_VERBOSE)
    for (const [whose, l] of Object.entries(lateness))
      for (const turn of l.late) console.log(`${new Date(turn.at).toISOString().slice(11, 23)} the ${whose}' event loop ${turn.ms} ms late`);
  stop = true;
  await faulting;
  const seconds = (Date.now() - started) / 1000;
  const broken = answers.filter((a) => !a.done || a.error !== undefined);
  const whole = answers.filter((a) => a.done && a.error === undefined);
  const differing = whole.filter((a) => a.text !== reference[a.prompt]!.text);
  if (process.env.CHAOS_VERBOSE)
    for (const a of differing) {
      const ref = reference[a.prompt]!.text;
      const at = commonPrefix(a.text, ref);
      const around = (t: string) => JSON.stringify(t.slice(Math.max(0, at - 12), at + 24));
      const began = a.times[0] === undefined ? '?' : new Date(a.times[0]).toISOString().slice(11, 23);
      log(
        `differs: ${a.id} (prompt ${a.prompt} on ${a.instance ?? '?'}, first piece ${began}) from character ${at} of ${ref.length}, ${around(ref)} → ${around(a.text)}; longest silence ${fmt(longestGap(a) / 1000)} s, ${a.reconnects} reconnects`,
      );
    }
  const offPieces = whole.reduce((n, a) => n + Math.abs(a.pieces - reference[a.prompt]!.pieces), 0);
  const gaps = whole.map(longestGap);
  const tokens = whole.reduce((n, a) => n + (a.completionTokens ?? 0), 0);
  // The wait for an answer's first piece; apart, those moved before it (handed back with nothing said: a drain's queue).
  const firstWait = (of: Answer[]) => of.filter((a) => a.times.length > 0).map((a) => a.times[0]! - a.asked);
  const movedFirst = answers.filter((a) => {
    const moved = a.id === undefined ? undefined : firstMoves.get(a.id.replace(/^chatcmpl-/, ''));
    return moved !== undefined && a.times.length > 0 && moved < a.times[0]!;
  });
  const waits = (of: Answer[]) => {
    const w = firstWait(of);
    return `p50 ${fmt(p50(w) / 1000)} s / p99 ${fmt(p99(w) / 1000)} s / max ${fmt(Math.max(0, ...w) / 1000)} s`;
  };
  const reasons = new Map<string, number>();
  // With how far each had come: a deadline passed in a queue (no piece yet) is not a stream cut mid-answer.
  for (const a of broken) {
    const why = `${a.error ?? 'no [DONE]'}, ${a.pieces === 0 ? 'before its first piece' : `after ${a.pieces} pieces`}`;
    reasons.set(why, (reasons.get(why) ?? 0) + 1);
  }
  return [
    `${name} (${fmt(seconds / 60, 1)} min${withFaults ? `, ${faults.length} faults` : ''}): ${answers.length} answers, ${broken.length} broken, ` +
      `${differing.length} differing from the reference, ${offPieces} pieces repeated or missing, ` +
      `longest silence between pieces p99 ${fmt(p99(gaps) / 1000)} s / max ${fmt(Math.max(0, ...gaps) / 1000)} s, ` +
      `${answers.reduce((n, a) => n + a.reconnects, 0)} reconnects, ${answers.reduce((n, a) => n + a.refused, 0)} refusals retried, ` +
      `${fmt(tokens / seconds, 1)} completion tokens/s`,
    `  wait for the first piece: ${waits(answers)}${process.env.CHAOS_VERBOSE ? `; of the ${movedFirst.length} moved before it: ${movedFirst.length > 0 ? waits(movedFirst) : '-'}` : ''}`,
    ...(process.env.CHAOS_VERBOSE ? [`  wait for the first piece by the instance first asked: ${byInstance(answers, waits)}`] : []),
    `  event loops late: the bridges' and supervisors' p99 ${fmt(lateness.bridges.p99Ms, 0)} / max ${fmt(lateness.bridges.maxMs, 0)} ms, the clients' p99 ${fmt(lateness.clients.p99Ms, 0)} / max ${fmt(lateness.clients.maxMs, 0)} ms`,
    ...[...reasons].map(([why, n]) => `  broken: ${n} × ${why}`),
    ...(withFaults ? resumesAfterGatewayKills(whole) : []),
    ...(withFaults
      ? [
          `  longest silence by the fault before it: ${[...gapsByFault(whole)]
            .sort()
            .map(([kind, ms]) => `${kind} ${fmt(ms / 1000)} s`)
            .join(', ')}`,
        ]
      : []),
  ].join('\n');
}

async function faultLoop(stopped: () => boolean): Promise<void> {
  const all = ['engine', 'drain', 'gateway', 'requests-leader', 'responses-leader', 'roll'] as const;
  const chosen = process.env.CHAOS_FAULTS?.split(',');
  const kinds = chosen ? all.filter((k) => chosen.includes(k)) : all;
  const jsm = await worker.jetstreamManager();
  for (let n = 0; !stopped(); n++) {
    for (let waited = 0; waited < FAULT_EVERY_S * 1000 && !stopped(); waited += 250) await sleep(250);
    if (stopped()) return;
    const kind = kinds[n % kinds.length]!;
    const instance = instances[Math.floor(Math.random() * instances.length)]!;
    const at = Date.now();
    const fault = (what: string) => faults.push({ what, kind, at, end: Date.now() });
    try {
      switch (kind) {
        case 'engine':
          process.kill(engines[instance]!.current.process.child.pid!, 'SIGKILL');
          fault(`engine of ${instance} SIGKILLed`);
          break;
        case 'drain': {
          await publishPoolView(
            worker,
            names,
            POOL,
            instances.filter((i) => i !== instance),
            1000,
          );
          const { bridge, nc } = bridges[instance]!;
          await bridge.stop();
          await nc.close();
          await startInstanceBridge(instance);
          await publishPoolView(worker, names, POOL, instances, 1000);
          fault(`${instance} drained and started again`);
          break;
        }
        case 'roll': {
          rolled += 1;
          const next = `i${INSTANCES.length + rolled}`;
          await startInstance(next);
          instances = instances.map((i) => (i === instance ? next : i));
          await publishPoolView(worker, names, POOL, instances, 1000);
          for (const [key, at] of pins)
            if (at === instance) {
              pins.set(key, next);
              await pinConversation(worker, names, key, POOL, next, PIN_TTL_MS);
            }
          const { bridge, nc } = bridges[instance]!;
          await bridge.stop();
          if (process.env.CHAOS_VERBOSE) log(`bridge ${instance}: ${JSON.stringify(bridge.stats)}`);
          await nc.close();
          delete bridges[instance];
          await engines[instance]!.stop();
          delete engines[instance];
          await deleteInstanceConsumer(jsm, names, { pool: POOL, instance });
          fault(`${instance} rolled over to ${next}`);
          break;
        }
        case 'gateway': {
          const victim = gateways[n % gateways.length]!;
          victim.child.kill('SIGKILL');
          await victim.exited;
          gateways = gateways.filter((g) => g !== victim);
          gatewaysChanged();
          gateways.push(await startGateway());
          gatewaysChanged();
          fault('a gateway SIGKILLed, another started');
          break;
        }
        case 'requests-leader':
        case 'responses-leader': {
          const stream = kind === 'requests-leader' ? names.requestStream : names.responseStream;
          const leader = (await jsm.streams.info(stream)).cluster?.leader;
          if (!leader) break;
          await cluster.kill(leader);
          fault(`${stream}'s leader ${leader} SIGKILLed`);
          await sleep(5000);
          await cluster.restart(leader);
          break;
        }
      }
      log(`fault: ${faults.at(-1)?.what}`);
    } catch (err) {
      log(`fault ${kind} failed: ${(err as Error).message}`);
    }
  }
}

async function main(): Promise<void> {
  log(`bench:chaos: ${STREAMS} streams over ${INSTANCES.length} instances (${SLOTS} slots each), ${TOKENS} tokens, 2 × ${MINUTES} min; ${cpus().length} cores`);
  cluster = await startNatsCluster({ syncInterval: '2m' });
  worker = await connect({ servers: cluster.servers, name: 'chaos-worker', maxReconnectAttempts: -1, reconnectTimeWait: 250 });
  const prefix = `X${randomBytes(3).toString('hex').toUpperCase()}`;
  const declare = () => ensureDataPlane(worker, { prefix, replicas: 3, responseMaxBytes: 256 * 2 ** 20 });
  // A cluster just started may not have every peer in its meta group yet ("no suitable peers for placement").
  await eventually(declare, 30_000);
  names = await declareOnReconnect(worker, declare, {
    what: 'data plane',
    log,
  });
  // A bucket just declared on a cluster may have no leader yet (503): tried until it has.
  const registry = await openModelRegistry(worker, names.modelsBucket);
  await eventually(() => registry.put(readyModel(POOL)), 30_000);
  gguf = await demoModelFile(log);
  for (const instance of INSTANCES) await startInstance(instance);
  await publishPoolView(worker, names, POOL, instances, 1000);
  // Fresh for the gateways' staleness bound while the bench runs.
  const views = setInterval(() => void publishPoolView(worker, names, POOL, instances, 1000).catch(() => undefined), 30_000);
  gateways = [await startGateway(), await startGateway()];
  const context: Omit<ClientContext, 'gateways'> = {
    pool: POOL,
    token: TOKEN,
    tokenId: TOKEN_ID,
    secret: SECRET,
    prompts: PROMPTS,
    maxTokens: TOKENS,
    maxReconnects: MAX_RECONNECTS,
  };
  clients = Array.from({ length: CLIENT_PROCESSES }, () => fork(join(__dirname, 'chaos-clients.ts'), [], { execArgv: ['-r', '@swc-node/register'] }));
  for (const c of clients) c.send({ type: 'start', context, gateways: gateways.map((g) => g.url) } satisfies ToClients);
  const sessions = Array.from({ length: STREAMS }, (_, n) => `chaos-${n}`);
  for (const [n, session] of sessions.entries()) {
    const key = conversationKey(SECRET, { scope: TOKEN_ID, model: `default/${POOL}`, messages: [], sessionId: session });
    const instance = INSTANCES[n % INSTANCES.length]!;
    pins.set(key, instance);
    await pinConversation(worker, names, key, POOL, instance, PIN_TTL_MS);
  }
  // The undisturbed answers: each prompt alone.
  const reference: Answer[] = [];
  for (const [p] of PROMPTS.entries()) reference.push(await answer({ ...context, gateways: () => gateways.map((g) => g.url) }, p, sessions[p]!, p));
  for (const r of reference) if (!r.done || r.error) throw new Error(`a reference answer failed: ${r.error ?? 'no [DONE]'}`);
  log(`reference answers: ${reference.map((r) => `${r.pieces} pieces`).join(', ')}`);
  const report: string[] = [];
  try {
    if (process.env.CHAOS_BASELINE !== '0') {
      report.push(await phase('undisturbed', reference, sessions, false));
      log(report.at(-1)!);
    }
    report.push(await phase('with faults', reference, sessions, true));
    log(report.at(-1)!);
  } finally {
    if (process.env.CHAOS_VERBOSE) {
      // Every answer is in; a bridge acks its last ones once their frames are stored, a moment later.
      const idle = () => Object.values(bridges).every(({ bridge }) => bridge.stats.inFlight === 0);
      for (const until = Date.now() + 10_000; !idle() && Date.now() < until;) await sleep(200);
      for (const [i, { bridge }] of Object.entries(bridges)) log(`bridge ${i}: ${JSON.stringify(bridge.stats)}`);
    }
    clearInterval(views);
    for (const c of clients) c.kill('SIGKILL');
    for (const g of gateways) g.child.kill('SIGKILL');
    await Promise.all(gateways.map((g) => g.exited));
    for (const { bridge, nc } of Object.values(bridges)) {
      await bridge.stop().catch(() => undefined);
      await nc.close().catch(() => undefined);
    }
    for (const e of Object.values(engines)) await e.stop().catch(() => undefined);
    rmSync(KV_DIR, { recursive: true, force: true });
    await worker.close().catch(() => undefined);
    await cluster.stop();
  }
  console.log(
    `\nbench:chaos — ${cpus().length} cores, load average ${loadavg()
      .map((l) => fmt(l, 1))
      .join(' ')}`,
  );
  console.log(
    `${STREAMS} streams, ${INSTANCES.length} instances × ${SLOTS} slots + ${RESUME_SLOTS} resume sequences (engines on standby: ${STANDBY}; KV snapshots: ${SNAPSHOTS ? 'kept' : 'none'}; queue wait bound: ${QUEUE_WAIT}), SmolLM2-135M-Instruct greedy, ${TOKENS} tokens`,
  );
  console.log(report.join('\n'));
  console.log(`faults: ${faults.map((f) => f.what).join('; ')}`);
}

main().then(
  () => process.exit(0),
  (err: unknown) => {
    console.error(err);
    process.exit(1);
  },
);

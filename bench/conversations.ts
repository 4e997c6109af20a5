/**
 * New conversations at scale, against a fresh `magus dev` with its default session TTL (30 min) and
 * the tiny demo model (`--demo tiny`: what is measured is the control plane, not the engine):
 * steps up the rate of new conversations (each a first turn, `max_tokens: 1`, a conversation id of
 * its own) and, in the same run on the same machine, measures Temporal's bare workflow-start rate
 * (the floor: workflows of a type no worker runs, started as fast as 32 callers can).
 *
 *   npm run bench:conversations                                # 10, 20, 40, 80, 160/s, 2 min each
 *   npm run bench:conversations -- --rates 50 --minutes 10     # a 10-minute hold at one rate
 *   npm run bench:conversations -- --rates 10,20 --step-sec 30 --seed-live 100000
 *   npm run bench:conversations -- --demo smollm2 --max-tokens 16 --in-flight 256 --rates 8,16 --max-queue-wait 5s --no-floor
 *   npm run bench:conversations -- --rates 45 --minutes 10 --ttl 120000          # steady state: sessions expire as they start
 *
 * `--demo smollm2` serves dev's default demo (SmolLM2-135M-Instruct: the engine is the limit)
 * instead of the tiny one; `--max-tokens` (default 1) is each turn's answer; `--in-flight N`
 * holds the client to N turns at once (the generator waits for one to end, as a client with a
 * connection pool does); `--stream` streams the turns and reports the time to their first text;
 * `--max-queue-wait` is dev's `MAGUS_MAX_QUEUE_WAIT` (refusals then are
 * 429 `queue_full`, reported with their own latency); `--no-floor` skips Temporal's start-rate floor.
 *
 * Per step: answered/s, p50/p99 first-turn latency, errors by kind (HTTP status or client
 * timeout), the pool's history events per minute (all its runs), history events per session
 * (sampled), each process's CPU share and RSS, and `temporal.db`'s size. `--seed-live N` writes N
 * live conversations straight into `magus_sessions` on the demo model's instance afterwards (with
 * `--seed-first`, before the steps, which then run beside them) and reports how the pool takes
 * them: its lease count, its longest run and largest continue-as-new input.
 */
import { readdirSync, readFileSync, statSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { connect } from 'nats';
import { dataPlaneNames } from '../dataplane';
import { poolKeyPrefix } from '../dataplane/session-keys';
import type { SessionEntry } from '../shared/serving';
import { poolStatusQuery, poolWorkflowId } from '../workflows/pool/definitions';
import { devNatsAuth, type DevConnection } from '../workers/config';
import { printed, processTree, startDev } from '../test/harness/dev';
import { badWindows, cpuOf, fmt, p50, p99, turnKind, rssMb } from './common';
import { within } from '../workers/dev/services';

const arg = (name: string, fallback: string) => {
  const k = process.argv.indexOf(`--${name}`);
  return k >= 0 ? process.argv[k + 1]! : fallback;
};
const rates = arg('rates', '10,20,40,80,160').split(',').map(Number);
const minutes = process.argv.includes('--minutes') ? Number(arg('minutes', '10')) : undefined;
const stepMs = (minutes ?? Number(arg('step-sec', '120')) / 60) * 60_000;
const seedLive = Number(arg('seed-live', '0'));
const seedFirst = process.argv.includes('--seed-first');
const demo = arg('demo', 'tiny');
const maxTokens = Number(arg('max-tokens', '1'));
const inFlightCap = Number(arg('in-flight', 'Infinity'));
const maxQueueWait = process.argv.includes('--max-queue-wait') ? arg('max-queue-wait', '5s') : undefined;
/** `--ttl MS`: dev's MAGUS_SESSION_TTL_MS (a steady state: once warm, as many sessions expire as start). */
const ttlMs = process.argv.includes('--ttl') ? arg('ttl', '120000') : undefined;
/** `--stream`: turns are streamed, and the time to their first piece of text is reported too. */
const streamed = process.argv.includes('--stream');
if (demo !== 'tiny' && demo !== 'smollm2') throw new Error(`--demo ${demo}: tiny or smollm2`);
const REQUEST_TIMEOUT_MS = 60_000;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const nameOf = (pid: number) => readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').slice(0, 3).join(' ').replace(/.*\//, '').slice(0, 40);

async function main(): Promise<void> {
  const data = mkdtempSync(join(tmpdir(), 'magus-bench-conv-'));
  const dev = startDev('direct', ['--no-kube', ...(demo === 'tiny' ? ['--demo', 'tiny'] : []), '--data-dir', data], {
    ...process.env,
    ...(maxQueueWait !== undefined ? { MAGUS_MAX_QUEUE_WAIT: maxQueueWait } : {}),
    ...(ttlMs !== undefined ? { MAGUS_SESSION_TTL_MS: ttlMs } : {}),
  });
  try {
    await dev.ready(600_000);
    const { gatewayUrl, tokenFile } = printed(dev.stdout());
    const token = readFileSync(tokenFile, 'utf8').trim();
    const conn = JSON.parse(readFileSync(join(data, 'connection.json'), 'utf8')) as DevConnection;
    const temporal = await Connection.connect({ address: conn.temporal.address });
    const client = new Client({ connection: temporal, namespace: conn.temporal.namespace });
    const headers = { authorization: `Bearer ${token}`, 'content-type': 'application/json' };
    const model = ((await (await fetch(`${gatewayUrl}/v1/models`, { headers })).json()) as { data: { id: string }[] }).data[0]!.id;
    const [ns, name] = model.includes('/') ? model.split('/') : ['default', model];
    const poolId = poolWorkflowId(ns!, name!);
    const turn = async (id: string): Promise<{ status: number | 'timeout'; ms: number; firstMs?: number; code?: string; at: number }> => {
      const t0 = performance.now();
      try {
        const r = await fetch(`${gatewayUrl}/v1/chat/completions`, {
          method: 'POST',
          headers: { ...headers, 'x-session-id': id },
          body: JSON.stringify({ model, messages: [{ role: 'user', content: 'Hi' }], max_tokens: maxTokens, ...(streamed ? { stream: true } : {}) }),
          signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS),
        });
        // Streamed: when the first piece of text came (its wait in the queue, plus the prompt's evaluation).
        let firstMs: number | undefined;
        let text = '';
        const decoder = new TextDecoder();
        for await (const bytes of r.body ?? []) {
          text += decoder.decode(bytes as Uint8Array, { stream: true });
          if (streamed && firstMs === undefined && r.status === 200 && /"content":"[^"]/.test(text)) firstMs = performance.now() - t0;
        }
        if (firstMs !== undefined) return { status: r.status, ms: performance.now() - t0, firstMs, at: Date.now() };
        const code =
          r.status === 200
            ? undefined
            : (() => {
                try {
                  return (JSON.parse(text) as { error?: { code?: string } }).error?.code;
                } catch {
                  return undefined;
                }
              })();
        return { status: r.status, ms: performance.now() - t0, code, at: Date.now() };
      } catch {
        return { status: 'timeout', ms: performance.now() - t0, at: Date.now() };
      }
    };
    // Warm: the demo model's pool has its instance.
    for (let k = 0; k < 120 && (await turn(`warmup-${k}`)).status !== 200; k++) await sleep(1000);

    // The floor: Temporal's bare start rate (a type no worker runs, on a queue nobody polls).
    const floorIds: string[] = [];
    const floorEnd = process.argv.includes('--no-floor') ? 0 : Date.now() + 10_000;
    await Promise.all(
      Array.from({ length: 32 }, async (_, c) => {
        for (let k = 0; Date.now() < floorEnd; k++) {
          const id = `bench-floor-${c}-${k}`;
          await client.workflow.start('benchFloor', { workflowId: id, taskQueue: 'bench-floor-nobody', args: [] });
          floorIds.push(id);
        }
      }),
    );
    const floor = floorIds.length / 10;
    for (let k = 0; k < floorIds.length; k += 32)
      await Promise.all(
        floorIds.slice(k, k + 32).map((id) =>
          client.workflow
            .getHandle(id)
            .terminate()
            .catch(() => undefined),
        ),
      );
    console.log(`floor: Temporal starts ${fmt(floor, 0)} bare workflows/s here (32 callers, 10 s)`);

    // Visibility counts a running execution's events only when it closes: the current run is described.
    const poolEvents = async () => {
      let n = 0;
      for await (const w of client.workflow.list({ query: `WorkflowId = "${poolId}" AND ExecutionStatus != "Running"` })) n += w.historyLength;
      return n + (await client.workflow.getHandle(poolId).describe()).historyLength;
    };
    const dbBytes = () =>
      readdirSync(data, { recursive: true })
        .map(String)
        .filter((f) => f.endsWith('temporal.db'))
        .reduce((n, f) => n + statSync(join(data, f)).size, 0);
    /** Writes `seedLive` live conversations onto the demo model's ready instance and reports how the pool takes them. */
    const seed = async (): Promise<void> => {
      const nc = await connect({ servers: conn.nats.servers, ...devNatsAuth(conn) });
      const kv = await nc.jetstream().views.kv(dataPlaneNames('').sessionsBucket);
      const status = await client.workflow.getHandle(poolId).query(poolStatusQuery);
      const instance = status.instances.find((i) => i.phase === 'ready')!;
      // A pool on load is counted as a whole (status.live); one on leases per instance.
      const countOf = (s: typeof status) => s.live ?? s.instances.find((i) => i.id === instance.id)?.leases ?? 0;
      const before = countOf(status);
      const entry: SessionEntry = {
        subject: instance.subject!,
        pool: name!,
        namespace: ns!,
        instance: instance.id,
        expiresAt: Date.now() + 30 * 60_000,
        placedAt: Date.now(),
      };
      const value = new TextEncoder().encode(JSON.stringify(entry));
      const s0 = Date.now();
      for (let k = 0; k < seedLive; k += 1000)
        await Promise.all(Array.from({ length: Math.min(1000, seedLive - k) }, (_, j) => kv.put(`${poolKeyPrefix(ns!, name!)}.seed-${k + j}`, value)));
      let counted = 0;
      for (let k = 0; k < 120 && counted < before + seedLive; k++) {
        await sleep(1000);
        counted = countOf(await client.workflow.getHandle(poolId).query(poolStatusQuery));
      }
      let longest = 0;
      let largestInput = 0;
      for await (const w of client.workflow.list({ query: `WorkflowId = "${poolId}"` })) {
        // Visibility has a running run's length only once it closes: that one is described.
        longest = Math.max(
          longest,
          w.status.name === 'RUNNING' ? (await client.workflow.getHandle(poolId, w.runId).describe()).historyLength : w.historyLength,
        );
        const first = (await client.workflow.getHandle(poolId, w.runId).fetchHistory()).events?.[0];
        const bytes = (first?.workflowExecutionStartedEventAttributes?.input?.payloads ?? []).reduce((n, p) => n + (p.data?.length ?? 0), 0);
        largestInput = Math.max(largestInput, bytes);
      }
      const row = `seeded ${seedLive} live conversations in ${fmt((Date.now() - s0) / 1000, 1)} s: the pool counts ${counted} live conversations; its longest run ${longest} events, its largest run input ${fmt(largestInput / 1024, 1)} KB`;
      console.log(row);
      rows.push(row);
      await nc.drain();
    };
    const rows: string[] = [];
    // `--seed-first`: the steps run with the live conversations already there.
    if (seedLive > 0 && seedFirst) await seed();
    for (const rate of rates) {
      const pids = processTree(dev.child.pid!);
      const cpu0 = new Map(pids.map((p) => [p, cpuOf(p)]));
      const db0 = dbBytes();
      const events0 = await poolEvents();
      const t0 = Date.now();
      const results: { status: number | 'timeout'; ms: number; firstMs?: number; code?: string; at: number }[] = [];
      // dev's own gauges every 10 s (its gateway's /metrics): heap in use, the event loop's delay,
      // and first turns placed from a pool view its pool had not rewritten in time.
      const gauges: { at: number; heap: number; loopMax: number; stalePicks: number; serviceSec: number }[] = [];
      const sampler = setInterval(() => {
        void fetch(`${gatewayUrl}/metrics`).then(
          async (r) => {
            const text = await r.text();
            const sample = (name: string) => Number(new RegExp(`^${name} (\\S+)$`, 'm').exec(text)?.[1] ?? NaN);
            gauges.push({
              at: Date.now(),
              heap: sample('nodejs_heap_size_used_bytes'),
              loopMax: sample('nodejs_eventloop_delay_max_seconds'),
              stalePicks: sample('magus_gateway_stale_view_picks_total'),
              // The engines' service time as their bridges measure it (90th percentile of the last 32; the longest of them).
              serviceSec: Math.max(0, ...[...text.matchAll(/^magus_bridge_service_seconds\{[^}]*\} (\S+)$/gm)].map((m) => Number(m[1]))),
            });
          },
          () => undefined,
        );
      }, 10_000);
      const inflight: Promise<void>[] = [];
      let open = 0;
      let freed: (() => void) | undefined;
      for (let k = 0; Date.now() - t0 < stepMs; k++) {
        const due = t0 + (k * 1000) / rate;
        if (due > Date.now()) await sleep(due - Date.now());
        while (open >= inFlightCap) await new Promise<void>((r) => (freed = r));
        const id = `bench-${rate}-${k}-${Math.random().toString(36).slice(2, 8)}`;
        open++;
        inflight.push(
          turn(id).then((r) => {
            results.push(r);
            open--;
            freed?.();
          }),
        );
      }
      await Promise.all(inflight);
      clearInterval(sampler);
      const secs = (Date.now() - t0) / 1000;
      const events = (await poolEvents()) - events0;
      const cpu = pids
        .filter((p) => {
          try {
            return cpuOf(p) >= 0;
          } catch {
            return false;
          }
        })
        .map((p) => `${nameOf(p)} ${fmt((100 * (cpuOf(p) - cpu0.get(p)!)) / secs, 0)}% ${fmt(rssMb(p), 0)} MB`);
      // History events per session: a sample of this step's sessions (running: started and asleep).
      let sampled = 0;
      let sessionEvents = 0;
      // (their ids are HMACs of the conversation ids: listed, then each history fetched).
      const sampledIds: string[] = [];
      for await (const w of client.workflow.list({ query: `MagusKind = "session" AND StartTime > "${new Date(t0).toISOString()}"`, pageSize: 20 })) {
        sampledIds.push(w.workflowId);
        if (sampledIds.length >= 20) break;
      }
      for (const id of sampledIds) {
        sessionEvents += ((await client.workflow.getHandle(id).fetchHistory()).events ?? []).length;
        sampled++;
      }
      const ok = results.filter((r) => r.status === 200);
      const errors = new Map<string, number>();
      for (const r of results) if (r.status !== 200) errors.set(turnKind(r), (errors.get(turnKind(r)) ?? 0) + 1);
      // Where in the step they came: 30-s windows (by answer time) with an error or a p99 over 1 s.
      for (const line of badWindows(results, t0, Date.now(), (w) => `dev ${devGauges(w)}`)) console.log(line);
      function devGauges(w: number): string {
        const g = gauges.filter((x) => x.at - t0 >= w * 30_000 && x.at - t0 < (w + 1) * 30_000);
        return g.length === 0
          ? 'not sampled'
          : `heap ${fmt(Math.max(...g.map((x) => x.heap)) / 2 ** 20, 0)} MB, event loop delayed up to ${fmt(Math.max(...g.map((x) => x.loopMax || 0)) * 1000, 0)} ms`;
      }
      const loopMax = Math.max(0, ...gauges.map((x) => x.loopMax || 0));
      const heapMax = Math.max(0, ...gauges.map((x) => x.heap || 0));
      const queueFull = results.filter((r) => r.code === 'queue_full').map((r) => r.ms);
      const service = Math.max(0, ...gauges.map((x) => x.serviceSec || 0));
      const refusedAt =
        (queueFull.length > 0 ? `; queue_full answered in p50 ${fmt(p50(queueFull), 0)} ms, p99 ${fmt(p99(queueFull), 0)} ms` : '') +
        (service > 0 ? `; an answer's service time (the bridge's p90) up to ${fmt(service, 2)} s` : '') +
        (streamed ? `; first text after p50 ${fmt(p50(ok.map((r) => r.firstMs ?? r.ms)), 0)} ms, p99 ${fmt(p99(ok.map((r) => r.firstMs ?? r.ms)), 0)} ms` : '');
      const row = `${rate}/s for ${fmt(secs, 0)} s: answered ${fmt(ok.length / secs, 1)}/s (${ok.length}/${results.length}), p50 ${fmt(p50(ok.map((r) => r.ms)), 0)} ms, p99 ${fmt(p99(ok.map((r) => r.ms)), 0)} ms${refusedAt}; errors ${errors.size === 0 ? 'none' : [...errors].map(([k, v]) => `${v}×${k}`).join(', ')}; pool ${fmt((events * 60) / secs, 0)} events/min; ${sampled > 0 ? fmt(sessionEvents / sampled, 1) : '—'} events per session (${sampled} sampled); temporal.db ${fmt(dbBytes() / 2 ** 20, 0)} MB (${fmt((dbBytes() - db0) / 2 ** 20, 1)} MB more in the step); dev's heap up to ${fmt(heapMax / 2 ** 20, 0)} MB, its event loop delayed up to ${fmt(loopMax * 1000, 0)} ms; ${fmt(Math.max(0, ...gauges.map((x) => x.stalePicks || 0)), 0)} first turns placed from a stale pool view\n    ${cpu.join('; ')}`;
      console.log(row);
      rows.push(row);
      if (errors.size > 0) {
        // What dev said meanwhile, kept past the data folder's removal: the errors' cause is there.
        const log = join(tmpdir(), `bench-conversations-dev-${Date.now()}.log`);
        writeFileSync(log, dev.stdout() + dev.stderr());
        console.log(`    dev's output: ${log}`);
      }
    }

    if (seedLive > 0 && !seedFirst) await seed();
    // SIGTERM under load: new conversations at the top rate, dev told to stop 3 s in.
    const top = Math.max(...rates);
    const burst: Promise<unknown>[] = [];
    const b0 = Date.now();
    for (let k = 0; Date.now() - b0 < 5000; k++) {
      const due = b0 + (k * 1000) / top;
      if (due > Date.now()) await sleep(due - Date.now());
      if (k === 3 * top) dev.child.kill('SIGTERM');
      burst.push(turn(`sigterm-${k}-${Math.random().toString(36).slice(2, 8)}`));
    }
    await Promise.allSettled(burst);
    let exit: Awaited<typeof dev.exited> | undefined;
    await within(
      dev.exited.then((e) => void (exit = e)),
      90_000,
    );
    // Processes of that dev still alive (its servers name its data folder on their command lines).
    const left = readdirSync('/proc')
      .filter((d) => /^\d+$/.test(d))
      .filter((d) => {
        try {
          return readFileSync(`/proc/${d}/cmdline`, 'utf8').includes(data);
        } catch {
          return false;
        }
      }).length;
    const uncaught = /uncaught|Channel has been shut down|MaxListenersExceeded/i.test(dev.stderr());
    const row = `SIGTERM at ${top}/s: dev exited ${exit ? `with ${exit.code ?? exit.signal}` : 'not within 90 s'}; ${uncaught ? 'an uncaught error or listener warning in its output' : 'no uncaught error or listener warning'}; ${left} process(es) left`;
    console.log(row);
    rows.push(row);
    if (exit?.code !== 0) console.log(`magus dev's last words:\n${(dev.stdout() + dev.stderr()).split('\n').slice(-25).join('\n')}`);
    console.log(`\nbench:conversations (floor ${fmt(floor, 0)} starts/s)\n${rows.join('\n')}`);
    await temporal.close();
  } finally {
    dev.child.kill('SIGTERM');
    await within(dev.exited, 60_000);
    rmSync(data, { recursive: true, force: true });
  }
}

void main().catch((err: unknown) => {
  console.error(err);
  process.exit(1);
});

/**
 * `npm run bench:deployment`: new conversations in the shape a deployment has, on this machine —
 * three `magus gateway` processes, two `magus worker` processes (local runtime: the instances of
 * the tiny model are their children), a three-node NATS cluster (streams and buckets at replicas
 * 3, `sync_interval` as nats-server's default), Temporal's dev server and S3. No `magus dev`.
 *
 *   npm run bench:deployment                                   # 45/s for 10 min, TTL 2 min
 *   npm run bench:deployment -- --rate 30 --minutes 2 --ttl 120000
 *
 * New conversations (a first turn each, `max_tokens: 1`, a session id of its own) at `--rate`
 * for `--minutes`, spread round-robin over the gateways, with the gateways'
 * MAGUS_SESSION_TTL_MS at `--ttl` (default 2 min: once warm, as many sessions end as start).
 * Reported: answered/s, p50/p99 latency, errors by kind (30-s windows with an error or a p99
 * over 1 s), each process's CPU share and RSS (a worker with its engines), `temporal.db`'s growth.
 */
import { S3Client } from '@aws-sdk/client-s3';
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, readdirSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { connect } from 'nats';
import { ensureDataPlane } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import { tokenDigest } from '../gateway/plugins/auth';
import { startServices } from '../workers/dev/services';
import { publishTinyGguf } from '../test/fixtures/tiny-gguf';
import { processTree } from '../test/harness/dev';
import { startNatsCluster } from '../test/harness/nats-cluster';
import { badWindows, cpuOf, fmt, p50, p99, turnKind, type TurnResult, rssMb } from './common';

const arg = (name: string, fallback: string) => {
  const k = process.argv.indexOf(`--${name}`);
  return k >= 0 ? process.argv[k + 1]! : fallback;
};
const RATE = Number(arg('rate', '45'));
const MINUTES = Number(arg('minutes', '10'));
const TTL_MS = arg('ttl', '120000');
const GATEWAYS = Number(arg('gateways', '3'));
const WORKERS = Number(arg('workers', '2'));
const MODEL = 'tiny';
const TOKEN_ID = 'benchdeploy';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(16).toString('hex')}`;
const SECRET = randomBytes(32).toString('hex');
const REQUEST_TIMEOUT_MS = 60_000;
const ROOT = join(__dirname, '..');
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
/** `f` summed over the processes still there. */
const sumOf = (pids: readonly number[], f: (pid: number) => number) =>
  pids.reduce((n, pid) => {
    try {
      return n + f(pid);
    } catch {
      return n; // gone meanwhile
    }
  }, 0);

interface Started {
  name: string;
  child: ChildProcess;
  output: () => string;
}

/** `magus <mode>` as a child process, resolved once its output matches `ready` (its last lines in the error otherwise). */
async function start(name: string, mode: string, env: NodeJS.ProcessEnv, ready: RegExp): Promise<Started & { match: RegExpExecArray }> {
  const child = spawn('setpriv', ['--pdeathsig', 'KILL', '--', process.execPath, join(ROOT, 'bin', 'magus.js'), mode], {
    cwd: ROOT,
    env: { ...process.env, ...env, MAGUS_LOG_LEVEL: 'warn' },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let out = '';
  child.stdout.on('data', (d: Buffer) => (out = (out + d.toString()).slice(-200_000)));
  child.stderr.on('data', (d: Buffer) => (out = (out + d.toString()).slice(-200_000)));
  for (let k = 0; k < 1200; k++) {
    const match = ready.exec(out);
    if (match) return { name, child, output: () => out, match };
    if (child.exitCode !== null) break;
    await sleep(100);
  }
  child.kill('SIGKILL');
  throw new Error(`${name} was not ready:\n${out.split('\n').slice(-20).join('\n')}`);
}

async function main(): Promise<void> {
  const services = await startServices({ services: ['temporal', 's3'] });
  const cluster = await startNatsCluster({ syncInterval: '2m' });
  const dir = mkdtempSync(join(tmpdir(), 'magus-bench-deploy-'));
  const processes: Started[] = [];
  try {
    const s3e = services.endpoints.s3!;
    const bucket = 'magus-bench-deploy';
    const common: NodeJS.ProcessEnv = {
      MAGUS_NATS_URL: cluster.servers.join(','),
      MAGUS_NATS_REPLICAS: '3',
      MAGUS_TEMPORAL_ADDRESS: services.endpoints.temporal!.address,
      MAGUS_S3_ENDPOINT: s3e.endpoint,
      MAGUS_S3_REGION: s3e.region,
      MAGUS_S3_BUCKET: bucket,
      AWS_ACCESS_KEY_ID: s3e.accessKeyId,
      AWS_SECRET_ACCESS_KEY: s3e.secretAccessKey,
    };
    for (let w = 1; w <= WORKERS; w++)
      processes.push(
        await start(`worker ${w}`, 'worker', { ...common, MAGUS_HEALTH_ADDRESS: '127.0.0.1:0', MAGUS_METRICS_ADDRESS: '127.0.0.1:0' }, /magus worker: polling/),
      );
    // The model, published as a pipeline would: its GGUF in S3, its entry in the registry.
    const nc = await connect({ servers: cluster.servers, name: 'bench-deployment' });
    const names = await ensureDataPlane(nc, { prefix: '', replicas: 3 });
    const s3 = new S3Client({
      endpoint: s3e.endpoint,
      region: s3e.region,
      forcePathStyle: true,
      credentials: { accessKeyId: s3e.accessKeyId, secretAccessKey: s3e.secretAccessKey },
    });
    await publishTinyGguf({ dir, s3, bucket, registry: await openModelRegistry(nc, names.modelsBucket), name: MODEL });
    const gateways: string[] = [];
    for (let g = 1; g <= GATEWAYS; g++) {
      const gw = await start(
        `gateway ${g}`,
        'gateway',
        {
          ...common,
          MAGUS_GATEWAY_HOST: '127.0.0.1',
          MAGUS_GATEWAY_PORT: '0',
          MAGUS_GATEWAY_SECRET: SECRET,
          MAGUS_GATEWAY_TOKENS: JSON.stringify({ [TOKEN_ID]: { digest: tokenDigest(TOKEN), name: 'bench:deployment' } }),
          MAGUS_SESSION_TTL_MS: TTL_MS,
        },
        /magus gateway: listening on (http:\/\/\S+) /,
      );
      processes.push(gw);
      gateways.push(gw.match[1]!);
    }
    const headers = { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' };
    type Result = TurnResult;
    const turn = async (url: string, id: string): Promise<Result> => {
      const t0 = performance.now();
      try {
        const r = await fetch(`${url}/v1/chat/completions`, {
          method: 'POST',
          headers: { ...headers, 'x-session-id': id },
          body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 1 }),
          signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS),
        });
        const text = await r.text();
        let code: string | undefined;
        if (r.status !== 200)
          try {
            code = (JSON.parse(text) as { error?: { code?: string } }).error?.code;
          } catch {
            code = undefined;
          }
        return { status: r.status, ms: performance.now() - t0, code, at: Date.now() };
      } catch {
        return { status: 'timeout', ms: performance.now() - t0, at: Date.now() };
      }
    };
    // Warm: the pool's first instance started (a cold start), then every gateway answers.
    for (const url of gateways) for (let k = 0; k < 180 && (await turn(url, `warmup-${randomBytes(4).toString('hex')}`)).status !== 200; k++) await sleep(1000);
    console.log(`deployment: ${GATEWAYS} gateways, ${WORKERS} workers, a ${cluster.servers.length}-node NATS cluster; warm`);

    const dbBytes = () =>
      readdirSync(services.dataDir, { recursive: true })
        .map(String)
        .filter((f) => f.endsWith('.db') || f.endsWith('.db-wal'))
        .reduce((n, f) => n + statSync(join(services.dataDir, f)).size, 0);
    const pidsOf = () => [
      ...processes.map((p) => ({ name: p.name, pids: processTree(p.child.pid!) })),
      ...cluster.nodes.map((n) => ({ name: `nats ${n.name}`, pids: n.pid ? [n.pid] : [] })),
      { name: 'temporal + s3', pids: services.pids },
    ];
    const before = pidsOf().map((p) => ({ ...p, cpu: sumOf(p.pids, cpuOf) }));
    const db0 = dbBytes();
    const t0 = Date.now();
    const stepMs = MINUTES * 60_000;
    const results: Result[] = [];
    const inflight: Promise<void>[] = [];
    for (let k = 0; Date.now() - t0 < stepMs; k++) {
      const due = t0 + (k * 1000) / RATE;
      if (due > Date.now()) await sleep(due - Date.now());
      const id = `deploy-${k}-${randomBytes(3).toString('hex')}`;
      inflight.push(turn(gateways[k % gateways.length]!, id).then((r) => void results.push(r)));
    }
    await Promise.all(inflight);
    const secs = (Date.now() - t0) / 1000;
    const ok = results.filter((r) => r.status === 200);
    const errors = new Map<string, number>();
    for (const r of results) if (r.status !== 200) errors.set(turnKind(r), (errors.get(turnKind(r)) ?? 0) + 1);
    for (const line of badWindows(results, t0, Date.now())) console.log(line);
    const cpu = before.map((b) => `${b.name} ${fmt((100 * (sumOf(b.pids, cpuOf) - b.cpu)) / secs, 0)}% ${fmt(sumOf(b.pids, rssMb), 0)} MB`);
    console.log(
      `${RATE}/s for ${fmt(secs, 0)} s, TTL ${Number(TTL_MS) / 1000} s: answered ${fmt(ok.length / secs, 1)}/s (${ok.length}/${results.length}), p50 ${fmt(p50(ok.map((r) => r.ms)), 0)} ms, p99 ${fmt(p99(ok.map((r) => r.ms)), 0)} ms; errors ${
        errors.size === 0 ? 'none' : [...errors].map(([k, v]) => `${v}×${k}`).join(', ')
      }; temporal.db ${fmt(dbBytes() / 2 ** 20, 0)} MB (${fmt((dbBytes() - db0) / 2 ** 20, 1)} MB more)\n    ${cpu.join('; ')}`,
    );
    await nc.drain();
  } finally {
    for (const p of processes) p.child.kill('SIGTERM');
    for (const p of processes) if (p.child.exitCode === null) await new Promise((r) => p.child.once('exit', r));
    await cluster.stop();
    await services.stop();
    rmSync(dir, { recursive: true, force: true });
  }
}

void main().catch((err: unknown) => {
  console.error(err);
  process.exit(1);
});

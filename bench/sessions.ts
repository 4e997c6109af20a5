/**
 * `npm run bench:sessions -- --live 0,100000,1000000`: what live conversations cost a gateway
 * process. For each count, `magus_sessions` is filled with that many live entries (written
 * straight into the bucket, as gateways write them), and a real `magus gateway` process is
 * started on it twice — holding only the conversations it serves (the default,
 * `MAGUS_GATEWAY_SESSION_CACHE`) and mirroring every entry (`MAGUS_GATEWAY_SESSION_CACHE=0`) — to
 * measure how long it takes to be ready, its RSS and heap once ready, and whether `/readyz`
 * failed while nats-server was restarted under it (polled every 50 ms). Also nats-server's RSS and
 * CPU holding them, and its CPU while each part runs.
 * No Temporal (the gateway answers `degraded` without it, which counts as ready). Then the
 * worker's and the controller's parts that read the bucket, each alone in a process
 * (bench/sessions-probe.ts): a pool's reconciler counted by the server (a pool on load), the same
 * from an index of every entry (a pool on leases), and the controller's Session mirror. Each
 * row: time to be ready (the gateway's `/readyz`, the reconciler's first report, the mirror's
 * replay), RSS and heap, and CPU over the 10 s after. Other flags: `--modes recent,all` (the
 * gateway's), `--parts gateway,reconciler-count,reconciler-index,controller`.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { createServer } from 'node:net';
import { join } from 'node:path';
import { connect } from 'nats';
import { dataPlaneNames, ensureDataPlane } from '../dataplane';
import type { SessionEntry } from '../shared/serving';
import { startServices } from '../workers/dev/services';
import { cpuOf, fmt, rssMb } from './common';

const arg = (name: string, fallback: string) => {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? process.argv[i + 1]! : fallback;
};
const counts = arg('live', '0,100000,1000000').split(',').map(Number);
const modes = arg('modes', 'recent,all').split(',') as ('recent' | 'all')[];
const parts = arg('parts', 'gateway,reconciler-count,reconciler-index,orphan-scan,controller').split(',');
const PROBES: Record<string, string> = {
  'reconciler-count': "worker: a pool's reconciler, counted by the server (pools on load)",
  'reconciler-index': "worker: a pool's reconciler, index of every entry (pools on leases)",
  'orphan-scan': "worker: one read of a pool's entries for orphans (pools on load, every 5 min or more)",
  controller: 'controller: the Session mirror (cap 200)',
};

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
/** A process's CPU use (% of one core) over `ms`. */
async function cpuPct(pid: number, ms: number): Promise<number> {
  const c0 = cpuOf(pid);
  await sleep(ms);
  return ((cpuOf(pid) - c0) * 100_000) / ms;
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address() as { port: number };
      s.close(() => resolve(port));
    });
    s.on('error', reject);
  });
}

async function readyz(url: string): Promise<number> {
  try {
    return (await fetch(`${url}/readyz`, { signal: AbortSignal.timeout(1_000) })).status;
  } catch {
    return 0;
  }
}

/** The heap the gateway reports on /metrics (MB). */
async function heapMb(url: string): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text();
  return Number(/^nodejs_heap_size_used_bytes (\S+)$/m.exec(text)?.[1] ?? NaN) / 1024 / 1024;
}

/** One part alone in a process (bench/sessions-probe.ts): its row's cells from ready to CPU. */
async function probe(part: string, natsUrl: string, natsPid: number): Promise<string> {
  const child = spawn(process.execPath, ['-r', '@swc-node/register', join(__dirname, 'sessions-probe.ts'), part], {
    env: { ...process.env, MAGUS_NATS_URL: natsUrl },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let out = '';
  let err = '';
  child.stdout.on('data', (d: Buffer) => (out += d.toString()));
  child.stderr.on('data', (d: Buffer) => (err += d.toString()));
  try {
    for (let k = 0; k < 3000 && !out.includes('\n') && child.exitCode === null; k++) await sleep(100);
    if (!out.includes('\n'))
      return `not ready (${child.exitCode === null ? 'after 300 s' : `exit ${child.exitCode}`}: ${err.trim().split('\n').at(-1)?.slice(0, 160) ?? ''}) | — | — | —`;
    const first = JSON.parse(out.split('\n')[0]!) as { readyMs: number; counted?: number; held?: number };
    await sleep(2_000);
    const rss = rssMb(child.pid!);
    const [cpu, natsCpu] = await Promise.all([cpuPct(child.pid!, 10_000), cpuPct(natsPid, 10_000)]);
    const lines = out.trim().split('\n');
    const heap = (JSON.parse(lines.at(-1)!) as { heapMb: number }).heapMb;
    const what = first.counted !== undefined ? ` (${first.counted.toLocaleString('en')} counted)` : first.held !== undefined ? ` (${first.held} held)` : '';
    return `${fmt(first.readyMs / 1000, 1)} s${what} | ${fmt(rss, 0)} MB | ${fmt(heap, 0)} MB | ${fmt(cpu, 1)} % (nats-server ${fmt(natsCpu, 1)} %)`;
  } finally {
    child.kill('SIGKILL');
    if (child.exitCode === null) await new Promise((resolve) => child.once('exit', resolve));
  }
}

async function main(): Promise<void> {
  const services = await startServices({ services: ['nats'] });
  const natsUrl = services.endpoints.nats!.servers;
  const natsPid = () => services.pids[0]!;
  const rows: string[] = [];
  try {
    const nc = await connect({ servers: natsUrl, name: 'bench-sessions' });
    await ensureDataPlane(nc, { prefix: '' });
    const kv = await nc.jetstream().views.kv(dataPlaneNames('').sessionsBucket);
    let written = 0;
    for (const live of counts) {
      const entry: SessionEntry = {
        subject: 'magus.req.bench.bench-1-00000000',
        pool: 'bench',
        namespace: 'default',
        instance: 'bench-1-00000000',
        expiresAt: Date.now() + 24 * 3_600_000,
        placedAt: Date.now(),
        watched: true,
      };
      const value = new TextEncoder().encode(JSON.stringify(entry));
      const s0 = Date.now();
      for (; written < live; written += 2000) {
        const n = Math.min(2000, live - written);
        // Keys as gateways write them: the pool, then a conversation's hex HMAC.
        await Promise.all(Array.from({ length: n }, (_, j) => kv.put(`default.bench.${(written + j).toString(16).padStart(64, '0')}`, value)));
      }
      if (live > 0) console.log(`${live} live entries written (${fmt((Date.now() - s0) / 1000, 1)} s)`);
      // nats-server holding them, with nobody but this connection: what every row below adds to.
      await sleep(2_000);
      const natsRow = `| ${live.toLocaleString('en')} | nats-server (the bucket's server), no client busy | — | ${fmt(rssMb(natsPid()), 0)} MB | — | ${fmt(await cpuPct(natsPid(), 10_000), 1)} % | — |`;
      console.log(natsRow);
      rows.push(natsRow);
      for (const mode of parts.includes('gateway') ? modes : []) {
        const port = await freePort();
        const url = `http://127.0.0.1:${port}`;
        const t0 = Date.now();
        const gw: ChildProcess = spawn(process.execPath, [join(__dirname, '..', 'bin', 'magus.js'), 'gateway', '--port', String(port)], {
          env: {
            ...process.env,
            MAGUS_NATS_URL: natsUrl,
            MAGUS_TEMPORAL_ADDRESS: '127.0.0.1:1',
            MAGUS_GATEWAY_SECRET: randomBytes(32).toString('hex'),
            MAGUS_GATEWAY_SESSION_CACHE: mode === 'all' ? '0' : '50000',
            MAGUS_LOG_LEVEL: 'warn',
          },
          stdio: ['ignore', 'ignore', 'pipe'],
        });
        let stderr = '';
        gw.stderr!.on('data', (d: Buffer) => (stderr += d.toString()));
        let readyMs = NaN;
        for (let k = 0; k < 1200 && gw.exitCode === null; k++) {
          if ((await readyz(url)) === 200) {
            readyMs = Date.now() - t0;
            break;
          }
          await sleep(50);
        }
        if (Number.isNaN(readyMs)) {
          gw.kill('SIGKILL');
          const why = stderr.trim().split('\n').at(-1)?.slice(0, 160) ?? '';
          const row = `| ${live.toLocaleString('en')} | ${mode === 'recent' ? 'recent (50,000 held at most)' : 'every entry'} | not ready (${gw.exitCode === null ? 'after 60 s' : `exit ${gw.exitCode}`}: ${why}) | — | — | — |`;
          console.log(row);
          rows.push(row);
          continue;
        }
        await sleep(2_000);
        const rss = rssMb(gw.pid!);
        const heap = await heapMb(url);
        const [cpu, natsCpu] = await Promise.all([cpuPct(gw.pid!, 10_000), cpuPct(natsPid(), 10_000)]);
        // nats-server restarted under it: /readyz every 50 ms for 10 s.
        let polls = 0;
        let failed = 0;
        const restart = services.restartNats();
        const p0 = Date.now();
        while (Date.now() - p0 < 10_000) {
          polls++;
          if ((await readyz(url)) !== 200) failed++;
          await sleep(50);
        }
        await restart;
        gw.kill('SIGTERM');
        await new Promise((resolve) => gw.once('exit', resolve));
        const row = `| ${live.toLocaleString('en')} | gateway: ${mode === 'recent' ? 'recent (50,000 held at most)' : 'every entry'} | ${fmt(readyMs / 1000, 1)} s | ${fmt(rss, 0)} MB | ${fmt(heap, 0)} MB | ${fmt(cpu, 1)} % (nats-server ${fmt(natsCpu, 1)} %) | ${failed} of ${polls} |`;
        console.log(row);
        rows.push(row);
      }
      for (const part of parts.filter((p) => PROBES[p])) {
        const row = `| ${live.toLocaleString('en')} | ${PROBES[part]} | ${await probe(part, natsUrl, natsPid())} | — |`;
        console.log(row);
        rows.push(row);
      }
    }
    await nc.drain();
  } finally {
    await services.stop();
  }
  console.log(
    '\n| live conversations | process (what it holds) | ready after start | RSS | heap | CPU, 10 s after (nats-server meanwhile) | /readyz failures during a NATS restart |',
  );
  console.log('|---|---|---|---|---|---|---|');
  for (const r of rows) console.log(r);
}

main().catch((err: unknown) => {
  console.error(err);
  process.exit(1);
});

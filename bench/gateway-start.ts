/**
 * What a `magus gateway` replica costs to start: spawned again and again (`START_RUNS`, default
 * 8) against a one-node NATS with the data plane declared, each run reports the time from spawn to
 * its `listening` line, the CPU it used by then (user + system, /proc) and by
 * `START_SETTLE_MS` (default 3 s) after it. A replica that starts while another takes the clients of
 * a killed one (bench:chaos's gateway kills) takes that CPU from it on a small machine.
 *
 * `npm run bench:gateway-start`; the process is SIGTERMed after each run.
 */
import { randomBytes } from 'node:crypto';
import { connect } from 'nats';
import { ensureDataPlane } from '../dataplane';
import { tokenDigest } from '../gateway/plugins/auth';
import { startNatsCluster } from '../test/harness/nats-cluster';
import { sleep } from '../test/harness/wait';
import { freePort } from '../workers/dev/services';
import { cpuOf, fmt, p50, rssMb, spawnGateway } from './common';

const RUNS = Number(process.env.START_RUNS ?? 8);
const SETTLE_MS = Number(process.env.START_SETTLE_MS ?? 3_000);

interface Start {
  listeningMs: number;
  cpuAtListening: number;
  cpuSettled: number;
  rssMb: number;
}

async function startOnce(env: NodeJS.ProcessEnv): Promise<Start> {
  const { child, exited, listeningMs } = await spawnGateway(env, {
    ...(process.env.START_PROF ? { nodeArgs: ['--cpu-prof', `--cpu-prof-dir=${process.env.START_PROF}`] } : {}),
  });
  const cpuAtListening = cpuOf(child.pid!);
  await sleep(SETTLE_MS);
  const out = { listeningMs, cpuAtListening, cpuSettled: cpuOf(child.pid!), rssMb: rssMb(child.pid!) };
  child.kill('SIGTERM');
  await exited;
  return out;
}

async function main(): Promise<void> {
  const cluster = await startNatsCluster({ size: 1 });
  const nc = await connect({ servers: cluster.servers });
  const prefix = `S${randomBytes(3).toString('hex').toUpperCase()}`;
  await ensureDataPlane(nc, { prefix, replicas: 1 });
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    MAGUS_NATS_URL: cluster.servers.join(','),
    MAGUS_NATS_PREFIX: prefix,
    MAGUS_GATEWAY_HOST: '127.0.0.1',
    MAGUS_GATEWAY_PORT: '0',
    MAGUS_GATEWAY_SECRET: randomBytes(32).toString('hex'),
    MAGUS_GATEWAY_TOKENS: JSON.stringify({ start: { digest: tokenDigest(`mgs_start_${randomBytes(16).toString('hex')}`), name: 'bench:gateway-start' } }),
    // Nothing listens there: the gateway starts without Temporal, as bench:chaos's do.
    MAGUS_TEMPORAL_ADDRESS: `127.0.0.1:${await freePort()}`,
    MAGUS_LOG_LEVEL: 'warn',
  };
  const runs: Start[] = [];
  try {
    for (let i = 0; i < RUNS; i++) {
      const r = await startOnce(env);
      runs.push(r);
      console.log(
        `run ${i + 1}: listening after ${fmt(r.listeningMs, 0)} ms, ${fmt(r.cpuAtListening)} s CPU by then, ${fmt(r.cpuSettled)} s ${SETTLE_MS / 1000} s later, RSS ${fmt(r.rssMb, 0)} MB`,
      );
    }
  } finally {
    await nc.close();
    await cluster.stop();
  }
  const of = (f: (r: Start) => number) => `p50 ${fmt(p50(runs.map(f)))} / max ${fmt(Math.max(...runs.map(f)))}`;
  console.log(`bench:gateway-start: ${RUNS} starts`);
  console.log(`  spawn → listening: ${of((r) => r.listeningMs / 1000)} s`);
  console.log(`  CPU by listening: ${of((r) => r.cpuAtListening)} s; by ${SETTLE_MS / 1000} s later: ${of((r) => r.cpuSettled)} s`);
  console.log(`  RSS: ${of((r) => r.rssMb)} MB`);
}

void main().catch((err: unknown) => {
  console.error(err);
  process.exit(1);
});

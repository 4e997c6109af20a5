/**
 * The single `magus <mode>` entry point. Each mode is one process kind from DESIGN.md; modes
 * not built yet say so and exit 2, so scripts can tell "not available" from "failed".
 */
import { writeFileSync } from 'node:fs';
import { createServer } from 'node:http';
import { join } from 'node:path';
import { MODES, type Mode } from '../shared/constants';
import { ConfigError, loadConfig } from './config';
import { ALL_SERVICES, startServices, type ServiceName } from './dev/services';
import type * as ConvertModule from './convert';
import type * as EngineModule from './engine';
import type * as BridgeModule from './bridge';
import type * as GatewayModule from '../gateway/server';
import type * as ModelPullModule from './model-pull';
import type * as WorkerModule from './worker';
import type * as TemporalWorkerModule from '@temporalio/worker';
import type * as DevModule from './dev/dev';
import type * as ControllerModule from './controller/main';

/*
 * Each mode loads its modules only when it runs: `magus convert` must not pay, in start-up time
 * and memory, for Temporal's worker runtime, the Kubernetes client and fastify.
 */
/* eslint-disable @typescript-eslint/no-require-imports */
const load = {
  convert: () => require('./convert') as typeof ConvertModule,
  engine: () => require('./engine') as typeof EngineModule,
  bridge: () => require('./bridge') as typeof BridgeModule,
  gateway: () => require('../gateway/server') as typeof GatewayModule,
  modelPull: () => require('./model-pull') as typeof ModelPullModule,
  worker: () => require('./worker') as typeof WorkerModule,
  temporalWorker: () => require('@temporalio/worker') as typeof TemporalWorkerModule,
  dev: () => require('./dev/dev') as typeof DevModule,
  controller: () => require('./controller/main') as typeof ControllerModule,
};
/* eslint-enable @typescript-eslint/no-require-imports */

const DESCRIPTIONS: Record<Mode, string> = {
  dev: 'everything locally: Temporal, NATS, S3, a worker, the gateway and a demo model (or --model org/repo)',
  worker: 'Temporal workers for the magus-control and magus-pipeline task queues',
  controller: 'watch Model/Dllama/Session resources and drive their workflows',
  gateway: 'OpenAI-compatible HTTP API',
  bridge: 'NATS ↔ engine sidecar',
  engine: 'llama.cpp engine with the dllama-api HTTP surface',
  convert: 'convert safetensors to GGUF or distributed-llama',
  model: 'model pull <org/repo>[@rev] --format gguf:q40,…: prepare a model through the pipeline',
};

export const EXIT_NOT_AVAILABLE = 2;

function usage(): string {
  const width = Math.max(...MODES.map((m) => m.length));
  return [
    'usage: magus <mode> [options]',
    '',
    'modes:',
    ...MODES.map((m) => `  ${m.padEnd(width)}  ${DESCRIPTIONS[m]}`),
    '',
    'magus dev [--model org/repo] [--port 8080] [--token-env HF_TOKEN] [--no-kube]',
    'magus dev --services temporal,nats,s3,kubernetes [--json]   (only the servers)',
    'magus convert <hf-dir> --format gguf|dllama --weights q40|q80|f16|f32 [-o out] [--threads N]',
    'magus model pull <org/repo>[@revision] --format gguf:q40[,dllama:q40] [--hub URL] [--token-env VAR]',
    'magus engine --model file.gguf [--host 127.0.0.1] [--port 0] [--slots 1] [--threads N] [--ctx 4096]',
    '',
    'worker and model read MAGUS_TEMPORAL_ADDRESS, MAGUS_NATS_URL, MAGUS_S3_ENDPOINT, MAGUS_S3_BUCKET',
    '(and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) from the environment.',
  ].join('\n');
}

function parseServices(arg: string | undefined): ServiceName[] {
  if (!arg) return ['temporal', 'nats', 's3'];
  const names = arg.split(',').map((s) => s.trim()).filter(Boolean);
  for (const n of names) {
    if (!(ALL_SERVICES as readonly string[]).includes(n)) throw new Error(`unknown service '${n}' (known: ${ALL_SERVICES.join(', ')})`);
  }
  return names as ServiceName[];
}

/** `magus dev`: the whole system; `--services a,b` starts only those servers (no worker, gateway or model). */
async function dev(args: string[]): Promise<number> {
  const flag = (name: string) => {
    const i = args.indexOf(name);
    return i >= 0 ? args[i + 1] : undefined;
  };
  const json = args.includes('--json');
  // Without --services: the whole system (servers, worker, gateway, demo model).
  if (!args.includes('--services')) {
    const port = flag('--port');
    if (port !== undefined && !/^\d{1,5}$/.test(port)) throw new Error(`--port ${port} is not a port number`);
    return load.dev().runDev({ model: flag('--model'), port: port === undefined ? undefined : Number(port), tokenEnv: flag('--token-env'), kube: !args.includes('--no-kube') });
  }
  const services = parseServices(flag('--services'));
  if (!json) process.stderr.write(`magus dev: starting ${services.join(', ')} …\n`);
  const running = await startServices({ services });
  const endpointsFile = join(running.dataDir, 'endpoints.json');
  writeFileSync(endpointsFile, JSON.stringify(running.endpoints, null, 2), { mode: 0o600 });

  const e = running.endpoints;
  if (json) {
    // Machine-readable readiness line (tests use it); credentials stay in the 0600 file.
    process.stdout.write(`${JSON.stringify({ ready: true, pids: running.pids, endpointsFile, dataDir: running.dataDir })}\n`);
  } else {
    const lines = [
      e.temporal && `Temporal      ${e.temporal.address}  (namespace ${e.temporal.namespace})`,
      e.temporal && `Temporal UI   ${e.temporal.uiUrl}`,
      e.nats && `NATS          ${e.nats.servers}  (monitoring ${e.nats.monitorUrl})`,
      e.s3 && `S3 (MinIO)    ${e.s3.endpoint}  (region ${e.s3.region})`,
      e.kubernetes && `Kubernetes    ${e.kubernetes.server}`,
      `credentials   ${endpointsFile}`,
      '',
      'Ctrl-C stops everything.',
    ].filter((l): l is string => typeof l === 'string');
    process.stdout.write(`${lines.join('\n')}\n`);
  }

  await new Promise<void>((resolve) => {
    for (const sig of ['SIGINT', 'SIGTERM'] as const) process.once(sig, () => resolve());
  });
  if (!json) process.stderr.write('\nmagus dev: stopping …\n');
  await running.stop();
  return 0;
}

/** Runs `fn`, turning a configuration error into a clear message and exit code 1. */
async function configErrors(fn: () => Promise<number>): Promise<number> {
  try {
    return await fn();
  } catch (err) {
    if (!(err instanceof ConfigError)) throw err;
    process.stderr.write(`magus: ${err.message}\n`);
    return 1;
  }
}

/**
 * `magus worker`: runs until SIGINT/SIGTERM, then stops gracefully. The Temporal SDK's metrics
 * are exported for Prometheus on MAGUS_METRICS_ADDRESS (default 127.0.0.1:9464, `/metrics`), and
 * MAGUS_HEALTH_ADDRESS (default 127.0.0.1:9465) answers `/healthz`, `/readyz` and `/metrics`
 * (the bridges of the local runtime's instances).
 */
function workerCommand(): Promise<number> {
  return configErrors(async () => {
    const cfg = loadConfig();
    const metrics = process.env.MAGUS_METRICS_ADDRESS ?? '127.0.0.1:9464';
    load.temporalWorker().Runtime.install({ telemetryOptions: { metrics: { prometheus: { bindAddress: metrics } } } });
    let ready = false;
    let workers: WorkerModule.RunningWorkers | undefined = undefined; // set once they run; /metrics reads it
    const [host, port] = (process.env.MAGUS_HEALTH_ADDRESS ?? '127.0.0.1:9465').split(':');
    const health = createServer((req, res) => {
      if (req.url === '/metrics') {
        res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4; charset=utf-8' });
        return void res.end(load.bridge().bridgeMetricsText(workers?.runtime.bridges() ?? []));
      }
      const ok = req.url === '/healthz' || (req.url === '/readyz' && ready);
      res.writeHead(ok ? 200 : req.url === '/readyz' ? 503 : 404, { 'content-type': 'text/plain' }).end(ok ? 'ok\n' : 'not ready\n');
    });
    await new Promise<void>((ok) => health.listen(Number(port), host, ok));
    workers = await load.worker().startWorkers(cfg);
    ready = true;
    process.stderr.write(`magus worker: polling ${cfg.taskQueue} and its pipeline queue on ${cfg.temporal.address}; metrics on http://${metrics}/metrics\n`);
    const stop = () => {
      ready = false;
      void workers.shutdown();
    };
    process.once('SIGINT', stop);
    process.once('SIGTERM', stop);
    await workers.done;
    health.close();
    return 0;
  });
}

/**
 * `magus <mode> --help` prints the mode's usage and exits 0, before anything starts (a user's
 * first move; `magus dev --help` used to start the whole stack). Gateway and controller parse
 * their own flags and answer it themselves.
 */
const MODE_USAGE: Partial<Record<Mode, () => string>> = {
  dev: () =>
    [
      'usage: magus dev [--model org/repo] [--port 8080] [--token-env HF_TOKEN] [--no-kube]',
      '       magus dev --services temporal,nats,s3,kubernetes [--json]   (only the servers)',
      '',
      DESCRIPTIONS.dev,
      '  --model org/repo   pull this Hugging Face repo instead of the offline demo model (needs internet)',
      '  --port P           the gateway\'s port (default 8080, or one the kernel picks when 8080 is taken)',
      '  --token-env VAR    the environment variable holding a Hugging Face token (gated repos)',
      '  --no-kube          do not start etcd + kube-apiserver and the controller (the kubectl door)',
    ].join('\n'),
  worker: () =>
    [
      'usage: magus worker',
      '',
      DESCRIPTIONS.worker,
      'Reads MAGUS_TEMPORAL_ADDRESS, MAGUS_TEMPORAL_NAMESPACE, MAGUS_TASK_QUEUE, MAGUS_NATS_URL, MAGUS_NATS_PREFIX,',
      'MAGUS_S3_ENDPOINT, MAGUS_S3_BUCKET, MAGUS_S3_REGION (and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), MAGUS_MODEL_CACHE,',
      'MAGUS_DLLAMA_API_BIN / MAGUS_DLLAMA_BIN; with KUBECONFIG (or in a pod) it also writes Model/Dllama status.',
      'Metrics on MAGUS_METRICS_ADDRESS (127.0.0.1:9464); /healthz, /readyz, /metrics on MAGUS_HEALTH_ADDRESS (127.0.0.1:9465).',
    ].join('\n'),
  convert: () => load.convert().CONVERT_USAGE,
  engine: () => load.engine().ENGINE_USAGE,
  bridge: () => load.bridge().BRIDGE_USAGE,
  model: () => load.modelPull().PULL_USAGE,
};

export async function main(argv: string[]): Promise<number> {
  const [mode, ...rest] = argv;
  if (!mode || mode === '--help' || mode === '-h' || mode === 'help') {
    process.stdout.write(`${usage()}\n`);
    return mode ? 0 : 1;
  }
  if (!(MODES as readonly string[]).includes(mode)) {
    process.stderr.write(`magus: unknown mode '${mode}'\n\n${usage()}\n`);
    return 1;
  }
  const modeUsage = MODE_USAGE[mode as Mode];
  if (modeUsage && (rest.includes('--help') || rest.includes('-h'))) {
    process.stdout.write(`${modeUsage()}\n`);
    return 0;
  }
  switch (mode as Mode) {
    case 'dev':
      return dev(rest);
    case 'convert':
      return load.convert().convertCommand(rest);
    case 'worker':
      return workerCommand();
    case 'engine':
      return load.engine().engineCommand(rest);
    case 'bridge':
      return load.bridge().bridgeCommand(rest);
    case 'gateway':
      return configErrors(() => load.gateway().gatewayCommand(rest));
    case 'controller':
      return configErrors(() => load.controller().controllerCommand(rest));
    case 'model':
      if (rest[0] === 'pull') return configErrors(() => load.modelPull().modelPullCommand(rest.slice(1)));
      process.stderr.write(`${load.modelPull().PULL_USAGE}\n`);
      return 1;
    default:
      process.stderr.write(`magus ${mode}: not yet available in this version of magus.\n`);
      return EXIT_NOT_AVAILABLE;
  }
}

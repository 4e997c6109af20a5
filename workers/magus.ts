/**
 * The single `magus <mode>` entry point. Each mode is one process kind (ARCHITECTURE.md,
 * "Processes"); modes not built yet say so and exit 2, so scripts can tell "not available" from
 * "failed".
 */
import { writeFileSync } from 'node:fs';
import { createServer } from 'node:http';
import { join } from 'node:path';
import { MODES, type Mode } from '../shared/constants';
import { ENGINE_KINDS, isEngineKind } from '../shared/engines';
import { loadConfig, useDevConnection } from './config';
import { ConfigError } from '../platform/config';
import type * as ServicesModule from './dev/services';
import type { ServiceName } from './dev/services';
import type * as ConvertModule from './convert';
import type * as EngineModule from './engine';
import type * as BridgeModule from './bridge';
import type * as FetchModule from './fetch';
import type * as BridgeMetricsModule from '../dataplane/bridge/metrics';
import type * as ProcessMetricsModule from '../platform/process-metrics';
import type * as GatewayModule from '../gateway/server';
import type * as KeysModule from './keys';
import type * as UsageModule from './usage';
import type * as NatsAuthModule from './nats-auth';
import type * as ModelPullModule from './model-pull';
import type * as ModelTinyModule from './model-tiny';
import type * as WorkerModule from './worker';
import type * as TemporalWorkerModule from '@temporalio/worker';
import type * as DevModule from './dev/dev';
import type * as DllamaDemoModule from './dev/dllama-demo';
import type * as ControllerModule from './controller';
import type * as TemporalHealthModule from '../platform/temporal-health';

/*
 * Each mode loads its modules only when it runs: `magus convert` must not pay, in start-up time
 * and memory, for Temporal's worker runtime, the Kubernetes client and fastify.
 */
/* eslint-disable @typescript-eslint/no-require-imports */
const load = {
  convert: () => require('./convert') as typeof ConvertModule,
  engine: () => require('./engine') as typeof EngineModule,
  bridge: () => require('./bridge') as typeof BridgeModule,
  fetch: () => require('./fetch') as typeof FetchModule,
  bridgeMetrics: () => require('../dataplane/bridge/metrics') as typeof BridgeMetricsModule,
  gateway: () => require('../gateway/server') as typeof GatewayModule,
  keys: () => require('./keys') as typeof KeysModule,
  usage: () => require('./usage') as typeof UsageModule,
  natsAuth: () => require('./nats-auth') as typeof NatsAuthModule,
  modelPull: () => require('./model-pull') as typeof ModelPullModule,
  modelTiny: () => require('./model-tiny') as typeof ModelTinyModule,
  worker: () => require('./worker') as typeof WorkerModule,
  temporalWorker: () => require('@temporalio/worker') as typeof TemporalWorkerModule,
  dev: () => require('./dev/dev') as typeof DevModule,
  dllamaDemo: () => require('./dev/dllama-demo') as typeof DllamaDemoModule,
  controller: () => require('./controller') as typeof ControllerModule,
  services: () => require('./dev/services') as typeof ServicesModule,
  temporalHealth: () => require('../platform/temporal-health') as typeof TemporalHealthModule,
  processMetrics: () => require('../platform/process-metrics') as typeof ProcessMetricsModule,
};
/* eslint-enable @typescript-eslint/no-require-imports */

const DESCRIPTIONS: Record<Mode, string> = {
  dev: 'everything locally: Temporal, NATS, S3, a worker, the gateway and a demo model (or --model org/repo)',
  worker: 'Temporal workers for the magus-control, magus-pools and magus-pipeline task queues',
  controller: 'watch Model/Dllama/Session resources and drive their workflows',
  gateway: 'OpenAI-compatible HTTP API',
  bridge: 'NATS ↔ engine sidecar',
  fetch: "a Kubernetes instance's init container: artifact files from S3, sha256-checked",
  engine: 'llama.cpp engine with the dllama-api HTTP surface',
  convert: 'convert safetensors to GGUF or distributed-llama',
  model: 'model pull <org/repo>[@rev] --format gguf:q40,…: prepare a model through the pipeline; model tiny <dir>: write a tiny test model',
  keys: 'keys create NAME | limits NAME | list | revoke NAME: API keys and their limits without Kubernetes (on a cluster: ApiKey resources)',
  usage: 'the usage ledger: requests and tokens per key, model and day or month (--csv: the billing export), or each request',
  'nats-auth': 'NATS users per role (gateway, controller, worker; a bridge per instance): credentials files, the signer and the server configuration',
};

/** `magus dev`'s options, in `magus --help` and `magus dev --help` alike. */
const DEV_SYNOPSIS =
  'magus dev [--model org/repo | --demo smollm2|tiny] [--engine KIND [--nodes N]] [--port 8080] [--token-env HF_TOKEN] [--no-kube] [--data-dir DIR] [--fresh]';

export const EXIT_NOT_AVAILABLE = 2;

function usage(): string {
  const width = Math.max(...MODES.map((m) => m.length));
  return [
    'usage: magus <mode> [options]',
    '',
    'modes:',
    ...MODES.map((m) => `  ${m.padEnd(width)}  ${DESCRIPTIONS[m]}`),
    '',
    DEV_SYNOPSIS,
    'magus dev --services temporal,nats,s3,kubernetes [--json]   (only the servers)',
    'magus convert <hf-dir> --format gguf|dllama --weights q40|q80|f16|f32 [-o out] [--threads N]',
    'magus model pull <org/repo>[@revision] --format gguf:q40[,dllama:q40] [--hub URL] [--token-env VAR]',
    'magus model tiny <dir> [--seed N] [--arch llama|qwen3]   (a tiny random safetensors model to try things with)',
    'magus keys create NAME [--models m1,m2] [--rpm N] [--tpm N] [--concurrency N] [--budget-tokens N --period day|month] [--storage-bytes N] [--model-limits M:rpm=N,…] | keys limits NAME … | keys list [--json] | keys revoke NAME',
    'magus usage [--key K] [--since T] [--until T] [--by day|month] [--records] [--json | --csv]   (K: an identity, or NAME for local/NAME; T: 2026-11-29, a date-time, 24h, 7d)',
    'magus engine --model file.gguf [--host 127.0.0.1] [--port 0] [--slots 1] [--threads N] [--ctx 4096]',
    'magus nats-auth --out DIR [--prefix P]   (NATS users per role; each process: MAGUS_NATS_CREDENTIALS=DIR/<role>.creds)',
    '',
    'worker and model read MAGUS_TEMPORAL_ADDRESS, MAGUS_NATS_URL, MAGUS_S3_ENDPOINT, MAGUS_S3_BUCKET',
    '(and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) from the environment; what it leaves unset comes from',
    "a running magus dev's connection.json (in MAGUS_DEV_DATA_DIR, default ~/.local/share/magus/dev).",
  ].join('\n');
}

function parseServices(arg: string | undefined): ServiceName[] {
  if (!arg) return ['temporal', 'nats', 's3'];
  const names = arg
    .split(',')
    .map((s) => s.trim())
    .filter(Boolean);
  const all = load.services().ALL_SERVICES;
  for (const n of names) {
    if (!(all as readonly string[]).includes(n)) throw new Error(`unknown service '${n}' (known: ${all.join(', ')})`);
  }
  return names as ServiceName[];
}

/**
 * How a long-running mode learns it should stop, the same however it was started (a terminal,
 * npm, npx, a supervisor):
 * - SIGINT, SIGTERM and SIGHUP (a closed terminal) ask for a clean stop. SIGHUP is passed on as
 *   SIGTERM, which every mode's own handler takes.
 * - The same request often arrives twice: a terminal's Ctrl-C reaches every process of its
 *   foreground group, `npm run` among them, and npm passes it on. Signals within
 *   {@link REPEAT_WINDOW_MS} of the first are that one request. A later one, during the stop, is
 *   the user insisting: the process exits at once (servers and engines die with it: they run
 *   under `setpriv --pdeathsig KILL`), with 130 after SIGINT and 143 after SIGTERM/SIGHUP.
 *   A listener stays on all three signals meanwhile, so none falls to Node's default (dying
 *   mid-stop).
 * - Started by npm or npx, it has a shell between itself and npm (`sh -c`), which swallows a SIGINT
 *   npm forwards and dies of a SIGTERM without passing it on, leaving this process behind. So
 *   when that parent goes away it stops as on SIGTERM. (`npm run dev` execs magus in place of
 *   the shell; `kill -INT` on an npx process still ends in the shell: send it to the process group.)
 */
export function watchStopRequests(opts: {
  name: string;
  /** Whether a second request forces an exit (engine: no; its second signal aborts generations). */
  forceOnRepeat: boolean;
  proc?: Pick<NodeJS.Process, 'on' | 'off' | 'kill' | 'pid' | 'ppid' | 'exit' | 'env'>;
  log?: (line: string) => void;
  now?: () => number;
  /** How often the parent is checked (ms). */
  parentCheckMs?: number;
}): { signal: AbortSignal; dispose(): void } {
  const proc = opts.proc ?? process;
  const log = opts.log ?? ((line: string) => void process.stderr.write(`magus ${opts.name}: ${line}\n`));
  const now = opts.now ?? Date.now;
  const controller = new AbortController();
  let first: number | undefined;
  const onSignal = (sig: NodeJS.Signals) => {
    const at = now();
    if (first === undefined) {
      first = at;
      controller.abort(sig);
      if (sig === 'SIGHUP') proc.kill(proc.pid, 'SIGTERM');
      return;
    }
    if (at - first < REPEAT_WINDOW_MS || !opts.forceOnRepeat) return;
    log(`${sig} again: exiting now, without finishing the stop`);
    proc.exit(sig === 'SIGINT' ? 130 : 143);
  };
  const signals = ['SIGINT', 'SIGTERM', 'SIGHUP'] as const;
  for (const sig of signals) proc.on(sig, onSignal);
  // npm_lifecycle_event: set by `npm run` and `npm exec`/npx for what they start.
  const parent = proc.ppid;
  const watchParent = proc.env.npm_lifecycle_event !== undefined && parent > 1;
  const timer: NodeJS.Timeout | undefined = watchParent
    ? setInterval(() => {
        if (proc.ppid === parent) return;
        clearInterval(timer);
        if (first !== undefined) return;
        log(`the npm that started it has gone (parent ${parent}): stopping`);
        proc.kill(proc.pid, 'SIGTERM');
      }, opts.parentCheckMs ?? 500).unref()
    : undefined;
  return {
    signal: controller.signal,
    dispose() {
      clearInterval(timer);
      for (const sig of signals) proc.off(sig, onSignal);
    },
  };
}

/** Signals this close after the first are the same request delivered twice (terminal and npm). */
export const REPEAT_WINDOW_MS = 1000;

/** `magus dev`: the whole system; `--services a,b` starts only those servers (no worker, gateway or model). */
async function dev(args: string[], stop: AbortSignal): Promise<number> {
  const flag = (name: string) => {
    const i = args.indexOf(name);
    return i >= 0 ? args[i + 1] : undefined;
  };
  const json = args.includes('--json');
  // A mistyped option (`--fresh-start`, `--datadir`) must not start a dev that ignores it.
  const valued = new Set(['--model', '--port', '--token-env', '--data-dir', '--services', '--demo', '--engine', '--nodes']);
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (valued.has(a)) i++;
    else if (!['--no-kube', '--fresh', '--json'].includes(a)) throw new Error(`dev: unknown option ${a} (magus dev --help lists them)`);
  }
  // Without --services: the whole system (servers, worker, gateway, demo model).
  if (!args.includes('--services')) {
    const port = flag('--port');
    if (port !== undefined && !/^\d{1,5}$/.test(port)) throw new Error(`--port ${port} is not a port number`);
    const dataDir = flag('--data-dir');
    if (args.includes('--data-dir') && !dataDir) throw new Error('--data-dir needs a folder');
    const demo = flag('--demo');
    if (args.includes('--demo') && demo !== 'smollm2' && demo !== 'tiny') throw new Error(`--demo ${demo ?? ''} must be smollm2 or tiny`);
    const engine = flag('--engine');
    if (args.includes('--engine') && !(engine && isEngineKind(engine))) throw new Error(`--engine ${engine ?? ''} must be one of ${ENGINE_KINDS.join(', ')}`);
    if (args.includes('--nodes') && engine !== 'dllama') throw new Error('--nodes is for distributed-llama topologies: give --engine dllama too');
    const nodes = engine === 'dllama' ? load.dllamaDemo().devNodes(flag('--nodes')) : undefined;
    return load.dev().runDev({
      model: flag('--model'),
      ...(demo === 'smollm2' || demo === 'tiny' ? { demo } : {}),
      ...(engine && isEngineKind(engine) ? { engine } : {}),
      ...(nodes !== undefined ? { nodes } : {}),
      port: port === undefined ? undefined : Number(port),
      tokenEnv: flag('--token-env'),
      kube: !args.includes('--no-kube'),
      dataDir,
      fresh: args.includes('--fresh'),
      stop,
    });
  }
  const services = parseServices(flag('--services'));
  if (!json) process.stderr.write(`magus dev: starting ${services.join(', ')} …\n`);
  const running = await load.services().startServices({ services });
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
      e.s3 && `S3 (s3proxy)  ${e.s3.endpoint}  (region ${e.s3.region})`,
      e.kubernetes && `Kubernetes    ${e.kubernetes.server}`,
      `credentials   ${endpointsFile}`,
      '',
      'Ctrl-C stops everything.',
    ].filter((l): l is string => typeof l === 'string');
    process.stdout.write(`${lines.join('\n')}\n`);
  }

  await new Promise<void>((resolve) => {
    if (stop.aborted) resolve();
    else stop.addEventListener('abort', () => resolve(), { once: true });
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
 * (the bridges of the local runtime's instances). Started while Temporal is away, it waits for it
 * (`/readyz` 200 `degraded: …` meanwhile, as when Temporal goes away later) and a stop ends the wait.
 */
function workerCommand(stop: AbortSignal): Promise<number> {
  return configErrors(async () => {
    const cfg = loadConfig();
    const metrics = process.env.MAGUS_METRICS_ADDRESS ?? '127.0.0.1:9464';
    load.temporalWorker().Runtime.install({ logger: load.worker().workerLogger(), telemetryOptions: { metrics: { prometheus: { bindAddress: metrics } } } });
    let ready = false;
    let workers: WorkerModule.RunningWorkers | undefined = undefined; // set once they run; /metrics reads it
    let temporal: TemporalHealthModule.TemporalHealth | undefined = undefined; // the workers', or the start's while it waits for Temporal
    const [host, port] = (process.env.MAGUS_HEALTH_ADDRESS ?? '127.0.0.1:9465').split(':');
    const health = createServer((req, res) => {
      if (req.url === '/metrics') {
        res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4; charset=utf-8' });
        return void res.end(
          load.bridgeMetrics().bridgeMetricsText(workers?.runtime.bridges() ?? []) +
            load.temporalHealth().temporalMetricsText('magus_worker', temporal) +
            load.processMetrics().processMetricsText() +
            load.processMetrics().cachedWorkflowsMetricsText(workers?.cachedWorkflows()),
        );
      }
      // Temporal away: still ready, `degraded: …` (the pollers reconnect by themselves, and a start waits for it; platform/temporal-health.ts).
      if (req.url === '/readyz' && ready)
        return void res.writeHead(200, { 'content-type': 'text/plain' }).end(load.temporalHealth().temporalReadyText(temporal));
      const ok = req.url === '/healthz';
      res.writeHead(ok ? 200 : req.url === '/readyz' ? 503 : 404, { 'content-type': 'text/plain' }).end(ok ? 'ok\n' : 'not ready\n');
    });
    await new Promise<void>((ok) => health.listen(Number(port), host, ok));
    try {
      workers = await load.worker().startWorkers(cfg, undefined, {
        signal: stop,
        onWaitingForTemporal: (waiting) => {
          temporal = waiting;
          ready = true;
        },
      });
    } catch (err) {
      health.close();
      if (!stop.aborted) throw err;
      process.stderr.write('magus worker: stopped before Temporal answered\n');
      return 0;
    }
    temporal = workers.temporal;
    ready = true;
    process.stderr.write(
      `magus worker: polling ${cfg.taskQueue} and its pools and pipeline queues on ${cfg.temporal.address}; metrics on http://${metrics}/metrics\n`,
    );
    const running = workers;
    const stopWorkers = () => {
      ready = false;
      void running.shutdown();
    };
    if (stop.aborted) stopWorkers();
    else stop.addEventListener('abort', stopWorkers, { once: true });
    await workers.done;
    health.close();
    return 0;
  });
}

/**
 * `magus <mode> --help` prints the mode's usage and exits 0, before anything starts (a user's
 * first move: `magus dev --help` must not start the whole stack). Gateway and controller parse
 * their own flags and answer it themselves.
 */
const MODE_USAGE: Partial<Record<Mode, () => string>> = {
  dev: () =>
    [
      `usage: ${DEV_SYNOPSIS}`,
      '       magus dev --services temporal,nats,s3,kubernetes [--json]   (only the servers, with throwaway data)',
      '',
      DESCRIPTIONS.dev,
      '  --model org/repo   pull this Hugging Face repo instead of the offline demo model (needs internet)',
      '  --demo NAME        the offline demo model: smollm2 (SmolLM2-135M-Instruct, the default) or tiny (a tiny',
      '                     random Llama: instant, gibberish)',
      `  --engine KIND      the engine instances run (one of ${ENGINE_KINDS.join(', ')}; as MAGUS_ENGINES; default: the first`,
      '                     that can serve the model). With dllama the demo is stories260K (FFN padded to 192),',
      "                     served by distributed-llama's real dllama-api root and dllama workers (built once, ~20 s)",
      '  --nodes N          distributed-llama nodes per topology, root included: 1, 2 or 4 (default 2; --engine dllama)',
      "  --port P           the gateway's port (default: the last run's, else 8080, else one the kernel picks)",
      '  --token-env VAR    the environment variable holding a Hugging Face token (gated repos)',
      '  --no-kube          do not start etcd + kube-apiserver and the controller (the kubectl door)',
      '  --data-dir DIR     where the state is kept across restarts (default $MAGUS_DEV_DATA_DIR, else',
      '                     $XDG_DATA_HOME/magus/dev or ~/.local/share/magus/dev); one magus dev per folder',
      '  --fresh            start over: empty the data folder first (new API token, the model pulled again)',
      '',
      'MAGUS_SESSION_TTL_MS: how long a conversation keeps its session (its engine, its magus_sessions entry) after',
      'its last turn, as for magus gateway: default 1800000 (30 min), 60000 to 86400000.',
      "MAGUS_MAX_QUEUE_WAIT: the longest a turn may be expected to wait in an engine's queue before it gets 429",
      'queue_full, as for magus gateway: default 5s; 0 bounds nothing.',
      '',
      "State (Temporal's database, the JetStream store, the S3 data, the API token, the ports) is kept in the",
      'data folder: a restart comes back with it. While it runs, connection.json there (0600) tells every other',
      'magus command (model pull, worker, gateway …) where it is. Ctrl-C or SIGTERM stops it; a second one, a',
      'second or more later, exits at once.',
    ].join('\n'),
  worker: () =>
    [
      'usage: magus worker',
      '',
      DESCRIPTIONS.worker,
      'Reads MAGUS_TEMPORAL_ADDRESS, MAGUS_TEMPORAL_NAMESPACE, MAGUS_TASK_QUEUE, MAGUS_NATS_URL, MAGUS_NATS_PREFIX,',
      'MAGUS_S3_ENDPOINT, MAGUS_S3_BUCKET, MAGUS_S3_REGION (and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), MAGUS_MODEL_CACHE,',
      'MAGUS_DLLAMA_API_BIN / MAGUS_DLLAMA_BIN; with KUBECONFIG (or in a pod) it also writes Model/Dllama status.',
      "MAGUS_HUB_ALLOW_NETWORKS: CIDRs and keywords (loopback, private, link-local, metadata …) a Model's hub may be at; unset: none.",
      'MAGUS_ENGINE_STANDBY: auto or 1 (default) keeps an engine on standby beside each llama.cpp engine of the local runtime,',
      'which serves at once if that one dies (not ~3 s later): warm (its context made, a second KV cache held) when that fits in',
      'half the free memory, else mapped (its model only; a start makes the context); warm, mapped: always that kind; 0: none.',
      'Metrics on MAGUS_METRICS_ADDRESS (127.0.0.1:9464); /healthz, /readyz, /metrics on MAGUS_HEALTH_ADDRESS (127.0.0.1:9465).',
    ].join('\n'),
  convert: () => load.convert().CONVERT_USAGE,
  engine: () => load.engine().ENGINE_USAGE,
  bridge: () => load.bridge().BRIDGE_USAGE,
  fetch: () => load.fetch().FETCH_USAGE,
  model: () => `${load.modelPull().PULL_USAGE}\n\n${load.modelTiny().TINY_USAGE}`,
  'nats-auth': () => load.natsAuth().NATS_AUTH_USAGE,
};

/**
 * The AWS SDK's documented switch for its "NodeVersionSupportWarning" (a notice about its own
 * future releases, printed by every mode that opens an S3 client); only that notice, and only
 * unless the user set the variable.
 */
export function quietAwsNodeVersionNotice(env: NodeJS.ProcessEnv = process.env): void {
  env.AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED ??= 'true';
}

export async function main(argv: string[]): Promise<number> {
  const [mode, ...rest] = argv;
  quietAwsNodeVersionNotice();
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
  if (LONG_RUNNING.has(mode as Mode)) {
    const stop = watchStopRequests({ name: mode, forceOnRepeat: mode !== 'engine' });
    try {
      return await runLongRunning(mode as Mode, rest, stop.signal);
    } finally {
      stop.dispose();
    }
  }
  switch (mode as Mode) {
    case 'convert':
      return load.convert().convertCommand(rest);
    case 'fetch':
      return load.fetch().fetchCommand(rest);
    case 'model':
      if (rest[0] === 'pull') return configErrors(() => load.modelPull().modelPullCommand(rest.slice(1)));
      if (rest[0] === 'tiny') return load.modelTiny().modelTinyCommand(rest.slice(1));
      process.stderr.write(`${load.modelPull().PULL_USAGE}\n\n${load.modelTiny().TINY_USAGE}\n`);
      return 1;
    case 'keys':
      return configErrors(() => load.keys().keysCommand(rest));
    case 'usage':
      return configErrors(() => load.usage().usageCommand(rest));
    case 'nats-auth':
      return load.natsAuth().natsAuthCommand(rest);
    default:
      process.stderr.write(`magus ${mode}: not yet available in this version of magus.\n`);
      return EXIT_NOT_AVAILABLE;
  }
}

/** Modes that run until they are told to stop. */
const LONG_RUNNING: ReadonlySet<Mode> = new Set<Mode>(['dev', 'worker', 'engine', 'bridge', 'gateway', 'controller']);

async function runLongRunning(mode: Mode, rest: string[], stop: AbortSignal): Promise<number> {
  if (mode === 'dev') return dev(rest, stop);
  // The servers a running `magus dev` has, for the settings the environment leaves unset.
  if (mode !== 'engine') {
    const devUse = useDevConnection(process.env, mode === 'gateway' || mode === 'controller' || mode === 'bridge' ? mode : 'worker');
    if (devUse && devUse.taken.length > 0)
      process.stderr.write(
        `magus ${mode}: using the running magus dev (pid ${devUse.connection.pid}) for ${devUse.taken.filter((v) => !v.startsWith('AWS_')).join(', ')} (${devUse.file})\n`,
      );
  }
  switch (mode) {
    case 'worker':
      return workerCommand(stop);
    case 'engine':
      return load.engine().engineCommand(rest);
    case 'bridge':
      return load.bridge().bridgeCommand(rest);
    case 'gateway':
      return configErrors(() => load.gateway().gatewayCommand(rest));
    case 'controller':
      return configErrors(() => load.controller().controllerCommand(rest));
    default:
      throw new Error(`${mode} is not a long-running mode`);
  }
}

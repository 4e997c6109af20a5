/**
 * `magus controller`: wires the controller core (controller.ts) to Temporal, NATS and the
 * cluster, runs it while this replica holds the leader Lease, and serves `/healthz`, `/readyz`
 * and `/metrics` (Prometheus text). Stops cleanly on SIGINT/SIGTERM.
 */
import { MeterVerifier } from '../dataplane/meter';
import { natsConnectAuth, readNatsCredentials } from '../dataplane/roles';
import { createServer } from 'node:http';
import { hostname } from 'node:os';
import { Client, Connection } from '@temporalio/client';
import { connect, type NatsConnection } from 'nats';
import { dataPlaneNames, declareOnReconnect, ensureDataPlane, type DataPlaneNames } from '../dataplane';
import { LimitStore } from '../dataplane/limits';
import { parseDuration } from '../shared/kube';
import { loadConfig } from './config';
import { natsServerList } from '../platform/config';
import { processMetricsText } from '../platform/process-metrics';
import { TEMPORAL_CHANNEL_ARGS, temporalMetricsText, temporalReadyText, watchTemporal } from '../platform/temporal-health';
import { kubeConfigFromEnv } from './worker';
import { startController, type Controller, type ControllerMetrics } from '../controller/controller';
import { startLeaderElection } from '../controller/leader';

export const CONTROLLER_USAGE = [
  'usage: magus controller [--namespace NS[,NS…]] [--shared-model-namespaces NS,…] [--health-address host:port] [--no-leader-elect] [--cleanup-timeout 2m] [--session-mirror-cap N]',
  '',
  'Watches Model and Dllama resources and drives their workflows; registers ApiKeys (and Secrets labelled',
  'magus.dev/api-token=true, until the next release) as API keys. Needs a cluster (in a pod, or KUBECONFIG)',
  'and reads MAGUS_TEMPORAL_ADDRESS,',
  'MAGUS_TEMPORAL_NAMESPACE, MAGUS_TASK_QUEUE, MAGUS_NATS_URL and MAGUS_NATS_PREFIX like `magus worker`.',
  '  --namespace NS,…      watch only these namespaces, one watch each (comma-separated, or the flag',
  '                         repeated; default MAGUS_CONTROLLER_NAMESPACES, else all namespaces).',
  '                         Its roles may then be Roles in those namespaces: no cluster-wide rights',
  '  --shared-model-namespaces NS,…  namespaces whose models an ApiKey of any namespace may name',
  '                         (ns/name, ns/*); default MAGUS_SHARED_MODEL_NAMESPACES, else none',
  '  --health-address A     /healthz, /readyz, /metrics (default MAGUS_HEALTH_ADDRESS or 127.0.0.1:9466)',
  '  --no-leader-elect      do not take the Lease magus-controller (only for a single replica)',
  "  --cleanup-timeout D    how long a deleted resource's cleanup may take before it is cut short",
  '  --session-mirror-cap N live conversations shown as Session resources, at most (default 200; 0: none)',
].join('\n');

/** Prometheus text of the controller's counters. */
export function controllerMetricsText(m: ControllerMetrics | undefined, leader: boolean): string {
  const lines = [
    '# HELP magus_controller_leader 1 when this replica holds the Lease.',
    '# TYPE magus_controller_leader gauge',
    `magus_controller_leader ${leader ? 1 : 0}`,
  ];
  if (!m) return `${lines.join('\n')}\n`;
  const counters: [string, string, number][] = [
    ['signals_total', 'Signal-with-starts sent to entity workflows.', m.signals],
    ['reconciles_total', 'Reconciles run.', m.reconciles],
    ['reconcile_failures_total', 'Reconciles that failed (retried with backoff).', m.failures],
    ['finalizers_removed_total', 'Deletions completed.', m.finalizersRemoved],
    ['cleanups_timed_out_total', 'Deletions whose cleanup was cut short.', m.cleanupsTimedOut],
    ['tokens_written_total', 'API keys registered (or changed) in magus_tokens.', m.tokensWritten],
    ['tokens_removed_total', 'Tokens revoked from magus_tokens.', m.tokensRemoved],
    ['token_conflicts_total', 'Keys refused because another key holds their token id.', m.tokenConflicts],
  ];
  for (const [name, help, v] of counters)
    lines.push(`# HELP magus_controller_${name} ${help}`, `# TYPE magus_controller_${name} counter`, `magus_controller_${name} ${v}`);
  lines.push('# HELP magus_controller_watch_errors_total Failed list/watch requests, by resource.', '# TYPE magus_controller_watch_errors_total counter');
  for (const [w, s] of Object.entries(m.watches)) lines.push(`magus_controller_watch_errors_total{resource="${w}"} ${s.errors}`);
  lines.push('# HELP magus_controller_relists_total Lists made (the first and every relist), by resource.', '# TYPE magus_controller_relists_total counter');
  for (const [w, s] of Object.entries(m.watches)) lines.push(`magus_controller_relists_total{resource="${w}"} ${s.lists}`);
  return `${lines.join('\n')}\n`;
}

const NAMESPACE = /^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$/;

/** Namespace names of a comma-separated list, each checked; duplicates dropped. */
function namespaceList(text: string, what: string): string[] {
  const names = text
    .split(',')
    .map((n) => n.trim())
    .filter(Boolean);
  for (const n of names) if (!NAMESPACE.test(n)) throw new Error(`${what} ${JSON.stringify(n)} is not a namespace name`);
  return [...new Set(names)];
}

/** `magus controller`'s flags (and MAGUS_CONTROLLER_NAMESPACES, MAGUS_SHARED_MODEL_NAMESPACES, MAGUS_HEALTH_ADDRESS); throws naming the bad one. */
export function parseControllerArgs(args: string[]): {
  namespaces: string[];
  sharedModelNamespaces: string[];
  health: string;
  leaderElect: boolean;
  cleanupTimeoutMs: number;
  sessionCap: number;
} {
  let sessionCap = 200;
  let shared = process.env.MAGUS_SHARED_MODEL_NAMESPACES ?? '';
  const namespaces: string[] = [];
  let namespaceFlag = false;
  let health = process.env.MAGUS_HEALTH_ADDRESS ?? '127.0.0.1:9466';
  let leaderElect = true;
  let cleanupTimeoutMs = 120_000;
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    const value = () => {
      const v = args[++i];
      if (v === undefined) throw new Error(`${a} needs a value`);
      return v;
    };
    if (a === '--namespace') {
      namespaceFlag = true;
      const v = value();
      const listed = namespaceList(v, '--namespace');
      if (listed.length === 0) throw new Error(`--namespace ${JSON.stringify(v)} names no namespace`);
      namespaces.push(...listed);
    } else if (a === '--shared-model-namespaces') shared = value();
    else if (a === '--health-address') health = value();
    else if (a === '--no-leader-elect') leaderElect = false;
    else if (a === '--cleanup-timeout') {
      const d = parseDuration(value());
      if (d === null || d < 1000) throw new Error(`--cleanup-timeout ${args[i]} is not a duration like 90s or 2m (at least 1s)`);
      cleanupTimeoutMs = d;
    } else if (a === '--session-mirror-cap') {
      sessionCap = Number(value());
      if (!Number.isInteger(sessionCap) || sessionCap < 0 || sessionCap > 100_000)
        throw new Error(`--session-mirror-cap ${args[i]} must be a whole number from 0 to 100000`);
    } else throw new Error(`unknown option ${a}`);
  }
  if (!namespaceFlag) namespaces.push(...namespaceList(process.env.MAGUS_CONTROLLER_NAMESPACES ?? '', 'MAGUS_CONTROLLER_NAMESPACES:'));
  const sharedModelNamespaces = namespaceList(shared, 'shared model namespace');
  if (!/^[A-Za-z0-9.-]+:\d{1,5}$/.test(health)) throw new Error(`health address ${health} is not host:port`);
  return { namespaces: [...new Set(namespaces)], sharedModelNamespaces, health, leaderElect, cleanupTimeoutMs, sessionCap };
}

export async function controllerCommand(args: string[]): Promise<number> {
  if (args.includes('--help') || args.includes('-h')) {
    process.stdout.write(`${CONTROLLER_USAGE}\n`);
    return 0;
  }
  let opts: ReturnType<typeof parseControllerArgs>;
  try {
    opts = parseControllerArgs(args);
  } catch (err) {
    process.stderr.write(`magus controller: ${(err as Error).message}\n${CONTROLLER_USAGE}\n`);
    return 1;
  }
  const kc = kubeConfigFromEnv();
  if (!kc) {
    process.stderr.write('magus controller: no cluster: run it in a pod or set KUBECONFIG\n');
    return 1;
  }
  const cfg = loadConfig();
  const log = (line: string) => process.stderr.write(`magus controller: ${line}\n`);
  // Lazy: the controller starts, watches and mirrors tokens with Temporal away; reconciles that
  // need it fail and come back with the queue's capped backoff until it answers.
  const connection = Connection.lazy({ address: cfg.temporal.address, channelArgs: TEMPORAL_CHANNEL_ARGS });
  const temporal = watchTemporal(connection, {
    onChange: (up) => log(`Temporal at ${cfg.temporal.address} ${up ? 'answers' : 'is unreachable: reconciles retry with backoff until it is back'}`),
  });
  const client = new Client({ connection, namespace: cfg.temporal.namespace });
  const nc = await connect({
    servers: natsServerList(cfg.nats.servers),
    name: 'magus-controller',
    maxReconnectAttempts: -1,
    ...natsConnectAuth(cfg.nats.credentials, natsServerList(cfg.nats.servers), (line) => process.stderr.write(`magus controller: ${line}\n`)),
  });
  // As the controller role it may declare nothing (dataplane/roles.ts): the data plane is the
  // worker's to declare, and the controller waits for it. Without credentials it declares it itself.
  const declares = !cfg.nats.credentials || readNatsCredentials(cfg.nats.credentials).role === 'worker';
  const names = declares
    ? await declareOnReconnect(nc, () => ensureDataPlane(nc, { prefix: cfg.natsPrefix, replicas: cfg.natsReplicas, ...cfg.responses }), {
        what: 'data plane',
        log,
      })
    : await dataPlaneDeclared(nc, dataPlaneNames(cfg.natsPrefix), log);
  const tokens = await nc.jetstream().views.kv(names.tokensBucket, { bindOnly: !declares });
  const sessions = { kv: await nc.jetstream().views.kv(names.sessionsBucket, { bindOnly: !declares }), cap: opts.sessionCap };
  // ApiKeys' usage: the ledger (records a gateway signed), and the gateways' counts for what a budget has left.
  const limitsKv = await nc.jetstream().views.kv(names.limitsBucket, { bindOnly: true });
  const usage = {
    js: nc.jetstream(),
    bucket: names.usageBucket,
    sumsBucket: names.usageSumsBucket,
    limits: new LimitStore(limitsKv),
    verifier: new MeterVerifier(limitsKv),
  };

  let controller: Controller | undefined;
  let synced = false;
  const run = () => {
    controller = startController({
      kc,
      temporal: { client, namespace: cfg.temporal.namespace, taskQueue: cfg.taskQueue },
      tokens,
      sharedModelNamespaces: opts.sharedModelNamespaces,
      sessions,
      usage,
      namespaces: opts.namespaces,
      cleanupTimeoutMs: opts.cleanupTimeoutMs,
      log,
    });
    void controller.synced.then(
      () => (synced = true),
      () => undefined,
    );
  };
  const halt = async () => {
    synced = false;
    const c = controller;
    controller = undefined;
    await c?.stop();
  };

  let stopping: () => void = () => undefined;
  const stopped = new Promise<void>((r) => (stopping = r));
  const leaseNamespace =
    process.env.MAGUS_NAMESPACE ??
    (opts.namespaces.length === 1 ? opts.namespaces[0] : undefined) ??
    kc.getContextObject(kc.getCurrentContext())?.namespace ??
    'default';
  const election = opts.leaderElect
    ? startLeaderElection({
        kc,
        namespace: leaseNamespace,
        name: 'magus-controller',
        identity: `${hostname()}-${process.pid}`,
        onStartedLeading: run,
        // A replica that lost the Lease stops at once; another one takes over.
        onStoppedLeading: () => void halt(),
        log,
      })
    : undefined;
  if (!election) run();

  const [host, port] = opts.health.split(':') as [string, string];
  const health = createServer((req, res) => {
    const leader = election ? election.isLeader() : true;
    if (req.url === '/metrics') {
      res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4; charset=utf-8' });
      return void res.end(controllerMetricsText(controller?.metrics(), leader) + temporalMetricsText('magus_controller', temporal) + processMetricsText());
    }
    // Ready: leading with every watch synced, or standing by (a standby is healthy too); Temporal
    // away only degrades it (200 `degraded: …`: it reconnects by itself).
    if (req.url === '/readyz' && (leader ? synced : true)) return void res.writeHead(200, { 'content-type': 'text/plain' }).end(temporalReadyText(temporal));
    const ok = req.url === '/healthz';
    res.writeHead(ok ? 200 : req.url === '/readyz' ? 503 : 404, { 'content-type': 'text/plain' }).end(ok ? 'ok\n' : 'not ready\n');
  });
  await new Promise<void>((ok, fail) => {
    health.once('error', fail);
    health.listen(Number(port), host, ok);
  });
  log(
    `watching ${opts.namespaces.length > 0 ? `namespace${opts.namespaces.length > 1 ? 's' : ''} ${opts.namespaces.join(', ')}` : 'all namespaces'}; health and metrics on http://${opts.health}`,
  );
  for (const sig of ['SIGINT', 'SIGTERM'] as const) process.once(sig, () => stopping());
  await stopped;
  log('stopping');
  await halt();
  await election?.stop();
  health.close();
  await nc.drain();
  await temporal.close();
  await connection.close();
  return 0;
}

/**
 * `names` once the buckets the controller opens exist (the worker declares them): polled every
 * 2 s, said once while it waits. A controller started before any worker waits rather than exits.
 */
async function dataPlaneDeclared(nc: NatsConnection, names: DataPlaneNames, log: (line: string) => void): Promise<DataPlaneNames> {
  const jsm = await nc.jetstreamManager({ checkAPI: false });
  const buckets = [names.tokensBucket, names.sessionsBucket, names.limitsBucket, names.usageBucket, names.usageSumsBucket];
  const declared = (bucket: string) =>
    jsm.streams.info(`KV_${bucket}`).then(
      () => true,
      () => false,
    );
  for (let said = false; ; said = true) {
    const missing: string[] = [];
    for (const b of buckets) if (!(await declared(b))) missing.push(b);
    if (missing.length === 0) return names;
    if (!said) log(`waiting for the data plane (${missing.join(', ')}): the worker declares it`);
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

/**
 * `magus bridge`: the sidecar next to an engine, as a process — flags, the NATS connection, the
 * data plane and this instance's consumer, `/health` `/ready` `/metrics`, SIGINT/SIGTERM. The
 * bridge itself is dataplane/bridge (the local runtime runs the same one in process).
 */
import { bridgeInboxPrefixOf, natsConnectAuth, natsCredentialsFrom, readNatsCredentials } from '../dataplane/roles';
import { createServer, type Server } from 'node:http';
import { connect } from 'nats';
import { dataPlaneNames, declareOnReconnect, ensureDataPlane, ensureInstanceConsumer } from '../dataplane';
import { bridgeMetricsText, startBridge } from '../dataplane/bridge';
import { ENGINE_KINDS, isEngineKind, type EngineKind } from '../shared/engines';

import { checkNatsServerList, natsReplicasFrom, natsServerList, responseStreamSizing } from '../platform/config';
import { processMetricsText } from '../platform/process-metrics';

export const BRIDGE_USAGE =
  'usage: magus bridge --pool P --instance I --engine http://HOST:PORT [--nats nats://HOST:PORT] [--slots N]\n' +
  `                    [--engine-kind ${ENGINE_KINDS.join('|')}] [--ack-wait-ms MS] [--drain-timeout-ms MS] [--health-port PORT] [--prefix NAME]\n` +
  'On SIGTERM it serves what its consumer still holds, stops taking requests and lets those in flight finish, all within\n' +
  "--drain-timeout-ms (default 30000); GET /drained on the health port answers once that is done (an engine container's\n" +
  'preStop waits on it, so the engine outlives the answers).\n' +
  'environment: MAGUS_NATS_URL (comma-separated: every server of a cluster), MAGUS_NATS_REPLICAS; MAGUS_RESPONSES_PEAK_BYTES_PER_SEC, MAGUS_RESPONSES_RETENTION_MS (as for the worker)';

/** `magus bridge …`: declares the data plane and this instance's consumer, serves until SIGINT/SIGTERM. */
export async function bridgeCommand(args: string[]): Promise<number> {
  const flags = new Map<string, string>();
  for (let i = 0; i < args.length; i += 1) {
    const a = args[i] as string;
    const value = args[i + 1];
    if (!a.startsWith('--') || value === undefined || value.startsWith('--')) {
      process.stderr.write(`magus bridge: unexpected argument '${a}'\n${BRIDGE_USAGE}\n`);
      return 1;
    }
    flags.set(a.slice(2), value);
    i += 1;
  }
  const problems: string[] = [];
  const known = new Set(['nats', 'pool', 'instance', 'engine', 'engine-kind', 'slots', 'ack-wait-ms', 'drain-timeout-ms', 'health-port', 'prefix']);
  for (const k of flags.keys()) if (!known.has(k)) problems.push(`unknown option --${k}`);
  const natsUrl = flags.get('nats') ?? process.env.MAGUS_NATS_URL ?? 'nats://127.0.0.1:4222';
  const pool = flags.get('pool') ?? '';
  const instance = flags.get('instance') ?? '';
  const engineUrl = flags.get('engine') ?? '';
  const engineKind = flags.get('engine-kind') ?? 'llamacpp';
  if (!isEngineKind(engineKind)) problems.push(`--engine-kind must be one of ${ENGINE_KINDS.join(', ')}`);
  const int = (name: string, fallback: number | undefined, min: number): number | undefined => {
    const raw = flags.get(name);
    if (raw === undefined) return fallback;
    const n = Number(raw);
    if (!Number.isInteger(n) || n < min) problems.push(`--${name} must be an integer ≥ ${min}`);
    return n;
  };
  const slots = int('slots', 1, 1) ?? 1;
  const ackWaitMs = int('ack-wait-ms', undefined, 1000);
  const drainTimeoutMs = int('drain-timeout-ms', undefined, 0);
  const healthPort = int('health-port', undefined, 0);
  checkNatsServerList('--nats', natsUrl, problems);
  if (!pool) problems.push('--pool is required');
  if (!instance) problems.push('--instance is required');
  if (!/^https?:\/\/[^\s]+$/.test(engineUrl)) problems.push('--engine must be an http(s) URL');
  // It declares the data plane like the worker does: with the same response stream size.
  const responses = responseStreamSizing(process.env, problems);
  const replicas = natsReplicasFrom(process.env, problems);
  const credentials = natsCredentialsFrom(process.env, problems);
  // A bridge user is its instance's: another instance's would be refused its consumer.
  const own = credentials && pool && instance && !problems.length ? readNatsCredentials(credentials) : undefined;
  if (own?.role === 'bridge' && own.inboxPrefix !== bridgeInboxPrefixOf(pool, instance))
    problems.push(`MAGUS_NATS_CREDENTIALS=${credentials} is another instance's bridge user (its inbox ${own.inboxPrefix}), not ${pool}/${instance}'s`);
  if (problems.length > 0) {
    process.stderr.write(`magus bridge: ${problems.join('; ')}\n${BRIDGE_USAGE}\n`);
    return 1;
  }

  const log = (line: string) => process.stderr.write(`magus bridge: ${line}\n`);
  const role = own?.role; // read above: credentials given and nothing wrong so far
  const nc = await connect({
    servers: natsServerList(natsUrl),
    name: `magus-bridge-${pool}-${instance}`,
    maxReconnectAttempts: -1,
    noAsyncTraces: true,
    ...natsConnectAuth(credentials, natsServerList(natsUrl), log),
  });
  let health: Server | undefined;
  try {
    // As the bridge role it may declare nothing but its instance's consumer: the data plane is the worker's to declare.
    const names =
      role === 'bridge'
        ? dataPlaneNames(flags.get('prefix'))
        : await declareOnReconnect(nc, () => ensureDataPlane(nc, { prefix: flags.get('prefix'), replicas, ...responses }), { what: 'data plane', log });
    await ensureInstanceConsumer(await nc.jetstreamManager(), names, { pool, instance, slots, ackWaitMs });
    const bridge = await startBridge({
      nc,
      names,
      pool,
      instance,
      engineUrl,
      slots,
      engineKind: engineKind as EngineKind,
      ...(drainTimeoutMs !== undefined ? { drainTimeoutMs } : {}),
    });
    if (healthPort !== undefined) {
      // /health: the bridge itself (liveness; a slow engine must not get the sidecar killed);
      // /ready: the bridge and the engine (readiness); /metrics: Prometheus.
      health = createServer((req, res) => {
        if (req.url === '/drained')
          return void drained(bridge).then((body) => res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify(body)));
        if (req.url === '/metrics') {
          res.writeHead(200, { 'content-type': 'text/plain; version=0.0.4; charset=utf-8' });
          return void res.end(bridgeMetricsText([{ pool, instance, stats: bridge.stats, health: bridge.health() }]) + processMetricsText());
        }
        void (async () => {
          const own = bridge.health();
          const engine = req.url === '/ready' ? await bridge.checkEngine() : undefined;
          const ok = own.ok && (engine?.ok ?? true);
          res.writeHead(req.url === '/health' || req.url === '/ready' ? (ok ? 200 : 503) : 404, { 'content-type': 'application/json' });
          res.end(JSON.stringify({ ...own, ok, engine, stats: bridge.stats }));
        })();
      }).listen(healthPort);
    }
    process.stderr.write(`magus bridge: serving ${pool}/${instance} (${slots} slot(s)) from ${natsUrl} to ${engineUrl}\n`);
    await new Promise<void>((resolve) => {
      for (const sig of ['SIGINT', 'SIGTERM'] as const) process.once(sig, () => resolve());
    });
    process.stderr.write('magus bridge: stopping …\n');
    await bridge.stop();
    return 0;
  } finally {
    // A `/drained` being answered is let finish (the kubelet's preStop reads it), at most 1 s.
    const h = health;
    if (h) await new Promise<void>((resolve) => (h.close(() => resolve()), setTimeout(() => h.closeAllConnections(), 1000).unref()));
    await nc.drain().catch(() => undefined);
  }
}

/** How long `/drained` waits for the bridge's own SIGTERM before it answers that it is not stopping. */
const DRAINED_SIGTERM_WAIT_MS = 2000;

/**
 * `GET /drained`, the engine container's preStop: the kubelet runs each container's preStop and
 * then sends it SIGTERM, all containers at once, so without it the engine would stop under the
 * answers the bridge is finishing. It answers once the bridge has stopped (what was in flight
 * ended, or was handed back at its drain timeout). A bridge that receives no SIGTERM within 2 s is
 * not stopping (the engine container alone is restarted, after a failed probe): answered at once.
 */
async function drained(bridge: { draining: boolean; stop(): Promise<void> }): Promise<{ drained: boolean; waitedMs: number }> {
  const started = Date.now();
  while (!bridge.draining && Date.now() - started < DRAINED_SIGTERM_WAIT_MS) await new Promise((r) => setTimeout(r, 100));
  if (!bridge.draining) return { drained: false, waitedMs: Date.now() - started };
  await bridge.stop();
  return { drained: true, waitedMs: Date.now() - started };
}

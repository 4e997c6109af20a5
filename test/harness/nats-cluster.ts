/**
 * A private NATS JetStream cluster for one test file: `size` nats-servers (default 3) clustered on
 * loopback, each with its own client, monitor and cluster port, `server_name` (`n1`, `n2`, …) and
 * store, from a config file this module writes (routes to every node, JetStream with
 * `sync_interval`). Not the global test server: a test may SIGKILL and restart its nodes.
 *
 *     let cluster: TestNatsCluster;
 *     beforeAll(async () => { cluster = await startNatsCluster(); }, 120_000);
 *     afterAll(() => cluster?.stop(), 30_000);
 *
 * Ports are chosen free, released and bound a moment later (workers/dev/services/ports.ts); when a node then finds
 * one taken ("address already in use"), the whole cluster starts again on new ports (each node's
 * routes name the others' cluster ports), at most `portAttempts` times. A node restarted after
 * {@link TestNatsCluster.kill} comes back on its own ports with its store, as a rescheduled pod
 * would; if another process took a port meanwhile the restart fails naming it. Every server runs
 * under `setpriv --pdeathsig KILL` (workers/dev/services/supervision.ts `launch`): it dies with the jest worker.
 */
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { alive, end, freePort, launch, resolveBinaries, type Proc } from '../../workers/dev/services';
import { sleep } from './wait';

/** What nats-server prints when a port it was given is taken (workers/dev/services/supervision.ts lists the forms). */
const ADDRESS_IN_USE = /address already in use/i;

export interface NatsClusterOptions {
  /** Servers (default 3). */
  size?: number;
  /**
   * JetStream's `sync_interval`: `always` fsyncs every write before it is acknowledged; a
   * duration (`2m`, nats-server's default) leaves writes in the page cache until then.
   */
  syncInterval?: string;
  /** Bound of each wait for the servers to be ready (default 90 s). */
  readyTimeoutSec?: number;
  /** Starts on fresh ports before "address already in use" is final (default 5). */
  portAttempts?: number;
  /** More of each node's configuration (`magus nats-auth`'s operator mode, say). */
  extraConfig?: string;
}

/**
 * The configuration a server gets from `magus nats-auth`'s nats-values.yaml (`valuesFile`) as the
 * official nats chart renders it: each key of its `config.merge` a line, its value as JSON (an
 * `extraConfig`).
 */
export function chartMergedConfig(valuesFile: string): string {
  const { merge } = (JSON.parse(readFileSync(valuesFile, 'utf8')) as { config: { merge: Record<string, unknown> } }).config;
  return Object.entries(merge)
    .map(([k, v]) => `${k}: ${JSON.stringify(v)}`)
    .join('\n');
}

export interface NatsClusterNode {
  /** Its `server_name`, as stream info's `cluster.leader` and `replicas[].name` give it. */
  name: string;
  clientUrl: string;
  monitorUrl: string;
  readonly pid: number | undefined;
  readonly running: boolean;
}

export interface TestNatsCluster {
  /** Every node's client URL, for `connect({ servers })` or `MAGUS_NATS_URL` (comma-joined). */
  servers: string[];
  nodes: NatsClusterNode[];
  node(name: string): NatsClusterNode;
  /** SIGKILLs a node (no lame duck, no flush: a crash) and waits until it is gone. */
  kill(name: string): Promise<void>;
  /** Starts a killed node again on its ports with its store; resolves once it is healthy. */
  restart(name: string): Promise<void>;
  /** The JetStream meta leader, as a running node's `/jsz` reports it (undefined: none now). */
  metaLeader(): Promise<string | undefined>;
  /** Stops every node and removes the stores. */
  stop(): Promise<void>;
  dataDir: string;
}

interface NodePorts {
  client: number;
  monitor: number;
  cluster: number;
}

/** A node's configuration; one alone (`all` of one) is a server of its own, no cluster. */
function configFor(name: string, ports: NodePorts, all: NodePorts[], store: string, syncInterval: string, extra = ''): string {
  const routes = all.filter((p) => p.cluster !== ports.cluster).map((p) => `    nats-route://127.0.0.1:${p.cluster}`);
  const cluster = ['cluster {', '  name: magus-test', `  listen: 127.0.0.1:${ports.cluster}`, '  routes: [', ...routes, '  ]', '}'];
  return [
    `server_name: ${name}`,
    `listen: 127.0.0.1:${ports.client}`,
    `http: 127.0.0.1:${ports.monitor}`,
    'jetstream {',
    `  store_dir: "${store}"`,
    `  sync_interval: ${syncInterval}`,
    // Each node reserves a memory stream's max_bytes for its replica: three nodes on one machine.
    '  max_memory_store: 1GB',
    '  max_file_store: 4GB',
    '}',
    ...(all.length > 1 ? cluster : []),
    extra,
    '',
  ].join('\n');
}

async function healthy(monitorUrl: string): Promise<boolean> {
  try {
    // In a cluster /healthz also waits for JetStream's meta group to be current.
    return (await fetch(`${monitorUrl}/healthz`, { signal: AbortSignal.timeout(2_000) })).ok;
  } catch {
    return false;
  }
}

export async function startNatsCluster(opts: NatsClusterOptions = {}): Promise<TestNatsCluster> {
  const size = opts.size ?? 3;
  const syncInterval = opts.syncInterval ?? 'always';
  const timeoutMs = (opts.readyTimeoutSec ?? 90) * 1000;
  const attempts = Math.max(1, opts.portAttempts ?? 5);
  const bin = (await resolveBinaries(['nats-server']))['nats-server'];
  if (!bin) throw new Error('scripts/dev-services did not resolve nats-server');
  const dataDir = mkdtempSync(join(tmpdir(), 'magus-nats-cluster-'));
  const logDir = join(dataDir, 'logs');
  mkdirSync(logDir, { recursive: true });
  const names = Array.from({ length: size }, (_, i) => `n${i + 1}`);
  const storeOf = (name: string) => join(dataDir, name, 'jetstream');
  const confOf = (name: string) => join(dataDir, name, 'nats.conf');
  const procs = new Map<string, Proc<string>>();
  let ports: NodePorts[] = [];
  const env = { GOMAXPROCS: '1' };

  const launchNode = (i: number, note: string): Proc<string> => {
    const name = names[i]!;
    const p = launch(name, bin, ['-c', confOf(name)], logDir, env, note);
    procs.set(name, p);
    return p;
  };

  /** Waits until `name` is healthy; throws (with its log tail) when it exits or loses a port. */
  const waitHealthy = async (name: string, deadline: number): Promise<void> => {
    const p = procs.get(name)!;
    const i = names.indexOf(name);
    while (Date.now() < deadline) {
      if (!alive(p) || ADDRESS_IN_USE.test(p.output())) break;
      if (await healthy(`http://127.0.0.1:${ports[i]!.monitor}`)) return;
      await sleep(150);
    }
    const tail = p.output().split('\n').slice(-20).join('\n');
    const why = ADDRESS_IN_USE.test(p.output()) ? 'a port of its is taken' : alive(p) ? `not healthy within ${timeoutMs / 1000} s` : 'it exited';
    throw Object.assign(new Error(`nats-server ${name} did not become ready (${why}); log tail:\n${tail}`), { portTaken: ADDRESS_IN_USE.test(p.output()) });
  };

  const stopAll = async () => {
    await Promise.all([...procs.values()].map((p) => end(p, 5_000)));
  };

  for (let attempt = 1; ; attempt++) {
    ports = [];
    const handed = new Set<number>();
    for (let i = 0; i < size; i++) {
      const pick = async () => {
        let port = await freePort();
        while (handed.has(port)) port = await freePort();
        handed.add(port);
        return port;
      };
      ports.push({ client: await pick(), monitor: await pick(), cluster: await pick() });
    }
    names.forEach((name, i) => {
      rmSync(join(dataDir, name), { recursive: true, force: true });
      mkdirSync(storeOf(name), { recursive: true });
      writeFileSync(confOf(name), configFor(name, ports[i]!, ports, storeOf(name), syncInterval, opts.extraConfig));
    });
    const described = ports.map((p, i) => `${names[i]} ${p.client}/${p.monitor}/${p.cluster}`).join(', ');
    names.forEach((_, i) => launchNode(i, `cluster start ${attempt} of ${attempts}, client/monitor/cluster ports ${described}`));
    try {
      const deadline = Date.now() + timeoutMs;
      await Promise.all(names.map((name) => waitHealthy(name, deadline)));
      break;
    } catch (err) {
      await stopAll();
      if (!(err as { portTaken?: boolean }).portTaken || attempt >= attempts) {
        rmSync(dataDir, { recursive: true, force: true });
        throw err;
      }
    }
  }

  const nodes: NatsClusterNode[] = names.map((name, i) => ({
    name,
    clientUrl: `nats://127.0.0.1:${ports[i]!.client}`,
    monitorUrl: `http://127.0.0.1:${ports[i]!.monitor}`,
    get pid() {
      return procs.get(name)?.child.pid;
    },
    get running() {
      const p = procs.get(name);
      return p !== undefined && alive(p);
    },
  }));
  const node = (name: string) => {
    const n = nodes.find((x) => x.name === name);
    if (!n) throw new Error(`no node ${name} (nodes: ${names.join(', ')})`);
    return n;
  };
  let stopped = false;
  return {
    servers: nodes.map((n) => n.clientUrl),
    nodes,
    node,
    dataDir,
    async kill(name) {
      node(name);
      await end(procs.get(name)!, 0);
    },
    async restart(name) {
      node(name);
      if (stopped) throw new Error('the cluster was stopped');
      if (alive(procs.get(name)!)) throw new Error(`${name} still runs: kill it first`);
      launchNode(names.indexOf(name), 'restart on the same ports, with its store');
      try {
        await waitHealthy(name, Date.now() + timeoutMs);
      } catch (err) {
        if ((err as { portTaken?: boolean }).portTaken) {
          const p = ports[names.indexOf(name)]!;
          throw new Error(
            `nats-server ${name} could not start again: one of its ports ${p.client} (client), ${p.monitor} (monitor), ${p.cluster} (cluster) was taken while it was down`,
            { cause: err },
          );
        }
        throw err;
      }
    },
    async metaLeader() {
      for (const n of nodes) {
        if (!n.running) continue;
        try {
          const jsz = (await (await fetch(`${n.monitorUrl}/jsz`, { signal: AbortSignal.timeout(2_000) })).json()) as { meta_cluster?: { leader?: string } };
          if (jsz.meta_cluster?.leader) return jsz.meta_cluster.leader;
        } catch {
          // try the next node
        }
      }
      return undefined;
    },
    async stop() {
      if (stopped) return;
      stopped = true;
      await stopAll();
      rmSync(dataDir, { recursive: true, force: true });
    },
  };
}

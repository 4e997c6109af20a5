/**
 * distributed-llama's launcher (engines.ts). On this machine: a root `dllama-api` and `nodes − 1`
 * `dllama worker` processes on loopback ports, sharing one model; in a cluster, the root pod's
 * `dllama-api` and a StatefulSet of `dllama worker` pods
 * (b4rtaz/distributed-llama; flags as parsed by `src/app.cpp` `AppCliArgs::parse`).
 *
 * Start-up order follows distributed-llama's own: workers first (each only listens, and learns
 * everything from the root), then the root, which connects to every worker, sends it its slice
 * of the weights, and only then opens its HTTP port. So the topology serves once the root's
 * `GET /v1/models` answers.
 *
 * A worker is never probed by connecting to it: whether it listens is read from the kernel
 * (/proc/net/tcp: a LISTEN socket on its port that is one of its own file descriptors). Upstream,
 * a worker takes the first connection for its root; built with images/dllama/patches/0003 and
 * given a topology's network key ({@link NETWORK_KEY_ENV}), it serves only a root that proves
 * the key and refuses anything else.
 *
 * The pieces are useless alone (a root whose worker died fails every request; workers wait for a
 * root forever), so when any process exits the others are stopped and the topology stays
 * unhealthy until it is destroyed.
 */
import { randomBytes } from 'node:crypto';
import { readdir, readFile, readlink } from 'node:fs/promises';
import { availableParallelism } from 'node:os';
import { createServer, type AddressInfo, type Server } from 'node:net';
import { setTimeout as sleep } from 'node:timers/promises';
import { RuntimeErrorType, runtimeError } from '../../shared/errors';
import type { Artifact, ReadyModel, StoredObject } from '../../shared/model';
import { WEIGHTS_PREFERENCE, weightsFormat, type ArtifactWeights } from '../../shared/weights';
import { cachedFile } from './cache';
import { NETWORK_KEY_FIELD, networkKeySecretName } from './kubernetes-manifests';
import type { DllamaOptions, EngineLauncher, LocalLaunch, LocalServing } from './launcher';
import { restartReport } from './launcher';
import { describeExit, spawnSupervised, type SupervisedProcess } from './process';
import { supervise, type RestartPolicy, type Supervised } from './supervise';

export type { DllamaOptions } from './launcher';

/** Loopback only: a topology on one machine is never reachable from another. */
const HOST = '127.0.0.1';
/**
 * `--buffer-float-type` for `weights` (shared/weights.ts `dllamaBuffer`): q80 for q40 weights, f32
 * for f32; null when distributed-llama cannot run them.
 */
export function dllamaBufferOf(weights: ArtifactWeights): 'f32' | 'q80' | null {
  return weights === 'source' ? null : weightsFormat(weights).dllamaBuffer;
}
/** `--max-seq-len` when the registry has no memory plan for the artifact (distributed-llama's 0 would mean the model's whole context). */
export const DEFAULT_MAX_SEQ_LEN = 4096;

/**
 * The environment variable of a topology's network key (images/dllama/patches/0003): the root and
 * its workers prove to each other that they share it before anything else passes on a
 * connection, so a worker serves only its own root. A secret: in the environment, never in argv
 * (which any process can read) or a log.
 */
export const NETWORK_KEY_ENV = 'DLLAMA_NETWORK_KEY';

/**
 * How many times in a row the root tries to set its network up (connect to and prove the key to
 * every worker; 3 s apart, each connect bounded to 10 s) before it exits naming the worker it
 * could not reach (images/dllama/patches/0004). Upstream retries for ever, so a root that lost a
 * worker, or whose worker is unreachable, would hang unready instead of failing with a reason.
 */
export const CONNECT_ATTEMPTS_ENV = 'DLLAMA_CONNECT_ATTEMPTS';
export const CONNECT_ATTEMPTS = 3;

/**
 * `dllama worker …` arguments (after the program). The one builder of a worker's command line,
 * for the local runtime (loopback) and the Kubernetes one (`host` 0.0.0.0 in its pod):
 * distributed-llama binds with `inet_addr()`, so `host` is an IPv4 address, never a name.
 */
export function dllamaWorkerArgs(o: { port: number; threads: number; host?: string; netTurbo?: boolean }): string[] {
  return ['worker', '--host', o.host ?? HOST, '--port', String(o.port), '--nthreads', String(o.threads), ...netTurboArgs(o.netTurbo)];
}

/** `--net-turbo 0` when turned off (distributed-llama's default is on). */
function netTurboArgs(on: boolean | undefined): string[] {
  return on === false ? ['--net-turbo', '0'] : [];
}

/**
 * Whether a topology of `nodes` × `threads` on this machine may keep distributed-llama's "net
 * turbo": with it every process spins on its sockets while it waits for the others, which is
 * fastest when each has a core of its own and ruinous when they share: 4 nodes on 2 cores
 * generated 2 tokens/s with it and 26 without (bench/README.md, "distributed-llama against llama.cpp").
 */
export function netTurboFits(nodes: number, threads: number, cores = availableParallelism()): boolean {
  return nodes * threads <= cores;
}

/**
 * `dllama-api …` arguments (after the program); `--workers` last, as it takes every following
 * address. `workers`: `host:port` each (the root resolves names with `getaddrinfo()`, so a
 * StatefulSet's stable DNS names work); default the loopback `workerPorts`.
 */
export function dllamaApiArgs(o: {
  port: number;
  model: string;
  tokenizer: string;
  /** The sync buffers' type: {@link dllamaBufferOf} the artifact's weights. */
  buffer: 'f32' | 'q80';
  threads: number;
  maxSeqLen: number;
  workerPorts?: readonly number[];
  workers?: readonly string[];
  host?: string;
  /** false: `--net-turbo 0` ({@link netTurboFits}). */
  netTurbo?: boolean;
}): string[] {
  const workers = o.workers ?? (o.workerPorts ?? []).map((p) => `${HOST}:${p}`);
  return [
    '--host',
    o.host ?? HOST,
    '--port',
    String(o.port),
    '--model',
    o.model,
    '--tokenizer',
    o.tokenizer,
    '--buffer-float-type',
    o.buffer,
    '--nthreads',
    String(o.threads),
    '--max-seq-len',
    String(o.maxSeqLen),
    ...netTurboArgs(o.netTurbo),
    ...(workers.length > 0 ? ['--workers', ...workers] : []),
  ];
}

/** What a topology serves: the artifact's two files and the context it was sized for. */
export interface DllamaChoice {
  artifact: Artifact;
  model: StoredObject;
  tokenizer: StoredObject;
  maxSeqLen: number;
  /** `--buffer-float-type` for the artifact's weights. */
  buffer: 'f32' | 'q80';
  /** Planned memory per node, when the registry has a plan. */
  memory?: { root: number; worker: number | null };
}

/**
 * The distributed-llama artifact of `ready` to serve on `nodes` nodes: the most compact weights
 * whose memory plan lists that topology (activities/size plans only the splits the model's
 * dimensions allow). `null` when the model has no distributed-llama artifact; `{ problem }` when
 * it has some, but none can run on `nodes` nodes.
 */
export function chooseDllamaArtifact(ready: ReadyModel, nodes: number): DllamaChoice | { problem: string } | null {
  const candidates = ready.artifacts
    .filter((a) => a.format === 'dllama')
    .sort((a, b) => WEIGHTS_PREFERENCE.indexOf(a.weights) - WEIGHTS_PREFERENCE.indexOf(b.weights));
  if (candidates.length === 0) return null;
  const refused: string[] = [];
  for (const artifact of candidates) {
    const model = artifact.files.find((f) => f.key.endsWith('.m'));
    const tokenizer = artifact.files.find((f) => f.key.endsWith('.t'));
    if (!model || !tokenizer) {
      refused.push(`${artifact.weights}: no .m and .t files`);
      continue;
    }
    const buffer = dllamaBufferOf(artifact.weights);
    if (buffer === null) {
      refused.push(`${artifact.weights}: distributed-llama runs only f32 and q40 weights on a CPU`);
      continue;
    }
    const plan = ready.memory.find((m) => m.format === 'dllama' && m.weights === artifact.weights);
    const topology = plan?.topologies.find((t) => t.nodes === nodes);
    if (plan && !topology) {
      // The plan says why (activities/size: the dimension that stops it), where it was sized with reasons.
      const why = plan.refused?.find((r) => r.nodes === nodes)?.reason;
      refused.push(`${artifact.weights}: splits into ${plan.topologies.map((t) => t.nodes).join(', ') || 'no'} nodes${why ? ` (${why})` : ''}`);
      continue;
    }
    return {
      artifact,
      model,
      tokenizer,
      maxSeqLen: plan?.contextLength ?? DEFAULT_MAX_SEQ_LEN,
      buffer,
      ...(topology ? { memory: { root: topology.root.total, worker: topology.worker?.total ?? null } } : {}),
    };
  }
  return { problem: `model ${ready.namespace}/${ready.name} has no distributed-llama artifact that runs on ${nodes} nodes (${refused.join('; ')})` };
}

export interface DllamaNode {
  role: 'root' | 'worker';
  /** 0 for the root; workers 1..nodes-1 in `--workers` order. */
  index: number;
  port: number;
  process: SupervisedProcess;
}

export interface DllamaTopology {
  /** The root's HTTP base URL. */
  url: string;
  /** Root first. */
  nodes: readonly DllamaNode[];
  /** Every process still runs. */
  healthy(): boolean;
  /**
   * Resolves, saying which process ended how (`worker 2 :port was killed by SIGKILL`), once a
   * process exited by itself and the rest of the topology was stopped; never after `stop()`.
   */
  failed: Promise<string>;
  /** Stops the root, then the workers (SIGTERM, SIGKILL after the grace); resolves when all have exited. */
  stop(): Promise<void>;
}

/** `n` distinct free loopback ports (held open together, so none is handed out twice). */
export async function freePorts(n: number): Promise<number[]> {
  const servers: Server[] = [];
  try {
    for (let i = 0; i < n; i++) {
      const s = createServer();
      servers.push(s);
      await new Promise<void>((ok, fail) => {
        s.once('error', fail);
        s.listen(0, HOST, ok);
      });
    }
    return servers.map((s) => (s.address() as AddressInfo).port);
  } finally {
    await Promise.all(servers.map((s) => new Promise((r) => s.close(r))));
  }
}

/** Inodes of the LISTEN sockets on `port` (/proc/net/tcp{,6}: `sl local rem st … inode`). */
async function listeningInodes(port: number): Promise<Set<string>> {
  const inodes = new Set<string>();
  for (const table of ['/proc/net/tcp', '/proc/net/tcp6']) {
    const text = await readFile(table, 'utf8').catch(() => '');
    for (const line of text.split('\n').slice(1)) {
      const f = line.trim().split(/\s+/);
      if (f.length < 10 || f[3] !== '0A') continue;
      if (parseInt(f[1]!.split(':').pop()!, 16) === port) inodes.add(f[9]!);
    }
  }
  return inodes;
}

/** Whether process `pid` itself listens on TCP `port`. */
export async function listensOn(pid: number, port: number): Promise<boolean> {
  const inodes = await listeningInodes(port);
  if (inodes.size === 0) return false;
  const fds = await readdir(`/proc/${pid}/fd`).catch(() => [] as string[]);
  for (const fd of fds) {
    const target = await readlink(`/proc/${pid}/fd/${fd}`).catch(() => '');
    const m = /^socket:\[(\d+)\]$/.exec(target);
    if (m && inodes.has(m[1]!)) return true;
  }
  return false;
}

class StartError extends Error {
  override readonly name = 'TopologyStartFailed';
}

/**
 * Starts a topology over the model and tokenizer at `files` and resolves once its root serves.
 * On any failure (a process exits, the deadline passes, `signal` aborts: then with
 * `signal.reason`) every process started is stopped before the error is thrown.
 */
export async function startDllamaTopology(
  files: { model: string; tokenizer: string; maxSeqLen: number; buffer: 'f32' | 'q80' },
  opts: DllamaOptions & { name: string; log: (line: string) => void; output?: (line: string) => void; signal?: AbortSignal; ports?: readonly number[] },
): Promise<DllamaTopology> {
  const { name, log, signal } = opts;
  // The programs' own output (dllama-api prints prompts and answers): not logged unless asked.
  const output = opts.output ?? (() => undefined);
  const grace = opts.stopGraceMs ?? 10_000;
  const deadline = Date.now() + (opts.startTimeoutSec ?? 300) * 1000;
  const nodes: DllamaNode[] = [];
  /** `root :port` / `worker i :port`: how a node is named, after the topology's name. */
  const nodeName = (n: Pick<DllamaNode, 'role' | 'index' | 'port'>) => (n.role === 'root' ? `root :${n.port}` : `worker ${n.index} :${n.port}`);
  // A key of this start's own (a restart gets a new one): the root and its workers prove it to
  // each other on every connection (patch 0003), so nothing else on the machine takes a worker.
  const env = { [NETWORK_KEY_ENV]: randomBytes(32).toString('hex'), [CONNECT_ATTEMPTS_ENV]: String(CONNECT_ATTEMPTS) };
  const spawnNode = (role: DllamaNode['role'], index: number, port: number, argv: string[]): DllamaNode => {
    const node = { role, index, port, process: spawnSupervised(`${name} ${nodeName({ role, index, port })}`, argv, { log: output, lineBuffered: true, env }) };
    nodes.push(node);
    return node;
  };
  const stopAll = async (): Promise<void> => {
    // Root first: workers then see their root leave instead of the root losing a worker mid-request.
    const root = nodes.find((n) => n.role === 'root');
    if (root) await root.process.stop(grace);
    await Promise.all(nodes.filter((n) => n.role === 'worker').map((n) => n.process.stop(grace)));
  };
  /** Waits, but not past an abort (the next check() throws it). */
  const pause = (ms: number) => sleep(ms, undefined, signal ? { signal } : {}).catch(() => undefined);
  /** Throws when something already went wrong. */
  const check = (what: string): void => {
    const dead = nodes.find((n) => n.process.exit);
    if (dead) {
      const tail = dead.process.tail().slice(-5);
      throw new StartError(
        `${dead.process.name} ${describeExit(dead.process.exit!)} while ${what}${tail.length > 0 ? `; its last output:\n  ${tail.join('\n  ')}` : ''}`,
      );
    }
    if (signal?.aborted) throw signal.reason as Error;
    if (Date.now() > deadline) throw new StartError(`the topology did not start within ${opts.startTimeoutSec ?? 300}s (${what})`);
  };

  try {
    // Given ports: a restart in place (the root's URL is what the instance's bridge calls).
    const [rootPort, ...workerPorts] = opts.ports ? [...opts.ports] : await freePorts(opts.nodes);
    const netTurbo = netTurboFits(opts.nodes, opts.threads);
    if (!netTurbo && !opts.ports)
      log(`${name}: ${opts.nodes} node(s) × ${opts.threads} thread(s) share ${availableParallelism()} core(s): --net-turbo 0 (no spinning on sockets)`);
    const workers = workerPorts.map((port, i) =>
      spawnNode('worker', i + 1, port, [opts.workerBin, ...dllamaWorkerArgs({ port, threads: opts.threads, netTurbo })]),
    );
    for (const w of workers) {
      for (;;) {
        check(`waiting for worker ${w.index} to listen on port ${w.port}`);
        if (w.process.child.pid !== undefined && (await listensOn(w.process.child.pid, w.port))) break;
        await pause(100);
      }
    }
    const root = spawnNode('root', 0, rootPort!, [
      opts.apiBin,
      ...dllamaApiArgs({
        port: rootPort!,
        model: files.model,
        tokenizer: files.tokenizer,
        buffer: files.buffer,
        netTurbo,
        threads: opts.threads,
        maxSeqLen: files.maxSeqLen,
        workerPorts,
      }),
    ]);
    const url = `http://${HOST}:${root.port}`;
    for (;;) {
      check(`waiting for the root to load the model, connect ${workers.length} worker(s) and answer ${url}/v1/models`);
      try {
        const res = await fetch(`${url}/v1/models`, { signal: signal ? AbortSignal.any([signal, AbortSignal.timeout(2000)]) : AbortSignal.timeout(2000) });
        await res.body?.cancel();
        if (res.ok) break;
      } catch {
        // Not listening yet (it opens its HTTP port last), or busy.
      }
      await pause(250);
    }
  } catch (err) {
    await stopAll();
    throw err;
  }

  let stopping = false;
  let fail: (how: string) => void = () => undefined;
  const failed = new Promise<string>((resolve) => (fail = resolve));
  for (const n of nodes) {
    void n.process.exited.then((e) => {
      if (stopping) return;
      stopping = true;
      log(`${n.process.name} ${describeExit(e)}: stopping the rest of the topology`);
      void stopAll().then(() => fail(`${nodeName(n)} ${describeExit(e)}`));
    });
  }
  return {
    url: `http://${HOST}:${nodes.find((n) => n.role === 'root')!.port}`,
    nodes: [...nodes].sort((a, b) => a.index - b.index),
    healthy: () => nodes.every((n) => !n.process.exit),
    failed,
    async stop() {
      stopping = true;
      await stopAll();
    },
  };
}

/**
 * Starts a topology and keeps it serving (supervise.ts): when any process dies, the rest is
 * stopped (as {@link startDllamaTopology} does) and the whole topology is started again on the
 * same ports after a backoff, so the instance's bridge and its queued requests carry on. A crash
 * loop and it stays down: `healthy()` turns false, for the pool to replace the instance.
 */
export async function startSupervisedTopology(
  files: Parameters<typeof startDllamaTopology>[0],
  opts: Parameters<typeof startDllamaTopology>[1] & { restart?: Partial<RestartPolicy> },
): Promise<Supervised<DllamaTopology>> {
  const first = await startDllamaTopology(files, opts);
  const ports = first.nodes.map((n) => n.port); // root first
  // `signal` is the first start's; a restart is aborted by stop() instead.
  const { signal: _startOnly, ...again } = opts;
  return supervise(first, {
    name: opts.name,
    log: opts.log,
    policy: opts.restart,
    where: `on ports ${ports.join(', ')}`,
    ended: (t) => t.failed,
    running: (t) => t.healthy(),
    restart: (signal) => startDllamaTopology(files, { ...again, ports, signal }),
    stop: (t) => t.stop(),
  });
}

/** The artifact of `ready` a topology of `nodes` nodes serves, or why there is none. */
function choice(ready: ReadyModel, nodes: number): DllamaChoice | string {
  const chosen = chooseDllamaArtifact(ready, nodes);
  if (chosen === null) return `model ${ready.namespace}/${ready.name} has no distributed-llama artifact`;
  return 'problem' in chosen ? chosen.problem : chosen;
}

async function startLocal(l: LocalLaunch): Promise<LocalServing> {
  const dllama = l.settings.dllama;
  if (!dllama) throw runtimeError(RuntimeErrorType.NoArtifact, 'distributed-llama is not configured on this worker (MAGUS_DLLAMA_API_BIN, MAGUS_DLLAMA_BIN)');
  const chosen = choice(l.ready, dllama.nodes);
  if (typeof chosen === 'string') throw runtimeError(RuntimeErrorType.NoArtifact, chosen);
  // Both downloads end before this fails: an aborted one is still removing its temporary file.
  const downloads = await Promise.allSettled([cachedFile(l.cache, chosen.model, '.m', l.signal), cachedFile(l.cache, chosen.tokenizer, '.t', l.signal)]);
  const failed = downloads.find((d) => d.status === 'rejected');
  if (failed) throw failed.reason;
  const [model, tokenizer] = downloads.map((d) => (d as PromiseFulfilledResult<string>).value) as [string, string];
  const mib = (n: number) => `${Math.ceil(n / 2 ** 20)} MiB`;
  const memory = chosen.memory
    ? `; planned memory: root ${mib(chosen.memory.root)}${chosen.memory.worker === null ? '' : `, each worker ${mib(chosen.memory.worker)}`}`
    : '';
  l.log(`${l.name}: distributed-llama on ${dllama.nodes} node(s), ${chosen.artifact.weights} weights, --max-seq-len ${chosen.maxSeqLen}${memory}`);
  const topology = await startSupervisedTopology(
    { model, tokenizer, maxSeqLen: chosen.maxSeqLen, buffer: chosen.buffer },
    { ...dllama, name: l.name, log: l.log, output: l.settings.output, restart: l.settings.restart, signal: l.signal },
  );
  return {
    slots: 1, // distributed-llama answers one request at a time
    url: topology.current.url, // restarts keep the ports
    get processes() {
      return topology.current.nodes;
    },
    healthy: () => topology.healthy(),
    restarts: () => restartReport(topology),
    stop: () => topology.stop(),
  };
}

/** A pod's network key, from the instance's Secret (kubernetes-manifests.ts `networkKeySecret`). */
const networkKeyEnv = (instance: string) => ({
  name: NETWORK_KEY_ENV,
  valueFrom: { secretKeyRef: { name: networkKeySecretName(instance), key: NETWORK_KEY_FIELD } },
});

export const dllamaLauncher: EngineLauncher = {
  local: {
    available: (settings) => settings.dllama !== undefined,
    refusal: (ready, settings) => {
      if (!settings.dllama) return 'distributed-llama is not configured on this worker';
      const chosen = choice(ready, settings.dllama.nodes);
      return typeof chosen === 'string' ? chosen : null;
    },
    start: startLocal,
  },
  kubernetes: {
    plan({ ready, nodes }) {
      const chosen = choice(ready, nodes);
      if (typeof chosen === 'string') throw runtimeError(RuntimeErrorType.NoArtifact, chosen);
      return {
        nodes,
        files: [
          { ...chosen.model, name: 'model.m' },
          { ...chosen.tokenizer, name: 'tokenizer.t' },
        ],
        maxSeqLen: chosen.maxSeqLen,
        dllamaBuffer: chosen.buffer,
        slots: 1,
        memory: { root: chosen.memory?.root ?? chosen.model.bytes, worker: nodes > 1 ? (chosen.memory?.worker ?? chosen.model.bytes / nodes) : null },
      };
    },
    containers: (plan, ports, file, workers) => ({
      engine: {
        name: 'engine',
        image: plan.images.dllama,
        env: [networkKeyEnv(plan.instance), { name: CONNECT_ATTEMPTS_ENV, value: String(CONNECT_ATTEMPTS) }],
        args: [
          'dllama-api',
          ...dllamaApiArgs({
            host: '0.0.0.0',
            port: ports.engine,
            model: file('model.m'),
            tokenizer: file('tokenizer.t'),
            threads: plan.threads,
            maxSeqLen: plan.maxSeqLen,
            buffer: plan.dllamaBuffer ?? 'q80',
            workers,
          }),
        ],
      },
      worker: {
        name: 'dllama',
        image: plan.images.dllama,
        // The program as args: the image's entrypoint (tini) stays PID 1 and passes SIGTERM on (dllama handles none).
        args: ['dllama', ...dllamaWorkerArgs({ host: '0.0.0.0', port: ports.worker, threads: plan.threads })],
        env: [networkKeyEnv(plan.instance)],
      },
    }),
  },
};

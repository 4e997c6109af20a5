/**
 * The `local` runtime: a topology instance is a set of processes on this machine plus an
 * in-process bridge that pulls the instance's requests from NATS. Which processes:
 * - a distributed-llama topology (root `dllama-api` + `nodes − 1` `dllama worker`s, dllama.ts)
 *   when the worker is configured with its binaries and the model has a distributed-llama
 *   artifact that runs on that many nodes;
 * - otherwise `magus engine` (llama.cpp, llama-cpp.ts) over the model's GGUF.
 * Model files come from S3 into a local cache once (cache.ts). A llama.cpp engine that dies, or
 * a topology one of whose processes dies, is restarted in place on its ports (supervise.ts: the
 * bridge and the queued requests carry on); one in a crash loop is given up and `describe`
 * reports the instance unhealthy. Every process runs under
 * `setpriv --pdeathsig KILL`, so it dies with the worker that started it; the pool notices
 * (describe) and starts new ones.
 */
import type { S3Client } from '@aws-sdk/client-s3';
import type { NatsConnection } from 'nats';
import { startBridge, type Bridge, type BridgeSample } from '../../workers/bridge';
import type { ReadyModel, StoredObject } from '../../shared/model';
import { deleteInstanceConsumer, ensureInstanceConsumer, requestSubjectOf, type DataPlaneNames } from '../nats/data-plane';
import type { ModelRegistry } from '../nats/registry';
import type { InstanceInfo, InstanceRequest, Runtime } from '../serving';
import { cachedFile, type ModelCache } from './cache';
import { chooseDllamaArtifact, startSupervisedTopology, type DllamaOptions } from './dllama';
import { startSupervisedEngine, type RestartPolicy } from './llama-cpp';
import type { SupervisedProcess } from './process';

export interface LocalRuntimeOptions {
  nc: NatsConnection;
  names: DataPlaneNames;
  registry: ModelRegistry;
  s3: S3Client;
  bucket: string;
  /** Where model files are cached, by sha256. */
  cacheDir: string;
  /** llama.cpp engine slots per instance (default 1, like distributed-llama). */
  slots?: number;
  /** llama.cpp engine threads (default 1: on small machines llama.cpp's spinning threads cost more than they give). */
  threads?: number;
  /** Seconds an engine may take to load its model. */
  startTimeoutSec?: number;
  /** When an engine or topology dies it is restarted in place (default: 3 restarts per 10 min, 500 ms backoff doubling). */
  restart?: Partial<RestartPolicy>;
  /** distributed-llama binaries and topology size; unset: llama.cpp only. */
  dllama?: DllamaOptions;
  /** What the runtime does: instances started and stopped, engines restarted or given up. */
  log?: (line: string) => void;
  /**
   * The engines' own output lines (default: dropped; a failed start still quotes its last lines).
   * distributed-llama's `dllama-api` prints prompts and answers: route them only where that is allowed.
   */
  output?: (line: string) => void;
}

/** One process of an instance, as {@link LocalRuntime.processes} reports it. */
export interface LocalProcessInfo {
  /** `engine` (llama.cpp), or the `root`/`worker`s of a distributed-llama topology. */
  role: 'engine' | 'root' | 'worker';
  /** 0 for an engine or root; workers 1..n-1 in the root's `--workers` order. */
  index: number;
  pid: number | undefined;
  /** Loopback port it serves on (HTTP for an engine or root, distributed-llama's protocol for a worker). */
  port: number;
  /** Program and arguments. */
  argv: readonly string[];
  running: boolean;
}

export interface LocalRuntime extends Runtime {
  /** The processes of an instance (root first), or null when the runtime does not know it. */
  processes(pool: string, instance: string): LocalProcessInfo[] | null;
  /** The in-process bridges of the running instances, for metrics. */
  bridges(): BridgeSample[];
  stopAll(): Promise<void>;
}

/** What serves an instance's requests. */
interface Serving {
  kind: 'llama.cpp' | 'dllama';
  url: string;
  readonly processes: readonly { role: LocalProcessInfo['role']; index: number; port: number; process: SupervisedProcess }[];
  healthy(): boolean;
  stop(): Promise<void>;
}

interface LocalInstance {
  pool: string;
  info: Omit<InstanceInfo, 'healthy'>;
  serving: Serving;
  bridge: Bridge;
}

const STOP_GRACE_MS = 10_000;
const WEIGHTS_PREFERENCE = ['q40', 'q80', 'f16', 'f32'];

export function createLocalRuntime(opts: LocalRuntimeOptions): LocalRuntime {
  const instances = new Map<string, LocalInstance>();
  const starting = new Map<string, Promise<InstanceInfo>>();
  const log = opts.log ?? (() => undefined);
  const cache: ModelCache = { s3: opts.s3, bucket: opts.bucket, dir: opts.cacheDir };
  const key = (pool: string, instance: string) => `${pool}/${instance}`;
  const infoOf = (i: LocalInstance): InstanceInfo => ({ ...i.info, healthy: i.serving.healthy() });

  async function startLlamaCpp(ready: ReadyModel, name: string, why: string | undefined): Promise<Serving> {
    const gguf = ready.artifacts.filter((a) => a.format === 'gguf').sort((a, b) => WEIGHTS_PREFERENCE.indexOf(a.weights) - WEIGHTS_PREFERENCE.indexOf(b.weights))[0];
    const file: StoredObject | undefined = gguf?.files[0];
    if (!file) throw Object.assign(new Error(why ?? `model ${ready.namespace}/${ready.name} has no GGUF artifact for llama.cpp`), { name: 'NoArtifact' });
    if (why) log(`${name}: ${why}; serving its GGUF with llama.cpp instead`);
    const model = await cachedFile(cache, file, '.gguf');
    // Responses name the model as clients know it, not by its cached file.
    const engine = await startSupervisedEngine(model, { modelId: ready.name, slots: opts.slots ?? 1, threads: opts.threads ?? 1, startTimeoutSec: opts.startTimeoutSec ?? 120, name: `${name} engine`, log, output: opts.output, restart: opts.restart, stopGraceMs: STOP_GRACE_MS });
    return {
      kind: 'llama.cpp',
      url: engine.current.url, // restarts keep the port
      get processes() {
        return [{ role: 'engine' as const, index: 0, port: engine.current.port, process: engine.current.process }];
      },
      healthy: () => engine.healthy(),
      stop: () => engine.stop(),
    };
  }

  async function startServing(req: InstanceRequest, signal: AbortSignal | undefined): Promise<Serving> {
    const ready = await opts.registry.get(req.namespace, req.model);
    if (!ready) throw Object.assign(new Error(`model ${req.namespace}/${req.model} is not in the registry`), { name: 'ModelNotReady' });
    const name = key(req.pool, req.instance);
    const choice = opts.dllama ? chooseDllamaArtifact(ready, opts.dllama.nodes) : null;
    if (!opts.dllama || !choice || 'problem' in choice) return startLlamaCpp(ready, name, choice && 'problem' in choice ? choice.problem : undefined);

    const [model, tokenizer] = await Promise.all([cachedFile(cache, choice.model, '.m'), cachedFile(cache, choice.tokenizer, '.t')]);
    const mib = (n: number) => `${Math.ceil(n / 2 ** 20)} MiB`;
    const memory = choice.memory ? `; planned memory: root ${mib(choice.memory.root)}${choice.memory.worker === null ? '' : `, each worker ${mib(choice.memory.worker)}`}` : '';
    log(`${name}: distributed-llama on ${opts.dllama.nodes} node(s), ${choice.artifact.weights} weights, --max-seq-len ${choice.maxSeqLen}${memory}`);
    const topology = await startSupervisedTopology({ model, tokenizer, maxSeqLen: choice.maxSeqLen }, { ...opts.dllama, name, log, output: opts.output, restart: opts.restart, ...(signal ? { signal } : {}) });
    return {
      kind: 'dllama',
      url: topology.current.url, // restarts keep the ports
      get processes() {
        return topology.current.nodes;
      },
      healthy: () => topology.healthy(),
      stop: () => topology.stop(),
    };
  }

  async function create(req: InstanceRequest, signal: AbortSignal | undefined): Promise<InstanceInfo> {
    const serving = await startServing(req, signal);
    // distributed-llama answers one request at a time.
    const slots = serving.kind === 'dllama' ? 1 : (opts.slots ?? 1);
    try {
      await ensureInstanceConsumer(await opts.nc.jetstreamManager(), opts.names, { pool: req.pool, instance: req.instance, slots });
      const bridge = await startBridge({ nc: opts.nc, names: opts.names, pool: req.pool, instance: req.instance, engineUrl: serving.url, slots, log });
      const instance: LocalInstance = { pool: req.pool, info: { instance: req.instance, subject: requestSubjectOf(opts.names, req.pool, req.instance) }, serving, bridge };
      instances.set(key(req.pool, req.instance), instance);
      log(`instance ${req.pool}/${req.instance} serves ${req.namespace}/${req.model} with ${serving.kind} at ${serving.url}`);
      return infoOf(instance);
    } catch (err) {
      await serving.stop();
      throw err;
    }
  }

  async function teardown(i: LocalInstance): Promise<void> {
    await i.bridge.stop();
    await i.serving.stop();
  }

  const runtime: LocalRuntime = {
    create(req: InstanceRequest, signal?: AbortSignal): Promise<InstanceInfo> {
      const k = key(req.pool, req.instance);
      let p = starting.get(k);
      if (!p) {
        const existing = instances.get(k);
        if (existing?.serving.healthy()) return Promise.resolve(infoOf(existing));
        p = (async () => {
          // A broken instance of the same id is replaced, not left running beside the new one.
          if (existing) {
            instances.delete(k);
            await teardown(existing);
          }
          return create(req, signal);
        })().finally(() => starting.delete(k));
        starting.set(k, p);
      }
      return p;
    },
    async destroy(pool: string, instance: string): Promise<void> {
      const k = key(pool, instance);
      const i = instances.get(k);
      instances.delete(k);
      if (i) await teardown(i);
      await deleteInstanceConsumer(await opts.nc.jetstreamManager(), opts.names, { pool, instance }).catch(() => false);
    },
    describe(pool: string, instance: string): Promise<InstanceInfo | null> {
      const i = instances.get(key(pool, instance));
      return Promise.resolve(i ? infoOf(i) : null);
    },
    processes(pool: string, instance: string): LocalProcessInfo[] | null {
      const i = instances.get(key(pool, instance));
      return i
        ? i.serving.processes.map((p) => ({ role: p.role, index: p.index, pid: p.process.child.pid, port: p.port, argv: p.process.argv, running: !p.process.exit }))
        : null;
    },
    bridges(): BridgeSample[] {
      return [...instances.values()].map((i) => ({ pool: i.pool, instance: i.info.instance, stats: i.bridge.stats, health: i.bridge.health() }));
    },
    async stopAll(): Promise<void> {
      await Promise.all([...instances.values()].map((i) => runtime.destroy(i.pool, i.info.instance)));
    },
  };
  return runtime;
}

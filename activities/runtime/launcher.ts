/**
 * What an engine's launcher is (engines.ts `LAUNCHERS`; one file per engine implements it): its
 * processes on this machine, its plan and containers in a pod. Types only, apart from the
 * lookup, so that the launchers and the lookup do not import each other.
 */
import type { ReadyModel, StoredObject } from '../../shared/model';
import type { RestartReport } from '../../shared/status';
import type { ModelCache } from './cache';
import type { InstancePlan, InstancePorts } from './kubernetes-manifests';
import type { RestartPolicy } from './supervise';
import type { SupervisedProcess } from './process';

/** Where and how topologies run (the worker's `MAGUS_DLLAMA_*` configuration). */
export interface DllamaOptions {
  /** `dllama-api` executable. */
  apiBin: string;
  /** `dllama` executable (run as `dllama worker`). */
  workerBin: string;
  /** Nodes, root included: a power of two. */
  nodes: number;
  /** `--nthreads` of every process. */
  threads: number;
  /** How long the root may take to load the model and connect its workers. Default 300 s. */
  startTimeoutSec?: number;
  /** SIGTERM → SIGKILL grace when stopping. Default 10 s. */
  stopGraceMs?: number;
}

/** What serves an instance's requests on this machine. */
export interface LocalServing {
  url: string;
  /** Requests it serves at once (the bridge's and the consumer's bound). */
  slots: number;
  readonly processes: readonly { role: 'engine' | 'root' | 'worker'; index: number; port: number; process: SupervisedProcess }[];
  healthy(): boolean;
  /** What it went through: how often it stopped by itself, how it last did, and whether it is being restarted in place now. */
  restarts(): RestartReport;
  stop(): Promise<void>;
}

/** The {@link RestartReport} of a supervised engine or topology; `subject` names what stopped when its stops do not (`engine`). */
export const restartReport = (s: { stops: number; lastStop: string | undefined; recovering(): boolean }, subject?: string): RestartReport => ({
  stops: s.stops,
  ...(s.lastStop !== undefined ? { last: subject ? `${subject} ${s.lastStop}` : s.lastStop } : {}),
  recovering: s.recovering(),
});

/** The local runtime's settings a launcher may read (local.ts `LocalRuntimeOptions` extends them). */
export interface LocalEngineSettings {
  /**
   * llama.cpp engine slots per instance, fixed; unset: the leases the instance's pool gives it
   * (`InstanceRequest.leases`), else sized from the model's memory plan within `instanceMemory`
   * (shared/engine-slots.ts), as the pools' default leases per instance are.
   */
  slots?: number;
  /** Memory budget of one instance in bytes (default shared/engine-slots.ts `DEFAULT_INSTANCE_MEMORY_BYTES`). */
  instanceMemory?: number;
  /** llama.cpp engine threads (default 1: on small machines llama.cpp's spinning threads cost more than they give). */
  threads?: number;
  /** Seconds an engine may take to load its model. */
  startTimeoutSec?: number;
  /** When an engine or topology dies it is restarted in place (default: 3 restarts per 10 min, 500 ms backoff doubling). */
  restart?: Partial<RestartPolicy>;
  /**
   * A llama.cpp engine keeps a second one on standby beside it, which serves at once when it dies
   * (llama-cpp.ts `startSupervisedEngine`): see {@link StandbyKind}. Default none here; a
   * worker's local runtime keeps an `auto` one unless `MAGUS_ENGINE_STANDBY` says otherwise
   * (local-entry.ts).
   */
  standby?: StandbyKind;
  /**
   * A llama.cpp engine saves its slots' KV caches as it answers, in a directory all the engines
   * this process starts share (under the system's temporary directory, removed when the process
   * exits), for the engine that follows it when it dies — its standby, or its restart — and
   * another instance an answer is handed to, to load rather than evaluate again
   * (engine/snapshots.ts). Default true.
   */
  snapshots?: boolean;
  /** distributed-llama binaries and topology size; unset: distributed-llama cannot run here. */
  dllama?: DllamaOptions;
  /**
   * The engines' own output lines (default: dropped; a failed start still quotes its last lines).
   * distributed-llama's `dllama-api` prints prompts and answers: route them only where that is allowed.
   */
  output?: (line: string) => void;
}

/**
 * An engine on standby: `mapped`, its model's weights mapped (a start makes its context: ~60 ms
 * per 4,096-token slot); `warm`, its context made too (a start is the listening alone), holding a
 * second KV cache while it waits; `auto`, warm when that KV cache fits in half the machine's free
 * memory at the time the standby starts, else mapped.
 */
export type StandbyKind = 'mapped' | 'warm' | 'auto';
/** The kind a standby is once started (`auto` decided). */
export type StartedStandby = Exclude<StandbyKind, 'auto'>;

/** One start on this machine. */
export interface LocalLaunch {
  ready: ReadyModel;
  /** `<pool>/<instance>`: names its processes and log lines. */
  name: string;
  /** The leases the instance's pool gives it. */
  leases: number | undefined;
  settings: LocalEngineSettings;
  cache: ModelCache;
  log: (line: string) => void;
  signal: AbortSignal;
}

/** What of an instance's plan an engine decides on Kubernetes (kubernetes-manifests.ts `InstancePlan`). */
export interface KubernetesEnginePlan {
  nodes: number;
  /** Files the root needs, with the names the engine is given. */
  files: (StoredObject & { name: string })[];
  maxSeqLen: number;
  /** distributed-llama's `--buffer-float-type` (the weights decide it). */
  dllamaBuffer?: 'f32' | 'q80';
  slots: number;
  /** llama.cpp's sequences for resumed answers beside the slots (default: the engine's). */
  resumeSlots?: number;
  ctx?: number;
  /** Bytes each pod needs, before headroom. */
  memory: { root: number; worker: number | null };
}

/** What a launcher gets from the Kubernetes runtime to plan an instance. */
export interface KubernetesPlanning {
  ready: ReadyModel;
  /** Nodes per instance (the `Dllama`'s, fit-first's or the runtime's default). */
  nodes: number;
  /** Slots fixed by the runtime, the pool or the `Dllama`; unset: sized. */
  fixedSlots: number | undefined;
  /** The `Dllama`'s sequences for resumed answers; unset: the default (shared/engine-slots.ts `RESUME_SLOTS`). */
  resumeSlots: number | undefined;
  instanceMemory: number;
}

export interface EngineLauncher {
  /** Its processes on this machine (local.ts). */
  local: {
    /** Whether the settings let it run here at all (distributed-llama needs its binaries). */
    available(settings: LocalEngineSettings): boolean;
    /** Why it cannot serve `ready` here (no artifact of its format, none for this topology), or null when it can. */
    refusal(ready: ReadyModel, settings: LocalEngineSettings): string | null;
    /** Starts it and resolves once it serves; aborted, it stops what it began and rejects. */
    start(launch: LocalLaunch): Promise<LocalServing>;
  };
  /** Its containers in a pod (kubernetes.ts, kubernetes-manifests.ts); absent: it does not run on Kubernetes. */
  kubernetes?: {
    /** The artifact, files, slots and memory of an instance on `nodes` nodes; throws a `NoArtifact` runtime error when it has none. */
    plan(p: KubernetesPlanning): KubernetesEnginePlan;
    /** The root pod's engine container, serving HTTP on `ports.engine` at `/v1/models`; `workers`: the worker pods' container, if it has workers. */
    containers(
      plan: Omit<InstancePlan, 'containers'>,
      ports: InstancePorts,
      file: (name: string) => string,
      workerAddresses: string[],
    ): InstancePlan['containers'];
  };
}

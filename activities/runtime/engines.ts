/**
 * How the runtimes launch each engine of shared/engines.ts: one file per engine (llama-cpp.ts,
 * dllama.ts) exporting an {@link EngineLauncher}, chosen by one lookup ({@link launcherOf}). The
 * runtimes (local.ts, kubernetes.ts) decide *where* an instance runs; a launcher decides *what*
 * runs there: which artifact of the model, its processes on this machine, its containers and
 * probes in a pod.
 *
 * A new engine: its row in shared/engines.ts, its launcher file, and one line in
 * {@link LAUNCHERS} (the type makes the line required).
 */
import type { EngineKind } from '../../shared/engines';
import { RuntimeErrorType, runtimeError } from '../../shared/errors';
import type { ReadyModel, StoredObject } from '../../shared/model';
import type { ModelCache } from './cache';
import { dllamaLauncher, type DllamaOptions } from './dllama';
import type { InstancePlan, InstancePorts } from './kubernetes-manifests';
import { llamaCppLauncher, type RestartPolicy } from './llama-cpp';
import type { SupervisedProcess } from './process';

/** What serves an instance's requests on this machine. */
export interface LocalServing {
  url: string;
  /** Requests it serves at once (the bridge's and the consumer's bound). */
  slots: number;
  readonly processes: readonly { role: 'engine' | 'root' | 'worker'; index: number; port: number; process: SupervisedProcess }[];
  healthy(): boolean;
  stop(): Promise<void>;
}

/** The local runtime's settings a launcher may read (local.ts `LocalRuntimeOptions`). */
export interface LocalEngineSettings {
  /** Slots per instance, fixed; unset: the pool's leases, else sized from the memory plan. */
  slots?: number;
  instanceMemory?: number;
  threads?: number;
  startTimeoutSec?: number;
  restart?: Partial<RestartPolicy>;
  /** distributed-llama binaries and topology size; unset: distributed-llama cannot run here. */
  dllama?: DllamaOptions;
  /** The engines' own output lines. */
  output?: (line: string) => void;
}

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
  slots: number;
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
  instanceMemory: number;
}

/** A container of an instance's pod, less what every container of it shares. */
export interface EngineContainer {
  name: string;
  image: string;
  args: string[];
  env?: { name: string; value: string }[];
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
    containers(plan: InstancePlan, ports: InstancePorts, file: (name: string) => string, workerAddresses: string[]): { engine: EngineContainer; worker?: EngineContainer };
  };
}

/** Every engine's launcher, by kind. */
export const LAUNCHERS: Readonly<Record<EngineKind, EngineLauncher>> = {
  llamacpp: llamaCppLauncher,
  dllama: dllamaLauncher,
};

export function launcherOf(kind: EngineKind): EngineLauncher {
  return LAUNCHERS[kind];
}

/** The engines that run in a pod. */
export function kubernetesEngines(): EngineKind[] {
  return (Object.keys(LAUNCHERS) as EngineKind[]).filter((k) => LAUNCHERS[k].kubernetes !== undefined);
}

/** The Kubernetes side of `kind`'s launcher, or a `NoArtifact` runtime error saying it has none. */
export function kubernetesLauncherOf(kind: EngineKind): NonNullable<EngineLauncher['kubernetes']> {
  const k = LAUNCHERS[kind].kubernetes;
  if (!k) throw runtimeError(RuntimeErrorType.NoArtifact, `engine ${kind} does not run on Kubernetes`);
  return k;
}

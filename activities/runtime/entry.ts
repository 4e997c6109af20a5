/**
 * What a runtime's registry entry is (index.ts `RUNTIMES`): the types every `<kind>-entry.ts`
 * implements, apart from the registry so that the entries and the registry do not import each
 * other.
 */
import type { S3Client } from '@aws-sdk/client-s3';
import type { KubeConfig } from '@kubernetes/client-node';
import type { NatsConnection } from 'nats';
import type { DataPlaneNames } from '../../dataplane';
import type { ModelRegistry } from '../../dataplane/registry';
import type { RuntimeAdvert } from '../../shared/runtimes';
import type { WorkerRuntime } from './runtime';

/** What every runtime may read of the worker's own configuration (workers/config.ts `MagusConfig`, validated at start). */
export interface CommonSettings {
  /** `MAGUS_NATS_URL`: the servers the worker reaches. */
  nats: { servers: string };
  s3: { endpoint: string | undefined; region: string; bucket: string };
  /** `MAGUS_MODEL_CACHE`: where model files are cached on this machine. */
  modelCacheDir: string;
  /** `MAGUS_INSTANCE_MEMORY`: the memory budget of one llama.cpp instance in bytes; unset: the runtimes' default. */
  instanceMemory?: number | undefined;
}

/** The worker's clients, which the runtime it builds shares. */
export interface RuntimeDeps {
  nc: NatsConnection;
  names: DataPlaneNames;
  registry: ModelRegistry;
  s3: S3Client;
  /** The cluster, when the worker has one (in a pod, `KUBECONFIG`, or given by a test). */
  kube?: KubeConfig;
  /** The variables with which the worker declares the data plane, for processes elsewhere that declare it too (a pod's bridge). */
  dataPlaneEnv: Record<string, string>;
  /** The runtime's own events (instances started and stopped, engines restarted). */
  log: (line: string) => void;
}

/** What a worker's runtime advert says it runs (shared/runtimes.ts `RuntimeAdvert`, less what the worker adds). */
export type RuntimeCapabilities = Pick<RuntimeAdvert, 'formats' | 'engines' | 'dllamaNodes'>;

/** One kind of runtime; `S`, its settings, read from the environment at start. */
export interface RuntimeEntry<S> {
  /** Its `MAGUS_RUNTIME` value, and the advert's `runtime`. */
  kind: string;
  /**
   * true: its instances are the processes of the worker that started them, so their describe,
   * destroy and watch must come to that worker's own runtime queue (named in each `InstanceInfo`).
   * false: any worker can answer for any instance.
   */
  ownsInstances: boolean;
  /**
   * Its settings from `env`, when `MAGUS_RUNTIME` selects it. Each bad value is one line added to
   * `problems`, naming the variable: the worker's start error lists them with all the others.
   */
  settingsFrom(env: NodeJS.ProcessEnv, problems: string[], common: CommonSettings): S;
  /** What it says of its variables when another runtime is selected (refuses them, or checks them all the same). */
  unselected?(env: NodeJS.ProcessEnv, problems: string[]): void;
  /** Builds the runtime; throws when the worker lacks what it needs (a message saying what). */
  create(settings: S, common: CommonSettings, deps: RuntimeDeps): WorkerRuntime;
  advert(settings: S): RuntimeCapabilities;
}

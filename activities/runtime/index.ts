/**
 * The runtimes a worker can run topology instances on, one entry per kind (`MAGUS_RUNTIME`):
 * how the worker's configuration reads the selected one's settings at start (workers/config.ts)
 * and how `magus worker` builds it (workers/worker.ts).
 *
 * A new runtime is its own file here exporting a {@link RuntimeEntry}, and one line in
 * {@link RUNTIMES}. The entry reads its variables (each bad value one line of the worker's start
 * error), builds the runtime from them and the worker's clients, says whether its instances
 * belong to the worker that started them, and what it runs (the worker's runtime advert,
 * shared/runtimes.ts). The runtime implements `WorkerRuntime` (./runtime.ts): `create`, `destroy`
 * and `describe`, idempotent by instance id, `create` resolving once the instance serves and
 * failing with the typed names the serving activities know (`runtimeError`, `RuntimeErrorType`
 * in shared/errors.ts); `watch` when it can be told of a loss; `bridges` and `stopAll` for what of it
 * lives in the worker's process.
 */
import type { CommonSettings, RuntimeCapabilities, RuntimeDeps, RuntimeEntry } from './entry';
import { kubernetes } from './kubernetes-entry';
import { local } from './local-entry';
import type { WorkerRuntime } from './runtime';

export type { CommonSettings, RuntimeCapabilities, RuntimeDeps, RuntimeEntry } from './entry';

/** The runtimes, one per kind. */
export const RUNTIMES: readonly RuntimeEntry<unknown>[] = [local, kubernetes];

/** The kind a worker runs when `MAGUS_RUNTIME` is unset. */
export const DEFAULT_RUNTIME = local.kind;

/**
 * The runtime a worker's configuration selects and its settings, as the registry read them: the
 * worker's configuration holds it without looking inside and hands it back to
 * {@link configuredRuntime}.
 */
export interface RuntimeConfig {
  readonly kind: string;
  readonly settings: unknown;
}

/**
 * The settings of the runtime of kind `kind` read from `env` (workers/config.ts `loadConfig`),
 * each other runtime's `unselected` applied too; undefined, with nothing added for `kind`, when
 * no runtime has that kind.
 */
export function runtimeConfigFrom(kind: string, env: NodeJS.ProcessEnv, problems: string[], common: CommonSettings): RuntimeConfig | undefined {
  let selected: RuntimeConfig | undefined;
  for (const entry of RUNTIMES) {
    if (entry.kind === kind) selected = { kind, settings: entry.settingsFrom(env, problems, common) };
    else entry.unselected?.(env, problems);
  }
  return selected;
}

/** `entry` with `settings`, as a {@link RuntimeConfig}: a worker configured in code (tests, benchmarks). */
export function runtimeConfig<S>(entry: RuntimeEntry<S>, settings: S): RuntimeConfig {
  return { kind: entry.kind, settings };
}

/** `entry`'s settings when `runtime` selects it, else undefined. */
export function settingsOf<S>(runtime: RuntimeConfig | undefined, entry: RuntimeEntry<S>): S | undefined {
  return runtime?.kind === entry.kind ? (runtime.settings as S) : undefined;
}

/** A runtime with the worker's settings for it: what the worker builds and advertises. */
export interface ConfiguredRuntime {
  kind: string;
  /** {@link RuntimeEntry.ownsInstances}. */
  ownsInstances: boolean;
  /** Builds the runtime; throws when the worker lacks what it needs (a message saying what). */
  create(deps: RuntimeDeps): WorkerRuntime;
  advert(): RuntimeCapabilities;
}

/**
 * The runtime `cfg.runtime` selects, with its settings and `cfg`'s common ones; unset (a worker
 * configured in code), the default kind with the settings of an empty environment.
 */
export function configuredRuntime(cfg: CommonSettings & { runtime?: RuntimeConfig | undefined }): ConfiguredRuntime {
  const runtime = cfg.runtime ?? defaultRuntimeConfig(cfg);
  const entry = RUNTIMES.find((e) => e.kind === runtime.kind);
  if (!entry) throw new Error(`no runtime of kind ${runtime.kind} (kinds: ${RUNTIMES.map((e) => e.kind).join(', ')})`);
  return {
    kind: entry.kind,
    ownsInstances: entry.ownsInstances,
    create: (deps) => entry.create(runtime.settings, cfg, deps),
    advert: () => entry.advert(runtime.settings),
  };
}

function defaultRuntimeConfig(common: CommonSettings): RuntimeConfig {
  const problems: string[] = [];
  const runtime = runtimeConfigFrom(DEFAULT_RUNTIME, {}, problems, common);
  if (!runtime || problems.length > 0) throw new Error(`the default runtime ${DEFAULT_RUNTIME} needs settings: ${problems.join('; ')}`);
  return runtime;
}

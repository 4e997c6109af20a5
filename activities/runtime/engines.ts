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
import { dllamaLauncher } from './dllama';
import type { EngineLauncher } from './launcher';
import { llamaCppLauncher } from './llama-cpp';

export type { EngineLauncher, KubernetesEnginePlan, KubernetesPlanning, LocalEngineSettings, LocalLaunch, LocalServing } from './launcher';

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

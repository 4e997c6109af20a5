/**
 * Which engine serves a local instance: the first of the worker's engines (its order: distributed
 * ones first by default) that is available here and can serve the model, started through its
 * launcher (engines.ts). An engine passed over although the model has an artifact of its format
 * is logged with why; with none left, the start fails `NoArtifact` with the most telling reason
 * (one of an engine that had an artifact, else the last).
 */
import { engineOf, type EngineKind } from '../../shared/engines';
import { RuntimeErrorType, runtimeError } from '../../shared/errors';
import type { ModelRegistry } from '../../dataplane/registry';
import { modelRevision } from '../../shared/model';
import type { ModelCache } from './cache';
import { launcherOf, type LocalEngineSettings } from './engines';
import { instanceKey, type Serving } from './local-instances';
import type { InstanceRequest } from './runtime';

export class ServingStarter {
  constructor(
    private readonly registry: ModelRegistry,
    /** The engines tried, in order. */
    private readonly engines: readonly EngineKind[],
    private readonly settings: LocalEngineSettings,
    private readonly cache: ModelCache,
    private readonly log: (line: string) => void,
  ) {}

  /** The first engine available here that can serve `req`'s model, started; aborted through `signal`, it stops what it began and rejects. */
  async start(req: InstanceRequest, signal: AbortSignal): Promise<Serving> {
    const ready = await this.registry.get(req.namespace, req.model);
    signal.throwIfAborted();
    if (!ready) throw runtimeError(RuntimeErrorType.ModelNotReady, `model ${req.namespace}/${req.model} is not in the registry`);
    const name = instanceKey(req.pool, req.instance);
    /** Why engines that have an artifact of their format here cannot serve it; then why the others cannot. */
    const refused: { why: string; hasArtifact: boolean }[] = [];
    for (const kind of this.engines) {
      const launcher = launcherOf(kind).local;
      if (!launcher.available(this.settings)) continue;
      const why = launcher.refusal(ready, this.settings);
      if (why !== null) {
        refused.push({ why, hasArtifact: ready.artifacts.some((a) => a.format === engineOf(kind).format) });
        continue;
      }
      const fellBack = refused.filter((r) => r.hasArtifact).map((r) => r.why);
      if (fellBack.length > 0) this.log(`${name}: ${fellBack.join('; ')}; serving it with ${engineOf(kind).short} instead`);
      const engine = await launcher.start({ ready, name, leases: req.leases, settings: this.settings, cache: this.cache, log: this.log, signal });
      return { kind, engine, revision: modelRevision(ready) };
    }
    const why = (refused.find((r) => r.hasArtifact) ?? refused.at(-1))?.why ?? `no engine on this worker serves model ${req.namespace}/${req.model}`;
    throw runtimeError(RuntimeErrorType.NoArtifact, why);
  }
}

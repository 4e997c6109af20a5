/**
 * What the workers' runtimes can serve, as each worker advertises it in the model registry
 * (`magus_models`, key `_runtime.<worker>`: dataplane/registry.ts), and the rule the
 * gateway applies to it: a model none of whose artifacts any live runtime can run is refused at
 * once, with the reason, instead of after a cold start that can only fail (`NoArtifact`).
 * Workflow-safe: no I/O.
 */
import { engineOf, enginesLoading, isDistributed, type Capability, type EngineKind } from './engines';
import type { ArtifactFormat, ReadyModel } from './model';

/** One worker's runtime, refreshed every {@link RUNTIME_ADVERT_INTERVAL_MS}. */
export interface RuntimeAdvert {
  /** The worker (its runtime queue's suffix). */
  worker: string;
  /** Its runtime's kind (`MAGUS_RUNTIME`: `local`, `kubernetes`; activities/runtime/index.ts). */
  runtime: string;
  /** Artifact formats it runs (each loaded by an engine of shared/engines.ts): `gguf` always; `dllama` with distributed-llama. */
  formats: ArtifactFormat[];
  /** The engines it runs (shared/engines.ts); absent in an older worker's advert: every engine loading its formats. */
  engines?: EngineKind[];
  /** Nodes of its distributed topologies, when fixed (the local runtime's `MAGUS_DLLAMA_NODES`). */
  dllamaNodes?: number;
  /** When it was last written (epoch ms). */
  at: number;
}

/**
 * How often a worker writes its advert again. The advert is also the pool's proof that a worker
 * lives (its watchers can be late when Temporal lags), so a killed worker's advert must go stale
 * about as fast as its watchers' heartbeats time out.
 */
export const RUNTIME_ADVERT_INTERVAL_MS = 10_000;
/** An advert older than this belongs to a worker that is gone (one that stops deletes its own). */
export const RUNTIME_ADVERT_STALE_MS = 3 * RUNTIME_ADVERT_INTERVAL_MS;

/** Why `runtime` cannot run any of `model`'s artifacts ('' when none is in its formats), or null when it can run one. */
function whyNot(model: ReadyModel, runtime: RuntimeAdvert): string | null {
  const refused: string[] = [];
  for (const a of model.artifacts) {
    if (!runtime.formats.includes(a.format)) continue;
    if (!enginesLoading(a.format).some(isDistributed)) return null;
    // The local runtime runs a distributed artifact only on its configured node count (dllama.ts, chooseDllamaArtifact).
    const plan = model.memory.find((m) => m.format === a.format && m.weights === a.weights);
    if (runtime.dllamaNodes === undefined || !plan || plan.topologies.some((t) => t.nodes === runtime.dllamaNodes)) return null;
    refused.push(`${a.format}:${a.weights} splits into ${plan.topologies.map((t) => t.nodes).join(', ') || 'no'} nodes, not ${runtime.dllamaNodes}`);
  }
  return refused.join('; ');
}

/**
 * Why no live runtime can serve `model` (a sentence for the caller), or null when one can — or
 * when nothing can be said: no live advert (no worker up, or workers older than adverts), or a
 * registry entry without artifacts (the pipeline never publishes one; only hand-made entries
 * served by instances pinned by hand have none).
 */
export function unservableReason(model: ReadyModel, adverts: readonly RuntimeAdvert[], now: number): string | null {
  if (model.artifacts.length === 0) return null;
  const live = adverts.filter((a) => now - a.at <= RUNTIME_ADVERT_STALE_MS);
  if (live.length === 0) return null;
  const reasons = new Set<string>();
  for (const r of live) {
    const why = whyNot(model, r);
    if (why === null) return null;
    if (why) reasons.add(why);
  }
  const has = model.artifacts.map((a) => `${a.format}:${a.weights}`).join(', ');
  const runs = [...new Set(live.map((r) => r.formats.map((f) => `${f} (${runsOn(f, r.dllamaNodes)})`).join(' and ')))].join('; or ');
  const hint = model.artifacts.some((a) => a.format === 'gguf')
    ? ''
    : ' Pull it with a GGUF artifact too (e.g. --format gguf:q80), or run a worker with distributed-llama (MAGUS_DLLAMA_API_BIN, MAGUS_DLLAMA_BIN).';
  return `The model '${model.name}' cannot be served here: it has ${has}, and the live workers' runtimes run ${runs}${reasons.size ? ` (${[...reasons].join('; ')})` : ''}.${hint}`;
}

/** The engines that run `format`, as a sentence's parenthesis (`llama.cpp`, `distributed-llama on 2 nodes`). */
function runsOn(format: ArtifactFormat, nodes: number | undefined): string {
  return enginesLoading(format)
    .map((e) => `${engineOf(e).short}${isDistributed(e) && nodes ? ` on ${nodes} nodes` : ''}`)
    .join(', ');
}

/**
 * The engines `runtime` may run `model` on, as its start would choose (activities/runtime):
 * the local runtime with a fixed node count runs a distributed artifact split for that count
 * first, else a single-process engine; the Kubernetes runtime follows the model's `Dllama`
 * resource, which the gateway does not see, so a model with artifacts for several engines may
 * get any of them there.
 */
function enginesOf(model: ReadyModel, runtime: RuntimeAdvert): EngineKind[] {
  const loadable = (f: ArtifactFormat) => runtime.formats.includes(f) && model.artifacts.some((a) => a.format === f);
  const runs = (e: EngineKind) => runtime.engines === undefined || runtime.engines.includes(e);
  const engines = [...new Set(model.artifacts.map((a) => a.format))].filter(loadable).flatMap(enginesLoading).filter(runs);
  if (runtime.dllamaNodes === undefined) return engines;
  const fits = (e: EngineKind) =>
    model.artifacts.some(
      (a) =>
        a.format === engineOf(e).format &&
        model.memory.some((m) => m.format === a.format && m.weights === a.weights && m.topologies.some((t) => t.nodes === runtime.dllamaNodes)),
    );
  const distributed = engines.filter((e) => isDistributed(e) && fits(e));
  return distributed.length > 0 ? distributed : engines.filter((e) => !isDistributed(e));
}

/**
 * The engines `model`'s instances may run on: those the live runtimes that can serve it would
 * choose; with no live advert, those its artifacts allow.
 */
export function modelEngines(model: ReadyModel, adverts: readonly RuntimeAdvert[], now: number): EngineKind[] {
  const live = adverts.filter((a) => now - a.at <= RUNTIME_ADVERT_STALE_MS && whyNot(model, a) === null);
  const engines = new Set<EngineKind>(live.flatMap((a) => enginesOf(model, a)));
  if (engines.size === 0) for (const a of model.artifacts) for (const e of enginesLoading(a.format)) engines.add(e);
  return [...engines].sort();
}

/** What every engine `model` may run on can do (`/v1/models` `capabilities`); none known: llama.cpp's (a hand-made entry). */
export function modelCapabilities(engines: readonly EngineKind[]): Capability[] {
  if (engines.length === 0) return [...engineOf('llamacpp').capabilities];
  return engineOf(engines[0]!).capabilities.filter((c) => engines.every((e) => engineOf(e).capabilities.includes(c)));
}

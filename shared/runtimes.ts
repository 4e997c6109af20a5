/**
 * What the workers' runtimes can serve, as each worker advertises it in the model registry
 * (`magus_models`, key `_runtime.<worker>`: dataplane/registry.ts), and the rule the
 * gateway applies to it: a model none of whose artifacts any live runtime can run is refused at
 * once, with the reason, instead of after a cold start that can only fail (`NoArtifact`).
 * Workflow-safe: no I/O.
 */
import { ENGINE_CAPABILITIES, type Capability, type EngineKind } from './chat';
import type { ArtifactFormat, ReadyModel } from './model';

/** One worker's runtime, refreshed every {@link RUNTIME_ADVERT_INTERVAL_MS}. */
export interface RuntimeAdvert {
  /** The worker (its runtime queue's suffix). */
  worker: string;
  /** Its runtime's kind (`MAGUS_RUNTIME`: `local`, `kubernetes`; activities/runtime/index.ts). */
  runtime: string;
  /** Artifact formats it runs: `gguf` (llama.cpp) always; `dllama` with distributed-llama. */
  formats: ArtifactFormat[];
  /** Nodes of its distributed-llama topologies, when fixed (the local runtime's `MAGUS_DLLAMA_NODES`). */
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
    if (a.format === 'gguf') return null;
    // The local runtime runs a dllama artifact only on its configured node count (dllama.ts, chooseDllamaArtifact).
    const plan = model.memory.find((m) => m.format === 'dllama' && m.weights === a.weights);
    if (runtime.dllamaNodes === undefined || !plan || plan.topologies.some((t) => t.nodes === runtime.dllamaNodes)) return null;
    refused.push(`dllama:${a.weights} splits into ${plan.topologies.map((t) => t.nodes).join(', ') || 'no'} nodes, not ${runtime.dllamaNodes}`);
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
  const runs = [...new Set(live.map((r) => r.formats.map((f) => (f === 'gguf' ? 'gguf (llama.cpp)' : `dllama (distributed-llama${r.dllamaNodes ? ` on ${r.dllamaNodes} nodes` : ''})`)).join(' and ')))].join('; or ');
  const hint = model.artifacts.some((a) => a.format === 'gguf') ? '' : ' Pull it with a GGUF artifact too (e.g. --format gguf:q80), or run a worker with distributed-llama (MAGUS_DLLAMA_API_BIN, MAGUS_DLLAMA_BIN).';
  return `The model '${model.name}' cannot be served here: it has ${has}, and the live workers' runtimes run ${runs}${reasons.size ? ` (${[...reasons].join('; ')})` : ''}.${hint}`;
}

/**
 * The engines `runtime` may run `model` on, as its start would choose (activities/runtime):
 * the local runtime with distributed-llama runs a dllama artifact split for its node count, else
 * llama.cpp; the Kubernetes runtime follows the model's `Dllama` resource, which the gateway does
 * not see, so a model with both kinds of artifact may get either there.
 */
function enginesOf(model: ReadyModel, runtime: RuntimeAdvert): EngineKind[] {
  const gguf = model.artifacts.some((a) => a.format === 'gguf' && runtime.formats.includes('gguf'));
  const dllama = runtime.formats.includes('dllama') && model.artifacts.some((a) => a.format === 'dllama');
  if (runtime.dllamaNodes !== undefined) {
    const fits = model.artifacts.some((a) => a.format === 'dllama' && model.memory.some((m) => m.format === 'dllama' && m.weights === a.weights && m.topologies.some((t) => t.nodes === runtime.dllamaNodes)));
    return fits ? ['dllama'] : gguf ? ['llamacpp'] : [];
  }
  return [...(gguf ? (['llamacpp'] as const) : []), ...(dllama ? (['dllama'] as const) : [])];
}

/**
 * The engines `model`'s instances may run on: those the live runtimes that can serve it would
 * choose; with no live advert, those its artifacts allow.
 */
export function modelEngines(model: ReadyModel, adverts: readonly RuntimeAdvert[], now: number): EngineKind[] {
  const live = adverts.filter((a) => now - a.at <= RUNTIME_ADVERT_STALE_MS && whyNot(model, a) === null);
  const engines = new Set<EngineKind>(live.flatMap((a) => enginesOf(model, a)));
  if (engines.size === 0) {
    if (model.artifacts.some((a) => a.format === 'gguf')) engines.add('llamacpp');
    if (model.artifacts.some((a) => a.format === 'dllama')) engines.add('dllama');
  }
  return [...engines].sort();
}

/** What every engine `model` may run on can do (`/v1/models` `capabilities`); none known: llama.cpp's (a hand-made entry). */
export function modelCapabilities(engines: readonly EngineKind[]): Capability[] {
  if (engines.length === 0) return [...ENGINE_CAPABILITIES.llamacpp];
  return ENGINE_CAPABILITIES[engines[0]!].filter((c) => engines.every((e) => ENGINE_CAPABILITIES[e].includes(c)));
}

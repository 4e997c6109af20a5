/**
 * Every engine magus can run, declared once: what it is called, which artifacts it loads, what it
 * can do beyond plain chat, how many requests it serves at once and the shape of its topology.
 * Everything else about an engine derives from this table: the gateway's refusals and
 * `/v1/models` capabilities (chat.ts, runtimes.ts), the bridge's `--engine-kind`, the `Dllama`
 * resource's `engine`, and which launcher the runtimes call (activities/runtime/engines.ts: one
 * file per engine with its processes, its Kubernetes containers and probes).
 *
 * Adding an engine: a row here, and its launcher (README.md, "Where to add X").
 * Workflow-safe: no I/O.
 */
import type { ArtifactFormat } from './model';

/** What an engine can do beyond plain chat (`/v1/models` `capabilities`). */
export const CAPABILITIES = ['json_schema', 'tools', 'logprobs', 'embeddings', 'completions'] as const;
export type Capability = (typeof CAPABILITIES)[number];

export interface EngineDeclaration {
  /** How errors and `/v1/models` name it to a client. */
  name: string;
  /** How logs name it. */
  short: string;
  /** The artifact format its instances load (shared/model.ts). */
  format: ArtifactFormat;
  /** What it does beyond plain chat completions. */
  capabilities: readonly Capability[];
  /** Requests one instance serves at once: its sized slots (`slots`), or one (`one`). */
  concurrency: 'slots' | 'one';
  /** One process per instance, or a root and 2^n − 1 workers sharing the model. */
  topology: 'single' | 'distributed';
  /**
   * Whether it continues an interrupted answer from the tokens already sent (shared/continuation.ts);
   * otherwise a later attempt generates it again with the pinned seed and checks it against them.
   */
  continues: boolean;
}

/** The engines, by kind (the kind is what the `Dllama` resource, the bridge and `/v1/models` say). */
export const ENGINES = {
  /** magus's own engine (`magus engine`, engine/): llama.cpp through node-llama-cpp, GGUF. */
  llamacpp: {
    name: 'llama.cpp (magus engine)',
    short: 'llama.cpp',
    format: 'gguf',
    capabilities: CAPABILITIES,
    concurrency: 'slots',
    topology: 'single',
    continues: true,
  },
  /** distributed-llama's `dllama-api` root and `dllama worker`s: its `.m` + `.t` artifacts, plain chat. */
  dllama: {
    name: "distributed-llama's dllama-api",
    short: 'distributed-llama',
    format: 'dllama',
    capabilities: [],
    concurrency: 'one',
    topology: 'distributed',
    continues: false,
  },
} as const satisfies Record<string, EngineDeclaration>;

export type EngineKind = keyof typeof ENGINES;
export const ENGINE_KINDS = Object.keys(ENGINES) as EngineKind[];

export function isEngineKind(kind: string): kind is EngineKind {
  return Object.hasOwn(ENGINES, kind);
}

/** The declaration of `kind`. */
export function engineOf(kind: EngineKind): EngineDeclaration {
  return ENGINES[kind];
}

/** Whether `kind` can do `capability`. */
export function engineCan(kind: EngineKind, capability: Capability): boolean {
  return engineOf(kind).capabilities.includes(capability);
}

/** Requests an instance of `kind` serves at once, given the slots it was sized for. */
export function concurrentRequests(kind: EngineKind, slots: number): number {
  return engineOf(kind).concurrency === 'one' ? 1 : slots;
}

/** Whether `kind` runs as a root and 2^n − 1 workers. */
export function isDistributed(kind: EngineKind): boolean {
  return engineOf(kind).topology === 'distributed';
}

/** `kinds` in the order a runtime that may run any of them tries them: distributed ones first (a worker configured for them wants them used). */
export function distributedFirst(kinds: readonly EngineKind[] = ENGINE_KINDS): EngineKind[] {
  return [...kinds].sort((a, b) => Number(isDistributed(b)) - Number(isDistributed(a)));
}

/** The artifact formats `kinds` load, once each (a runtime advert's `formats`). */
export function formatsLoadedBy(kinds: readonly EngineKind[]): ArtifactFormat[] {
  return [...new Set(kinds.map((k) => engineOf(k).format))];
}

/** The engines that load artifacts of `format`. */
export function enginesLoading(format: ArtifactFormat): EngineKind[] {
  return ENGINE_KINDS.filter((k) => ENGINES[k].format === format);
}

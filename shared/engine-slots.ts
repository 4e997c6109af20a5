/**
 * How many slots (llama.cpp sequences, each with its own KV cache) an engine instance gets, and
 * so how many leases its pool gives it: one conversation per slot, so that a pinned conversation
 * finds its prefix in the cache instead of evicting, and being evicted by, the others.
 *
 * The rule, one pure function used by every place that sizes an instance (the runtimes that start
 * engines, the gateway that starts pools, dev): within a per-instance memory budget,
 *
 *   slots = clamp(⌊(budget − weights − buffers) / kvCachePerSlot⌋ − resumeSlots, 1, {@link MAX_ENGINE_SLOTS})
 *
 * (`resumeSlots`: {@link RESUME_SLOTS}, or a `Dllama`'s `resumeSlots`) *
 * with the terms from the model's published memory plan (`ReadyModel.memory`, llama.cpp on one
 * node, activities/size/memory.ts): the KV cache is linear in the context, so one slot of
 * `contextLength` tokens costs `kvCache × contextLength / plan.contextLength`. The compute buffers
 * are the plan's, computed for the plan's context: at least what the engine's shorter context
 * needs (each of their terms grows with the context), so the rule errs towards fewer slots.
 * distributed-llama serves one request at a time: one slot, whatever the memory.
 * Workflow-safe: no I/O.
 */
import type { Artifact, MemoryPlan, NodeMemory, ReadyModel } from './model';
import { WEIGHTS_PREFERENCE } from './weights';

/** Context tokens per slot (the engine's `--ctx` default), unless the model plans a shorter one. */
export const ENGINE_CONTEXT = 4096;
/** The most slots `magus engine --slots` takes (a `Dllama` may ask for many leases per instance). */
export const ENGINE_SLOTS_LIMIT = 256;
/** More slots than this buy little on a CPU engine and make each generation slower. */
export const MAX_ENGINE_SLOTS = 16;
/**
 * Sequences a llama.cpp engine keeps beside its slots for answers resumed after their own engine
 * went away (engine/slots.ts, "urgent"): such an answer's client is waiting mid-answer, so it
 * starts at once instead of waiting for a slot to free; the next slot released refills the reserve
 * (other requests fill only `slots`). Each costs a slot's KV cache. The default;
 * a `Dllama` may set its own (`resumeSlots`): an engine that dies under full load hands back
 * `slots` answers, spread over the pool's other instances, so `slots / (instances − 1)` of them
 * start at once (crds/README.md).
 */
export const RESUME_SLOTS = 1;
/** The per-instance memory budget when none is configured (`MAGUS_INSTANCE_MEMORY`). */
export const DEFAULT_INSTANCE_MEMORY_BYTES = 8 * 2 ** 30;

/** An engine's size: its slots, the context of each, and the memory they take. */
export interface EngineSizing {
  slots: number;
  /** Sequences beside them for resumed answers (the engine's `--resume-slots`). */
  resumeSlots: number;
  /** Tokens per slot: the engine's `--ctx`. */
  contextLength: number;
  /** KV-cache bytes of one slot. */
  kvCachePerSlot: number;
  /** Bytes the instance needs: weights + buffers + (slots + resumeSlots) × kvCachePerSlot. */
  memory: number;
}

/**
 * The engine size for llama.cpp serving with `plan` (its one-node figures) within `budgetBytes`.
 * @param contextLength tokens per slot (default: {@link ENGINE_CONTEXT}, or the plan's context if shorter)
 * @param resumeSlots sequences kept for resumed answers beside the slots (default {@link RESUME_SLOTS})
 */
export function engineSizing(
  plan: { contextLength: number; root: NodeMemory },
  budgetBytes: number,
  contextLength = Math.min(ENGINE_CONTEXT, plan.contextLength),
  resumeSlots = RESUME_SLOTS,
): EngineSizing {
  if (!(budgetBytes > 0)) throw new RangeError(`the instance memory budget must be positive, got ${budgetBytes}`);
  if (!(plan.contextLength > 0 && contextLength > 0)) throw new RangeError(`context lengths must be positive, got ${plan.contextLength} and ${contextLength}`);
  const { weights, buffers, kvCache } = plan.root;
  const kvCachePerSlot = Math.ceil((kvCache * contextLength) / plan.contextLength);
  const fit = kvCachePerSlot > 0 ? Math.floor((budgetBytes - weights - buffers) / kvCachePerSlot) - resumeSlots : MAX_ENGINE_SLOTS;
  const slots = Math.min(MAX_ENGINE_SLOTS, Math.max(1, fit));
  return { slots, resumeSlots, contextLength, kvCachePerSlot, memory: weights + buffers + (slots + resumeSlots) * kvCachePerSlot };
}

/** Slots fixed by a runtime's option or a pool's leases (1 when neither says), within 1..{@link ENGINE_SLOTS_LIMIT}. */
export const fixedSlots = (slots: number | undefined): number => Math.min(Math.max(1, Math.floor(slots ?? 1)), ENGINE_SLOTS_LIMIT);

/**
 * {@link engineSizing}, with `slots` fixed when given (a pool's leases per instance: one slot per
 * lease, whatever the budget; {@link fixedSlots}) and `memory` counting them, beside
 * `resumeSlots` sequences for resumed answers (default {@link RESUME_SLOTS}).
 */
export function engineSizingWith(
  plan: { contextLength: number; root: NodeMemory },
  budgetBytes: number,
  slots: number | undefined,
  resumeSlots = RESUME_SLOTS,
): EngineSizing {
  const sized = engineSizing(plan, budgetBytes, undefined, resumeSlots);
  if (slots === undefined) return sized;
  const fixed = fixedSlots(slots);
  return { ...sized, slots: fixed, memory: sized.memory + (fixed - sized.slots) * sized.kvCachePerSlot };
}

/** The GGUF artifact llama.cpp serves ({@link WEIGHTS_PREFERENCE}: a GGUF source's own file, else the most compact) and its one-node plan, if the model has one. */
export function servedGguf(
  ready: Pick<ReadyModel, 'artifacts' | 'memory'>,
): { artifact: Artifact; plan: { contextLength: number; root: NodeMemory } | undefined } | undefined {
  const artifact = ready.artifacts
    .filter((a) => a.format === 'gguf')
    .sort((a, b) => WEIGHTS_PREFERENCE.indexOf(a.weights) - WEIGHTS_PREFERENCE.indexOf(b.weights))[0];
  if (!artifact) return undefined;
  const planned: MemoryPlan | undefined = ready.memory.find((m) => m.format === 'gguf' && m.weights === artifact.weights);
  const root = planned?.topologies.find((t) => t.nodes === 1)?.root;
  return { artifact, plan: planned && root ? { contextLength: planned.contextLength, root } : undefined };
}

/**
 * The names an engine's GGUF files get on disk: `model.gguf` for one file; for the parts of a split
 * GGUF, llama.cpp's part names (`model-00001-of-00003.gguf` …), since llama.cpp opens the first part
 * and finds the others beside it by those names. The engine is given the first.
 */
export function ggufFileNames(parts: number): string[] {
  if (parts <= 1) return ['model.gguf'];
  const of = String(parts).padStart(5, '0');
  return Array.from({ length: parts }, (_, i) => `model-${String(i + 1).padStart(5, '0')}-of-${of}.gguf`);
}

/**
 * The leases per instance of a pool of `ready` that no `Dllama` sizes: the slots of the llama.cpp
 * engine the runtimes start for it, 1 without a GGUF artifact or a plan (distributed-llama, or an
 * entry made by hand).
 */
export function leasesPerInstance(ready: Pick<ReadyModel, 'artifacts' | 'memory'>, budgetBytes: number): number {
  const plan = servedGguf(ready)?.plan;
  return plan ? engineSizing(plan, budgetBytes).slots : 1;
}

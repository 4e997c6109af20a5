/** Engine slots from the memory plan: the rule, its bounds, and which artifact's plan it reads. */
import { parseModelSpec } from '../convert/arch';
import { planMemory } from '../activities/size/memory';
import {
  ENGINE_CONTEXT,
  ENGINE_SLOTS_LIMIT,
  engineSizing,
  engineSizingWith,
  leasesPerInstance,
  MAX_ENGINE_SLOTS,
  RESUME_SLOTS,
  servedGguf,
} from './engine-slots';
import type { Artifact, MemoryPlan, ReadyModel } from './model';

const MIB = 2 ** 20;
const GIB = 2 ** 30;

/** SmolLM2-135M's shape (its config.json): 30 layers, 3 KV heads of 64. */
const smol = parseModelSpec({
  architectures: ['LlamaForCausalLM'],
  model_type: 'llama',
  hidden_size: 576,
  intermediate_size: 1536,
  num_attention_heads: 9,
  num_key_value_heads: 3,
  num_hidden_layers: 30,
  vocab_size: 49152,
  max_position_embeddings: 8192,
  rms_norm_eps: 1e-5,
  rope_theta: 100000,
  hidden_act: 'silu',
  tie_word_embeddings: true,
  bos_token_id: 1,
  eos_token_id: 2,
});

const plan = (weights: number, kvCache: number, buffers: number, contextLength: number) => ({
  contextLength,
  root: { weights, kvCache, buffers, total: weights + kvCache + buffers },
});

test('slots = ⌊(budget − weights − buffers) / KV per slot⌋ − the resume slot, the KV cache scaled to the engine context', () => {
  // KV cache for 8192 tokens: 64 MiB, so 32 MiB per slot of 4096: 5 fit, one of them kept for resumed answers.
  const sized = engineSizing(plan(100 * MIB, 64 * MIB, 20 * MIB, 8192), 300 * MIB);
  expect(RESUME_SLOTS).toBe(1);
  expect(sized).toEqual({ slots: 4, resumeSlots: 1, contextLength: ENGINE_CONTEXT, kvCachePerSlot: 32 * MIB, memory: 120 * MIB + 5 * 32 * MIB });
  expect(sized.memory).toBeLessThanOrEqual(300 * MIB);
  // A model planned for a shorter context gets slots of that context.
  expect(engineSizing(plan(100 * MIB, 16 * MIB, 20 * MIB, 2048), 300 * MIB)).toMatchObject({ contextLength: 2048, kvCachePerSlot: 16 * MIB, slots: 10 });
  // An explicit context.
  expect(engineSizing(plan(100 * MIB, 64 * MIB, 20 * MIB, 8192), 300 * MIB, 1024)).toMatchObject({
    contextLength: 1024,
    kvCachePerSlot: 8 * MIB,
    slots: MAX_ENGINE_SLOTS,
  });
});

test('at least one slot when the weights alone exceed the budget; at most MAX_ENGINE_SLOTS', () => {
  expect(engineSizing(plan(10 * GIB, 1 * GIB, 1 * GIB, 4096), 8 * GIB).slots).toBe(1);
  expect(engineSizing(plan(1 * MIB, 1 * MIB, 1 * MIB, 4096), 8 * GIB).slots).toBe(MAX_ENGINE_SLOTS);
  expect(engineSizing(plan(1 * MIB, 0, 1 * MIB, 4096), 8 * GIB).slots).toBe(MAX_ENGINE_SLOTS);
  expect(() => engineSizing(plan(1, 1, 1, 4096), 0)).toThrow(RangeError);
});

test('slots fixed by a pool (a slot per lease): the memory counts them, beyond the budget if need be; 1..ENGINE_SLOTS_LIMIT', () => {
  const p = plan(100 * MIB, 64 * MIB, 20 * MIB, 8192);
  expect(engineSizingWith(p, 300 * MIB, undefined)).toEqual(engineSizing(p, 300 * MIB));
  expect(engineSizingWith(p, 300 * MIB, 2)).toEqual({
    slots: 2,
    resumeSlots: 1,
    contextLength: ENGINE_CONTEXT,
    kvCachePerSlot: 32 * MIB,
    memory: 120 * MIB + 3 * 32 * MIB,
  });
  expect(engineSizingWith(p, 300 * MIB, 32)).toMatchObject({ slots: 32, memory: 120 * MIB + 33 * 32 * MIB });
  expect(engineSizingWith(p, 300 * MIB, 10_000).slots).toBe(ENGINE_SLOTS_LIMIT);
  expect(engineSizingWith(p, 300 * MIB, 0).slots).toBe(1);
});

test("a Dllama's resume slots: taken from what the budget holds, or counted beside fixed slots; 0 keeps none", () => {
  const p = plan(100 * MIB, 64 * MIB, 20 * MIB, 8192);
  // 5 slots' KV fit in 300 MiB: 3 for conversations beside 2 for resumed answers.
  expect(engineSizing(p, 300 * MIB, undefined, 2)).toEqual({
    slots: 3,
    resumeSlots: 2,
    contextLength: ENGINE_CONTEXT,
    kvCachePerSlot: 32 * MIB,
    memory: 120 * MIB + 5 * 32 * MIB,
  });
  expect(engineSizing(p, 300 * MIB, undefined, 0)).toMatchObject({ slots: 5, resumeSlots: 0, memory: 120 * MIB + 5 * 32 * MIB });
  expect(engineSizingWith(p, 300 * MIB, 4, 2)).toMatchObject({ slots: 4, resumeSlots: 2, memory: 120 * MIB + 6 * 32 * MIB });
});

test('SmolLM2-135M (Q4_1-sized GGUF, planned at its 8192 tokens): 23 KB of KV per token, 90 MiB per 4096-token slot', () => {
  const memory = planMemory(smol, 'gguf', 'q40', undefined, 87 * MIB);
  const sized = engineSizing({ contextLength: memory.contextLength, root: memory.topologies[0]!.root }, 1 * GIB);
  expect(sized.kvCachePerSlot).toBe(30 * 2 * 4096 * 192 * 2);
  // (1 GiB − 87 MiB weights − ~158 MiB buffers) / 90 MiB, less the resume slot.
  expect(sized.slots).toBe(7);
  expect(engineSizing({ contextLength: memory.contextLength, root: memory.topologies[0]!.root }, 8 * GIB).slots).toBe(MAX_ENGINE_SLOTS);
});

describe('the served GGUF and its pool leases', () => {
  const artifact = (format: Artifact['format'], weights: Artifact['weights']): Artifact => ({
    format,
    weights,
    converterVersion: '1',
    files: [{ key: `${format}-${weights}`, bytes: 1, sha256: 'x' }],
  });
  const gguf = (weights: MemoryPlan['weights'], kv: number): MemoryPlan => ({
    format: 'gguf',
    weights,
    contextLength: 4096,
    topologies: [{ nodes: 1, root: plan(100 * MIB, kv, 0, 4096).root, worker: null }],
  });
  const entry = (artifacts: Artifact[], memory: MemoryPlan[]): Pick<ReadyModel, 'artifacts' | 'memory'> => ({ artifacts, memory });

  test('the most compact GGUF weights are served, with their own plan', () => {
    const ready = entry([artifact('gguf', 'f16'), artifact('gguf', 'q40'), artifact('dllama', 'q40')], [gguf('f16', 200 * MIB), gguf('q40', 100 * MIB)]);
    expect(servedGguf(ready)?.artifact.weights).toBe('q40');
    expect(servedGguf(ready)?.plan?.root.kvCache).toBe(100 * MIB);
    expect(leasesPerInstance(ready, 600 * MIB)).toBe(4);
  });

  test('one lease per instance without a GGUF or without its plan', () => {
    expect(leasesPerInstance(entry([artifact('dllama', 'q40')], []), 8 * GIB)).toBe(1);
    expect(leasesPerInstance(entry([artifact('gguf', 'q40')], []), 8 * GIB)).toBe(1);
    expect(servedGguf(entry([artifact('gguf', 'q40')], []))?.plan).toBeUndefined();
  });
});

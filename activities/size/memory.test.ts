/** The memory table for a Llama-3.2-1B-shaped model, term by term against hand arithmetic. */
import { parseModelSpec } from '../../convert/arch';
import { dllamaNodeCounts } from '../../shared/dllama-topology';
import { dllamaNodeMemory, dllamaSplitProblem, llamaCppMemory, planMemory } from './memory';

const spec = parseModelSpec({
  architectures: ['LlamaForCausalLM'],
  model_type: 'llama',
  hidden_size: 2048,
  intermediate_size: 8192,
  num_attention_heads: 32,
  num_key_value_heads: 8,
  num_hidden_layers: 16,
  vocab_size: 128256,
  max_position_embeddings: 131072,
  rms_norm_eps: 1e-5,
  rope_theta: 500000,
  hidden_act: 'silu',
  tie_word_embeddings: true,
  bos_token_id: 128000,
  eos_token_id: 128001,
});

const layerParams = 2048 * 2048 * 2 + 512 * 2048 * 2 + 8192 * 2048 * 3; // q, o, k, v, gate/up/down
const q40 = (params: number) => (params / 32) * 18;

test('distributed-llama on one node: all weights, the F32 embedding, the full KV cache', () => {
  const { root, worker } = dllamaNodeMemory(spec, 'q40', 4096, 1);
  expect(worker).toBeNull();
  const sliced = q40(16 * layerParams + 128256 * 2048); // layers + lm_head (tied: the embedding, quantized)
  const embedding = 128256 * 2048 * 4;
  const norms = (16 * 2 + 1) * 2048 * 4;
  expect(root.weights).toBe(sliced + embedding + norms);
  expect(root.kvCache).toBe(16 * 2 * 4096 * 512 * 4); // 256 MiB
  // The attention scores alone: 32 batches × 32 heads × 4096 positions × 4 bytes.
  expect(root.buffers).toBeGreaterThan(32 * 32 * 4096 * 4);
  expect(root.total).toBe(root.weights + root.kvCache + root.buffers);
});

test('four nodes: a quarter of the matrices and KV cache each; only the root holds the embedding', () => {
  const one = dllamaNodeMemory(spec, 'q40', 4096, 1).root;
  const { root, worker } = dllamaNodeMemory(spec, 'q40', 4096, 4);
  const embedding = 128256 * 2048 * 4;
  const norms = (16 * 2 + 1) * 2048 * 4;
  const sliced = q40(16 * layerParams + 128256 * 2048);
  expect(root.weights).toBe(sliced / 4 + embedding + norms);
  expect(worker!.weights).toBe(sliced / 4 + norms);
  expect(root.kvCache).toBe(one.kvCache / 4);
  expect(worker!.kvCache).toBe(root.kvCache);
  expect(root.buffers).toBeLessThan(one.buffers);
});

test('topologies: only node counts distributed-llama runs, and why the others do not', () => {
  expect(dllamaNodeCounts(spec, 'q40')).toEqual([1, 2, 4, 8]); // 8 KV heads
  const plan = planMemory(spec, 'dllama', 'q40', 4096, 0);
  expect(plan.topologies.map((t) => t.nodes)).toEqual([1, 2, 4, 8]);
  expect(plan.refused).toEqual([{ nodes: 16, reason: 'num_key_value_heads 8 / 16 nodes is not a whole number of KV heads per node' }]);
  expect(plan.contextLength).toBe(4096);
  // More nodes, less memory per node.
  const totals = plan.topologies.map((t) => t.root.total);
  expect([...totals].sort((a, b) => b - a)).toEqual(totals);
});

test('f16 and q80 weights, which distributed-llama cannot run: no topology, each refused for the weights', () => {
  for (const weights of ['f16', 'q80'] as const) {
    const plan = planMemory(spec, 'dllama', weights, 4096, 0);
    expect(plan.topologies).toEqual([]);
    expect(plan.refused?.map((r) => r.nodes)).toEqual([1, 2, 4, 8, 16]);
    expect(new Set(plan.refused?.map((r) => r.reason))).toEqual(new Set([dllamaSplitProblem(spec, weights, 1)]));
    expect(plan.refused?.[0]?.reason).toMatch(new RegExp(`^distributed-llama cannot run ${weights} weights`));
  }
});

test('a dimension no node count splits: an empty plan naming it for every count', () => {
  const odd = { ...spec, intermediate: 8196 }; // 8196 / 1 = 8196, not a multiple of 8
  const plan = planMemory(odd, 'dllama', 'f32', 4096, 0);
  expect(plan.topologies).toEqual([]);
  expect(plan.refused?.[0]).toEqual({ nodes: 1, reason: 'intermediate_size 8196 / 1 node = 8196 values per node, not a multiple of 8 (F32 matmul)' });
});

test('f32 weights sync in f32: their buffers are larger than q40’s by the F32 pipe and the missing q80 copies', () => {
  const q40 = dllamaNodeMemory(spec, 'q40', 4096, 2).root.buffers;
  const f32 = dllamaNodeMemory(spec, 'f32', 4096, 2).root.buffers;
  const B = 32;
  const q80 = 34 / 32;
  const [dim, qDim, ff, N] = [2048, 2048, 8192, 2];
  // ZQ pipe and q_z_slice become F32; q_y, q_d, q_moe_y and q_moe_d are not allocated.
  const expected = B * dim * N * (4 - q80) + B * (qDim / N) * (4 - q80) - B * dim * q80 * 2 - B * (ff / N) * q80 * 2;
  expect(f32 - q40).toBeCloseTo(expected, -1);
});

test('llama.cpp: the mapped file, an F16 KV cache, and the compute buffer', () => {
  const m = llamaCppMemory(spec, 800_000_000, 4096);
  expect(m.weights).toBe(800_000_000);
  expect(m.kvCache).toBe(16 * 2 * 4096 * 512 * 2); // 128 MiB
  expect(m.buffers).toBeGreaterThanOrEqual(512 * 4096 * 32 * 4); // KQ scores of one micro-batch
  const plan = planMemory(spec, 'gguf', 'q40', undefined, 800_000_000);
  expect(plan.contextLength).toBe(131072); // the model's own maximum by default
  expect(plan.topologies).toHaveLength(1);
});

test('the context is capped at the model maximum', () => {
  expect(planMemory(spec, 'dllama', 'f16', 10_000_000, 0).contextLength).toBe(131072);
});

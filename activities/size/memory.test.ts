/** The memory table for a Llama-3.2-1B-shaped model, term by term against hand arithmetic. */
import { parseModelSpec } from '../../convert/arch';
import { dllamaNodeMemory, dllamaSplits, llamaCppMemory, planMemory } from './memory';

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

test('topologies: only node counts the heads and blocks split into', () => {
  expect([1, 2, 4, 8, 16].filter((n) => dllamaSplits(spec, 'q40', n))).toEqual([1, 2, 4, 8]); // 8 KV heads
  const plan = planMemory(spec, 'dllama', 'q40', 4096, 0);
  expect(plan.topologies.map((t) => t.nodes)).toEqual([1, 2, 4, 8]);
  expect(plan.contextLength).toBe(4096);
  // More nodes, less memory per node.
  const totals = plan.topologies.map((t) => t.root.total);
  expect([...totals].sort((a, b) => b - a)).toEqual(totals);
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

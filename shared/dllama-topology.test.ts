/**
 * distributed-llama's topology rule, case by case. Where a case says "ran" or "aborted", that
 * shape was converted (the tiny synthetic model) and run with distributed-llama 0.16.4's `dllama
 * inference` (AVX2 build, `dllama worker`s on this machine) while the rule was written: the
 * aborts are its assertions, quoted.
 */
import { DLLAMA_NODE_COUNTS, dllamaNodeCounts, dllamaSplitProblem, dllamaSplitProblems, dllamaWeightsProblem, type DllamaShape } from './dllama-topology';

/** The tiny synthetic model's default shape: 4 heads of 16, 2 KV heads. */
const tiny: DllamaShape = { hidden: 64, intermediate: 256, heads: 4, kvHeads: 2, headDim: 16, vocab: 384 };
/** Llama 3.2 1B: 32 heads of 64, 8 KV heads. */
const llama1b: DllamaShape = { hidden: 2048, intermediate: 8192, heads: 32, kvHeads: 8, headDim: 64, vocab: 128256 };

test('a real model: every power of two up to its KV heads, in both weights formats', () => {
  expect(dllamaNodeCounts(llama1b, 'q40')).toEqual([1, 2, 4, 8]);
  expect(dllamaNodeCounts(llama1b, 'f32')).toEqual([1, 2, 4, 8]);
  expect(dllamaSplitProblem(llama1b, 'q40', 16)).toBe('num_key_value_heads 8 / 16 nodes is not a whole number of KV heads per node');
});

test('f16 and q80 weights: no topology at all, and the reason is the weights', () => {
  for (const weights of ['f16', 'q80'] as const) {
    expect(dllamaNodeCounts(llama1b, weights)).toEqual([]);
    const reason = `distributed-llama cannot run ${weights} weights: its CPU matmuls take q40 or f32 weights only (${weights} stops at the first matmul: "Unsupported op quant")`;
    expect(dllamaWeightsProblem(weights)).toBe(reason);
    for (const n of DLLAMA_NODE_COUNTS) expect(dllamaSplitProblems(llama1b, weights, n)).toEqual([reason]);
  }
  expect(dllamaWeightsProblem('q40')).toBeNull();
  expect(dllamaWeightsProblem('f32')).toBeNull();
});

test('more nodes than KV heads, or heads that do not divide: aborted ("does not support more nodes than the number of KV heads")', () => {
  expect(dllamaSplitProblems(tiny, 'f32', 4)).toEqual(['num_key_value_heads 2 / 4 nodes is not a whole number of KV heads per node']);
  expect(dllamaSplitProblems({ ...tiny, heads: 6, kvHeads: 6, hidden: 96 }, 'f32', 4)).toEqual([
    'num_key_value_heads 6 / 4 nodes is not a whole number of KV heads per node',
    'num_attention_heads 6 / 4 nodes is not a whole number of heads per node',
  ]);
  expect(dllamaSplitProblems(tiny, 'f32', 3)).toEqual(['distributed-llama runs a root and 2^n − 1 workers: 3 nodes is not one of 1, 2, 4, 8, 16']);
});

test('intermediate_size per node: a multiple of 8 in f32, whole 32-value blocks in q40 (down_proj reads it)', () => {
  // Aborted: `matmul_F32_F32_F32: Assertion n % 8 == 0`.
  expect(dllamaSplitProblem({ ...tiny, intermediate: 100 }, 'f32', 1)).toBe(
    'intermediate_size 100 / 1 node = 100 values per node, not a multiple of 8 (F32 matmul)',
  );
  expect(dllamaSplitProblem({ ...tiny, intermediate: 104 }, 'f32', 2)).toBe(
    'intermediate_size 104 / 2 nodes = 52 values per node, not a multiple of 8 (F32 matmul)',
  );
  expect(dllamaNodeCounts({ ...tiny, intermediate: 104 }, 'f32')).toEqual([1]);
  // Ran: 56 per node.
  expect(dllamaNodeCounts({ ...tiny, intermediate: 112 }, 'f32')).toEqual([1, 2]);
  // Aborted (`n % Q80_BLOCK_SIZE == 0`): 48 per node; ran: 32.
  expect(dllamaSplitProblem({ ...tiny, intermediate: 96 }, 'q40', 2)).toBe(
    'intermediate_size 96 / 2 nodes = 48 values per node, not a whole number of 32-value q40 blocks (Q40 matmul)',
  );
  expect(dllamaNodeCounts({ ...tiny, intermediate: 64 }, 'q40')).toEqual([1, 2]);
  expect(dllamaSplitProblem({ ...tiny, intermediate: 98 }, 'f32', 4)).toContain('intermediate_size 98 / 4 nodes is not a whole number of values per node');
});

test('heads × head_dim per node (o_proj reads it): whole q40 blocks', () => {
  const kv4 = { ...tiny, kvHeads: 4 };
  // Aborted in q40 (16 per node); ran in f32.
  expect(dllamaSplitProblem(kv4, 'q40', 4)).toBe(
    'num_attention_heads × head_dim 64 / 4 nodes = 16 values per node, not a whole number of 32-value q40 blocks (Q40 matmul)',
  );
  expect(dllamaNodeCounts(kv4, 'f32')).toEqual([1, 2, 4]);
  expect(dllamaNodeCounts(kv4, 'q40')).toEqual([1, 2]);
});

test('hidden_size and head_dim: multiples of 8 whatever the weights (the F32 RMS norm, attention)', () => {
  // Aborted: `invRms_F32: Assertion size % 8 == 0`.
  expect(dllamaSplitProblem({ ...tiny, hidden: 44 }, 'f32', 1)).toBe('hidden_size 44 is not a multiple of 8 (F32 RMS norm and matmul)');
  expect(dllamaSplitProblem({ ...tiny, hidden: 48, headDim: 12 }, 'q40', 1)).toBe(
    "hidden_size 48 is not a whole number of 32-value q40 blocks (Q40 matmul); head_dim 12 is not a multiple of 8 (attention's F32 dot product); num_attention_heads × head_dim 48 / 1 node = 48 values per node, not a whole number of 32-value q40 blocks (Q40 matmul)",
  );
  // Aborted: `dotProduct_F32: Assertion size % 8 == 0`.
  expect(dllamaSplitProblems({ ...tiny, hidden: 48, headDim: 12 }, 'f32', 1)).toEqual(["head_dim 12 is not a multiple of 8 (attention's F32 dot product)"]);
});

test('rows a node computes need only divide: the classifier and the KV projections', () => {
  // Ran: 195 classifier rows per node in f32 and q40; 387 on 1 node.
  expect(dllamaNodeCounts({ ...tiny, vocab: 390 }, 'f32')).toEqual([1, 2]);
  expect(dllamaNodeCounts({ ...tiny, vocab: 390 }, 'q40')).toEqual([1, 2]);
  expect(dllamaNodeCounts({ ...tiny, vocab: 387 }, 'f32')).toEqual([1]);
  expect(dllamaSplitProblem({ ...tiny, vocab: 387 }, 'f32', 2)).toBe('vocab_size 387 / 2 nodes is not a whole number of classifier rows per node');
  // Ran: 16 KV rows per node in q40 (2 nodes), not a whole block.
  expect(dllamaNodeCounts(tiny, 'q40')).toEqual([1, 2]);
});

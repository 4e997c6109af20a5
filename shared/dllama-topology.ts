/**
 * Which distributed-llama topologies run a model, from its dimensions and weights format alone,
 * and, for one that does not, the dimension that stops it. One rule for the converter (it refuses
 * a model no topology runs, convert/dllama.ts), the memory plans (they list only topologies that
 * run, activities/size/memory.ts) and the controller (a `Dllama`'s `Splittable` condition).
 *
 * Read in distributed-llama 0.16.4's source (src/llm.cpp `buildLlmNet`, src/nn/nn-core.cpp
 * `slice*`, src/nn/nn-cpu-ops.cpp) and checked against its programs, built for AVX2:
 * - weights: its CPU matmuls are F32 × F32 (f32 weights, `--buffer-float-type f32`) and Q40 × Q80
 *   (q40 weights, q80 buffers) only: f16 and q80 weights stop at the first matmul ("Unsupported
 *   op quant"), as shared/weights.ts `dllamaBuffer` says;
 * - nodes: a root and 2^n − 1 workers, never more than the KV heads ("This version does not
 *   support more nodes than the number of KV heads"), dividing the heads and KV heads
 *   (`sliceMultiHeadAtt`, `sliceKvCache`) and the classifier's rows (`sliceRowMatmul` asserts
 *   `d % nNodes == 0`);
 * - what each node's matmuls read: `hidden_size` for q/k/v, gate/up and the classifier (it is
 *   never sliced), `heads × head_dim / N` for o_proj and `intermediate_size / N` for down_proj
 *   (`sliceColMatmul`). The F32 matmul steps 8 values at a time (`matmul_F32_F32_F32: Assertion
 *   n % 8 == 0`); the Q40 one and the q80 buffers that feed it need whole 32-value blocks;
 * - whatever the weights: `hidden_size` and `head_dim` multiples of 8, which the F32 RMS norm
 *   (`invRms_F32`) and attention's dot product (`dotProduct_F32`) assert.
 * The rows a node computes (its slice of q/k/v, gate/up, the classifier) need only divide evenly:
 * tried here, 195 classifier rows per node ran, as did 16 KV rows per node in q40.
 * ARM builds step by 4 where AVX2 steps by 8: the rule is AVX2's, the stricter.
 *
 * Workflow-safe: no I/O.
 */
import { WEIGHTS, WEIGHTS_FORMATS, weightsFormat, type WeightsFormat } from './weights';

/** Topologies distributed-llama runs: a root and 2^n − 1 workers, n = 0..4. */
export const DLLAMA_NODE_COUNTS = [1, 2, 4, 8, 16] as const;

/** The dimensions the rule reads (a converter's `ModelSpec` has them, under these names). */
export interface DllamaShape {
  /** `hidden_size` */
  hidden: number;
  /** `intermediate_size` */
  intermediate: number;
  /** `num_attention_heads` */
  heads: number;
  /** `num_key_value_heads` */
  kvHeads: number;
  /** `head_dim` */
  headDim: number;
  /** `vocab_size` */
  vocab: number;
}

/** Values the F32 matmul, RMS norm and dot product take per AVX2 step. */
const F32_STEP = 8;

const nodesText = (n: number): string => `${n} node${n === 1 ? '' : 's'}`;

/** The weights formats distributed-llama runs on a CPU, in the table's order. */
export const DLLAMA_RUNNABLE_WEIGHTS: readonly WeightsFormat[] = WEIGHTS_FORMATS.filter((f) => WEIGHTS[f].dllamaBuffer !== null);

/** Why distributed-llama cannot run `weights` at all, or null when it can. */
export function dllamaWeightsProblem(weights: WeightsFormat): string | null {
  if (weightsFormat(weights).dllamaBuffer !== null) return null;
  return `distributed-llama cannot run ${weights} weights: its CPU matmuls take ${DLLAMA_RUNNABLE_WEIGHTS.join(' or ')} weights only (${weights} stops at the first matmul: "Unsupported op quant")`;
}

/**
 * Every reason distributed-llama cannot run a model of `shape` in `weights` on `nodes` nodes,
 * each naming the dimension (empty: it runs).
 */
export function dllamaSplitProblems(shape: DllamaShape, weights: WeightsFormat, nodes: number): string[] {
  const weightsProblem = dllamaWeightsProblem(weights);
  if (weightsProblem) return [weightsProblem];
  const problems: string[] = [];
  if (!(DLLAMA_NODE_COUNTS as readonly number[]).includes(nodes)) {
    problems.push(`distributed-llama runs a root and 2^n − 1 workers: ${nodesText(nodes)} is not one of ${DLLAMA_NODE_COUNTS.join(', ')}`);
    return problems;
  }
  const n = nodesText(nodes);
  const whole = (name: string, value: number, what: string): boolean => {
    if (value % nodes === 0) return true;
    problems.push(`${name} ${value} / ${n} is not a whole number of ${what} per node`);
    return false;
  };
  const { blockQuantized, blockSize } = weightsFormat(weights);
  const step = blockQuantized ? blockSize : F32_STEP;
  const unit = blockQuantized
    ? `a whole number of ${blockSize}-value ${weights} blocks (${weights.toUpperCase()} matmul)`
    : `a multiple of ${F32_STEP} (F32 matmul)`;
  /** What one node's matmul reads: `value` split `nodes` ways, in whole steps. */
  const perNode = (name: string, value: number): void => {
    const slice = value / nodes;
    if (slice % step !== 0) problems.push(`${name} ${value} / ${n} = ${slice} values per node, not ${unit}`);
  };

  whole('num_key_value_heads', shape.kvHeads, 'KV heads');
  const headsSplit = whole('num_attention_heads', shape.heads, 'heads');
  whole('vocab_size', shape.vocab, 'classifier rows');
  // Every step is a multiple of 8: this covers the F32 RMS norm over hidden_size too.
  if (shape.hidden % step !== 0)
    problems.push(`hidden_size ${shape.hidden} is not ${blockQuantized ? unit : `a multiple of ${F32_STEP} (F32 RMS norm and matmul)`}`);
  if (shape.headDim % F32_STEP !== 0) problems.push(`head_dim ${shape.headDim} is not a multiple of ${F32_STEP} (attention's F32 dot product)`);
  if (headsSplit) perNode('num_attention_heads × head_dim', shape.heads * shape.headDim);
  if (whole('intermediate_size', shape.intermediate, 'values')) perNode('intermediate_size', shape.intermediate);
  return problems;
}

/** Why distributed-llama cannot run the model on `nodes` nodes (the reasons joined), or null when it can. */
export function dllamaSplitProblem(shape: DllamaShape, weights: WeightsFormat, nodes: number): string | null {
  const problems = dllamaSplitProblems(shape, weights, nodes);
  return problems.length === 0 ? null : problems.join('; ');
}

/** The node counts of {@link DLLAMA_NODE_COUNTS} that run the model. */
export function dllamaNodeCounts(shape: DllamaShape, weights: WeightsFormat): number[] {
  return DLLAMA_NODE_COUNTS.filter((n) => dllamaSplitProblems(shape, weights, n).length === 0);
}

/**
 * How much memory a node needs to serve an artifact: distributed-llama on 1, 2, 4, 8 or 16
 * nodes, or llama.cpp on one node. Pure arithmetic over the model spec.
 *
 * distributed-llama (derived from b4rtaz/distributed-llama at 8d624a7, src/llm.cpp
 * `buildLlmNet` and src/nn/nn-core.cpp `slice*`): every matrix is split across the N nodes —
 * q/k/v/w1/w3/wcls by output rows, wo/w2 by input columns — so each node holds 1/N of it; the
 * token embedding (F32) is loaded by the root only; norms are small F32 vectors every node holds.
 * The KV cache is F32 and split by kv dimension: `layers × 2 × seqLen × kvDim/N × 4`. Buffers are
 * the pipes every node maps (`POS`, `TOK`, `X`, `LG` logits, `ZQ` sync) plus each node's own
 * activations for a batch of `nBatches` (32 by default) tokens, the rope cache
 * (`seqLen × sliceDim × 4`) and the attention scores (`nBatches × heads/N × seqLen × 4`), the
 * largest term at long contexts. Sync buffers have the type the weights run with
 * (`--buffer-float-type`: f32 for f32 weights, q80 for q40; shared/weights.ts `dllamaBuffer`);
 * with f32 the `q_*` copies are the F32 buffers themselves.
 *
 * Which node counts a model runs on is shared/dllama-topology.ts's rule: a plan lists only those
 * (none for f16 and q80 weights, which distributed-llama cannot run) and says why each other
 * count does not run (`refused`).
 *
 * llama.cpp: the GGUF is memory-mapped whole; the KV cache is F16 (`layers × 2 × ctx × kvDim × 2`);
 * the compute buffer is estimated for a 512-token micro-batch without flash attention, where
 * the attention scores (`ubatch × ctx × heads × 4`) dominate, plus FFN and embedding
 * activations and one row of logits. It is an estimate, meant to choose a node size, not exact.
 */
import { planTensors, type ModelSpec } from '../../convert/arch';
import { DLLAMA_NODE_COUNTS, dllamaSplitProblem } from '../../shared/dllama-topology';
import type { ArtifactFormat, MemoryPlan, NodeMemory } from '../../shared/model';
import { weightsFormat, type ArtifactWeights, type WeightsFormat } from '../../shared/weights';

export { DLLAMA_NODE_COUNTS, dllamaSplitProblem };

/** What llama.cpp's memory depends on: a converter's spec has it, and a GGUF source's metadata (convert/gguf-source.ts). */
export type LlamaCppShape = Pick<ModelSpec, 'layers' | 'hidden' | 'intermediate' | 'heads' | 'kvHeads' | 'headDim' | 'vocab' | 'ctx'>;

/** distributed-llama's default number of batched tokens (`--nbatches`). */
export const DLLAMA_BATCHES = 32;
/** llama.cpp's default micro-batch (`n_ubatch`). */
export const LLAMA_CPP_UBATCH = 512;

const F32 = 4;
/** Bytes per value of a q80 buffer (34-byte blocks of 32). */
const Q80 = weightsFormat('q80').bytesPerValue;

const node = (weights: number, kvCache: number, buffers: number): NodeMemory => ({
  weights: Math.ceil(weights),
  kvCache: Math.ceil(kvCache),
  buffers: Math.ceil(buffers),
  total: Math.ceil(weights) + Math.ceil(kvCache) + Math.ceil(buffers),
});

/** Memory per node for distributed-llama on `nodes` nodes (root, and any worker). */
export function dllamaNodeMemory(spec: ModelSpec, weights: WeightsFormat, seqLen: number, nodes: number): { root: NodeMemory; worker: NodeMemory | null } {
  const N = nodes;
  const B = DLLAMA_BATCHES;
  const dim = spec.hidden;
  const ff = spec.intermediate;
  const qDim = spec.heads * spec.headDim;
  const kvDim = spec.kvHeads * spec.headDim;

  // Which tensors are sliced is decided by the plan the converter writes (the same list).
  const plan = planTensors(spec, 'dllama', weights, () => true);
  let sliced = 0;
  let embedding = 0;
  let norms = 0;
  for (const t of plan) {
    if (t.source === 'model.embed_tokens.weight' && t.name === 'model.embed_tokens.weight') embedding += t.byteLength;
    else if (t.shape.length === 1) norms += t.byteLength;
    else sliced += t.byteLength;
  }

  const kvCache = spec.layers * 2 * seqLen * (kvDim / N) * F32;

  // The sync type: q80 buffers are copies beside the F32 ones; f32 "copies" are those buffers.
  const f32Sync = weightsFormat(weights).dllamaBuffer === 'f32';
  const sync = f32Sync ? F32 : Q80;
  const copy = f32Sync ? 0 : Q80;
  const pipes = 2 * B * F32 + B * dim * F32 + B * spec.vocab * F32 + B * dim * N * sync;
  const activations =
    2 * B * dim * F32 + // x, y
    B * dim * copy + // q_y
    B * qDim * F32 + // z
    B * (qDim / N) * sync + // q_z_slice
    B * (qDim / N) * F32 + // q
    2 * B * (kvDim / N) * F32 + // k_temp, v_temp
    B * (spec.heads / N) * seqLen * F32 + // att
    B * (spec.vocab / N) * F32 + // lg
    2 * B * (ff / N) * F32 + // d, l
    B * (ff / N) * copy + // q_d
    B * dim * (F32 + copy) + // moe_y, q_moe_y (allocated for dense models too)
    B * (ff / N) * (F32 + copy); // moe_d, q_moe_d
  const ropeCache = (nodeIndex: number): number => {
    if (spec.arch === 'qwen3') return seqLen * spec.headDim * F32; // falcon-style rope
    const sliceDim = (qDim / N) * (nodeIndex + 1) - (kvDim / N) * nodeIndex;
    return seqLen * sliceDim * F32;
  };

  const perNode = sliced / N + norms;
  const root = node(perNode + embedding, kvCache, pipes + activations + ropeCache(0));
  const worker = N > 1 ? node(perNode, kvCache, pipes + activations + ropeCache(N - 1)) : null;
  return { root, worker };
}

/** Memory of llama.cpp serving a GGUF of `fileBytes` on one node with context `ctx`. */
export function llamaCppMemory(spec: LlamaCppShape, fileBytes: number, ctx: number): NodeMemory {
  const kvDim = spec.kvHeads * spec.headDim;
  const kvCache = spec.layers * 2 * ctx * kvDim * 2;
  const ub = Math.min(LLAMA_CPP_UBATCH, ctx);
  const buffers = ub * ctx * spec.heads * F32 + 3 * ub * spec.intermediate * F32 + 4 * ub * spec.hidden * F32 + spec.vocab * F32;
  return node(fileBytes, kvCache, buffers);
}

/** The memory table of a GGUF artifact: llama.cpp on one node. */
export function planLlamaCppMemory(shape: LlamaCppShape, weights: ArtifactWeights, contextLength: number | undefined, artifactBytes: number): MemoryPlan {
  const ctx = Math.min(contextLength ?? shape.ctx, shape.ctx);
  return { format: 'gguf', weights, contextLength: ctx, topologies: [{ nodes: 1, root: llamaCppMemory(shape, artifactBytes, ctx), worker: null }] };
}

/**
 * The memory table of one artifact.
 * @param contextLength the context to size for; capped at the model's own maximum
 * @param artifactBytes the GGUF file's size (llama.cpp maps it whole)
 */
export function planMemory(
  spec: ModelSpec,
  format: ArtifactFormat,
  weights: WeightsFormat,
  contextLength: number | undefined,
  artifactBytes: number,
): MemoryPlan {
  if (format === 'gguf') return planLlamaCppMemory(spec, weights, contextLength, artifactBytes);
  const ctx = Math.min(contextLength ?? spec.ctx, spec.ctx);
  const topologies: MemoryPlan['topologies'] = [];
  const refused: NonNullable<MemoryPlan['refused']> = [];
  for (const nodes of DLLAMA_NODE_COUNTS) {
    const reason = dllamaSplitProblem(spec, weights, nodes);
    if (reason === null) topologies.push({ nodes, ...dllamaNodeMemory(spec, weights, ctx, nodes) });
    else refused.push({ nodes, reason });
  }
  return { format, weights, contextLength: ctx, topologies, refused };
}

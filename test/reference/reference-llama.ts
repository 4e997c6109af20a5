/**
 * An independent reference forward pass of Llama / Qwen3 computed straight from the ORIGINAL
 * Hugging Face checkpoint, in float64 over the float32-widened weights. It is the yardstick for
 * converted models: it shares nothing with the converter but the safetensors reader and the
 * config parser, so it cannot share a bug in the Q/K permutation, rope or norms.
 *
 * The math follows transformers' `modeling_llama.py` / `modeling_qwen3.py` line by line:
 * RMSNorm → Q/K/V (GQA) → [Qwen3: per-head RMSNorm of Q and K] → rotary embeddings on the halves
 * of each head (`rotate_half`: dimension i pairs with i + headDim/2), frequencies adjusted as
 * `_compute_llama3_parameters` when `rope_type` is `llama3` → causal softmax attention scaled by
 * 1/√headDim → o_proj → residual → RMSNorm → down(silu(gate) · up) → residual; final RMSNorm →
 * lm_head (or the tied embeddings).
 *
 * Tokens are processed one at a time with a K/V cache: exactly causal attention, without the
 * cubic cost of recomputing every prefix. Only tiny models fit: every weight is held in memory.
 */
import { readFile } from 'node:fs/promises';
import * as path from 'node:path';
import { parseModelSpec, type ModelSpec } from '../../convert/arch';
import { openModelDir, readTensorF32All } from '../../convert/safetensors';

interface LayerWeights {
  inputNorm: Float32Array;
  q: Float32Array;
  k: Float32Array;
  v: Float32Array;
  o: Float32Array;
  /** Qwen3 only: per-head RMSNorm weights of Q and K (headDim values). */
  qNorm: Float32Array | null;
  kNorm: Float32Array | null;
  postNorm: Float32Array;
  gate: Float32Array;
  up: Float32Array;
  down: Float32Array;
}

/** A loaded reference model: the spec, every weight (row-major, HF layout) and the rotary frequencies. */
export interface ReferenceModel {
  spec: ModelSpec;
  embed: Float32Array;
  layers: LayerWeights[];
  norm: Float32Array;
  /** `lm_head.weight`, or the embeddings when tied. */
  lmHead: Float32Array;
  /** Rotary inverse frequencies, `headDim / 2` values, llama3 scaling applied. */
  invFreq: Float64Array;
}

/** Loads a Hugging Face model directory (`config.json` + safetensors, F32/F16/BF16). */
export async function loadReference(dir: string): Promise<ReferenceModel> {
  const spec = parseModelSpec(JSON.parse(await readFile(path.join(dir, 'config.json'), 'utf8')));
  const weights = await openModelDir(dir);
  try {
    const read = (name: string): Promise<Float32Array> => readTensorF32All(weights.get(name));
    const layers: LayerWeights[] = [];
    for (let l = 0; l < spec.layers; l++) {
      const p = `model.layers.${l}`;
      const qwen3 = spec.arch === 'qwen3';
      layers.push({
        inputNorm: await read(`${p}.input_layernorm.weight`),
        q: await read(`${p}.self_attn.q_proj.weight`),
        k: await read(`${p}.self_attn.k_proj.weight`),
        v: await read(`${p}.self_attn.v_proj.weight`),
        o: await read(`${p}.self_attn.o_proj.weight`),
        qNorm: qwen3 ? await read(`${p}.self_attn.q_norm.weight`) : null,
        kNorm: qwen3 ? await read(`${p}.self_attn.k_norm.weight`) : null,
        postNorm: await read(`${p}.post_attention_layernorm.weight`),
        gate: await read(`${p}.mlp.gate_proj.weight`),
        up: await read(`${p}.mlp.up_proj.weight`),
        down: await read(`${p}.mlp.down_proj.weight`),
      });
    }
    const embed = await read('model.embed_tokens.weight');
    const untied = !spec.tieWordEmbeddings && weights.has('lm_head.weight');
    return { spec, embed, layers, norm: await read('model.norm.weight'), lmHead: untied ? await read('lm_head.weight') : embed, invFreq: ropeInvFreq(spec) };
  } finally {
    await weights.close();
  }
}

/** `inv_freq` of transformers' rope init, including `_compute_llama3_parameters` for `rope_type: llama3`. */
export function ropeInvFreq(spec: ModelSpec): Float64Array {
  const dim = spec.headDim;
  const inv = Float64Array.from({ length: dim / 2 }, (_, i) => 1 / Math.pow(spec.ropeTheta, (2 * i) / dim));
  const s = spec.ropeScaling;
  if (s === null) return inv;
  const lowFreqWavelen = s.originalMaxPositionEmbeddings / s.lowFreqFactor;
  const highFreqWavelen = s.originalMaxPositionEmbeddings / s.highFreqFactor;
  return inv.map((f) => {
    const wavelen = (2 * Math.PI) / f;
    if (wavelen < highFreqWavelen) return f; // high frequencies: unchanged
    if (wavelen > lowFreqWavelen) return f / s.factor; // low frequencies: scaled down
    const smooth = (s.originalMaxPositionEmbeddings / wavelen - s.lowFreqFactor) / (s.highFreqFactor - s.lowFreqFactor);
    return (1 - smooth) * (f / s.factor) + smooth * f;
  });
}

/** `W x` for a row-major `rows x cols` matrix, `cols = x.length`. */
function matVec(w: Float32Array, x: Float64Array, rows: number): Float64Array {
  const cols = x.length;
  if (w.length !== rows * cols) throw new RangeError(`matrix of ${w.length} values is not ${rows}x${cols}`);
  const y = new Float64Array(rows);
  for (let r = 0; r < rows; r++) {
    let sum = 0;
    for (let c = 0, at = r * cols; c < cols; c++, at++) sum += w[at]! * x[c]!;
    y[r] = sum;
  }
  return y;
}

/** RMSNorm of `x[offset, offset + weight.length)`, in place. */
function rmsNorm(x: Float64Array, weight: Float32Array, eps: number, offset = 0): void {
  const n = weight.length;
  let ss = 0;
  for (let i = 0; i < n; i++) ss += x[offset + i]! ** 2;
  const scale = 1 / Math.sqrt(ss / n + eps);
  for (let i = 0; i < n; i++) x[offset + i] = weight[i]! * (x[offset + i]! * scale);
}

/** HF rotary embedding of every head of `x` at `pos`: (x1, x2) → (x1 cos − x2 sin, x2 cos + x1 sin) on the halves. */
function rope(x: Float64Array, heads: number, headDim: number, invFreq: Float64Array, pos: number): void {
  const half = headDim / 2;
  for (let h = 0; h < heads; h++) {
    for (let i = 0; i < half; i++) {
      const a = h * headDim + i;
      const b = a + half;
      const cos = Math.cos(pos * invFreq[i]!);
      const sin = Math.sin(pos * invFreq[i]!);
      const [x1, x2] = [x[a]!, x[b]!];
      x[a] = x1 * cos - x2 * sin;
      x[b] = x2 * cos + x1 * sin;
    }
  }
}

const silu = (v: number): number => v / (1 + Math.exp(-v));

/** Per-sequence state: the K and V (after rope) of every processed position, per layer. */
interface Sequence {
  keys: Float64Array[][];
  values: Float64Array[][];
}

/**
 * Runs one token at position `keys.length` through the model and appends its K/V.
 * @returns the next-token logits when `wantLogits`, else null (skips the lm_head)
 */
function step(m: ReferenceModel, seq: Sequence, token: number, wantLogits: boolean): Float64Array | null {
  const { hidden, heads, kvHeads, headDim, intermediate, vocab, rmsNormEps: eps } = m.spec;
  if (!Number.isInteger(token) || token < 0 || token >= vocab) throw new RangeError(`token ${token} is outside the vocabulary (${vocab})`);
  const pos = seq.keys[0]?.length ?? 0;
  const x = Float64Array.from(m.embed.subarray(token * hidden, (token + 1) * hidden));
  const group = heads / kvHeads;
  const scale = 1 / Math.sqrt(headDim);
  m.layers.forEach((w, l) => {
    const h = x.slice();
    rmsNorm(h, w.inputNorm, eps);
    const q = matVec(w.q, h, heads * headDim);
    const k = matVec(w.k, h, kvHeads * headDim);
    const v = matVec(w.v, h, kvHeads * headDim);
    if (w.qNorm && w.kNorm) {
      for (let i = 0; i < heads; i++) rmsNorm(q, w.qNorm, eps, i * headDim);
      for (let i = 0; i < kvHeads; i++) rmsNorm(k, w.kNorm, eps, i * headDim);
    }
    rope(q, heads, headDim, m.invFreq, pos);
    rope(k, kvHeads, headDim, m.invFreq, pos);
    const keys = (seq.keys[l] ??= []);
    const values = (seq.values[l] ??= []);
    keys.push(k);
    values.push(v);

    const attn = new Float64Array(heads * headDim);
    const scores = new Float64Array(keys.length);
    for (let hd = 0; hd < heads; hd++) {
      const qo = hd * headDim;
      const ko = Math.floor(hd / group) * headDim; // GQA: query head hd reads kv head hd / group
      let max = -Infinity;
      for (let t = 0; t < keys.length; t++) {
        let dot = 0;
        for (let i = 0; i < headDim; i++) dot += q[qo + i]! * keys[t]![ko + i]!;
        scores[t] = dot * scale;
        max = Math.max(max, scores[t]!);
      }
      let total = 0;
      for (let t = 0; t < keys.length; t++) {
        scores[t] = Math.exp(scores[t]! - max);
        total += scores[t]!;
      }
      for (let i = 0; i < headDim; i++) {
        let sum = 0;
        for (let t = 0; t < keys.length; t++) sum += scores[t]! * values[t]![ko + i]!;
        attn[qo + i] = sum / total;
      }
    }
    const o = matVec(w.o, attn, hidden);
    for (let i = 0; i < hidden; i++) x[i] = x[i]! + o[i]!;

    const h2 = x.slice();
    rmsNorm(h2, w.postNorm, eps);
    const gate = matVec(w.gate, h2, intermediate);
    const up = matVec(w.up, h2, intermediate);
    for (let i = 0; i < intermediate; i++) gate[i] = silu(gate[i]!) * up[i]!;
    const down = matVec(w.down, gate, hidden);
    for (let i = 0; i < hidden; i++) x[i] = x[i]! + down[i]!;
  });
  if (!wantLogits) return null;
  rmsNorm(x, m.norm, eps);
  return matVec(m.lmHead, x, vocab);
}

function newSequence(): Sequence {
  return { keys: [], values: [] };
}

/** Next-token logits after `tokenIds` (the last position), in float64. */
export function logits(m: ReferenceModel, tokenIds: readonly number[]): Float64Array {
  if (tokenIds.length === 0) throw new RangeError('logits of an empty sequence');
  return prefill(m, newSequence(), tokenIds);
}

/** Feeds `tokenIds` into `seq`; returns the logits after the last one. */
function prefill(m: ReferenceModel, seq: Sequence, tokenIds: readonly number[]): Float64Array {
  const last = tokenIds.length - 1;
  for (let i = 0; i < last; i++) step(m, seq, tokenIds[i]!, false);
  return step(m, seq, tokenIds[last]!, true)!;
}

/** Index of the largest value (the first one on ties, like torch.argmax and llama.cpp's greedy sampler) and its lead over the runner-up. */
export function argmax(values: ArrayLike<number>): { index: number; margin: number } {
  let index = 0;
  let second = -Infinity;
  for (let i = 1; i < values.length; i++) {
    if (values[i]! > values[index]!) {
      second = values[index]!;
      index = i;
    } else if (values[i]! > second) {
      second = values[i]!;
    }
  }
  return { index, margin: values[index]! - second };
}

/** What {@link generate} produced. */
export interface Generation {
  tokens: number[];
  /** Per generated token: top-1 minus top-2 logit. Small margins make greedy decoding fragile across implementations. */
  margins: number[];
}

/**
 * Greedy (argmax) continuation of `promptTokenIds` by `nTokens` tokens. No BOS is added and
 * generation does not stop at EOS: exactly `nTokens` tokens come back.
 */
export function generate(m: ReferenceModel, promptTokenIds: readonly number[], nTokens: number): Generation {
  if (promptTokenIds.length === 0) throw new RangeError('greedy decoding needs at least one prompt token');
  const seq = newSequence();
  const out: Generation = { tokens: [], margins: [] };
  let next = prefill(m, seq, promptTokenIds);
  for (let n = 0; n < nTokens; n++) {
    const { index, margin } = argmax(next);
    out.tokens.push(index);
    out.margins.push(margin);
    if (n + 1 < nTokens) next = step(m, seq, index, true)!;
  }
  return out;
}

/** The greedy tokens of {@link generate}. */
export function greedy(m: ReferenceModel, promptTokenIds: readonly number[], nTokens: number): number[] {
  return generate(m, promptTokenIds, nTokens).tokens;
}

import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { llama3RopeFactors } from '../../convert/arch';
import { tinyTensorData, writeTinyModel, type TinyModel, type TinyModelOptions } from '../../workers/dev/tiny-model';
import { LLAMA_CPP_ERROR, runLlamaCpp } from './llama-cpp';
import { argmax, generate, greedy, loadReference, logits, ropeInvFreq } from './reference-llama';

let root: string;
beforeAll(async () => {
  root = await mkdtemp(path.join(tmpdir(), 'magus-reference-'));
});
afterAll(async () => {
  await rm(root, { recursive: true, force: true });
});

let n = 0;
const tiny = (opts: TinyModelOptions): Promise<TinyModel> => writeTinyModel(path.join(root, String(n++)), { dtype: 'F32', ...opts });

/**
 * Logits of a one-token prompt, written out by hand from the generator's own values (not from
 * the file): at a single position the softmax weight is 1, so attention returns V (each query
 * head reading its KV group) and rope, Q and K drop out.
 */
function singleTokenLogits(model: TinyModel, token: number): Float64Array {
  const { seed, hidden, heads, kvHeads, headDim, intermediate, vocab, layers } = model.layout;
  const eps = model.config.rms_norm_eps as number;
  const w = (name: string): Float32Array => {
    const t = model.tensors.find((x) => x.name === name);
    if (!t) throw new Error(`no tensor ${name}`);
    return tinyTensorData(seed, t);
  };
  const mul = (m: Float32Array, x: number[]): number[] => {
    const cols = x.length;
    return Array.from({ length: m.length / cols }, (_, r) => x.reduce((s, v, c) => s + m[r * cols + c]! * v, 0));
  };
  const norm = (x: number[], g: Float32Array): number[] => {
    const rms = Math.sqrt(x.reduce((s, v) => s + v * v, 0) / x.length + eps);
    return x.map((v, i) => (v / rms) * g[i]!);
  };
  const embed = w('model.embed_tokens.weight');
  let x = Array.from(embed.subarray(token * hidden, (token + 1) * hidden));
  for (let l = 0; l < layers; l++) {
    const p = `model.layers.${l}`;
    const v = mul(w(`${p}.self_attn.v_proj.weight`), norm(x, w(`${p}.input_layernorm.weight`)));
    const attn: number[] = [];
    for (let h = 0; h < heads; h++) {
      const g = Math.floor(h / (heads / kvHeads));
      attn.push(...v.slice(g * headDim, (g + 1) * headDim));
    }
    const o = mul(w(`${p}.self_attn.o_proj.weight`), attn);
    x = x.map((xi, i) => xi + o[i]!);
    const h2 = norm(x, w(`${p}.post_attention_layernorm.weight`));
    const gate = mul(w(`${p}.mlp.gate_proj.weight`), h2);
    const up = mul(w(`${p}.mlp.up_proj.weight`), h2);
    expect(gate).toHaveLength(intermediate);
    const down = mul(
      w(`${p}.mlp.down_proj.weight`),
      gate.map((g, i) => (g / (1 + Math.exp(-g))) * up[i]!),
    );
    x = x.map((xi, i) => xi + down[i]!);
  }
  const head = model.layout.tied ? embed : w('lm_head.weight');
  const out = Float64Array.from(mul(head, norm(x, w('model.norm.weight'))));
  expect(out).toHaveLength(vocab);
  return out;
}

function expectClose(actual: ArrayLike<number>, expected: ArrayLike<number>, tolerance: number): void {
  expect(actual.length).toBe(expected.length);
  let worst = 0;
  for (let i = 0; i < actual.length; i++) worst = Math.max(worst, Math.abs(actual[i]! - expected[i]!));
  expect(worst).toBeLessThan(tolerance);
}

describe('reference forward pass', () => {
  test.each<[string, TinyModelOptions]>([
    ['llama, GQA', { seed: 3 }],
    ['llama, tied, llama3 rope', { seed: 4, tied: true, ropeScaling: true }],
    ['qwen3', { seed: 5, arch: 'qwen3' }],
  ])('a one-token prompt matches the hand-written single-position forward pass (%s)', async (_name, opts) => {
    const model = await tiny(opts);
    const ref = await loadReference(model.dir);
    for (const token of [0, 7, model.layout.vocab - 1]) expectClose(logits(ref, [token]), singleTokenLogits(model, token), 1e-9);
  });

  test('is deterministic, and greedy decoding is the argmax of fresh forward passes', async () => {
    const model = await tiny({ seed: 11, ropeScaling: true });
    const [a, b] = [await loadReference(model.dir), await loadReference(model.dir)];
    const prompt = [model.specialIds['<|begin_of_text|>']!, 40, 41, 300, 12, 99, 5, 250];
    expect(Array.from(logits(a, prompt))).toEqual(Array.from(logits(b, prompt)));
    const out = generate(a, prompt, 12);
    expect(greedy(b, prompt, 12)).toEqual(out.tokens);
    expect(out.tokens.every((t) => Number.isInteger(t) && t >= 0 && t < model.layout.vocab)).toBe(true);
    // The K/V-cached continuation agrees with recomputing every prefix from scratch.
    out.tokens.forEach((t, i) => {
      const fresh = argmax(logits(a, [...prompt, ...out.tokens.slice(0, i)]));
      expect(fresh.index).toBe(t);
      expect(fresh.margin).toBeCloseTo(out.margins[i]!, 9);
    });
  });

  test('position matters: rope makes the logits depend on token order', async () => {
    const ref = await loadReference((await tiny({ seed: 12 })).dir);
    const ab = logits(ref, [10, 20, 30]);
    const ba = logits(ref, [20, 10, 30]);
    expect(Math.max(...ab.map((v, i) => Math.abs(v - ba[i]!)))).toBeGreaterThan(1e-6);
  });

  test('llama3 rope frequencies agree with the converter’s rope_freqs factors', async () => {
    const ref = await loadReference((await tiny({ seed: 13, ropeScaling: true })).dir);
    const base = ropeInvFreq({ ...ref.spec, ropeScaling: null });
    const factors = llama3RopeFactors(ref.spec);
    // Each regime occurs: unchanged (1), divided by `factor` (8) and smoothed in between.
    expect(factors[0]).toBe(1);
    expect(factors[factors.length - 1]).toBe(8);
    expect(Array.from(factors).some((f) => f > 1 && f < 8)).toBe(true);
    expectClose(
      Array.from(base, (f, i) => f / ref.invFreq[i]!),
      factors,
      1e-5,
    );
  });

  test('rejects tokens outside the vocabulary', async () => {
    const ref = await loadReference((await tiny({ seed: 14 })).dir);
    expect(() => logits(ref, [ref.spec.vocab])).toThrow(RangeError);
    expect(() => greedy(ref, [], 3)).toThrow(RangeError);
  });
});

describe('runLlamaCpp', () => {
  test('reports a runner failure with its message', async () => {
    const missing = path.join(root, 'missing.gguf');
    await expect(runLlamaCpp({ model: missing, promptTokens: [1], nTokens: 1 })).rejects.toMatchObject({
      name: LLAMA_CPP_ERROR,
      message: expect.stringContaining(missing) as unknown,
    });
  });
});

import { encodedSize } from './quant';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { type ModelSpec, checkSourceShape, llama3RopeFactors, parseModelSpec, permuteQK, permutedSourceRow, planTensors, unknownConfigKeys } from './arch';

const testdata = join(__dirname, 'testdata');
const tinyLlama = (): Record<string, unknown> => JSON.parse(readFileSync(join(testdata, 'tiny-llama', 'config.json'), 'utf8')) as Record<string, unknown>;
const tinyQwen3 = (): Record<string, unknown> => JSON.parse(readFileSync(join(testdata, 'tiny-qwen3', 'config.json'), 'utf8')) as Record<string, unknown>;

function failure(fn: () => unknown): { name: string; code: string; message: string } {
  try {
    fn();
  } catch (err) {
    return err as { name: string; code: string; message: string };
  }
  throw new Error('expected a failure');
}

describe('parseModelSpec', () => {
  it('reads a Llama 3 config', () => {
    expect(parseModelSpec(tinyLlama())).toEqual<ModelSpec>({
      arch: 'llama',
      hidden: 64,
      intermediate: 128,
      layers: 2,
      heads: 4,
      kvHeads: 2,
      headDim: 16,
      vocab: 32,
      ctx: 131072,
      rmsNormEps: 1e-5,
      ropeTheta: 500000,
      ropeScaling: { type: 'llama3', factor: 32, lowFreqFactor: 1, highFreqFactor: 4, originalMaxPositionEmbeddings: 8192 },
      tieWordEmbeddings: true,
      bosTokenId: 17,
      eosTokenIds: [18, 19],
      hiddenAct: 'silu',
      explicit: { headDim: true, ropeTheta: true },
    });
  });

  it('reads a Qwen3 config', () => {
    expect(parseModelSpec(tinyQwen3())).toMatchObject({
      arch: 'qwen3',
      hidden: 64,
      intermediate: 96,
      heads: 4,
      kvHeads: 2,
      headDim: 32,
      vocab: 40,
      ctx: 40960,
      rmsNormEps: 1e-6,
      ropeTheta: 1000000,
      ropeScaling: null,
      tieWordEmbeddings: true,
      eosTokenIds: [19],
    });
  });

  it('applies the transformers defaults for optional keys', () => {
    const llama = tinyLlama();
    for (const k of [
      'num_key_value_heads',
      'head_dim',
      'rope_theta',
      'rope_scaling',
      'rms_norm_eps',
      'hidden_act',
      'tie_word_embeddings',
      'bos_token_id',
      'eos_token_id',
    ])
      delete llama[k];
    expect(parseModelSpec(llama)).toMatchObject({
      kvHeads: 4,
      headDim: 16,
      ropeTheta: 10000,
      ropeScaling: null,
      rmsNormEps: 1e-6,
      tieWordEmbeddings: false,
      bosTokenId: null,
      eosTokenIds: [],
      explicit: { headDim: false, ropeTheta: false },
    });
    const qwen = tinyQwen3();
    delete qwen.head_dim;
    expect(parseModelSpec(qwen)).toMatchObject({ headDim: 128, explicit: { headDim: false } }); // Qwen3Config's default
  });

  it('reads transformers 5 rope_parameters', () => {
    const c = tinyLlama();
    c.rope_parameters = { ...(c.rope_scaling as object), rope_theta: 500000 };
    delete c.rope_scaling;
    delete c.rope_theta;
    expect(parseModelSpec(c)).toMatchObject({ ropeTheta: 500000, ropeScaling: { factor: 32 }, explicit: { ropeTheta: true } });
    const d = tinyLlama();
    d.rope_scaling = { rope_type: 'default' };
    expect(parseModelSpec(d).ropeScaling).toBeNull();
  });

  it('rejects other architectures by name', () => {
    expect(failure(() => parseModelSpec({ ...tinyLlama(), model_type: 'mistral' }))).toMatchObject({
      name: 'ConvertError',
      code: 'UnsupportedArchitecture',
      message: expect.stringContaining('"mistral"') as unknown,
    });
    expect(failure(() => parseModelSpec([]))).toMatchObject({ code: 'UnsupportedConfig' });
  });

  const rejections: [string, (c: Record<string, unknown>) => void, string][] = [
    ['attention_bias', (c) => (c.attention_bias = true), 'attention_bias=true'],
    ['mlp_bias', (c) => (c.mlp_bias = true), 'mlp_bias=true'],
    ['hidden_act', (c) => (c.hidden_act = 'gelu'), 'hidden_act="gelu"'],
    ['partial_rotary_factor', (c) => (c.partial_rotary_factor = 0.5), 'partial_rotary_factor=0.5'],
    ['sliding_window on llama', (c) => (c.sliding_window = 4096), 'sliding_window=4096'],
    ['layer_types', (c) => (c.layer_types = ['full_attention', 'sliding_attention']), 'layer_types=["full_attention","sliding_attention"]'],
    ['quantization_config', (c) => (c.quantization_config = { quant_method: 'gptq' }), 'quantization_config={"quant_method":"gptq"}'],
    ['num_local_experts', (c) => (c.num_local_experts = 8), 'num_local_experts=8'],
    ['num_experts', (c) => (c.num_experts = 8), 'num_experts=8'],
    ['rope yarn', (c) => (c.rope_scaling = { rope_type: 'yarn', factor: 4, original_max_position_embeddings: 32768 }), 'rope_scaling.rope_type="yarn"'],
    ['rope linear (old "type" key)', (c) => (c.rope_scaling = { type: 'linear', factor: 2 }), 'rope_scaling.rope_type="linear"'],
    ['rope dynamic', (c) => (c.rope_scaling = { rope_type: 'dynamic', factor: 2 }), 'rope_scaling.rope_type="dynamic"'],
    [
      'llama3 rope without factor',
      (c) => (c.rope_scaling = { rope_type: 'llama3', low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192 }),
      'rope_scaling.factor=undefined',
    ],
    ['logit softcapping', (c) => (c.final_logit_softcapping = 30), 'final_logit_softcapping=30'],
    ['non-causal', (c) => (c.is_causal = false), 'is_causal=false'],
    ['multimodal wrapper', (c) => (c.text_config = {}), 'text_config={}'],
    ['missing hidden_size', (c) => delete c.hidden_size, 'missing hidden_size'],
    ['kv heads not dividing heads', (c) => (c.num_key_value_heads = 3), 'num_key_value_heads=3'],
    ['odd head_dim', (c) => (c.head_dim = 15), 'head_dim=15'],
    ['non-integer layers', (c) => (c.num_hidden_layers = 2.5), 'num_hidden_layers=2.5'],
  ];
  it.each(rejections)('rejects %s', (_, mutate, expected) => {
    const c = tinyLlama();
    mutate(c);
    expect(failure(() => parseModelSpec(c))).toMatchObject({
      name: 'ConvertError',
      code: 'UnsupportedConfig',
      message: expect.stringContaining(expected) as unknown,
    });
  });

  it('rejects Qwen sliding windows and llama3 rope on qwen3, accepts disabled windows', () => {
    const q = tinyQwen3();
    q.sliding_window = 4096; // with use_sliding_window: false, as Qwen3 ships it
    expect(parseModelSpec(q).arch).toBe('qwen3');
    q.use_sliding_window = true;
    expect(failure(() => parseModelSpec(q))).toMatchObject({ code: 'UnsupportedConfig', message: expect.stringContaining('sliding_window=4096') as unknown });
    delete q.sliding_window;
    expect(failure(() => parseModelSpec(q))).toMatchObject({
      code: 'UnsupportedConfig',
      message: expect.stringContaining('use_sliding_window=true') as unknown,
    });
    const r = tinyQwen3();
    r.rope_scaling = tinyLlama().rope_scaling;
    expect(failure(() => parseModelSpec(r))).toMatchObject({
      code: 'UnsupportedConfig',
      message: expect.stringContaining('only supported for llama') as unknown,
    });
    const s = tinyQwen3();
    s.layer_types = ['full_attention', 'full_attention'];
    expect(parseModelSpec(s).arch).toBe('qwen3');
  });

  it('lists unknown keys but ignores them', () => {
    const c = { ...tinyLlama(), some_new_flag: true, auto_map: {} };
    expect(parseModelSpec(c).arch).toBe('llama');
    expect(unknownConfigKeys(c)).toEqual(['some_new_flag', 'auto_map']);
    expect(unknownConfigKeys(tinyQwen3())).toEqual([]);
  });
});

/** numpy's `w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)`, spelled out. */
function numpyPermute(w: Float32Array, rows: number, cols: number, heads: number): Float32Array {
  const half = rows / heads / 2;
  const out = new Float32Array(w.length);
  // out[h, i, j, c] (shape heads x half x 2 x cols) = in[h, j, i, c] (shape heads x 2 x half x cols)
  for (let h = 0; h < heads; h++)
    for (let i = 0; i < half; i++)
      for (let j = 0; j < 2; j++) for (let c = 0; c < cols; c++) out[((h * half + i) * 2 + j) * cols + c] = w[((h * 2 + j) * half + i) * cols + c] as number;
  return out;
}

describe('permuteQK', () => {
  it('interleaves the rotary halves of each head (by hand)', () => {
    // one head of 4 rows [a b | c d] -> pairs (a c) (b d)
    expect(Array.from(permuteQK(Float32Array.of(0, 1, 2, 3), 4, 1, 1))).toEqual([0, 2, 1, 3]);
    // two heads, two columns
    const w = Float32Array.from({ length: 16 }, (_, i) => i);
    expect(Array.from(permuteQK(w, 8, 2, 2))).toEqual([0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]);
  });

  it('matches the numpy reshape/swapaxes of both reference converters', () => {
    for (const [rows, cols, heads] of [
      [64, 16, 4],
      [32, 16, 2],
      [48, 8, 3],
      [256, 3, 8],
    ] as const) {
      const w = Float32Array.from({ length: rows * cols }, (_, i) => Math.sin(i) * 100);
      const ours = permuteQK(w, rows, cols, heads);
      expect(Buffer.from(ours.buffer).equals(Buffer.from(numpyPermute(w, rows, cols, heads).buffer))).toBe(true);
      for (let r = 0; r < rows; r++) expect(ours[r * cols]).toBe(w[permutedSourceRow(r, rows, heads) * cols]);
    }
  });

  it('rejects shapes that cannot be split into heads of pairs', () => {
    expect(() => permuteQK(new Float32Array(12), 6, 2, 2)).toThrow(RangeError);
    expect(() => permuteQK(new Float32Array(10), 4, 2, 1)).toThrow(RangeError);
  });
});

describe('llama3RopeFactors', () => {
  it('matches convert_hf_to_gguf.py (float32, computed with numpy)', () => {
    const tiny = parseModelSpec(tinyLlama());
    const expected = [1.0, 1.0, 1.0, 1.0, 3.2922627925872803, 32.0, 32.0, 32.0];
    Array.from(llama3RopeFactors(tiny)).forEach((v, i) => expect(v).toBeCloseTo(expected[i] as number, 5));
    // Llama 3.1 8B: head_dim 128, factor 8
    const big = { ...tiny, headDim: 128, ropeScaling: { ...(tiny.ropeScaling as NonNullable<ModelSpec['ropeScaling']>), factor: 8 } };
    const f = llama3RopeFactors(big);
    expect(f).toHaveLength(64);
    expect(f[28]).toBe(1);
    expect(Array.from(f.subarray(29, 35)).map((v) => Number(v.toFixed(5)))).toEqual([1.20748, 1.55341, 2.02631, 2.69453, 3.68425, 5.25733]);
    expect(f[35]).toBe(8);
    expect(f[63]).toBe(8);
  });
});

describe('planTensors', () => {
  const llama = (): ModelSpec => parseModelSpec(tinyLlama());
  const all = (): boolean => true;
  const noHead = (n: string): boolean => n !== 'lm_head.weight';

  it('plans distributed-llama tensors in convert-hf.py order with its float types', () => {
    const plan = planTensors(llama(), 'dllama', 'q40', noHead);
    const layer0 = [
      'self_attn.q_proj',
      'self_attn.k_proj',
      'self_attn.v_proj',
      'self_attn.o_proj',
      'mlp.gate_proj',
      'mlp.down_proj',
      'mlp.up_proj',
      'input_layernorm',
      'post_attention_layernorm',
    ].map((n) => `model.layers.0.${n}.weight`);
    expect(plan.map((t) => t.name)).toEqual([
      'model.embed_tokens.weight',
      ...layer0,
      ...layer0.map((n) => n.replace('layers.0', 'layers.1')),
      'model.norm.weight',
      'lm_head.weight',
    ]);
    const layerFormats = ['q40', 'q40', 'q40', 'q40', 'q40', 'q40', 'q40', 'f32', 'f32'];
    expect(plan.map((t) => t.format)).toEqual(['f32', ...layerFormats, ...layerFormats, 'f32', 'q40']);
    // tied: the classifier is read from the embedding
    expect(plan.at(-1)).toMatchObject({ name: 'lm_head.weight', source: 'model.embed_tokens.weight', shape: [32, 64], byteLength: 32 * 2 * 18 });
    expect(plan[1]).toMatchObject({ source: 'model.layers.0.self_attn.q_proj.weight', shape: [64, 64], permute: { heads: 4 } });
    expect(plan[2]).toMatchObject({ shape: [32, 64], permute: { heads: 2 } });
    expect(plan[3]?.permute).toBeNull();
    expect(plan[0]).toMatchObject({ format: 'f32', byteLength: 32 * 64 * 4 });
    // with an lm_head, it is used even when tie_word_embeddings says otherwise (as convert-hf.py does)
    expect(planTensors(llama(), 'dllama', 'f16', all).at(-1)?.source).toBe('lm_head.weight');
  });

  it('plans qwen3 with q/k norms and no permutation', () => {
    const spec = parseModelSpec(tinyQwen3());
    const plan = planTensors(spec, 'dllama', 'q80', noHead);
    expect(plan.slice(1, 12).map((t) => t.name.replace('model.layers.0.', ''))).toEqual([
      'self_attn.q_proj.weight',
      'self_attn.k_proj.weight',
      'self_attn.v_proj.weight',
      'self_attn.o_proj.weight',
      'mlp.gate_proj.weight',
      'mlp.down_proj.weight',
      'mlp.up_proj.weight',
      'self_attn.q_norm.weight',
      'self_attn.k_norm.weight',
      'input_layernorm.weight',
      'post_attention_layernorm.weight',
    ]);
    expect(plan.every((t) => t.permute === null)).toBe(true);
    expect(plan[1]).toMatchObject({ shape: [128, 64] }); // heads * head_dim = 4 * 32
    expect(plan[4]).toMatchObject({ shape: [64, 128] }); // o_proj
    expect(plan[8]).toMatchObject({ format: 'f32', shape: [32] });
    const gguf = planTensors(spec, 'gguf', 'q80', all);
    expect(gguf.find((t) => t.name === 'blk.0.attn_q.weight')).toMatchObject({ shape: [64, 128], permute: null });
    expect(gguf.find((t) => t.name === 'output.weight')).toBeUndefined(); // tied
  });

  it('plans GGUF tensors: llama names, reversed dims, rope_freqs, output only when untied', () => {
    const spec = llama();
    const plan = planTensors(spec, 'gguf', 'f16', noHead);
    expect(plan[0]).toMatchObject({ name: 'rope_freqs.weight', source: null, shape: [8], format: 'f32', byteLength: 32 });
    expect(Array.from(plan[0]?.generated ?? [])).toEqual(Array.from(llama3RopeFactors(spec)));
    expect(plan[1]).toMatchObject({ name: 'token_embd.weight', source: 'model.embed_tokens.weight', sourceShape: [32, 64], shape: [64, 32], format: 'f16' });
    expect(plan.find((t) => t.name === 'blk.0.attn_k.weight')).toMatchObject({ sourceShape: [32, 64], shape: [64, 32], permute: { heads: 2 } });
    expect(plan.find((t) => t.name === 'blk.0.ffn_down.weight')).toMatchObject({ source: 'model.layers.0.mlp.down_proj.weight', shape: [128, 64] });
    expect(plan.at(-1)?.name).toBe('output_norm.weight');
    const untied = { ...spec, tieWordEmbeddings: false };
    expect(planTensors(untied, 'gguf', 'f16', all).at(-1)).toMatchObject({ name: 'output.weight', source: 'lm_head.weight', shape: [64, 32] });
    expect(planTensors(untied, 'gguf', 'f16', noHead).at(-1)?.name).toBe('output_norm.weight');
  });

  it('names missing tensors and rows that do not fit 32-value blocks', () => {
    expect(failure(() => planTensors(llama(), 'gguf', 'f16', (n) => n !== 'model.layers.1.mlp.up_proj.weight'))).toMatchObject({
      name: 'ConvertError',
      code: 'MissingTensor',
      message: expect.stringContaining('model.layers.1.mlp.up_proj.weight') as unknown,
    });
    const odd = { ...llama(), intermediate: 48 };
    expect(failure(() => planTensors(odd, 'dllama', 'q40', all))).toMatchObject({
      code: 'BadBlockSize',
      message: expect.stringContaining('mlp.down_proj') as unknown,
    });
    expect(planTensors(odd, 'dllama', 'f16', all)).toHaveLength(2 + 2 * 9 + 1);
  });

  it('computes encoded sizes and checks source shapes', () => {
    expect([encodedSize('f32', 64), encodedSize('f16', 64), encodedSize('q80', 64), encodedSize('q40', 64)]).toEqual([256, 128, 68, 36]);
    const t = planTensors(llama(), 'dllama', 'f32', all)[1];
    if (!t) throw new Error('no tensor');
    expect(() => checkSourceShape(t, [64, 64])).not.toThrow();
    expect(failure(() => checkSourceShape(t, [64, 32]))).toMatchObject({ code: 'ShapeMismatch' });
  });
});

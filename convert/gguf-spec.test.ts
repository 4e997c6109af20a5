/**
 * specFromGguf on GGUF files magus's own converter wrote from the tiny synthetic models: the
 * spec read back equals the one config.json gives (up to what a GGUF does not keep), and every
 * shape or key it cannot represent is refused with a typed error.
 */
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { writeTinyModel, type TinyModelOptions } from '../workers/dev/tiny-model';
import { parseModelSpec, type ModelSpec } from './arch';
import { convertModel } from './convert';
import type { GgufValue } from './gguf';
import { type GgufFile, readGguf } from './gguf-reader';
import { ggufRopeFreqs } from './gguf-dequant';
import { decimalOfFloat32, specFromGguf } from './gguf-spec';
import { bytesSource } from './safetensors';

let root: string;
beforeAll(() => {
  root = mkdtempSync(join(tmpdir(), 'magus-gguf-spec-'));
});
afterAll(() => rmSync(root, { recursive: true, force: true }));

/** The tiny model `name` written with `opts`, converted to an F32 GGUF: its header and its config's spec. */
async function tinyGguf(name: string, opts: TinyModelOptions): Promise<{ file: GgufFile; bytes: Uint8Array; config: ModelSpec }> {
  const dir = join(root, name);
  const model = await writeTinyModel(dir, { seed: 3, ...opts });
  const out = join(root, `${name}.gguf`);
  await convertModel({ source: dir, format: 'gguf', weights: 'f32', output: out, threads: 1 });
  const bytes = new Uint8Array(readFileSync(out));
  return { file: await readGguf(bytes), bytes, config: parseModelSpec(model.config) };
}

/** `file` with metadata keys set (or removed, given undefined) and tensors filtered or added. */
function edited(file: GgufFile, kvs: Record<string, GgufValue | undefined>, tensors?: (t: GgufFile['tensors']) => GgufFile['tensors']): GgufFile {
  const metadata = new Map(file.metadata);
  for (const [key, value] of Object.entries(kvs)) {
    if (value === undefined) metadata.delete(key);
    else metadata.set(key, value);
  }
  return { ...file, metadata, tensors: tensors ? tensors(file.tensors) : file.tensors };
}

function refusal(file: GgufFile, options?: { ropeFreqs: Float32Array }): { name: string; code: string; message: string } {
  try {
    specFromGguf(file, options);
  } catch (err) {
    return err as { name: string; code: string; message: string };
  }
  throw new Error('expected specFromGguf to refuse');
}

describe('specFromGguf', () => {
  let llama: { file: GgufFile; config: ModelSpec };
  let qwen3: { file: GgufFile; config: ModelSpec };
  beforeAll(async () => {
    llama = await tinyGguf('llama', { dtype: 'F32' });
    qwen3 = await tinyGguf('qwen3', { arch: 'qwen3', dtype: 'F32' });
  });

  it('reads back the spec config.json gave (llama, untied, head size implied)', () => {
    const spec = specFromGguf(llama.file);
    // A GGUF keeps one EOS id (the tokenizer's); config.json listed <|end_of_text|> too.
    const eot = llama.config.eosTokenIds[1] as number;
    expect(spec).toEqual({ ...llama.config, eosTokenIds: [eot], explicit: { headDim: false, ropeTheta: true } });
    expect(spec.rmsNormEps).toBe(1e-5);
    expect(spec.ropeTheta).toBe(500000);
    expect(spec.tieWordEmbeddings).toBe(false);
  });

  it('reads back qwen3 with tied embeddings and an explicit head size', () => {
    const spec = specFromGguf(qwen3.file);
    expect(spec).toEqual({ ...qwen3.config, explicit: { headDim: false, ropeTheta: true } });
    expect(spec.tieWordEmbeddings).toBe(true);
    expect(spec.headDim).toBe(32);
    expect(spec.rmsNormEps).toBe(1e-6);
  });

  it('refuses other architectures, naming them', () => {
    const err = refusal(edited(llama.file, { 'general.architecture': { type: 'string', value: 'gemma2' } }));
    expect(err).toMatchObject({ name: 'ConvertError', code: 'UnsupportedArchitecture' });
    expect(err.message).toContain("'gemma2'");
  });

  it('refuses keys that change the math, and missing or malformed hyper-parameters', () => {
    const cases: [Record<string, GgufValue | undefined>, string][] = [
      [{ 'llama.attention.sliding_window': { type: 'uint32', value: 4096 } }, 'llama.attention.sliding_window=4096'],
      [{ 'llama.expert_count': { type: 'uint32', value: 8 } }, 'llama.expert_count=8'],
      [{ 'llama.rope.scaling.type': { type: 'string', value: 'yarn' } }, 'llama.rope.scaling.type="yarn"'],
      [{ 'llama.rope.dimension_count': { type: 'uint32', value: 8 } }, 'partial rotary'],
      [{ 'llama.block_count': undefined }, 'llama.block_count is missing'],
      [{ 'llama.block_count': { type: 'float32', value: 2 } }, 'not a positive integer'],
      [{ 'llama.attention.head_count': { type: 'array', itemType: 'uint32', value: [4, 4] } }, 'per-layer'],
      [{ 'llama.attention.head_count_kv': { type: 'uint32', value: 3 } }, 'does not divide'],
      [{ 'llama.vocab_size': { type: 'uint32', value: 999 } }, "differs from token_embd.weight's 384 rows"],
      [{ 'tokenizer.ggml.bos_token_id': { type: 'string', value: '1' } }, 'not a token id'],
    ];
    for (const [kvs, text] of cases) {
      const err = refusal(edited(llama.file, kvs));
      expect(err).toMatchObject({ name: 'ConvertError', code: 'UnsupportedConfig' });
      expect(err.message).toContain(text);
    }
  });

  it('refuses a missing, misshapen or unexpected tensor, naming it', () => {
    const missing = refusal(edited(llama.file, {}, (ts) => ts.filter((t) => t.name !== 'blk.1.ffn_up.weight')));
    expect(missing).toMatchObject({ name: 'ConvertError', code: 'MissingTensor' });
    expect(missing.message).toContain('blk.1.ffn_up.weight');

    const misshapen = refusal(edited(llama.file, {}, (ts) => ts.map((t) => (t.name === 'blk.0.attn_k.weight' ? { ...t, dims: [64, 64] } : t))));
    expect(misshapen).toMatchObject({ name: 'ConvertError', code: 'ShapeMismatch' });
    expect(misshapen.message).toContain('blk.0.attn_k.weight has shape [64, 64], expected [64, 32]');

    const bias = llama.file.tensors.find((t) => t.name === 'blk.0.attn_norm.weight')!;
    const extra = refusal(edited(llama.file, {}, (ts) => [...ts, { ...bias, name: 'blk.0.attn_q.bias' }]));
    expect(extra).toMatchObject({ name: 'ConvertError', code: 'UnsupportedConfig' });
    expect(extra.message).toContain('blk.0.attn_q.bias');
  });

  it('recovers Llama 3 rope scaling from the rope_freqs factors, and refuses it without them or when they match no scaling', async () => {
    const scaled = await tinyGguf('llama-rope', { dtype: 'F32', ropeScaling: true });
    const ropeFreqs = await ggufRopeFreqs(bytesSource('llama-rope.gguf', scaled.bytes), scaled.file);
    expect(ropeFreqs).toHaveLength(8);
    const spec = specFromGguf(scaled.file, { ropeFreqs: ropeFreqs! });
    expect(spec.ropeScaling).toEqual({ type: 'llama3', factor: 8, lowFreqFactor: 1, highFreqFactor: 4, originalMaxPositionEmbeddings: 64 });
    expect(spec).toEqual({ ...scaled.config, eosTokenIds: [scaled.config.eosTokenIds[1]], explicit: { headDim: false, ropeTheta: true } });

    const without = refusal(scaled.file);
    expect(without).toMatchObject({ name: 'ConvertError', code: 'UnsupportedConfig' });
    expect(without.message).toContain('rope_freqs.weight');
    const tampered = Float32Array.from(ropeFreqs!, (f, i) => (i === 4 ? f * 1.01 : f));
    const unmatched = refusal(scaled.file, { ropeFreqs: tampered });
    expect(unmatched).toMatchObject({ name: 'ConvertError', code: 'UnsupportedConfig' });
    expect(unmatched.message).toContain('match no Llama 3 scaling');
  });

  it('refuses rope factors on qwen3', () => {
    const freqs = llama.file.tensors.find((t) => t.name === 'output_norm.weight')!;
    const err = refusal(
      edited(qwen3.file, {}, (ts) => [...ts, { ...freqs, name: 'rope_freqs.weight', dims: [16] }]),
      { ropeFreqs: new Float32Array(16).fill(1) },
    );
    expect(err).toMatchObject({ name: 'ConvertError', code: 'UnsupportedConfig' });
    expect(err.message).toContain('not supported for qwen3');
  });
});

describe('decimalOfFloat32', () => {
  it('recovers the decimal a float32 was rounded from', () => {
    expect(decimalOfFloat32(Math.fround(1e-5))).toBe(1e-5);
    expect(decimalOfFloat32(Math.fround(1e-6))).toBe(1e-6);
    expect(decimalOfFloat32(Math.fround(0.1))).toBe(0.1);
    expect(decimalOfFloat32(500000)).toBe(500000);
    expect(decimalOfFloat32(Math.fround(1 / 3))).toBe(0.33333334);
  });
});

/**
 * convertGgufToDllama against the direct path: the tiny synthetic models are converted to GGUF by
 * magus's own writer, that GGUF to distributed-llama, and the result compared with convertModel's
 * distributed-llama output of the same checkpoint. A GGUF that holds the source values exactly
 * (F32, or F16 from an F16 source) must give the same bytes; a quantized GGUF must give values
 * within the quantization error of the source. Only f32 and q40 are written (distributed-llama
 * runs no other weights). Refusals (K-quants, truncated or garbage files, what distributed-llama
 * cannot serve) are checked to leave no output behind.
 *
 * The layout (Q/K rows taken as the GGUF has them) was also checked once by hand with the real
 * distributed-llama (b4rtaz/distributed-llama 8d624a7) on SmolLM2-135M-Instruct.Q4_1.gguf: its f32
 * `.m`, given llama.cpp's tokens for a ChatML "What is the capital of France?", generates the
 * same 12 tokens as llama.cpp does on the GGUF ("The capital of France is Paris." and on). The
 * converter now refuses SmolLM2 (its GPT-2-style vocabulary: distributed-llama would split its
 * own prompts into single bytes, dllama.ts `checkDllamaTokenizer`).
 */
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { writeTinyModel, type TinyModelOptions } from '../workers/dev/tiny-model';
import { type ConvertProgress, convertModel, loadModelSpec, loadTokenizer } from './convert';
import { encodeDllamaTokenizer, planDllama } from './dllama';
import { dequantizeQ40, dequantizeQ41, dequantizeQ80 } from './gguf-dequant';
import { convertGgufToDllama } from './gguf-dllama';
import { readGguf } from './gguf-reader';
import { F16_TABLE, f32ToF16Bits } from './quant';
import { bytesSource, localCheckpoint } from './safetensors';
import type { WeightsFormat } from './types';

let root: string;
beforeAll(() => {
  root = mkdtempSync(join(tmpdir(), 'magus-gguf-dllama-'));
});
afterAll(() => rmSync(root, { recursive: true, force: true }));

let serial = 0;
const fresh = (name: string): string => join(root, `${name}-${++serial}`);

interface DllamaFiles {
  m: Buffer;
  t: Buffer;
}

function readDllama(dir: string): DllamaFiles {
  return { m: readFileSync(join(dir, 'model.m')), t: readFileSync(join(dir, 'tokenizer.t')) };
}

async function direct(model: string, weights: WeightsFormat): Promise<DllamaFiles> {
  const out = fresh('direct');
  await convertModel({ source: model, format: 'dllama', weights, output: out, threads: 2 });
  return readDllama(out);
}

async function gguf(model: string, weights: WeightsFormat): Promise<string> {
  const out = `${fresh('model')}.gguf`;
  await convertModel({ source: model, format: 'gguf', weights, output: out, threads: 2 });
  return out;
}

async function viaGguf(file: string, weights: WeightsFormat): Promise<DllamaFiles> {
  const out = fresh('via');
  await convertGgufToDllama({ gguf: file, weights, output: out, threads: 2 });
  return readDllama(out);
}

/** Every tensor of a `.m` file decoded to float32, in file order, as planned for `model`. */
async function decodeModel(model: string, weights: WeightsFormat, m: Buffer): Promise<{ name: string; values: Float32Array }[]> {
  const spec = await loadModelSpec(localCheckpoint(model));
  const plan = planDllama(spec, weights, (n) => n !== 'lm_head.weight' || !spec.tieWordEmbeddings);
  let at = m.readInt32LE(4);
  return plan.tensors.map((t) => {
    const bytes = new Uint8Array(m.subarray(at, at + t.byteLength));
    at += t.byteLength;
    const values = new Float32Array(t.sourceShape.reduce((a, b) => a * b, 1));
    if (t.format === 'f32') values.set(new Float32Array(bytes.slice().buffer));
    else if (t.format === 'f16') new Uint16Array(bytes.slice().buffer).forEach((h, i) => (values[i] = F16_TABLE[h]!));
    else if (t.format === 'q80') dequantizeQ80(bytes, values);
    else dequantizeQ40(bytes, values);
    return { name: t.name, values };
  });
}

/** The largest error of `actual` in each 32-value block, relative to the block's largest |expected|. */
function worstBlockError(expected: Float32Array, actual: Float32Array): number {
  let worst = 0;
  for (let b = 0; b < expected.length; b += 32) {
    let amax = 0;
    let err = 0;
    for (let j = b; j < b + 32 && j < expected.length; j++) {
      amax = Math.max(amax, Math.abs(expected[j]!));
      err = Math.max(err, Math.abs(expected[j]! - actual[j]!));
    }
    if (amax > 0) worst = Math.max(worst, err / amax);
  }
  return worst;
}

const headerOf = (m: Buffer): Buffer => m.subarray(0, m.readInt32LE(4));

/** Where tensor `name`'s ggml type id is in a GGUF's tensor infos: after its length-prefixed name, dim count and dims. */
function typeIdOffset(file: Buffer, name: string): number {
  const key = Buffer.alloc(8 + Buffer.byteLength(name));
  key.writeBigUInt64LE(BigInt(key.length - 8));
  key.write(name, 8);
  const at = file.indexOf(key) + key.length;
  return at + 4 + 8 * file.readUInt32LE(at);
}

describe('convertGgufToDllama: a GGUF holding the source values exactly', () => {
  const models: Record<string, TinyModelOptions> = {
    'llama (untied, Q/K permuted)': { dtype: 'F32' },
    'qwen3 (tied embeddings)': { arch: 'qwen3', dtype: 'F32' },
    'llama with Llama 3 rope scaling': { dtype: 'F32', ropeScaling: true },
  };
  const dirs: Record<string, string> = {};
  const ggufs: Record<string, string> = {};
  beforeAll(async () => {
    for (const [name, opts] of Object.entries(models)) {
      dirs[name] = fresh('tiny');
      await writeTinyModel(dirs[name], { seed: 11, ...opts });
      ggufs[name] = await gguf(dirs[name], 'f32');
    }
  });

  // Both weights formats distributed-llama runs for llama; qwen3 (no Q/K permutation, tied) too;
  // rope scaling (recovered from rope_freqs.weight) for the header.
  const formats: Record<string, readonly WeightsFormat[]> = {
    'llama (untied, Q/K permuted)': ['f32', 'q40'],
    'qwen3 (tied embeddings)': ['f32', 'q40'],
    'llama with Llama 3 rope scaling': ['q40'],
  };
  const cases = Object.entries(formats).flatMap(([name, ws]) => ws.map((w) => [name, w] as const));
  test.each(cases)('%s, F32 GGUF → %s: the same .m bytes as from the safetensors', async (name, weights) => {
    const expected = await direct(dirs[name]!, weights);
    const actual = await viaGguf(ggufs[name]!, weights);
    expect(actual.m.length).toBe(expected.m.length);
    expect(headerOf(actual.m).equals(headerOf(expected.m))).toBe(true);
    expect(actual.m.equals(expected.m)).toBe(true);
  });

  it('writes the tokenizer the safetensors path writes, with the EOS ids the GGUF keeps', async () => {
    for (const name of ['llama (untied, Q/K permuted)', 'qwen3 (tied embeddings)']) {
      const dir = dirs[name]!;
      const spec = await loadModelSpec(localCheckpoint(dir));
      const hf = await loadTokenizer(localCheckpoint(dir), spec);
      const actual = await viaGguf(ggufs[name]!, 'q40');
      // A GGUF stores one EOS (the tokenizer's), not config.json's list.
      const expected = encodeDllamaTokenizer({ ...hf, eosIds: [hf.eosId!] });
      expect(actual.t.equals(Buffer.from(expected))).toBe(true);
    }
    // Qwen3's config.json lists only the tokenizer's EOS: the whole file is the same.
    expect((await viaGguf(ggufs['qwen3 (tied embeddings)']!, 'f32')).t.equals((await direct(dirs['qwen3 (tied embeddings)']!, 'f32')).t)).toBe(true);
  });

  it('reads a byte source, writes to the outputs given, and reports progress to the end', async () => {
    const name = 'llama (untied, Q/K permuted)';
    const out = fresh('outputs');
    mkdirSync(out);
    const progress: ConvertProgress[] = [];
    const result = await convertGgufToDllama({
      gguf: bytesSource('memory.gguf', readFileSync(ggufs[name]!)),
      weights: 'q40',
      output: { model: join(out, 'x.m'), tokenizer: join(out, 'x.t') },
      threads: 1,
      chunkElements: 1000,
      onProgress: (p) => progress.push(p),
    });
    expect(readFileSync(join(out, 'x.m')).equals((await direct(dirs[name]!, 'q40')).m)).toBe(true);
    expect(readdirSync(out).sort()).toEqual(['x.m', 'x.t']);
    expect(result.files.map((f) => f.bytes)).toEqual([readFileSync(join(out, 'x.m')).length, readFileSync(join(out, 'x.t')).length]);
    const last = progress.at(-1)!;
    expect(last.tensorsDone).toBe(last.tensorsTotal);
    expect(last.tensorsTotal).toBe(result.tensors);
    expect(last.bytesDone).toBe(last.bytesTotal);
  });
});

describe('convertGgufToDllama: quantized and half-precision GGUFs', () => {
  let model: string;
  let reference: { name: string; values: Float32Array }[];
  beforeAll(async () => {
    model = fresh('tiny-f16');
    await writeTinyModel(model, { seed: 5, dtype: 'F16' });
    // F16 values are exact in f32: the direct f32 file holds the source values.
    reference = await decodeModel(model, 'f32', (await direct(model, 'f32')).m);
  });

  it('F16 GGUF → f32: the same bytes as from the F16 safetensors', async () => {
    const file = await gguf(model, 'f16');
    expect((await viaGguf(file, 'f32')).m.equals((await direct(model, 'f32')).m)).toBe(true);
  });

  // Bounds per 32-value block, relative to the block's largest |value|: Q8_0/q80 round to a step
  // of amax/127 (error ≤ half a step); Q4_0/q40 to a step of amax/8 (≤ one step where the block's
  // largest value is negative and +amax clamps to 7 steps); the fp16 scale adds up to 2^-11 of
  // amax. A second quantization adds its own.
  const scale = 2 ** -11;
  const cases: [WeightsFormat, WeightsFormat, number][] = [
    ['q80', 'f32', 0.5 / 127 + scale],
    ['q40', 'f32', 1 / 8 + scale],
    ['q40', 'q40', 1 / 8 + 2 * scale],
    ['q80', 'q40', 1 / 8 + 0.5 / 127 + 2 * scale],
  ];
  test.each(cases)("%s GGUF → %s: same header, every value within %f of its block's largest", async (ggufWeights, weights, bound) => {
    const actual = await viaGguf(await gguf(model, ggufWeights), weights);
    const expected = await direct(model, weights);
    expect(headerOf(actual.m).equals(headerOf(expected.m))).toBe(true);
    expect(actual.m.length).toBe(expected.m.length);
    const decoded = await decodeModel(model, weights, actual.m);
    let worst = 0;
    decoded.forEach((t, i) => {
      const ref = reference[i]!;
      expect(t.name).toBe(ref.name);
      const err = worstBlockError(ref.values, t.values);
      expect({ tensor: t.name, withinBound: err <= bound }).toEqual({ tensor: t.name, withinBound: true });
      worst = Math.max(worst, err);
    });
    // Not lossless by accident of a shortcut: the embedding went through the GGUF's quantization.
    expect(worst).toBeGreaterThan(0);
  });
});

describe('convertGgufToDllama: BF16 and Q4_1 tensors (types magus does not write: patched in)', () => {
  let model: string;
  beforeAll(async () => {
    model = fresh('tiny-types');
    await writeTinyModel(model, { seed: 13, dtype: 'F16' });
  });

  /** Tensor `name`'s data and the offset of its ggml type id, in a GGUF's bytes. */
  async function locate(file: Buffer, name: string): Promise<{ data: Buffer; typeAt: number }> {
    const entry = (await readGguf(new Uint8Array(file))).tensors.find((t) => t.name === name)!;
    const at = typeIdOffset(file, name);
    return { data: file.subarray(entry.absoluteOffset, entry.absoluteOffset + entry.byteLength!), typeAt: at };
  }

  async function tensorOf(file: Buffer, name: string): Promise<Float32Array> {
    const path = `${fresh('patched')}.gguf`;
    writeFileSync(path, file);
    const decoded = await decodeModel(model, 'f32', (await viaGguf(path, 'f32')).m);
    return decoded.find((t) => t.name === name)!.values;
  }

  it('BF16: each 16-bit value is the top half of a float32', async () => {
    const file = readFileSync(await gguf(model, 'f16'));
    const { data, typeAt } = await locate(file, 'blk.0.ffn_up.weight');
    file.writeUInt32LE(30, typeAt);
    const bits = new Uint16Array(data.buffer.slice(data.byteOffset, data.byteOffset + data.byteLength));
    const values = await tensorOf(file, 'model.layers.0.mlp.up_proj.weight');
    expect(Array.from(values)).toEqual(Array.from(bits, (h) => new Float32Array(new Uint32Array([h << 16]).buffer)[0]));
  });

  it('Q4_1: 20-byte blocks expanded by the Q4_1 kernel (the last tensor, so its longer data fits)', async () => {
    const q40 = readFileSync(await gguf(model, 'q40'));
    const { data, typeAt } = await locate(q40, 'output.weight');
    expect(data.byteOffset + data.length).toBe(q40.length); // the last tensor's data ends the file
    const blocks = data.length / 18;
    // Blocks of d = k/256, m = −k/64 (k = 1..7) and a nibble pattern, in place of the Q4_0 data.
    const q41 = Buffer.alloc(blocks * 20);
    for (let b = 0; b < blocks; b++) {
      const k = (b % 7) + 1;
      q41.writeUInt16LE(f32ToF16Bits(k / 256), b * 20);
      q41.writeUInt16LE(f32ToF16Bits(-k / 64), b * 20 + 2);
      for (let j = 0; j < 16; j++) q41[b * 20 + 4 + j] = (b * 3 + j * 5) & 0xff;
    }
    const file = Buffer.concat([q40.subarray(0, data.byteOffset), q41]);
    file.writeUInt32LE(3, typeAt);
    const expected = new Float32Array(blocks * 32);
    dequantizeQ41(new Uint8Array(q41), expected);
    expect(expected[1]).toBe(Math.fround(5 / 256 - 1 / 64)); // block 0: d = 1/256, m = −1/64, q = 5
    expect(Array.from(await tensorOf(file, 'lm_head.weight'))).toEqual(Array.from(expected));
  });
});

describe('convertGgufToDllama: refusals', () => {
  let file: Buffer;
  beforeAll(async () => {
    const model = fresh('tiny-refusals');
    await writeTinyModel(model, { seed: 9, dtype: 'F32' });
    file = readFileSync(await gguf(model, 'f32'));
  });

  /** The GGUF with one tensor's ggml type id replaced (its data then reads shorter: no overlap). */
  function withTensorType(name: string, ggmlType: number): Buffer {
    const copy = Buffer.from(file);
    copy.writeUInt32LE(ggmlType, typeIdOffset(copy, name));
    return copy;
  }

  async function refusal(
    bytes: Buffer | null,
    weights: WeightsFormat = 'q40',
  ): Promise<{ error: { name: string; code: string; message: string }; left: string[] }> {
    const dir = fresh('refused');
    mkdirSync(dir);
    const input = join(dir, 'input.gguf');
    if (bytes) writeFileSync(input, bytes);
    const out = join(dir, 'out');
    const error = await convertGgufToDllama({ gguf: input, weights, output: out, threads: 1 }).then(
      () => {
        throw new Error('expected a refusal');
      },
      (err: { name: string; code: string; message: string }) => err,
    );
    return { error, left: readdirSync(dir).filter((f) => f !== 'input.gguf') };
  }

  test.each([
    [12, 'Q4_K'],
    [14, 'Q6_K'],
    [6, 'Q5_0'],
    [16, 'IQ2_XXS'],
  ])('a tensor of ggml type %i is refused as %s before anything is written', async (type, typeName) => {
    const { error, left } = await refusal(withTensorType('blk.1.ffn_down.weight', type));
    expect(error).toMatchObject({ name: 'ConvertError', code: 'UnsupportedDType' });
    expect(error.message).toContain(`blk.1.ffn_down.weight is ${typeName}`);
    expect(error.message).toContain('safetensors repository');
    expect(left).toEqual([]);
  });

  it('a file cut short, in the header or in the tensor data, is TruncatedFile', async () => {
    for (const cut of [200, file.length - 1000]) {
      const { error, left } = await refusal(file.subarray(0, cut));
      expect(error).toMatchObject({ name: 'ConvertError', code: 'TruncatedFile' });
      expect(error.message).toContain('input.gguf');
      expect(left).toEqual([]);
    }
  });

  it('garbage and a missing file are refused with a clear error', async () => {
    const garbage = await refusal(Buffer.from('this is not a GGUF file at all, just text'.repeat(10)));
    expect(garbage.error).toMatchObject({ name: 'ConvertError', code: 'BadHeader' });
    expect(garbage.error.message).toContain('bad magic');
    expect(garbage.left).toEqual([]);
    const missing = await refusal(null);
    expect(missing.error).toMatchObject({ name: 'ConvertError', code: 'MissingFile' });
    expect(missing.left).toEqual([]);
  });

  it('an unknown weights format is refused', async () => {
    const { error } = await refusal(file, 'q3' as WeightsFormat);
    expect(error).toMatchObject({ name: 'ConvertError', code: 'UnsupportedConfig' });
  });

  test.each(['f16', 'q80'] as const)('%s, which distributed-llama cannot run, is refused before anything is read or written', async (weights) => {
    const { error, left } = await refusal(null, weights);
    expect(error).toMatchObject({ name: 'ConvertError', code: 'UnsupportedWeights' });
    expect(error.message).toContain(`distributed-llama cannot run ${weights} weights`);
    expect(left).toEqual([]);
  });

  it('a GGUF without a chat template is refused: dllama-api would not start', async () => {
    const model = fresh('tiny-no-template');
    await writeTinyModel(model, { seed: 9, dtype: 'F32' });
    const configPath = join(model, 'tokenizer_config.json');
    const { chat_template: _, ...config } = JSON.parse(readFileSync(configPath, 'utf8')) as Record<string, unknown>;
    writeFileSync(configPath, JSON.stringify(config));
    const { error, left } = await refusal(readFileSync(await gguf(model, 'f32')));
    expect(error).toMatchObject({ name: 'ConvertError', code: 'UnsupportedChatTemplate' });
    expect(error.message).toContain('The tokenizer does not include chat template');
    expect(left).toEqual([]);
  });
});

describe('ggml block dequantizers', () => {
  const f16 = (v: number): [number, number] => {
    const h = f32ToF16Bits(v);
    return [h & 0xff, h >>> 8];
  };
  const nibbles = (q: number[]): number[] => Array.from({ length: 16 }, (_, j) => q[j]! | (q[j + 16]! << 4));
  const q = Array.from({ length: 32 }, (_, i) => (i * 7) % 16);

  it('Q8_0: x = q·d', () => {
    const ints = Array.from({ length: 32 }, (_, i) => i * 8 - 127);
    const out = new Float32Array(32);
    dequantizeQ80(Uint8Array.from([...f16(0.25), ...ints.map((v) => v & 0xff)]), out);
    expect(Array.from(out)).toEqual(ints.map((v) => v * 0.25));
  });

  it('Q4_0: x = (q − 8)·d, element j in the low nibble of byte j and j + 16 in its high nibble', () => {
    const out = new Float32Array(32);
    dequantizeQ40(Uint8Array.from([...f16(-0.5), ...nibbles(q)]), out);
    expect(Array.from(out)).toEqual(q.map((v) => (v - 8) * -0.5));
  });

  it('Q4_1: x = q·d + m, rounded once to float32', () => {
    const out = new Float32Array(64);
    const block = [...f16(0.1), ...f16(-1.5), ...nibbles(q)];
    dequantizeQ41(Uint8Array.from([...block, ...block]), out);
    const d = F16_TABLE[f32ToF16Bits(0.1)]!;
    const expected = q.map((v) => Math.fround(v * d + -1.5));
    expect(Array.from(out)).toEqual([...expected, ...expected]);
  });
});

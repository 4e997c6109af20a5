/**
 * The conversion pipeline end to end on the tiny synthetic model: every format and weights
 * encoding, parsed back; output independent of thread count and sharding; bad input fails with
 * a typed error and leaves nothing at (or next to) the output name.
 */
import { createHash } from 'node:crypto';
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { writeTinyModel, type TinyModelOptions } from '../workers/dev/tiny-model';
import { convertModel, type ConvertProgress } from './convert';
import { planDllama } from './dllama';
import { readGguf } from './gguf-reader';
import { parseModelSpec } from './arch';
import { GgmlType } from './gguf';
import { localCheckpoint } from './safetensors';
import type { CheckpointFiles, WeightsFormat } from './types';

let root: string;
beforeAll(() => {
  root = mkdtempSync(join(tmpdir(), 'magus-convert-'));
});
afterAll(() => rmSync(root, { recursive: true, force: true }));

const sha = (path: string) => createHash('sha256').update(readFileSync(path)).digest('hex');
const GGML_OF: Record<WeightsFormat, number> = { f32: GgmlType.F32, f16: GgmlType.F16, q80: GgmlType.Q8_0, q40: GgmlType.Q4_0 };

describe('GGUF', () => {
  let model: string;
  beforeAll(async () => {
    model = join(root, 'tiny-f16');
    await writeTinyModel(model, { seed: 7, dtype: 'F16', ropeScaling: true });
  });

  test.each(['f32', 'f16', 'q80', 'q40'] as const)('%s: every tensor and key parses back, with progress', async (weights) => {
    const out = join(root, `tiny-${weights}.gguf`);
    const progress: ConvertProgress[] = [];
    const result = await convertModel({ source: model, format: 'gguf', weights, output: out, threads: 2, onProgress: (p) => progress.push(p) });
    const bytes = readFileSync(out);
    expect(bytes.length).toBe(result.files[0]?.bytes);

    const gguf = await readGguf(new Uint8Array(bytes));
    const kv = (k: string) => gguf.metadata.get(k)?.value;
    expect(kv('general.architecture')).toBe('llama');
    expect(kv('llama.block_count')).toBe(2);
    expect(kv('llama.embedding_length')).toBe(64);
    expect(kv('tokenizer.ggml.model')).toBe('gpt2');
    expect(typeof kv('tokenizer.chat_template')).toBe('string');
    const names = gguf.tensors.map((t) => t.name);
    expect(names).toEqual(expect.arrayContaining(['rope_freqs.weight', 'token_embd.weight', 'blk.1.ffn_down.weight', 'output_norm.weight', 'output.weight']));
    expect(gguf.tensors).toHaveLength(result.tensors);
    for (const t of gguf.tensors) {
      const oneD = t.dims.length === 1;
      expect([t.name, t.ggmlType]).toEqual([t.name, oneD ? GgmlType.F32 : GGML_OF[weights]]);
    }

    const last = progress[progress.length - 1];
    expect(last?.tensorsDone).toBe(result.tensors);
    expect(last?.bytesDone).toBe(last?.bytesTotal);
    expect(last?.bytesTotal).toBe(result.inputBytes);
    expect(readdirSync(root).filter((f) => f.includes('.tmp-'))).toEqual([]);
  });

  test.each(['gguf', 'dllama'] as const)('%s: output bytes do not depend on chunking (permuted Q/K split across chunks)', async (format) => {
    const a = join(root, `chunks-a-${format}`);
    const b = join(root, `chunks-b-${format}`);
    await convertModel({ source: model, format, weights: 'q40', output: a, threads: 2, name: 'tiny' });
    // 256 values: every 64x64 Q/K matrix becomes 16 chunks of 4 rows.
    await convertModel({ source: model, format, weights: 'q40', output: b, threads: 2, name: 'tiny', chunkElements: 256 });
    if (format === 'gguf') expect(sha(b)).toBe(sha(a));
    else expect(sha(join(b, 'model.m'))).toBe(sha(join(a, 'model.m')));
  });

  test('output bytes do not depend on thread count or sharding', async () => {
    const sharded = join(root, 'tiny-f16-sharded');
    await writeTinyModel(sharded, { seed: 7, dtype: 'F16', ropeScaling: true, shards: 3 });
    const a = join(root, 'a.gguf');
    const b = join(root, 'b.gguf');
    await convertModel({ source: model, format: 'gguf', weights: 'q40', output: a, threads: 1, name: 'tiny' });
    await convertModel({ source: sharded, format: 'gguf', weights: 'q40', output: b, threads: 2, name: 'tiny' });
    expect(sha(a)).toBe(sha(b));
  });
});

test('distributed-llama: model.m header as planned, sizes add up, tokenizer.t written', async () => {
  const model = join(root, 'tiny-bf16');
  await writeTinyModel(model, { seed: 3, dtype: 'BF16' });
  const out = join(root, 'dllama-q40');
  const result = await convertModel({ source: model, format: 'dllama', weights: 'q40', output: out, threads: 2 });
  const m = readFileSync(join(out, 'model.m'));
  const config = JSON.parse(readFileSync(join(model, 'config.json'), 'utf8')) as unknown;
  const plan = planDllama(parseModelSpec(config), 'q40', (n) => n !== 'nothing');
  expect(m.length).toBe(plan.totalSize);
  expect(m.subarray(0, plan.headerBytes.length).equals(Buffer.from(plan.headerBytes))).toBe(true);
  expect(result.files.map((f) => f.path)).toEqual([join(out, 'model.m'), join(out, 'tokenizer.t')]);
  expect(readFileSync(join(out, 'tokenizer.t')).readUInt32LE(0)).toBe(0x567124);
});

describe('distributed-llama: what it cannot serve is refused before any tensor is read or any output written', () => {
  /** A tiny model written with `opts`, then `edit`ed (config.json, tokenizer_config.json), converted to dllama with `weights`. */
  async function refusal(
    name: string,
    weights: WeightsFormat,
    opts: TinyModelOptions = {},
    edit: (files: { config: Record<string, unknown>; tokenizerConfig: Record<string, unknown> }) => void = () => undefined,
  ): Promise<{ code: string; message: string }> {
    const dir = join(root, `serve-${name}`);
    await writeTinyModel(dir, { seed: 21, ...opts });
    const json = (file: string) => JSON.parse(readFileSync(join(dir, file), 'utf8')) as Record<string, unknown>;
    const files = { config: json('config.json'), tokenizerConfig: json('tokenizer_config.json') };
    edit(files);
    writeFileSync(join(dir, 'config.json'), JSON.stringify(files.config));
    writeFileSync(join(dir, 'tokenizer_config.json'), JSON.stringify(files.tokenizerConfig));
    // Every byte range read from a weights file, checked against where its header ends.
    const local = localCheckpoint(dir);
    const beyondHeader: string[] = [];
    const checkpoint: CheckpointFiles = {
      location: local.location,
      readText: (file) => local.readText(file),
      async open(file) {
        const source = await local.open(file);
        const headerEnd = 8 + Number(readFileSync(join(dir, file)).readBigUInt64LE(0));
        return {
          name: source.name,
          size: () => source.size(),
          close: () => source.close(),
          read(offset, length, into) {
            if (offset + length > headerEnd) beyondHeader.push(`${file}@${offset}+${length}`);
            return source.read(offset, length, into);
          },
        };
      },
    };
    const progress: ConvertProgress[] = [];
    const out = join(root, `serve-${name}-out`);
    const err = (await convertModel({ source: checkpoint, format: 'dllama', weights, output: out, threads: 1, onProgress: (p) => progress.push(p) }).catch(
      (e: unknown) => e,
    )) as { name: string; code: string; message: string };
    expect(err).toMatchObject({ name: 'ConvertError' });
    expect(beyondHeader).toEqual([]);
    expect(progress).toEqual([]);
    expect(readdirSync(root).filter((f) => f.startsWith(`serve-${name}-out`))).toEqual([]);
    return { code: err.code, message: err.message };
  }

  test.each(['f16', 'q80'] as const)('%s weights: distributed-llama runs no matmul on them', async (weights) => {
    expect(await refusal(`weights-${weights}`, weights)).toEqual({
      code: 'UnsupportedWeights',
      message: `distributed-llama cannot run ${weights} weights: its CPU matmuls take q40 or f32 weights only (${weights} stops at the first matmul: "Unsupported op quant"); convert to q40 or f32`,
    });
  });

  test('dimensions no topology runs, not even 1 node, named with the weights that would run', async () => {
    expect(await refusal('ffn-100', 'f32', { intermediateSize: 100 })).toEqual({
      code: 'NoTopology',
      message:
        'distributed-llama cannot run this model in f32 on any number of nodes: intermediate_size 100 / 1 node = 100 values per node, not a multiple of 8 (F32 matmul)',
    });
    expect(await refusal('ffn-104', 'q40', { intermediateSize: 104 })).toEqual({
      code: 'NoTopology',
      message:
        'distributed-llama cannot run this model in q40 on any number of nodes: intermediate_size 104 / 1 node = 104 values per node, not a whole number of 32-value q40 blocks (Q40 matmul) (f32 runs on 1 node)',
    });
  });

  test('a byte-level BPE vocabulary with BOS before its regular tokens (GPT-2 style): prompts would reach the model as single bytes', async () => {
    // Qwen3's tokenizer names no BOS token: config.json's bos_token_id is the BOS, here id 1.
    const { code, message } = await refusal('bos-first', 'q40', { arch: 'qwen3' }, ({ config }) => (config.bos_token_id = 1));
    expect(code).toBe('UnsupportedTokenizer');
    expect(message).toMatch(
      /^distributed-llama takes the ids below BOS as its regular vocabulary and merges only those, .*\(.+, id 1\) before 380 of its 381 regular tokens/,
    );
    expect(message).toContain('every prompt would reach the model as single bytes');
  });

  test('no chat template, or one dllama-api does not recognize: it would not start', async () => {
    const none = await refusal('no-template', 'q40', {}, ({ tokenizerConfig }) => delete tokenizerConfig.chat_template);
    expect(none.code).toBe('UnsupportedChatTemplate');
    expect(none.message).toContain('it would stop at start with "The tokenizer does not include chat template"');
    const zephyr = "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}{% endfor %}";
    const unknown = await refusal('zephyr-template', 'q40', {}, ({ tokenizerConfig }) => (tokenizerConfig.chat_template = zephyr));
    expect(unknown.code).toBe('UnsupportedChatTemplate');
    expect(unknown.message).toContain('it would stop at start with "Not supported chat template"');
  });
});

describe('bad input', () => {
  test('a NaN weight names its tensor and leaves no output', async () => {
    const model = join(root, 'nan');
    const tiny = await writeTinyModel(model, { seed: 5, dtype: 'F32' });
    const file = join(model, tiny.weightFiles[0]!);
    const buf = readFileSync(file);
    const headerLen = Number(buf.readBigUInt64LE(0));
    const header = JSON.parse(buf.subarray(8, 8 + headerLen).toString('utf8')) as Record<string, { data_offsets: [number, number] }>;
    const target = 'model.layers.1.mlp.up_proj.weight';
    buf.writeFloatLE(Number.NaN, 8 + headerLen + header[target]!.data_offsets[0] + 4 * 100);
    writeFileSync(file, buf);
    const out = join(root, 'nan-out');
    const err = await convertModel({ source: model, format: 'gguf', weights: 'q40', output: `${out}.gguf`, threads: 2 }).catch((e: unknown) => e);
    expect(err).toMatchObject({ name: 'ConvertError', code: 'NonFinite' });
    expect((err as Error).message).toContain(target);
    expect(readdirSync(root).filter((f) => f.startsWith('nan-out'))).toEqual([]);
  });

  // GGUF parses the tokenizer while the first chunks are encoded; distributed-llama before any is read.
  test.each(['gguf', 'dllama'] as const)('%s: a bad tokenizer fails cleanly, nothing left behind', async (format) => {
    const model = join(root, `bad-tokenizer-${format}`);
    await writeTinyModel(model, { seed: 4, dtype: 'F16' });
    writeFileSync(join(model, 'tokenizer.json'), '{"model": ');
    const out = join(root, `bad-tokenizer-out-${format}`);
    const err = await convertModel({
      source: model,
      format,
      weights: 'q40',
      output: format === 'gguf' ? `${out}.gguf` : out,
      threads: 2,
      chunkElements: 64,
    }).catch((e: unknown) => e);
    expect(err).toMatchObject({ name: 'ConvertError', code: 'BadHeader' });
    expect((err as Error).message).toContain('tokenizer.json');
    expect(readdirSync(root).filter((f) => f.startsWith(`bad-tokenizer-out-${format}`) && f !== `bad-tokenizer-out-${format}`)).toEqual([]);
  });

  test('an unsupported architecture is a typed error naming it', async () => {
    const model = join(root, 'mistral');
    await writeTinyModel(model, { seed: 1 });
    const configPath = join(model, 'config.json');
    const config = JSON.parse(readFileSync(configPath, 'utf8')) as Record<string, unknown>;
    writeFileSync(configPath, JSON.stringify({ ...config, architectures: ['GPTNeoXForCausalLM'], model_type: 'gpt_neox' }));
    const err = await convertModel({ source: model, format: 'gguf', weights: 'f16', output: join(root, 'x.gguf') }).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: 'UnsupportedArchitecture' });
    expect((err as Error).message).toMatch(/gpt_neox|GPTNeoX/);
  });

  test('a missing tensor is a typed error before anything is written', async () => {
    const model = join(root, 'missing');
    const tiny = await writeTinyModel(model, { seed: 2, dtype: 'F32' });
    // Rename a tensor in place (same length, so every offset stays valid).
    const file = join(model, tiny.weightFiles[0]!);
    const buf = readFileSync(file);
    const at = buf.indexOf('model.layers.0.self_attn.v_proj.weight');
    expect(at).toBeGreaterThan(0);
    buf.write('model.layers.0.self_attn.w_proj.weight', at);
    writeFileSync(file, buf);
    const out = join(root, 'missing-out');
    const err = await convertModel({ source: model, format: 'dllama', weights: 'q40', output: out }).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: 'MissingTensor' });
    expect((err as Error).message).toContain('model.layers.0.self_attn.v_proj.weight');
    expect(readdirSync(root).filter((f) => f.startsWith('missing-out'))).toEqual([]);
  });
});

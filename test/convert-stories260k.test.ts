/**
 * Trained weights through the converter: stories260K (workers/dev/stories260k.ts) converted to
 * GGUF F32 and F16 generates, greedily from BOS alone in llama.cpp, exactly the text llama2.c
 * generates from the original checkpoint; converted for distributed-llama with its FFN padded to
 * 192 (and Llama 2's chat template), its f32 `.m` holds exactly llama2.c's weights (q/k back in
 * llama2.c's order, the padding's zeros) and its `.t` spells that text. A random model cannot
 * tell a wrong rotary un-permute from a right one by its text; this one can (without the
 * fixture's permute, F32 goes astray after "there was a little").
 * What cannot hold or run its 172-value FFN is refused before any tensor data is read or any
 * output written: quantized GGUFs (their blocks), and every distributed-llama conversion of the
 * model as published (its F32 matmul steps by 8, q40 by 32; f16 and q80 it cannot run at all).
 */
import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseModelSpec, planTensors } from '../convert/arch';
import { convertModel, type ConvertProgress } from '../convert/convert';
import { DLLAMA_TOKENIZER_MAGIC, DllamaTokenizerKey, planDllama } from '../convert/dllama';
import { readGguf } from '../convert/gguf-reader';
import { localCheckpoint } from '../convert/safetensors';
import type { CheckpointFiles } from '../convert/types';
import {
  LLAMA2_CHAT_TEMPLATE,
  modelsDir,
  STORIES260K,
  STORIES260K_DLLAMA_FFN,
  STORIES260K_TEXT,
  writeStories260k,
  type Stories260k,
} from '../workers/dev/stories260k';
import { runLlamaCpp } from './reference/llama-cpp';

let root: string;
let model: Stories260k;
/** The same model with its FFN zero-padded to what distributed-llama splits, and a chat template dllama-api knows. */
let padded: Stories260k;
/** The GGUF conversions, by weights format. */
const gguf = { f32: '', f16: '' };
beforeAll(async () => {
  root = mkdtempSync(join(tmpdir(), 'magus-stories260k-'));
  model = await writeStories260k(join(root, 'hf'));
  padded = await writeStories260k(join(root, 'hf-padded'), { ffn: STORIES260K_DLLAMA_FFN, chatTemplate: LLAMA2_CHAT_TEMPLATE });
  for (const weights of ['f32', 'f16'] as const) {
    gguf[weights] = join(root, `stories260k-${weights}.gguf`);
    await convertModel({ source: model.dir, format: 'gguf', weights, output: gguf[weights], threads: 2 });
  }
});
afterAll(() => rmSync(root, { recursive: true, force: true }));

/** Generated tokens: enough to cover the README's text (about 45 pieces) with room to spare. */
const N_TOKENS = 64;

/** A tensor's values in llama2.c's order, as the runtimes store them. */
const llama2cBytes = (hfName: string, of: Stories260k = model): Buffer => {
  const t = of.tensors.find((x) => x.name === hfName);
  if (!t) throw new Error(`no tensor ${hfName} in the fixture`);
  return Buffer.from(t.llama2c.buffer, t.llama2c.byteOffset, t.llama2c.byteLength);
};

const spec = (of: Stories260k = model) => parseModelSpec(JSON.parse(readFileSync(join(of.dir, 'config.json'), 'utf8')));
const has = (name: string) => model.tensors.some((t) => t.name === name);

describe('GGUF in llama.cpp', () => {
  test.each(['f32', 'f16'] as const)(
    '%s: greedy decoding from BOS generates the text llama2.c does',
    async (weights) => {
      const got = await runLlamaCpp({ model: gguf[weights], promptTokens: [STORIES260K.bos], nTokens: N_TOKENS });
      // F16 rounds every weight, but moves the top-1/top-2 logit margins by ~0.003 while the smallest
      // margin within the text is 0.13 (0.07 at token 62, past it): it generates the whole text too.
      expect(got.text.slice(0, STORIES260K_TEXT.length)).toBe(STORIES260K_TEXT);
    },
    60_000,
  );

  test('f32: every tensor holds exactly llama2.c’s values, and the tokenizer is SentencePiece with BOS 1 / EOS 2', async () => {
    const bytes = readFileSync(gguf.f32);
    const file = await readGguf(new Uint8Array(bytes));
    const kv = (k: string) => file.metadata.get(k)?.value;
    expect([
      kv('tokenizer.ggml.model'),
      kv('tokenizer.ggml.bos_token_id'),
      kv('tokenizer.ggml.eos_token_id'),
      (kv('tokenizer.ggml.tokens') as unknown[]).length,
    ]).toEqual(['llama', 1, 2, 512]);
    const plan = planTensors(spec(), 'gguf', 'f32', has);
    expect(file.tensors.map((t) => t.name)).toEqual(plan.map((t) => t.name));
    for (const [i, t] of file.tensors.entries()) {
      const data = bytes.subarray(t.absoluteOffset, t.absoluteOffset + (t.byteLength ?? 0));
      expect([t.name, data.equals(llama2cBytes(plan[i]!.source!))]).toEqual([t.name, true]);
    }
  });
});

/** The `.t` file's header values, EOS ids and each token's bytes (distributed-llama's tokenizer.cpp layout). */
function readDllamaTokenizer(t: Buffer): { header: Map<number, number>; eos: number[]; tokens: Buffer[] } {
  expect(t.readInt32LE(0)).toBe(DLLAMA_TOKENIZER_MAGIC);
  const headerSize = t.readInt32LE(4);
  const header = new Map<number, number>();
  for (let at = 8; at < headerSize; at += 8) header.set(t.readInt32LE(at), t.readInt32LE(at + 4));
  let at = headerSize + (header.get(DllamaTokenizerKey.chat_template) ?? 0);
  const eos: number[] = [];
  for (let i = 0; i < (header.get(DllamaTokenizerKey.n_eos_tokens) ?? 0); i++, at += 4) eos.push(t.readInt32LE(at));
  const tokens: Buffer[] = [];
  for (let i = 0; i < (header.get(DllamaTokenizerKey.vocab_size) ?? 0); i++) {
    const length = t.readUInt32LE(at + 4);
    tokens.push(t.subarray(at + 8, at + 8 + length));
    at += 8 + length;
  }
  expect(at).toBe(t.length);
  return { header, eos, tokens };
}

// The model as published does not run on distributed-llama (its AVX2 F32 matmul asserts a node's
// FFN values are a multiple of 8, and 172 is not: refused below); padded to 192 it runs, and
// generates the text from BOS alone (the models README; test/dllama-stories260k.int.test.ts
// serves it).
test('distributed-llama f32 of the padded FFN: the .m is its header and llama2.c’s weights, the .t spells the text from llama.cpp’s tokens', async () => {
  const out = join(root, 'dllama-f32');
  await convertModel({ source: padded.dir, format: 'dllama', weights: 'f32', output: out, threads: 2 });
  const plan = planDllama(spec(padded), 'f32', has);
  expect(Object.fromEntries(plan.header)).toMatchObject({
    dim: 64,
    hidden_dim: STORIES260K_DLLAMA_FFN,
    n_layers: 5,
    n_heads: 8,
    n_kv_heads: 4,
    vocab_size: 512,
    max_seq_len: 512,
    weights_float_type: 0,
    rope_theta: 10000,
    norm_epsilon: 5,
  });
  // The classifier is the (tied) embedding again, last.
  expect(plan.tensors.at(-1)?.source).toBe('model.embed_tokens.weight');
  const expected = Buffer.concat([plan.headerBytes, ...plan.tensors.map((t) => llama2cBytes(t.source!, padded))]);
  expect(readFileSync(join(out, 'model.m')).equals(expected)).toBe(true);

  const tokenizer = readDllamaTokenizer(readFileSync(join(out, 'tokenizer.t')));
  expect([tokenizer.header.get(DllamaTokenizerKey.bos_id), tokenizer.eos, tokenizer.header.get(DllamaTokenizerKey.add_bos)]).toEqual([1, [2], 1]);
  const { tokens } = await runLlamaCpp({ model: gguf.f32, promptTokens: [STORIES260K.bos], nTokens: N_TOKENS });
  // SentencePiece's leading space of the first piece is dropped after BOS, as run.c and llama.cpp do.
  const text = Buffer.concat(tokens.map((id) => tokenizer.tokens[id]!))
    .toString('utf8')
    .replace(/^ /, '');
  expect(text.slice(0, STORIES260K_TEXT.length)).toBe(STORIES260K_TEXT);
}, 60_000);

/** The fixture folder, recording every byte range read from model.safetensors. */
function recordingReads(dir: string): { checkpoint: CheckpointFiles; reads: { offset: number; length: number }[] } {
  const local = localCheckpoint(dir);
  const reads: { offset: number; length: number }[] = [];
  const checkpoint: CheckpointFiles = {
    location: local.location,
    readText: (name) => local.readText(name),
    async open(name) {
      const source = await local.open(name);
      return {
        name: source.name,
        size: () => source.size(),
        close: () => source.close(),
        read(offset, length, into) {
          reads.push({ offset, length });
          return source.read(offset, length, into);
        },
      };
    },
  };
  return { checkpoint, reads };
}

/** What each refused conversion of the model as published fails with. */
const DLLAMA_172 = 'distributed-llama cannot run this model in';
const REFUSALS = [
  [
    'gguf',
    'q40',
    'BadBlockSize',
    'tensor blk.0.ffn_down.weight (model.layers.0.mlp.down_proj.weight): rows of 172 values cannot be split into 32-value q40 blocks; convert this model to f16 or f32',
  ],
  [
    'gguf',
    'q80',
    'BadBlockSize',
    'tensor blk.0.ffn_down.weight (model.layers.0.mlp.down_proj.weight): rows of 172 values cannot be split into 32-value q80 blocks; convert this model to f16 or f32',
  ],
  [
    'dllama',
    'q40',
    'NoTopology',
    `${DLLAMA_172} q40 on any number of nodes: intermediate_size 172 / 1 node = 172 values per node, not a whole number of 32-value q40 blocks (Q40 matmul)`,
  ],
  [
    'dllama',
    'f32',
    'NoTopology',
    `${DLLAMA_172} f32 on any number of nodes: intermediate_size 172 / 1 node = 172 values per node, not a multiple of 8 (F32 matmul)`,
  ],
  [
    'dllama',
    'q80',
    'UnsupportedWeights',
    'distributed-llama cannot run q80 weights: its CPU matmuls take q40 or f32 weights only (q80 stops at the first matmul: "Unsupported op quant"); convert to q40 or f32',
  ],
  [
    'dllama',
    'f16',
    'UnsupportedWeights',
    'distributed-llama cannot run f16 weights: its CPU matmuls take q40 or f32 weights only (f16 stops at the first matmul: "Unsupported op quant"); convert to q40 or f32',
  ],
] as const;

describe('what cannot hold or run its 172-value FFN is refused', () => {
  test.each(REFUSALS)('%s %s is refused (%s) naming what stops it, before any tensor is read or output written', async (format, weights, code, message) => {
    const { checkpoint, reads } = recordingReads(model.dir);
    const progress: ConvertProgress[] = [];
    const out = join(root, `refused-${format}-${weights}`);
    const output = format === 'gguf' ? `${out}.gguf` : out;
    const err = await convertModel({ source: checkpoint, format, weights, output, threads: 2, onProgress: (p) => progress.push(p) }).catch((e: unknown) => e);
    expect(err).toMatchObject({ name: 'ConvertError', code, message });
    // At most the safetensors header was read (its 8-byte length, then the JSON), no tensor data.
    const headerEnd = 8 + Number(readFileSync(join(model.dir, 'model.safetensors')).readBigUInt64LE(0));
    expect(reads.filter((r) => r.offset + r.length > headerEnd)).toEqual([]);
    expect(progress).toEqual([]);
    expect(readdirSync(root).filter((f) => f.startsWith(`refused-${format}-${weights}`))).toEqual([]);
  });
});

describe('the fixture refuses inputs it cannot vouch for', () => {
  const withModelsDir = async (dir: string): Promise<unknown> => {
    const before = process.env.MAGUS_MODELS_DIR;
    process.env.MAGUS_MODELS_DIR = dir;
    try {
      return await writeStories260k(join(dir, 'out')).catch((e: unknown) => e);
    } finally {
      if (before === undefined) delete process.env.MAGUS_MODELS_DIR;
      else process.env.MAGUS_MODELS_DIR = before;
    }
  };

  test('a missing file is named with where the models are looked for', async () => {
    const empty = mkdtempSync(join(root, 'no-models-'));
    const err = (await withModelsDir(empty)) as Error;
    expect(err.message).toContain(join(empty, 'stories260K'));
    expect(err.message).toContain('MAGUS_MODELS_DIR');
  });

  test('a file that differs is named with its sha256 and the expected one', async () => {
    const copy = mkdtempSync(join(root, 'bad-models-'));
    mkdirSync(join(copy, 'stories260K'));
    copyFileSync(join(modelsDir(), 'stories260K', 'tok512.bin'), join(copy, 'stories260K', 'tok512.bin'));
    const bin = readFileSync(join(modelsDir(), 'stories260K', 'stories260K.bin'));
    bin[1000] = bin[1000]! ^ 1;
    writeFileSync(join(copy, 'stories260K', 'stories260K.bin'), bin);
    const err = (await withModelsDir(copy)) as Error;
    expect(err.message).toMatch(/stories260K\.bin is not the expected file \(1056540 bytes, sha256 [0-9a-f]{64}; expected 1056540 bytes, sha256 b0a507e7/);
  });
});

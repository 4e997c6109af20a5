/**
 * GGUF writer and reader.
 *
 * Cross-check with an independent implementation (done once, by hand; the tests below do not need
 * Python): the file {@link everyTypeFile} writes was read with gguf-py 0.19.0's GGUFReader
 * (`python3 -m venv /tmp/ggufvenv && /tmp/ggufvenv/bin/pip install gguf numpy`), which listed
 * every key with the same type and value and every tensor with the same type, shape, offset and
 * bytes; and gguf-py's GGUFWriter, fed the same keys and tensors, produced exactly the same file.
 * That GGUFWriter output is testdata/gguf-every-type.hex, compared byte for byte below. The
 * script is recorded in testdata/README.md.
 */
import { mkdtemp, readFile, readdir, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseModelSpec, planTensors } from './arch';
import { GgmlType, type GgufKv, type GgufTensorInfo, ggmlByteLength, ggufModelMetadata, planGguf, planGgufModel, writeGgufFile } from './gguf';
import { readGguf } from './gguf-reader';
import { parseTokenizer } from './tokenizer';
import type { ByteSource } from './types';

const testdata = join(__dirname, 'testdata');

async function readHex(name: string): Promise<Buffer> {
  return Buffer.from((await readFile(join(testdata, name), 'utf8')).replace(/\s+/g, ''), 'hex');
}

/** One key of every type, arrays of every item type, a nested array. */
export const everyTypeKvs: GgufKv[] = [
  { key: 'general.architecture', type: 'string', value: 'llama' },
  { key: 'test.uint8', type: 'uint8', value: 200 },
  { key: 'test.int8', type: 'int8', value: -100 },
  { key: 'test.uint16', type: 'uint16', value: 60000 },
  { key: 'test.int16', type: 'int16', value: -30000 },
  { key: 'test.uint32', type: 'uint32', value: 4000000000 },
  { key: 'test.int32', type: 'int32', value: -2000000000 },
  { key: 'test.uint64', type: 'uint64', value: 18446744073709551615n },
  { key: 'test.int64', type: 'int64', value: -9223372036854775808n },
  { key: 'test.float32', type: 'float32', value: 0.5 },
  { key: 'test.float64', type: 'float64', value: Math.PI },
  { key: 'test.bool', type: 'bool', value: true },
  { key: 'test.bool_false', type: 'bool', value: false },
  { key: 'test.string', type: 'string', value: 'h\u00e9llo \u2713' },
  { key: 'test.string_empty', type: 'string', value: '' },
  { key: 'test.arr.uint8', type: 'array', itemType: 'uint8', value: [1, 2, 255] },
  { key: 'test.arr.int8', type: 'array', itemType: 'int8', value: [-1, 0, 1] },
  { key: 'test.arr.uint16', type: 'array', itemType: 'uint16', value: [65535] },
  { key: 'test.arr.int16', type: 'array', itemType: 'int16', value: [-32768, 32767] },
  { key: 'test.arr.uint32', type: 'array', itemType: 'uint32', value: [0, 4294967295] },
  { key: 'test.arr.int32', type: 'array', itemType: 'int32', value: [-5, 7] },
  { key: 'test.arr.uint64', type: 'array', itemType: 'uint64', value: [0n, 18446744073709551615n] },
  { key: 'test.arr.int64', type: 'array', itemType: 'int64', value: [-1n, 1n] },
  { key: 'test.arr.float32', type: 'array', itemType: 'float32', value: [1.5, -2.25] },
  { key: 'test.arr.float64', type: 'array', itemType: 'float64', value: [0.1] },
  { key: 'test.arr.bool', type: 'array', itemType: 'bool', value: [true, false, true] },
  { key: 'test.arr.string', type: 'array', itemType: 'string', value: ['a', '', '\u00fc'] },
  {
    key: 'test.arr.nested',
    type: 'array',
    itemType: 'array',
    value: [
      { type: 'array', itemType: 'int32', value: [1, 2] },
      { type: 'array', itemType: 'string', value: ['x', 'y'] },
    ],
  },
];

export const everyTypeTensors: GgufTensorInfo[] = [
  { name: 'a.f32', ggmlType: GgmlType.F32, dims: [3] },
  { name: 'b.f16', ggmlType: GgmlType.F16, dims: [4, 2] },
  { name: 'c.q4_0', ggmlType: GgmlType.Q4_0, dims: [32, 2] },
  { name: 'd.q8_0', ggmlType: GgmlType.Q8_0, dims: [64] },
];

/** Deterministic bytes for tensor `t`. */
export function tensorBytes(t: number, n: number): Uint8Array {
  return Uint8Array.from({ length: n }, (_, i) => (i * 7 + t * 31 + 1) & 0xff);
}

async function withTmp<T>(fn: (dir: string) => Promise<T>): Promise<T> {
  const dir = await mkdtemp(join(tmpdir(), 'gguf-test-'));
  try {
    return await fn(dir);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

/** Writes the every-type file; exported so the cross-check script can produce it. */
export async function everyTypeFile(path: string): Promise<void> {
  await writeGgufFile(path, everyTypeKvs, everyTypeTensors, (i, t) => tensorBytes(i, ggmlByteLength(t.ggmlType, t.dims)));
}

function bufferSource(bytes: Uint8Array, name = 'mem'): ByteSource & { reads: number } {
  const src = {
    name,
    reads: 0,
    size: () => Promise.resolve(bytes.length),
    read(offset: number, length: number, into?: Uint8Array): Promise<Uint8Array> {
      src.reads++;
      if (offset + length > bytes.length) return Promise.reject(new RangeError('read past end'));
      if (into) {
        into.set(bytes.subarray(offset, offset + length));
        return Promise.resolve(into.subarray(0, length));
      }
      return Promise.resolve(bytes.subarray(offset, offset + length));
    },
  };
  return src;
}

describe('GGUF writer + reader', () => {
  it('round-trips every value type, tensor infos, offsets, alignment and data', async () => {
    await withTmp(async (dir) => {
      const path = join(dir, 'every.gguf');
      await everyTypeFile(path);
      expect((await readdir(dir)).sort()).toEqual(['every.gguf']); // no temporary left behind
      const bytes = new Uint8Array(await readFile(path));
      const file = await readGguf(bytes);

      expect(file.version).toBe(3);
      expect(file.alignment).toBe(32);
      expect(file.kvs).toEqual(everyTypeKvs);
      expect(file.metadata.get('test.uint64')).toEqual({ type: 'uint64', value: 18446744073709551615n });

      // Offsets: 12 bytes of F32 pad to 32; 16 of F16 pad to 32; Q4_0 2 blocks = 36 -> 64; Q8_0 2 blocks = 68.
      expect(file.tensors.map((t) => [t.name, t.ggmlType, t.dims, t.offset, t.byteLength])).toEqual([
        ['a.f32', 0, [3], 0, 12],
        ['b.f16', 1, [4, 2], 32, 16],
        ['c.q4_0', 2, [32, 2], 64, 36],
        ['d.q8_0', 8, [64], 128, 68],
      ]);
      expect(file.dataOffset % 32).toBe(0);
      expect(bytes.length).toBe(file.dataOffset + 128 + 96); // last tensor padded too
      // the header is padded with zeros up to the data section
      const plan = planGguf(everyTypeKvs, everyTypeTensors);
      expect(Buffer.from(bytes.subarray(0, file.dataOffset)).equals(Buffer.from(plan.headerBytes))).toBe(true);
      file.tensors.forEach((t, i) => {
        expect(t.absoluteOffset % 32).toBe(0);
        const data = bytes.subarray(t.absoluteOffset, t.absoluteOffset + (t.byteLength ?? 0));
        expect(Buffer.from(data).equals(Buffer.from(tensorBytes(i, t.byteLength ?? 0)))).toBe(true);
        const next = file.tensors[i + 1]?.absoluteOffset ?? bytes.length;
        expect(bytes.subarray(t.absoluteOffset + (t.byteLength ?? 0), next).every((b) => b === 0)).toBe(true);
      });
    });
  });

  it('writes exactly what gguf-py 0.19.0 writes for the same keys and tensors', async () => {
    await withTmp(async (dir) => {
      const path = join(dir, 'every.gguf');
      await everyTypeFile(path);
      const ours = await readFile(path);
      const golden = await readHex('gguf-every-type.hex');
      expect(ours.length).toBe(golden.length);
      expect(ours.equals(golden)).toBe(true);
    });
  });

  it('plans the header up front: headerBytes + data + paddingAfter add up to the file', () => {
    const plan = planGguf(everyTypeKvs, everyTypeTensors);
    expect(plan.dataOffset).toBe(plan.headerBytes.length);
    expect(plan.tensorOffsets).toEqual([0, 32, 64, 128]);
    expect(everyTypeTensors.map((_, i) => plan.paddingAfter(i))).toEqual([20, 16, 28, 28]);
    expect(plan.totalSize).toBe(plan.dataOffset + 224);
    // header starts with the magic, version 3, 4 tensors, 28 keys
    const view = new DataView(plan.headerBytes.buffer, plan.headerBytes.byteOffset);
    expect(Buffer.from(plan.headerBytes.subarray(0, 4)).toString('latin1')).toBe('GGUF');
    expect(view.getUint32(4, true)).toBe(3);
    expect(view.getBigUint64(8, true)).toBe(4n);
    expect(view.getBigUint64(16, true)).toBe(BigInt(everyTypeKvs.length));
  });

  it('writes strings as UTF-8 exactly as TextEncoder encodes them, lone surrogates included', async () => {
    const value = ['', 'a', 'héllo', '日本語', '\u{1f600}', '\ud83d', 'x\udc00y', '\u0000', 'x'.repeat(70000)];
    const plan = planGguf([{ key: 'test.strings', type: 'array', itemType: 'string', value }], []);
    const encoded = value.map((v) => new TextEncoder().encode(v));
    const header = await readGguf(plan.headerBytes, { fileSize: plan.totalSize });
    const got = header.metadata.get('test.strings');
    expect(got).toEqual({ type: 'array', itemType: 'string', value: encoded.map((b) => new TextDecoder().decode(b)) });
    const body = Buffer.concat(encoded.flatMap((b) => [Buffer.from(new BigUint64Array([BigInt(b.length)]).buffer), Buffer.from(b)]));
    expect(Buffer.from(plan.headerBytes).includes(body)).toBe(true);
  });

  it('honours a custom alignment and records it as general.alignment', async () => {
    const plan = planGguf([{ key: 'general.architecture', type: 'string', value: 'llama' }], everyTypeTensors, { alignment: 64 });
    expect(plan.tensorOffsets).toEqual([0, 64, 128, 192]);
    const header = await readGguf(plan.headerBytes, { fileSize: plan.totalSize });
    expect(header.metadata.get('general.alignment')).toEqual({ type: 'uint32', value: 64 });
    expect(header.alignment).toBe(64);
    expect(header.dataOffset % 64).toBe(0);
  });

  it('reads a header larger than the first window from a ByteSource', async () => {
    const big = 'x'.repeat(3 << 20);
    const kvs: GgufKv[] = [
      { key: 'general.architecture', type: 'string', value: 'llama' },
      { key: 'big', type: 'string', value: big },
      { key: 'empty.array', type: 'array', itemType: 'int32', value: [] },
    ];
    const plan = planGguf(kvs, [{ name: 't', ggmlType: GgmlType.F32, dims: [8] }]);
    const bytes = new Uint8Array(plan.totalSize);
    bytes.set(plan.headerBytes);
    const src = bufferSource(bytes);
    const file = await readGguf(src);
    expect(file.metadata.get('big')).toEqual({ type: 'string', value: big });
    expect(file.metadata.get('empty.array')).toEqual({ type: 'array', itemType: 'int32', value: [] });
    expect(file.tensors[0]).toMatchObject({ name: 't', absoluteOffset: plan.dataOffset, byteLength: 32 });
    expect(src.reads).toBeGreaterThan(1);
  });

  it('rejects malformed values, duplicates and bad block sizes', () => {
    const arch: GgufKv = { key: 'general.architecture', type: 'string', value: 'llama' };
    expect(() => planGguf([arch, { key: 'x', type: 'uint8', value: 256 }], [])).toThrow(RangeError);
    expect(() => planGguf([arch, { key: 'x', type: 'int32', value: 1.5 }], [])).toThrow(RangeError);
    expect(() => planGguf([arch, { key: 'x', type: 'uint64', value: -1n }], [])).toThrow(RangeError);
    expect(() => planGguf([arch, arch], [])).toThrow(/duplicate GGUF key/);
    expect(() => planGguf([arch], [everyTypeTensors[0] as GgufTensorInfo, everyTypeTensors[0] as GgufTensorInfo])).toThrow(/duplicate tensor/);
    try {
      planGguf([arch], [{ name: 'q', ggmlType: GgmlType.Q4_0, dims: [48, 2] }]);
      throw new Error('expected a failure');
    } catch (err) {
      expect(err).toMatchObject({ name: 'ConvertError', code: 'BadBlockSize' });
    }
  });

  it('rejects truncated and foreign files', async () => {
    const plan = planGguf(everyTypeKvs, everyTypeTensors);
    await expect(readGguf(plan.headerBytes.subarray(0, 100))).rejects.toMatchObject({ name: 'GgufFormatError' });
    // header alone: tensor data would end beyond the file
    await expect(readGguf(plan.headerBytes)).rejects.toThrow(/beyond the file size/);
    await expect(readGguf(new TextEncoder().encode('NOTGGUF at all, not even close'))).rejects.toThrow(/bad magic/);
  });

  it('never leaves a file at the final name when a tensor is short', async () => {
    await withTmp(async (dir) => {
      const path = join(dir, 'short.gguf');
      await expect(writeGgufFile(path, everyTypeKvs, everyTypeTensors, () => new Uint8Array(1))).rejects.toThrow(/expected 12/);
      expect(await readdir(dir)).toEqual([]);
    });
  });
});

describe('llama.cpp model metadata', () => {
  async function tiny(): Promise<{ config: Record<string, unknown>; tokenizerJson: unknown; tokenizerConfig: unknown }> {
    const dir = join(testdata, 'tiny-llama');
    const json = async (name: string): Promise<unknown> => JSON.parse(await readFile(join(dir, name), 'utf8'));
    return {
      config: (await json('config.json')) as Record<string, unknown>,
      tokenizerJson: await json('tokenizer.json'),
      tokenizerConfig: await json('tokenizer_config.json'),
    };
  }

  it('writes the llama keys, tokenizer keys and tensors llama.cpp reads', async () => {
    const { config, tokenizerJson, tokenizerConfig } = await tiny();
    const spec = parseModelSpec(config);
    const tokenizer = parseTokenizer({ tokenizerJson, tokenizerConfig, bosTokenId: spec.bosTokenId, eosTokenIds: spec.eosTokenIds });
    const names = new Set(planTensors(spec, 'dllama', 'f32', () => true).map((t) => t.source ?? ''));
    names.delete('lm_head.weight'); // tied: the checkpoint has no lm_head
    const plan = planGgufModel({ spec, tokenizer, weights: 'q80', name: 'tiny', hasTensor: (n) => names.has(n) });
    const file = await readGguf(plan.layout.headerBytes.slice(0, plan.layout.dataOffset)).catch(() => null);
    expect(file).toBeNull(); // the header alone announces data beyond it
    const bytes = new Uint8Array(plan.layout.totalSize);
    bytes.set(plan.layout.headerBytes);
    const read = await readGguf(bytes);
    const m = Object.fromEntries(read.kvs.map((kv) => [kv.key, kv]));
    const value = (k: string): unknown => (m[k] as { value: unknown } | undefined)?.value;
    const type = (k: string): unknown => (m[k] as { type: unknown } | undefined)?.type;

    expect(read.kvs.slice(0, 3).map((kv) => kv.key)).toEqual(['general.architecture', 'general.type', 'general.name']);
    expect(value('general.architecture')).toBe('llama');
    expect(value('general.name')).toBe('tiny');
    const u32 = {
      'llama.block_count': 2,
      'llama.context_length': 131072,
      'llama.embedding_length': 64,
      'llama.feed_forward_length': 128,
      'llama.attention.head_count': 4,
      'llama.attention.head_count_kv': 2,
      'llama.attention.key_length': 16,
      'llama.attention.value_length': 16,
      'llama.vocab_size': 32,
      'llama.rope.dimension_count': 16,
      'general.file_type': 7, // MOSTLY_Q8_0
      'general.quantization_version': 2,
      'tokenizer.ggml.bos_token_id': 17,
      'tokenizer.ggml.eos_token_id': 19,
    };
    for (const [k, v] of Object.entries(u32)) {
      expect([k, type(k), value(k)]).toEqual([k, 'uint32', v]);
    }
    expect([type('llama.rope.freq_base'), value('llama.rope.freq_base')]).toEqual(['float32', 500000]);
    expect(type('llama.attention.layer_norm_rms_epsilon')).toBe('float32');
    expect(value('llama.attention.layer_norm_rms_epsilon')).toBeCloseTo(1e-5, 10);
    expect(value('tokenizer.ggml.model')).toBe('gpt2');
    expect(value('tokenizer.ggml.pre')).toBe('llama-bpe');
    const tokens = value('tokenizer.ggml.tokens') as string[];
    expect(tokens).toHaveLength(32); // padded to vocab_size
    expect(tokens.slice(14, 23)).toEqual(['hello', 'Ġw', 'Ã©', '<|begin_of_text|>', '<|end_of_text|>', '<|eot_id|>', '<think>', '<|reserved_0|>', '[PAD22]']);
    expect(m['tokenizer.ggml.token_type']).toMatchObject({ type: 'array', itemType: 'int32' });
    expect((value('tokenizer.ggml.token_type') as number[]).slice(15, 24)).toEqual([1, 1, 3, 3, 3, 4, 3, 5, 5]);
    expect(m['tokenizer.ggml.scores']).toBeUndefined(); // gpt2 vocabularies have none
    expect(value('tokenizer.ggml.merges')).toEqual(['h e', 'l l', 'he ll', 'hell o', 'Ġ w', 'Ã ©']);
    expect([type('tokenizer.ggml.add_bos_token'), value('tokenizer.ggml.add_bos_token')]).toEqual(['bool', true]);
    expect(value('tokenizer.chat_template')).toContain('{% for m in messages %}');

    // rope_freqs first, then the embedding; tied: no output.weight
    expect(read.tensors.map((t) => t.name).slice(0, 3)).toEqual(['rope_freqs.weight', 'token_embd.weight', 'blk.0.attn_norm.weight']);
    expect(read.tensors.find((t) => t.name === 'output.weight')).toBeUndefined();
    const byName = Object.fromEntries(read.tensors.map((t) => [t.name, t]));
    expect(byName['rope_freqs.weight']).toMatchObject({ ggmlType: 0, dims: [8] });
    expect(byName['token_embd.weight']).toMatchObject({ ggmlType: 8, dims: [64, 32] });
    expect(byName['blk.1.attn_q.weight']).toMatchObject({ ggmlType: 8, dims: [64, 64] });
    expect(byName['blk.1.attn_k.weight']).toMatchObject({ ggmlType: 8, dims: [64, 32] });
    expect(byName['blk.1.attn_output.weight']).toMatchObject({ ggmlType: 8, dims: [64, 64] });
    expect(byName['blk.1.ffn_down.weight']).toMatchObject({ ggmlType: 8, dims: [128, 64] });
    expect(byName['blk.1.ffn_up.weight']).toMatchObject({ ggmlType: 8, dims: [64, 128] });
    expect(byName['blk.1.ffn_norm.weight']).toMatchObject({ ggmlType: 0, dims: [64] });
    expect(byName['output_norm.weight']).toMatchObject({ ggmlType: 0, dims: [64] });
    expect(read.tensors).toHaveLength(2 + 2 * 9 + 1);
  });

  it('writes qwen3 keys and q/k norms', async () => {
    const spec = parseModelSpec(JSON.parse(await readFile(join(testdata, 'tiny-qwen3', 'config.json'), 'utf8')));
    const { tokenizerJson, tokenizerConfig } = await tiny();
    const tokenizer = parseTokenizer({ tokenizerJson, tokenizerConfig, bosTokenId: spec.bosTokenId, eosTokenIds: spec.eosTokenIds });
    const kvs = ggufModelMetadata({ spec, tokenizer, weights: 'f16', name: 'q' });
    const keys = kvs.map((kv) => kv.key);
    expect(keys).toEqual(expect.arrayContaining(['qwen3.attention.key_length', 'qwen3.attention.value_length', 'qwen3.rope.freq_base']));
    expect(kvs.find((kv) => kv.key === 'qwen3.attention.key_length')).toMatchObject({ value: 32 });
    expect(kvs.find((kv) => kv.key === 'general.file_type')).toMatchObject({ value: 1 });
    const plan = planGgufModel({ spec, tokenizer, weights: 'f16', name: 'q', hasTensor: (n) => n !== 'lm_head.weight' });
    const names = plan.tensors.map((t) => t.name);
    expect(names).toContain('blk.0.attn_q_norm.weight');
    expect(names).not.toContain('rope_freqs.weight');
    expect(plan.tensors.find((t) => t.name === 'blk.0.attn_k_norm.weight')).toMatchObject({ format: 'f32', shape: [32] });
  });
});

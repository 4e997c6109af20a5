import { mkdtemp, readFile, rm, unlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { encodeRawHeader, encodeSafetensors, encodeValues, tinyModelLayout, tinyModelTensors, tinyTensorData, writeTinyModel } from '../workers/dev/tiny-model';
import { isConvertError } from './errors';
import { f16BitsToF32 } from './quant';
import {
  MAX_HEADER_BYTES,
  bytesSource,
  chunkElementsFor,
  fileSource,
  openModelDir,
  openSafetensors,
  readTensorChunks,
  readTensorF32,
  readTensorF32All,
} from './safetensors';
import type { SourceTensor } from './types';

async function codeOf(p: Promise<unknown>): Promise<string | undefined> {
  try {
    await p;
  } catch (err) {
    return isConvertError(err) ? err.code : `not a ConvertError: ${String(err)}`;
  }
  return undefined;
}

async function errorOf(p: Promise<unknown>): Promise<{ code?: string; message: string }> {
  try {
    await p;
  } catch (err) {
    return { code: (err as { code?: string }).code, message: (err as Error).message };
  }
  throw new Error('expected a rejection');
}

/** A file whose header is exactly `body` (no padding), with a correct length prefix. */
function rawFile(body: Uint8Array): Uint8Array {
  const out = Buffer.alloc(8 + body.length);
  out.writeBigUInt64LE(BigInt(body.length));
  out.set(body, 8);
  return out;
}

const f32 = (values: number[]): Uint8Array => new Uint8Array(Float32Array.from(values).buffer);

async function collect(it: AsyncIterable<Float32Array>): Promise<{ chunks: number[]; values: number[] }> {
  const chunks: number[] = [];
  const values: number[] = [];
  for await (const c of it) {
    chunks.push(c.length);
    values.push(...c);
  }
  return { chunks, values };
}

describe('openSafetensors', () => {
  test('round-trips F32, F16 and BF16 tensors with absolute offsets and metadata', async () => {
    const a = Float32Array.from({ length: 12 }, (_, i) => i / 8 - 0.75);
    const b = Float32Array.from({ length: 64 }, (_, i) => (i - 32) / 64);
    const c = Float32Array.from({ length: 6 }, (_, i) => 1 + i / 128);
    const file = encodeSafetensors(
      [
        { name: 'a', dtype: 'F32', shape: [3, 4], data: encodeValues(a, 'F32') },
        { name: 'b.weight', dtype: 'F16', shape: [2, 32], data: encodeValues(b, 'F16') },
        { name: 'c', dtype: 'BF16', shape: [6], data: encodeValues(c, 'BF16') },
        { name: 'scalar', dtype: 'F32', shape: [], data: f32([42]) },
        { name: 'empty', dtype: 'F16', shape: [0, 5], data: new Uint8Array(0) },
      ],
      { format: 'pt' },
    );
    const st = await openSafetensors(bytesSource('mem.safetensors', file));
    expect(st.metadata).toEqual({ format: 'pt' });
    expect(st.tensors.map((t) => [t.name, t.dtype, t.shape, t.offset - st.dataOffset, t.byteLength])).toEqual([
      ['a', 'F32', [3, 4], 0, 48],
      ['b.weight', 'F16', [2, 32], 48, 128],
      ['c', 'BF16', [6], 176, 12],
      ['scalar', 'F32', [], 188, 4],
      ['empty', 'F16', [0, 5], 192, 0],
    ]);
    expect(st.dataOffset % 8).toBe(0);
    const byName = new Map(st.tensors.map((t) => [t.name, t]));
    // all these values are exact in every dtype
    expect([...(await readTensorF32All(byName.get('a')!))]).toEqual([...a]);
    expect([...(await readTensorF32All(byName.get('b.weight')!))]).toEqual([...b]);
    expect([...(await readTensorF32All(byName.get('c')!))]).toEqual([...c]);
    expect([...(await readTensorF32All(byName.get('scalar')!))]).toEqual([42]);
    expect((await collect(readTensorF32(byName.get('empty')!))).values).toEqual([]);
  });

  test('keeps tensors of other dtypes aside instead of failing', async () => {
    const file = encodeSafetensors([
      { name: 'w', dtype: 'F32', shape: [2], data: f32([1, 2]) },
      { name: 'position_ids', dtype: 'I64', shape: [3], data: new Uint8Array(24) },
      { name: 'fp8', dtype: 'F8_E4M3', shape: [4], byteLength: 4, data: new Uint8Array(4) },
    ]);
    const st = await openSafetensors(bytesSource('m', file));
    expect(st.tensors.map((t) => t.name)).toEqual(['w']);
    expect(st.unsupported).toEqual([
      { name: 'position_ids', dtype: 'I64', shape: [3] },
      { name: 'fp8', dtype: 'F8_E4M3', shape: [4] },
    ]);
  });

  describe('rejects malformed files', () => {
    const good = (): { header: Record<string, unknown>; data: Uint8Array } => ({
      header: {
        a: { dtype: 'F32', shape: [2], data_offsets: [0, 8] },
        b: { dtype: 'F16', shape: [2, 2], data_offsets: [8, 16] },
      },
      data: new Uint8Array(16),
    });
    const build = (header: unknown, data: Uint8Array): Uint8Array =>
      Buffer.concat([encodeRawHeader(typeof header === 'string' ? header : JSON.stringify(header)), data]);
    const open = (bytes: Uint8Array): Promise<unknown> => openSafetensors(bytesSource('bad.safetensors', bytes));

    test('the well-formed baseline opens', async () => {
      const { header, data } = good();
      expect((await openSafetensors(bytesSource('ok', build(header, data)))).tensors).toHaveLength(2);
    });

    test.each([
      ['shorter than 8 bytes', () => new Uint8Array(5), 'TruncatedFile'],
      ['empty', () => new Uint8Array(0), 'TruncatedFile'],
      ['header length beyond the file', () => encodeRawHeader('{}', 1000n), 'HeaderTooLarge'],
      ['header length beyond the cap', () => encodeRawHeader('{}', BigInt(MAX_HEADER_BYTES) + 1n), 'HeaderTooLarge'],
      ['header length near 2^64', () => encodeRawHeader('{}', 0xfffffffffffffff0n), 'HeaderTooLarge'],
      ['invalid JSON', () => build('{"a": {', new Uint8Array(0)), 'BadHeader'],
      ['a JSON array', () => build('[]', new Uint8Array(0)), 'BadHeader'],
      ['invalid UTF-8', () => rawFile(Buffer.concat([Buffer.from('{"'), Buffer.from([0xff, 0xfe]), Buffer.from('":{}}')])), 'BadHeader'],
    ] as const)('%s', async (_what, bytes, code) => {
      expect(await codeOf(open(bytes()))).toBe(code);
    });

    type Mutate = (h: Record<string, Record<string, unknown>>) => void;
    test.each<[string, Mutate, Uint8Array | null, string, RegExp]>([
      ['unknown dtype', (h) => (h.b!.dtype = 'Q7_K'), null, 'UnsupportedDType', /tensor b: unknown dtype Q7_K/],
      ['shape × dtype ≠ bytes', (h) => (h.b!.shape = [3, 2]), null, 'ShapeMismatch', /tensor b: shape \[3, 2\] of F16 needs 12 bytes but data_offsets span 8/],
      ['overlapping tensors', (h) => (h.b!.data_offsets = [4, 12]), null, 'BadOffsets', /overlaps/],
      [
        'a gap between tensors',
        (h) => {
          h.b!.data_offsets = [12, 20];
        },
        new Uint8Array(20),
        'BadOffsets',
        /bytes 8\.\.12 .* belong to no tensor/,
      ],
      [
        'offsets past the data section',
        (h) => (h.b!.data_offsets = [8, 16]),
        new Uint8Array(12),
        'TruncatedFile',
        /tensor b ends at data byte 16 but the file holds only 12/,
      ],
      ['trailing bytes', () => undefined, new Uint8Array(24), 'BadOffsets', /last 8 bytes/],
      ['reversed offsets', (h) => (h.b!.data_offsets = [16, 8]), null, 'BadOffsets', /end before they begin/],
      ['negative offset', (h) => (h.b!.data_offsets = [-8, 8]), null, 'BadHeader', /data_offsets/],
      ['fractional shape', (h) => (h.a!.shape = [1.5]), null, 'BadHeader', /shape/],
      ['missing dtype', (h) => delete h.a!.dtype, null, 'BadHeader', /tensor a: dtype/],
      ['non-string metadata', (h) => (h.__metadata__ = { n: 1 }), null, 'BadHeader', /__metadata__\.n/],
      ['entry not an object', (h) => ((h as Record<string, unknown>).a = 3), null, 'BadHeader', /tensor a/],
    ])('%s', async (_what, mutate, data, code, message) => {
      const g = good();
      const header = g.header as Record<string, Record<string, unknown>>;
      mutate(header);
      const err = await errorOf(open(build(header, data ?? g.data)));
      expect(err.code).toBe(code);
      expect(err.message).toMatch(message);
      expect(err.message).toContain('bad.safetensors');
    });
  });
});

describe('chunked reads', () => {
  test('chunk sizes are whole rows and whole 32-value blocks where possible', () => {
    expect(chunkElementsFor([1000, 64], 1000)).toBe(960); // 15 rows
    expect(chunkElementsFor([1000, 48], 1000)).toBe(960); // rows of 48, blocks of 32: lcm 96
    expect(chunkElementsFor([10, 5000], 1000)).toBe(992); // a row longer than a chunk: split at blocks
    expect(chunkElementsFor([7], 1000)).toBe(896); // lcm(7, 32) = 224, four of them
    expect(chunkElementsFor([10, 3000], 20)).toBe(20); // too small for a block
    expect(chunkElementsFor([], 5)).toBe(5);
    expect(() => chunkElementsFor([4], 0)).toThrow(RangeError);
  });

  test('streams a tensor in bounded, row-aligned chunks whose concatenation is the tensor', async () => {
    const values = Float32Array.from({ length: 40 * 64 }, (_, i) => ((i * 37) % 101) / 50 - 1);
    const file = encodeSafetensors([{ name: 'm', dtype: 'F16', shape: [40, 64], data: encodeValues(values, 'F16') }]);
    const [t] = (await openSafetensors(bytesSource('m', file))).tensors;
    const { chunks, values: got } = await collect(readTensorF32(t!, { chunkElements: 300 }));
    expect(chunks).toEqual(Array<number>(10).fill(256)); // 4 rows of 64 each time
    expect(got).toEqual([...encodeValuesRoundTrip(values)]);
    const raw: number[] = [];
    for await (const c of readTensorChunks(t!, { chunkElements: 1000 })) raw.push(c.elementOffset, c.elements, c.bytes.length);
    expect(raw).toEqual([0, 960, 1920, 960, 960, 1920, 1920, 640, 1280]);
  });

  test('reads each chunk into the buffer the caller gives for it', async () => {
    const values = Float32Array.from({ length: 40 * 64 }, (_, i) => i / 100);
    const data = encodeValues(values, 'F16');
    const [t] = (await openSafetensors(bytesSource('m', encodeSafetensors([{ name: 'm', dtype: 'F16', shape: [40, 64], data }])))).tensors;
    const buffer = new Uint8Array(4096);
    const asked: number[] = [];
    const seen: number[] = [];
    for await (const c of readTensorChunks(t!, { chunkElements: 1000, buffer: (n) => (asked.push(n), buffer) })) {
      expect(c.bytes.buffer).toBe(buffer.buffer);
      expect(c.bytes.byteOffset).toBe(0);
      seen.push(...c.bytes); // copied out before the next chunk overwrites it
    }
    expect(asked).toEqual([1920, 1920, 1280]);
    expect(Buffer.from(seen).equals(Buffer.from(data))).toBe(true);
  });

  test('NaN/Inf while reading names the file, tensor and element', async () => {
    const h = new Uint16Array(96).fill(0x3c00);
    h[70] = 0xfc00; // -Inf
    const file = encodeSafetensors([{ name: 'model.norm.weight', dtype: 'F16', shape: [96], data: new Uint8Array(h.buffer) }]);
    const [t] = (await openSafetensors(bytesSource('shard.safetensors', file))).tensors;
    const err = await errorOf(collect(readTensorF32(t!, { chunkElements: 32 })));
    expect(err.code).toBe('NonFinite');
    expect(err.message).toMatch(/shard\.safetensors: tensor model\.norm\.weight: element 70 is -Infinity/);
    expect((await collect(readTensorF32(t!, { checkFinite: false }))).values[70]).toBe(-Infinity);
    expect(await codeOf(readTensorF32All(t!))).toBe('NonFinite');
  });
});

function encodeValuesRoundTrip(values: Float32Array): Float32Array {
  const h = new Uint16Array(encodeValues(values, 'F16').buffer);
  return Float32Array.from(h, f16BitsToF32);
}

describe('model directories', () => {
  let dir: string;
  beforeEach(async () => {
    dir = await mkdtemp(path.join(tmpdir(), 'magus-st-'));
  });
  afterEach(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  async function expectTensorsMatch(tensors: ReadonlyMap<string, SourceTensor>, seed: number, dtype: 'F32' | 'F16' | 'BF16', names: string[]): Promise<void> {
    const layout = tinyModelLayout({ seed, dtype });
    for (const t of tinyModelTensors(layout).filter((x) => names.includes(x.name))) {
      const expected = encodeValues(tinyTensorData(seed, t), dtype);
      const src = tensors.get(t.name)!;
      expect(src.shape).toEqual(t.shape);
      expect(Buffer.from(await src.source.read(src.offset, src.byteLength)).equals(Buffer.from(expected))).toBe(true);
    }
  }

  test('a single-file model', async () => {
    await writeTinyModel(dir, { seed: 5, dtype: 'BF16' });
    const w = await openModelDir(dir);
    try {
      expect(w.files).toHaveLength(1);
      expect(w.tensors.size).toBe(tinyModelTensors(tinyModelLayout({})).length);
      expect(w.has('model.embed_tokens.weight')).toBe(true);
      await expectTensorsMatch(w.tensors, 5, 'BF16', ['model.embed_tokens.weight', 'model.layers.1.mlp.down_proj.weight', 'model.norm.weight']);
      expect(await codeOf(Promise.resolve().then(() => w.get('nope')))).toBe('MissingTensor');
    } finally {
      await w.close();
    }
  });

  test('a sharded model opens every shard once and holds the same tensors as the single file', async () => {
    await writeTinyModel(dir, { seed: 9, dtype: 'F16', shards: 3, arch: 'qwen3' });
    const w = await openModelDir(dir);
    try {
      expect(w.files.map((f) => path.basename(f.source.name))).toEqual([
        'model-00001-of-00003.safetensors',
        'model-00002-of-00003.safetensors',
        'model-00003-of-00003.safetensors',
      ]);
      const index = JSON.parse(await readFile(path.join(dir, 'model.safetensors.index.json'), 'utf8')) as { weight_map: Record<string, string> };
      expect(new Set(w.tensors.keys())).toEqual(new Set(Object.keys(index.weight_map)));
      for (const [name, shard] of Object.entries(index.weight_map)) expect(path.basename(w.get(name).source.name)).toBe(shard);
      // all tensors of a shard share one source object (one open handle per shard)
      expect(new Set([...w.tensors.values()].map((t) => t.source)).size).toBe(3);
      const layout = tinyModelLayout({ seed: 9, dtype: 'F16', arch: 'qwen3' });
      const names = tinyModelTensors(layout).map((t) => t.name);
      expect(names).toContain('model.layers.0.self_attn.q_norm.weight');
      const expected = tinyModelTensors(layout);
      for (const t of expected) {
        const src = w.get(t.name);
        const bytes = await src.source.read(src.offset, src.byteLength);
        expect(Buffer.from(bytes).equals(Buffer.from(encodeValues(tinyTensorData(9, t), 'F16')))).toBe(true);
      }
    } finally {
      await w.close();
    }
  });

  test('reports integer tensors by dtype', async () => {
    await writeFile(
      path.join(dir, 'model.safetensors'),
      encodeSafetensors([
        { name: 'w', dtype: 'F32', shape: [1], data: f32([1]) },
        { name: 'q', dtype: 'I32', shape: [1], data: new Uint8Array(4) },
      ]),
    );
    const w = await openModelDir(dir);
    try {
      const err = await errorOf(Promise.resolve().then(() => w.get('q')));
      expect(err.code).toBe('UnsupportedDType');
      expect(err.message).toMatch(/tensor q has dtype I32/);
    } finally {
      await w.close();
    }
  });

  test.each([
    ['no weights at all', () => Promise.resolve(), 'MissingFile'],
    [
      'a shard named by the index is missing',
      async (d: string) => {
        await writeTinyModel(d, { shards: 2 });
        await unlink(path.join(d, 'model-00002-of-00002.safetensors'));
      },
      'MissingFile',
    ],
    [
      'the index names a tensor its shard lacks',
      async (d: string) => {
        await writeTinyModel(d, { shards: 2 });
        const p = path.join(d, 'model.safetensors.index.json');
        const index = JSON.parse(await readFile(p, 'utf8')) as { weight_map: Record<string, string> };
        index.weight_map['model.extra.weight'] = 'model-00001-of-00002.safetensors';
        await writeFile(p, JSON.stringify(index));
      },
      'MissingTensor',
    ],
    [
      'the index puts a tensor in the wrong shard',
      async (d: string) => {
        await writeTinyModel(d, { shards: 2 });
        const p = path.join(d, 'model.safetensors.index.json');
        const index = JSON.parse(await readFile(p, 'utf8')) as { weight_map: Record<string, string> };
        index.weight_map['model.embed_tokens.weight'] = 'model-00002-of-00002.safetensors';
        await writeFile(p, JSON.stringify(index));
      },
      'MissingTensor',
    ],
    ['the index is not JSON', async (d: string) => writeFile(path.join(d, 'model.safetensors.index.json'), '{oops'), 'BadIndex'],
    ['the index has no weight_map', async (d: string) => writeFile(path.join(d, 'model.safetensors.index.json'), '{"metadata": {}}'), 'BadIndex'],
    [
      'the index points outside the directory',
      async (d: string) => writeFile(path.join(d, 'model.safetensors.index.json'), JSON.stringify({ weight_map: { w: '../../etc/passwd' } })),
      'BadIndex',
    ],
    [
      'two shards hold the same tensor',
      async (d: string) => {
        const one = encodeSafetensors([{ name: 'w', dtype: 'F32', shape: [1], data: f32([1]) }]);
        await writeFile(path.join(d, 'a.safetensors'), one);
        await writeFile(path.join(d, 'b.safetensors'), one);
        await writeFile(path.join(d, 'model.safetensors.index.json'), JSON.stringify({ weight_map: { w: 'a.safetensors', x: 'b.safetensors' } }));
      },
      'BadIndex',
    ],
    ['a shard is malformed', async (d: string) => writeFile(path.join(d, 'model.safetensors'), new Uint8Array(3)), 'TruncatedFile'],
  ] as const)('%s', async (_what, setup, code) => {
    await setup(dir);
    expect(await codeOf(openModelDir(dir))).toBe(code);
  });
});

describe('byte sources', () => {
  test('fileSource reads ranges through one handle and reports truncation', async () => {
    const dir = await mkdtemp(path.join(tmpdir(), 'magus-src-'));
    try {
      const p = path.join(dir, 'f.bin');
      await writeFile(
        p,
        Uint8Array.from({ length: 100 }, (_, i) => i),
      );
      const src = fileSource(p);
      expect(await src.size()).toBe(100);
      expect([...(await src.read(10, 5))]).toEqual([10, 11, 12, 13, 14]);
      const into = new Uint8Array(new SharedArrayBuffer(8));
      const got = await src.read(20, 6, into);
      expect(got.buffer).toBe(into.buffer);
      expect([got.byteOffset, got.length, ...got]).toEqual([0, 6, 20, 21, 22, 23, 24, 25]);
      await expect(src.read(0, 9, into)).rejects.toThrow(RangeError);
      const err = await errorOf(src.read(95, 10));
      expect(err.code).toBe('TruncatedFile');
      expect(err.message).toContain(p);
      await src.close();
      await src.close(); // idempotent
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  test('bytesSource returns copies and rejects reads past the end', async () => {
    const bytes = Uint8Array.of(1, 2, 3, 4);
    const src = bytesSource('mem', bytes);
    const r = await src.read(1, 2);
    r[0] = 99;
    expect([...bytes]).toEqual([1, 2, 3, 4]);
    expect(await codeOf(src.read(3, 2))).toBe('TruncatedFile');
    const into = new Uint8Array(5).fill(7);
    const got = await src.read(2, 2, into);
    expect(got.buffer).toBe(into.buffer);
    expect([...into]).toEqual([3, 4, 7, 7, 7]);
    await expect(src.read(0, 4, new Uint8Array(3))).rejects.toThrow(RangeError);
  });
});

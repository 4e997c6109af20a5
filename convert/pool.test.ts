import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { writeTinyModel } from '../workers/dev/tiny-model';
import { isConvertError } from './errors';
import { QuantPool } from './pool';
import { encodeChunk, encodedSize, f32ToF16Bits } from './quant';
import { bytesSource, openModelDir, openSafetensors, readTensorChunks } from './safetensors';
import type { QuantFlavor, SourceDType, WeightsFormat } from './types';

function randomF16(n: number, seed: number): Uint8Array {
  let s = seed;
  const h = new Uint16Array(n);
  for (let i = 0; i < n; i++) {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    h[i] = f32ToF16Bits(((s | 0) / 2 ** 31) * 0.1);
  }
  return new Uint8Array(h.buffer);
}

function inline(dtype: SourceDType, bytes: Uint8Array, format: WeightsFormat, flavor: QuantFlavor = 'ggml'): Uint8Array {
  const elements = bytes.length / (dtype === 'F32' ? 4 : 2);
  const out = new Uint8Array(encodedSize(format, elements));
  encodeChunk({ dtype, bytes }, format, out, { flavor });
  return out;
}

async function concat(it: AsyncIterable<Uint8Array>): Promise<Buffer> {
  const parts: Uint8Array[] = [];
  for await (const c of it) parts.push(c);
  return Buffer.concat(parts);
}

describe('QuantPool', () => {
  const pools: QuantPool[] = [];
  const pool = (size: number): QuantPool => {
    const p = new QuantPool({ size });
    pools.push(p);
    return p;
  };
  afterAll(async () => {
    await Promise.all(pools.map((p) => p.close()));
  });

  test('output is byte-identical to the inline encoder whatever the pool size', async () => {
    const chunks = Array.from({ length: 12 }, (_, i) => randomF16(32 * (50 + 17 * i), i + 1));
    const sized = [pool(1), pool(3)];
    for (const [format, flavor] of [
      ['q40', 'ggml'],
      ['q40', 'dllama'],
      ['q80', 'ggml'],
      ['q80', 'dllama'],
      ['f16', 'ggml'],
      ['f32', 'ggml'],
    ] as const) {
      const expected = Buffer.concat(chunks.map((c) => inline('F16', c, format, flavor)));
      for (const p of sized) {
        const got = await concat(
          p.encodeStream(
            chunks.map((c) => ({ dtype: 'F16' as const, bytes: c.slice() })),
            { format, flavor, maxInFlight: 5 },
          ),
        );
        expect(got.equals(expected)).toBe(true);
      }
    }
  });

  test('encodeTensor streams a checkpoint tensor in order', async () => {
    const dir = await mkdtemp(path.join(tmpdir(), 'magus-pool-'));
    try {
      await writeTinyModel(dir, { seed: 3, dtype: 'BF16' });
      const w = await openModelDir(dir);
      try {
        const t = w.get('model.layers.0.mlp.down_proj.weight');
        const parts: Uint8Array[] = [];
        for await (const c of readTensorChunks(t, { chunkElements: 2048 })) parts.push(inline('BF16', c.bytes, 'q40', 'dllama'));
        const got = await concat(pool(2).encodeTensor(t, { format: 'q40', flavor: 'dllama', chunkElements: 2048 }));
        expect(got.equals(Buffer.concat(parts))).toBe(true);
        expect(got.length).toBe(encodedSize('q40', 64 * 256));
      } finally {
        await w.close();
      }
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  test('transfers whole buffers and copies views', async () => {
    const p = pool(1);
    const whole = randomF16(64, 1);
    await p.encode({ dtype: 'F16', bytes: whole, format: 'q80' });
    expect(whole.byteLength).toBe(0); // detached: moved to the worker, not copied
    const backing = randomF16(96, 2);
    const view = backing.subarray(64);
    const out = await p.encode({ dtype: 'F16', bytes: view, format: 'q80' });
    expect(backing.byteLength).toBe(192);
    expect(Buffer.from(out).equals(Buffer.from(inline('F16', backing.slice(64), 'q80')))).toBe(true);
  });

  test('shares SharedArrayBuffer views instead of copying or detaching them, and encodes into a shared output', async () => {
    const p = pool(1);
    const input = randomF16(96, 3);
    const shared = new Uint8Array(new SharedArrayBuffer(input.length + 64));
    shared.set(input, 64);
    const view = shared.subarray(64);
    const out = new Uint8Array(new SharedArrayBuffer(200)).fill(0xee);
    for (const format of ['q40', 'q80'] as const) {
      const got = await p.encode({ dtype: 'F16', bytes: view, format, out });
      expect(got.buffer).toBe(out.buffer);
      expect([got.byteOffset, got.length]).toEqual([0, encodedSize(format, 96)]);
      expect(Buffer.from(got).equals(Buffer.from(inline('F16', input, format)))).toBe(true);
      expect(view.length).toBe(input.length); // still attached
    }
    // Without `out`, a shared input still gets a fresh output.
    expect(Buffer.from(await p.encode({ dtype: 'F16', bytes: view, format: 'q40' })).equals(Buffer.from(inline('F16', input, 'q40')))).toBe(true);
    const small = new Uint8Array(new SharedArrayBuffer(10));
    await expect(p.encode({ dtype: 'F16', bytes: view, format: 'q40', out: small })).rejects.toThrow(/do not fit/);
    await expect(p.encode({ dtype: 'F16', bytes: view, format: 'q40', out: new Uint8Array(100) })).rejects.toThrow(TypeError);
  });

  test('a worker error rejects its task with the ConvertError code, and the pool goes on', async () => {
    const p = pool(2);
    const h = new Uint16Array(64).fill(0x3c00);
    h[33] = 0x7e00; // NaN
    const bad = new Uint8Array(h.buffer);
    const err = await p.encode({ dtype: 'F16', bytes: bad, format: 'q40', label: 'model.norm.weight', elementOffset: 64 }).catch((e: unknown) => e);
    expect(isConvertError(err, 'NonFinite')).toBe(true);
    expect((err as Error).message).toMatch(/model\.norm\.weight: element 97 is NaN/);
    expect(isConvertError(await p.encode({ dtype: 'F32', bytes: new Uint8Array(33 * 4), format: 'q80' }).catch((e: unknown) => e), 'BadBlockSize')).toBe(true);
    const ok = randomF16(64, 5);
    expect(Buffer.from(await p.encode({ dtype: 'F16', bytes: ok.slice(), format: 'q40' })).equals(Buffer.from(inline('F16', ok, 'q40')))).toBe(true);
  });

  test('a stream fails at the first bad chunk, in order', async () => {
    const p = pool(2);
    const h = new Uint16Array(32).fill(0x7c00);
    const chunks = [randomF16(64, 1), randomF16(64, 2), new Uint8Array(h.buffer), randomF16(64, 3)].map((bytes) => ({ dtype: 'F16' as const, bytes }));
    const seen: number[] = [];
    const err = await (async () => {
      for await (const out of p.encodeStream(chunks, { format: 'q40', label: 't' })) seen.push(out.length);
    })().catch((e: unknown) => e);
    expect(seen).toEqual([36, 36]);
    expect(isConvertError(err, 'NonFinite')).toBe(true);
  });

  test('encodeTensor rejects tensors that are not whole blocks before reading', async () => {
    const file = Buffer.concat([Buffer.from(JSON.stringify({ t: { dtype: 'F32', shape: [33], data_offsets: [0, 132] } }))]);
    const prefix = Buffer.alloc(8);
    prefix.writeBigUInt64LE(BigInt(file.length));
    const [t] = (await openSafetensors(bytesSource('odd', Buffer.concat([prefix, file, Buffer.alloc(132)])))).tensors;
    expect(() => pool(1).encodeTensor(t!, { format: 'q40' })).toThrow(expect.objectContaining({ code: 'BadBlockSize' }) as Error);
  });

  test('warm starts every worker up front, and they work as usual', async () => {
    const p = pool(2);
    p.warm();
    p.warm(); // no more than `size`
    const ok = randomF16(64, 9);
    const outs = await Promise.all([1, 2, 3].map(() => p.encode({ dtype: 'F16', bytes: ok.slice(), format: 'q40' })));
    for (const out of outs) expect(Buffer.from(out).equals(Buffer.from(inline('F16', ok, 'q40')))).toBe(true);
    expect((p as unknown as { slots: unknown[] }).slots).toHaveLength(2);
  });

  test('close rejects new and queued work and is idempotent', async () => {
    const p = new QuantPool({ size: 1 });
    const inFlight = [
      p.encode({ dtype: 'F16', bytes: randomF16(32 * 4096, 1), format: 'q40' }),
      p.encode({ dtype: 'F16', bytes: randomF16(64, 2), format: 'q40' }),
    ];
    const settled = Promise.allSettled(inFlight);
    await p.close();
    await p.close();
    expect((await settled).map((r) => r.status)).toEqual(['rejected', 'rejected']);
    await expect(p.encode({ dtype: 'F16', bytes: randomF16(32, 1), format: 'q40' })).rejects.toThrow(/closed/);
  });
});

/** s3Source against the real S3 server (s3proxy) of the test harness: exact ranges, few GETs, fresh buffers or the caller's. */
import { CreateBucketCommand, PutObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import { isolation, s3Client } from '../../test/harness';
import { s3Source } from './s3-source';
import { calls, logCalls, pseudoRandomBytes } from '../../test/harness/storage';

const MiB = 1024 * 1024;
const BLOCK = 4 * MiB;
/** Five full blocks and a ragged end. */
const SIZE = 20 * MiB + 12345;
const BLOCKS = Math.ceil(SIZE / BLOCK);

const { bucket } = isolation();
const key = 'sources/org/model/rev/model-00001-of-00002.safetensors';
const data = pseudoRandomBytes(SIZE, 3);
const clients: S3Client[] = [];

function client(): { s3: S3Client; log: ReturnType<typeof logCalls> } {
  const s3 = s3Client();
  clients.push(s3);
  return { s3, log: logCalls(s3) };
}

/** Small deterministic RNG for read positions. */
function rng(seed: number): () => number {
  let x = seed;
  return () => {
    x = (Math.imul(x, 1103515245) + 12345) >>> 0;
    return x / 2 ** 32;
  };
}

beforeAll(async () => {
  const { s3 } = client();
  await s3.send(new CreateBucketCommand({ Bucket: bucket }));
  await s3.send(new PutObjectCommand({ Bucket: bucket, Key: key, Body: data }));
});
afterAll(() => clients.forEach((c) => c.destroy()));

describe('s3Source', () => {
  test('reads arbitrary ranges exactly: inside a block, across blocks, larger than a block, up to the last byte', async () => {
    const { s3, log } = client();
    const source = s3Source(s3, bucket, key, { blockSize: BLOCK });
    expect(source.name).toBe(`s3://${bucket}/${key}`);
    expect(await source.size()).toBe(SIZE);
    expect(calls(log, 'HeadObject')).toBe(1);
    const random = rng(11);
    const reads: [number, number][] = [
      [0, 8],
      [BLOCK - 3, 7], // straddles a block boundary
      [BLOCK, BLOCK], // exactly one block
      [3 * BLOCK - 1, BLOCK], // a block's worth across two blocks
      [1000, 9 * MiB], // larger than a block: one direct GET
      [SIZE - 1, 1],
      [SIZE - 5 * MiB, 5 * MiB],
      [SIZE, 0],
    ];
    for (let i = 0; i < 100; i++) {
      const length = Math.floor(random() * (random() < 0.2 ? 6 * MiB : 300 * 1024));
      reads.push([Math.floor(random() * (SIZE - length)), length]);
    }
    for (const [offset, length] of reads) {
      const got = await source.read(offset, length);
      expect(got.length).toBe(length);
      expect(Buffer.from(got.buffer, got.byteOffset, got.length).equals(data.subarray(offset, offset + length))).toBe(true);
      // A fresh buffer owning its ArrayBuffer: the converter's worker pool may transfer it.
      expect(got.byteOffset).toBe(0);
      expect(got.buffer.byteLength).toBe(length);
    }
    await source.close();
  });

  test('sequential small reads cost one GET per block (read-ahead included), and a known size no HeadObject', async () => {
    const { s3, log } = client();
    const source = s3Source(s3, bucket, key, { blockSize: BLOCK, size: SIZE });
    const out = Buffer.alloc(SIZE);
    let reads = 0;
    for (let offset = 0; offset < SIZE; offset += 100 * 1024 + 7, reads++) {
      const length = Math.min(100 * 1024 + 7, SIZE - offset);
      out.set(await source.read(offset, length), offset);
    }
    expect(out.equals(data)).toBe(true);
    expect(reads).toBeGreaterThan(200);
    expect(calls(log, 'GetObject')).toBe(BLOCKS);
    expect(calls(log, 'HeadObject')).toBe(0);
    await source.close();
  });

  test('reads into a buffer the caller gives, from the cache or with a direct GET', async () => {
    const { s3 } = client();
    const source = s3Source(s3, bucket, key, { blockSize: BLOCK });
    const into = new Uint8Array(new SharedArrayBuffer(6 * MiB));
    for (const [offset, length] of [
      [BLOCK - 3, 7], // across two cached blocks
      [123, 5 * MiB], // larger than a block
      [SIZE - 10, 10],
      [0, 0],
    ] as const) {
      const got = await source.read(offset, length, into);
      expect([got.buffer === into.buffer, got.byteOffset, got.length]).toEqual([true, 0, length]);
      expect(Buffer.from(got).equals(data.subarray(offset, offset + length))).toBe(true);
    }
    await expect(source.read(0, 6 * MiB + 1, into)).rejects.toThrow(RangeError);
    await source.close();
  });

  test('concurrent reads are served correctly', async () => {
    const { s3, log } = client();
    const source = s3Source(s3, bucket, key, { blockSize: BLOCK });
    const random = rng(5);
    const ranges = Array.from({ length: 60 }, () => {
      const length = 1 + Math.floor(random() * 2 * MiB);
      return [Math.floor(random() * (SIZE - length)), length] as const;
    });
    const got = await Promise.all(ranges.map(([o, l]) => source.read(o, l)));
    ranges.forEach(([o, l], i) => expect(Buffer.from(got[i] as Uint8Array).equals(data.subarray(o, o + l))).toBe(true));
    expect(calls(log, 'GetObject')).toBeLessThan(60);
  });

  test('a read past the end throws TruncatedFile; a bad range throws InvalidArgument', async () => {
    const { s3 } = client();
    const source = s3Source(s3, bucket, key);
    await expect(source.read(SIZE - 10, 11)).rejects.toMatchObject({ name: 'ConvertError', code: 'TruncatedFile' });
    await expect(source.read(-1, 1)).rejects.toMatchObject({ name: 'StorageError', code: 'InvalidArgument' });
    await expect(s3Source(s3, bucket, 'no/such/key').size()).rejects.toMatchObject({ name: 'NotFound' });
  });
});

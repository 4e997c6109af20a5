/** createS3ObjectWriter against the real S3 server (s3proxy) of the test harness. */
import { CreateBucketCommand, HeadObjectCommand, PutObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import { isolation, s3Client } from '../../test/harness';
import { writeFileAtomically } from '../../convert/atomic-file';
import { listIncompleteUploads } from './cleanup';
import { createS3ObjectWriter, s3OutputTarget } from './s3-writer';
import { calls, getObjectBytes, logCalls, pseudoRandomBytes, sha256Hex } from '../../test/harness/storage';
import type { StoredObject } from '../../shared/model';

const MiB = 1024 * 1024;
const PART = 5 * MiB;
const { bucket } = isolation();
const clients: S3Client[] = [];

function client(): { s3: S3Client; log: ReturnType<typeof logCalls> } {
  const s3 = s3Client();
  clients.push(s3);
  return { s3, log: logCalls(s3) };
}

async function expectStored(s3: S3Client, key: string, bytes: Buffer, extra: Record<string, string> = {}): Promise<void> {
  const head = await s3.send(new HeadObjectCommand({ Bucket: bucket, Key: key }));
  expect(head.ContentLength).toBe(bytes.length);
  expect(head.Metadata).toEqual({ ...extra, sha256: sha256Hex(bytes) });
  expect((await getObjectBytes(s3, bucket, key)).equals(bytes)).toBe(true);
  expect(await listIncompleteUploads(s3, bucket, key)).toEqual([]);
}

async function expectAbsent(s3: S3Client, key: string): Promise<void> {
  await expect(s3.send(new HeadObjectCommand({ Bucket: bucket, Key: key }))).rejects.toMatchObject({ name: 'NotFound' });
  expect(await listIncompleteUploads(s3, bucket, key)).toEqual([]);
}

beforeAll(async () => {
  await client().s3.send(new CreateBucketCommand({ Bucket: bucket }));
});
afterAll(() => clients.forEach((c) => c.destroy()));

describe('createS3ObjectWriter', () => {
  test.each([
    ['0 B', 0],
    ['1 KiB', 1024],
    ['12 MiB', 12 * MiB],
  ])('round trip of %s, with sha256 metadata and the object absent until complete()', async (_label, size) => {
    const { s3, log } = client();
    const key = `artifacts/org/model/rev/gguf-q40/c1/size-${size}.gguf`;
    const bytes = pseudoRandomBytes(size, size + 1);
    const w = createS3ObjectWriter(s3, bucket, key, { partSize: PART, concurrency: 2, metadata: { converter: 'c1' } });
    // Uneven chunks, the caller reusing its buffer after each write (so the writer must copy).
    const scratch = Buffer.alloc(MiB + 3);
    for (let pos = 0; pos < size; pos += scratch.length) {
      const n = Math.min(scratch.length, size - pos);
      bytes.copy(scratch, 0, pos, pos + n);
      await w.sink.write(scratch.subarray(0, n));
      scratch.fill(0xee);
    }
    expect(w.sink.bytesWritten).toBe(size);
    await expect(s3.send(new HeadObjectCommand({ Bucket: bucket, Key: key }))).rejects.toMatchObject({ name: 'NotFound' });
    const stored: StoredObject = await w.complete();
    expect(stored).toEqual({ key, bytes: size, sha256: sha256Hex(bytes) });
    await expectStored(s3, key, bytes, { converter: 'c1' });
    if (size < PART) {
      expect(calls(log, 'PutObject')).toBe(1);
      expect(calls(log, 'CreateMultipartUpload')).toBe(0);
    } else {
      expect(calls(log, 'UploadPart')).toBe(Math.ceil(size / PART));
      expect(calls(log, 'CopyObject')).toBe(1); // the sha256 metadata
      expect(log.maxInFlight.UploadPartCommand).toBeLessThanOrEqual(2);
    }
  });

  test('owned chunks larger than a part are sent without copying and land intact', async () => {
    const { s3, log } = client();
    const key = 'artifacts/owned.bin';
    const bytes = pseudoRandomBytes(17 * MiB + 5, 9);
    const w = createS3ObjectWriter(s3, bucket, key, { partSize: PART });
    await w.sink.write(bytes.subarray(0, 100)); // a partial part first
    await w.sink.write(Buffer.from(bytes.subarray(100, 11 * MiB)), { owned: true });
    await w.sink.write(Buffer.from(bytes.subarray(11 * MiB)), { owned: true });
    await w.complete();
    await expectStored(s3, key, bytes);
    expect(calls(log, 'UploadPart')).toBe(4);
  });

  test('beyond the single-copy limit the metadata is set with a multipart copy', async () => {
    const { s3, log } = client();
    const key = 'artifacts/big-copy.bin';
    const bytes = pseudoRandomBytes(12 * MiB, 4);
    const w = createS3ObjectWriter(s3, bucket, key, { partSize: PART, singleCopyLimit: PART });
    await w.sink.write(bytes);
    await w.complete();
    await expectStored(s3, key, bytes);
    expect(calls(log, 'CopyObject')).toBe(0);
    expect(calls(log, 'UploadPartCopy')).toBe(1); // 12 MiB in one 1 GiB copy part
  });

  test('abort() after parts were sent leaves nothing; later writes fail', async () => {
    const { s3, log } = client();
    const key = 'artifacts/aborted.bin';
    const w = createS3ObjectWriter(s3, bucket, key, { partSize: PART });
    await w.sink.write(pseudoRandomBytes(12 * MiB, 2));
    expect(calls(log, 'UploadPart')).toBe(2);
    expect(await listIncompleteUploads(s3, bucket, key)).toHaveLength(1);
    await w.abort();
    await w.abort(); // idempotent
    await expectAbsent(s3, key);
    await expect(w.sink.write(Buffer.from([1]))).rejects.toThrow(/aborted/);
    await expect(w.complete()).rejects.toThrow(/aborted/);
  });

  test('abort() of a small object sends nothing at all, and an existing object at the key is left alone', async () => {
    const { s3, log } = client();
    const key = 'artifacts/kept.bin';
    await s3.send(new PutObjectCommand({ Bucket: bucket, Key: key, Body: 'old' }));
    const w = createS3ObjectWriter(s3, bucket, key);
    await w.sink.write(Buffer.from('new bytes'));
    await w.abort();
    expect((await getObjectBytes(s3, bucket, key)).toString()).toBe('old');
    expect(calls(log, 'PutObject')).toBe(1); // the test's own
  });

  test("as the converter's OutputTarget: committed on success, nothing left on failure", async () => {
    const { s3 } = client();
    const bytes = pseudoRandomBytes(7 * MiB, 8);
    let stored: StoredObject | null = null;
    const good = s3OutputTarget(s3, bucket, 'artifacts/target/model.m', { partSize: PART, onStored: (s) => (stored = s) });
    expect(good.name).toBe(`s3://${bucket}/artifacts/target/model.m`);
    const n = await writeFileAtomically(good, async (sink) => {
      await sink.write(bytes);
      return sink.bytesWritten;
    });
    expect(n).toBe(bytes.length);
    expect(stored).toEqual({ key: 'artifacts/target/model.m', bytes: bytes.length, sha256: sha256Hex(bytes) });
    await expectStored(s3, 'artifacts/target/model.m', bytes);

    const bad = s3OutputTarget(s3, bucket, 'artifacts/target/broken.m', { partSize: PART });
    await expect(
      writeFileAtomically(bad, async (sink) => {
        await sink.write(bytes);
        throw new Error('converter failed');
      }),
    ).rejects.toThrow('converter failed');
    await expectAbsent(s3, 'artifacts/target/broken.m');
  });
});

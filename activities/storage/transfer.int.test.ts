/**
 * transferToS3 against the real S3 server (s3proxy) of the test harness, with sources we control: a buffer in
 * memory, or a local HTTP server that honours Range and can cut a response short.
 */
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import {
  AbortMultipartUploadCommand,
  CreateBucketCommand,
  CreateMultipartUploadCommand,
  HeadObjectCommand,
  PutObjectCommand,
  UploadPartCommand,
  type S3Client,
} from '@aws-sdk/client-s3';
import { isolation, s3Client } from '../../test/harness';
import { listIncompleteUploads } from './cleanup';
import { isStorageError } from './errors';
import { calls, getObjectBytes, logCalls, memorySource, pseudoRandomBytes, sha256Hex } from '../../test/harness/storage';
import { transferToS3, type TransferCheckpoint, type TransferOptions } from './transfer';

const MiB = 1024 * 1024;
const PART = 5 * MiB;
/** 23 MiB in 5 MiB parts: four full parts and a 3 MiB last one. */
const SIZE = 23 * MiB;
const PARTS = 5;

const { bucket } = isolation();
const data = pseudoRandomBytes(SIZE, 7);
const dataSha = sha256Hex(data);
let keyCounter = 0;
const newKey = (name: string): string => `sources/org/model/${'0'.repeat(39)}${++keyCounter}/${name}`;

const clients: S3Client[] = [];
afterAll(() => clients.forEach((c) => c.destroy()));

/** A fresh client whose calls are logged (hooks as in logCalls). */
function client(hooks?: Parameters<typeof logCalls>[1]): { s3: S3Client; log: ReturnType<typeof logCalls> } {
  const s3 = s3Client();
  clients.push(s3);
  return { s3, log: logCalls(s3, hooks) };
}

function base(s3: S3Client, key: string, source: { open: TransferOptions['open'] }): TransferOptions {
  return { s3, bucket, key, size: SIZE, sha256: dataSha, open: source.open, partSize: PART, concurrency: 2 };
}

async function expectStored(key: string, bytes: Buffer, sha: string): Promise<void> {
  const { s3 } = client();
  const head = await s3.send(new HeadObjectCommand({ Bucket: bucket, Key: key }));
  expect(head.ContentLength).toBe(bytes.length);
  expect(head.Metadata?.sha256).toBe(sha);
  const stored = await getObjectBytes(s3, bucket, key);
  expect(stored.length).toBe(bytes.length);
  expect(sha256Hex(stored)).toBe(sha);
  expect(stored.equals(bytes)).toBe(true);
  expect(await listIncompleteUploads(s3, bucket, key)).toEqual([]);
}

async function caught(p: Promise<unknown>): Promise<Record<string, unknown>> {
  try {
    await p;
  } catch (err) {
    return err as Record<string, unknown>;
  }
  throw new Error('expected a rejection');
}

beforeAll(async () => {
  await client().s3.send(new CreateBucketCommand({ Bucket: bucket }));
});

describe('transferToS3', () => {
  const firstKey = newKey('model.safetensors');

  test('copies a multi-part file byte for byte, with its sha256 as metadata, and skips it the second time', async () => {
    const { s3, log } = client();
    const source = memorySource(data);
    const checkpoints: TransferCheckpoint[] = [];
    const progress: number[] = [];
    const result = await transferToS3({ ...base(s3, firstKey, source), onCheckpoint: (cp) => checkpoints.push(cp), onProgress: (b) => progress.push(b) });

    expect(result).toEqual({ key: firstKey, bytes: SIZE, sha256: dataSha, partsUploaded: PARTS, partsReused: 0, skipped: false });
    expect(calls(log, 'UploadPart')).toBe(PARTS);
    expect(calls(log, 'CreateMultipartUpload')).toBe(1);
    expect(calls(log, 'CompleteMultipartUpload')).toBe(1);
    expect(calls(log, 'CopyObject')).toBe(0); // metadata was set when the upload was created
    expect(log.maxInFlight.UploadPartCommand).toBeLessThanOrEqual(2);
    expect(source.opens).toEqual([0]);
    // The committed prefix only grows, ends at the whole file, and each hash state is a saved state.
    const committed = checkpoints.map((c) => c.committedPart);
    expect(committed).toEqual([...committed].sort((a, b) => a - b));
    expect(checkpoints.at(-1)).toMatchObject({ committedPart: PARTS, bytes: SIZE, partSize: PART });
    for (const c of checkpoints) expect(c.bytes).toBe(Math.min(c.committedPart * PART, SIZE));
    expect(progress.at(-1)).toBe(SIZE);
    await expectStored(firstKey, data, dataSha);

    // Same key again: the complete object is recognised by its metadata; nothing is read or sent.
    const again = client();
    const source2 = memorySource(data);
    const second = await transferToS3(base(again.s3, firstKey, source2));
    expect(second).toEqual({ key: firstKey, bytes: SIZE, sha256: dataSha, partsUploaded: 0, partsReused: 0, skipped: true });
    expect(calls(again.log, 'UploadPart')).toBe(0);
    expect(calls(again.log, 'PutObject')).toBe(0);
    expect(calls(again.log, 'CreateMultipartUpload')).toBe(0);
    expect(source2.opens).toEqual([]);
  });

  test('resumes from its checkpoint after an abort: reads from the committed offset, sends no part twice except the one in flight', async () => {
    const key = newKey('resume-checkpoint.bin');
    // Part 3 is held back until part 4 is done; then the transfer is aborted. The committed prefix
    // is parts 1–2 (part 4 finished beyond it, part 3 was in flight).
    const stop = new AbortController();
    let part4Done!: () => void;
    const part4 = new Promise<void>((r) => (part4Done = r));
    const first = client({
      before: async (cmd, input) => {
        if (cmd === 'UploadPartCommand' && input.PartNumber === 3) await part4;
      },
      after: (cmd, input) => {
        if (cmd === 'UploadPartCommand' && input.PartNumber === 4) {
          stop.abort(new Error('stopped by the test'));
          part4Done();
        }
      },
    });
    const checkpoints: TransferCheckpoint[] = [];
    const err = await caught(transferToS3({ ...base(first.s3, key, memorySource(data)), signal: stop.signal, onCheckpoint: (cp) => checkpoints.push(cp) }));
    expect(err.message).toBe('stopped by the test');
    const cp = checkpoints.at(-1) as TransferCheckpoint;
    expect(cp).toMatchObject({ committedPart: 2, bytes: 2 * PART, partSize: PART });
    expect(JSON.parse(JSON.stringify(cp))).toEqual(cp); // heartbeat-safe
    expect(first.log.uploadedParts.sort()).toEqual([1, 2, 3, 4]);
    expect(await listIncompleteUploads(first.s3, bucket, key)).toHaveLength(1); // kept for the retry

    const second = client();
    const source = memorySource(data);
    const result = await transferToS3({ ...base(second.s3, key, source), resume: cp });
    expect(source.opens).toEqual([2 * PART]);
    expect(source.bytesYielded).toBe(SIZE - 2 * PART);
    expect(result).toMatchObject({ bytes: SIZE, sha256: dataSha, partsUploaded: 2, partsReused: 1, skipped: false });
    expect(second.log.uploadedParts.sort()).toEqual([3, 5]);
    expect(calls(second.log, 'CreateMultipartUpload')).toBe(0);
    // Every part once, plus at most the parts in flight at the abort (here: part 3).
    const total = calls(first.log, 'UploadPart') + calls(second.log, 'UploadPart');
    expect(total).toBe(PARTS + 1);
    expect(total).toBeLessThanOrEqual(PARTS + 2);
    await expectStored(key, data, dataSha);
  });

  test('resumes after the source broke off mid-stream (local HTTP server), reopening at the committed offset', async () => {
    const key = newKey('resume-http.bin');
    const ranges: number[] = [];
    let requests = 0;
    const server: Server = createServer((req, res) => {
      const start = Number(/^bytes=(\d+)-$/.exec(req.headers.range ?? '')?.[1] ?? 0);
      ranges.push(start);
      const cutAt = ++requests === 1 ? 12 * MiB + 1234 : Infinity; // the first response dies mid-part-3
      res.writeHead(start > 0 ? 206 : 200, { 'content-length': String(SIZE - start) });
      let pos = start;
      const pump = (): void => {
        while (pos < SIZE) {
          if (pos >= cutAt) {
            res.destroy();
            return;
          }
          const end = Math.min(SIZE, pos + 256 * 1024, cutAt);
          const ok = res.write(data.subarray(pos, end));
          pos = end;
          if (!ok) {
            res.once('drain', pump);
            return;
          }
        }
        res.end();
      };
      pump();
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/file`;
    const open: TransferOptions['open'] = async (offset, signal) => {
      const res = await fetch(url, { headers: offset > 0 ? { range: `bytes=${offset}-` } : {}, signal });
      if (!res.ok || !res.body) throw new Error(`source answered ${res.status}`);
      return res.body;
    };
    try {
      const first = client();
      const checkpoints: TransferCheckpoint[] = [];
      const err = await caught(transferToS3({ ...base(first.s3, key, { open }), onCheckpoint: (cp) => checkpoints.push(cp) }));
      expect(isStorageError(err)).toBe(false); // a transport error, as the source raised it: retry
      const cp = checkpoints.at(-1) as TransferCheckpoint;
      expect(cp.committedPart).toBe(2); // parts 1 and 2 were complete when the stream died in part 3
      expect(calls(first.log, 'UploadPart')).toBe(2);

      const second = client();
      const result = await transferToS3({ ...base(second.s3, key, { open }), resume: cp });
      expect(ranges).toEqual([0, cp.bytes]);
      expect(result).toMatchObject({ sha256: dataSha, partsUploaded: PARTS - 2, partsReused: 0 });
      expect(calls(first.log, 'UploadPart') + calls(second.log, 'UploadPart')).toBe(PARTS);
      await expectStored(key, data, dataSha);
    } finally {
      await new Promise<void>((r) => server.close(() => r()));
    }
  });

  test("without a checkpoint, adopts the key's in-progress upload: re-reads from 0, sends only parts that differ, aborts stale uploads", async () => {
    const key = newKey('resume-listing.bin');
    const stop = new AbortController();
    const first = client({
      after: (cmd, input) => {
        if (cmd === 'UploadPartCommand' && input.PartNumber === 3) stop.abort(new Error('stopped'));
      },
    });
    await caught(transferToS3({ ...base(first.s3, key, memorySource(data)), concurrency: 1, signal: stop.signal }));
    const [upload] = await listIncompleteUploads(first.s3, bucket, key);
    expect(upload).toBeDefined();
    // Part 2 on the server now holds other bytes of the same size: its ETag no longer matches.
    await first.s3.send(new UploadPartCommand({ Bucket: bucket, Key: key, UploadId: upload?.uploadId, PartNumber: 2, Body: pseudoRandomBytes(PART, 99) }));
    // And a stale empty upload of the same key, which must be aborted.
    await first.s3.send(new CreateMultipartUploadCommand({ Bucket: bucket, Key: key }));
    expect(await listIncompleteUploads(first.s3, bucket, key)).toHaveLength(2);

    const second = client();
    const source = memorySource(data);
    const result = await transferToS3({ ...base(second.s3, key, source), resume: null });
    expect(source.opens).toEqual([0]);
    expect(result).toMatchObject({ sha256: dataSha, partsReused: 2, partsUploaded: 3 });
    expect(second.log.uploadedParts.sort()).toEqual([2, 4, 5]);
    expect(calls(second.log, 'CreateMultipartUpload')).toBe(0);
    expect(calls(second.log, 'AbortMultipartUpload')).toBe(1);
    await expectStored(key, data, dataSha);
  });

  test('a checkpoint whose upload was aborted meanwhile restarts cleanly', async () => {
    const key = newKey('resume-gone.bin');
    const stop = new AbortController();
    const first = client({
      after: (cmd, input) => {
        if (cmd === 'UploadPartCommand' && input.PartNumber === 2) stop.abort(new Error('stopped'));
      },
    });
    const checkpoints: TransferCheckpoint[] = [];
    await caught(transferToS3({ ...base(first.s3, key, memorySource(data)), concurrency: 1, signal: stop.signal, onCheckpoint: (cp) => checkpoints.push(cp) }));
    const cp = checkpoints.at(-1) as TransferCheckpoint;
    expect(cp.committedPart).toBe(2);
    await first.s3.send(new AbortMultipartUploadCommand({ Bucket: bucket, Key: key, UploadId: cp.uploadId }));

    const second = client();
    const source = memorySource(data);
    const result = await transferToS3({ ...base(second.s3, key, source), resume: cp });
    expect(source.opens).toEqual([0]);
    expect(result).toMatchObject({ sha256: dataSha, partsUploaded: PARTS, partsReused: 0 });
    expect(calls(second.log, 'CreateMultipartUpload')).toBe(1);
    await expectStored(key, data, dataSha);
  });

  test('a corrupted byte fails with ChecksumMismatch and leaves neither an object nor an incomplete upload', async () => {
    const key = newKey('corrupt.bin');
    const corrupt = Buffer.from(data);
    corrupt.writeUInt8(corrupt.readUInt8(17 * MiB + 5) ^ 0x40, 17 * MiB + 5);
    const { s3 } = client();
    const err = await caught(transferToS3(base(s3, key, memorySource(corrupt))));
    expect(err).toMatchObject({ name: 'StorageError', code: 'ChecksumMismatch', permanent: true });
    expect(err.message).toContain(dataSha);
    expect(await listIncompleteUploads(s3, bucket, key)).toEqual([]);
    await expect(s3.send(new HeadObjectCommand({ Bucket: bucket, Key: key }))).rejects.toMatchObject({ name: 'NotFound' });

    // The same for a file small enough for one PutObject.
    const small = newKey('corrupt-small.json');
    const smallCorrupt = Buffer.from(data.subarray(0, 1000));
    smallCorrupt.writeUInt8(smallCorrupt.readUInt8(500) ^ 1, 500);
    const err2 = await caught(transferToS3({ ...base(s3, small, memorySource(smallCorrupt)), size: 1000, sha256: sha256Hex(data.subarray(0, 1000)) }));
    expect(err2).toMatchObject({ name: 'StorageError', code: 'ChecksumMismatch' });
    await expect(s3.send(new HeadObjectCommand({ Bucket: bucket, Key: small }))).rejects.toMatchObject({ name: 'NotFound' });
  });

  test('a source that ends early fails with a retryable SizeMismatch and keeps the upload; the retry resumes and completes', async () => {
    const key = newKey('short.bin');
    const { s3, log } = client();
    const checkpoints: TransferCheckpoint[] = [];
    const err = await caught(transferToS3({ ...base(s3, key, memorySource(data.subarray(0, SIZE - 1000))), onCheckpoint: (cp) => checkpoints.push(cp) }));
    expect(err).toMatchObject({ name: 'StorageError', code: 'SizeMismatch', permanent: false });
    expect(await listIncompleteUploads(s3, bucket, key)).toHaveLength(1);
    const cp = checkpoints.at(-1) as TransferCheckpoint;
    expect(cp.committedPart).toBe(PARTS - 1);
    expect(calls(log, 'UploadPart')).toBe(PARTS - 1);

    const source = memorySource(data);
    const result = await transferToS3({ ...base(s3, key, source), resume: cp });
    expect(source.opens).toEqual([4 * PART]);
    expect(result).toMatchObject({ partsUploaded: 1, partsReused: 0 });
    await expectStored(key, data, dataSha);
  });

  test('a source with more bytes than listed fails with a permanent SizeMismatch and aborts the upload', async () => {
    const key = newKey('long.bin');
    const { s3 } = client();
    const longer = Buffer.concat([data, Buffer.from([1])]);
    const err = await caught(transferToS3(base(s3, key, memorySource(longer))));
    expect(err).toMatchObject({ name: 'StorageError', code: 'SizeMismatch', permanent: true });
    expect(await listIncompleteUploads(s3, bucket, key)).toEqual([]);

    const small = newKey('long-small.json');
    const err2 = await caught(transferToS3({ ...base(s3, small, memorySource(data.subarray(0, 1001))), size: 1000, sha256: null }));
    expect(err2).toMatchObject({ name: 'StorageError', code: 'SizeMismatch', permanent: true });
    const err3 = await caught(transferToS3({ ...base(s3, small, memorySource(data.subarray(0, 999))), size: 1000, sha256: null }));
    expect(err3).toMatchObject({ name: 'StorageError', code: 'SizeMismatch', permanent: false });
  });

  test('without an expected sha256 it computes and stores one (one PutObject when small, a metadata copy when multipart), then skips', async () => {
    const { s3, log } = client();
    const small = newKey('config.json');
    const smallBytes = Buffer.from(JSON.stringify({ hidden_size: 64, note: 'x'.repeat(1000) }));
    const r1 = await transferToS3({ ...base(s3, small, memorySource(smallBytes)), size: smallBytes.length, sha256: null });
    expect(r1).toMatchObject({ bytes: smallBytes.length, sha256: sha256Hex(smallBytes), partsUploaded: 1, skipped: false });
    expect(calls(log, 'PutObject')).toBe(1);
    expect(calls(log, 'CreateMultipartUpload')).toBe(0);
    await expectStored(small, smallBytes, sha256Hex(smallBytes));

    const big = newKey('unlisted.bin');
    const r2 = await transferToS3({ ...base(s3, big, memorySource(data)), sha256: null });
    expect(r2).toMatchObject({ sha256: dataSha, partsUploaded: PARTS });
    expect(calls(log, 'CopyObject')).toBe(1);
    await expectStored(big, data, dataSha);

    const r3 = await transferToS3({ ...base(s3, big, memorySource(data)), sha256: null });
    const r4 = await transferToS3({ ...base(s3, small, memorySource(smallBytes)), size: smallBytes.length, sha256: sha256Hex(smallBytes) });
    expect([r3.skipped, r4.skipped]).toEqual([true, true]);
  });

  test('an empty file is stored (and recognised afterwards)', async () => {
    const { s3 } = client();
    const key = newKey('empty.txt');
    const empty = Buffer.alloc(0);
    const r = await transferToS3({ ...base(s3, key, memorySource(empty)), size: 0, sha256: sha256Hex(empty) });
    expect(r).toMatchObject({ bytes: 0, skipped: false });
    await expectStored(key, empty, sha256Hex(empty));
    expect((await transferToS3({ ...base(s3, key, memorySource(empty)), size: 0, sha256: sha256Hex(empty) })).skipped).toBe(true);
  });

  test('an object at the key with another sha256 is replaced, not taken for ours', async () => {
    const { s3 } = client();
    const key = newKey('replaced.bin');
    await s3.send(new PutObjectCommand({ Bucket: bucket, Key: key, Body: data.subarray(0, SIZE), Metadata: { sha256: 'f'.repeat(64) } }));
    const r = await transferToS3(base(s3, key, memorySource(data)));
    expect(r).toMatchObject({ skipped: false, partsUploaded: PARTS });
    await expectStored(key, data, dataSha);
  });

  test('rejects bad arguments before touching S3, and honours an already-aborted signal', async () => {
    const { s3, log } = client();
    const key = newKey('args.bin');
    expect(await caught(transferToS3({ ...base(s3, key, memorySource(data)), sha256: 'xyz' }))).toMatchObject({ code: 'InvalidArgument' });
    expect(await caught(transferToS3({ ...base(s3, key, memorySource(data)), partSize: MiB }))).toMatchObject({ code: 'InvalidArgument' });
    expect(await caught(transferToS3({ ...base(s3, key, memorySource(data)), size: -1 }))).toMatchObject({ code: 'InvalidArgument' });
    const err = await caught(transferToS3({ ...base(s3, key, memorySource(data)), signal: AbortSignal.abort(new Error('cancelled')) }));
    expect(err.message).toBe('cancelled');
    expect(Object.values(log.counts).reduce((a, b) => a + b, 0)).toBe(0);
  });
});

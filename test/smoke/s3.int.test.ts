import {
  CompleteMultipartUploadCommand,
  CreateBucketCommand,
  CreateMultipartUploadCommand,
  GetObjectCommand,
  HeadObjectCommand,
  ListMultipartUploadsCommand,
  ListPartsCommand,
  UploadPartCommand,
  type S3Client,
} from '@aws-sdk/client-s3';
import { createHash } from 'node:crypto';
import { isolation, s3Client } from '../harness';

const MiB = 1024 * 1024;
let s3: S3Client;
const iso = isolation();

beforeAll(async () => {
  s3 = s3Client();
  await s3.send(new CreateBucketCommand({ Bucket: iso.bucket }));
});
afterAll(() => s3.destroy());

/** Deterministic, non-repeating content so a misplaced byte range is caught. */
function partBytes(part: number, size: number): Buffer {
  const buf = Buffer.alloc(size);
  for (let i = 0; i < size; i += 32) createHash('sha256').update(`${part}:${i}`).digest().copy(buf, i);
  return buf;
}

test('multipart upload with 3 parts, ListParts, and ranged GET', async () => {
  const Key = 'sources/org/model/abc123/model.safetensors';
  const parts = [partBytes(1, 5 * MiB), partBytes(2, 5 * MiB), partBytes(3, 1234)];
  const whole = Buffer.concat(parts);
  const { UploadId } = await s3.send(new CreateMultipartUploadCommand({ Bucket: iso.bucket, Key }));
  expect(UploadId).toBeTruthy();

  const etags: string[] = [];
  for (const [i, body] of parts.entries()) {
    const r = await s3.send(new UploadPartCommand({ Bucket: iso.bucket, Key, UploadId, PartNumber: i + 1, Body: body }));
    etags.push(r.ETag ?? '');
  }

  // An interrupted uploader resumes from ListParts: the server must report what it holds.
  const listed = await s3.send(new ListPartsCommand({ Bucket: iso.bucket, Key, UploadId }));
  expect(listed.Parts?.map((p) => [p.PartNumber, p.Size, p.ETag])).toEqual(parts.map((b, i) => [i + 1, b.length, etags[i]]));
  const inFlight = await s3.send(new ListMultipartUploadsCommand({ Bucket: iso.bucket }));
  expect(inFlight.Uploads?.map((u) => u.UploadId)).toContain(UploadId);

  await s3.send(
    new CompleteMultipartUploadCommand({
      Bucket: iso.bucket,
      Key,
      UploadId,
      MultipartUpload: { Parts: etags.map((ETag, i) => ({ ETag, PartNumber: i + 1 })) },
    }),
  );
  const head = await s3.send(new HeadObjectCommand({ Bucket: iso.bucket, Key }));
  expect(head.ContentLength).toBe(whole.length);

  // A range that straddles the boundary between parts 1 and 2.
  const start = 5 * MiB - 100;
  const end = 5 * MiB + 99;
  const got = await s3.send(new GetObjectCommand({ Bucket: iso.bucket, Key, Range: `bytes=${start}-${end}` }));
  expect(got.ContentRange).toBe(`bytes ${start}-${end}/${whole.length}`);
  const body = Buffer.from(await got.Body!.transformToByteArray());
  expect(body.equals(whole.subarray(start, end + 1))).toBe(true);

  const full = Buffer.from(await (await s3.send(new GetObjectCommand({ Bucket: iso.bucket, Key }))).Body!.transformToByteArray());
  expect(createHash('sha256').update(full).digest('hex')).toBe(createHash('sha256').update(whole).digest('hex'));
});

/** abortStaleUploads / listIncompleteUploads against the real S3 server of the test harness. */
import { CreateBucketCommand, CreateMultipartUploadCommand } from '@aws-sdk/client-s3';
import { isolation, s3Client } from '../../test/harness';
import { sleep } from '../../test/harness/wait';
import { abortStaleUploads, listIncompleteUploads } from './cleanup';

const { bucket } = isolation();
const s3 = s3Client();

beforeAll(async () => {
  await s3.send(new CreateBucketCommand({ Bucket: bucket }));
});
afterAll(() => s3.destroy());

test('lists incomplete uploads under a prefix and aborts only those older than the cutoff', async () => {
  const keys = ['sources/a/1/x.bin', 'sources/a/1/y.bin', 'sources/a/1/y.bin', 'artifacts/a/1/z.gguf'];
  for (const Key of keys) await s3.send(new CreateMultipartUploadCommand({ Bucket: bucket, Key }));

  const sources = await listIncompleteUploads(s3, bucket, 'sources/');
  expect(sources.map((u) => u.key).sort()).toEqual(['sources/a/1/x.bin', 'sources/a/1/y.bin', 'sources/a/1/y.bin']);
  for (const u of sources) expect(u.initiated).toBeInstanceOf(Date);
  expect(await listIncompleteUploads(s3, bucket)).toHaveLength(4);
  expect(await listIncompleteUploads(s3, bucket, 'sources/a/1/y.bin')).toHaveLength(2);

  // Nothing is an hour old yet.
  expect(await abortStaleUploads(s3, bucket, { prefix: 'sources/', olderThanMs: 3_600_000 })).toBe(0);
  // An hour later, the ones under the prefix are.
  expect(await abortStaleUploads(s3, bucket, { prefix: 'sources/', olderThanMs: 3_600_000, now: Date.now() + 3_600_000 + 60_000 })).toBe(3);
  expect(await listIncompleteUploads(s3, bucket, 'sources/')).toEqual([]);
  expect((await listIncompleteUploads(s3, bucket)).map((u) => u.key)).toEqual(['artifacts/a/1/z.gguf']);
});

test("an upload's start is when it was created, not when it is listed: a cleanup on the real clock finds it", async () => {
  const Key = 'sources/b/1/old.bin';
  const before = Date.now();
  await s3.send(new CreateMultipartUploadCommand({ Bucket: bucket, Key }));
  await sleep(2500);
  const [upload] = await listIncompleteUploads(s3, bucket, Key);
  // S3 reports whole seconds: within a second of the creation, and well before this listing.
  expect(upload!.initiated!.getTime()).toBeGreaterThanOrEqual(before - 1000);
  expect(upload!.initiated!.getTime()).toBeLessThan(Date.now() - 1000);
  expect(await abortStaleUploads(s3, bucket, { prefix: 'sources/b/', olderThanMs: 1000 })).toBe(1);
  expect(await listIncompleteUploads(s3, bucket, 'sources/b/')).toEqual([]);
});

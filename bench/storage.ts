/**
 * Throughput of {@link transferToS3} against a local MinIO, next to two baselines on the same
 * bytes: a plain streamed copy to a local file (`stream.pipeline`, fsynced), and a bare multipart
 * upload with the same part size and concurrency but no hashing, checkpoints or checks.
 *
 *   node -r @swc-node/register bench/storage.ts
 *
 * Environment: BENCH_MB (default 200), BENCH_RUNS (default 3), BENCH_PART_MB (16), BENCH_CONCURRENCY (4).
 */
import { createReadStream, createWriteStream } from 'node:fs';
import { mkdtemp, open, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { pipeline } from 'node:stream/promises';
import { CreateBucketCommand, DeleteObjectCommand, S3Client } from '@aws-sdk/client-s3';
import { startServices } from '../workers/dev/services';
import { MIB, PartUploader, completeUpload, createUpload } from '../activities/storage/multipart';
import { pseudoRandomBytes, sha256Hex } from '../test/harness/storage';
import { transferToS3 } from '../activities/storage/transfer';

const sizeMb = Number(process.env.BENCH_MB ?? 200);
const runs = Number(process.env.BENCH_RUNS ?? 3);
const partSize = Number(process.env.BENCH_PART_MB ?? 16) * MIB;
const concurrency = Number(process.env.BENCH_CONCURRENCY ?? 4);

async function time(fn: () => Promise<void>): Promise<number> {
  const t0 = process.hrtime.bigint();
  await fn();
  return Number(process.hrtime.bigint() - t0) / 1e9;
}

async function main(): Promise<void> {
  const services = await startServices({ services: ['s3'] });
  const dir = await mkdtemp(join(tmpdir(), 'magus-storage-bench-'));
  try {
    const e = services.endpoints.s3!;
    const s3 = new S3Client({
      endpoint: e.endpoint,
      region: e.region,
      forcePathStyle: true,
      credentials: { accessKeyId: e.accessKeyId, secretAccessKey: e.secretAccessKey },
    });
    const bucket = 'bench';
    await s3.send(new CreateBucketCommand({ Bucket: bucket }));
    const size = sizeMb * 1e6;
    const src = join(dir, 'source.bin');
    const data = pseudoRandomBytes(size, 42);
    const sha = sha256Hex(data);
    await writeFile(src, data);
    const mbps = (s: number): string => `${(size / 1e6 / s).toFixed(0)} MB/s`;

    const results: Record<string, number[]> = { 'plain copy to a local file (fsync)': [], 'bare multipart upload (no hashing)': [], transferToS3: [] };
    for (let r = 0; r < runs; r++) {
      results['plain copy to a local file (fsync)']!.push(
        await time(async () => {
          const dst = join(dir, `copy-${r}.bin`);
          await pipeline(createReadStream(src, { highWaterMark: MIB }), createWriteStream(dst));
          const fh = await open(dst, 'r+');
          await fh.sync();
          await fh.close();
          await rm(dst);
        }),
      );
      results['bare multipart upload (no hashing)']!.push(
        await time(async () => {
          const ref = { s3, bucket, key: `bare-${r}` };
          const uploadId = await createUpload(ref, {}, 'application/octet-stream');
          const etags = new Map<number, string>();
          const up = new PartUploader(ref, uploadId, { concurrency, signal: new AbortController().signal, onUploaded: (n, etag) => etags.set(n, etag) });
          let part = Buffer.allocUnsafe(Math.min(partSize, size));
          let fill = 0;
          let n = 0;
          let offset = 0;
          for await (const chunk of createReadStream(src, { highWaterMark: MIB }) as AsyncIterable<Buffer>) {
            for (let pos = 0; pos < chunk.length;) {
              const take = Math.min(chunk.length - pos, part.length - fill);
              chunk.copy(part, fill, pos, pos + take);
              fill += take;
              pos += take;
              if (fill === part.length) {
                await up.submit(++n, part);
                offset += part.length;
                part = Buffer.allocUnsafe(Math.max(1, Math.min(partSize, size - offset)));
                fill = 0;
              }
            }
          }
          await up.drain();
          await completeUpload(ref, uploadId, etags);
        }),
      );
      results.transferToS3!.push(
        await time(async () => {
          const key = `transfer-${r}`;
          const res = await transferToS3({
            s3,
            bucket,
            key,
            size,
            sha256: sha,
            partSize,
            concurrency,
            open: (offset) => Promise.resolve(createReadStream(src, { start: offset, highWaterMark: MIB }) as AsyncIterable<Buffer>),
          });
          if (res.skipped || res.sha256 !== sha) throw new Error('unexpected result');
        }),
      );
      for (const k of [`bare-${r}`, `transfer-${r}`]) await s3.send(new DeleteObjectCommand({ Bucket: bucket, Key: k }));
    }
    console.log(`${sizeMb} MB, part ${partSize / MIB} MiB, concurrency ${concurrency}, ${runs} runs (median, best):`);
    for (const [name, secs] of Object.entries(results)) {
      const sorted = [...secs].sort((a, b) => a - b);
      console.log(`  ${name.padEnd(40)} ${mbps(sorted[Math.floor(sorted.length / 2)]!).padStart(10)} ${mbps(sorted[0]!).padStart(10)}`);
    }
    s3.destroy();
  } finally {
    await rm(dir, { recursive: true, force: true });
    await services.stop();
  }
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});

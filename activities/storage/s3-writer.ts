/**
 * A streaming writer of one S3 object: the S3 counterpart of write-to-temp-and-rename. Bytes go
 * into a multipart upload as they are written (bounded memory), the sha256 is computed on the
 * way, and the object appears only when `complete()` succeeds, with `x-amz-meta-sha256` set.
 * `abort()` aborts the upload and leaves nothing behind.
 *
 * Objects smaller than one part are sent with a single PutObject at `complete()`. For larger
 * ones the sha256 is only known after the last part, while S3 fixes metadata when the upload
 * starts, so `complete()` then sets it with a copy of the object onto itself (server-side; a
 * metadata-only update on MinIO).
 */
import { createHash, type Hash } from 'node:crypto';
import { DeleteObjectCommand, PutObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import type { ByteSink, OutputTarget } from '../../convert';
import type { StoredObject } from '../../shared/model';
import { StorageError } from './errors';
import {
  MAX_PART_SIZE,
  MIB,
  MIN_PART_SIZE,
  PartUploader,
  SHA256_METADATA,
  abortUpload,
  completeUpload,
  createUpload,
  linkedController,
  replaceMetadata,
  type ObjectRef,
} from './multipart';

export interface S3ObjectWriterOptions {
  /** Default 16 MiB, at least 5 MiB. Objects up to this size are sent with one PutObject. */
  partSize?: number;
  /** Parts uploading at once (default 4). Memory is bounded by partSize × (concurrency + 1). */
  concurrency?: number;
  /** Extra user metadata for the object (`sha256` is always ours). */
  metadata?: Record<string, string>;
  contentType?: string;
  /** Aborts every request (the activity's cancellation signal). */
  signal?: AbortSignal;
  /** Objects up to this size get their metadata with one CopyObject (default 5 GiB, S3's limit); tests lower it. */
  singleCopyLimit?: number;
}

export interface S3ObjectWriter {
  readonly sink: ByteSink;
  /** Uploads what is left and makes the object appear. Call `abort()` if this throws. */
  complete(): Promise<StoredObject>;
  /** Stops, aborts the upload, and waits for requests in flight. Safe to call more than once, and after a failure. */
  abort(): Promise<void>;
}

const DEFAULT_PART_SIZE = 16 * MIB;
const DEFAULT_CONCURRENCY = 4;

/** Starts writing `s3://bucket/key`; nothing is sent until a part is full or `complete()`. */
export function createS3ObjectWriter(s3: S3Client, bucket: string, key: string, opts: S3ObjectWriterOptions = {}): S3ObjectWriter {
  const ref: ObjectRef = { s3, bucket, key };
  const partSize = opts.partSize ?? DEFAULT_PART_SIZE;
  const concurrency = opts.concurrency ?? DEFAULT_CONCURRENCY;
  if (!Number.isSafeInteger(partSize) || partSize < MIN_PART_SIZE || partSize > MAX_PART_SIZE) {
    throw new StorageError('InvalidArgument', `${key}: part size ${partSize} must be an integer between 5 MiB and 5 GiB`, { permanent: true });
  }
  if (!Number.isInteger(concurrency) || concurrency < 1) {
    throw new StorageError('InvalidArgument', `${key}: concurrency ${concurrency} must be a positive integer`, { permanent: true });
  }
  const contentType = opts.contentType ?? 'application/octet-stream';
  const { controller, dispose } = linkedController(opts.signal);
  const hash: Hash = createHash('sha256');

  let state: 'open' | 'completing' | 'completed' | 'aborted' = 'open';
  let written = 0;
  let part: Buffer | null = null;
  let fill = 0;
  let partNumber = 0;
  let uploadId: string | null = null;
  let uploader: PartUploader | null = null;
  /** The multipart upload is complete but the object does not carry its sha256 yet. */
  let dataCommitted = false;
  const etags = new Map<number, string>();

  const started = async (): Promise<PartUploader> => {
    if (uploader) return uploader;
    uploadId = await createUpload(ref, { ...opts.metadata }, contentType, controller.signal);
    uploader = new PartUploader(ref, uploadId, {
      concurrency,
      signal: controller.signal,
      onUploaded: (n, etag) => etags.set(n, etag),
      onFailure: (err) => controller.abort(err),
    });
    return uploader;
  };

  /** Hashes and sends one full part (the hash sees parts in order: they are sent in order). */
  const sendPart = async (body: Uint8Array): Promise<void> => {
    hash.update(body);
    const up = await started();
    await up.submit(++partNumber, body);
  };

  const sink: ByteSink = {
    async write(chunk, wopts) {
      if (state !== 'open') throw new Error(`${key}: write after ${state}`);
      controller.signal.throwIfAborted();
      let pos = 0;
      // An owned chunk is sent in part-sized slices without a copy while no partial part is pending.
      if (wopts?.owned && fill === 0) {
        while (chunk.length - pos >= partSize) {
          await sendPart(chunk.subarray(pos, pos + partSize));
          pos += partSize;
          written += partSize;
        }
      }
      while (pos < chunk.length) {
        part ??= Buffer.allocUnsafe(partSize);
        const take = Math.min(chunk.length - pos, partSize - fill);
        part.set(pos === 0 && take === chunk.length ? chunk : chunk.subarray(pos, pos + take), fill);
        fill += take;
        pos += take;
        written += take;
        if (fill === partSize) {
          const full = part;
          part = null;
          fill = 0;
          await sendPart(full);
        }
      }
    },
    get bytesWritten() {
      return written;
    },
  };

  return {
    sink,
    async complete(): Promise<StoredObject> {
      if (state !== 'open') throw new Error(`${key}: complete after ${state}`);
      state = 'completing';
      const last = part ? part.subarray(0, fill) : Buffer.alloc(0);
      part = null;
      if (!uploader) {
        // Smaller than a part: one PutObject, metadata included.
        const sha256 = hash.update(last).digest('hex');
        await s3.send(
          new PutObjectCommand({
            Bucket: bucket,
            Key: key,
            Body: last,
            ContentLength: last.length,
            ContentType: contentType,
            Metadata: { ...opts.metadata, [SHA256_METADATA]: sha256 },
          }),
          { abortSignal: controller.signal },
        );
        state = 'completed';
        dispose();
        return { key, bytes: written, sha256 };
      }
      if (last.length > 0) await sendPart(last);
      await uploader.drain();
      const sha256 = hash.digest('hex');
      await completeUpload(ref, uploadId as string, etags, controller.signal);
      dataCommitted = true;
      await replaceMetadata(ref, written, { ...opts.metadata, [SHA256_METADATA]: sha256 }, contentType, {
        signal: controller.signal,
        singleCopyLimit: opts.singleCopyLimit,
      });
      state = 'completed';
      dispose();
      return { key, bytes: written, sha256 };
    },
    async abort(): Promise<void> {
      if (state === 'completed' || state === 'aborted') return;
      state = 'aborted';
      part = null;
      controller.abort(new Error(`${key}: write aborted`));
      await uploader?.settle();
      dispose();
      if (uploadId) await abortUpload(ref, uploadId);
      // Completed but never stamped with its sha256: remove it rather than leave an object that
      // looks finished by size alone.
      if (dataCommitted) await s3.send(new DeleteObjectCommand({ Bucket: bucket, Key: key }));
    },
  };
}

/**
 * The writer as the converter's {@link OutputTarget}: each `create()` starts a new object write;
 * `commit()` completes it and hands the stored object to `onStored`.
 */
export function s3OutputTarget(
  s3: S3Client,
  bucket: string,
  key: string,
  opts: S3ObjectWriterOptions & { onStored?: (stored: StoredObject) => void } = {},
): OutputTarget {
  return {
    name: `s3://${bucket}/${key}`,
    create() {
      const w = createS3ObjectWriter(s3, bucket, key, opts);
      return Promise.resolve({
        sink: w.sink,
        async commit() {
          opts.onStored?.(await w.complete());
        },
        abort: () => w.abort(),
      });
    },
  };
}

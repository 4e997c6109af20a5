/**
 * Building blocks shared by the transfer, the object writer and the cleanup: S3 error
 * classification, paginated listings of uploads and parts, and {@link PartUploader}, which keeps
 * a bounded number of `UploadPart` requests in flight.
 */
import {
  AbortMultipartUploadCommand,
  CopyObjectCommand,
  CreateMultipartUploadCommand,
  CompleteMultipartUploadCommand,
  HeadObjectCommand,
  ListMultipartUploadsCommand,
  ListPartsCommand,
  UploadPartCommand,
  UploadPartCopyCommand,
  type S3Client,
} from '@aws-sdk/client-s3';
import { crc32 } from 'node:zlib';
import { StorageError } from './errors';

export const MIB = 1024 * 1024;
/** S3's smallest part, except the last one. */
export const MIN_PART_SIZE = 5 * MIB;
/** S3's largest part, and the largest object a single CopyObject may copy. */
export const MAX_PART_SIZE = 5 * 1024 * MIB;
/** S3's part-number ceiling. */
export const MAX_PARTS = 10_000;
/** Metadata key (`x-amz-meta-sha256`) holding the hex sha256 of a complete object we wrote. */
export const SHA256_METADATA = 'sha256';

const SHA256_HEX = /^[0-9a-f]{64}$/;

/** Where an object lives. */
export interface ObjectRef {
  s3: S3Client;
  bucket: string;
  key: string;
}

/** True for S3's "this upload does not exist (any more)". */
export function isNoSuchUpload(err: unknown): boolean {
  const e = err as { name?: unknown; Code?: unknown } | null;
  return e?.name === 'NoSuchUpload' || e?.Code === 'NoSuchUpload';
}

/** True for a missing object (HeadObject answers a bare 404, GetObject `NoSuchKey`). */
export function isNoSuchKey(err: unknown): boolean {
  const e = err as { name?: unknown; $metadata?: { httpStatusCode?: number } } | null;
  return e?.name === 'NotFound' || e?.name === 'NoSuchKey' || (e?.$metadata?.httpStatusCode === 404 && !isNoSuchUpload(err));
}

/** A part as S3 lists it; `etag` keeps its quotes, as CompleteMultipartUpload wants it back. */
export interface PartInfo {
  size: number;
  etag: string;
}

/** What HeadObject tells us about an object. */
export interface ObjectInfo {
  size: number;
  /** Our `sha256` metadata (lowercase hex), or null when absent or malformed. */
  sha256: string | null;
  metadata: Record<string, string>;
}

/** The object's size and sha256 metadata, or null when it does not exist. */
export async function headObject(ref: ObjectRef, signal?: AbortSignal): Promise<ObjectInfo | null> {
  try {
    const head = await ref.s3.send(new HeadObjectCommand({ Bucket: ref.bucket, Key: ref.key }), { abortSignal: signal });
    const metadata = head.Metadata ?? {};
    const sha = metadata[SHA256_METADATA]?.toLowerCase() ?? null;
    return { size: head.ContentLength ?? 0, sha256: sha !== null && SHA256_HEX.test(sha) ? sha : null, metadata };
  } catch (err) {
    if (isNoSuchKey(err)) return null;
    throw err;
  }
}

/** Validates a sha256 argument and returns it lowercased. */
export function normalizeSha256(sha256: string, what: string): string {
  const sha = sha256.toLowerCase();
  if (!SHA256_HEX.test(sha)) throw new StorageError('InvalidArgument', `${what}: ${JSON.stringify(sha256)} is not a hex sha256`, { permanent: true });
  return sha;
}

/** Every part of an upload by part number, or null when the upload does not exist. */
export async function listAllParts(ref: ObjectRef, uploadId: string, signal?: AbortSignal): Promise<Map<number, PartInfo> | null> {
  const parts = new Map<number, PartInfo>();
  let marker: string | undefined;
  try {
    for (;;) {
      const page = await ref.s3.send(new ListPartsCommand({ Bucket: ref.bucket, Key: ref.key, UploadId: uploadId, PartNumberMarker: marker }), {
        abortSignal: signal,
      });
      for (const p of page.Parts ?? []) {
        if (p.PartNumber !== undefined && p.ETag !== undefined && p.Size !== undefined) parts.set(p.PartNumber, { size: p.Size, etag: p.ETag });
      }
      if (!page.IsTruncated || page.NextPartNumberMarker === undefined) return parts;
      marker = page.NextPartNumberMarker;
    }
  } catch (err) {
    if (isNoSuchUpload(err)) return null;
    throw err;
  }
}

/** An incomplete multipart upload. */
export interface IncompleteUpload {
  key: string;
  uploadId: string;
  /** When it was created, as the server reports it (null if it does not). */
  initiated: Date | null;
}

/**
 * Incomplete uploads of exactly `key` (`{ key }`) or of every key under a prefix (`{ prefix }`).
 *
 * MinIO answers `ListMultipartUploads` only for a prefix that is a whole object name (any other
 * prefix lists nothing), so prefix listings read every upload in the bucket and filter here.
 * Incomplete uploads are few, so this stays cheap.
 */
export async function listUploads(
  s3: S3Client,
  bucket: string,
  which: { key: string } | { prefix: string },
  signal?: AbortSignal,
): Promise<IncompleteUpload[]> {
  const exact = 'key' in which ? which.key : null;
  const prefix = 'key' in which ? which.key : which.prefix;
  const out: IncompleteUpload[] = [];
  let keyMarker: string | undefined;
  let uploadIdMarker: string | undefined;
  for (;;) {
    const page = await s3.send(
      new ListMultipartUploadsCommand({ Bucket: bucket, Prefix: exact ?? undefined, KeyMarker: keyMarker, UploadIdMarker: uploadIdMarker }),
      { abortSignal: signal },
    );
    for (const u of page.Uploads ?? []) {
      if (u.Key === undefined || u.UploadId === undefined) continue;
      if (exact !== null ? u.Key !== exact : !u.Key.startsWith(prefix)) continue;
      out.push({ key: u.Key, uploadId: u.UploadId, initiated: u.Initiated ?? null });
    }
    if (!page.IsTruncated) return out;
    // Guard against a server that says "truncated" without moving the markers.
    if (page.NextKeyMarker === keyMarker && page.NextUploadIdMarker === uploadIdMarker) return out;
    keyMarker = page.NextKeyMarker;
    uploadIdMarker = page.NextUploadIdMarker;
  }
}

/** Aborts an upload; one that is already gone counts as aborted. */
export async function abortUpload(ref: ObjectRef, uploadId: string, signal?: AbortSignal): Promise<void> {
  try {
    await ref.s3.send(new AbortMultipartUploadCommand({ Bucket: ref.bucket, Key: ref.key, UploadId: uploadId }), { abortSignal: signal });
  } catch (err) {
    if (!isNoSuchUpload(err)) throw err;
  }
}

/** Starts a multipart upload whose object will carry `metadata`. */
export async function createUpload(ref: ObjectRef, metadata: Record<string, string>, contentType: string, signal?: AbortSignal): Promise<string> {
  const out = await ref.s3.send(new CreateMultipartUploadCommand({ Bucket: ref.bucket, Key: ref.key, Metadata: metadata, ContentType: contentType }), {
    abortSignal: signal,
  });
  if (!out.UploadId) throw new Error(`s3://${ref.bucket}/${ref.key}: CreateMultipartUpload returned no upload id`);
  return out.UploadId;
}

/** Completes an upload from parts 1..`etags.size`. */
export async function completeUpload(ref: ObjectRef, uploadId: string, etags: Map<number, string>, signal?: AbortSignal): Promise<void> {
  const parts: { PartNumber: number; ETag: string }[] = [];
  for (let n = 1; n <= etags.size; n++) {
    const etag = etags.get(n);
    if (etag === undefined) throw new Error(`s3://${ref.bucket}/${ref.key}: part ${n} of ${etags.size} is missing at completion`);
    parts.push({ PartNumber: n, ETag: etag });
  }
  await ref.s3.send(new CompleteMultipartUploadCommand({ Bucket: ref.bucket, Key: ref.key, UploadId: uploadId, MultipartUpload: { Parts: parts } }), {
    abortSignal: signal,
  });
}

/**
 * Replaces an existing object's user metadata. S3 metadata is immutable, so this is a copy onto
 * itself: one CopyObject up to 5 GiB (MinIO then rewrites only the metadata), a multipart
 * `UploadPartCopy` beyond (server-side; no bytes pass through us).
 */
export async function replaceMetadata(
  ref: ObjectRef,
  size: number,
  metadata: Record<string, string>,
  contentType: string,
  opts: { signal?: AbortSignal; singleCopyLimit?: number; copyPartSize?: number } = {},
): Promise<void> {
  const source = `${ref.bucket}/${encodeURIComponent(ref.key).replace(/%2F/g, '/')}`;
  if (size <= (opts.singleCopyLimit ?? MAX_PART_SIZE)) {
    await ref.s3.send(
      new CopyObjectCommand({
        Bucket: ref.bucket,
        Key: ref.key,
        CopySource: source,
        MetadataDirective: 'REPLACE',
        Metadata: metadata,
        ContentType: contentType,
      }),
      { abortSignal: opts.signal },
    );
    return;
  }
  const partSize = Math.max(opts.copyPartSize ?? 1024 * MIB, Math.ceil(size / MAX_PARTS));
  const uploadId = await createUpload(ref, metadata, contentType, opts.signal);
  try {
    const etags = new Map<number, string>();
    for (let n = 1, start = 0; start < size; n++, start += partSize) {
      const end = Math.min(size, start + partSize) - 1;
      const out = await ref.s3.send(
        new UploadPartCopyCommand({
          Bucket: ref.bucket,
          Key: ref.key,
          UploadId: uploadId,
          PartNumber: n,
          CopySource: source,
          CopySourceRange: `bytes=${start}-${end}`,
        }),
        { abortSignal: opts.signal },
      );
      const etag = out.CopyPartResult?.ETag;
      if (!etag) throw new Error(`s3://${ref.bucket}/${ref.key}: UploadPartCopy returned no ETag`);
      etags.set(n, etag);
    }
    await completeUpload(ref, uploadId, etags, opts.signal);
  } catch (err) {
    await abortUpload(ref, uploadId).catch(() => undefined);
    throw err;
  }
}

/**
 * Keeps at most `concurrency` `UploadPart` requests of one upload in flight. {@link submit}
 * returns once the part is on its way (waiting for a free slot first), so a producer that fills
 * one buffer at a time holds at most `concurrency + 1` part buffers.
 *
 * The first failure is kept, `onFailure` is told (so the owner can abort the others), and every
 * later `submit`/`drain` throws it.
 */
export class PartUploader {
  /** Parts this uploader sent successfully. */
  uploaded = 0;
  private readonly inFlight = new Set<Promise<void>>();
  private failed: { error: unknown } | null = null;

  constructor(
    private readonly ref: ObjectRef,
    private readonly uploadId: string,
    private readonly opts: {
      concurrency: number;
      signal: AbortSignal;
      onUploaded: (partNumber: number, etag: string, bytes: number) => void;
      onFailure?: (err: unknown) => void;
      /** After each part's request ends, successfully or not: its buffer may be reused. */
      onSettled?: (partNumber: number) => void;
    },
  ) {}

  /** The first failure, if any. */
  get failure(): { error: unknown } | null {
    return this.failed;
  }

  /** Starts uploading `body` as part `partNumber` once fewer than `concurrency` parts are in flight. */
  async submit(partNumber: number, body: Uint8Array): Promise<void> {
    this.throwIfFailed();
    while (this.inFlight.size >= this.opts.concurrency) {
      await Promise.race(this.inFlight);
      this.throwIfFailed();
    }
    this.opts.signal.throwIfAborted();
    const task = this.upload(partNumber, body).catch((err: unknown) => {
      if (this.failed) return;
      this.failed = { error: err };
      this.opts.onFailure?.(err);
    });
    this.inFlight.add(task);
    void task.finally(() => {
      this.inFlight.delete(task);
      this.opts.onSettled?.(partNumber);
    });
  }

  /** Waits for every part in flight; throws the first failure. */
  async drain(): Promise<void> {
    await this.settle();
    this.throwIfFailed();
  }

  /** Waits for every part in flight, whatever their outcome. */
  async settle(): Promise<void> {
    while (this.inFlight.size > 0) await Promise.all(this.inFlight);
  }

  private throwIfFailed(): void {
    if (this.failed) throw this.failed.error;
  }

  private async upload(partNumber: number, body: Uint8Array): Promise<void> {
    const command = new UploadPartCommand({
      Bucket: this.ref.bucket,
      Key: this.ref.key,
      UploadId: this.uploadId,
      PartNumber: partNumber,
      Body: body,
      ContentLength: body.length,
      ChecksumCRC32: crc32Base64(body),
    });
    // SigV4 would otherwise hash every part with SHA-256 on this thread just to sign it; the
    // CRC32 above (native, several times faster) is what S3 verifies the bytes against instead.
    command.middlewareStack.add(
      (next) => (args) => {
        const headers = (args.request as { headers?: Record<string, string> }).headers;
        if (headers) headers['x-amz-content-sha256'] = 'UNSIGNED-PAYLOAD';
        return next(args);
      },
      { step: 'build', name: 'magusUnsignedPayload' },
    );
    const out = await this.ref.s3.send(command, { abortSignal: this.opts.signal });
    if (!out.ETag) throw new Error(`s3://${this.ref.bucket}/${this.ref.key}: UploadPart ${partNumber} returned no ETag`);
    this.uploaded++;
    this.opts.onUploaded(partNumber, out.ETag, body.length);
  }
}

/** CRC32 of `bytes` as S3's `x-amz-checksum-crc32` wants it: big-endian, base64. */
export function crc32Base64(bytes: Uint8Array): string {
  const b = Buffer.allocUnsafe(4);
  b.writeUInt32BE(crc32(bytes) >>> 0);
  return b.toString('base64');
}

/** An AbortController that also aborts when `parent` does; `dispose()` unlinks it. */
export function linkedController(parent?: AbortSignal): { controller: AbortController; dispose: () => void } {
  const controller = new AbortController();
  if (!parent) return { controller, dispose: () => undefined };
  const onAbort = (): void => controller.abort(parent.reason);
  if (parent.aborted) onAbort();
  else parent.addEventListener('abort', onAbort, { once: true });
  return { controller, dispose: () => parent.removeEventListener('abort', onAbort) };
}

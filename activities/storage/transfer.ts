/**
 * A resumable, streamed copy of one source file (a Hugging Face download) into S3, with the
 * multipart API used directly so that an interrupted copy resumes without sending parts again.
 *
 * Invariants:
 * - The object at `key` only ever appears complete, with `x-amz-meta-sha256` set; an object with
 *   that metadata and the expected size is never copied again (content-addressed idempotence).
 * - The sha256 is computed while streaming and checked before `CompleteMultipartUpload`.
 * - A {@link TransferCheckpoint} is reported whenever the contiguous prefix of finished parts
 *   grows; it carries the SHA-256 state after exactly that prefix, so a resumed attempt re-reads
 *   the source only from the end of the prefix. Parts that finished out of order beyond the
 *   prefix are found with `ListParts` and kept when their ETag is the MD5 of the re-read bytes.
 * - Memory: at most `concurrency + 1` part buffers (parts uploading, plus the one filling). The
 *   SHA-256 runs on a worker thread reading those buffers in place (see hasher.ts), so hashing
 *   overlaps reading and uploading instead of stalling them.
 * - On failure or abort the upload is kept for the retry, except when the content is wrong
 *   (checksum mismatch, too many bytes): then it is aborted.
 *
 * Pure library: no Temporal imports. The activity heartbeats `onCheckpoint`, passes the last
 * heartbeat as `resume`, and its cancellation signal as `signal`.
 */
import { createHash } from 'node:crypto';
import { PutObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import { ErrorType } from '../../shared/errors';
import { StorageError, isStorageError } from './errors';
import { Sha256Thread, sharedBuffer } from './hasher';
import {
  MAX_PARTS,
  MAX_PART_SIZE,
  MIB,
  MIN_PART_SIZE,
  PartUploader,
  SHA256_METADATA,
  abortUpload,
  completeUpload,
  createUpload,
  headObject,
  isNoSuchUpload,
  linkedController,
  listAllParts,
  listUploads,
  normalizeSha256,
  replaceMetadata,
  type ObjectRef,
  type PartInfo,
} from './multipart';

export const DEFAULT_PART_SIZE = 16 * MIB;
export const DEFAULT_CONCURRENCY = 4;
const CONTENT_TYPE = 'application/octet-stream';

/**
 * Where an interrupted transfer stands; JSON-serializable (it travels in Temporal heartbeats).
 * Parts `1..committedPart` are uploaded and `hashState` covers exactly their bytes.
 */
export interface TransferCheckpoint {
  /** The multipart upload being filled. */
  uploadId: string;
  /** Size of every part but the last (a resumed transfer keeps it). */
  partSize: number;
  /** Highest part number such that parts 1..committedPart are all uploaded; 0 = none. */
  committedPart: number;
  /** base64 of hash-wasm's SHA-256 `save()` after the first `bytes` bytes. */
  hashState: string;
  /** Bytes covered: `min(committedPart × partSize, size)`; the source is reopened here. */
  bytes: number;
}

export interface TransferOptions {
  s3: S3Client;
  bucket: string;
  key: string;
  /** Expected size from the source listing. */
  size: number;
  /** Expected sha256 (hex) from the source (LFS); null = compute and report only. */
  sha256: string | null;
  /** The source's bytes from `offset` to its end. Iterated once; breaking out must close it. */
  open: (offset: number, signal?: AbortSignal) => Promise<AsyncIterable<Uint8Array>>;
  /** Default 16 MiB; at least 5 MiB; raised when the file would need more than 10 000 parts. */
  partSize?: number;
  /** Parts uploading at once (default 4). Memory is bounded by partSize × (concurrency + 1). */
  concurrency?: number;
  /** The last checkpoint of an earlier attempt, if any. */
  resume?: TransferCheckpoint | null;
  /** Called whenever the committed prefix grows (the activity heartbeats it). */
  onCheckpoint?: (cp: TransferCheckpoint) => void;
  /** Bytes of finished parts (uploaded or reused), after every part. */
  onProgress?: (bytesDone: number) => void;
  signal?: AbortSignal;
}

export interface TransferResult {
  key: string;
  bytes: number;
  /** sha256 (hex) of the object's content. */
  sha256: string;
  /** Parts sent by this call (a file that fits in one part is sent with one PutObject, counted as 1). */
  partsUploaded: number;
  /** Parts an earlier attempt had uploaded with identical bytes, kept without sending them again. */
  partsReused: number;
  /** True when the complete object was already there: nothing was read or sent. */
  skipped: boolean;
}

/**
 * Copies the source into `s3://bucket/key`, resuming an earlier attempt when possible.
 * @throws StorageError `ChecksumMismatch` (upload aborted), `SizeMismatch`, `InvalidArgument`;
 *   S3 and source errors as they are (transient: retry, passing the last checkpoint).
 */
export async function transferToS3(opts: TransferOptions): Promise<TransferResult> {
  const { s3, bucket, key, size, signal } = opts;
  const ref: ObjectRef = { s3, bucket, key };
  if (!Number.isSafeInteger(size) || size < 0) throw invalid(`${key}: size ${size} is not a byte count`);
  const expected = opts.sha256 === null ? null : normalizeSha256(opts.sha256, key);
  const concurrency = opts.concurrency ?? DEFAULT_CONCURRENCY;
  if (!Number.isInteger(concurrency) || concurrency < 1) throw invalid(`concurrency ${concurrency} must be a positive integer`);
  const partSize = choosePartSize(size, opts.partSize ?? DEFAULT_PART_SIZE);
  signal?.throwIfAborted();

  try {
    const existing = await headObject(ref, signal);
    if (existing && existing.size === size && existing.sha256 !== null && (expected === null || existing.sha256 === expected)) {
      opts.onProgress?.(size);
      return { key, bytes: size, sha256: existing.sha256, partsUploaded: 0, partsReused: 0, skipped: true };
    }
    // One part's worth: a single PutObject (an empty file cannot be a multipart upload at all).
    if (size === 0 || (size <= partSize && !opts.resume)) return await putWhole(opts, expected);

    const plan = await planUpload(ref, opts, partSize, expected);
    return await streamParts(ref, opts, plan, expected, concurrency);
  } catch (err) {
    // Cancelled: report the caller's reason (e.g. Temporal's CancelledFailure), not the SDK's AbortError.
    throw signal?.aborted ? (signal.reason as unknown) : err;
  }
}

/** The part size to use: `requested`, raised (to whole MiB) when the file needs more than 10 000 parts. */
export function choosePartSize(size: number, requested: number): number {
  if (!Number.isSafeInteger(requested) || requested < MIN_PART_SIZE || requested > MAX_PART_SIZE) {
    throw invalid(`part size ${requested} must be an integer between 5 MiB and 5 GiB`);
  }
  if (Math.ceil(size / requested) <= MAX_PARTS) return requested;
  return Math.ceil(size / MAX_PARTS / MIB) * MIB;
}

function invalid(message: string): StorageError {
  return new StorageError('InvalidArgument', message, { permanent: true });
}

function tooLong(key: string, size: number): StorageError {
  return new StorageError('SizeMismatch', `${key}: the source has more than the ${size} bytes its listing declares`, { permanent: true });
}

function tooShort(key: string, size: number, got: number): StorageError {
  return new StorageError('SizeMismatch', `${key}: the source ended after ${got} of ${size} bytes`, { permanent: false });
}

function checksumMismatch(key: string, expected: string, actual: string): StorageError {
  return new StorageError(ErrorType.ChecksumMismatch, `${key}: content sha256 ${actual} differs from the source's ${expected}`, { permanent: true });
}

/** A file that fits in one part: read it whole, check it, one PutObject. Nothing to resume. */
async function putWhole(opts: TransferOptions, expected: string | null): Promise<TransferResult> {
  const { key, size, signal } = opts;
  const buf = Buffer.allocUnsafe(size);
  let fill = 0;
  for await (const chunk of await opts.open(0, signal)) {
    if (fill + chunk.length > size) throw tooLong(key, size);
    buf.set(chunk, fill);
    fill += chunk.length;
  }
  if (fill < size) throw tooShort(key, size, fill);
  const sha256 = createHash('sha256').update(buf).digest('hex');
  if (expected !== null && sha256 !== expected) throw checksumMismatch(key, expected, sha256);
  await opts.s3.send(
    new PutObjectCommand({ Bucket: opts.bucket, Key: key, Body: buf, ContentLength: size, ContentType: CONTENT_TYPE, Metadata: { [SHA256_METADATA]: sha256 } }),
    { abortSignal: signal },
  );
  opts.onProgress?.(size);
  return { key, bytes: size, sha256, partsUploaded: 1, partsReused: 0, skipped: false };
}

/** The upload to fill and where to start in it. */
interface UploadPlan {
  uploadId: string;
  partSize: number;
  /** Parts 1..committedPart are uploaded and `hasher` covers their bytes. */
  committedPart: number;
  hasher: Sha256Thread;
  /** Parts the server already has (from ListParts), reused when their bytes match. */
  parts: Map<number, PartInfo>;
}

/**
 * Picks the upload: the checkpoint's if it still exists; otherwise the in-progress upload of
 * this key holding the most bytes (the others are aborted); otherwise a new one.
 */
async function planUpload(ref: ObjectRef, opts: TransferOptions, partSize: number, expected: string | null): Promise<UploadPlan> {
  const { size, signal } = opts;
  const cp = opts.resume;
  if (cp && checkpointFits(cp, size)) {
    const parts = await listAllParts(ref, cp.uploadId, signal);
    if (parts) {
      const partLength = (n: number): number => Math.min(cp.partSize, size - (n - 1) * cp.partSize);
      let prefixIntact = true;
      for (let n = 1; n <= cp.committedPart && prefixIntact; n++) prefixIntact = parts.get(n)?.size === partLength(n);
      // A state that does not load (another hash-wasm build) or a damaged prefix: re-read
      // everything, keeping the parts whose bytes match.
      const { hasher, restored } = await Sha256Thread.start(prefixIntact ? Buffer.from(cp.hashState, 'base64') : null);
      return { uploadId: cp.uploadId, partSize: cp.partSize, committedPart: restored ? cp.committedPart : 0, hasher, parts };
    }
    // The upload is gone (aborted, expired, or completed by another attempt): start over.
  }

  let best: { uploadId: string; parts: Map<number, PartInfo>; bytes: number } | null = null;
  const stale: string[] = [];
  for (const u of await listUploads(ref.s3, ref.bucket, { key: ref.key }, signal)) {
    const parts = await listAllParts(ref, u.uploadId, signal);
    if (!parts) continue;
    let bytes = 0;
    for (const p of parts.values()) bytes += p.size;
    if (best === null || bytes > best.bytes) {
      if (best) stale.push(best.uploadId);
      best = { uploadId: u.uploadId, parts, bytes };
    } else {
      stale.push(u.uploadId);
    }
  }
  for (const uploadId of stale) await abortUpload(ref, uploadId, signal);
  if (best) {
    // Keep the existing upload's part size so that its parts line up with ours.
    const first = best.parts.get(1)?.size;
    const adopted = first !== undefined && first >= MIN_PART_SIZE && first < size && Math.ceil(size / first) <= MAX_PARTS ? first : partSize;
    const { hasher } = await Sha256Thread.start(null);
    return { uploadId: best.uploadId, partSize: adopted, committedPart: 0, hasher, parts: best.parts };
  }
  const metadata: Record<string, string> = expected === null ? {} : { [SHA256_METADATA]: expected };
  const uploadId = await createUpload(ref, metadata, CONTENT_TYPE, signal);
  const { hasher } = await Sha256Thread.start(null);
  return { uploadId, partSize, committedPart: 0, hasher, parts: new Map() };
}

/** True when the checkpoint is well-formed and consistent with `size`. */
function checkpointFits(cp: TransferCheckpoint, size: number): boolean {
  const ints = [cp.partSize, cp.committedPart, cp.bytes].every((v) => Number.isSafeInteger(v) && v >= 0);
  return (
    ints &&
    typeof cp.uploadId === 'string' &&
    cp.uploadId !== '' &&
    typeof cp.hashState === 'string' &&
    cp.partSize >= MIN_PART_SIZE &&
    Math.ceil(size / cp.partSize) <= MAX_PARTS &&
    cp.committedPart <= Math.ceil(size / cp.partSize) &&
    cp.bytes === Math.min(cp.committedPart * cp.partSize, size)
  );
}

/**
 * Part buffers: SharedArrayBuffers (the hash worker reads them while they upload), at most
 * `max` of them, each reused once its upload and its hashing are both over.
 */
class PartBuffers {
  private readonly free: Buffer[] = [];
  private allocated = 0;
  private waiters: (() => void)[] = [];

  constructor(
    private readonly size: number,
    private readonly max: number,
    private readonly signal: AbortSignal,
  ) {
    signal.addEventListener('abort', () => this.wakeAll(), { once: true });
  }

  async acquire(): Promise<Buffer> {
    for (;;) {
      this.signal.throwIfAborted();
      const b = this.free.pop();
      if (b) return b;
      if (this.allocated < this.max) {
        this.allocated++;
        return sharedBuffer(this.size);
      }
      await new Promise<void>((resolve) => this.waiters.push(resolve));
    }
  }

  release(b: Buffer): void {
    this.free.push(b);
    this.waiters.shift()?.();
  }

  private wakeAll(): void {
    const w = this.waiters;
    this.waiters = [];
    for (const resolve of w) resolve();
  }
}

async function streamParts(ref: ObjectRef, opts: TransferOptions, plan: UploadPlan, expected: string | null, concurrency: number): Promise<TransferResult> {
  const { key, size, signal } = opts;
  const { uploadId, partSize, hasher } = plan;
  const totalParts = Math.ceil(size / partSize);
  const partLength = (n: number): number => Math.min(partSize, size - (n - 1) * partSize);

  const etags = new Map<number, string>();
  for (let n = 1; n <= plan.committedPart; n++) etags.set(n, (plan.parts.get(n) as PartInfo).etag);
  // A part counts towards the committed prefix once it is on the server *and* hashed (hashing
  // is in order, so `hashedThrough` says how far). The state after each part is kept until the
  // prefix passes it: states are ~100 bytes and at most `concurrency + 1` are pending.
  const onServer = new Set<number>();
  const hashStates = new Map<number, Uint8Array>();
  let hashedThrough = plan.committedPart;
  let committed = plan.committedPart;
  let bytesDone = Math.min(committed * partSize, size);
  let partsReused = 0;

  const advance = (): void => {
    const before = committed;
    while (committed < hashedThrough && onServer.delete(committed + 1)) committed++;
    if (committed === before) return;
    const state = hashStates.get(committed) as Uint8Array;
    for (const k of hashStates.keys()) if (k <= committed) hashStates.delete(k);
    opts.onCheckpoint?.({
      uploadId,
      partSize,
      committedPart: committed,
      hashState: Buffer.from(state).toString('base64'),
      bytes: Math.min(committed * partSize, size),
    });
  };
  const partOnServer = (n: number, etag: string): void => {
    etags.set(n, etag);
    onServer.add(n);
    bytesDone += partLength(n);
    // Checkpoint first: a caller heartbeating from onProgress then sends the newest checkpoint.
    advance();
    opts.onProgress?.(bytesDone);
  };

  const { controller, dispose } = linkedController(signal);
  let firstError: { error: unknown } | null = null;
  const fail = (err: unknown): void => {
    firstError ??= { error: err };
    controller.abort(err);
  };
  const buffers = new PartBuffers(partSize, concurrency + 1, controller.signal);
  // Each part's buffer is held by its upload and its hashing; the last to finish releases it.
  const holds = new Map<number, { buffer: Buffer; left: number }>();
  const letGo = (n: number): void => {
    const h = holds.get(n);
    if (h && --h.left === 0) {
      holds.delete(n);
      buffers.release(h.buffer);
    }
  };
  const uploader = new PartUploader(ref, uploadId, {
    concurrency,
    signal: controller.signal,
    onUploaded: (n, etag) => partOnServer(n, etag),
    onFailure: fail,
    onSettled: letGo,
  });
  let lastHash: Promise<unknown> = Promise.resolve();

  /** A full part: hash it (off-thread), then reuse the server's copy if identical, else send it. */
  const finishPart = async (n: number, buffer: Buffer, body: Buffer): Promise<void> => {
    controller.signal.throwIfAborted();
    holds.set(n, { buffer, left: 2 });
    const known = plan.parts.get(n);
    const candidate = known !== undefined && known.size === body.length;
    const hashed = hasher.update(body, { md5: candidate }).then(
      ({ state, md5 }) => {
        hashStates.set(n, state);
        hashedThrough = n;
        letGo(n);
        advance();
        return md5;
      },
      (err: unknown) => {
        letGo(n);
        fail(err);
        return null;
      },
    );
    lastHash = hashed;
    if (candidate) {
      // Resuming: the server has a part of this size; keep it if its ETag is our bytes' MD5.
      const md5 = await hashed;
      if (md5 !== null && known.etag.replace(/"/g, '').toLowerCase() === md5) {
        partsReused++;
        letGo(n);
        partOnServer(n, known.etag);
        return;
      }
    }
    try {
      await uploader.submit(n, body);
    } catch (err) {
      letGo(n);
      throw err;
    }
  };

  // Set when the source fails on its own (a broken stream, a short file): parts already on their
  // way are then let finish, so that the checkpoint the retry resumes from includes them.
  let sourceFailed = false;
  try {
    let offset = Math.min(committed * partSize, size);
    if (offset < size) {
      let n = committed + 1;
      let buffer = await buffers.acquire();
      let part: Buffer | null = buffer.subarray(0, partLength(n));
      let fill = 0;
      let source: AsyncIterator<Uint8Array>;
      try {
        source = (await opts.open(offset, controller.signal))[Symbol.asyncIterator]();
      } catch (err) {
        sourceFailed = true;
        throw err;
      }
      let ended = false;
      try {
        for (;;) {
          let next: IteratorResult<Uint8Array>;
          try {
            next = await source.next();
          } catch (err) {
            ended = sourceFailed = true;
            throw err;
          }
          if (next.done) break;
          const chunk = next.value;
          let pos = 0;
          while (pos < chunk.length) {
            if (part === null) throw tooLong(key, size);
            const take = Math.min(chunk.length - pos, part.length - fill);
            part.set(take === chunk.length ? chunk : chunk.subarray(pos, pos + take), fill);
            fill += take;
            pos += take;
            if (fill === part.length) {
              await finishPart(n, buffer, part);
              offset += part.length;
              n++;
              fill = 0;
              if (n <= totalParts) {
                buffer = await buffers.acquire();
                part = buffer.subarray(0, partLength(n));
              } else {
                part = null;
              }
            }
          }
        }
        ended = true;
      } finally {
        // Leaving early (our own error): close the source (e.g. its HTTP connection).
        if (!ended) await source.return?.().catch(() => undefined);
      }
      if (part !== null) {
        sourceFailed = true;
        throw tooShort(key, size, offset + fill);
      }
    }
    await uploader.drain();
    await lastHash;
    // A hashing failure is recorded by its callback (closures escape narrowing, hence the cast).
    const failed = firstError as { error: unknown } | null;
    if (failed) throw failed.error;

    const sha256 = await hasher.digest();
    if (expected !== null && sha256 !== expected) throw checksumMismatch(key, expected, sha256);
    try {
      await completeUpload(ref, uploadId, etags, signal);
    } catch (err) {
      // Another attempt (a zombie of ours) may have completed this very upload a moment ago.
      if (!isNoSuchUpload(err)) throw err;
    }
    // The object must now be ours and carry its sha256; an upload we adopted (or one started
    // without an expected sha256) may lack the metadata, which a self-copy adds.
    const head = await headObject(ref, signal);
    if (!head || head.size !== size) throw new Error(`${key}: the object is missing or has the wrong size right after completing its upload`);
    if (head.sha256 !== sha256) {
      await replaceMetadata(ref, size, { ...head.metadata, [SHA256_METADATA]: sha256 }, CONTENT_TYPE, { signal });
    }
    return { key, bytes: size, sha256, partsUploaded: uploader.uploaded, partsReused, skipped: false };
  } catch (err) {
    firstError ??= { error: err };
    if (!(sourceFailed && !controller.signal.aborted)) controller.abort(firstError.error);
    await uploader.settle();
    await lastHash;
    const error = signal?.aborted ? (signal.reason as unknown) : firstError.error;
    // Wrong content cannot be resumed; anything else leaves the upload for the retry.
    if (isStorageError(error) && error.permanent) await abortUpload(ref, uploadId).catch(() => undefined);
    throw error;
  } finally {
    dispose();
    await hasher.close();
  }
}

/**
 * A {@link ByteSource} over an S3 object, for the converter reading safetensors straight from S3.
 *
 * The converter reads a header, then tensors in file order, often a few MiB or less at a time.
 * Reads up to `blockSize` are served from a small cache of aligned blocks fetched with one ranged
 * GET each, and a sequential reader gets the next block fetched ahead of time, so a conversion
 * does a GET per block rather than per tensor and does not wait for the network at block
 * boundaries. Larger reads are one ranged GET of exactly their range, straight into the buffer
 * that is returned.
 *
 * Every read returns a fresh buffer that owns its whole ArrayBuffer (the converter's worker pool
 * transfers such buffers instead of copying them; a view into the cache would be detached), or
 * fills the caller's buffer when given one (`into`, which the converter recycles).
 */
import { GetObjectCommand, HeadObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import { type ByteSource, ConvertError, target } from '../../convert';
import { StorageError } from './errors';
import { MIB } from './multipart';

export interface S3SourceOptions {
  /** The object's size, when known (saves a HeadObject). */
  size?: number;
  /** Cache block, and the largest read served from the cache (default 8 MiB). */
  blockSize?: number;
  /** Blocks kept, the one being read ahead included (default 3). */
  maxBlocks?: number;
  /** Attempts per ranged GET when the body breaks off (default 3); S3 errors are retried by the client. */
  attempts?: number;
  /** Aborts every request (the activity's cancellation signal). */
  signal?: AbortSignal;
}

export const DEFAULT_BLOCK_SIZE = 8 * MIB;

/** A byte source reading `s3://bucket/key` with ranged GETs. */
export function s3Source(s3: S3Client, bucket: string, key: string, opts: S3SourceOptions = {}): ByteSource & { close(): Promise<void> } {
  return new S3ByteSource(s3, bucket, key, opts);
}

class S3ByteSource implements ByteSource {
  readonly name: string;
  private readonly blockSize: number;
  private readonly maxBlocks: number;
  private readonly attempts: number;
  private sizeP: Promise<number> | null;
  /** Cached blocks by index, least recently used first. */
  private readonly blocks = new Map<number, Promise<Uint8Array>>();
  /** Last block a read touched, to recognise sequential reading. */
  private lastBlock = -1;

  constructor(
    private readonly s3: S3Client,
    private readonly bucket: string,
    private readonly key: string,
    private readonly opts: S3SourceOptions,
  ) {
    this.name = `s3://${bucket}/${key}`;
    this.blockSize = opts.blockSize ?? DEFAULT_BLOCK_SIZE;
    this.maxBlocks = Math.max(2, opts.maxBlocks ?? 3);
    this.attempts = Math.max(1, opts.attempts ?? 3);
    if (!Number.isSafeInteger(this.blockSize) || this.blockSize < 1)
      throw new StorageError('InvalidArgument', `${this.name}: bad block size ${this.blockSize}`, { permanent: true });
    this.sizeP = opts.size === undefined ? null : Promise.resolve(opts.size);
  }

  size(): Promise<number> {
    if (!this.sizeP) {
      const p = this.s3
        .send(new HeadObjectCommand({ Bucket: this.bucket, Key: this.key }), { abortSignal: this.opts.signal })
        .then((head) => head.ContentLength ?? 0);
      // A failed HeadObject is not cached: the next call asks again.
      p.catch(() => {
        if (this.sizeP === p) this.sizeP = null;
      });
      this.sizeP = p;
    }
    return this.sizeP;
  }

  async read(offset: number, length: number, into?: Uint8Array): Promise<Uint8Array> {
    if (!Number.isSafeInteger(offset) || !Number.isSafeInteger(length) || offset < 0 || length < 0) {
      throw new StorageError('InvalidArgument', `${this.name}: bad read of ${length} bytes at ${offset}`, { permanent: true });
    }
    const dest = into ? target(this.name, into, length) : undefined;
    const size = await this.size();
    if (offset + length > size) {
      throw new ConvertError('TruncatedFile', `${this.name}: file ends at byte ${size}, wanted ${length} bytes at offset ${offset}`);
    }
    if (length === 0) return dest ?? Buffer.allocUnsafeSlow(0);
    if (length > this.blockSize) return this.fetchRange(offset, length, dest);

    const bs = this.blockSize;
    const first = Math.floor(offset / bs);
    const last = Math.floor((offset + length - 1) / bs);
    const sequential = first === this.lastBlock || first === this.lastBlock + 1;
    this.lastBlock = last;
    const head = this.block(first, size);
    const tail = last === first ? head : this.block(last, size);
    if (sequential && (last + 1) * bs < size) this.block(last + 1, size).catch(() => undefined);

    const out = dest ?? Buffer.allocUnsafeSlow(length);
    const a = await head;
    const start = offset - first * bs;
    const fromHead = Math.min(length, a.length - start);
    out.set(a.subarray(start, start + fromHead), 0);
    if (fromHead < length) out.set((await tail).subarray(0, length - fromHead), fromHead);
    return out;
  }

  async close(): Promise<void> {
    this.blocks.clear();
    this.lastBlock = -1;
    return Promise.resolve();
  }

  /** Block `index`, from the cache or fetched now (and cached, evicting the least recently used). */
  private block(index: number, size: number): Promise<Uint8Array> {
    let p = this.blocks.get(index);
    if (p) {
      this.blocks.delete(index);
      this.blocks.set(index, p);
      return p;
    }
    const start = index * this.blockSize;
    p = this.fetchRange(start, Math.min(this.blockSize, size - start));
    const cached = p;
    cached.catch(() => {
      if (this.blocks.get(index) === cached) this.blocks.delete(index);
    });
    this.blocks.set(index, cached);
    while (this.blocks.size > this.maxBlocks) this.blocks.delete(this.blocks.keys().next().value as number);
    return cached;
  }

  /** Exactly `length` bytes at `offset`, in `dest` (`length` bytes long) or a fresh buffer. */
  private async fetchRange(offset: number, length: number, dest?: Uint8Array): Promise<Uint8Array> {
    for (let attempt = 1; ; attempt++) {
      try {
        return await this.getRange(offset, length, dest);
      } catch (err) {
        // Retry a body that broke off; S3 answers (4xx/5xx) were already retried by the client.
        const answered = (err as { $metadata?: unknown } | null)?.$metadata !== undefined;
        if (attempt >= this.attempts || answered || this.opts.signal?.aborted) throw err;
      }
    }
  }

  private async getRange(offset: number, length: number, dest?: Uint8Array): Promise<Uint8Array> {
    const out = await this.s3.send(new GetObjectCommand({ Bucket: this.bucket, Key: this.key, Range: `bytes=${offset}-${offset + length - 1}` }), {
      abortSignal: this.opts.signal,
    });
    const body = out.Body as AsyncIterable<Uint8Array> | undefined;
    const buf = dest ?? Buffer.allocUnsafeSlow(length);
    let fill = 0;
    if (body) {
      for await (const chunk of body) {
        if (fill + chunk.length > length)
          throw new StorageError('ShortRead', `${this.name}: the GET of ${length} bytes at ${offset} returned more`, { permanent: false });
        buf.set(chunk, fill);
        fill += chunk.length;
      }
    }
    if (fill !== length) {
      throw new StorageError('ShortRead', `${this.name}: the GET of ${length} bytes at ${offset} ended after ${fill}`, { permanent: false });
    }
    return buf;
  }
}

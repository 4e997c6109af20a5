/**
 * Test helpers for the storage integration tests: an in-memory byte source that records how it
 * is read and can fail on cue, a counter of S3 calls (client middleware), and small readers.
 * Not used by production code.
 */
import { createHash } from 'node:crypto';
import { setImmediate as yieldToLoop } from 'node:timers/promises';
import { GetObjectCommand, type S3Client } from '@aws-sdk/client-s3';

/** Deterministic pseudo-random bytes (xorshift32, four bytes per step), fast enough for hundreds of MiB. */
export function pseudoRandomBytes(length: number, seed = 1): Buffer {
  const words = new Uint32Array(Math.ceil(length / 4));
  let x = seed >>> 0 || 1;
  for (let i = 0; i < words.length; i++) {
    x ^= x << 13;
    x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5;
    x >>>= 0;
    words[i] = x;
  }
  return Buffer.from(words.buffer, 0, length);
}

export function sha256Hex(bytes: Uint8Array): string {
  return createHash('sha256').update(bytes).digest('hex');
}

export interface MemorySourceOptions {
  /** Bytes per yielded chunk (default 64 KiB, like a network stream). */
  chunkSize?: number;
  /** Throw this error once this many bytes (from the start of the file) have been yielded. */
  failAt?: { offset: number; error: Error };
}

/** An `open(offset, signal)` over a buffer that records every open and how many bytes it yielded. */
export function memorySource(data: Uint8Array, opts: MemorySourceOptions = {}) {
  const chunkSize = opts.chunkSize ?? 64 * 1024;
  const opens: number[] = [];
  let bytesYielded = 0;
  const open = (offset: number, signal?: AbortSignal): Promise<AsyncIterable<Uint8Array>> => {
    opens.push(offset);
    async function* body(): AsyncGenerator<Uint8Array> {
      for (let pos = offset; pos < data.length; pos += chunkSize) {
        signal?.throwIfAborted();
        const end = Math.min(data.length, pos + chunkSize);
        if (opts.failAt && end > opts.failAt.offset) throw opts.failAt.error;
        // Let I/O callbacks run, as a network stream would.
        if ((pos / chunkSize) % 16 === 0) await yieldToLoop();
        bytesYielded += end - pos;
        yield data.subarray(pos, end);
      }
    }
    return Promise.resolve(body());
  };
  return {
    open,
    opens,
    get bytesYielded() {
      return bytesYielded;
    },
  };
}

export interface CallLog {
  /** Calls started, by command name (counted once per `send`, not per SDK retry). */
  counts: Record<string, number>;
  /** Most calls of one command in flight at once. */
  maxInFlight: Record<string, number>;
  /** `PartNumber`s of UploadPart calls, in the order they started. */
  uploadedParts: number[];
}

type Input = Record<string, unknown>;

/**
 * Counts the client's calls. `before`/`after` run around each call (e.g. to delay one part, or
 * to abort a transfer once a part has been sent).
 */
export function logCalls(
  s3: S3Client,
  hooks: { before?: (command: string, input: Input) => Promise<void> | void; after?: (command: string, input: Input) => void } = {},
): CallLog {
  const log: CallLog = { counts: {}, maxInFlight: {}, uploadedParts: [] };
  const inFlight: Record<string, number> = {};
  s3.middlewareStack.add(
    (next, context) => async (args) => {
      const name = context.commandName ?? '?';
      const input = args.input as Input;
      log.counts[name] = (log.counts[name] ?? 0) + 1;
      if (name === 'UploadPartCommand') log.uploadedParts.push(input.PartNumber as number);
      inFlight[name] = (inFlight[name] ?? 0) + 1;
      log.maxInFlight[name] = Math.max(log.maxInFlight[name] ?? 0, inFlight[name]);
      try {
        await hooks.before?.(name, input);
        const out = await next(args);
        hooks.after?.(name, input);
        return out;
      } finally {
        inFlight[name] -= 1;
      }
    },
    { step: 'initialize', name: 'magusTestCallLog' },
  );
  return log;
}

/** Calls of `command` (e.g. `UploadPart`) logged so far. */
export function calls(log: CallLog, command: string): number {
  return log.counts[`${command}Command`] ?? 0;
}

/** The whole object. */
export async function getObjectBytes(s3: S3Client, bucket: string, key: string): Promise<Buffer> {
  const out = await s3.send(new GetObjectCommand({ Bucket: bucket, Key: key }));
  return Buffer.from(await (out.Body as { transformToByteArray(): Promise<Uint8Array> }).transformToByteArray());
}

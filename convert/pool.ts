/**
 * A small pool of worker threads that encode (convert or quantize) tensor chunks in parallel.
 *
 * Contract: results come back in submission order ({@link QuantPool.encodeStream}), and every
 * chunk is encoded by the same pure function whatever thread runs it, so output bytes do not
 * depend on the pool size. Input buffers are transferred to the worker (the caller's view is
 * detached afterwards) unless they are views into a larger buffer, which are copied. Views of a
 * `SharedArrayBuffer` are neither: the worker reads (and, given `out`, writes) that memory in
 * place, so a caller can recycle a few shared buffers with no allocation, copy or transfer per
 * chunk. (Recycling transferred buffers is not enough: each arrives as a new ArrayBuffer, and
 * V8's external-memory heuristics still ran ~20 full collections per GB converted.)
 *
 * Workers are started on demand, `unref`'d while idle (an unclosed pool does not keep the process
 * alive), and a worker that crashes rejects its task and is replaced on the next one.
 */
import { availableParallelism } from 'node:os';
import * as path from 'node:path';
import { types } from 'node:util';
import { Worker } from 'node:worker_threads';
import { ConvertError, type ConvertErrorCode } from './errors';
import type { EncodeRequest, EncodeResponse } from './quant-worker';
import { elementCount, readTensorChunks } from './safetensors';
import type { QuantFlavor, SourceDType, SourceTensor, WeightsFormat } from './types';
import { weightsFormat } from '../shared/weights';

/** One chunk to encode. */
export interface EncodeTask {
  dtype: SourceDType;
  /** Raw little-endian source bytes (transferred when they span their whole buffer, shared when in a SharedArrayBuffer, else copied). */
  bytes: Uint8Array;
  format: WeightsFormat;
  /** For q40/q80 (default `ggml`). */
  flavor?: QuantFlavor;
  /** Tensor name for error messages. */
  label?: string;
  /** Index of the chunk's first element within its tensor, for error messages. */
  elementOffset?: number;
  /**
   * A view of a `SharedArrayBuffer` to encode into (from its start; it must be large enough):
   * the result is then its first bytes, and no output buffer is allocated.
   */
  out?: Uint8Array;
}

/** Options of the ordered stream encoders. */
export interface EncodeStreamOptions {
  format: WeightsFormat;
  flavor?: QuantFlavor;
  label?: string;
  /** Chunks submitted ahead of the one being yielded (default 2 × pool size). Bounds memory. */
  maxInFlight?: number;
}

interface Pending {
  request: EncodeRequest;
  resolve: (out: Uint8Array) => void;
  reject: (err: Error) => void;
}

interface Slot {
  worker: Worker;
  task: Pending | null;
}

/** The worker entry next to this module: the `.ts` source under ts runners (jest), else the compiled `.js`. */
function spawnWorker(): Worker {
  if (__filename.endsWith('.ts')) {
    return new Worker(path.join(__dirname, 'quant-worker.ts'), { execArgv: ['-r', require.resolve('@swc-node/register')] });
  }
  return new Worker(path.join(__dirname, 'quant-worker.js'));
}

function revive(error: { name: string; message: string; code?: string; stack?: string }): Error {
  const err = error.name === 'ConvertError' && error.code ? new ConvertError(error.code as ConvertErrorCode, error.message) : new Error(error.message);
  if (!(err instanceof ConvertError)) err.name = error.name;
  if (error.stack) err.stack = error.stack;
  return err;
}

/** Worker pool for {@link encodeChunk}-style work; see the module comment. */
export class QuantPool {
  /** Maximum number of worker threads. */
  readonly size: number;
  private readonly slots: Slot[] = [];
  private readonly queue: Pending[] = [];
  private nextId = 1;
  private closed = false;

  constructor(opts?: { size?: number }) {
    const size = opts?.size ?? availableParallelism();
    if (!Number.isInteger(size) || size < 1) throw new RangeError(`pool size ${size} is not a positive integer`);
    this.size = size;
  }

  /**
   * Encodes one chunk on some worker. A shared input or output buffer must not be touched until
   * the returned promise settles.
   */
  encode(task: EncodeTask): Promise<Uint8Array> {
    if (this.closed) return Promise.reject(new Error('QuantPool is closed'));
    if (task.out && !types.isSharedArrayBuffer(task.out.buffer)) return Promise.reject(new TypeError('an output buffer must be a view of a SharedArrayBuffer'));
    // util.types, not instanceof: buffers from Node's own allocators live in another realm under jest.
    const shared = types.isSharedArrayBuffer(task.bytes.buffer);
    const whole = task.bytes.byteOffset === 0 && task.bytes.byteLength === task.bytes.buffer.byteLength && types.isArrayBuffer(task.bytes.buffer);
    // A real copy: Buffer#slice (Node buffers from fs reads) returns a view, and transferring a
    // view's buffer would detach memory it shares (a pooled slab, or the rest of a tensor).
    const bytes = shared || whole ? task.bytes : new Uint8Array(task.bytes);
    const request: EncodeRequest = {
      id: this.nextId++,
      dtype: task.dtype,
      bytes,
      format: task.format,
      flavor: task.flavor ?? 'ggml',
      label: task.label,
      elementOffset: task.elementOffset,
      ...(task.out ? { out: task.out } : {}),
    };
    return new Promise<Uint8Array>((resolve, reject) => {
      this.queue.push({ request, resolve, reject });
      this.pump();
    });
  }

  /**
   * Encodes a stream of chunks, yielding outputs in input order with at most `maxInFlight`
   * chunks submitted ahead. The first failure is thrown when its turn comes.
   */
  async *encodeStream(
    chunks:
      | AsyncIterable<{ dtype: SourceDType; bytes: Uint8Array; elementOffset?: number }>
      | Iterable<{ dtype: SourceDType; bytes: Uint8Array; elementOffset?: number }>,
    opts: EncodeStreamOptions,
  ): AsyncGenerator<Uint8Array> {
    const max = opts.maxInFlight ?? 2 * this.size;
    const inFlight: Promise<Uint8Array>[] = [];
    for await (const c of chunks) {
      const p = this.encode({ dtype: c.dtype, bytes: c.bytes, format: opts.format, flavor: opts.flavor, label: opts.label, elementOffset: c.elementOffset });
      // Observed when its turn comes; without this an early rejection would be "unhandled" meanwhile.
      p.catch(() => undefined);
      inFlight.push(p);
      if (inFlight.length >= max) yield await inFlight.shift()!;
    }
    while (inFlight.length > 0) yield await inFlight.shift()!;
  }

  /**
   * Reads and encodes a whole tensor chunk by chunk, in order. Memory is bounded by
   * `maxInFlight` chunks of `chunkElements`.
   * @throws ConvertError `BadBlockSize` before reading if a block format (q40/q80) and the size is not whole blocks.
   */
  encodeTensor(t: SourceTensor, opts: Omit<EncodeStreamOptions, 'label'> & { chunkElements?: number }): AsyncGenerator<Uint8Array> {
    const label = `${t.source.name}: tensor ${t.name}`;
    const { blockQuantized, blockSize } = weightsFormat(opts.format);
    if (blockQuantized && elementCount(t.shape) % blockSize !== 0) {
      throw new ConvertError('BadBlockSize', `${label}: ${elementCount(t.shape)} values are not a whole number of ${blockSize}-value blocks`);
    }
    return this.encodeStream(readTensorChunks(t, { chunkElements: opts.chunkElements }), { ...opts, label });
  }

  /**
   * Starts every worker now rather than with the first tasks, so that their start-up (loading
   * modules) overlaps the caller's own. Idle workers do not keep the process alive.
   */
  warm(): void {
    if (this.closed) return;
    while (this.slots.length < this.size) this.startWorker().worker.unref();
  }

  /** Rejects queued tasks and terminates every worker. Idempotent. */
  async close(): Promise<void> {
    this.closed = true;
    const closing = new Error('QuantPool is closed');
    for (const p of this.queue.splice(0)) p.reject(closing);
    const slots = this.slots.splice(0);
    for (const s of slots) {
      s.task?.reject(closing);
      s.task = null;
    }
    await Promise.all(slots.map((s) => s.worker.terminate()));
  }

  private pump(): void {
    while (this.queue.length > 0) {
      let slot = this.slots.find((s) => s.task === null);
      if (!slot) {
        if (this.slots.length >= this.size) return;
        slot = this.startWorker();
      }
      const task = this.queue.shift()!;
      slot.task = task;
      slot.worker.ref();
      const transfer = types.isArrayBuffer(task.request.bytes.buffer) ? [task.request.bytes.buffer] : [];
      slot.worker.postMessage(task.request, transfer);
    }
  }

  private startWorker(): Slot {
    const slot: Slot = { worker: spawnWorker(), task: null };
    const { worker } = slot;
    worker.on('message', (res: EncodeResponse) => {
      const task = slot.task;
      if (!task || task.request.id !== res.id) return;
      slot.task = null;
      worker.unref();
      if (res.ok) task.resolve('out' in res ? res.out : (task.request.out as Uint8Array).subarray(0, res.written));
      else task.reject(revive(res.error));
      this.pump();
    });
    const fail = (err: Error): void => {
      const i = this.slots.indexOf(slot);
      if (i < 0) return; // already removed (close, or error then exit)
      this.slots.splice(i, 1);
      slot.task?.reject(err);
      slot.task = null;
      void worker.terminate();
      this.pump();
    };
    worker.on('error', fail);
    worker.on('exit', (code) => fail(new Error(`quantization worker exited with code ${code}`)));
    this.slots.push(slot);
    return slot;
  }
}

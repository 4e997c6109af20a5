/**
 * A resumable SHA-256 computed on a worker thread, so that hashing a multi-gigabyte transfer
 * (hash-wasm runs at a few hundred MB/s) does not stall the thread that moves the bytes.
 *
 * Parts must live in SharedArrayBuffers ({@link sharedBuffer}): the worker reads them in place
 * while the same bytes are being uploaded. Updates are pipelined; each resolves with the state
 * after that part (for checkpoints) and, on request, the part's MD5.
 *
 * Each hasher leases a worker of its own (transfers run in parallel, and each then hashes on its
 * own core); a few idle workers are kept, `unref`'d, so that the next file does not pay for a
 * thread start.
 */
import * as path from 'node:path';
import { Worker } from 'node:worker_threads';
import type { HashRequest, HashResponse } from './sha256-worker';

type Payload = HashRequest extends infer R ? (R extends { id: number } ? Omit<R, 'id'> : never) : never;
type Ok = Extract<HashResponse, { ok: true }>;

/** Idle workers kept for reuse. */
const MAX_IDLE = 2;
const idle: Worker[] = [];
/** Request ids are unique across hashers: a reused worker may still answer its previous lessee. */
let nextId = 1;

/** The worker entry next to this module: the `.ts` source under ts runners (jest), else the compiled `.js`. */
function spawnWorker(): Worker {
  if (__filename.endsWith('.ts')) {
    return new Worker(path.join(__dirname, 'sha256-worker.ts'), { execArgv: ['-r', require.resolve('@swc-node/register')] });
  }
  return new Worker(path.join(__dirname, 'sha256-worker.js'));
}

function dropIdle(worker: Worker): void {
  const i = idle.indexOf(worker);
  if (i >= 0) idle.splice(i, 1);
}

function leaseWorker(): Worker {
  const worker = idle.pop();
  if (!worker) return spawnWorker();
  worker.removeAllListeners('exit');
  worker.ref();
  return worker;
}

function returnWorker(worker: Worker): void {
  if (idle.length >= MAX_IDLE) {
    void worker.terminate();
    return;
  }
  worker.unref();
  worker.once('exit', () => dropIdle(worker));
  idle.push(worker);
}

/** A zero-filled Buffer over a SharedArrayBuffer of `length` bytes. */
export function sharedBuffer(length: number): Buffer {
  return Buffer.from(new SharedArrayBuffer(length));
}

export class Sha256Thread {
  private readonly worker: Worker;
  private readonly pending = new Map<number, { resolve: (r: Ok) => void; reject: (e: Error) => void }>();
  private dead: Error | null = null;
  private closed = false;
  private readonly onMessage = (res: HashResponse): void => {
    const p = this.pending.get(res.id);
    if (!p) return;
    this.pending.delete(res.id);
    if (res.ok) p.resolve(res);
    else p.reject(new Error(`sha256 worker: ${res.message}`));
  };
  private readonly onError = (err: Error): void => this.fail(err);
  private readonly onExit = (code: number): void => this.fail(new Error(`sha256 worker exited (code ${code})`));

  private constructor() {
    this.worker = leaseWorker();
    this.worker.on('message', this.onMessage);
    this.worker.on('error', this.onError);
    this.worker.on('exit', this.onExit);
  }

  /**
   * Starts a hasher from a saved state (`state`) or from scratch (null).
   * @returns the hasher, and whether the state was restored (false also when it did not load)
   */
  static async start(state: Uint8Array | null): Promise<{ hasher: Sha256Thread; restored: boolean }> {
    const hasher = new Sha256Thread();
    try {
      const res = await hasher.call({ op: 'init', state });
      return { hasher, restored: res.loaded === true };
    } catch (err) {
      await hasher.close();
      throw err;
    }
  }

  /**
   * Hashes `bytes` (a view of a SharedArrayBuffer, untouched until this resolves) after every
   * earlier update.
   */
  async update(bytes: Uint8Array, opts: { md5?: boolean } = {}): Promise<{ state: Uint8Array; md5: string | null }> {
    const res = await this.call({ op: 'update', bytes, md5: opts.md5 === true });
    return { state: res.state as Uint8Array, md5: res.md5 ?? null };
  }

  /** Hex digest of everything hashed. */
  async digest(): Promise<string> {
    return (await this.call({ op: 'digest' })).hex as string;
  }

  /** Gives the worker back (or ends it, if it failed). Pending calls are rejected. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    const healthy = this.dead === null;
    this.fail(new Error('sha256 hasher closed'));
    this.worker.off('message', this.onMessage);
    this.worker.off('error', this.onError);
    this.worker.off('exit', this.onExit);
    if (healthy) returnWorker(this.worker);
    else await this.worker.terminate();
  }

  private fail(err: Error): void {
    this.dead ??= err;
    for (const p of this.pending.values()) p.reject(err);
    this.pending.clear();
  }

  private call(payload: Payload): Promise<Ok> {
    if (this.dead) return Promise.reject(this.dead);
    const id = nextId++;
    return new Promise<Ok>((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.worker.postMessage({ ...payload, id });
    });
  }
}

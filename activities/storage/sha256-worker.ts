/**
 * Worker-thread entry of {@link Sha256Thread} (hasher.ts): one resumable SHA-256 (hash-wasm,
 * whose state can be saved and restored) fed with parts in order. Part bytes arrive as views of
 * SharedArrayBuffers, so nothing is copied; each update answers with the state after that part
 * and, when asked, the part's MD5 (to compare with an S3 part ETag).
 */
import { createHash } from 'node:crypto';
import { parentPort } from 'node:worker_threads';
import { createSHA256, type IHasher } from 'hash-wasm';

/** Thread → worker. Requests are handled strictly in the order they are posted. */
export type HashRequest =
  { id: number; op: 'init'; state: Uint8Array | null } | { id: number; op: 'update'; bytes: Uint8Array; md5: boolean } | { id: number; op: 'digest' };

/** Worker → thread. */
export type HashResponse =
  { id: number; ok: true; loaded?: boolean; state?: Uint8Array; md5?: string; hex?: string } | { id: number; ok: false; message: string };

let hasher: IHasher | null = null;

async function handle(req: HashRequest): Promise<HashResponse> {
  switch (req.op) {
    case 'init': {
      hasher ??= await createSHA256();
      hasher.init();
      if (req.state === null) return { id: req.id, ok: true, loaded: false };
      try {
        hasher.load(req.state);
        return { id: req.id, ok: true, loaded: true };
      } catch {
        // Saved by another hash-wasm build: the caller starts from the beginning.
        hasher.init();
        return { id: req.id, ok: true, loaded: false };
      }
    }
    case 'update': {
      if (!hasher) throw new Error('update before init');
      hasher.update(req.bytes);
      const md5 = req.md5 ? createHash('md5').update(req.bytes).digest('hex') : undefined;
      return { id: req.id, ok: true, state: hasher.save(), md5 };
    }
    case 'digest': {
      if (!hasher) throw new Error('digest before init');
      return { id: req.id, ok: true, hex: hasher.digest('hex') };
    }
  }
}

const port = parentPort;
if (port) {
  // Serialised: each request is answered before the next is looked at (hash-wasm is synchronous,
  // and only `init` awaits, once).
  let queue: Promise<void> = Promise.resolve();
  port.on('message', (req: HashRequest) => {
    queue = queue.then(async () => {
      let res: HashResponse;
      try {
        res = await handle(req);
      } catch (err) {
        res = { id: req.id, ok: false, message: err instanceof Error ? err.message : String(err) };
      }
      port.postMessage(res);
    });
  });
}

/**
 * A free list of equal-sized buffers in shared memory, so that streaming a checkpoint reads
 * every chunk into (and encodes every chunk into) memory that is reused rather than freshly
 * allocated per chunk, and that the worker pool shares with its threads instead of transferring.
 *
 * It does not bound memory by itself: a buffer is allocated whenever the list is empty, and the
 * caller's window of chunks in flight bounds how many exist. It keeps at most `keep` free ones.
 */
import { types } from 'node:util';

export class ChunkBuffers {
  private readonly free: SharedArrayBuffer[] = [];
  /** Pooled buffers allocated so far (for tests and tuning). */
  allocated = 0;

  /**
   * @param byteLength size of every pooled buffer
   * @param keep most free buffers kept
   */
  constructor(
    readonly byteLength: number,
    private readonly keep: number,
  ) {
    if (!Number.isSafeInteger(byteLength) || byteLength < 0) throw new RangeError(`chunk buffer size ${byteLength} is not a non-negative integer`);
  }

  /**
   * `length` bytes at the start of a pooled shared buffer (contents undefined), or, if `length`
   * exceeds the pool's buffer size, of a fresh unshared buffer that {@link give} will drop.
   */
  take(length: number): Uint8Array {
    if (length > this.byteLength) return new Uint8Array(length);
    let buf = this.free.pop();
    if (!buf) {
      buf = new SharedArrayBuffer(this.byteLength);
      this.allocated++;
    }
    return new Uint8Array(buf, 0, length);
  }

  /**
   * Hands back a view from {@link take}, whose buffer nobody (no worker either) uses any more.
   * Other buffers, and any beyond `keep` free ones, are dropped.
   */
  give(bytes: Uint8Array): void {
    const buf = bytes.buffer;
    // util.types, not instanceof: it holds across realms (jest).
    if (types.isSharedArrayBuffer(buf) && buf.byteLength === this.byteLength && this.free.length < this.keep && !this.free.includes(buf)) this.free.push(buf);
  }
}

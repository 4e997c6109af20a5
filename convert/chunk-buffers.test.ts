import { ChunkBuffers } from './chunk-buffers';

describe('ChunkBuffers', () => {
  test('hands out views of shared buffers and reuses the ones given back', () => {
    const b = new ChunkBuffers(1024, 2);
    const x = b.take(1000);
    const y = b.take(10);
    expect(x.buffer).toBeInstanceOf(SharedArrayBuffer);
    expect([x.byteOffset, x.length, x.buffer.byteLength]).toEqual([0, 1000, 1024]);
    expect(y.buffer).not.toBe(x.buffer);
    expect(b.allocated).toBe(2);
    b.give(y);
    b.give(y); // twice: kept once
    b.give(x);
    expect(b.take(5).buffer).toBe(x.buffer);
    expect(b.take(5).buffer).toBe(y.buffer);
    expect(b.take(5).buffer).not.toBe(y.buffer);
    expect(b.allocated).toBe(3);
  });

  test('keeps at most `keep` free buffers, and drops buffers it did not hand out', () => {
    const b = new ChunkBuffers(64, 1);
    const [x, y] = [b.take(64), b.take(64)];
    b.give(x);
    b.give(y);
    b.give(new Uint8Array(64));
    expect(b.take(64).buffer).toBe(x.buffer);
    expect(b.take(64).buffer).not.toBe(y.buffer);
  });

  test('a request larger than the pooled size gets an unpooled buffer', () => {
    const b = new ChunkBuffers(64, 4);
    const big = b.take(100);
    expect([big.length, big.buffer instanceof SharedArrayBuffer]).toEqual([100, false]);
    b.give(big);
    expect(b.take(64).buffer).not.toBe(big.buffer);
    expect(() => new ChunkBuffers(-1, 1)).toThrow(RangeError);
  });
});

import { mkdtemp, open, readFile, readdir, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { writeFileAtomically, writeTensorData } from './atomic-file';

let dir: string;
beforeAll(async () => {
  dir = await mkdtemp(join(tmpdir(), 'magus-atomic-'));
});
afterAll(() => rm(dir, { recursive: true, force: true }));

describe('writeFileAtomically', () => {
  test('a caller may reuse a chunk once write() resolves, small or large', async () => {
    const path = join(dir, 'reuse.bin');
    const small = new Uint8Array(100);
    const large = new Uint8Array(300 * 1024);
    const expected: Buffer[] = [];
    await writeFileAtomically(path, async (sink) => {
      for (let i = 1; i <= 3; i++) {
        for (const buf of [small, large]) {
          buf.fill(i);
          await sink.write(buf);
          expected.push(Buffer.from(buf)); // a copy of what was written
        }
      }
      await sink.write(Uint8Array.of(9), { owned: true });
      expected.push(Buffer.of(9));
      expect(sink.bytesWritten).toBe(Buffer.concat(expected).length);
    });
    expect((await readFile(path)).equals(Buffer.concat(expected))).toBe(true);
    expect((await readdir(dir)).filter((f) => f.includes('.tmp-'))).toEqual([]);
  });

  test('writeTensorData is done with each streamed chunk before it asks for the next', async () => {
    const path = join(dir, 'stream.bin');
    const buf = new Uint8Array(200 * 1024);
    async function* chunks(): AsyncGenerator<Uint8Array> {
      for (let i = 1; i <= 4; i++) {
        await Promise.resolve();
        buf.fill(i); // the producer reuses one buffer
        yield i % 2 ? buf : buf.subarray(0, 10);
      }
    }
    const n = await writeFileAtomically(path, (sink) => writeTensorData(sink, chunks()));
    const got = await readFile(path);
    expect(n).toBe(got.length);
    const parts = [Buffer.alloc(buf.length, 1), Buffer.alloc(10, 2), Buffer.alloc(buf.length, 3), Buffer.alloc(10, 4)];
    expect(got.equals(Buffer.concat(parts))).toBe(true);
  });

  test('a large file is synced in the background as it is written, and a failed writeback fails the write', async () => {
    const path = join(dir, 'big.bin');
    const fill = async (sink: { write(c: Uint8Array): Promise<void> }) => {
      const chunk = new Uint8Array(3 * 1024 * 1024);
      for (let i = 0; i < 30; i++) await sink.write(chunk.fill(i));
    };
    const probe = await open(join(dir, 'probe'), 'w');
    const proto = Object.getPrototypeOf(probe) as { datasync(): Promise<void> };
    await probe.close();
    const datasync = jest.spyOn(proto, 'datasync');
    try {
      await writeFileAtomically(path, fill);
      expect(datasync.mock.calls.length).toBeGreaterThanOrEqual(1);
      const got = await readFile(path);
      expect(got.length).toBe(90 * 1024 * 1024);
      expect([got[0], got[3 * 1024 * 1024], got[got.length - 1]]).toEqual([0, 1, 29]);

      datasync.mockRejectedValueOnce(Object.assign(new Error('EIO: i/o error, fdatasync'), { code: 'EIO' }));
      await expect(writeFileAtomically(join(dir, 'eio.bin'), fill)).rejects.toThrow(/EIO/);
      expect((await readdir(dir)).filter((f) => f.startsWith('eio.bin'))).toEqual([]);
    } finally {
      datasync.mockRestore();
    }
  });

  test('a failing fill leaves nothing behind', async () => {
    const path = join(dir, 'fail.bin');
    await expect(
      writeFileAtomically(path, async (sink) => {
        await sink.write(new Uint8Array(1000));
        throw new Error('boom');
      }),
    ).rejects.toThrow('boom');
    expect((await readdir(dir)).filter((f) => f.startsWith('fail.bin'))).toEqual([]);
  });
});

/** Pure helpers of the storage library (no server needed). */
import { crc32Base64, isNoSuchKey, isNoSuchUpload, MIB } from './multipart';
import { choosePartSize } from './transfer';

describe('choosePartSize', () => {
  test('keeps the requested size while the file fits in 10 000 parts', () => {
    expect(choosePartSize(0, 16 * MIB)).toBe(16 * MIB);
    expect(choosePartSize(10_000 * 16 * MIB, 16 * MIB)).toBe(16 * MIB);
  });
  test('raises it to whole MiB beyond that', () => {
    const size = 200 * 1024 * MIB; // 200 GiB
    const part = choosePartSize(size, 16 * MIB);
    expect(part % MIB).toBe(0);
    expect(Math.ceil(size / part)).toBeLessThanOrEqual(10_000);
    expect(part).toBe(21 * MIB);
  });
  test('rejects parts S3 would refuse', () => {
    expect(() => choosePartSize(1, 4 * MIB)).toThrow(expect.objectContaining({ name: 'StorageError', code: 'InvalidArgument' }) as Error);
    expect(() => choosePartSize(1, 6 * 1024 * MIB)).toThrow(/between 5 MiB and 5 GiB/);
  });
});

test('crc32Base64 is the big-endian CRC32 S3 expects', () => {
  expect(crc32Base64(Buffer.from('hello'))).toBe(Buffer.from([0x36, 0x10, 0xa6, 0x86]).toString('base64'));
  expect(crc32Base64(new Uint8Array(0))).toBe('AAAAAA==');
});

test('S3 error classification', () => {
  expect(isNoSuchUpload({ name: 'NoSuchUpload', $metadata: { httpStatusCode: 404 } })).toBe(true);
  expect(isNoSuchKey({ name: 'NoSuchUpload', $metadata: { httpStatusCode: 404 } })).toBe(false);
  expect(isNoSuchKey({ name: 'NotFound', $metadata: { httpStatusCode: 404 } })).toBe(true);
  expect(isNoSuchKey({ name: 'NoSuchKey' })).toBe(true);
  expect(isNoSuchKey({ name: 'AccessDenied', $metadata: { httpStatusCode: 403 } })).toBe(false);
  expect(isNoSuchUpload(null)).toBe(false);
});

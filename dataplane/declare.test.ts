import { MIN_RESPONSE_MAX_BYTES, responseStreamLimits } from './declare';

describe('responseStreamLimits', () => {
  const MiB = 1024 * 1024;
  it('sizes MAGUS_RESPONSES as peak throughput × the longest request, and keeps frames at least that long', () => {
    expect(responseStreamLimits()).toEqual({ maxBytes: 300 * MiB, maxAgeMs: 30 * 60_000, retentionMs: 10 * 60_000, peakBytesPerSec: 512 * 1024 });
    expect(responseStreamLimits({ responsePeakBytesPerSec: 2 * MiB, responseRetentionMs: 60 * 60_000 })).toMatchObject({
      maxBytes: 7200 * MiB,
      maxAgeMs: 60 * 60_000,
    });
  });
  it('never below the floor, unless an exact cap is given', () => {
    expect(responseStreamLimits({ responsePeakBytesPerSec: 1024, responseRetentionMs: 60_000 }).maxBytes).toBe(MIN_RESPONSE_MAX_BYTES);
    expect(responseStreamLimits({ responseMaxBytes: 64 * 1024 }).maxBytes).toBe(64 * 1024);
    expect(() => responseStreamLimits({ responseRetentionMs: 0 })).toThrow(/responseRetentionMs/);
  });
});

import { ephemeralRange, freePort, serverPortBand } from './ports';

describe('ports for servers that restart on the same port', () => {
  test('the ephemeral range is read from the kernel, and a bad reading falls back to Linux default', () => {
    expect(ephemeralRange(() => '32768\t60999\n')).toEqual([32_768, 60_999]);
    expect(ephemeralRange(() => '1024 65535')).toEqual([1_024, 65_535]);
    expect(ephemeralRange(() => 'nonsense')).toEqual([32_768, 60_999]);
    expect(ephemeralRange(() => '5000 4000')).toEqual([32_768, 60_999]);
    expect(
      ephemeralRange(() => {
        throw new Error('ENOENT');
      }),
    ).toEqual([32_768, 60_999]);
  });

  test('the band is the larger stretch of 10000–65535 outside the ephemeral range, none when too small', () => {
    expect(serverPortBand([32_768, 60_999])).toEqual([10_000, 32_767]);
    expect(serverPortBand([10_500, 40_000])).toEqual([40_001, 65_535]);
    expect(serverPortBand([10_000, 65_000])).toEqual([0, 0]);
    expect(serverPortBand([1_024, 65_535])).toEqual([0, 0]);
  });

  test('freePort draws from the band on this machine', async () => {
    const [low, high] = serverPortBand();
    const [elow, ehigh] = ephemeralRange();
    for (let i = 0; i < 5; i++) {
      const port = await freePort();
      if (low > 0) {
        expect(port).toBeGreaterThanOrEqual(low);
        expect(port).toBeLessThanOrEqual(high);
      } else {
        expect(port).toBeGreaterThanOrEqual(elow);
        expect(port).toBeLessThanOrEqual(ehigh);
      }
    }
  });
});

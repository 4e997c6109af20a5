import { bridgeCommand } from './bridge';

describe('bridgeCommand', () => {
  it('rejects missing or bad options before connecting anywhere', async () => {
    const err = jest.spyOn(process.stderr, 'write').mockImplementation(() => true);
    try {
      expect(await bridgeCommand(['--pool', 'p'])).toBe(1);
      expect(String(err.mock.calls.at(-1)?.[0])).toMatch(/--instance is required.*--engine must be an http\(s\) URL/s);
      expect(await bridgeCommand(['--pool', 'p', '--instance', 'i', '--engine', 'http://e:1', '--slots', '0'])).toBe(1);
      expect(String(err.mock.calls.at(-1)?.[0])).toMatch(/--slots must be an integer ≥ 1/);
      expect(await bridgeCommand(['--pool', 'p', '--instance', 'i', '--engine', 'http://e:1', '--colour', 'red'])).toBe(1);
      expect(String(err.mock.calls.at(-1)?.[0])).toMatch(/unknown option --colour/);
      expect(await bridgeCommand(['--pool', 'p', '--instance', 'i', '--engine', 'http://e:1', '--engine-kind', 'vllm'])).toBe(1);
      expect(String(err.mock.calls.at(-1)?.[0])).toMatch(/--engine-kind must be one of llamacpp, dllama/);
    } finally {
      err.mockRestore();
    }
  });
});

/** One placement per conversation, shared by its concurrent turns and aborted only when all have gone. */
import { SharedCalls } from './shared-calls';

function deferred<T>() {
  let resolve!: (v: T) => void;
  const promise = new Promise<T>((r) => (resolve = r));
  return { promise, resolve };
}

it('runs one call per key for concurrent callers, and a new one once it settled', async () => {
  const calls = new SharedCalls<string>();
  const d = deferred<string>();
  const run = jest.fn(() => d.promise);
  const a = calls.join('k', run, new AbortController().signal);
  const b = calls.join('k', run, new AbortController().signal);
  d.resolve('placed');
  await expect(Promise.all([a, b])).resolves.toEqual(['placed', 'placed']);
  expect(run).toHaveBeenCalledTimes(1);
  await calls.join('k', () => Promise.resolve('again'), new AbortController().signal);
  expect(run).toHaveBeenCalledTimes(1);
});

it('a caller that leaves is rejected at once; the call is aborted only when the last one leaves', async () => {
  const calls = new SharedCalls<string>();
  let callSignal: AbortSignal | undefined;
  const run = (signal: AbortSignal) => ((callSignal = signal), new Promise<string>(() => undefined));
  const first = new AbortController();
  const second = new AbortController();
  const a = calls.join('k', run, first.signal);
  const b = calls.join('k', run, second.signal);
  first.abort(new Error('client gone'));
  await expect(a).rejects.toThrow('client gone');
  expect(callSignal!.aborted).toBe(false);
  second.abort(new Error('also gone'));
  await expect(b).rejects.toThrow('also gone');
  expect(callSignal!.aborted).toBe(true);
});

it('abortAll aborts every call under way', async () => {
  const calls = new SharedCalls<string>();
  const run = (signal: AbortSignal) => new Promise<string>((_resolve, reject) => signal.addEventListener('abort', () => reject(signal.reason as Error)));
  const p = calls.join('k', run, new AbortController().signal);
  calls.abortAll(new Error('gateway closing'));
  await expect(p).rejects.toThrow('gateway closing');
});

/** underOwnSignal: calls under a long-lived signal leave nothing on it (the Temporal client never removes the listeners it adds). */
import { getEventListeners } from 'node:events';
import { underOwnSignal } from './temporal';

/** As @temporalio/client's Connection does: each call adds an abort listener to the signal it runs under, never removed. */
function leakyClient() {
  const signals: AbortSignal[] = [];
  return {
    signals,
    withAbortSignal: <R>(signal: AbortSignal, fn: () => Promise<R>): Promise<R> => {
      signals.push(signal);
      signal.addEventListener('abort', () => undefined);
      return fn();
    },
  };
}

it('a call runs under a signal of its own: nothing stays on the long-lived one after calls end, well or not', async () => {
  const client = leakyClient();
  const stopping = new AbortController();
  for (let k = 0; k < 100; k++) await underOwnSignal(client, stopping.signal, () => Promise.resolve(k));
  await expect(underOwnSignal(client, stopping.signal, () => Promise.reject(new Error('failed')))).rejects.toThrow('failed');
  expect(getEventListeners(stopping.signal, 'abort')).toHaveLength(0);
  expect(new Set(client.signals).size).toBe(101);
  expect(client.signals).not.toContain(stopping.signal);
});

it('aborting the long-lived signal aborts the calls in flight, with its reason; a call made after runs already aborted', async () => {
  const client = leakyClient();
  const stopping = new AbortController();
  const inFlight = underOwnSignal(
    client,
    stopping.signal,
    () => new Promise<never>((_, reject) => client.signals.at(-1)!.addEventListener('abort', () => reject(client.signals.at(-1)!.reason as Error))),
  );
  stopping.abort(new Error('stopping'));
  await expect(inFlight).rejects.toThrow('stopping');
  let sawAborted: boolean | undefined;
  await underOwnSignal(client, stopping.signal, () => Promise.resolve((sawAborted = client.signals.at(-1)!.aborted)));
  expect(sawAborted).toBe(true);
});

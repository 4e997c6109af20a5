import { StartRegistry, unlessAborted } from './local-starts';
import type { InstanceInfo } from './runtime';

const info: InstanceInfo = { instance: 'i1', subject: 'req.p.i1', healthy: true };

/** A start that ends when told to, or rejects with its signal's reason once aborted (after `stopping`). */
function controllable() {
  let finish!: (v: InstanceInfo) => void;
  let seen: AbortSignal | undefined;
  let stopped = false;
  const run = (signal: AbortSignal) => {
    seen = signal;
    return new Promise<InstanceInfo>((ok, fail) => {
      finish = ok;
      signal.addEventListener('abort', () => {
        // What the start began is stopped before it rejects.
        setImmediate(() => {
          stopped = true;
          fail(signal.reason as Error);
        });
      });
    });
  };
  return { run, finish: (v: InstanceInfo) => finish(v), signal: () => seen!, stopped: () => stopped };
}

test('callers share one start; one whose signal aborts is answered at once, the start goes on for the others', async () => {
  const starts = new StartRegistry();
  const s = controllable();
  const pending = starts.begin('p/i1', 'p', 'i1', s.run);
  const a = new AbortController();
  const b = new AbortController();
  const first = starts.join(pending, a.signal);
  const second = starts.join(pending, b.signal);
  a.abort(new Error('first gave up'));
  await expect(first).rejects.toThrow('first gave up');
  expect(s.signal().aborted).toBe(false);
  s.finish(info);
  await expect(second).resolves.toEqual(info);
  await pending.settled;
  expect(starts.get('p/i1')).toBeUndefined();
});

test('the last caller to give up aborts the start, and is answered only once it has stopped', async () => {
  const starts = new StartRegistry();
  const s = controllable();
  const pending = starts.begin('p/i1', 'p', 'i1', s.run);
  const a = new AbortController();
  const only = starts.join(pending, a.signal);
  a.abort(new Error('cancelled'));
  expect(s.signal().aborted).toBe(true);
  await expect(only).rejects.toThrow('cancelled');
  expect(s.stopped()).toBe(true);
});

test('a caller without a signal keeps the start going whoever else gives up', async () => {
  const starts = new StartRegistry();
  const s = controllable();
  const pending = starts.begin('p/i1', 'p', 'i1', s.run);
  const kept = starts.join(pending, undefined);
  const a = new AbortController();
  const leaving = starts.join(pending, a.signal);
  a.abort(new Error('gone'));
  await expect(leaving).rejects.toThrow('gone');
  expect(s.signal().aborted).toBe(false);
  s.finish(info);
  await expect(kept).resolves.toEqual(info);
});

test('abort ends a start with the reason given and waits for it; the entry is gone by then', async () => {
  const starts = new StartRegistry();
  const s = controllable();
  const pending = starts.begin('p/i1', 'p', 'i1', s.run);
  const caller = starts.join(pending, undefined);
  const settled = expect(caller).rejects.toThrow('destroyed');
  await starts.abort('p/i1', () => new Error('destroyed'));
  expect(s.stopped()).toBe(true);
  expect(starts.get('p/i1')).toBeUndefined();
  expect(starts.all()).toEqual([]);
  await settled;
  // Nothing under way: nothing to abort.
  await starts.abort('p/i1', () => new Error('never made'));
});

test('unlessAborted: the promise, or the signal’s reason as soon as it aborts', async () => {
  await expect(unlessAborted(Promise.resolve(1), undefined)).resolves.toBe(1);
  const a = new AbortController();
  const never = new Promise<number>(() => undefined);
  const raced = unlessAborted(never, a.signal);
  a.abort(new Error('stop'));
  await expect(raced).rejects.toThrow('stop');
  const gone = new AbortController();
  gone.abort(new Error('already'));
  await expect(unlessAborted(never, gone.signal)).rejects.toThrow('already');
});

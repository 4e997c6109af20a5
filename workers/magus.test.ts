import { EventEmitter } from 'node:events';
import { REPEAT_WINDOW_MS, watchStopRequests } from './magus';

/** A process stand-in: signals are emitted, kills and exits recorded, the parent settable. */
function fakeProcess(env: NodeJS.ProcessEnv = {}) {
  const emitter = new EventEmitter();
  const calls: string[] = [];
  const proc = {
    pid: 4242,
    ppid: 100,
    env,
    on: (event: string, fn: (...args: unknown[]) => void) => emitter.on(event, fn),
    off: (event: string, fn: (...args: unknown[]) => void) => emitter.off(event, fn),
    kill: (pid: number, sig: string) => {
      calls.push(`kill ${pid} ${sig}`);
      return true;
    },
    exit: (code: number) => {
      calls.push(`exit ${code}`);
    },
  };
  return {
    proc: proc as unknown as NodeJS.Process,
    emitter,
    calls,
    setParent: (ppid: number) => (proc.ppid = ppid),
    listeners: (sig: string) => emitter.listenerCount(sig),
  };
}

test('the first SIGINT asks for a stop; the same request delivered twice (terminal and npm) is one; a later one exits at once', () => {
  let now = 1000;
  const fake = fakeProcess();
  const lines: string[] = [];
  const w = watchStopRequests({ name: 'dev', forceOnRepeat: true, proc: fake.proc, log: (l) => lines.push(l), now: () => now });
  expect(w.signal.aborted).toBe(false);
  fake.emitter.emit('SIGINT', 'SIGINT');
  expect([w.signal.aborted, w.signal.reason]).toEqual([true, 'SIGINT']);
  now += REPEAT_WINDOW_MS / 2;
  fake.emitter.emit('SIGINT', 'SIGINT');
  expect(fake.calls).toEqual([]);
  now += REPEAT_WINDOW_MS;
  fake.emitter.emit('SIGTERM', 'SIGTERM');
  expect(fake.calls).toEqual(['exit 143']);
  expect(lines).toEqual(['SIGTERM again: exiting now, without finishing the stop']);
  w.dispose();
  expect(['SIGINT', 'SIGTERM', 'SIGHUP'].map(fake.listeners)).toEqual([0, 0, 0]);
});

test('a listener stays on every stop signal while it runs, so none falls to the default of dying mid-stop', () => {
  const fake = fakeProcess();
  const w = watchStopRequests({ name: 'worker', forceOnRepeat: false, proc: fake.proc, log: () => undefined });
  for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP']) expect(fake.listeners(sig)).toBe(1);
  fake.emitter.emit('SIGTERM', 'SIGTERM');
  fake.emitter.emit('SIGINT', 'SIGINT');
  expect(fake.calls).toEqual([]); // forceOnRepeat false: the mode's own second-signal handling
  w.dispose();
});

test('SIGHUP (a closed terminal) is passed on as SIGTERM, which every mode handles', () => {
  const fake = fakeProcess();
  const w = watchStopRequests({ name: 'gateway', forceOnRepeat: true, proc: fake.proc, log: () => undefined });
  fake.emitter.emit('SIGHUP', 'SIGHUP');
  expect(w.signal.reason).toBe('SIGHUP');
  expect(fake.calls).toEqual(['kill 4242 SIGTERM']);
  w.dispose();
});

test('started by npm: when the parent goes away (npm killed, its shell dead) it stops as on SIGTERM', async () => {
  const fake = fakeProcess({ npm_lifecycle_event: 'dev' });
  const lines: string[] = [];
  const w = watchStopRequests({ name: 'dev', forceOnRepeat: true, proc: fake.proc, log: (l) => lines.push(l), parentCheckMs: 10 });
  await new Promise((r) => setTimeout(r, 50));
  expect(fake.calls).toEqual([]);
  fake.setParent(1);
  await new Promise((r) => setTimeout(r, 50));
  expect(fake.calls).toEqual(['kill 4242 SIGTERM']);
  expect(lines).toEqual(['the npm that started it has gone (parent 100): stopping']);
  w.dispose();
});

test('not started by npm: a parent that goes away is not a stop request (nohup, a daemonising shell)', async () => {
  const fake = fakeProcess({});
  const w = watchStopRequests({ name: 'dev', forceOnRepeat: true, proc: fake.proc, log: () => undefined, parentCheckMs: 10 });
  fake.setParent(1);
  await new Promise((r) => setTimeout(r, 50));
  expect(fake.calls).toEqual([]);
  w.dispose();
});

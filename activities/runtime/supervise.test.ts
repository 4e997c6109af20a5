import { supervise, type SuperviseOptions } from './supervise';
import { sleep, until } from '../../test/harness/wait';

/** Something that serves until `die()`; each one has its own id. */
class Fake {
  static started = 0;
  readonly id = ++Fake.started;
  running = true;
  die!: (how: string) => void;
  readonly ended = new Promise<string>((resolve) => (this.die = (how) => ((this.running = false), resolve(how))));
}

function supervised(over: Partial<SuperviseOptions<Fake>> = {}) {
  const logs: string[] = [];
  const stopped: number[] = [];
  const first = new Fake();
  const s = supervise(first, {
    name: 'p/i1 engine',
    log: (l) => logs.push(l),
    policy: { maxRestarts: 2, windowMs: 60_000, backoffMs: 1 },
    where: 'on port 1234',
    ended: (f) => f.ended,
    running: (f) => f.running,
    restart: () => Promise.resolve(new Fake()),
    stop: (f) => {
      stopped.push(f.id);
      f.running = false;
      return Promise.resolve();
    },
    ...over,
  });
  return { s, first, logs, stopped };
}

it('restarts what stopped by itself, in place, and reports it healthy again', async () => {
  const { s, first, logs } = supervised();
  first.die('was killed by SIGKILL');
  await until('a healthy replacement', () => s.current !== first && s.healthy(), 5_000);
  expect(s.restarts).toBe(1);
  expect(logs).toEqual(['p/i1 engine was killed by SIGKILL; restarting it on port 1234 in 1 ms']);
});

it('says how it stopped and that it is recovering until the restart completes (what the pool reports)', async () => {
  let release!: () => void;
  const gate = new Promise<void>((r) => (release = r));
  const { s, first } = supervised({ restart: () => gate.then(() => new Fake()) });
  expect([s.stops, s.lastStop, s.recovering()]).toEqual([0, undefined, false]);
  first.die('node 1 (worker) was killed by SIGKILL');
  await until('the stop is seen', () => s.stops === 1, 5_000);
  expect([s.lastStop, s.recovering(), s.healthy()]).toEqual(['node 1 (worker) was killed by SIGKILL', true, true]);
  release();
  await until('restarted', () => !s.recovering(), 5_000);
  expect([s.stops, s.restarts, s.lastStop]).toEqual([1, 1, 'node 1 (worker) was killed by SIGKILL']);
});

it('more stops within the window than the policy allows: given up, unhealthy, and nothing is started again', async () => {
  const { s, first, logs } = supervised();
  first.die('exited with code 1');
  await until('the first restart', () => s.restarts === 1, 5_000);
  s.current.die('exited with code 1');
  await until('the second restart', () => s.restarts === 2, 5_000);
  expect(logs[1]).toBe('p/i1 engine exited with code 1; restarting it on port 1234 in 2 ms'); // the backoff doubles
  const last = s.current;
  last.die('exited with code 1');
  await until('given up', () => !s.healthy(), 5_000);
  expect(s.current).toBe(last);
  expect(logs.at(-1)).toBe('p/i1 engine exited with code 1; 2 restarts within 60s already: giving up');
});

it('a restart that fails is tried again after the next backoff, and gives up when the window is used up', async () => {
  let attempts = 0;
  const { s, first, logs } = supervised({ restart: () => (++attempts, Promise.reject(new Error('port in use'))) });
  first.die('was killed by SIGKILL');
  await until('given up, with its two lines logged', () => !s.healthy() && logs.length === 2, 5_000);
  expect(attempts).toBe(2);
  expect(logs[1]).toBe('p/i1 engine could not be restarted (port in use): giving up');
});

it('stop() stops what runs, and what stops after that is not restarted', async () => {
  const { s, first, stopped } = supervised();
  await s.stop();
  expect(stopped).toEqual([first.id]);
  first.die('exited with code 0');
  await sleep(30);
  expect(s.current).toBe(first);
  expect(s.healthy()).toBe(false);
});

it('a restart that completes after stop() is stopped at once', async () => {
  let release!: () => void;
  const gate = new Promise<void>((r) => (release = r));
  const { s, first, stopped } = supervised({ restart: () => gate.then(() => new Fake()) });
  first.die('was killed by SIGKILL');
  await sleep(20); // the restart is under way
  const stopping = s.stop();
  release();
  await stopping;
  await until('both stopped', () => stopped.length === 2, 5_000);
  expect(s.current).toBe(first);
});

it('stop() during a restart aborts the start and resolves only once it has ended; nothing is started after', async () => {
  let seen: AbortSignal | undefined;
  let attempts = 0;
  let startEnded = false;
  const { s, first, stopped } = supervised({
    restart: (signal) => {
      attempts += 1;
      seen = signal;
      // A start that takes its time to clean up after the abort (a process being killed).
      return new Promise((_, fail) => signal.addEventListener('abort', () => setTimeout(() => ((startEnded = true), fail(new Error('aborted'))), 20)));
    },
  });
  first.die('was killed by SIGKILL');
  await until('the restart started', () => seen !== undefined, 5_000);
  await s.stop();
  expect(seen!.aborted).toBe(true);
  expect(startEnded).toBe(true);
  expect(stopped).toEqual([first.id]);
  await sleep(30);
  expect(attempts).toBe(1);
  expect(s.current).toBe(first);
  expect(s.healthy()).toBe(false);
});

it('stop() during the backoff: no restart is attempted', async () => {
  let attempts = 0;
  const { s, first } = supervised({
    policy: { maxRestarts: 2, windowMs: 60_000, backoffMs: 60_000 },
    restart: () => (++attempts, Promise.resolve(new Fake())),
  });
  first.die('was killed by SIGKILL');
  await until('healthy again', () => s.healthy(), 5_000); // restarting, within the policy
  await s.stop(); // resolves at once, not after the 60 s backoff
  expect(attempts).toBe(0);
  expect(s.healthy()).toBe(false);
});

it('restarts at once while something waits on standby (immediate), backs off otherwise, and still gives a crash loop up', async () => {
  let waiting = true;
  const { s, first, logs } = supervised({ policy: { maxRestarts: 2, windowMs: 60_000, backoffMs: 40 }, immediate: () => waiting });
  first.die('was killed by SIGKILL');
  await until('the first restart', () => s.restarts === 1, 5_000);
  s.current.die('was killed by SIGKILL');
  await until('the second restart', () => s.restarts === 2, 5_000);
  waiting = false;
  s.current.die('was killed by SIGKILL');
  await until('given up', () => !s.healthy(), 5_000);
  expect(logs).toEqual([
    'p/i1 engine was killed by SIGKILL; restarting it on port 1234 in 0 ms',
    'p/i1 engine was killed by SIGKILL; restarting it on port 1234 in 0 ms',
    'p/i1 engine was killed by SIGKILL; 2 restarts within 60s already: giving up',
  ]);
  // Nothing waits: the backoff, doubling.
  const other = supervised({ policy: { maxRestarts: 2, windowMs: 60_000, backoffMs: 40 }, immediate: () => false });
  other.first.die('was killed by SIGKILL');
  await until('restarted', () => other.s.restarts === 1, 5_000);
  other.s.current.die('was killed by SIGKILL');
  await until('restarted again', () => other.s.restarts === 2, 5_000);
  expect(other.logs).toEqual([
    'p/i1 engine was killed by SIGKILL; restarting it on port 1234 in 40 ms',
    'p/i1 engine was killed by SIGKILL; restarting it on port 1234 in 80 ms',
  ]);
});

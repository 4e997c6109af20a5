/**
 * Waiting in tests for something that happens elsewhere (another process, a server, a timer), and
 * whether a process still runs. Every test waits with these: one `sleep`, one poll (`until`), and
 * `eventually` for an assertion that has to come true.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { setTimeout as timer } from 'node:timers/promises';

/** Resolves after `ms` milliseconds. */
export const sleep = (ms: number): Promise<void> => timer(ms);

/**
 * Polls `cond` until it holds; throws `timed out waiting for <what>` after `timeoutMs` (`what`
 * read then, when a function: the state it names at the end, not at the start). The first polls
 * come quickly (5 ms, doubling to 50 ms), so a condition about to hold costs a unit test little
 * and a long wait costs the machine little.
 */
export async function until(what: string | (() => string), cond: () => boolean | Promise<boolean>, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  for (let pause = 5; !(await cond()); pause = Math.min(2 * pause, 50)) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${typeof what === 'string' ? what : what()}`);
    await sleep(pause);
  }
}

/** Polls `check` until it resolves without throwing (an `expect` inside, say); rethrows its last error after `timeoutMs`. */
export async function eventually<T>(check: () => Promise<T>, timeoutMs = 20_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    try {
      return await check();
    } catch (err) {
      if (Date.now() > deadline) throw err;
      await sleep(200);
    }
  }
}

/** Whether process `pid` is alive and not a zombie (a zombie has exited; it only waits to be reaped). */
export function processRunning(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2, stat.lastIndexOf(')') + 3) !== 'Z';
  } catch {
    return false;
  }
}

/** Pids of the live processes whose arguments name a file in `folder` (an engine over a cached model). */
export function processesUsing(folder: string): number[] {
  return readdirSync('/proc')
    .filter((p) => /^\d+$/.test(p) && Number(p) !== process.pid)
    .filter((p) => {
      try {
        return (
          readFileSync(`/proc/${p}/cmdline`, 'utf8')
            .split('\0')
            .some((a) => a.startsWith(`${folder}/`)) && processRunning(Number(p))
        );
      } catch {
        return false;
      }
    })
    .map(Number);
}

/** Whether `pid` is an engine waiting on standby (`magus engine --standby`), not one serving. */
export function onStandby(pid: number): boolean {
  try {
    return readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').includes('--standby');
  } catch {
    return false;
  }
}

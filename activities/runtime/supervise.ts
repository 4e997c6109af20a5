/**
 * Restart in place, for whatever serves an instance (a llama.cpp engine, a distributed-llama
 * topology): when it stops by itself it is started again where it was (the same port, so the
 * instance's bridge and its queued requests carry on) after a backoff. Too many stops within a
 * window is a crash loop: it is given up and stays down, and `healthy()` turns false for the pool
 * to replace the instance.
 */
import { setTimeout as sleep } from 'node:timers/promises';

export interface RestartPolicy {
  /** Restarts allowed within `windowMs` before it is given up (unhealthy). Default 3. */
  maxRestarts: number;
  windowMs: number;
  /** Pause before the first restart; doubles with each restart in the window. Default 500 ms. */
  backoffMs: number;
}

export const DEFAULT_RESTART_POLICY: RestartPolicy = { maxRestarts: 3, windowMs: 10 * 60_000, backoffMs: 500 };

export interface Supervised<T> {
  /** What runs now (a new one after each restart). */
  readonly current: T;
  readonly restarts: number;
  /** Times it stopped by itself (each began a restart, or the giving up). */
  readonly stops: number;
  /** How it last stopped by itself (`exited with code 1`, `node 1 (worker) killed by SIGKILL`), if it did. */
  readonly lastStop: string | undefined;
  /** Stopped by itself and being started again now (the backoff or the start under way). */
  recovering(): boolean;
  /** Running, or being restarted within the policy; false once given up or stopped. */
  healthy(): boolean;
  /** Stops it for good: a restart under way is aborted and awaited, and none follows. */
  stop(): Promise<void>;
}

export interface SuperviseOptions<T> {
  /** Names it in log lines. */
  name: string;
  log: (line: string) => void;
  policy?: Partial<RestartPolicy>;
  /** Where it is restarted, for the log (`on port 8080`). */
  where: string;
  /** Resolves, saying how, when `t` stopped by itself (never after `stop`). */
  ended: (t: T) => Promise<string>;
  running: (t: T) => boolean;
  /**
   * Starts it again where it was. `signal` aborts when `stop()` is called meanwhile: the start
   * must then stop whatever it started and reject.
   */
  restart: (signal: AbortSignal) => Promise<T>;
  stop: (t: T) => Promise<void>;
  /**
   * Whether the next restart may come at once, without its backoff (an engine waits on standby,
   * loaded: starting it costs little). A crash loop is still given up after `maxRestarts`.
   */
  immediate?: () => boolean;
  /** What a restart's log line says of what now runs (`pid 4242`); absent: no line. */
  describe?: (t: T) => string;
}

/** Watches `first` (already started) and restarts it in place by the policy. */
export function supervise<T>(first: T, o: SuperviseOptions<T>): Supervised<T> {
  const policy = { ...DEFAULT_RESTART_POLICY, ...o.policy };
  let current = first;
  let givenUp = false;
  let restarts = 0;
  let stops = 0;
  let lastStop: string | undefined;
  const recent: number[] = [];
  // Aborted by stop(): the backoff and a start under way end at once.
  const stopping = new AbortController();
  /** The restart under way (backoff and start), so stop() can wait for it to end. */
  let restarting: Promise<void> | null = null;

  /** Counts a restart in the window and returns its backoff; null when that is one too many (a crash loop). */
  const nextDelay = (): number | null => {
    const now = Date.now();
    while (recent.length > 0 && now - recent[0]! > policy.windowMs) recent.shift();
    if (recent.length >= policy.maxRestarts) return null;
    recent.push(now);
    if (o.immediate?.()) return 0;
    return policy.backoffMs * 2 ** (recent.length - 1);
  };

  const restartLoop = async (delay: number): Promise<void> => {
    for (let next: number | null = delay; next !== null;) {
      await sleep(next, undefined, { signal: stopping.signal }).catch(() => undefined);
      if (stopping.signal.aborted) return;
      let started: T;
      try {
        started = await o.restart(stopping.signal);
      } catch (err) {
        if (stopping.signal.aborted) return;
        next = nextDelay();
        if (next === null) {
          givenUp = true;
          o.log(`${o.name} could not be restarted (${(err as Error).message}): giving up`);
        }
        continue;
      }
      // A start that ignored the abort: it must not outlive stop().
      if (stopping.signal.aborted) return o.stop(started);
      current = started;
      restarts += 1;
      if (o.describe) o.log(`${o.name} restarted ${o.where} (${o.describe(started)})`);
      watch(current);
      return;
    }
  };

  const watch = (t: T): void => {
    void o.ended(t).then((how) => {
      if (stopping.signal.aborted || t !== current) return;
      stops += 1;
      lastStop = how;
      const delay = nextDelay();
      if (delay === null) {
        givenUp = true;
        o.log(`${o.name} ${how}; ${recent.length} restarts within ${policy.windowMs / 1000}s already: giving up`);
        return;
      }
      o.log(`${o.name} ${how}; restarting it ${o.where} in ${delay} ms`);
      const run: Promise<void> = restartLoop(delay)
        .catch((err: unknown) => o.log(`${o.name} could not be stopped (${(err as Error).message})`))
        .finally(() => {
          if (restarting === run) restarting = null;
        });
      restarting = run;
    });
  };
  watch(current);

  return {
    get current() {
      return current;
    },
    get restarts() {
      return restarts;
    },
    get stops() {
      return stops;
    },
    get lastStop() {
      return lastStop;
    },
    recovering: () => restarting !== null,
    healthy: () => !givenUp && !stopping.signal.aborted && (restarting !== null || o.running(current)),
    async stop() {
      stopping.abort();
      await restarting;
      await o.stop(current);
    },
  };
}

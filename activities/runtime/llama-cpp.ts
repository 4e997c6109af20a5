/**
 * The llama.cpp engine of the `local` runtime: one `magus engine` process over a GGUF, with
 * distributed-llama's HTTP surface. It reports `listening` and `ready` as JSON lines on stdout.
 */
import { join, resolve } from 'node:path';
import { spawnSupervised, describeExit, type SupervisedProcess } from './process';

/** How to run `magus engine` from here: the compiled CLI, or the sources under a TS loader. */
function engineArgv(args: string[]): string[] {
  if (__filename.endsWith('.ts')) {
    const root = resolve(__dirname, '..', '..');
    return [process.execPath, '-r', require.resolve('@swc-node/register'), '-e', `require(${JSON.stringify(join(root, 'workers', 'engine'))}).engineCommand(process.argv.slice(1)).then((c) => process.exit(c))`, '--', ...args];
  }
  return [process.execPath, resolve(__dirname, '..', '..', '..', 'bin', 'magus.js'), 'engine', ...args];
}

export interface LlamaCppEngine {
  url: string;
  port: number;
  process: SupervisedProcess;
}

/**
 * Starts an engine and resolves with its URL once it reports ready (a failed start leaves no
 * process behind). `port`: a fixed one (a restart keeps the URL its bridge calls); default any.
 */
export function startLlamaCppEngine(
  model: string,
  opts: { modelId: string; slots: number; threads: number; startTimeoutSec: number; name: string; log: (line: string) => void; output?: (line: string) => void; port?: number },
): Promise<LlamaCppEngine> {
  const argv = engineArgv(['--model', model, '--model-id', opts.modelId, '--port', String(opts.port ?? 0), '--json', '--slots', String(opts.slots), '--threads', String(opts.threads)]);
  let url: string | null = null;
  let onReady: (() => void) | undefined;
  const proc = spawnSupervised(opts.name, argv, {
    log: opts.output ?? (() => undefined),
    onStdoutLine: (line) => {
      let event: { event?: string; url?: string };
      try {
        event = JSON.parse(line) as typeof event;
      } catch {
        return;
      }
      if (event.event === 'listening' && event.url) url = event.url;
      if (event.event === 'ready' && url) onReady?.();
    },
  });
  return new Promise((ok, fail) => {
    const timer = setTimeout(() => {
      fail(new Error(`engine did not become ready within ${opts.startTimeoutSec}s`));
      void proc.stop(0);
    }, opts.startTimeoutSec * 1000);
    void proc.exited.then((e) => {
      clearTimeout(timer);
      fail(new Error(`engine ${describeExit(e)} before it was ready`));
    });
    onReady = () => {
      clearTimeout(timer);
      ok({ url: url!, port: Number(new URL(url!).port), process: proc });
    };
  });
}

export interface RestartPolicy {
  /** Restarts allowed within `windowMs` before the engine is given up (unhealthy). Default 3. */
  maxRestarts: number;
  windowMs: number;
  /** Pause before the first restart; doubles with each restart in the window. Default 500 ms. */
  backoffMs: number;
}

export const DEFAULT_RESTART_POLICY: RestartPolicy = { maxRestarts: 3, windowMs: 10 * 60_000, backoffMs: 500 };

/** An engine that is restarted in place (same port, so its bridge and queued requests carry on) when it dies. */
export interface SupervisedEngine {
  url: string;
  port: number;
  /** The current process (a new one after each restart). */
  readonly process: SupervisedProcess;
  readonly restarts: number;
  /** Running, or being restarted within the policy; false once given up. */
  healthy(): boolean;
  stop(graceMs: number): Promise<void>;
}

/**
 * Starts an engine and keeps it running: when it exits unexpectedly it is started again on the
 * same port after a backoff; requests in flight fail over to the bridge's retry (nak, redelivery)
 * and queued ones wait in the instance's consumer. More than `maxRestarts` exits within
 * `windowMs` (a crash loop) and it stays down: `healthy()` turns false, for the pool to replace.
 */
export async function startSupervisedEngine(
  model: string,
  opts: Parameters<typeof startLlamaCppEngine>[1] & { restart?: Partial<RestartPolicy> },
): Promise<SupervisedEngine> {
  const policy = { ...DEFAULT_RESTART_POLICY, ...opts.restart };
  let current = await startLlamaCppEngine(model, opts);
  const port = current.port;
  let stopping = false;
  let givenUp = false;
  let restarting = false;
  let restarts = 0;
  const recent: number[] = [];

  /** Counts a restart in the window and returns its backoff; null when that is one too many (a crash loop). */
  const nextDelay = (): number | null => {
    const now = Date.now();
    while (recent.length > 0 && now - recent[0]! > policy.windowMs) recent.shift();
    if (recent.length >= policy.maxRestarts) return null;
    recent.push(now);
    return policy.backoffMs * 2 ** (recent.length - 1);
  };

  const watch = (engine: LlamaCppEngine): void => {
    void engine.process.exited.then(async (exit) => {
      if (stopping || engine !== current) return;
      let delay = nextDelay();
      if (delay === null) {
        givenUp = true;
        opts.log(`${opts.name} ${describeExit(exit)}; ${recent.length} restarts within ${policy.windowMs / 1000}s already: giving up`);
        return;
      }
      opts.log(`${opts.name} ${describeExit(exit)}; restarting it on port ${port} in ${delay} ms`);
      restarting = true;
      try {
        while (delay !== null) {
          await new Promise((r) => setTimeout(r, delay!));
          if (stopping) return;
          try {
            current = await startLlamaCppEngine(model, { ...opts, port });
            restarts += 1;
            watch(current);
            return;
          } catch (err) {
            delay = nextDelay();
            if (delay === null) {
              givenUp = true;
              opts.log(`${opts.name} could not be restarted (${(err as Error).message}): giving up`);
            }
          }
        }
      } finally {
        restarting = false;
      }
    });
  };
  watch(current);

  return {
    url: current.url,
    port,
    get process() {
      return current.process;
    },
    get restarts() {
      return restarts;
    },
    healthy: () => !givenUp && !stopping && (restarting || !current.process.exit),
    async stop(graceMs: number) {
      stopping = true;
      await current.process.stop(graceMs);
    },
  };
}

/**
 * The llama.cpp engine of the `local` runtime: one `magus engine` process over a GGUF, with
 * distributed-llama's HTTP surface. It reports `listening` and `ready` as JSON lines on stdout.
 */
import { join, resolve } from 'node:path';
import { spawnSupervised, describeExit, type SupervisedProcess } from './process';
import { supervise, type RestartPolicy, type Supervised } from './supervise';

export type { RestartPolicy } from './supervise';

/** How to run `magus engine` from here: the compiled CLI, or the sources under a TS loader. */
function engineArgv(args: string[]): string[] {
  if (__filename.endsWith('.ts')) {
    const root = resolve(__dirname, '..', '..');
    return [process.execPath, '-r', require.resolve('@swc-node/register'), '-e', `require(${JSON.stringify(join(root, 'workers', 'engine'))}).engineCommand(process.argv.slice(1)).then((c) => process.exit(c))`, '--', ...args];
  }
  return [process.execPath, resolve(__dirname, '..', '..', '..', 'bin', 'magus.js'), 'engine', ...args];
}

/**
 * `magus engine …` arguments (after the mode): the one builder of an engine's command line, for
 * the local runtime (loopback, any port) and the Kubernetes one (0.0.0.0 in its pod, so the
 * kubelet's probes reach it).
 */
export function engineArgs(o: { model: string; modelId: string; port: number; slots: number; threads: number; host?: string; /** Tokens per slot (default: the engine's). */ ctx?: number }): string[] {
  return [
    ...['--model', o.model, '--model-id', o.modelId, ...(o.host ? ['--host', o.host] : []), '--port', String(o.port), '--json', '--slots', String(o.slots), '--threads', String(o.threads)],
    ...(o.ctx !== undefined ? ['--ctx', String(o.ctx)] : []),
  ];
}

export interface LlamaCppEngine {
  url: string;
  port: number;
  process: SupervisedProcess;
}

/**
 * Starts an engine and resolves with its URL once it reports ready. A failed start (it exits,
 * the deadline passes, `signal` aborts) rejects only once the process has exited, so it leaves
 * none behind; aborted, it rejects with `signal.reason`. `port`: a fixed one (a restart keeps
 * the URL its bridge calls); default any.
 */
export function startLlamaCppEngine(
  model: string,
  opts: { modelId: string; slots: number; threads: number; ctx?: number; startTimeoutSec: number; name: string; log: (line: string) => void; output?: (line: string) => void; port?: number; signal?: AbortSignal },
): Promise<LlamaCppEngine> {
  const { signal } = opts;
  if (signal?.aborted) return Promise.reject(signal.reason as Error);
  const argv = engineArgv(engineArgs({ model, modelId: opts.modelId, port: opts.port ?? 0, slots: opts.slots, threads: opts.threads, ...(opts.ctx !== undefined ? { ctx: opts.ctx } : {}) }));
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
    /** Why the start is being given up; it fails with this once the process has exited. */
    let giveUp: Error | null = null;
    const abandon = (why: Error) => {
      giveUp ??= why;
      // Nothing is served yet: no grace to give.
      void proc.stop(0);
    };
    const timer = setTimeout(() => abandon(new Error(`engine did not become ready within ${opts.startTimeoutSec}s`)), opts.startTimeoutSec * 1000);
    const onAbort = () => abandon(signal!.reason as Error);
    signal?.addEventListener('abort', onAbort, { once: true });
    void proc.exited.then((e) => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', onAbort);
      fail(giveUp ?? new Error(`engine ${describeExit(e)} before it was ready`));
    });
    onReady = () => {
      if (giveUp) return;
      clearTimeout(timer);
      signal?.removeEventListener('abort', onAbort);
      ok({ url: url!, port: Number(new URL(url!).port), process: proc });
    };
  });
}

/**
 * Starts an engine and keeps it running (supervise.ts): when it exits unexpectedly it is started
 * again on the same port (its URL, which the bridge calls, stays) after a backoff; requests in
 * flight fail over to the bridge's retry (nak, redelivery) and queued ones wait in the instance's
 * consumer. A crash loop and it stays down: `healthy()` turns false, for the pool to replace.
 */
export async function startSupervisedEngine(
  model: string,
  opts: Parameters<typeof startLlamaCppEngine>[1] & { restart?: Partial<RestartPolicy>; stopGraceMs: number },
): Promise<Supervised<LlamaCppEngine>> {
  const first = await startLlamaCppEngine(model, opts);
  const port = first.port;
  // `signal` is the first start's; a restart is aborted by stop() instead.
  const { signal: _startOnly, ...again } = opts;
  return supervise(first, {
    name: opts.name,
    log: opts.log,
    policy: opts.restart,
    where: `on port ${port}`,
    ended: (e) => e.process.exited.then(describeExit),
    running: (e) => !e.process.exit,
    restart: (signal) => startLlamaCppEngine(model, { ...again, port, signal }),
    stop: (e) => e.process.stop(opts.stopGraceMs),
  });
}

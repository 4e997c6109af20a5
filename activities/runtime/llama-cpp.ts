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
  return supervise(first, {
    name: opts.name,
    log: opts.log,
    policy: opts.restart,
    where: `on port ${port}`,
    ended: (e) => e.process.exited.then(describeExit),
    running: (e) => !e.process.exit,
    restart: () => startLlamaCppEngine(model, { ...opts, port }),
    stop: (e) => e.process.stop(opts.stopGraceMs),
  });
}

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

/** Starts an engine and resolves with its URL once it reports ready (a failed start leaves no process behind). */
export function startLlamaCppEngine(
  model: string,
  opts: { modelId: string; slots: number; threads: number; startTimeoutSec: number; name: string; log: (line: string) => void },
): Promise<LlamaCppEngine> {
  const argv = engineArgv(['--model', model, '--model-id', opts.modelId, '--port', '0', '--json', '--slots', String(opts.slots), '--threads', String(opts.threads)]);
  let url: string | null = null;
  let onReady: (() => void) | undefined;
  const proc = spawnSupervised(opts.name, argv, {
    log: opts.log,
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

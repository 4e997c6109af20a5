/**
 * Child processes of the local runtime (engines, distributed-llama roots and workers). Each runs
 * under `setpriv --pdeathsig KILL`, so the kernel kills it when the worker that started it dies,
 * however that happens; its output goes to the runtime's log a line at a time, prefixed with its
 * name, and the last lines are kept for error messages.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { accessSync, constants } from 'node:fs';
import { delimiter, join } from 'node:path';
import { createInterface } from 'node:readline';

export interface ProcessExit {
  code: number | null;
  signal: NodeJS.Signals | null;
  /** Set when the process could not be started at all. */
  error?: Error;
}

export interface SupervisedProcess {
  /** Log prefix, e.g. `pool/i-1 worker 1`. */
  readonly name: string;
  readonly child: ChildProcess;
  /** The program and arguments the process runs (what setpriv executes). */
  readonly argv: readonly string[];
  /** Null while it runs. */
  readonly exit: ProcessExit | null;
  /** Resolves when it has exited (or failed to start). */
  readonly exited: Promise<ProcessExit>;
  /** Its last lines of output (stdout and stderr), oldest first. */
  tail(): string[];
  /** SIGTERM; SIGKILL if it is still running after `graceMs`. Resolves once it has exited. */
  stop(graceMs: number): Promise<void>;
}

export interface SpawnOptions {
  log: (line: string) => void;
  /** Handles stdout lines instead of logging them (they still enter the tail). */
  onStdoutLine?: (line: string) => void;
  /**
   * Run through `stdbuf -oL` when it is installed: a C program's stdout into a pipe is block
   * buffered, so its log lines would arrive kilobytes late.
   */
  lineBuffered?: boolean;
  /** Its stdin is a pipe (`child.stdin`; a write after it has gone is dropped), not closed. */
  stdin?: boolean;
  /** Set in its environment beside the worker's own (e.g. a secret it must not see on its command line, which any process can read). */
  env?: Readonly<Record<string, string>>;
}

const TAIL_LINES = 20;

let stdbufPath: string | null | undefined;
function stdbuf(): string | null {
  if (stdbufPath === undefined) {
    stdbufPath =
      (process.env.PATH ?? '')
        .split(delimiter)
        .filter(Boolean)
        .map((dir) => join(dir, 'stdbuf'))
        .find((p) => {
          try {
            accessSync(p, constants.X_OK);
            return true;
          } catch {
            return false;
          }
        }) ?? null;
  }
  return stdbufPath;
}

export function spawnSupervised(name: string, argv: readonly string[], opts: SpawnOptions): SupervisedProcess {
  const [cmd, ...args] = argv;
  if (!cmd) throw new Error(`${name}: empty command`);
  const buffering = opts.lineBuffered && stdbuf() ? [stdbuf()!, '-oL', '-eL'] : [];
  // A process group of its own: a terminal's Ctrl-C goes to the worker (or `magus dev`), which
  // stops its engines in order, not to the engines behind its back. pdeathsig still ends them
  // with the process that started them.
  const child = spawn('setpriv', ['--pdeathsig', 'KILL', '--', ...buffering, cmd, ...args], {
    stdio: [opts.stdin ? 'pipe' : 'ignore', 'pipe', 'pipe'],
    detached: true,
    ...(opts.env ? { env: { ...process.env, ...opts.env } } : {}),
  });
  child.stdin?.on('error', () => undefined); // EPIPE: it has exited, which `exited` says
  const lines: string[] = [];
  const remember = (line: string): void => {
    lines.push(line);
    if (lines.length > TAIL_LINES) lines.shift();
  };
  createInterface({ input: child.stdout! }).on('line', (line) => {
    remember(line);
    if (opts.onStdoutLine) opts.onStdoutLine(line);
    else opts.log(`${name}: ${line}`);
  });
  createInterface({ input: child.stderr! }).on('line', (line) => {
    remember(line);
    opts.log(`${name}: ${line}`);
  });
  let exit: ProcessExit | null = null;
  const exited = new Promise<ProcessExit>((resolve) => {
    child.once('error', (error) => {
      // Only a failed spawn leaves no 'exit' to follow.
      if (child.pid === undefined) {
        exit = { code: null, signal: null, error };
        resolve(exit);
      }
    });
    child.once('exit', (code, signal) => {
      exit = { code, signal };
      // Its last words are still in the pipes: give them a moment to reach the tail.
      const settled = exit;
      const timer = setTimeout(() => resolve(settled), 250);
      child.once('close', () => {
        clearTimeout(timer);
        resolve(settled);
      });
    });
  });
  return {
    name,
    child,
    argv: [cmd, ...args],
    get exit() {
      return exit;
    },
    exited,
    tail: () => [...lines],
    async stop(graceMs: number) {
      if (exit) return;
      child.kill('SIGTERM');
      let timer: NodeJS.Timeout | undefined;
      const graceOver = new Promise<'grace over'>((r) => (timer = setTimeout(() => r('grace over'), graceMs)));
      const first = await Promise.race([exited, graceOver]);
      clearTimeout(timer);
      if (first === 'grace over') {
        child.kill('SIGKILL');
        await exited;
      }
    },
  };
}

/** How a process ended, for messages: `exited with code 1`, `was killed by SIGKILL`, … */
export function describeExit(e: ProcessExit): string {
  if (e.error) return `could not be started (${e.error.message})`;
  if (e.signal) return `was killed by ${e.signal}`;
  return `exited with code ${e.code}`;
}

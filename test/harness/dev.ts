/**
 * `magus dev` as a user starts it — `node bin/magus.js dev` directly, `npm run dev`, or
 * `npx magus dev` — in a process group of its own, as a terminal runs a command (so a test can
 * send a "Ctrl-C" to the whole group), with its output collected and the process tree below it
 * read from /proc. Uses the compiled CLI (`npm run build`), as users do.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { processRunning, sleep } from './wait';

export const REPO_ROOT = join(__dirname, '..', '..');
export const MAGUS_BIN = join(REPO_ROOT, 'bin', 'magus.js');

/** What a finished `magus` command printed, its exit code and how long it ran. */
export interface MagusRun {
  code: number | null;
  stdout: string;
  stderr: string;
  ms: number;
}

/** `magus <args>` (the built CLI) to its end, with `env`; killed after `timeoutMs`. */
export function runMagus(args: string[], env: NodeJS.ProcessEnv, timeoutMs = 20_000): Promise<MagusRun> {
  const started = Date.now();
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [MAGUS_BIN, ...args], { cwd: REPO_ROOT, env, stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d: Buffer) => (stdout += d.toString()));
    child.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
    const timer = setTimeout(() => child.kill('SIGKILL'), timeoutMs);
    child.once('error', reject);
    child.once('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr, ms: Date.now() - started });
    });
  });
}

export type DevLauncher = 'direct' | 'npm' | 'npx';

export interface DevRun {
  /** The process the launcher started: node itself, npm, or npx. */
  child: ChildProcess;
  /** Everything printed so far, stdout and stderr. */
  stdout(): string;
  stderr(): string;
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  /**
   * Resolves once every process holding the top process's stdout and stderr (dev itself, when npx
   * is gone before it) has closed them: all it printed has been read.
   */
  outputClosed: Promise<void>;
  /** Resolves once dev has printed its last ready line; rejects if it exits first or after `timeoutMs`. */
  ready(timeoutMs?: number): Promise<void>;
  /** The top process and every descendant of it now. */
  tree(): number[];
  /** SIGKILL to every process of the tree (cleanup after a failed test). */
  killTree(): void;
}

/** Children of every process, from /proc (`ppid` is the 2nd field after the command). */
function childrenByParent(): Map<number, number[]> {
  const map = new Map<number, number[]>();
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      const stat = readFileSync(`/proc/${entry}/stat`, 'utf8');
      const ppid = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
      const list = map.get(ppid) ?? [];
      list.push(Number(entry));
      map.set(ppid, list);
    } catch {
      // exited meanwhile
    }
  }
  return map;
}

/** The running descendants of `pid` whose program (argv[0]) is one of `programs`, with their arguments. */
export function descendantsRunning(pid: number, programs: readonly string[]): { pid: number; argv: string[] }[] {
  return processTree(pid)
    .filter((p) => p !== pid)
    .flatMap((p) => {
      try {
        const argv = readFileSync(`/proc/${p}/cmdline`, 'utf8').split('\0').slice(0, -1);
        return programs.includes(argv[0]!) ? [{ pid: p, argv }] : [];
      } catch {
        return []; // exited meanwhile
      }
    });
}

/** `pid` and all its descendants. */
export function processTree(pid: number): number[] {
  const children = childrenByParent();
  const out: number[] = [];
  const todo = [pid];
  while (todo.length > 0) {
    const p = todo.pop()!;
    out.push(p);
    todo.push(...(children.get(p) ?? []));
  }
  return out.filter(processRunning);
}

/** Starts `magus dev <args>` the way `launcher` says, in a new process group. */
export function startDev(launcher: DevLauncher, args: string[], env: NodeJS.ProcessEnv = process.env): DevRun {
  const [cmd, argv] =
    launcher === 'direct'
      ? [process.execPath, [MAGUS_BIN, 'dev', ...args]]
      : launcher === 'npm'
        ? ['npm', ['run', 'dev', '--', ...args]]
        : ['npx', ['magus', 'dev', ...args]];
  const child = spawn(cmd, argv, { cwd: REPO_ROOT, env, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
  let out = '';
  let err = '';
  child.stdout.on('data', (d: Buffer) => (out += d.toString()));
  child.stderr.on('data', (d: Buffer) => (err += d.toString()));
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((r) => child.once('exit', (code, signal) => r({ code, signal })));
  const outputClosed = new Promise<void>((r) => child.once('close', () => r()));
  let collected: number[] = [];
  return {
    child,
    stdout: () => out,
    stderr: () => err,
    exited,
    outputClosed,
    async ready(timeoutMs = 150_000) {
      const deadline = Date.now() + timeoutMs;
      while (!out.includes('Ctrl-C stops everything')) {
        if (child.exitCode !== null || child.signalCode !== null) throw new Error(`magus dev (${launcher}) exited before it was ready:\n${err}`);
        if (Date.now() > deadline) throw new Error(`magus dev (${launcher}) was not ready within ${timeoutMs / 1000} s:\n${err}`);
        await sleep(200);
      }
    },
    tree() {
      collected = [...new Set([...collected, ...processTree(child.pid!)])];
      return processTree(child.pid!);
    },
    killTree() {
      for (const pid of [...collected, ...processTree(child.pid!)]) {
        try {
          process.kill(pid, 'SIGKILL');
        } catch {
          // gone
        }
      }
    },
  };
}

/** What the printed curl does (non-streamed, a few tokens): the status and body. */
export async function chat(gatewayUrl: string, token: string, content = 'Hello!'): Promise<{ status: number; body: string }> {
  const res = await fetch(`${gatewayUrl}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'demo', messages: [{ role: 'user', content }], max_tokens: 4 }),
    signal: AbortSignal.timeout(90_000),
  });
  return { status: res.status, body: await res.text() };
}

/** The gateway URL, API token file, Temporal UI and connection file (if any) a ready dev printed. */
export function printed(stdout: string): { gatewayUrl: string; tokenFile: string; temporalUi: string; connectionFile: string | undefined } {
  const need = (re: RegExp, what: string) => {
    const m = re.exec(stdout);
    if (!m) throw new Error(`magus dev did not print ${what}:\n${stdout}`);
    return m[1]!;
  };
  return {
    gatewayUrl: need(/served at (http:\/\/\S+)\/v1/, 'the gateway URL'),
    tokenFile: need(/API token: +in (\S+)/, 'the API token file'),
    temporalUi: need(/Temporal UI: (\S+)/, 'the Temporal UI'),
    connectionFile: /Connection: +(\S+)/.exec(stdout)?.[1],
  };
}

/**
 * `magus dev` stops cleanly however it was started and however it is told: `npm run dev` sent
 * SIGINT, `npx magus dev` sent SIGTERM (the shell npx puts in between dies of it without passing
 * it on), and a terminal's Ctrl-C (SIGINT to the whole process group, the engine included).
 * Each time, with an engine serving, every process of the tree — magus, Temporal, NATS, s3proxy,
 * the engine, npm and its shell — is gone within a bounded time, nothing was restarted, no stop
 * step failed, and the exit says so. (Before: npm swallowed SIGINT, npx's SIGTERM left the whole
 * tree running under init, and Ctrl-C restarted the engine and ended in `while stopping: TIMEOUT`.)
 */
import { spawn } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { chat, MAGUS_BIN, printed, processTree, REPO_ROOT, startDev, type DevLauncher, type DevRun } from '../harness/dev';
import { within } from '../../workers/dev/services';
import { processRunning, sleep, until } from '../harness/wait';

let root: string;
const runs: DevRun[] = [];

beforeAll(() => {
  root = mkdtempSync(join(tmpdir(), 'magus-dev-stop-'));
});

afterAll(() => {
  for (const run of runs) run.killTree();
  rmSync(root, { recursive: true, force: true });
});

/**
 * Starts dev with `launcher` on a data folder of its own (the fastest start: no Kubernetes), waits
 * until it serves with an engine running, then `tell`s it to stop and checks the whole tree goes.
 */
async function startServeAndStop(
  launcher: DevLauncher,
  tell: (run: DevRun) => unknown,
  name: string = launcher,
  extra: string[] = [],
): Promise<{ run: DevRun; exit: { code: number | null; signal: NodeJS.Signals | null } }> {
  // No --port: dev binds the gateway's port itself (a port picked here first could be taken by another test meanwhile).
  const run = startDev(launcher, ['--no-kube', '--data-dir', join(root, name), ...extra]);
  runs.push(run);
  await run.ready();
  const { gatewayUrl, tokenFile } = printed(run.stdout());
  const answer = await chat(gatewayUrl, readFileSync(tokenFile, 'utf8').trim());
  expect([answer.status, answer.status === 200 ? '' : answer.body]).toEqual([200, '']);

  const tree = run.tree();
  // magus, Temporal, NATS, s3proxy and the engine at least (plus npm, and npx's shell).
  expect(tree.length).toBeGreaterThanOrEqual(launcher === 'direct' ? 5 : 6);
  await tell(run);
  let timer: NodeJS.Timeout | undefined;
  const exit = await Promise.race([
    run.exited,
    new Promise<never>((_, fail) => (timer = setTimeout(() => fail(new Error(`${launcher}: the top process did not exit within 60 s`)), 60_000))),
  ]);
  clearTimeout(timer);
  await until(
    () => `every process of the ${launcher} tree to exit (left: ${tree.filter(processRunning).join(', ')})`,
    () => !tree.some(processRunning),
    30_000,
  );
  // What dev printed last can still be in the pipe when its process is seen gone (npx exits first: dev writes to npx's pipe).
  await within(run.outputClosed, 10_000);
  const output = run.stdout() + run.stderr();
  expect(output).not.toMatch(/restarting|TIMEOUT|while stopping|not cleanly|[Uu]ncaught|[Uu]nhandled|Channel has been shut down|MaxListenersExceeded/);
  expect(output).toMatch(/^magus dev: stopped$/m);
  return { run, exit };
}

test('npm run dev: SIGINT to npm stops everything and npm exits 0', async () => {
  const { exit } = await startServeAndStop('npm', (run) => run.child.kill('SIGINT'));
  expect(exit).toEqual({ code: 0, signal: null });
}, 240_000);

test('npx magus dev: SIGTERM to npx stops everything (npx itself ends by the signal)', async () => {
  const { run } = await startServeAndStop('npx', (r) => r.child.kill('SIGTERM'));
  // The shell between npx and magus dies of the SIGTERM; magus sees its parent go and stops.
  expect(run.stderr()).toContain('the npm that started it has gone');
}, 240_000);

test('Ctrl-C in a terminal (SIGINT to the whole process group) stops everything without restarting the engine, exit 0', async () => {
  const { exit } = await startServeAndStop('direct', (run) => process.kill(-run.child.pid!, 'SIGINT'));
  expect(exit).toEqual({ code: 0, signal: null });
}, 240_000);

/** Outcomes of new conversations sent by {@link startLoad}: HTTP statuses, or the kind of failure. */
type Outcomes = Map<string, number>;

/**
 * New conversations (one first turn each, `max_tokens: 1`, stream and not) at `perSec` to
 * `gatewayUrl`, plus `long` streamed answers kept in flight, until the returned stop is called.
 */
function startLoad(gatewayUrl: string, token: string, perSec: number, long: number): { outcomes: Outcomes; stop: () => Promise<void> } {
  const outcomes: Outcomes = new Map();
  const count = (k: string) => outcomes.set(k, (outcomes.get(k) ?? 0) + 1);
  const inflight = new Set<Promise<void>>();
  const send = (content: string, maxTokens: number, stream: boolean) => {
    const p = (async () => {
      try {
        const res = await fetch(`${gatewayUrl}/v1/chat/completions`, {
          method: 'POST',
          headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
          body: JSON.stringify({ model: 'demo', messages: [{ role: 'user', content }], max_tokens: maxTokens, stream }),
          signal: AbortSignal.timeout(60_000),
        });
        await res.text();
        count(String(res.status));
      } catch (err) {
        count((err as Error).name === 'TimeoutError' ? 'timeout' : 'network');
      }
    })();
    inflight.add(p);
    void p.then(() => inflight.delete(p));
  };
  const tag = randomBytes(4).toString('hex');
  for (let k = 0; k < long; k++) send(`long ${tag} ${k}`, 256, true);
  let n = 0;
  const timer = setInterval(() => send(`new ${tag} ${n++}`, 1, n % 2 === 0), 1000 / perSec);
  return {
    outcomes,
    async stop() {
      clearInterval(timer);
      await Promise.all([...inflight]);
    },
  };
}

test('SIGTERM under load: a `magus gateway` beside dev and then dev itself exit 0, nothing uncaught, no process left', async () => {
  let devLoad: { outcomes: Outcomes; stop: () => Promise<void> } | undefined;
  const { exit } = await startServeAndStop(
    'direct',
    async (run) => {
      const { gatewayUrl, tokenFile } = printed(run.stdout());
      const token = readFileSync(tokenFile, 'utf8').trim();
      // A second gateway, as `magus gateway` finds a running dev (its connection file).
      const gw = spawn(process.execPath, [MAGUS_BIN, 'gateway', '--host', '127.0.0.1', '--port', '0'], {
        cwd: REPO_ROOT,
        env: {
          ...process.env,
          MAGUS_DEV_DATA_DIR: join(root, 'load'),
          MAGUS_GATEWAY_SECRET: randomBytes(32).toString('hex'),
          MAGUS_GATEWAY_TOKENS: JSON.stringify({ dev: { digest: createHash('sha256').update(token).digest('hex'), name: 'load' } }),
          MAGUS_GATEWAY_SHUTDOWN_GRACE_MS: '5000',
        },
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      let gwErr = '';
      gw.stdout.resume();
      gw.stderr.on('data', (d: Buffer) => (gwErr += d.toString()));
      const gwExit = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((r) => gw.once('exit', (code, signal) => r({ code, signal })));
      try {
        await until('magus gateway to listen', () => /listening on (http:\S+)/.test(gwErr) || gw.exitCode !== null, 60_000);
        const gwUrl = /listening on (http:\S+)/.exec(gwErr)?.[1];
        expect([gwUrl, gw.exitCode === null ? '' : gwErr]).toEqual([expect.stringMatching(/^http:/), '']);
        const onDev = (devLoad = startLoad(gatewayUrl, token, 10, 2));
        const onGw = startLoad(gwUrl!, token, 10, 2);
        // Steady load on both first: every answer so far a 200.
        await sleep(6000);
        const before = (o: Outcomes) => Object.fromEntries(o);
        const steadyDev = before(onDev.outcomes);
        const steadyGw = before(onGw.outcomes);
        expect(Object.keys(steadyDev)).toEqual(['200']);
        expect(Object.keys(steadyGw)).toEqual(['200']);
        expect(steadyDev['200']! + steadyGw['200']!).toBeGreaterThan(40);
        // The gateway is told to stop in the middle of it.
        const gwTree = processTree(gw.pid!);
        gw.kill('SIGTERM');
        let timer: NodeJS.Timeout | undefined;
        const gwExited = await Promise.race([
          gwExit,
          new Promise<never>((_, fail) => (timer = setTimeout(() => fail(new Error(`magus gateway did not exit within 30 s:\n${gwErr}`)), 30_000))),
        ]);
        clearTimeout(timer);
        expect([gwExited, gwErr]).toEqual([
          { code: 0, signal: null },
          expect.not.stringMatching(/[Uu]ncaught|[Uu]nhandled|Channel has been shut down|MaxListenersExceeded|Error:/),
        ]);
        expect(gwTree.filter(processRunning)).toEqual([]);
        await onGw.stop();
        // Dev still answers under its own load; then it is told to stop, the load still running.
        await sleep(2000);
        expect(onDev.outcomes.get('200')!).toBeGreaterThan(steadyDev['200']!);
        expect([...onDev.outcomes.keys()]).toEqual(['200']);
        run.child.kill('SIGTERM');
      } finally {
        if (gw.exitCode === null) gw.kill('SIGKILL');
      }
    },
    'load',
    // The tiny demo model: the load is about stopping, and the real model answers fewer a second here.
    ['--demo', 'tiny'],
  );
  expect(exit).toEqual({ code: 0, signal: null });
  await devLoad?.stop();
}, 300_000);

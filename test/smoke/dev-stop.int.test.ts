/**
 * `magus dev` stops cleanly however it was started and however it is told: `npm run dev` sent
 * SIGINT, `npx magus dev` sent SIGTERM (the shell npx puts in between dies of it without passing
 * it on), and a terminal's Ctrl-C (SIGINT to the whole process group, the engine included).
 * Each time, with an engine serving, every process of the tree — magus, Temporal, NATS, MinIO,
 * the engine, npm and its shell — is gone within a bounded time, nothing was restarted, no stop
 * step failed, and the exit says so. (Before: npm swallowed SIGINT, npx's SIGTERM left the whole
 * tree running under init, and Ctrl-C restarted the engine and ended in `while stopping: TIMEOUT`.)
 */
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { chat, printed, startDev, type DevLauncher, type DevRun } from '../harness/dev';
import { processRunning, until } from '../harness/wait';

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
async function startServeAndStop(launcher: DevLauncher, tell: (run: DevRun) => void): Promise<{ run: DevRun; exit: { code: number | null; signal: NodeJS.Signals | null } }> {
  // No --port: dev binds the gateway's port itself (a port picked here first could be taken by another test meanwhile).
  const run = startDev(launcher, ['--no-kube', '--data-dir', join(root, launcher)]);
  runs.push(run);
  await run.ready();
  const { gatewayUrl, tokenFile } = printed(run.stdout());
  const answer = await chat(gatewayUrl, readFileSync(tokenFile, 'utf8').trim());
  expect([answer.status, answer.status === 200 ? '' : answer.body]).toEqual([200, '']);

  const tree = run.tree();
  // magus, Temporal, NATS, MinIO and the engine at least (plus npm, and npx's shell).
  expect(tree.length).toBeGreaterThanOrEqual(launcher === 'direct' ? 5 : 6);
  tell(run);
  let timer: NodeJS.Timeout | undefined;
  const exit = await Promise.race([run.exited, new Promise<never>((_, fail) => (timer = setTimeout(() => fail(new Error(`${launcher}: the top process did not exit within 60 s`)), 60_000)))]);
  clearTimeout(timer);
  await until(`every process of the ${launcher} tree to exit (left: ${tree.filter(processRunning).join(', ')})`, () => !tree.some(processRunning), 30_000);
  // What dev printed last can still be in the pipe when its process is seen gone (npx exits first: dev writes to npx's pipe).
  await Promise.race([run.outputClosed, new Promise((r) => setTimeout(r, 10_000))]);
  const output = run.stdout() + run.stderr();
  expect(output).not.toMatch(/restarting|TIMEOUT|while stopping|not cleanly/);
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

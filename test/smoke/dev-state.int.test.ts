/**
 * `magus dev` keeps its state and tells other commands where it is. One data folder (the default
 * one, under a temporary XDG_DATA_HOME), three starts:
 * 1. a first start serves the printed curl; while it runs, a second `magus dev` on the folder is
 *    refused naming the first, and `magus model pull` with no address finds it (and its demo hub)
 *    through the 0600 connection file; a pull whose hub is unreachable is retried with one
 *    console line per attempt; SIGINT stops it, exit 0, nothing left running;
 * 2. with no dev running, `magus model pull` fails at once naming the address it could not reach;
 * 3. a restart on the same folder comes back with the same token, ports and models: the demo model
 *    is not pulled again (its pipeline is the same workflow run, no file transferred since), the
 *    pulled one is listed too, and the conversation of the first run is served again (by a new
 *    engine: the old one's pool and session were ended); SIGTERM stops it, exit 0;
 * 4. a state stamped by a magus whose workflow histories this one does not replay: its running
 *    workflows are ended before any worker starts, and its models are served again;
 * 5. `--fresh` starts over: a new token, the old one refused.
 */
import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { WORKFLOWS_REPLAY_FROM } from '../../shared/constants';
import type { DevConnection } from '../../workers/config';
import { portFree } from '../../workers/dev/services';
import { chat, MAGUS_BIN, printed, startDev, type DevRun } from '../harness/dev';
import { processRunning, until } from '../harness/wait';

let xdg: string;
let env: NodeJS.ProcessEnv;
const runs: DevRun[] = [];

beforeAll(() => {
  xdg = mkdtempSync(join(tmpdir(), 'magus-dev-state-'));
  // No address of any server: what the commands find, they find through the data folder.
  env = { ...process.env, XDG_DATA_HOME: xdg };
  for (const name of Object.keys(env)) if (/^MAGUS_|^AWS_/.test(name)) delete env[name];
});

// A test that failed midway leaves its dev running, and the next would find the folder locked by it.
afterEach(async () => {
  for (const run of runs)
    if (run.child.exitCode === null && run.child.signalCode === null) {
      run.killTree();
      await run.exited;
    }
});

afterAll(() => {
  for (const run of runs) run.killTree();
  rmSync(xdg, { recursive: true, force: true });
});

const dataDir = () => join(xdg, 'magus', 'dev');

/** `magus <args>` with the test's environment, bounded. */
function magus(args: string[], timeoutMs = 120_000) {
  return spawnSync(process.execPath, [MAGUS_BIN, ...args], { env, encoding: 'utf8', timeout: timeoutMs });
}

async function models(gatewayUrl: string, token: string): Promise<{ status: number; ids: string[] }> {
  const res = await fetch(`${gatewayUrl}/v1/models`, { headers: { authorization: `Bearer ${token}` } });
  const body = (await res.json()) as { data?: { id: string }[] };
  return { status: res.status, ids: (body.data ?? []).map((m) => m.id).sort() };
}

/** The demo pipeline's run id and how many transfers it has scheduled. */
async function demoPipeline(address: string): Promise<{ runId: string; status: string; transfers: number }> {
  const connection = await Connection.connect({ address });
  try {
    const handle = new Client({ connection }).workflow.getHandle('model/default/demo');
    const description = await handle.describe();
    const history = await handle.fetchHistory();
    const transfers = (history.events ?? []).filter((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === 'transferFile').length;
    return { runId: description.runId, status: description.status.name, transfers };
  } finally {
    await connection.close();
  }
}

async function terminate(address: string, workflowId: string): Promise<void> {
  const connection = await Connection.connect({ address });
  try {
    await new Client({ connection }).workflow.getHandle(workflowId).terminate('test over');
  } finally {
    await connection.close();
  }
}

async function stop(run: DevRun, signal: NodeJS.Signals) {
  const tree = run.tree();
  run.child.kill(signal);
  const exit = await run.exited;
  await until(
    () => `the tree to exit (left: ${tree.filter(processRunning).join(', ')})`,
    () => !tree.some(processRunning),
    30_000,
  );
  // Its output, should it not have stopped cleanly.
  expect({ ...exit, output: exit.code === 0 ? '' : run.stderr() }).toEqual({ code: 0, signal: null, output: '' });
  expect(run.stderr()).not.toMatch(/while stopping|not cleanly|TIMEOUT|restarting/);
}

/** What the first run left, for the restart to compare with. */
let first: { token: string; gatewayUrl: string; temporalUi: string; connection: DevConnection; pipeline: { runId: string; transfers: number } };

test('a first start serves; a second dev on its folder is refused; model pull finds it by its connection file; SIGINT stops it', async () => {
  const run = startDev('direct', ['--no-kube'], env);
  runs.push(run);
  await run.ready();
  const out = run.stdout();
  const { gatewayUrl, tokenFile, temporalUi, connectionFile } = printed(out);
  expect(tokenFile).toBe(join(dataDir(), 'api-token'));
  expect(connectionFile).toBe(join(dataDir(), 'connection.json'));
  const token = readFileSync(tokenFile, 'utf8').trim();
  if (connectionFile === undefined) throw new Error(`magus dev did not print where its connection settings are:\n${out}`);
  const connection = JSON.parse(readFileSync(connectionFile, 'utf8')) as DevConnection;
  // It holds the S3 keys: the owner's alone; printed where it is, never what it holds.
  expect(statSync(connectionFile).mode & 0o777).toBe(0o600);
  expect(connection.s3.secretAccessKey.length).toBeGreaterThan(10);
  for (const secret of [token, connection.s3.secretAccessKey, connection.s3.accessKeyId]) expect(out + run.stderr()).not.toContain(secret);
  // Every address is printed.
  for (const address of [connection.temporal.address, connection.nats.servers, connection.s3.endpoint, connection.hub!.url]) expect(out).toContain(address);

  const answer = await chat(gatewayUrl, token);
  expect([answer.status, answer.status === 200 ? '' : answer.body]).toEqual([200, '']);

  const second = magus(['dev', '--no-kube'], 60_000);
  expect(second.status).toBe(1);
  expect(second.stderr).toContain(`another magus dev (pid ${run.child.pid}) is using ${dataDir()}`);

  // No address given: the connection file has Temporal, and the demo hub for the demo repo.
  const pull = magus(['model', 'pull', 'magus-demo/tiny-llama', '--format', 'gguf:q80', '--name', 'demo-q80']);
  expect([pull.status, pull.stderr]).toEqual([0, expect.stringContaining(`using the running magus dev (pid ${run.child.pid}; ${connectionFile})`)]);
  expect(pull.stderr).toContain(`comes from magus dev's demo hub at ${connection.hub!.url}`);
  expect(pull.stdout).toContain('default/demo-q80 is ready');

  // A hub that cannot be reached: the pipeline retries, and dev's console says so in one line
  // per attempt, not a stack trace each time.
  const unreachable = magus(['model', 'pull', 'nowhere/model', '--format', 'gguf:q40', '--hub', 'http://127.0.0.1:1', '--detach']);
  expect(unreachable.status).toBe(0);
  await until('two failed attempts in the console', () => run.stderr().includes('resolveSource of model/default/model failed (attempt 2): '), 60_000);
  const lines = run
    .stderr()
    .split('\n')
    .filter((l) => l.includes('model/default/model'));
  expect(lines.every((l) => /^magus dev: worker: resolveSource of model\/default\/model failed \(attempt \d+\): HubError: .*127\.0\.0\.1:1\//.test(l))).toBe(
    true,
  );
  expect(run.stderr()).not.toMatch(/^\s+at /m);
  await terminate(connection.temporal.address, 'model/default/model');

  const pipeline = await demoPipeline(connection.temporal.address);
  expect(pipeline.transfers).toBeGreaterThan(0);
  first = { token, gatewayUrl, temporalUi, connection, pipeline };
  await stop(run, 'SIGINT');
}, 240_000);

test('with no dev running, model pull fails at once naming the address it could not reach', async () => {
  // Its default address, unless another process on this machine happens to serve it.
  const useDefault = await portFree(7233);
  const address = useDefault ? '127.0.0.1:7233' : `127.0.0.1:${first.connection.temporal.address.split(':')[1]}`;
  const args = ['model', 'pull', 'magus-demo/tiny-llama', '--format', 'gguf:q40'];
  const started = Date.now();
  const pull = await new Promise<{ code: number | null; stderr: string }>((resolve) => {
    const child = spawn(process.execPath, [MAGUS_BIN, ...args], {
      env: useDefault ? env : { ...env, MAGUS_TEMPORAL_ADDRESS: address },
      stdio: ['ignore', 'ignore', 'pipe'],
    });
    let stderr = '';
    child.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
    const timer = setTimeout(() => child.kill('SIGKILL'), 60_000);
    child.once('exit', (code) => (clearTimeout(timer), resolve({ code, stderr })));
  });
  expect(pull.code).toBe(1);
  expect(pull.stderr).toContain(`cannot reach Temporal at ${address}`);
  if (useDefault) expect(pull.stderr).toMatch(/the default: MAGUS_TEMPORAL_ADDRESS is unset and no magus dev runs/);
  process.stderr.write(`model pull without a dev failed in ${Date.now() - started} ms\n`);
}, 90_000);

test('a restart on the same folder keeps the token, the ports, the models and the pipeline; SIGTERM stops it', async () => {
  const run = startDev('direct', ['--no-kube'], env);
  runs.push(run);
  await run.ready();
  const { gatewayUrl, tokenFile, temporalUi } = printed(run.stdout());
  expect(readFileSync(tokenFile, 'utf8').trim()).toBe(first.token);
  // The same ports, as they were free again — unless another suite's dev (they run at once) took
  // one meanwhile: then that one is not free now (CI once saw the gateway's 8080 go so).
  for (const [now, before] of [
    [gatewayUrl, first.gatewayUrl],
    [temporalUi, first.temporalUi],
  ] as const)
    if (now !== before) expect({ port: before, free: await portFree(Number(new URL(before).port)) }).toEqual({ port: before, free: false });
  expect(run.stderr()).toContain('model "demo" (magus-demo/SmolLM2-135M-Instruct-GGUF) is ready from an earlier run: not pulled again');
  expect(run.stderr()).not.toMatch(/pulling magus-demo|transferring/);

  // The engines of the first run are gone: their pools and sessions were ended, so the same
  // conversation (the printed curl again) is served at once by a new engine, not sent to a dead one.
  expect(run.stderr()).toMatch(/the engines of the previous run are gone: [1-9]\d* pool and session workflow\(s\) of theirs ended/);
  const answer = await chat(gatewayUrl, first.token);
  expect([answer.status, answer.status === 200 ? '' : answer.body]).toEqual([200, '']);

  const listed = await models(gatewayUrl, first.token);
  expect(listed).toEqual({ status: 200, ids: ['demo', 'demo-q80'] });
  const connection = JSON.parse(readFileSync(join(dataDir(), 'connection.json'), 'utf8')) as DevConnection;
  const pipeline = await demoPipeline(connection.temporal.address);
  expect(pipeline).toEqual({ runId: first.pipeline.runId, status: 'RUNNING', transfers: first.pipeline.transfers });
  await stop(run, 'SIGTERM');
}, 240_000);

test('a state an older magus wrote (stamped with another baseline): its workflows are ended at start, its models served', async () => {
  const stamp = join(dataDir(), 'workflows-replay-from');
  expect(readFileSync(stamp, 'utf8').trim()).toBe(WORKFLOWS_REPLAY_FROM);
  writeFileSync(stamp, 'v0.0.0\n');
  const run = startDev('direct', ['--no-kube'], env);
  runs.push(run);
  await run.ready();
  // Ended before any worker could fail a task on their histories (a nondeterminism error each).
  expect(run.stderr()).toMatch(/magus dev: [1-9]\d* workflow\(s\) of an older magus ended: their histories do not replay on this version/);
  expect(run.stderr()).not.toMatch(/[Nn]ondeterminism/);
  expect(readFileSync(stamp, 'utf8').trim()).toBe(WORKFLOWS_REPLAY_FROM);
  const { gatewayUrl } = printed(run.stdout());
  expect(await models(gatewayUrl, first.token)).toEqual({ status: 200, ids: ['demo', 'demo-q80'] });
  const answer = await chat(gatewayUrl, first.token);
  expect([answer.status, answer.status === 200 ? '' : answer.body]).toEqual([200, '']);
  const connection = JSON.parse(readFileSync(join(dataDir(), 'connection.json'), 'utf8')) as DevConnection;
  const pipeline = await demoPipeline(connection.temporal.address);
  expect(pipeline.runId).not.toBe(first.pipeline.runId);
  await stop(run, 'SIGINT');
}, 240_000);

test('--fresh starts over: a new token, and the old one is refused', async () => {
  const run = startDev('direct', ['--no-kube', '--fresh'], env);
  runs.push(run);
  await run.ready();
  const { gatewayUrl, tokenFile } = printed(run.stdout());
  const token = readFileSync(tokenFile, 'utf8').trim();
  expect(token).not.toBe(first.token);
  expect((await models(gatewayUrl, first.token)).status).toBe(401);
  expect(await models(gatewayUrl, token)).toEqual({ status: 200, ids: ['demo'] });
  expect(run.stderr()).toContain('pulling magus-demo/SmolLM2-135M-Instruct-GGUF');
  await stop(run, 'SIGINT');
}, 240_000);

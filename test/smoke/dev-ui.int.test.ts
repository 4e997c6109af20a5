/**
 * The Temporal UI that `magus dev` starts tells the story, checked in a real browser (headless
 * chromium; screenshots in test-results/ui/): after a conversation and a pull that cannot reach
 * its hub, a user finds the model pipelines (and only them) with one filter, the failing pull by
 * its phase, the conversations of a model by their ids, and each workflow's page says in words
 * what it is and where it stands — the retried step and its last error, the pool's instances, the
 * instance a conversation is on.
 */
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { spawnSync } from 'node:child_process';
import { openBrowser, type UiBrowser } from '../harness/browser';
import { chat, MAGUS_BIN, printed, startDev, type DevRun } from '../harness/dev';
import { until } from '../harness/wait';

let data: string;
let run: DevRun | undefined;
let browser: UiBrowser | undefined;

beforeAll(() => {
  data = mkdtempSync(join(tmpdir(), 'magus-dev-ui-'));
});

afterAll(async () => {
  await browser?.close();
  run?.killTree();
  rmSync(data, { recursive: true, force: true });
});

test('the Temporal UI of magus dev: workflows found by kind, model and phase; each page says where it stands', async () => {
  const env = { ...process.env };
  for (const name of Object.keys(env)) if (/^MAGUS_|^AWS_/.test(name) && name !== 'MAGUS_CHROMIUM') delete env[name];
  run = startDev('direct', ['--no-kube', '--data-dir', data], env);
  await run.ready();
  const { gatewayUrl, tokenFile, temporalUi } = printed(run.stdout());
  const answer = await chat(gatewayUrl, readFileSync(tokenFile, 'utf8').trim());
  expect([answer.status, answer.status === 200 ? '' : answer.body]).toEqual([200, '']);
  // A pull whose hub cannot be reached: its pipeline retries resolving.
  const pull = spawnSync(process.execPath, [MAGUS_BIN, 'model', 'pull', 'nowhere/model', '--format', 'gguf:q40', '--hub', 'http://127.0.0.1:1', '--detach'], {
    env: { ...env, MAGUS_DEV_DATA_DIR: data },
    encoding: 'utf8',
    timeout: 60_000,
  });
  expect([pull.status, pull.stderr]).toEqual([0, expect.stringContaining('pipeline model/default/model')]);
  await until('two failed attempts in the console', () => run!.stderr().includes('resolveSource of model/default/model failed (attempt 2): '), 60_000);

  browser = await openBrowser();
  const list = (query: string) => `${temporalUi}/namespaces/default/workflows?query=${encodeURIComponent(query)}`;

  // One filter lists the model pipelines, and nothing else, however many conversations there are.
  const models = await browser.look(
    '1-models',
    list('MagusKind="model"'),
    /model\/default\/demo[^]*model\/default\/model|model\/default\/model[^]*model\/default\/demo/,
  );
  expect(models).not.toMatch(/\b(session|pool)\/default\//);
  // The failing one, by its phase.
  const resolving = await browser.look('2-models-resolving', list('MagusKind="model" AND MagusPhase="resolving"'), /model\/default\/model/);
  expect(resolving).not.toContain('model/default/demo');
  // A model's conversations: their ids name the model, and reveal nothing of the conversation.
  const sessions = await browser.look('3-sessions-of-demo', list('MagusKind="session" AND MagusModel="default/demo"'), /session\/default\/demo\/[0-9a-f]{64}/);
  expect(sessions).not.toContain('Hello');

  // Each page says what the workflow is and where it stands (User Metadata: its summary and current
  // details, each rendered as its data arrives: every line is waited for).
  await browser.lookAtWorkflow('4-pipeline-retrying', temporalUi, 'model/default/model', 'user-metadata', [
    /retrying resolveSource: attempt \d+ failed at \S+: HubError: .*127\.0\.0\.1:1\//,
    /Model default\/model: nowhere\/model to S3, converted and sized/,
    /resolving · nowhere\/model · generation 1/,
  ]);
  await browser.lookAtWorkflow('5-pipeline-ready', temporalUi, 'model/default/demo', 'user-metadata', [
    /ready · magus-demo\/SmolLM2-135M-Instruct-GGUF @ [0-9a-f]{12}/,
    /published: the model can be served/,
  ]);
  await browser.lookAtWorkflow('6-pool', temporalUi, 'pool/default/demo', 'user-metadata', [
    /serving · model default\/demo · 1 of 0\.\.\d+ instances/,
    /Instances serving model default\/demo/,
    /demo-\d+-[0-9a-f]{8} ready\b/, // <model>-<n>-<tag> (pool-unique-instance-ids)
    /scales on load \(\d+ requests? in flight or queued per instance\) · [1-9]\d* live conversations?/, // counted by nats-server
  ]);
  const sessionId = /session\/default\/demo\/[0-9a-f]{64}/.exec(sessions)![0];
  // Its lease is its conversation's entry: started late, at the lease's end, its page says when it looks.
  await browser.lookAtWorkflow('7-session', temporalUi, sessionId, 'user-metadata', [
    /Its first look at its lease comes when the lease ends unless renewed, \d+ s after the conversation.s last turn/,
    /A conversation on model default\/demo/,
  ]);

  run.child.kill('SIGINT');
  expect((await run.exited).code).toBe(0);
}, 300_000);

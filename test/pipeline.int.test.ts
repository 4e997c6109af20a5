/**
 * The model pipeline end to end on the real Temporal dev server, nats-server and s3proxy, with the
 * Hugging Face-compatible fixture hub serving the tiny synthetic model.
 */
import type { S3Client } from '@aws-sdk/client-s3';
import type { Client } from '@temporalio/client';
import { temporal } from '@temporalio/proto';
import { spawn } from 'node:child_process';
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { convertModel } from '../convert/convert';
import { openModelRegistry, type ModelRegistry } from '../dataplane/registry';
import { listIncompleteUploads } from '../activities/storage/cleanup';
import { modelRevision, type ModelSpec } from '../shared/model';
import { cancelSignal, progressQuery, specChangedSignal } from '../workflows/model/definitions';
import type { MagusConfig } from '../workers/config';
import type { HubCommit, TestHub } from './fixtures/hub';
import { writeTinyModel } from '../workers/dev/tiny-model';
import { currentDetails, endpoint, isolation, listWorkflowIds, recordHistory } from './harness';
import { hubStack, magusStack, TestStack } from './harness/stack';
import { objectBytes, pipelineSettled, startPipeline } from './harness/pipeline';
import { historyText } from './harness/history';
import { runLlamaCpp } from './reference/llama-cpp';
import { sleep } from './harness/wait';

const EventType = temporal.api.enums.v1.EventType;
const iso = isolation();
const TOKEN = 'hf_fixture_token_7c1d9e2b0a4f';
const REPO = 'magus-test/tiny-llama';
const GGUF_REPO = 'magus-test/tiny-llama-GGUF';

let dir: string;
let cfg: MagusConfig;
let s3: S3Client;
let client: Client;
let registry: ModelRegistry;
let hub: TestHub;
let commit: HubCommit;
let ggufCommit: HubCommit;
const stack = new TestStack();

beforeAll(async () => {
  // The worker's S3 client takes credentials from the standard environment, as in production.
  process.env.MAGUS_TEST_HF_TOKEN = TOKEN;
  const magus = await stack.open(magusStack(iso, { dirPrefix: 'magus-pipeline-', overrides: { convertThreads: 2 } }));
  ({ dir, s3, cfg, client } = magus);
  registry = await openModelRegistry(magus.nc, magus.names.modelsBucket);
  await writeTinyModel(join(dir, 'tiny'), { seed: 31 });
  await writeTinyModel(join(dir, 'other'), { seed: 32 });
  ({ hub } = await stack.open(hubStack({ tokens: [TOKEN] })));
  commit = await hub.addRepo({ id: REPO, dir: join(dir, 'tiny') });
  await hub.addRepo({ id: 'magus-test/gated-llama', dir: join(dir, 'tiny'), gated: true, access: [TOKEN] });
  await hub.addRepo({ id: 'magus-test/corrupt-llama', dir: join(dir, 'other') });
  await hub.addRepo({ id: 'magus-test/flaky-llama', dir: join(dir, 'tiny') });
  // A GGUF repository as they are published: one file per quantization, a README, no config.json.
  mkdirSync(join(dir, 'gguf'));
  for (const [weights, file] of [
    ['q80', 'Tiny-Llama.Q8_0.gguf'],
    ['f16', 'Tiny-Llama.F16.gguf'],
  ] as const) {
    await convertModel({ source: join(dir, 'tiny'), format: 'gguf', weights, output: join(dir, 'gguf', file), threads: 2 });
  }
  writeFileSync(join(dir, 'gguf', 'README.md'), '# Tiny-Llama GGUF\n');
  ggufCommit = await hub.addRepo({ id: GGUF_REPO, dir: join(dir, 'gguf') });
}, 120_000);

afterAll(() => stack.close());

const spec = (repo: string, extra: Partial<ModelSpec['source']> = {}): ModelSpec => ({
  source: { repo, hubUrl: hub.url, ...extra },
  artifacts: [
    { format: 'gguf', weights: 'q40' },
    { format: 'dllama', weights: 'q40' },
  ],
  contextLength: 128,
});

/** A model name of this file's own (its isolation id): its pipeline's and pool's workflow ids are too. */
const named = (base: string) => `${base}-${iso.id}`;
const start = (name: string, s: ModelSpec) => startPipeline(client, cfg.taskQueue, named(name), s);
const getObject = (key: string) => objectBytes(s3, iso.bucket, key);

test('happy path: sources verified in S3, artifacts converted and sized, registry entry written, GGUF runs in llama.cpp', async () => {
  const handle = await start('tiny', spec(REPO));
  const p = await pipelineSettled(handle);
  expect(p).toMatchObject({ phase: 'ready', sha: commit.sha, failure: null });
  await recordHistory('model-pipeline-ready', handle);
  expect(p.files.done).toBe(p.files.total);
  expect(p.bytes.done).toBe(p.bytes.total);

  const ready = await registry.get('default', named('tiny'));
  expect(ready?.source).toEqual({ repo: REPO, revision: 'main', sha: commit.sha });
  expect(ready?.artifacts.map((a) => `${a.format}:${a.weights}`)).toEqual(['gguf:q40', 'dllama:q40']);
  expect(ready?.artifacts[1]?.files.map((f) => f.key.split('/').pop())).toEqual(['model.m', 'tokenizer.t']);
  // The repository's generation_config.json (do_sample, temperature 0.6, top_p 0.9) travels with each artifact; the spec sets none.
  expect(ready?.artifacts.map((a) => a.sampling)).toEqual([
    { temperature: 0.6, top_p: 0.9 },
    { temperature: 0.6, top_p: 0.9 },
  ]);
  expect(ready?.sampling).toBeUndefined();
  // Its pool is told the revision it published: instances of another are replaced (workflows/README.md, "Rollout").
  const told = (await handle.fetchHistory()).events!.find((e) => e.signalExternalWorkflowExecutionInitiatedEventAttributes?.signalName === 'modelPublished');
  const input = told!.signalExternalWorkflowExecutionInitiatedEventAttributes!.input!.payloads![0]!.data!;
  expect(JSON.parse(Buffer.from(input).toString('utf8'))).toEqual({ revision: modelRevision(ready!) });
  // Memory: llama.cpp on one node; distributed-llama on every node count the tiny model splits into (2 KV heads).
  expect(ready?.memory[0]?.topologies.map((t) => t.nodes)).toEqual([1]);
  expect(ready?.memory[1]?.topologies.map((t) => t.nodes)).toEqual([1, 2]);

  // Every source object is byte-identical to the hub's file.
  for (const f of commit.files) {
    const body = await getObject(`sources/${REPO}/${commit.sha}/${f.path}`);
    expect([f.path, body.equals(f.content)]).toEqual([f.path, true]);
  }
  // The artifact's recorded sha256 is its content's, and the GGUF generates text in llama.cpp.
  const gguf = ready!.artifacts[0]!.files[0]!;
  const bytes = await getObject(gguf.key);
  const { createHash } = await import('node:crypto');
  expect(createHash('sha256').update(bytes).digest('hex')).toBe(gguf.sha256);
  const local = join(dir, 'tiny.gguf');
  writeFileSync(local, bytes);
  const out = await runLlamaCpp({ model: local, promptTokens: [379, 72, 101, 108], nTokens: 16 });
  expect(out.tokens).toHaveLength(16);
  expect(await listIncompleteUploads(s3, iso.bucket)).toEqual([]);
});

test('a GGUF repository: the chosen file is transferred, checked and published as it is (no conversion), sized from its metadata, and runs in llama.cpp', async () => {
  const handle = await start('tiny-gguf', {
    source: { repo: GGUF_REPO, hubUrl: hub.url, gguf: { quantization: 'q8_0' } },
    artifacts: [{ format: 'gguf', weights: 'source' }],
    contextLength: 128,
    // As magus dev's demo Model has it: the GGUF publishes no defaults, the Model does.
    sampling: { temperature: 0.2, top_p: 0.9 },
  });
  const p = await pipelineSettled(handle);
  expect(p).toMatchObject({ phase: 'ready', sha: ggufCommit.sha, failure: null });
  await recordHistory('model-pipeline-gguf-source', handle);
  expect(p.files).toEqual({ done: 1, total: 1 }); // neither the other quantization nor the README
  const ready = (await registry.get('default', named('tiny-gguf')))!;
  expect(ready.sampling).toEqual({ temperature: 0.2, top_p: 0.9 });
  const source = ggufCommit.files.find((f) => f.path === 'Tiny-Llama.Q8_0.gguf')!;
  // The artifact is the source object itself: nothing was copied or converted.
  expect(ready.artifacts).toEqual([
    {
      format: 'gguf',
      weights: 'source',
      sourceType: 'Q8_0',
      converterVersion: expect.any(String) as string,
      files: [{ key: `sources/${GGUF_REPO}/${ggufCommit.sha}/Tiny-Llama.Q8_0.gguf`, bytes: source.content.length, sha256: source.sha256 }],
    },
  ]);
  expect(ready.memory).toHaveLength(1);
  expect(ready.memory[0]).toMatchObject({ format: 'gguf', weights: 'source', contextLength: 128 });
  expect(ready.memory[0]!.topologies.map((t) => [t.nodes, t.root.weights])).toEqual([[1, source.content.length]]);
  expect(ready.memory[0]!.topologies[0]!.root.kvCache).toBeGreaterThan(0);
  const local = join(dir, 'from-gguf-repo.gguf');
  writeFileSync(local, await getObject(ready.artifacts[0]!.files[0]!.key));
  const out = await runLlamaCpp({ model: local, promptTokens: [379, 72, 101, 108], nTokens: 8 });
  expect(out.tokens).toHaveLength(8);
});

test('a GGUF repository converted for distributed-llama: the same .m and .t as from the safetensors repository', async () => {
  const handle = await start('tiny-gguf-dllama', {
    source: { repo: GGUF_REPO, hubUrl: hub.url, gguf: { file: '*.F16.gguf' } },
    artifacts: [
      { format: 'gguf', weights: 'source' },
      { format: 'dllama', weights: 'f32' },
    ],
    contextLength: 128,
  });
  const p = await pipelineSettled(handle);
  expect(p).toMatchObject({ phase: 'ready', failure: null });
  const ready = (await registry.get('default', named('tiny-gguf-dllama')))!;
  expect(ready.artifacts.map((a) => `${a.format}:${a.weights}`)).toEqual(['gguf:source', 'dllama:f32']);
  expect(ready.memory.map((m) => [`${m.format}:${m.weights}`, m.topologies.map((t) => t.nodes)])).toEqual([
    ['gguf:source', [1]],
    ['dllama:f32', [1, 2]],
  ]);
  const direct = join(dir, 'direct-dllama-f32');
  mkdirSync(direct);
  await convertModel({
    source: join(dir, 'tiny'),
    format: 'dllama',
    weights: 'f32',
    output: { model: join(direct, 'model.m'), tokenizer: join(direct, 'tokenizer.t') },
    threads: 2,
  });
  const [m, t] = ready.artifacts[1]!.files;
  expect((await getObject(m!.key)).equals(readFileSync(join(direct, 'model.m')))).toBe(true);
  expect((await getObject(t!.key)).length).toBeGreaterThan(0);
});

test('a GGUF choice that matches nothing fails at once, typed, naming the files there are', async () => {
  const handle = await start('tiny-gguf-missing', {
    source: { repo: GGUF_REPO, hubUrl: hub.url, gguf: { file: '*Q4_K_M.gguf' } },
    artifacts: [{ format: 'gguf', weights: 'source' }],
  });
  const p = await pipelineSettled(handle);
  expect(p.phase).toBe('failed');
  expect(p.failure).toMatchObject({ type: 'NoSuchFile', during: 'resolving' });
  expect(p.failure?.message).toBe('source.gguf: file "*Q4_K_M.gguf" matches none of the repository\'s GGUF files: Tiny-Llama.F16.gguf, Tiny-Llama.Q8_0.gguf');
  expect(p.files.total).toBe(0);
});

test('a hub inside (an address the worker does not allow) fails at once, typed, with the reason and nothing the server said', async () => {
  // 127.0.0.3: loopback, so nothing could leave the machine, and not one of the fixture hub's
  // allowed addresses (harness TEST_HUB_NETWORKS). A server there would answer with a secret.
  const { createServer } = await import('node:http');
  let connections = 0;
  const inside = createServer((_req, res) => res.writeHead(404, { 'X-Error-Message': 'inside-secret' }).end('inside-secret'));
  inside.on('connection', () => connections++);
  await new Promise<void>((r) => inside.listen(0, '127.0.0.3', r));
  try {
    const hubUrl = `http://127.0.0.3:${(inside.address() as { port: number }).port}`;
    const handle = await start('tiny-inside', { ...spec(REPO), source: { repo: REPO, hubUrl, tokenRef: { env: 'MAGUS_TEST_HF_TOKEN' } } });
    const p = await pipelineSettled(handle);
    expect(p.phase).toBe('failed');
    expect(p.failure).toMatchObject({ type: 'AddressRefused', during: 'resolving' });
    expect(p.failure?.message).toBe(
      `request to ${hubUrl}/api/models/${REPO}/revision/main refused: 127.0.0.3 is a loopback address; refused (MAGUS_HUB_ALLOW_NETWORKS allows networks)`,
    );
    expect(JSON.stringify(p)).not.toContain('inside-secret');
    expect(JSON.stringify(p)).not.toContain(TOKEN);
    expect(connections).toBe(0);
  } finally {
    await new Promise<void>((r) => inside.close(() => r()));
  }
});

test('a step that keeps failing is named where a user looks (progress, search attributes, the UI’s current details) until it succeeds', async () => {
  const repo = 'magus-test/flaky-llama';
  hub.setFaults({ status: { path: `/api/models/${repo}`, code: 503 } });
  const handle = await start('flaky', spec(repo));
  try {
    const deadline = Date.now() + 60_000;
    let p = await handle.query(progressQuery);
    while (!(p.retrying && p.retrying.attempt >= 2)) {
      if (Date.now() > deadline) throw new Error(`no second failed attempt reported: ${JSON.stringify(p)}`);
      await sleep(200);
      p = await handle.query(progressQuery);
    }
    expect([p.phase, p.failure, p.retrying.activity, p.retrying.message]).toEqual(['resolving', null, 'resolveSource', expect.stringContaining('HTTP 503')]);
    expect(Date.parse(p.retrying.at)).toBeGreaterThan(Date.now() - 60_000);
    // The list can be filtered by phase, and the workflow's page says what is going on.
    const listed = await listWorkflowIds(client, `MagusKind="model" AND MagusModel="default/${named('flaky')}" AND MagusPhase="resolving"`);
    expect(listed).toContain(handle.workflowId);
    expect(await currentDetails(handle)).toMatch(
      /^\*\*resolving\*\* · `magus-test\/flaky-llama`[^]*retrying resolveSource: attempt \d+ failed at [^:]+:[^:]+:[^:]+: .*503/,
    );
  } finally {
    hub.setFaults({});
  }
  const p = await pipelineSettled(handle);
  expect(p.phase).toBe('ready');
  expect(p.retrying).toBeUndefined();
  expect(await listWorkflowIds(client, `MagusKind="model" AND MagusModel="default/${named('flaky')}" AND MagusPhase="ready"`)).toContain(handle.workflowId);
  expect(await currentDetails(handle)).toMatch(
    /^\*\*ready\*\* · `magus-test\/flaky-llama` @ `[0-9a-f]{12}` · generation 1 {2}\n5 of 5 files · [^]*gguf:q40: (\d+) of \1 tensors[^]*published: the model can be served$/,
  );
  await recordHistory('model-pipeline-retried', handle);
}, 120_000);

test('a second pipeline for the same repo and revision transfers and converts nothing', async () => {
  await pipelineSettled(await start('tiny-first', spec(REPO)));
  hub.stats.reset();
  const p = await pipelineSettled(await start('tiny-again', spec(REPO)));
  expect(p.phase).toBe('ready');
  for (const f of commit.files) expect([f.path, hub.stats.served(REPO, f.path)]).toEqual([f.path, 0]);
  expect(hub.stats.requests.filter((r) => r.path.includes('/resolve/') || r.server === 'cdn')).toEqual([]);
});

/** How many times an activity type was started, from the workflow's history. */
async function attempts(workflowId: string, activityType: string): Promise<number> {
  const history = await client.workflow.getHandle(workflowId).fetchHistory();
  return (history.events ?? []).filter(
    (e) => e.eventType === EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED && e.activityTaskScheduledEventAttributes?.activityType?.name === activityType,
  ).length;
}

test.each([
  ['an unknown repo', 'magus-test/does-not-exist', {}, 'RepoNotFound'],
  ['a gated repo without a token', 'magus-test/gated-llama', {}, 'Unauthorized'],
  ['an unknown revision', REPO, { revision: 'no-such-branch' }, 'RepoNotFound'],
])('%s fails once with its typed reason, then sits idle', async (_what, repo, extra, type) => {
  const name = `fail-${type.toLowerCase()}-${Math.random().toString(36).slice(2, 6)}`;
  const started = Date.now();
  const handle = await start(name, spec(repo, extra));
  const p = await pipelineSettled(handle, 20_000);
  expect(Date.now() - started).toBeLessThan(15_000);
  expect(p.phase).toBe('failed');
  expect(p.failure?.type).toBe(type);
  const requests = hub.stats.requests.length;
  await sleep(3000);
  // Still failed, one attempt in all, and nothing more asked of the hub: it waits for a new spec.
  expect((await handle.query(progressQuery)).phase).toBe('failed');
  expect(await attempts(handle.workflowId, 'resolveSource')).toBe(1);
  expect(hub.stats.requests.length).toBe(requests);
});

test('a failed pipeline re-plans when its spec changes, and the token stays out of the history', async () => {
  const handle = await start('gated', spec('magus-test/gated-llama'));
  expect((await pipelineSettled(handle)).failure?.type).toBe('Unauthorized');
  await handle.signal(specChangedSignal, spec('magus-test/gated-llama', { tokenRef: { env: 'MAGUS_TEST_HF_TOKEN' } }));
  // The old `failed` state lingers until the new run starts; wait for the generation to move.
  for (let i = 0; (await handle.query(progressQuery)).generation < 2 && i < 50; i++) await sleep(100);
  const p = await pipelineSettled(handle);
  expect(p).toMatchObject({ phase: 'ready', generation: 2 });
  const history = historyText(await handle.fetchHistory());
  expect(history.includes('MAGUS_TEST_HF_TOKEN')).toBe(true); // the reference is there…
  expect(history.includes(TOKEN)).toBe(false); // …the value never is
});

test('a byte corrupted by the source is caught by the checksum, after one fresh download', async () => {
  hub.setFaults({ corrupt: { path: 'model.safetensors', offset: 4096, times: 2 } });
  try {
    const p = await pipelineSettled(await start('corrupt', spec('magus-test/corrupt-llama')));
    expect(p.phase).toBe('failed');
    expect(p.failure?.type).toBe('ChecksumMismatch');
    expect(p.failure?.message).toContain('model.safetensors');
  } finally {
    hub.setFaults({});
  }
  expect(await listIncompleteUploads(s3, iso.bucket)).toEqual([]);
});

test('cancel stops a transfer in flight and removes its partial uploads', async () => {
  await hub.addRepo({ id: 'magus-test/cancel-llama', dir: join(dir, 'other'), files: { 'padding.safetensors': new Uint8Array(12 * 1024 * 1024) } });
  hub.setFaults({ bytesPerSecond: 1_000_000 });
  try {
    const handle = await start('cancel', spec('magus-test/cancel-llama'));
    let p = await handle.query(progressQuery);
    for (let i = 0; (p.phase !== 'transferring' || p.bytes.done < 6 * 1024 * 1024) && i < 200; i++) {
      await sleep(100);
      p = await handle.query(progressQuery);
    }
    expect(p.phase).toBe('transferring');
    await handle.signal(cancelSignal);
    await handle.result(); // the workflow ends after its cleanup
    expect((await handle.query(progressQuery)).phase).toBe('cancelled');
  } finally {
    hub.setFaults({});
  }
  expect(await listIncompleteUploads(s3, iso.bucket, 'sources/magus-test/cancel-llama/')).toEqual([]);
}, 60_000);

test('magus model pull starts the pipeline and returns when the model is ready', async () => {
  const child = spawn(
    process.execPath,
    [
      '-r',
      require.resolve('@swc-node/register'),
      '-e',
      "require('./workers/magus').main(process.argv.slice(1)).then((c) => process.exit(c))",
      'model',
      'pull',
      REPO,
      '--format',
      'gguf:q80',
      '--hub',
      hub.url,
      '--name',
      named('pulled'),
    ],
    {
      cwd: join(__dirname, '..'),
      env: {
        ...process.env,
        MAGUS_TEMPORAL_ADDRESS: endpoint('temporal').address,
        MAGUS_TASK_QUEUE: cfg.taskQueue,
        MAGUS_NATS_URL: endpoint('nats').servers,
        MAGUS_S3_ENDPOINT: cfg.s3.endpoint,
      },
    },
  );
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (d: Buffer) => (stdout += d.toString()));
  child.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
  const code = await new Promise<number | null>((r) => child.once('exit', r));
  expect([code, stderr]).toEqual([0, expect.stringContaining(`pipeline model/default/${named('pulled')}`)]);
  expect(stdout).toContain(`default/${named('pulled')} is ready (${REPO}@${commit.sha})`);
  expect(stderr).toMatch(/^ready$/m);
  expect((await registry.get('default', named('pulled')))?.artifacts.map((a) => a.weights)).toEqual(['q80']);
}, 120_000);

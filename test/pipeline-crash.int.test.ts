/**
 * The pipeline worker process is SIGKILLed three times during a multi-part transfer: the model
 * still becomes ready, every object is byte-identical to the source, no part is uploaded twice
 * except parts in flight at a kill, and no incomplete multipart upload remains.
 */
import { GetObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import type { Client } from '@temporalio/client';
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { listIncompleteUploads } from '../activities/storage/cleanup';
import { modelWorkflowId, progressQuery, type PipelineProgress } from '../workflows/model/definitions';
import { modelPipeline } from '../workflows/model/pipeline';
import type { HubCommit, TestHub } from './fixtures/hub';
import { writeTinyModel } from '../workers/dev/tiny-model';
import { isolation, recordHistory, workerEnv } from './harness';
import { hubStack, s3Stack, tempDir, temporalStack, TestStack } from './harness/stack';
import { sleep } from './harness/wait';

const iso = isolation();
const REPO = 'magus-test/crash-llama';
/** The model's name, and so its pipeline's workflow id, carry the file's isolation id. */
const MODEL = `crash-${iso.id}`;
const PART = 5 * 1024 * 1024;
/** Parts a transfer uploads at once (the transfer's default concurrency). */
const CONCURRENCY = 4;
const KILLS = 3;

let hub: TestHub;
let commit: HubCommit;
let client: Client;
let s3: S3Client;
let dir: string;
let worker: ChildProcess | undefined;
const stack = new TestStack();
const traceFile = () => join(dir, 's3-writes.log');

/** A `magus worker` process run from the TypeScript sources. */
function spawnWorker(): ChildProcess {
  const child = spawn(
    process.execPath,
    ['-r', require.resolve('@swc-node/register'), '-e', "require('./workers/magus').main(['worker']).then((c) => process.exit(c))"],
    {
      cwd: join(__dirname, '..'),
      stdio: ['ignore', 'ignore', 'pipe'],
      env: { ...process.env, ...workerEnv(iso), MAGUS_TRANSFER_PART_SIZE: String(PART), MAGUS_S3_TRACE_FILE: traceFile(), MAGUS_CONVERT_THREADS: '1' },
    },
  );
  child.stderr?.resume();
  return child;
}

beforeAll(async () => {
  ({ dir } = stack.open(tempDir('magus-crash-')));
  // ~37 MB of F32 weights: 8 parts of 5 MiB for model.safetensors.
  await writeTinyModel(join(dir, 'model'), {
    seed: 41,
    dtype: 'F32',
    hiddenSize: 512,
    intermediateSize: 1024,
    numLayers: 4,
    numHeads: 8,
    numKvHeads: 4,
    vocabSize: 6144,
  });
  ({ hub } = await stack.open(hubStack()));
  commit = await hub.addRepo({ id: REPO, dir: join(dir, 'model') });
  ({ s3 } = await stack.open(s3Stack(iso)));
  ({ client } = await stack.open(temporalStack()));
  stack.defer(() => worker?.kill('SIGKILL'));
}, 60_000);

afterAll(() => stack.close());

test(`SIGKILL of the worker ${KILLS} times during a multi-part transfer`, async () => {
  const weights = commit.files.find((f) => f.path === 'model.safetensors')!;
  const parts = Math.ceil(weights.size / PART);
  expect(parts).toBeGreaterThanOrEqual(6);
  // Throttled so that the transfer takes long enough to be killed in the middle, three times.
  hub.setFaults({ bytesPerSecond: 2_500_000 });

  worker = spawnWorker();
  const handle = await client.workflow.start(modelPipeline, {
    workflowId: modelWorkflowId('default', MODEL),
    taskQueue: `${iso.id}-control`,
    args: [{ namespace: 'default', name: MODEL, spec: { source: { repo: REPO, hubUrl: hub.url }, artifacts: [{ format: 'gguf', weights: 'q80' }] } }],
  });
  // While a new worker is starting nobody can answer a query: retry until one does.
  const progress = async (): Promise<PipelineProgress> => {
    for (let i = 0; ; i++) {
      try {
        return await handle.query(progressQuery);
      } catch (err) {
        if (i >= 20) throw err;
        await sleep(500);
      }
    }
  };

  let killedAt = 0;
  for (let kill = 1; kill <= KILLS; kill++) {
    // Kill once another part or so has been committed since the last kill.
    const target = killedAt + PART * 1.2;
    const deadline = Date.now() + 120_000;
    let p: PipelineProgress;
    do {
      await sleep(250);
      p = await progress();
      if (Date.now() > deadline) throw new Error(`no transfer progress before kill ${kill}: ${JSON.stringify(p)}`);
    } while (p.phase === 'resolving' || (p.phase === 'transferring' && p.bytes.done < target));
    expect(p.phase).toBe('transferring'); // still in the middle of the transfer
    const exited = new Promise((r) => worker!.once('exit', r));
    worker.kill('SIGKILL');
    await exited;
    killedAt = p.bytes.done;
    worker = spawnWorker();
  }

  hub.setFaults({});
  const deadline = Date.now() + 180_000;
  let p = await progress();
  while (p.phase !== 'ready' && p.phase !== 'failed' && Date.now() < deadline) {
    await sleep(500);
    p = await progress();
  }
  expect(p.phase).toBe('ready');
  worker.kill('SIGTERM');
  // A pipeline resumed by a new worker after each crash (activity timeouts and retries in its history).
  await recordHistory('model-pipeline-resumed', handle);

  // Byte-identical objects.
  for (const f of commit.files) {
    const r = await s3.send(new GetObjectCommand({ Bucket: iso.bucket, Key: `sources/${REPO}/${commit.sha}/${f.path}` }));
    expect([f.path, Buffer.from(await r.Body!.transformToByteArray()).equals(f.content)]).toEqual([f.path, true]);
  }
  // Each part uploaded once, except parts that were in flight when a worker died.
  expect(existsSync(traceFile())).toBe(true);
  const uploads = readFileSync(traceFile(), 'utf8')
    .split('\n')
    .filter((l) => l.startsWith(`UploadPartCommand sources/${REPO}/${commit.sha}/model.safetensors `));
  const perPart = new Map<string, number>();
  for (const l of uploads) perPart.set(l, (perPart.get(l) ?? 0) + 1);
  expect(perPart.size).toBe(parts);
  const repeats = uploads.length - parts;
  expect(repeats).toBeLessThanOrEqual(KILLS * CONCURRENCY);
  // No incomplete multipart upload is left behind.
  expect(await listIncompleteUploads(s3, iso.bucket)).toEqual([]);
}, 400_000);

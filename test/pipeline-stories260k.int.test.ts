/**
 * Trained weights through the real pipeline: the fixture hub serves stories260K
 * (workers/dev/stories260k.ts) as a repository, `modelPipeline` on the real Temporal dev server,
 * nats-server and s3proxy pulls it to S3 and converts it, and the GGUFs read back from S3 generate
 * llama2.c's text in llama.cpp. What its 172-value FFN rows cannot fit or run — quantized GGUFs,
 * and every distributed-llama conversion — ends the pipeline in `failed` with a typed permanent
 * failure naming the tensor or the dimension, shown in the `Model`'s conditions, and nothing
 * published. The same model with its FFN padded to 192 (a second repository) is converted for
 * distributed-llama, and its memory plans list exactly the topologies distributed-llama runs.
 */
import { ListObjectsV2Command, type S3Client } from '@aws-sdk/client-s3';
import type { Client } from '@temporalio/client';
import { temporal } from '@temporalio/proto';
import { createHash } from 'node:crypto';
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { CONVERTER_VERSION } from '../convert/convert';
import { modelConditions } from '../kube/status';
import { openModelRegistry, type ModelRegistry } from '../dataplane/registry';
import { listIncompleteUploads } from '../activities/storage/cleanup';
import { artifactPrefix, type ArtifactRequest, type ModelSpec } from '../shared/model';
import type { MagusConfig } from '../workers/config';
import type { HubCommit, TestHub } from './fixtures/hub';
import { LLAMA2_CHAT_TEMPLATE, STORIES260K, STORIES260K_DLLAMA_FFN, STORIES260K_TEXT, writeStories260k } from '../workers/dev/stories260k';
import { isolation } from './harness';
import { hubStack, magusStack, TestStack } from './harness/stack';
import { objectBytes, pipelineSettled, startPipeline } from './harness/pipeline';
import { runLlamaCpp } from './reference/llama-cpp';

const EventType = temporal.api.enums.v1.EventType;
const iso = isolation();
const REPO = 'karpathy/stories260K';
/** The padded model (FFN 192, Llama 2's chat template): what distributed-llama runs. */
const PADDED_REPO = 'magus-test/stories260K-ffn192';

let hub: TestHub;
let commit: HubCommit;
let paddedCommit: HubCommit;
let client: Client;
let registry: ModelRegistry;
let s3: S3Client;
let dir: string;
let cfg: MagusConfig;
const stack = new TestStack();

beforeAll(async () => {
  const magus = await stack.open(magusStack(iso, { dirPrefix: 'magus-stories260k-pipeline-', overrides: { convertThreads: 2 } }));
  ({ dir, s3, cfg, client } = magus);
  registry = await openModelRegistry(magus.nc, magus.names.modelsBucket);
  await writeStories260k(join(dir, 'stories260K'));
  ({ hub } = await stack.open(hubStack()));
  commit = await hub.addRepo({ id: REPO, dir: join(dir, 'stories260K') });
  await writeStories260k(join(dir, 'stories260K-ffn192'), { ffn: STORIES260K_DLLAMA_FFN, chatTemplate: LLAMA2_CHAT_TEMPLATE });
  paddedCommit = await hub.addRepo({ id: PADDED_REPO, dir: join(dir, 'stories260K-ffn192') });
}, 120_000);

afterAll(() => stack.close());

const spec = (artifacts: ArtifactRequest[], repo = REPO): ModelSpec => ({ source: { repo, hubUrl: hub.url }, artifacts, contextLength: 512 });
/** A model name of this file's own (its isolation id): its pipeline's and pool's workflow ids are too. */
const named = (base: string) => `${base}-${iso.id}`;
const start = (name: string, s: ModelSpec) => startPipeline(client, cfg.taskQueue, named(name), s);
const sha256 = (bytes: Buffer) => createHash('sha256').update(bytes).digest('hex');

test('pulled, converted to gguf:f32 and gguf:f16, published; each GGUF from S3 generates llama2.c’s text in llama.cpp', async () => {
  const handle = await start(
    'stories',
    spec([
      { format: 'gguf', weights: 'f32' },
      { format: 'gguf', weights: 'f16' },
    ]),
  );
  const p = await pipelineSettled(handle);
  expect(p).toMatchObject({ phase: 'ready', sha: commit.sha, failure: null });

  const ready = await registry.get('default', named('stories'));
  expect(ready?.source).toEqual({ repo: REPO, revision: 'main', sha: commit.sha });
  expect(ready?.artifacts.map((a) => `${a.format}:${a.weights}`)).toEqual(['gguf:f32', 'gguf:f16']);
  for (const artifact of ready!.artifacts) {
    for (const f of artifact.files) {
      const bytes = await objectBytes(s3, iso.bucket, f.key);
      expect([f.key, bytes.length, sha256(bytes)]).toEqual([f.key, f.bytes, f.sha256]);
      if (artifact.format !== 'gguf') continue;
      const local = join(dir, `${artifact.weights}.gguf`);
      writeFileSync(local, bytes);
      const out = await runLlamaCpp({ model: local, promptTokens: [STORIES260K.bos], nTokens: 64 });
      expect([artifact.weights, out.text.slice(0, STORIES260K_TEXT.length)]).toEqual([artifact.weights, STORIES260K_TEXT]);
    }
  }
  expect(await listIncompleteUploads(s3, iso.bucket)).toEqual([]);
}, 120_000);

test('the padded FFN converted for distributed-llama: published with the topologies it runs on, and why not the others', async () => {
  const handle = await start(
    'stories-ffn192',
    spec(
      [
        { format: 'dllama', weights: 'f32' },
        { format: 'dllama', weights: 'q40' },
      ],
      PADDED_REPO,
    ),
  );
  const p = await pipelineSettled(handle);
  expect(p).toMatchObject({ phase: 'ready', sha: paddedCommit.sha, failure: null });
  const ready = (await registry.get('default', named('stories-ffn192')))!;
  expect(ready.artifacts.map((a) => [`${a.format}:${a.weights}`, a.files.map((f) => f.key.split('/').pop())])).toEqual([
    ['dllama:f32', ['model.m', 'tokenizer.t']],
    ['dllama:q40', ['model.m', 'tokenizer.t']],
  ]);
  // 4 KV heads; q40 needs whole 32-value blocks of what each node's o_proj and down_proj read.
  expect(ready.memory.map((m) => [m.weights, m.topologies.map((t) => t.nodes)])).toEqual([
    ['f32', [1, 2, 4]],
    ['q40', [1, 2]],
  ]);
  expect(ready.memory[0]!.refused).toEqual([
    { nodes: 8, reason: 'num_key_value_heads 4 / 8 nodes is not a whole number of KV heads per node' },
    {
      nodes: 16,
      reason:
        'num_key_value_heads 4 / 16 nodes is not a whole number of KV heads per node; num_attention_heads 8 / 16 nodes is not a whole number of heads per node; intermediate_size 192 / 16 nodes = 12 values per node, not a multiple of 8 (F32 matmul)',
    },
  ]);
  expect(ready.memory[1]!.refused?.[0]).toEqual({
    nodes: 4,
    reason:
      'num_attention_heads × head_dim 64 / 4 nodes = 16 values per node, not a whole number of 32-value q40 blocks (Q40 matmul); intermediate_size 192 / 4 nodes = 48 values per node, not a whole number of 32-value q40 blocks (Q40 matmul)',
  });
}, 120_000);

/** How many times an activity type was scheduled, from the workflow's history. */
async function scheduled(workflowId: string, activityType: string): Promise<number> {
  const history = await client.workflow.getHandle(workflowId).fetchHistory();
  return (history.events ?? []).filter(
    (e) => e.eventType === EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED && e.activityTaskScheduledEventAttributes?.activityType?.name === activityType,
  ).length;
}

const BLOCKS = (weights: string) =>
  `BadBlockSize: tensor blk.0.ffn_down.weight (model.layers.0.mlp.down_proj.weight): rows of 172 values cannot be split into 32-value ${weights} blocks; convert this model to f16 or f32`;
const NO_DLLAMA = 'NoTopology: distributed-llama cannot run this model in';
test.each([
  ['gguf', 'q40', BLOCKS('q40')],
  ['gguf', 'q80', BLOCKS('q80')],
  [
    'dllama',
    'q40',
    `${NO_DLLAMA} q40 on any number of nodes: intermediate_size 172 / 1 node = 172 values per node, not a whole number of 32-value q40 blocks (Q40 matmul)`,
  ],
  ['dllama', 'f32', `${NO_DLLAMA} f32 on any number of nodes: intermediate_size 172 / 1 node = 172 values per node, not a multiple of 8 (F32 matmul)`],
  // dllama:q80 and dllama:f16 never get this far: the spec is refused before anything is fetched (shared/model.ts).
] as const)('%s:%s fails once, permanently, naming what stops it; nothing is published', async (format, weights, message) => {
  const name = `stories-${format}-${weights}`;
  const handle = await start(name, spec([{ format, weights }]));
  const p = await pipelineSettled(handle, 60_000);
  expect(p).toMatchObject({ phase: 'failed', failure: { type: 'UnsupportedModel', message, during: 'converting' } });
  expect(await scheduled(handle.workflowId, 'convertArtifact')).toBe(1);

  // What `kubectl describe model` shows: downloaded, then conversion and readiness refused with the reason.
  const conditions = modelConditions(p, 1).map(({ type, status, reason, message: m }) => ({ type, status, reason, message: m }));
  expect(conditions).toEqual([
    { type: 'Downloaded', status: 'True', reason: 'Downloaded', message: '' },
    { type: 'Converted', status: 'False', reason: 'UnsupportedModel', message },
    { type: 'Sized', status: 'False', reason: 'Pending', message: '' },
    { type: 'Ready', status: 'False', reason: 'UnsupportedModel', message },
  ]);

  // Nothing in the registry, no artifact object and no upload left behind.
  expect(await registry.get('default', named(name))).toBeFalsy();
  const prefix = artifactPrefix(REPO, commit.sha, { format, weights }, CONVERTER_VERSION);
  const listed = await s3.send(new ListObjectsV2Command({ Bucket: iso.bucket, Prefix: prefix }));
  expect(listed.Contents ?? []).toEqual([]);
  expect(await listIncompleteUploads(s3, iso.bucket, prefix)).toEqual([]);
});

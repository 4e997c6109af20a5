/** Driving the `modelPipeline` workflow from a test: start it, wait until it settles, read what it stored. */
import { GetObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import type { Client, WorkflowHandle } from '@temporalio/client';
import type { ModelSpec } from '../../shared/model';
import { modelWorkflowId, progressQuery, type PipelineProgress } from '../../workflows/model/definitions';
import { modelPipeline } from '../../workflows/model/pipeline';
import { sleep } from './wait';

/**
 * Starts the pipeline of model `default/<name>` on `taskQueue` (the worker's control queue). Its
 * workflow id, `model/default/<name>`, and the pool it tells of the model derive from the name:
 * give a name that carries the test file's isolation id, so files sharing the server never collide.
 */
export function startPipeline(client: Client, taskQueue: string, name: string, spec: ModelSpec): Promise<WorkflowHandle<typeof modelPipeline>> {
  return client.workflow.start(modelPipeline, { workflowId: modelWorkflowId('default', name), taskQueue, args: [{ namespace: 'default', name, spec }] });
}

/** Polls the progress query until the pipeline settles in `ready` or `failed`. */
export async function pipelineSettled(handle: { query: WorkflowHandle<typeof modelPipeline>['query'] }, timeoutMs = 90_000): Promise<PipelineProgress> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const p = await handle.query(progressQuery);
    if (p.phase === 'ready' || p.phase === 'failed') return p;
    if (Date.now() > deadline) throw new Error(`pipeline still ${p.phase} after ${timeoutMs} ms`);
    await sleep(200);
  }
}

/** An S3 object's bytes. */
export async function objectBytes(s3: S3Client, bucket: string, key: string): Promise<Buffer> {
  const r = await s3.send(new GetObjectCommand({ Bucket: bucket, Key: key }));
  return Buffer.from(await r.Body!.transformToByteArray());
}

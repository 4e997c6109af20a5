/**
 * A `magus worker` start is quiet about what is expected: neither the Temporal SDK's
 * "No workflows registered" (its pipeline and runtime queues have activities only) nor the AWS
 * SDK's NodeVersionSupportWarning, while it still prints its own start line.
 */
import { CreateBucketCommand } from '@aws-sdk/client-s3';
import { spawn, type ChildProcess } from 'node:child_process';
import { join } from 'node:path';
import { endpoint, isolation, s3Client } from './harness';

const iso = isolation();
let worker: ChildProcess | undefined;

afterAll(() => {
  worker?.kill('SIGKILL');
});

test('a worker start prints neither "No workflows registered" nor the AWS SDK Node-version notice', async () => {
  const s3 = s3Client();
  await s3.send(new CreateBucketCommand({ Bucket: iso.bucket }));
  s3.destroy();
  const s3e = endpoint('s3');
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    MAGUS_TEMPORAL_ADDRESS: endpoint('temporal').address,
    MAGUS_NATS_URL: endpoint('nats').servers,
    MAGUS_S3_ENDPOINT: s3e.endpoint,
    MAGUS_S3_BUCKET: iso.bucket,
    AWS_ACCESS_KEY_ID: s3e.accessKeyId,
    AWS_SECRET_ACCESS_KEY: s3e.secretAccessKey,
    MAGUS_TASK_QUEUE: `${iso.id}-control`,
    MAGUS_NATS_PREFIX: iso.natsPrefix,
    MAGUS_METRICS_ADDRESS: '127.0.0.1:0',
    MAGUS_HEALTH_ADDRESS: '127.0.0.1:0',
    // Not using any leftover dev's connection.
    MAGUS_DEV_DATA_DIR: join(__dirname, 'no-such-dev'),
  };
  delete env.AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED;
  delete env.NODE_NO_WARNINGS;
  worker = spawn(process.execPath, ['-r', require.resolve('@swc-node/register'), '-e', "require('./workers/magus').main(['worker']).then((c) => process.exit(c))"], {
    cwd: join(__dirname, '..'),
    stdio: ['ignore', 'ignore', 'pipe'],
    env,
  });
  let stderr = '';
  worker.stderr!.setEncoding('utf8');
  worker.stderr!.on('data', (d: string) => (stderr += d));
  const exited = new Promise<number | null>((resolve) => worker!.once('exit', (code) => resolve(code)));
  const deadline = Date.now() + 60_000;
  while (!stderr.includes('magus worker: polling') && Date.now() < deadline && worker.exitCode === null) await new Promise((r) => setTimeout(r, 100));
  expect(stderr).toContain('magus worker: polling');
  // The warnings come once the workers run their pollers, just after the start line.
  await new Promise((r) => setTimeout(r, 2000));
  worker.kill('SIGTERM');
  expect(await exited).toBe(0);
  expect(stderr).not.toContain('No workflows registered');
  expect(stderr).not.toContain('NodeVersionSupportWarning');
}, 90_000);

/**
 * `magus dev`: everything on one machine, one command. Starts Temporal, NATS and S3 (MinIO), a
 * worker with the local runtime and the gateway; pulls a model through the real pipeline — by
 * default the tiny synthetic demo model from a bundled Hugging Face-compatible hub, so it works
 * offline, or `--model org/repo` from the real hub — and prints a ready-to-paste `curl`.
 * Ctrl-C stops everything it started.
 */
import { Client, Connection } from '@temporalio/client';
import { DefaultLogger, Runtime } from '@temporalio/worker';
import { createHash, randomBytes } from 'node:crypto';
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { startFixtureHub, type FixtureHub } from '../../test/fixtures/hf-hub';
import { writeTinyModel } from '../../test/fixtures/tiny-model';
import { loadGatewayConfig } from '../../gateway/config';
import { startGateway } from '../../gateway/server';
import { temporalSessions } from '../../gateway/temporal';
import { validateModelSpec, type ModelSpec } from '../../shared/model';
import { modelWorkflowId, progressQuery } from '../../workflows/model/definitions';
import type { modelPipeline } from '../../workflows/model/pipeline';
import { loadConfig } from '../config';
import { defaultModelName } from '../model-pull';
import { startWorkers } from '../worker';
import { listenOnPort, startServices } from './services';

const DEMO_REPO = 'magus-demo/tiny-llama';

export interface DevOptions {
  /** A Hugging Face repo to pull instead of the demo model (needs internet). */
  model?: string;
  /** Gateway port; a taken one is an error. Default 8080, or one the kernel picks when 8080 is taken. */
  port?: number;
  /** Env var holding a Hugging Face token for gated models. */
  tokenEnv?: string;
}

const say = (line: string) => process.stderr.write(`magus dev: ${line}\n`);

export async function runDev(opts: DevOptions): Promise<number> {
  Runtime.install({ logger: new DefaultLogger('WARN') }); // the worker's INFO lines would bury the output
  say('starting Temporal, NATS and S3 …');
  const services = await startServices({ services: ['temporal', 'nats', 's3'] });
  const e = services.endpoints;
  const stops: (() => Promise<unknown>)[] = [() => services.stop()];
  const stopAll = async () => {
    for (const stop of stops.reverse()) await stop().catch((err: Error) => say(`while stopping: ${err.message}`));
  };
  try {
    // The worker and gateway read their configuration as they would in production.
    Object.assign(process.env, {
      MAGUS_TEMPORAL_ADDRESS: e.temporal!.address,
      MAGUS_NATS_URL: e.nats!.servers,
      MAGUS_S3_ENDPOINT: e.s3!.endpoint,
      MAGUS_S3_BUCKET: 'magus',
      AWS_ACCESS_KEY_ID: e.s3!.accessKeyId,
      AWS_SECRET_ACCESS_KEY: e.s3!.secretAccessKey,
      MAGUS_MODEL_CACHE: join(services.dataDir, 'models'),
    });
    const cfg = loadConfig();

    let hub: FixtureHub | undefined;
    let repo = opts.model;
    if (!repo) {
      say('generating the demo model and serving it from a local Hugging Face-compatible hub …');
      const dir = join(services.dataDir, 'demo-model');
      mkdirSync(dir, { recursive: true });
      await writeTinyModel(dir, { seed: 2026 });
      hub = await startFixtureHub();
      stops.push(() => hub!.stop());
      await hub.addRepo({ id: DEMO_REPO, dir });
      repo = DEMO_REPO;
    }

    const workers = await startWorkers(cfg);
    stops.push(() => workers.shutdown());

    const connection = await Connection.connect({ address: cfg.temporal.address });
    stops.push(() => connection.close());
    const client = new Client({ connection, namespace: cfg.temporal.namespace });

    const token = `mgs_dev_${randomBytes(24).toString('hex')}`;
    const tokenFile = join(services.dataDir, 'api-token');
    writeFileSync(tokenFile, `${token}\n`, { mode: 0o600 });
    const secret = randomBytes(32).toString('hex');
    const digest = createHash('sha256').update(token).digest('hex');
    const sessions = temporalSessions({ client, taskQueue: cfg.taskQueue, pool: { minInstances: 0, maxInstances: 1, leasesPerInstance: 8, idleTimeoutMs: 15 * 60_000 }, sessionTtlMs: 30 * 60_000 });
    // Listening is what takes the port: no "is it free?" probe that another process could beat.
    const gateway = await listenOnPort(
      'the gateway',
      (port) =>
        startGateway(
          loadGatewayConfig({
            MAGUS_GATEWAY_HOST: '127.0.0.1',
            MAGUS_GATEWAY_PORT: String(port),
            MAGUS_NATS_URL: cfg.nats.servers,
            MAGUS_NATS_PREFIX: cfg.natsPrefix,
            MAGUS_GATEWAY_SECRET: secret,
            MAGUS_GATEWAY_TOKENS: JSON.stringify({ dev: { digest, name: 'magus dev' } }),
            MAGUS_LOG_LEVEL: 'warn',
          }),
          { ...sessions },
        ),
      { port: opts.port, preferred: 8080, flag: '--port' },
    );
    stops.push(() => gateway.close());

    const name = opts.model ? defaultModelName(repo) : 'demo';
    const spec: ModelSpec = {
      source: { repo, ...(hub ? { hubUrl: hub.url } : {}), ...(opts.tokenEnv ? { tokenRef: { env: opts.tokenEnv } } : {}) },
      artifacts: [{ format: 'gguf', weights: 'q40' }],
    };
    const problems = validateModelSpec(spec);
    if (problems.length > 0) throw new Error(problems.join('; '));
    say(`pulling ${repo} through the modelPipeline workflow (watch it at ${e.temporal!.uiUrl}) …`);
    const handle = await client.workflow.start<typeof modelPipeline>('modelPipeline', {
      workflowId: modelWorkflowId('default', name),
      taskQueue: cfg.taskQueue,
      args: [{ namespace: 'default', name, spec }],
      workflowIdConflictPolicy: 'USE_EXISTING',
    });
    let phase = '';
    for (;;) {
      const p = await handle.query(progressQuery);
      if (p.phase !== phase) {
        phase = p.phase;
        say(`  ${phase}${p.failure ? `: ${p.failure.type}: ${p.failure.message}` : ''}`);
      }
      if (p.phase === 'ready') break;
      if (p.phase === 'failed') throw new Error(`the model could not be prepared (${p.failure?.type})`);
      await new Promise((r) => setTimeout(r, 300));
    }

    const body = JSON.stringify({ model: name, messages: [{ role: 'user', content: 'Hello!' }], stream: true, max_tokens: 32 });
    process.stdout.write(
      [
        '',
        `magus is ready. Model "${name}" (${repo}) is served at ${gateway.url}/v1`,
        `Temporal UI: ${e.temporal!.uiUrl}`,
        `API token:   in ${tokenFile}`,
        '',
        'Try a streamed chat completion (the first request starts an engine):',
        `  curl -sN ${gateway.url}/v1/chat/completions -H "Authorization: Bearer $(cat ${tokenFile})" -H 'Content-Type: application/json' -d '${body}'`,
        '',
        'Ctrl-C stops everything.',
        '',
      ].join('\n'),
    );
    await new Promise<void>((resolve) => {
      process.once('SIGINT', () => resolve());
      process.once('SIGTERM', () => resolve());
    });
    say('stopping …');
    return 0;
  } catch (err) {
    say((err as Error).message);
    return 1;
  } finally {
    await stopAll();
  }
}

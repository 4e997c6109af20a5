/**
 * `magus dev`: everything on one machine, one command. Starts Temporal, NATS and S3 (MinIO), a
 * worker with the local runtime and the gateway; pulls a model through the real pipeline — by
 * default the tiny synthetic demo model from a bundled Hugging Face-compatible hub, so it works
 * offline, or `--model org/repo` from the real hub — and prints a ready-to-paste `curl`.
 * When the Kubernetes servers are built (`scripts/dev-services etcd kube-apiserver`) it also opens
 * the kubectl door: etcd + kube-apiserver, the CRDs, the controller, and the demo model declared
 * as a `Model` resource; `--no-kube` leaves it shut. Ctrl-C stops everything it started.
 */
import { Client, Connection } from '@temporalio/client';
import { DefaultLogger, Runtime } from '@temporalio/worker';
import { createHash, randomBytes } from 'node:crypto';
import { execFile } from 'node:child_process';
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { CustomObjectsApi, KubeConfig, PatchStrategy, setHeaderOptions } from '@kubernetes/client-node';
import { connect } from 'nats';
import { installCrds } from '../../activities/kubernetes/crds';
import { dataPlaneNames } from '../../activities/nats/data-plane';
import { CRD_GROUP, CRD_VERSION } from '../../shared/constants';
import type { ModelResource } from '../../shared/kube';
import { startController } from '../controller/controller';
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
import { listenOnPort, REPO_ROOT, startServices, writeKubeconfig, type ServiceName } from './services';

const DEMO_REPO = 'magus-demo/tiny-llama';

export interface DevOptions {
  /** A Hugging Face repo to pull instead of the demo model (needs internet). */
  model?: string;
  /** Gateway port; a taken one is an error. Default 8080, or one the kernel picks when 8080 is taken. */
  port?: number;
  /** Env var holding a Hugging Face token for gated models. */
  tokenEnv?: string;
  /** Open the kubectl door when the Kubernetes servers are built (default true). */
  kube?: boolean;
}

/** Whether etcd and kube-apiserver are built (never starts a build: that takes minutes). */
async function kubeBinariesBuilt(): Promise<boolean> {
  try {
    await promisify(execFile)(join(REPO_ROOT, 'scripts', 'dev-services'), ['--check', 'etcd', 'kube-apiserver'], { timeout: 30_000 });
    return true;
  } catch {
    return false;
  }
}

const say = (line: string) => process.stderr.write(`magus dev: ${line}\n`);

export async function runDev(opts: DevOptions): Promise<number> {
  Runtime.install({ logger: new DefaultLogger('WARN') }); // the worker's INFO lines would bury the output
  const kube = opts.kube !== false && (await kubeBinariesBuilt());
  if (opts.kube !== false && !kube) say('the kubectl door stays shut: etcd and kube-apiserver are not built (scripts/dev-services etcd kube-apiserver builds them, ~5 min once; --no-kube hides this note)');
  const wanted: ServiceName[] = ['temporal', 'nats', 's3', ...(kube ? (['kubernetes'] as const) : [])];
  say(`starting ${kube ? 'Temporal, NATS, S3 and Kubernetes (etcd + kube-apiserver)' : 'Temporal, NATS and S3'} …`);
  const services = await startServices({ services: wanted });
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

    // The kubectl door: an admin kubeconfig in the data folder, the CRDs, the controller in process.
    let kc: KubeConfig | undefined;
    let kubeconfigFile: string | undefined;
    if (e.kubernetes) {
      kubeconfigFile = join(services.dataDir, 'kubeconfig');
      writeKubeconfig(kubeconfigFile, e.kubernetes);
      kc = new KubeConfig();
      kc.loadFromFile(kubeconfigFile);
      await installCrds(kc);
    }

    const workers = await startWorkers(cfg, { kube: kc });
    stops.push(() => workers.shutdown());

    const connection = await Connection.connect({ address: cfg.temporal.address });
    stops.push(() => connection.close());
    const client = new Client({ connection, namespace: cfg.temporal.namespace });

    if (kc) {
      const nc = await connect({ servers: cfg.nats.servers, name: 'magus-dev-controller', maxReconnectAttempts: -1 });
      stops.push(() => nc.drain());
      const names = dataPlaneNames(cfg.natsPrefix);
      const controller = startController({
        kc,
        temporal: { client, namespace: cfg.temporal.namespace, taskQueue: cfg.taskQueue },
        tokens: await nc.jetstream().views.kv(names.tokensBucket),
        sessions: { kv: await nc.jetstream().views.kv(names.sessionsBucket), cap: 200 },
        log: (line) => say(`controller: ${line}`),
      });
      stops.push(() => controller.stop());
      await controller.synced;
    }

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
    // With the kubectl door open the model is declared as a `Model` and the controller starts its
    // pipeline; a token from an env var has no place in a resource, so that pull goes direct.
    const declared = kc && !opts.tokenEnv;
    if (declared) await declareModel(kc!, name, spec);
    const handle = declared
      ? await waitForWorkflow(client, modelWorkflowId('default', name))
      : await client.workflow.start<typeof modelPipeline>('modelPipeline', {
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
        ...(kubeconfigFile ? [`Kubernetes:  ${e.kubernetes!.server} (Model, Dllama and Session resources; kubeconfig ${kubeconfigFile})`] : []),
        ...(hub ? [`Demo hub:    ${hub.url} (Hugging Face-compatible; serves ${DEMO_REPO})`] : []),
        '',
        'Try a streamed chat completion (the first request starts an engine):',
        `  curl -sN ${gateway.url}/v1/chat/completions -H "Authorization: Bearer $(cat ${tokenFile})" -H 'Content-Type: application/json' -d '${body}'`,
        '',
        ...(kubeconfigFile ? ['And the kubectl door (declare more models with kubectl apply -f crds/examples/…):', `  KUBECONFIG=${kubeconfigFile} kubectl get models`, ''] : []),
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

/** The demo model as a `Model` resource in `default`, created or updated by server-side apply. */
async function declareModel(kc: KubeConfig, name: string, spec: ModelSpec): Promise<void> {
  const custom = kc.makeApiClient(CustomObjectsApi);
  const body: Pick<ModelResource, 'apiVersion' | 'kind' | 'spec'> & { metadata: { name: string; namespace: string } } = {
    apiVersion: `${CRD_GROUP}/${CRD_VERSION}`,
    kind: 'Model',
    metadata: { name, namespace: 'default' },
    spec: { source: { repo: spec.source.repo, ...(spec.source.hubUrl ? { hubUrl: spec.source.hubUrl } : {}) }, artifacts: spec.artifacts },
  };
  await custom.patchNamespacedCustomObject(
    { group: CRD_GROUP, version: CRD_VERSION, namespace: 'default', plural: 'models', name, body, fieldManager: 'magus-dev', force: true },
    setHeaderOptions('Content-Type', PatchStrategy.ServerSideApply),
  );
}

/** The handle of a workflow someone else (the controller) starts, once it exists. */
async function waitForWorkflow(client: Client, workflowId: string) {
  const deadline = Date.now() + 60_000;
  for (;;) {
    const handle = client.workflow.getHandle<typeof modelPipeline>(workflowId);
    try {
      await handle.describe();
      return handle;
    } catch (err) {
      if (Date.now() > deadline) throw new Error(`the controller did not start ${workflowId} within 60 s: ${(err as Error).message}`);
      await new Promise((r) => setTimeout(r, 200));
    }
  }
}

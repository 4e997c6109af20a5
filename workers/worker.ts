/**
 * `magus worker`: Temporal workers for the control queue (workflows, registry writes), the
 * pipeline queue (download, convert, size) and this worker's own runtime queue (describe and
 * destroy of the instances it runs), wired to real Temporal, NATS and S3 clients.
 */
import { natsConnectAuth } from '../dataplane/roles';
import { randomBytes } from 'node:crypto';
import { appendFileSync } from 'node:fs';
import { hostname } from 'node:os';
import { CreateBucketCommand, HeadBucketCommand, S3Client } from '@aws-sdk/client-s3';
import { CoreV1Api, KubeConfig } from '@kubernetes/client-node';
import { Client, Connection } from '@temporalio/client';
import { bundleWorkflowCode, DefaultLogger, NativeConnection, TransportError, Worker, type Logger, type LogLevel, type LogMetadata } from '@temporalio/worker';
import { temporal } from '@temporalio/proto';
import { connect, type ConsumerInfo, type NatsConnection } from 'nats';
import { createPipelineActivities } from '../activities/pipeline';
import { createSecretResolver } from '../activities/huggingface/secrets';
import { declareOnReconnect, ensureDataPlane, instanceConsumerNamesOf } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import { leaderGet } from '../dataplane/kv-leader';
import { claimOrphanRead, deleteEntry, poolEntryCounter } from '../dataplane/session-keys';
import { createKubernetesActivities } from '../activities/kubernetes/activities';
import { configuredRuntime } from '../activities/runtime';
import type { WorkerRuntime } from '../activities/runtime/runtime';
import { createServingActivities } from '../activities/serving';
import { pipelineQueueFor, poolQueueFor, runtimeQueueFor, SearchAttribute, workerOfRuntimeQueue } from '../shared/constants';
import { RUNTIME_ADVERT_INTERVAL_MS } from '../shared/runtimes';
import { activityFailedSignal, activityProgressSignal } from '../workflows/model/definitions';
import { DEFAULT_WORKFLOW_CACHE, dataPlaneEnv, type MagusConfig } from './config';
import { natsServerList } from '../platform/config';
import {
  isTemporalUnreachable,
  TEMPORAL_CHANNEL_ARGS,
  unreachableHealth,
  untilTemporalAnswers,
  watchTemporal,
  type TemporalHealth,
} from '../platform/temporal-health';

/** gRPC status codes (as @grpc/grpc-js numbers them). */
const GrpcStatus = { PERMISSION_DENIED: 7, UNIMPLEMENTED: 12 } as const;

export interface RunningWorkers {
  /** Resolves when all three workers (control, pipeline, this worker's runtime queue) have stopped. */
  done: Promise<void>;
  /** Graceful stop: in-flight activity attempts are cancelled and resumed by the next worker. */
  shutdown(): Promise<void>;
  /**
   * The runtime the worker's configuration selects (`MAGUS_RUNTIME`, activities/runtime/index.ts):
   * its instances, its in-process bridges, its stop.
   */
  runtime: WorkerRuntime;
  /** This worker's own task queue: its instances' describe, destroy and watch activities. */
  runtimeQueue: string;
  /**
   * Whether Temporal answers (a probe on the client connection). While it does not, the SDK's
   * pollers retry by themselves with capped backoff (~1 failed poll a second per worker process,
   * measured) and take work again once it is back; nothing here needs restarting.
   */
  temporal: TemporalHealth;
  /**
   * Workflows the SDK keeps cached over this process's Temporal workers (each one's state lives
   * in the workflow threads' V8 heaps, which the process's heap gauges do not see; the cache holds
   * at most `maxCachedWorkflows` per worker, by default sized from the heap limit).
   */
  cachedWorkflows(): number;
}

/** Registers magus's search attributes on the namespace (idempotent). */
export async function ensureSearchAttributes(connection: Connection, namespace: string): Promise<void> {
  const Keyword = temporal.api.enums.v1.IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD;
  // One at a time: a request naming one that exists already is refused as a whole (a namespace
  // from an older magus has the first two).
  for (const name of Object.values(SearchAttribute)) {
    try {
      await connection.operatorService.addSearchAttributes({ namespace, searchAttributes: { [name]: Keyword } });
    } catch (err) {
      if (/already exists/i.test((err as Error).message)) continue;
      // A Temporal that keeps this to its operators (Temporal Cloud, a restricted role): fine if
      // an operator added it; if not, the workflows' upserts would fail their tasks, so say so now.
      const code = (err as { code?: number }).code;
      if (code !== GrpcStatus.PERMISSION_DENIED && code !== GrpcStatus.UNIMPLEMENTED) throw err;
      const known = await connection.operatorService.listSearchAttributes({ namespace }).then(
        (r) => Object.keys(r.customAttributes ?? {}),
        () => undefined,
      );
      const fix = `add it once: temporal operator search-attribute create --namespace ${namespace} --name ${name} --type Keyword`;
      if (known && !known.includes(name))
        throw new Error(
          `the search attribute ${name} is missing in Temporal namespace ${namespace} and this worker may not add it (${(err as Error).message}); ${fix}`,
        );
      if (!known)
        process.stderr.write(
          `magus worker: cannot register or list the search attribute ${name} in ${namespace} (${(err as Error).message}); if it is missing, ${fix}\n`,
        );
    }
  }
}

async function ensureBucket(s3: S3Client, bucket: string): Promise<void> {
  try {
    await s3.send(new HeadBucketCommand({ Bucket: bucket }));
  } catch {
    await s3.send(new CreateBucketCommand({ Bucket: bucket })).catch((err: Error) => {
      if (!/BucketAlreadyOwnedByYou|BucketAlreadyExists/.test(err.name)) throw err;
    });
  }
}

const WRITE_COMMANDS = new Set([
  'PutObjectCommand',
  'UploadPartCommand',
  'CreateMultipartUploadCommand',
  'CompleteMultipartUploadCommand',
  'AbortMultipartUploadCommand',
]);

/** Appends `<command> <key> <part>` for every S3 write request that succeeded (MAGUS_S3_TRACE_FILE). */
function traceS3Writes(s3: S3Client, file: string): void {
  s3.middlewareStack.add(
    (next, context) => async (args) => {
      const result = await next(args);
      if (WRITE_COMMANDS.has(context.commandName ?? '')) {
        const input = args.input as { Key?: string; PartNumber?: number };
        appendFileSync(file, `${context.commandName} ${input.Key ?? ''} ${input.PartNumber ?? ''}\n`);
      }
      return result;
    },
    { step: 'initialize', name: 'magusWriteTrace' },
  );
}

/**
 * A Kubernetes client for `{secret}` token references, when the worker runs in a cluster or a
 * kubeconfig is given; otherwise those references fail with SecretUnavailable.
 */
export function kubeConfigFromEnv(): KubeConfig | undefined {
  if (!process.env.KUBERNETES_SERVICE_HOST && !process.env.KUBECONFIG) return undefined;
  const kc = new KubeConfig();
  kc.loadFromDefault();
  return kc;
}

function kubeForSecrets(kc: KubeConfig | undefined): { coreApi: CoreV1Api; defaultNamespace: string } | undefined {
  if (!kc) return undefined;
  const ns = process.env.MAGUS_NAMESPACE ?? kc.getContextObject(kc.getCurrentContext())?.namespace ?? 'default';
  return { coreApi: kc.makeApiClient(CoreV1Api), defaultNamespace: ns };
}

/**
 * The Temporal SDK's log for the worker processes: `inner`, less the SDK's
 * "No workflows registered, not polling for workflow tasks" warning, which the pipeline and
 * runtime queues (activities only, by design) would print at every start. Every other message,
 * warnings included, passes.
 */
export function workerLogger(inner: Logger = new DefaultLogger('INFO')): Logger {
  const log = (level: LogLevel, message: string, meta?: LogMetadata): void => {
    if (level === 'WARN' && message.startsWith('No workflows registered')) return;
    inner.log(level, message, meta);
  };
  return {
    log,
    trace: (message, meta) => log('TRACE', message, meta),
    debug: (message, meta) => log('DEBUG', message, meta),
    info: (message, meta) => log('INFO', message, meta),
    warn: (message, meta) => log('WARN', message, meta),
    error: (message, meta) => log('ERROR', message, meta),
  };
}

export interface WorkerDeps {
  /**
   * The cluster, when there is one (in a pod, `KUBECONFIG`, or given by a test): token Secrets
   * resolve through it and the control queue writes `Model`/`Dllama` status.
   */
  kube?: KubeConfig;
}

export interface StartOptions {
  /**
   * Ends a start that waits for Temporal (a stop asked for meanwhile): startWorkers stops what it
   * started (NATS, S3, the runtime) and rejects with the signal's reason.
   */
  signal?: AbortSignal;
  /**
   * Told when Temporal does not answer the start's first attempt (not at all when it does): the
   * health to show while the start waits for it (unreachable, failed attempts counted). Until
   * Temporal answers, the Temporal workers do not exist; everything else is up.
   */
  onWaitingForTemporal?: (health: TemporalHealth) => void;
  /** The start's own lines (each failed attempt, Temporal answering); default stderr (`magus worker: …`). */
  log?: (line: string) => void;
  /**
   * false: an unreachable Temporal fails the start at its first attempt instead (`magus dev`,
   * which has just started its own and would only hide its crash by waiting). Default true.
   */
  waitForTemporal?: boolean;
}

/**
 * Starts the worker: NATS, S3, the data plane and the runtime first, then — once Temporal
 * answers — its search attributes and the Temporal workers. While Temporal is unreachable the
 * start waits for it (untilTemporalAnswers: one attempt, then 1 s, 2 s and every 3 s after it,
 * each failure logged), as a running worker's pollers do; anything else Temporal says (a
 * namespace that does not exist, a search attribute it may not add) fails the start as before.
 */
export async function startWorkers(cfg: MagusConfig, deps: WorkerDeps = { kube: kubeConfigFromEnv() }, opts: StartOptions = {}): Promise<RunningWorkers> {
  const log = opts.log ?? ((line: string) => void process.stderr.write(`magus worker: ${line}\n`));
  // Lazy: nothing waits on Temporal before the Temporal workers need it (connectTemporal, below).
  const connection = Connection.lazy({ address: cfg.temporal.address, channelArgs: TEMPORAL_CHANNEL_ARGS });
  const client = new Client({ connection, namespace: cfg.temporal.namespace });
  // Reconnects for ever: the local runtime's bridges and the serving activities live on this connection.
  const nc: NatsConnection = await connect({
    servers: natsServerList(cfg.nats.servers),
    name: 'magus-worker',
    maxReconnectAttempts: -1,
    noAsyncTraces: true,
    ...natsConnectAuth(cfg.nats.credentials, natsServerList(cfg.nats.servers), log),
  });
  const s3 = new S3Client({ endpoint: cfg.s3.endpoint, region: cfg.s3.region, forcePathStyle: cfg.s3.forcePathStyle });
  if (cfg.s3TraceFile) traceS3Writes(s3, cfg.s3TraceFile);
  await ensureBucket(s3, cfg.s3.bucket);
  // The data plane and the registry's bucket, now and after every reconnect (a restarted server may have lost them).
  const { names, registry } = await declareOnReconnect(
    nc,
    async () => {
      const names = await ensureDataPlane(nc, { prefix: cfg.natsPrefix, replicas: cfg.natsReplicas, ...cfg.responses });
      return { names, registry: await openModelRegistry(nc, names.modelsBucket) };
    },
    { what: 'data plane', log: (line) => process.stderr.write(`magus worker: ${line}\n`) },
  );
  // The runtime the configuration selects. Its own events (instances, restarts) go to stderr; the
  // engines' output does not (prompts).
  const configured = configuredRuntime(cfg);
  const runtime = configured.create({
    nc,
    names,
    registry,
    s3,
    ...(deps.kube ? { kube: deps.kube } : {}),
    dataPlaneEnv: dataPlaneEnv(cfg),
    log: (line) => process.stderr.write(`magus worker: ${configured.kind} runtime: ${line}\n`),
  });
  // A runtime whose instances are this worker's processes (local) has their describe, destroy and
  // watch come to this worker's own queue (the pool learns it from createInstance); one that
  // answers from elsewhere (Kubernetes: the cluster) lets any worker answer, and names no queue.
  const workerId = `${hostname()}-${process.pid}-${randomBytes(3).toString('hex')}`;
  const runtimeQueue = runtimeQueueFor(cfg.taskQueue, workerId);
  const sessionsKv = await nc.jetstream().views.kv(names.sessionsBucket);
  const poolsKv = await nc.jetstream().views.kv(names.poolsBucket);
  // Whether another worker still lives, asked by a pool whose watcher on that worker's queue was not taken in time.
  const advertOf = async (queue: string) => {
    const worker = workerOfRuntimeQueue(cfg.taskQueue, queue);
    return worker === null ? null : registry.runtimeAdvert(worker);
  };
  // An instance's backlog, for its pool's reconciler: its consumers' pending and in-flight requests (its own, and its lanes').
  const jsm = await nc.jetstreamManager();
  const backlog = async (pool: string, instance: string) => {
    const [info, ...lanes] = await Promise.all(
      instanceConsumerNamesOf(pool, instance).map((c) => jsm.consumers.info(names.requestStream, c).catch(() => null)),
    );
    if (!info) return null;
    const sum = (of: (i: ConsumerInfo) => number) => lanes.reduce((n, lane) => n + (lane ? of(lane) : 0), of(info));
    return { pending: sum((i) => i.num_pending), ackPending: sum((i) => i.num_ack_pending) };
  };
  const serving = createServingActivities({
    runtime,
    sessions: sessionsKv,
    readSession: (key) => leaderGet(jsm, names.sessionsBucket, key),
    // A pool's entries counted by the server, and deletes whose markers expire: no copy of them here.
    countEntries: poolEntryCounter(jsm, names.sessionsBucket),
    deleteSession: (key, previousSeq) => deleteEntry(nc.jetstream(), names.sessionsBucket, key, { previousSeq }),
    claimOrphanRead: (prefix, forMs) => claimOrphanRead(nc.jetstream(), names.sessionsBucket, prefix, forMs, workerId),
    pools: poolsKv,
    ...(configured.ownsInstances ? { runtimeQueue } : {}),
    advertOf,
    backlog,
  });

  const activities = createPipelineActivities({
    s3,
    bucket: cfg.s3.bucket,
    registry,
    resolveSecret: createSecretResolver({ kube: kubeForSecrets(deps.kube) }),
    reportProgress: (workflowId, progress) => client.workflow.getHandle(workflowId).signal(activityProgressSignal, progress),
    reportRetry: (workflowId, retry) => client.workflow.getHandle(workflowId).signal(activityFailedSignal, retry),
    convertThreads: cfg.convertThreads,
    transfer: { partSize: cfg.transferPartSize },
    ...(cfg.hubAllowNetworks ? { hubAllowNetworks: cfg.hubAllowNetworks } : {}),
  });

  // Everything above runs without Temporal; from here on the workers need it.
  let temporalFailures: number;
  let workerConnection: NativeConnection;
  try {
    ({ failures: temporalFailures, native: workerConnection } = await connectTemporal(cfg, connection, opts, log));
  } catch (err) {
    await runtime.stopAll().catch(() => undefined);
    await connection.close();
    await nc.drain().catch(() => undefined);
    s3.destroy();
    throw err;
  }

  // MAGUS_WORKER_QUEUES: a Deployment per queue scales and sizes them apart (the chart does).
  const polls = (q: 'control' | 'pipeline') => (cfg.queues ?? 'all') === 'all' || cfg.queues === q;
  const controlActivities = {
    publishModel: (model: Parameters<typeof activities.publishModel>[0]) => activities.publishModel(model),
    ...serving,
    ...(deps.kube ? createKubernetesActivities({ kc: deps.kube, bucket: cfg.s3.bucket }) : {}),
  };
  // One bundle of the workflow code for the control and the pools' queues.
  const workflowBundle = polls('control')
    ? { code: (await bundleWorkflowCode({ workflowsPath: require.resolve('../workflows'), logger: new DefaultLogger('WARN') })).code }
    : undefined;
  const control = !polls('control')
    ? undefined
    : await Worker.create({
        connection: workerConnection,
        namespace: cfg.temporal.namespace,
        taskQueue: cfg.taskQueue,
        // Each serving instance's watcher holds a slot for the instance's life (mostly waiting on a
        // timer or a pod watch), beside the starts and the short activities.
        maxConcurrentActivityTaskExecutions: 1000,
        workflowBundle,
        // Sessions sleep until their expiry: caching thousands of them buys nothing but heap.
        maxCachedWorkflows: cfg.workflowCache ?? DEFAULT_WORKFLOW_CACHE,
        // Workflows, registry writes, and the runtime and session-KV activities of the serving workflows.
        activities: controlActivities,
      });
  // The pools' own queue (ARCHITECTURE.md, "Processes": a pool's task never waits behind
  // thousands of session tasks): the pool workflows and their activities (instances, watchers,
  // the reconciler, the view).
  const poolsWorker = !polls('control')
    ? undefined
    : await Worker.create({
        connection: workerConnection,
        namespace: cfg.temporal.namespace,
        taskQueue: poolQueueFor(cfg.taskQueue),
        maxConcurrentActivityTaskExecutions: 1000,
        workflowBundle,
        activities: controlActivities,
      });
  const pipeline = !polls('pipeline')
    ? undefined
    : await Worker.create({
        connection: workerConnection,
        namespace: cfg.temporal.namespace,
        taskQueue: pipelineQueueFor(cfg.taskQueue),
        activities,
        // Conversions use every core through their own thread pool: one at a time per worker.
        maxConcurrentActivityTaskExecutions: 8,
      });

  const own = !polls('control')
    ? undefined
    : await Worker.create({
        connection: workerConnection,
        namespace: cfg.temporal.namespace,
        taskQueue: runtimeQueue,
        activities: {
          destroyInstance: (input: Parameters<typeof serving.destroyInstance>[0]) => serving.destroyInstance(input),
          watchInstance: (input: Parameters<typeof serving.watchInstance>[0]) => serving.watchInstance(input),
        },
      });

  // What this worker's runtime can serve, refreshed while it runs (a gone worker's advert goes
  // stale): gateways refuse at once a model no live runtime can run (shared/runtimes.ts).
  const advertise = (): Promise<void> =>
    registry
      .advertiseRuntime({ worker: workerId, runtime: configured.kind, ...configured.advert(), at: Date.now() })
      .catch((err: unknown) => void process.stderr.write(`magus worker: runtime advert not written: ${(err as Error).message}\n`));
  let advertTimer: NodeJS.Timeout | undefined;
  if (control) {
    await advertise();
    advertTimer = setInterval(() => void advertise(), RUNTIME_ADVERT_INTERVAL_MS);
    advertTimer.unref();
  }

  const running = [control, poolsWorker, pipeline, own].filter((w): w is Worker => w !== undefined);
  const temporalHealth = watchTemporal(connection, { failures: temporalFailures });
  const done = Promise.all(running.map((w) => w.run())).then(async () => {
    await temporalHealth.close();
    if (advertTimer) {
      clearInterval(advertTimer);
      await registry.withdrawRuntime(workerId).catch(() => undefined);
    }
    await runtime.stopAll();
    await workerConnection.close();
    await connection.close();
    await nc.drain();
    s3.destroy();
  });
  return {
    done,
    runtime,
    runtimeQueue,
    temporal: temporalHealth,
    cachedWorkflows: () => running.reduce((n, w) => n + w.getStatus().numCachedWorkflows, 0),
    async shutdown() {
      // The SDK stops its workers by itself on SIGINT/SIGTERM; only stop those still running.
      for (const w of running) if (w.getState() === 'RUNNING') w.shutdown();
      await done;
    },
  };
}

/**
 * Waits until Temporal answers (untilTemporalAnswers), then registers the search attributes and
 * opens the workers' connection; if Temporal goes away again in between, waits again. Only
 * "unreachable" waits: any other error is thrown (the start fails, as it always did).
 */
async function connectTemporal(
  cfg: MagusConfig,
  connection: Connection,
  opts: StartOptions,
  log: (line: string) => void,
): Promise<{ failures: number; native: NativeConnection }> {
  const { address, namespace } = cfg.temporal;
  const waiting = { since: 0, failures: 0 };
  const failed = (attempt: number, reason: string, retryInMs?: number) => {
    if (opts.waitForTemporal === false) throw new Error(`Temporal at ${address} is unreachable: ${reason}`);
    waiting.failures = attempt;
    if (attempt === 1) {
      waiting.since = Date.now();
      opts.onWaitingForTemporal?.(unreachableHealth(waiting));
    }
    const next = retryInMs === undefined ? 'trying again' : `next attempt in ${retryInMs / 1000} s`;
    log(`Temporal at ${address} is unreachable (attempt ${attempt}: ${reason}); ${next}${attempt === 1 ? ', the task queues are polled once it answers' : ''}`);
  };
  for (;;) {
    waiting.failures = await untilTemporalAnswers(address, { signal: opts.signal, failures: waiting.failures, onFailure: failed });
    try {
      await ensureSearchAttributes(connection, namespace);
      const native = await NativeConnection.connect({ address });
      if (waiting.failures > 0)
        log(
          `Temporal at ${address} answers, after ${waiting.failures} failed attempt${waiting.failures === 1 ? '' : 's'} in ${Math.round((Date.now() - waiting.since) / 1000)} s`,
        );
      return { failures: waiting.failures, native };
    } catch (err) {
      // Gone again between the answer and these calls: wait again.
      if (!isTemporalUnreachable(err) && !(err instanceof TransportError)) throw err;
      failed(waiting.failures + 1, (err as Error).message.split('\n')[0]!);
    }
  }
}

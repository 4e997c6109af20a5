/**
 * Process configuration from the environment, validated at start: a bad value fails fast with
 * a message naming the variable. Credentials (S3 keys) are read by the AWS SDK's default chain
 * (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, profiles, IRSA …) and never stored here or logged.
 */
import { accessSync, constants, readFileSync, statSync } from 'node:fs';
import { homedir } from 'node:os';
import { delimiter, isAbsolute, join, resolve } from 'node:path';
import { TaskQueue } from '../shared/constants';
import { parseMemory } from '../shared/kube';

export interface MagusConfig {
  temporal: { address: string; namespace: string };
  /** The control task queue; the pipeline queue is derived from it (shared/constants). */
  taskQueue: string;
  nats: { servers: string };
  s3: { endpoint: string | undefined; region: string; bucket: string; forcePathStyle: boolean };
  /** Prefix of every NATS stream, subject and bucket name ('' in production; tests isolate with it). */
  natsPrefix: string;
  /** `MAGUS_NATS_REPLICAS`: replicas of the data plane's streams and buckets (ensureDataPlane); unset: 1. */
  natsReplicas?: number;
  /** Where the local runtime caches GGUF files. */
  modelCacheDir: string;
  convertThreads: number | undefined;
  /** Multipart part size of source transfers (bytes, ≥ 5 MiB); default the transfer's own. */
  transferPartSize: number | undefined;
  /** Debugging aid: append one line per S3 write request (`<command> <key> <part>`) to this file. */
  s3TraceFile: string | undefined;
  /** distributed-llama topologies in the local runtime; unset: llama.cpp only. */
  dllama?: DllamaConfig | undefined;
  /** How `MAGUS_RESPONSES` is sized where this process declares the data plane (ensureDataPlane options); unset: its defaults. */
  responses?: ResponseStreamSizing;
  /** `MAGUS_RUNTIME=kubernetes`: instances are pods (activities/runtime/kubernetes.ts); unset: local processes. */
  kubernetes?: KubernetesRuntimeConfig;
  /**
   * `MAGUS_WORKER_QUEUES`: which task queues this worker polls: `control` (workflows, serving
   * activities, its own runtime queue), `pipeline` (downloads, conversions, sizing) or `all` (default).
   */
  queues?: 'all' | 'control' | 'pipeline';
  /**
   * `MAGUS_WORKFLOW_CACHE`: how many workflows the control queue's worker keeps cached (default
   * 256). Its workflows are mostly sessions asleep until their expiry, one per live conversation:
   * a cached one saves only a replay of its few events when it wakes, and costs heap in the
   * process that also serves requests. Pools run on their own queue with the SDK's default cache.
   */
  workflowCache?: number;
  /**
   * `MAGUS_INSTANCE_MEMORY` (bytes or a Kubernetes quantity, e.g. `8Gi`): the memory budget of one
   * llama.cpp instance, which decides its slots and so the leases per instance of pools no
   * `Dllama` sizes (shared/engine-slots.ts). Workers (runtimes) and gateways (pool starts) must
   * agree on it: set it for both. Unset: 8 GiB (shared/engine-slots.ts).
   */
  instanceMemory?: number;
}

/**
 * The Kubernetes runtime's settings: `MAGUS_K8S_MAGUS_IMAGE` and `MAGUS_K8S_DLLAMA_IMAGE`
 * (required: the images instance pods run), `MAGUS_K8S_NATS_URL` (NATS as instance
 * pods reach it; default MAGUS_NATS_URL), `MAGUS_K8S_S3_SECRET` (a Secret in each model namespace
 * with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for the pods' `magus fetch`),
 * `MAGUS_K8S_INSTANCE_SERVICE_ACCOUNT`, `MAGUS_K8S_NODES` (distributed-llama nodes of a pool
 * without a `Dllama`; default 1: llama.cpp), `MAGUS_K8S_UNSCHEDULABLE_AFTER_MS` (default 30000).
 */
export interface KubernetesRuntimeConfig {
  images: { magus: string; dllama: string };
  natsUrl: string;
  s3Secret?: string;
  serviceAccount?: string;
  defaultNodes: number;
  unschedulableAfterMs: number;
}

/**
 * `MAGUS_RESPONSES_PEAK_BYTES_PER_SEC` × `MAGUS_RESPONSES_RETENTION_MS` sizes the response stream
 * (dataplane/data-plane.ts `responseStreamLimits`). Every process that declares the data
 * plane (worker, controller, `magus bridge`) must be given the same values: each declaration
 * brings the stream to its own.
 */
export interface ResponseStreamSizing {
  responsePeakBytesPerSec?: number;
  responseRetentionMs?: number;
}

/**
 * `MAGUS_DLLAMA_API_BIN` + `MAGUS_DLLAMA_BIN` (both or neither): the local runtime serves models
 * that have a distributed-llama artifact with a root `dllama-api` and `nodes − 1` `dllama worker`
 * processes on loopback ports.
 */
export interface DllamaConfig {
  /** Absolute path of `dllama-api`. */
  apiBin: string;
  /** Absolute path of `dllama` (run as `dllama worker`). */
  workerBin: string;
  /** Nodes per topology, root included: a power of two (distributed-llama splits by 2^n). */
  nodes: number;
  /** `--nthreads` of every process of a topology. */
  threads: number;
}

/** Node counts a topology may have: 2^n up to the 16 that activities/size plans memory for. */
export const DLLAMA_NODES = [1, 2, 4, 8, 16] as const;

export class ConfigError extends Error {
  override readonly name = 'ConfigError';
}

const HOST_PORT = /^[A-Za-z0-9.-]+:\d{1,5}$/;
/** The control worker's workflow cache ({@link WorkerConfig.workflowCache}). */
export const DEFAULT_WORKFLOW_CACHE = 256;

export function loadConfig(env: NodeJS.ProcessEnv = process.env): MagusConfig {
  const problems: string[] = [];
  const get = (name: string, fallback?: string): string => {
    const v = env[name]?.trim();
    if (v) return v;
    if (fallback !== undefined) return fallback;
    problems.push(`${name} is required`);
    return '';
  };
  const temporalAddress = get('MAGUS_TEMPORAL_ADDRESS', '127.0.0.1:7233');
  if (!HOST_PORT.test(temporalAddress)) problems.push(`MAGUS_TEMPORAL_ADDRESS=${temporalAddress} is not host:port`);
  const natsServers = get('MAGUS_NATS_URL', 'nats://127.0.0.1:4222');
  if (!isNatsServerList(natsServers)) problems.push(`MAGUS_NATS_URL=${natsServers} is not a list of nats:// URLs`);
  const natsReplicas = natsReplicasFrom(env, problems);
  const endpoint = env.MAGUS_S3_ENDPOINT?.trim() || undefined;
  if (endpoint && !/^https?:\/\/[^\s/]+\/?$/.test(endpoint)) problems.push(`MAGUS_S3_ENDPOINT=${endpoint} is not an http(s) origin`);
  const bucket = get('MAGUS_S3_BUCKET', 'magus');
  if (!/^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$/.test(bucket)) problems.push(`MAGUS_S3_BUCKET=${bucket} is not a valid bucket name`);
  let convertThreads: number | undefined;
  if (env.MAGUS_CONVERT_THREADS) {
    convertThreads = Number(env.MAGUS_CONVERT_THREADS);
    if (!Number.isInteger(convertThreads) || convertThreads < 1 || convertThreads > 256) problems.push(`MAGUS_CONVERT_THREADS=${env.MAGUS_CONVERT_THREADS} must be 1..256`);
  }
  let transferPartSize: number | undefined;
  if (env.MAGUS_TRANSFER_PART_SIZE) {
    transferPartSize = Number(env.MAGUS_TRANSFER_PART_SIZE);
    if (!Number.isInteger(transferPartSize) || transferPartSize < 5 * 1024 * 1024 || transferPartSize > 5 * 1024 ** 3) {
      problems.push(`MAGUS_TRANSFER_PART_SIZE=${env.MAGUS_TRANSFER_PART_SIZE} must be a byte count from 5 MiB to 5 GiB`);
    }
  }
  if (env.MAGUS_NATS_PREFIX && !/^[A-Za-z0-9_-]+$/.test(env.MAGUS_NATS_PREFIX.trim())) problems.push(`MAGUS_NATS_PREFIX=${env.MAGUS_NATS_PREFIX} may hold only letters, digits, '_' and '-'`);
  const dllama = dllamaConfig(env, problems);
  const responses = responseStreamSizing(env, problems);
  const kubernetes = kubernetesRuntimeConfig(env, natsServers, problems);
  const queues = env.MAGUS_WORKER_QUEUES?.trim() || 'all';
  if (queues !== 'all' && queues !== 'control' && queues !== 'pipeline') problems.push(`MAGUS_WORKER_QUEUES=${queues} must be all, control or pipeline`);
  const workflowCache = Number(env.MAGUS_WORKFLOW_CACHE?.trim() || String(DEFAULT_WORKFLOW_CACHE));
  if (!Number.isInteger(workflowCache) || workflowCache < 2 || workflowCache > 100_000) problems.push(`MAGUS_WORKFLOW_CACHE=${env.MAGUS_WORKFLOW_CACHE} must be an integer from 2 to 100000`);
  const instanceMemory = env.MAGUS_INSTANCE_MEMORY?.trim() ? parseMemory(env.MAGUS_INSTANCE_MEMORY) : undefined;
  if (instanceMemory !== undefined && !(instanceMemory >= 2 ** 20)) problems.push(`MAGUS_INSTANCE_MEMORY=${env.MAGUS_INSTANCE_MEMORY} must be bytes or a quantity such as 8Gi, at least 1Mi`);
  if (problems.length > 0) throw new ConfigError(`invalid configuration:\n  ${problems.join('\n  ')}`);
  return {
    temporal: { address: temporalAddress, namespace: get('MAGUS_TEMPORAL_NAMESPACE', 'default') },
    taskQueue: get('MAGUS_TASK_QUEUE', TaskQueue.control),
    nats: { servers: natsServers },
    s3: { endpoint, region: get('MAGUS_S3_REGION', 'us-east-1'), bucket, forcePathStyle: endpoint !== undefined },
    natsPrefix: env.MAGUS_NATS_PREFIX?.trim() ?? '',
    ...(natsReplicas !== undefined ? { natsReplicas } : {}),
    modelCacheDir: get('MAGUS_MODEL_CACHE', join(homedir(), '.cache', 'magus', 'models')),
    convertThreads,
    transferPartSize,
    s3TraceFile: env.MAGUS_S3_TRACE_FILE?.trim() || undefined,
    dllama,
    responses,
    ...(kubernetes ? { kubernetes } : {}),
    ...(queues !== 'all' ? { queues: queues as 'control' | 'pipeline' } : {}),
    workflowCache,
    ...(instanceMemory !== undefined ? { instanceMemory } : {}),
  };
}

function kubernetesRuntimeConfig(env: NodeJS.ProcessEnv, natsServers: string, problems: string[]): KubernetesRuntimeConfig | undefined {
  const runtime = env.MAGUS_RUNTIME?.trim() || 'local';
  if (runtime !== 'local' && runtime !== 'kubernetes') problems.push(`MAGUS_RUNTIME=${runtime} must be local or kubernetes`);
  if (runtime !== 'kubernetes') {
    const stray = Object.keys(env).filter((k) => k.startsWith('MAGUS_K8S_') && env[k]?.trim());
    if (stray.length > 0) problems.push(`${stray.join(', ')} set, but MAGUS_RUNTIME is not kubernetes`);
    return undefined;
  }
  const nodes = Number(env.MAGUS_K8S_NODES?.trim() || '1');
  if (!(DLLAMA_NODES as readonly number[]).includes(nodes)) problems.push(`MAGUS_K8S_NODES=${env.MAGUS_K8S_NODES} must be one of ${DLLAMA_NODES.join(', ')}`);
  const after = Number(env.MAGUS_K8S_UNSCHEDULABLE_AFTER_MS?.trim() || '30000');
  if (!Number.isInteger(after) || after < 1000) problems.push(`MAGUS_K8S_UNSCHEDULABLE_AFTER_MS=${env.MAGUS_K8S_UNSCHEDULABLE_AFTER_MS} must be an integer ≥ 1000`);
  for (const name of ['MAGUS_K8S_MAGUS_IMAGE', 'MAGUS_K8S_DLLAMA_IMAGE']) if (!env[name]?.trim()) problems.push(`${name} is required with MAGUS_RUNTIME=kubernetes (the image instance pods run)`);
  const natsUrl = env.MAGUS_K8S_NATS_URL?.trim() || natsServers;
  if (!/^(nats|tls):\/\/[^\s/]+(,(nats|tls):\/\/[^\s/]+)*$/.test(natsUrl)) problems.push(`MAGUS_K8S_NATS_URL=${natsUrl} is not a nats:// URL`);
  return {
    images: { magus: env.MAGUS_K8S_MAGUS_IMAGE?.trim() ?? '', dllama: env.MAGUS_K8S_DLLAMA_IMAGE?.trim() ?? '' },
    natsUrl,
    ...(env.MAGUS_K8S_S3_SECRET?.trim() ? { s3Secret: env.MAGUS_K8S_S3_SECRET.trim() } : {}),
    ...(env.MAGUS_K8S_INSTANCE_SERVICE_ACCOUNT?.trim() ? { serviceAccount: env.MAGUS_K8S_INSTANCE_SERVICE_ACCOUNT.trim() } : {}),
    defaultNodes: nodes,
    unschedulableAfterMs: after,
  };
}

/** {@link ResponseStreamSizing} from the environment; a bad value is added to `problems`. */
/**
 * The variables with which this process declares the data plane (replicas, response stream
 * size), for a process it starts that declares it too — a `magus bridge` sidecar in an instance
 * pod: declared with other values, the streams would be brought back and forth between the two.
 */
export function dataPlaneEnv(cfg: Pick<MagusConfig, 'natsReplicas' | 'responses'>): Record<string, string> {
  const env: Record<string, string> = {};
  if (cfg.natsReplicas !== undefined) env.MAGUS_NATS_REPLICAS = String(cfg.natsReplicas);
  if (cfg.responses?.responsePeakBytesPerSec !== undefined) env.MAGUS_RESPONSES_PEAK_BYTES_PER_SEC = String(cfg.responses.responsePeakBytesPerSec);
  if (cfg.responses?.responseRetentionMs !== undefined) env.MAGUS_RESPONSES_RETENTION_MS = String(cfg.responses.responseRetentionMs);
  return env;
}

/**
 * The servers of a comma-separated list of NATS URLs (`MAGUS_NATS_URL`, `--nats`): every server
 * of a cluster, so a process reaches the cluster while any of them is up (nats.js also learns
 * the others from the one it reaches, but only once it reached one).
 */
export function natsServerList(value: string): string[] {
  return value
    .split(',')
    .map((u) => u.trim())
    .filter((u) => u !== '');
}

/** Whether `value` is a comma-separated list of `nats://` or `tls://` URLs. */
export function isNatsServerList(value: string): boolean {
  const list = natsServerList(value);
  return list.length > 0 && list.every((u) => /^(nats|tls):\/\/[^\s/,]+$/.test(u));
}

/**
 * `MAGUS_NATS_REPLICAS`: replicas of the data plane's streams and buckets (1–5; unset: 1). Every
 * process that declares the data plane (worker, controller, `magus bridge`) must be given the
 * same value: each declaration brings the streams to its own.
 */
export function natsReplicasFrom(env: NodeJS.ProcessEnv, problems: string[]): number | undefined {
  const raw = env.MAGUS_NATS_REPLICAS?.trim();
  if (!raw) return undefined;
  const n = Number(raw);
  if (!Number.isInteger(n) || n < 1 || n > 5) {
    problems.push(`MAGUS_NATS_REPLICAS=${raw} must be an integer from 1 to 5 (3 on a cluster of three servers)`);
    return undefined;
  }
  return n;
}

export function responseStreamSizing(env: NodeJS.ProcessEnv, problems: string[]): ResponseStreamSizing {
  const sizing: ResponseStreamSizing = {};
  const read = (name: string, key: keyof ResponseStreamSizing, min: number, max: number, what: string) => {
    const raw = env[name]?.trim();
    if (!raw) return;
    const n = Number(raw);
    if (!Number.isInteger(n) || n < min || n > max) problems.push(`${name}=${raw} must be ${what}`);
    else sizing[key] = n;
  };
  read('MAGUS_RESPONSES_PEAK_BYTES_PER_SEC', 'responsePeakBytesPerSec', 1024, 2 ** 30, 'a byte rate from 1024 to 1073741824 (peak response frames per second, all gateways)');
  read('MAGUS_RESPONSES_RETENTION_MS', 'responseRetentionMs', 10_000, 24 * 3_600_000, 'milliseconds from 10000 to 86400000 (the longest a request may run)');
  return sizing;
}

/** An executable file: a path (relative to the working directory) or a bare name looked up in PATH. */
function executable(name: string, value: string, env: NodeJS.ProcessEnv, problems: string[]): string {
  const isExecutableFile = (p: string): boolean => {
    try {
      accessSync(p, constants.X_OK);
      return statSync(p).isFile();
    } catch {
      return false;
    }
  };
  if (value.includes('/')) {
    const path = isAbsolute(value) ? value : resolve(value);
    if (!isExecutableFile(path)) problems.push(`${name}=${value} is not an executable file`);
    return path;
  }
  const found = (env.PATH ?? '').split(delimiter).filter(Boolean).map((dir) => join(dir, value)).find(isExecutableFile);
  if (!found) problems.push(`${name}=${value} is not an executable file in PATH`);
  return found ?? value;
}

function dllamaConfig(env: NodeJS.ProcessEnv, problems: string[]): DllamaConfig | undefined {
  const apiBin = env.MAGUS_DLLAMA_API_BIN?.trim();
  const workerBin = env.MAGUS_DLLAMA_BIN?.trim();
  const nodesText = env.MAGUS_DLLAMA_NODES?.trim();
  const threadsText = env.MAGUS_DLLAMA_THREADS?.trim();
  if (!apiBin && !workerBin) {
    const stray = [nodesText && 'MAGUS_DLLAMA_NODES', threadsText && 'MAGUS_DLLAMA_THREADS'].filter(Boolean);
    if (stray.length > 0) problems.push(`${stray.join(' and ')} ${stray.length > 1 ? 'are' : 'is'} set, but distributed-llama is off: set MAGUS_DLLAMA_API_BIN and MAGUS_DLLAMA_BIN`);
    return undefined;
  }
  if (!apiBin || !workerBin) {
    problems.push(`distributed-llama needs both MAGUS_DLLAMA_API_BIN (dllama-api) and MAGUS_DLLAMA_BIN (dllama); only ${apiBin ? 'MAGUS_DLLAMA_API_BIN' : 'MAGUS_DLLAMA_BIN'} is set`);
    return undefined;
  }
  const nodes = Number(nodesText ?? '2');
  if (!(DLLAMA_NODES as readonly number[]).includes(nodes)) {
    problems.push(`MAGUS_DLLAMA_NODES=${nodesText} must be a power of two from 1 to 16 (the root plus 2^n − 1 workers): one of ${DLLAMA_NODES.join(', ')}`);
  }
  const threads = Number(threadsText ?? '1');
  if (!Number.isInteger(threads) || threads < 1 || threads > 256) problems.push(`MAGUS_DLLAMA_THREADS=${threadsText} must be 1..256`);
  return {
    apiBin: executable('MAGUS_DLLAMA_API_BIN', apiBin, env, problems),
    workerBin: executable('MAGUS_DLLAMA_BIN', workerBin, env, problems),
    nodes,
    threads,
  };
}

/**
 * Where `magus dev` keeps its state (Temporal's database, the JetStream store, MinIO's data, the
 * API token, the connection settings): `MAGUS_DEV_DATA_DIR`, else `$XDG_DATA_HOME/magus/dev`,
 * else `~/.local/share/magus/dev`. `magus dev --data-dir` overrides it for that dev; other
 * commands find that one through `MAGUS_DEV_DATA_DIR`.
 */
export function devDataDir(env: NodeJS.ProcessEnv = process.env): string {
  const explicit = env.MAGUS_DEV_DATA_DIR?.trim();
  if (explicit) return resolve(explicit);
  const xdg = env.XDG_DATA_HOME?.trim();
  return join(xdg && isAbsolute(xdg) ? xdg : join(homedir(), '.local', 'share'), 'magus', 'dev');
}

/** The file in a dev data folder with the running `magus dev`'s connection settings. */
export const DEV_CONNECTION_FILE = 'connection.json';

/**
 * What a running `magus dev` writes to `<data dir>/connection.json` (mode 0600: it holds the S3
 * keys) for every other `magus` command, and removes when it stops.
 */
export interface DevConnection {
  /** The `magus dev` process; the file counts only while it runs. */
  pid: number;
  dataDir: string;
  temporal: { address: string; namespace: string; uiUrl: string };
  taskQueue: string;
  nats: { servers: string };
  s3: { endpoint: string; region: string; bucket: string; accessKeyId: string; secretAccessKey: string };
  gateway: { url: string; tokenFile: string };
  /** The bundled Hugging Face-compatible hub and the repos it serves (the demo model). */
  hub?: { url: string; repos: string[] };
  kubeconfig?: string;
}

const running = (pid: number): boolean => {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
};

/**
 * The connection settings of the `magus dev` whose data folder is {@link devDataDir}: `connection`
 * while that dev runs; `stalePid` when the file is left from one that is gone (killed); neither
 * when there is no file.
 */
export function readDevConnection(env: NodeJS.ProcessEnv = process.env): { file: string; connection?: DevConnection; stalePid?: number } {
  const file = join(devDataDir(env), DEV_CONNECTION_FILE);
  let connection: DevConnection;
  try {
    connection = JSON.parse(readFileSync(file, 'utf8')) as DevConnection;
  } catch {
    return { file };
  }
  if (!Number.isInteger(connection.pid) || !running(connection.pid)) return { file, stalePid: connection.pid };
  return { file, connection };
}

/** What {@link useDevConnection} took from a running `magus dev`. */
export interface DevConnectionUse {
  file: string;
  connection: DevConnection;
  /** The variables it set (never their values: some are secrets). */
  taken: string[];
}

/**
 * Fills in, from a running `magus dev`'s connection file, the settings `env` leaves unset, so
 * `magus model pull`, `worker`, `gateway` … find that dev without flags. Each server comes as a
 * whole or not at all: Temporal when `MAGUS_TEMPORAL_ADDRESS` is unset, NATS when `MAGUS_NATS_URL`
 * is, S3 (endpoint, bucket, region, and the keys unless `AWS_ACCESS_KEY_ID` is set) when
 * `MAGUS_S3_ENDPOINT` is. Undefined when no dev runs there.
 */
export function useDevConnection(env: NodeJS.ProcessEnv = process.env): DevConnectionUse | undefined {
  const { file, connection: c } = readDevConnection(env);
  if (!c) return undefined;
  const taken: string[] = [];
  const set = (name: string, value: string) => {
    env[name] = value;
    taken.push(name);
  };
  const unset = (name: string) => !env[name]?.trim();
  if (unset('MAGUS_TEMPORAL_ADDRESS')) {
    set('MAGUS_TEMPORAL_ADDRESS', c.temporal.address);
    if (unset('MAGUS_TEMPORAL_NAMESPACE')) set('MAGUS_TEMPORAL_NAMESPACE', c.temporal.namespace);
    if (unset('MAGUS_TASK_QUEUE')) set('MAGUS_TASK_QUEUE', c.taskQueue);
  }
  if (unset('MAGUS_NATS_URL')) set('MAGUS_NATS_URL', c.nats.servers);
  if (unset('MAGUS_S3_ENDPOINT')) {
    set('MAGUS_S3_ENDPOINT', c.s3.endpoint);
    if (unset('MAGUS_S3_BUCKET')) set('MAGUS_S3_BUCKET', c.s3.bucket);
    if (unset('MAGUS_S3_REGION')) set('MAGUS_S3_REGION', c.s3.region);
    if (unset('AWS_ACCESS_KEY_ID')) {
      set('AWS_ACCESS_KEY_ID', c.s3.accessKeyId);
      set('AWS_SECRET_ACCESS_KEY', c.s3.secretAccessKey);
    }
  }
  return { file, connection: c, taken };
}

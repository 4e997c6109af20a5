/**
 * Process configuration from the environment, validated at start: a bad value fails fast with
 * a message naming the variable. The settings every process reads alike (Temporal, NATS, the
 * data plane's sizing, the instance memory) are read by platform/config.ts; the variables of the
 * runtime `MAGUS_RUNTIME` selects by that runtime's entry in activities/runtime/index.ts, into the
 * same error. Credentials (S3 keys) are read by the AWS SDK's default chain (AWS_ACCESS_KEY_ID /
 * AWS_SECRET_ACCESS_KEY, profiles, IRSA …) and never stored here or logged.
 */
import { natsAuthOptions, natsCredentialsFrom, readNatsCredentials, type NatsRole } from '../dataplane/roles';
import { readFileSync } from 'node:fs';
import { homedir } from 'node:os';
import { isAbsolute, join, resolve } from 'node:path';
import {
  checkNatsServerList,
  ConfigError,
  instanceMemoryFrom,
  natsReplicasFrom,
  responseStreamSizing,
  temporalSettings,
  type ResponseStreamSizing,
} from '../platform/config';
import { DEFAULT_RUNTIME, RUNTIMES, runtimeConfigFrom, type RuntimeConfig } from '../activities/runtime';
import { ALLOW_NETWORKS_ENV, parseAllowedNetworks } from '../activities/huggingface/addresses';

export interface MagusConfig {
  temporal: { address: string; namespace: string };
  /** The control task queue; the pipeline queue is derived from it (shared/constants). */
  taskQueue: string;
  /** `servers`, and `credentials`: `MAGUS_NATS_CREDENTIALS`, the file of its NATS user (dataplane/roles.ts). */
  nats: { servers: string; credentials?: string };
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
  /** How `MAGUS_RESPONSES` is sized where this process declares the data plane (ensureDataPlane options); unset: its defaults. */
  responses?: ResponseStreamSizing;
  /**
   * `MAGUS_RUNTIME` and the variables of the runtime it selects, read by that runtime's entry in
   * activities/runtime/index.ts and handed back to it by the worker (`configuredRuntime`); unset
   * (a configuration built in code): the default runtime, `local`, without distributed-llama.
   */
  runtime?: RuntimeConfig;
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
   * `MAGUS_HUB_ALLOW_NETWORKS`: networks a Model's hub (and its redirects) may be at although they
   * are loopback, private, link-local, metadata, shared, unspecified or reserved addresses:
   * comma-separated CIDRs (a bare address is one host) and kind keywords (`loopback`, `private` …;
   * activities/huggingface/addresses.ts). Unset: none, every such address is refused.
   */
  hubAllowNetworks?: string[];
  /** `MAGUS_INSTANCE_MEMORY`: the memory budget of one llama.cpp instance (platform/config.ts `instanceMemoryFrom`); unset: 8 GiB. */
  instanceMemory?: number;
}

/** The control worker's workflow cache ({@link MagusConfig.workflowCache}). */
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
  const temporal = temporalSettings(env, problems);
  const natsServers = get('MAGUS_NATS_URL', 'nats://127.0.0.1:4222');
  checkNatsServerList('MAGUS_NATS_URL', natsServers, problems);
  const natsCredentials = natsCredentialsFrom(env, problems);
  const natsReplicas = natsReplicasFrom(env, problems);
  const endpoint = env.MAGUS_S3_ENDPOINT?.trim() || undefined;
  if (endpoint && !/^https?:\/\/[^\s/]+\/?$/.test(endpoint)) problems.push(`MAGUS_S3_ENDPOINT=${endpoint} is not an http(s) origin`);
  const bucket = get('MAGUS_S3_BUCKET', 'magus');
  if (!/^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$/.test(bucket)) problems.push(`MAGUS_S3_BUCKET=${bucket} is not a valid bucket name`);
  let convertThreads: number | undefined;
  if (env.MAGUS_CONVERT_THREADS) {
    convertThreads = Number(env.MAGUS_CONVERT_THREADS);
    if (!Number.isInteger(convertThreads) || convertThreads < 1 || convertThreads > 256)
      problems.push(`MAGUS_CONVERT_THREADS=${env.MAGUS_CONVERT_THREADS} must be 1..256`);
  }
  let transferPartSize: number | undefined;
  if (env.MAGUS_TRANSFER_PART_SIZE) {
    transferPartSize = Number(env.MAGUS_TRANSFER_PART_SIZE);
    if (!Number.isInteger(transferPartSize) || transferPartSize < 5 * 1024 * 1024 || transferPartSize > 5 * 1024 ** 3) {
      problems.push(`MAGUS_TRANSFER_PART_SIZE=${env.MAGUS_TRANSFER_PART_SIZE} must be a byte count from 5 MiB to 5 GiB`);
    }
  }
  if (env.MAGUS_NATS_PREFIX && !/^[A-Za-z0-9_-]+$/.test(env.MAGUS_NATS_PREFIX.trim()))
    problems.push(`MAGUS_NATS_PREFIX=${env.MAGUS_NATS_PREFIX} may hold only letters, digits, '_' and '-'`);
  const responses = responseStreamSizing(env, problems);
  const queues = env.MAGUS_WORKER_QUEUES?.trim() || 'all';
  if (queues !== 'all' && queues !== 'control' && queues !== 'pipeline') problems.push(`MAGUS_WORKER_QUEUES=${queues} must be all, control or pipeline`);
  const workflowCache = Number(env.MAGUS_WORKFLOW_CACHE?.trim() || String(DEFAULT_WORKFLOW_CACHE));
  if (!Number.isInteger(workflowCache) || workflowCache < 2 || workflowCache > 100_000)
    problems.push(`MAGUS_WORKFLOW_CACHE=${env.MAGUS_WORKFLOW_CACHE} must be an integer from 2 to 100000`);
  const instanceMemory = instanceMemoryFrom(env, problems);
  const hubNetworks = parseAllowedNetworks(env[ALLOW_NETWORKS_ENV]?.split(',') ?? []);
  for (const problem of hubNetworks.problems) problems.push(`${ALLOW_NETWORKS_ENV}: ${problem}`);
  const s3 = { endpoint, region: get('MAGUS_S3_REGION', 'us-east-1'), bucket, forcePathStyle: endpoint !== undefined };
  const modelCacheDir = get('MAGUS_MODEL_CACHE', join(homedir(), '.cache', 'magus', 'models'));
  // The runtime's own variables are its registry entry's to read (activities/runtime/index.ts).
  const runtimeKind = env.MAGUS_RUNTIME?.trim() || DEFAULT_RUNTIME;
  const kinds = RUNTIMES.map((e) => e.kind);
  if (!kinds.includes(runtimeKind))
    problems.push(`MAGUS_RUNTIME=${runtimeKind} must be ${kinds.length > 1 ? `${kinds.slice(0, -1).join(', ')} or ${kinds.at(-1)}` : kinds.join('')}`);
  const runtime = runtimeConfigFrom(runtimeKind, env, problems, { nats: { servers: natsServers }, s3, modelCacheDir, instanceMemory });
  if (problems.length > 0) throw new ConfigError(`invalid configuration:\n  ${problems.join('\n  ')}`);
  return {
    temporal: { address: temporal.address, namespace: temporal.namespace },
    taskQueue: temporal.taskQueue,
    nats: { servers: natsServers, ...(natsCredentials ? { credentials: natsCredentials } : {}) },
    s3,
    natsPrefix: env.MAGUS_NATS_PREFIX?.trim() ?? '',
    ...(natsReplicas !== undefined ? { natsReplicas } : {}),
    modelCacheDir,
    convertThreads,
    transferPartSize,
    s3TraceFile: env.MAGUS_S3_TRACE_FILE?.trim() || undefined,
    responses,
    ...(runtime ? { runtime } : {}),
    ...(queues !== 'all' ? { queues: queues as 'control' | 'pipeline' } : {}),
    workflowCache,
    ...(instanceMemory !== undefined ? { instanceMemory } : {}),
    ...(hubNetworks.allowed.entries.length > 0 ? { hubAllowNetworks: [...hubNetworks.allowed.entries] } : {}),
  };
}

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
 * Where `magus dev` keeps its state (Temporal's database, the JetStream store, the S3 data, the
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
  /** `credentialsDir`: its NATS users' credentials files, one per role (`<role>.creds`). */
  nats: { servers: string; credentialsDir?: string };
  s3: { endpoint: string; region: string; bucket: string; accessKeyId: string; secretAccessKey: string };
  gateway: { url: string; tokenFile: string };
  /** The bundled Hugging Face-compatible hub, its CDN's origin, and the repos it serves (the demo model). */
  hub?: { url: string; cdnUrl?: string; repos: string[] };
  kubeconfig?: string;
}

/** nats.js options to connect to a running dev's NATS as `role` (its users' folder); none when it has no users. */
export function devNatsAuth(c: Pick<DevConnection, 'nats'>, role: NatsRole = 'worker'): ReturnType<typeof natsAuthOptions> {
  return c.nats.credentialsDir ? natsAuthOptions(readNatsCredentials(join(c.nats.credentialsDir, `${role}.creds`))) : {};
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
 * `MAGUS_S3_ENDPOINT` is. A worker beside it may fetch from its demo hub: `MAGUS_HUB_ALLOW_NETWORKS`,
 * when unset, becomes that hub's and its CDN's (loopback) addresses. Undefined when no dev runs there.
 */
export function useDevConnection(env: NodeJS.ProcessEnv = process.env, role: NatsRole = 'worker'): DevConnectionUse | undefined {
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
  if (unset('MAGUS_NATS_URL')) {
    set('MAGUS_NATS_URL', c.nats.servers);
    // Its NATS has a user per role: this command connects as `role`.
    if (c.nats.credentialsDir && unset('MAGUS_NATS_CREDENTIALS')) set('MAGUS_NATS_CREDENTIALS', join(c.nats.credentialsDir, `${role}.creds`));
  }
  if (unset('MAGUS_S3_ENDPOINT')) {
    set('MAGUS_S3_ENDPOINT', c.s3.endpoint);
    if (unset('MAGUS_S3_BUCKET')) set('MAGUS_S3_BUCKET', c.s3.bucket);
    if (unset('MAGUS_S3_REGION')) set('MAGUS_S3_REGION', c.s3.region);
    if (unset('AWS_ACCESS_KEY_ID')) {
      set('AWS_ACCESS_KEY_ID', c.s3.accessKeyId);
      set('AWS_SECRET_ACCESS_KEY', c.s3.secretAccessKey);
    }
  }
  if (unset(ALLOW_NETWORKS_ENV) && c.hub) {
    const hosts = [c.hub.url, ...(c.hub.cdnUrl ? [c.hub.cdnUrl] : [])].map((u) => new URL(u).hostname.replace(/^\[(.*)\]$/, '$1'));
    set(ALLOW_NETWORKS_ENV, hosts.join(','));
  }
  return { file, connection: c, taken };
}

/**
 * Process configuration from the environment, validated at start: a bad value fails fast with
 * a message naming the variable. Credentials (S3 keys) are read by the AWS SDK's default chain
 * (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, profiles, IRSA …) and never stored here or logged.
 */
import { accessSync, constants, statSync } from 'node:fs';
import { homedir } from 'node:os';
import { delimiter, isAbsolute, join, resolve } from 'node:path';
import { TaskQueue } from '../shared/constants';

export interface MagusConfig {
  temporal: { address: string; namespace: string };
  /** The control task queue; the pipeline queue is derived from it (shared/constants). */
  taskQueue: string;
  nats: { servers: string };
  s3: { endpoint: string | undefined; region: string; bucket: string; forcePathStyle: boolean };
  /** Prefix of every NATS stream, subject and bucket name ('' in production; tests isolate with it). */
  natsPrefix: string;
  /** Where the local runtime caches GGUF files. */
  modelCacheDir: string;
  convertThreads: number | undefined;
  /** Multipart part size of source transfers (bytes, ≥ 5 MiB); default the transfer's own. */
  transferPartSize: number | undefined;
  /** Debugging aid: append one line per S3 write request (`<command> <key> <part>`) to this file. */
  s3TraceFile: string | undefined;
  /** distributed-llama topologies in the local runtime; unset: llama.cpp only. */
  dllama?: DllamaConfig | undefined;
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
  if (!natsServers.split(',').every((u) => /^(nats|tls):\/\/[^\s/]+$/.test(u.trim()))) problems.push(`MAGUS_NATS_URL=${natsServers} is not a list of nats:// URLs`);
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
  if (problems.length > 0) throw new ConfigError(`invalid configuration:\n  ${problems.join('\n  ')}`);
  return {
    temporal: { address: temporalAddress, namespace: get('MAGUS_TEMPORAL_NAMESPACE', 'default') },
    taskQueue: get('MAGUS_TASK_QUEUE', TaskQueue.control),
    nats: { servers: natsServers },
    s3: { endpoint, region: get('MAGUS_S3_REGION', 'us-east-1'), bucket, forcePathStyle: endpoint !== undefined },
    natsPrefix: env.MAGUS_NATS_PREFIX?.trim() ?? '',
    modelCacheDir: get('MAGUS_MODEL_CACHE', join(homedir(), '.cache', 'magus', 'models')),
    convertThreads,
    transferPartSize,
    s3TraceFile: env.MAGUS_S3_TRACE_FILE?.trim() || undefined,
    dllama,
  };
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

/**
 * Process configuration from the environment, validated at start: a bad value fails fast with
 * a message naming the variable. Credentials (S3 keys) are read by the AWS SDK's default chain
 * (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, profiles, IRSA …) and never stored here or logged.
 */
import { homedir } from 'node:os';
import { join } from 'node:path';
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
}

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
  };
}

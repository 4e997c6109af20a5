/**
 * Configuration primitives every process reads the same way: the NATS server list, the data
 * plane's declaration settings (replicas, response stream size), the Temporal settings and the
 * instance memory budget. Each reads its variables from an environment and adds a message naming
 * the variable to the caller's `problems`, so a process reports all its bad values in one error.
 */
import { TaskQueue } from '../shared/constants';
import { parseMemory } from '../shared/kube';

/** A bad configuration value; its message names every bad variable. */
export class ConfigError extends Error {
  override readonly name = 'ConfigError';
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
function isNatsServerList(value: string): boolean {
  const list = natsServerList(value);
  return list.length > 0 && list.every((u) => /^(nats|tls):\/\/[^\s/,]+$/.test(u));
}

/**
 * Adds to `problems` that `value` is not a NATS server list ({@link isNatsServerList}), naming
 * where it came from: a variable (`MAGUS_NATS_URL=…`) or a flag (`--nats …`).
 */
export function checkNatsServerList(name: string, value: string, problems: string[]): void {
  if (!isNatsServerList(value)) problems.push(`${name}${name.startsWith('--') ? ' ' : '='}${value} is not a list of nats:// URLs`);
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

/**
 * `MAGUS_RESPONSES_PEAK_BYTES_PER_SEC` × `MAGUS_RESPONSES_RETENTION_MS` sizes the response stream
 * (dataplane/declare.ts `responseStreamLimits`). Every process that declares the data
 * plane (worker, controller, `magus bridge`) must be given the same values: each declaration
 * brings the stream to its own.
 */
export interface ResponseStreamSizing {
  responsePeakBytesPerSec?: number;
  responseRetentionMs?: number;
}

/** {@link ResponseStreamSizing} from the environment; a bad value is added to `problems`. */
export function responseStreamSizing(env: NodeJS.ProcessEnv, problems: string[]): ResponseStreamSizing {
  const sizing: ResponseStreamSizing = {};
  const read = (name: string, key: keyof ResponseStreamSizing, min: number, max: number, what: string) => {
    const raw = env[name]?.trim();
    if (!raw) return;
    const n = Number(raw);
    if (!Number.isInteger(n) || n < min || n > max) problems.push(`${name}=${raw} must be ${what}`);
    else sizing[key] = n;
  };
  read(
    'MAGUS_RESPONSES_PEAK_BYTES_PER_SEC',
    'responsePeakBytesPerSec',
    1024,
    2 ** 30,
    'a byte rate from 1024 to 1073741824 (peak response frames per second, all gateways)',
  );
  read('MAGUS_RESPONSES_RETENTION_MS', 'responseRetentionMs', 10_000, 24 * 3_600_000, 'milliseconds from 10000 to 86400000 (the longest a request may run)');
  return sizing;
}

/** Where Temporal is and which control task queue this deployment's workflows run on. */
export interface TemporalSettings {
  /** `MAGUS_TEMPORAL_ADDRESS`, host:port (default 127.0.0.1:7233). */
  address: string;
  /** `MAGUS_TEMPORAL_NAMESPACE` (default `default`). */
  namespace: string;
  /** `MAGUS_TASK_QUEUE`: the control task queue; the pipeline queue is derived from it (shared/constants). */
  taskQueue: string;
}

const HOST_PORT = /^[A-Za-z0-9.-]+:\d{1,5}$/;

/** {@link TemporalSettings} from the environment; an address that is not host:port is added to `problems`. */
export function temporalSettings(env: NodeJS.ProcessEnv, problems: string[]): TemporalSettings {
  const address = env.MAGUS_TEMPORAL_ADDRESS?.trim() || '127.0.0.1:7233';
  if (!HOST_PORT.test(address)) problems.push(`MAGUS_TEMPORAL_ADDRESS=${address} is not host:port`);
  return {
    address,
    namespace: env.MAGUS_TEMPORAL_NAMESPACE?.trim() || 'default',
    taskQueue: env.MAGUS_TASK_QUEUE?.trim() || TaskQueue.control,
  };
}

/**
 * `MAGUS_INSTANCE_MEMORY` (bytes or a Kubernetes quantity, e.g. `8Gi`, at least 1 MiB): the memory
 * budget of one llama.cpp instance, which decides its slots and so the leases per instance of
 * pools no `Dllama` sizes (shared/engine-slots.ts). Workers (runtimes) and gateways (pool starts)
 * must agree on it: set it for both. Unset (undefined): 8 GiB (shared/engine-slots.ts); a bad
 * value is added to `problems`.
 */
export function instanceMemoryFrom(env: NodeJS.ProcessEnv, problems: string[]): number | undefined {
  const raw = env.MAGUS_INSTANCE_MEMORY;
  if (!raw?.trim()) return undefined;
  const bytes = parseMemory(raw);
  if (!(bytes >= 2 ** 20)) {
    problems.push(`MAGUS_INSTANCE_MEMORY=${raw} must be bytes or a quantity such as 8Gi, at least 1Mi`);
    return undefined;
  }
  return bytes;
}

/**
 * `magus gateway` configuration from the environment (and `--host`, `--port`, `--health-address`,
 * `--openapi`), validated at start
 * against one table of variables: a bad value fails fast with a message naming the variable.
 * Secrets (the HMAC key, token digests) are read here but never printed.
 */
import { natsCredentialsFrom } from '../dataplane/roles';
import { dataPlaneNames, DEFAULT_RESPONSES_MAX_AGE_MS, REPLICA_ID } from '../dataplane';
import { readFileSync } from 'node:fs';
import { checkNatsServerList, instanceMemoryFrom, natsReplicasFrom, temporalSettings, type TemporalSettings } from '../platform/config';
import { staticTokenSource } from './plugins/auth';
import { newReplicaId } from './serving/exchange';
import { MAX_PENDING_SESSION_STARTS } from './serving/sessions';
import { DEFAULT_RESUME_HOLD_MS } from './serving/resume';
import { OPENAPI_ACCESS, type GatewaySettings } from './plugins/services';

/** Conversations' entries a gateway holds (`MAGUS_GATEWAY_SESSION_CACHE`): ~0.4 KB each, so ~20 MB. */
export const DEFAULT_SESSION_CACHE_ENTRIES = 50_000;

/** `MAGUS_GATEWAY_NATS_GRACE_MS`' default: a NATS restart or reconnect degrades a replica, never takes it out of its Service, for this long. */
export const DEFAULT_NATS_GRACE_MS = 30_000;

export interface GatewayConfig {
  host: string;
  port: number;
  /**
   * `MAGUS_GATEWAY_HEALTH_ADDRESS` (`--health-address`): the operations listener, which serves
   * `/healthz`, `/readyz` and `/metrics`; `/metrics` then leaves the API port. Unset: all three
   * on the API port (local use: `magus dev`, one machine).
   */
  healthAddress?: ListenAddress;
  natsServers: string;
  /** `MAGUS_NATS_CREDENTIALS`: the file of its NATS user (dataplane/roles.ts); unset, none. */
  natsCredentials?: string;
  /** Where first turns start session workflows and tell pools of demand: `MAGUS_TEMPORAL_ADDRESS`, `_NAMESPACE`, `MAGUS_TASK_QUEUE`, as for the worker. */
  temporal: TemporalSettings;
  /** `MAGUS_INSTANCE_MEMORY`: sizes the leases per instance of the pools it starts; must be the workers' (platform/config.ts). Unset: 8 GiB. */
  instanceMemory?: number;
  /** Prepended to response subjects (`<scope>.magus.res.<replica>.<id>`) of a scoped data plane; '' = none. */
  subjectScope: string;
  /** This process's token in its response subjects (`magus.res.<replica>.<id>`): it receives only its own frames. */
  replicaId: string;
  buckets: { models: string; tokens: string; sessions: string; pools: string; responses: string; limits: string; usage: string; claims: string };
  /** A limited key's reservation lapses (charged in full) this long after its gateway stopped renewing it. */
  limitLeaseMs: number;
  /** The stream that stores response frames (`MAGUS_RESPONSES`): read back after a reconnect. */
  responseStream: string;
  /** The stream of requests (`MAGUS_REQUESTS`), whose instance consumers show whether a bridge is consuming. */
  requestStream: string;
  settings: GatewaySettings;
  /** Local-mode tokens (token file and/or env value), validated: `{ "<id>": {digest, name, models?} }`. */
  staticTokens: { origin: string; entries: Record<string, unknown> }[];
  http: {
    /** Socket idle timeout (fastify `connectionTimeout`); 0 = none. */
    connectionTimeoutMs: number;
    /** Time to receive a whole request (Node `requestTimeout`); not the response. */
    requestTimeoutMs: number;
    keepAliveTimeoutMs: number;
    headersTimeoutMs: number;
  };
  /** How long a graceful close waits for in-flight requests (streams) before cutting them. */
  shutdownGraceMs: number;
  logLevel: 'fatal' | 'error' | 'warn' | 'info' | 'debug' | 'trace' | 'silent';
  /** `shared`: one `magus.res.<replica>.*` subscription per process; `per-request`: one per request. */
  responseRouting: 'shared' | 'per-request';
  /** `MAGUS_SESSION_TTL_MS`: a conversation keeps its session (its instance, its `magus_sessions` entry) this long after its last turn. */
  sessionTtlMs: number;
  /** `MAGUS_RESPONSES_TTL`: how long a stored response (the max age of `magus_responses`) is kept after it was created. */
  responsesTtlMs: number;
  /** `MAGUS_MAX_QUEUE_WAIT`: the longest a turn may be expected to wait in an instance's queue (0: no bound). */
  maxQueueWaitMs: number;
  /** `MAGUS_NATS_REPLICAS`: replicas of the bucket the gateway declares (`magus_responses`), as the other processes' of theirs. */
  natsReplicas?: number;
}

export class GatewayConfigError extends Error {
  override readonly name = 'GatewayConfigError';
}

/** Command-line overrides (`--host`, `--port`, `--health-address`, `--openapi`). */
export interface GatewayArgs {
  host?: string;
  port?: string;
  healthAddress?: string;
  openApi?: string;
}

/** A `host:port` to listen on. */
export interface ListenAddress {
  host: string;
  port: number;
}

/** `host:port` (a name, an IPv4 address, or an IPv6 one in brackets; port 0 = any free one), or the problem with it. */
export function listenAddressFrom(name: string, value: string): ListenAddress | { problem: string } {
  const m = /^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})$/.exec(value);
  const port = m ? Number(m[2]) : NaN;
  if (!m || port > 65535) return { problem: `${name}=${value} must be host:port (e.g. 0.0.0.0:9467; [::]:9467)` };
  return { host: m[1]!.replace(/^\[(.*)\]$/, '$1'), port };
}

const BUCKET = /^[A-Za-z0-9_-]{1,64}$/;
const LOG_LEVELS = ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'] as const;

/**
 * `MAGUS_SESSION_TTL_MS`, the session TTL: how long a conversation keeps its session after its
 * last turn. At least 1 min: the gateway renews a session at most every 30 s and takes one within
 * 5 s of its end for ended (serving/sessions/), so a shorter TTL would send warm conversations
 * down the cold path. At most 24 h: the `magus_sessions` bucket's max age
 * (dataplane/declare.ts), which would drop the entry of a session still running.
 */
export const SESSION_TTL_MS = { default: 30 * 60_000, min: 60_000, max: 24 * 3_600_000 } as const;

/** `MAGUS_RESPONSES_TTL`: at least a minute, at most a year; default 30 days. */
export const RESPONSES_TTL_MS = { default: DEFAULT_RESPONSES_MAX_AGE_MS, min: 60_000, max: 365 * 24 * 3_600_000 } as const;
const DURATION_UNITS_MS: Readonly<Record<string, number>> = { '': 1, ms: 1, s: 1_000, m: 60_000, h: 3_600_000, d: 24 * 3_600_000 };

/** `MAGUS_RESPONSES_TTL` from `env`: whole milliseconds or a number with a unit (`90s`, `12h`, `30d`); default 30 days. */
export function responsesTtlFrom(env: NodeJS.ProcessEnv): { ttlMs: number; problem?: string } {
  const d = durationFrom(env, 'MAGUS_RESPONSES_TTL', RESPONSES_TTL_MS, '1m to 365d');
  return { ttlMs: d.ms, ...(d.problem !== undefined ? { problem: d.problem } : {}) };
}

/** `MAGUS_MAX_QUEUE_WAIT`: how long a turn may be expected to wait in an instance's queue (serving/queue-waits.ts); 0 bounds nothing. */
export const MAX_QUEUE_WAIT_MS = { default: 5_000, min: 0, max: 10 * 60_000 } as const;

/** `MAGUS_MAX_QUEUE_WAIT` from `env` (default 5 s), or the problem with it. */
export function maxQueueWaitFrom(env: NodeJS.ProcessEnv): { ms: number; problem?: string } {
  return durationFrom(env, 'MAGUS_MAX_QUEUE_WAIT', MAX_QUEUE_WAIT_MS, '0 (no bound) to 10m');
}

/** A duration setting: whole milliseconds or a number with a unit (`ms`, `s`, `m`, `h`, `d`), within `bounds` (`range` says them). */
function durationFrom(
  env: NodeJS.ProcessEnv,
  name: string,
  bounds: { default: number; min: number; max: number },
  range: string,
): { ms: number; problem?: string } {
  const value = env[name]?.trim();
  if (value === undefined || value === '') return { ms: bounds.default };
  const m = /^(\d+)(ms|s|m|h|d)?$/.exec(value);
  const ms = m ? Number(m[1]) * DURATION_UNITS_MS[m[2] ?? '']! : NaN;
  if (!Number.isSafeInteger(ms) || ms < bounds.min || ms > bounds.max)
    return { ms: bounds.default, problem: `${name}=${value} must be a duration from ${range} (whole milliseconds, or a number with ms, s, m, h or d)` };
  return { ms };
}

/** `MAGUS_SESSION_TTL_MS` from `env` (default 30 min), or the problem with it. */
export function sessionTtlFrom(env: NodeJS.ProcessEnv): { ttlMs: number; problem?: string } {
  const value = env.MAGUS_SESSION_TTL_MS?.trim();
  if (value === undefined || value === '') return { ttlMs: SESSION_TTL_MS.default };
  const n = Number(value);
  if (!/^\d+$/.test(value) || !Number.isSafeInteger(n) || n < SESSION_TTL_MS.min || n > SESSION_TTL_MS.max) {
    return {
      ttlMs: SESSION_TTL_MS.default,
      problem: `MAGUS_SESSION_TTL_MS=${value} must be whole milliseconds from ${SESSION_TTL_MS.min} (1 min: sessions are renewed every 30 s) to ${SESSION_TTL_MS.max} (24 h: the magus_sessions bucket's max age)`,
    };
  }
  return { ttlMs: n };
}

/** `MAGUS_SESSION_TTL_MS` from `env` (default 30 min); a bad value throws a {@link GatewayConfigError} naming it. */
export function loadSessionTtl(env: NodeJS.ProcessEnv = process.env): number {
  const { ttlMs, problem } = sessionTtlFrom(env);
  if (problem !== undefined) throw new GatewayConfigError(problem);
  return ttlMs;
}

/** `MAGUS_MAX_QUEUE_WAIT` alone (`magus dev` reads it as the gateway does), or a {@link GatewayConfigError}. */
export function loadMaxQueueWait(env: NodeJS.ProcessEnv = process.env): number {
  const { ms, problem } = maxQueueWaitFrom(env);
  if (problem !== undefined) throw new GatewayConfigError(problem);
  return ms;
}

export function loadGatewayConfig(env: NodeJS.ProcessEnv = process.env, args: GatewayArgs = {}): GatewayConfig {
  const problems: string[] = [];
  const raw = (name: string): string | undefined => {
    const v = env[name]?.trim();
    return v === '' ? undefined : v;
  };
  const int = (name: string, fallback: number, min: number, max: number, value = raw(name)): number => {
    if (value === undefined) return fallback;
    const n = Number(value);
    if (!Number.isInteger(n) || n < min || n > max) {
      problems.push(`${name}=${value} must be a whole number from ${min} to ${max}`);
      return fallback;
    }
    return n;
  };
  const str = (name: string, fallback: string, pattern: RegExp, what: string, value = raw(name)): string => {
    const v = value ?? fallback;
    if (!pattern.test(v)) problems.push(`${name}=${v} ${what}`);
    return v;
  };
  const bool = (name: string, fallback: boolean): boolean => {
    const v = raw(name);
    if (v === undefined) return fallback;
    if (/^(1|true|yes|on)$/i.test(v)) return true;
    if (/^(0|false|no|off)$/i.test(v)) return false;
    problems.push(`${name}=${v} must be true or false`);
    return fallback;
  };
  const oneOf = <T extends string>(name: string, fallback: T, allowed: readonly T[], value = raw(name)): T => {
    const v = value ?? fallback;
    if (!(allowed as readonly string[]).includes(v)) problems.push(`${name}=${v} must be one of ${allowed.join(', ')}`);
    return v as T;
  };

  const host = str('MAGUS_GATEWAY_HOST (--host)', '0.0.0.0', /^[A-Za-z0-9.:-]+$/, 'is not a host name or address', args.host ?? raw('MAGUS_GATEWAY_HOST'));
  const port = int('MAGUS_GATEWAY_PORT (--port)', 8080, 0, 65535, args.port ?? raw('MAGUS_GATEWAY_PORT'));
  let healthAddress: ListenAddress | undefined;
  const healthValue = args.healthAddress ?? raw('MAGUS_GATEWAY_HEALTH_ADDRESS');
  if (healthValue !== undefined) {
    const a = listenAddressFrom('MAGUS_GATEWAY_HEALTH_ADDRESS (--health-address)', healthValue);
    if ('problem' in a) problems.push(a.problem);
    else if (a.port !== 0 && a.port === port)
      problems.push(`MAGUS_GATEWAY_HEALTH_ADDRESS (--health-address) ${healthValue} must be on another port than the API's (${port})`);
    else healthAddress = a;
  }
  const natsServers = raw('MAGUS_NATS_URL') ?? 'nats://127.0.0.1:4222';
  checkNatsServerList('MAGUS_NATS_URL', natsServers, problems);
  const natsCredentials = natsCredentialsFrom(env, problems);
  const temporal = temporalSettings(env, problems);
  const instanceMemory = instanceMemoryFrom(env, problems);
  // One prefix names the whole data plane, as for the worker (workers/config.ts); the
  // per-bucket variables override single names.
  const prefix = str('MAGUS_NATS_PREFIX', '', /^[A-Za-z0-9_-]*$/, "may hold only letters, digits, '_' and '-'");
  const names = dataPlaneNames(/^[A-Za-z0-9_-]*$/.test(prefix) ? prefix : '');
  const subjectScope = str(
    'MAGUS_NATS_SUBJECT_SCOPE',
    names.subjectScope,
    /^([a-z0-9_-]{1,64})?$/,
    'is not a subject token (lowercase letters, digits, _ and -)',
  );
  const buckets = {
    models: str('MAGUS_MODELS_BUCKET', names.modelsBucket, BUCKET, 'is not a KV bucket name ([A-Za-z0-9_-])'),
    tokens: str('MAGUS_TOKENS_BUCKET', names.tokensBucket, BUCKET, 'is not a KV bucket name ([A-Za-z0-9_-])'),
    sessions: str('MAGUS_SESSIONS_BUCKET', names.sessionsBucket, BUCKET, 'is not a KV bucket name ([A-Za-z0-9_-])'),
    pools: str('MAGUS_POOLS_BUCKET', names.poolsBucket, BUCKET, 'is not a KV bucket name ([A-Za-z0-9_-])'),
    responses: str('MAGUS_RESPONSES_BUCKET', names.responsesBucket, BUCKET, 'is not a KV bucket name ([A-Za-z0-9_-])'),
    limits: str('MAGUS_LIMITS_BUCKET', names.limitsBucket, BUCKET, 'is not a KV bucket name ([A-Za-z0-9_-])'),
    usage: str('MAGUS_USAGE_BUCKET', names.usageBucket, BUCKET, 'is not a KV bucket name ([A-Za-z0-9_-])'),
    // Bridges name it by the data plane's prefix only.
    claims: names.claimsBucket,
  };
  const limitLeaseMs = int('MAGUS_GATEWAY_LIMIT_LEASE_MS', 30_000, 1_000, 3_600_000);

  let secret = raw('MAGUS_GATEWAY_SECRET');
  const secretFile = raw('MAGUS_GATEWAY_SECRET_FILE');
  if (secret === undefined && secretFile !== undefined) {
    try {
      secret = readFileSync(secretFile, 'utf8').trim();
    } catch (err) {
      problems.push(`MAGUS_GATEWAY_SECRET_FILE=${secretFile} cannot be read (${(err as NodeJS.ErrnoException).code ?? 'error'})`);
    }
  }
  if (secret === undefined) {
    if (secretFile === undefined)
      problems.push(
        'MAGUS_GATEWAY_SECRET (or MAGUS_GATEWAY_SECRET_FILE) is required: the key of conversation keys, the same on every replica (e.g. `openssl rand -hex 32`)',
      );
  } else if (secret.length < 32) {
    problems.push('MAGUS_GATEWAY_SECRET must be at least 32 characters');
  }

  const staticTokens: GatewayConfig['staticTokens'] = [];
  const addTokens = (origin: string, text: string) => {
    try {
      const entries = JSON.parse(text) as Record<string, unknown>;
      staticTokenSource(entries, origin); // validates every entry
      staticTokens.push({ origin, entries });
    } catch (err) {
      problems.push(err instanceof SyntaxError ? `${origin} is not valid JSON` : (err as Error).message);
    }
  };
  const tokensFile = raw('MAGUS_GATEWAY_TOKENS_FILE');
  if (tokensFile !== undefined) {
    let text: string | undefined;
    try {
      text = readFileSync(tokensFile, 'utf8');
    } catch (err) {
      problems.push(`MAGUS_GATEWAY_TOKENS_FILE=${tokensFile} cannot be read (${(err as NodeJS.ErrnoException).code ?? 'error'})`);
    }
    if (text !== undefined) addTokens('MAGUS_GATEWAY_TOKENS_FILE', text);
  }
  const tokensEnv = raw('MAGUS_GATEWAY_TOKENS');
  if (tokensEnv !== undefined) addTokens('MAGUS_GATEWAY_TOKENS', tokensEnv);

  const settings: GatewaySettings = {
    secret: secret ?? '',
    allowAnonymous: bool('MAGUS_GATEWAY_ALLOW_ANONYMOUS', false),
    bodyLimit: int('MAGUS_GATEWAY_BODY_LIMIT', 4 * 1024 * 1024, 1024, 1024 * 1024 * 1024),
    requestTimeoutMs: int('MAGUS_GATEWAY_REQUEST_TIMEOUT_MS', 300_000, 100, 3_600_000),
    gapTimeoutMs: int('MAGUS_GATEWAY_GAP_TIMEOUT_MS', 2_000, 10, 600_000),
    keepAliveMs: int('MAGUS_GATEWAY_SSE_KEEPALIVE_MS', 2_000, 100, 600_000),
    resumeHoldMs: int('MAGUS_GATEWAY_RESUME_HOLD_MS', DEFAULT_RESUME_HOLD_MS, 0, 600_000),
    coldStartTimeoutMs: int('MAGUS_GATEWAY_COLD_START_TIMEOUT_MS', 300_000, 100, 3_600_000),
    retryAfterSec: int('MAGUS_GATEWAY_RETRY_AFTER_SEC', 5, 1, 3_600),
    maxPendingSessionStarts: int('MAGUS_GATEWAY_MAX_PENDING_SESSION_STARTS', MAX_PENDING_SESSION_STARTS, 1, 10_000_000),
    sessionCacheEntries: int('MAGUS_GATEWAY_SESSION_CACHE', DEFAULT_SESSION_CACHE_ENTRIES, 0, 100_000_000),
    natsGraceMs: int('MAGUS_GATEWAY_NATS_GRACE_MS', DEFAULT_NATS_GRACE_MS, 0, 3_600_000),
    openApi: oneOf('MAGUS_GATEWAY_OPENAPI (--openapi)', 'public', OPENAPI_ACCESS, args.openApi ?? raw('MAGUS_GATEWAY_OPENAPI')),
  };
  const http = {
    connectionTimeoutMs: int('MAGUS_GATEWAY_CONNECTION_TIMEOUT_MS', 0, 0, 24 * 3_600_000),
    requestTimeoutMs: int('MAGUS_GATEWAY_HTTP_REQUEST_TIMEOUT_MS', 60_000, 0, 3_600_000),
    keepAliveTimeoutMs: int('MAGUS_GATEWAY_KEEP_ALIVE_TIMEOUT_MS', 72_000, 1, 3_600_000),
    headersTimeoutMs: int('MAGUS_GATEWAY_HEADERS_TIMEOUT_MS', 20_000, 1, 3_600_000),
  };
  const session = sessionTtlFrom(env);
  if (session.problem !== undefined) problems.push(session.problem);
  const responsesTtl = responsesTtlFrom(env);
  if (responsesTtl.problem !== undefined) problems.push(responsesTtl.problem);
  const maxQueueWait = maxQueueWaitFrom(env);
  if (maxQueueWait.problem !== undefined) problems.push(maxQueueWait.problem);
  const natsReplicas = natsReplicasFrom(env, problems);
  // Cross-field rules.
  if (settings.gapTimeoutMs >= settings.requestTimeoutMs)
    problems.push(`MAGUS_GATEWAY_GAP_TIMEOUT_MS (${settings.gapTimeoutMs}) must be below MAGUS_GATEWAY_REQUEST_TIMEOUT_MS (${settings.requestTimeoutMs})`);
  if (http.requestTimeoutMs > 0 && http.headersTimeoutMs > http.requestTimeoutMs)
    problems.push(
      `MAGUS_GATEWAY_HEADERS_TIMEOUT_MS (${http.headersTimeoutMs}) must not exceed MAGUS_GATEWAY_HTTP_REQUEST_TIMEOUT_MS (${http.requestTimeoutMs})`,
    );
  // A non-streamed answer sends nothing until it is complete: an idle-socket timeout shorter than
  // the longest wait would cut it.
  const longestSilence = settings.coldStartTimeoutMs + settings.requestTimeoutMs;
  if (http.connectionTimeoutMs > 0 && http.connectionTimeoutMs <= longestSilence) {
    problems.push(
      `MAGUS_GATEWAY_CONNECTION_TIMEOUT_MS (${http.connectionTimeoutMs}) must be 0 or above MAGUS_GATEWAY_COLD_START_TIMEOUT_MS + MAGUS_GATEWAY_REQUEST_TIMEOUT_MS (${longestSilence})`,
    );
  }

  const config: GatewayConfig = {
    host,
    port,
    ...(healthAddress ? { healthAddress } : {}),
    natsServers,
    ...(natsCredentials ? { natsCredentials } : {}),
    temporal,
    ...(instanceMemory !== undefined ? { instanceMemory } : {}),
    subjectScope,
    replicaId: str('MAGUS_GATEWAY_REPLICA_ID', newReplicaId(), REPLICA_ID, "is not a subject token (letters, digits, '_' and '-', at most 64)"),
    responseStream: names.responseStream,
    requestStream: names.requestStream,
    buckets,
    limitLeaseMs,
    settings,
    staticTokens,
    http,
    shutdownGraceMs: int('MAGUS_GATEWAY_SHUTDOWN_GRACE_MS', 30_000, 0, 3_600_000),
    logLevel: oneOf('MAGUS_LOG_LEVEL', 'info', LOG_LEVELS),
    responseRouting: oneOf('MAGUS_GATEWAY_RESPONSE_ROUTING', 'shared', ['shared', 'per-request'] as const),
    sessionTtlMs: session.ttlMs,
    responsesTtlMs: responsesTtl.ttlMs,
    maxQueueWaitMs: maxQueueWait.ms,
    ...(natsReplicas !== undefined ? { natsReplicas } : {}),
  };
  if (problems.length > 0) throw new GatewayConfigError(`invalid gateway configuration:\n  ${problems.join('\n  ')}`);
  return config;
}

/** The variables, for `magus gateway --help`. */
export const GATEWAY_USAGE = `usage: magus gateway [--host H] [--port P] [--health-address host:port] [--openapi public|authenticated|off]

environment:
  MAGUS_NATS_URL                       nats://127.0.0.1:4222
  MAGUS_NATS_CREDENTIALS               the gateway role's credentials file (magus nats-auth); unset: none
  MAGUS_TEMPORAL_ADDRESS               127.0.0.1:7233 (cold turns start session workflows there; warm turns never need it)
  MAGUS_TEMPORAL_NAMESPACE, MAGUS_TASK_QUEUE   default, magus-control (as for the workers)
  MAGUS_INSTANCE_MEMORY                8Gi (the memory of one instance, which sizes a pool's leases: the workers' value)
  MAGUS_GATEWAY_SECRET[_FILE]          HMAC key of conversation keys (required, ≥ 32 chars, same on every replica)
  MAGUS_GATEWAY_HOST, _PORT            0.0.0.0, 8080
  MAGUS_GATEWAY_HEALTH_ADDRESS         unset: /healthz, /readyz and /metrics on the API port (for local use); host:port (--health-address,
                                       e.g. 0.0.0.0:9467): all three there, and /metrics no longer on the API port
  MAGUS_GATEWAY_OPENAPI                public (--openapi): /openapi.json for anyone | authenticated: with a valid API key, else 401 | off: 404
  MAGUS_GATEWAY_ALLOW_ANONYMOUS        false; true serves requests without Authorization
  MAGUS_GATEWAY_TOKENS_FILE, _TOKENS   local tokens: {"<id>": {"digest": "<hex sha256 of mgs_<id>_<secret>>", "name": "…"}}
  MAGUS_NATS_SUBJECT_SCOPE             '' (a scoped data plane: frames on <scope>.magus.res.<replica>.<id>)
  MAGUS_GATEWAY_REPLICA_ID             gw-<random> (this replica's frames come on magus.res.<replica>.*; unique per replica, e.g. the pod name)
  MAGUS_MODELS_BUCKET, MAGUS_TOKENS_BUCKET, MAGUS_SESSIONS_BUCKET   magus_models, magus_tokens, magus_sessions
  MAGUS_POOLS_BUCKET                                           magus_pools
  MAGUS_RESPONSES_BUCKET               magus_responses (stored responses of /v1/responses; the gateway declares it)
  MAGUS_RESPONSES_TTL                  30d (a stored response is kept this long after it was created: 1m to 365d, or whole ms)
  MAGUS_NATS_REPLICAS                  1 (replicas of magus_responses, as the other processes' of theirs)
  MAGUS_GATEWAY_BODY_LIMIT             4194304 bytes
  MAGUS_GATEWAY_REQUEST_TIMEOUT_MS     300000 (504 when the engine sends nothing for this long)
  MAGUS_GATEWAY_GAP_TIMEOUT_MS         2000 (a missing response frame is read back from the stream 300 ms into the gap, then after each this long; 502 after 9 reads miss it)
  MAGUS_GATEWAY_SSE_KEEPALIVE_MS       2000
  MAGUS_GATEWAY_RESUME_HOLD_MS         10000 (a resumable stream whose client left is cancelled this long after, unless a client resumed it; 0: at once)
  MAGUS_GATEWAY_COLD_START_TIMEOUT_MS  300000 (503 when no session is ready by then)
  MAGUS_GATEWAY_RETRY_AFTER_SEC        5 (when no queue says otherwise)
  MAGUS_MAX_QUEUE_WAIT                 5s (a turn expected to wait longer in every instance's queue gets 429 queue_full at once; 0: no bound)
  MAGUS_GATEWAY_MAX_PENDING_SESSION_STARTS  5000 (answered conversations whose session workflow has not started yet; beyond it new ones get 503)
  MAGUS_GATEWAY_SESSION_CACHE          50000 (conversations whose entries this gateway holds, read from magus_sessions on first use; 0: mirror every entry)
  MAGUS_GATEWAY_NATS_GRACE_MS          30000 (cut off from NATS, or rebuilding a mirror after a reconnect, /readyz says degraded this long, then fails)
  MAGUS_GATEWAY_CONNECTION_TIMEOUT_MS, _HTTP_REQUEST_TIMEOUT_MS, _KEEP_ALIVE_TIMEOUT_MS, _HEADERS_TIMEOUT_MS
  MAGUS_GATEWAY_SHUTDOWN_GRACE_MS      30000
  MAGUS_GATEWAY_RESPONSE_ROUTING       shared (one subscription per replica) | per-request
  MAGUS_SESSION_TTL_MS                 1800000 (a conversation keeps its instance this long after its last turn; 60000 to 86400000)
  MAGUS_LOG_LEVEL                      info`;

/**
 * The gateway side of integration tests: a configuration on this test file's data plane, and a
 * conversation pinned to an instance (its `magus_sessions` entry, without `placedAt`: never
 * moved), so a test can route turns without Temporal.
 */
import type { NatsConnection } from 'nats';
import { dataPlaneNames, requestSubjectOf, type DataPlaneNames } from '../../dataplane';
import { loadGatewayConfig, type GatewayConfig } from '../../gateway/config';
import { tokenDigest } from '../../gateway/plugins/auth';
import { conversationKey } from '../../gateway/serving/conversation';
import { openModelRegistry } from '../../dataplane/registry';
import { readyModel } from './gateway-app';
import type { AcquireRequest, ColdStart } from '../../gateway/serving/sessions';
import type { PoolEntry, SessionEntry } from '../../shared/serving';
import { endpoint, natsCredentialsEnv, natsRoleCredentials } from './index';

/**
 * A gateway on loopback (port chosen by the OS) against the test NATS server (or `env`'s
 * `MAGUS_NATS_URL`: a test's own), data plane `prefix`, accepting `tokens` (token id → whole
 * token); `env` adds or overrides variables.
 */
export function gatewayConfigFor(prefix: string, opts: { secret: string; tokens: Record<string, string>; env?: Record<string, string> }): GatewayConfig {
  const entries = Object.fromEntries(Object.entries(opts.tokens).map(([id, token]) => [id, { digest: tokenDigest(token), name: `test token ${id}` }]));
  return loadGatewayConfig({
    MAGUS_GATEWAY_HOST: '127.0.0.1',
    MAGUS_GATEWAY_PORT: '0',
    MAGUS_NATS_URL: opts.env?.MAGUS_NATS_URL ?? endpoint('nats').servers,
    MAGUS_NATS_PREFIX: prefix,
    MAGUS_GATEWAY_SECRET: opts.secret,
    MAGUS_GATEWAY_TOKENS: JSON.stringify(entries),
    ...opts.env,
  });
}

/**
 * {@link gatewayConfigFor} on the test NATS server, connecting as the gateway's user of data plane
 * `prefix` (its role's permissions, as in production): for a gateway that connects by itself.
 */
export async function gatewayConfigAs(
  prefix: string,
  opts: { secret: string; tokens: Record<string, string>; env?: Record<string, string> },
): Promise<GatewayConfig> {
  const credentials = natsCredentialsEnv(await natsRoleCredentials('gateway', dataPlaneNames(prefix)));
  return gatewayConfigFor(prefix, { ...opts, env: { ...credentials, ...opts.env } });
}

/** Writes conversation `key`'s session entry: its turns go to `pool`/`instance` for `ttlMs`. */
export async function pinConversation(
  nc: NatsConnection,
  names: DataPlaneNames,
  key: string,
  pool: string,
  instance: string,
  ttlMs = 3_600_000,
): Promise<SessionEntry> {
  const entry: SessionEntry = { subject: requestSubjectOf(names, pool, instance), pool, instance, expiresAt: Date.now() + ttlMs };
  await (await nc.jetstream().views.kv(names.sessionsBucket)).put(key, new TextEncoder().encode(JSON.stringify(entry)));
  return entry;
}

/**
 * Model `pool` ready in the registry, and the conversation `sessionId` of a key scoped `scope`
 * pinned to its `instance` (as its session would): that conversation's turns are warm on a
 * gateway with `secret`. Returns the conversation's key.
 */
export async function pinnedConversation(
  nc: NatsConnection,
  names: DataPlaneNames,
  o: { pool: string; instance: string; secret: string; scope: string; sessionId: string },
): Promise<string> {
  await (await openModelRegistry(nc, names.modelsBucket)).put(readyModel(o.pool));
  const key = conversationKey(o.secret, { scope: o.scope, model: `default/${o.pool}`, messages: [], sessionId: o.sessionId });
  await pinConversation(nc, names, key, o.pool, o.instance);
  return key;
}

/**
 * Publishes a fresh pool view (`magus_pools`) with `instances` serving `pool` (namespace
 * `default`), as the pool workflow writes it: what gateways route requests of no conversation
 * (embeddings) by, and where a gateway places a new conversation while its instances have room
 * (`leasesPerInstance` conversations each). Fresh for the gateway's staleness bound (minutes): enough for a test.
 */
export async function publishPoolView(nc: NatsConnection, names: DataPlaneNames, pool: string, instances: string[], leasesPerInstance = 4): Promise<void> {
  const view: PoolEntry = {
    instances: instances.map((instance) => ({ instance, subject: requestSubjectOf(names, pool, instance), leases: 0 })),
    leasesPerInstance,
    updatedAt: Date.now(),
  };
  await (await nc.jetstream().views.kv(names.poolsBucket)).put(`default.${pool}`, new TextEncoder().encode(JSON.stringify(view)));
}

/** A cold start for a test where none may happen: records the conversation's key in `seen`, and refuses (`why`). */
export function refusedColdStart(seen: string[], why: string): ColdStart {
  return (req: AcquireRequest) => {
    seen.push(req.conversationKey);
    return Promise.reject(new Error(why));
  };
}

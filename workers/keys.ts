/**
 * `magus keys create NAME [--models m1,m2] | list [--json] | revoke NAME`: API keys without
 * Kubernetes (local mode: `magus dev`, or `magus gateway` next to a NATS server). A key is
 * `local/<NAME>` in the same store the controller writes ApiKeys to (`magus_tokens`,
 * dataplane/keys.ts): its token id is random and registered once, so it can neither take nor be
 * taken by another key. The token is printed once, on stdout, and stored only as its sha256.
 * On a cluster, declare an `ApiKey` instead (README "Tenants").
 *
 * Where NATS is: `MAGUS_NATS_URL` (and `MAGUS_NATS_PREFIX`), else the running `magus dev`.
 */
import { randomBytes, randomUUID } from 'node:crypto';
import { connect, type KV, type NatsConnection } from 'nats';
import { dataPlaneNames, JsApiError, jsErrorCode } from '../dataplane';
import { listKeys, registerKey, tokenDigest, unregisterKey } from '../dataplane/keys';
import { natsServerList } from '../platform/config';
import { UsageError, usageFailure } from '../platform/cli';
import { keyOwner, type TokenEntry } from '../shared/serving';
import { loadConfig, useDevConnection } from './config';

export const KEYS_USAGE = [
  'usage: magus keys create NAME [--models MODEL,…]   a new key: its token is printed once',
  '       magus keys list [--json]                    the keys (local ones, ApiKeys and labelled Secrets)',
  "       magus keys revoke NAME                      a local key's token stops working at once",
  '',
  'Local keys (identity local/NAME) are for magus without Kubernetes; on a cluster declare an ApiKey.',
  'MODEL: a model name (in any namespace), NAMESPACE/NAME or NAMESPACE/*; without --models every model.',
  'NATS: MAGUS_NATS_URL and MAGUS_NATS_PREFIX, else the running magus dev (its connection.json).',
].join('\n');

const NAME = /^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$/;
const MODEL = /^(([a-z0-9]([-a-z0-9]*[a-z0-9])?)\/)?([A-Za-z0-9][A-Za-z0-9._-]{0,252}|\*)$/;
const LOCAL = 'local/';

export type KeysArgs = { command: 'create'; name: string; models?: string[] } | { command: 'list'; json: boolean } | { command: 'revoke'; name: string };

export function parseKeysArgs(args: string[]): KeysArgs {
  const [command, ...rest] = args;
  const name = (): string => {
    // The value after --models is not the name (`create --models m1 NAME`).
    const n = rest.find((a, i) => !a.startsWith('-') && rest[i - 1] !== '--models');
    if (n === undefined) throw new UsageError(`magus keys ${command} needs a NAME`);
    if (!NAME.test(n))
      throw new UsageError(`key name ${JSON.stringify(n)} must be 1-63 characters of a-z, 0-9 and '-', starting and ending with a letter or digit`);
    return n;
  };
  if (command === 'list') {
    for (const a of rest) if (a !== '--json') throw new UsageError(`unknown option ${a}`);
    return { command, json: rest.includes('--json') };
  }
  if (command === 'revoke') {
    const n = name();
    for (const a of rest) if (a !== n) throw new UsageError(`unknown option ${a}`);
    return { command, name: n };
  }
  if (command === 'create') {
    const n = name();
    let models: string[] | undefined;
    for (let i = 0; i < rest.length; i++) {
      const a = rest[i]!;
      if (a === n) continue;
      if (a === '--models') {
        const v = rest[++i];
        if (v === undefined) throw new UsageError('--models needs a value: MODEL,…');
        models = v
          .split(',')
          .map((m) => m.trim())
          .filter(Boolean);
        if (models.length === 0) throw new UsageError('--models lists no model (leave it out for every model)');
        for (const m of models) if (!MODEL.test(m)) throw new UsageError(`--models: ${JSON.stringify(m)} is not a model name, NAMESPACE/NAME or NAMESPACE/*`);
      } else throw new UsageError(`unknown option ${a}`);
    }
    return { command, name: n, ...(models ? { models } : {}) };
  }
  throw new UsageError(command === undefined ? 'magus keys needs a command: create, list or revoke' : `unknown command keys ${command}`);
}

/** A new token: a random id (64 bits, hex) and a random secret (256 bits). */
export const newToken = (): { id: string; token: string } => {
  const id = randomBytes(8).toString('hex');
  return { id, token: `mgs_${id}_${randomBytes(32).toString('base64url')}` };
};

/** Creates local key `name`; the token, or why not. */
export async function createLocalKey(kv: KV, name: string, models?: string[]): Promise<{ token: string; id: string } | { error: string }> {
  const key = `${LOCAL}${name}`;
  if ((await listKeys(kv)).some((k) => k.entry.key === key)) return { error: `a key named ${name} exists; revoke it first (magus keys revoke ${name})` };
  for (let attempt = 0; attempt < 3; attempt++) {
    const { id, token } = newToken();
    const entry: TokenEntry & { key: string; uid: string } = {
      digest: tokenDigest(token),
      name: key,
      key,
      uid: randomUUID(),
      ...(models ? { models } : {}),
      origin: 'local',
    };
    // A random 64-bit id is taken only by chance; registration never overwrites one that is.
    if ((await registerKey(kv, id, entry)).ok) return { token, id };
  }
  return { error: 'three random token ids in a row were taken; this should not happen' };
}

/** Revokes every token of local key `name`; how many there were. */
export async function revokeLocalKey(kv: KV, name: string): Promise<number> {
  let n = 0;
  for (const { id, entry } of await listKeys(kv)) {
    if (entry.key === `${LOCAL}${name}` && entry.uid !== undefined && (await unregisterKey(kv, id, { key: entry.key, uid: entry.uid }))) n++;
  }
  return n;
}

export async function keysCommand(args: string[]): Promise<number> {
  if (args.includes('--help') || args.includes('-h')) {
    process.stdout.write(`${KEYS_USAGE}\n`);
    return 0;
  }
  let parsed: KeysArgs;
  try {
    parsed = parseKeysArgs(args);
  } catch (err) {
    return usageFailure('magus keys', KEYS_USAGE, err);
  }
  const dev = useDevConnection(process.env);
  const cfg = loadConfig();
  let nc: NatsConnection;
  try {
    nc = await connect({ servers: natsServerList(cfg.nats.servers), name: 'magus-keys', reconnect: false, timeout: 5000 });
  } catch (err) {
    const where = dev?.taken.includes('MAGUS_NATS_URL')
      ? `the running magus dev's NATS (${cfg.nats.servers})`
      : `NATS at ${cfg.nats.servers}${process.env.MAGUS_NATS_URL ? '' : ' (the default: MAGUS_NATS_URL is unset and no magus dev runs)'}`;
    process.stderr.write(`magus keys: cannot reach ${where}: ${(err as Error).message}\n`);
    return 1;
  }
  try {
    const bucket = dataPlaneNames(cfg.natsPrefix).tokensBucket;
    let kv: KV;
    try {
      kv = await nc.jetstream().views.kv(bucket, { bindOnly: true });
      await kv.status(); // binding does not look for the bucket: this fails when it is missing
    } catch (err) {
      if (jsErrorCode(err) !== JsApiError.streamNotFound) throw err;
      process.stderr.write(`magus keys: NATS at ${cfg.nats.servers} has no ${bucket} bucket: start magus dev (or a gateway) first\n`);
      return 1;
    }
    if (parsed.command === 'create') {
      const made = await createLocalKey(kv, parsed.name, parsed.models);
      if ('error' in made) {
        process.stderr.write(`magus keys: ${made.error}\n`);
        return 1;
      }
      process.stderr.write(
        `key local/${parsed.name} created (token id ${made.id}; ${parsed.models ? `models ${parsed.models.join(', ')}` : 'every model'}). Its token, shown only this once:\n`,
      );
      process.stdout.write(`${made.token}\n`);
      return 0;
    }
    if (parsed.command === 'revoke') {
      const n = await revokeLocalKey(kv, parsed.name);
      if (n === 0) {
        process.stderr.write(`magus keys: no local key named ${parsed.name} (magus keys list shows them)\n`);
        return 1;
      }
      process.stderr.write(`key local/${parsed.name} revoked: its token is refused from now on\n`);
      return 0;
    }
    const keys = (await listKeys(kv)).map(({ id, entry }) => ({
      key: entry.key ?? `token/${id}`,
      tokenId: id,
      models: entry.models ?? ['*'],
      suspended: entry.suspended === true,
      origin: entry.origin ?? 'unknown',
      owner: keyOwner(entry.key ?? `token/${id}`, entry.uid ?? id),
    }));
    if (parsed.json) process.stdout.write(`${JSON.stringify(keys, null, 2)}\n`);
    else {
      const rows = [
        ['KEY', 'TOKEN ID', 'MODELS', 'SUSPENDED', 'FROM'],
        ...keys.map((k) => [k.key, k.tokenId, k.models.join(','), k.suspended ? 'yes' : 'no', k.origin.split('/')[0]!]),
      ];
      const widths = rows[0]!.map((_, i) => Math.max(...rows.map((r) => r[i]!.length)));
      for (const r of rows)
        process.stdout.write(
          `${r
            .map((c, i) => c.padEnd(widths[i]!))
            .join('  ')
            .trimEnd()}\n`,
        );
    }
    return 0;
  } finally {
    await nc.close();
  }
}

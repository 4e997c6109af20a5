/**
 * API-token authentication. Tokens look like `mgs_<id>_<secret>` (`<id>`: letters, digits, `-`);
 * the gateway looks the id up (a watch-backed `magus_tokens` KV mirror, or a token file / env
 * value in local mode) and compares `sha256(token)` with the stored digest in constant time.
 * The caller is then the *key* the entry names — its identity (`<namespace>/<name>` of an
 * ApiKey, `local/<name>` of a `magus keys` key) and owner (identity and uid), never the token
 * id: what a key stores belongs to its owner, and an id is registered to one key only
 * (dataplane/keys.ts).
 * Every request that presents a bearer token costs exactly one sha256 and one `timingSafeEqual`,
 * whether the id exists or not, so response time does not reveal which ids exist.
 * Tokens are never stored, logged or echoed.
 */
import { hash, timingSafeEqual } from 'node:crypto';
import type { FastifyReply, FastifyRequest, onRequestHookHandler } from 'fastify';
import type { KeyLimits } from '../../shared/limits';
import { keyOwner, type TokenEntry } from '../../shared/serving';
import { entryLimits, TOKEN_PATTERN, tokenDigest } from '../../dataplane/keys';
import { errors } from './errors';
import { watchKv, type KvCache, type WatchableKv } from '../../dataplane/kv-mirror';
import { servicePlugin } from './plugin';

/** Who is calling. */
export interface Principal {
  /** The key's identity: `<namespace>/<name>`, `local/<name>`, `config/<token id>`, or `anonymous`. */
  key: string;
  /**
   * What owns the conversations and stored responses of its requests: the identity and the
   * declaring object's uid (keyOwner, shared/serving.ts), so a key declared again under the same
   * name never reads the old one's. Anonymous callers own nothing ({@link Principal.anonymous}).
   */
  owner: string;
  /**
   * What its conversation keys are scoped by (serving/conversation.ts): its owner, or — for a
   * token whose entry names no key (a configured token, or an entry an older magus wrote) — the
   * token id, as conversation keys were made before keys had identities, so the conversations
   * such a token holds keep their sessions across the upgrade. Token ids are registered once,
   * so no two keys share one.
   */
  conversationScope: string;
  name: string;
  /** Models it may use (see {@link mayUse}); absent = all, empty = none. */
  models?: readonly string[];
  /** No key at all (`allowAnonymous`): nothing stored is shared between such callers. */
  anonymous?: true;
  /** The key's limits (serving/limits.ts enforces them), if it has any. */
  limits?: KeyLimits;
}

/** A {@link TokenEntry} ready for comparison, and the caller it makes (built once, not per request). */
export interface TokenRecord {
  digest: Buffer;
  principal: Principal;
  suspended?: boolean;
}

export interface TokenSource {
  lookup(id: string): TokenRecord | undefined;
}

export const ANONYMOUS: Principal = Object.freeze({ key: 'anonymous', owner: 'anonymous', conversationScope: 'anonymous', name: 'anonymous', anonymous: true });

const TOKEN_ID = /^[A-Za-z0-9-]{1,64}$/;
const HEX_DIGEST = /^[0-9a-f]{64}$/i;
/** Compared against when the id is unknown, so that path costs the same as a wrong secret. */
const NO_DIGEST = Buffer.alloc(32);

export { tokenDigest };

/**
 * A {@link TokenEntry} of token id `id` as stored, checked; throws naming what is wrong. An entry
 * that names no key (configured tokens, or one an older magus wrote) is the key `<fallback>/<id>`.
 */
export function toTokenRecord(entry: unknown, where: string, id: string, fallback: string): TokenRecord {
  const e = entry as Partial<TokenEntry> | null;
  if (typeof e !== 'object' || e === null) throw new Error(`${where}: must be an object {digest, name, models?}`);
  if (typeof e.digest !== 'string' || !HEX_DIGEST.test(e.digest)) throw new Error(`${where}.digest: must be the hex sha256 of the token (64 hex digits)`);
  if (typeof e.name !== 'string' || e.name === '') throw new Error(`${where}.name: must be a non-empty string`);
  if (e.models !== undefined && (!Array.isArray(e.models) || !e.models.every((m) => typeof m === 'string')))
    throw new Error(`${where}.models: must be a list of model names`);
  if ((e.key !== undefined || e.uid !== undefined) && (typeof e.key !== 'string' || e.key === '' || typeof e.uid !== 'string' || e.uid === ''))
    throw new Error(`${where}: key and uid must be non-empty strings, given together`);
  const limits = entryLimits(e.limits, `${where}.limits`);
  if ('error' in limits) throw new Error(limits.error);
  const key = e.key ?? `${fallback}/${id}`;
  const owner = keyOwner(key, e.uid ?? id);
  const principal: Principal = Object.freeze({
    key,
    owner,
    conversationScope: e.key === undefined ? id : owner,
    name: e.name,
    ...(e.models ? { models: Object.freeze([...e.models]) } : {}),
    ...(limits.limits ? { limits: limits.limits } : {}),
  });
  return { digest: Buffer.from(e.digest, 'hex'), principal, ...(e.suspended === true ? { suspended: true } : {}) };
}

/** Tokens given in configuration (local mode): `{ "<id>": {digest, name, models?}, … }`. Throws on a bad entry. */
export function staticTokenSource(entries: Record<string, unknown>, origin: string): TokenSource {
  const map = new Map<string, TokenRecord>();
  if (typeof entries !== 'object' || entries === null || Array.isArray(entries))
    throw new Error(`${origin}: must be a JSON object {"<token id>": {"digest": "<hex sha256>", "name": "…"}}`);
  for (const [id, entry] of Object.entries(entries)) {
    if (!TOKEN_ID.test(id)) throw new Error(`${origin}: token id ${JSON.stringify(id)} must be 1-64 letters, digits or '-'`);
    map.set(id, toTokenRecord(entry, `${origin}.${id}`, id, 'config'));
  }
  return { lookup: (id) => map.get(id) };
}

/** The `magus_tokens` KV bucket (key = token id), mirrored by a watch. Malformed entries are skipped and reported. */
export function kvTokenSource(kv: WatchableKv, onError?: (err: unknown) => void): TokenSource & { cache: KvCache<TokenRecord> } {
  const cache = watchKv<TokenRecord>(kv, {
    decode: (e) => toTokenRecord(JSON.parse(new TextDecoder().decode(e.value)), `token ${e.key}`, e.key, 'token'),
    onError,
  });
  return { cache, lookup: (id) => cache.get(id) };
}

/** The first source that knows the id answers. */
export function combineTokenSources(sources: TokenSource[]): TokenSource {
  if (sources.length === 1) return sources[0]!;
  return {
    lookup(id) {
      for (const s of sources) {
        const r = s.lookup(id);
        if (r) return r;
      }
      return undefined;
    },
  };
}

/**
 * Checks an `Authorization` header value. Without a header the caller is anonymous when that is
 * allowed; a header that is present must always be valid.
 */
export function authenticate(header: string | undefined, tokens: TokenSource, allowAnonymous: boolean): Principal {
  if (header === undefined || header === '') {
    if (allowAnonymous) return ANONYMOUS;
    throw errors.unauthorized('Missing API key. Send `Authorization: Bearer mgs_<id>_<secret>`.');
  }
  const token = header.length > 7 && header.slice(0, 7).toLowerCase() === 'bearer ' ? header.slice(7).trim() : '';
  const m = TOKEN_PATTERN.exec(token);
  const record = m ? tokens.lookup(m[1]!) : undefined;
  const digest = hash('sha256', token, 'buffer'); // one-shot: no Hash object per request
  const match = timingSafeEqual(digest, record?.digest ?? NO_DIGEST);
  if (!match || !record || !m) throw errors.unauthorized('Incorrect API key provided.');
  if (record.suspended) throw errors.keySuspended(record.principal.key);
  return record.principal;
}

/**
 * Whether a principal may use a model. Its `models` hold `*` (any), `<namespace>/*`,
 * `<namespace>/<name>`, or a bare `<name>` (that name in any namespace: configured and local keys
 * only; the controller writes every ApiKey's as `namespace/…`). Absent: any model; empty: none.
 */
export function mayUse(p: Principal, namespace: string, name: string): boolean {
  if (!p.models) return true;
  for (const m of p.models) if (m === '*' || m === name || m === `${namespace}/${name}` || m === `${namespace}/*`) return true;
  return false;
}

declare module 'fastify' {
  interface FastifyInstance {
    /** onRequest hook: sets `request.principal` or answers 401. */
    authenticate: onRequestHookHandler;
  }
  interface FastifyRequest {
    principal: Principal | null;
  }
}

export interface AuthPluginOptions {
  tokens: TokenSource;
  allowAnonymous: boolean;
}

export const authPlugin = servicePlugin<AuthPluginOptions>(
  (app, opts, pluginDone) => {
    app.decorateRequest('principal', null);
    app.decorate('authenticate', function (request: FastifyRequest, _reply: FastifyReply, done: (err?: Error) => void) {
      try {
        request.principal = authenticate(request.headers.authorization, opts.tokens, opts.allowAnonymous);
      } catch (err) {
        done(err as Error);
        return;
      }
      done();
    });
    pluginDone();
  },
  { name: 'magus-auth', dependencies: ['magus-errors'] },
);

/** The owner of a configured token's requests (`MAGUS_GATEWAY_TOKENS`): key `config/<id>`. */
export const configOwner = (id: string): string => keyOwner(`config/${id}`, id);

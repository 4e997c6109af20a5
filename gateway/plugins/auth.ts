/**
 * API-token authentication. Tokens look like `mgs_<id>_<secret>` (`<id>`: letters, digits, `-`);
 * the gateway looks the id up (a watch-backed `magus_tokens` KV mirror, or a token file / env
 * value in local mode) and compares `sha256(token)` with the stored digest in constant time.
 * Every request that presents a bearer token costs exactly one sha256 and one `timingSafeEqual`,
 * whether the id exists or not, so response time does not reveal which ids exist.
 * Tokens are never stored, logged or echoed.
 */
import { createHash, hash, timingSafeEqual } from 'node:crypto';
import type { FastifyReply, FastifyRequest, onRequestHookHandler } from 'fastify';
import type { TokenEntry } from '../../shared/serving';
import { errors } from './errors';
import { watchKv, type KvCache, type WatchableKv } from '../../dataplane/kv-mirror';
import { servicePlugin } from './plugin';

/** Who is calling. `tokenId` keys conversations and metrics; `models` restricts access (absent/empty = all). */
export interface Principal {
  tokenId: string;
  name: string;
  models?: readonly string[];
}

/** A {@link TokenEntry} ready for comparison. */
export interface TokenRecord {
  digest: Buffer;
  name: string;
  models?: readonly string[];
}

export interface TokenSource {
  lookup(id: string): TokenRecord | undefined;
}

export const ANONYMOUS: Principal = Object.freeze({ tokenId: 'anonymous', name: 'anonymous' });

const TOKEN = /^mgs_([A-Za-z0-9-]{1,64})_([A-Za-z0-9_-]{1,512})$/;
const TOKEN_ID = /^[A-Za-z0-9-]{1,64}$/;
const HEX_DIGEST = /^[0-9a-f]{64}$/i;
/** Compared against when the id is unknown, so that path costs the same as a wrong secret. */
const NO_DIGEST = Buffer.alloc(32);

/** hex sha256 of a whole token: the {@link TokenEntry} digest format. */
export const tokenDigest = (token: string): string => createHash('sha256').update(token).digest('hex');

/** A {@link TokenEntry} as stored, checked; throws naming what is wrong. */
export function toTokenRecord(entry: unknown, where: string): TokenRecord {
  const e = entry as Partial<TokenEntry> | null;
  if (typeof e !== 'object' || e === null) throw new Error(`${where}: must be an object {digest, name, models?}`);
  if (typeof e.digest !== 'string' || !HEX_DIGEST.test(e.digest)) throw new Error(`${where}.digest: must be the hex sha256 of the token (64 hex digits)`);
  if (typeof e.name !== 'string' || e.name === '') throw new Error(`${where}.name: must be a non-empty string`);
  if (e.models !== undefined && (!Array.isArray(e.models) || !e.models.every((m) => typeof m === 'string'))) throw new Error(`${where}.models: must be a list of model names`);
  return { digest: Buffer.from(e.digest, 'hex'), name: e.name, ...(e.models && e.models.length > 0 ? { models: [...e.models] } : {}) };
}

/** Tokens given in configuration (local mode): `{ "<id>": {digest, name, models?}, … }`. Throws on a bad entry. */
export function staticTokenSource(entries: Record<string, unknown>, origin: string): TokenSource {
  const map = new Map<string, TokenRecord>();
  if (typeof entries !== 'object' || entries === null || Array.isArray(entries)) throw new Error(`${origin}: must be a JSON object {"<token id>": {"digest": "<hex sha256>", "name": "…"}}`);
  for (const [id, entry] of Object.entries(entries)) {
    if (!TOKEN_ID.test(id)) throw new Error(`${origin}: token id ${JSON.stringify(id)} must be 1-64 letters, digits or '-'`);
    map.set(id, toTokenRecord(entry, `${origin}.${id}`));
  }
  return { lookup: (id) => map.get(id) };
}

/** The `magus_tokens` KV bucket (key = token id), mirrored by a watch. Malformed entries are skipped and reported. */
export function kvTokenSource(kv: WatchableKv, onError?: (err: unknown) => void): TokenSource & { cache: KvCache<TokenRecord> } {
  const cache = watchKv<TokenRecord>(kv, {
    decode: (e) => toTokenRecord(JSON.parse(new TextDecoder().decode(e.value)), `token ${e.key}`),
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
  const m = TOKEN.exec(token);
  const record = m ? tokens.lookup(m[1]!) : undefined;
  const digest = hash('sha256', token, 'buffer'); // one-shot: no Hash object per request
  const match = timingSafeEqual(digest, record?.digest ?? NO_DIGEST);
  if (!match || !record || !m) throw errors.unauthorized('Incorrect API key provided.');
  return record.models ? { tokenId: m[1]!, name: record.name, models: record.models } : { tokenId: m[1]!, name: record.name };
}

/** Whether a principal may use a model (by name, or `namespace/name`). */
export function mayUse(p: Principal, namespace: string, name: string): boolean {
  return !p.models || p.models.length === 0 || p.models.includes(name) || p.models.includes(`${namespace}/${name}`);
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

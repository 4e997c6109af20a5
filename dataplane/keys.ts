/**
 * API keys in `magus_tokens` (key = the token's embedded id; value a `TokenEntry`,
 * shared/serving.ts). One rule for every writer — the controller (ApiKeys, labelled Secrets) and
 * `magus keys` (local keys): **an id is registered once.** A key takes a free id with KV `create`;
 * afterwards only the same owner (identity and uid) may change or delete it, each time by
 * compare-and-swap on the revision it read. A second key presenting a taken id is told who holds
 * it and writes nothing, on any number of controller replicas or CLIs at once.
 */
import { createHash } from 'node:crypto';
import { ValueErrorType } from '@sinclair/typebox/errors';
import { Value } from '@sinclair/typebox/value';
import type { KV } from 'nats';
import { KeyLimits, type RateLimits } from '../shared/limits';
import type { TokenEntry } from '../shared/serving';
import { isRevisionConflict } from './errors';

/** Who a `TokenEntry` belongs to. */
export interface KeyOwnerRef {
  key: string;
  uid: string;
}

export type Registration =
  /** The entry is the one asked for (`written`: false when it already was). */
  | { ok: true; written: boolean }
  /** The id belongs to another key; nothing was written. `holder` may be absent for an entry an older magus wrote. */
  | { ok: false; holder: { key?: string; origin?: string } };

/** The token id of `mgs_<id>_<secret>` (the gateway's and the controller's one pattern). */
export const TOKEN_PATTERN = /^mgs_([A-Za-z0-9-]{1,64})_([A-Za-z0-9_-]{1,512})$/;

/** hex sha256 of a whole token: the `TokenEntry` digest. */
export const tokenDigest = (token: string): string => createHash('sha256').update(token).digest('hex');

/**
 * Declared limits as a `TokenEntry` holds them, or what is wrong with them: checked against
 * `KeyLimits` (shared/limits.ts, what the gateway enforces and refuses an entry over), their
 * fields always in one order — {@link registerKey} compares entries as JSON, so the same limits
 * always read the same and a change always reads as one — and `undefined` when none is set (an
 * empty object limits nothing). `where` names the declaration in each problem (`spec.limits`).
 */
export function entryLimits(value: unknown, where: string): { limits: KeyLimits | undefined } | { error: string } {
  if (value === undefined || value === null) return { limits: undefined };
  if (!Value.Check(KeyLimits, value)) return { error: limitsProblems(value, where).join('; ') };
  const models = Object.entries(value.models ?? {})
    .map(([m, l]): [string, RateLimits] => [m, rateLimitsOf(l)])
    .filter(([, l]) => Object.keys(l).length > 0)
    .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  const limits: KeyLimits = {
    ...rateLimitsOf(value),
    ...(models.length > 0 ? { models: Object.fromEntries(models) } : {}),
    ...(value.storageBytes !== undefined ? { storageBytes: value.storageBytes } : {}),
  };
  return { limits: Object.keys(limits).length > 0 ? limits : undefined };
}

/** One scope's rate limits, their fields in one order. */
function rateLimitsOf({ requestsPerMinute, tokensPerMinute, concurrency, budget }: RateLimits): RateLimits {
  return {
    ...(requestsPerMinute !== undefined ? { requestsPerMinute } : {}),
    ...(tokensPerMinute !== undefined ? { tokensPerMinute } : {}),
    ...(concurrency !== undefined ? { concurrency } : {}),
    ...(budget ? { budget: { tokens: budget.tokens, period: budget.period } } : {}),
  };
}

/** Each field of `value` that `KeyLimits` refuses, once, with why. */
function limitsProblems(value: unknown, where: string): string[] {
  const byPath = new Map<string, string>();
  for (const e of Value.Errors(KeyLimits, value)) {
    // A JSON pointer: `/models/default~1llama/concurrency` is `models`, `default/llama`, `concurrency`.
    const segments = e.path
      .split('/')
      .slice(1)
      .map((p) => p.replaceAll('~1', '/').replaceAll('~0', '~'));
    const path = [where, ...segments].join('.');
    if (byPath.has(path)) continue;
    const schema = e.schema as { description?: string; enum?: string[] };
    const got = `got ${JSON.stringify(e.value)}`;
    const isModel = segments.length === 2 && segments[0] === 'models';
    byPath.set(
      path,
      e.type === ValueErrorType.ObjectAdditionalProperties
        ? isModel
          ? `${path}: a model is named namespace/name`
          : `${path} is not a limit`
        : e.type === ValueErrorType.ObjectRequiredProperty
          ? `${path} is required`
          : schema.enum
            ? `${path} must be one of ${schema.enum.join(', ')}, ${got}`
            : schema.description
              ? `${path} must be ${schema.description}, ${got}`
              : `${path}: ${e.message}, ${got}`,
    );
  }
  return [...byPath.values()];
}

/** One scope's rate limits in a few words: `rpm 60, tpm 10000, concurrency 4, budget 300/day`. */
function describeRateLimits(limits: RateLimits): string[] {
  return [
    limits.requestsPerMinute !== undefined ? `rpm ${limits.requestsPerMinute}` : '',
    limits.tokensPerMinute !== undefined ? `tpm ${limits.tokensPerMinute}` : '',
    limits.concurrency !== undefined ? `concurrency ${limits.concurrency}` : '',
    limits.budget ? `budget ${limits.budget.tokens}/${limits.budget.period}` : '',
  ].filter(Boolean);
}

/**
 * Limits in a few words, as `magus keys list` and an ApiKey's status show them:
 * `rpm 60, tpm 10000, concurrency 4, budget 300/day, storage 1000000 bytes; default/llama: rpm 5`.
 */
export function describeKeyLimits(limits: KeyLimits | undefined): string {
  const key = [...(limits ? describeRateLimits(limits) : []), ...(limits?.storageBytes !== undefined ? [`storage ${limits.storageBytes} bytes`] : [])];
  const models = Object.entries(limits?.models ?? {}).map(([m, l]) => `${m}: ${describeRateLimits(l).join(', ')}`);
  if (key.length === 0 && models.length === 0) return 'unlimited';
  return [key.join(', '), ...models].filter(Boolean).join('; ');
}

const decoder = new TextDecoder();

/** A stored entry, or undefined when there is none (never written, deleted, or not JSON). */
async function read(kv: KV, id: string): Promise<{ entry: TokenEntry | null; revision: number } | undefined> {
  const e = await kv.get(id);
  if (!e || e.operation !== 'PUT') return undefined;
  try {
    return { entry: JSON.parse(decoder.decode(e.value)) as TokenEntry, revision: e.revision };
  } catch {
    return { entry: null, revision: e.revision };
  }
}

/** Whether `entry` is `owner`'s; `null` stands for no owner: an entry an older magus wrote (no uid). */
const owns = (entry: TokenEntry | null, owner: KeyOwnerRef | null): boolean =>
  owner === null ? entry !== null && entry.uid === undefined : entry?.key === owner.key && entry?.uid === owner.uid;

/**
 * Registers `entry` (which names its owner: `key` and `uid`) under token id `id`. `adopts`
 * decides whether an existing entry with no owner — written by an older magus — is this key's
 * own (e.g. the same origin); anything else held by another owner is a conflict.
 */
export async function registerKey(
  kv: KV,
  id: string,
  entry: TokenEntry & KeyOwnerRef,
  adopts: (existing: TokenEntry) => boolean = () => false,
): Promise<Registration> {
  const data = JSON.stringify(entry);
  for (;;) {
    const current = await read(kv, id);
    try {
      if (!current) {
        await kv.create(id, data);
        return { ok: true, written: true };
      }
      const mine = owns(current.entry, entry) || (owns(current.entry, null) && adopts(current.entry!));
      if (!mine)
        return {
          ok: false,
          holder: { ...(current.entry?.key ? { key: current.entry.key } : {}), ...(current.entry?.origin ? { origin: current.entry.origin } : {}) },
        };
      if (JSON.stringify(current.entry) === data) return { ok: true, written: false };
      await kv.update(id, data, current.revision);
      return { ok: true, written: true };
    } catch (err) {
      // Another writer got there between the read and the write: read again and decide again.
      if (!isRevisionConflict(err)) throw err;
    }
  }
}

/**
 * Deletes the entry of `id` if `owner` holds it (`null`: if it names no owner, as an older magus
 * wrote it); true when it did. Another owner's entry is left alone.
 */
export async function unregisterKey(kv: KV, id: string, owner: KeyOwnerRef | null): Promise<boolean> {
  for (;;) {
    const current = await read(kv, id);
    if (!current || !owns(current.entry, owner)) return false;
    try {
      await kv.delete(id, { previousSeq: current.revision });
      return true;
    } catch (err) {
      if (!isRevisionConflict(err)) throw err;
    }
  }
}

/** Every entry of the bucket with its id (entries that are not JSON are skipped). */
export async function listKeys(kv: KV): Promise<{ id: string; entry: TokenEntry; revision: number }[]> {
  const ids: string[] = [];
  for await (const k of await kv.keys()) ids.push(k);
  const out: { id: string; entry: TokenEntry; revision: number }[] = [];
  for (const id of ids.sort()) {
    const current = await read(kv, id);
    if (current?.entry) out.push({ id, entry: current.entry, revision: current.revision });
  }
  return out;
}

/** How a conflict reads to the one refused, naming the holder only when `visible` says the reader may know of it. */
export function conflictMessage(id: string, holder: { key?: string; origin?: string }, visible: (key: string) => boolean): string {
  const who = holder.key === undefined ? 'a key an older magus registered' : visible(holder.key) ? `key ${holder.key}` : 'a key in another namespace';
  return `token id '${id}' is already registered to ${who}; an id is registered once — give this key a token with a new random id`;
}

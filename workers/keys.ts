/**
 * `magus keys create NAME [--models m1,m2] [limits] | limits NAME (limits | --none) | list [--json]
 * | revoke NAME`: API keys without Kubernetes (local mode: `magus dev`, or `magus gateway` next to
 * a NATS server). A key is `local/<NAME>` in the same store the controller writes ApiKeys to
 * (`magus_tokens`, dataplane/keys.ts): its token id is random and registered once, so it can
 * neither take nor be taken by another key. The token is printed once, on stdout, and stored only
 * as its sha256. Its limits (`--rpm`, `--tpm`, `--concurrency`, `--budget-tokens` with
 * `--period`, `--storage-bytes`, and per model `--model-limits`) are checked whole against KeyLimits' bounds (shared/limits.ts) before anything is
 * written, and stored in its entry, where every gateway enforces them.
 * On a cluster, declare an `ApiKey` instead (README "Tenants").
 *
 * Where NATS is: `MAGUS_NATS_URL` (and `MAGUS_NATS_PREFIX`), else the running `magus dev`.
 */
import { randomBytes, randomUUID } from 'node:crypto';
import type { KV } from 'nats';
import { describeKeyLimits, entryLimits, listKeys, registerKey, tokenDigest, unregisterKey, type KeyOwnerRef } from '../dataplane/keys';
import { UsageError, usageFailure } from '../platform/cli';
import { KeyLimits, type BudgetPeriod } from '../shared/limits';
import { keyOwner, type TokenEntry } from '../shared/serving';
import { alignedLines, onDataPlaneBucket } from './data-plane-cli';

/** The flags of a whole-number limit: what it counts, and its bounds (KeyLimits', the ones the gateway and the ApiKey CRD hold). */
const WHOLE_LIMITS = {
  '--rpm': { what: 'requests per minute', schema: KeyLimits.properties.requestsPerMinute },
  '--tpm': { what: 'tokens per minute', schema: KeyLimits.properties.tokensPerMinute },
  '--concurrency': { what: 'requests in flight at once', schema: KeyLimits.properties.concurrency },
  '--budget-tokens': { what: 'tokens per period', schema: KeyLimits.properties.budget.properties.tokens },
  '--storage-bytes': { what: 'bytes of stored responses', schema: KeyLimits.properties.storageBytes },
} as const;
type WholeLimitFlag = keyof typeof WHOLE_LIMITS;
const PERIODS: readonly BudgetPeriod[] = ['day', 'month'];
const bounds = (flag: WholeLimitFlag) => `${WHOLE_LIMITS[flag].schema.minimum}-${WHOLE_LIMITS[flag].schema.maximum}`;

export const KEYS_USAGE = [
  'usage: magus keys create NAME [--models MODEL,…] [LIMITS]   a new key: its token is printed once',
  "       magus keys limits NAME (LIMITS | --none)            a local key's limits, replaced by these (--none: unlimited)",
  '       magus keys list [--json]                             the keys (local ones, ApiKeys and labelled Secrets)',
  "       magus keys revoke NAME                               a local key's token stops working at once",
  '',
  'Local keys (identity local/NAME) are for magus without Kubernetes; on a cluster declare an ApiKey.',
  'MODEL: a model name (in any namespace), NAMESPACE/NAME or NAMESPACE/*; without --models every model.',
  'LIMITS, per key across its models and every gateway (one left out is unlimited):',
  `  --rpm N                       requests per minute (${bounds('--rpm')})`,
  `  --tpm N                       tokens per minute, prompt and completion (${bounds('--tpm')})`,
  `  --concurrency N               requests in flight at once (${bounds('--concurrency')})`,
  `  --budget-tokens N --period P  a budget of N tokens (${bounds('--budget-tokens')}) per UTC day or calendar month: P day or month`,
  `  --storage-bytes N             bytes its stored responses (POST /v1/responses) may keep (${bounds('--storage-bytes')})`,
  "  --model-limits MODEL:L,…      limits of one model, beside the key's (repeat per model): MODEL a name of magus dev's",
  '                                (namespace default) or NAMESPACE/NAME; L rpm=N, tpm=N, concurrency=N or budget=N/day|month',
  "  A request's worst case is reserved when admitted and settled to its real usage; a budget is",
  '  never exceeded. Over a limit: 429 rate_limit_exceeded (insufficient_quota for a budget or the storage).',
  'NATS: MAGUS_NATS_URL and MAGUS_NATS_PREFIX, else the running magus dev (its connection.json).',
].join('\n');

const NAME = /^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$/;
const MODEL = /^(([a-z0-9]([-a-z0-9]*[a-z0-9])?)\/)?([A-Za-z0-9][A-Za-z0-9._-]{0,252}|\*)$/;
const LOCAL = 'local/';
/** Options followed by a value. */
const VALUE_FLAGS = new Set<string>(['--models', '--period', '--model-limits', ...Object.keys(WHOLE_LIMITS)]);
/** The namespace of a model `--model-limits` names without one: magus dev's. */
const DEV_NAMESPACE = 'default';

export type KeysArgs =
  | { command: 'create'; name: string; models?: string[]; limits?: KeyLimits }
  /** `limits` undefined: `--none`, the key is unlimited. */
  | { command: 'limits'; name: string; limits: KeyLimits | undefined }
  | { command: 'list'; json: boolean }
  | { command: 'revoke'; name: string };

/** The limits the flags in `given` (flag → value) declare; undefined when none. */
function limitsOf(given: ReadonlyMap<string, string>, modelLimits: readonly string[] = []): KeyLimits | undefined {
  const whole = (flag: WholeLimitFlag): number | undefined => {
    const v = given.get(flag);
    if (v === undefined) return undefined;
    const { what, schema } = WHOLE_LIMITS[flag];
    const n = /^[0-9]+$/.test(v) ? Number(v) : NaN;
    if (!(n >= schema.minimum! && n <= schema.maximum!))
      throw new UsageError(`${flag} must be a whole number from ${schema.minimum} to ${schema.maximum} (${what}), got ${JSON.stringify(v)}`);
    return n;
  };
  const [rpm, tpm, concurrency, budgetTokens, storageBytes] = (['--rpm', '--tpm', '--concurrency', '--budget-tokens', '--storage-bytes'] as const).map(whole);
  const period = given.get('--period');
  if (period !== undefined && !PERIODS.includes(period as BudgetPeriod)) throw new UsageError(`--period must be day or month, got ${JSON.stringify(period)}`);
  if (budgetTokens !== undefined && period === undefined)
    throw new UsageError('--budget-tokens needs --period day or --period month: the budget renews each UTC day or each calendar month');
  if (period !== undefined && budgetTokens === undefined) throw new UsageError('--period is the period of a budget: give --budget-tokens N with it');
  const checked = entryLimits(
    {
      ...(rpm !== undefined ? { requestsPerMinute: rpm } : {}),
      ...(tpm !== undefined ? { tokensPerMinute: tpm } : {}),
      ...(concurrency !== undefined ? { concurrency } : {}),
      ...(budgetTokens !== undefined ? { budget: { tokens: budgetTokens, period } } : {}),
      ...(storageBytes !== undefined ? { storageBytes } : {}),
      ...(modelLimits.length > 0 ? { models: Object.fromEntries(modelLimits.map(modelLimitsOf)) } : {}),
    },
    'limits',
  );
  // The flags were checked one by one against the same bounds (a model's limits, and its name, in modelLimitsOf).
  if ('error' in checked) throw new UsageError(checked.error.replaceAll('limits.models.', '--model-limits '));
  return checked.limits;
}

/** `--model-limits MODEL:rpm=N,tpm=N,concurrency=N,budget=N/day` as `[namespace/name, its limits]`. */
function modelLimitsOf(v: string): [string, unknown] {
  const colon = v.indexOf(':');
  const model = colon < 0 ? '' : v.slice(0, colon);
  if (!/^([a-z0-9]([-a-z0-9]*[a-z0-9])?\/)?[a-z0-9]([-a-z0-9]*[a-z0-9])?$/.test(model))
    throw new UsageError(`--model-limits ${JSON.stringify(v)}: give MODEL:LIMITS, MODEL a model's name or NAMESPACE/NAME`);
  const limits: Record<string, unknown> = {};
  for (const part of v.slice(colon + 1).split(',')) {
    const m = /^(rpm|tpm|concurrency|budget)=([0-9]+)(?:\/(day|month))?$/.exec(part.trim());
    if (!m || (m[1] === 'budget') !== (m[3] !== undefined))
      throw new UsageError(`--model-limits ${JSON.stringify(v)}: ${JSON.stringify(part)} is not rpm=N, tpm=N, concurrency=N or budget=N/day|month`);
    const n = Number(m[2]);
    if (m[1] === 'budget') limits.budget = { tokens: n, period: m[3] };
    else limits[{ rpm: 'requestsPerMinute', tpm: 'tokensPerMinute', concurrency: 'concurrency' }[m[1] as 'rpm']] = n;
  }
  return [model.includes('/') ? model : `${DEV_NAMESPACE}/${model}`, limits];
}

export function parseKeysArgs(args: string[]): KeysArgs {
  const [command, ...rest] = args;
  const name = (): string => {
    // The value after an option is not the name (`create --models m1 NAME`).
    const n = rest.find((a, i) => !a.startsWith('-') && !VALUE_FLAGS.has(rest[i - 1] ?? ''));
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
  if (command === 'create' || command === 'limits') {
    const n = name();
    let models: string[] | undefined;
    const modelLimits: string[] = [];
    let none = false;
    const given = new Map<string, string>();
    for (let i = 0; i < rest.length; i++) {
      const a = rest[i]!;
      if (a === n) continue;
      if (a === '--none' && command === 'limits') none = true;
      else if (a === '--period' || Object.hasOwn(WHOLE_LIMITS, a)) {
        const v = rest[++i];
        if (v === undefined) throw new UsageError(`${a} needs a value`);
        if (given.has(a)) throw new UsageError(`${a} is given twice`);
        given.set(a, v);
      } else if (a === '--model-limits') {
        const v = rest[++i];
        if (v === undefined) throw new UsageError('--model-limits needs a value: MODEL:rpm=N,…');
        modelLimits.push(v);
      } else if (a === '--models' && command === 'create') {
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
    const limits = limitsOf(given, modelLimits);
    if (command === 'create') return { command, name: n, ...(models ? { models } : {}), ...(limits ? { limits } : {}) };
    if (none && limits) throw new UsageError('--none makes the key unlimited: give it alone, or the limits without it');
    if (!none && !limits)
      throw new UsageError(
        'magus keys limits needs the limits to set (--rpm, --tpm, --concurrency, --budget-tokens with --period, --storage-bytes, --model-limits) or --none',
      );
    return { command, name: n, limits };
  }
  throw new UsageError(command === undefined ? 'magus keys needs a command: create, limits, list or revoke' : `unknown command keys ${command}`);
}

/** A new token: a random id (64 bits, hex) and a random secret (256 bits). */
export const newToken = (): { id: string; token: string } => {
  const id = randomBytes(8).toString('hex');
  return { id, token: `mgs_${id}_${randomBytes(32).toString('base64url')}` };
};

/** Creates local key `name`; the token, or why not. */
export async function createLocalKey(
  kv: KV,
  name: string,
  { models, limits }: { models?: string[]; limits?: KeyLimits } = {},
): Promise<{ token: string; id: string } | { error: string }> {
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
      ...(limits ? { limits } : {}),
      origin: 'local',
    };
    // A random 64-bit id is taken only by chance; registration never overwrites one that is.
    if ((await registerKey(kv, id, entry)).ok) return { token, id };
  }
  return { error: 'three random token ids in a row were taken; this should not happen' };
}

/**
 * Replaces the limits of local key `name` (every token of it) with `limits` (undefined: none);
 * how many of its tokens have them now (0: there is no such key). Each entry is rewritten by compare-and-swap as its owner, so a
 * key revoked or created anew meanwhile is left alone.
 */
export async function setLocalKeyLimits(kv: KV, name: string, limits: KeyLimits | undefined): Promise<number> {
  let n = 0;
  for (const { id, entry } of await listKeys(kv)) {
    if (entry.key !== `${LOCAL}${name}` || entry.uid === undefined) continue;
    const { limits: _was, origin, ...rest } = entry;
    const next: TokenEntry & KeyOwnerRef = {
      ...rest,
      key: entry.key,
      uid: entry.uid,
      ...(limits ? { limits } : {}),
      ...(origin !== undefined ? { origin } : {}),
    };
    if ((await registerKey(kv, id, next)).ok) n++;
  }
  return n;
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
  return onDataPlaneBucket(
    'magus keys',
    (names) => names.tokensBucket,
    'start magus dev (or a gateway) first',
    async (kv) => {
      if (parsed.command === 'create') {
        const made = await createLocalKey(kv, parsed.name, parsed);
        if ('error' in made) {
          process.stderr.write(`magus keys: ${made.error}\n`);
          return 1;
        }
        const models = parsed.models ? `models ${parsed.models.join(', ')}` : 'every model';
        const limits = parsed.limits ? `limits: ${describeKeyLimits(parsed.limits)}` : 'no limits';
        process.stderr.write(`key local/${parsed.name} created (token id ${made.id}; ${models}; ${limits}). Its token, shown only this once:\n`);
        process.stdout.write(`${made.token}\n`);
        return 0;
      }
      if (parsed.command === 'limits') {
        if ((await setLocalKeyLimits(kv, parsed.name, parsed.limits)) === 0) {
          process.stderr.write(`magus keys: no local key named ${parsed.name} (magus keys list shows them; an ApiKey's limits are its spec.limits)\n`);
          return 1;
        }
        process.stderr.write(
          `key local/${parsed.name}: ${parsed.limits ? `limits ${describeKeyLimits(parsed.limits)}` : 'no limits'}, at every gateway within seconds\n`,
        );
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
        ...(entry.limits ? { limits: entry.limits } : {}),
        suspended: entry.suspended === true,
        origin: entry.origin ?? 'unknown',
        owner: keyOwner(entry.key ?? `token/${id}`, entry.uid ?? id),
      }));
      if (parsed.json) process.stdout.write(`${JSON.stringify(keys, null, 2)}\n`);
      else {
        const rows = [
          ['KEY', 'TOKEN ID', 'MODELS', 'LIMITS', 'SUSPENDED', 'FROM'],
          ...keys.map((k) => [k.key, k.tokenId, k.models.join(','), describeKeyLimits(k.limits), k.suspended ? 'yes' : 'no', k.origin.split('/')[0]!]),
        ];
        process.stdout.write(alignedLines(rows, new Set()));
      }
      return 0;
    },
  );
}

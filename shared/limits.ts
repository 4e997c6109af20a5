/**
 * Per-key limits — requests per minute, tokens per minute, concurrent requests and a token budget
 * per UTC day or month — as pure functions over the state of one limited scope (a JSON document;
 * dataplane/limits.ts keeps one per key in KV `magus_limits` and changes it by compare-and-swap
 * only, so N gateway replicas enforce one limit with no central process). No I/O and no Node
 * builtins: usable on both sides of a workflow boundary.
 *
 * A request is admitted by *reserving* its worst case (its prompt's tokens plus the most it may
 * generate), and settled to its real usage when its answer ends, is cancelled or fails. Every
 * reservation carries a lease its gateway renews; one whose lease passed (its gateway died) is
 * released by the next {@link admit}, {@link settle} or {@link sweep} of its scope, charged at its
 * full worst case.
 *
 * Invariants:
 * - **A budget is never exceeded**: admission keeps `used + Σ reserved ≤ budget.tokens`; a settle
 *   moves at most the reservation into `used` (callers cap a request's output so that its real
 *   usage never exceeds its reservation), an expired lease moves exactly it. Since every change
 *   of the document is a compare-and-swap, this holds at any concurrency, on any number of
 *   replicas. (Lowering a budget below what is used only refuses until the next period.)
 * - **Idempotent per request id**: admitting an id that is reserved returns ok and counts nothing
 *   again; settling an id that is not reserved (already settled, or released) is a no-op, so a
 *   retried settle never charges twice. An id admitted again *after* its settle is a new request.
 * - **Retry-After is computed**, never a constant: the time a bucket needs to refill what is
 *   asked, the end of the budget's period, or the expected time until a concurrent request ends.
 * - Token buckets are exact: levels are whole numbers of 1/60 000 of a token (or request), so
 *   refill (`limit` units per ms), refunds and Retry-After are integer arithmetic.
 *
 * Times are epoch ms of the caller's clock (whole ms: fractions are dropped); replicas must keep
 * clocks in step (NTP) to well within a lease. A clock behind another's never refills a bucket
 * backwards.
 */
import { Type, type Static } from '@sinclair/typebox';
import { Value } from '@sinclair/typebox/value';
import { StringEnum } from './chat';

/** Most requests or tokens per minute: × {@link BUCKET_SCALE} stays an exact integer. */
export const MAX_PER_MINUTE = 100_000_000_000;
/** Most tokens a budget may hold: sums of usage stay exact integers. */
export const MAX_BUDGET_TOKENS = 1_000_000_000_000_000;
/** Most bytes of stored responses a key may be allowed: sums stay exact integers. */
export const MAX_STORAGE_BYTES = 1_000_000_000_000_000;
/** Most models one key may have limits of its own for (as many as an ApiKey may name). */
export const MAX_LIMITED_MODELS = 64;
/** A model as per-model limits name it: `namespace/name`, as the gateway serves it. */
export const MODEL_REF_PATTERN = '^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9]*[a-z0-9])?$';

const perMinute = (what: string) =>
  Type.Optional(Type.Integer({ minimum: 1, maximum: MAX_PER_MINUTE, description: `a whole number of ${what} per minute from 1 to ${MAX_PER_MINUTE}` }));

const rateLimitFields = {
  requestsPerMinute: perMinute('requests'),
  /** Counted on each request's worst case at admission, then refunded down to its real usage. */
  tokensPerMinute: perMinute('tokens'),
  /** Requests in flight at once. */
  concurrency: Type.Optional(Type.Integer({ minimum: 1, maximum: 1_000_000, description: 'a whole number from 1 to 1000000' })),
  /** Tokens (prompt and completion) per UTC day or calendar month. */
  budget: Type.Optional(
    Type.Object(
      {
        tokens: Type.Integer({ minimum: 1, maximum: MAX_BUDGET_TOKENS, description: `a whole number from 1 to ${MAX_BUDGET_TOKENS}` }),
        period: StringEnum(['day', 'month']),
      },
      { additionalProperties: false },
    ),
  ),
};

/** The limits of one scope: a key across all its models, or a key on one model; an absent field is unlimited. */
export const RateLimits = Type.Object(rateLimitFields, { additionalProperties: false });
export type RateLimits = Static<typeof RateLimits>;

/**
 * A key's limits; an absent field is unlimited. Its rates, concurrency and budget hold across all
 * its models; `models` adds limits of its own to the key's requests of each model named (both
 * hold: a request is admitted only when the key's and its model's allow it); `storageBytes`
 * bounds the bytes its stored responses (`POST /v1/responses`) keep.
 */
export const KeyLimits = Type.Object(
  {
    ...rateLimitFields,
    models: Type.Optional(
      Type.Record(Type.String({ pattern: MODEL_REF_PATTERN }), RateLimits, {
        maxProperties: MAX_LIMITED_MODELS,
        additionalProperties: false,
        description: `at most ${MAX_LIMITED_MODELS} models, each named namespace/name`,
      }),
    ),
    storageBytes: Type.Optional(
      Type.Integer({ minimum: 1, maximum: MAX_STORAGE_BYTES, description: `a whole number of bytes from 1 to ${MAX_STORAGE_BYTES}` }),
    ),
  },
  { additionalProperties: false },
);
export type KeyLimits = Static<typeof KeyLimits>;
export type BudgetPeriod = NonNullable<KeyLimits['budget']>['period'];

/** Units of a bucket level per request or token: a bucket of `limit` per minute refills `limit` units per ms. */
export const BUCKET_SCALE = 60_000;

/** A token bucket refilling continuously to its capacity (the per-minute limit) in one minute. */
const Bucket = Type.Object({
  /** Units ({@link BUCKET_SCALE} per request or token) at `at`; below 0 when a request used more than it reserved. */
  level: Type.Integer(),
  /** Epoch ms of `level`. */
  at: Type.Integer(),
});
export type Bucket = Static<typeof Bucket>;

/** A live request's worst case, held until it settles or its lease passes. */
const Reservation = Type.Object({
  tokens: Type.Integer({ minimum: 0 }),
  /** The gateway replica that renews it. */
  replica: Type.String(),
  /** Epoch ms after which it is released (charged in full) unless renewed. */
  leaseUntil: Type.Integer(),
  /** Epoch ms of its admission. */
  at: Type.Integer(),
  /** Its model, when that model has limits of its own (`KeyLimits.models`): it counts there too. */
  model: Type.Optional(Type.String()),
  /**
   * Concurrent slots it holds: absent for a request (one); a slice's (see {@link leaseSlice}) as
   * many as it leased, 0 when no concurrency limit applies.
   */
  slots: Type.Optional(Type.Integer({ minimum: 0 })),
});
export type Reservation = Static<typeof Reservation>;

/** What one scope (the key, or the key on one model) has counted. */
const counterFields = {
  /** Requests-per-minute bucket; absent while unlimited (or untouched: full). */
  requests: Type.Optional(Bucket),
  /** Tokens-per-minute bucket, likewise. */
  tokens: Type.Optional(Bucket),
  /** The budget's current period (`2026-11-29` or `2026-11`, UTC) and the tokens charged in it. */
  budget: Type.Optional(Type.Object({ period: Type.String(), used: Type.Integer({ minimum: 0 }) })),
  /**
   * Mean duration of this scope's settled requests (admission to settle, ms): an exponentially
   * weighted moving average with weight 1/8, as TCP smooths its round-trip time (RFC 6298).
   * Released leases do not count (their end is unknown). Retry-After of a concurrency refusal.
   */
  meanDurationMs: Type.Optional(Type.Number({ minimum: 0 })),
};
const Counters = Type.Object(counterFields);
export type Counters = Static<typeof Counters>;

/** The state of one limited scope (one key): the document stored in `magus_limits`. */
export const LimitState = Type.Object({
  ...counterFields,
  /** Live reservations by request id (of every model). */
  reservations: Type.Record(Type.String(), Reservation),
  /** The counters of each model the key has limits of its own for (`KeyLimits.models`). */
  models: Type.Optional(Type.Record(Type.String(), Counters)),
  /**
   * Bytes of stored responses charged to the key, by the UTC day (`2026-12-29`) on which they
   * have all expired: a day's bytes stop counting when it is over (at most a day after the last of
   * them expired; never before).
   */
  stored: Type.Optional(Type.Record(Type.String(), Type.Integer({ minimum: 0 }))),
});
export type LimitState = Static<typeof LimitState>;

/** The state of a scope never written. */
export const emptyLimitState = (): LimitState => ({ reservations: {} });

/** A stored document as a {@link LimitState}, or undefined when it is not one. */
export function decodeLimitState(text: string): LimitState | undefined {
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch {
    return undefined;
  }
  return Value.Check(LimitState, value) ? value : undefined;
}

/** What {@link admit} is asked to reserve. */
export interface AdmitRequest {
  /** The request id (idempotency key). */
  id: string;
  /** Its worst case: prompt tokens (bounded from its size until counted) plus max_tokens or the context room left. */
  tokens: number;
  /**
   * Set when its output has no bound of its own (no max_tokens): reserve as much as the budget
   * and the tokens-per-minute bucket have room for, from `tokens` up to `upTo` (the caller then
   * caps the output at what was reserved, `Admission.tokens`). A request that fits its minimum is
   * served, cut at what the key has left, rather than refused for a worst case it may never use.
   */
  upTo?: number;
  /** Its model (`namespace/name`): the model's own limits (`KeyLimits.models`) hold too. */
  model?: string;
  /**
   * Set when its answer will be stored (a Responses request with `store`): the bytes of the
   * request the stored response keeps. Refused while the key's stored bytes and these exceed
   * `KeyLimits.storageBytes`.
   */
  storeBytes?: number;
  /** The gateway replica that will renew its lease. */
  replica: string;
  /** How long it holds without a renewal. */
  leaseMs: number;
}

/** OpenAI's `x-ratelimit-*` response headers (only those whose limit is set). */
export type RateLimitHeaders = Record<string, string>;

export type RefusalCode = 'rate_limit_exceeded' | 'insufficient_quota';

export type Admission =
  | {
      ok: true;
      state: LimitState;
      headers: RateLimitHeaders;
      /** The tokens reserved: `tokens`, or with `upTo`, as many as there was room for (at least `tokens`). */
      tokens: number;
    }
  | {
      ok: false;
      /** 429 either way: `rate_limit_exceeded` for a rate or concurrency limit, `insufficient_quota` for the budget. */
      code: RefusalCode;
      message: string;
      /** When asking again may succeed; null when waiting cannot help (the request alone exceeds a limit). */
      retryAfterMs: number | null;
      headers: RateLimitHeaders;
    };

export interface Settlement {
  state: LimitState;
  /** False when the id was not reserved (settled before, or released): nothing was charged. */
  settled: boolean;
  headers: RateLimitHeaders;
}

const hasOwn = (o: object, k: string): boolean => Object.prototype.hasOwnProperty.call(o, k);

function checkWhole(what: string, n: number, min: number): void {
  if (!Number.isSafeInteger(n) || n < min) throw new RangeError(`${what} must be a whole number ≥ ${min}, got ${n}`);
}

/** The last period {@link budgetPeriodOf} computed per kind, and when it starts: nearly every call falls in it. */
const lastPeriods: Partial<Record<BudgetPeriod, { startsAt: number; period: { readonly id: string; readonly endsAt: number } }>> = {};

/** The UTC period `nowMs` falls in: its id (`2026-11-29`, `2026-11`) and when it ends (epoch ms). Shared: not to be changed. */
export function budgetPeriodOf(period: BudgetPeriod, nowMs: number): { readonly id: string; readonly endsAt: number } {
  // A Date and its ISO string per call were a measurable part of an admission's CPU: the last period is kept.
  const last = lastPeriods[period];
  if (last && nowMs >= last.startsAt && nowMs < last.period.endsAt) return last.period;
  const d = new Date(nowMs);
  const [y, m, day] = [d.getUTCFullYear(), d.getUTCMonth(), d.getUTCDate()];
  const iso = d.toISOString();
  const computed =
    period === 'day'
      ? { startsAt: Date.UTC(y, m, day), period: { id: iso.slice(0, 10), endsAt: Date.UTC(y, m, day + 1) } }
      : { startsAt: Date.UTC(y, m, 1), period: { id: iso.slice(0, 7), endsAt: Date.UTC(y, m + 1, 1) } };
  lastPeriods[period] = computed;
  return computed.period;
}

/** The kind of period a stored period id is (`YYYY-MM-DD` a day, `YYYY-MM` a month). */
const periodKindOf = (id: string): BudgetPeriod => (id.length === 10 ? 'day' : 'month');

/** `b` refilled to `nowMs` (a full bucket when there is none yet; never above the capacity of `limit`). */
function refill(b: Bucket | undefined, limit: number, nowMs: number): Bucket {
  const capacity = limit * BUCKET_SCALE;
  if (!b) return { level: capacity, at: nowMs };
  const at = Math.max(b.at, nowMs);
  const gained = (at - b.at) * limit;
  return { level: gained >= capacity - b.level ? capacity : b.level + gained, at };
}

/** Whole ms until `b` holds `units` (0 when it does): the least t with level + t × limit ≥ units, in exact integers. */
function msUntil(b: Bucket, limit: number, units: number): number {
  const deficit = units - b.level;
  if (deficit <= 0) return 0;
  let t = Math.ceil(deficit / limit);
  // The float quotient may round across a whole number; the products are exact.
  while (t > 0 && (t - 1) * limit >= deficit) t -= 1;
  while (t * limit < deficit) t += 1;
  return t;
}

/** The budget in the current period: `used` back to 0 in a new one (and when the period kind changed). */
function rollBudget(budget: LimitState['budget'], kind: BudgetPeriod | undefined, nowMs: number): LimitState['budget'] {
  if (!kind) return undefined;
  const { id } = budgetPeriodOf(kind, nowMs);
  return budget?.period === id ? budget : { period: id, used: 0 };
}

/** `budget` with `charged` more tokens used (none: unchanged). */
const charge = (budget: LimitState['budget'], charged: number): LimitState['budget'] =>
  budget && charged > 0 ? { period: budget.period, used: budget.used + charged } : budget;

/**
 * Releases every reservation whose lease passed at `nowMs` (its gateway died or lost touch): each
 * is charged to the current budget period — the key's, and its model's when it has one — at its
 * **full reserved worst case** (its real usage is unknown, and charging less could let a budget be
 * exceeded), and nothing returns to the tokens-per-minute buckets. A reservation is so released
 * within one lease of its last renewal, by the first write to its scope after that.
 */
export function sweep(state: LimitState, nowMs: number): LimitState {
  nowMs = Math.floor(nowMs);
  const roll = (b: LimitState['budget']) => b && rollBudget(b, periodKindOf(b.period), nowMs);
  const budget = roll(state.budget);
  let rolled = budget !== state.budget;
  let charged = 0;
  const byModel = new Map<string, number>();
  const live: [string, Reservation][] = [];
  for (const [id, r] of Object.entries(state.reservations)) {
    if (r.leaseUntil > nowMs) live.push([id, r]);
    else {
      charged += r.tokens;
      if (r.model !== undefined) byModel.set(r.model, (byModel.get(r.model) ?? 0) + r.tokens);
    }
  }
  const models =
    state.models &&
    Object.entries(state.models).map(([m, c]): [string, Counters] => {
      const b = roll(c.budget);
      if (b !== c.budget) rolled = true;
      return [m, b === c.budget && !byModel.has(m) ? c : { ...c, budget: charge(b, byModel.get(m) ?? 0) }];
    });
  if (charged === 0 && !rolled) return state;
  return {
    ...state,
    reservations: Object.fromEntries(live),
    ...(budget ? { budget: charge(budget, charged) } : {}),
    ...(models ? { models: Object.fromEntries(models) } : {}),
  };
}

/** `c` at `nowMs` under `limits`: buckets refilled, the budget in its period; what is unlimited dropped. */
function normalizeCounters(c: Counters | undefined, limits: RateLimits, nowMs: number): Counters {
  const out: Counters = {};
  if (limits.requestsPerMinute) out.requests = refill(c?.requests, limits.requestsPerMinute, nowMs);
  if (limits.tokensPerMinute) out.tokens = refill(c?.tokens, limits.tokensPerMinute, nowMs);
  const budget = rollBudget(c?.budget, limits.budget?.period, nowMs);
  if (budget) out.budget = budget;
  if (c?.meanDurationMs !== undefined) out.meanDurationMs = c.meanDurationMs;
  return out;
}

/** The counters of the key's own scope in `s` (nothing else of the document). */
function keyCounters(s: LimitState): Counters {
  const c: Counters = {};
  if (s.requests) c.requests = s.requests;
  if (s.tokens) c.tokens = s.tokens;
  if (s.budget) c.budget = s.budget;
  if (s.meanDurationMs !== undefined) c.meanDurationMs = s.meanDurationMs;
  return c;
}

/** The UTC day (`2026-11-29`) of `ms`. */
const dayOf = (ms: number): string => budgetPeriodOf('day', ms).id;

/** `stored` without the days that are over at `nowMs` (none left: undefined). */
function liveStored(stored: LimitState['stored'], nowMs: number): LimitState['stored'] {
  if (!stored) return undefined;
  const today = dayOf(nowMs);
  const live = Object.entries(stored).filter(([day, bytes]) => day >= today && bytes > 0);
  return live.length === 0 ? undefined : live.length === Object.keys(stored).length ? stored : Object.fromEntries(live);
}

/** `state` at `nowMs` under `limits`: leases swept, buckets refilled, budgets in their period; what is unlimited dropped. */
function normalize(state: LimitState, limits: KeyLimits, nowMs: number): LimitState {
  const swept = sweep(state, nowMs);
  const out: LimitState = { ...normalizeCounters(keyCounters(swept), limits, nowMs), reservations: swept.reservations };
  if (limits.models) {
    const models = Object.entries(limits.models).map(([m, l]): [string, Counters] => [m, normalizeCounters(swept.models?.[m], l, nowMs)]);
    if (models.length > 0) out.models = Object.fromEntries(models);
  }
  const stored = liveStored(swept.stored, nowMs);
  if (stored) out.stored = stored;
  return out;
}

/** The limits `limits` has of its own for `model`, if any. */
export const modelLimitsOf = (limits: KeyLimits, model: string | undefined): RateLimits | undefined =>
  model !== undefined && limits.models && hasOwn(limits.models, model) ? limits.models[model] : undefined;

/** The tokens `live` reservations hold. */
export const reservedTokens = (live: readonly Reservation[]): number => live.reduce((sum, r) => sum + r.tokens, 0);

/** The concurrent slots `live` reservations hold (a request one, a slice its `slots`). */
export const reservedSlots = (live: readonly Reservation[]): number => live.reduce((sum, r) => sum + (r.slots ?? 1), 0);

/** The bytes of stored responses charged to `state`'s key that have not expired at `nowMs`. */
export const storedBytes = (state: LimitState, nowMs: number): number =>
  Object.values(liveStored(state.stored, Math.floor(nowMs)) ?? {}).reduce((sum, b) => sum + b, 0);

/**
 * One scope a request is held to: the key across its models, or the key on the request's model.
 * `live` are the reservations that count in it.
 */
interface Scope {
  limits: RateLimits;
  counters: Counters;
  live: Reservation[];
  /** Where a message names the scope: '' for the key, ` for <model>` for a model. */
  of: string;
}

/** The scopes of `s` (normalized) a request of `model` is held to: the key's, then the model's when it has limits. */
function scopesOf(s: LimitState, limits: KeyLimits, model: string | undefined): Scope[] {
  const all = Object.values(s.reservations);
  const scopes: Scope[] = [{ limits, counters: keyCounters(s), live: all, of: '' }];
  const own = modelLimitsOf(limits, model);
  if (own) scopes.push({ limits: own, counters: s.models![model!]!, live: all.filter((r) => r.model === model), of: ` for ${model}` });
  return scopes;
}

/**
 * Ms until one of a scope's `live` requests in flight is expected to end: with a measured mean
 * duration D, D / n (durations taken as memoryless: each has D left on average, and the first of
 * n ends after D / n); before any request of the scope settled, D is estimated by the age of the
 * oldest one (a request seen at a random point of its life has about as long again to run). At
 * least 1 ms.
 */
function concurrencyWaitMs(scope: Scope, nowMs: number): number {
  const mean = scope.counters.meanDurationMs ?? Math.max(0, ...scope.live.map((r) => nowMs - r.at));
  return Math.max(1, Math.ceil(mean / Math.max(1, reservedSlots(scope.live))));
}

/** `s` with `scope`'s counters replaced by `c`. */
function withCounters(s: LimitState, scope: number, model: string | undefined, c: Counters): LimitState {
  if (scope === 0) return { ...s, ...c };
  return { ...s, models: { ...s.models, [model!]: c } };
}

/**
 * Admits request `req` at `nowMs` if every limit allows its worst case — the key's, and its
 * model's when `limits.models` names it — reserving it (one request off each requests bucket, its
 * tokens off each tokens bucket and budget, a concurrent slot in each) under a lease of
 * `req.leaseMs`; otherwise refuses it, changing nothing. Refusals, in the order checked (the key's
 * scope before the model's at each step):
 * - a worst case beyond a tokens-per-minute limit (`rate_limit_exceeded`) or a whole budget
 *   (`insufficient_quota`): "Request too large", no Retry-After;
 * - `used + Σ reserved + tokens > budget.tokens`: `insufficient_quota`, retry at the period's end;
 * - with `storeBytes`, stored bytes + `storeBytes` > `storageBytes`: `insufficient_quota`, retry
 *   when enough of what is stored has expired;
 * - concurrency, requests and tokens per minute: `rate_limit_exceeded`, retry after the longest
 *   of their waits (the message names that limit).
 * An id already reserved is admitted again without counting anything twice (its lease renewed
 * when the same replica asks).
 */
export function admit(state: LimitState, limits: KeyLimits, req: AdmitRequest, nowMs: number): Admission {
  checkWhole('tokens', req.tokens, 0);
  checkWhole('leaseMs', req.leaseMs, 1);
  if (req.storeBytes !== undefined) checkWhole('storeBytes', req.storeBytes, 0);
  nowMs = Math.floor(nowMs);
  if (!req.id) throw new RangeError('a request id is required');
  const s = normalize(state, limits, nowMs);
  const headersOf = (st: LimitState) => rateLimitHeaders(st, limits, nowMs, req.model);
  const refuse = (code: RefusalCode, message: string, retryAfterMs: number | null): Admission => ({
    ok: false,
    code,
    message,
    retryAfterMs,
    headers: headersOf(s),
  });

  if (hasOwn(s.reservations, req.id)) {
    const r = s.reservations[req.id]!;
    const renewed = r.replica === req.replica ? { ...r, leaseUntil: Math.max(r.leaseUntil, nowMs + req.leaseMs) } : r;
    const next = { ...s, reservations: { ...s.reservations, [req.id]: renewed } };
    return { ok: true, state: next, headers: headersOf(next), tokens: r.tokens };
  }

  const scopes = scopesOf(s, limits, req.model);
  for (const { limits: l, of } of scopes) {
    if (l.tokensPerMinute !== undefined && req.tokens > l.tokensPerMinute)
      return refuse(
        'rate_limit_exceeded',
        `Request too large${of} on tokens per min (TPM): Limit ${l.tokensPerMinute}, Requested ${req.tokens}. The input or output tokens must be reduced in order to run successfully.`,
        null,
      );
  }
  // What to reserve: the worst case, or with `upTo` as much as every budget and bucket has room for (never below the worst case).
  let grant = req.tokens;
  if (req.upTo !== undefined) {
    checkWhole('upTo', req.upTo, 0);
    let room = req.upTo;
    for (const { limits: l, counters: c, live } of scopes) {
      if (l.tokensPerMinute !== undefined) room = Math.min(room, l.tokensPerMinute, Math.floor(c.tokens!.level / BUCKET_SCALE));
      if (l.budget) room = Math.min(room, l.budget.tokens - c.budget!.used - reservedTokens(live));
    }
    grant = Math.max(req.tokens, room);
  }
  for (const { limits: l, counters: c, live, of } of scopes) {
    if (!l.budget) continue;
    const per = l.budget.period;
    if (req.tokens > l.budget.tokens)
      return refuse(
        'insufficient_quota',
        `Request too large${of} for the token budget per ${per}: Limit ${l.budget.tokens}, Requested ${req.tokens}. The input or output tokens must be reduced in order to run successfully.`,
        null,
      );
    const used = c.budget!.used;
    const reserved = reservedTokens(live);
    if (used + reserved + grant > l.budget.tokens) {
      const { id, endsAt } = budgetPeriodOf(per, nowMs);
      return refuse(
        'insufficient_quota',
        `You exceeded your current quota${of}: token budget per ${per} (${id}): Limit ${l.budget.tokens}, Used ${used}, Reserved by requests in flight ${reserved}, Requested ${grant}. It renews at ${new Date(endsAt).toISOString()}.`,
        endsAt - nowMs,
      );
    }
  }
  if (req.storeBytes !== undefined && limits.storageBytes !== undefined) {
    const quota = limits.storageBytes;
    const held = storedBytes(s, nowMs);
    if (held + req.storeBytes > quota) {
      const wait = storageWaitMs(s.stored ?? {}, held + req.storeBytes - quota, nowMs);
      return refuse(
        'insufficient_quota',
        `You exceeded your storage quota for stored responses: Limit ${quota} bytes, Stored ${held}, Requested ${req.storeBytes}. ` +
          (req.storeBytes > quota
            ? 'This request alone is larger than the quota: send less, or `store: false`.'
            : 'Delete stored responses (DELETE /v1/responses/{id}), wait for them to expire, or send `store: false`.'),
        req.storeBytes > quota ? null : wait,
      );
    }
  }

  const waits: { ms: number; message: (retry: string) => string }[] = [];
  for (const scope of scopes) {
    const { limits: l, counters: c, live, of } = scope;
    const slots = reservedSlots(live);
    if (l.concurrency !== undefined && slots >= l.concurrency)
      waits.push({
        ms: concurrencyWaitMs(scope, nowMs),
        message: (retry) => `Rate limit reached${of} on concurrent requests: Limit ${l.concurrency}, Used ${slots}, Requested 1. Please try again in ${retry}.`,
      });
    const rpm = l.requestsPerMinute;
    if (rpm !== undefined && c.requests!.level < BUCKET_SCALE) {
      const usedRequests = rpm - Math.max(0, Math.floor(c.requests!.level / BUCKET_SCALE));
      waits.push({
        ms: msUntil(c.requests!, rpm, BUCKET_SCALE),
        message: (retry) => `Rate limit reached${of} on requests per min (RPM): Limit ${rpm}, Used ${usedRequests}, Requested 1. Please try again in ${retry}.`,
      });
    }
    const tpm = l.tokensPerMinute;
    if (tpm !== undefined && c.tokens!.level < grant * BUCKET_SCALE) {
      const usedTokens = tpm - Math.max(0, Math.floor(c.tokens!.level / BUCKET_SCALE));
      waits.push({
        ms: msUntil(c.tokens!, tpm, grant * BUCKET_SCALE),
        message: (retry) =>
          `Rate limit reached${of} on tokens per min (TPM): Limit ${tpm}, Used ${usedTokens}, Requested ${grant}. Please try again in ${retry}.`,
      });
    }
  }
  if (waits.length > 0) {
    const longest = waits.reduce((a, b) => (b.ms > a.ms ? b : a));
    return refuse('rate_limit_exceeded', longest.message(formatResetDuration(longest.ms)), longest.ms);
  }

  const model = scopes.length > 1 ? req.model : undefined;
  let next: LimitState = {
    ...s,
    reservations: {
      ...s.reservations,
      [req.id]: { tokens: grant, replica: req.replica, leaseUntil: nowMs + req.leaseMs, at: nowMs, ...(model !== undefined ? { model } : {}) },
    },
  };
  scopes.forEach(({ counters: c }, i) => {
    const taken: Counters = { ...c };
    if (c.requests) taken.requests = { level: c.requests.level - BUCKET_SCALE, at: c.requests.at };
    if (c.tokens) taken.tokens = { level: c.tokens.level - grant * BUCKET_SCALE, at: c.tokens.at };
    next = withCounters(next, i, model, taken);
  });
  return { ok: true, state: next, headers: headersOf(next), tokens: grant };
}

/** Ms from `nowMs` until days of `stored` worth `excess` bytes are over (the earliest first). */
function storageWaitMs(stored: Record<string, number>, excess: number, nowMs: number): number {
  let freed = 0;
  for (const day of Object.keys(stored).sort()) {
    freed += stored[day]!;
    if (freed >= excess) return Math.max(1, Date.parse(`${day}T00:00:00Z`) + 86_400_000 - nowMs);
  }
  return 1;
}

/** `c` settled for a reservation of `r.tokens` that used `actualTokens`, ending at `nowMs`. */
function settleCounters(c: Counters, limits: RateLimits, r: Reservation, actualTokens: number, nowMs: number): Counters {
  const next: Counters = { ...c };
  if (next.budget) next.budget = { period: next.budget.period, used: next.budget.used + actualTokens };
  if (next.tokens && limits.tokensPerMinute) {
    const capacity = limits.tokensPerMinute * BUCKET_SCALE;
    next.tokens = { level: Math.min(capacity, next.tokens.level + (r.tokens - actualTokens) * BUCKET_SCALE), at: next.tokens.at };
  }
  const duration = Math.max(0, nowMs - r.at);
  next.meanDurationMs = next.meanDurationMs === undefined ? duration : next.meanDurationMs + (duration - next.meanDurationMs) / 8;
  return next;
}

/**
 * Settles request `id` to its real usage `actualTokens`: removes its reservation, charges
 * `actualTokens` to the budgets (`used += actual`: the key's, and its model's), returns
 * `reserved − actual` to the tokens-per-minute buckets (capped at their capacity) and counts its
 * duration into `meanDurationMs`. Callers cap a request's output (max_tokens) so that
 * `actual ≤ reserved`: then no budget can be exceeded. Should a request use more, the truth is
 * charged anyway — the budget's `used` and the bucket (which goes below zero and refills from
 * there) take the excess. Settling an id that is not reserved (settled before, or released after
 * its lease) is a no-op: a retried settle never charges twice.
 */
export function settle(state: LimitState, limits: KeyLimits, id: string, actualTokens: number, nowMs: number): Settlement {
  checkWhole('actualTokens', actualTokens, 0);
  nowMs = Math.floor(nowMs);
  const s = normalize(state, limits, nowMs);
  if (!hasOwn(s.reservations, id)) return { state: s, settled: false, headers: rateLimitHeaders(s, limits, nowMs) };
  const r = s.reservations[id]!;
  let next: LimitState = {
    ...s,
    ...settleCounters(keyCounters(s), limits, r, actualTokens, nowMs),
    reservations: Object.fromEntries(Object.entries(s.reservations).filter(([k]) => k !== id)),
  };
  const own = modelLimitsOf(limits, r.model);
  if (own) next = withCounters(next, 1, r.model, settleCounters(next.models![r.model!]!, own, r, actualTokens, nowMs));
  return { state: next, settled: true, headers: rateLimitHeaders(next, limits, nowMs, r.model) };
}

/**
 * The most of what a limit has available that one slice takes: 1 / SLICE_SHARE of it — so a few
 * replicas leasing at once leave room for each other, and a slice lost with its gateway (charged
 * in full) costs a bounded part of a budget.
 */
export const SLICE_SHARE = 8;

/** What {@link leaseSlice} is asked to lease. */
export interface SliceRequest {
  /** The slice's reservation id (unique: a request id never takes it). */
  id: string;
  /** The gateway replica that admits from it and renews its lease. */
  replica: string;
  leaseMs: number;
  /** The model whose own limits (`KeyLimits.models`) it counts in too, when it has any. */
  model?: string;
  /** Wanted: requests it may admit, tokens (worst cases) it may hand out, requests in flight at once. */
  requests: number;
  tokens: number;
  slots: number;
  /** The fewest tokens worth leasing (a slice that cannot hold a couple of requests is not leased). */
  minTokens: number;
}

/** What a leased slice holds; null where no limit of that kind applies (unbounded). */
export interface Slice {
  requests: number | null;
  tokens: number | null;
  slots: number | null;
}

/**
 * Leases a *slice* of what the key (and `req.model`, when it has limits of its own) has available
 * at `nowMs`, for a gateway replica to admit requests from without a write each: `requests` off
 * each requests bucket, `tokens` off each tokens bucket and held against each budget, `slots`
 * concurrent slots — all in one reservation under `req.id` with a lease like a request's (a
 * replica that dies has it released, charged in full, by {@link sweep}). Each is at most
 * 1/{@link SLICE_SHARE} of what its limit has available; refused (nothing changed, `ok: false`)
 * when that cannot hold one request, one slot and `minTokens` — near a limit, requests are
 * admitted one by one ({@link admit}), exactly as before. The replica gives back what it did not
 * use with {@link returnSlice}. Every invariant of {@link admit} holds: what a slice holds is
 * reserved in the document, and the replica admits within it only.
 */
export function leaseSlice(
  state: LimitState,
  limits: KeyLimits,
  req: SliceRequest,
  nowMs: number,
): { ok: true; state: LimitState; slice: Slice } | { ok: false } {
  for (const [what, n, min] of [
    ['requests', req.requests, 1],
    ['tokens', req.tokens, 0],
    ['slots', req.slots, 1],
    ['minTokens', req.minTokens, 0],
    ['leaseMs', req.leaseMs, 1],
  ] as const)
    checkWhole(what, n, min);
  if (!req.id) throw new RangeError('a slice id is required');
  nowMs = Math.floor(nowMs);
  const s = normalize(state, limits, nowMs);
  if (hasOwn(s.reservations, req.id)) return { ok: false };
  const scopes = scopesOf(s, limits, req.model);
  let requests: number | null = null;
  let tokens: number | null = null;
  let slots: number | null = null;
  const cap = (current: number | null, wanted: number, available: number) => Math.min(current ?? wanted, Math.floor(Math.max(0, available) / SLICE_SHARE));
  for (const { limits: l, counters: c, live } of scopes) {
    if (l.requestsPerMinute !== undefined) requests = cap(requests, req.requests, Math.floor(c.requests!.level / BUCKET_SCALE));
    if (l.tokensPerMinute !== undefined) tokens = cap(tokens, req.tokens, Math.floor(c.tokens!.level / BUCKET_SCALE));
    if (l.budget) tokens = cap(tokens, req.tokens, l.budget.tokens - c.budget!.used - reservedTokens(live));
    if (l.concurrency !== undefined) slots = cap(slots, req.slots, l.concurrency - reservedSlots(live));
  }
  if ((requests !== null && requests < 1) || (slots !== null && slots < 1) || (tokens !== null && tokens < Math.max(1, req.minTokens))) return { ok: false };
  const model = scopes.length > 1 ? req.model : undefined;
  let next: LimitState = {
    ...s,
    reservations: {
      ...s.reservations,
      [req.id]: {
        tokens: tokens ?? 0,
        replica: req.replica,
        leaseUntil: nowMs + req.leaseMs,
        at: nowMs,
        slots: slots ?? 0,
        ...(model !== undefined ? { model } : {}),
      },
    },
  };
  scopes.forEach(({ counters: c }, i) => {
    const taken: Counters = { ...c };
    if (c.requests && requests !== null) taken.requests = { level: c.requests.level - requests * BUCKET_SCALE, at: c.requests.at };
    if (c.tokens && tokens !== null) taken.tokens = { level: c.tokens.level - tokens * BUCKET_SCALE, at: c.tokens.at };
    next = withCounters(next, i, model, taken);
  });
  return { ok: true, state: next, slice: { requests, tokens, slots } };
}

/** What a replica did with a slice, given back by {@link returnSlice}. */
export interface SliceUse {
  /** Requests of the slice it did not admit (back to the requests buckets). */
  requestsLeft: number;
  /** Tokens its requests used, by their settles (charged to the budgets; the rest of its tokens back to the tokens buckets). */
  usedTokens: number;
  /** The mean duration of the requests it settled, smoothed from the scope's as {@link settle} smooths it; absent when none settled. */
  meanDurationMs?: number;
}

/**
 * Gives back slice `id` ({@link leaseSlice}) once none of its requests is in flight: its
 * reservation removed, `use.usedTokens` charged to the budgets, the tokens it did not use and
 * the requests it did not admit returned to the buckets (capped at their capacity), its slots
 * free. A slice not reserved (released after its lease passed, charged in full) is a no-op.
 */
export function returnSlice(state: LimitState, limits: KeyLimits, id: string, use: SliceUse, nowMs: number): Settlement {
  checkWhole('requestsLeft', use.requestsLeft, 0);
  checkWhole('usedTokens', use.usedTokens, 0);
  nowMs = Math.floor(nowMs);
  const s = normalize(state, limits, nowMs);
  if (!hasOwn(s.reservations, id)) return { state: s, settled: false, headers: rateLimitHeaders(s, limits, nowMs) };
  const r = s.reservations[id]!;
  const back = (c: Counters, l: RateLimits): Counters => {
    const next: Counters = { ...c };
    if (next.budget) next.budget = { period: next.budget.period, used: next.budget.used + use.usedTokens };
    if (next.tokens && l.tokensPerMinute)
      next.tokens = { level: Math.min(l.tokensPerMinute * BUCKET_SCALE, next.tokens.level + (r.tokens - use.usedTokens) * BUCKET_SCALE), at: next.tokens.at };
    if (next.requests && l.requestsPerMinute)
      next.requests = { level: Math.min(l.requestsPerMinute * BUCKET_SCALE, next.requests.level + use.requestsLeft * BUCKET_SCALE), at: next.requests.at };
    if (use.meanDurationMs !== undefined && Number.isFinite(use.meanDurationMs) && use.meanDurationMs >= 0) next.meanDurationMs = use.meanDurationMs;
    return next;
  };
  let next: LimitState = {
    ...s,
    ...back(keyCounters(s), limits),
    reservations: Object.fromEntries(Object.entries(s.reservations).filter(([k]) => k !== id)),
  };
  const own = modelLimitsOf(limits, r.model);
  if (own) next = withCounters(next, 1, r.model, back(next.models![r.model!]!, own));
  return { state: next, settled: true, headers: rateLimitHeaders(next, limits, nowMs, r.model) };
}

/**
 * `state` (as a slice was leased on) with what a replica's slice still holds added back to the
 * buckets it was taken from — the key's, and `model`'s when the slice counts there — so that
 * {@link rateLimitHeaders} of it tell a client what the key has left as this replica sees it.
 */
export function withSliceLeft(state: LimitState, model: string | undefined, left: { requests: number | null; tokens: number | null }): LimitState {
  const add = (c: Counters): Counters => {
    const next: Counters = { ...c };
    if (c.requests && left.requests !== null) next.requests = { level: c.requests.level + left.requests * BUCKET_SCALE, at: c.requests.at };
    if (c.tokens && left.tokens !== null) next.tokens = { level: c.tokens.level + Math.max(0, left.tokens) * BUCKET_SCALE, at: c.tokens.at };
    return next;
  };
  const next: LimitState = { ...state, ...add(keyCounters(state)) };
  const own = model !== undefined ? state.models?.[model] : undefined;
  return own ? { ...next, models: { ...state.models, [model!]: add(own) } } : next;
}

/**
 * Charges `bytes` of a response stored at `nowMs` that expires at `expiresAtMs` to the key's
 * stored bytes (the day `expiresAtMs` falls in: they count until that day is over). Unchanged
 * when the key has no storage quota: nothing is counted then, so a quota set later counts only
 * what is stored from then on.
 */
export function chargeStorage(state: LimitState, limits: KeyLimits, bytes: number, expiresAtMs: number, nowMs: number): LimitState {
  checkWhole('bytes', bytes, 0);
  if (limits.storageBytes === undefined || bytes === 0) return state;
  const s = normalize(state, limits, Math.floor(nowMs));
  const day = dayOf(expiresAtMs);
  const held = s.stored && hasOwn(s.stored, day) ? s.stored[day]! : 0;
  return { ...s, stored: { ...s.stored, [day]: held + bytes } };
}

/**
 * Gives back `bytes` of a stored response deleted before it expired (at `expiresAtMs`), from the
 * day they were charged to; never below zero (a response stored before the quota was set was
 * never charged). Unchanged when nothing is charged to that day.
 */
export function releaseStorage(state: LimitState, limits: KeyLimits, bytes: number, expiresAtMs: number, nowMs: number): LimitState {
  checkWhole('bytes', bytes, 0);
  const day = dayOf(expiresAtMs);
  if (!state.stored || !hasOwn(state.stored, day) || bytes === 0) return state;
  const s = normalize(state, limits, Math.floor(nowMs));
  if (!s.stored || !hasOwn(s.stored, day)) return s;
  const left = s.stored[day]! - bytes;
  const stored = Object.fromEntries(
    Object.entries(s.stored)
      .filter(([d]) => d !== day || left > 0)
      .map(([d, b]) => [d, d === day ? left : b]),
  );
  const { stored: _, ...rest } = s;
  return Object.keys(stored).length > 0 ? { ...rest, stored } : rest;
}

/**
 * Extends to `leaseUntil` the leases of `replica`'s reservations among `ids` (a lease never
 * shortens). `missing`: the ids that are not reserved by `replica` — settled, or released because
 * their lease passed (and charged in full) — which the caller stops renewing.
 */
export function renew(state: LimitState, replica: string, ids: Iterable<string>, leaseUntil: number): { state: LimitState; missing: string[] } {
  leaseUntil = Math.floor(leaseUntil);
  const missing: string[] = [];
  const extend = new Set<string>();
  for (const id of ids) {
    const r = hasOwn(state.reservations, id) ? state.reservations[id] : undefined;
    if (!r || r.replica !== replica) missing.push(id);
    else if (r.leaseUntil < leaseUntil) extend.add(id);
  }
  if (extend.size === 0) return { state, missing };
  // Rebuilt from entries, never assigned by key: an id may be `__proto__`.
  const reservations = Object.fromEntries(Object.entries(state.reservations).map(([id, r]) => [id, extend.has(id) ? { ...r, leaseUntil } : r]));
  return { state: { ...state, reservations }, missing };
}

/**
 * OpenAI's rate-limit headers at `nowMs` for the limits that are set:
 * `x-ratelimit-{limit,remaining,reset}-requests` and `-tokens`. Remaining is the whole part of
 * the bucket's level (never below 0); reset is the time until the bucket is full again, written
 * as OpenAI writes it ({@link formatResetDuration}). For a request of `model` that has limits of
 * its own, each kind is the tighter of the key's bucket and the model's (the fewer remaining).
 */
export function rateLimitHeaders(state: LimitState, limits: KeyLimits, nowMs: number, model?: string): RateLimitHeaders {
  nowMs = Math.floor(nowMs);
  const own = modelLimitsOf(limits, model);
  const counters = own ? state.models?.[model!] : undefined;
  const headers: RateLimitHeaders = {};
  // Once per request: no arrays, tuples or names built per call.
  addKind(headers, REQUEST_HEADERS, limits.requestsPerMinute, state.requests, own?.requestsPerMinute, counters?.requests, nowMs);
  addKind(headers, TOKEN_HEADERS, limits.tokensPerMinute, state.tokens, own?.tokensPerMinute, counters?.tokens, nowMs);
  return headers;
}

const REQUEST_HEADERS = ['x-ratelimit-limit-requests', 'x-ratelimit-remaining-requests', 'x-ratelimit-reset-requests'] as const;
const TOKEN_HEADERS = ['x-ratelimit-limit-tokens', 'x-ratelimit-remaining-tokens', 'x-ratelimit-reset-tokens'] as const;

/** One kind's three headers into `headers`: the tighter (fewer remaining) of the key's bucket and the model's, when set. */
function addKind(
  headers: RateLimitHeaders,
  names: readonly [string, string, string],
  keyLimit: number | undefined,
  keyBucket: Bucket | undefined,
  modelLimit: number | undefined,
  modelBucket: Bucket | undefined,
  nowMs: number,
): void {
  let limit = keyLimit;
  let bucket = keyLimit === undefined ? undefined : refill(keyBucket, keyLimit, nowMs);
  if (modelLimit !== undefined) {
    const b = refill(modelBucket, modelLimit, nowMs);
    if (!bucket || b.level < bucket.level) [limit, bucket] = [modelLimit, b];
  }
  if (limit === undefined || !bucket) return;
  headers[names[0]] = String(limit);
  headers[names[1]] = String(Math.max(0, Math.floor(bucket.level / BUCKET_SCALE)));
  headers[names[2]] = bucket.level >= limit * BUCKET_SCALE ? '0s' : formatResetDuration(msUntil(bucket, limit, limit * BUCKET_SCALE));
}

/**
 * A duration as OpenAI's headers and messages write it (Go's `time.Duration` format, to the ms):
 * `0s`, `20ms`, `1s`, `1.5s`, `6m0s`, `1h0m0s`. Rounded up: a client that waits as long is not early.
 */
export function formatResetDuration(ms: number): string {
  const whole = Math.max(0, Math.ceil(ms));
  if (whole === 0) return '0s';
  if (whole < 1000) return `${whole}ms`;
  const h = Math.floor(whole / 3_600_000);
  const m = Math.floor((whole % 3_600_000) / 60_000);
  const rest = whole % 60_000;
  const s = `${Math.floor(rest / 1000)}${rest % 1000 ? `.${String(rest % 1000).padStart(3, '0')}`.replace(/0+$/, '') : ''}s`;
  return h > 0 ? `${h}h${m}m${s}` : m > 0 ? `${m}m${s}` : s;
}

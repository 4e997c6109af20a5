import { Value } from '@sinclair/typebox/value';
import {
  BUCKET_SCALE,
  KeyLimits,
  admit,
  budgetPeriodOf,
  chargeStorage,
  decodeLimitState,
  emptyLimitState,
  formatResetDuration,
  leaseSlice,
  returnSlice,
  withSliceLeft,
  rateLimitHeaders,
  releaseStorage,
  renew,
  settle,
  storedBytes,
  sweep,
  type Admission,
  type AdmitRequest,
  type LimitState,
} from './limits';

const T0 = Date.UTC(2026, 10, 29, 12, 0, 0); // 2026-11-29T12:00:00Z
const LEASE = 30_000;

const req = (id: string, tokens = 1, replica = 'gw-a'): AdmitRequest => ({ id, tokens, replica, leaseMs: LEASE });

/** Admits `r` and returns the new state, failing the test on a refusal. */
function admitted(state: LimitState, limits: KeyLimits, r: AdmitRequest, now: number): LimitState {
  const a = admit(state, limits, r, now);
  if (!a.ok) throw new Error(`refused: ${a.message}`);
  return a.state;
}

function refused(a: Admission): Extract<Admission, { ok: false }> {
  if (a.ok) throw new Error('admitted');
  return a;
}

const reserved = (s: LimitState) => Object.values(s.reservations).reduce((n, r) => n + r.tokens, 0);

describe('requests per minute', () => {
  const limits: KeyLimits = { requestsPerMinute: 5 };

  it('admits the capacity at once; the next waits exactly the 12 s one request takes to refill', () => {
    let s = emptyLimitState();
    for (let i = 0; i < 5; i += 1) s = admitted(s, limits, req(`r${i}`), T0);
    const r = refused(admit(s, limits, req('r5'), T0));
    expect(r.code).toBe('rate_limit_exceeded');
    expect(r.retryAfterMs).toBe(12_000);
    expect(r.message).toBe('Rate limit reached on requests per min (RPM): Limit 5, Used 5, Requested 1. Please try again in 12s.');
    expect(r.headers).toEqual({ 'x-ratelimit-limit-requests': '5', 'x-ratelimit-remaining-requests': '0', 'x-ratelimit-reset-requests': '1m0s' });

    // 4 s later the bucket holds a third of a request: 8 s left.
    expect(refused(admit(s, limits, req('r5'), T0 + 4000)).retryAfterMs).toBe(8000);
    expect(refused(admit(s, limits, req('r5'), T0 + 11_999)).retryAfterMs).toBe(1);
    s = admitted(s, limits, req('r5'), T0 + 12_000);
    expect(refused(admit(s, limits, req('r6'), T0 + 12_000)).retryAfterMs).toBe(12_000);
  });

  it('refills continuously up to the capacity and no further', () => {
    let s = emptyLimitState();
    for (let i = 0; i < 5; i += 1) s = admitted(s, limits, req(`r${i}`), T0);
    expect(rateLimitHeaders(s, limits, T0 + 30_000)['x-ratelimit-remaining-requests']).toBe('2');
    expect(rateLimitHeaders(s, limits, T0 + 60_000)).toMatchObject({ 'x-ratelimit-remaining-requests': '5', 'x-ratelimit-reset-requests': '0s' });
    // An hour idle refills one minute's worth: 5 more at once, then a wait.
    for (let i = 0; i < 5; i += 1) s = admitted(s, limits, req(`later${i}`), T0 + 3_600_000);
    expect(refused(admit(s, limits, req('later5'), T0 + 3_600_000)).retryAfterMs).toBe(12_000);
  });

  it('a clock behind the last write refills nothing and never runs the bucket backwards', () => {
    let s = emptyLimitState();
    for (let i = 0; i < 5; i += 1) s = admitted(s, limits, req(`r${i}`), T0);
    const behind = refused(admit(s, limits, req('r5'), T0 - 5000));
    expect(behind.retryAfterMs).toBe(12_000);
    expect(refused(admit(s, limits, req('r5'), T0 + 6000)).retryAfterMs).toBe(6000);
  });
});

describe('tokens per minute', () => {
  const limits: KeyLimits = { tokensPerMinute: 1000 };

  it('reserves the worst case; Retry-After is the time the bucket needs for the tokens asked', () => {
    let s = admitted(emptyLimitState(), limits, req('a', 600), T0);
    const r = refused(admit(s, limits, req('b', 600), T0));
    // 400 left, 200 missing at 1000 per minute: 12 s.
    expect(r.retryAfterMs).toBe(12_000);
    expect(r.message).toBe('Rate limit reached on tokens per min (TPM): Limit 1000, Used 600, Requested 600. Please try again in 12s.');
    expect(refused(admit(s, limits, req('b', 600), T0 + 11_999)).retryAfterMs).toBe(1);
    s = admitted(s, limits, req('b', 600), T0 + 12_000);
    expect(s.tokens!.level).toBe(0);
  });

  it('a settle refunds what was reserved and not used, never above the capacity', () => {
    let s = admitted(emptyLimitState(), limits, req('a', 600), T0);
    s = settle(s, limits, 'a', 100, T0).state;
    expect(s.tokens!.level).toBe(900 * BUCKET_SCALE);
    expect(rateLimitHeaders(s, limits, T0)).toEqual({
      'x-ratelimit-limit-tokens': '1000',
      'x-ratelimit-remaining-tokens': '900',
      'x-ratelimit-reset-tokens': '6s',
    });
    s = admitted(s, limits, req('b', 500), T0);
    s = settle(s, limits, 'b', 0, T0 + 60_000).state; // refilled meanwhile: the refund is capped
    expect(s.tokens!.level).toBe(1000 * BUCKET_SCALE);
  });

  it('a request that used more than it reserved is charged the truth: the bucket goes below zero and refills from there', () => {
    let s = admitted(emptyLimitState(), limits, req('a', 900), T0);
    s = settle(s, limits, 'a', 1200, T0).state;
    expect(s.tokens!.level).toBe(-200 * BUCKET_SCALE);
    expect(rateLimitHeaders(s, limits, T0)['x-ratelimit-remaining-tokens']).toBe('0');
    // 210 tokens need 410 refilled: 24.6 s.
    expect(refused(admit(s, limits, req('b', 210), T0)).retryAfterMs).toBe(24_600);
  });

  it('a worst case beyond the limit alone is refused as too large, with no Retry-After', () => {
    const r = refused(admit(emptyLimitState(), limits, req('big', 1001), T0));
    expect(r).toMatchObject({ code: 'rate_limit_exceeded', retryAfterMs: null });
    expect(r.message).toBe(
      'Request too large on tokens per min (TPM): Limit 1000, Requested 1001. The input or output tokens must be reduced in order to run successfully.',
    );
    expect(admit(emptyLimitState(), limits, req('max', 1000), T0).ok).toBe(true);
  });
});

describe('token budget', () => {
  const limits: KeyLimits = { budget: { tokens: 100, period: 'day' } };
  const endOfDay = Date.UTC(2026, 10, 30);

  it('is exact at the boundary: used + reserved + asked ≤ budget', () => {
    let s = admitted(emptyLimitState(), limits, req('a', 60), T0);
    s = admitted(s, limits, req('b', 40), T0);
    const r = refused(admit(s, limits, req('c', 1), T0));
    expect(r).toMatchObject({ code: 'insufficient_quota', retryAfterMs: endOfDay - T0 });
    expect(r.message).toBe(
      'You exceeded your current quota: token budget per day (2026-11-29): Limit 100, Used 0, Reserved by requests in flight 100, Requested 1. It renews at 2026-11-30T00:00:00.000Z.',
    );
    s = settle(s, limits, 'a', 50, T0).state;
    expect(s.budget).toEqual({ period: '2026-11-29', used: 50 });
    expect(refused(admit(s, limits, req('c', 11), T0)).code).toBe('insufficient_quota');
    s = admitted(s, limits, req('c', 10), T0);
    expect(s.budget!.used + reserved(s)).toBe(100);
    s = settle(s, limits, 'b', 40, T0).state;
    s = settle(s, limits, 'c', 10, T0).state;
    expect(s.budget).toEqual({ period: '2026-11-29', used: 100 });
    expect(refused(admit(s, limits, req('d', 1), T0)).code).toBe('insufficient_quota');
  });

  it('a worst case beyond the whole budget is refused as too large, with no Retry-After', () => {
    const r = refused(admit(emptyLimitState(), limits, req('big', 101), T0));
    expect(r).toMatchObject({ code: 'insufficient_quota', retryAfterMs: null });
    expect(r.message).toMatch(/^Request too large for the token budget per day: Limit 100, Requested 101\./);
  });

  it('rolls over at the end of the UTC day: used starts again, live reservations still count', () => {
    const t = endOfDay - 10_000;
    let s = admitted(emptyLimitState(), limits, req('a', 70), t);
    s = settle(s, limits, 'a', 70, t).state;
    s = admitted(s, limits, req('b', 30), t); // in flight across midnight
    expect(refused(admit(s, limits, req('c', 1), endOfDay - 1)).retryAfterMs).toBe(1);
    const r = admit(s, limits, req('c', 70), endOfDay);
    expect(r.ok).toBe(true);
    s = (r as Extract<Admission, { ok: true }>).state;
    expect(s.budget).toEqual({ period: '2026-11-30', used: 0 });
    expect(refused(admit(s, limits, req('d', 1), endOfDay)).message).toMatch(/Used 0, Reserved by requests in flight 100/);
    s = settle(s, limits, 'b', 30, endOfDay + 1).state; // charged to the period it settles in
    expect(s.budget).toEqual({ period: '2026-11-30', used: 30 });
  });

  it('budgetPeriodOf keeps its last period per kind: the bounds are exact whatever order times come in', () => {
    const times = [
      Date.UTC(2026, 10, 30, 23, 59, 59, 999),
      Date.UTC(2026, 11, 1),
      Date.UTC(2026, 10, 30, 23, 59, 59, 999), // a clock behind another's
      Date.UTC(2026, 10, 1),
      Date.UTC(2026, 9, 31, 23, 59, 59, 999),
      Date.UTC(2026, 11, 1, 12),
      Date.UTC(2026, 11, 2) - 1,
      Date.UTC(2026, 11, 2),
    ];
    for (const period of ['day', 'month'] as const)
      for (const t of times) {
        const d = new Date(t).toISOString();
        const endsAt =
          period === 'day'
            ? Date.UTC(new Date(t).getUTCFullYear(), new Date(t).getUTCMonth(), new Date(t).getUTCDate() + 1)
            : Date.UTC(new Date(t).getUTCFullYear(), new Date(t).getUTCMonth() + 1, 1);
        expect([t, budgetPeriodOf(period, t)]).toEqual([t, { id: period === 'day' ? d.slice(0, 10) : d.slice(0, 7), endsAt }]);
      }
  });

  it('monthly periods end on the first of the next month (UTC), across a year too', () => {
    expect(budgetPeriodOf('month', T0)).toEqual({ id: '2026-11', endsAt: Date.UTC(2026, 11, 1) });
    expect(budgetPeriodOf('month', Date.UTC(2026, 11, 31, 23, 59))).toEqual({ id: '2026-12', endsAt: Date.UTC(2027, 0, 1) });
    expect(budgetPeriodOf('day', Date.UTC(2028, 1, 28, 5))).toEqual({ id: '2028-02-28', endsAt: Date.UTC(2028, 1, 29) });
    const monthly: KeyLimits = { budget: { tokens: 10, period: 'month' } };
    let s = admitted(emptyLimitState(), monthly, req('a', 10), T0);
    s = settle(s, monthly, 'a', 10, T0).state;
    expect(refused(admit(s, monthly, req('b', 1), T0)).retryAfterMs).toBe(Date.UTC(2026, 11, 1) - T0);
    expect(admit(s, monthly, req('b', 10), Date.UTC(2026, 11, 1)).ok).toBe(true);
  });
});

describe('an output with no bound of its own (upTo)', () => {
  const limits: KeyLimits = { budget: { tokens: 300, period: 'day' }, tokensPerMinute: 1000 };

  it('reserves as much as the budget has room for, never less than the worst case, and the next is refused once it is spent', () => {
    const first = admit(emptyLimitState(), limits, { ...req('a', 40), upTo: 2048 }, T0);
    expect(first).toMatchObject({ ok: true, tokens: 300 }); // all the budget had: the answer is cut there
    const second = refused(admit(first.ok ? first.state : emptyLimitState(), limits, { ...req('b', 40), upTo: 2048 }, T0));
    expect(second.code).toBe('insufficient_quota');
    // Settled at what it used, the rest is room again.
    const settled = settle(first.ok ? first.state : emptyLimitState(), limits, 'a', 120, T0 + 1000).state;
    expect(admit(settled, limits, { ...req('c', 40), upTo: 2048 }, T0 + 1000)).toMatchObject({ ok: true, tokens: 180 });
  });

  it('is held to the tokens-per-minute bucket too, and to its own bound', () => {
    expect(admit(emptyLimitState(), { tokensPerMinute: 100 }, { ...req('a', 10), upTo: 2048 }, T0)).toMatchObject({ ok: true, tokens: 100 });
    expect(admit(emptyLimitState(), { tokensPerMinute: 100 }, { ...req('a', 10), upTo: 50 }, T0)).toMatchObject({ ok: true, tokens: 50 });
    expect(admit(emptyLimitState(), {}, { ...req('a', 10), upTo: 50 }, T0)).toMatchObject({ ok: true, tokens: 50 });
  });
});

describe('idempotence', () => {
  const limits: KeyLimits = { requestsPerMinute: 10, tokensPerMinute: 1000, concurrency: 5, budget: { tokens: 1000, period: 'day' } };

  it('admitting a reserved id again counts nothing twice (and renews its lease)', () => {
    const once = admitted(emptyLimitState(), limits, req('a', 100), T0);
    const twice = admitted(once, limits, req('a', 100), T0 + 1000);
    expect(twice.requests).toEqual(refill(once, T0 + 1000).requests);
    expect(twice.tokens!.level).toBe(refill(once, T0 + 1000).tokens!.level);
    expect(reserved(twice)).toBe(100);
    expect(twice.reservations.a!.leaseUntil).toBe(T0 + 1000 + LEASE);
    // Another replica's retry does not take its lease over.
    expect(admitted(once, limits, req('a', 100, 'gw-b'), T0 + 1000).reservations.a).toEqual(once.reservations.a);
  });

  it('settling twice, or settling an unknown id, charges nothing more', () => {
    let s = admitted(emptyLimitState(), limits, req('a', 100), T0);
    const first = settle(s, limits, 'a', 80, T0 + 500);
    expect(first.settled).toBe(true);
    s = first.state;
    expect(s.budget!.used).toBe(80);
    const again = settle(s, limits, 'a', 80, T0 + 600);
    expect(again.settled).toBe(false);
    expect(again.state.budget!.used).toBe(80);
    expect(settle(s, limits, 'never', 5, T0 + 600)).toMatchObject({ settled: false, state: { budget: { used: 80 } } });
  });

  it('ids that are Object.prototype names are plain ids', () => {
    let s = emptyLimitState();
    for (const id of ['__proto__', 'constructor', 'toString']) s = admitted(s, limits, req(id, 10), T0);
    expect(reserved(s)).toBe(30);
    s = decodeLimitState(JSON.stringify(s))!;
    expect(reserved(s)).toBe(30);
    s = renew(s, 'gw-a', ['__proto__'], T0 + 2 * LEASE).state;
    expect(s.reservations['__proto__']!.leaseUntil).toBe(T0 + 2 * LEASE);
    s = settle(s, limits, '__proto__', 10, T0).state;
    s = settle(s, limits, 'constructor', 10, T0).state;
    expect(Object.keys(s.reservations)).toEqual(['toString']);
    expect(s.budget!.used).toBe(20);
    expect(Object.getPrototypeOf(s.reservations)).toBe(Object.prototype);
  });

  /** `s` refilled to `now` (as admit sees it), through a no-op settle. */
  function refill(s: LimitState, now: number): LimitState {
    return settle(s, limits, 'no-such-id', 0, now).state;
  }
});

describe('leases', () => {
  const limits: KeyLimits = { tokensPerMinute: 1000, concurrency: 2, budget: { tokens: 500, period: 'day' } };

  it('a reservation whose lease passed is released, charged its whole worst case, nothing refunded', () => {
    let s = admitted(emptyLimitState(), limits, { ...req('dead', 300), leaseMs: 1500 }, T0);
    s = admitted(s, limits, { ...req('live', 100, 'gw-b'), leaseMs: 1500 }, T0);
    s = renew(s, 'gw-b', ['live'], T0 + 1000 + 1500).state;
    expect(sweep(s, T0 + 1499)).toBe(s);
    const swept = sweep(s, T0 + 1500);
    expect(Object.keys(swept.reservations)).toEqual(['live']);
    expect(swept.budget).toEqual({ period: '2026-11-29', used: 300 });
    expect(swept.tokens).toEqual(s.tokens);
    // A late settle of the released request charges nothing more.
    expect(settle(s, limits, 'dead', 10, T0 + 1500)).toMatchObject({ settled: false, state: { budget: { used: 300 } } });
    // Admission sweeps too: room for 200 more, and the concurrency slot is free.
    expect(refused(admit(s, limits, req('x', 101), T0 + 1500)).code).toBe('insufficient_quota');
    expect(admit(s, limits, req('x', 100), T0 + 1500).ok).toBe(true);
  });

  it('renew extends only the replica’s own reservations, never shortens one, and names the missing', () => {
    let s = admitted(emptyLimitState(), limits, req('a', 10), T0);
    s = admitted(s, limits, req('b', 10, 'gw-b'), T0);
    const r = renew(s, 'gw-a', ['a', 'b', 'gone'], T0 + 2 * LEASE);
    expect(r.missing).toEqual(['b', 'gone']);
    expect(r.state.reservations.a!.leaseUntil).toBe(T0 + 2 * LEASE);
    expect(r.state.reservations.b!.leaseUntil).toBe(T0 + LEASE);
    expect(renew(r.state, 'gw-a', ['a'], T0 + LEASE).state).toBe(r.state);
  });
});

describe('concurrency', () => {
  const limits: KeyLimits = { concurrency: 2 };

  it('refuses the next while the limit is in flight; Retry-After from the requests’ durations', () => {
    let s = admitted(emptyLimitState(), limits, req('a'), T0);
    s = admitted(s, limits, req('b'), T0 + 2000);
    // Nothing settled yet: the oldest has run 4 s, so each is taken to have ~4 s left; the first of 2 ends in ~2 s.
    const r = refused(admit(s, limits, req('c'), T0 + 4000));
    expect(r.retryAfterMs).toBe(2000);
    expect(r.message).toBe('Rate limit reached on concurrent requests: Limit 2, Used 2, Requested 1. Please try again in 2s.');
    s = settle(s, limits, 'a', 1, T0 + 8000).state; // ran 8 s
    expect(s.meanDurationMs).toBe(8000);
    s = admitted(s, limits, req('c'), T0 + 8000);
    expect(refused(admit(s, limits, req('d'), T0 + 9000)).retryAfterMs).toBe(4000);
    s = settle(s, limits, 'b', 1, T0 + 10_000).state; // ran 8 s, the mean: it stays
    s = settle(s, limits, 'c', 1, T0 + 24_000).state; // ran 16 s: the mean moves an eighth of the way
    expect(s.meanDurationMs).toBe(9000);
  });

  it('of several limits refused at once, the longest wait is the Retry-After and the message names it', () => {
    const both: KeyLimits = { concurrency: 1, requestsPerMinute: 1 };
    const s = admitted(emptyLimitState(), both, req('a'), T0);
    const r = refused(admit(s, both, req('b'), T0 + 1000));
    expect(r.retryAfterMs).toBe(59_000);
    expect(r.message).toMatch(/^Rate limit reached on requests per min \(RPM\)/);
  });
});

describe('headers', () => {
  it('formats durations as OpenAI does', () => {
    expect([0, 0.2, 20, 999, 1000, 1500, 12_000, 59_999, 60_000, 61_001, 360_000, 3_600_000, 3_723_400].map(formatResetDuration)).toEqual([
      '0s',
      '1ms',
      '20ms',
      '999ms',
      '1s',
      '1.5s',
      '12s',
      '59.999s',
      '1m0s',
      '1m1.001s',
      '6m0s',
      '1h0m0s',
      '1h2m3.4s',
    ]);
  });

  it('carries the six headers of the limits that are set, and no others', () => {
    const limits: KeyLimits = { requestsPerMinute: 60, tokensPerMinute: 10_000, concurrency: 3 };
    const a = admit(emptyLimitState(), limits, req('a', 2500), T0);
    expect(a.headers).toEqual({
      'x-ratelimit-limit-requests': '60',
      'x-ratelimit-remaining-requests': '59',
      'x-ratelimit-reset-requests': '1s',
      'x-ratelimit-limit-tokens': '10000',
      'x-ratelimit-remaining-tokens': '7500',
      'x-ratelimit-reset-tokens': '15s',
    });
    expect(rateLimitHeaders(emptyLimitState(), { budget: { tokens: 5, period: 'day' } }, T0)).toEqual({});
    expect(rateLimitHeaders(emptyLimitState(), { tokensPerMinute: 7 }, T0)).toEqual({
      'x-ratelimit-limit-tokens': '7',
      'x-ratelimit-remaining-tokens': '7',
      'x-ratelimit-reset-tokens': '0s',
    });
  });
});

describe('limits of one model', () => {
  const M = 'default/llama';
  const limits: KeyLimits = {
    concurrency: 3,
    budget: { tokens: 1000, period: 'day' },
    models: { [M]: { concurrency: 1, tokensPerMinute: 600, budget: { tokens: 300, period: 'day' } } },
  };
  const on = (id: string, tokens: number, model: string | null = M): AdmitRequest => ({ ...req(id, tokens), ...(model !== null ? { model } : {}) });

  it('hold beside the key’s: a request of the model is held to both, one of another model only to the key’s', () => {
    let s = admitted(emptyLimitState(), limits, on('a', 100), T0);
    expect(s.reservations.a!.model).toBe(M);
    // The model's concurrency (1) is spent; the key's (3) is not.
    const r = refused(admit(s, limits, on('b', 10), T0 + 1000));
    expect(r.code).toBe('rate_limit_exceeded');
    expect(r.message).toBe(`Rate limit reached for ${M} on concurrent requests: Limit 1, Used 1, Requested 1. Please try again in 1s.`);
    s = admitted(s, limits, on('other', 500, 'default/phi'), T0);
    expect(s.reservations.other!.model).toBeUndefined();
    s = admitted(s, limits, on('bare', 100, null), T0);
    // The key's concurrency (3) is now spent, for every model.
    expect(refused(admit(s, limits, on('c', 10, 'default/phi'), T0)).message).toMatch(/^Rate limit reached on concurrent requests: Limit 3, Used 3/);
  });

  it('a model’s budget and tokens per minute are its own: settled, charged and refunded in both scopes', () => {
    let s = admitted(emptyLimitState(), limits, on('a', 250), T0);
    expect(s.models![M]).toMatchObject({ budget: { used: 0 }, tokens: { level: (600 - 250) * BUCKET_SCALE } });
    s = settle(s, limits, 'a', 200, T0 + 1000).state;
    expect(s.budget).toEqual({ period: '2026-11-29', used: 200 });
    expect(s.models![M]!.budget).toEqual({ period: '2026-11-29', used: 200 });
    expect(s.models![M]!.tokens!.level).toBe((600 - 200) * BUCKET_SCALE + 1000 * 600);
    // 100 of the model's 300 are left; the key has 800.
    const r = refused(admit(s, limits, on('b', 101), T0 + 2000));
    expect(r.code).toBe('insufficient_quota');
    expect(r.message).toMatch(
      `You exceeded your current quota for ${M}: token budget per day (2026-11-29): Limit 300, Used 200, Reserved by requests in flight 0, Requested 101.`,
    );
    expect(r.retryAfterMs).toBe(Date.UTC(2026, 10, 30) - (T0 + 2000));
    expect(admit(s, limits, on('b', 700, 'default/phi'), T0 + 2000).ok).toBe(true);
    expect(refused(admit(s, limits, on('big', 301), T0 + 2000)).message).toMatch(new RegExp(`^Request too large for ${M} for the token budget per day`));
    expect(refused(admit(s, limits, on('big', 601), T0 + 2000)).message).toMatch(new RegExp(`^Request too large for ${M} on tokens per min`));
  });

  it('an output with no bound is held to the room of both scopes', () => {
    const s = admitted(
      emptyLimitState(),
      { budget: { tokens: 1000, period: 'day' }, models: { [M]: { budget: { tokens: 120, period: 'day' } } } },
      { ...on('a', 10), upTo: 4096 },
      T0,
    );
    expect(s.reservations.a!.tokens).toBe(120);
  });

  it('a lapsed reservation is charged in full to the model’s budget too', () => {
    const s = admitted(emptyLimitState(), limits, { ...on('dead', 250), leaseMs: 1000 }, T0);
    const swept = sweep(s, T0 + 1000);
    expect(swept.reservations).toEqual({});
    expect(swept.budget!.used).toBe(250);
    expect(swept.models![M]!.budget!.used).toBe(250);
  });

  it('headers show the tighter of the key’s bucket and the model’s', () => {
    const both: KeyLimits = { requestsPerMinute: 100, tokensPerMinute: 1000, models: { [M]: { requestsPerMinute: 5 } } };
    const a = admit(emptyLimitState(), both, on('a', 300), T0);
    expect(a.ok && a.headers).toEqual({
      'x-ratelimit-limit-requests': '5',
      'x-ratelimit-remaining-requests': '4',
      'x-ratelimit-reset-requests': '12s',
      'x-ratelimit-limit-tokens': '1000',
      'x-ratelimit-remaining-tokens': '700',
      'x-ratelimit-reset-tokens': '18s',
    });
  });
});

describe('stored responses’ bytes', () => {
  const limits: KeyLimits = { storageBytes: 1000 };
  const DAY = 86_400_000;
  const TTL = 30 * DAY;
  const storing = (id: string, bytes: number): AdmitRequest => ({ ...req(id, 1), storeBytes: bytes });

  it('are charged until the day they expire is over, and a request that would not fit is refused with when it will', () => {
    let s = chargeStorage(emptyLimitState(), limits, 600, T0 + TTL, T0);
    s = chargeStorage(s, limits, 300, T0 + DAY + TTL, T0 + DAY);
    expect(storedBytes(s, T0 + DAY)).toBe(900);
    expect(admit(s, limits, storing('a', 100), T0 + DAY).ok).toBe(true);
    const r = refused(admit(s, limits, storing('b', 101), T0 + DAY));
    expect(r.code).toBe('insufficient_quota');
    expect(r.message).toMatch(/^You exceeded your storage quota for stored responses: Limit 1000 bytes, Stored 900, Requested 101\. Delete stored responses/);
    // The 600 expire on 2026-12-29 (T0 + 30 days): they stop counting when that day is over.
    expect(r.retryAfterMs).toBe(Date.UTC(2026, 11, 30) - (T0 + DAY));
    expect(storedBytes(s, Date.UTC(2026, 11, 30) - 1)).toBe(900);
    expect(storedBytes(s, Date.UTC(2026, 11, 30))).toBe(300);
    // A request that stores nothing is not held to the quota; one larger than it never fits.
    expect(admit(s, limits, req('c', 1), T0 + DAY).ok).toBe(true);
    const big = refused(admit(emptyLimitState(), limits, storing('d', 1001), T0));
    expect(big.retryAfterMs).toBeNull();
    expect(big.message).toMatch(/larger than the quota/);
  });

  it('a deleted response gives its bytes back to its day, never below zero; nothing is counted without a quota', () => {
    let s = chargeStorage(emptyLimitState(), limits, 600, T0 + TTL, T0);
    s = releaseStorage(s, limits, 200, T0 + TTL, T0 + 1000);
    expect(storedBytes(s, T0)).toBe(400);
    s = releaseStorage(s, limits, 999, T0 + TTL, T0 + 1000);
    expect(s.stored).toBeUndefined();
    expect(releaseStorage(s, limits, 5, T0 + TTL, T0)).toBe(s);
    expect(chargeStorage(emptyLimitState(), {}, 600, T0 + TTL, T0)).toEqual(emptyLimitState());
    expect(decodeLimitState(JSON.stringify(chargeStorage(emptyLimitState(), limits, 1, T0 + TTL, T0)))).toBeDefined();
  });
});

describe('the stored document', () => {
  it('limits are positive whole numbers and a day or month budget; nothing else', () => {
    for (const good of [{}, { requestsPerMinute: 1, tokensPerMinute: 40_000, concurrency: 4, budget: { tokens: 1_000_000, period: 'month' } }])
      expect(Value.Check(KeyLimits, good)).toBe(true);
    for (const bad of [
      { requestsPerMinute: 0 },
      { tokensPerMinute: 1.5 },
      { concurrency: -1 },
      { budget: { tokens: 10, period: 'week' } },
      { budget: { tokens: 10 } },
      { requestsPerMinute: 200_000_000_000 },
      { rpm: 5 },
      { models: { llama: { concurrency: 1 } } },
      { models: { 'default/llama': { concurrency: 0 } } },
      { models: { 'default/llama': { storageBytes: 10 } } },
      { models: Object.fromEntries(Array.from({ length: 65 }, (_, i) => [`default/m${i}`, { concurrency: 1 }])) },
      { storageBytes: 0 },
    ])
      expect(Value.Check(KeyLimits, bad)).toBe(false);
    expect(Value.Check(KeyLimits, { models: { 'default/llama': { requestsPerMinute: 5 }, 'shared/x': {} }, storageBytes: 1 })).toBe(true);
  });

  it('round-trips through JSON, and anything else is no state', () => {
    const limits: KeyLimits = { requestsPerMinute: 3, tokensPerMinute: 100, budget: { tokens: 100, period: 'month' } };
    const s = admitted(emptyLimitState(), limits, req('a', 10), T0);
    expect(decodeLimitState(JSON.stringify(s))).toEqual(s);
    for (const bad of [
      '',
      'null',
      '{}',
      '[]',
      '{"reservations":{"a":{"tokens":-1,"replica":"x","leaseUntil":1,"at":1}}}',
      '{"reservations":{},"tokens":{"level":0.5,"at":1}}',
    ])
      expect(decodeLimitState(bad)).toBeUndefined();
  });

  it('refuses inputs that would break the arithmetic', () => {
    expect(() => admit(emptyLimitState(), {}, { ...req('a'), tokens: 1.5 }, T0)).toThrow(RangeError);
    expect(() => admit(emptyLimitState(), {}, { ...req('a'), leaseMs: 0 }, T0)).toThrow(RangeError);
    expect(() => settle(emptyLimitState(), {}, 'a', -1, T0)).toThrow(RangeError);
  });
});

describe('slices', () => {
  const ask = (over: Partial<Parameters<typeof leaseSlice>[2]> = {}) => ({
    id: '~slice.1',
    replica: 'gw-a',
    leaseMs: LEASE,
    requests: 100,
    tokens: 10_000,
    slots: 16,
    minTokens: 200,
    ...over,
  });

  it('takes at most an eighth of what each limit has available, and reserves it like a request', () => {
    const limits: KeyLimits = { requestsPerMinute: 400, tokensPerMinute: 1_000_000, concurrency: 64, budget: { tokens: 40_000, period: 'day' } };
    const l = leaseSlice(emptyLimitState(), limits, ask(), T0);
    if (!l.ok) throw new Error('refused');
    expect(l.slice).toEqual({ requests: 50, tokens: 5_000, slots: 8 });
    expect(l.state.reservations['~slice.1']).toEqual({ tokens: 5_000, replica: 'gw-a', leaseUntil: T0 + LEASE, at: T0, slots: 8 });
    expect(l.state.requests!.level).toBe(350 * BUCKET_SCALE);
    expect(l.state.tokens!.level).toBe((1_000_000 - 5_000) * BUCKET_SCALE);
    // Its slots and tokens count for every other admission.
    const full = { ...limits, concurrency: 9 };
    const s = admitted(l.state, full, req('r1', 100), T0);
    expect(refused(admit(s, full, req('r2', 100), T0)).message).toContain('Used 9');
    expect(refused(admit(l.state, limits, req('big', 35_001), T0)).code).toBe('insufficient_quota');
  });

  it('is refused near a limit (an eighth would not hold minTokens, a request or a slot), changing nothing', () => {
    expect(leaseSlice(emptyLimitState(), { budget: { tokens: 1_599, period: 'day' } }, ask(), T0)).toEqual({ ok: false });
    expect(leaseSlice(emptyLimitState(), { requestsPerMinute: 7 }, ask(), T0)).toEqual({ ok: false });
    expect(leaseSlice(emptyLimitState(), { concurrency: 7 }, ask(), T0)).toEqual({ ok: false });
    expect(leaseSlice(emptyLimitState(), { budget: { tokens: 1_600, period: 'day' } }, ask(), T0)).toMatchObject({ ok: true, slice: { tokens: 200 } });
    // Unlimited kinds are unbounded in the slice and take nothing.
    expect(leaseSlice(emptyLimitState(), {}, ask(), T0)).toMatchObject({ ok: true, slice: { requests: null, tokens: null, slots: null } });
  });

  it('given back: used tokens charged, the rest and the requests not admitted returned, capped at capacity; a second return is a no-op', () => {
    const limits: KeyLimits = { requestsPerMinute: 800, tokensPerMinute: 80_000, budget: { tokens: 1_000_000, period: 'month' } };
    const l = leaseSlice(emptyLimitState(), limits, ask(), T0);
    if (!l.ok) throw new Error('refused');
    expect(l.slice).toEqual({ requests: 100, tokens: 10_000, slots: null });
    const r = returnSlice(l.state, limits, '~slice.1', { requestsLeft: 90, usedTokens: 1_234, meanDurationMs: 42 }, T0);
    expect(r.settled).toBe(true);
    expect(r.state.reservations).toEqual({});
    expect(r.state.budget).toEqual({ period: '2026-11', used: 1_234 });
    expect(r.state.requests!.level).toBe(790 * BUCKET_SCALE);
    expect(r.state.tokens!.level).toBe((80_000 - 1_234) * BUCKET_SCALE);
    expect(r.state.meanDurationMs).toBe(42);
    expect(returnSlice(r.state, limits, '~slice.1', { requestsLeft: 90, usedTokens: 1_234 }, T0).settled).toBe(false);
  });

  it('lapsed, it is charged in full', () => {
    const limits: KeyLimits = { budget: { tokens: 1_000_000, period: 'month' } };
    const l = leaseSlice(emptyLimitState(), limits, ask(), T0);
    if (!l.ok) throw new Error('refused');
    expect(sweep(l.state, T0 + LEASE)).toMatchObject({ reservations: {}, budget: { used: 10_000 } });
  });

  it("counts in a model's own limits too", () => {
    const limits: KeyLimits = { budget: { tokens: 1_000_000, period: 'month' }, models: { 'ns/m': { concurrency: 80 } } };
    const l = leaseSlice(emptyLimitState(), limits, ask({ model: 'ns/m' }), T0);
    if (!l.ok) throw new Error('refused');
    expect(l.slice).toEqual({ requests: null, tokens: 10_000, slots: 10 });
    expect(l.state.reservations['~slice.1']).toMatchObject({ model: 'ns/m', slots: 10 });
    const r = returnSlice(l.state, limits, '~slice.1', { requestsLeft: 0, usedTokens: 500 }, T0);
    expect(r.state).toMatchObject({ budget: { used: 500 }, reservations: {} });
  });

  it('the headers of a slice count what it still holds', () => {
    const limits: KeyLimits = { requestsPerMinute: 800 };
    const l = leaseSlice(emptyLimitState(), limits, ask(), T0);
    if (!l.ok) throw new Error('refused');
    expect(rateLimitHeaders(l.state, limits, T0)['x-ratelimit-remaining-requests']).toBe('700');
    expect(rateLimitHeaders(withSliceLeft(l.state, undefined, { requests: 60, tokens: null }), limits, T0)['x-ratelimit-remaining-requests']).toBe('760');
  });
});

/**
 * Each ApiKey's `status.usage`: what the key used in the current period (its budget's, else the
 * UTC month) from the usage ledger (`magus_usage`, dataplane/usage.ts), in all and per model, and
 * from the gateways' own count (`magus_limits`) what its budgets — the key's, each model's — have
 * left beside the requests in flight, and the bytes its stored responses hold against its quota.
 *
 * One ordered consumer reads the ledger from the start of the month and follows it, summing the
 * records per key and period ({@link UsageSums}); every `intervalMs` the keys whose usage changed
 * are written — server-side apply of `status.usage` alone, as field manager `magus-usage`, so the
 * fields the key reconciler writes (keys.ts) are not touched.
 */
import type { CustomObjectsApi } from '@kubernetes/client-node';
import { DeliverPolicy, type ConsumerMessages, type JetStreamClient } from 'nats';
import type { LimitStore } from '../dataplane/limits';
import { FieldManager, type ApiKeyResource, type ApiKeyUsageStatus } from '../shared/kube';
import { storedBytes, type Counters, type KeyLimits, type Reservation } from '../shared/limits';
import { entryLimits } from '../dataplane/keys';
import { isoSeconds, parseUsageRecord, periodOf, type UsageRecord } from '../shared/usage';
import { applyApiKeyStatus, resolveLimitModels } from './keys';

/** How often ApiKeys' usage is written (when it changed). */
export const USAGE_STATUS_INTERVAL_MS = 30_000;

interface Sums {
  requests: number;
  promptTokens: number;
  completionTokens: number;
  totalTokens: number;
}

const noSums = (): Sums => ({ requests: 0, promptTokens: 0, completionTokens: 0, totalTokens: 0 });

function addTo(s: Sums, r: UsageRecord): void {
  s.requests += 1;
  s.promptTokens += r.tokens.prompt;
  s.completionTokens += r.tokens.completion;
  s.totalTokens += r.tokens.total;
}

/** The ledger's records summed per key, UTC day and month, in all and per model; the last end per key. */
export class UsageSums {
  private readonly byKey = new Map<string, Map<string, { all: Sums; models: Map<string, Sums> }>>();
  private readonly last = new Map<string, number>();

  add(r: UsageRecord): void {
    let periods = this.byKey.get(r.key);
    if (!periods) this.byKey.set(r.key, (periods = new Map<string, { all: Sums; models: Map<string, Sums> }>()));
    for (const p of [periodOf(r.start, 'day'), periodOf(r.start, 'month')]) {
      let sums = periods.get(p);
      if (!sums) periods.set(p, (sums = { all: noSums(), models: new Map() }));
      addTo(sums.all, r);
      let model = sums.models.get(r.model);
      if (!model) sums.models.set(r.model, (model = noSums()));
      addTo(model, r);
    }
    this.last.set(r.key, Math.max(this.last.get(r.key) ?? 0, r.end));
  }

  /** Key `key`'s sums in period `period` (a day or month id). */
  of(key: string, period: string): Sums | undefined {
    return this.byKey.get(key)?.get(period)?.all;
  }

  /** Key `key`'s sums in period `period` per model (`namespace/name`). */
  byModel(key: string, period: string): ReadonlyMap<string, Sums> {
    return this.byKey.get(key)?.get(period)?.models ?? new Map();
  }

  /** When key `key`'s last recorded request ended (epoch ms). */
  lastUsed(key: string): number | undefined {
    return this.last.get(key);
  }

  /** Drops the days before `nowMs`'s and the months before its month. */
  prune(nowMs: number): void {
    const day = periodOf(nowMs, 'day');
    const month = periodOf(nowMs, 'month');
    for (const periods of this.byKey.values()) {
      for (const p of periods.keys()) if (p < (p.length === 10 ? day : month)) periods.delete(p);
    }
  }
}

export interface UsageStatusOptions {
  js: JetStreamClient;
  /** The ledger's bucket (`names.usageBucket`). */
  bucket: string;
  custom: CustomObjectsApi;
  /** The ApiKeys to write (the key reconciler's watch). */
  apikeys: () => ApiKeyResource[];
  /** The gateways' limit counts, for what a budget has left. */
  limits?: LimitStore;
  intervalMs?: number;
  log: (line: string) => void;
  now?: () => number;
}

export interface UsageStatus {
  /** Writes every changed status now (tests; the interval does it otherwise). */
  flush(): Promise<void>;
  stop(): Promise<void>;
}

/** A usage status as comparable text (the API server returns its fields in its own order). */
const canonical = (u: ApiKeyUsageStatus | undefined): string => JSON.stringify(u ?? null, Object.keys(u ?? {}).sort());

/** Most models `status.usage.models` lists (those with the most tokens first). */
export const MAX_STATUS_MODELS = 64;

/** The status `o` should show now. */
async function usageOf(o: ApiKeyResource, sums: UsageSums, limits: LimitStore | undefined, nowMs: number): Promise<ApiKeyUsageStatus> {
  const ns = o.metadata.namespace;
  const identity = `${ns}/${o.metadata.name}`;
  const named = resolveLimitModels(ns, o.spec.limits);
  const declared = 'error' in named ? undefined : entryLimits(named.limits, 'spec.limits');
  const keyLimits = declared && 'limits' in declared ? declared.limits : undefined;
  const budget = keyLimits?.budget;
  const period = periodOf(nowMs, budget?.period ?? 'month');
  const s = sums.of(identity, period);
  const state = limits && (budget || keyLimits?.models || keyLimits?.storageBytes !== undefined) ? (await limits.read(identity))?.state : undefined;
  /** What budget `b` has left: less what its counters used in its period and what `live` reserve. */
  const left = (b: NonNullable<KeyLimits['budget']>, counters: Counters | undefined, live: Reservation[]): number => {
    const used = counters?.budget?.period === periodOf(nowMs, b.period) ? counters.budget.used : 0;
    return Math.max(0, b.tokens - used - live.reduce((n, r) => n + r.tokens, 0));
  };
  const live = state ? Object.values(state.reservations) : [];
  const modelBudgets = Object.entries(keyLimits?.models ?? {}).filter(([, l]) => l.budget);
  const used = sums.byModel(identity, period);
  const models = [...new Set([...used.keys(), ...modelBudgets.map(([m]) => m)])]
    .map((model) => {
      const b = keyLimits?.models?.[model]?.budget;
      const remainingTokens =
        b && limits
          ? left(
              b,
              state?.models?.[model],
              live.filter((r) => r.model === model),
            )
          : undefined;
      return {
        model,
        ...(used.get(model) ?? { requests: 0, promptTokens: 0, completionTokens: 0, totalTokens: 0 }),
        ...(remainingTokens !== undefined ? { remainingTokens } : {}),
      };
    })
    .sort((a, b) => b.totalTokens - a.totalTokens || (a.model < b.model ? -1 : 1))
    .slice(0, MAX_STATUS_MODELS)
    .sort((a, b) => (a.model < b.model ? -1 : 1));
  const last = sums.lastUsed(identity);
  return {
    period,
    requests: s?.requests ?? 0,
    promptTokens: s?.promptTokens ?? 0,
    completionTokens: s?.completionTokens ?? 0,
    totalTokens: s?.totalTokens ?? 0,
    ...(budget && limits ? { remainingTokens: left(budget, state, live) } : {}),
    ...(keyLimits?.storageBytes !== undefined && limits ? { storedBytes: state ? storedBytes(state, nowMs) : 0 } : {}),
    ...(models.length > 0 ? { models } : {}),
    ...(last !== undefined ? { lastUsed: isoSeconds(last) } : {}),
  };
}

/** Starts following the ledger and writing ApiKeys' usage. */
export async function startUsageStatus(opts: UsageStatusOptions): Promise<UsageStatus> {
  const now = opts.now ?? Date.now;
  const sums = new UsageSums();
  const monthStart = new Date(`${periodOf(now(), 'month')}-01T00:00:00Z`);
  const consumer = await opts.js.consumers.get(`KV_${opts.bucket}`, {
    filterSubjects: [`$KV.${opts.bucket}.>`],
    deliver_policy: DeliverPolicy.StartTime,
    opt_start_time: monthStart.toISOString(),
  });
  const messages: ConsumerMessages = await consumer.consume();
  const reading = (async () => {
    for await (const m of messages) {
      if (m.data.length === 0) continue; // a delete or purge marker
      try {
        const r = parseUsageRecord(m.json());
        if (r) sums.add(r);
      } catch {
        // not JSON: not a record
      }
    }
  })();
  /** What each ApiKey (by uid) was last written. */
  const written = new Map<string, string>();
  let running: Promise<void> | undefined;
  const flush = async (): Promise<void> => {
    const at = now();
    sums.prune(at);
    for (const o of opts.apikeys()) {
      const usage = await usageOf(o, sums, opts.limits, at);
      const text = canonical(usage);
      if (written.get(o.metadata.uid) === text || canonical(o.status?.usage) === text) continue;
      try {
        await applyApiKeyStatus(opts.custom, o, { usage }, FieldManager.usage);
        written.set(o.metadata.uid, text);
      } catch (err) {
        opts.log(`apikey ${o.metadata.namespace}/${o.metadata.name}: writing its usage failed: ${(err as Error).message}`);
      }
    }
  };
  const tick = () => {
    running ??= flush()
      .catch((err: unknown) => opts.log(`usage status: ${(err as Error).message}`))
      .finally(() => (running = undefined));
  };
  const timer = setInterval(tick, opts.intervalMs ?? USAGE_STATUS_INTERVAL_MS);
  timer.unref();
  return {
    flush: async () => {
      await running;
      await flush();
    },
    stop: async () => {
      clearInterval(timer);
      await running;
      messages.stop();
      await reading.catch(() => undefined);
    },
  };
}

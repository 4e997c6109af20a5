/**
 * Each ApiKey's `status.usage`: what the key used in the current period (its budget's, else the
 * UTC month) from the usage ledger (`magus_usage`, dataplane/usage.ts), in all and per model, and
 * from the gateways' own count (`magus_limits`) what its budgets — the key's, each model's — have
 * left beside the requests in flight, and the bytes its stored responses hold against its quota.
 *
 * One ordered consumer reads the ledger and follows it, summing the records per key and period
 * ({@link UsageSums}) — from where the last checkpoint of the sums left it ({@link UsageCheckpoint},
 * `magus_usage_sums`), else from the start of the month; every `intervalMs` the sums that changed
 * are checkpointed and the keys whose usage changed are written — server-side apply of `status.usage` alone, as field manager `magus-usage`, so the
 * fields the key reconciler writes (keys.ts) are not touched.
 */
import type { MeterVerifier } from '../dataplane/meter';
import type { CustomObjectsApi } from '@kubernetes/client-node';
import { DeliverPolicy, type ConsumerMessages, type JetStreamClient, type KV } from 'nats';
import { isRevisionConflict } from '../dataplane/errors';
import type { LimitStore } from '../dataplane/limits';
import { FieldManager, type ApiKeyResource, type ApiKeyUsageStatus } from '../shared/kube';
import { reservedTokens, storedBytes, type Counters, type KeyLimits, type Reservation } from '../shared/limits';
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

/** Adds `r`; a correction (shared/usage.ts, `corrects`) replaces what its request's record added (the ledger holds that one before it). */
function addTo(s: Sums, r: UsageRecord): void {
  const was = r.corrects?.tokens;
  if (!was) s.requests += 1;
  s.promptTokens += r.tokens.prompt - (was?.prompt ?? 0);
  s.completionTokens += r.tokens.completion - (was?.completion ?? 0);
  s.totalTokens += r.tokens.total - (was?.total ?? 0);
}

/** One key's sums in one period (a UTC day or month): in all, per model, its last request's end, and the last ledger sequence folded in. */
export interface PeriodSums {
  all: Sums;
  models: Record<string, Sums>;
  /** Epoch ms: when its last request ended. */
  last: number;
  /** The ledger stream's sequence of the last record folded in (0: none known): a record at or below it is in already. */
  seq: number;
}

const SEP = '\u0000';

/** The ledger's records summed per key, UTC day and month, in all and per model. */
export class UsageSums {
  private readonly byKey = new Map<string, Map<string, PeriodSums>>();
  /** `key SEP period` of the sums changed since {@link takeChanged}. */
  private readonly changed = new Set<string>();

  /** Folds record `r` in, unless its sequence `seq` (> 0) is one its periods' sums already hold. */
  add(r: UsageRecord, seq = 0): void {
    for (const p of [periodOf(r.start, 'day'), periodOf(r.start, 'month')]) {
      const e = this.entry(r.key, p);
      if (seq > 0 && e.seq >= seq) continue;
      addTo(e.all, r);
      e.models[r.model] ??= noSums();
      addTo(e.models[r.model]!, r);
      e.last = Math.max(e.last, r.end);
      if (seq > 0) e.seq = seq;
      this.changed.add(`${r.key}${SEP}${p}`);
    }
  }

  /** Sets key `key`'s sums of `period` as a checkpoint held them. */
  load(key: string, period: string, sums: PeriodSums): void {
    let periods = this.byKey.get(key);
    if (!periods) this.byKey.set(key, (periods = new Map<string, PeriodSums>()));
    periods.set(period, structuredClone(sums));
  }

  /** The sums changed since the last call (a checkpoint writes them); {@link markChanged} them again if that fails. */
  takeChanged(): [key: string, period: string, sums: PeriodSums][] {
    const out = [...this.changed].flatMap((k): [string, string, PeriodSums][] => {
      const [key, period] = k.split(SEP) as [string, string];
      const e = this.byKey.get(key)?.get(period);
      return e ? [[key, period, structuredClone(e)]] : [];
    });
    this.changed.clear();
    return out;
  }

  /** Forgets every sum. */
  clear(): void {
    this.byKey.clear();
    this.changed.clear();
  }

  markChanged(key: string, period: string): void {
    this.changed.add(`${key}${SEP}${period}`);
  }

  /** Key `key`'s sums in period `period` (a day or month id). */
  of(key: string, period: string): Sums | undefined {
    return this.byKey.get(key)?.get(period)?.all;
  }

  /** Key `key`'s sums in period `period` per model (`namespace/name`). */
  byModel(key: string, period: string): ReadonlyMap<string, Sums> {
    return new Map(Object.entries(this.byKey.get(key)?.get(period)?.models ?? {}));
  }

  /** When key `key`'s last recorded request (of the periods held) ended (epoch ms). */
  lastUsed(key: string): number | undefined {
    const lasts = [...(this.byKey.get(key)?.values() ?? [])].map((e) => e.last).filter((t) => t > 0);
    return lasts.length > 0 ? Math.max(...lasts) : undefined;
  }

  /** Drops the days before `nowMs`'s and the months before its month. */
  prune(nowMs: number): void {
    const day = periodOf(nowMs, 'day');
    const month = periodOf(nowMs, 'month');
    for (const [key, periods] of this.byKey) {
      for (const p of periods.keys()) {
        if (p >= (p.length === 10 ? day : month)) continue;
        periods.delete(p);
        this.changed.delete(`${key}${SEP}${p}`);
      }
    }
  }

  private entry(key: string, period: string): PeriodSums {
    let periods = this.byKey.get(key);
    if (!periods) this.byKey.set(key, (periods = new Map<string, PeriodSums>()));
    let e = periods.get(period);
    if (!e) periods.set(period, (e = { all: noSums(), models: {}, last: 0, seq: 0 }));
    return e;
  }
}

/** The KV key of key `key`'s sums of `period`: the identity's base64url, a dot, the period. */
const checkpointKeyOf = (key: string, period: string): string => `${Buffer.from(key, 'utf8').toString('base64url')}.${period}`;
/** The entry holding the last ledger sequence whose record every stored sum holds. */
const CURSOR = 'cursor';

const decoder = new TextDecoder();
const parseJson = (bytes: Uint8Array): unknown => {
  try {
    return JSON.parse(decoder.decode(bytes)) as unknown;
  } catch {
    return undefined;
  }
};
const isSums = (v: unknown): v is Sums =>
  typeof v === 'object' &&
  v !== null &&
  ['requests', 'promptTokens', 'completionTokens', 'totalTokens'].every((k) => Number.isSafeInteger((v as Record<string, unknown>)[k]));
const isPeriodSums = (v: unknown): v is PeriodSums => {
  const e = v as Partial<PeriodSums> | null;
  return (
    typeof e === 'object' &&
    e !== null &&
    isSums(e.all) &&
    typeof e.models === 'object' &&
    e.models !== null &&
    Object.values(e.models).every(isSums) &&
    Number.isSafeInteger(e.last) &&
    Number.isSafeInteger(e.seq)
  );
};
const seqIn = (bytes: Uint8Array | undefined): number => {
  const v = bytes && parseJson(bytes);
  return typeof v === 'object' && v !== null && Number.isSafeInteger((v as { seq?: unknown }).seq) ? (v as { seq: number }).seq : 0;
};

/**
 * The controller's checkpoint of the ledger's sums (`magus_usage_sums`): each key's sums of the
 * current day and month, each with the last ledger sequence folded into it, and a cursor — the
 * last sequence whose record every stored sum holds, written after them. A controller that starts
 * loads the sums and reads the ledger from the cursor on (not from the month's start), skipping
 * in each sum the records it holds already: so a crash between two writes counts nothing twice
 * and misses nothing. Every write moves a sequence forward only (compare-and-swap; one that finds a
 * later one stored keeps it), so a leader handing over to another never writes older sums over newer.
 */
export class UsageCheckpoint {
  private readonly revisions = new Map<string, number>();

  constructor(private readonly kv: KV) {}

  /** Loads the sums of `nowMs`'s day and month into `sums`; the cursor (undefined: none). */
  async load(sums: UsageSums, nowMs: number): Promise<number | undefined> {
    for (const period of [periodOf(nowMs, 'day'), periodOf(nowMs, 'month')]) {
      for await (const k of await this.kv.keys(`*.${period}`)) {
        const e = await this.kv.get(k);
        if (!e || e.operation !== 'PUT') continue;
        const v = parseJson(e.value);
        if (!isPeriodSums(v)) continue;
        const key = Buffer.from(k.slice(0, k.indexOf('.')), 'base64url').toString('utf8');
        sums.load(key, period, v);
        this.revisions.set(k, e.revision);
      }
    }
    const cursor = await this.kv.get(CURSOR);
    if (!cursor || cursor.operation !== 'PUT') return undefined;
    this.revisions.set(CURSOR, cursor.revision);
    return seqIn(cursor.value) || undefined;
  }

  /** Forgets every stored sum (the ledger they counted is gone: its stream was made anew). */
  async clear(): Promise<void> {
    const keys: string[] = [];
    for await (const k of await this.kv.keys()) keys.push(k);
    for (const k of keys) await this.kv.purge(k);
    this.revisions.clear();
  }

  /** Writes the sums changed in `sums`, then the cursor `seq` (the last record read). */
  async save(sums: UsageSums, seq: number): Promise<void> {
    const changed = sums.takeChanged();
    try {
      for (const [key, period, e] of changed) await this.write(checkpointKeyOf(key, period), e, e.seq);
    } catch (err) {
      for (const [key, period] of changed) sums.markChanged(key, period);
      throw err;
    }
    if (seq > 0) await this.write(CURSOR, { seq }, seq);
  }

  private async write(k: string, value: object, seq: number): Promise<void> {
    const data = JSON.stringify(value);
    for (let attempt = 0; attempt < 16; attempt++) {
      const revision = this.revisions.get(k);
      try {
        this.revisions.set(k, revision === undefined ? await this.kv.create(k, data) : await this.kv.update(k, data, revision));
        return;
      } catch (err) {
        if (!isRevisionConflict(err)) throw err;
        const current = await this.kv.get(k);
        if (current?.operation === 'PUT' && seqIn(current.value) >= seq) {
          // Another controller wrote these sums as far or further: theirs stand.
          this.revisions.set(k, current.revision);
          return;
        }
        if (current) this.revisions.set(k, current.revision);
        else this.revisions.delete(k);
      }
    }
    throw new Error(`usage sums ${k}: 16 compare-and-swap attempts lost to other writers`);
  }
}

export interface UsageStatusOptions {
  js: JetStreamClient;
  /** The ledger's bucket (`names.usageBucket`). */
  bucket: string;
  /** The checkpoint of its sums (`names.usageSumsBucket`); absent (or missing): the ledger is read from the month's start at every start. */
  sumsBucket?: string;
  custom: CustomObjectsApi;
  /** The ApiKeys to write (the key reconciler's watch). */
  apikeys: () => ApiKeyResource[];
  /** The gateways' limit counts, for what a budget has left. */
  limits?: LimitStore;
  /** Counts only records a gateway signed (dataplane/meter.ts); absent: every record (tests of the sums alone). */
  verifier?: MeterVerifier;
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
    return Math.max(0, b.tokens - used - reservedTokens(live));
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

/** The checkpoint on bucket `bucket`, or undefined (logged) when there is none: an older data plane. */
async function openCheckpoint(js: JetStreamClient, bucket: string, log: (line: string) => void): Promise<UsageCheckpoint | undefined> {
  try {
    return new UsageCheckpoint(await js.views.kv(bucket, { bindOnly: true }));
  } catch (err) {
    log(`usage sums: no ${bucket} bucket (${(err as Error).message}): the ledger is read from the month's start at every start`);
    return undefined;
  }
}

/** Starts following the ledger and writing ApiKeys' usage. */
export async function startUsageStatus(opts: UsageStatusOptions): Promise<UsageStatus> {
  const now = opts.now ?? Date.now;
  const sums = new UsageSums();
  const checkpoint = opts.sumsBucket ? await openCheckpoint(opts.js, opts.sumsBucket, opts.log) : undefined;
  let cursor = checkpoint ? await checkpoint.load(sums, now()) : undefined;
  if (checkpoint && cursor !== undefined) {
    const { state } = await (await opts.js.jetstreamManager()).streams.info(`KV_${opts.bucket}`);
    if (cursor > state.last_seq) {
      // The ledger's stream is newer than the sums (made anew): they count records it no longer has.
      opts.log(
        `usage sums: their cursor ${cursor} is past the ledger's last record ${state.last_seq} (its stream was made anew): counting again from the month's start`,
      );
      await checkpoint.clear();
      sums.clear();
      cursor = undefined;
    }
  }
  const monthStart = new Date(`${periodOf(now(), 'month')}-01T00:00:00Z`);
  opts.log(
    cursor !== undefined
      ? `usage: reading the ledger from record ${cursor + 1} on (where the checkpoint of its sums left it)`
      : `usage: reading the ledger from the month's start (${monthStart.toISOString()}) on`,
  );
  const consumer = await opts.js.consumers.get(`KV_${opts.bucket}`, {
    filterSubjects: [`$KV.${opts.bucket}.>`],
    ...(cursor !== undefined
      ? { deliver_policy: DeliverPolicy.StartSequence, opt_start_seq: cursor + 1 }
      : { deliver_policy: DeliverPolicy.StartTime, opt_start_time: monthStart.toISOString() }),
  });
  const messages: ConsumerMessages = await consumer.consume();
  /** The ledger sequence of the last message read. */
  let read = cursor ?? 0;
  let unsigned = 0;
  const reading = (async () => {
    for await (const m of messages) {
      read = m.seq;
      if (m.data.length === 0) continue; // a delete or purge marker
      try {
        const r = parseUsageRecord(m.json());
        if (r && (!opts.verifier || (await opts.verifier.verify(r)))) sums.add(r, m.seq);
        else if (r && (unsigned += 1) % 1000 === 1)
          opts.log(
            `usage: left out ${unsigned} record(s) no gateway signed so far (the last: ${r.id} for ${r.key}); they stand for no request a gateway took in`,
          );
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
    // Every record up to `read` is in the sums: written, they are where the next start begins.
    if (checkpoint) {
      const upTo = read;
      await checkpoint.save(sums, upTo).catch((err: unknown) => opts.log(`usage sums: the checkpoint was not written (${(err as Error).message})`));
    }
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

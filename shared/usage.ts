/**
 * The usage ledger's record and what is read from it (dataplane/usage.ts stores it; the README
 * one folder up, "Tenants", says how it is used): one {@link UsageRecord} per request a bridge
 * ended, with its key's identity, its model and the tokens the engine reported — the numbers the
 * client received. Pure: the gateway, the bridge, `magus usage` and the controller share it.
 */
import { budgetPeriodOf, type BudgetPeriod } from './limits';
import type { CompletionUsage } from './serving';

/** The tokens of one answer, as an engine's `usage` reports them. */
export interface Tokens {
  prompt: number;
  /** Prompt tokens the engine's cache already held (part of `prompt`). */
  cached: number;
  completion: number;
  /** Never below prompt + completion: an engine's total is not trusted to add up. */
  total: number;
}

/** The `usage` an engine's answer or usage chunk carries, if any (engines are not trusted to send one). */
export function usageIn(data: unknown): Tokens | undefined {
  const usage = (data as { usage?: Partial<CompletionUsage> | null } | null)?.usage;
  if (typeof usage?.prompt_tokens !== 'number') return undefined;
  const cached = usage.prompt_tokens_details?.cached_tokens;
  const completion = typeof usage.completion_tokens === 'number' ? usage.completion_tokens : 0;
  const total = Math.max(typeof usage.total_tokens === 'number' ? usage.total_tokens : 0, usage.prompt_tokens + completion);
  return { prompt: usage.prompt_tokens, cached: typeof cached === 'number' ? cached : 0, completion, total };
}

/** How a request ended: answered, failed (an error frame), or cancelled because its client went away. */
export type UsageOutcome = 'completed' | 'failed' | 'cancelled';

/** One request in the ledger: written once per request id, by the bridge that ended it. */
export interface UsageRecord {
  /** The request id (the gateway's `x-request-id`). */
  id: string;
  /** The key's identity: `<namespace>/<name>`, `local/<name>`, `config/<token id>` or `anonymous`. */
  key: string;
  /** The model: `<namespace>/<name>`. */
  model: string;
  kind: 'chat' | 'completions' | 'embeddings';
  /** Epoch ms: when the gateway took the request in. */
  start: number;
  /** Epoch ms: when its last frame was sent. */
  end: number;
  outcome: UsageOutcome;
  /** The error's code (`client_closed`, `deadline_exceeded`, …) when it did not complete. */
  error?: string;
  tokens: Tokens;
  /**
   * Whether the engine reported the tokens. An answer cut off before its usage (cancelled, or an
   * engine that failed mid-answer) reports none: `tokens.completion` then counts the chunks it
   * streamed (one token each from magus's engines) and the prompt is 0.
   */
  reported: boolean;
  /**
   * The gateway's signature of the request it sent (its meter's, dataplane/meter.ts): what proves
   * a record stands for a request a gateway took in for this key. Readers leave out records
   * without a valid one.
   */
  sig?: string;
  /**
   * Set on a gateway's correction (dataplane/usage.ts, `recordRefusal`): the client was told this
   * record's outcome, and the bridge's record of the same request — written first, with this
   * outcome and these tokens — stands corrected by it. Readers show the correction in its place;
   * sums subtract what it corrects.
   */
  corrects?: { outcome: UsageOutcome; tokens: Tokens };
}

/** What a request carries for its record (InferenceRequest `meter`): set by the gateway, which knows the key. */
export interface UsageMeter {
  key: string;
  model: string;
  /** Epoch ms: when the gateway took the request in. */
  at: number;
  /** The gateway's signature of the request's id, kind and this meter (dataplane/meter.ts); the record carries it. */
  sig?: string;
}

/** Epoch ms in ISO 8601 to the second (`2026-11-29T10:00:00Z`), as Kubernetes writes times. */
export const isoSeconds = (at: number): string => new Date(at).toISOString().replace(/\.[0-9]{3}Z$/, 'Z');

/** How a request ended, for its record: the tokens its frames reported (absent: none, `completion` the chunks seen). */
export interface UsageEnd {
  outcome: UsageOutcome;
  error?: string;
  tokens?: Tokens;
  /** Chunks streamed, counted as completion tokens when no tokens were reported. */
  chunks?: number;
}

/**
 * The ledger record of request `req`, ended now as `end` says: the one shape the bridge that
 * ends a request and the gateway that gives up on one both write. None for a request that carries
 * no meter (an older gateway's).
 */
export function usageRecordOf(
  req: { id: string; kind?: UsageRecord['kind']; meter?: UsageMeter; continues?: { id: string } },
  end: UsageEnd,
): UsageRecord | undefined {
  if (!req.meter) return undefined;
  const chunks = end.chunks ?? 0;
  return {
    // A continuation's usage is its whole answer's (the engine counts the tokens it was given): recorded as the request it continues.
    id: req.continues?.id ?? req.id,
    key: req.meter.key,
    model: req.meter.model,
    kind: req.kind ?? 'chat',
    start: req.meter.at,
    end: Date.now(),
    outcome: end.outcome,
    ...(end.error !== undefined ? { error: end.error } : {}),
    tokens: end.tokens ?? { prompt: 0, cached: 0, completion: chunks, total: chunks },
    reported: end.tokens !== undefined,
    ...(req.meter.sig !== undefined ? { sig: req.meter.sig } : {}),
  };
}

/** A period's bucket: the UTC day `2026-11-29` or month `2026-11` of epoch ms `at` (a budget's period ids). */
export const periodOf = (at: number, period: BudgetPeriod): string => budgetPeriodOf(period, at).id;

/** One row of {@link aggregateUsage}: a key's use of one model in one period. */
export interface UsageRow {
  key: string;
  model: string;
  period: string;
  requests: number;
  /** Of `requests`, those that did not complete (failed or cancelled). */
  incomplete: number;
  promptTokens: number;
  cachedTokens: number;
  completionTokens: number;
  totalTokens: number;
  /** Epoch ms of its last request's end. */
  lastUsed: number;
}

/** Records summed per key, model and period (UTC days or months), sorted by key, model, period. */
export function aggregateUsage(records: Iterable<UsageRecord>, period: 'day' | 'month'): UsageRow[] {
  const rows = new Map<string, UsageRow>();
  for (const r of records) {
    const p = periodOf(r.start, period);
    const id = JSON.stringify([r.key, r.model, p]);
    let row = rows.get(id);
    if (!row) {
      row = {
        key: r.key,
        model: r.model,
        period: p,
        requests: 0,
        incomplete: 0,
        promptTokens: 0,
        cachedTokens: 0,
        completionTokens: 0,
        totalTokens: 0,
        lastUsed: 0,
      };
      rows.set(id, row);
    }
    row.requests += 1;
    if (r.outcome !== 'completed') row.incomplete += 1;
    row.promptTokens += r.tokens.prompt;
    row.cachedTokens += r.tokens.cached;
    row.completionTokens += r.tokens.completion;
    row.totalTokens += r.tokens.total;
    row.lastUsed = Math.max(row.lastUsed, r.end);
  }
  const order = (a: UsageRow, b: UsageRow) => a.key.localeCompare(b.key) || a.model.localeCompare(b.model) || a.period.localeCompare(b.period);
  return [...rows.values()].sort(order);
}

/** A CSV field: quoted when it holds a comma, quote or line break (RFC 4180). */
const csvField = (v: string | number | boolean | undefined): string => {
  const s = v === undefined ? '' : String(v);
  return /[",\r\n]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s;
};

/** Rows as CSV with a header line, columns in `columns`' order. */
export function toCsv<T extends object>(rows: readonly T[], columns: readonly (keyof T & string)[]): string {
  const lines = [columns.join(',')];
  for (const row of rows) lines.push(columns.map((c) => csvField(row[c] as string | number | boolean | undefined)).join(','));
  return `${lines.join('\n')}\n`;
}

/** A record flattened for CSV (one column per token count, times in ISO 8601). */
export function flatRecord(r: UsageRecord) {
  return {
    id: r.id,
    key: r.key,
    model: r.model,
    kind: r.kind,
    start: new Date(r.start).toISOString(),
    end: new Date(r.end).toISOString(),
    outcome: r.outcome,
    error: r.error ?? '',
    promptTokens: r.tokens.prompt,
    cachedTokens: r.tokens.cached,
    completionTokens: r.tokens.completion,
    totalTokens: r.tokens.total,
    reported: r.reported,
  };
}
export const RECORD_COLUMNS = [
  'id',
  'key',
  'model',
  'kind',
  'start',
  'end',
  'outcome',
  'error',
  'promptTokens',
  'cachedTokens',
  'completionTokens',
  'totalTokens',
  'reported',
] as const satisfies readonly (keyof ReturnType<typeof flatRecord>)[];
export const ROW_COLUMNS = [
  'key',
  'model',
  'period',
  'requests',
  'incomplete',
  'promptTokens',
  'cachedTokens',
  'completionTokens',
  'totalTokens',
  'lastUsed',
] as const satisfies readonly (keyof UsageRow)[];

const isOutcome = (v: unknown): v is UsageOutcome => v === 'completed' || v === 'failed' || v === 'cancelled';

function isTokens(v: unknown): v is Tokens {
  const t = v as Partial<Tokens> | null | undefined;
  return !!t && [t.prompt, t.cached, t.completion, t.total].every((n) => typeof n === 'number' && Number.isFinite(n) && n >= 0);
}

/** A record read back from the ledger, checked (a stored value that is not one is skipped by readers). */
export function parseUsageRecord(value: unknown): UsageRecord | undefined {
  const r = value as Partial<UsageRecord> | null;
  if (!r || typeof r.id !== 'string' || typeof r.key !== 'string' || typeof r.model !== 'string' || !isTokens(r.tokens)) return undefined;
  if (typeof r.start !== 'number' || typeof r.end !== 'number' || !isOutcome(r.outcome)) return undefined;
  if (r.corrects !== undefined && (!isOutcome(r.corrects?.outcome) || !isTokens(r.corrects.tokens))) return undefined;
  return r as UsageRecord;
}

/** Per key, model and token kind, the tokens recorded (the `magus_usage_tokens_total` counter of the bridges that wrote them). */
export class UsageTotals {
  private readonly sums = new Map<string, { key: string; model: string; prompt: number; cached: number; completion: number }>();

  add(r: UsageRecord): void {
    const id = JSON.stringify([r.key, r.model]);
    const s = this.sums.get(id) ?? { key: r.key, model: r.model, prompt: 0, cached: 0, completion: 0 };
    s.prompt += r.tokens.prompt;
    s.cached += r.tokens.cached;
    s.completion += r.tokens.completion;
    this.sums.set(id, s);
  }

  /** Each key and model's sums. */
  entries(): { key: string; model: string; prompt: number; cached: number; completion: number }[] {
    return [...this.sums.values()];
  }
}

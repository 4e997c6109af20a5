/**
 * The usage ledger in KV `magus_usage` (records: shared/usage.ts): one entry per request id,
 * created — never updated — by the bridge that ended the request. KV `create` refuses a key that
 * exists, so a record is written exactly once however often a request is delivered, taken over or
 * replayed (README.md, "The usage ledger"), and for as long as the bucket keeps it: no
 * de-duplication window to outlive.
 *
 * Keys are `<key identity, base64url>.<UTC day of the request's start>.<request id>`, so a reader
 * lists one key's records, or one key's days, by a subject filter instead of reading everything.
 */
import type { JetStreamClient, KV } from 'nats';
import { periodOf, parseUsageRecord, type UsageRecord } from '../shared/usage';
import { isRevisionConflict } from './errors';
import { decodeJson, encodeJson } from './json';
import { limitKeyOf } from './limits';
import type { MeterVerifier } from './meter';
import type { DataPlaneNames } from './names';

/** The ledger key of `r`: the same for every attempt at its request (all from the request itself). */
export const usageKeyOf = (r: Pick<UsageRecord, 'key' | 'start' | 'id'>): string => `${limitKeyOf(r.key)}.${periodOf(r.start, 'day')}.${r.id}`;

/** The ledger key of a gateway's correction of `r`'s record ({@link UsageLedger.recordRefusal}). */
const correctionKeyOf = (r: Pick<UsageRecord, 'key' | 'start' | 'id'>): string => `${usageKeyOf(r)}.told`;

/** What a reader asks of the ledger. */
export interface UsageQuery {
  /** One key's records (its identity), else every key's. */
  key?: string;
  /** Records of requests that started at or after this (epoch ms). */
  since?: number;
  /** And before this (epoch ms). */
  until?: number;
}

export class UsageLedger {
  constructor(private readonly kv: KV) {}

  /** Binds the bucket (declared by `ensureDataPlane`). */
  static async open(js: JetStreamClient, names: DataPlaneNames): Promise<UsageLedger> {
    return new UsageLedger(await js.views.kv(names.usageBucket, { bindOnly: true }));
  }

  /** Writes `r` unless its request has a record already: `written`, or `existed` (another attempt wrote it). */
  async record(r: UsageRecord): Promise<'written' | 'existed'> {
    try {
      // A put expecting no earlier revision, not `create`: create reads the key back after a
      // conflict (to revive a deleted one: records are never deleted), and a bridge's NATS user
      // may write the ledger but not read it (roles.ts).
      await this.kv.put(usageKeyOf(r), encodeJson(r), { previousSeq: 0 });
      return 'written';
    } catch (err) {
      if (isRevisionConflict(err)) return 'existed';
      throw err;
    }
  }

  /**
   * Records what a gateway told the client of a request it gave up on (`r`: failed, no tokens;
   * README.md, "The usage ledger"). `written`: no record was there. `existed`: one was that says
   * what `r` says (this gateway's earlier try, or a bridge's `failed` with no tokens). `corrected`:
   * a bridge recorded the request otherwise first — its publish was stored after all and served,
   * `completed` (the gateway's cancel lost) or `cancelled` with the tokens made before the cancel
   * came: a correction carrying what it corrects is written beside that record, once, and readers
   * and sums take the correction instead. Records are never updated: a correction is a record of
   * its own.
   */
  async recordRefusal(r: UsageRecord): Promise<'written' | 'existed' | 'corrected'> {
    if ((await this.record(r)) === 'written') return 'written';
    const stored = await this.kv.get(usageKeyOf(r));
    const base = stored?.operation === 'PUT' ? parseUsageRecord(decodeJson(stored.value)) : undefined;
    if (base === undefined || (base.outcome === r.outcome && base.tokens.total === r.tokens.total)) return 'existed';
    try {
      await this.kv.put(correctionKeyOf(r), encodeJson({ ...r, corrects: { outcome: base.outcome, tokens: base.tokens } }), { previousSeq: 0 });
    } catch (err) {
      if (!isRevisionConflict(err)) throw err; // else: an earlier try of ours wrote it
    }
    return 'corrected';
  }

  /**
   * The records `q` selects, one per request — a gateway's correction in place of the record it
   * corrects — in the ledger's order (by key, then as written). Values that are not records are skipped.
   */
  async read(q: UsageQuery = {}): Promise<UsageRecord[]> {
    const filter = q.key === undefined ? '>' : `${limitKeyOf(q.key)}.>`;
    // By request id: a correction takes its record's place, whichever of the two comes first.
    const out = new Map<string, UsageRecord>();
    const sinceDay = q.since === undefined ? undefined : periodOf(q.since, 'day');
    // The watch delivers what is stored, then waits for news: it is stopped where it caught up
    // (for an empty bucket, that may be before the watch is returned).
    const watch: { iter?: Awaited<ReturnType<KV['watch']>>; caughtUp: boolean } = { caughtUp: false };
    const iter = await this.kv.watch({
      key: filter,
      ignoreDeletes: true,
      initializedFn: () => {
        watch.caughtUp = true;
        watch.iter?.stop();
      },
    });
    watch.iter = iter;
    if (watch.caughtUp) iter.stop();
    for await (const e of iter) {
      if (e.operation !== 'PUT' || e.value.length === 0) continue;
      const day = e.key.split('.')[1] ?? '';
      if (sinceDay !== undefined && day < sinceDay) continue;
      const r = parseUsageRecord(decodeJson(e.value));
      if (!r || (q.since !== undefined && r.start < q.since) || (q.until !== undefined && r.start >= q.until)) continue;
      if (r.corrects !== undefined || !out.has(r.id)) out.set(r.id, r);
    }
    return [...out.values()];
  }

  /**
   * The records `q` selects that a gateway signed (dataplane/meter.ts), and how many it left out:
   * records without a valid signature stand for no request a gateway took in.
   */
  async readSigned(q: UsageQuery, verifier: MeterVerifier): Promise<{ records: UsageRecord[]; unsigned: number }> {
    const records: UsageRecord[] = [];
    let unsigned = 0;
    for (const r of await this.read(q)) {
      if (await verifier.verify(r)) records.push(r);
      else unsigned += 1;
    }
    return { records, unsigned };
  }
}

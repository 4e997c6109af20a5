/**
 * Where a streamed answer can be picked up again (gateway/README.md, "Resuming a stream"): each
 * chunk's SSE `id` names the request, the replica that published it, the instance answering it,
 * and the chunk's seq, with a MAC binding all but the seq to the key's scope — so a client that
 * lost its connection (its gateway died) and sends the same request again with `Last-Event-ID`
 * to any replica gets the rest of that answer, and nobody else's.
 *
 * `<base64url of replica/pool/instance/request id>.<MAC>.<seq>`; the MAC is HMAC-SHA256 under the
 * gateways' shared secret (the one conversation keys use), its first 16 base64url characters.
 */
import { createHmac, timingSafeEqual } from 'node:crypto';
import type { KV } from 'nats';

/** The answer a stream belongs to. */
export interface ResumableAnswer {
  replica: string;
  pool: string;
  instance: string;
  requestId: string;
}

/** An event of it: the answer and the chunk's seq (the client has every chunk up to it). */
export interface ResumePoint extends ResumableAnswer {
  seq: number;
  /** What its events' ids begin with ({@link resumeIdPrefix}). */
  idPrefix: string;
}

const MAC_CHARS = 16;
/** Names in it are NATS subject tokens: none holds `/`. */
const NAME = /^[A-Za-z0-9_-]+$/;

function macOf(secret: string, scope: string, a: ResumableAnswer): string {
  return createHmac('sha256', secret)
    .update(['magus-resume', scope, a.replica, a.pool, a.instance, a.requestId].join('\0'))
    .digest('base64url')
    .slice(0, MAC_CHARS);
}

/** What every event id of answer `a`, served to a key of `scope`, begins with (its seq follows). */
export function resumeIdPrefix(secret: string, scope: string, a: ResumableAnswer): string {
  return `${Buffer.from([a.replica, a.pool, a.instance, a.requestId].join('/')).toString('base64url')}.${macOf(secret, scope, a)}.`;
}

/**
 * A `Last-Event-ID` this gateway (or another sharing its secret) issued to a key of `scope`, or
 * undefined. Without a seq (`<answer>.<mac>.`: the id a stream says while it waits for its first
 * chunk) it resumes from before the first: seq −1.
 */
export function parseLastEventId(secret: string, scope: string, id: string): ResumePoint | undefined {
  const parts = id.trim().split('.');
  if (parts.length !== 3 || !/^\d{0,9}$/.test(parts[2]!)) return undefined;
  const names = Buffer.from(parts[0]!, 'base64url').toString('utf8').split('/');
  if (names.length !== 4 || !names.every((n) => NAME.test(n))) return undefined;
  const [replica, pool, instance, requestId] = names as [string, string, string, string];
  const answer = { replica, pool, instance, requestId };
  const given = Buffer.from(parts[1]!);
  const expected = Buffer.from(macOf(secret, scope, answer));
  if (given.length !== expected.length || !timingSafeEqual(given, expected)) return undefined;
  return { ...answer, seq: parts[2] === '' ? -1 : Number(parts[2]), idPrefix: `${parts[0]!}.${parts[1]!}.` };
}

/**
 * Where each move of an answer went (dataplane/README.md, "Handing an answer back"): its n-th
 * continuation's request and instance, under the first request's id, in the gateways'
 * `magus_responses` bucket (key `moved.<first id>.<n>`, kept as long as stored responses), so
 * that a resume on any replica follows the answer past its moves (routes/resume.ts). A move is
 * claimed before its continuation is published, by whichever replica gets there first — the one
 * that published the answer, or one resuming it after that one died — so an answer is continued
 * once. A resume of the answer is recorded there too (key `resumed.<first id>`): the replica whose
 * client left does not cancel an answer a client came back for (routes/inference.ts `cancelUnlessResumed`).
 */
export interface MoveLog {
  /** Records `to` as move `n` unless one is recorded already; resolves with the move that holds (`to`, or the one before it). */
  claim(first: string, n: number, to: MoveRecord): Promise<MoveRecord>;
  find(first: string, n: number): Promise<MoveRecord | undefined>;
  /** Records that a client came back for the answer of `first`; resolves with the record's revision. */
  resumed?(first: string): Promise<number>;
  /**
   * The revision of the last record that a client came back for the answer of `first` (its resume
   * ids are its client's alone); 0 when none did. Revisions only grow: a resume after one a
   * replica recorded itself has a higher one.
   */
  lastResumed?(first: string): Promise<number>;
}

/**
 * A move as recorded: where the answer went, and `at`, the frames of the request it left that the
 * replica moving it had relayed — the answer's seqs go on from there, so a replay relays exactly
 * those of that request (a bridge that was only slow may publish more of it, or answer it whole
 * later) and numbers the rest as the live stream did. Moves recorded by gateways before it lack `at`.
 */
export interface MoveRecord extends ResumableAnswer {
  at?: number;
}

/** A {@link MoveLog} in KV bucket `kv`. */
export function kvMoveLog(kv: Pick<KV, 'create' | 'get' | 'put'>): MoveLog {
  const key = (first: string, n: number) => `moved.${first}.${n}`;
  const resumedKey = (first: string) => `resumed.${first}`;
  const find = async (first: string, n: number): Promise<MoveRecord | undefined> => {
    const e = await kv.get(key(first, n));
    if (!e || e.operation !== 'PUT') return undefined;
    const a = JSON.parse(e.string()) as Partial<MoveRecord>;
    if (![a.replica, a.pool, a.instance, a.requestId].every((v) => typeof v === 'string' && NAME.test(v))) return undefined;
    const to = { replica: a.replica!, pool: a.pool!, instance: a.instance!, requestId: a.requestId! };
    return Number.isSafeInteger(a.at) && a.at! >= 0 ? { ...to, at: a.at! } : to;
  };
  return {
    claim: async (first, n, to) => {
      try {
        await kv.create(key(first, n), JSON.stringify(to));
        return to;
      } catch (err) {
        // Refused because the key is there: the move another replica claimed first.
        const held = await find(first, n);
        if (held) return held;
        throw err;
      }
    },
    find,
    resumed: (first) => kv.put(resumedKey(first), String(Date.now())),
    lastResumed: async (first) => {
      const e = await kv.get(resumedKey(first));
      return e?.operation === 'PUT' ? e.revision : 0;
    },
  };
}

/**
 * How long the answer of a resumable stream whose client left goes on for a client to come back
 * for it (`MAGUS_GATEWAY_RESUME_HOLD_MS`): a dropped connection is resumed within seconds (an
 * `EventSource` retries after 3 s), and an answer nobody comes back for costs its engine this
 * long at most before it is cancelled.
 */
export const DEFAULT_RESUME_HOLD_MS = 10_000;

/** The request id of an answer's `n`-th continuation: `<first>-m<n>` (a request id: at most 128 characters), else a fresh one (not followed by resumes). */
export const continuationIdOf = (first: string, n: number, fresh: () => string): string =>
  first.length + 2 + String(n).length <= 128 ? `${first}-m${n}` : fresh();

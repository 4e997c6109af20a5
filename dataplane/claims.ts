/**
 * `magus_claims`: who owns the current attempt at a request, and how it ended (README.md,
 * "Exactly one answer per request id"). The bucket is declared by declare.ts; bridges bind it.
 */
import { setTimeout as sleep } from 'node:timers/promises';
import type { JetStreamClient, KV } from 'nats';
import { CONTINUE_ELSEWHERE } from '../shared/continuation';
import type { ResponseFrame } from '../shared/serving';
import type { UsageRecord } from '../shared/usage';
import { isRevisionConflict } from './errors';
import { decodeJson, encodeJson } from './json';
import type { DataPlaneNames } from './names';

/**
 * `magus_claims` entry: which delivery of a request owns it, and how it ended. Created by the
 * first delivery (KV create = CAS), taken over by every later delivery (CAS on the revision), and
 * finished (CAS) by the owner *before* it publishes the terminal frame, which it records here so
 * a later delivery can re-publish exactly that frame.
 */
export interface RequestClaim {
  attempt: number;
  /** Bridge process that owns the current attempt (for logs). */
  owner: string;
  /** Epoch ms of the first claim: every attempt stamps chunks with it, so attempts look alike. */
  createdAt: number;
  state: 'running' | 'finished';
  terminal?: ResponseFrame;
  /** The request's usage record (usage.ts), for a later delivery to write if the finishing one could not. */
  usage?: UsageRecord;
}

export type ClaimResult = { kind: 'fresh' | 'takeover'; claim: RequestClaim; revision: number } | { kind: 'finished'; claim: RequestClaim; revision: number };

export interface RequestClaims {
  /** Claims request `id` for this delivery: fresh, taken over from an earlier delivery, or already finished. */
  acquire(id: string, owner: string): Promise<ClaimResult>;
  /**
   * Marks the attempt holding `revision` finished with `terminal`; false when a later delivery
   * has taken the request over (the caller must then publish nothing more). Revision 0: a first
   * delivery that wrote no claim while it ran — the claim is created, already finished, and any
   * claim found instead means it was taken over. Safe to retry after an error (a lost reply): a
   * retry recognises its own earlier write.
   */
  finish(id: string, claim: RequestClaim, revision: number, terminal: ResponseFrame, usage?: UsageRecord): Promise<boolean>;
  /**
   * The claim's current revision (null when absent): an owner is superseded when it is past its
   * own. Read from any replica, it may be behind (never ahead): lower than the owner's proves nothing.
   */
  revision(id: string): Promise<number | null>;
  /** Whether a gateway ended request `id` ({@link endClaim}): its answer went on elsewhere. */
  ended(id: string): Promise<boolean>;
}

/** The owner a claim ended by a gateway names ({@link endClaim}). */
const ENDED_BY = 'gateway';

/**
 * The claim key of request `id` served by `own`: `<pool>.<instance>.<id>`, so a bridge's NATS user
 * may read and write its own instance's claims only (roles.ts). Bridges before it keyed claims by
 * the bare id: a request redelivered across that upgrade is claimed afresh (README.md, "The
 * instance's subject").
 */
export const claimKeyOf = (own: { pool: string; instance: string }, id: string): string => `${own.pool}.${own.instance}.${id}`;

/** The wait before re-read `round` (1, 2, …) of a claim: 20, 40, 80 … ms, time for a replica behind its leader to catch up. */
const backoff = (round: number) => sleep(10 * 2 ** round);

/** The claim stored under `key` and its revision; null when there is none (never written, or deleted). */
async function readClaim(kv: Pick<KV, 'get'>, key: string): Promise<{ claim: RequestClaim; revision: number } | null> {
  const e = await kv.get(key);
  return e && e.operation === 'PUT' ? { claim: decodeJson(e.value) as RequestClaim, revision: e.revision } : null;
}

/** Binds the claims bucket (declared by `ensureDataPlane`, declare.ts) for the bridge of `own`. */
export async function openRequestClaims(js: JetStreamClient, names: DataPlaneNames, own: { pool: string; instance: string }): Promise<RequestClaims> {
  // Gets go direct (the bucket allows it, declare.ts): a direct get names the key in its subject,
  // which a bridge's NATS user may ask for its own instance's keys only (roles.ts). A bound
  // bucket uses direct gets only when told.
  const kv: KV = await js.views.kv(names.claimsBucket, { bindOnly: true, allow_direct: true });
  const keyOf = (id: string) => claimKeyOf(own, id);
  const read = (id: string) => readClaim(kv, keyOf(id));
  return {
    async acquire(id, owner) {
      const fresh: RequestClaim = { attempt: 1, owner, createdAt: Date.now(), state: 'running' };
      // A few rounds: a conflict means another party moved the claim in between (e.g. the
      // superseded owner finishing at the same moment), or the read came from a replica that had
      // not yet applied the last write (direct gets go to any replica); re-read and decide again.
      for (let round = 0; round < 5; round += 1) {
        if (round > 0) await backoff(round);
        const current = await read(id);
        try {
          if (!current) return { kind: 'fresh', claim: fresh, revision: await kv.create(keyOf(id), encodeJson(fresh)) };
          if (current.claim.state === 'finished') return { kind: 'finished', ...current };
          const next: RequestClaim = { ...current.claim, attempt: current.claim.attempt + 1, owner };
          return { kind: 'takeover', claim: next, revision: await kv.update(keyOf(id), encodeJson(next), current.revision) };
        } catch (err) {
          if (!isRevisionConflict(err)) throw err;
        }
      }
      throw new Error(`request ${id}: could not claim it (the claim kept changing)`);
    },
    async finish(id, claim, revision, terminal, usage) {
      const finished: RequestClaim = { ...claim, state: 'finished', terminal, ...(usage ? { usage } : {}) };
      try {
        if (revision === 0) await kv.create(keyOf(id), encodeJson(finished));
        else await kv.update(keyOf(id), encodeJson(finished), revision);
        return true;
      } catch (err) {
        if (!isRevisionConflict(err)) throw err;
        // Either superseded, or this is a retry of a finish whose reply was lost: only the
        // latter leaves exactly our value behind. The conflict says the claim is past `revision`;
        // a read that is not (a replica behind the leader) is asked again.
        let current = await read(id);
        for (let round = 1; round < 5 && current !== null && current.revision <= revision; round += 1) {
          await backoff(round);
          current = await read(id);
        }
        return current !== null && JSON.stringify(current.claim) === JSON.stringify(finished);
      }
    },
    async revision(id) {
      return (await read(id))?.revision ?? null;
    },
    async ended(id) {
      const current = await read(id);
      return current?.claim.state === 'finished' && current.claim.owner === ENDED_BY;
    },
  };
}

/**
 * Ends request `id` of instance `own` for its gateway, which moved the answer away from a bridge
 * it heard no beat of after `at` of its frames (README.md, "Cancels"): its claim, unless an
 * attempt finished it already, becomes finished with a hand-back at `at` (`CONTINUE_ELSEWHERE`,
 * the terminal frame a redelivery says again). No delivery serves the request afterwards — on a
 * bridge that did not hear the gateway's cancel (restarted since, or cut off when it went out)
 * either: a first delivery asks {@link RequestClaims.ended} as it begins and ends as handed back,
 * an attempt running finds itself superseded at its next check, and a redelivery finds the claim
 * finished and says the hand-back again, which no one reads.
 */
export async function endClaim(kv: Pick<KV, 'get' | 'create' | 'update'>, own: { pool: string; instance: string }, id: string, at: number): Promise<void> {
  const key = claimKeyOf(own, id);
  const terminal: ResponseFrame = {
    seq: at,
    type: 'error',
    error: { status: 503, type: 'server_error', code: CONTINUE_ELSEWHERE, message: 'its gateway heard no beat of this bridge and continued it elsewhere' },
  };
  const ended: RequestClaim = { attempt: 0, owner: ENDED_BY, createdAt: Date.now(), state: 'finished', terminal };
  for (let round = 0; round < 5; round += 1) {
    if (round > 0) await backoff(round);
    const current = await readClaim(kv, key);
    if (current?.claim.state === 'finished') return;
    try {
      if (current) await kv.update(key, encodeJson({ ...ended, attempt: current.claim.attempt, createdAt: current.claim.createdAt }), current.revision);
      else await kv.create(key, encodeJson(ended));
      return;
    } catch (err) {
      if (!isRevisionConflict(err)) throw err; // an attempt wrote meanwhile: read again
    }
  }
  throw new Error(`request ${id}: could not end its claim (it kept changing)`);
}

/**
 * Serving one delivery of a request to its end (README.md one folder up, "Exactly one answer per
 * request id", rules 1 and 3): checked at the trust boundary, dropped when its client went away,
 * served by a first attempt that writes no claim, or — a redelivery — claimed, replayed when it
 * was answered already, and resumed after the frames an earlier attempt published. A delivery of
 * a request this bridge is serving now is adopted by the attempt serving it (attempt.ts `adopt`).
 */
import type { JetStreamClient, JetStreamManager, JsMsg, NatsConnection } from 'nats';
import type { InferenceRequest, ResponseFrame } from '../../shared/serving';
import type { RequestClaims } from '../claims';
import { encodeFrame, FrameParts } from '../frames';
import type { DataPlaneNames } from '../names';
import { readStoredFrames, type StoredFrames } from '../response-stream';
import { recordUsage, type Attempt, type Outcome } from './attempt';
import type { LiveAttempts } from './attempts';
import type { Cancels } from './cancels';
import { BridgeErrorCode, errorFrame } from './error-frames';
import { handBackFrame, movable } from './generate';
import type { BridgeStats } from './metrics';
import { parseInferenceRequest } from './requests';

/** What serving a delivery needs of its bridge. */
export interface DeliveryContext {
  nc: NatsConnection;
  js: JetStreamClient;
  jsm: JetStreamManager;
  names: DataPlaneNames;
  /** The instance this bridge serves: a request's frames go to its subject when the request asks (requests.ts). */
  own: { pool: string; instance: string };
  claims: RequestClaims;
  /** This bridge process, as claims name it. */
  owner: string;
  attempts: LiveAttempts;
  cancels: Cancels;
  stats: BridgeStats;
  log: (line: string) => void;
  /** Logs and counts an unexpected failure. */
  failed: (what: string, err: unknown) => void;
  /** `nak` delay when a claim or a read-back failed. */
  retryDelayMs: number;
  /** How often a delivery calls `working()` and its attempt checks it still owns the request. */
  workingEveryMs: number;
  /** Calls the engine for an attempt (generate.ts, with the bridge's engine). */
  generate(a: Attempt, prior: ResponseFrame[]): Promise<Outcome>;
}

/** Serves one delivery to its end: resolved (ack/term/nak) unless superseded or disconnected. */
export async function serveDelivery(ctx: DeliveryContext, m: JsMsg): Promise<void> {
  const { nc, stats } = ctx;
  stats.pulled += 1;
  if (m.redelivered) stats.redelivered += 1;
  const parsed = parseInferenceRequest(m.data, ctx.names, ctx.own);
  if (!parsed.ok) {
    ctx.log(`terminating malformed request (stream seq ${m.seq}): ${parsed.problem}`);
    if (parsed.replyTo) {
      nc.publish(parsed.replyTo, encodeFrame(errorFrame(0, 400, 'invalid_request_error', BridgeErrorCode.invalidRequest, parsed.problem)));
      await nc.flush();
    }
    m.term(parsed.problem);
    stats.termed += 1;
    return;
  }
  const req = parsed.req;
  if (ctx.cancels.has(req.id)) {
    // Its client went away while it was queued: nobody waits for an answer.
    m.term('cancelled');
    stats.termed += 1;
    stats.cancelled += 1;
    return;
  }
  let attempt: Attempt | undefined;
  // Keeps JetStream from redelivering it, and checks periodically that the attempt still owns it.
  const ticker = setInterval(() => {
    try {
      m.working();
    } catch {
      // closed connection: nc.closed() aborts the attempt
    }
    attempt?.check();
  }, ctx.workingEveryMs);
  try {
    // Delivered again while this bridge serves it — marked so, or as a first delivery by a new
    // consumer leader that did not know of the one before: the attempt goes on and resolves this
    // delivery (attempt.ts `adopt`); this one's ticker keeps it from being delivered once more meanwhile.
    const live = ctx.attempts.serving(req.id);
    if (live) {
      stats.adopted += 1;
      live.log(`delivered again (delivery ${m.info.deliveryCount}) while this bridge serves it: its attempt goes on`);
      return await live.adopt(m);
    }
    if (!m.redelivered) return await serveFirst(ctx, m, req, (a) => (attempt = a));
    await serveRedelivery(ctx, m, req, (a) => (attempt = a));
  } finally {
    clearInterval(ticker);
  }
}

/**
 * A first delivery. No earlier delivery exists, so nobody else can own the request and no claim
 * is written while it runs (revision 0 = none). Connected at the end, it publishes its terminal
 * frame and acks: no KV write at all, the stored frame is the record a redelivery finds. Cut off
 * from NATS at the end, it creates the claim, already finished, before publishing (the CAS
 * proves nobody took over meanwhile). A later delivery that takes over creates a claim, which
 * this attempt notices at its periodic check and then publishes nothing more.
 */
async function serveFirst(ctx: DeliveryContext, m: JsMsg, req: InferenceRequest, track: (a: Attempt | undefined) => void): Promise<void> {
  const a = ctx.attempts.open(req, m, { attempt: 1, owner: ctx.owner, createdAt: Date.now(), state: 'running' }, 0);
  track(a);
  // Beside the engine call, not before it: whether its gateway ended the request (moved its answer
  // away while this bridge was silent: claims.ts `endClaim`) with a cancel this process may not
  // have heard — restarted since, or cut off then. It then ends as that cancel would have ended it.
  ctx.claims.ended(req.id).then(
    (ended) => ended && !a.isConcluding && a.abort('moved'),
    () => undefined, // unread, the attempt's periodic check still finds the claim
  );
  try {
    if (Date.now() >= a.cutsAt()) {
      return await a.conclude(errorFrame(0, 504, 'timeout', BridgeErrorCode.deadlineExceeded, 'the request deadline passed before it was served'), 'term');
    }
    await a.settle(await ctx.generate(a, []));
  } finally {
    ctx.attempts.retire(a);
    track(undefined);
  }
}

/** How long a redelivery reads its request's stored frames again before it hands the request back with a nak. */
const READ_BACK_PATIENCE_MS = 12_000;
/** How long one read of them may take to reach the last stored frame (a new stream leader catching up). */
const READ_BACK_TIMEOUT_MS = 3_000;
/** The first pause between two reads of them (doubling, up to the bridge's retry delay). */
const READ_BACK_FIRST_PAUSE_MS = 250;

/** A redelivery: claims the request, replays a finished one, or resumes after what reached the server. */
async function serveRedelivery(ctx: DeliveryContext, m: JsMsg, req: InferenceRequest, track: (a: Attempt | undefined) => void): Promise<void> {
  const { nc, stats, log, names } = ctx;
  let claimed: Awaited<ReturnType<RequestClaims['acquire']>>;
  try {
    claimed = await ctx.claims.acquire(req.id, ctx.owner);
  } catch (err) {
    ctx.failed(`request ${req.id}: claiming it failed; retrying later`, err);
    m.nak(ctx.retryDelayMs);
    stats.nakked += 1;
    return;
  }
  if (claimed.kind === 'finished') {
    // An earlier delivery answered but its ack was lost: say the same last word again, and write
    // its usage record if that delivery could not.
    if (claimed.claim.terminal) nc.publish(req.replyTo, encodeFrame(claimed.claim.terminal));
    await nc.flush();
    if (!(await recordUsage(ctx.attempts.context, claimed.claim.usage))) {
      m.nak(ctx.retryDelayMs);
      stats.nakked += 1;
      return;
    }
    m.ack();
    stats.acked += 1;
    stats.replayed += 1;
    return;
  }
  const a = ctx.attempts.open(req, m, claimed.claim, claimed.revision);
  track(a);
  try {
    // A redelivery: an earlier delivery may have published frames already (a first delivery
    // writes its claim only once it has answered, so finding no claim proves nothing).
    let prior: ResponseFrame[] = [];
    {
      // No frame of the request is older than the request itself (stored at `since`).
      let stored: StoredFrames | undefined;
      // The response stream has no leader (an election) or NATS is away: what was sent cannot be
      // known yet. Read again here, the delivery kept (the ticker says it is being worked on), each
      // read given READ_BACK_TIMEOUT_MS, for READ_BACK_PATIENCE_MS: a nak's redelivery comes from
      // the request consumer, which is often electing a leader itself then and loses a nak sent to
      // its old one — under bench:chaos one read waited 10 s, and the delivery after its nak came
      // at ack_wait, 20 s later: a 31-s silence. Then hand it back for a retry; the next delivery
      // takes over from our claim.
      for (let pause = READ_BACK_FIRST_PAUSE_MS, giveUpAt = Date.now() + READ_BACK_PATIENCE_MS; !stored; pause = Math.min(2 * pause, ctx.retryDelayMs)) {
        try {
          stored = await readStoredFrames(ctx.js, ctx.jsm, names.responseStream, req.replyTo, {
            since: m.info.timestampNanos / 1e6,
            timeoutMs: READ_BACK_TIMEOUT_MS,
          });
        } catch (err) {
          if (a.signal.aborted) return; // superseded or cut off meanwhile: not ours to resolve
          if (Date.now() + pause > giveUpAt) {
            ctx.failed(`request ${req.id}: reading back its frames failed; retrying in ${ctx.retryDelayMs} ms`, err);
            m.nak(ctx.retryDelayMs);
            stats.nakked += 1;
            return;
          }
          ctx.log(`request ${req.id}: reading back its frames failed (${(err as Error).message}); reading again in ${pause} ms`);
          await new Promise((resolve) => setTimeout(resolve, pause));
        }
      }
      prior = stored.frames;
      // A large answer's parts say its usage only once joined into their `done`.
      const parts = new FrameParts();
      for (const f of prior) {
        if (f.type === 'part') parts.add(f);
        else a.note(f.type === 'done' ? (parts.join(f) ?? f) : f);
      }
      a.nextSeq = prior.length;
      if (prior.length > 0) {
        stats.resumed += 1;
        log(`request ${req.id}: attempt ${a.claim.attempt} resumes after ${prior.length} frames`);
      }
      const last = prior.at(-1);
      if (last && (last.type === 'done' || last.type === 'error')) return await a.conclude(last, 'ack'); // answered, but never claimed finished
      // (Ending in parts: it died halfway through a large answer's; answered again, its own parts follow.)
      if (stored.incomplete && acrossGap(stored)) {
        // Frames lost in the middle (published while the stream had no leader, and not published
        // again: their attempt was superseded or died) with frames stored after them: the client
        // has at most what is stored in order, and may have had the lost ones straight from their
        // publish. Generated again from there (the same words from an exact engine: engine/README.md),
        // checked against the frames stored after them (generate.ts).
        stats.resumedAcrossGap += 1;
        a.beyondGap = new Map(stored.beyondGap.map((f) => [f.seq, f]));
        log(`request ${req.id}: attempt ${a.claim.attempt} resumes across a gap (${stored.incomplete.detail})`);
      } else if (stored.incomplete) {
        // Frames of the request are gone (MAGUS_RESPONSES evicted or aged them out, or lost them
        // with a leader): what the client has cannot be known here, but its gateway knows what it
        // relayed. A streamed answer that can be continued is handed back to go on after that;
        // any other ends there with resume_failed. Readers of the stream find either after the
        // highest seq stored.
        const seq = Math.max(prior.length, stored.highestSeq + 1);
        if (movable(a, ctx.attempts.context.continues === true, true)) {
          log(
            `request ${req.id}: its earlier frames are no longer in ${names.responseStream} (${stored.incomplete.detail}); handing it back to go on after what its gateway relayed`,
          );
          return await a.conclude(
            { ...handBackFrame(a, 'its earlier frames were lost: continue it after what was relayed', a.handedBack()), seq, afterRelayed: true },
            'term',
          );
        }
        stats.resumeFailed += 1;
        log(`request ${req.id}: its earlier frames are no longer in ${names.responseStream}; ending it (resume_failed: ${stored.incomplete.detail})`);
        return await a.conclude(
          { ...errorFrame(seq, 502, 'server_error', BridgeErrorCode.resumeFailed, 'the interrupted answer could not be read back'), afterRelayed: true },
          'term',
        );
      }
    }
    if (Date.now() >= a.cutsAt(prior)) {
      return await a.conclude(
        errorFrame(a.nextSeq, 504, 'timeout', BridgeErrorCode.deadlineExceeded, 'the request deadline passed before it was served'),
        'term',
      );
    }
    await a.settle(await ctx.generate(a, prior));
  } finally {
    ctx.attempts.retire(a);
  }
}

/**
 * A request still queued for this instance when its drain deadline passed (its bridge stops, and
 * its consumer goes with it): a first delivery its gateway can continue elsewhere (a stream, on
 * an engine that `continues` answers) is handed back at once, nothing of it said, and the gateway
 * sends it to another instance; any other first delivery is answered 503 `instance_stopped` (its
 * client retries, on an instance that serves) rather than lost with the consumer. A redelivery
 * (an earlier attempt may have said part of it) goes back to the consumer for a bridge of this
 * instance that comes back, after `naksForMs`.
 */
export async function handBackQueued(ctx: DeliveryContext, m: JsMsg, continues: boolean, naksForMs: number): Promise<void> {
  const parsed = parseInferenceRequest(m.data, ctx.names, ctx.own);
  if (!parsed.ok || ctx.cancels.has(parsed.req.id)) return serveDelivery(ctx, m); // terminated either way
  const { req } = parsed;
  if (m.redelivered) {
    m.nak(naksForMs);
    ctx.stats.nakked += 1;
    return;
  }
  ctx.stats.pulled += 1;
  const a = ctx.attempts.open(req, m, { attempt: 1, owner: ctx.owner, createdAt: Date.now(), state: 'running' }, 0);
  try {
    if (movable(a, continues, true)) await a.settle({ kind: 'aborted', reason: 'shutdown' });
    else await a.conclude(errorFrame(0, 503, 'server_error', BridgeErrorCode.instanceStopped, 'its instance stopped before serving it; retry'), 'term');
  } finally {
    ctx.attempts.retire(a);
  }
}

/**
 * Whether a redelivery can go on across the gap its read-back found: frames lost between stored
 * ones, those after them only chunks of a streamed answer or its `done` (an error or a part after
 * a gap: ended as before).
 */
function acrossGap(stored: StoredFrames): boolean {
  const { incomplete, beyondGap, highestSeq } = stored;
  return (
    incomplete?.why === 'gap' &&
    beyondGap.at(-1)?.seq === highestSeq && // every frame after the gap read (a reader holds at most MAX_HELD_FRAMES)
    beyondGap.every((f) => f.type === 'chunk' || f.type === 'done')
  );
}

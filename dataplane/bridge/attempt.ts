/**
 * One delivery's attempt at a request (README.md one folder up, "Exactly one answer per request
 * id"): the frames it publishes, held while NATS is away and published again once it proved it
 * still owns the request; the checks that it does; and its end — the terminal frame, the claim's
 * CAS, and the ack, term or nak of its message.
 */
import type { JsMsg, NatsConnection } from 'nats';
import type { InferenceRequest, ResponseFrame } from '../../shared/serving';
import { usageIn, usageRecordOf, type Tokens, type UsageRecord, type UsageTotals } from '../../shared/usage';
import type { RequestClaim, RequestClaims } from '../claims';
import type { UsageLedger } from '../usage';
import { BridgeErrorCode, errorFrame } from './error-frames';
import type { BridgeStats } from './metrics';
import { PendingFrames, type StoredFramePublisher } from './stored-frames';
import { DEFAULT_MAX_PAYLOAD, splitFrame } from '../frames';
import { within } from '../errors';
import { CONTINUE_ELSEWHERE, resumedAnswer } from '../../shared/continuation';
import { carriesText, handBackFrame, movable } from './generate';

/** Why an attempt was stopped before it concluded. */
export type AbortReason = 'superseded' | 'closed' | 'shutdown' | 'diverged' | 'cancelled' | 'moved';

/** How an engine call (or a failure before it) ends an attempt: see {@link Attempt.settle}. */
export type Outcome =
  | { kind: 'finish'; frame: ResponseFrame; resolve: 'ack' | 'term' }
  /**
   * `engineAway`: the engine was unreachable, died mid-answer or is starting (503), not refusing
   * the request; `engineStarting`: it said it starts from standby (shared/continuation.ts `ENGINE_STARTING`).
   */
  | { kind: 'retry'; reason: string; engineAway?: boolean; engineStarting?: boolean }
  | { kind: 'aborted'; reason: AbortReason };

/** What every attempt of one bridge shares. */
export interface AttemptContext {
  nc: NatsConnection;
  frames: StoredFramePublisher;
  claims: RequestClaims;
  stats: BridgeStats;
  log: (line: string) => void;
  /** `names.responseStream`, for logs. */
  responseStream: string;
  /** The consumer's `ack_wait`. */
  ackWaitMs: number;
  /** How long a delivery waits for its frames to be stored before it is resolved anyway. */
  storeWaitMs: number;
  /** First `nak` delay after a transient failure; doubles per delivery, at most 30 s. */
  retryDelayMs: number;
  /** The consumer's `max_deliver` (Infinity: unbounded). */
  maxDeliver: number;
  /** Whether NATS is connected now. */
  isConnected(): boolean;
  /** Where each request's usage record goes (absent: none is written). */
  ledger?: UsageLedger;
  /** The tokens of the records this bridge wrote (`magus_usage_tokens_total`). */
  usage: UsageTotals;
  /** Its engine continues answers from their tokens (shared/engines.ts): one stopped at the drain deadline is handed back to be continued elsewhere. */
  continues?: boolean;
  /** Numbers the answers handed back together (their frames' `spread`). */
  handBacks: HandBacks;
}

/**
 * Numbers a bridge's hand-backs, the `spread` of their frames (shared/serving.ts `ResponseFrame`):
 * 0, 1, 2 … among those handed back together (from 0 again after {@link HAND_BACKS_APART_MS}
 * without one). Answers with something said and answers with nothing said yet are numbered apart:
 * a drain hands back both at once, and the first go on in the other instances' resume sequences,
 * the second in their queues — each kind spreads evenly by itself.
 */
export class HandBacks {
  private readonly last = new Map<boolean, number>();
  private readonly count = new Map<boolean, number>();

  next(said: boolean, now = Date.now()): number {
    const n = now - (this.last.get(said) ?? -Infinity) > HAND_BACKS_APART_MS ? 0 : (this.count.get(said) ?? 0);
    this.last.set(said, now);
    this.count.set(said, n + 1);
    return n;
  }
}

/** Hand-backs further apart than this are not numbered together. */
export const HAND_BACKS_APART_MS = 1_000;

/**
 * How long a claim check after a reconnect waits for its read. A direct get can go unanswered
 * while the cluster gets over a server's death (a replica that knows of no leader drops it), and
 * waiting out the client's 5-s timeout kept frames held that long; a read asked again (the sweep,
 * every 500 ms) was answered at once. bench:chaos: held 5.2 s, the read that went out after the
 * timeout answered in 156 ms.
 */
export const CLAIM_CHECK_MS = 1_000;

export class Attempt {
  private controller = new AbortController();
  /** Frames withheld while NATS is disconnected: published after a reconnect proves we still own the request. */
  private readonly held: ResponseFrame[] = [];
  /** Frames published but not yet acknowledged as stored by the response stream. */
  private readonly pending = new PendingFrames();
  /** Its claim is finished with its terminal frame (by this attempt): no later check can find it superseded. */
  private recorded = false;
  private paused: boolean;
  /** When it last began holding frames. */
  private pausedAt = Date.now();
  private resuming = false;
  /** A claim check after a reconnect failed since it began holding frames (the first failure is logged, not each). */
  private checkFailed = false;
  private concluding = false;
  /** The seq the next frame of this request gets (frames before it may come from an earlier attempt). */
  nextSeq = 0;
  /** The answer's frames so far, earlier attempts' included, as its engine call keeps them (generate.ts). */
  answer: readonly ResponseFrame[] = [];
  /**
   * Frames an earlier attempt stored beyond a seq the response stream lost (by seq): its client
   * may have them, so what this attempt generates at those seqs must say the same (generate.ts).
   */
  beyondGap: ReadonlyMap<number, ResponseFrame> = new Map();

  /** The seq after every frame its client may have: this attempt's next, or past those stored beyond a gap. */
  get saidUpTo(): number {
    let upTo = this.nextSeq;
    for (const s of this.beyondGap.keys()) upTo = Math.max(upTo, s + 1);
    return upTo;
  }
  /** The tokens the request's frames reported (the engine's `usage`), and the chunks they streamed. */
  private tokens: Tokens | undefined;
  private chunks = 0;

  /** Logs `line` as this request's. */
  log(line: string): void {
    this.ctx.log(`request ${this.req.id}: ${line}`);
  }

  /** The deliveries it resolves: the one it began with, and any later one it adopted. */
  private readonly deliveries: JsMsg[];
  /** Resolves once its delivery is done with ({@link end}). */
  private readonly ended: Promise<void>;
  private markEnded: () => void = () => undefined;

  constructor(
    private readonly ctx: AttemptContext,
    readonly req: InferenceRequest,
    msg: JsMsg,
    readonly claim: RequestClaim,
    /** The claim's revision this attempt holds (0: none written, a first delivery's). */
    readonly revision: number,
  ) {
    this.deliveries = [msg];
    this.ended = new Promise((resolve) => (this.markEnded = resolve));
    this.paused = !ctx.isConnected();
  }

  /** Its latest delivery. */
  get msg(): JsMsg {
    return this.deliveries.at(-1)!;
  }

  /**
   * Whether it is serving its request and may take a later delivery of it on ({@link adopt}):
   * neither stopped nor ending.
   */
  get serving(): boolean {
    return !this.signal.aborted && !this.concluding;
  }

  /**
   * Takes `m`, a later delivery of its request to this bridge, on as the one it resolves: JetStream
   * delivered it again while this attempt ran (a new leader of the request consumer does, whatever
   * the attempt's progress reports said to the old one). Taking it over instead — claim, read back,
   * continue — would stop an answer that was going well, and under bench:chaos that cost silences of
   * ~1 s, and 31 s once its read-back failed. The attempt resolves every delivery it holds alike
   * (one message delivered twice, or two messages of one request). Resolves once it is done with them.
   */
  adopt(m: JsMsg): Promise<void> {
    this.deliveries.push(m);
    return this.ended;
  }

  /** Hands its deliveries back to JetStream, for a retry after `delay` ms (default: at once). */
  private nak(delay?: number): void {
    for (const m of this.deliveries) m.nak(delay);
    this.ctx.stats.nakked += 1;
  }

  /** Aborted when the attempt must stop; the reason is an {@link AbortReason}. */
  get signal(): AbortSignal {
    return this.controller.signal;
  }

  /** Whether it is ending (its terminal frame is decided): a cancel no longer stops it. */
  get isConcluding(): boolean {
    return this.concluding;
  }

  /** Stops the attempt (once; later reasons are ignored). */
  abort(reason: AbortReason): void {
    if (this.controller.signal.aborted) return;
    if (reason === 'superseded') this.ctx.stats.superseded += 1;
    this.controller.abort(reason);
  }

  /** Its engine continues the answer from the tokens an earlier attempt sent (generate.ts). */
  continued(): void {
    this.ctx.stats.continued += 1;
  }

  /** It hands its answer back to be continued elsewhere (generate.ts `handBackFrame`): its `spread`. */
  handedBack(): number {
    this.ctx.stats.handedBack += 1;
    return this.ctx.handBacks.next(this.holdsPart);
  }

  /** Part of its answer has been said (by this attempt or the request it continues): its client waits mid-answer. */
  get holdsPart(): boolean {
    return (this.req.continues?.resume.tokens.length ?? 0) > 0 || (resumedAnswer(this.answer)?.tokens.length ?? 0) > 0;
  }

  /**
   * When time cuts its request (epoch ms), `said` its frames so far: the request's deadline (its
   * gateway stops waiting for it) until its client has part of the answer; then never. A stream
   * that has begun goes on to its end, handed back and continued as often as that takes: its
   * gateway bounds each silence instead (`MAGUS_GATEWAY_REQUEST_TIMEOUT_MS`), as it bounds the wait
   * for the first piece. (Not {@link holdsPart}: a stream whose frames say no tokens — one that
   * cannot be continued elsewhere — has begun too.)
   */
  cutsAt(said: readonly ResponseFrame[] = this.answer): number {
    const begun =
      this.req.kind !== 'embeddings' &&
      this.req.body.stream === true &&
      ((this.req.continues?.resume.tokens.length ?? 0) > 0 || said.some((f) => f.type === 'chunk' && carriesText(f.data)));
    return begun ? Infinity : this.req.deadline;
  }

  /** Notes what a frame of the request says of its usage: this attempt's, and those an earlier one sent. */
  note(frame: ResponseFrame): void {
    if (frame.type === 'error' || frame.type === 'part') return;
    const tokens = usageIn(frame.data);
    if (tokens) this.tokens = tokens;
    else if (frame.type === 'chunk' && ((frame.data as { choices?: unknown[] } | null)?.choices ?? []).length > 0) this.chunks += 1;
  }

  /** Publishes a frame (or holds it while disconnected); never throws. */
  send(frame: ResponseFrame): void {
    if (this.signal.aborted) return;
    this.note(frame);
    if (this.paused) {
      this.held.push(frame);
      return;
    }
    try {
      this.ctx.frames.publish(this.pending, this.req.replyTo, frame);
    } catch {
      this.abort('closed'); // the connection is closed: this process can no longer answer
    }
  }

  /** NATS went away: hold frames from now on. */
  pause(): void {
    if (!this.paused) this.pausedAt = Date.now();
    this.paused = true;
  }

  /**
   * After a reconnect: publish again the frames not known to be stored, and the held ones, only
   * if no later delivery took the request over meanwhile. A failed check is retried by the sweep.
   */
  async resume(): Promise<void> {
    if (this.resuming || !this.paused || this.signal.aborted) return;
    this.resuming = true;
    try {
      if (!this.recorded) {
        const rev = (await within("the claim's read", CLAIM_CHECK_MS, this.ctx.claims.revision(this.req.id))) ?? 0; // 0: no claim yet (a first delivery's)
        if (!this.ctx.isConnected() || this.signal.aborted) return;
        if (rev > this.revision) return this.abort('superseded'); // a later delivery's claim (a lower one: a replica behind)
      }
      if (!this.ctx.isConnected()) return;
      this.paused = false;
      this.ctx.frames.resend(this.pending, true);
      const held = this.held.splice(0);
      for (const f of held) this.send(f);
      if (held.length > 0) this.ctx.log(`request ${this.req.id}: ${held.length} frame(s) held ${Date.now() - this.pausedAt} ms while NATS was away published`);
      this.checkFailed = false;
    } catch (err) {
      if (!this.checkFailed)
        this.ctx.log(`request ${this.req.id}: claim check after reconnect failed (${(err as Error).message}); still holding frames, asking again`);
      this.checkFailed = true;
    } finally {
      this.resuming = false;
    }
  }

  /** The periodic sweep, while connected: a paused attempt tries to resume, unstored frames go out again. */
  sweep(): void {
    if (this.signal.aborted) return;
    if (this.paused) void this.resume();
    else if (this.pending.size > 0) this.ctx.frames.resend(this.pending);
  }

  /** Checks (every ⅓ ack_wait) that this attempt still owns its request. */
  check(): void {
    if (this.concluding) return;
    if (this.paused) {
      if (this.ctx.isConnected()) void this.resume();
      return;
    }
    this.ctx.claims.revision(this.req.id).then(
      (rev) => {
        // Past our own: a later delivery took it over. Lower: read from a replica behind the leader.
        if (!this.concluding && rev !== null && rev > this.revision) this.abort('superseded');
      },
      () => undefined, // a failed check proves nothing; the finish CAS is the last word
    );
  }

  /**
   * Ends an attempt its own abort stopped (the drain deadline, a `moved` cancel) with the frame
   * that hands its answer back: concluded as if it had not been aborted, since it still owns the
   * request — only its engine call was stopped.
   */
  private endHandedBack(why: string, spread?: number): Promise<void> {
    this.controller = new AbortController();
    return this.conclude(handBackFrame(this, why, spread), 'term');
  }

  /** Resolves a delivery after its engine call (or a failure before it). */
  async settle(outcome: Outcome): Promise<void> {
    const m = this.msg;
    switch (outcome.kind) {
      case 'finish':
        return this.conclude(outcome.frame, outcome.resolve);
      case 'aborted':
        if (outcome.reason === 'cancelled') {
          // Recorded as finished so no later delivery regenerates it; nobody listens to the frame.
          this.ctx.stats.cancelled += 1;
          return this.conclude(errorFrame(this.nextSeq, 499, 'cancelled', 'client_closed', 'the client went away'), 'term');
        }
        // Its gateway heard no beat of this bridge in time and continues the answer elsewhere:
        // end it as handed back (finished, nothing recorded), so no later delivery serves it.
        if (outcome.reason === 'moved') return this.endHandedBack('its gateway continues it elsewhere');
        if (outcome.reason === 'shutdown') {
          // The drain deadline passed: an answer that can be continued is handed back to its
          // gateway, which continues it on another instance (this one's consumer goes with it);
          // any other goes back to the consumer, for a bridge of this instance that comes back.
          if (this.ctx.isConnected() && movable(this, this.ctx.continues === true, true))
            return this.endHandedBack('its instance is stopping (the drain deadline passed): continue it elsewhere', this.handedBack());
          this.nak();
        }
        return;
      case 'retry': {
        const delivery = m.info.deliveryCount;
        const delay = Math.min(this.ctx.retryDelayMs * 2 ** (delivery - 1), 30_000);
        if (delivery >= this.ctx.maxDeliver) {
          return this.conclude(
            errorFrame(this.nextSeq, 503, 'server_error', BridgeErrorCode.engineUnavailable, `${outcome.reason} (after ${delivery} deliveries)`),
            'term',
          );
        }
        if (Date.now() + delay >= this.cutsAt()) {
          return this.conclude(errorFrame(this.nextSeq, 504, 'timeout', BridgeErrorCode.deadlineExceeded, `${outcome.reason}; no time left to retry`), 'term');
        }
        this.ctx.log(`request ${this.req.id}: ${outcome.reason}; retrying in ${delay} ms`);
        this.nak(delay);
        return;
      }
    }
  }

  /**
   * Publishes the terminal `frame`, records it in the claim and resolves the message. Connected
   * and holding nothing (the usual case), the frame goes out first and the claim's CAS follows,
   * off the client's path; otherwise the CAS comes first and proves we still own the request —
   * or a claim check after the reconnect does ({@link resume}) and it goes out then, the CAS after.
   * Superseded (the CAS fails): nothing more is published and the message is left to its owner.
   * A first delivery that wrote no claim and published its terminal frame writes none at all:
   * `MAGUS_RESPONSES` holds the frame, and a redelivery (a lost ack) reads it back and replays it.
   * A whole answer larger than a NATS message may be goes out as parts before a terminal frame
   * that says how many (frames.ts `splitFrame`); the claim records that small terminal frame.
   */
  async conclude(whole: ResponseFrame, resolve: 'ack' | 'term'): Promise<void> {
    const { ctx } = this;
    this.concluding = true;
    this.note(whole);
    const usage = this.usageRecord(whole);
    const out = splitFrame(whole, ctx.nc.info?.max_payload ?? DEFAULT_MAX_PAYLOAD);
    const frame = out.at(-1)!;
    this.nextSeq = frame.seq + 1;
    /** Publishes the end; false when the connection is closed (the attempt is then aborted). */
    const sendEnd = (): boolean => {
      try {
        for (const f of out) ctx.frames.publish(this.pending, this.req.replyTo, f);
        return true;
      } catch {
        this.abort('closed');
        return false;
      }
    };
    let early = ctx.isConnected() && !this.paused && !this.signal.aborted;
    if (early) {
      if (!sendEnd()) return;
      if (this.revision === 0) {
        await this.whenStored();
        if (this.signal.aborted) return; // superseded or closed while waiting: not ours to resolve
        if (!(await recordUsage(ctx, usage, this.signal))) return;
        return this.resolveMessage(frame, resolve);
      }
    }
    // NATS may be reconnecting: retry a while (a retry recognises its own lost write). If we
    // cannot finish before JetStream redelivers, the next delivery takes over and our CAS fails.
    const giveUpAt = Date.now() + 2 * ctx.ackWaitMs;
    let finished: boolean;
    for (;;) {
      while (!ctx.isConnected() && !ctx.nc.isClosed() && Date.now() < giveUpAt) await new Promise((resolve) => setTimeout(resolve, 50));
      if (!early && !this.paused && !this.signal.aborted && ctx.isConnected()) {
        // The frames it held went out (a claim check after the reconnect found the request still
        // its own, `resume`): the end follows them now, as it would have without the reconnect,
        // and the claim's CAS records it off the client's path — it may wait for the claims
        // bucket to have a leader again (an election: seconds).
        early = true;
        if (!sendEnd()) return;
      }
      try {
        finished = await ctx.claims.finish(this.req.id, this.claim, this.revision, frame, usage);
        break;
      } catch (err) {
        if (Date.now() > giveUpAt || ctx.nc.isClosed()) throw err;
        ctx.log(`request ${this.req.id}: finishing the claim failed (${(err as Error).message}); retrying`);
        await new Promise((resolve) => setTimeout(resolve, 250));
      }
    }
    if (finished) this.recorded = true;
    else {
      this.abort('superseded');
      ctx.log(
        `request ${this.req.id}: taken over by a later delivery; ${early ? 'its terminal frame was already sent (the gateway keeps the first)' : 'not answering'}`,
      );
      return;
    }
    if (!early) {
      // The CAS proved we own the request: publish what is held and the terminal frame.
      this.paused = false;
      ctx.frames.resend(this.pending, true);
      for (const f of [...this.held.splice(0), ...out]) ctx.frames.publish(this.pending, this.req.replyTo, f);
    }
    await this.whenStored();
    if (!(await recordUsage(ctx, usage, this.signal))) return;
    this.resolveMessage(frame, resolve);
  }

  /** The request's usage record, ended by `frame`; none when it is handed back (the request that ends it records the whole answer). */
  private usageRecord(frame: ResponseFrame): UsageRecord | undefined {
    if (frame.type === 'error' && frame.error.code === CONTINUE_ELSEWHERE) return undefined;
    const outcome = frame.type !== 'error' ? 'completed' : frame.error.status === 499 ? 'cancelled' : 'failed';
    return usageRecordOf(this.req, {
      outcome,
      ...(frame.type === 'error' ? { error: frame.error.code ?? frame.error.type } : {}),
      ...(this.tokens ? { tokens: this.tokens } : {}),
      chunks: this.chunks,
    });
  }

  /** Its delivery is done with: late acknowledgements of its frames are ignored. */
  end(): void {
    this.ctx.frames.forget(this.pending);
    this.markEnded();
  }

  /**
   * Before the delivery is resolved: until every frame it published is stored (a redelivery then
   * finds the whole answer), at most `storeWaitMs`.
   */
  private async whenStored(): Promise<void> {
    const { pending, ctx } = this;
    if (pending.size === 0) return;
    if (await pending.allStored(ctx.storeWaitMs, this.signal)) return;
    if (this.signal.aborted) return;
    ctx.stats.framesUnstored += pending.size;
    ctx.log(`request ${this.req.id}: ${pending.size} frame(s) not acknowledged by ${ctx.responseStream} within ${ctx.storeWaitMs} ms; resolving it anyway`);
  }

  /** Acks or terms the delivery once its terminal frame is out. */
  private resolveMessage(frame: ResponseFrame, resolve: 'ack' | 'term'): void {
    for (const m of this.deliveries) {
      if (resolve === 'ack') m.ack();
      else m.term(frame.type === 'error' ? (frame.error.code ?? 'error') : undefined);
    }
    if (resolve === 'ack') this.ctx.stats.acked += 1;
    else this.ctx.stats.termed += 1;
  }
}

/**
 * Writes a request's usage record before its message is resolved (README.md one folder up, "The
 * usage ledger"), once per request id, retried while NATS may be electing a leader. False when it
 * could not be written by `storeWaitMs`: the message is then left unresolved, and the delivery
 * JetStream makes after `ack_wait` writes it (from the claim, or from the frames it reads back).
 */
export async function recordUsage(ctx: AttemptContext, usage: UsageRecord | undefined, signal?: AbortSignal): Promise<boolean> {
  if (!usage || !ctx.ledger) return true;
  const giveUpAt = Date.now() + ctx.storeWaitMs;
  for (;;) {
    try {
      if ((await ctx.ledger.record(usage)) === 'written') {
        ctx.usage.add(usage);
        ctx.stats.usageRecorded += 1;
      }
      return true;
    } catch (err) {
      if (Date.now() > giveUpAt || ctx.nc.isClosed() || signal?.aborted) {
        ctx.stats.usageUnrecorded += 1;
        ctx.log(`request ${usage.id}: its usage record could not be written (${(err as Error).message}); left for its next delivery`);
        return false;
      }
      await new Promise((resolve) => setTimeout(resolve, 250));
    }
  }
}

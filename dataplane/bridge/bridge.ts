/**
 * The bridge: the sidecar next to an engine (`magus bridge`, workers/bridge.ts) and, in process,
 * the local runtime's. It pulls requests for one topology instance from JetStream (at most
 * `slots` at a time), calls the engine's OpenAI API (node:http, keep-alive: engine-client.ts)
 * and streams numbered {@link ResponseFrame}s back to the request's `replyTo` with core NATS,
 * each acknowledged by the response stream that stores it and published again until it is
 * (stored-frames.ts); a request is acked only once all of its frames are stored.
 *
 * Exactly one answer per request id, although JetStream delivers at least once (README of
 * dataplane/ has the whole protocol):
 * - a redelivery claims the request in `magus_claims` (create, or CAS take-over of an earlier
 *   delivery); a first delivery writes its claim only when it has answered (nobody else can own
 *   it before); a superseded attempt notices (periodic check, reconnect check, failed finish)
 *   and publishes nothing more;
 * - a terminal frame (`done`/`error`) is recorded in the claim (`finished`) right after it is
 *   published (before, when the bridge was disconnected); a later delivery of a finished request
 *   re-publishes exactly it;
 * - a take-over reads the frames that already reached the server (response stream), regenerates
 *   with the same pinned seed, checks its first frames match them and publishes only the rest;
 *   if they differ it ends the answer with a `generation_diverged` error instead of mixing two.
 */
import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import type { JetStreamClient, JetStreamManager, JsMsg, NatsConnection } from 'nats';
import { engineOf, type EngineKind } from '../../shared/engines';
import { requestKindOf } from '../../shared/request-kinds';
import type { BridgeLoad, ResponseFrame } from '../../shared/serving';
import type { UsageTotals } from '../../shared/usage';
import { openRequestClaims, type RequestClaims } from '../claims';
import { HELD_LANE } from '../consumers';
import { beatSubjectOf, cancelSubjectOf, LANES, type DataPlaneNames } from '../names';
import { BEAT_EVERY_MS, STOPPING_BEAT_EVERY_MS } from '../../shared/continuation';
import { UsageLedger } from '../usage';
import { HandBacks, type Attempt } from './attempt';
import { LiveAttempts } from './attempts';
import { Cancels } from './cancels';
import { RequestConsumer } from './consumer';
import { handBackQueued, serveDelivery, type DeliveryContext } from './delivery';
import { createEngineClient, type EngineClient } from './engine-client';
import { errorFrame } from './error-frames';
import { generate, LostAnswers, movable } from './generate';
import { HeldRequests } from './held';
import { processUsage, type BridgeHealth, type BridgeStats } from './metrics';
import { storedFramePublisher, type StoredFramePublisher } from './stored-frames';

export interface BridgeOptions {
  nc: NatsConnection;
  names: DataPlaneNames;
  pool: string;
  instance: string;
  /** The engine's base URL, e.g. `http://127.0.0.1:9990` (the bridge calls `/v1/chat/completions`). */
  engineUrl: string;
  /** Requests served at once; the consumer's `max_ack_pending` should equal it. */
  slots: number;
  /**
   * What the engine is (default `llamacpp`, magus's own): a request needing what it cannot do
   * (shared/chat.ts `unsupportedBy`: structured output from `dllama-api`) is answered 400
   * `unsupported_feature` without calling it — never served with the field silently ignored.
   */
  engineKind?: EngineKind;
  /** How to call the engine (default: {@link createEngineClient} on `engineUrl`); closed by stop(). */
  engineClient?: EngineClient;
  /** Upper bound of one engine call; the request's deadline bounds it too until its client has part of the answer (Attempt.cutsAt). Default 10 min. */
  requestTimeoutMs?: number;
  /** First `nak` delay after a transient engine failure; doubles per delivery, at most 30 s. Default 1 s. */
  retryDelayMs?: number;
  /**
   * How long an attempt whose engine went away (died, restarting in place) tries it again, every
   * 100 ms, before handing the request back; it then continues the answer from what it sent.
   * Default 15 s.
   */
  engineWaitMs?: number;
  /**
   * How long an attempt whose engine went away waits before it hands a streamed answer it can
   * continue back to its gateway, to be continued on another instance of the pool (generate.ts
   * `handBackAfterMs`). Default 500 ms; null: never (it waits `engineWaitMs`, then naks).
   */
  handBackAfterMs?: number | null;
  /**
   * How much longer than `handBackAfterMs` an attempt waits for an engine that said, since it went
   * away, that it starts from standby (restarted in place; it serves within a second): generate.ts
   * `startingWaitMs`. Default 1,500 ms (the hand-back then comes 2 s after the engine went away).
   */
  startingWaitMs?: number;
  /**
   * How long {@link Bridge.stop} goes on serving what its instance's consumer holds and lets
   * requests in flight finish, before it hands the rest back. Default 30 s.
   */
  drainTimeoutMs?: number;
  log?: (line: string) => void;
  /** Where the tokens of the usage records it writes are counted (default: the process's, `magus_usage_tokens_total`). */
  usage?: UsageTotals;
}

class Semaphore {
  private free: number;
  private readonly waiters: (() => void)[] = [];
  constructor(n: number) {
    this.free = n;
  }
  async acquire(): Promise<void> {
    if (this.free > 0) {
      this.free -= 1;
      return;
    }
    await new Promise<void>((resolve) => this.waiters.push(resolve));
  }
  /** Takes a free one now, if there is one (never waits). */
  tryAcquire(): boolean {
    if (this.free === 0) return false;
    this.free -= 1;
    return true;
  }
  release(): void {
    const next = this.waiters.shift();
    if (next) next();
    else this.free += 1;
  }
}

/** Waits for `p` at most `ms`; true when it settled in time. Leaves no timer behind. */
async function settlesWithin(p: Promise<unknown>, ms: number): Promise<boolean> {
  let timer: NodeJS.Timeout | undefined;
  const expired = new Promise<false>((resolve) => (timer = setTimeout(() => resolve(false), ms)));
  try {
    return await Promise.race([
      p.then(
        () => true,
        () => true,
      ),
      expired,
    ]);
  } finally {
    clearTimeout(timer);
  }
}

/** What {@link Bridge.start} prepares before the bridge exists. */
interface Prepared {
  js: JetStreamClient;
  jsm: JetStreamManager;
  consumer: RequestConsumer;
  lanes: RequestConsumer[];
  claims: RequestClaims;
  ledger: UsageLedger;
  stats: BridgeStats;
  log: (line: string) => void;
  failed: (what: string, err: unknown) => void;
}

/** How long a bridge past its drain deadline goes on handing back what is still queued for its instance. */
const HAND_BACK_MS = 5_000;
/** A redelivery it cannot hand back goes back to the consumer after this long: for a bridge of the instance that comes back, not this one. */
const HAND_BACK_NAK_MS = 60_000;
/** How long a beat waits for its queue's read before it says the last one read. */
const QUEUE_READ_WAIT_MS = 100;

/**
 * One instance's bridge: pulls deliveries from its {@link RequestConsumer}s (at most `slots` at a
 * time from each: its requests, and its lanes — the answers moved to it, which the engine takes
 * first, and the requests handed back to it, which it takes next, earliest deadline first of up to
 * the lane consumer's `max_ack_pending` it holds: held.ts) and
 * serves each (delivery.ts) by an {@link Attempt}; {@link LiveAttempts} follows the connection,
 * {@link Cancels} the gateways' cancels.
 */
export class Bridge {
  private readonly counts: BridgeStats;
  private readonly usageTotals: UsageTotals;
  private readonly nc: NatsConnection;
  private readonly slots: number;
  private readonly drainTimeoutMs: number;
  private readonly beatSubject: string;
  /** This start's id in its beats (shared/serving.ts `BridgeLoad.boot`): gateways tell it from the bridge of the instance's next pod. */
  private readonly boot = randomBytes(6).toString('base64url');
  private beats: NodeJS.Timeout | undefined;
  private readonly log: (line: string) => void;
  private readonly failed: (what: string, err: unknown) => void;
  private readonly engine: EngineClient;
  private readonly consumer: RequestConsumer;
  /** Its lanes (names.ts `LANES`: answers moved to it, requests handed back to it), served beside its requests and before those queued. */
  private readonly lanes: RequestConsumer[];
  private readonly frames: StoredFramePublisher;
  private readonly attempts: LiveAttempts;
  private readonly cancels: Cancels;
  private readonly delivery: DeliveryContext;
  /** Its engine continues answers (shared/engines.ts): a stream may be handed back to its gateway. */
  private readonly continues: boolean;
  /** Past the drain deadline with requests still queued: each delivered is handed back, not served (delivery.ts `handBackQueued`). */
  private handingBack = false;
  /** Deliveries being served. */
  private readonly handlers = new Set<Promise<void>>();
  private loop: Promise<void> = Promise.resolve();
  private consuming = true;
  /** Set once no delivery may be served any more (a late one is handed back). */
  private stopping = false;
  private stopped: Promise<void> | undefined;
  /** Deliveries being served (requests and its lanes'; hand-backs not counted). */
  private running = 0;
  /** Undelivered requests and its lanes', as last read (readQueued), and when that read was asked. */
  private queued = 0;
  private queuedAt = 0;
  /** A beat is being made (its queue read). */
  private beating = false;
  /** The queue's read under way. */
  private reading: Promise<void> | undefined;
  /** How long the recent deliveries took to serve. */
  private readonly service = new ServiceTimes();
  /** The requests handed back to it, held until a slot is free (held.ts); none before its lane is pulled. */
  private held: HeldRequests | undefined;
  /** Hands the held requests on as far as slots and state allow (set while its lane is pulled). */
  private pumpHeld: () => void = () => undefined;

  /** Starts pulling and serving requests of one instance; the consumer must exist (ensureInstanceConsumer). */
  static async start(opts: BridgeOptions): Promise<Bridge> {
    const { nc, names, pool, instance, slots } = opts;
    const log = opts.log ?? ((line: string) => process.stderr.write(`magus bridge ${pool}/${instance}: ${line}\n`));
    if (!Number.isInteger(slots) || slots < 1) throw new Error(`slots must be a positive integer, got ${slots}`);
    const stats: BridgeStats = {
      pulled: 0,
      acked: 0,
      termed: 0,
      nakked: 0,
      redelivered: 0,
      errors: 0,
      resumed: 0,
      continued: 0,
      resumeFailed: 0,
      resumedAcrossGap: 0,
      replayed: 0,
      superseded: 0,
      adopted: 0,
      handedBack: 0,
      cancelled: 0,
      heartbeatsMissed: 0,
      framesResent: 0,
      framesUnstored: 0,
      usageRecorded: 0,
      usageUnrecorded: 0,
      inFlight: 0,
    };
    const failed = (what: string, err: unknown) => {
      stats.errors += 1;
      log(`${what}: ${(err as Error)?.message ?? String(err)}`);
    };
    const js = nc.jetstream();
    const jsm = await nc.jetstreamManager();
    const consumer = await RequestConsumer.open({ nc, js, jsm, names, pool, instance, slots, stats, log, failed });
    const lanes: RequestConsumer[] = [];
    for (const lane of LANES) {
      // The requests handed back are held and served earliest deadline first (held.ts).
      const holds = lane === HELD_LANE;
      const opened = await RequestConsumer.open({
        nc,
        js,
        jsm,
        names,
        pool,
        instance,
        slots,
        holds,
        stats,
        log,
        failed,
        lane: { lane, like: consumer.config },
      }).catch((err: unknown) => {
        // An instance whose NATS user was made before that lane may not pull it: its beats say
        // so (no `requeued`), and gateways send what it would hold to its requests instead.
        if (lane !== 'requeued') throw err;
        log(`not pulling the requests handed back to this instance (${(err as Error).message}): gateways queue them with its requests`);
        return null;
      });
      if (opened) lanes.push(opened);
    }
    const claims = await openRequestClaims(js, names, { pool, instance });
    const ledger = await UsageLedger.open(js, names);
    const bridge = new Bridge(opts, { js, jsm, consumer, lanes, claims, ledger, stats, log, failed });
    for (const c of [consumer, ...lanes]) await c.start();
    bridge.run();
    return bridge;
  }

  private constructor(opts: BridgeOptions, prepared: Prepared) {
    const { nc, names, pool, instance, slots } = opts;
    const { consumer, lanes, claims, stats, log } = prepared;
    this.nc = nc;
    this.slots = slots;
    this.drainTimeoutMs = opts.drainTimeoutMs ?? 30_000;
    this.counts = stats;
    this.usageTotals = opts.usage ?? processUsage;
    this.log = log;
    this.failed = prepared.failed;
    this.consumer = consumer;
    this.lanes = lanes;
    // A socket for every call its consumers may have at once (each pulls `slots`: run()) and one
    // for /health: with fewer, an answer moved here mid-way waited ~2 s under bench:chaos for a
    // socket held by requests queued in the engine, which it would have gone before.
    this.engine = opts.engineClient ?? createEngineClient(opts.engineUrl, { maxSockets: slots * (1 + lanes.length) + 1 });
    const requestTimeoutMs = opts.requestTimeoutMs ?? 10 * 60_000;
    const engineKind = opts.engineKind ?? 'llamacpp';
    const continues = engineOf(engineKind).continues;
    this.continues = continues;
    const handBackAfterMs = opts.handBackAfterMs === undefined ? 500 : opts.handBackAfterMs;
    const generateOptions = {
      requestTimeoutMs,
      continues,
      engineWaitMs: opts.engineWaitMs ?? 15_000,
      lost: new LostAnswers(),
      ...(handBackAfterMs !== null ? { handBackAfterMs, startingWaitMs: opts.startingWaitMs ?? 1_500 } : {}),
    };
    const retryDelayMs = opts.retryDelayMs ?? 1000;
    const ackWaitMs = consumer.ackWaitMs;
    const owner = `${instance}@${hostname()}:${process.pid}:${randomBytes(3).toString('hex')}`;
    this.frames = storedFramePublisher(nc, { onResend: () => (stats.framesResent += 1) });
    this.attempts = new LiveAttempts(
      {
        nc,
        frames: this.frames,
        claims,
        stats,
        log,
        responseStream: names.responseStream,
        ackWaitMs,
        // How long an answered request waits for its last frames to be stored before it is acked anyway
        // (a stream without a leader for this long is an outage, not an election): well inside ack_wait.
        storeWaitMs: Math.max(1_000, Math.floor((ackWaitMs * 2) / 3)),
        retryDelayMs,
        maxDeliver: consumer.maxDeliver,
        ledger: prepared.ledger,
        usage: this.usageTotals,
        continues,
        handBacks: new HandBacks(),
      },
      () => this.stopping,
    );
    this.cancels = new Cancels(nc, cancelSubjectOf(names, pool, instance), (id, moved) => this.attempts.cancel(id, moved));
    this.beatSubject = beatSubjectOf(names, pool, instance);
    this.delivery = {
      nc,
      js: prepared.js,
      jsm: prepared.jsm,
      names,
      own: { pool: opts.pool, instance: opts.instance },
      claims,
      owner,
      attempts: this.attempts,
      cancels: this.cancels,
      stats,
      log,
      failed: prepared.failed,
      retryDelayMs,
      // working() well inside ack_wait, so neither a slow first token nor a long answer is redelivered.
      workingEveryMs: Math.max(100, Math.floor(ackWaitMs / 3)),
      generate: (a: Attempt, prior: ResponseFrame[]) => {
        const refused = requestKindOf(a.req).unsupportedBy(engineKind, a.req);
        if (refused)
          return Promise.resolve({
            kind: 'finish',
            resolve: 'term',
            frame: errorFrame(a.nextSeq, 400, 'invalid_request_error', 'unsupported_feature', refused.message, refused.field),
          });
        return generate(this.engine, a, prior, generateOptions);
      },
    };
  }

  /** Counters since start. */
  get stats(): Readonly<BridgeStats> {
    return this.counts;
  }

  /** The tokens of the usage records it wrote, per key and model. */
  get usage(): UsageTotals {
    return this.usageTotals;
  }

  /** The bridge's own health (NATS connection, consumer, heartbeats); cheap and synchronous. */
  health(): BridgeHealth {
    const problems: string[] = [];
    if (this.nc.isClosed()) problems.push('NATS connection closed');
    else if (!this.attempts.isConnected) problems.push('NATS disconnected');
    if (!this.consuming) problems.push('not consuming');
    for (const c of [this.consumer, ...this.lanes]) problems.push(...c.problems());
    const { queued, serviceMs } = this.load();
    return { ok: problems.length === 0, problems, inFlight: this.attempts.size, slots: this.slots, queued, serviceMs };
  }

  /** Probes the engine's `/health`; a slow or loading engine is reported, never awaited long. */
  async checkEngine(timeoutMs = 2000): Promise<{ ok: boolean; status?: number; error?: string }> {
    try {
      const res = await this.engine.get('/health', { signal: AbortSignal.timeout(timeoutMs) });
      res.cancel();
      return { ok: res.status >= 200 && res.status < 300, status: res.status };
    } catch (err) {
      return { ok: false, error: (err as { cause?: Error }).cause?.message ?? (err as Error).message };
    }
  }

  /** True once {@link Bridge.stop} was called (it serves what is queued and in flight, then stops). */
  get draining(): boolean {
    return this.stopped !== undefined;
  }

  /**
   * Drains, within the drain timeout: goes on pulling until the instance's consumer holds nothing
   * undelivered (what gateways queued for the instance before it was unpublished would be lost
   * with the consumer), then stops pulling and lets requests in flight finish; what is still in
   * flight at the deadline is handed back, and what is still queued then too ({@link handBackQueued}).
   * Every call resolves when that is done.
   */
  stop(): Promise<void> {
    if (this.stopped) return this.stopped;
    this.stopped = this.drainAndStop();
    // Its beats say it stops, and come faster: once it is killed, its answers move sooner.
    if (this.beats) this.beatEvery(STOPPING_BEAT_EVERY_MS);
    return this.stopped;
  }

  private async drainAndStop(): Promise<void> {
    const deadline = Date.now() + this.drainTimeoutMs;
    await this.serveQueued(deadline);
    this.stopping = true;
    if (Date.now() >= deadline && this.consuming && (await this.undelivered())) await this.handBackQueued();
    await settlesWithin(Promise.all([this.consumer, ...this.lanes].map((c) => c.stopPulling())), 5000);
    await settlesWithin(this.loop, 5000);
    const drained = await settlesWithin(Promise.allSettled([...this.handlers]), Math.max(0, deadline - Date.now()));
    if (!drained) {
      this.log(`stopping: handing ${this.attempts.size} request(s) in flight back`);
      this.attempts.abortAll('shutdown');
      await Promise.allSettled([...this.handlers]);
    }
    this.attempts.close();
    await this.frames.close();
    this.engine.close();
    this.cancels.close();
    clearInterval(this.beats);
    for (const c of [this.consumer, ...this.lanes]) c.close();
    // Its acks are fire-and-forget: on their way to the server before stop resolves (a runtime may exit then).
    if (!this.nc.isClosed()) await this.nc.flush().catch(() => undefined);
  }

  /**
   * The drain deadline passed with requests still queued, which would go with the consumer: the
   * answers in flight that can be continued elsewhere are handed back (as at any deadline; the
   * others run on), and then every queued request as it is delivered (delivery.ts
   * `handBackQueued`: a stream goes on another instance at once, any other is answered 503
   * `instance_stopped`), until none is left or {@link HAND_BACK_MS} has passed.
   */
  private async handBackQueued(): Promise<void> {
    this.log(`stopping: the drain deadline passed; handing ${this.attempts.size} request(s) in flight and those still queued back`);
    this.handingBack = true;
    // Those it can hand back now; any other runs on, holding its slot (the consumer's max_ack_pending), until it ends or the hand-back does.
    this.attempts.abortWhere('shutdown', (a) => movable(a, this.continues, true));
    // Then every request it holds (after: their hand-backs are attempts of their own, not to be aborted).
    this.pumpHeld();
    await this.whileQueued(Date.now() + HAND_BACK_MS);
  }

  /** Goes on serving until the consumer holds nothing undelivered, the deadline passes, or that cannot be known. */
  private serveQueued(deadline: number): Promise<void> {
    return this.whileQueued(deadline, (waiting) => this.log(`stopping: serving the ${waiting} request(s) queued for this instance first`));
  }

  /** Waits until the consumers hold nothing undelivered, `deadline` passes, or that cannot be known; `first` hears how many wait, once. */
  private async whileQueued(deadline: number, first?: (waiting: number) => void): Promise<void> {
    for (let told = false; ; told = true) {
      const waiting = this.consuming ? await this.undelivered() : null;
      if (!waiting || Date.now() >= deadline) return;
      if (!told) first?.(waiting);
      await new Promise((r) => setTimeout(r, 200));
    }
  }

  /** Requests and its lanes' not delivered yet, and those it holds (null: that cannot be read now). */
  private async undelivered(): Promise<number | null> {
    const [requests = null, ...lanes] = await Promise.all([this.consumer, ...this.lanes].map((c) => c.undelivered()));
    return requests === null ? null : lanes.reduce<number>((sum, n) => sum + (n ?? 0), requests + (this.held?.size ?? 0));
  }

  /** Serves what the consumers deliver until the bridge stops or the connection closes. */
  private run(): void {
    // Alive, to the gateways whose answers this bridge serves: one that stops beating is continued
    // elsewhere. Each beat says the load (shared/serving.ts BridgeLoad): what a gateway bounds a
    // request's wait in its queue by (gateway/serving/queue-waits.ts).
    this.beatEvery(this.draining ? STOPPING_BEAT_EVERY_MS : BEAT_EVERY_MS);
    void this.nc.closed().then(() => {
      // Killed from under us: nothing can be answered or resolved any more (JetStream redelivers).
      this.attempts.connectionClosed();
      for (const c of [this.consumer, ...this.lanes]) c.connectionClosed();
    });
    // The lanes beside the slots' requests: the engine puts a resumed answer before its queue, and a
    // request handed back after those (generate.ts sends it with REQUEUED_HEADER).
    this.loop = Promise.all([this.consumer, ...this.lanes].map((c) => (c.holds ? this.pullHeld(c) : this.pull(c)))).then(() => undefined);
  }

  /** Serves what `consumer` delivers, in the order delivered, `slots` at a time. */
  private async pull(consumer: RequestConsumer): Promise<void> {
    const semaphore = new Semaphore(this.slots);
    await this.pullEach(consumer, async (m) => {
      await semaphore.acquire();
      this.dispatch(m, () => semaphore.release());
    });
  }

  /**
   * Holds what `consumer` delivers (up to its `max_ack_pending`) and serves it earliest deadline
   * first, `slots` at a time (held.ts). Stopping, it holds them until it hands them back (past
   * the drain deadline) or stops; what it still holds then goes back to the consumer.
   */
  private async pullHeld(consumer: RequestConsumer): Promise<void> {
    const held = new HeldRequests(this.delivery.workingEveryMs);
    this.held = held;
    const semaphore = new Semaphore(this.slots);
    this.pumpHeld = () => {
      if (this.handingBack) {
        for (const m of held.takeAll()) this.dispatch(m, () => undefined);
        return;
      }
      while (!this.stopping && held.size > 0 && semaphore.tryAcquire())
        this.dispatch(held.next()!, () => {
          semaphore.release();
          this.pumpHeld();
        });
    };
    try {
      await this.pullEach(consumer, (m) => {
        held.hold(m);
        this.pumpHeld();
      });
    } finally {
      held.close();
      this.pumpHeld = () => undefined;
      for (const m of held.takeAll()) this.nakLeft(m);
    }
  }

  /** Hands each delivery of `consumer` to `each` until the bridge stops or the connection closes. */
  private async pullEach(consumer: RequestConsumer, each: (m: JsMsg) => unknown): Promise<void> {
    try {
      for (let current = consumer.current; ; current = consumer.current) {
        for await (const m of current) {
          consumer.delivered();
          await each(m);
        }
        // Ended: replaced (go on with the new one), or stopped or closed (done).
        if (current === consumer.current || this.stopping || this.nc.isClosed()) break;
      }
    } catch (err) {
      if (!this.nc.isClosed()) this.failed(`${consumer.label} loop`, err);
    } finally {
      this.consuming = false;
    }
  }

  /**
   * Serves a delivery, or past the drain deadline hands it back, or stopping sends it back to its
   * consumer; `release` when that is done (its slot is free).
   */
  private dispatch(m: JsMsg, release: () => void): void {
    if (this.stopping && !this.handingBack) {
      this.nakLeft(m);
      release();
      return;
    }
    const done = this.handingBack
      ? handBackQueued(this.delivery, m, this.continues, HAND_BACK_NAK_MS).catch((err) => this.failed(`handing back the request at stream seq ${m.seq}`, err))
      : this.serve(m);
    const h = done.finally(() => {
      release();
      this.handlers.delete(h);
    });
    this.handlers.add(h);
  }

  /** A delivery it will not serve, stopping: back to its consumer (for the bridge of the instance that comes back). */
  private nakLeft(m: JsMsg): void {
    try {
      m.nak();
      this.counts.nakked += 1;
    } catch {
      // closed connection: JetStream redelivers it after ack_wait
    }
  }

  private serve(m: JsMsg): Promise<void> {
    const start = Date.now();
    this.running += 1;
    return serveDelivery(this.delivery, m)
      .catch((err) => this.failed(`request at stream seq ${m.seq}`, err))
      .finally(() => {
        this.running -= 1;
        this.service.add(Date.now() - start);
      });
  }

  /** Beats now and every `ms` (replacing the beats before). */
  private beatEvery(ms: number): void {
    clearInterval(this.beats);
    const beat = () => {
      if (this.beating) return; // the last one still reads its queue
      this.beating = true;
      void this.readQueued()
        .then(() => {
          if (!this.nc.isClosed()) this.nc.publish(this.beatSubject, JSON.stringify(this.load()));
        })
        .catch(() => undefined) // closed meanwhile
        .finally(() => (this.beating = false));
    };
    beat();
    this.beats = setInterval(beat, ms);
    this.beats.unref();
  }

  /** What this bridge's beat says of its load. */
  private load(): BridgeLoad {
    const saturated = this.running >= this.slots;
    return {
      running: this.running,
      slots: this.slots,
      queued: saturated ? this.queued : 0,
      serviceMs: this.service.p90(),
      ...(saturated ? { queuedAgeMs: Date.now() - this.queuedAt } : {}),
      ...(this.lanes.some((c) => c.lane === 'requeued') ? { requeued: true as const } : {}),
      ...(this.draining ? { stopping: true as const } : {}),
      boot: this.boot,
    };
  }

  /**
   * Reads how many wait undelivered (a consumer info each) before a beat says it, only while every
   * slot is taken: with a slot free, nothing waits for long.
   */
  private readQueued(): Promise<void> {
    // Stopping: none is sent here any more, and its beats must not wait (shared/continuation.ts `STOPPING_SILENT_MS`).
    if (this.running < this.slots || this.draining) return Promise.resolve();
    // One read at a time; a beat waits for it at most QUEUE_READ_WAIT_MS (a slow JetStream API
    // must not silence the beats: gateways would move this bridge's answers).
    const asked = Date.now();
    this.reading ??= this.undelivered()
      .then((n) => {
        if (n === null) return;
        this.queued = n;
        this.queuedAt = asked;
      })
      .catch(() => undefined)
      .finally(() => (this.reading = undefined));
    let timer: NodeJS.Timeout | undefined;
    return Promise.race([this.reading, new Promise<void>((resolve) => (timer = setTimeout(resolve, QUEUE_READ_WAIT_MS)))]).finally(() => clearTimeout(timer));
  }
}

/** Starts pulling and serving requests of one instance; the consumer must exist (ensureInstanceConsumer). */
export const startBridge = (opts: BridgeOptions): Promise<Bridge> => Bridge.start(opts);

/**
 * The last {@link ServiceTimes.SIZE} service times: an instance drains its queue at about
 * `slots / mean` while every slot is taken. What a beat says is their 90th percentile: a gateway
 * bounding a turn's wait by it errs on the side of a wait shorter than its budget (a real engine's
 * answers take longer as its batch fills and its cores are shared), and the engine's queue is kept
 * no less full for it — only the excess is refused sooner.
 */
export class ServiceTimes {
  static readonly SIZE = 32;
  private readonly times: number[] = [];
  private next = 0;

  add(ms: number): void {
    if (this.times.length < ServiceTimes.SIZE) this.times.push(ms);
    else {
      this.times[this.next] = ms;
      this.next = (this.next + 1) % ServiceTimes.SIZE;
    }
  }

  /** The 90th percentile (nearest rank), or null before the first. */
  p90(): number | null {
    if (this.times.length === 0) return null;
    const sorted = [...this.times].sort((a, b) => a - b);
    return sorted[Math.ceil(0.9 * sorted.length) - 1]!;
  }
}

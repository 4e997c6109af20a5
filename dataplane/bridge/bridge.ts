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
import { ConsumerEvents, Events, millis, type ConsumerMessages, type JsMsg, type NatsConnection } from 'nats';
import {
  REQUEST_ID,
  cancelSubjectOf,
  consumerNameOf,
  decodeJson,
  openRequestClaims,
  readStoredFrames,
  declareOnReconnect,
  restoreConsumer,
  type DataPlaneNames,
  type RequestClaim,
} from '../data-plane';
import { encodeFrame } from '../frames';
import { PendingFrames, storedFramePublisher } from './stored-frames';
import type { ChatCompletionRequest, InferenceRequest, ResponseFrame } from '../../shared/serving';
import { createEngineClient, type EngineClient, type EngineResponse } from './engine-client';
import type { BridgeHealth, BridgeStats } from './metrics';
import { parseInferenceRequest, seedFor } from './requests';

export interface BridgeOptions {
  nc: NatsConnection;
  names: DataPlaneNames;
  pool: string;
  instance: string;
  /** The engine's base URL, e.g. `http://127.0.0.1:9990` (the bridge calls `/v1/chat/completions`). */
  engineUrl: string;
  /** Requests served at once; the consumer's `max_ack_pending` should equal it. */
  slots: number;
  /** How to call the engine (default: {@link createEngineClient} on `engineUrl`); closed by stop(). */
  engineClient?: EngineClient;
  /** Upper bound of one engine call; the request's deadline bounds it too. Default 10 min. */
  requestTimeoutMs?: number;
  /** First `nak` delay after a transient engine failure; doubles per delivery, at most 30 s. Default 1 s. */
  retryDelayMs?: number;
  /** How long {@link Bridge.stop} lets requests in flight finish before handing them back. Default 30 s. */
  drainTimeoutMs?: number;
  log?: (line: string) => void;
}

export interface Bridge {
  readonly stats: Readonly<BridgeStats>;
  /** The bridge's own health (NATS connection, consumer, heartbeats); cheap and synchronous. */
  health(): BridgeHealth;
  /** Probes the engine's `/health`; a slow or loading engine is reported, never awaited long. */
  checkEngine(timeoutMs?: number): Promise<{ ok: boolean; status?: number; error?: string }>;
  /** Stops pulling, lets requests in flight finish (up to the drain timeout), hands the rest back. */
  stop(): Promise<void>;
}

/** `code` of the error frames the bridge itself produces (engine errors carry the engine's code). */
export const BridgeErrorCode = {
  invalidRequest: 'invalid_request',
  deadlineExceeded: 'deadline_exceeded',
  engineUnavailable: 'engine_unavailable',
  engineProtocol: 'engine_protocol_error',
  generationDiverged: 'generation_diverged',
  resumeFailed: 'resume_failed',
} as const;

const errorFrame = (seq: number, status: number, type: string, code: string | null, message: string): ResponseFrame => ({
  seq,
  type: 'error',
  error: { status, type, code, message },
});

// ---------------------------------------------------------------------------------------------
// Engine I/O

/** Makes engine output attempt-independent: the response id is the request's, `created` the first claim's. */
function stamp(data: unknown, requestId: string, createdAt: number): unknown {
  if (typeof data !== 'object' || data === null || Array.isArray(data)) return data;
  return { ...data, id: `chatcmpl-${requestId}`, created: Math.floor(createdAt / 1000) };
}

/** What must be equal for two attempts' chunks to be "the same": the choices' deltas (not timings, ids …). */
function fingerprint(frame: ResponseFrame): string {
  if (frame.type !== 'chunk') return frame.type;
  const choices = (frame.data as { choices?: unknown } | null)?.choices;
  if (!Array.isArray(choices)) return 'no-choices';
  return JSON.stringify(
    choices.map((c: { index?: unknown; delta?: unknown; finish_reason?: unknown }) => [c.index ?? 0, c.delta ?? null, c.finish_reason ?? null]),
  );
}

async function engineErrorBody(res: EngineResponse): Promise<{ message: string; type?: string; code?: string | null }> {
  const text = await res.text().catch(() => '');
  try {
    const e = (JSON.parse(text) as { error?: { message?: unknown; type?: unknown; code?: unknown } | string }).error;
    if (typeof e === 'string') return { message: e };
    if (e && typeof e.message === 'string') {
      return { message: e.message, type: typeof e.type === 'string' ? e.type : undefined, code: typeof e.code === 'string' ? e.code : null };
    }
  } catch {
    // not JSON: use the text
  }
  return { message: text.slice(0, 500) || `HTTP ${res.status}` };
}

/** Statuses worth a retry: the engine is busy, loading or broken, not the request. */
const transientStatus = (s: number) => s === 408 || s === 429 || s >= 500;

type Outcome =
  | { kind: 'finish'; frame: ResponseFrame; resolve: 'ack' | 'term' }
  | { kind: 'retry'; reason: string }
  | { kind: 'aborted'; reason: AbortReason };

type AbortReason = 'superseded' | 'closed' | 'shutdown' | 'diverged' | 'cancelled';

/** Why an engine call was cut (preallocated: see generate). */
const ENGINE_TIMEOUT = Object.assign(new Error('engine call timed out'), { name: 'TimeoutError' });
const READ_NO_FURTHER = Object.assign(new Error('the bridge reads no further'), { name: 'AbortError' });

// ---------------------------------------------------------------------------------------------
// The bridge

interface Attempt {
  req: InferenceRequest;
  msg: JsMsg;
  claim: RequestClaim;
  revision: number;
  abort: AbortController;
  /** Frames withheld while NATS is disconnected: published after a reconnect proves we still own the request. */
  held: ResponseFrame[];
  /** Frames published but not yet acknowledged as stored by the response stream. */
  pending: PendingFrames;
  /** Its claim is finished with its terminal frame (by this attempt): no later check can find it superseded. */
  recorded: boolean;
  paused: boolean;
  resuming: boolean;
  concluding: boolean;
  /** The seq the next frame of this request gets (frames before it may come from an earlier attempt). */
  nextSeq: number;
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
    return await Promise.race([p.then(() => true, () => true), expired]);
  } finally {
    clearTimeout(timer);
  }
}

/** Whether a `chat.completion.chunk` carries text (the role-only first chunk does not). */
function carriesText(chunk: unknown): boolean {
  const content = (chunk as { choices?: { delta?: { content?: unknown } }[] } | null)?.choices?.[0]?.delta?.content;
  return typeof content === 'string' && content.length > 0;
}

/** Starts pulling and serving requests of one instance; the consumer must exist (ensureInstanceConsumer). */
export async function startBridge(opts: BridgeOptions): Promise<Bridge> {
  const { nc, names, pool, instance, slots } = opts;
  const engine = opts.engineClient ?? createEngineClient(opts.engineUrl, { maxSockets: Math.max(slots, 1) * 2 });
  const requestTimeoutMs = opts.requestTimeoutMs ?? 10 * 60_000;
  const retryDelayMs = opts.retryDelayMs ?? 1000;
  const drainTimeoutMs = opts.drainTimeoutMs ?? 30_000;
  const log = opts.log ?? ((line: string) => process.stderr.write(`magus bridge ${pool}/${instance}: ${line}\n`));
  if (!Number.isInteger(slots) || slots < 1) throw new Error(`slots must be a positive integer, got ${slots}`);

  const js = nc.jetstream();
  const jsm = await nc.jetstreamManager();
  const consumer = await js.consumers.get(names.requestStream, consumerNameOf(pool, instance));
  const { config } = await consumer.info();
  const ackWaitMs = millis(config.ack_wait ?? 30_000_000_000);
  const maxDeliver = config.max_deliver !== undefined && config.max_deliver > 0 ? config.max_deliver : Infinity;
  if ((config.max_ack_pending ?? 0) !== slots) log(`consumer max_ack_pending is ${config.max_ack_pending}, bridge slots ${slots}`);
  const claims = await openRequestClaims(js, names);
  const owner = `${instance}@${hostname()}:${process.pid}:${randomBytes(3).toString('hex')}`;
  // working() well inside ack_wait, so neither a slow first token nor a long answer is redelivered.
  const workingEveryMs = Math.max(100, Math.floor(ackWaitMs / 3));

  const stats: BridgeStats = { pulled: 0, acked: 0, termed: 0, nakked: 0, redelivered: 0, errors: 0, resumed: 0, resumeFailed: 0, replayed: 0, superseded: 0, cancelled: 0, heartbeatsMissed: 0, framesResent: 0, framesUnstored: 0, inFlight: 0 };
  const frames = storedFramePublisher(nc, { onResend: () => (stats.framesResent += 1) });
  // How long an answered request waits for its last frames to be stored before it is acked anyway
  // (a stream without a leader for this long is an outage, not an election): well inside ack_wait.
  const storeWaitMs = Math.max(1_000, Math.floor((ackWaitMs * 2) / 3));
  const live = new Set<Attempt>();
  // Cancels from gateways (their client went away): stop the attempt serving it, or drop the
  // request when it is pulled later. Remembered for a while, at most a bounded number.
  const cancelled = new Map<string, number>();
  const CANCEL_MEMORY_MS = 10 * 60_000;
  const CANCEL_MEMORY_MAX = 10_000;
  const cancelSub = nc.subscribe(cancelSubjectOf(names, pool, instance), {
    callback: (err, msg) => {
      if (err) return;
      let id: unknown;
      try {
        id = (decodeJson(msg.data) as { id?: unknown } | null)?.id;
      } catch {
        return;
      }
      if (typeof id !== 'string' || !REQUEST_ID.test(id)) return;
      for (const a of live) if (a.req.id === id && !a.concluding) abortAttempt(a, 'cancelled');
      const now = Date.now();
      if (cancelled.size >= CANCEL_MEMORY_MAX) {
        for (const [k, at] of cancelled) if (now - at > CANCEL_MEMORY_MS || cancelled.size >= CANCEL_MEMORY_MAX) cancelled.delete(k);
      }
      cancelled.set(id, now);
    },
  });
  const handlers = new Set<Promise<void>>();
  let connected = true;
  let consuming = true;
  let stopping = false;
  let consumerMissing = false;
  let lastHeartbeatMissAt = 0;
  let lastMessageAt = 0;

  const failed = (what: string, err: unknown) => {
    stats.errors += 1;
    log(`${what}: ${(err as Error)?.message ?? String(err)}`);
  };

  const abortAttempt = (a: Attempt, reason: AbortReason) => {
    if (a.abort.signal.aborted) return;
    if (reason === 'superseded') stats.superseded += 1;
    a.abort.abort(reason);
  };

  /** Publishes a frame of `a` (or holds it while disconnected); never throws. */
  const send = (a: Attempt, frame: ResponseFrame) => {
    if (a.abort.signal.aborted) return;
    if (a.paused) {
      a.held.push(frame);
      return;
    }
    try {
      frames.publish(a.pending, a.req.replyTo, frame);
    } catch {
      abortAttempt(a, 'closed'); // the connection is closed: this process can no longer answer
    }
  };

  /**
   * Before `a`'s delivery is resolved: until every frame it published is stored (a redelivery then
   * finds the whole answer), at most {@link storeWaitMs}.
   */
  const whenStored = async (a: Attempt) => {
    if (a.pending.size === 0) return;
    if (await a.pending.allStored(storeWaitMs, a.abort.signal)) return;
    if (a.abort.signal.aborted) return;
    stats.framesUnstored += a.pending.size;
    log(`request ${a.req.id}: ${a.pending.size} frame(s) not acknowledged by ${names.responseStream} within ${storeWaitMs} ms; resolving it anyway`);
  };

  /**
   * After a reconnect: publish again the frames not known to be stored, and the held ones, only
   * if no later delivery took the request over meanwhile. A failed check is retried by the sweep.
   */
  const resume = async (a: Attempt) => {
    if (a.resuming || !a.paused || a.abort.signal.aborted) return;
    a.resuming = true;
    try {
      if (!a.recorded) {
        const rev = (await claims.revision(a.req.id)) ?? 0; // 0: no claim yet (a first delivery's)
        if (!connected || a.abort.signal.aborted) return;
        if (rev !== a.revision) return abortAttempt(a, 'superseded');
      }
      if (!connected) return;
      a.paused = false;
      frames.resend(a.pending, true);
      for (const f of a.held.splice(0)) send(a, f);
    } catch (err) {
      log(`request ${a.req.id}: claim check after reconnect failed (${(err as Error).message}); still holding frames`);
    } finally {
      a.resuming = false;
    }
  };

  // Frames not acknowledged in time are published again; attempts still paused after a reconnect
  // (their claim check failed: the KV may be electing a leader) try again.
  const sweep = setInterval(() => {
    if (!connected) return;
    for (const a of live) {
      if (a.abort.signal.aborted) continue;
      if (a.paused) void resume(a);
      else if (a.pending.size > 0) frames.resend(a.pending);
    }
  }, 500);
  sweep.unref();

  void (async () => {
    for await (const s of nc.status()) {
      if (stopping) break;
      if (s.type === Events.Disconnect) {
        connected = false;
        for (const a of live) a.paused = true;
        log('NATS disconnected: holding frames');
      } else if (s.type === Events.Reconnect) {
        connected = true;
        log('NATS reconnected');
        for (const a of live) void resume(a);
      }
    }
  })();

  /** Checks periodically that this attempt still owns its request; keeps JetStream from redelivering it. */
  const tick = (m: JsMsg, a: () => Attempt | undefined) => {
    try {
      m.working();
    } catch {
      // closed connection: nc.closed() aborts the attempt
    }
    const attempt = a();
    if (!attempt || attempt.concluding) return;
    if (attempt.paused) {
      if (connected) void resume(attempt);
      return;
    }
    claims.revision(attempt.req.id).then(
      (rev) => {
        if (!attempt.concluding && rev !== null && rev !== attempt.revision) abortAttempt(attempt, 'superseded');
      },
      () => undefined, // a failed check proves nothing; the finish CAS is the last word
    );
  };

  /** Acks or terms the delivery of `a` once its terminal frame is out. */
  const resolveMessage = (a: Attempt, frame: ResponseFrame, resolve: 'ack' | 'term') => {
    if (resolve === 'ack') {
      a.msg.ack();
      stats.acked += 1;
    } else {
      a.msg.term(frame.type === 'error' ? frame.error.code ?? 'error' : undefined);
      stats.termed += 1;
    }
  };

  /**
   * Publishes the terminal `frame`, records it in the claim and resolves the message. Connected
   * and holding nothing (the usual case), the frame goes out first and the claim's CAS follows,
   * off the client's path; otherwise the CAS comes first and proves we still own the request.
   * Superseded (the CAS fails): nothing more is published and the message is left to its owner.
   * A first delivery that wrote no claim and published its terminal frame writes none at all:
   * `MAGUS_RESPONSES` holds the frame, and a redelivery (a lost ack) reads it back and replays it.
   */
  const conclude = async (a: Attempt, frame: ResponseFrame, resolve: 'ack' | 'term') => {
    a.concluding = true;
    const early = connected && !a.paused && !a.abort.signal.aborted;
    if (early) {
      try {
        frames.publish(a.pending, a.req.replyTo, frame);
      } catch {
        abortAttempt(a, 'closed');
        return;
      }
      if (a.revision === 0) {
        await whenStored(a);
        if (a.abort.signal.aborted) return; // superseded or closed while waiting: not ours to resolve
        return resolveMessage(a, frame, resolve);
      }
    }
    // NATS may be reconnecting: retry a while (a retry recognises its own lost write). If we
    // cannot finish before JetStream redelivers, the next delivery takes over and our CAS fails.
    const giveUpAt = Date.now() + 2 * ackWaitMs;
    let finished: boolean;
    for (;;) {
      while (!connected && !nc.isClosed() && Date.now() < giveUpAt) await new Promise((resolve) => setTimeout(resolve, 50));
      try {
        finished = await claims.finish(a.req.id, a.claim, a.revision, frame);
        break;
      } catch (err) {
        if (Date.now() > giveUpAt || nc.isClosed()) throw err;
        log(`request ${a.req.id}: finishing the claim failed (${(err as Error).message}); retrying`);
        await new Promise((resolve) => setTimeout(resolve, 250));
      }
    }
    if (finished) a.recorded = true;
    else {
      abortAttempt(a, 'superseded');
      log(`request ${a.req.id}: taken over by a later delivery; ${early ? 'its terminal frame was already sent (the gateway keeps the first)' : 'not answering'}`);
      return;
    }
    if (!early) {
      // The CAS proved we own the request: publish what is held and the terminal frame.
      a.paused = false;
      frames.resend(a.pending, true);
      for (const f of a.held.splice(0)) frames.publish(a.pending, a.req.replyTo, f);
      frames.publish(a.pending, a.req.replyTo, frame);
    }
    await whenStored(a);
    resolveMessage(a, frame, resolve);
  };

  /** Resolves a delivery after its engine call (or a failure before it). */
  const settle = async (a: Attempt, outcome: Outcome): Promise<void> => {
    const m = a.msg;
    switch (outcome.kind) {
      case 'finish':
        return conclude(a, outcome.frame, outcome.resolve);
      case 'aborted':
        if (outcome.reason === 'cancelled') {
          // Recorded as finished so no later delivery regenerates it; nobody listens to the frame.
          stats.cancelled += 1;
          return conclude(a, errorFrame(a.nextSeq, 499, 'cancelled', 'client_closed', 'the client went away'), 'term');
        }
        if (outcome.reason === 'shutdown') {
          m.nak(); // hand it to another bridge now; it resumes after our frames
          stats.nakked += 1;
        }
        return;
      case 'retry': {
        const delivery = m.info.deliveryCount;
        const delay = Math.min(retryDelayMs * 2 ** (delivery - 1), 30_000);
        if (delivery >= maxDeliver) {
          return conclude(a, errorFrame(a.nextSeq, 503, 'server_error', BridgeErrorCode.engineUnavailable, `${outcome.reason} (after ${delivery} deliveries)`), 'term');
        }
        if (Date.now() + delay >= a.req.deadline) {
          return conclude(a, errorFrame(a.nextSeq, 504, 'timeout', BridgeErrorCode.deadlineExceeded, `${outcome.reason}; no time left to retry`), 'term');
        }
        log(`request ${a.req.id}: ${outcome.reason}; retrying in ${delay} ms`);
        m.nak(delay);
        stats.nakked += 1;
        return;
      }
    }
  };

  const newAttempt = (req: InferenceRequest, m: JsMsg, claim: RequestClaim, revision: number): Attempt => {
    const a: Attempt = { req, msg: m, claim, revision, abort: new AbortController(), held: [], pending: new PendingFrames(), recorded: false, paused: !connected, resuming: false, concluding: false, nextSeq: 0 };
    live.add(a);
    stats.inFlight = live.size;
    return a;
  };
  const retire = (a: Attempt) => {
    frames.forget(a.pending);
    live.delete(a);
    stats.inFlight = live.size;
  };

  /**
   * A first delivery. No earlier delivery exists, so nobody else can own the request and no claim
   * is written while it runs (revision 0 = none). Connected at the end, it publishes its terminal
   * frame and acks: no KV write at all, the stored frame is the record a redelivery finds. Cut off
   * from NATS at the end, it creates the claim, already finished, before publishing (the CAS
   * proves nobody took over meanwhile). A later delivery that takes over creates a claim, which
   * this attempt notices at its periodic check and then publishes nothing more.
   */
  const serveFirst = async (m: JsMsg, req: InferenceRequest, track: (a: Attempt | undefined) => void): Promise<void> => {
    const a = newAttempt(req, m, { attempt: 1, owner, createdAt: Date.now(), state: 'running' }, 0);
    track(a);
    try {
      if (Date.now() >= req.deadline) {
        return await conclude(a, errorFrame(0, 504, 'timeout', BridgeErrorCode.deadlineExceeded, 'the request deadline passed before it was served'), 'term');
      }
      await settle(a, await generate(a, []));
    } finally {
      retire(a);
      track(undefined);
    }
  };

  /** Calls the engine for `a`, publishing chunk frames after those an earlier attempt published (`prior`). */
  const generate = async (a: Attempt, prior: ResponseFrame[]): Promise<Outcome> => {
    const { req } = a;
    const stream = req.body.stream === true;
    const body: ChatCompletionRequest = { ...req.body, stream, seed: req.body.seed ?? seedFor(req.id) };
    const timeout = Math.max(1, Math.min(requestTimeoutMs, req.deadline - Date.now()));
    // One controller for the engine call: the attempt's abort, the timeout, and our own stop when
    // we read no further (divergence, errors). Reasons are preallocated: a DOMException per call
    // costs more than the rest of this function.
    const local = new AbortController();
    const signal = local.signal;
    const onAttemptAbort = () => local.abort(a.abort.signal.reason);
    a.abort.signal.addEventListener('abort', onAttemptAbort, { once: true });
    const timer = setTimeout(() => local.abort(ENGINE_TIMEOUT), timeout);
    const aborted = (): Outcome | null => {
      if (a.abort.signal.aborted) return { kind: 'aborted', reason: a.abort.signal.reason as AbortReason };
      if (Date.now() >= req.deadline) return { kind: 'finish', resolve: 'term', frame: errorFrame(a.nextSeq, 504, 'timeout', BridgeErrorCode.deadlineExceeded, 'the request deadline passed while the engine was generating') };
      if (signal.aborted) return { kind: 'retry', reason: `engine call exceeded ${requestTimeoutMs} ms` };
      return null;
    };
    const diverged = (): Outcome => ({
      kind: 'finish',
      resolve: 'term',
      frame: errorFrame(a.nextSeq, 502, 'server_error', BridgeErrorCode.generationDiverged, 'the answer was interrupted and could not be resumed identically'),
    });
    try {
      const res = await engine.post('/v1/chat/completions', JSON.stringify(body), { accept: stream ? 'text/event-stream' : 'application/json', signal });
      if (res.status < 200 || res.status > 299) {
        const e = await engineErrorBody(res);
        if (transientStatus(res.status)) return { kind: 'retry', reason: `engine ${res.status}: ${e.message}` };
        return { kind: 'finish', resolve: 'term', frame: errorFrame(a.nextSeq, res.status, e.type ?? 'invalid_request_error', e.code ?? null, e.message) };
      }
      if (!stream) {
        const completion: unknown = JSON.parse(await res.text());
        return { kind: 'finish', resolve: 'ack', frame: { seq: a.nextSeq, type: 'done', data: stamp(completion, req.id, a.claim.createdAt) } };
      }
      if (!res.contentType.includes('text/event-stream')) {
        res.cancel();
        return { kind: 'finish', resolve: 'term', frame: errorFrame(a.nextSeq, 502, 'server_error', BridgeErrorCode.engineProtocol, 'the engine did not stream (no text/event-stream)') };
      }
      let seq = 0;
      let firstToken = false;
      // A batch is what one read of the engine's body completed: its frames are published in one
      // go, so NATS gets them in one write instead of one per event — except that the frames up
      // to the answer's first token go out ahead of the rest of their batch (time to first token).
      read: for await (const batch of res.eventBatches()) {
        for (const [i, event] of batch.entries()) {
          if (event.trim() === '[DONE]') break read;
          let data: unknown;
          try {
            data = JSON.parse(event);
          } catch {
            return { kind: 'finish', resolve: 'term', frame: errorFrame(a.nextSeq, 502, 'server_error', BridgeErrorCode.engineProtocol, 'the engine sent a malformed event') };
          }
          const engineError = (data as { error?: { message?: string } } | null)?.error;
          if (engineError) {
            return { kind: 'finish', resolve: 'term', frame: errorFrame(a.nextSeq, 502, 'server_error', BridgeErrorCode.engineProtocol, `engine: ${engineError.message ?? 'error'}`) };
          }
          const frame: ResponseFrame = { seq, type: 'chunk', data: stamp(data, req.id, a.claim.createdAt) };
          const before = prior[seq];
          if (before) {
            if (fingerprint(before) !== fingerprint(frame)) return diverged();
          } else {
            send(a, frame);
            a.nextSeq = seq + 1;
          }
          seq += 1;
          if (a.abort.signal.aborted) break read;
          if (!firstToken && carriesText(data)) {
            firstToken = true;
            if (i < batch.length - 1) await new Promise<void>((resolve) => setImmediate(resolve)); // NATS flushes it now
            if (a.abort.signal.aborted) break read;
          }
        }
      }
      const stopped = aborted();
      if (stopped) return stopped;
      if (seq < prior.length) return diverged();
      return { kind: 'finish', resolve: 'ack', frame: { seq: a.nextSeq, type: 'done' } };
    } catch (err) {
      // Aborted (ours, deadline, timeout) or the engine is unreachable / died mid-answer: a later
      // attempt resumes after the frames already sent, so a retry is safe.
      return aborted() ?? { kind: 'retry', reason: `engine unreachable: ${(err as { cause?: Error }).cause?.message ?? (err as Error).message}` };
    } finally {
      clearTimeout(timer);
      a.abort.signal.removeEventListener('abort', onAttemptAbort);
      local.abort(READ_NO_FURTHER);
    }
  };

  /** Serves one delivery to its end: resolved (ack/term/nak) unless superseded or disconnected. */
  const serve = async (m: JsMsg) => {
    stats.pulled += 1;
    if (m.redelivered) stats.redelivered += 1;
    const parsed = parseInferenceRequest(m.data, names);
    if (!parsed.ok) {
      log(`terminating malformed request (stream seq ${m.seq}): ${parsed.problem}`);
      if (parsed.replyTo) {
        nc.publish(parsed.replyTo, encodeFrame(errorFrame(0, 400, 'invalid_request_error', BridgeErrorCode.invalidRequest, parsed.problem)));
        await nc.flush();
      }
      m.term(parsed.problem);
      stats.termed += 1;
      return;
    }
    const req = parsed.req;
    const cancelledAt = cancelled.get(req.id);
    if (cancelledAt !== undefined && Date.now() - cancelledAt < CANCEL_MEMORY_MS) {
      // Its client went away while it was queued: nobody waits for an answer.
      m.term('cancelled');
      stats.termed += 1;
      stats.cancelled += 1;
      return;
    }
    let attempt: Attempt | undefined;
    const ticker = setInterval(() => tick(m, () => attempt), workingEveryMs);
    try {
      if (!m.redelivered) return await serveFirst(m, req, (a) => (attempt = a));
      let claimed: Awaited<ReturnType<typeof claims.acquire>>;
      try {
        claimed = await claims.acquire(req.id, owner);
      } catch (err) {
        failed(`request ${req.id}: claiming it failed; retrying later`, err);
        m.nak(retryDelayMs);
        stats.nakked += 1;
        return;
      }
      if (claimed.kind === 'finished') {
        // An earlier delivery answered but its ack was lost: say the same last word again.
        if (claimed.claim.terminal) nc.publish(req.replyTo, encodeFrame(claimed.claim.terminal));
        await nc.flush();
        m.ack();
        stats.acked += 1;
        stats.replayed += 1;
        return;
      }
      const a = newAttempt(req, m, claimed.claim, claimed.revision);
      attempt = a;
      try {
        // A redelivery: an earlier delivery may have published frames already (a first delivery
        // writes its claim only once it has answered, so finding no claim proves nothing).
        let prior: ResponseFrame[] = [];
        {
          // No frame of the request is older than the request itself (stored at `since`).
          let stored: Awaited<ReturnType<typeof readStoredFrames>>;
          try {
            stored = await readStoredFrames(js, jsm, names.responseStream, req.replyTo, { since: m.info.timestampNanos / 1e6 });
          } catch (err) {
            // The response stream has no leader (an election) or NATS is away: what was sent cannot
            // be known yet. Hand it back for a retry soon rather than leave it to ack_wait; the
            // next delivery takes over from our claim.
            failed(`request ${req.id}: reading back its frames failed; retrying in ${retryDelayMs} ms`, err);
            m.nak(retryDelayMs);
            stats.nakked += 1;
            return;
          }
          prior = stored.frames;
          a.nextSeq = prior.length;
          if (prior.length > 0) {
            stats.resumed += 1;
            log(`request ${req.id}: attempt ${a.claim.attempt} resumes after ${prior.length} frames`);
          }
          const last = prior.at(-1);
          if (last && last.type !== 'chunk') return await conclude(a, last, 'ack'); // answered, but never claimed finished
          if (!stored.complete) {
            // Frames of the request are gone (MAGUS_RESPONSES evicted or aged them out): what the
            // client has cannot be known. End after the highest seq stored, which it may have.
            stats.resumeFailed += 1;
            log(`request ${req.id}: its earlier frames are no longer in ${names.responseStream}; ending it (resume_failed)`);
            const seq = Math.max(prior.length, stored.highestSeq + 1);
            return await conclude(a, errorFrame(seq, 502, 'server_error', BridgeErrorCode.resumeFailed, 'the interrupted answer could not be read back'), 'term');
          }
        }
        if (Date.now() >= req.deadline) {
          return await conclude(a, errorFrame(a.nextSeq, 504, 'timeout', BridgeErrorCode.deadlineExceeded, 'the request deadline passed before it was served'), 'term');
        }
        await settle(a, await generate(a, prior));
      } finally {
        retire(a);
      }
    } finally {
      clearInterval(ticker);
    }
  };

  // Pulls through one `consume()` at a time; a new one replaces it when the consumer had to be
  // created again (the old one would only notice after its heartbeats went missing, ~30 s).
  let messages: ConsumerMessages = await consumer.consume({ max_messages: slots });
  const watch = (current: ConsumerMessages) =>
    void (async () => {
      for await (const s of await current.status()) {
        switch (s.type) {
          case ConsumerEvents.HeartbeatsMissed:
            stats.heartbeatsMissed += 1;
            lastHeartbeatMissAt = Date.now();
            log(`consumer heartbeats missed (${String(s.data)})`);
            break;
          case ConsumerEvents.ConsumerNotFound:
          case ConsumerEvents.ConsumerDeleted:
          case ConsumerEvents.StreamNotFound:
          case ConsumerEvents.NoResponders:
            consumerMissing = true;
            log(`consumer unavailable: ${s.type}`);
            break;
          default:
            break;
        }
      }
    })().catch(() => undefined);
  watch(messages);

  /** Pulls through a new `consume()` from now on; the loop below moves over to it. */
  const pullAfresh = async () => {
    const old = messages;
    messages = await consumer.consume({ max_messages: slots });
    watch(messages);
    old.stop();
  };

  // A server that restarted without its store (or lost the consumer some other way) would leave
  // this bridge pulling from nothing: after every reconnect it creates its consumer again, as it
  // was, unless it is stopping (a destroyed instance's consumer is deleted after its bridge stops).
  await declareOnReconnect(
    nc,
    async () => {
      if (!(await restoreConsumer(jsm, names.requestStream, config)) || stopping) return;
      log('request consumer was missing: created again');
      await pullAfresh();
    },
    { what: 'request consumer', log, isDone: () => stopping },
  );

  // On a cluster the consumer (replicated like its stream) has a leader, which holds this
  // bridge's pull requests. A new leader (the old one's server died, or stepped down) knows
  // nothing of them: the old consume() would wait for its heartbeats to go missing (2 × 15 s)
  // before it pulled again, and until then no request is delivered. The server announces every
  // election: pull afresh from the new leader at once (measured, test/nats-cluster.int.test.ts:
  // a leader's SIGKILL paused clients ~30 s without this, ~7–10 s with it — the election).
  const elected = nc.subscribe(`$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.${names.requestStream}.${config.durable_name ?? consumerNameOf(pool, instance)}`, {
    callback: (err) => {
      if (err || stopping || nc.isClosed()) return;
      log('request consumer has a new leader: pulling from it');
      pullAfresh().catch((e: unknown) => failed('pulling from the new consumer leader', e));
    },
  });

  void nc.closed().then(() => {
    // Killed from under us: nothing can be answered or resolved any more (JetStream redelivers).
    connected = false;
    for (const a of live) abortAttempt(a, 'closed');
    messages.stop();
  });

  const semaphore = new Semaphore(slots);
  const loop = (async () => {
    try {
      for (let current = messages; ; current = messages) {
        for await (const m of current) {
          lastMessageAt = Date.now();
          consumerMissing = false;
          await semaphore.acquire();
          if (stopping) {
            m.nak();
            stats.nakked += 1;
            semaphore.release();
            continue;
          }
          const h = serve(m)
            .catch((err) => failed(`request at stream seq ${m.seq}`, err))
            .finally(() => {
              semaphore.release();
              handlers.delete(h);
            });
          handlers.add(h);
        }
        // Ended: replaced (go on with the new one), or stopped or closed (done).
        if (current === messages || stopping || nc.isClosed()) break;
      }
    } catch (err) {
      if (!nc.isClosed()) failed('consume loop', err);
    } finally {
      consuming = false;
    }
  })();

  return {
    stats,
    health() {
      const problems: string[] = [];
      if (nc.isClosed()) problems.push('NATS connection closed');
      else if (!connected) problems.push('NATS disconnected');
      if (!consuming) problems.push('not consuming');
      if (consumerMissing) problems.push('request consumer missing');
      if (lastHeartbeatMissAt > lastMessageAt && Date.now() - lastHeartbeatMissAt < 2 * 30_000) problems.push('consumer heartbeats missed');
      return { ok: problems.length === 0, problems, inFlight: live.size, slots };
    },
    async checkEngine(timeoutMs = 2000) {
      try {
        const res = await engine.get('/health', { signal: AbortSignal.timeout(timeoutMs) });
        res.cancel();
        return { ok: res.status >= 200 && res.status < 300, status: res.status };
      } catch (err) {
        return { ok: false, error: (err as { cause?: Error }).cause?.message ?? (err as Error).message };
      }
    },
    async stop() {
      if (stopping) return;
      stopping = true;
      if (!nc.isClosed()) await settlesWithin(messages.close(), 5000);
      else messages.stop();
      await settlesWithin(loop, 5000);
      const drained = await settlesWithin(Promise.allSettled([...handlers]), drainTimeoutMs);
      if (!drained) {
        log(`stopping: handing ${live.size} request(s) in flight back`);
        for (const a of live) abortAttempt(a, 'shutdown');
        await Promise.allSettled([...handlers]);
      }
      clearInterval(sweep);
      await frames.close();
      engine.close();
      cancelSub.unsubscribe();
      elected.unsubscribe();
    },
  };
}

/**
 * Reading `MAGUS_RESPONSES` back: the frames of one response subject as the stream stored them
 * (a take-over learns what its client may already have; a gateway back from an outage fetches
 * what it missed), and whether the stream keeps frames as long as take-overs need them.
 */
import { ErrorCode, RequestStrategy, type JetStreamClient, type JetStreamManager, type NatsConnection, type StoredMsg } from 'nats';
import type { ResponseFrame } from '../shared/serving';
import { ResponseStreamMetadata } from './declare';
import { JsApiError, jsErrorCode } from './errors';
import { decodeFrame, FrameSequencer } from './frames';

/** What {@link readStoredFrames} found of one response subject. */
export interface StoredFrames {
  /** Frames 0..k in order, each seq once: what a {@link FrameSequencer} would have relayed. */
  frames: ResponseFrame[];
  /** Frames stored beyond a missing seq, in seq order: a reader that has the missing ones (a gateway back from an outage) can still use them. */
  beyondGap: ResponseFrame[];
  /** The highest seq stored (−1: none). */
  highestSeq: number;
  /**
   * False when frames of the subject are gone (aged out, or evicted by a full stream: a missing
   * seq, or with `since`, nothing left although the stream dropped frames published after it):
   * then what was sent cannot be known, and the prefix cannot be trusted.
   */
  complete: boolean;
  /**
   * Why not complete: a seq missing with frames stored beyond it (`gap`), none stored although the
   * stream dropped frames younger than `since` (`dropped`), or a frame that does not decode.
   */
  incomplete?: { why: 'gap' | 'dropped' | 'malformed'; detail: string };
}

/**
 * The frames of `subject` that reached the server, read from the response stream `stream`
 * (`names.responseStream`). `since` (epoch ms, server time: e.g. when the request was stored)
 * says no frame of the subject is older: finding none then proves nothing was sent only if the
 * stream has dropped nothing younger since — a stream that evicts under pressure can have lost
 * every frame of a request, and a take-over that took that for "nothing sent" would restart an
 * answer the client already has part of. (A stream declared again after it was lost, e.g. a
 * restarted server, has dropped nothing: what it holds is what there is.) A read that does not
 * reach the subject's last stored frame within `timeoutMs` (a stream leader still catching up
 * after an election) throws: frames it did not get are not frames that are gone.
 */
export async function readStoredFrames(
  js: JetStreamClient,
  jsm: JetStreamManager,
  stream: string,
  subject: string,
  opts: {
    since?: number;
    timeoutMs?: number;
    /**
     * Read by batched direct gets on this connection, whose role may send `$JS.API.DIRECT.GET.<stream>`
     * for any subject (the gateway's): no consumer is made, so a herd of readers (the clients of a
     * killed gateway resuming on another at once) costs the cluster's meta leader nothing.
     */
    direct?: NatsConnection;
  } = {},
): Promise<StoredFrames> {
  // The first batch is asked for beside the last stored seq (one round trip, not two, for the
  // answers of up to a batch of frames: a herd of resumes on one replica waits that much less); it
  // is read only once that seq is known, as the later ones are.
  const first = opts.direct ? directBatch(opts.direct, stream, subject, 1, opts.timeoutMs ?? 10_000) : undefined;
  first?.catch(() => undefined); // awaited below only when the subject has frames
  let lastSeq: number;
  try {
    lastSeq = await lastSeqOf(jsm, stream, subject);
  } catch (err) {
    if (!isNoMessage(err)) throw err;
    const dropped = opts.since === undefined ? undefined : await droppedSince(jsm, stream, opts.since);
    return { frames: [], beyondGap: [], highestSeq: -1, complete: !dropped, ...(dropped ? { incomplete: { why: 'dropped', detail: dropped } } : {}) };
  }
  const sequencer = new FrameSequencer();
  const frames: ResponseFrame[] = [];
  let highestSeq = -1;
  let malformed = false;
  const take = (data: Uint8Array) => {
    const frame = decodeFrame(data);
    if (frame) {
      frames.push(...sequencer.push(frame));
      highestSeq = Math.max(highestSeq, frame.seq);
    } else malformed = true;
  };
  const found = (): StoredFrames => {
    const beyondGap = sequencer.waiting();
    const incomplete: StoredFrames['incomplete'] = malformed
      ? { why: 'malformed', detail: 'a stored frame does not decode' }
      : sequencer.hasGap
        ? { why: 'gap', detail: `seq ${frames.length} missing; ${beyondGap.length} frame(s) stored beyond it, up to seq ${highestSeq}` }
        : undefined;
    return { frames, beyondGap, highestSeq, complete: !incomplete, ...(incomplete ? { incomplete } : {}) };
  };
  if (opts.direct) {
    const stored = await readDirect(opts.direct, stream, subject, lastSeq, opts.timeoutMs ?? 10_000, first);
    if (stored) {
      for (const data of stored) take(data);
      return found();
    }
  }
  // One filter subject, as a string: nats.js then names it in the create request's subject
  // (`$JS.API.CONSUMER.CREATE.<stream>.<name>.<subject>`), which a bridge's permissions allow for
  // its own instance's subjects only (roles.ts).
  const consumer = await js.consumers.get(stream, { filterSubjects: subject });
  const messages = await consumer.consume({ max_messages: 256 });
  const timer = setTimeout(() => void messages.close(), opts.timeoutMs ?? 10_000);
  let reachedEnd = false;
  try {
    for await (const m of messages) {
      take(m.data);
      if (m.seq >= lastSeq) {
        reachedEnd = true;
        break;
      }
    }
  } finally {
    clearTimeout(timer);
    await messages.close();
  }
  // Not gone, unread (an election's new leader can take longer than the timeout to deliver):
  // the caller retries rather than end an answer it cannot see (the cluster test saw a
  // take-over end a live answer with resume_failed at seq 0 this way).
  if (!reachedEnd) throw new Error(`reading ${subject} from ${stream} stopped before its last stored frame (stream seq ${lastSeq})`);
  return found();
}

/** Messages one batched direct get returns at most. */
const DIRECT_BATCH = 256;

/**
 * `subject`'s messages in `stream` up to stream sequence `lastSeq`, in order, by batched direct
 * gets (`{seq, next_by_subj, batch}`: any replica answers from its subject index); undefined when
 * the server does not batch them (before NATS 2.11: its replies carry no `Nats-Num-Pending`).
 * A replica behind the one that told `lastSeq` is asked again until `timeoutMs`; then it throws,
 * as the consumer's read does: frames not read are not frames that are gone. `first`, when given,
 * is the batch from seq 1, asked for already.
 */
async function readDirect(
  nc: NatsConnection,
  stream: string,
  subject: string,
  lastSeq: number,
  timeoutMs: number,
  first?: Promise<DirectBatch | undefined>,
): Promise<Uint8Array[] | undefined> {
  const out: Uint8Array[] = [];
  const deadline = Date.now() + timeoutMs;
  let from = 1;
  let asked = first;
  while (from <= lastSeq) {
    const left = deadline - Date.now();
    if (left <= 0) throw new Error(`reading ${subject} from ${stream} stopped before its last stored frame (stream seq ${lastSeq})`);
    const batch = await (asked ?? directBatch(nc, stream, subject, from, left));
    asked = undefined;
    if (!batch) return undefined;
    const before = from;
    for (const m of batch) {
      if (m.seq < from) throw new Error(`a direct get of ${subject} from ${stream} answered stream seq ${m.seq}`);
      if (m.seq > lastSeq) return out;
      out.push(m.data);
      from = m.seq + 1;
    }
    // Nothing new from this replica: it is behind; another, or the same later, is asked.
    if (from === before) await new Promise((resolve) => setTimeout(resolve, 50));
  }
  return out;
}

/** What one batched direct get returned: each message's stream seq and data, in order. */
type DirectBatch = { seq: number; data: Uint8Array }[];

/**
 * One batched direct get of `subject`'s messages from stream seq `from` on (up to
 * {@link DIRECT_BATCH}); undefined when the server does not batch them or nobody answers direct
 * gets (a stream declared before `allow_direct`).
 */
async function directBatch(nc: NatsConnection, stream: string, subject: string, from: number, maxWait: number): Promise<DirectBatch | undefined> {
  const out: DirectBatch = [];
  try {
    const replies = await nc.requestMany(`$JS.API.DIRECT.GET.${stream}`, JSON.stringify({ seq: from, next_by_subj: subject, batch: DIRECT_BATCH }), {
      strategy: RequestStrategy.SentinelMsg,
      maxWait,
    });
    for await (const m of replies) {
      // The end of the batch (204), or nothing from `from` on (404): a reply without data.
      if (m.data.length === 0) break;
      if (m.headers?.get('Nats-Num-Pending') === '') return undefined;
      const seq = Number(m.headers?.get('Nats-Sequence'));
      if (!Number.isSafeInteger(seq)) throw new Error(`a direct get of ${subject} from ${stream} answered stream seq ${m.headers?.get('Nats-Sequence')}`);
      out.push({ seq, data: m.data });
    }
  } catch (err) {
    if ((err as { code?: string } | null)?.code === ErrorCode.NoResponders) return undefined;
    throw err;
  }
  return out;
}

/**
 * The stream sequence of `subject`'s last stored message: a direct get, whose request names the
 * subject (`$JS.API.DIRECT.GET.<stream>.<subject>`), so permissions can allow it per subject; a
 * stream declared before `allow_direct` (no responders) is asked through the stream API instead.
 */
async function lastSeqOf(jsm: JetStreamManager, stream: string, subject: string): Promise<number> {
  // nats.js's manager has the direct API (its KV reads use it) without declaring it.
  const direct = (jsm as JetStreamManager & { direct?: { getMessage(stream: string, q: { last_by_subj: string }): Promise<StoredMsg> } }).direct;
  if (direct) {
    try {
      return (await direct.getMessage(stream, { last_by_subj: subject })).seq;
    } catch (err) {
      if ((err as { code?: string } | null)?.code !== ErrorCode.NoResponders) throw err;
    }
  }
  return (await jsm.streams.getMessage(stream, { last_by_subj: subject })).seq;
}

/** A get that found no message: the stream API's error, or a direct get's 404. */
const isNoMessage = (err: unknown): boolean =>
  jsErrorCode(err) === JsApiError.noMessage || (err as { code?: string } | null)?.code === ErrorCode.JetStream404NoMessages;

/** Whether `stream`, declared before `since`, has dropped messages stored after it (its oldest is younger): what it says of that, or undefined. */
async function droppedSince(jsm: JetStreamManager, stream: string, since: number): Promise<string | undefined> {
  const { created, state } = await jsm.streams.info(stream);
  const dropped = Date.parse(created) <= since && state.messages > 0 && Date.parse(state.first_ts) > since;
  return dropped ? `none stored, and the stream's oldest frame (${state.first_ts}) is younger than the request (${new Date(since).toISOString()})` : undefined;
}

/** What {@link responseStreamState} reports of `MAGUS_RESPONSES`: whether it keeps frames as long as take-overs need them. */
export interface ResponseStreamState {
  /** Age of the oldest stored frame (undefined: none stored). */
  oldestFrameAgeMs: number | undefined;
  /** How long frames must stay (`responseRetentionMs` as declared; undefined for a stream declared without it). */
  requiredRetentionMs: number | undefined;
  bytes: number;
  maxBytes: number;
}

/**
 * The response stream's retention as it is now. A full stream (`bytes` near `maxBytes`) whose
 * oldest frame is younger than the required retention is evicting frames a take-over may still
 * need: the stream is too small for the traffic.
 */
export async function responseStreamState(jsm: JetStreamManager, stream: string): Promise<ResponseStreamState> {
  const { config, state } = await jsm.streams.info(stream);
  const required = Number(config.metadata?.[ResponseStreamMetadata.retentionMs]);
  return {
    oldestFrameAgeMs: state.messages > 0 ? Math.max(0, Date.now() - Date.parse(state.first_ts)) : undefined,
    requiredRetentionMs: Number.isFinite(required) && required > 0 ? required : undefined,
    bytes: state.bytes,
    maxBytes: config.max_bytes,
  };
}

/**
 * Response frames on the wire: the one codec and the one ordering rule. The gateway relays with
 * them, and a bridge that takes over a request (or a gateway back from a NATS outage) reads the
 * stored frames back with them; a take-over is correct only because both read frames alike, so
 * neither has a copy of its own (README.md next to this file, "Exactly one answer per request id").
 */
import type { ResponseFrame } from '../shared/serving';

const encoder = new TextEncoder();
const decoder = new TextDecoder();

/** A frame as bridges publish it (JSON). */
export function encodeFrame(frame: ResponseFrame): Uint8Array {
  return encoder.encode(JSON.stringify(frame));
}

/**
 * A frame off the wire, checked; `undefined` when it is not a {@link ResponseFrame}. `seq` must be
 * a non-negative *safe* integer: beyond 2^53 distinct seqs compare equal, which would break the
 * first-arrival rule.
 */
export function decodeFrame(bytes: Uint8Array): ResponseFrame | undefined {
  let v: unknown;
  try {
    v = JSON.parse(decoder.decode(bytes));
  } catch {
    return undefined;
  }
  if (typeof v !== 'object' || v === null) return undefined;
  const f = v as { seq?: unknown; type?: unknown; error?: unknown };
  if (typeof f.seq !== 'number' || !Number.isSafeInteger(f.seq) || f.seq < 0) return undefined;
  if (f.type === 'chunk') return v as ResponseFrame;
  if (f.type === 'done') {
    const parts = (v as { parts?: unknown }).parts;
    return parts === undefined || (Number.isSafeInteger(parts) && (parts as number) > 0) ? (v as ResponseFrame) : undefined;
  }
  if (f.type === 'part') return typeof (v as { piece?: unknown }).piece === 'string' ? (v as ResponseFrame) : undefined;
  if (f.type === 'error' && typeof f.error === 'object' && f.error !== null) return v as ResponseFrame;
  return undefined;
}

/** nats-server's `max_payload` unless it is configured otherwise (1 MiB). */
export const DEFAULT_MAX_PAYLOAD = 1024 * 1024;

/**
 * Bytes a frame's encoding may take beside the message's other costs: a NATS message's payload
 * and headers count toward `max_payload`, and a frame goes out with no headers, so only the
 * margin a stored copy's envelope might need is kept back.
 */
const FRAME_MARGIN_BYTES = 512;

/** The bytes of a `part`'s envelope (`{"seq":…,"type":"part","piece":""}`), with room for any seq. */
const PART_ENVELOPE_BYTES = 64;

/**
 * `frame` as published within `maxPayload` bytes per message: itself when it fits; a `done` whose
 * data does not is its data's JSON (UTF-8) cut into `part` frames, base64 each, numbered from
 * `frame.seq` on, then a `done` with no data that says how many (`parts`), numbered after them.
 * A chunk or an error is never larger than a few kilobytes and is returned as it is.
 */
export function splitFrame(frame: ResponseFrame, maxPayload: number): ResponseFrame[] {
  if (frame.type !== 'done' || frame.data === undefined) return [frame];
  const budget = maxPayload - FRAME_MARGIN_BYTES;
  if (encodeFrame(frame).length <= budget) return [frame];
  const bytes = Buffer.from(JSON.stringify(frame.data), 'utf8');
  // base64 takes 4 bytes for every 3.
  const per = Math.floor((budget - PART_ENVELOPE_BYTES) / 4) * 3;
  if (per <= 0) throw new Error(`max_payload ${maxPayload} leaves no room for a frame`);
  const out: ResponseFrame[] = [];
  for (let at = 0; at < bytes.length; at += per) {
    out.push({ seq: frame.seq + out.length, type: 'part', piece: bytes.subarray(at, at + per).toString('base64') });
  }
  out.push({ seq: frame.seq + out.length, type: 'done', parts: out.length });
  return out;
}

/** Most bytes a split answer may have, joined: beyond it the answer is refused, not held. */
export const MAX_JOINED_BYTES = 64 * 1024 * 1024;

/**
 * The `part` frames of one response as they are relayed (in seq order), joined into the `done`
 * that follows them. Only the last `parts` pieces belong to it: an attempt that died halfway
 * through its parts left pieces that a later attempt's `done` does not count.
 */
export class FrameParts {
  private pieces: Buffer[] = [];
  private bytes = 0;

  /** Keeps a part's piece; false when the pieces so far exceed {@link MAX_JOINED_BYTES}. */
  add(frame: Extract<ResponseFrame, { type: 'part' }>): boolean {
    const piece = Buffer.from(frame.piece, 'base64');
    this.pieces.push(piece);
    this.bytes += piece.length;
    return this.bytes <= MAX_JOINED_BYTES;
  }

  /**
   * `done` with its data: as it came, or joined from the pieces it counts. Undefined when it
   * counts more pieces than came, or they do not join into JSON.
   */
  join(done: Extract<ResponseFrame, { type: 'done' }>): Extract<ResponseFrame, { type: 'done' }> | undefined {
    if (done.parts === undefined) return done;
    if (done.parts > this.pieces.length) return undefined;
    const joined = Buffer.concat(this.pieces.slice(this.pieces.length - done.parts));
    this.pieces = [];
    this.bytes = 0;
    try {
      return { seq: done.seq, type: 'done', data: JSON.parse(joined.toString('utf8')) as unknown };
    } catch {
      return undefined;
    }
  }
}

/** Frames held behind a missing seq, at most; one more gives the gap up at once (bounded memory). */
export const MAX_HELD_FRAMES = 4096;

export interface FrameSequencerOptions {
  /**
   * While frames wait behind a missing seq, give up on it after this long (each further gap gets
   * its own full wait) and call `onGap`. Default: no timer — a read of stored frames ends by itself.
   */
  gapTimeoutMs?: number;
  /**
   * The first wait of each gap, when shorter than `gapTimeoutMs` (with `onGapTimeout`: an owner
   * that reads the stream back looks there sooner; later waits are `gapTimeoutMs`).
   */
  firstGapTimeoutMs?: number;
  /** A gap given up on (timed out, or more than `maxHeld` frames behind it); the sequencer has stopped. */
  onGap?: (missingSeq: number) => void;
  /**
   * Called instead of giving up when `gapTimeoutMs` passes: the owner looks for the missing frame
   * elsewhere (the gateway reads the stream back) and then calls {@link FrameSequencer.waitAgain}
   * or {@link FrameSequencer.giveUp}.
   */
  onGapTimeout?: (missingSeq: number) => void;
  /** Default {@link MAX_HELD_FRAMES}. */
  maxHeld?: number;
}

/**
 * The rule for one response subject: relay frames strictly in `seq` order from 0, each seq once —
 * the first frame to arrive with a seq wins, a later one with a seq already relayed or held is a
 * duplicate (a re-published terminal, or a redelivery restarted from seq 0) and is dropped; a
 * frame ahead of the next seq waits for the gap to fill; the first terminal (`done`/`error`)
 * relayed ends the response.
 */
export class FrameSequencer {
  private next = 0;
  private ended = false;
  private stopped = false;
  private gaveUp = false;
  private readonly held = new Map<number, ResponseFrame>();
  private gapTimer: NodeJS.Timeout | undefined;
  private readonly maxHeld: number;
  /** How long a new gap waits before it first times out. */
  private readonly firstWaitMs: number | undefined;

  constructor(private readonly opts: FrameSequencerOptions = {}) {
    this.maxHeld = opts.maxHeld ?? MAX_HELD_FRAMES;
    const { gapTimeoutMs, firstGapTimeoutMs } = opts;
    this.firstWaitMs = firstGapTimeoutMs !== undefined && gapTimeoutMs !== undefined ? Math.min(firstGapTimeoutMs, gapTimeoutMs) : gapTimeoutMs;
  }

  /** Frames now ready to relay, in order (possibly none). */
  push(frame: ResponseFrame): ResponseFrame[] {
    if (this.stopped || frame.seq < this.next || this.held.has(frame.seq)) return [];
    if (frame.seq > this.next) {
      if (this.held.size >= this.maxHeld) {
        this.gap();
        return [];
      }
      this.held.set(frame.seq, frame);
      if (this.opts.gapTimeoutMs !== undefined) this.gapTimer ??= setTimeout(() => this.timedOut(), this.firstWaitMs);
      return [];
    }
    const out: ResponseFrame[] = [];
    for (let f: ResponseFrame | undefined = frame; f && !this.stopped; f = this.held.get(this.next)) {
      this.held.delete(f.seq);
      this.next += 1;
      out.push(f);
      if (f.type === 'done' || f.type === 'error') {
        this.ended = true;
        this.stop(); // terminal: nothing after it is relayed
      }
    }
    if (this.gapTimer) {
      clearTimeout(this.gapTimer);
      // Still holding frames: a further seq is missing; give it its own full wait.
      this.gapTimer = this.held.size > 0 ? setTimeout(() => this.timedOut(), this.firstWaitMs) : undefined;
    }
    return out;
  }

  /** The seq the next relayed frame must have (= frames relayed so far). */
  get expected(): number {
    return this.next;
  }

  /** True once a terminal frame was relayed. */
  get finished(): boolean {
    return this.ended;
  }

  /** True while frames wait behind a missing seq, or once a gap was given up on. */
  get hasGap(): boolean {
    return this.gaveUp || this.held.size > 0;
  }

  /** The frames waiting behind a missing seq, in seq order. */
  waiting(): ResponseFrame[] {
    return [...this.held.values()].sort((a, b) => a.seq - b.seq);
  }

  /** Relays nothing more and drops what it holds (clears the gap timer). */
  stop(): void {
    this.stopped = true;
    if (this.gapTimer) clearTimeout(this.gapTimer);
    this.gapTimer = undefined;
    this.held.clear();
  }

  /** While frames still wait behind a missing seq: waits `ms` (default `gapTimeoutMs`) more before the gap times out again. */
  waitAgain(ms = this.opts.gapTimeoutMs): void {
    if (this.stopped || this.held.size === 0 || ms === undefined) return;
    clearTimeout(this.gapTimer);
    this.gapTimer = setTimeout(() => this.timedOut(), ms);
  }

  /** Gives the current gap up now: stops, and calls `onGap`. */
  giveUp(): void {
    this.gap();
  }

  private timedOut(): void {
    this.gapTimer = undefined;
    if (this.stopped) return;
    if (this.opts.onGapTimeout) this.opts.onGapTimeout(this.next);
    else this.gap();
  }

  private gap(): void {
    if (this.stopped) return;
    this.gaveUp = true;
    this.stop();
    this.opts.onGap?.(this.next);
  }
}

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
  if (f.type === 'chunk' || f.type === 'done') return v as ResponseFrame;
  if (f.type === 'error' && typeof f.error === 'object' && f.error !== null) return v as ResponseFrame;
  return undefined;
}

/** Frames held behind a missing seq, at most; one more gives the gap up at once (bounded memory). */
export const MAX_HELD_FRAMES = 4096;

export interface FrameSequencerOptions {
  /**
   * While frames wait behind a missing seq, give up on it after this long (each further gap gets
   * its own full wait) and call `onGap`. Default: no timer — a read of stored frames ends by itself.
   */
  gapTimeoutMs?: number;
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

  constructor(private readonly opts: FrameSequencerOptions = {}) {
    this.maxHeld = opts.maxHeld ?? MAX_HELD_FRAMES;
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
      if (this.opts.gapTimeoutMs !== undefined) this.gapTimer ??= setTimeout(() => this.timedOut(), this.opts.gapTimeoutMs);
      return [];
    }
    const out: ResponseFrame[] = [];
    for (let f: ResponseFrame | undefined = frame; f && !this.stopped; f = this.held.get(this.next)) {
      this.held.delete(f.seq);
      this.next += 1;
      out.push(f);
      if (f.type !== 'chunk') {
        this.ended = true;
        this.stop(); // terminal: nothing after it is relayed
      }
    }
    if (this.gapTimer) {
      clearTimeout(this.gapTimer);
      // Still holding frames: a further seq is missing; give it its own full wait.
      this.gapTimer = this.held.size > 0 ? setTimeout(() => this.timedOut(), this.opts.gapTimeoutMs) : undefined;
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

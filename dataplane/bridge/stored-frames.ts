/**
 * Frames published so that the bridge knows they were *stored*: each goes out as a core publish
 * (subscribers such as the waiting gateway get it at once, as before) with a reply subject, so
 * the stream that captures it (`MAGUS_RESPONSES`) acknowledges it; a frame stays in its attempt's
 * {@link PendingFrames} until it is acknowledged, and is published again when no acknowledgement
 * comes in time, the stream refuses it, or the connection broke (after the reconnect).
 *
 * Why: a core publish is fire and forget. A frame in the client's buffer when its server dies,
 * or published while the stream has no leader (a cluster's election, 5–10 s), reaches nobody's
 * store; a gateway that was cut off at the same time reads the stream back and finds a hole it can
 * never fill (`frames_lost`), and a later delivery cannot know what was sent. With
 * acknowledgements every frame ends up stored while its bridge lives, and the bridge acks the
 * request only once all of its frames are: a redelivery finds the whole answer.
 *
 * Cost: one small acknowledgement message per frame back to the bridge, off the client's path
 * (README.md one folder up, "Stored frames"). Copies a resend adds, in the stream or at a
 * subscriber, carry a seq already seen: the gateway's and the take-over's sequencers drop them.
 */
import { inboxOf } from '../roles';
import { type NatsConnection, type Subscription } from 'nats';
import { streamAckProblem } from '../errors';
import { encodeFrame } from '../frames';
import type { ResponseFrame } from '../../shared/serving';

interface Entry {
  subject: string;
  data: Uint8Array;
  /** When it was last published; 0 = publish it again at the next sweep. */
  sentAt: number;
  /** How often it was published. */
  sends: number;
  token: string;
}

/** One attempt's frames that went out but are not acknowledged as stored yet. */
export class PendingFrames {
  readonly unstored = new Map<number, Entry>();
  private waiters: (() => void)[] = [];

  get size(): number {
    return this.unstored.size;
  }

  /** Resolves true once every frame published so far is stored; false after `timeoutMs` or when `signal` aborts. */
  async allStored(timeoutMs: number, signal?: AbortSignal): Promise<boolean> {
    if (this.unstored.size === 0) return true;
    if (signal?.aborted) return false;
    let timer: NodeJS.Timeout | undefined;
    let waiter: (() => void) | undefined;
    let onAbort: (() => void) | undefined;
    try {
      return await new Promise<boolean>((resolve) => {
        waiter = () => resolve(true);
        this.waiters.push(waiter);
        timer = setTimeout(() => resolve(false), timeoutMs);
        onAbort = () => resolve(false);
        signal?.addEventListener('abort', onAbort, { once: true });
      });
    } finally {
      clearTimeout(timer);
      if (onAbort) signal?.removeEventListener('abort', onAbort);
      this.waiters = this.waiters.filter((w) => w !== waiter);
    }
  }

  /** @internal */
  stored(seq: number): void {
    this.unstored.delete(seq);
    if (this.unstored.size === 0 && this.waiters.length > 0) for (const w of this.waiters.splice(0)) w();
  }
}

export interface StoredFramePublisherOptions {
  /** A frame not acknowledged this long after it went out is published again. Default 2 s. */
  resendAfterMs?: number;
  /**
   * The same for its first publish: sooner, since a frame lost on its way (its bridge's or its
   * gateway's NATS server killed while the stream elects a leader) reaches its gateway only when
   * published again — its client waits that long. Default 500 ms (at most `resendAfterMs`).
   */
  firstResendAfterMs?: number;
  /** Called for each frame published again (metrics). */
  onResend?: () => void;
}

export interface StoredFramePublisher {
  /** Publishes `frame` on `subject`, tracked in `pending` until stored. Throws when the connection is closed. */
  publish(pending: PendingFrames, subject: string, frame: ResponseFrame): void;
  /** Publishes again the frames of `pending` not acknowledged within the resend delay (`all`: every one, e.g. after a reconnect). */
  resend(pending: PendingFrames, all?: boolean): number;
  /** Forgets `pending` (its attempt ended): late acknowledgements of it are ignored. */
  forget(pending: PendingFrames): void;
  close(): Promise<void>;
}

/** One inbox subscription for the bridge's acknowledgements; each publish's reply subject is the inbox plus a token. */
export function storedFramePublisher(nc: NatsConnection, opts: StoredFramePublisherOptions = {}): StoredFramePublisher {
  const resendAfterMs = opts.resendAfterMs ?? 2_000;
  const firstResendAfterMs = Math.min(opts.firstResendAfterMs ?? 500, resendAfterMs);
  const prefix = `${inboxOf(nc)}.`;
  const byToken = new Map<string, { pending: PendingFrames; seq: number }>();
  let counter = 0;
  const sub: Subscription = nc.subscribe(`${prefix}*`, {
    callback: (err, msg) => {
      if (err) return;
      const token = msg.subject.slice(prefix.length);
      const owner = byToken.get(token);
      if (!owner) return; // superseded by a resend, or its attempt ended
      byToken.delete(token);
      const entry = owner.pending.unstored.get(owner.seq);
      if (!entry || entry.token !== token) return;
      if (streamAckProblem(msg) === undefined) owner.pending.stored(owner.seq);
      else entry.sentAt = 0; // refused (no leader yet, no stream): again at the next sweep
    },
  });
  const send = (pending: PendingFrames, seq: number, entry: Entry) => {
    byToken.delete(entry.token);
    entry.token = (counter++).toString(36);
    entry.sentAt = Date.now();
    entry.sends += 1;
    byToken.set(entry.token, { pending, seq });
    nc.publish(entry.subject, entry.data, { reply: prefix + entry.token });
  };
  return {
    publish(pending, subject, frame) {
      const entry: Entry = { subject, data: encodeFrame(frame), sentAt: 0, sends: 0, token: '' };
      pending.unstored.set(frame.seq, entry);
      send(pending, frame.seq, entry);
    },
    resend(pending, all = false) {
      const now = Date.now();
      let n = 0;
      // In seq order: a subscriber that lost a run of frames gets them back in order.
      for (const seq of [...pending.unstored.keys()].sort((a, b) => a - b)) {
        const entry = pending.unstored.get(seq)!;
        if (!all && entry.sentAt > now - (entry.sends <= 1 ? firstResendAfterMs : resendAfterMs)) continue;
        send(pending, seq, entry);
        opts.onResend?.();
        n += 1;
      }
      return n;
    },
    forget(pending) {
      for (const entry of pending.unstored.values()) byToken.delete(entry.token);
    },
    async close() {
      byToken.clear();
      if (!sub.isClosed()) {
        sub.unsubscribe();
        await sub.closed;
      }
    },
  };
}

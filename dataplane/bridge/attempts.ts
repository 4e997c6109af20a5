/**
 * The attempts a bridge is running, and the NATS connection they follow: while it is away they
 * hold their frames, once it is back they prove they still own their requests and publish again
 * (attempt.ts); a sweep publishes again what the response stream has not acknowledged.
 */
import { Events, type JsMsg } from 'nats';
import type { InferenceRequest } from '../../shared/serving';
import type { RequestClaim } from '../claims';
import { Attempt, type AbortReason, type AttemptContext } from './attempt';

export class LiveAttempts {
  private readonly live = new Set<Attempt>();
  private connected = true;
  private readonly ctx: AttemptContext;
  private readonly sweeper: NodeJS.Timeout;

  /** Follows `ctx.nc`'s status until `isStopping()`. */
  constructor(ctx: Omit<AttemptContext, 'isConnected'>, isStopping: () => boolean) {
    this.ctx = { ...ctx, isConnected: () => this.connected };
    // Frames not acknowledged in time are published again; attempts still paused after a reconnect
    // (their claim check failed: the KV may be electing a leader) try again.
    this.sweeper = setInterval(() => {
      if (!this.connected) return;
      for (const a of this.live) a.sweep();
    }, 500);
    this.sweeper.unref();
    void this.follow(isStopping);
  }

  /** What every attempt shares (a replayed delivery writes its usage record with it). */
  get context(): AttemptContext {
    return this.ctx;
  }

  /** Whether NATS is connected (as the attempts see it). */
  get isConnected(): boolean {
    return this.connected;
  }

  get size(): number {
    return this.live.size;
  }

  /** Starts an attempt at `req` holding the claim's `revision` (0: none written). */
  open(req: InferenceRequest, msg: JsMsg, claim: RequestClaim, revision: number): Attempt {
    const a = new Attempt(this.ctx, req, msg, claim, revision);
    this.live.add(a);
    this.ctx.stats.inFlight = this.live.size;
    return a;
  }

  /** The attempt serving request `id` now, if one is ({@link Attempt.serving}). */
  serving(id: string): Attempt | undefined {
    for (const a of this.live) if (a.req.id === id && a.serving) return a;
    return undefined;
  }

  retire(a: Attempt): void {
    a.end();
    this.live.delete(a);
    this.ctx.stats.inFlight = this.live.size;
  }

  /** A gateway's cancel: stops the attempts serving request `id` unless they are already ending (`moved`: its answer goes on elsewhere). */
  cancel(id: string, moved = false): void {
    for (const a of this.live) if (a.req.id === id && !a.isConcluding) a.abort(moved ? 'moved' : 'cancelled');
  }

  abortAll(reason: AbortReason): void {
    for (const a of this.live) a.abort(reason);
  }

  /** Aborts those of them `which` picks. */
  abortWhere(reason: AbortReason, which: (a: Attempt) => boolean): void {
    for (const a of this.live) if (which(a)) a.abort(reason);
  }

  /** The connection was closed from under us: nothing can be answered or resolved any more (JetStream redelivers). */
  connectionClosed(): void {
    this.connected = false;
    this.abortAll('closed');
  }

  /** Stops the sweep. */
  close(): void {
    clearInterval(this.sweeper);
  }

  private async follow(isStopping: () => boolean): Promise<void> {
    for await (const s of this.ctx.nc.status()) {
      if (isStopping()) break;
      if (s.type === Events.Disconnect) {
        this.connected = false;
        for (const a of this.live) a.pause();
        this.ctx.log('NATS disconnected: holding frames');
      } else if (s.type === Events.Reconnect) {
        this.connected = true;
        this.ctx.log('NATS reconnected');
        for (const a of this.live) void a.resume();
      }
    }
  }
}

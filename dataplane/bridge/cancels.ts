/**
 * Cancels from gateways (their client went away, or they moved the answer elsewhere: `moved`;
 * README.md one folder up, "Cancels"): `{"id"}` on
 * core NATS `magus.cancel.<pool>.<instance>`. The bridge stops the attempt serving it, or drops
 * the request when it is pulled later: cancels are remembered for a while, at most a bounded
 * number.
 */
import type { NatsConnection, Subscription } from 'nats';
import { decodeJson } from '../json';
import { REQUEST_ID } from '../names';

const CANCEL_MEMORY_MS = 10 * 60_000;
const CANCEL_MEMORY_MAX = 10_000;

export class Cancels {
  /** Request id → when its cancel came. */
  private readonly cancelled = new Map<string, number>();
  private readonly sub: Subscription;

  /**
   * Subscribes to `subject`; `onCancel` stops what serves the request now. `moved`: the gateway
   * continues the answer elsewhere (it heard no beat of this bridge), so this one records nothing.
   */
  constructor(nc: NatsConnection, subject: string, onCancel: (id: string, moved: boolean) => void) {
    this.sub = nc.subscribe(subject, {
      callback: (err, msg) => {
        if (err) return;
        let cancel: { id?: unknown; moved?: unknown } | null;
        try {
          cancel = decodeJson(msg.data) as { id?: unknown; moved?: unknown } | null;
        } catch {
          return;
        }
        const id = cancel?.id;
        if (typeof id !== 'string' || !REQUEST_ID.test(id)) return;
        onCancel(id, cancel?.moved === true);
        this.remember(id);
      },
    });
  }

  /** Whether request `id` was cancelled (within the memory). */
  has(id: string): boolean {
    const at = this.cancelled.get(id);
    return at !== undefined && Date.now() - at < CANCEL_MEMORY_MS;
  }

  close(): void {
    this.sub.unsubscribe();
  }

  private remember(id: string): void {
    const now = Date.now();
    if (this.cancelled.size >= CANCEL_MEMORY_MAX) {
      for (const [k, at] of this.cancelled) if (now - at > CANCEL_MEMORY_MS || this.cancelled.size >= CANCEL_MEMORY_MAX) this.cancelled.delete(k);
    }
    this.cancelled.set(id, now);
  }
}

/**
 * The bridges' beats as a gateway hears them (`<prefix>.<pool>.<instance>`, every
 * `BEAT_EVERY_MS`, each with its load for serving/queue-waits.ts): whether a bridge went silent,
 * which moves its answers elsewhere (serving/exchange.ts, routes/inference.ts, routes/resume.ts).
 *
 * A bridge is silent once one heard before has not beaten for `BRIDGE_SILENT_MS` **while another
 * bridge was heard within that window**. When none was, the silence is more likely this side's:
 * this process's event loop stalled (its timers run before it reads the beats that queued
 * meanwhile), its link to NATS lagged, or the one process holding every bridge stalled — moving
 * every answer at once then cuts them all for nothing. A bridge alone in the gateway's hearing has
 * nowhere to move its answers to anyway. A bridge whose last beat said it stops (SIGTERM: its pod
 * deleted, its instance drained) is judged by `STOPPING_SILENT_MS` instead: it beats faster, and
 * may be killed any time. A bridge never heard (gone before this gateway started listening, or
 * before its reconnect; forgotten after 10 minutes unheard) is silent too once this gateway has
 * listened for `BRIDGE_SILENT_MS` and hears others: a turn sent to an instance whose bridge died
 * unheard would otherwise wait in a queue nobody serves until its deadline.
 */
import type { NatsConnection } from 'nats';
import { BRIDGE_SILENT_MS, STOPPING_SILENT_MS } from '../../shared/continuation';
import { bridgeLoadOf } from '../../shared/serving';
import type { QueueWaits } from './queue-waits';

export interface BridgeBeats {
  /** Whether the bridge of `key` (`<pool>.<instance>`) went silent (above). */
  silent(key: string): boolean;
  /** Whether the last beat of `key`'s bridge said it stops: it serves what it holds, and is going. */
  stopping(key: string): boolean;
  /** Every bridge unheard again (after a reconnect: this process, not they, was away). */
  forget(): void;
  close(): Promise<void>;
}

const FORGET_AFTER_MS = 10 * 60_000;

export function bridgeBeats(
  nc: Pick<NatsConnection, 'subscribe'>,
  prefix: string,
  waits: Pick<QueueWaits, 'beat' | 'sweep' | 'forget'>,
  now: () => number = Date.now,
): BridgeBeats {
  /** When each bridge was heard last, and whether it said it stops. */
  const heard = new Map<string, { at: number; stopping: boolean }>();
  let lastAny = -Infinity;
  /** Since when this process has been hearing beats (its start, or its last reconnect). */
  let listening = now();
  const sub = nc.subscribe(`${prefix}.>`, {
    callback: (err, msg) => {
      if (err) return;
      const key = msg.subject.slice(prefix.length + 1);
      const load = bridgeLoadOf(msg.data);
      lastAny = now();
      heard.set(key, { at: lastAny, stopping: load?.stopping === true });
      waits.beat(key, load);
    },
  });
  const sweep = setInterval(() => {
    const old = now() - FORGET_AFTER_MS;
    for (const [k, { at }] of heard) if (at < old) heard.delete(k);
    waits.sweep();
  }, 60_000);
  sweep.unref();
  return {
    silent: (key) => {
      const h = heard.get(key);
      const t = now();
      const window = h?.stopping ? STOPPING_SILENT_MS : BRIDGE_SILENT_MS;
      return t - (h?.at ?? listening) > window && t - lastAny <= window;
    },
    stopping: (key) => heard.get(key)?.stopping === true,
    forget: () => {
      heard.clear();
      lastAny = -Infinity;
      listening = now();
      waits.forget();
    },
    close: () => {
      clearInterval(sweep);
      sub.unsubscribe();
      return Promise.resolve();
    },
  };
}

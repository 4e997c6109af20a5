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
 *
 * Not hearing a beat is not enough: a process that stalls, or reads a backlog of frames (a hundred
 * streams resumed at once after another gateway died), reads its socket a chunk at a time, and its
 * timers run between chunks — the beats of one bridge read, another's still unread behind them. So
 * a bridge found quiet is silent only once a round trip to the NATS server that began after it
 * was due (`flush`: the server answers after everything it sent before) has come back and its
 * beat was not among what came before the answer; until then (a millisecond when idle) it is not.
 *
 * Each start of an instance's bridge is judged apart (its beats' `boot`): a pod made again under
 * the same instance (a StatefulSet's, at once after a forced delete) beats while the one before is
 * still being killed, and must not vouch for it. The instance is silent for a request sent there
 * at `since` when a start heard at or after then (one that may hold it) went silent, or its
 * newest did; for the rest (the picker, a load) only the newest start counts.
 */
import type { NatsConnection } from 'nats';
import { BRIDGE_SILENT_MS, STOPPING_SILENT_MS } from '../../shared/continuation';
import { bridgeLoadOf } from '../../shared/serving';
import type { QueueWaits } from './queue-waits';

export interface BridgeBeats {
  /**
   * Whether the bridge of `key` (`<pool>.<instance>`) went silent (above): its newest start, or
   * with `since` (when a request was sent there) any start heard since then. A quiet one is not
   * silent until a round trip to the server has shown no beat of it was waiting to be read: the
   * first judgement asks for one and says no, a later one (after it came back) says yes.
   */
  silent(key: string, since?: number): boolean;
  /** Whether the last beat of `key`'s newest bridge said it stops: it serves what it holds, and is going. */
  stopping(key: string): boolean;
  /** Every bridge unheard again (after a reconnect: this process, not they, was away). */
  forget(): void;
  close(): Promise<void>;
}

const FORGET_AFTER_MS = 10 * 60_000;

/** What was heard of one start of a bridge: its last beat, whether it said it stops, its first beat. */
interface Heard {
  at: number;
  stopping: boolean;
  first: number;
}

const windowOf = (h: Heard): number => (h.stopping ? STOPPING_SILENT_MS : BRIDGE_SILENT_MS);

/** The start of a bridge heard first most recently. */
function newestOf(starts: Map<string, Heard>): Heard | undefined {
  let newest: Heard | undefined;
  for (const h of starts.values()) if (!newest || h.first > newest.first) newest = h;
  return newest;
}

export function bridgeBeats(
  nc: Pick<NatsConnection, 'subscribe' | 'flush'>,
  prefix: string,
  waits: Pick<QueueWaits, 'beat' | 'sweep' | 'forget'>,
  now: () => number = Date.now,
): BridgeBeats {
  /** Each instance's bridge starts (by their `boot`; '' for a bridge from before it) as last heard. */
  const heard = new Map<string, Map<string, Heard>>();
  let lastAny = -Infinity;
  /** Since when this process has been hearing beats (its start, or its last reconnect). */
  let listening = now();
  /** When the newest round trip to the server that came back began: every beat sent before then was read. */
  let readUpTo = -Infinity;
  let asking = false;
  /** Whether every beat the server sent since `due` was read; if not known yet, a round trip (one at a time) is asked to learn it. */
  const readSince = (due: number): boolean => {
    if (readUpTo >= due) return true;
    if (!asking) {
      asking = true;
      const began = now();
      nc.flush().then(
        () => {
          asking = false;
          readUpTo = began;
        },
        () => (asking = false), // disconnected: the next judgement asks again
      );
    }
    return false;
  };
  const sub = nc.subscribe(`${prefix}.>`, {
    callback: (err, msg) => {
      if (err) return;
      const key = msg.subject.slice(prefix.length + 1);
      const load = bridgeLoadOf(msg.data);
      lastAny = now();
      let starts = heard.get(key);
      if (!starts) heard.set(key, (starts = new Map<string, Heard>()));
      const boot = load?.boot ?? '';
      const h = { at: lastAny, stopping: load?.stopping === true, first: starts.get(boot)?.first ?? lastAny };
      starts.set(boot, h);
      // The load of the start that serves new turns: not the one before, still finishing.
      if (newestOf(starts) === h) waits.beat(key, load);
    },
  });
  const sweep = setInterval(() => {
    const old = now() - FORGET_AFTER_MS;
    for (const [k, starts] of heard) {
      for (const [boot, { at }] of starts) if (at < old) starts.delete(boot);
      if (starts.size === 0) heard.delete(k);
    }
    waits.sweep();
  }, 60_000);
  sweep.unref();
  return {
    silent: (key, since) => {
      const t = now();
      const quiet = (at: number, window: number) => t - at > window && t - lastAny <= window && readSince(at + window);
      const starts = heard.get(key);
      const newest = starts && newestOf(starts);
      if (!starts || !newest) return quiet(listening, BRIDGE_SILENT_MS);
      for (const h of starts.values()) {
        // One silent before the request was sent cannot hold it.
        const mayHold = h === newest || (since !== undefined && h.at >= since - windowOf(h));
        if (mayHold && quiet(h.at, windowOf(h))) return true;
      }
      return false;
    },
    stopping: (key) => {
      const starts = heard.get(key);
      return (starts && newestOf(starts)?.stopping) === true;
    },
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

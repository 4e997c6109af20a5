/**
 * Publishes to JetStream as a core publish whose acknowledgement comes back on one shared inbox
 * subscription (under the connection's inbox prefix, as a role's must be: roles.ts), settled from
 * a `Map` by the reply subject's token — no request, timer or `NatsError` per publish, as
 * `js.publish` and `kv.update` make. The gateway's request publisher (gateway/serving/exchange.ts
 * `streamPublisher`) and the limits store's compare-and-swap (limits.ts `kvCasWriter`) are built on
 * it; each reads the acknowledgement its own way.
 *
 * A publish unacknowledged after `timeoutMs` fails (checked every `min(timeoutMs, 1 s)`); so do
 * those under way when the connection drops (their acknowledgements would go to the old
 * connection, and nats.js discards what it buffered when it dials again), and one while it is down
 * or after `close` fails at once.
 */
import { Events, type Msg, type MsgHdrs, type NatsConnection } from 'nats';
import { inboxOf } from './roles';

export interface AckedPublisher {
  /** Publishes `data` to `subject`; resolves with the acknowledgement (its data and headers are the caller's to read). */
  publish(subject: string, data: string | Uint8Array, headers: MsgHdrs): Promise<Msg>;
  /** Fails what is waiting and stops listening. */
  close(): Promise<void>;
}

/** The failures' messages, in the caller's words. */
export interface AckedPublisherMessages {
  /** A publish while the connection is down. */
  unreachable: string;
  /** Publishes under way when it drops. */
  disconnected: string;
  /** A publish unacknowledged within the timeout. */
  timedOut: string;
  /** A publish under way at, or made after, `close`. */
  closed: string;
}

export function ackedPublisher(nc: NatsConnection, timeoutMs: number, messages: AckedPublisherMessages): AckedPublisher {
  const prefix = `${inboxOf(nc)}.`;
  interface Waiting {
    resolve: (msg: Msg) => void;
    reject: (err: Error) => void;
    at: number;
  }
  // Insertion order is publish order: the oldest at the front.
  const waiting = new Map<string, Waiting>();
  const failAll = (why: string) => {
    for (const w of waiting.values()) w.reject(new Error(why));
    waiting.clear();
  };
  let counter = 0;
  let connected = true;
  let closed = false;
  void (async () => {
    for await (const s of nc.status()) {
      if (closed) break;
      if (s.type === Events.Disconnect) {
        connected = false;
        failAll(messages.disconnected);
      } else if (s.type === Events.Reconnect) connected = true;
    }
  })().catch(() => undefined);
  const sub = nc.subscribe(`${prefix}*`, {
    callback: (err, msg) => {
      if (err) return;
      const token = msg.subject.slice(prefix.length);
      const w = waiting.get(token);
      if (!w) return; // timed out already
      waiting.delete(token);
      w.resolve(msg);
    },
  });
  const sweep = setInterval(
    () => {
      const cutoff = Date.now() - timeoutMs;
      for (const [token, w] of waiting) {
        if (w.at > cutoff) break;
        waiting.delete(token);
        w.reject(new Error(messages.timedOut));
      }
    },
    Math.min(1_000, timeoutMs),
  );
  sweep.unref();
  return {
    publish(subject, data, headers) {
      if (closed) return Promise.reject(new Error(messages.closed));
      if (!connected) return Promise.reject(new Error(messages.unreachable));
      const token = (counter++).toString(36);
      return new Promise<Msg>((resolve, reject) => {
        waiting.set(token, { resolve, reject, at: Date.now() });
        try {
          nc.publish(subject, data, { reply: prefix + token, headers });
        } catch (err) {
          waiting.delete(token);
          reject(err instanceof Error ? err : new Error(String(err)));
        }
      });
    },
    async close() {
      closed = true;
      clearInterval(sweep);
      failAll(messages.closed);
      if (!sub.isClosed()) {
        sub.unsubscribe();
        await sub.closed;
      }
    },
  };
}

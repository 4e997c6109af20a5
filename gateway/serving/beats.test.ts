import type { Msg, NatsConnection, NatsError, SubscriptionOptions } from 'nats';
import { BRIDGE_SILENT_MS, STOPPING_SILENT_MS } from '../../shared/continuation';
import { encodeJson } from '../../dataplane/json';
import { bridgeBeats } from './beats';
import { QueueWaits } from './queue-waits';

/** A connection that delivers what the test publishes to the one subscription bridgeBeats makes. */
function fakeConnection() {
  let deliver: ((err: NatsError | null, msg: Msg) => void) | undefined;
  const nc = {
    subscribe: (_subject: string, opts?: SubscriptionOptions) => {
      deliver = opts?.callback;
      return { unsubscribe: () => (deliver = undefined) };
    },
  } as unknown as Pick<NatsConnection, 'subscribe'>;
  const beat = (key: string, stopping = false, boot?: string, running = 0) =>
    deliver?.(null, {
      subject: `beats.${key}`,
      data: encodeJson({ running, slots: 4, queued: 0, serviceMs: null, ...(stopping ? { stopping: true } : {}), ...(boot ? { boot } : {}) }),
    } as Msg);
  return { nc, beat };
}

describe('bridgeBeats', () => {
  let t = 0;
  const now = () => t;
  beforeEach(() => (t = 1_000_000));

  it('a bridge past BRIDGE_SILENT_MS without a beat is silent while another bridge beats', async () => {
    const { nc, beat } = fakeConnection();
    const waits = new QueueWaits(0, now);
    const beats = bridgeBeats(nc, 'beats', waits, now);
    beat('p.i1');
    beat('p.i2');
    t += BRIDGE_SILENT_MS;
    beat('p.i2');
    expect(beats.silent('p.i1')).toBe(false); // just at the limit
    t += 1;
    expect(beats.silent('p.i1')).toBe(true);
    expect(beats.silent('p.i2')).toBe(false);
    expect(waits.occupancy('p', 'i2')).toBe(0); // the loads go on to the queue waits
    beats.forget();
    expect(beats.silent('p.i1')).toBe(false);
    await beats.close();
  });

  it('a bridge never heard is silent once this gateway has listened for BRIDGE_SILENT_MS while hearing others, counted again from a reconnect', async () => {
    const { nc, beat } = fakeConnection();
    const beats = bridgeBeats(nc, 'beats', new QueueWaits(0, now), now);
    beat('p.i2');
    expect(beats.silent('p.i1')).toBe(false); // just started: its first beat may be on its way
    t += BRIDGE_SILENT_MS;
    beat('p.i2');
    expect(beats.silent('p.i1')).toBe(false); // just at the limit
    t += 1;
    expect(beats.silent('p.i1')).toBe(true); // e.g. its instance died before this gateway started
    expect(beats.silent('p.i2')).toBe(false);
    // A reconnect forgets every bridge: each is given the window again.
    beats.forget();
    beat('p.i2');
    expect(beats.silent('p.i1')).toBe(false);
    t += BRIDGE_SILENT_MS + 1;
    beat('p.i2');
    expect(beats.silent('p.i1')).toBe(true);
    // Hearing no bridge at all says nothing of this one.
    t += 2 * BRIDGE_SILENT_MS;
    expect(beats.silent('p.i1')).toBe(false);
    await beats.close();
  });

  it('no bridge heard within the window (this process stalled, or the one holding every bridge): none is silent, and each is again once the others beat', async () => {
    const { nc, beat } = fakeConnection();
    const beats = bridgeBeats(nc, 'beats', new QueueWaits(0, now), now);
    beat('p.i1');
    beat('p.i2');
    t += 3 * BRIDGE_SILENT_MS; // e.g. the event loop blocked for 3 s: the judging timer runs before the queued beats are read
    expect(beats.silent('p.i1')).toBe(false);
    expect(beats.silent('p.i2')).toBe(false);
    beat('p.i2'); // the beats that queued meanwhile are read: i1 is still not among them
    expect(beats.silent('p.i1')).toBe(true);
    await beats.close();
  });

  it('a bridge whose last beat said it stops is silent after STOPPING_SILENT_MS, and again judged by BRIDGE_SILENT_MS once it beats as before', async () => {
    const { nc, beat } = fakeConnection();
    const beats = bridgeBeats(nc, 'beats', new QueueWaits(0, now), now);
    beat('p.i1', true);
    beat('p.i2');
    expect(beats.stopping('p.i1')).toBe(true);
    expect(beats.stopping('p.i2')).toBe(false);
    t += STOPPING_SILENT_MS;
    beat('p.i2');
    expect(beats.silent('p.i1')).toBe(false); // just at the limit
    t += 1;
    expect(beats.silent('p.i1')).toBe(true);
    // A stall of this process longer than that window, with no beat read since: nobody is silent.
    t += STOPPING_SILENT_MS;
    expect(beats.silent('p.i1')).toBe(false);
    beat('p.i2');
    expect(beats.silent('p.i1')).toBe(true);
    // Its stop called off (a beat without it): the longer window again.
    beat('p.i1');
    t += STOPPING_SILENT_MS + 1;
    beat('p.i2');
    expect(beats.stopping('p.i1')).toBe(false);
    expect(beats.silent('p.i1')).toBe(false);
    t += BRIDGE_SILENT_MS - STOPPING_SILENT_MS;
    beat('p.i2');
    expect(beats.silent('p.i1')).toBe(true);
    await beats.close();
  });

  it("a bridge's next start (its pod made again) does not vouch for the one before: a request sent before is moved once that one is silent", async () => {
    const { nc, beat } = fakeConnection();
    const waits = new QueueWaits(0, now);
    const beats = bridgeBeats(nc, 'beats', waits, now);
    beat('p.i1', false, 'old', 3);
    beat('p.i2');
    const sent = t;
    // Its pod force-deleted: the old start says it stops; the StatefulSet's new pod beats at once.
    t += 100;
    beat('p.i1', true, 'old', 3);
    beat('p.i1', false, 'new', 0);
    expect(beats.stopping('p.i1')).toBe(false); // the newest start's
    expect(waits.occupancy('p', 'i1')).toBe(0); // the newest start's load: not the old's 3 of 4
    beat('p.i1', true, 'old', 3); // an older start's beat does not set the load
    expect(waits.occupancy('p', 'i1')).toBe(0);
    t += STOPPING_SILENT_MS + 1; // the old one killed, the new one beats on
    beat('p.i1', false, 'new');
    beat('p.i2');
    expect(beats.silent('p.i1', sent)).toBe(true); // the request sent before the new start: the old one may hold it
    expect(beats.silent('p.i1')).toBe(false); // the instance serves (the picker's question)
    expect(beats.silent('p.i1', t)).toBe(false); // a request sent now goes to the new one
    // One silent before a request was sent cannot hold it.
    expect(beats.silent('p.i1', t + STOPPING_SILENT_MS + 1)).toBe(false);
    // A bridge from before starts' ids ('') is one start.
    beat('p.i3');
    t += BRIDGE_SILENT_MS + 1;
    beat('p.i1', false, 'new');
    expect(beats.silent('p.i3', sent)).toBe(true);
    await beats.close();
  });
});

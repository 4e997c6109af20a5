import type { Msg, NatsConnection, NatsError, SubscriptionOptions } from 'nats';
import { BRIDGE_SILENT_MS, STOPPING_SILENT_MS } from '../../shared/continuation';
import { encodeJson } from '../../dataplane/json';
import { bridgeBeats, type BridgeBeats } from './beats';
import { QueueWaits } from './queue-waits';

/**
 * A connection that delivers what the test publishes to the one subscription bridgeBeats makes.
 * Its round trips (`flush`) come back at once, or, with `held`, when the test says (`answer`).
 */
function fakeConnection(held = false) {
  let deliver: ((err: NatsError | null, msg: Msg) => void) | undefined;
  const pongs: (() => void)[] = [];
  let flushes = 0;
  const nc = {
    subscribe: (_subject: string, opts?: SubscriptionOptions) => {
      deliver = opts?.callback;
      return { unsubscribe: () => (deliver = undefined) };
    },
    flush: () => {
      flushes += 1;
      return held ? new Promise<void>((resolve) => pongs.push(resolve)) : Promise.resolve();
    },
  } as unknown as Pick<NatsConnection, 'subscribe' | 'flush'>;
  const beat = (key: string, stopping = false, boot?: string, running = 0) =>
    deliver?.(null, {
      subject: `beats.${key}`,
      data: encodeJson({ running, slots: 4, queued: 0, serviceMs: null, ...(stopping ? { stopping: true } : {}), ...(boot ? { boot } : {}) }),
    } as Msg);
  /** The server's answer to every round trip asked so far: what was delivered before it was read. */
  const answer = async () => {
    for (const pong of pongs.splice(0)) pong();
    await settled();
  };
  return { nc, beat, answer, flushes: () => flushes };
}

const settled = () => new Promise<void>((resolve) => setImmediate(resolve));

/** What `beats` says of `key` once the round trip its first judgement asks for (if any) came back. */
async function judged(beats: BridgeBeats, key: string, since?: number): Promise<boolean> {
  beats.silent(key, since);
  await settled();
  return beats.silent(key, since);
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
    expect(await judged(beats, 'p.i1')).toBe(false); // just at the limit
    t += 1;
    expect(await judged(beats, 'p.i1')).toBe(true);
    expect(await judged(beats, 'p.i2')).toBe(false);
    expect(waits.occupancy('p', 'i2')).toBe(0); // the loads go on to the queue waits
    beats.forget();
    expect(await judged(beats, 'p.i1')).toBe(false);
    await beats.close();
  });

  it('a bridge never heard is silent once this gateway has listened for BRIDGE_SILENT_MS while hearing others, counted again from a reconnect', async () => {
    const { nc, beat } = fakeConnection();
    const beats = bridgeBeats(nc, 'beats', new QueueWaits(0, now), now);
    beat('p.i2');
    expect(await judged(beats, 'p.i1')).toBe(false); // just started: its first beat may be on its way
    t += BRIDGE_SILENT_MS;
    beat('p.i2');
    expect(await judged(beats, 'p.i1')).toBe(false); // just at the limit
    t += 1;
    expect(await judged(beats, 'p.i1')).toBe(true); // e.g. its instance died before this gateway started
    expect(await judged(beats, 'p.i2')).toBe(false);
    // A reconnect forgets every bridge: each is given the window again.
    beats.forget();
    beat('p.i2');
    expect(await judged(beats, 'p.i1')).toBe(false);
    t += BRIDGE_SILENT_MS + 1;
    beat('p.i2');
    expect(await judged(beats, 'p.i1')).toBe(true);
    // Hearing no bridge at all says nothing of this one.
    t += 2 * BRIDGE_SILENT_MS;
    expect(await judged(beats, 'p.i1')).toBe(false);
    await beats.close();
  });

  it('no bridge heard within the window (this process stalled, or the one holding every bridge): none is silent, and each is again once the others beat', async () => {
    const { nc, beat } = fakeConnection();
    const beats = bridgeBeats(nc, 'beats', new QueueWaits(0, now), now);
    beat('p.i1');
    beat('p.i2');
    t += 3 * BRIDGE_SILENT_MS; // e.g. the event loop blocked for 3 s: the judging timer runs before the queued beats are read
    expect(await judged(beats, 'p.i1')).toBe(false);
    expect(await judged(beats, 'p.i2')).toBe(false);
    beat('p.i2'); // the beats that queued meanwhile are read: i1 is still not among them
    expect(await judged(beats, 'p.i1')).toBe(true);
    await beats.close();
  });

  it('a quiet bridge is silent only once a round trip to the server begun after it was due came back without its beat', async () => {
    const { nc, beat, answer, flushes } = fakeConnection(true);
    const beats = bridgeBeats(nc, 'beats', new QueueWaits(0, now), now);
    beat('p.i1');
    beat('p.i2');
    // This process stalled, then reads its backlog a chunk at a time: i2's beat first, i1's behind it.
    t += BRIDGE_SILENT_MS + 500;
    beat('p.i2');
    expect(beats.silent('p.i1')).toBe(false); // a round trip asked
    expect(beats.silent('p.i1')).toBe(false); // and not another while it is out
    expect(flushes()).toBe(1);
    beat('p.i1'); // the rest of the backlog, read before the server's answer
    await answer();
    expect(beats.silent('p.i1')).toBe(false);
    // Now it stops beating: the round trip that came back began before it was due, so it proves nothing.
    t += BRIDGE_SILENT_MS + 1;
    beat('p.i2');
    expect(beats.silent('p.i1')).toBe(false);
    expect(flushes()).toBe(2);
    await answer();
    expect(beats.silent('p.i1')).toBe(true);
    expect(beats.silent('p.i2')).toBe(false);
    expect(flushes()).toBe(2);
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
    expect(await judged(beats, 'p.i1')).toBe(false); // just at the limit
    t += 1;
    expect(await judged(beats, 'p.i1')).toBe(true);
    // A stall of this process longer than that window, with no beat read since: nobody is silent.
    t += STOPPING_SILENT_MS;
    expect(await judged(beats, 'p.i1')).toBe(false);
    beat('p.i2');
    expect(await judged(beats, 'p.i1')).toBe(true);
    // Its stop called off (a beat without it): the longer window again.
    beat('p.i1');
    t += STOPPING_SILENT_MS + 1;
    beat('p.i2');
    expect(beats.stopping('p.i1')).toBe(false);
    expect(await judged(beats, 'p.i1')).toBe(false);
    t += BRIDGE_SILENT_MS - STOPPING_SILENT_MS;
    beat('p.i2');
    expect(await judged(beats, 'p.i1')).toBe(true);
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
    expect(await judged(beats, 'p.i1', sent)).toBe(true); // the request sent before the new start: the old one may hold it
    expect(await judged(beats, 'p.i1')).toBe(false); // the instance serves (the picker's question)
    expect(await judged(beats, 'p.i1', t)).toBe(false); // a request sent now goes to the new one
    // One silent before a request was sent cannot hold it.
    expect(await judged(beats, 'p.i1', t + STOPPING_SILENT_MS + 1)).toBe(false);
    // A bridge from before starts' ids ('') is one start.
    beat('p.i3');
    t += BRIDGE_SILENT_MS + 1;
    beat('p.i1', false, 'new');
    expect(await judged(beats, 'p.i3', sent)).toBe(true);
    await beats.close();
  });
});

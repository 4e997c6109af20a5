/**
 * The bridge's stored-frame publisher against the real nats-server: a frame counts as stored
 * only once the stream that captures it acknowledged it, and one the stream could not store (no
 * stream yet: what a publisher sees while a cluster elects the stream's leader) is published
 * again until it is — then it is stored, and subscribers got every frame at least once.
 */
import { randomBytes } from 'node:crypto';
import { RetentionPolicy, StorageType, type NatsConnection } from 'nats';
import { natsConnect } from '../../test/harness';
import { decodeFrame } from '../frames';
import type { ResponseFrame } from '../../shared/serving';
import { PendingFrames, storedFramePublisher, type StoredFramePublisher } from './stored-frames';
import { sleep } from '../../test/harness/wait';

describe('storedFramePublisher', () => {
  let nc: NatsConnection;
  let publisher: StoredFramePublisher;
  let resent = 0;
  const created: string[] = [];
  const chunk = (seq: number): ResponseFrame => ({ seq, type: 'chunk', data: { n: seq } });

  beforeAll(async () => {
    nc = await natsConnect();
    publisher = storedFramePublisher(nc, { resendAfterMs: 200, onResend: () => (resent += 1) });
  });
  afterAll(async () => {
    await publisher.close();
    const jsm = await nc.jetstreamManager();
    for (const s of created) await jsm.streams.delete(s).catch(() => undefined);
    await nc.close();
  });

  const stream = async (subjects: string) => {
    const name = `SF_${randomBytes(4).toString('hex').toUpperCase()}`;
    await (await nc.jetstreamManager()).streams.add({ name, subjects: [subjects], storage: StorageType.Memory, retention: RetentionPolicy.Limits });
    created.push(name);
    return name;
  };
  const storedSeqs = async (name: string, subject: string) => {
    const jsm = await nc.jetstreamManager();
    const info = await jsm.streams.info(name);
    const seqs: number[] = [];
    for (let s = info.state.first_seq; s <= info.state.last_seq && info.state.messages > 0; s++) {
      const m = await jsm.streams.getMessage(name, { seq: s }).catch(() => undefined);
      if (m?.subject === subject) seqs.push(decodeFrame(m.data)!.seq);
    }
    return seqs;
  };

  it('a frame counts as stored once the stream acknowledges it; subscribers get it at once', async () => {
    const scope = `sf${randomBytes(3).toString('hex')}`;
    const name = await stream(`${scope}.res.>`);
    const subject = `${scope}.res.r1`;
    const seen: number[] = [];
    const sub = nc.subscribe(subject, { callback: (_e, m) => seen.push(decodeFrame(m.data)!.seq) });
    const pending = new PendingFrames();
    for (let seq = 0; seq < 5; seq++) publisher.publish(pending, subject, chunk(seq));
    expect(pending.size).toBe(5);
    expect(await pending.allStored(5_000)).toBe(true);
    expect(pending.size).toBe(0);
    expect(await storedSeqs(name, subject)).toEqual([0, 1, 2, 3, 4]);
    await nc.flush();
    expect(seen).toEqual([0, 1, 2, 3, 4]);
    expect(publisher.resend(pending, true)).toBe(0); // nothing left to send again
    sub.unsubscribe();
  });

  it('a frame no stream could store is sent again until one does: then stored, and never lost to a subscriber', async () => {
    const scope = `sf${randomBytes(3).toString('hex')}`;
    const subject = `${scope}.res.r2`;
    const seen: number[] = [];
    const sub = nc.subscribe(subject, { callback: (_e, m) => seen.push(decodeFrame(m.data)!.seq) });
    const pending = new PendingFrames();
    for (let seq = 0; seq < 3; seq++) publisher.publish(pending, subject, chunk(seq));
    // Nothing stores the subject yet, so no acknowledgement comes: not stored, not dropped.
    expect(await pending.allStored(300)).toBe(false);
    expect(pending.size).toBe(3);
    const before = resent;
    expect(publisher.resend(pending)).toBe(3); // due again: unacknowledged for longer than resendAfterMs
    expect(resent - before).toBe(3);
    expect(await pending.allStored(300)).toBe(false);

    // The stream is there now (a leader was elected): the next sweep stores every frame.
    const name = await stream(`${scope}.res.>`);
    const waiting = pending.allStored(5_000);
    await sleep(250);
    publisher.resend(pending);
    expect(await waiting).toBe(true);
    expect((await storedSeqs(name, subject)).sort()).toEqual([0, 1, 2]);
    await nc.flush();
    expect(new Set(seen)).toEqual(new Set([0, 1, 2])); // copies carry the same seqs: the sequencer drops them
    sub.unsubscribe();
  });

  it('an acknowledgement that never comes leaves the frame due after resendAfterMs, not before', async () => {
    const scope = `sf${randomBytes(3).toString('hex')}`;
    const subject = `${scope}.res.r3`;
    const pending = new PendingFrames();
    // A subscriber that swallows requests without answering: no acknowledgement, no "no responders".
    const silent = nc.subscribe(subject, { callback: () => undefined });
    await nc.flush();
    publisher.publish(pending, subject, chunk(0));
    await sleep(50);
    expect(publisher.resend(pending)).toBe(0);
    await sleep(200);
    expect(publisher.resend(pending)).toBe(1);
    publisher.forget(pending);
    silent.unsubscribe();
  });

  it('a frame not acknowledged is published again sooner the first time (its subscriber may have lost it), then every resendAfterMs', async () => {
    const subject = `sf${randomBytes(3).toString('hex')}.res.r4`;
    const quick = storedFramePublisher(nc, { resendAfterMs: 1_000, firstResendAfterMs: 100 });
    const pending = new PendingFrames();
    const silent = nc.subscribe(subject, { callback: () => undefined }); // no acknowledgement ever
    await nc.flush();
    try {
      quick.publish(pending, subject, chunk(0));
      await sleep(150);
      expect(quick.resend(pending)).toBe(1); // after 100 ms
      await sleep(150);
      expect(quick.resend(pending)).toBe(0); // then not before 1 s
      await sleep(900);
      expect(quick.resend(pending)).toBe(1);
    } finally {
      quick.forget(pending);
      await quick.close();
      silent.unsubscribe();
    }
  });
});

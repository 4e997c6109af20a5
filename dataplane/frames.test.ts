/** The frame codec and the ordering rule (frames.ts), as the gateway relays and a take-over reads back; gap timers with fake timers. */
import type { ResponseFrame } from '../shared/serving';
import { decodeFrame, encodeFrame, FrameParts, FrameSequencer, splitFrame } from './frames';

const c = (seq: number, text = `t${seq}`): ResponseFrame => ({ seq, type: 'chunk', data: { choices: [{ index: 0, delta: { content: text } }] } });
const done = (seq: number): ResponseFrame => ({ seq, type: 'done', data: 'end' });
const err = (seq: number): ResponseFrame => ({ seq, type: 'error', error: { status: 500, message: 'x', type: 'server_error', code: null } });
const seqs = (frames: ResponseFrame[]) => frames.map((f) => (f.type === 'chunk' ? f.seq : `${f.type}@${f.seq}`));

/** Pushes `frames` in arrival order; returns what was relayed, in order. */
const relay = (s: FrameSequencer, frames: ResponseFrame[]) => seqs(frames.flatMap((f) => s.push(f)));

describe('FrameSequencer', () => {
  it('relays in order, each seq once, holding early frames until the gap fills', () => {
    const s = new FrameSequencer();
    expect(s.push(c(0))).toEqual([c(0)]);
    expect(s.push(c(0, 'again'))).toEqual([]);
    expect(s.push(c(2))).toEqual([]);
    expect(s.hasGap).toBe(true);
    expect(s.waiting()).toEqual([c(2)]);
    expect(s.push(c(1))).toEqual([c(1), c(2)]);
    expect(s.hasGap).toBe(false);
    expect(s.push(done(3))).toEqual([done(3)]);
    expect(s.finished).toBe(true);
    expect(s.push(c(4))).toEqual([]);
    expect(s.expected).toBe(4);
  });

  it('drops duplicates, including a restarted stream from seq 0', () => {
    const s = new FrameSequencer();
    expect(relay(s, [c(0), c(1), c(1), c(0), c(2), c(0), c(1), c(2), c(3), c(2), c(3)])).toEqual([0, 1, 2, 3]);
    expect(s.expected).toBe(4);
  });

  it('drops a duplicate of a held frame: the first arrival wins', () => {
    const s = new FrameSequencer();
    expect(s.push(c(1, 'first'))).toEqual([]);
    expect(s.push(c(1, 'second'))).toEqual([]);
    expect(s.push(c(0))).toEqual([c(0), c(1, 'first')]);
  });

  it('lets a restarted attempt fill a gap and ignores what it repeats', () => {
    const s = new FrameSequencer();
    expect(relay(s, [c(0), c(1), c(3), /* attempt 2: */ c(0), c(1), c(2), c(3), done(4)])).toEqual([0, 1, 2, 3, 'done@4']);
  });

  it('relays a terminal held behind a gap once the gap fills, not before, and nothing after it', () => {
    const s = new FrameSequencer();
    expect(relay(s, [c(0), err(2), c(3)])).toEqual([0]);
    expect(s.finished).toBe(false);
    expect(relay(s, [c(1)])).toEqual([1, 'error@2']);
    expect(s.finished).toBe(true);
    expect(relay(s, [c(3), done(3), err(2)])).toEqual([]); // a re-published terminal, late frames
  });

  it('ends at done even with frames held beyond it', () => {
    const s = new FrameSequencer();
    expect(relay(s, [c(2), done(1), c(0)])).toEqual([0, 'done@1']);
    expect(s.hasGap).toBe(false);
  });

  it('gives a gap up when more frames wait behind it than it may hold', () => {
    const gaps: number[] = [];
    const s = new FrameSequencer({ maxHeld: 2, onGap: (m) => gaps.push(m) });
    expect(relay(s, [c(0), c(2), c(3), c(4)])).toEqual([0]);
    expect(gaps).toEqual([1]);
    expect(s.hasGap).toBe(true);
    expect(relay(s, [c(1)])).toEqual([]); // too late: stopped
  });

  describe('with a gap timeout (the gateway)', () => {
    beforeEach(() => jest.useFakeTimers());
    afterEach(() => jest.useRealTimers());

    it('reports the missing seq when a gap is not filled in time', () => {
      const gaps: number[] = [];
      const s = new FrameSequencer({ gapTimeoutMs: 100, onGap: (m) => gaps.push(m) });
      expect(relay(s, [c(0), c(2), c(3)])).toEqual([0]);
      jest.advanceTimersByTime(99);
      expect(gaps).toEqual([]);
      jest.advanceTimersByTime(1);
      expect(gaps).toEqual([1]);
      expect(relay(s, [c(1)])).toEqual([]); // too late: stopped
    });

    it('gives a second gap its own full wait', () => {
      const gaps: number[] = [];
      const s = new FrameSequencer({ gapTimeoutMs: 100, onGap: (m) => gaps.push(m) });
      expect(relay(s, [c(1), c(3)])).toEqual([]);
      jest.advanceTimersByTime(80);
      expect(relay(s, [c(0)])).toEqual([0, 1]); // 2 still missing
      jest.advanceTimersByTime(80);
      expect(gaps).toEqual([]);
      expect(relay(s, [c(2)])).toEqual([2, 3]);
      jest.advanceTimersByTime(500);
      expect(gaps).toEqual([]);
    });

    it('starts no timer without a gap, and none runs after the end', () => {
      const gaps: number[] = [];
      const s = new FrameSequencer({ gapTimeoutMs: 100, onGap: (m) => gaps.push(m) });
      expect(relay(s, [c(2), c(0), c(3), c(1), done(4)])).toEqual([0, 1, 2, 3, 'done@4']);
      expect(relay(s, [c(0), err(1), c(3)])).toEqual([]);
      jest.advanceTimersByTime(1000);
      expect(gaps).toEqual([]);
      expect(jest.getTimerCount()).toBe(0);
    });

    it('stop() relays nothing more and fires no gap', () => {
      const gaps: number[] = [];
      const s = new FrameSequencer({ gapTimeoutMs: 100, onGap: (m) => gaps.push(m) });
      relay(s, [c(0), c(2)]);
      s.stop();
      jest.advanceTimersByTime(1000);
      expect(gaps).toEqual([]);
      expect(relay(s, [c(1)])).toEqual([]);
    });
  });
});

describe('frame codec', () => {
  const enc = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));

  it('round-trips the three frame types', () => {
    for (const f of [c(0), done(3), { seq: 1, type: 'done' } as ResponseFrame, err(2)]) expect(decodeFrame(encodeFrame(f))).toEqual(f);
    expect(decodeFrame(enc({ seq: 1, type: 'error', error: { status: 500 } }))).toEqual({ seq: 1, type: 'error', error: { status: 500 } });
  });

  it('rejects anything else', () => {
    const bad = [
      { seq: -1, type: 'chunk' },
      { seq: 1.5, type: 'done' },
      // Beyond 2^53 two different seqs are the same number: not a usable seq.
      { seq: 2 ** 53, type: 'done' },
      { seq: '1', type: 'done' },
      { seq: 0, type: 'other' },
      { seq: 1, type: 'restart' },
      { seq: 0, type: 'error' },
      { seq: 0, type: 'error', error: null },
      { seq: 0, type: 'part' },
      { seq: 0, type: 'part', piece: 7 },
      { seq: 1, type: 'done', parts: 0 },
      { seq: 1, type: 'done', parts: 1.5 },
      { seq: 1, type: 'done', parts: '2' },
      { type: 'done' },
      null,
      'x',
      [],
    ];
    for (const v of bad) expect(decodeFrame(enc(v))).toBeUndefined();
    expect(decodeFrame(new TextEncoder().encode('{not json'))).toBeUndefined();
    expect(decodeFrame(new TextEncoder().encode('{'))).toBeUndefined();
  });
});

describe('an answer larger than a message (splitFrame, FrameParts)', () => {
  const LIMIT = 4096;
  /** A completion of about `n` bytes, with text that is not ASCII (a piece may cut a character). */
  const completion = (n: number) => ({ object: 'chat.completion', choices: [{ message: { content: 'héllo wörld ✓ '.repeat(Math.ceil(n / 18)) } }] });
  /** The frames relayed in order, joined as the gateway joins them. */
  const joined = (frames: ResponseFrame[]) => {
    const s = new FrameSequencer();
    const parts = new FrameParts();
    const out: ResponseFrame[] = [];
    for (const f of frames.flatMap((x) => s.push(x))) {
      if (f.type === 'part') expect(parts.add(f)).toBe(true);
      else out.push(f.type === 'done' ? parts.join(f)! : f);
    }
    return { out, finished: s.finished };
  };

  it('leaves a frame that fits, a chunk, an error and a done without data as they are', () => {
    for (const f of [c(0), err(1), { seq: 2, type: 'done' } as ResponseFrame, { seq: 3, type: 'done', data: completion(100) } as ResponseFrame])
      expect(splitFrame(f, LIMIT)).toEqual([f]);
  });

  it('cuts a larger done into parts each within the limit, numbered on, and a done that counts them; joined, it is the same answer', () => {
    const whole: ResponseFrame = { seq: 5, type: 'done', data: completion(50_000) };
    const frames = splitFrame(whole, LIMIT);
    expect(frames.length).toBeGreaterThan(10);
    expect(frames.map((f) => f.seq)).toEqual(frames.map((_, k) => 5 + k));
    for (const f of frames) expect(encodeFrame(f).length).toBeLessThanOrEqual(LIMIT);
    // Every one survives the codec, and only the last ends the response.
    expect(frames.map((f) => decodeFrame(encodeFrame(f)))).toEqual(frames);
    expect(frames.at(-1)).toEqual({ seq: 5 + frames.length - 1, type: 'done', parts: frames.length - 1 });
    const prefix = [c(0), c(1), c(2), c(3), c(4)];
    // Out of order, with duplicates: the sequencer puts them right first.
    const shuffled = [...prefix, ...frames].reverse().concat(frames.slice(0, 3));
    const { out, finished } = joined(shuffled);
    expect(finished).toBe(true);
    expect(out).toEqual([...prefix, { seq: whole.seq + frames.length - 1, type: 'done', data: whole.data }]);
  });

  it('joins only the parts its done counts: those of an attempt that died halfway through its own are not the answer', () => {
    const first = splitFrame({ seq: 0, type: 'done', data: completion(20_000) }, LIMIT);
    const stale = first.slice(0, 3); // published before the bridge died: no done
    const answer = { answer: 'the second attempt '.repeat(100) };
    const again = splitFrame({ seq: stale.length, type: 'done', data: answer }, 1024);
    expect(again.length).toBeGreaterThan(1);
    const { out } = joined([...stale, ...again]);
    expect(out).toEqual([{ seq: again.at(-1)!.seq, type: 'done', data: answer }]);
  });

  it('a done that counts parts that never came, or that do not join into JSON, is no answer', () => {
    const parts = new FrameParts();
    expect(parts.join({ seq: 1, type: 'done', parts: 2 })).toBeUndefined();
    parts.add({ seq: 0, type: 'part', piece: Buffer.from('{"a":').toString('base64') });
    expect(parts.join({ seq: 1, type: 'done', parts: 1 })).toBeUndefined();
  });
});

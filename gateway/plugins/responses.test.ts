/** The frame ordering rule (responses.ts) and the exchange's timeouts, with fake timers. */
import type { InferenceRequest, ResponseFrame, SessionEntry } from '../../shared/serving';
import { decodeFrame, exchange, frameError, FrameSequencer, type ResponseRouter } from './responses';

const c = (seq: number): ResponseFrame => ({ seq, type: 'chunk', data: seq });
const done = (seq: number): ResponseFrame => ({ seq, type: 'done', data: 'end' });
const err = (seq: number): ResponseFrame => ({ seq, type: 'error', error: { status: 500, message: 'x', type: 'server_error', code: null } });

function sequencer(gapMs = 100) {
  const out: (number | string)[] = [];
  const gaps: number[] = [];
  const s = new FrameSequencer((f) => out.push(f.type === 'chunk' ? (f.data as number) : `${f.type}@${f.seq}`), (m) => gaps.push(m), gapMs);
  return { s, out, gaps };
}

beforeEach(() => jest.useFakeTimers());
afterEach(() => jest.useRealTimers());

describe('FrameSequencer', () => {
  it('delivers in order, holding early frames until the gap fills', () => {
    const { s, out, gaps } = sequencer();
    [c(2), c(0), c(3), c(1), done(4)].forEach((f) => s.push(f));
    expect(out).toEqual([0, 1, 2, 3, 'done@4']);
    jest.advanceTimersByTime(1000);
    expect(gaps).toEqual([]);
  });

  it('drops duplicates, including a restarted stream from seq 0', () => {
    const { s, out } = sequencer();
    [c(0), c(1), c(1), c(0), c(2), c(0), c(1), c(2), c(3), c(2), c(3)].forEach((f) => s.push(f));
    expect(out).toEqual([0, 1, 2, 3]);
    expect(s.expected).toBe(4);
  });

  it('drops a duplicate of a held frame', () => {
    const { s, out } = sequencer();
    [c(1), c(1), c(0)].forEach((f) => s.push(f));
    expect(out).toEqual([0, 1]);
  });

  it('reports the missing seq when a gap is not filled in time', () => {
    const { s, out, gaps } = sequencer(100);
    [c(0), c(2), c(3)].forEach((f) => s.push(f));
    jest.advanceTimersByTime(99);
    expect(gaps).toEqual([]);
    jest.advanceTimersByTime(1);
    expect(gaps).toEqual([1]);
    s.push(c(1)); // too late: stopped
    expect(out).toEqual([0]);
  });

  it('gives a second gap its own full wait', () => {
    const { s, out, gaps } = sequencer(100);
    [c(1), c(3)].forEach((f) => s.push(f));
    jest.advanceTimersByTime(80);
    s.push(c(0)); // fills 0; 2 still missing
    jest.advanceTimersByTime(80);
    expect(gaps).toEqual([]);
    s.push(c(2));
    jest.advanceTimersByTime(500);
    expect(gaps).toEqual([]);
    expect(out).toEqual([0, 1, 2, 3]);
  });

  it('relays an error frame in seq order too, and nothing after the first terminal', () => {
    const { s, out, gaps } = sequencer();
    [c(0), err(2), c(3)].forEach((f) => s.push(f));
    expect(out).toEqual([0]);
    s.push(c(1));
    expect(out).toEqual([0, 1, 'error@2']);
    [c(3), done(3), err(2)].forEach((f) => s.push(f)); // a re-published terminal, late frames
    jest.advanceTimersByTime(1000);
    expect(out).toEqual([0, 1, 'error@2']);
    expect(gaps).toEqual([]);
  });

  it('ends at done even with frames held beyond it', () => {
    const { s, out, gaps } = sequencer();
    [c(2), done(1), c(0)].forEach((f) => s.push(f));
    expect(out).toEqual([0, 'done@1']);
    jest.advanceTimersByTime(1000);
    expect(gaps).toEqual([]);
  });
});

describe('decodeFrame', () => {
  const enc = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));
  it('accepts frames and rejects anything else', () => {
    expect(decodeFrame(enc({ seq: 0, type: 'chunk', data: {} }))).toEqual({ seq: 0, type: 'chunk', data: {} });
    expect(decodeFrame(enc({ seq: 3, type: 'done' }))).toEqual({ seq: 3, type: 'done' });
    for (const bad of [{ seq: -1, type: 'chunk' }, { seq: 1.5, type: 'done' }, { seq: 0, type: 'other' }, { seq: 0, type: 'error' }, null, 'x']) expect(decodeFrame(enc(bad))).toBeUndefined();
    expect(decodeFrame(new TextEncoder().encode('{not json'))).toBeUndefined();
  });
});

describe('exchange', () => {
  function fakeRouter() {
    const listeners = new Map<string, (f: ResponseFrame) => void>();
    const router: ResponseRouter = { replySubject: (id) => `magus.res.${id}`, listen: (id, fn) => (listeners.set(id, fn), () => void listeners.delete(id)), recover: () => Promise.resolve(0), close: () => Promise.resolve() };
    return { router, listeners };
  }
  const session: SessionEntry = { subject: 'magus.req.p.i', pool: 'p', instance: 'i', expiresAt: 0 };
  const req: InferenceRequest = { id: 'r1', replyTo: 'magus.res.r1', deadline: 0, body: { model: 'm', messages: [] } };

  it('listens before it publishes, and stops listening when done', async () => {
    const { router, listeners } = fakeRouter();
    const order: string[] = [];
    const p = exchange(session, req, {
      router,
      publish: () => {
        order.push(listeners.has('r1') ? 'publish-after-listen' : 'publish-before-listen');
        return Promise.resolve();
      },
      requestTimeoutMs: 1000,
      gapTimeoutMs: 100,
      retryAfterSec: 1,
      signal: new AbortController().signal,
    });
    await Promise.resolve();
    listeners.get('r1')!(done(0));
    await expect(p).resolves.toBe('end');
    expect(order).toEqual(['publish-after-listen']);
    expect(listeners.size).toBe(0);
  });

  it('times out only when no frame arrives for requestTimeoutMs (idle, not total)', async () => {
    const { router, listeners } = fakeRouter();
    const chunks: unknown[] = [];
    const p = exchange(session, req, { router, publish: () => Promise.resolve(), requestTimeoutMs: 1000, gapTimeoutMs: 100, retryAfterSec: 1, signal: new AbortController().signal, onChunk: (d) => chunks.push(d) });
    for (let i = 0; i < 5; i++) {
      jest.advanceTimersByTime(900);
      listeners.get('r1')!(c(i));
    }
    jest.advanceTimersByTime(1000);
    await expect(p).rejects.toMatchObject({ name: 'GatewayError', status: 504, code: 'timeout' });
    expect(chunks).toEqual([0, 1, 2, 3, 4]);
    expect(listeners.size).toBe(0);
  });

  it('rejects with the abort reason when the client goes away', async () => {
    const { router, listeners } = fakeRouter();
    const ctl = new AbortController();
    const p = exchange(session, req, { router, publish: () => Promise.resolve(), requestTimeoutMs: 1000, gapTimeoutMs: 100, retryAfterSec: 1, signal: ctl.signal });
    ctl.abort(new Error('gone'));
    await expect(p).rejects.toThrow('gone');
    expect(listeners.size).toBe(0);
  });
});

describe('frameError', () => {
  const frame = (status: number, code: string | null = 'x'): Extract<ResponseFrame, { type: 'error' }> => ({ seq: 0, type: 'error', error: { status, message: 'engine 10.0.0.7 says no', type: 'server_error', code } });
  it('passes 4xx through, with Retry-After on 429', () => {
    expect(frameError(frame(400, 'context_length_exceeded'), 5)).toMatchObject({ status: 400, code: 'context_length_exceeded', message: 'engine 10.0.0.7 says no' });
    expect(frameError(frame(429), 7).headers).toEqual({ 'retry-after': '7' });
  });
  it('hides 5xx, and a 504 (the bridge’s deadline) is the gateway’s own timeout answer', () => {
    const e500 = frameError(frame(500), 5);
    expect(e500).toMatchObject({ status: 500, code: 'engine_error' });
    expect(e500.message).not.toContain('10.0.0.7');
    expect(frameError(frame(504, 'deadline_exceeded'), 5)).toMatchObject({ status: 504, code: 'timeout' });
  });
});

/** The exchange's ordering and timeouts (with fake timers) and the HTTP answer of error frames; the ordering rule itself is tested with dataplane/frames.ts. */
import type { ErrorFrame, InferenceRequest, ResponseFrame, SessionEntry } from '../../shared/serving';
import { SessionError, SessionErrorType } from '../plugins/errors';
import {
  exchange,
  FIRST_GAP_READ_MS,
  frameError,
  GAP_READ_BACKS,
  NATS_UNREACHABLE,
  PUBLISH_RETRY_MS,
  PUBLISH_RETRY_UNCOMMITTED_MS,
  type MoveHow,
  type ResponseRouter,
} from './exchange';

const c = (seq: number): ResponseFrame => ({ seq, type: 'chunk', data: seq });
const done = (seq: number): ResponseFrame => ({ seq, type: 'done', data: 'end' });
const err = (seq: number): ResponseFrame => ({ seq, type: 'error', error: { status: 500, message: 'x', type: 'server_error', code: null } });

beforeEach(() => jest.useFakeTimers());
afterEach(() => jest.useRealTimers());

/** A router that hands each request's frames to whoever listens for its id, as the test sends them. */
function fakeRouter() {
  const listeners = new Map<string, (f: ResponseFrame) => void>();
  const router: ResponseRouter = {
    replySubject: (id) => `magus.res.${id}`,
    listen: (id, fn) => (listeners.set(id, fn), () => void listeners.delete(id)),
    recover: () => Promise.resolve(0),
    close: () => Promise.resolve(),
  };
  return { router, listeners };
}

describe('exchange', () => {
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
    const p = exchange(session, req, {
      router,
      publish: () => Promise.resolve(),
      requestTimeoutMs: 1000,
      gapTimeoutMs: 100,
      retryAfterSec: 1,
      signal: new AbortController().signal,
      onChunk: (d) => chunks.push(d),
    });
    for (let i = 0; i < 5; i++) {
      jest.advanceTimersByTime(900);
      listeners.get('r1')!(c(i));
    }
    jest.advanceTimersByTime(1000);
    await expect(p).rejects.toMatchObject({ name: 'GatewayError', status: 504, code: 'timeout' });
    expect(chunks).toEqual([0, 1, 2, 3, 4]);
    expect(listeners.size).toBe(0);
  });

  it('relays chunks in seq order, each once, and resolves with the done frame', async () => {
    const { router, listeners } = fakeRouter();
    const chunks: unknown[] = [];
    const p = exchange(session, req, {
      router,
      publish: () => Promise.resolve(),
      requestTimeoutMs: 1000,
      gapTimeoutMs: 100,
      retryAfterSec: 1,
      signal: new AbortController().signal,
      onChunk: (d) => chunks.push(d),
    });
    for (const f of [c(1), c(0), c(0), c(2), done(3), c(4)]) listeners.get('r1')?.(f);
    await expect(p).resolves.toBe('end');
    expect(chunks).toEqual([0, 1, 2]);
  });

  it('without a read-back, a gap not filled within gapTimeoutMs fails with 502 frames_lost and gives the request up', async () => {
    const { router, listeners } = fakeRouter();
    const reasons: string[] = [];
    let abandoned = 0;
    const p = exchange(session, req, {
      router,
      publish: () => Promise.resolve(),
      requestTimeoutMs: 1000,
      gapTimeoutMs: 100,
      retryAfterSec: 1,
      signal: new AbortController().signal,
      onUpstreamError: (r) => reasons.push(r),
      onAbandon: () => (abandoned += 1),
    });
    for (const f of [c(0), c(2)]) listeners.get('r1')!(f);
    jest.advanceTimersByTime(100);
    await expect(p).rejects.toMatchObject({ name: 'GatewayError', status: 502, code: 'frames_lost' });
    expect(reasons).toEqual(['frames_lost']);
    expect(abandoned).toBe(1);
  });

  it('a gap is read back from the stream before it is given up: the stored frame fills it', async () => {
    const { router, listeners } = fakeRouter();
    const chunks: unknown[] = [];
    const reads: number[] = [];
    const p = exchange(session, req, {
      router,
      publish: () => Promise.resolve(),
      requestTimeoutMs: 1000,
      gapTimeoutMs: 100,
      readBack: () => (reads.push(Date.now()), Promise.resolve([c(0), c(1), c(2)])),
      retryAfterSec: 1,
      signal: new AbortController().signal,
      onChunk: (d) => chunks.push(d),
    });
    for (const f of [c(0), c(2), done(3)]) listeners.get('r1')!(f);
    expect(chunks).toEqual([0]);
    await jest.advanceTimersByTimeAsync(99);
    expect(reads).toHaveLength(0); // a frame merely late is not read back
    await jest.advanceTimersByTimeAsync(1);
    await expect(p).resolves.toBe('end');
    expect(reads).toHaveLength(1);
    expect(chunks).toEqual([0, 1, 2]);
  });

  it('a gap that read-backs keep missing fails with frames_lost after GAP_READ_BACKS reads, gapTimeoutMs apart', async () => {
    const { router, listeners } = fakeRouter();
    const reasons: string[] = [];
    let reads = 0;
    const p = exchange(session, req, {
      router,
      publish: () => Promise.resolve(),
      requestTimeoutMs: 10_000,
      gapTimeoutMs: 100,
      readBack: () => (reads++, Promise.resolve([c(0), c(2)])),
      retryAfterSec: 1,
      signal: new AbortController().signal,
      onUpstreamError: (r) => reasons.push(r),
    });
    const outcome = p.then(
      () => 'resolved',
      (e: unknown) => e,
    );
    for (const f of [c(0), c(2)]) listeners.get('r1')!(f);
    await jest.advanceTimersByTimeAsync(100 * GAP_READ_BACKS);
    expect(reads).toBe(GAP_READ_BACKS);
    expect(reasons).toEqual([]);
    await jest.advanceTimersByTimeAsync(100);
    await expect(outcome).resolves.toMatchObject({ name: 'GatewayError', status: 502, code: 'frames_lost' });
    expect(reasons).toEqual(['frames_lost']);
  });

  it(`a gap is first read back FIRST_GAP_READ_MS (${FIRST_GAP_READ_MS} ms) into it, then gapTimeoutMs apart; each new gap gets the short first wait`, async () => {
    const { router, listeners } = fakeRouter();
    const readAt: number[] = [];
    const start = Date.now();
    const p = exchange(session, req, {
      router,
      publish: () => Promise.resolve(),
      requestTimeoutMs: 60_000,
      gapTimeoutMs: 2_000,
      readBack: () => (readAt.push(Date.now() - start), Promise.resolve([])),
      retryAfterSec: 1,
      signal: new AbortController().signal,
    });
    for (const f of [c(0), c(2)]) listeners.get('r1')!(f);
    await jest.advanceTimersByTimeAsync(FIRST_GAP_READ_MS - 10);
    expect(readAt).toEqual([]);
    await jest.advanceTimersByTimeAsync(20);
    expect(readAt).toEqual([FIRST_GAP_READ_MS]);
    await jest.advanceTimersByTimeAsync(2_000);
    expect(readAt).toEqual([FIRST_GAP_READ_MS, FIRST_GAP_READ_MS + 2_000]);
    // Filled live, with a further seq missing: that gap is read back FIRST_GAP_READ_MS later.
    listeners.get('r1')!(c(4));
    listeners.get('r1')!(c(1));
    const filledAt = Date.now() - start;
    await jest.advanceTimersByTimeAsync(FIRST_GAP_READ_MS);
    expect(readAt).toEqual([FIRST_GAP_READ_MS, FIRST_GAP_READ_MS + 2_000, filledAt + FIRST_GAP_READ_MS]);
    listeners.get('r1')!(c(3));
    listeners.get('r1')!(done(5));
    await expect(p).resolves.toBe('end');
  });

  it('failed read-backs (a stream without a leader) are tried again until one succeeds, and do not count as misses', async () => {
    const { router, listeners } = fakeRouter();
    const chunks: unknown[] = [];
    let reads = 0;
    const p = exchange(
      session,
      { ...req, deadline: Date.now() + 60_000 },
      {
        router,
        publish: () => Promise.resolve(),
        requestTimeoutMs: 60_000,
        gapTimeoutMs: 100,
        readBack: () => (++reads <= 8 ? Promise.reject(new Error('no leader')) : Promise.resolve([c(1)])),
        retryAfterSec: 1,
        signal: new AbortController().signal,
        onChunk: (d) => chunks.push(d),
      },
    );
    for (const f of [c(0), c(2), done(3)]) listeners.get('r1')!(f);
    await jest.advanceTimersByTimeAsync(100 + 8 * 100);
    await expect(p).resolves.toBe('end');
    expect(reads).toBe(9);
    expect(chunks).toEqual([0, 1, 2]);
  });

  it('each missing seq gets its own reads: a gap filled live resets the count', async () => {
    const { router, listeners } = fakeRouter();
    let reads = 0;
    const p = exchange(session, req, {
      router,
      publish: () => Promise.resolve(),
      requestTimeoutMs: 60_000,
      gapTimeoutMs: 100,
      readBack: () => (reads++, Promise.resolve([])),
      retryAfterSec: 1,
      signal: new AbortController().signal,
    });
    for (const f of [c(0), c(2)]) listeners.get('r1')!(f);
    await jest.advanceTimersByTimeAsync(250); // two reads missed seq 1
    listeners.get('r1')!(c(1));
    listeners.get('r1')!(c(4)); // now seq 3 is missing
    await jest.advanceTimersByTimeAsync(250);
    listeners.get('r1')!(c(3));
    listeners.get('r1')!(done(5));
    await expect(p).resolves.toBe('end');
    expect(reads).toBe(4);
  });

  it('an error frame in seq order ends it with that frame’s answer', async () => {
    const { router, listeners } = fakeRouter();
    const p = exchange(session, req, {
      router,
      publish: () => Promise.resolve(),
      requestTimeoutMs: 1000,
      gapTimeoutMs: 100,
      retryAfterSec: 1,
      signal: new AbortController().signal,
    });
    for (const f of [err(1), c(0)]) listeners.get('r1')!(f);
    await expect(p).rejects.toMatchObject({ name: 'GatewayError', status: 500, code: 'engine_error' });
  });

  it('an error frame its bridge could not place (afterRelayed: the stored frames were gone) ends it at once, whatever its seq', async () => {
    const { router, listeners } = fakeRouter();
    const p = exchange(session, req, {
      router,
      publish: () => Promise.resolve(),
      requestTimeoutMs: 10_000,
      gapTimeoutMs: 5_000,
      retryAfterSec: 1,
      signal: new AbortController().signal,
    });
    listeners.get('r1')!(c(0));
    listeners.get('r1')!(c(2)); // held behind a missing seq 1
    // Stored after the highest seq the stream held (none): seq 0, a seq this gateway has relayed.
    listeners.get('r1')!({ seq: 0, type: 'error', afterRelayed: true, error: { status: 502, message: 'gone', type: 'server_error', code: 'resume_failed' } });
    await expect(p).rejects.toMatchObject({ name: 'GatewayError', status: 502, code: 'engine_error' });
    // Without the flag the same frame is a duplicate of seq 0: dropped, and only the idle timeout ends it.
    const second = fakeRouter();
    const q = exchange(session, req, {
      router: second.router,
      publish: () => Promise.resolve(),
      requestTimeoutMs: 10_000,
      gapTimeoutMs: 5_000,
      retryAfterSec: 1,
      signal: new AbortController().signal,
    });
    let settled = false;
    q.then(
      () => (settled = true),
      () => (settled = true),
    );
    second.listeners.get('r1')!(c(0));
    second.listeners.get('r1')!(err(0));
    await jest.advanceTimersByTimeAsync(1000);
    expect(settled).toBe(false);
    await jest.advanceTimersByTimeAsync(10_000);
    await expect(q).rejects.toMatchObject({ code: 'timeout' });
  });

  it('rejects with the abort reason when the client goes away', async () => {
    const { router, listeners } = fakeRouter();
    const ctl = new AbortController();
    const p = exchange(session, req, {
      router,
      publish: () => Promise.resolve(),
      requestTimeoutMs: 1000,
      gapTimeoutMs: 100,
      retryAfterSec: 1,
      signal: ctl.signal,
    });
    ctl.abort(new Error('gone'));
    await expect(p).rejects.toThrow('gone');
    expect(listeners.size).toBe(0);
  });
});

describe('exchange: a publish that fails', () => {
  const session: SessionEntry = { subject: 'magus.req.p.i', pool: 'p', instance: 'i', expiresAt: 0 };
  const noRouter: ResponseRouter = {
    replySubject: (id) => `magus.res.${id}`,
    listen: () => () => undefined,
    recover: () => Promise.resolve(0),
    close: () => Promise.resolve(),
  };
  function run(outcomes: (Error | undefined)[], committed: boolean) {
    let committedNow = committed;
    const listeners = new Map<string, (f: ResponseFrame) => void>();
    const router: ResponseRouter = { ...noRouter, listen: (id, fn) => (listeners.set(id, fn), () => void listeners.delete(id)) };
    const published: string[] = [];
    let retries = 0;
    let abandoned = 0;
    const req: InferenceRequest = { id: 'r2', replyTo: 'magus.res.r2', deadline: Date.now() + 10 * 60_000, body: { model: 'm', messages: [] } };
    const p = exchange(session, req, {
      router,
      publish: (_subject, r) => {
        published.push(r.id);
        const e = outcomes.length > 0 ? outcomes.shift() : new Error('no stream stores this subject (no responders)');
        return e ? Promise.reject(e) : Promise.resolve();
      },
      requestTimeoutMs: 10 * 60_000,
      gapTimeoutMs: 100,
      retryAfterSec: 3,
      signal: new AbortController().signal,
      committed: () => committedNow,
      onPublishRetry: () => (retries += 1),
      onAbandon: () => (abandoned += 1),
    });
    p.catch(() => undefined);
    return { p, listeners, published, retries: () => retries, abandoned: () => abandoned, commit: () => (committedNow = true) };
  }
  const noLeader = () => new Error('no stream stores this subject (no responders)');

  it('not committed, waits out an election (same request id): the answer comes with no refusal', async () => {
    const r = run([noLeader(), noLeader(), noLeader(), noLeader(), undefined], false);
    await jest.advanceTimersByTimeAsync(250 + 500 + 1_000 + 2_000);
    expect(r.published).toEqual(['r2', 'r2', 'r2', 'r2', 'r2']);
    expect(r.retries()).toBe(4);
    r.listeners.get('r2')!(done(0));
    await expect(r.p).resolves.toBe('end');
    expect(r.abandoned()).toBe(0);
  });

  it(`not committed, is refused 503 with Retry-After after PUBLISH_RETRY_UNCOMMITTED_MS (${PUBLISH_RETRY_UNCOMMITTED_MS} ms) of failures`, async () => {
    const r = run([], false);
    let refused = false;
    r.p.catch(() => (refused = true));
    await jest.advanceTimersByTimeAsync(PUBLISH_RETRY_UNCOMMITTED_MS - 2_500);
    expect(refused).toBe(false);
    await jest.advanceTimersByTimeAsync(2_500);
    await expect(r.p).rejects.toMatchObject({ name: 'GatewayError', status: 503, code: 'unavailable', headers: { 'retry-after': '3' } });
    expect(r.abandoned()).toBe(1);
    const n = r.published.length;
    await jest.advanceTimersByTimeAsync(10_000);
    expect(r.published.length).toBe(n);
  });

  it('not committed, is refused at once (503 with Retry-After) when the gateway is cut off from NATS: another replica may not be', async () => {
    const r = run([new Error(NATS_UNREACHABLE)], false);
    await expect(r.p).rejects.toMatchObject({ status: 503, code: 'unavailable', headers: { 'retry-after': '3' } });
    expect(r.published).toEqual(['r2']);
  });

  it('committed while it tries, is tried for PUBLISH_RETRY_MS from its first failure', async () => {
    const r = run([], false);
    let refused = false;
    r.p.catch(() => (refused = true));
    await jest.advanceTimersByTimeAsync(2_000);
    r.commit();
    await jest.advanceTimersByTimeAsync(PUBLISH_RETRY_MS - 2_000 - 2_500);
    expect(refused).toBe(false);
    await jest.advanceTimersByTimeAsync(2_500);
    await expect(r.p).rejects.toMatchObject({ status: 503, code: 'unavailable' });
  });

  it('is tried again, same request id, once the response is committed; the answer then comes as usual', async () => {
    const r = run([noLeader(), new Error('TIMEOUT'), noLeader(), undefined], true);
    await jest.advanceTimersByTimeAsync(250 + 500 + 1_000);
    expect(r.published).toEqual(['r2', 'r2', 'r2', 'r2']);
    expect(r.retries()).toBe(3);
    r.listeners.get('r2')!(done(0));
    await expect(r.p).resolves.toBe('end');
    expect(r.abandoned()).toBe(0);
  });

  it(`gives up after PUBLISH_RETRY_MS (${PUBLISH_RETRY_MS} ms) of failures, with 503 unavailable`, async () => {
    const r = run([], true);
    await jest.advanceTimersByTimeAsync(PUBLISH_RETRY_MS - 2_500);
    expect(r.retries()).toBeGreaterThan(10);
    await jest.advanceTimersByTimeAsync(2_500);
    await expect(r.p).rejects.toMatchObject({ status: 503, code: 'unavailable' });
    const n = r.published.length;
    await jest.advanceTimersByTimeAsync(10_000);
    expect(r.published.length).toBe(n);
  });

  it('a full backlog is answered at once (429), committed or not: trying again would only queue behind it', async () => {
    const r = run([new SessionError(SessionErrorType.BacklogFull, 'full')], true);
    await expect(r.p).rejects.toMatchObject({ status: 429 });
    expect(r.published).toEqual(['r2']);
  });
});

describe('frameError', () => {
  const frame = (status: number, code: string | null = 'x'): Extract<ResponseFrame, { type: 'error' }> => ({
    seq: 0,
    type: 'error',
    error: { status, message: 'engine 10.0.0.7 says no', type: 'server_error', code },
  });
  it('passes 4xx through, with Retry-After on 429', () => {
    expect(frameError(frame(400, 'context_length_exceeded'), 5)).toMatchObject({
      status: 400,
      code: 'context_length_exceeded',
      message: 'engine 10.0.0.7 says no',
    });
    expect(frameError(frame(429), 7).headers).toEqual({ 'retry-after': '7' });
  });
  it('hides 5xx, and a 504 (the bridge’s deadline) is the gateway’s own timeout answer', () => {
    const e500 = frameError(frame(500), 5);
    expect(e500).toMatchObject({ status: 500, code: 'engine_error' });
    expect(e500.message).not.toContain('10.0.0.7');
    expect(frameError(frame(504, 'deadline_exceeded'), 5)).toMatchObject({ status: 504, code: 'timeout' });
  });
});

describe('exchange: an answer handed back, or whose bridge went silent, goes on as a request that continues it', () => {
  const text = (seq: number, content: string, tokens: number[]): ResponseFrame => ({
    seq,
    type: 'chunk',
    data: { created: 1700000000, choices: [{ index: 0, delta: { content }, finish_reason: null }] },
    tokens,
  });
  const role = (seq: number): ResponseFrame => ({
    seq,
    type: 'chunk',
    data: { choices: [{ index: 0, delta: { role: 'assistant', content: '' }, finish_reason: null }] },
  });
  const handedBack = (seq: number): ErrorFrame => ({
    seq,
    type: 'error',
    error: { status: 503, message: 'continue it elsewhere', type: 'server_error', code: 'continue_elsewhere' },
  });
  const s1: SessionEntry = { subject: 'magus.req.p.i1', pool: 'p', instance: 'i1', expiresAt: 0 };
  const s2: SessionEntry = { subject: 'magus.req.p.i2', pool: 'p', instance: 'i2', expiresAt: 0 };
  const first: InferenceRequest = { id: 'r1', replyTo: 'magus.res.r1', deadline: Date.now() + 60_000, body: { model: 'm', messages: [], stream: true } };

  function setUp(over: Partial<Parameters<typeof exchange>[2]> = {}) {
    const { router, listeners } = fakeRouter();
    const published: string[] = [];
    const relayed: [unknown, number][] = [];
    const asked: { said: unknown; from: string; createdAt: number; at: number }[] = [];
    const p = exchange(s1, first, {
      router,
      publish: (subject, r) => (published.push(`${subject} ${r.id}`), Promise.resolve()),
      requestTimeoutMs: 10_000,
      gapTimeoutMs: 100,
      retryAfterSec: 1,
      signal: new AbortController().signal,
      onChunk: (d, seq) => relayed.push([(d as { choices?: { delta?: { content?: string } }[] }).choices?.[0]?.delta?.content ?? d, seq]),
      move: (said, from, { createdAt, at }) => {
        asked.push({ said, from: from.session.instance, createdAt, at });
        return Promise.resolve({ session: s2, req: { ...from.req, id: `r${asked.length + 1}`, replyTo: `magus.res.r${asked.length + 1}` } });
      },
      ...over,
    });
    return { p, listeners, published, relayed, asked };
  }

  it('continues after what was relayed: the said answer handed over, seqs following on, a fresh role chunk not relayed twice', async () => {
    const t = setUp();
    await Promise.resolve();
    const send = (id: string, f: ResponseFrame) => t.listeners.get(id)!(f);
    send('r1', role(0));
    send('r1', text(1, 'Once', [7]));
    send('r1', text(2, ' upon', [8, 9]));
    send('r1', handedBack(3));
    await Promise.resolve();
    await Promise.resolve();
    expect(t.asked).toEqual([{ said: { tokens: [7, 8, 9], text: 'Once upon' }, from: 'i1', createdAt: 1700000000 * 1000, at: 3 }]);
    expect(t.published).toEqual(['magus.req.p.i1 r1', 'magus.req.p.i2 r2']);
    expect(t.listeners.has('r1')).toBe(false); // the first request's late frames are not this answer's any more
    send('r2', role(0)); // a continuation that starts afresh says the role again: dropped
    send('r2', text(1, ' a', [10]));
    send('r2', done(2));
    await expect(t.p).resolves.toBe('end');
    expect(t.relayed).toEqual([
      ['', 0],
      ['Once', 1],
      [' upon', 2],
      [' a', 4],
    ]);
  });

  it("a continuation goes to the lane its instance's bridge pulls: the moved answers with something said; with nothing said, the requeued requests only of a bridge that says it pulls them", async () => {
    const cases: [ResponseFrame[], boolean, string][] = [
      [[text(0, 'Once', [7])], true, 'magus.req.p.i2.moved'],
      [[text(0, 'Once', [7])], false, 'magus.req.p.i2.moved'],
      [[role(0)], true, 'magus.req.p.i2.requeued'],
      [[role(0)], false, 'magus.req.p.i2'],
    ];
    for (const [before, requeues, subject] of cases) {
      const t = setUp({
        requeues: (s) => s.instance === 'i2' && requeues,
        move: (said, from, { createdAt }) =>
          Promise.resolve({ session: s2, req: { ...from.req, id: 'r2', replyTo: 'magus.res.r2', continues: { id: from.req.id, createdAt, resume: said } } }),
      });
      await Promise.resolve();
      for (const f of before) t.listeners.get('r1')!(f);
      t.listeners.get('r1')!(handedBack(before.length));
      await Promise.resolve();
      await Promise.resolve();
      expect(t.published).toEqual(['magus.req.p.i1 r1', `${subject} r2`]);
      t.listeners.get('r2')!(done(0));
      await expect(t.p).resolves.toBe('end');
    }
  });

  it("a hand-back's place in a queue (its frame's due) goes to the move, which the continuation keeps; one that is no finite number does not", async () => {
    for (const [due, expected] of [
      [1_700_000_000_000, 1_700_000_000_000],
      [undefined, undefined],
      [Number.NaN, undefined],
      ['soon', undefined],
    ] as const) {
      const hows: MoveHow[] = [];
      const t = setUp({
        move: (said, from, how) => {
          hows.push(how);
          return Promise.resolve({ session: s2, req: { ...from.req, id: 'r2', replyTo: 'magus.res.r2' } });
        },
      });
      await Promise.resolve();
      t.listeners.get('r1')!(text(0, 'Once', [7]));
      t.listeners.get('r1')!({ ...handedBack(1), due } as ErrorFrame);
      await Promise.resolve();
      await Promise.resolve();
      expect(hows).toHaveLength(1);
      expect(hows[0]!.due).toBe(expected);
      expect('due' in hows[0]!).toBe(expected !== undefined);
      t.listeners.get('r2')!(done(0));
      await expect(t.p).resolves.toBe('end');
    }
  });

  it('a hand-back its bridge could not place (afterRelayed: the stored frames were gone) continues after what this gateway relayed, frames held behind a gap dropped', async () => {
    const t = setUp();
    await Promise.resolve();
    const send = (id: string, f: ResponseFrame) => t.listeners.get(id)!(f);
    send('r1', role(0));
    send('r1', text(1, 'Once', [7]));
    send('r1', text(3, ' time', [11])); // held: seq 2 never came
    send('r1', { ...handedBack(0), afterRelayed: true });
    await Promise.resolve();
    await Promise.resolve();
    expect(t.asked).toEqual([{ said: { tokens: [7], text: 'Once' }, from: 'i1', createdAt: 1700000000 * 1000, at: 2 }]);
    send('r2', text(0, ' upon', [8]));
    send('r2', done(1));
    await expect(t.p).resolves.toBe('end');
    expect(t.relayed).toEqual([
      ['', 0],
      ['Once', 1],
      [' upon', 2],
    ]);
  });

  it('ends with the error when the relayed answer cannot be continued (no tokens said) or nothing moves it', async () => {
    const t = setUp();
    await Promise.resolve();
    t.listeners.get('r1')!({ seq: 0, type: 'chunk', data: { choices: [{ index: 0, delta: { content: 'x' }, finish_reason: null }] } }); // no tokens
    t.listeners.get('r1')!(handedBack(1));
    await expect(t.p).rejects.toMatchObject({ status: 503 });
    expect(t.asked).toEqual([]);
    const u = setUp({ move: undefined });
    await Promise.resolve();
    u.listeners.get('r1')!(handedBack(0));
    await expect(u.p).rejects.toMatchObject({ status: 503 });
    // A silent bridge's answer that cannot be continued is left to its redelivery.
    const v = setUp({ silent: () => true });
    await Promise.resolve();
    v.listeners.get('r1')!({ seq: 0, type: 'chunk', data: { choices: [{ index: 0, delta: { content: 'x' }, finish_reason: null }] } });
    jest.advanceTimersByTime(2000);
    expect(v.asked).toEqual([]);
    v.listeners.get('r1')!(done(1));
    await expect(v.p).resolves.toBe('end');
  });

  it('moves the answer of a bridge gone silent, telling the request left behind', async () => {
    let silent = false;
    const left: string[] = [];
    const t = setUp({ silent: (s) => silent && s.instance === 'i1', onMovedAway: (from) => left.push(from.req.id) });
    await Promise.resolve();
    t.listeners.get('r1')!(text(0, 'Hi', [5]));
    jest.advanceTimersByTime(1000);
    expect(t.asked).toEqual([]); // beating: nothing moves
    silent = true;
    jest.advanceTimersByTime(250);
    await Promise.resolve();
    await Promise.resolve();
    expect(left).toEqual(['r1']);
    expect(t.asked).toEqual([{ said: { tokens: [5], text: 'Hi' }, from: 'i1', createdAt: 1700000000 * 1000, at: 1 }]);
    t.listeners.get('r2')!(text(0, '!', [6]));
    t.listeners.get('r2')!(done(1));
    await expect(t.p).resolves.toBe('end');
    expect(t.relayed).toEqual([
      ['Hi', 0],
      ['!', 1],
    ]);
  });

  it('follows a move recorded elsewhere from where it left the request: that far of its frames (not what its bridge sent after), the rest numbered as the mover numbered them', async () => {
    // The live stream moved away from r1's silent bridge after its role and 'Once'; the bridge, only slow, said more of r1 later.
    const t = setUp({ leftAt: (at) => (at.req.id === 'r1' ? 2 : undefined) });
    await Promise.resolve();
    const send = (id: string, f: ResponseFrame) => t.listeners.get(id)?.(f);
    send('r1', role(0));
    send('r1', text(2, ' upon', [8])); // after where the answer left it: not the answer's
    expect(t.asked).toEqual([]);
    send('r1', text(1, 'Once', [7]));
    await Promise.resolve();
    await Promise.resolve();
    expect(t.asked).toEqual([{ said: { tokens: [7], text: 'Once' }, from: 'i1', createdAt: 1700000000 * 1000, at: 2 }]);
    send('r1', text(3, ' a', [9]));
    send('r2', role(0));
    send('r2', text(1, ' time', [10]));
    send('r2', done(2));
    await expect(t.p).resolves.toBe('end');
    expect(t.relayed).toEqual([
      ['', 0],
      ['Once', 1],
      [' time', 3],
    ]);
  });

  it('a request the answer is known to have left before any of it is not published again; a continuation numbers after the frames its move recorded, not those seen here', async () => {
    const t = setUp({
      leftAt: (at) => (at.req.id === 'r1' ? 0 : undefined),
      move: (said, from) => Promise.resolve({ session: s2, req: { ...from.req, id: 'r2', replyTo: 'magus.res.r2' }, after: 0 }),
    });
    await Promise.resolve();
    await Promise.resolve();
    expect(t.published).toEqual(['magus.req.p.i2 r2']);
    t.listeners.get('r2')!(text(0, 'Once', [7]));
    t.listeners.get('r2')!(done(1));
    await expect(t.p).resolves.toBe('end');
    expect(t.relayed).toEqual([['Once', 0]]);
    // Handed back at 3 here, but moved at 1 where the move was recorded (the relaying replica saw less): numbered from 1.
    const u = setUp({ move: (said, from) => Promise.resolve({ session: s2, req: { ...from.req, id: 'r2', replyTo: 'magus.res.r2' }, after: 1 }) });
    await Promise.resolve();
    u.listeners.get('r1')!(role(0));
    u.listeners.get('r1')!(text(1, 'Once', [7]));
    u.listeners.get('r1')!(text(2, ' upon', [8]));
    u.listeners.get('r1')!(handedBack(3));
    await Promise.resolve();
    await Promise.resolve();
    u.listeners.get('r2')!(text(0, ' a', [9]));
    u.listeners.get('r2')!(done(1));
    await expect(u.p).resolves.toBe('end');
    expect(u.relayed.map(([, seq]) => seq)).toEqual([0, 1, 2, 1]);
  });
});

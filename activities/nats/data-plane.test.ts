import type { ResponseFrame } from '../../shared/serving';
import { FrameSequencer, consumerNameOf, dataPlaneNames, parseFrame, requestSubjectOf, responseSubjectOf } from './data-plane';

const chunk = (seq: number, text = `t${seq}`): ResponseFrame => ({ seq, type: 'chunk', data: { choices: [{ index: 0, delta: { content: text } }] } });

describe('data-plane names', () => {
  it('are the shared names without a prefix', () => {
    const n = dataPlaneNames();
    expect(n).toMatchObject({ requestStream: 'MAGUS_REQUESTS', responseStream: 'MAGUS_RESPONSES', sessionsBucket: 'magus_sessions', tokensBucket: 'magus_tokens', claimsBucket: 'magus_claims', modelsBucket: 'magus_models' });
    expect(requestSubjectOf(n, 'llama', 'i-0')).toBe('magus.req.llama.i-0');
    expect(responseSubjectOf(n, 'r1')).toBe('magus.res.r1');
  });

  it('are all renamed by a prefix', () => {
    const n = dataPlaneNames('T_X');
    expect(n).toMatchObject({ requestStream: 'T_X_MAGUS_REQUESTS', responseStream: 'T_X_MAGUS_RESPONSES', sessionsBucket: 'T_X_magus_sessions', claimsBucket: 'T_X_magus_claims' });
    expect(requestSubjectOf(n, 'p', 'i')).toBe('t_x.magus.req.p.i');
    expect(responseSubjectOf(n, 'r1')).toBe('t_x.magus.res.r1');
  });

  it('reject names that would break subjects or make consumer names ambiguous', () => {
    expect(() => dataPlaneNames('a.b')).toThrow(/prefix/);
    expect(() => requestSubjectOf(dataPlaneNames(), 'a.b', 'i')).toThrow(/pool/);
    expect(() => consumerNameOf('a_b', 'c')).toThrow(/pool/);
    expect(() => responseSubjectOf(dataPlaneNames(), 'x.*')).toThrow(/request id/);
    expect(consumerNameOf('pool-a', 'inst-1')).toBe('pool-a_inst-1');
  });
});

describe('FrameSequencer (the gateway rule)', () => {
  it('relays in order, each seq once, and ends at the first terminal', () => {
    const s = new FrameSequencer();
    expect(s.push(chunk(0))).toEqual([chunk(0)]);
    expect(s.push(chunk(0, 'again'))).toEqual([]);
    expect(s.push(chunk(2))).toEqual([]);
    expect(s.hasGap).toBe(true);
    expect(s.push(chunk(1))).toEqual([chunk(1), chunk(2)]);
    expect(s.push({ seq: 3, type: 'done' })).toEqual([{ seq: 3, type: 'done' }]);
    expect(s.finished).toBe(true);
    expect(s.push(chunk(4))).toEqual([]);
    expect(s.expected).toBe(4);
  });

  it('lets a restarted attempt fill a gap and ignores what it repeats', () => {
    const s = new FrameSequencer();
    const relayed = [chunk(0), chunk(1), chunk(3), /* attempt 2: */ chunk(0), chunk(1), chunk(2), chunk(3), { seq: 4, type: 'done' } as ResponseFrame].flatMap((f) => s.push(f));
    expect(relayed.map((f) => f.seq)).toEqual([0, 1, 2, 3, 4]);
  });

  it('a terminal held behind a gap is relayed once the gap fills, not before', () => {
    const s = new FrameSequencer();
    expect(s.push({ seq: 1, type: 'error', error: { status: 502, type: 'server_error', code: null, message: 'x' } })).toEqual([]);
    expect(s.finished).toBe(false);
    expect(s.push(chunk(0)).map((f) => f.type)).toEqual(['chunk', 'error']);
    expect(s.finished).toBe(true);
  });
});

describe('parseFrame', () => {
  const enc = (v: unknown) => new TextEncoder().encode(JSON.stringify(v));
  it('accepts the three frame types and rejects anything else', () => {
    expect(parseFrame(enc(chunk(0)))).toEqual(chunk(0));
    expect(parseFrame(enc({ seq: 1, type: 'done' }))).toEqual({ seq: 1, type: 'done' });
    expect(parseFrame(enc({ seq: 1, type: 'error', error: { status: 500 } }))).not.toBeNull();
    expect(parseFrame(enc({ seq: -1, type: 'done' }))).toBeNull();
    expect(parseFrame(enc({ seq: 1.5, type: 'done' }))).toBeNull();
    expect(parseFrame(enc({ seq: 1, type: 'restart' }))).toBeNull();
    expect(parseFrame(new TextEncoder().encode('{'))).toBeNull();
  });
});

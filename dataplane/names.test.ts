import {
  consumerNameOf,
  dataPlaneNames,
  instanceConsumerNamesOf,
  instanceResponseSubjectOf,
  isResponseSubjectOf,
  requestSubjectFor,
  requestSubjectOf,
  responseSubjectOf,
} from './names';

describe('data-plane names', () => {
  it('a continuation its client holds part of goes to the moved answers; one with nothing said to the requeued requests; a request of its own to the requests', () => {
    const subject = requestSubjectOf(dataPlaneNames(), 'llama', 'i-0');
    const continues = (tokens: number[]) => ({ id: 'r1', createdAt: 1, resume: { tokens, text: tokens.length > 0 ? 'Hi' : '' } });
    expect(requestSubjectFor(subject, {}, true)).toBe('magus.req.llama.i-0');
    expect(requestSubjectFor(subject, { continues: continues([42]) }, true)).toBe('magus.req.llama.i-0.moved');
    // Not behind the instance's queue (it waited its turn in another's), and not among the moved
    // answers either: it would hold back answers waiting mid-way (bench/README.md, "Streams under faults").
    expect(requestSubjectFor(subject, { continues: continues([]) }, true)).toBe('magus.req.llama.i-0.requeued');
    // A bridge that does not say it pulls that lane (one from before it) finds it among its requests.
    expect(requestSubjectFor(subject, { continues: continues([]) }, false)).toBe('magus.req.llama.i-0');
    expect(requestSubjectFor(subject, { continues: continues([42]) }, false)).toBe('magus.req.llama.i-0.moved');
    expect(instanceConsumerNamesOf('llama', 'i-0')).toEqual(['llama_i-0', 'llama_i-0_moved', 'llama_i-0_requeued']);
  });

  it('are the shared names without a prefix', () => {
    const n = dataPlaneNames();
    expect(n).toMatchObject({
      requestStream: 'MAGUS_REQUESTS',
      responseStream: 'MAGUS_RESPONSES',
      sessionsBucket: 'magus_sessions',
      tokensBucket: 'magus_tokens',
      claimsBucket: 'magus_claims',
      modelsBucket: 'magus_models',
      limitsBucket: 'magus_limits',
      usageBucket: 'magus_usage',
      usageSumsBucket: 'magus_usage_sums',
    });
    expect(requestSubjectOf(n, 'llama', 'i-0')).toBe('magus.req.llama.i-0');
    expect(responseSubjectOf(n, 'r1')).toBe('magus.res.r1');
  });

  it('are all renamed by a prefix', () => {
    const n = dataPlaneNames('T_X');
    expect(n).toMatchObject({
      requestStream: 'T_X_MAGUS_REQUESTS',
      responseStream: 'T_X_MAGUS_RESPONSES',
      sessionsBucket: 'T_X_magus_sessions',
      claimsBucket: 'T_X_magus_claims',
      limitsBucket: 'T_X_magus_limits',
      usageBucket: 'T_X_magus_usage',
      usageSumsBucket: 'T_X_magus_usage_sums',
    });
    expect(requestSubjectOf(n, 'p', 'i')).toBe('t_x.magus.req.p.i');
    expect(responseSubjectOf(n, 'r1')).toBe('t_x.magus.res.r1');
    expect(responseSubjectOf(n, 'r1', 'gw-1')).toBe('t_x.magus.res.gw-1.r1');
  });

  it('put each gateway replica’s frames under a subject token of its own', () => {
    const n = dataPlaneNames();
    expect(responseSubjectOf(n, 'r1', 'gw-a')).toBe('magus.res.gw-a.r1');
    expect(() => responseSubjectOf(n, 'r1', 'a.b')).toThrow(/replica/);
    expect(() => responseSubjectOf(n, 'r1', '*')).toThrow(/replica/);
    // What a bridge answers on: the request's own subject, in either form, and nothing else.
    expect(isResponseSubjectOf(n, 'magus.res.gw-a.r1', 'r1')).toBe(true);
    expect(isResponseSubjectOf(n, 'magus.res.r1', 'r1')).toBe(true);
    for (const bad of [
      'magus.res.gw-a.r2',
      'magus.res.xr1',
      'magus.res.a.b.r1',
      'magus.res.*.r1',
      'magus.res..r1',
      'other.gw-a.r1',
      't_x.magus.res.gw-a.r1',
      'magus.res.gw-a.>',
    ]) {
      expect([bad, isResponseSubjectOf(n, bad, 'r1')]).toEqual([bad, false]);
    }
    expect(isResponseSubjectOf(dataPlaneNames('T_X'), 't_x.magus.res.gw-a.r1', 'r1')).toBe(true);
  });

  it('put an instance’s frames under its pool and instance, before the request id', () => {
    const n = dataPlaneNames('T_X');
    const reply = responseSubjectOf(n, 'r1', 'gw-1');
    expect(instanceResponseSubjectOf(reply, 'r1', 'pool-a', 'pool-a-1-0a1b2c3d')).toBe('t_x.magus.res.gw-1.pool-a.pool-a-1-0a1b2c3d.r1');
    expect(() => instanceResponseSubjectOf(reply, 'r2', 'p', 'i')).toThrow(/request id/);
    expect(() => instanceResponseSubjectOf(reply, 'r1', 'p.q', 'i')).toThrow(/pool/);
    expect(() => instanceResponseSubjectOf(reply, 'r1', 'p', '*')).toThrow(/instance/);
  });

  it('reject names that would break subjects or make consumer names ambiguous', () => {
    expect(() => dataPlaneNames('a.b')).toThrow(/prefix/);
    expect(() => requestSubjectOf(dataPlaneNames(), 'a.b', 'i')).toThrow(/pool/);
    expect(() => consumerNameOf('a_b', 'c')).toThrow(/pool/);
    expect(() => responseSubjectOf(dataPlaneNames(), 'x.*')).toThrow(/request id/);
    expect(consumerNameOf('pool-a', 'inst-1')).toBe('pool-a_inst-1');
  });
});

import { encodeJson } from '../json';
import { dataPlaneNames, responseSubjectOf } from '../names';
import { parseInferenceRequest, seedFor } from './requests';

const names = dataPlaneNames('T_U');
const valid = {
  id: 'r-1',
  replyTo: responseSubjectOf(names, 'r-1', 'gw-a1'),
  deadline: 1_900_000_000_000,
  body: { model: 'm', messages: [{ role: 'user', content: 'hi' }], stream: true, max_tokens: 8 },
};

describe('parseInferenceRequest', () => {
  it('accepts a request of the shared contract', () => {
    expect(parseInferenceRequest(encodeJson(valid), names)).toEqual({ ok: true, req: valid });
  });

  it('served by its instance, a request that asks for it comes back with replyTo that instance’s subject; one that does not keeps its own', () => {
    const own = { pool: 'p', instance: 'p-1-0a1b2c3d' };
    const asks = { ...valid, instanceFrames: true };
    expect(parseInferenceRequest(encodeJson(asks), names, own)).toEqual({ ok: true, req: { ...asks, replyTo: 't_u.magus.res.gw-a1.p.p-1-0a1b2c3d.r-1' } });
    expect(parseInferenceRequest(encodeJson(valid), names, own)).toEqual({ ok: true, req: valid });
    // An invalid one's error frame goes where its frames would have.
    const invalid = parseInferenceRequest(encodeJson({ ...asks, body: { ...asks.body, messages: [] } }), names, own);
    expect(invalid).toMatchObject({ ok: false, replyTo: 't_u.magus.res.gw-a1.p.p-1-0a1b2c3d.r-1' });
  });

  it('accepts the older replyTo without a replica (requests queued before per-replica subjects)', () => {
    const old = { ...valid, replyTo: responseSubjectOf(names, 'r-1') };
    expect(old.replyTo).toBe('t_u.magus.res.r-1');
    expect(parseInferenceRequest(encodeJson(old), names)).toEqual({ ok: true, req: old });
  });

  it('accepts an embeddings request, checked against its own contract', () => {
    const embeddings = { ...valid, kind: 'embeddings', body: { model: 'm', input: ['a', 'b'], encoding_format: 'base64' } };
    expect(parseInferenceRequest(encodeJson(embeddings), names)).toEqual({ ok: true, req: embeddings });
    const bad = parseInferenceRequest(encodeJson({ ...embeddings, body: { model: 'm', input: [] } }), names);
    expect(bad).toMatchObject({ ok: false, problem: expect.stringMatching(/^body\.input: must be a string, a list of up to 256 strings/) as unknown });
    // A chat body under the embeddings kind is no embeddings request.
    expect(parseInferenceRequest(encodeJson({ ...valid, kind: 'embeddings' }), names)).toMatchObject({
      ok: false,
      problem: expect.stringMatching(/^body\.input/) as unknown,
    });
    expect(parseInferenceRequest(encodeJson({ ...valid, kind: 'poems' }), names)).toMatchObject({
      ok: false,
      problem: expect.stringMatching(/^kind/) as unknown,
    });
  });

  it('rejects what is not JSON, without a replyTo to answer on', () => {
    expect(parseInferenceRequest(new TextEncoder().encode('{'), names)).toEqual({ ok: false, problem: 'request is not JSON' });
  });

  it.each([
    ['a bad id', { id: 'a.b' }, /id/],
    ['a replyTo other than the response subject', { replyTo: 't_u.magus.res.other' }, /replyTo/],
    ["another request's replyTo", { replyTo: 't_u.magus.res.gw-a1.r-2' }, /replyTo/],
    ['a replyTo with two tokens before the id', { replyTo: 't_u.magus.res.gw.a1.r-1' }, /replyTo/],
    ["a replyTo outside the data plane's scope", { replyTo: 'magus.res.gw-a1.r-1' }, /replyTo/],
    ['no deadline', { deadline: 'soon' }, /deadline/],
    ['no messages', { body: { ...valid.body, messages: [] } }, /messages/],
    ['an unknown role', { body: { ...valid.body, messages: [{ role: 'function', content: 'x' }] } }, /role/],
    ['a bad max_tokens', { body: { ...valid.body, max_tokens: 0 } }, /max_tokens/],
  ])('rejects %s, keeping a usable replyTo for the error frame', (_what, change, problem) => {
    const parsed = parseInferenceRequest(encodeJson({ ...valid, ...change }), names);
    expect(parsed.ok).toBe(false);
    if (parsed.ok) return;
    expect(parsed.problem).toMatch(problem);
    expect(parsed.replyTo).toBe((change as { replyTo?: string }).replyTo ?? valid.replyTo);
  });

  it('never offers a wildcard replyTo', () => {
    const parsed = parseInferenceRequest(encodeJson({ ...valid, id: 'bad id', replyTo: 'magus.res.>' }), names);
    expect(parsed).toMatchObject({ ok: false, replyTo: undefined });
  });
});

describe('seedFor', () => {
  it('is a stable non-negative 31-bit integer per request id', () => {
    expect(seedFor('r-1')).toBe(seedFor('r-1'));
    expect(seedFor('r-1')).not.toBe(seedFor('r-2'));
    expect(seedFor('r-1')).toBeGreaterThanOrEqual(0);
    expect(seedFor('r-1')).toBeLessThan(2 ** 31);
  });
});

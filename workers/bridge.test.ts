import { dataPlaneNames, encodeJson, responseSubjectOf } from '../activities/nats/data-plane';
import { bridgeCommand, bridgeMetricsText, parseInferenceRequest, seedFor, type BridgeStats } from './bridge';

const names = dataPlaneNames('T_U');
const valid = {
  id: 'r-1',
  replyTo: responseSubjectOf(names, 'r-1'),
  deadline: 1_900_000_000_000,
  body: { model: 'm', messages: [{ role: 'user', content: 'hi' }], stream: true, max_tokens: 8 },
};

describe('parseInferenceRequest', () => {
  it('accepts a request of the shared contract', () => {
    expect(parseInferenceRequest(encodeJson(valid), names)).toEqual({ ok: true, req: valid });
  });

  it('rejects what is not JSON, without a replyTo to answer on', () => {
    expect(parseInferenceRequest(new TextEncoder().encode('{'), names)).toEqual({ ok: false, problem: 'request is not JSON' });
  });

  it.each([
    ['a bad id', { id: 'a.b' }, /id/],
    ['a replyTo other than the response subject', { replyTo: 't_u.magus.res.other' }, /replyTo/],
    ['no deadline', { deadline: 'soon' }, /deadline/],
    ['no messages', { body: { ...valid.body, messages: [] } }, /messages/],
    ['an unknown role', { body: { ...valid.body, messages: [{ role: 'tool', content: 'x' }] } }, /role/],
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

describe('bridgeCommand', () => {
  it('rejects missing or bad options before connecting anywhere', async () => {
    const err = jest.spyOn(process.stderr, 'write').mockImplementation(() => true);
    try {
      expect(await bridgeCommand(['--pool', 'p'])).toBe(1);
      expect(String(err.mock.calls.at(-1)?.[0])).toMatch(/--instance is required.*--engine must be an http\(s\) URL/s);
      expect(await bridgeCommand(['--pool', 'p', '--instance', 'i', '--engine', 'http://e:1', '--slots', '0'])).toBe(1);
      expect(String(err.mock.calls.at(-1)?.[0])).toMatch(/--slots must be an integer ≥ 1/);
      expect(await bridgeCommand(['--pool', 'p', '--instance', 'i', '--engine', 'http://e:1', '--colour', 'red'])).toBe(1);
      expect(String(err.mock.calls.at(-1)?.[0])).toMatch(/unknown option --colour/);
    } finally {
      err.mockRestore();
    }
  });
});

describe('bridgeMetricsText', () => {
  const stats = (pulled: number): BridgeStats => ({ pulled, acked: pulled, termed: 0, nakked: 0, redelivered: 0, errors: 0, resumed: 0, replayed: 0, superseded: 0, cancelled: 0, heartbeatsMissed: 0, inFlight: 0 });
  it('one family per metric, one series per bridge, Prometheus text', () => {
    const text = bridgeMetricsText([
      { pool: 'p', instance: 'a', stats: stats(3), health: { ok: true, problems: [], inFlight: 1, slots: 2 } },
      { pool: 'p', instance: 'b', stats: stats(5), health: { ok: false, problems: ['NATS disconnected'], inFlight: 0, slots: 1 } },
    ]);
    expect(text.match(/^# TYPE magus_bridge_pulled_total counter$/gm)).toHaveLength(1);
    expect(text).toContain('magus_bridge_pulled_total{pool="p",instance="a"} 3\nmagus_bridge_pulled_total{pool="p",instance="b"} 5\n');
    expect(text).toContain('magus_bridge_heartbeats_missed_total{pool="p",instance="a"} 0');
    expect(text).toContain('magus_bridge_healthy{pool="p",instance="b"} 0');
    expect(text).toContain('magus_bridge_in_flight{pool="p",instance="a"} 1');
    for (const line of text.trimEnd().split('\n')) expect(line).toMatch(/^(# (HELP|TYPE) magus_bridge_\w+ .+|magus_bridge_\w+\{pool="p",instance="[ab]"\} \d+)$/);
    expect(bridgeMetricsText([])).not.toMatch(/^magus_bridge_\w+\{/m); // no instances: families, no series
  });
});

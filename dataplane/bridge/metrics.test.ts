import { UsageTotals, type UsageRecord } from '../../shared/usage';
import { bridgeMetricsText, type BridgeStats } from './metrics';

describe('bridgeMetricsText', () => {
  const stats = (pulled: number): BridgeStats => ({
    pulled,
    acked: pulled,
    termed: 0,
    nakked: 0,
    redelivered: 0,
    errors: 0,
    resumed: 0,
    continued: 0,
    resumeFailed: 0,
    resumedAcrossGap: 0,
    replayed: 0,
    superseded: 0,
    adopted: 0,
    handedBack: 0,
    cancelled: 0,
    heartbeatsMissed: 0,
    framesResent: 2,
    framesUnstored: 0,
    usageRecorded: 0,
    usageUnrecorded: 0,
    inFlight: 0,
  });
  it('one family per metric, one series per bridge, Prometheus text', () => {
    const text = bridgeMetricsText([
      { pool: 'p', instance: 'a', stats: stats(3), health: { ok: true, problems: [], inFlight: 1, slots: 2 } },
      { pool: 'p', instance: 'b', stats: stats(5), health: { ok: false, problems: ['NATS disconnected'], inFlight: 0, slots: 1 } },
    ]);
    expect(text.match(/^# TYPE magus_bridge_pulled_total counter$/gm)).toHaveLength(1);
    expect(text).toContain('magus_bridge_pulled_total{pool="p",instance="a"} 3\nmagus_bridge_pulled_total{pool="p",instance="b"} 5\n');
    expect(text).toContain('magus_bridge_heartbeats_missed_total{pool="p",instance="a"} 0');
    expect(text).toContain('magus_bridge_resume_failed_total{pool="p",instance="b"} 0');
    expect(text).toContain('magus_bridge_frames_resent_total{pool="p",instance="a"} 2');
    expect(text).toContain('magus_bridge_healthy{pool="p",instance="b"} 0');
    expect(text).toContain('magus_bridge_in_flight{pool="p",instance="a"} 1');
    for (const line of text.trimEnd().split('\n'))
      expect(line).toMatch(/^(# (HELP|TYPE) magus_(bridge|usage)_\w+ .+|magus_bridge_\w+\{pool="p",instance="[ab]"\} \d+)$/);
    expect(bridgeMetricsText([])).not.toMatch(/^magus_bridge_\w+\{/m); // no instances: families, no series
  });

  it("the ledger's tokens: one series per key, model and kind, labels escaped", () => {
    const record = (key: string, model: string, prompt: number, cached: number, completion: number): UsageRecord => ({
      id: `r${prompt}`,
      key,
      model,
      kind: 'chat',
      start: 0,
      end: 1,
      outcome: 'completed',
      tokens: { prompt, cached, completion, total: prompt + completion },
      reported: true,
    });
    const totals = new UsageTotals();
    totals.add(record('team-a/chat', 'default/demo', 10, 4, 7));
    totals.add(record('team-a/chat', 'default/demo', 5, 0, 1));
    totals.add(record('team-a/chat', 'default/demo', 1, 1, 1));
    totals.add(record('odd "key"\\', 'default/demo', 2, 0, 3));
    const text = bridgeMetricsText([{ pool: 'p', instance: 'a', stats: stats(1), health: { ok: true, problems: [], inFlight: 0, slots: 1 } }], totals);
    expect(text.match(/^magus_usage_tokens_total\{.*$/gm)).toEqual([
      'magus_usage_tokens_total{key="team-a/chat",model="default/demo",kind="prompt"} 16',
      'magus_usage_tokens_total{key="team-a/chat",model="default/demo",kind="cached"} 5',
      'magus_usage_tokens_total{key="team-a/chat",model="default/demo",kind="completion"} 9',
      'magus_usage_tokens_total{key="odd \\"key\\"\\\\",model="default/demo",kind="prompt"} 2',
      'magus_usage_tokens_total{key="odd \\"key\\"\\\\",model="default/demo",kind="cached"} 0',
      'magus_usage_tokens_total{key="odd \\"key\\"\\\\",model="default/demo",kind="completion"} 3',
    ]);
  });
});

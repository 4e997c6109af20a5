/**
 * Determinism guard: a recorded `modelPipeline` history (test/histories, refreshed with
 * MAGUS_RECORD_HISTORY, see test/pipeline.int.test.ts) replays against today's workflow code,
 * and the same history with one command altered is rejected as non-deterministic.
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { temporal } from '@temporalio/proto';
import { DefaultLogger, Runtime, Worker } from '@temporalio/worker';

Runtime.install({ logger: new DefaultLogger('WARN') });

// The file is the protobuf object's own JSON (fetchHistory() → JSON.stringify), so fromObject reads it back.
const { History } = temporal.api.history.v1;

const workflowsPath = require.resolve('../workflows');
const raw = JSON.parse(readFileSync(join(__dirname, 'histories', 'model-pipeline-ready.json'), 'utf8')) as {
  events: { eventType: string; activityTaskScheduledEventAttributes?: { activityType?: { name?: string } } }[];
};

test('the recorded model pipeline history replays', async () => {
  expect(raw.events.some((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === 'publishModel')).toBe(true);
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(raw), 'model/default/replay')).resolves.toBeUndefined();
}, 60_000);

test('an altered history is a determinism violation', async () => {
  const altered = structuredClone(raw);
  const first = altered.events.find((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === 'resolveSource');
  first!.activityTaskScheduledEventAttributes!.activityType!.name = 'resolveSourceRenamed';
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(altered), 'model/default/replay-altered')).rejects.toMatchObject({
    name: 'DeterminismViolationError',
  });
}, 60_000);

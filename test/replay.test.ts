/**
 * Determinism guard: the recorded histories (test/histories, recorded by the integration tests
 * that call `recordHistory`, `scripts/record-histories`) replay against today's workflow code, and
 * a history with one command altered is rejected as non-deterministic. The histories of the first
 * release's baseline carry no patch marker; a later change to a workflow's commands adds a patch,
 * a history recorded from it (its marker listed below) and keeps the older ones replaying
 * (workflows/README.md, "Changing workflow code").
 */
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { temporal } from '@temporalio/proto';
import { DefaultLogger, Runtime, Worker } from '@temporalio/worker';

Runtime.install({ logger: new DefaultLogger('WARN') });

// The file is the protobuf object's own JSON (fetchHistory() → JSON.stringify), so fromObject reads it back.
const { History } = temporal.api.history.v1;
const workflowsPath = require.resolve('../workflows');
const historiesDir = join(__dirname, 'histories');

interface RecordedHistory {
  events: {
    eventType: string;
    activityTaskScheduledEventAttributes?: { activityType?: { name?: string }; input?: { payloads?: { data?: string }[] } };
    activityTaskStartedEventAttributes?: { attempt?: number };
    activityTaskCompletedEventAttributes?: { result?: { payloads?: { data?: string }[] } };
    workflowExecutionSignaledEventAttributes?: { signalName?: string };
    signalExternalWorkflowExecutionInitiatedEventAttributes?: { signalName?: string; workflowExecution?: { workflowId?: string } };
    markerRecordedEventAttributes?: { markerName?: string; details?: Record<string, { payloads?: { data?: string }[] }> };
  }[];
}

const read = (name: string): RecordedHistory => JSON.parse(readFileSync(join(historiesDir, `${name}.json`), 'utf8')) as RecordedHistory;
const countOf = (h: RecordedHistory, type: string) => h.events.filter((e) => e.eventType === type).length;
const scheduledOf = (h: RecordedHistory, activity: string) => h.events.filter((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === activity);
const signalsOf = (h: RecordedHistory) =>
  h.events.map((e) => e.workflowExecutionSignaledEventAttributes?.signalName).filter((s): s is string => s !== undefined);
const lastEvent = (h: RecordedHistory) => h.events.at(-1)?.eventType;
/** A marker's first payload, decoded (its JSON). */
const markerData = (e: RecordedHistory['events'][number], key: string): unknown =>
  JSON.parse(Buffer.from(e.markerRecordedEventAttributes?.details?.[key]?.payloads?.[0]?.data ?? '', 'base64').toString('utf8'));
/** The patch ids a history recorded (`core_patch` markers). */
const patchesOf = (h: RecordedHistory): string[] =>
  h.events.filter((e) => e.markerRecordedEventAttributes?.markerName === 'core_patch').map((e) => (markerData(e, 'patch-data') as { id: string }).id);
/** The local activities a history ran (`core_local_activity` markers name their type). */
const localActivitiesOf = (h: RecordedHistory): string[] =>
  h.events
    .filter((e) => e.markerRecordedEventAttributes?.markerName === 'core_local_activity')
    .map((e) => (markerData(e, 'data') as { activity_type: string }).activity_type);
/** The first input of an activity's first scheduling. */
const inputOf = (h: RecordedHistory, activity: string): unknown =>
  JSON.parse(Buffer.from(scheduledOf(h, activity)[0]?.activityTaskScheduledEventAttributes?.input?.payloads?.[0]?.data ?? '', 'base64').toString('utf8'));

/** The signals a pool takes: none per conversation (ARCHITECTURE.md, "Data plane", "The entry-lease protocol"). */
const POOL_SIGNALS = new Set(['demand', 'resourceChanged', 'modelPublished']);

/**
 * Each recorded history: the patches it recorded (none in the baseline) and the path it shows, so
 * a history re-recorded from a test that no longer takes that path fails here rather than
 * replaying something else.
 */
const histories: [name: string, patches: string[], tookThePath: (h: RecordedHistory) => boolean][] = [
  // test/pipeline.int.test.ts: a pipeline that published its model (and told its pool).
  ['model-pipeline-ready', [], (h) => scheduledOf(h, 'publishModel').length === 1],
  // A GGUF repository as the source: one file chosen, transferred, converted (copied) and published as it is.
  ['model-pipeline-gguf-source', [], (h) => ['transferFile', 'convertArtifact', 'publishModel'].every((a) => scheduledOf(h, a).length === 1)],
  // A resolve that failed and was retried: the activity's `activityFailed` signal, its phase a search attribute.
  ['model-pipeline-retried', [], (h) => signalsOf(h).includes('activityFailed') && countOf(h, 'EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES') >= 2],
  // test/pipeline-crash.int.test.ts: its worker SIGKILLed mid-transfer: a workflow task timed out, transfers resumed on later attempts.
  [
    'model-pipeline-resumed',
    [],
    (h) => countOf(h, 'EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT') >= 1 && h.events.some((e) => (e.activityTaskStartedEventAttributes?.attempt ?? 1) > 1),
  ],
  // test/controller.int.test.ts: a `Model`'s pipeline, its status written back (a local activity), its pool told when it published.
  [
    'model-pipeline-resource',
    [],
    (h) =>
      localActivitiesOf(h).includes('writeModelStatus') &&
      h.events.some((e) => e.signalExternalWorkflowExecutionInitiatedEventAttributes?.signalName === 'modelPublished'),
  ],
  // Since model-status-activity: the status written by activities, never a local activity (workflows/resource-status.ts, `statusWrite`).
  [
    'model-pipeline-status-written',
    ['model-status-activity'],
    (h) => scheduledOf(h, 'writeModelStatus').length >= 2 && localActivitiesOf(h).length === 0 && scheduledOf(h, 'publishModel').length >= 1,
  ],
  // A `Model` deleted: the pipeline cancelled, forgetting the model.
  ['model-pipeline-resource-deleted', [], (h) => localActivitiesOf(h).includes('writeModelStatus') && signalsOf(h).includes('cancel')],
  // A pool sized by a `Dllama` that was scaled and deleted, its status written back.
  ['pool-resource-scaled', [], (h) => localActivitiesOf(h).includes('writeDllamaStatus') && signalsOf(h).filter((s) => s === 'resourceChanged').length >= 2],
  // The same since pool-status-activity: the status written by activities, never a local activity.
  [
    'pool-status-written',
    ['pool-status-activity', 'pool-restart-reports'],
    (h) => scheduledOf(h, 'writeDllamaStatus').length >= 2 && localActivitiesOf(h).length === 0 && scheduledOf(h, 'watchLoad').length >= 1,
  ],
  // test/serving.int.test.ts: a pool serving conversations: an instance, its reconciler, the view it publishes.
  ['pool-serving', [], (h) => ['createInstance', 'watchInstance', 'watchLoad', 'writePool'].every((a) => scheduledOf(h, a).length >= 1)],
  // Scaled up for demand, down to zero once its entries were gone, and up again.
  ['pool-scaled-to-zero-and-back', [], (h) => scheduledOf(h, 'createInstance').length >= 2 && scheduledOf(h, 'destroyInstance').length >= 1],
  // test/serving-entries.int.test.ts: 50,000 live conversations counted, then the run continued as new.
  ['pool-continued', [], (h) => lastEvent(h) === 'EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW'],
  // test/serving-withdraw.int.test.ts: demand that clients took back while instances started; the instances started for it stopped.
  ['pool-demand-withdrawn', [], (h) => signalsOf(h).filter((s) => s === 'demand').length >= 2 && scheduledOf(h, 'destroyInstance').length >= 1],
  // test/pool-runs.int.test.ts: a carried instance whose worker's queue nobody polls: its owner asked (alive, then gone), the instance dropped and replaced, started with the pool's leases per instance.
  [
    'pool-owner-confirmed',
    [],
    (h) =>
      scheduledOf(h, 'workerGone').length >= 2 &&
      scheduledOf(h, 'destroyInstance').length >= 1 &&
      (inputOf(h, 'createInstance') as { leases?: number }).leases === 4,
  ],
  // The same since pool-unique-instance-ids: the new instance named <model>-<n>-<tag>, so two namespaces' models of one name never share an instance id.
  [
    'pool-instance-ids-unique',
    ['pool-restart-reports', 'pool-unique-instance-ids'],
    (h) => /-101-[0-9a-f]{8}$/.test((inputOf(h, 'createInstance') as { instance?: string }).instance ?? ''),
  ],
  // test/serving-errors.int.test.ts: a model whose instances can never start: failed starts backing off, then one at once when the model is published.
  ['pool-start-backoff', [], (h) => scheduledOf(h, 'createInstance').length >= 3 && signalsOf(h).includes('modelPublished')],
  // test/serving-workers.int.test.ts: a watcher per instance on its worker's queue; that worker gone, the instance replaced on the other.
  ['pool-watch-owner-gone', [], (h) => scheduledOf(h, 'watchInstance').length >= 2 && scheduledOf(h, 'createInstance').length >= 2],
  // test/serving.int.test.ts: an engine killed and restarted in place; its watcher reported the stop (and the restart's end) and was started again.
  [
    'pool-restart-reported',
    ['pool-restart-reports'],
    (h) => scheduledOf(h, 'watchInstance').length >= 2 && (inputOf(h, 'watchInstance') as { known?: unknown }).known !== undefined,
  ],
  // test/serving-rollout.int.test.ts: a cold start whose view listed the instance starting (pool-view-starting); a new model revision (modelPublished with its revision): a new instance started beside the old, the old one drained (its reconciler told of it) and destroyed.
  [
    'pool-rolled-out',
    ['pool-unique-instance-ids', 'pool-view-starting', 'pool-restart-reports'],
    (h) =>
      signalsOf(h).includes('modelPublished') &&
      scheduledOf(h, 'createInstance').length >= 2 &&
      scheduledOf(h, 'destroyInstance').length >= 1 &&
      scheduledOf(h, 'watchLoad').some(
        (e) =>
          (
            JSON.parse(Buffer.from(e.activityTaskScheduledEventAttributes?.input?.payloads?.[0]?.data ?? '', 'base64').toString('utf8')) as {
              draining?: string[];
            }
          ).draining !== undefined,
      ),
  ],
  // test/serving-scale-on-load.int.test.ts: a pool that scales on load (pool-scale-on-load): grown by a burst's queue, shrunk back once it was over; its reconciler and its view say `load`.
  [
    'pool-scaled-on-load',
    ['pool-scale-on-load', 'pool-unique-instance-ids', 'pool-view-starting', 'pool-restart-reports'],
    (h) =>
      scheduledOf(h, 'createInstance').length >= 2 &&
      scheduledOf(h, 'destroyInstance').length >= 1 &&
      (inputOf(h, 'watchLoad') as { scaleOn?: string }).scaleOn === 'load' &&
      (inputOf(h, 'writePool') as { scalesOn?: string }).scalesOn === 'load',
  ],
  // The same test since keys carry their pool: the reconciler's reports say the pool's entries as the NATS server counts them (`live`), not per instance.
  [
    'pool-counted-by-server',
    ['pool-scale-on-load', 'pool-unique-instance-ids', 'pool-view-starting', 'pool-restart-reports'],
    (h) =>
      scheduledOf(h, 'createInstance').length >= 2 &&
      h.events.some((e) => {
        const data = e.activityTaskCompletedEventAttributes?.result?.payloads?.[0]?.data;
        return data !== undefined && typeof (JSON.parse(Buffer.from(data, 'base64').toString('utf8')) as { live?: unknown } | null)?.live === 'number';
      }),
  ],
  // test/serving.int.test.ts, before sessions were started late (sessionStart's delay): a session asleep on a timer until its entry's expiry.
  ['session-started', [], (h) => countOf(h, 'EVENT_TYPE_TIMER_STARTED') >= 1],
  // Its end: the TTL passed without a turn, the entry deleted, the session completed.
  ['session-expired', [], (h) => lastEvent(h) === 'EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED'],
  // test/serving-entries.int.test.ts: started with a delay to its lease's end (sessionStart), looked once and ended: no timer, ≤ 7 events.
  [
    'session-delayed',
    [],
    (h) => lastEvent(h) === 'EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED' && countOf(h, 'EVENT_TYPE_TIMER_STARTED') === 0 && h.events.length <= 7,
  ],
  // test/serving-entries.int.test.ts: renewed twice by turns (compare-and-swap by gateways), then expired: ≤ 24 events.
  ['session-renewed', [], (h) => lastEvent(h) === 'EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED' && h.events.length <= 24],
];

test.each(histories)(
  'the recorded %s history replays (patches %j)',
  async (name, patches, tookThePath) => {
    const history = read(name);
    expect(patchesOf(history)).toEqual(patches);
    expect(tookThePath(history)).toBe(true);
    // Pools and sessions record no event per conversation: a session takes no signal or update, a pool only these signals.
    if (name.startsWith('session-')) expect([signalsOf(history), countOf(history, 'EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED')]).toEqual([[], 0]);
    if (name.startsWith('pool-')) expect(signalsOf(history).filter((s) => !POOL_SIGNALS.has(s))).toEqual([]);
    await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(history), `${name}/replay`)).resolves.toBeUndefined();
  },
  60_000,
);

test('every recorded history is replayed above', () => {
  const files = readdirSync(historiesDir)
    .filter((f) => f.endsWith('.json'))
    .map((f) => f.slice(0, -'.json'.length));
  expect(files.sort()).toEqual(histories.map(([name]) => name).sort());
});

test('an altered history is a determinism violation', async () => {
  const altered = structuredClone(read('model-pipeline-ready'));
  const first = altered.events.find((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === 'resolveSource');
  first!.activityTaskScheduledEventAttributes!.activityType!.name = 'resolveSourceRenamed';
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(altered), 'model/default/replay-altered')).rejects.toMatchObject({
    name: 'DeterminismViolationError',
  });
}, 60_000);

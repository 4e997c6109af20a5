/**
 * Determinism guard: recorded histories (test/histories, refreshed with MAGUS_RECORD_HISTORIES,
 * see test/README.md) replay against today's workflow code — a `modelPipeline`
 * (test/pipeline.int.test.ts), a `dllamaPool` whose instance's worker went away
 * (test/serving-workers.int.test.ts) and a `session` started cold (test/serving.int.test.ts) —
 * and a history with one command altered is rejected as non-deterministic.
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

test('the recorded pool history (probes on the owner’s queue, the owner gone, a replacement) replays', async () => {
  const pool = JSON.parse(readFileSync(join(__dirname, 'histories', 'pool-owner-gone.json'), 'utf8')) as typeof raw;
  expect(pool.events.some((e) => e.eventType === 'EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT')).toBe(true);
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(pool), 'pool/default/replay')).resolves.toBeUndefined();
}, 60_000);

test('the recorded session history (update-with-start, a lease) replays', async () => {
  const session = JSON.parse(readFileSync(join(__dirname, 'histories', 'session-cold-start.json'), 'utf8')) as typeof raw;
  expect(session.events.some((e) => e.eventType === 'EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED')).toBe(true);
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(session), 'session/replay')).resolves.toBeUndefined();
}, 60_000);

/**
 * Histories of the `Model`/`Dllama` resource paths (test/controller.int.test.ts): a pipeline
 * whose resource changed spec once (status written back, the `model-resource-status` patch), one
 * whose resource was deleted (cancel with forget), and a pool sized by a Dllama that was scaled
 * up, down and deleted (`pool-resource-status`).
 */
test('the recorded Model pipeline tells its pool when it publishes (`model-published-notifies-pool`)', () => {
  const history = JSON.parse(readFileSync(join(__dirname, 'histories', 'model-pipeline-resource.json'), 'utf8')) as { events: { signalExternalWorkflowExecutionInitiatedEventAttributes?: { signalName?: string; workflowExecution?: { workflowId?: string } } }[] };
  const notes = history.events.map((e) => e.signalExternalWorkflowExecutionInitiatedEventAttributes).filter((a) => a?.signalName === 'modelPublished');
  expect(notes.length).toBeGreaterThanOrEqual(1);
  expect(notes[0]?.workflowExecution?.workflowId).toMatch(/^pool\/test-controller-[0-9a-f]+\/tiny$/);
});

test.each([
  ['model-pipeline-resource', 'writeModelStatus'],
  ['model-pipeline-resource-deleted', 'writeModelStatus'],
  ['pool-resource-scaled', 'writeDllamaStatus'],
])('the recorded %s history replays', async (name, activity) => {
  interface Marked {
    events: { eventType: string; markerRecordedEventAttributes?: { markerName?: string; details?: { data?: { payloads?: { data?: string }[] } } } }[];
  }
  const history = JSON.parse(readFileSync(join(__dirname, 'histories', `${name}.json`), 'utf8')) as Marked;
  // Status writes are local activities: markers whose data name the activity type.
  const localActivities = history.events
    .filter((e) => e.markerRecordedEventAttributes?.markerName === 'core_local_activity')
    .map((e) => (JSON.parse(Buffer.from(e.markerRecordedEventAttributes?.details?.data?.payloads?.[0]?.data ?? '', 'base64').toString('utf8')) as { activity_type: string }).activity_type);
  expect(localActivities).toContain(activity);
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(history), `${name}/replay`)).resolves.toBeUndefined();
}, 60_000);

test('the recorded session history (a retry after NoCapacity, then a lease: `session-retry-clears-failure`) replays', async () => {
  const session = JSON.parse(readFileSync(join(__dirname, 'histories', 'session-retry-after-no-capacity.json'), 'utf8')) as typeof raw;
  expect(session.events.filter((e) => e.eventType === 'EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED')).toHaveLength(2);
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(session), 'session/replay-retry')).resolves.toBeUndefined();
}, 60_000);

test('the recorded pool history (failed starts backing off: `pool-start-backoff`) replays', async () => {
  const pool = JSON.parse(readFileSync(join(__dirname, 'histories', 'pool-start-backoff.json'), 'utf8')) as typeof raw;
  expect(pool.events.filter((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === 'createInstance').length).toBeGreaterThanOrEqual(3);
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(pool), 'pool/replay-backoff')).resolves.toBeUndefined();
}, 60_000);

/** The patch ids a history recorded (`core_patch` markers). */
function patchesOf(history: { events: { markerRecordedEventAttributes?: { markerName?: string; details?: Record<string, { payloads?: { data?: string }[] }> } }[] }): string[] {
  return history.events
    .filter((e) => e.markerRecordedEventAttributes?.markerName === 'core_patch')
    .map((e) => (JSON.parse(Buffer.from(e.markerRecordedEventAttributes?.details?.['patch-data']?.payloads?.[0]?.data ?? '', 'base64').toString('utf8')) as { id: string }).id);
}

test.each([
  // A session whose cold start was abandoned (`withdraw`), then served on a retry (`session-withdraw`).
  ['session-withdrawn', 'session-withdraw', 'withdraw'],
  // A pool whose waiting sessions withdrew (`pool-release-withdraws`), publishing whether it can grow (`pool-publish-growable`).
  ['pool-withdrawn-requests', 'pool-release-withdraws', 'leaseReleased'],
  // A pipeline whose resolve failed and was retried (`activityFailed` signals), its phase a search attribute.
  ['model-pipeline-retried', 'model-phase-search-attribute', 'activityFailed'],
  // A session whose id names its model, with its kind, model and phase as search attributes.
  ['session-cold-start-named', 'session-search-attributes', 'leaseGranted'],
  // A pool serving it, its phase a search attribute.
  ['pool-serving', 'pool-phase-search-attribute', 'leaseRequested'],
  // A session whose first turn was served from the view, asking again while it waited for room, then granted.
  ['session-preferred-reask', 'session-preferred-reask', 'leaseGranted'],
])('the recorded %s history replays (patch %s)', async (name, patch, signal) => {
  const history = JSON.parse(readFileSync(join(__dirname, 'histories', `${name}.json`), 'utf8')) as {
    events: (Parameters<typeof patchesOf>[0]['events'][number] & { workflowExecutionSignaledEventAttributes?: { signalName?: string } })[];
  };
  expect(patchesOf(history)).toContain(patch);
  expect(history.events.some((e) => e.workflowExecutionSignaledEventAttributes?.signalName === signal)).toBe(true);
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(history), `${name}/replay`)).resolves.toBeUndefined();
}, 60_000);

test('the recorded pipeline of a GGUF repository (`model-gguf-source`: one file chosen, published as it is) replays', async () => {
  const history = JSON.parse(readFileSync(join(__dirname, 'histories', 'model-pipeline-gguf-source.json'), 'utf8')) as { events: (Parameters<typeof patchesOf>[0]['events'][number] & (typeof raw)['events'][number])[] };
  expect(patchesOf(history)).toContain('model-gguf-source');
  const scheduled = (name: string) => history.events.filter((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === name).length;
  expect([scheduled('transferFile'), scheduled('convertArtifact'), scheduled('publishModel')]).toEqual([1, 1, 1]);
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(history), 'model/replay-gguf-source')).resolves.toBeUndefined();
}, 60_000);

test('the recorded pool history (a watcher per instance on its worker’s queue, that worker gone: `pool-watch-instances`) replays', async () => {
  const pool = JSON.parse(readFileSync(join(__dirname, 'histories', 'pool-watch-owner-gone.json'), 'utf8')) as { events: (Parameters<typeof patchesOf>[0]['events'][number] & (typeof raw)['events'][number])[] };
  expect(patchesOf(pool)).toContain('pool-watch-instances');
  const scheduled = (name: string) => pool.events.filter((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === name).length;
  expect(scheduled('watchInstance')).toBeGreaterThanOrEqual(2); // the first instance's, then its replacement's
  expect(scheduled('describeInstance')).toBe(0); // no probe loop in the workflow
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(pool), 'pool/replay-watch')).resolves.toBeUndefined();
}, 60_000);

/** Paths each workflow type takes over its life (issue: versioned workflows), recorded by scripts/record-histories. */
test.each([
  // Its worker SIGKILLed three times mid-transfer (test/pipeline-crash.int.test.ts): a workflow task timed out, transfers resumed on later attempts.
  ['model-pipeline-resumed', (h: RecordedHistory) => h.events.some((e) => e.eventType === 'EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT') && h.events.some((e) => (e.activityTaskStartedEventAttributes?.attempt ?? 1) > 1)],
  // Scaled up for a conversation, down to zero when idle (its instance destroyed), and up again.
  ['pool-scaled-to-zero-and-back', (h: RecordedHistory) => h.events.filter((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === 'createInstance').length >= 2 && h.events.some((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === 'destroyInstance')],
  // Expired after its TTL: released its lease and completed.
  ['session-expired', (h: RecordedHistory) => h.events.some((e) => e.eventType === 'EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED')],
])('the recorded %s history replays', async (name, tookThePath) => {
  const history = JSON.parse(readFileSync(join(__dirname, 'histories', `${name}.json`), 'utf8')) as RecordedHistory;
  expect(tookThePath(history)).toBe(true);
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(history), `${name}/replay`)).resolves.toBeUndefined();
}, 60_000);

/** The pool under load (test/pool-runs.int.test.ts): each history, the patches it took and the path it shows. */
test.each([
  // A busy run that continued as new at 250 events, once its grants were delivered, publishing lease counts at most every 5 s.
  ['pool-continued', ['pool-shorter-runs', 'pool-grants-before-continue', 'pool-view-throttle'], (h: RecordedHistory) => h.events.at(-1)?.eventType === 'EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW'],
  // The next run: its carried instance watched on its worker's queue, nothing described inline.
  ['pool-carried-watch', ['pool-carried-watch'], (h: RecordedHistory) => scheduledOf(h, 'watchInstance') >= 1 && scheduledOf(h, 'describeInstance') === 0],
  // A run asked for leases without pause: once due, it stopped granting and continued as new with the leases it gave carried.
  ['pool-quiesced', ['pool-quiesce-before-continue'], (h: RecordedHistory) => h.events.at(-1)?.eventType === 'EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW' && carriedGrants(h) > 0],
  // The next run: it sent the grants it was handed before anything else.
  ['pool-carried-grants', ['pool-quiesce-before-continue'], (h: RecordedHistory) => h.events.some((e) => e.eventType === 'EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED')],
  // A watcher nobody took: its owner asked (alive, then gone), the instance destroyed and replaced.
  ['pool-owner-confirmed', ['pool-owner-confirm'], (h: RecordedHistory) => scheduledOf(h, 'workerGone') >= 2 && scheduledOf(h, 'destroyInstance') >= 1 && scheduledOf(h, 'createInstance') >= 1],
])('the recorded %s history replays (patches %j)', async (name, patches, tookThePath) => {
  const history = JSON.parse(readFileSync(join(__dirname, 'histories', `${name}.json`), 'utf8')) as RecordedHistory & Parameters<typeof patchesOf>[0];
  for (const patch of patches) expect(patchesOf(history)).toContain(patch);
  expect(tookThePath(history)).toBe(true);
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(history), `${name}/replay`)).resolves.toBeUndefined();
}, 60_000);

/** How many grants a run that continued as new handed to the next one (its carry, the second argument). */
const carriedGrants = (h: RecordedHistory) => {
  const data = h.events.at(-1)?.workflowExecutionContinuedAsNewEventAttributes?.input?.payloads?.[1]?.data;
  return data ? ((JSON.parse(Buffer.from(data, 'base64').toString('utf8')) as { grants?: unknown[] }).grants?.length ?? 0) : 0;
};
const scheduledOf = (h: RecordedHistory, activity: string) => h.events.filter((e) => e.activityTaskScheduledEventAttributes?.activityType?.name === activity).length;

interface RecordedHistory {
  events: {
    eventType: string;
    activityTaskScheduledEventAttributes?: { activityType?: { name?: string } };
    activityTaskStartedEventAttributes?: { attempt?: number };
    workflowExecutionContinuedAsNewEventAttributes?: { input?: { payloads?: { data?: string }[] } };
  }[];
}

/**
 * The entry-lease protocol (`pool-entry-leases`; sessions of it are marked by their input, DESIGN.md
 * "Control plane"): each history, and the path it shows — never a signal or update for a
 * conversation in a pool, never one in a session.
 */
const countOf = (h: RecordedHistory, type: string) => h.events.filter((e) => e.eventType === type).length;
test.each([
  // A pool serving conversations (test/serving.int.test.ts): instances, the reconciler, the view.
  ['pool-entry-serving', (h: RecordedHistory) => scheduledOf(h, 'watchLoad') >= 1 && scheduledOf(h, 'writePool') >= 1],
  // Scaled up for demand, down to zero when its entries were gone, and up again.
  ['pool-entry-scaled-to-zero-and-back', (h: RecordedHistory) => scheduledOf(h, 'createInstance') >= 2 && scheduledOf(h, 'destroyInstance') >= 1],
  // 50,000 live conversations counted, then a run continued as new (test/serving-entries.int.test.ts).
  ['pool-entry-continued', (h: RecordedHistory) => h.events.at(-1)?.eventType === 'EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW'],
  // Demand that clients took back while instances started (test/serving-withdraw.int.test.ts).
  ['pool-entry-demand-withdrawn', (h: RecordedHistory) => countOf(h, 'EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED') >= 2 && scheduledOf(h, 'destroyInstance') >= 1],
  // A carried instance whose worker's queue nobody polls: its owner asked, then dropped and replaced (test/pool-runs.int.test.ts).
  ['pool-entry-owner-confirmed', (h: RecordedHistory) => scheduledOf(h, 'workerGone') >= 2 && scheduledOf(h, 'destroyInstance') >= 1 && scheduledOf(h, 'createInstance') >= 1],
  // The same, with instances started with the pool's leases per instance (`pool-instance-leases`).
  ['pool-entry-instance-leases', (h: RecordedHistory) => patchesOf(h as Parameters<typeof patchesOf>[0]).includes('pool-instance-leases') && scheduledOf(h, 'createInstance') >= 1],
  // A session that watched its entry, renewed twice by turns, then expired it (≤ 24 events).
  ['session-entry-renewed', (h: RecordedHistory) => h.events.at(-1)?.eventType === 'EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED' && h.events.length <= 24],
  // A session that lived one TTL of a served conversation (test/serving.int.test.ts), and its end.
  ['session-entry', (h: RecordedHistory) => countOf(h, 'EVENT_TYPE_TIMER_STARTED') >= 1],
  ['session-entry-expired', (h: RecordedHistory) => h.events.at(-1)?.eventType === 'EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED'],
])('the recorded %s history (entry leases) replays', async (name, tookThePath) => {
  const history = JSON.parse(readFileSync(join(__dirname, 'histories', `${name}.json`), 'utf8')) as RecordedHistory & Parameters<typeof patchesOf>[0];
  // A pool started with a carry of the protocol takes it without a patch check (pool-runs starts one so).
  if (name.startsWith('pool-') && name !== 'pool-entry-owner-confirmed' && name !== 'pool-entry-instance-leases') expect(patchesOf(history)).toContain('pool-entry-leases');
  const signals = history.events.map((e) => (e as { workflowExecutionSignaledEventAttributes?: { signalName?: string } }).workflowExecutionSignaledEventAttributes?.signalName).filter(Boolean);
  expect(signals.filter((s) => s === 'leaseRequested' || s === 'leaseReleased' || s === 'touch')).toEqual([]);
  expect(countOf(history, 'EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED')).toBe(0);
  expect(tookThePath(history)).toBe(true);
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(history), `${name}/replay`)).resolves.toBeUndefined();
}, 60_000);

/**
 * An old pool's run taken over by today's code (test/protocol-upgrade.int.test.ts: the old
 * commit's worker and gateway, then today's): its instance lost with the old worker, the
 * old-protocol sessions leasing it are granted another (`pool-legacy-regrant`).
 */
test('the recorded pool-entry-legacy-regrant history replays', async () => {
  const history = JSON.parse(readFileSync(join(__dirname, 'histories', 'pool-entry-legacy-regrant.json'), 'utf8')) as RecordedHistory & Parameters<typeof patchesOf>[0];
  expect(patchesOf(history)).toEqual(expect.arrayContaining(['pool-entry-leases', 'pool-legacy-regrant']));
  expect(countOf(history, 'EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED')).toBeGreaterThanOrEqual(6);
  await expect(Worker.runReplayHistory({ workflowsPath }, History.fromObject(history), 'pool-entry-legacy-regrant/replay')).resolves.toBeUndefined();
}, 60_000);


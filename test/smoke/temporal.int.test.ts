import { Worker } from '@temporalio/worker';
import { temporal } from '@temporalio/proto';
import * as activities from './activities';
import { smokeWorkflow } from './workflows';
import { isolation, temporalClient, temporalWorkerConnection } from '../harness';

const EventType = temporal.api.enums.v1.EventType;

test('a workflow with an activity and a timer runs on the Temporal dev server', async () => {
  const iso = isolation();
  const { client, connection } = await temporalClient();
  const workerConnection = await temporalWorkerConnection();
  try {
    const worker = await Worker.create({
      connection: workerConnection,
      taskQueue: iso.taskQueue,
      workflowsPath: require.resolve('./workflows'),
      activities,
    });
    const workflowId = `smoke-${iso.id}`;
    const started = Date.now();
    const result = await worker.runUntil(
      client.workflow.execute(smokeWorkflow, { taskQueue: iso.taskQueue, workflowId, args: [{ name: 'magus', timerMs: 1500 }] }),
    );
    expect(result).toBe('hello magus from activity greet after 1500ms');
    // The timer is real: the server fired it, not a time-skipping test environment.
    expect(Date.now() - started).toBeGreaterThanOrEqual(1500);

    const history = await client.workflow.getHandle(workflowId).fetchHistory();
    const types = (history.events ?? []).map((e) => e.eventType);
    expect(types).toContain(EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED);
    expect(types).toContain(EventType.EVENT_TYPE_TIMER_FIRED);
    expect(types[types.length - 1]).toBe(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED);
  } finally {
    await workerConnection.close();
    await connection.close();
  }
});

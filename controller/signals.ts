/**
 * The controller's one door to Temporal: the entity workflows are told of resources here, and
 * asked whether they still run.
 *
 * A spec change is one signal-with-start whose request id is the controller's own
 * (`<uid>/<generation>`, where the SDK would draw a random one): Temporal de-duplicates a repeat
 * of it, so a reconcile retried, a restarted controller or a second replica starts nothing twice.
 */
import { WorkflowNotFoundError, type Client, type WorkflowHandle } from '@temporalio/client';
import { defaultPayloadConverter } from '@temporalio/common';
import { temporal } from '@temporalio/proto';
import { poolQueueFor } from '../shared/constants';

const { WorkflowIdConflictPolicy, WorkflowIdReusePolicy, TaskQueueKind } = temporal.api.enums.v1;

/** One signal-with-start: the workflow started with `input` unless it runs, then signalled. */
export interface SignalWithStart {
  workflowType: 'modelPipeline' | 'dllamaPool';
  workflowId: string;
  input: unknown;
  signalName: string;
  signal: unknown;
  /** De-duplicates a repeat: `<uid>/<generation>` of the resource. */
  requestId: string;
  /** The Temporal UI's summary of the workflow (kept from its first start). */
  summary: string;
}

export class WorkflowSignals {
  /** Signal-with-starts sent (repeats de-duplicated by Temporal included). */
  sent = 0;

  constructor(
    private readonly client: Client,
    private readonly namespace: string,
    /** The control task queue; pools run on theirs (`poolQueueFor`). */
    private readonly taskQueue: string,
  ) {}

  async signalWithStart(s: SignalWithStart): Promise<void> {
    this.sent++;
    await this.client.workflowService.signalWithStartWorkflowExecution({
      namespace: this.namespace,
      identity: 'magus-controller',
      requestId: s.requestId,
      workflowId: s.workflowId,
      workflowType: { name: s.workflowType },
      // Pools run on a task queue of their own (a pool already running keeps its queue).
      taskQueue: { name: s.workflowType === 'dllamaPool' ? poolQueueFor(this.taskQueue) : this.taskQueue, kind: TaskQueueKind.TASK_QUEUE_KIND_NORMAL },
      input: { payloads: [defaultPayloadConverter.toPayload(s.input)] },
      signalName: s.signalName,
      signalInput: { payloads: [defaultPayloadConverter.toPayload(s.signal)] },
      workflowIdReusePolicy: WorkflowIdReusePolicy.WORKFLOW_ID_REUSE_POLICY_ALLOW_DUPLICATE,
      workflowIdConflictPolicy: WorkflowIdConflictPolicy.WORKFLOW_ID_CONFLICT_POLICY_USE_EXISTING,
      userMetadata: { summary: defaultPayloadConverter.toPayload(s.summary) },
    });
  }

  /** The workflow's handle, to signal or terminate it. */
  handle(workflowId: string): WorkflowHandle {
    return this.client.workflow.getHandle(workflowId);
  }

  /** Whether the workflow still runs (false when it never existed or has closed). */
  async running(workflowId: string): Promise<boolean> {
    try {
      return (await this.handle(workflowId).describe()).status.name === 'RUNNING';
    } catch (err) {
      if (err instanceof WorkflowNotFoundError) return false;
      throw err;
    }
  }
}

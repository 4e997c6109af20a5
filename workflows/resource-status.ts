/**
 * The status mirror shared by `modelPipeline` and `dllamaPool`: while the workflow serves a
 * resource, what it shows is written through an activity on the workflow's own queue (its
 * workers have the Kubernetes client), only when it changed, at most once per
 * {@link STATUS_MIN_INTERVAL_MS}. A failed write is dropped (its resource is gone; a new one
 * comes with its own signal); the workflow never waits for the mirror.
 */
import { condition, patched, proxyActivities, proxyLocalActivities, sleep, type ActivityOptions, type LocalActivityOptions } from '@temporalio/workflow';
import type { KubernetesActivities } from '../activities/kubernetes/activities';
import type { Condition } from '../shared/kube';
import { RESOURCE_GONE } from '../shared/errors';

export const STATUS_MIN_INTERVAL_MS = 1000;
const retry = { initialInterval: '1s', maximumInterval: '30s', nonRetryableErrorTypes: [RESOURCE_GONE] };
export const STATUS_WRITE: LocalActivityOptions & ActivityOptions = { startToCloseTimeout: '30s', retry };

type StatusWrites = Pick<KubernetesActivities, 'writeModelStatus' | 'writeDllamaStatus'>;

/**
 * The status write `name` as a workflow schedules it: an activity where `patch` is recorded
 * (every execution since), a local activity in the executions before it.
 *
 * A local activity's completion is not an event of its own: a replay delivers it beside the jobs
 * of the activation next to it, where the first run had delivered it alone — after an activity
 * cancelled at once (a pool's reconciler, when its instances change), in the same workflow task,
 * the mirror's `sleep` and the pool loop's `condition` timer were created in the other order, and
 * the pool failed every task after a worker restart ("TimerMachine in state Canceled … TimerFired").
 * An activity's completion is an event: every replay resumes the mirror where the first run did.
 */
export function statusWrite<K extends keyof StatusWrites>(name: K, patch: string): StatusWrites[K] {
  const local = proxyLocalActivities<StatusWrites>(STATUS_WRITE)[name] as (input: never) => Promise<unknown>;
  const task = proxyActivities<StatusWrites>(STATUS_WRITE)[name] as (input: never) => Promise<unknown>;
  return ((input: never) => (patched(patch) ? task : local)(input)) as StatusWrites[K];
}

/** What the last write showed: its phase (an Event marks a change) and conditions (transition times carry over). */
export interface WrittenStatus {
  phase: string | null;
  conditions: Condition[];
}

export interface StatusView {
  /** Whether there is a resource to write to now. */
  attached(): boolean;
  /** What a write would show, as a comparable string (no clock-driven fields such as an ETA). */
  shown(): string;
  /** Writes the status; returns what it wrote for the next write. */
  write(previous: WrittenStatus): Promise<WrittenStatus>;
}

/** Runs for the workflow's whole life; start it with `void`. */
export async function mirrorStatus(view: StatusView): Promise<void> {
  let written = '';
  let previous: WrittenStatus = { phase: null, conditions: [] };
  for (;;) {
    await condition(() => view.attached() && view.shown() !== written);
    written = view.shown();
    try {
      previous = await view.write(previous);
    } catch {
      // The resource is gone; nothing to write to until a new one arrives.
    }
    await sleep(STATUS_MIN_INTERVAL_MS);
  }
}

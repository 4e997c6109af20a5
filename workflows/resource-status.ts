/**
 * The status mirror shared by `modelPipeline` and `dllamaPool`: while the workflow serves a
 * resource, what it shows is written through a local activity (the control worker running the
 * workflow has the Kubernetes client), only when it changed, at most once per
 * {@link STATUS_MIN_INTERVAL_MS}. A failed write is dropped (its resource is gone; a new one
 * comes with its own signal); the workflow never waits for the mirror.
 */
import { condition, sleep, type LocalActivityOptions } from '@temporalio/workflow';
import type { Condition } from '../shared/kube';
import { RESOURCE_GONE } from '../shared/errors';

export const STATUS_MIN_INTERVAL_MS = 1000;
export const STATUS_WRITE: LocalActivityOptions = {
  startToCloseTimeout: '30s',
  retry: { initialInterval: '1s', maximumInterval: '30s', nonRetryableErrorTypes: [RESOURCE_GONE] },
};

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

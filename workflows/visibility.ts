/**
 * What the Temporal UI shows of a workflow while it runs: its `MagusPhase` search attribute (the
 * list can be filtered by it: `MagusKind="model" AND MagusPhase="failed"`) and its current
 * details (the workflow page's "Current Details", Markdown), kept in step with its state.
 *
 * Current details are served by the SDK's built-in metadata query and emit no command: what they
 * say can change without a patch. Upserting the phase is a command, issued only when the phase
 * changed: a change to when it is issued is a change to the workflow's commands (a patch,
 * workflows/README.md).
 */
import { setCurrentDetails, upsertSearchAttributes } from '@temporalio/workflow';

export interface Visibility {
  /** Call after every change of state (from the workflow's code or a signal/update handler, never a query). */
  refresh(): void;
}

export function visibility(opts: { phase: () => string; details: () => string }): Visibility {
  let shownPhase = '';
  let shownDetails = '';
  return {
    refresh() {
      const details = opts.details();
      if (details !== shownDetails) {
        shownDetails = details;
        setCurrentDetails(details);
      }
      const phase = opts.phase();
      if (phase !== shownPhase) {
        shownPhase = phase;
        upsertSearchAttributes({ MagusPhase: [phase] });
      }
    },
  };
}

/** A workflow time as the UI reader wants it: ISO-8601 to the second, UTC. */
export function at(ms: number): string {
  return `${new Date(ms).toISOString().slice(0, 19)}Z`;
}

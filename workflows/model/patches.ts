/**
 * The model pipeline's patches (workflows/README.md, "Changing workflow code"): each id guards one
 * change of the commands a pipeline emits. An id is never reused or renamed: it is in the histories.
 */

/**
 * The `Model`'s status is written by an activity, not a local activity: a local activity's
 * completion could reach a replay beside other jobs and reorder the pipeline's commands
 * (workflows/resource-status.ts, `statusWrite`).
 */
export const STATUS_ACTIVITY_PATCH = 'model-status-activity';

/** A workflow for the Temporal smoke test: one activity, one durable timer. */
import { proxyActivities, sleep } from '@temporalio/workflow';
import type * as activities from './activities';

const { greet } = proxyActivities<typeof activities>({ startToCloseTimeout: '10 seconds' });

export async function smokeWorkflow(input: { name: string; timerMs: number }): Promise<string> {
  const greeting = await greet(input.name);
  await sleep(input.timerMs);
  return `${greeting} after ${input.timerMs}ms`;
}

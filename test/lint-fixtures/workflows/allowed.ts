// Lint fixture: what workflow code may do — the workflow SDK and activities as types only.
import { proxyActivities } from '@temporalio/workflow';
import type * as activities from '../../smoke/activities';

const { greet } = proxyActivities<typeof activities>({ startToCloseTimeout: '1 minute' });

export async function good(): Promise<string> {
  return greet('x');
}

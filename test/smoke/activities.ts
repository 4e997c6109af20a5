import { activityInfo } from '@temporalio/activity';

export async function greet(name: string): Promise<string> {
  return Promise.resolve(`hello ${name} from activity ${activityInfo().activityType}`);
}

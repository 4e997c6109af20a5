// Lint fixture: importing an activity module for its values pulls I/O into the sandbox.
import { greet } from '../../smoke/activities';

export async function bad(): Promise<string> {
  return greet('x');
}

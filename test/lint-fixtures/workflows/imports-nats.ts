// Lint fixture: workflow code may not talk to NATS directly.
import { connect } from 'nats';

export async function bad(): Promise<void> {
  await (await connect()).close();
}

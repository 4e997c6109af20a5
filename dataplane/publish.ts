/** Handing a request to its instance: the gateway's (and tests') side of `MAGUS_REQUESTS`. */
import type { JetStreamClient } from 'nats';
import type { InferenceRequest } from '../shared/serving';
import { encodeJson } from './json';
import { REQUEST_ID, requestSubjectFor, requestSubjectOf, type DataPlaneNames } from './names';

/**
 * Publishes a request to its instance with `Nats-Msg-Id` = `req.id`, so a retried publish
 * within the duplicate window is stored once; a continuation to one of the instance's lanes
 * (names.ts `requestSubjectFor`: its bridge is this version's, so it pulls them all).
 */
export async function publishRequest(
  js: JetStreamClient,
  names: DataPlaneNames,
  to: { pool: string; instance: string },
  req: InferenceRequest,
): Promise<{ duplicate: boolean; seq: number }> {
  if (!REQUEST_ID.test(req.id)) throw new Error(`request id '${req.id}' must match ${String(REQUEST_ID)}`);
  const ack = await js.publish(requestSubjectFor(requestSubjectOf(names, to.pool, to.instance), req, true), encodeJson(req), {
    msgID: req.id,
    expect: { streamName: names.requestStream },
  });
  return { duplicate: ack.duplicate, seq: ack.seq };
}

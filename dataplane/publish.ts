/** Handing a request to its instance: the gateway's (and tests') side of `MAGUS_REQUESTS`. */
import type { JetStreamClient } from 'nats';
import type { InferenceRequest } from '../shared/serving';
import { encodeJson } from './json';
import { movedSubjectOf, REQUEST_ID, requestSubjectOf, type DataPlaneNames } from './names';

/**
 * Publishes a request to its instance with `Nats-Msg-Id` = `req.id`, so a retried publish
 * within the duplicate window is stored once. One that continues an answer its client already
 * holds part of goes to the instance's moved answers, which its bridge takes before the requests
 * queued for it (one with nothing said yet queues as any request does).
 */
export async function publishRequest(
  js: JetStreamClient,
  names: DataPlaneNames,
  to: { pool: string; instance: string },
  req: InferenceRequest,
): Promise<{ duplicate: boolean; seq: number }> {
  if (!REQUEST_ID.test(req.id)) throw new Error(`request id '${req.id}' must match ${String(REQUEST_ID)}`);
  const subject = (req.continues?.resume.tokens.length ?? 0) > 0 ? movedSubjectOf(names, to.pool, to.instance) : requestSubjectOf(names, to.pool, to.instance);
  const ack = await js.publish(subject, encodeJson(req), {
    msgID: req.id,
    expect: { streamName: names.requestStream },
  });
  return { duplicate: ack.duplicate, seq: ack.seq };
}

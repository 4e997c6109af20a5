/**
 * The per-instance consumers of `MAGUS_REQUESTS`: one durable pull consumer per topology
 * instance, declared by whoever creates the instance (the runtimes, `magus bridge`), restored by
 * its bridge after a server forgot it, and read by the gateway to tell whether a bridge serves it.
 */
import { AckPolicy, DeliverPolicy, type ConsumerConfig, type ConsumerInfo, type JetStreamManager, type NatsConnection, nanos } from 'nats';
import { JsApiError, jsErrorCode } from './errors';
import { consumerNameOf, instanceConsumerNamesOf, laneConsumerNameOf, laneSubjectOf, LANES, requestSubjectOf, type DataPlaneNames, type Lane } from './names';

/**
 * Creates an instance's consumer again with the configuration it had (`config`, as read from
 * its info) when the server no longer has it; true when it was missing. The stream must exist.
 */
export async function restoreConsumer(jsm: JetStreamManager, stream: string, config: ConsumerConfig): Promise<boolean> {
  try {
    await jsm.consumers.info(stream, config.durable_name ?? '');
    return false;
  } catch (err) {
    if (jsErrorCode(err) !== JsApiError.consumerNotFound) throw err;
  }
  try {
    await jsm.consumers.add(stream, config);
  } catch (err) {
    if (jsErrorCode(err) !== JsApiError.consumerExists) throw err;
  }
  return true;
}

export interface InstanceConsumerOptions {
  pool: string;
  instance: string;
  /** Requests the engine serves at once: the consumer's `max_ack_pending`. */
  slots: number;
  /**
   * Redelivery after this long without `ack`/`working()`. Bridges call `working()` every third
   * of it, so it need not cover a slow first token; it bounds how long a crashed bridge's request
   * waits before another bridge takes it over. Default 30 s.
   */
  ackWaitMs?: number;
  /** Deliveries before JetStream gives up; the bridge answers with an error on the last one. Default 5. */
  maxDeliver?: number;
}

/**
 * Whether an instance's bridge consumes its requests: its durable consumer has a pull request
 * waiting (a bridge keeps one open, busy or not; a dead bridge's expire within the pull's 30 s).
 * False when the consumer does not exist.
 */
export async function instanceConsuming(nc: NatsConnection, requestStream: string, pool: string, instance: string): Promise<boolean> {
  try {
    const info = await (await nc.jetstreamManager({ checkAPI: false })).consumers.info(requestStream, consumerNameOf(pool, instance));
    return info.num_waiting > 0;
  } catch (err) {
    if (jsErrorCode(err) === JsApiError.consumerNotFound) return false;
    throw err;
  }
}

/**
 * Declares (or updates) the durable pull consumers of one instance: its requests', and its lanes'
 * ({@link laneConsumerConfig}). Returns the first's info.
 */
export async function ensureInstanceConsumer(jsm: JetStreamManager, names: DataPlaneNames, opts: InstanceConsumerOptions): Promise<ConsumerInfo> {
  if (!Number.isInteger(opts.slots) || opts.slots < 1) throw new Error(`slots must be a positive integer, got ${opts.slots}`);
  const info = await addOrUpdate(jsm, names.requestStream, {
    description: `bridge of ${opts.pool}/${opts.instance}`,
    durable_name: consumerNameOf(opts.pool, opts.instance),
    filter_subject: requestSubjectOf(names, opts.pool, opts.instance),
    max_ack_pending: opts.slots,
    ack_wait: nanos(opts.ackWaitMs ?? 30_000),
    max_deliver: opts.maxDeliver ?? 5,
    ack_policy: AckPolicy.Explicit,
    deliver_policy: DeliverPolicy.All,
  });
  for (const lane of LANES) await addOrUpdate(jsm, names.requestStream, laneConsumerConfig(names, opts.pool, opts.instance, lane, info.config));
  return info;
}

const LANE_DESCRIPTIONS: Record<Lane, string> = { moved: 'answers moved to', requeued: 'requests handed back to' };

/**
 * How many of the requests handed back to an instance (its `requeued` lane) its bridge holds at
 * once, however few its slots: it hands them to its engine earliest deadline first, as many at
 * once as its slots (bridge/held.ts).
 */
export const REQUEUED_HELD = 64;

/** The lane whose requests its bridge holds and orders itself ({@link REQUEUED_HELD}); the others it serves as delivered. */
export const HELD_LANE: Lane = 'requeued';

/**
 * The consumer of one of an instance's lanes (names.ts `LANES`), shaped like its request consumer
 * `like`: as many at once as its slots (the `requeued` lane: at least {@link REQUEUED_HELD}),
 * the same ack wait and deliveries.
 */
export function laneConsumerConfig(names: DataPlaneNames, pool: string, instance: string, lane: Lane, like: Partial<ConsumerConfig>): ConsumerConfig {
  return {
    description: `${LANE_DESCRIPTIONS[lane]} ${pool}/${instance}`,
    durable_name: laneConsumerNameOf(pool, instance, lane),
    filter_subject: laneSubjectOf(names, pool, instance, lane),
    max_ack_pending: lane === HELD_LANE ? Math.max(like.max_ack_pending ?? 1, REQUEUED_HELD) : (like.max_ack_pending ?? 1),
    ack_wait: like.ack_wait ?? nanos(30_000),
    max_deliver: like.max_deliver ?? 5,
    ack_policy: AckPolicy.Explicit,
    deliver_policy: DeliverPolicy.All,
  } as ConsumerConfig;
}

/** Creates consumer `cfg`, or updates what may change of it (all but its name, ack and deliver policies) when it exists. */
async function addOrUpdate(jsm: JetStreamManager, stream: string, cfg: Partial<ConsumerConfig>): Promise<ConsumerInfo> {
  try {
    return await jsm.consumers.add(stream, cfg);
  } catch (err) {
    if (jsErrorCode(err) !== JsApiError.consumerExists) throw err;
    const { description, filter_subject, max_ack_pending, ack_wait, max_deliver } = cfg;
    return jsm.consumers.update(stream, cfg.durable_name!, { description, filter_subject, max_ack_pending, ack_wait, max_deliver });
  }
}

/**
 * Deletes an instance's consumers and the requests left on its subjects (its requests' and its
 * lanes'); false when there was no consumer. The instance is gone for good (a name is never
 * started again): what was left there is what its bridge no longer took — handed back at its
 * drain, or moved by the gateways that never heard of it — and kept, it would count towards
 * the subject's `max_msgs_per_subject` until `max_age`.
 */
export async function deleteInstanceConsumer(jsm: JetStreamManager, names: DataPlaneNames, opts: { pool: string; instance: string }): Promise<boolean> {
  const gone = async (name: string) => {
    try {
      return await jsm.consumers.delete(names.requestStream, name);
    } catch (err) {
      if (jsErrorCode(err) === JsApiError.consumerNotFound) return false;
      throw err;
    }
  };
  let any = false;
  for (const name of instanceConsumerNamesOf(opts.pool, opts.instance).reverse()) any = (await gone(name)) || any;
  const subjects = [requestSubjectOf(names, opts.pool, opts.instance), ...LANES.map((lane) => laneSubjectOf(names, opts.pool, opts.instance, lane))];
  for (const filter of subjects) await jsm.streams.purge(names.requestStream, { filter });
  return any;
}

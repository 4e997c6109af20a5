/**
 * The per-instance consumers of `MAGUS_REQUESTS`: one durable pull consumer per topology
 * instance, declared by whoever creates the instance (the runtimes, `magus bridge`), restored by
 * its bridge after a server forgot it, and read by the gateway to tell whether a bridge serves it.
 */
import { AckPolicy, DeliverPolicy, type ConsumerConfig, type ConsumerInfo, type JetStreamManager, type NatsConnection, nanos } from 'nats';
import { JsApiError, jsErrorCode } from './errors';
import { consumerNameOf, requestSubjectOf, type DataPlaneNames } from './names';

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

/** Declares (or updates) the durable pull consumer of one instance. */
export async function ensureInstanceConsumer(jsm: JetStreamManager, names: DataPlaneNames, opts: InstanceConsumerOptions): Promise<ConsumerInfo> {
  if (!Number.isInteger(opts.slots) || opts.slots < 1) throw new Error(`slots must be a positive integer, got ${opts.slots}`);
  const name = consumerNameOf(opts.pool, opts.instance);
  const changeable = {
    description: `bridge of ${opts.pool}/${opts.instance}`,
    filter_subject: requestSubjectOf(names, opts.pool, opts.instance),
    max_ack_pending: opts.slots,
    ack_wait: nanos(opts.ackWaitMs ?? 30_000),
    max_deliver: opts.maxDeliver ?? 5,
  } satisfies Partial<ConsumerConfig>;
  const cfg: Partial<ConsumerConfig> = {
    ...changeable,
    durable_name: name,
    ack_policy: AckPolicy.Explicit,
    deliver_policy: DeliverPolicy.All,
  };
  try {
    return await jsm.consumers.add(names.requestStream, cfg);
  } catch (err) {
    if (jsErrorCode(err) !== JsApiError.consumerExists) throw err;
    return jsm.consumers.update(names.requestStream, name, changeable);
  }
}

/** Deletes an instance's consumer; false when there was none. Unconsumed requests stay until max age. */
export async function deleteInstanceConsumer(jsm: JetStreamManager, names: DataPlaneNames, opts: { pool: string; instance: string }): Promise<boolean> {
  try {
    return await jsm.consumers.delete(names.requestStream, consumerNameOf(opts.pool, opts.instance));
  } catch (err) {
    if (jsErrorCode(err) === JsApiError.consumerNotFound) return false;
    throw err;
  }
}

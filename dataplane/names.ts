/**
 * Every NATS name of the serving data plane (ARCHITECTURE.md, "Data plane"; the shared names in
 * shared/constants `Nats`, the subjects in shared/serving.ts): streams, buckets, subjects,
 * consumer names and the ids that become subject tokens. One {@link DataPlaneNames} value carries
 * them, so a test (or a second installation) can rename everything with a prefix.
 */
import { Nats } from '../shared/constants';
import { holdsPart } from '../shared/continuation';
import { beatSubject, cancelSubject, requestSubject, responseSubject, type InferenceRequest } from '../shared/serving';

/** Names this module adds to shared/constants `Nats` (proposed there; see README.md). */
export const RESPONSE_STREAM = 'MAGUS_RESPONSES';
export const CLAIMS_BUCKET = 'magus_claims';

/**
 * Every NATS name of one data plane. Plain data (it may cross a Temporal boundary); subjects are
 * built with {@link requestSubjectOf} / {@link responseSubjectOf}.
 */
export interface DataPlaneNames {
  /** `''` in production; e.g. `T_X` in a test. */
  prefix: string;
  requestStream: string;
  /** Subject scope prepended to shared/serving subjects: `''` or e.g. `t_x`. */
  subjectScope: string;
  responseStream: string;
  sessionsBucket: string;
  tokensBucket: string;
  modelsBucket: string;
  claimsBucket: string;
  poolsBucket: string;
  responsesBucket: string;
  limitsBucket: string;
  usageBucket: string;
  usageSumsBucket: string;
}

const NAME = /^[A-Za-z0-9_-]+$/;
/** Pool and instance names: DNS-label-like, and without `_` so `<pool>_<instance>` is unambiguous. */
const TOKEN = /^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$/;
/** Request ids: one subject token and one KV key. */
export const REQUEST_ID = /^[A-Za-z0-9_-]{1,128}$/;
/** Gateway replica ids: one subject token. */
export const REPLICA_ID = /^[A-Za-z0-9_-]{1,64}$/;

/** The names of the data plane, optionally renamed by `prefix` for isolation. */
export function dataPlaneNames(prefix = ''): DataPlaneNames {
  if (prefix && !NAME.test(prefix)) throw new Error(`data-plane prefix '${prefix}' must match ${String(NAME)}`);
  const p = prefix ? `${prefix}_` : '';
  return {
    prefix,
    requestStream: `${p}${Nats.requestStream}`,
    subjectScope: prefix.toLowerCase(),
    responseStream: `${p}${RESPONSE_STREAM}`,
    sessionsBucket: `${p}${Nats.sessionsBucket}`,
    tokensBucket: `${p}${Nats.tokensBucket}`,
    modelsBucket: `${p}${Nats.modelsBucket}`,
    claimsBucket: `${p}${CLAIMS_BUCKET}`,
    poolsBucket: `${p}${Nats.poolsBucket}`,
    responsesBucket: `${p}${Nats.responsesBucket}`,
    limitsBucket: `${p}${Nats.limitsBucket}`,
    usageBucket: `${p}${Nats.usageBucket}`,
    usageSumsBucket: `${p}${Nats.usageSumsBucket}`,
  };
}

/** `subject` inside a data plane's subject scope (`''`: unscoped). */
export const scopeSubject = (scope: string | undefined, subject: string): string => (scope ? `${scope}.${subject}` : subject);
/** `subject` inside the subject scope of `names`. */
export const scopedSubject = (names: DataPlaneNames, subject: string): string => scopeSubject(names.subjectScope, subject);

function checkToken(what: string, value: string): void {
  if (!TOKEN.test(value)) throw new Error(`${what} '${value}' is not a valid name (letters, digits and '-', at most 63)`);
}

/** `magus.req.<pool>.<instance>` in this data plane. */
export function requestSubjectOf(names: DataPlaneNames, pool: string, instance: string): string {
  checkToken('pool', pool);
  checkToken('instance', instance);
  return scopedSubject(names, requestSubject(pool, instance));
}

/**
 * The lanes of an instance beside its requests, each `magus.req.<pool>.<instance>.<lane>` with a
 * durable consumer of its own ({@link laneConsumerNameOf}) that its bridge pulls beside its
 * requests, so what is sent there never waits behind the requests queued for the instance:
 * - `moved`: answers continued on this instance after their own instance lost them
 *   (shared/continuation.ts), whose clients hold part of them — the engine takes them first;
 * - `requeued`: requests handed back by another instance with nothing said (its drain deadline,
 *   its engine gone), which had already waited their turn in its queue — apart from `moved`, so
 *   they never hold back an answer waiting mid-way.
 */
export const LANES = ['moved', 'requeued'] as const;
export type Lane = (typeof LANES)[number];

/** `magus.req.<pool>.<instance>.<lane>` in this data plane ({@link LANES}). */
export function laneSubjectOf(names: DataPlaneNames, pool: string, instance: string, lane: Lane): string {
  return laneSubjectFor(requestSubjectOf(names, pool, instance), lane);
}

/** {@link laneSubjectOf} of the instance whose requests go to `requestSubject` (a session entry's `subject`). */
export const laneSubjectFor = (requestSubject: string, lane: Lane): string => `${requestSubject}.${lane}`;

/**
 * Where `req` goes on the instance whose requests go to `requestSubject`: a continuation to its
 * moved answers when its client holds part of the answer, to its requeued requests when nothing
 * was said yet and its bridge pulls them (`requeued`: its beat says so, shared/serving.ts
 * `BridgeLoad`); any other request to its requests.
 */
export function requestSubjectFor(requestSubject: string, req: Pick<InferenceRequest, 'continues'>, requeued: boolean): string {
  if (req.continues === undefined) return requestSubject;
  if (holdsPart(req.continues.resume)) return laneSubjectFor(requestSubject, 'moved');
  return requeued ? laneSubjectFor(requestSubject, 'requeued') : requestSubject;
}

/** `magus.cancel.<pool>.<instance>` in this data plane: where a gateway says a request's client went away. */
export function cancelSubjectOf(names: DataPlaneNames, pool: string, instance: string): string {
  checkToken('pool', pool);
  checkToken('instance', instance);
  return scopedSubject(names, cancelSubject(pool, instance));
}

/** `magus.beat.<pool>.<instance>` in this data plane: where the instance's bridge says it is alive. */
export function beatSubjectOf(names: DataPlaneNames, pool: string, instance: string): string {
  checkToken('pool', pool);
  checkToken('instance', instance);
  return scopedSubject(names, beatSubject(pool, instance));
}

/**
 * Where the frames of request `requestId` go in this data plane: `magus.res.<replica>.<id>`, the
 * subject of the gateway replica that waits for them; without a replica the older
 * `magus.res.<id>` (requests queued by gateways from before per-replica subjects).
 */
export function responseSubjectOf(names: DataPlaneNames, requestId: string, replica?: string): string {
  if (!REQUEST_ID.test(requestId)) throw new Error(`request id '${requestId}' must match ${String(REQUEST_ID)}`);
  if (replica !== undefined && !REPLICA_ID.test(replica)) throw new Error(`replica '${replica}' must match ${String(REPLICA_ID)}`);
  return scopedSubject(names, responseSubject(requestId, replica));
}

/**
 * Where the bridge of `pool`/`instance` publishes the frames of a request that asks for it
 * (InferenceRequest `instanceFrames`): its `replyTo` with the pool and instance before the id,
 * `magus.res.<replica>.<pool>.<instance>.<id>`. A bridge's NATS user may publish, and read back,
 * only subjects that name its own instance (roles.ts), so no tenant's pod reads or writes another
 * instance's answers; the gateway that waits hears both forms.
 */
export function instanceResponseSubjectOf(replyTo: string, requestId: string, pool: string, instance: string): string {
  checkToken('pool', pool);
  checkToken('instance', instance);
  if (!replyTo.endsWith(`.${requestId}`)) throw new Error(`reply subject '${replyTo}' does not end with its request id '${requestId}'`);
  return `${replyTo.slice(0, replyTo.length - requestId.length)}${pool}.${instance}.${requestId}`;
}

/** Whether `subject` is a `replyTo` a bridge may answer request `requestId` on: one of {@link responseSubjectOf}'s two forms. */
export function isResponseSubjectOf(names: DataPlaneNames, subject: string, requestId: string): boolean {
  const prefix = `${scopedSubject(names, Nats.responseSubjectPrefix)}.`;
  if (!subject.startsWith(prefix) || !subject.endsWith(requestId)) return false;
  const rest = subject.slice(prefix.length, subject.length - requestId.length);
  return rest === '' || (rest.endsWith('.') && REPLICA_ID.test(rest.slice(0, -1)));
}

/** The durable consumer of one instance (consumers live in the stream, which is already prefixed). */
export function consumerNameOf(pool: string, instance: string): string {
  checkToken('pool', pool);
  checkToken('instance', instance);
  return `${pool}_${instance}`;
}

/** The durable consumer of one of an instance's {@link LANES}; no instance's {@link consumerNameOf} (tokens hold no `_`). */
export function laneConsumerNameOf(pool: string, instance: string, lane: Lane): string {
  return `${consumerNameOf(pool, instance)}_${lane}`;
}

/** Every durable consumer of one instance: its requests', then its {@link LANES}'. */
export function instanceConsumerNamesOf(pool: string, instance: string): string[] {
  return [consumerNameOf(pool, instance), ...LANES.map((lane) => laneConsumerNameOf(pool, instance, lane))];
}

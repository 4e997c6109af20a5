/**
 * The serving data plane's public surface (README.md next to this file), for the rooms above:
 * `names.ts` (every name, subject and id pattern), `declare.ts` (streams, buckets, the response
 * stream's size, declaring again after a reconnect), `consumers.ts` (one consumer per instance),
 * `publish.ts` (a request to its instance), `response-stream.ts` (reading frames back),
 * `claims.ts` (`magus_claims`), `errors.ts` (what JetStream's errors mean), `json.ts`. Modules of
 * this folder import each other directly; the registry, the KV mirror, the frame codec and the
 * bridge have entry points of their own (`registry.ts`, `kv-mirror.ts`, `frames.ts`, `bridge/`).
 */
export { type ClaimResult, type RequestClaim, type RequestClaims, endClaim, openRequestClaims } from './claims';
export { deleteInstanceConsumer, ensureInstanceConsumer, instanceConsuming, restoreConsumer, type InstanceConsumerOptions } from './consumers';
export {
  DEFAULT_INSTANCE_BACKLOG,
  DEFAULT_RESPONSES_MAX_AGE_MS,
  DEFAULT_RESPONSE_PEAK_BYTES_PER_SEC,
  DEFAULT_RESPONSE_RETENTION_MS,
  MAX_REPLICAS,
  MIN_RESPONSE_MAX_BYTES,
  ResponseStreamMetadata,
  declareOnReconnect,
  ensureDataPlane,
  ensureResponsesBucket,
  responseStreamLimits,
  type DataPlaneOptions,
} from './declare';
export { JsApiError, isBacklogFull, isRevisionConflict, jsErrorCode, streamAckProblem } from './errors';
export { decodeJson, encodeJson } from './json';
export {
  CLAIMS_BUCKET,
  REPLICA_ID,
  REQUEST_ID,
  RESPONSE_STREAM,
  beatSubjectOf,
  cancelSubjectOf,
  consumerNameOf,
  dataPlaneNames,
  instanceResponseSubjectOf,
  isResponseSubjectOf,
  instanceConsumerNamesOf,
  laneConsumerNameOf,
  laneSubjectFor,
  laneSubjectOf,
  LANES,
  requestSubjectFor,
  requestSubjectOf,
  responseSubjectOf,
  scopeSubject,
  scopedSubject,
  type DataPlaneNames,
  type Lane,
} from './names';
export { publishRequest } from './publish';
export { readStoredFrames, responseStreamState, type ResponseStreamState, type StoredFrames } from './response-stream';

/**
 * The bridge between the request stream and an engine (README.md one folder up, "Exactly one
 * answer per request id"): `bridge.ts` runs the protocol, `requests.ts` checks what it pulls,
 * `metrics.ts` reports it, `engine-client.ts` calls the engine. Its processes — `magus bridge`
 * (workers/bridge.ts) and the local runtime — import it from here.
 */
export { BridgeErrorCode, startBridge, type Bridge, type BridgeOptions } from './bridge';
export { bridgeMetricsText, type BridgeHealth, type BridgeSample, type BridgeStats } from './metrics';
export { parseInferenceRequest, seedFor, type ParsedRequest } from './requests';

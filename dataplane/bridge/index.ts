/**
 * The bridge between the request stream and an engine (README.md one folder up, "Exactly one
 * answer per request id"): `bridge.ts` wires a bridge from its parts — `consumer.ts` pulls,
 * `delivery.ts` serves each delivery by an attempt (`attempt.ts`, the live ones in
 * `attempts.ts`), `generate.ts` calls the engine through `engine-client.ts`, `stored-frames.ts`
 * publishes frames until they are stored, `cancels.ts` hears gateways' cancels; `requests.ts`
 * checks what it pulls, `metrics.ts` reports it. Its processes — `magus bridge`
 * (workers/bridge.ts) and the local runtime — import it from here.
 */
export { startBridge, type Bridge, type BridgeOptions } from './bridge';
export { BridgeErrorCode } from './error-frames';
export { bridgeMetricsText, type BridgeHealth, type BridgeSample, type BridgeStats } from './metrics';
export { parseInferenceRequest, seedFor, type ParsedRequest } from './requests';

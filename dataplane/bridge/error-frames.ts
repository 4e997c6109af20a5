/** The error frames the bridge itself produces (engine errors carry the engine's code). */
import type { ErrorFrame } from '../../shared/serving';

/** `code` of the error frames the bridge itself produces (engine errors carry the engine's code). */
export const BridgeErrorCode = {
  invalidRequest: 'invalid_request',
  deadlineExceeded: 'deadline_exceeded',
  engineUnavailable: 'engine_unavailable',
  engineProtocol: 'engine_protocol_error',
  generationDiverged: 'generation_diverged',
  resumeFailed: 'resume_failed',
  /** Still queued when its instance stopped (the drain deadline passed), and not one its gateway can send elsewhere: retry. */
  instanceStopped: 'instance_stopped',
} as const;

/** An `error` frame at `seq`, in the OpenAI error shape the gateway relays. */
export const errorFrame = (seq: number, status: number, type: string, code: string | null, message: string, param?: string | null): ErrorFrame => ({
  seq,
  type: 'error',
  error: param ? { status, type, code, message, param } : { status, type, code, message },
});

/**
 * What a bridge accepts off the request stream: an {@link InferenceRequest} checked against the
 * contract of shared/serving.ts at the trust boundary (anyone who can publish to a request subject
 * can send anything), and the seed every attempt of a request generates with.
 */
import { hash } from 'node:crypto';
import { REQUEST_ID, decodeJson, isResponseSubjectOf, responseSubjectOf, type DataPlaneNames } from '../data-plane';
import type { InferenceRequest } from '../../shared/serving';

/** A checked request, or why not — with the `replyTo` to send the error frame to when it is a usable subject. */
export type ParsedRequest = { ok: true; req: InferenceRequest } | { ok: false; problem: string; replyTo?: string };

const LITERAL_SUBJECT = /^[^\s*>.]+(\.[^\s*>.]+)*$/;
const ROLES = new Set(['system', 'user', 'assistant']);

/** Checks one request message; never throws. */
export function parseInferenceRequest(data: Uint8Array, names: DataPlaneNames): ParsedRequest {
  let v: unknown;
  try {
    v = decodeJson(data);
  } catch {
    return { ok: false, problem: 'request is not JSON' };
  }
  if (typeof v !== 'object' || v === null || Array.isArray(v)) return { ok: false, problem: 'request is not an object' };
  const r = v as Record<string, unknown>;
  const replyTo = typeof r.replyTo === 'string' && LITERAL_SUBJECT.test(r.replyTo) ? r.replyTo : undefined;
  const bad = (problem: string): ParsedRequest => ({ ok: false, problem, replyTo });
  if (typeof r.id !== 'string' || !REQUEST_ID.test(r.id)) return bad(`id must match ${String(REQUEST_ID)}`);
  // Only the request's own response subject, in either form: a request cannot point frames elsewhere.
  if (typeof r.replyTo !== 'string' || !isResponseSubjectOf(names, r.replyTo, r.id)) {
    return bad(`replyTo must be the request's response subject: ${responseSubjectOf(names, r.id)}, or a replica token before the id`);
  }
  if (typeof r.deadline !== 'number' || !Number.isFinite(r.deadline)) return bad('deadline must be epoch milliseconds');
  const b = r.body as Record<string, unknown> | null;
  if (typeof b !== 'object' || b === null || Array.isArray(b)) return bad('body must be a chat completion request');
  if (typeof b.model !== 'string' || b.model === '') return bad('body.model must be a non-empty string');
  if (!Array.isArray(b.messages) || b.messages.length === 0) return bad('body.messages must be a non-empty array');
  for (const m of b.messages as unknown[]) {
    const msg = m as Record<string, unknown> | null;
    if (typeof msg !== 'object' || msg === null || !ROLES.has(msg.role as string) || typeof msg.content !== 'string') {
      return bad('every message needs a role (system, user, assistant) and string content');
    }
  }
  const optional: [string, (x: unknown) => boolean][] = [
    ['stream', (x) => typeof x === 'boolean'],
    ['max_tokens', (x) => Number.isInteger(x) && (x as number) > 0],
    ['temperature', (x) => typeof x === 'number' && x >= 0],
    ['top_p', (x) => typeof x === 'number' && x >= 0 && x <= 1],
    ['seed', (x) => Number.isInteger(x)],
    ['stop', (x) => typeof x === 'string' || (Array.isArray(x) && x.every((s) => typeof s === 'string'))],
    ['stream_options', (x) => typeof x === 'object' && !Array.isArray(x) && ['boolean', 'undefined'].includes(typeof (x as { include_usage?: unknown }).include_usage)],
  ];
  for (const [field, ok] of optional) {
    if (b[field] !== undefined && b[field] !== null && !ok(b[field])) return bad(`body.${field} has an invalid value`);
  }
  return { ok: true, req: v as InferenceRequest };
}

/** The seed every attempt of a request uses when the client gave none, so a retry regenerates the same text. */
export function seedFor(requestId: string): number {
  return hash('sha256', requestId, 'buffer').readUInt32BE(0) & 0x7fffffff; // one-shot: no Hash object per request
}

/**
 * What a bridge accepts off the request stream: an {@link InferenceRequest} checked against the
 * contract of shared/serving.ts at the trust boundary (anyone who can publish to a request subject
 * can send anything), and the seed every attempt of a request generates with.
 */
import { hash } from 'node:crypto';
import type { TSchema } from '@sinclair/typebox';
import { TypeCompiler, type TypeCheck, type ValueError } from '@sinclair/typebox/compiler';
import { decodeJson } from '../json';
import { REQUEST_ID, instanceResponseSubjectOf, isResponseSubjectOf, responseSubjectOf, type DataPlaneNames } from '../names';
import { kindOf, REQUEST_KINDS, type RequestKind } from '../../shared/request-kinds';
import type { InferenceRequest } from '../../shared/serving';

/** A checked request, or why not — with the `replyTo` to send the error frame to when it is a usable subject. */
export type ParsedRequest = { ok: true; req: InferenceRequest } | { ok: false; problem: string; replyTo?: string };

const LITERAL_SUBJECT = /^[^\s*>.]+(\.[^\s*>.]+)*$/;
/** The shared schemas, compiled once: every request is checked against exactly what the gateway validates and sends (by its kind, so a problem is named in its kind's terms). */
const contracts = Object.fromEntries(
  Object.entries(REQUEST_KINDS).map(([kind, k]): [string, TypeCheck<TSchema>] => [kind, TypeCompiler.Compile<TSchema>(k.inference)]),
) as Record<RequestKind, TypeCheck<TSchema>>;

/** `/body/messages/0/role` → `body.messages[0].role`, and what is wrong with it. */
function problemOf(e: ValueError | undefined): string {
  if (!e) return 'request does not match the contract';
  const param = e.path
    .split('/')
    .slice(1)
    .reduce((out, s) => (/^\d+$/.test(s) ? `${out}[${s}]` : out ? `${out}.${s}` : s), '');
  // In the schema's words where it has them (a list of values, a description of a union), else TypeBox's.
  const { enum: allowed, description } = e.schema as { enum?: unknown; description?: unknown };
  const what = Array.isArray(allowed)
    ? `must be one of ${allowed.map((v) => JSON.stringify(v)).join(', ')}`
    : typeof description === 'string'
      ? `must be ${description}`
      : e.message.replace(/^./, (c) => c.toLowerCase());
  return `${param || 'request'}: ${what}`;
}

/**
 * Checks one request message; never throws. Served by the bridge of `own` (pool and instance), a
 * request that asks for it (`instanceFrames`) comes back with `replyTo` its instance's subject
 * ({@link instanceResponseSubjectOf}), the one this bridge's NATS user may publish and read back.
 */
export function parseInferenceRequest(data: Uint8Array, names: DataPlaneNames, own?: { pool: string; instance: string }): ParsedRequest {
  let v: unknown;
  try {
    v = decodeJson(data);
  } catch {
    return { ok: false, problem: 'request is not JSON' };
  }
  if (typeof v !== 'object' || v === null || Array.isArray(v)) return { ok: false, problem: 'request is not an object' };
  const r = v as Record<string, unknown>;
  const literal = typeof r.replyTo === 'string' && LITERAL_SUBJECT.test(r.replyTo) ? r.replyTo : undefined;
  const bad = (problem: string, replyTo = literal): ParsedRequest => ({ ok: false, problem, replyTo });
  if (typeof r.id !== 'string' || !REQUEST_ID.test(r.id)) return bad(`id must match ${String(REQUEST_ID)}`);
  // Only the request's own response subject, in either form: a request cannot point frames elsewhere.
  if (typeof r.replyTo !== 'string' || !isResponseSubjectOf(names, r.replyTo, r.id)) {
    return bad(`replyTo must be the request's response subject: ${responseSubjectOf(names, r.id)}, or a replica token before the id`);
  }
  // Where this bridge answers, an error frame included.
  const replyTo = own && r.instanceFrames === true ? instanceResponseSubjectOf(r.replyTo, r.id, own.pool, own.instance) : r.replyTo;
  const contract = contracts[kindOf(r)];
  if (!contract.Check(v)) return bad(problemOf(contract.Errors(v).First()), replyTo);
  // Checked against its kind's contract: it is that kind's request.
  const req = v as InferenceRequest;
  req.replyTo = replyTo;
  return { ok: true, req };
}

/** The seed every attempt of a request uses when the client gave none, so a retry regenerates the same text. */
export function seedFor(requestId: string): number {
  return hash('sha256', requestId, 'buffer').readUInt32BE(0) & 0x7fffffff; // one-shot: no Hash object per request
}

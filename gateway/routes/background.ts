/**
 * Background responses (`POST /v1/responses` with `background: true`; gateway/README.md,
 * "Background responses"). The response is stored `queued` and answered at once; the accepting
 * replica runs the turn without its client (inference.ts `runTurn`, the engine streaming) and
 * stores the response as it ends. Its record's `run` (serving/response-store.ts) says where the
 * answer's frames are once the request is published, so any replica can, whether the accepting
 * one still runs or not:
 * - poll it (`GET /v1/responses/{id}`): the answer so far, read back from `MAGUS_RESPONSES`; an
 *   answer that ended there but whose record was not written (its replica died) is written then;
 * - stream it (`GET …?stream=true&starting_after=N`): the Responses API's events, the same on
 *   every replica and every time — the same order, the same `sequence_number`s, the same item
 *   ids (derived from the response id) — read back, then followed live;
 * - cancel it (`POST …/cancel`): stored `cancelled`, and the bridge told to stop.
 * Every write of a running response's record is conditional on the revision it read, so a run's
 * end, a poll that finishes it and a cancel never overwrite one another.
 */
import type { FastifyInstance } from 'fastify';
import { CONTINUE_ELSEWHERE } from '../../shared/continuation';
import type { ResponseFrame } from '../../shared/serving';
import { isAnswering, type ResponseObject } from '../../shared/responses';
import type { Principal } from '../plugins/auth';
import { errors } from '../plugins/errors';
import type { BackgroundRun, StoredResponse } from '../serving/response-store';
import { roleOnly } from '../serving/exchange';
import type { ResumableAnswer } from '../serving/resume';
import { instanceEntry, publishedAs } from './resume';
import { ResponseDraft, type ResponseEvent } from './response-draft';

/** Whether a stored response is still being answered. */
export const isRunning = (record: StoredResponse): boolean => isAnswering(record.response.status);

/** A background response's draft, from its start: the same item ids on every replica (from the response id). */
export function runDraft(record: StoredResponse): ResponseDraft {
  const base = record.response.id.slice('resp_'.length);
  const pending: ResponseObject = {
    ...structuredClone(record.response),
    status: 'queued',
    output: [],
    usage: null,
    error: null,
    incomplete_details: null,
  };
  return new ResponseDraft(pending, record.run?.logprobs === true, (kind, index) => `${kind}_${base}_${index}`);
}

/**
 * The events of a run's frames: each request's in order from seq 0 up to the first one missing or
 * its last — the first request's, then, where its bridge handed the answer back, each
 * continuation's ({@link storedSegments}) without its role chunk again. A hand-back with no
 * continuation after it ends nothing: the answer is being moved.
 */
export function replayFrames(draft: ResponseDraft, segments: readonly (readonly ResponseFrame[])[]): ResponseEvent[] {
  const events = draft.begin();
  let chunks = 0;
  for (const frames of segments) {
    const bySeq = new Map<number, ResponseFrame>();
    for (const f of frames) if (!bySeq.has(f.seq)) bySeq.set(f.seq, f);
    for (let seq = 0; !draft.ended; seq++) {
      const f = bySeq.get(seq);
      if (!f) break;
      if (f.type === 'chunk') {
        if (segments[0] !== frames && chunks > 0 && roleOnly(f.data)) continue; // a continuation's role: said already
        chunks += 1;
        events.push(...draft.chunk(f.data));
      } else if (f.type === 'done') events.push(...draft.finish().events);
      else if (f.type === 'error') {
        if (f.error.code === CONTINUE_ELSEWHERE) break; // it goes on in the next segment, or is being moved
        events.push(...draft.failed(f.error.code ?? f.error.type, f.error.message, f.error.status === 499));
      }
      // A run streams: its `done` carries no data, so it never comes in parts.
    }
    if (draft.ended) break;
  }
  return events;
}

/** Whether `frames`, read from seq 0 up to the first missing, end with their answer handed back. */
function handedBack(frames: readonly ResponseFrame[]): boolean {
  const bySeq = new Map(frames.map((f) => [f.seq, f]));
  let last: ResponseFrame | undefined;
  for (let seq = 0; bySeq.has(seq); seq++) last = bySeq.get(seq);
  return last?.type === 'error' && last.error.code === CONTINUE_ELSEWHERE;
}

/**
 * What `MAGUS_RESPONSES` holds of the answer at `place`: its request's frames, then, for each move
 * recorded (serving/resume.ts `MoveLog`), that continuation's — each request's only up to where the
 * answer left it (a bridge gone silent may have said more of it, or answered it whole, later).
 * A move recorded without that point (by a gateway before it) is followed only from a hand-back.
 */
export async function storedSegments(app: FastifyInstance, place: ResumableAnswer): Promise<ResponseFrame[][]> {
  const { readStored, moves } = app.gateway;
  const read = async (at: ResumableAnswer): Promise<ResponseFrame[] | undefined> => {
    const published = publishedAs(app, at);
    return published && readStored ? (await Promise.all(published.subjects.map(readStored))).flat() : undefined;
  };
  const first = await read(place);
  if (!first) return [];
  const segments = [first];
  for (let n = 1; moves; n++) {
    const to = await moves.find(place.requestId, n);
    const last = segments.length - 1;
    if (!to || (to.at === undefined && !handedBack(segments[last]!))) break;
    const frames = await read(to);
    if (!frames) break;
    if (to.at !== undefined) segments[last] = segments[last]!.filter((f) => f.seq < to.at!);
    segments.push(frames);
  }
  return segments;
}

/**
 * The events of a finished response read from its record (its frames no longer held, or it was
 * cancelled): each item's content as one delta, then its end.
 */
export function replayRecord(record: StoredResponse): ResponseEvent[] {
  const draft = runDraft(record);
  const r = record.response;
  const events = draft.begin();
  for (const [index, item] of r.output.entries()) {
    const delta =
      item.type === 'message'
        ? { content: item.content.map((p) => p.text).join('') }
        : { tool_calls: [{ index, id: item.call_id, function: { name: item.name, arguments: item.arguments } }] };
    const logprobs = item.type === 'message' ? { content: item.content.flatMap((p) => p.logprobs ?? []) } : null;
    events.push(...draft.chunk({ choices: [{ delta, logprobs }] }));
  }
  if (r.status === 'completed' || r.status === 'incomplete') {
    const usage = r.usage && {
      prompt_tokens: r.usage.input_tokens,
      completion_tokens: r.usage.output_tokens,
      total_tokens: r.usage.total_tokens,
      prompt_tokens_details: { cached_tokens: r.usage.input_tokens_details.cached_tokens },
    };
    events.push(...draft.chunk({ choices: [{ delta: {}, finish_reason: r.status === 'incomplete' ? 'length' : 'stop' }], usage }));
    events.push(...draft.finish().events);
  } else {
    events.push(...draft.failed(r.error?.code ?? r.status, r.error?.message ?? `The response was ${r.status}.`, r.status === 'cancelled'));
  }
  return events;
}

/** Where a published run's frames are, as {@link followAnswer} takes it. */
export function placeOf(run: BackgroundRun): ResumableAnswer | undefined {
  return run.replica !== undefined && run.pool !== undefined && run.instance !== undefined
    ? { replica: run.replica, pool: run.pool, instance: run.instance, requestId: run.request }
    : undefined;
}

/**
 * `record`'s answer as `MAGUS_RESPONSES` holds it: a draft fed its stored frames (from seq 0 up to
 * the first missing, across its moves), their events, whether any were stored, and whether its
 * bridge handed it back with no move recorded yet (`movePending`).
 */
export async function readBack(
  app: FastifyInstance,
  record: StoredResponse,
): Promise<{ draft: ResponseDraft; events: ResponseEvent[]; stored: boolean; movePending: boolean }> {
  const draft = runDraft(record);
  const place = record.run && placeOf(record.run);
  const segments = place ? await storedSegments(app, place) : [];
  const events = replayFrames(draft, segments);
  const last = segments[segments.length - 1];
  return { draft, events, stored: segments.some((f) => f.length > 0), movePending: !draft.ended && last !== undefined && handedBack(last) };
}

/** What {@link settleRun} makes of a running record; undefined leaves it as it is. */
export type RunUpdate = (record: StoredResponse) => StoredResponse | undefined;

/**
 * Writes `update` of response `id`'s record while it is running, conditional on the revision
 * read (read again after a conflict); the response as stored after, or undefined when it is gone.
 * The write that ends a run counts the record against the key's storage quota.
 */
export async function settleRun(app: FastifyInstance, principal: Principal, id: string, update: RunUpdate): Promise<StoredResponse | undefined> {
  const g = app.gateway;
  for (;;) {
    const current = await g.storedResponses.read(id);
    if (!current) return undefined;
    if (!isRunning(current.record)) return current.record;
    const next = update(current.record);
    if (!next) return current.record;
    const size = await g.storedResponses.replace(id, next, current.revision);
    if (!size) continue; // another write came first: look again
    if (!isRunning(next) && principal.limits) await g.limiter?.stored(principal.key, principal.limits, size.bytes, size.storedAtMs);
    return next;
  }
}

/**
 * A running record ended by `draft` (finished or failed): the response and the answer a later turn
 * sends back. It keeps its run (but its request's body): a stream of it reads the same events
 * from the frames while they are kept.
 */
export function endedBy(record: StoredResponse, draft: ResponseDraft, response: ResponseObject): StoredResponse {
  // Its request's body was kept only to send the answer on while it ran.
  const run = record.run && { ...record.run, body: undefined };
  return { ...record, ...(run ? { run } : {}), output: draft.assistantMessages(), response };
}

/** A running record ended without its answer: `status` with `error`, its output as far as `draft` got. */
export function endedWithout(record: StoredResponse, draft: ResponseDraft, status: 'failed' | 'cancelled', code: string, message: string): StoredResponse {
  const response = { ...draft.snapshot(), status, error: { code, message } };
  return endedBy(record, draft, response);
}

/**
 * The latest state of a running record without a replica to end it: its answer read back (ended
 * there: the record is written so), or — never published by its deadline, or nothing of it held
 * well past that — failed. Returns the record as it stands (a running one with its output so far).
 * `onStalled` is told when its answer must move (handed back with no move recorded, or its
 * bridge silent): the replica that accepted it may be gone, and the caller may adopt the run.
 */
export async function lookIn(app: FastifyInstance, principal: Principal, record: StoredResponse, onStalled?: () => void): Promise<StoredResponse> {
  const run = record.run;
  if (!run) return record;
  const { draft, stored, movePending } = await readBack(app, record);
  const place = placeOf(run);
  // Handed back with no move recorded, or its bridge silent: it must move, and its replica may be gone.
  if (!draft.ended && place && (movePending || app.gateway.bridgeSilent?.(instanceEntry(place.pool, place.instance)))) onStalled?.();
  const now = Date.now();
  let end: RunUpdate | undefined;
  if (draft.ended) end = (r) => endedBy(r, draft, draft.snapshot());
  else if (!placeOf(run) && now > run.publishBy)
    end = (r) => endedWithout(r, draft, 'failed', 'server_error', 'The gateway that accepted this response stopped before its request was queued.');
  // Well past its deadline with nothing of it held: it never began, or its frames aged out. (One
  // whose frames are held goes on: a stream that has begun is not cut by its deadline, and one that
  // had not is ended by its bridge, in a frame, when the deadline passes: dataplane/README.md.)
  else if (placeOf(run) && run.deadline !== undefined && now > run.deadline + app.gateway.settings.requestTimeoutMs && !stored)
    end = (r) => endedWithout(r, draft, 'failed', 'timeout', 'The answer did not end by its deadline, and what it had is no longer held.');
  if (end) return (await settleRun(app, principal, record.response.id, end)) ?? record;
  return stored ? { ...record, response: draft.snapshot() } : record;
}

/** The 400 for a cancel of a response that was not created in the background. */
export const notBackground = (id: string) =>
  errors.invalid(`Response '${id}' was not created with \`background: true\`: only background responses can be cancelled.`, 'response_id', 'invalid_value');

/**
 * The gateway's request publisher against a real request stream: the same contract as a
 * JetStream publish (stored, de-duplicated by request id, backlog full, no stream, no ack in
 * time), on one inbox subscription instead of a request per publish; a request over NATS's
 * max_payload is a 413, never sent.
 */
import type { NatsConnection } from 'nats';
import { requestSubjectOf, responseSubjectOf, type DataPlaneNames } from '../../dataplane';
import type { InferenceRequest } from '../../shared/serving';
import { isolation } from '../../test/harness';
import { natsStack, TestStack } from '../../test/harness/stack';
import { SessionError, SessionErrorType } from '../plugins/errors';
import { streamAckProblem, streamPublisher, type StreamPublisher } from './exchange';

const iso = isolation();
let nc: NatsConnection;
let names: DataPlaneNames;
let publisher: StreamPublisher | undefined;
let counter = 0;
const stack = new TestStack();

const entry = (subject: string) => ({ subject, pool: 'p', instance: 'i1', expiresAt: Date.now() + 60_000 });
const request = (id = `r${Date.now().toString(36)}x${counter++}`): InferenceRequest => ({
  id,
  replyTo: responseSubjectOf(names, id),
  deadline: Date.now() + 60_000,
  body: { model: 'm', messages: [{ role: 'user', content: 'hi' }] },
});
const storedOn = async (subject: string) =>
  (await (await nc.jetstreamManager()).streams.info(names.requestStream, { subjects_filter: subject })).state.subjects?.[subject] ?? 0;

beforeAll(async () => {
  ({ nc, names } = await stack.open(natsStack(iso, { declare: { instanceBacklog: 2 } })));
});
afterEach(async () => {
  await publisher?.close();
  publisher = undefined;
});
afterAll(() => stack.close());

it('resolves once the stream stored the request; a second publish of the same id is de-duplicated', async () => {
  publisher = streamPublisher(nc);
  const subject = requestSubjectOf(names, 'p', 'dedupe');
  const req = request();
  await publisher.publish(subject, req, entry(subject));
  await publisher.publish(subject, req, entry(subject));
  expect(await storedOn(subject)).toBe(1);
});

it('a full backlog is a BacklogFull session error (the gateway answers 429)', async () => {
  publisher = streamPublisher(nc);
  const subject = requestSubjectOf(names, 'p', 'full');
  await publisher.publish(subject, request(), entry(subject));
  await publisher.publish(subject, request(), entry(subject));
  const refused = await publisher.publish(subject, request(), entry(subject)).catch((err: unknown) => err);
  expect(refused).toBeInstanceOf(SessionError);
  expect((refused as SessionError).type).toBe(SessionErrorType.BacklogFull);
  expect(await storedOn(subject)).toBe(2);
});

it("a request larger than the servers' max_payload is a 413 naming the limit, nothing published (no retry can help)", async () => {
  publisher = streamPublisher(nc);
  const subject = requestSubjectOf(names, 'p', 'i-big');
  const max = nc.info!.max_payload;
  const sized = (chars: number): InferenceRequest =>
    ({ ...request(), body: { model: 'm', messages: [{ role: 'user', content: 'x'.repeat(chars) }] } }) as InferenceRequest;
  const big = sized(max);
  const err = await publisher.publish(subject, big, entry(subject)).catch((e: unknown) => e);
  expect(err).toMatchObject({ status: 413, code: 'request_too_large' });
  expect((err as Error).message).toContain(`(${max} bytes, the NATS servers' max_payload)`);
  expect(await storedOn(subject)).toBe(0);
  // Just under it goes through.
  await publisher.publish(subject, sized(max - 2048), entry(subject));
  expect(await storedOn(subject)).toBe(1);
});

it('a subject no stream stores fails at once (no responders), not after the timeout', async () => {
  publisher = streamPublisher(nc, 30_000);
  const started = Date.now();
  await expect(publisher.publish(`${iso.natsPrefix}.nowhere`, request(), entry('nowhere'))).rejects.toThrow(/no stream stores this subject/);
  expect(Date.now() - started).toBeLessThan(5_000);
});

it('no acknowledgement within the timeout fails the publish; closing fails those still waiting', async () => {
  // A plain subscriber on the subject answers nothing: the publish waits for an ack that never comes.
  const silent = nc.subscribe(`${iso.natsPrefix}.silent`);
  await nc.flush();
  publisher = streamPublisher(nc, 300);
  await expect(publisher.publish(`${iso.natsPrefix}.silent`, request(), entry('silent'))).rejects.toThrow(/did not acknowledge a publish within 300 ms/);
  const pending = publisher.publish(`${iso.natsPrefix}.silent`, request(), entry('silent'));
  await publisher.close();
  await expect(pending).rejects.toThrow(/closing/);
  silent.unsubscribe();
});

describe('streamAckProblem', () => {
  const msg = (data: string, code?: number) => ({ data: new TextEncoder().encode(data), headers: code === undefined ? undefined : ({ code } as never) });

  it('an acknowledgement, also of a duplicate, is no problem', () => {
    expect(streamAckProblem(msg('{"stream":"S","seq":3}'))).toBeUndefined();
    expect(streamAckProblem(msg('{"stream":"S","seq":3,"duplicate":true}'))).toBeUndefined();
  });

  it('a stream error keeps the server’s api_error; empty and malformed replies are problems', () => {
    const err = streamAckProblem(msg('{"error":{"code":503,"err_code":10077,"description":"maximum messages per subject exceeded"}}'));
    expect(err?.message).toBe('maximum messages per subject exceeded');
    expect(err).toMatchObject({ api_error: { err_code: 10077 } });
    expect(streamAckProblem(msg('', 503))?.message).toMatch(/no responders/);
    expect(streamAckProblem(msg('', 408))?.message).toMatch(/status 408/);
    expect(streamAckProblem(msg('not json'))?.message).toMatch(/malformed/);
    expect(streamAckProblem(msg('{"seq":1}'))?.message).toMatch(/malformed/);
  });
});

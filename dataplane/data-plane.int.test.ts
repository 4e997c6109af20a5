/**
 * The data plane against the real nats-server: what ensureDataPlane declares (the response
 * stream sized from throughput × retention), per-instance consumers, de-duplicated request
 * publishing, request claims, and reading frames back — also from a stream that evicted them.
 */
import { AckPolicy, RetentionPolicy, StorageType, nanos, type JetStreamManager, type JsMsg, type NatsConnection } from 'nats';
import { eventually, sleep } from '../test/harness/wait';
import { isolation } from '../test/harness';
import { natsStack, TestStack } from '../test/harness/stack';
import type { InferenceRequest, ResponseFrame } from '../shared/serving';
import { openRequestClaims } from './claims';
import { deleteInstanceConsumer, ensureInstanceConsumer, instanceConsuming } from './consumers';
import { ensureDataPlane } from './declare';
import { encodeJson } from './json';
import { consumerNameOf, laneSubjectOf, requestSubjectOf, responseSubjectOf, type DataPlaneNames } from './names';
import { publishRequest } from './publish';
import { readStoredFrames, responseStreamState } from './response-stream';

let nc: NatsConnection;
let jsm: JetStreamManager;
let names: DataPlaneNames;
const stack = new TestStack();

beforeAll(async () => {
  ({ nc, names } = await stack.open(natsStack(isolation(), { declare: true })));
  jsm = await nc.jetstreamManager();
});

afterAll(() => stack.close());

const request = (id: string): InferenceRequest => ({
  id,
  replyTo: responseSubjectOf(names, id),
  deadline: Date.now() + 60_000,
  body: { model: 'm', messages: [{ role: 'user', content: 'hi' }] },
});

describe('ensureDataPlane', () => {
  it('declares the request stream as a de-duplicating, age- and size-bounded work queue on file', async () => {
    const { config } = await jsm.streams.info(names.requestStream);
    expect(config.subjects).toEqual([`${names.subjectScope}.magus.req.>`]);
    expect(config.retention).toBe(RetentionPolicy.Workqueue);
    expect(config.storage).toBe(StorageType.File);
    expect(config.max_bytes).toBe(512 * 1024 * 1024);
    expect(config.duplicate_window).toBe(nanos(5 * 60_000));
    expect(config.max_age).toBe(nanos(60 * 60_000));
  });

  it('declares the response capture stream and the KV buckets', async () => {
    const res = (await jsm.streams.info(names.responseStream)).config;
    expect(res.subjects).toEqual([`${names.subjectScope}.magus.res.>`]);
    expect(res.storage).toBe(StorageType.Memory);
    expect(res.max_age).toBeGreaterThan(0);
    const sessions = (await jsm.streams.info(`KV_${names.sessionsBucket}`)).config;
    expect(sessions.max_age).toBe(nanos(24 * 60 * 60_000));
    expect(sessions.max_msgs_per_subject).toBe(1);
    // Deletes leave markers that expire (session-keys.ts): the pools' server-kept counts hold no day of deletes.
    expect((sessions as typeof sessions & { allow_msg_ttl?: boolean }).allow_msg_ttl).toBe(true);
    expect((await jsm.streams.info(`KV_${names.tokensBucket}`)).config.max_age).toBe(0);
    expect((await jsm.streams.info(`KV_${names.claimsBucket}`)).config.max_age).toBe(nanos(2 * 60 * 60_000));
  });

  it('sizes the response stream from peak throughput × the longest request, records that retention, and follows a changed configuration', async () => {
    const MiB = 1024 * 1024;
    const info = async () => (await jsm.streams.info(names.responseStream)).config;
    expect(await info()).toMatchObject({
      max_bytes: 300 * MiB,
      max_age: nanos(30 * 60_000),
      metadata: expect.objectContaining({ 'magus.dev/required-retention-ms': '600000' }) as unknown,
    });
    await ensureDataPlane(nc, { prefix: names.prefix, responsePeakBytesPerSec: 16 * 1024, responseRetentionMs: 45 * 60_000 });
    expect(await info()).toMatchObject({
      max_bytes: 16 * 1024 * 45 * 60,
      max_age: nanos(45 * 60_000),
      metadata: expect.objectContaining({ 'magus.dev/required-retention-ms': '2700000', 'magus.dev/peak-bytes-per-sec': '16384' }) as unknown,
    });
    // A memory stream reserves its size from JetStream's max_memory: too big fails, naming the knobs, and changes nothing.
    await expect(ensureDataPlane(nc, { prefix: names.prefix, responsePeakBytesPerSec: 2 ** 30, responseRetentionMs: 24 * 3_600_000 })).rejects.toThrow(
      /MAGUS_RESPONSES: JetStream has less memory left than .* \(peak 1073741824 B\/s × 86400 s\)/,
    );
    expect((await info()).max_bytes).toBe(16 * 1024 * 45 * 60);
    await ensureDataPlane(nc, { prefix: names.prefix });
    expect((await info()).max_bytes).toBe(300 * MiB);
  });

  it('captures frames of both reply subject forms', async () => {
    const perReplica = responseSubjectOf(names, 'forms-1', 'gw-a');
    const older = responseSubjectOf(names, 'forms-2');
    nc.publish(perReplica, encodeJson({ seq: 0, type: 'done' }));
    nc.publish(older, encodeJson({ seq: 0, type: 'done' }));
    await nc.flush();
    for (const subject of [perReplica, older]) {
      expect(await readStoredFrames(nc.jetstream(), jsm, names.responseStream, subject)).toMatchObject({ frames: [{ seq: 0, type: 'done' }], complete: true });
    }
  });

  it('is idempotent and brings limits of existing streams and buckets up to date', async () => {
    const again = await ensureDataPlane(nc, { prefix: names.prefix, requestMaxAgeMs: 30 * 60_000, sessionMaxAgeMs: 60 * 60_000 });
    expect(again).toEqual(names);
    expect((await jsm.streams.info(names.requestStream)).config.max_age).toBe(nanos(30 * 60_000));
    expect((await jsm.streams.info(`KV_${names.sessionsBucket}`)).config.max_age).toBe(nanos(60 * 60_000));
    await ensureDataPlane(nc, { prefix: names.prefix });
    expect((await jsm.streams.info(names.requestStream)).config.max_age).toBe(nanos(60 * 60_000));
  });
});

describe('instance consumers', () => {
  it('are durable pull consumers filtered to the instance, bounded by slots, and updatable', async () => {
    const info = await ensureInstanceConsumer(jsm, names, { pool: 'pool', instance: 'c1', slots: 2, ackWaitMs: 5000, maxDeliver: 3 });
    expect(info.name).toBe(consumerNameOf('pool', 'c1'));
    expect(info.config).toMatchObject({
      durable_name: 'pool_c1',
      filter_subject: requestSubjectOf(names, 'pool', 'c1'),
      ack_policy: AckPolicy.Explicit,
      max_ack_pending: 2,
      ack_wait: nanos(5000),
      max_deliver: 3,
    });
    const again = await ensureInstanceConsumer(jsm, names, { pool: 'pool', instance: 'c1', slots: 2, ackWaitMs: 5000, maxDeliver: 3 });
    expect(again.config.max_ack_pending).toBe(2);
    const resized = await ensureInstanceConsumer(jsm, names, { pool: 'pool', instance: 'c1', slots: 4 });
    expect(resized.config.max_ack_pending).toBe(4);
    expect(resized.config.ack_wait).toBe(nanos(30_000));
    expect(await deleteInstanceConsumer(jsm, names, { pool: 'pool', instance: 'c1' })).toBe(true);
    expect(await deleteInstanceConsumer(jsm, names, { pool: 'pool', instance: 'c1' })).toBe(false);
  });

  it('tell whether a bridge consumes them: a consumer pulling, idle or with every slot busy, is; one nobody pulls from, or none, is not', async () => {
    await ensureInstanceConsumer(jsm, names, { pool: 'pool', instance: 'c3', slots: 2 });
    expect(await instanceConsuming(nc, names.requestStream, 'pool', 'c3')).toBe(false);
    expect(await instanceConsuming(nc, names.requestStream, 'pool', 'nobody')).toBe(false);
    // As the bridge consumes (dataplane/bridge/consumer.ts): `max_messages` = slots.
    const consumer = await nc.jetstream().consumers.get(names.requestStream, consumerNameOf('pool', 'c3'));
    const messages = await consumer.consume({ max_messages: 2 });
    const held: JsMsg[] = [];
    const reading = (async () => {
      for await (const m of messages) held.push(m);
    })();
    await eventually(async () => expect(await instanceConsuming(nc, names.requestStream, 'pool', 'c3')).toBe(true), 10_000);
    // Every slot busy (two requests delivered, not acked): still consuming.
    for (let i = 0; i < 3; i++) await nc.jetstream().publish(requestSubjectOf(names, 'pool', 'c3'), new TextEncoder().encode(`r${i}`));
    await eventually(() => Promise.resolve(expect(held).toHaveLength(2)), 10_000);
    expect((await jsm.consumers.info(names.requestStream, consumerNameOf('pool', 'c3'))).num_ack_pending).toBe(2);
    expect(await instanceConsuming(nc, names.requestStream, 'pool', 'c3')).toBe(true);
    for (const m of held) m.ack();
    await messages.close();
    await reading;
    // The third is still on the subject (the two acked are gone), and one on a lane; deleted with the instance's consumers, so are they.
    await nc.jetstream().publish(laneSubjectOf(names, 'pool', 'c3', 'moved'), new TextEncoder().encode('m0'));
    const left = async () => {
      const subjects = (await jsm.streams.info(names.requestStream, { subjects_filter: `${requestSubjectOf(names, 'pool', 'c3')}.>` })).state.subjects ?? {};
      const own = (await jsm.streams.info(names.requestStream, { subjects_filter: requestSubjectOf(names, 'pool', 'c3') })).state.subjects ?? {};
      return Object.values({ ...subjects, ...own }).reduce((n, c) => n + c, 0);
    };
    expect(await left()).toBe(2);
    expect(await deleteInstanceConsumer(jsm, names, { pool: 'pool', instance: 'c3' })).toBe(true);
    expect(await left()).toBe(0);
    expect(await instanceConsuming(nc, names.requestStream, 'pool', 'c3')).toBe(false);
  });

  it('reject a non-positive slot count', async () => {
    await expect(ensureInstanceConsumer(jsm, names, { pool: 'pool', instance: 'c2', slots: 0 })).rejects.toThrow(/slots/);
  });
});

describe('publishRequest', () => {
  it('stores a request once however often it is published with the same id', async () => {
    await ensureInstanceConsumer(jsm, names, { pool: 'pool', instance: 'dup', slots: 1 });
    const req = request('dup-1');
    const first = await publishRequest(nc.jetstream(), names, { pool: 'pool', instance: 'dup' }, req);
    const second = await publishRequest(nc.jetstream(), names, { pool: 'pool', instance: 'dup' }, req);
    expect(first.duplicate).toBe(false);
    expect(second).toEqual({ duplicate: true, seq: first.seq });
    const info = await jsm.consumers.info(names.requestStream, consumerNameOf('pool', 'dup'));
    expect(info.num_pending).toBe(1);
  });
});

describe('request claims', () => {
  it('create, take over with a CAS, fence the superseded attempt, and remember the terminal frame', async () => {
    const claims = await openRequestClaims(nc.jetstream(), names, { pool: 'pool', instance: 'claims' });
    const first = await claims.acquire('claim-1', 'a');
    expect(first.kind).toBe('fresh');
    expect(first.claim).toMatchObject({ attempt: 1, owner: 'a', state: 'running' });
    const second = await claims.acquire('claim-1', 'b');
    expect(second.kind).toBe('takeover');
    expect(second.claim).toMatchObject({ attempt: 2, owner: 'b', createdAt: first.claim.createdAt });
    const done: ResponseFrame = { seq: 3, type: 'done' };
    // The first attempt lost the request: its finish must fail.
    expect(await claims.finish('claim-1', first.claim, first.revision, done)).toBe(false);
    expect(await claims.finish('claim-1', second.claim, second.revision, done)).toBe(true);
    const third = await claims.acquire('claim-1', 'c');
    expect(third.kind).toBe('finished');
    expect(third.claim.terminal).toEqual(done);
    expect(await claims.revision('nobody')).toBeNull();
  });
});

describe('readStoredFrames', () => {
  it('returns what reached the server, in order and each seq once', async () => {
    const subject = responseSubjectOf(names, 'stored-1');
    const chunk = (seq: number, text: string): ResponseFrame => ({ seq, type: 'chunk', data: { choices: [{ index: 0, delta: { content: text } }] } });
    for (const f of [chunk(0, 'a'), chunk(1, 'b'), chunk(1, 'b-late'), chunk(2, 'c')]) nc.publish(subject, encodeJson(f));
    nc.publish(responseSubjectOf(names, 'stored-other'), encodeJson(chunk(0, 'x')));
    await nc.flush();
    const { frames, complete } = await readStoredFrames(nc.jetstream(), jsm, names.responseStream, subject);
    expect(complete).toBe(true);
    expect(frames).toEqual([chunk(0, 'a'), chunk(1, 'b'), chunk(2, 'c')]);
    const never = responseSubjectOf(names, 'never');
    expect(await readStoredFrames(nc.jetstream(), jsm, names.responseStream, never)).toEqual({ frames: [], beyondGap: [], highestSeq: -1, complete: true });
    // A stream that dropped nothing: none stored means none sent.
    expect((await readStoredFrames(nc.jetstream(), jsm, names.responseStream, never, { since: Date.now() - 60_000 })).complete).toBe(true);
  });

  it('reads the same by batched direct gets (the gateway: no consumer made), across pages and beside other subjects', async () => {
    const subject = responseSubjectOf(names, 'stored-direct');
    const other = responseSubjectOf(names, 'stored-direct-other');
    const chunk = (seq: number): ResponseFrame => ({ seq, type: 'chunk', data: { choices: [{ index: 0, delta: { content: `piece ${seq}` } }] } });
    // 600 frames, more than one batch (256), each between two of another subject's.
    for (let seq = 0; seq < 600; seq++) {
      nc.publish(other, encodeJson(chunk(seq)));
      nc.publish(subject, encodeJson(chunk(seq)));
    }
    nc.publish(subject, encodeJson({ seq: 600, type: 'done', data: {} }));
    await nc.flush();
    // Every consumer made is asked for on the JetStream API: heard here.
    const creates = nc.subscribe(`$JS.API.CONSUMER.CREATE.${names.responseStream}.>`);
    let made = 0;
    void (async () => {
      for await (const _ of creates) made++;
    })();
    const direct = await readStoredFrames(nc.jetstream(), jsm, names.responseStream, subject, { direct: nc });
    expect(direct.frames).toHaveLength(601);
    expect(direct.frames.map((f) => f.seq)).toEqual([...Array(601).keys()]);
    expect(direct.complete).toBe(true);
    const never = responseSubjectOf(names, 'never-direct');
    expect(await readStoredFrames(nc.jetstream(), jsm, names.responseStream, never, { direct: nc })).toEqual({
      frames: [],
      beyondGap: [],
      highestSeq: -1,
      complete: true,
    });
    // Gaps show the same way.
    const gap = responseSubjectOf(names, 'stored-direct-gap');
    nc.publish(gap, encodeJson({ seq: 0, type: 'chunk', data: {} }));
    nc.publish(gap, encodeJson({ seq: 2, type: 'chunk', data: {} }));
    await nc.flush();
    expect(await readStoredFrames(nc.jetstream(), jsm, names.responseStream, gap, { direct: nc })).toMatchObject({
      frames: [{ seq: 0 }],
      beyondGap: [{ seq: 2 }],
      highestSeq: 2,
      complete: false,
    });
    await nc.flush();
    expect(made).toBe(0);
    // One round trip, not two: the first batch is asked for before the last seq is answered.
    const seen: string[] = [];
    // Every message on the server, as the read's requests and their replies (to its inbox) pass.
    const spy = nc.subscribe('>', {
      callback: (_err, m) => {
        if (m.subject === `$JS.API.DIRECT.GET.${names.responseStream}`) seen.push('batch asked');
        else if (m.subject.startsWith(`$JS.API.DIRECT.GET.${names.responseStream}.`)) seen.push('last asked');
        else if (m.subject.startsWith('_INBOX')) seen.push('answered');
      },
    });
    await nc.flush();
    const short = responseSubjectOf(names, 'stored-direct-short');
    for (let seq = 0; seq < 3; seq++) nc.publish(short, encodeJson(chunk(seq)));
    await nc.flush();
    expect((await readStoredFrames(nc.jetstream(), jsm, names.responseStream, short, { direct: nc })).frames).toHaveLength(3);
    await nc.flush();
    expect(seen.filter((w) => w !== 'answered').sort()).toEqual(['batch asked', 'last asked']);
    expect(seen.indexOf('batch asked')).toBeLessThan(seen.indexOf('answered'));
    expect(seen.indexOf('last asked')).toBeLessThan(seen.indexOf('answered'));
    spy.unsubscribe();
    // The consumer's read (bridges read so) finds the same, and makes one.
    expect(await readStoredFrames(nc.jetstream(), jsm, names.responseStream, subject)).toEqual(direct);
    await nc.flush();
    expect(made).toBe(1);
    creates.unsubscribe();
  });

  it('reports a gap as incomplete', async () => {
    const subject = responseSubjectOf(names, 'stored-gap');
    nc.publish(subject, encodeJson({ seq: 0, type: 'chunk', data: {} }));
    nc.publish(subject, encodeJson({ seq: 2, type: 'chunk', data: {} }));
    await nc.flush();
    const { frames, beyondGap, highestSeq, complete } = await readStoredFrames(nc.jetstream(), jsm, names.responseStream, subject);
    expect(frames.map((f) => f.seq)).toEqual([0]);
    expect(beyondGap.map((f) => f.seq)).toEqual([2]);
    expect(highestSeq).toBe(2);
    expect(complete).toBe(false);
  });

  describe('from a stream too small for its traffic (it evicts the oldest frames)', () => {
    let small: DataPlaneNames;
    const chunk = (seq: number) => encodeJson({ seq, type: 'chunk', data: { choices: [{ index: 0, delta: { content: `piece ${seq}` } }] } });
    /** Other requests' frames, more than the stream holds: everything published before them is evicted. */
    const traffic = async (tag: string) => {
      for (let i = 0; i < 160; i += 1)
        nc.publish(responseSubjectOf(small, `${tag}-${i}`, 'gw-other'), encodeJson({ seq: 0, type: 'done', data: 'x'.repeat(400) }));
      await nc.flush();
    };

    beforeAll(async () => {
      small = await ensureDataPlane(nc, { prefix: `${names.prefix}S`, responseMaxBytes: 32 * 1024 });
    });
    afterAll(async () => {
      for (const s of [
        small.requestStream,
        small.responseStream,
        ...[small.sessionsBucket, small.tokensBucket, small.claimsBucket, small.poolsBucket, small.limitsBucket, small.usageBucket, small.usageSumsBucket].map(
          (b) => `KV_${b}`,
        ),
      ]) {
        await jsm.streams.delete(s).catch(() => false);
      }
    });

    it('every frame of a request evicted: incomplete given when the request was stored, not "nothing was sent"', async () => {
      const since = Date.now(); // the request was stored now; its frames follow
      await sleep(5);
      const subject = responseSubjectOf(small, 'all-gone', 'gw-a');
      for (let seq = 0; seq < 3; seq += 1) nc.publish(subject, chunk(seq));
      await nc.flush();
      await traffic('all-gone');
      // Without `since` nothing tells eviction from silence.
      expect(await readStoredFrames(nc.jetstream(), jsm, small.responseStream, subject)).toMatchObject({ frames: [], complete: true });
      expect(await readStoredFrames(nc.jetstream(), jsm, small.responseStream, subject, { since })).toMatchObject({
        frames: [],
        highestSeq: -1,
        complete: false,
      });
    });

    it('the start evicted: the frames after it come back apart, with the highest seq stored', async () => {
      const subject = responseSubjectOf(small, 'start-gone', 'gw-a');
      for (let seq = 0; seq < 3; seq += 1) nc.publish(subject, chunk(seq));
      await nc.flush();
      await traffic('start-gone');
      for (let seq = 3; seq < 5; seq += 1) nc.publish(subject, chunk(seq));
      await nc.flush();
      const stored = await readStoredFrames(nc.jetstream(), jsm, small.responseStream, subject, { since: Date.now() - 60_000 });
      expect({ frames: stored.frames, beyondGap: stored.beyondGap.map((f) => f.seq), highestSeq: stored.highestSeq, complete: stored.complete }).toEqual({
        frames: [],
        beyondGap: [3, 4],
        highestSeq: 4,
        complete: false,
      });
    });

    it('responseStreamState shows it: full, and its oldest frame far younger than the retention requests need', async () => {
      await traffic('state');
      const state = await responseStreamState(jsm, small.responseStream);
      expect(state.maxBytes).toBe(32 * 1024);
      expect(state.bytes).toBeGreaterThan(0.9 * state.maxBytes);
      expect(state.requiredRetentionMs).toBe(10 * 60_000);
      expect(state.oldestFrameAgeMs).toBeLessThan(state.requiredRetentionMs!);
      const roomy = await responseStreamState(jsm, names.responseStream);
      expect(roomy.bytes).toBeLessThan(0.01 * roomy.maxBytes);
    });
  });
});

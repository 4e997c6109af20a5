/**
 * The far side of `npm run bench:nats-floor` (bench/nats-floor.ts), in a process of its own as a
 * bridge is: a stub engine and the least a bridge can do on each path — take a request, call the
 * engine over HTTP, publish the answer to the request's `replyTo` (and ack it, on JetStream).
 */
import { AckPolicy, connect, RetentionPolicy, StorageType, type NatsConnection } from 'nats';
import { startStubEngine, type StubEngine } from '../test/fixtures/stub-engine';
import { createEngineClient } from '../dataplane/bridge/engine-client';

/** The paths, by request subject; each JetStream one is a work-queue stream of its own. */
export const CORE_SUBJECT = 'floor.core';
export const QUEUES = { file: { stream: 'FLOOR_FILE', storage: StorageType.File }, memory: { stream: 'FLOOR_MEMORY', storage: StorageType.Memory } } as const;
export type QueueKind = keyof typeof QUEUES;
export const queueSubject = (kind: QueueKind) => `floor.${kind}`;
/** Answers published under this prefix are captured by a memory stream, as `MAGUS_RESPONSES` captures `magus.res.>`. */
export const CAPTURED_PREFIX = 'floor.res';
const CAPTURE_STREAM = 'FLOOR_RESPONSES';

export interface FloorRequest {
  replyTo: string;
  body: unknown;
}

export type FloorCommand = { type: 'start'; nats: string } | { type: 'stop' };
export type FloorReply = { engineUrl: string } | { stopped: true } | { error: string };

const FOREVER = new AbortController().signal;
let nc: NatsConnection | undefined;
let engine: StubEngine | undefined;

async function start(servers: string): Promise<string> {
  nc = await connect({ servers, name: 'bench-floor-bridge', noAsyncTraces: true });
  const conn = nc;
  engine = await startStubEngine({ modelId: 'stub', chunks: 1 });
  const client = createEngineClient(engine.url);
  const answer = async (data: Uint8Array): Promise<void> => {
    const req = JSON.parse(new TextDecoder().decode(data)) as FloorRequest;
    const res = await client.post('/v1/chat/completions', JSON.stringify(req.body), { accept: 'application/json', signal: FOREVER });
    conn.publish(req.replyTo, await res.text());
  };

  const sub = conn.subscribe(CORE_SUBJECT);
  void (async () => {
    for await (const m of sub) void answer(m.data);
  })();

  const jsm = await conn.jetstreamManager();
  for (const [kind, q] of Object.entries(QUEUES) as [QueueKind, (typeof QUEUES)[QueueKind]][]) {
    await jsm.streams.delete(q.stream).catch(() => false);
    await jsm.streams.add({
      name: q.stream,
      subjects: [queueSubject(kind)],
      retention: RetentionPolicy.Workqueue,
      storage: q.storage,
      duplicate_window: 300e9,
    });
    await jsm.consumers.add(q.stream, { durable_name: 'bridge', ack_policy: AckPolicy.Explicit, max_ack_pending: 16, filter_subject: queueSubject(kind) });
    const messages = await (await conn.jetstream().consumers.get(q.stream, 'bridge')).consume({ max_messages: 16 });
    void (async () => {
      for await (const m of messages)
        void answer(m.data).then(
          () => m.ack(),
          () => m.term(),
        );
    })();
  }
  await jsm.streams.delete(CAPTURE_STREAM).catch(() => false);
  await jsm.streams.add({ name: CAPTURE_STREAM, subjects: [`${CAPTURED_PREFIX}.>`], storage: StorageType.Memory, max_age: 1800e9 });
  return engine.url;
}

async function handle(cmd: FloorCommand): Promise<FloorReply> {
  if (cmd.type === 'start') return { engineUrl: await start(cmd.nats) };
  await nc?.drain();
  await engine?.stop();
  return { stopped: true };
}

if (require.main === module) {
  process.on('message', (cmd: FloorCommand) => {
    handle(cmd).then(
      (reply) => process.send!(reply),
      (err: unknown) => process.send!({ error: (err as Error).stack ?? String(err) }),
    );
  });
  process.on('disconnect', () => process.exit(0));
}

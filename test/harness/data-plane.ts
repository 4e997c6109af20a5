/** The data plane from a test's side: ask an instance the way the gateway does, without a gateway. */
import { randomBytes } from 'node:crypto';
import type { NatsConnection } from 'nats';
import { instanceResponseSubjectOf, publishRequest, responseSubjectOf, type DataPlaneNames } from '../../dataplane';
import { decodeFrame, FrameParts, FrameSequencer } from '../../dataplane/frames';
import type { ChatCompletionRequest } from '../../shared/chat';
import type { ResponseFrame } from '../../shared/serving';

/**
 * Publishes a chat request to `pool`/`instance` and collects its frames in order, as the gateway
 * would; resolves with them (a large answer's parts as they came) and the answer's text. Rejects
 * when no complete answer comes within `timeoutMs`.
 */
export async function askInstance(
  nc: NatsConnection,
  names: DataPlaneNames,
  pool: string,
  instance: string,
  body: Partial<ChatCompletionRequest>,
  timeoutMs = 30_000,
): Promise<{ frames: ResponseFrame[]; text: string }> {
  const id = `req-${randomBytes(6).toString('hex')}`;
  const sequencer = new FrameSequencer();
  const relayed: ResponseFrame[] = [];
  // As a gateway replica asks: its reply subject, the frames on the instance's subject for it.
  const replyTo = responseSubjectOf(names, id, 'gw-test');
  const sub = nc.subscribe(instanceResponseSubjectOf(replyTo, id, pool, instance));
  const done = (async () => {
    for await (const m of sub) {
      const f = decodeFrame(m.data);
      if (f) relayed.push(...sequencer.push(f));
      if (sequencer.finished) break;
    }
  })();
  await nc.flush();
  const timer = setTimeout(() => sub.unsubscribe(), timeoutMs);
  await publishRequest(
    nc.jetstream(),
    names,
    { pool, instance },
    {
      id,
      replyTo,
      instanceFrames: true,
      deadline: Date.now() + timeoutMs,
      body: { model: pool, messages: [{ role: 'user', content: 'Hello' }], ...body },
    },
  );
  await done;
  clearTimeout(timer);
  sub.unsubscribe();
  if (!sequencer.finished) throw new Error(`no complete answer to ${id}`);
  // An answer larger than a message came in parts: its text is in the `done` they join into.
  const parts = new FrameParts();
  const whole: ResponseFrame[] = [];
  for (const f of relayed) {
    if (f.type === 'part') parts.add(f);
    else whole.push(f.type === 'done' ? (parts.join(f) ?? f) : f);
  }
  const text = whole
    .map(
      (f) =>
        (f as { data?: { choices?: { delta?: { content?: string }; message?: { content?: string } }[] } }).data?.choices
          ?.map((c) => c.delta?.content ?? c.message?.content ?? '')
          .join('') ?? '',
    )
    .join('');
  return { frames: relayed, text };
}

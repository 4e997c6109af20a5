/**
 * A resume follows an answer's moves with frames read back from the store: a read of a request's
 * frames that ends after the answer moved on from that request is that request's, not the next
 * one's. (bench:chaos: the first request's stored hand-back, read after its recorded move was
 * followed, reached the continuation's sequencer — the resuming replica moved the answer again at
 * once, with nothing of the continuation said, and its client waited 60–115 s for the rest.)
 */
import { CONTINUE_ELSEWHERE } from '../../shared/continuation';
import type { ResponseFrame } from '../../shared/serving';
import { buildTestApp, chunk, sseEvents, TEST_SECRET, type TestApp } from '../../test/harness/gateway-app';
import type { MoveLog, MoveRecord } from '../serving/resume';
import { resumeIdPrefix } from '../serving/resume';

const first = { replica: 'gw-000000000001', pool: 'pool-a', instance: 'inst-1', requestId: 'R1' };
const handedBack: ResponseFrame = {
  seq: 0,
  type: 'error',
  error: { status: 503, type: 'server_error', code: CONTINUE_ELSEWHERE, message: 'handed back before its first piece' },
};

let t: TestApp;
afterEach(() => t?.app.close());

test("a resume whose first request's stored frames come after its recorded move was followed relays the continuation, once, and moves it no further", async () => {
  const claimed: { n: number; to: MoveRecord }[] = [];
  const moves: MoveLog = {
    // Recorded by the replica that published it (gone): handed back before anything was said, continued on inst-2.
    find: (id, n) => Promise.resolve(id === 'R1' && n === 1 ? { ...first, instance: 'inst-2', requestId: 'R1-m1', at: 0 } : undefined),
    claim: (_id, n, to) => {
      claimed.push({ n, to });
      return Promise.resolve(to);
    },
  };
  // The first request's frames are read slowly (a herd of resumes, a busy stream), the continuation's after them.
  const stored: Record<string, { frames: ResponseFrame[]; ms: number }> = {
    'magus.res.R1': { frames: [handedBack], ms: 400 },
    'magus.res.R1-m1': { frames: [chunk(0, 'Hello'), chunk(1, ' world'), { seq: 2, type: 'done' }], ms: 700 },
  };
  const readStored = async (subject: string): Promise<ResponseFrame[]> => {
    const s = stored[subject];
    await new Promise((resolve) => setTimeout(resolve, s?.ms ?? 0));
    return s?.frames ?? [];
  };
  t = await buildTestApp({ moves, readStored });

  const res = await t.app.inject({
    method: 'POST',
    url: '/v1/chat/completions',
    headers: { authorization: `Bearer ${t.tokens.alice.token}`, 'last-event-id': resumeIdPrefix(TEST_SECRET, 'alice', first) },
    payload: { model: 'tiny', messages: [{ role: 'user', content: 'hi' }], stream: true },
  });

  expect(res.statusCode).toBe(200);
  const events = sseEvents(res.body);
  const text = events.map((e) => (e as { choices?: { delta?: { content?: string } }[] }).choices?.[0]?.delta?.content ?? '').join('');
  expect(text).toBe('Hello world');
  expect(events.at(-1)).toBe('[DONE]');
  // Nothing moved again, nothing published: the continuation was under way.
  expect(claimed).toEqual([]);
  expect(t.plane.published).toEqual([]);
});

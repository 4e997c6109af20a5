import type { FastifyReply } from 'fastify';
import { SseResponse } from './sse';

/** A reply whose raw response records each socket write. */
function fakeReply() {
  const writes: string[] = [];
  let ended = false;
  const raw = {
    destroyed: false,
    writeHead: jest.fn(),
    write: (text: string) => writes.push(text),
    end: () => (ended = true),
  };
  const reply = { raw, hijack: jest.fn(), getHeaders: () => ({}) } as unknown as FastifyReply;
  return { reply, writes, ended: () => ended };
}

const tick = () => new Promise((resolve) => process.nextTick(resolve));

describe('SseResponse', () => {
  it('sends the first event at once and the events written in one turn after it in one write', async () => {
    const { reply, writes } = fakeReply();
    const sse = new SseResponse(reply, 60_000, 'r1');
    sse.data({ n: 0 });
    expect(writes).toEqual(['data: {"n":0}\n\n']);
    sse.data({ n: 1 });
    sse.data({ n: 2 });
    expect(writes).toHaveLength(1);
    await tick();
    expect(writes).toEqual(['data: {"n":0}\n\n', 'data: {"n":1}\n\ndata: {"n":2}\n\n']);
    sse.stop();
  });

  it('done() hands over what is pending, then [DONE], before it ends the response', () => {
    const { reply, writes, ended } = fakeReply();
    const sse = new SseResponse(reply, 60_000, 'r1');
    sse.data({ n: 0 });
    sse.data({ n: 1 });
    sse.done();
    expect(writes.join('')).toBe('data: {"n":0}\n\ndata: {"n":1}\n\ndata: [DONE]\n\n');
    expect(ended()).toBe(true);
  });

  it('writes nothing more once the client is gone', async () => {
    const { reply, writes } = fakeReply();
    const sse = new SseResponse(reply, 60_000, 'r1');
    sse.data({ n: 0 });
    sse.data({ n: 1 });
    (reply.raw as { destroyed: boolean }).destroyed = true;
    await tick();
    expect(writes).toHaveLength(1);
    sse.stop();
  });

  it("says a resumable answer's id without a seq in its keep-alives until its first chunk, then no more", () => {
    jest.useFakeTimers();
    try {
      const { reply, writes } = fakeReply();
      const sse = new SseResponse(reply, 2000, 'r1');
      jest.advanceTimersByTime(2000);
      // Not resumable yet (not published): a plain comment.
      expect(writes).toEqual([': keep-alive\n\n']);
      sse.resumable('ANSWER.MAC.');
      sse.waiting('queued');
      jest.advanceTimersByTime(2000);
      expect(writes[1]).toBe('id: ANSWER.MAC.\n: keep-alive: queued\n\n');
      sse.data({ n: 0 }, 0);
      jest.advanceTimersByTime(2000); // the chunk was this interval's write
      jest.advanceTimersByTime(2000);
      expect(writes.slice(2)).toEqual(['id: ANSWER.MAC.0\ndata: {"n":0}\n\n', ': keep-alive: queued\n\n']);
      sse.stop();
      // A resumed stream whose client has chunk 17: its keep-alives say no id.
      const resumed = fakeReply();
      const again = new SseResponse(resumed.reply, 2000, 'r1');
      again.resumable('ANSWER.MAC.', 17);
      jest.advanceTimersByTime(2000);
      expect(resumed.writes).toEqual([': keep-alive\n\n']);
      again.stop();
    } finally {
      jest.useRealTimers();
    }
  });
});

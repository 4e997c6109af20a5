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
});

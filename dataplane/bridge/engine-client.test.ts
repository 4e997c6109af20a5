import { sseEventBatches } from './engine-client';

const collect = async (chunks: (string | Buffer)[]) => {
  const out: string[][] = [];
  for await (const batch of sseEventBatches(chunks)) out.push(batch);
  return out;
};

describe('sseEventBatches', () => {
  it('gives one batch per chunk with the events that chunk completed', async () => {
    expect(await collect(['data: a\n\ndata: b\n\n', 'data: c\n\n'])).toEqual([['a', 'b'], ['c']]);
  });

  it('an event split across chunks is given with the chunk that completes it; chunks that complete none give no batch', async () => {
    expect(await collect(['data: {"x"', ':1}\n', '\ndata: [DONE]\n\n'])).toEqual([['{"x":1}', '[DONE]']]);
  });

  it('joins multi-line data, accepts CRLF, skips comments and other fields, and ends an unterminated last event', async () => {
    expect(await collect([': keep-alive\r\n\r\nevent: x\r\ndata: one\r\ndata:two\r\n\r\n', 'data: last'])).toEqual([['one\ntwo'], ['last']]);
  });

  it('decodes UTF-8 split between byte chunks', async () => {
    const bytes = Buffer.from('data: é€\n\n');
    expect(await collect([bytes.subarray(0, 7), bytes.subarray(7)])).toEqual([['é€']]);
  });
});

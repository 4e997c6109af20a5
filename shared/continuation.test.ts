import type { ResponseFrame } from './serving';
import { resumedAnswer } from './continuation';

const chunk = (seq: number, delta: Record<string, unknown>, tokens?: number[], finish: string | null = null): ResponseFrame => ({
  seq,
  type: 'chunk',
  data: { object: 'chat.completion.chunk', choices: [{ index: 0, delta, finish_reason: finish }] },
  ...(tokens ? { tokens } : {}),
});

describe('resumedAnswer: what an engine that continues answers is handed from the frames already sent', () => {
  it('joins every chunk’s tokens and text; the role chunk carries neither', () => {
    const prior = [chunk(0, { role: 'assistant', content: '' }), chunk(1, { content: 'Hel' }, [10, 11]), chunk(2, { content: 'lo' }, [12])];
    expect(resumedAnswer(prior)).toEqual({ tokens: [10, 11, 12], text: 'Hello' });
    expect(resumedAnswer([])).toEqual({ tokens: [], text: '' });
  });

  it('text completions: the choices’ text', () => {
    const text = (seq: number, t: string, tokens: number[]): ResponseFrame => ({
      seq,
      type: 'chunk',
      data: { object: 'text_completion', choices: [{ index: 0, text: t, finish_reason: null }] },
      tokens,
    });
    expect(resumedAnswer([text(0, 'Once', [1]), text(1, ' upon', [2, 3])])).toEqual({ tokens: [1, 2, 3], text: 'Once upon' });
  });

  it.each<[string, ResponseFrame[]]>([
    ['a chunk with text and no tokens (another engine’s)', [chunk(0, { role: 'assistant', content: '' }), chunk(1, { content: 'Hi' })]],
    ['a finished choice', [chunk(0, { content: 'Hi' }, [1]), chunk(1, {}, undefined, 'stop')]],
    ['a tool call', [chunk(0, { tool_calls: [{ index: 0, function: { name: 'f', arguments: '{}' } }] }, [1])]],
    ['several choices', [{ seq: 0, type: 'chunk', data: { choices: [{ delta: { content: 'a' } }, { delta: { content: 'b' } }] }, tokens: [1] }]],
    ['a usage chunk', [{ seq: 0, type: 'chunk', data: { choices: [], usage: { completion_tokens: 3 } } }]],
    ['a terminal frame', [{ seq: 0, type: 'done' }]],
  ])('cannot say it with %s: the answer is generated again and compared', (_what, prior) => {
    expect(resumedAnswer(prior)).toBeUndefined();
  });
});

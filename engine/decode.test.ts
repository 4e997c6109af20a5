import type { Token } from 'node-llama-cpp' with { 'resolution-mode': 'import' };
import { drawToken } from './decode';

describe('drawToken', () => {
  // Most likely first, as node-llama-cpp returns them.
  const logits = new Map([
    [7, 3],
    [8, 2],
    [9, -1],
  ]) as unknown as ReadonlyMap<Token, number>;

  it('is greedy at temperature 0, whatever the draw', () => {
    for (const u of [0, 0.5, 0.999]) expect(drawToken(logits, 0, 1, u)).toBe(7);
  });

  it('draws by softmax at the temperature: the draw walks the cumulative probabilities', () => {
    const w = [3, 2, -1].map((l) => Math.exp(l - 3));
    const total = w.reduce((a, b) => a + b);
    expect(drawToken(logits, 1, 1, 0)).toBe(7);
    expect(drawToken(logits, 1, 1, (w[0]! + 0.5 * w[1]!) / total)).toBe(8);
    expect(drawToken(logits, 1, 1, 0.9999)).toBe(9);
  });

  it('top_p keeps the smallest set that reaches it (at least one token)', () => {
    expect(drawToken(logits, 1, 0, 0.9999)).toBe(7);
    // p(7) ≈ 0.72 at temperature 1: top_p 0.8 needs 7 and 8, never 9.
    expect(drawToken(logits, 1, 0.8, 0.9999)).toBe(8);
  });

  it('top_k keeps the k most likely (a model default the gateway sets)', () => {
    expect(drawToken(logits, 1, 1, 0.9999, 2)).toBe(8);
    expect(drawToken(logits, 1, 1, 0.9999, 1)).toBe(7);
    expect(drawToken(logits, 1, 1, 0.9999, 3)).toBe(9);
  });

  it('a higher temperature flattens the distribution', () => {
    const u = 0.8;
    expect(drawToken(logits, 0.2, 1, u)).toBe(7);
    expect(drawToken(logits, 5, 1, u)).not.toBe(7);
  });
});

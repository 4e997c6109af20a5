import type { LlamaContextSequence, Token } from 'node-llama-cpp' with { 'resolution-mode': 'import' };
import { BatchShares, drawToken } from './decode';

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

describe('BatchShares', () => {
  const sequence = () => ({}) as LlamaContextSequence;
  /** Whether `p` has settled after the callbacks already queued ran (a setImmediate turn included). */
  const settledSoon = async (p: Promise<void> | undefined) => {
    let done = false;
    void p?.then(() => (done = true));
    await new Promise((resolve) => setImmediate(resolve));
    await new Promise((resolve) => setImmediate(resolve));
    return p === undefined || done;
  };

  test('prompts share a batch evenly after a token for each generating sequence', () => {
    const shares = new BatchShares(63);
    const [a, b, g] = [sequence(), sequence(), sequence()];
    shares.now(a, 'prompt');
    expect(shares.piece()).toBe(63);
    shares.now(g, 'generate');
    shares.now(b, 'prompt');
    expect(shares.piece()).toBe(31); // (63 - 1) / 2
    shares.end(b);
    expect(shares.piece()).toBe(62);
  });

  test("a resumed answer's prompt has the batches while it is evaluated: the other prompts wait, and go on when it generates or ends", async () => {
    const shares = new BatchShares(63);
    const [fresh, other, resumed, second, g] = [sequence(), sequence(), sequence(), sequence(), sequence()];
    shares.now(g, 'generate');
    shares.now(fresh, 'prompt');
    shares.now(other, 'prompt');
    expect(shares.piece()).toBe(31);
    shares.now(resumed, 'resume');
    // Its share: the batch but the generating token, not a third of it.
    expect(shares.piece()).toBe(62);
    const freshTurn = shares.turn(fresh);
    const otherTurn = shares.turn(other);
    expect(await settledSoon(shares.turn(resumed))).toBe(true);
    expect(await settledSoon(freshTurn)).toBe(false);
    shares.now(second, 'resume');
    expect(shares.piece()).toBe(31); // two resumed prompts share it
    shares.now(resumed, 'generate');
    expect(await settledSoon(freshTurn)).toBe(false); // the second is still evaluated
    shares.end(second); // (its client left)
    expect(await settledSoon(freshTurn)).toBe(true);
    expect(await settledSoon(otherTurn)).toBe(true);
    expect(shares.piece()).toBe(30); // (63 - 2) / 2 again
  });

  test('without a generating sequence a prompt goes on at once', () => {
    const shares = new BatchShares(63);
    const a = sequence();
    shares.now(a, 'prompt');
    expect(shares.turn(a)).toBeUndefined();
  });
});

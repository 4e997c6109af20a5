/**
 * Converted models run in llama.cpp (node-llama-cpp's prebuilt CPU build, in a child process)
 * and agree with an independent float64 forward pass over the original safetensors
 * (test/reference/reference-llama.ts). For F32 the greedy tokens must be identical and the logits
 * equal to float32 rounding; for F16/Q8_0/Q4_0 the logits must stay within the error their
 * encoding allows. The logit check matters: with small random weights a broken rotary
 * permutation can still produce the same argmax tokens.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { convertModel } from '../convert/convert';
import type { WeightsFormat } from '../convert/types';
import { writeTinyModel, type TinyModelOptions } from '../workers/dev/tiny-model';
import { runLlamaCpp } from './reference/llama-cpp';
import { generate, loadReference, logits, type ReferenceModel } from './reference/reference-llama';

let root: string;
beforeAll(() => {
  root = mkdtempSync(join(tmpdir(), 'magus-llamacpp-'));
});
afterAll(() => rmSync(root, { recursive: true, force: true }));

const maxAbsDiff = (a: ArrayLike<number>, b: ArrayLike<number>): number => {
  expect(a.length).toBe(b.length);
  let m = 0;
  for (let i = 0; i < a.length; i++) m = Math.max(m, Math.abs(a[i]! - b[i]!));
  return m;
};

interface Case {
  name: string;
  model: TinyModelOptions;
  prompt: number[];
}
const cases: Case[] = [
  { name: 'llama, GQA, llama3 rope scaling', model: { seed: 21, dtype: 'F32', ropeScaling: true }, prompt: [379, 72, 101, 108, 108, 111, 32, 119] },
  { name: 'llama, tied embeddings, F16 source', model: { seed: 22, dtype: 'F16', tied: true }, prompt: [379, 33, 200, 17, 64, 9, 250, 120] },
  { name: 'qwen3', model: { seed: 23, dtype: 'F32', arch: 'qwen3' }, prompt: [40, 41, 300, 12, 99, 180, 7, 66] },
];

// Largest logit error allowed, relative to the reference's logit range. Measured on these cases:
// f32 ≤ 1.3e-7, f16 ≤ 2.4e-4, q80 ≤ 8.4e-3, q40 ≤ 9.7e-2. Skipping the Llama Q/K permutation
// gives ~3e-2 at f32, so the f32 bound is what guards the permutation, rope and norms.
const TOLERANCE: Record<WeightsFormat, number> = { f32: 1e-5, f16: 1e-3, q80: 2e-2, q40: 1.5e-1 };

describe.each(cases)('$name', ({ name, model, prompt }) => {
  let dir: string;
  let ref: ReferenceModel;
  let want: Float64Array;
  beforeAll(async () => {
    dir = join(root, name.replace(/[^a-z0-9]+/gi, '-'));
    await writeTinyModel(dir, model);
    ref = await loadReference(dir);
    want = logits(ref, prompt);
  });

  test.each(['f32', 'f16', 'q80', 'q40'] as const)(
    'GGUF %s runs in llama.cpp and matches the reference',
    async (weights) => {
      const gguf = join(root, `${name.replace(/[^a-z0-9]+/gi, '-')}-${weights}.gguf`);
      await convertModel({ source: dir, format: 'gguf', weights, output: gguf, threads: 2 });
      const got = await runLlamaCpp({ model: gguf, promptTokens: prompt, nTokens: 24, logits: true });
      expect(got.tokens).toHaveLength(24);
      const range = Math.max(...want) - Math.min(...want);
      const diff = maxAbsDiff(got.logits ?? [], want);
      expect(diff / range).toBeLessThan(TOLERANCE[weights]);
      if (weights === 'f32') {
        const reference = generate(ref, prompt, 24);
        expect(got.tokens).toEqual(reference.tokens);
      }
    },
    60_000,
  );
});

#!/usr/bin/env node
/**
 * llama.cpp's view of GBNF grammars (node-llama-cpp 3.22.1, CPU prebuilt binary), for
 * shared/grammar/llama.test.ts: node-llama-cpp is ESM-only and jest runs CommonJS, so the test
 * spawns this script (as test/reference/llama-cpp.ts does llama-cpp-runner.mjs).
 *
 * Input (JSON on stdin):
 *   { checks?: [{ gbnf, texts: string[] }],
 *       each grammar parsed by llama.cpp (no model needed) and each text run through llama.cpp's
 *       matcher (`isTextCompatible`: the text's code points accepted one by one, then complete?)
 *     generate?: { model, jobs: [{ gbnf, count, maxTokens, temperature }] } }
 *       a model sampling under each grammar, seeds 0..count-1, control tokens banned (llama.cpp's
 *       grammar matches them by their text, which the detokenizer then drops)
 * Output (one JSON line): { checks: [{ error?, matches: boolean[] }], generated: [[{ tokens, bytes, eog }]] }
 *   where `bytes` (hex) is the tokens' bytes joined, as the grammar saw them — not the
 *   detokenized text, which llama.cpp cleans (" !" becomes "!") for BPE vocabularies.
 * Exit status: 0 on success; 1 with a one-line message on stderr otherwise.
 */
import { Buffer } from 'node:buffer';
import process from 'node:process';
import { getLlama, LlamaCompletion, LlamaLogLevel, TokenBias } from 'node-llama-cpp';

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const input = JSON.parse(Buffer.concat(chunks).toString('utf8'));

const llama = await getLlama({
  gpu: false,
  build: 'never',
  usePrebuiltBinaries: true,
  skipDownload: true,
  progressLogs: false,
  logLevel: LlamaLogLevel.disabled,
});
try {
  const checks = [];
  for (const { gbnf, texts } of input.checks ?? []) {
    let grammar;
    try {
      grammar = await llama.createGrammar({ grammar: gbnf });
    } catch (err) {
      checks.push({ error: err.message, matches: [] });
      continue;
    }
    checks.push({ matches: texts.map((t) => grammar._testText(t)) });
  }

  const generated = [];
  if (input.generate) {
    const model = await llama.loadModel({ modelPath: input.generate.model, gpuLayers: 0 });
    const context = await model.createContext({ contextSize: 1024, threads: 1 });
    const completion = new LlamaCompletion({ contextSequence: context.getSequence() });
    // Each token's bytes from the byte-level BPE vocabulary (GPT-2's byte ↔ character map).
    const pieces = model.fileInfo.metadata.tokenizer.ggml.tokens;
    const printable = [];
    for (let b = 0x21; b <= 0x7e; b++) printable.push(b);
    for (let b = 0xa1; b <= 0xac; b++) printable.push(b);
    for (let b = 0xae; b <= 0xff; b++) printable.push(b);
    const byteOfChar = new Map();
    let extra = 0;
    for (let b = 0; b < 256; b++) byteOfChar.set(printable.includes(b) ? b : 256 + extra++, b);
    const tokenBytes = pieces.map((p) => [...p].map((ch) => byteOfChar.get(ch.codePointAt(0)) ?? 0));
    const bias = new TokenBias(model.tokenizer);
    pieces.forEach((_, t) => {
      if (model.isSpecialToken(t)) bias.set(t, 'never');
    });
    for (const job of input.generate.jobs) {
      const grammar = await llama.createGrammar({ grammar: job.gbnf });
      const runs = [];
      for (let seed = 0; seed < job.count; seed++) {
        const tokens = [];
        const { metadata } = await completion.generateCompletionWithMeta('{', {
          grammar,
          tokenBias: bias,
          maxTokens: job.maxTokens,
          temperature: job.temperature,
          seed,
          onToken: (t) => tokens.push(...t),
        });
        const eog = metadata.stopReason === 'eogToken';
        const body = tokens.filter((t) => !model.isEogToken(t));
        runs.push({ tokens: body, bytes: Buffer.from(body.flatMap((t) => tokenBytes[t])).toString('hex'), eog });
      }
      generated.push(runs);
    }
  }
  process.stdout.write(`${JSON.stringify({ checks, generated })}\n`);
} catch (err) {
  process.stderr.write(`${err.message}\n`);
  process.exitCode = 1;
} finally {
  await llama.dispose();
}

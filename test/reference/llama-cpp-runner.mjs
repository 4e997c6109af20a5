#!/usr/bin/env node
/**
 * Runs a GGUF model with llama.cpp (node-llama-cpp, CPU prebuilt binary) and prints one JSON line.
 * node-llama-cpp is ESM-only and jest runs CommonJS, so tests spawn this script (see llama-cpp.ts).
 *
 * Input: a JSON object as the first argument, or on stdin when there is none:
 *   { model: string,          path of the .gguf file
 *     promptTokens?: number[], evaluated exactly as given (no BOS added)
 *     prompt?: string,         tokenized with the model's own tokenizer (special tokens parsed,
 *                              BOS/EOS added as the GGUF's add_bos/add_eos say, like HF
 *                              `tokenizer(prompt).input_ids`); used as the prompt when no promptTokens
 *     nTokens: number,         tokens to generate (no stop at EOS/EOT)
 *     contextSize?: number,    default: prompt + nTokens (llama.cpp rounds up to 256)
 *     threads?: number,        CPU threads (default 1: node-llama-cpp's default of at least 4
 *                              busy-waiting threads makes tiny models 10-100x slower on small hosts)
 *     logits?: boolean }       also print the full logits after the prompt
 * Output: { tokens, text, vocabSize, margins, tokenizedPrompt?, logits? } where `margins[i]` is
 *   the top-1 minus top-2 logit behind `tokens[i]` and `logits[id]` predicts `tokens[0]`.
 *
 * Decoding is plain argmax: temperature 0 (llama.cpp's greedy sampler) with no repetition
 * penalty, token bias or any other sampler, and the chosen token is checked against the argmax
 * of the raw logits. The KV cache is F32 and flash attention off, so an F32 GGUF computes in F32
 * throughout (the F16 default cache would round K and V). Nothing is downloaded or built: the
 * prebuilt binary shipped with node-llama-cpp is used or the run fails.
 * Exit status: 0 on success; 1 with a one-line message on stderr otherwise.
 */
import { Buffer } from 'node:buffer';
import process from 'node:process';
import { getLlama, LlamaLogLevel } from 'node-llama-cpp';

async function readInput() {
  let text = process.argv[2];
  if (text === undefined) {
    const chunks = [];
    for await (const chunk of process.stdin) chunks.push(chunk);
    text = Buffer.concat(chunks).toString('utf8');
  }
  let input;
  try {
    input = JSON.parse(text);
  } catch (err) {
    throw new Error(`input is not JSON: ${err.message}`);
  }
  const isTokens = (v) => Array.isArray(v) && v.every((t) => Number.isSafeInteger(t) && t >= 0);
  if (typeof input !== 'object' || input === null) throw new Error('input must be a JSON object');
  if (typeof input.model !== 'string') throw new Error('input.model must be the path of a .gguf file');
  if (!Number.isSafeInteger(input.nTokens) || input.nTokens < 0) throw new Error('input.nTokens must be a non-negative integer');
  if (input.promptTokens !== undefined && !isTokens(input.promptTokens)) throw new Error('input.promptTokens must be a list of token ids');
  if (input.prompt !== undefined && typeof input.prompt !== 'string') throw new Error('input.prompt must be a string');
  if (input.contextSize !== undefined && (!Number.isSafeInteger(input.contextSize) || input.contextSize < 1)) {
    throw new Error('input.contextSize must be a positive integer');
  }
  if (input.threads !== undefined && (!Number.isSafeInteger(input.threads) || input.threads < 1)) throw new Error('input.threads must be a positive integer');
  return input;
}

/** Top-1 and top-2 of a logits map that node-llama-cpp returns sorted by logit, descending. */
function topTwo(logits) {
  const it = logits.entries();
  const first = it.next().value;
  const second = it.next().value;
  if (first === undefined) throw new Error('llama.cpp returned no logits');
  return { token: first[0], margin: second === undefined ? Infinity : first[1] - second[1] };
}

async function run(input) {
  const threads = input.threads ?? 1;
  const llama = await getLlama({
    gpu: false,
    maxThreads: threads,
    build: 'never',
    usePrebuiltBinaries: true,
    skipDownload: true,
    progressLogs: false,
    logLevel: LlamaLogLevel.error,
    logger: (level, message) => process.stderr.write(`llama.cpp [${level}]: ${message}\n`),
  });
  try {
    const model = await llama.loadModel({ modelPath: input.model, gpuLayers: 0, useMmap: false });
    let tokenizedPrompt;
    if (input.prompt !== undefined) {
      tokenizedPrompt = model.tokenize(input.prompt, true);
      if (model.tokens.shouldPrependBosToken && model.tokens.bos != null) tokenizedPrompt.unshift(model.tokens.bos);
      if (model.tokens.shouldAppendEosToken && model.tokens.eos != null) tokenizedPrompt.push(model.tokens.eos);
    }
    const prompt = input.promptTokens ?? tokenizedPrompt;
    if (prompt === undefined || prompt.length === 0) throw new Error('give promptTokens or a prompt that tokenizes to at least one token');

    const context = await model.createContext({
      contextSize: input.contextSize ?? prompt.length + input.nTokens,
      batchSize: Math.max(prompt.length, 1),
      threads,
      flashAttention: false,
      experimentalKvCacheKeyType: 'F32',
      experimentalKvCacheValueType: 'F32',
    });
    const sequence = context.getSequence();
    const next = { generateNext: { token: true, logits: true, options: { temperature: 0 } } };

    const tokens = [];
    const margins = [];
    let vocabSize;
    let firstLogits;
    let feed = [...prompt.slice(0, -1), [prompt[prompt.length - 1], next]];
    for (let n = 0; n < Math.max(input.nTokens, 1); n++) {
      const results = await sequence.controlledEvaluate(feed);
      const out = results[feed.length - 1]?.next;
      if (out?.logits === undefined || out.token == null) throw new Error(`llama.cpp produced no token at step ${n}`);
      const top = topTwo(out.logits);
      // A greedy sampler that disagrees with the raw argmax means a sampler we did not ask for.
      if (top.token !== out.token && top.margin > 0) throw new Error(`llama.cpp chose token ${out.token} but the argmax is ${top.token}`);
      if (n === 0) {
        vocabSize = out.logits.size;
        if (input.logits === true) {
          firstLogits = new Array(vocabSize).fill(null);
          for (const [token, logit] of out.logits) firstLogits[token] = logit;
        }
      }
      if (n >= input.nTokens) break; // nTokens = 0: only the logits were wanted
      tokens.push(out.token);
      margins.push(top.margin);
      feed = [[out.token, next]];
      if (n + 1 === input.nTokens) break; // the last token needs no evaluation
    }

    const result = { tokens, text: model.detokenize(tokens), vocabSize, margins };
    if (tokenizedPrompt !== undefined) result.tokenizedPrompt = tokenizedPrompt;
    if (firstLogits !== undefined) result.logits = firstLogits;
    return result;
  } finally {
    await llama.dispose();
  }
}

try {
  const result = await run(await readInput());
  // Infinity (a one-token vocabulary) is not JSON; write it as null.
  process.stdout.write(`${JSON.stringify(result, (_k, v) => (v === Infinity ? null : v))}\n`);
  process.exitCode = 0;
} catch (err) {
  process.stderr.write(`llama-cpp-runner: ${err instanceof Error ? err.message : String(err)}\n`);
  process.exitCode = 1;
}

/**
 * Runs a GGUF model with llama.cpp from jest: spawns `llama-cpp-runner.mjs` (node-llama-cpp is
 * ESM-only) with this Node binary and parses the JSON line it prints. See the runner for the
 * exact decoding rules (plain argmax, F32 KV cache, no downloads).
 */
import { spawn } from 'node:child_process';
import * as path from 'node:path';

/** Path of the runner script (plain ESM; run it with `node` directly to debug). */
export const LLAMA_CPP_RUNNER = path.join(__dirname, 'llama-cpp-runner.mjs');

/** Input of {@link runLlamaCpp}; give `promptTokens`, `prompt`, or both. */
export interface LlamaCppOptions {
  /** Path of the .gguf file. */
  model: string;
  /** Evaluated exactly as given (no BOS added). Takes precedence over `prompt` as the prompt. */
  promptTokens?: number[];
  /** Tokenized by the model's own tokenizer (BOS/EOS per the GGUF) into `tokenizedPrompt`. */
  prompt?: string;
  /** Tokens to generate greedily; generation does not stop at EOS. */
  nTokens: number;
  contextSize?: number;
  /** CPU threads (default 1, fastest for tiny models; results do not depend on it). */
  threads?: number;
  /** Return the full logits after the prompt (they predict `tokens[0]`). */
  logits?: boolean;
  /** Kill the runner after this long (default 120 s). */
  timeoutMs?: number;
}

/** What the runner printed. */
export interface LlamaCppResult {
  tokens: number[];
  /** `tokens` detokenized by llama.cpp. */
  text: string;
  vocabSize: number;
  /** Per generated token: top-1 minus top-2 logit (null for a one-token vocabulary). */
  margins: (number | null)[];
  /** `prompt` as llama.cpp tokenizes it, when a prompt was given. */
  tokenizedPrompt?: number[];
  /** With `logits: true`: the logits after the prompt, indexed by token id. */
  logits?: number[];
}

/** Error `name` of a runner that failed, timed out or printed something unparsable. */
export const LLAMA_CPP_ERROR = 'LlamaCppError';

function failure(message: string): Error {
  const err = new Error(message);
  err.name = LLAMA_CPP_ERROR;
  return err;
}

/**
 * Runs the model in a child process.
 * @throws Error named {@link LLAMA_CPP_ERROR} with the runner's stderr when it fails or times out
 */
export function runLlamaCpp(opts: LlamaCppOptions): Promise<LlamaCppResult> {
  const { timeoutMs = 120_000, ...input } = opts;
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [LLAMA_CPP_RUNNER], {
      stdio: ['pipe', 'pipe', 'pipe'],
      // Belt and braces: the runner already passes skipDownload and build: 'never'.
      env: { ...process.env, NODE_LLAMA_CPP_SKIP_DOWNLOAD: 'true' },
    });
    let stdout = '';
    let stderr = '';
    let timedOut = false;
    const timer = setTimeout(() => {
      timedOut = true;
      child.kill('SIGKILL');
    }, timeoutMs);
    child.stdout.setEncoding('utf8').on('data', (d: string) => (stdout += d));
    child.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
    child.on('error', (err) => {
      clearTimeout(timer);
      reject(failure(`cannot start ${LLAMA_CPP_RUNNER}: ${err.message}`));
    });
    child.on('close', (code, signal) => {
      clearTimeout(timer);
      if (timedOut) return reject(failure(`llama.cpp runner timed out after ${timeoutMs} ms\n${stderr}`));
      if (code !== 0) return reject(failure(`llama.cpp runner exited with ${code ?? signal}: ${stderr.trim()}`));
      const line = stdout.trim().split('\n').pop() ?? '';
      try {
        resolve(JSON.parse(line) as LlamaCppResult);
      } catch {
        reject(failure(`llama.cpp runner printed no JSON: ${JSON.stringify(stdout.slice(0, 500))}\n${stderr}`));
      }
    });
    // The input goes over stdin: token lists can exceed the argument size limit.
    child.stdin.end(JSON.stringify(input));
  });
}

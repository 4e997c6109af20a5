/**
 * A GGUF model file → distributed-llama `.m` + `.t`, by dequantizing its tensors to float32 and
 * encoding them again with the converter's own encoders (dllama rounding), through the same
 * streaming writer as a Hugging Face checkpoint (convert.ts).
 *
 * Layout. llama.cpp's converter and distributed-llama's (convert-hf.py `permute`) apply the same
 * rotary permutation to Llama's Q/K rows, `reshape(heads, 2, rows/heads/2, cols).swapaxes(1, 2)`
 * with the KV head count for K; Qwen3 is permuted by neither. So a GGUF's Q/K rows are already in
 * `.m` order and are copied as they are: the plan's permutation is dropped. Tied embeddings (no
 * `output.weight`) give the classifier from `token_embd.weight`, as distributed-llama expects.
 *
 * Everything the input decides is checked before the first byte is written: the header
 * (ConvertError `TruncatedFile`/`BadHeader`), the spec ({@link specFromGguf}), the tokenizer
 * ({@link tokenizerFromGguf}), every tensor's type ({@link checkDequantizable}) and whether
 * distributed-llama can serve the result (dllama.ts `checkDllamaModel`, `checkDllamaTokenizer`).
 */
import { type ModelSpec, planTensors } from './arch';
import { CHUNK_ELEMENTS, type ConvertProgress, type ConvertResult, type Output, tensorStreamer, writeDllama } from './convert';
import { checkDllamaModel, checkDllamaTokenizer, checkDllamaWeights, planDllama } from './dllama';
import { ConvertError } from './errors';
import { checkDequantizable, ggufRopeFreqs, ggufSourceTensor } from './gguf-dequant';
import { readGgufHeader } from './gguf-source';
import { specFromGguf } from './gguf-spec';
import { tokenizerFromGguf } from './gguf-tokenizer';
import { QuantPool } from './pool';
import { fileSource } from './safetensors';
import type { ByteSource, SourceTensor, WeightsFormat } from './types';
import { WEIGHTS_FORMATS } from '../shared/weights';

export interface GgufToDllamaOptions {
  /** The GGUF file: a local path, or a byte source (e.g. an S3 object). */
  gguf: string | ByteSource;
  weights: WeightsFormat;
  /** A directory (gets `model.m` and `tokenizer.t`), or one output for each. */
  output: string | { model: Output; tokenizer: Output };
  /** Worker threads (default: all cores). Output bytes do not depend on it. */
  threads?: number;
  /** Values per chunk handed to a worker (default 4 Mi; rounded to whole rows). Output bytes do not depend on it. */
  chunkElements?: number;
  /** Progress; bytes count float32 values for quantized tensors (4 per value), as they are encoded. */
  onProgress?: (p: ConvertProgress) => void;
}

/**
 * Hugging Face tensor name → GGUF tensor name for `spec`'s architecture, from the plan magus's
 * own GGUF writer follows (so the two cannot disagree).
 */
function ggufTensorNames(spec: ModelSpec): Map<string, string> {
  const all = planTensors({ ...spec, tieWordEmbeddings: false, ropeScaling: null }, 'gguf', 'f32', () => true);
  return new Map(all.flatMap((t) => (t.source === null ? [] : [[t.source, t.name] as const])));
}

/** A local path as a byte source, refusing a missing file with `MissingFile`. */
async function openLocal(path: string): Promise<ByteSource & { close(): Promise<void> }> {
  const source = fileSource(path);
  try {
    await source.size();
  } catch (err) {
    await source.close().catch(() => undefined);
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') throw new ConvertError('MissingFile', `${path} does not exist`, { cause: err });
    throw err;
  }
  return source;
}

/**
 * Converts a GGUF model to distributed-llama files (see the module comment); outputs are written
 * under temporary names and renamed when complete.
 * @throws ConvertError for every input-caused failure: `MissingFile`, `TruncatedFile`,
 *   `BadHeader`, `UnsupportedArchitecture`, `UnsupportedConfig` (also for Llama 3 rope factors that
 *   match no scaling), `MissingTensor`, `ShapeMismatch`,
 *   `UnsupportedDType` (a tensor type that cannot be dequantized, e.g. Q4_K: use the safetensors
 *   repository), `BadBlockSize`, `NonFinite`; what distributed-llama cannot serve:
 *   `UnsupportedWeights`, `NoTopology`, `UnsupportedTokenizer`, `UnsupportedChatTemplate`.
 */
export async function convertGgufToDllama(opts: GgufToDllamaOptions): Promise<ConvertResult> {
  if (!WEIGHTS_FORMATS.includes(opts.weights))
    throw new ConvertError('UnsupportedConfig', `unknown weights format '${String(opts.weights)}' (${WEIGHTS_FORMATS.join(', ')})`);
  checkDllamaWeights(opts.weights);
  const opened = typeof opts.gguf === 'string' ? await openLocal(opts.gguf) : null;
  const source = opened ?? (opts.gguf as ByteSource);
  let pool: QuantPool | undefined;
  try {
    const file = await readGgufHeader(source);
    for (const t of file.tensors) checkDequantizable(t);
    const ropeFreqs = await ggufRopeFreqs(source, file);
    const spec = specFromGguf(file, ropeFreqs ? { ropeFreqs } : {});
    checkDllamaModel(spec, opts.weights);
    const tokenizer = tokenizerFromGguf(file);
    checkDllamaTokenizer(tokenizer);
    const entries = new Map(file.tensors.map((t) => [t.name, t]));

    const names = ggufTensorNames(spec);
    const entry = (hf: string) => entries.get(names.get(hf) ?? '');
    const plan = planDllama(spec, opts.weights, (hf) => entry(hf) !== undefined);
    // The GGUF's Q/K rows are already in distributed-llama's order (module comment).
    plan.tensors = plan.tensors.map((t) => ({ ...t, permute: null }));
    const weights = {
      get(hf: string): SourceTensor {
        const t = entry(hf);
        if (!t) throw new ConvertError('MissingTensor', `GGUF tensor for ${hf} is missing`);
        return ggufSourceTensor(source, t);
      },
    };
    pool = new QuantPool(opts.threads !== undefined ? { size: opts.threads } : {});
    const stream = tensorStreamer(plan.tensors, weights, pool, 'dllama', opts.chunkElements ?? CHUNK_ELEMENTS, opts.onProgress);
    stream.start();
    return await writeDllama(opts.output, spec, tokenizer, plan, stream, pool);
  } finally {
    await pool?.close();
    await opened?.close();
  }
}

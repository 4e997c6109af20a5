/**
 * The conversion pipeline: a Hugging Face checkpoint directory → a GGUF file, or a
 * distributed-llama `.m` model + `.t` tokenizer. One streaming pass over the input: each planned
 * tensor is read chunk by chunk, encoded on the worker pool in order, and appended to an output
 * written under a temporary name that is renamed only when complete.
 *
 * Memory: `maxInFlight` chunks per tensor, except the Llama Q/K projections, which are read
 * whole because their rotary permutation reorders rows across the tensor.
 */
import { mkdir, readFile, stat } from 'node:fs/promises';
import { basename, join } from 'node:path';
import { parseModelSpec, permuteQK, type ModelSpec, type OutputFormat, type PlannedTensor, checkSourceShape } from './arch';
import { planDllama, writeDllamaModel, writeDllamaTokenizer } from './dllama';
import { ConvertError } from './errors';
import { ggufTensorInfos, planGgufModel, writeGgufFile } from './gguf';
import { QuantPool } from './pool';
import { openModelDir, readTensorChunks, readTensorF32All, chunkElementsFor, type ModelWeights } from './safetensors';
import { parseTokenizer, type ParsedTokenizer } from './tokenizer';
import type { QuantFlavor, SourceDType, WeightsFormat } from './types';

/** Bumped whenever output bytes for the same input could change (S3 artifact keys include it). */
export const CONVERTER_VERSION = 'c1';

export const OUTPUT_FORMATS: readonly OutputFormat[] = ['gguf', 'dllama'];
export const WEIGHTS_FORMATS: readonly WeightsFormat[] = ['q40', 'q80', 'f16', 'f32'];

export interface ConvertOptions {
  /** Hugging Face checkpoint directory (config.json, tokenizer.json, safetensors). */
  modelDir: string;
  format: OutputFormat;
  weights: WeightsFormat;
  /** GGUF: the output file. dllama: the output directory (gets `model.m` and `tokenizer.t`). */
  output: string;
  /** Worker threads (default: all cores). Output bytes do not depend on it. */
  threads?: number;
  /** `general.name` for GGUF (default: the directory's name). */
  name?: string;
  onProgress?: (p: ConvertProgress) => void;
}

export interface ConvertProgress {
  tensorsDone: number;
  tensorsTotal: number;
  /** Source bytes read so far and in all (a tensor used twice, e.g. tied embeddings, counts twice). */
  bytesDone: number;
  bytesTotal: number;
  /** Name of the tensor being written. */
  tensor: string;
}

export interface ConvertResult {
  spec: ModelSpec;
  /** Files written, with their sizes. */
  files: { path: string; bytes: number }[];
  tensors: number;
  inputBytes: number;
  threads: number;
}

/** Reads and validates the checkpoint's JSON files into a model spec and tokenizer. */
export async function loadCheckpointMeta(dir: string): Promise<{ spec: ModelSpec; tokenizer: ParsedTokenizer }> {
  const readJson = async (file: string, required: boolean): Promise<unknown> => {
    let text: string;
    try {
      text = await readFile(join(dir, file), 'utf8');
    } catch (err) {
      if (!required && (err as NodeJS.ErrnoException).code === 'ENOENT') return undefined;
      throw new ConvertError('MissingFile', `${join(dir, file)}: ${(err as Error).message}`);
    }
    try {
      return JSON.parse(text);
    } catch (err) {
      throw new ConvertError('BadHeader', `${join(dir, file)} is not valid JSON: ${(err as Error).message}`);
    }
  };
  const config = await readJson('config.json', true);
  const spec = parseModelSpec(config);
  const chatTemplateFile = await readFile(join(dir, 'chat_template.jinja'), 'utf8').catch(() => null);
  const tokenizer = parseTokenizer({
    tokenizerJson: await readJson('tokenizer.json', true),
    tokenizerConfig: await readJson('tokenizer_config.json', false),
    chatTemplateFile,
    bosTokenId: spec.bosTokenId,
    eosTokenIds: spec.eosTokenIds,
  });
  return { spec, tokenizer };
}

/** Converts a checkpoint; see the module comment. */
export async function convertModel(opts: ConvertOptions): Promise<ConvertResult> {
  if (!OUTPUT_FORMATS.includes(opts.format)) throw new ConvertError('UnsupportedConfig', `unknown output format '${String(opts.format)}' (gguf or dllama)`);
  if (!WEIGHTS_FORMATS.includes(opts.weights)) throw new ConvertError('UnsupportedConfig', `unknown weights format '${String(opts.weights)}' (${WEIGHTS_FORMATS.join(', ')})`);
  const { spec, tokenizer } = await loadCheckpointMeta(opts.modelDir);
  const weights = await openModelDir(opts.modelDir);
  const pool = new QuantPool(opts.threads !== undefined ? { size: opts.threads } : {});
  try {
    const has = (name: string) => weights.has(name);
    if (opts.format === 'gguf') {
      const name = opts.name ?? basename(opts.modelDir);
      const plan = planGgufModel({ spec, tokenizer, weights: opts.weights, name, hasTensor: has });
      const stream = tensorStreamer(plan.tensors, weights, pool, 'ggml', opts.onProgress);
      await writeGgufFile(opts.output, plan.kvs, ggufTensorInfos(plan.tensors), (i) => stream(i));
      return { spec, files: [{ path: opts.output, bytes: plan.layout.totalSize }], tensors: plan.tensors.length, inputBytes: stream.bytesTotal, threads: pool.size };
    }
    const plan = planDllama(spec, opts.weights, has);
    await mkdir(opts.output, { recursive: true });
    const modelPath = join(opts.output, 'model.m');
    const tokenizerPath = join(opts.output, 'tokenizer.t');
    // The tokenizer first: it validates cheaply (BOS/EOS present) before the long model pass.
    await writeDllamaTokenizer(tokenizerPath, tokenizer);
    const stream = tensorStreamer(plan.tensors, weights, pool, 'dllama', opts.onProgress);
    await writeDllamaModel(modelPath, plan, (i) => stream(i));
    return {
      spec,
      files: [
        { path: modelPath, bytes: plan.totalSize },
        { path: tokenizerPath, bytes: (await stat(tokenizerPath)).size },
      ],
      tensors: plan.tensors.length,
      inputBytes: stream.bytesTotal,
      threads: pool.size,
    };
  } finally {
    await pool.close();
    await weights.close();
  }
}

type Streamer = ((index: number) => AsyncIterable<Uint8Array>) & { bytesTotal: number };
type Chunk = { dtype: SourceDType; bytes: Uint8Array; elementOffset: number };

/**
 * Returns `stream(i)`: the encoded bytes of planned tensor `i`, read and encoded chunk by chunk.
 * Shapes are checked for every tensor before the first byte is written, so a bad checkpoint
 * fails fast instead of after minutes of work.
 */
function tensorStreamer(
  plan: readonly PlannedTensor[],
  weights: ModelWeights,
  pool: QuantPool,
  flavor: QuantFlavor,
  onProgress?: (p: ConvertProgress) => void,
): Streamer {
  let bytesTotal = 0;
  for (const t of plan) {
    if (t.source === null) continue;
    const src = weights.get(t.source);
    checkSourceShape(t, src.shape);
    bytesTotal += src.byteLength;
  }
  let bytesDone = 0;
  let tensorsDone = 0;
  const report = (tensor: string) => onProgress?.({ tensorsDone, tensorsTotal: plan.length, bytesDone, bytesTotal, tensor });

  async function* stream(index: number): AsyncGenerator<Uint8Array> {
    const t = plan[index];
    if (!t) throw new RangeError(`no planned tensor ${index}`);
    report(t.name);
    const label = t.source ?? t.name;
    if (t.source === null) {
      const data = t.generated ?? new Float32Array(0);
      yield* pool.encodeStream([{ dtype: 'F32', bytes: new Uint8Array(data.buffer.slice(data.byteOffset, data.byteOffset + data.byteLength)) }], { format: t.format, flavor, label });
    } else {
      const src = weights.get(t.source);
      const cols = t.sourceShape[t.sourceShape.length - 1] ?? 1;
      let chunks: AsyncIterable<Chunk> | Iterable<Chunk>;
      // Progress counts source bytes; permuted chunks are float32, whatever the source dtype.
      let sourceBytesPerChunkByte = 1;
      if (t.permute) {
        const rows = t.sourceShape[0] ?? 0;
        const permuted = permuteQK(await readTensorF32All(src), rows, cols, t.permute.heads);
        chunks = f32Chunks(permuted, chunkElementsFor(t.sourceShape));
        sourceBytesPerChunkByte = src.byteLength / permuted.byteLength;
      } else {
        chunks = readTensorChunks(src);
      }
      const counted = async function* (): AsyncGenerator<Chunk> {
        for await (const c of chunks) {
          // Counted before the yield: the pool transfers (detaches) the chunk's buffer.
          const n = c.bytes.byteLength * sourceBytesPerChunkByte;
          yield c;
          bytesDone += n;
        }
      };
      yield* pool.encodeStream(counted(), { format: t.format, flavor, label: `${src.source.name}: tensor ${label}` });
    }
    tensorsDone++;
    report(t.name);
  }

  return Object.assign(stream, { bytesTotal });
}

/** Splits a float32 array into row-aligned chunks of raw little-endian bytes. */
function* f32Chunks(data: Float32Array, chunkElements: number): Generator<Chunk> {
  for (let at = 0; at < data.length; at += chunkElements) {
    const n = Math.min(chunkElements, data.length - at);
    yield { dtype: 'F32', bytes: new Uint8Array(data.buffer.slice(data.byteOffset + at * 4, data.byteOffset + (at + n) * 4)), elementOffset: at };
  }
}

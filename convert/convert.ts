/**
 * The conversion pipeline: a Hugging Face checkpoint directory → a GGUF file, or a
 * distributed-llama `.m` model + `.t` tokenizer. One streaming pass over the input: each planned
 * tensor is read chunk by chunk, encoded on the worker pool in order, and appended to an output
 * written under a temporary name that is renamed only when complete.
 *
 * Memory: a window of chunks in flight (read into a few recycled buffers), plus the Llama Q/K
 * projections, which are read whole because their rotary permutation reorders rows across the
 * tensor.
 */
import { mkdir } from 'node:fs/promises';
import { basename, join } from 'node:path';
import { parseModelSpec, permutedSourceRow, planTensors, type ModelSpec, type OutputFormat, type PlannedTensor, checkSourceShape } from './arch';
import type { OutputTarget } from './atomic-file';
import { ChunkBuffers } from './chunk-buffers';
import { checkDllamaModel, checkDllamaTokenizer, checkDllamaWeights, type DllamaModelPlan, planDllama, writeDllamaModel, writeDllamaTokenizer } from './dllama';
import { ConvertError } from './errors';
import { ggufTensorInfos, planGgufModel, writeGgufPlanned } from './gguf';
import { QuantPool } from './pool';
import { QK, dtypeSize, encodedSize } from './quant';
import { chunkElementsFor, elementCount, localCheckpoint, openModel, readTensorChunks, type ModelWeights } from './safetensors';
import { parseTokenizer, type ParsedTokenizer } from './tokenizer';
import type { CheckpointFiles, QuantFlavor, SourceDType, WeightsFormat } from './types';
import { WEIGHTS_FORMATS } from '../shared/weights';

/** Bumped whenever output bytes for the same input could change (S3 artifact keys include it). */
export const CONVERTER_VERSION = 'c1';

export const OUTPUT_FORMATS: readonly OutputFormat[] = ['gguf', 'dllama'];

/** A local path, or an output that appears whole on commit (e.g. an S3 object). */
export type Output = string | OutputTarget;

export interface ConvertOptions {
  /** Hugging Face checkpoint: a local directory, or its files from elsewhere (S3). */
  source: string | CheckpointFiles;
  format: OutputFormat;
  weights: WeightsFormat;
  /**
   * GGUF: the output file. dllama: a directory (gets `model.m` and `tokenizer.t`), or one output
   * for each.
   */
  output: Output | { model: Output; tokenizer: Output };
  /** Worker threads (default: all cores). Output bytes do not depend on it. */
  threads?: number;
  /** `general.name` for GGUF (default: the directory's name). */
  name?: string;
  /** Values per chunk handed to a worker (default 4 Mi; rounded to whole rows). Output bytes do not depend on it. */
  chunkElements?: number;
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
  /** Outputs written (paths, or target names), with their sizes. */
  files: { path: string; bytes: number }[];
  tensors: number;
  inputBytes: number;
  threads: number;
}

async function readJson(checkpoint: CheckpointFiles, file: string, required: boolean): Promise<unknown> {
  const text = await checkpoint.readText(file);
  if (text === null) {
    if (!required) return undefined;
    throw new ConvertError('MissingFile', `${checkpoint.location}/${file} does not exist`);
  }
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new ConvertError('BadHeader', `${checkpoint.location}/${file} is not valid JSON: ${(err as Error).message}`);
  }
}

/** Reads and validates the checkpoint's config.json into a model spec. */
export async function loadModelSpec(checkpoint: CheckpointFiles): Promise<ModelSpec> {
  return parseModelSpec(await readJson(checkpoint, 'config.json', true));
}

/** Reads and validates the checkpoint's tokenizer files. */
export async function loadTokenizer(checkpoint: CheckpointFiles, spec: ModelSpec): Promise<ParsedTokenizer> {
  return parseTokenizer({
    tokenizerJson: await readJson(checkpoint, 'tokenizer.json', true),
    tokenizerConfig: await readJson(checkpoint, 'tokenizer_config.json', false),
    chatTemplateFile: await checkpoint.readText('chat_template.jinja'),
    bosTokenId: spec.bosTokenId,
    eosTokenIds: spec.eosTokenIds,
  });
}

const nameOf = (o: Output): string => (typeof o === 'string' ? o : o.name);

/** Converts a checkpoint; see the module comment. */
export async function convertModel(opts: ConvertOptions): Promise<ConvertResult> {
  if (!OUTPUT_FORMATS.includes(opts.format)) throw new ConvertError('UnsupportedConfig', `unknown output format '${String(opts.format)}' (gguf or dllama)`);
  if (!WEIGHTS_FORMATS.includes(opts.weights))
    throw new ConvertError('UnsupportedConfig', `unknown weights format '${String(opts.weights)}' (${WEIGHTS_FORMATS.join(', ')})`);
  if (opts.format === 'dllama') checkDllamaWeights(opts.weights);
  const checkpoint = typeof opts.source === 'string' ? localCheckpoint(opts.source) : opts.source;
  // The workers start now, so that their start-up overlaps reading the checkpoint's metadata.
  const pool = new QuantPool(opts.threads !== undefined ? { size: opts.threads } : {});
  pool.warm();
  let weights: ModelWeights | undefined;
  try {
    const spec = await loadModelSpec(checkpoint);
    if (opts.format === 'dllama') checkDllamaModel(spec, opts.weights);
    weights = await openModel(checkpoint);
    return await convertOpened(opts, checkpoint, spec, weights, pool);
  } finally {
    await pool.close();
    await weights?.close();
  }
}

/**
 * The conversion proper. As soon as the tensors are planned (and checked against the
 * checkpoint), the first chunks are read and sent to the workers, which encode them while this
 * thread parses the tokenizer and lays out the header. For distributed-llama the tokenizer is
 * parsed first: whether distributed-llama can serve it is decided before any tensor is read.
 */
async function convertOpened(
  opts: ConvertOptions,
  checkpoint: CheckpointFiles,
  spec: ModelSpec,
  weights: ModelWeights,
  pool: QuantPool,
): Promise<ConvertResult> {
  const chunkElements = opts.chunkElements ?? CHUNK_ELEMENTS;
  const has = (name: string) => weights.has(name);
  if (opts.format === 'gguf') {
    if (typeof opts.output === 'object' && 'model' in opts.output) throw new ConvertError('UnsupportedConfig', 'a GGUF output is one file');
    const name = opts.name ?? basename(checkpoint.location);
    const tensors = planTensors(spec, 'gguf', opts.weights, has);
    const stream = tensorStreamer(tensors, weights, pool, 'ggml', chunkElements, opts.onProgress);
    stream.start();
    const tokenizer = await loadTokenizer(checkpoint, spec);
    const plan = planGgufModel({ spec, tokenizer, weights: opts.weights, name, hasTensor: has, tensors });
    await writeGgufPlanned(opts.output, plan.layout, ggufTensorInfos(plan.tensors), (i) => stream(i));
    return {
      spec,
      files: [{ path: nameOf(opts.output), bytes: plan.layout.totalSize }],
      tensors: plan.tensors.length,
      inputBytes: stream.bytesTotal,
      threads: pool.size,
    };
  }
  const tokenizer = await loadTokenizer(checkpoint, spec);
  checkDllamaTokenizer(tokenizer);
  const plan = planDllama(spec, opts.weights, has);
  const stream = tensorStreamer(plan.tensors, weights, pool, 'dllama', chunkElements, opts.onProgress);
  stream.start();
  return writeDllama(opts.output, spec, tokenizer, plan, stream, pool);
}

/** Where a distributed-llama conversion writes: `model.m` and `tokenizer.t` in a directory (created), or the two outputs given. */
async function dllamaOutputs(output: ConvertOptions['output']): Promise<{ model: Output; tokenizer: Output }> {
  if (typeof output === 'string') {
    await mkdir(output, { recursive: true });
    return { model: join(output, 'model.m'), tokenizer: join(output, 'tokenizer.t') };
  }
  if ('model' in output) return output;
  throw new ConvertError('UnsupportedConfig', 'distributed-llama output needs a directory or a model and a tokenizer output');
}

/**
 * Writes a planned distributed-llama model whose tensors `stream` yields (already started), and
 * its tokenizer: the tokenizer first, as it validates cheaply (BOS/EOS present) before the long
 * model pass.
 */
export async function writeDllama(
  output: ConvertOptions['output'],
  spec: ModelSpec,
  tokenizer: ParsedTokenizer,
  plan: DllamaModelPlan,
  stream: Streamer,
  pool: QuantPool,
): Promise<ConvertResult> {
  const outputs = await dllamaOutputs(output);
  const tokenizerBytes = await writeDllamaTokenizer(outputs.tokenizer, tokenizer);
  await writeDllamaModel(outputs.model, plan, (i) => stream(i));
  return {
    spec,
    files: [
      { path: nameOf(outputs.model), bytes: plan.totalSize },
      { path: nameOf(outputs.tokenizer), bytes: tokenizerBytes },
    ],
    tensors: plan.tensors.length,
    inputBytes: stream.bytesTotal,
    threads: pool.size,
  };
}

/** The encoded bytes of each planned tensor, requested in plan order (see {@link tensorStreamer}). */
export type Streamer = ((index: number) => AsyncIterable<Uint8Array>) & {
  bytesTotal: number;
  /** Starts reading and encoding ahead (a window's worth) before the first tensor is asked for. */
  start(): void;
};
type Chunk = { dtype: SourceDType; bytes: Uint8Array; elementOffset: number };

/** Chunks in flight per worker thread, across tensor boundaries. */
const IN_FLIGHT_PER_THREAD = 3;
/** Values per chunk (8 MiB of F16): large enough that per-chunk overhead is noise. */
export const CHUNK_ELEMENTS = 4 << 20;

/**
 * Returns `stream(i)`: the encoded bytes of planned tensor `i`, which the writers request in
 * order. Behind it one producer reads every tensor's chunks in plan order and keeps the pool
 * busy with a bounded window of chunks that spans tensor boundaries (so the pool never drains
 * between tensors). Shapes are checked for every tensor before the first byte is read, so a
 * bad checkpoint fails fast instead of after minutes of work.
 */
export function tensorStreamer(
  plan: readonly PlannedTensor[],
  weights: Pick<ModelWeights, 'get'>,
  pool: QuantPool,
  flavor: QuantFlavor,
  chunkElements: number,
  onProgress?: (p: ConvertProgress) => void,
): Streamer {
  let bytesTotal = 0;
  /** The largest chunk of any tensor, read and encoded: the sizes of the recycled buffers. */
  let inBytes = 0;
  let outBytes = 0;
  for (const t of plan) {
    if (t.source === null) continue;
    const src = weights.get(t.source);
    checkSourceShape(t, src.shape);
    bytesTotal += src.byteLength;
    const elements = Math.min(elementCount(src.shape), chunkElementsFor(src.shape, chunkElements));
    inBytes = Math.max(inBytes, elements * dtypeSize(src.dtype));
    outBytes = Math.max(outBytes, encodedSize(t.format, Math.ceil(elements / QK) * QK));
  }
  let bytesDone = 0;
  let tensorsDone = 0;
  let current = plan[0]?.name ?? '';
  const report = () => onProgress?.({ tensorsDone, tensorsTotal: plan.length, bytesDone, bytesTotal, tensor: current });

  const max = IN_FLIGHT_PER_THREAD * pool.size;
  // Every chunk is read into one of a few recycled shared buffers and encoded into another,
  // which the workers use in place: the window in flight, the chunk being read (or a permuted
  // tensor's whole copy) and the chunk being written are all there ever are.
  const inputs = new ChunkBuffers(inBytes, max + 2);
  const outputs = new ChunkBuffers(outBytes, max + 2);

  /** Every chunk of every tensor, in plan order, tagged with its tensor's index. */
  async function* chunks(): AsyncGenerator<Chunk & { index: number; sourceBytes: number; pooled: boolean }> {
    for (const [index, t] of plan.entries()) {
      if (t.source === null) {
        const data = t.generated ?? new Float32Array(0);
        yield {
          index,
          dtype: 'F32',
          bytes: new Uint8Array(data.buffer.slice(data.byteOffset, data.byteOffset + data.byteLength)),
          elementOffset: 0,
          sourceBytes: 0,
          pooled: false,
        };
        continue;
      }
      const src = weights.get(t.source);
      const elementBytes = dtypeSize(src.dtype);
      if (t.permute) {
        // The rotary permutation moves whole rows across the tensor: read it whole and copy the
        // raw rows (no decoding) in their new order into chunk buffers.
        const rows = t.sourceShape[0] ?? 0;
        const rowBytes = src.byteLength / rows;
        if (!Number.isInteger(rowBytes) || rows % (t.permute.heads * 2) !== 0) {
          throw new RangeError(`${t.source}: ${rows} rows cannot be split into ${t.permute.heads} heads of pairs`);
        }
        const scratch = inputs.take(src.byteLength); // a pooled buffer if the tensor fits one
        const whole = await src.source.read(src.offset, src.byteLength, scratch);
        const step = chunkElementsFor(t.sourceShape, chunkElements) * elementBytes;
        for (let at = 0; at < src.byteLength; at += step) {
          const bytes = inputs.take(Math.min(step, src.byteLength - at));
          // Chunks hold whole rows (chunkElementsFor), so a row never straddles two.
          for (let r = at / rowBytes, o = 0; o < bytes.length; r++, o += rowBytes) {
            const from = permutedSourceRow(r, rows, t.permute.heads) * rowBytes;
            bytes.set(whole.subarray(from, from + rowBytes), o);
          }
          yield { index, dtype: src.dtype, bytes, elementOffset: at / elementBytes, sourceBytes: bytes.length, pooled: true };
        }
        inputs.give(scratch);
      } else {
        let given: Uint8Array | undefined;
        for await (const c of readTensorChunks(src, { chunkElements, buffer: (n) => (given = inputs.take(n)) })) {
          // A source must read into the buffer it is given; if one did not, its bytes are sent
          // as they are and the buffer is not reused.
          yield {
            index,
            dtype: c.dtype,
            bytes: c.bytes,
            elementOffset: c.elementOffset,
            sourceBytes: c.bytes.length,
            pooled: c.bytes.buffer === given?.buffer,
          };
        }
      }
    }
  }

  /** Encoded chunks in plan order, with a bounded window submitted ahead; pooled ones are `outputs` buffers. */
  async function* encoded(): AsyncGenerator<{ index: number; bytes: Uint8Array; pooled: boolean }> {
    const window: { index: number; out: Promise<Uint8Array>; pooled: boolean }[] = [];
    for await (const c of chunks()) {
      const t = plan[c.index] as PlannedTensor;
      const out = pool.encode({
        dtype: c.dtype,
        bytes: c.bytes,
        format: t.format,
        flavor,
        label: t.source ?? t.name,
        elementOffset: c.elementOffset,
        ...(c.pooled ? { out: outputs.take(outputs.byteLength) } : {}),
      });
      // Once encoded, the input buffer is free (a failed conversion just drops its buffers).
      if (c.pooled)
        out.then(
          () => inputs.give(c.bytes),
          () => undefined,
        );
      out.catch(() => undefined); // observed in order below; avoids an "unhandled" report meanwhile
      window.push({ index: c.index, out, pooled: c.pooled });
      bytesDone += c.sourceBytes;
      if (window.length >= max) {
        const head = window.shift()!;
        yield { index: head.index, bytes: await head.out, pooled: head.pooled };
      }
    }
    for (const head of window.splice(0)) yield { index: head.index, bytes: await head.out, pooled: head.pooled };
  }

  const encodedChunks = encoded();
  type Next = Promise<IteratorResult<{ index: number; bytes: Uint8Array; pooled: boolean }>>;
  let primed: Next | null = null;
  let pulled = false;
  const start = (): void => {
    if (pulled || primed) return;
    primed = encodedChunks.next();
    primed.catch(() => undefined); // observed by the first pull; a failure before that is reported there
  };
  const pull = (): Next => {
    pulled = true;
    const next = primed ?? encodedChunks.next();
    primed = null;
    return next;
  };

  async function* stream(index: number): AsyncGenerator<Uint8Array> {
    const t = plan[index];
    if (!t) throw new RangeError(`no planned tensor ${index}`);
    current = t.name;
    report();
    // Writers ask for tensors in plan order, and chunks never straddle tensors.
    for (let got = 0; got < t.byteLength;) {
      const next = await pull();
      if (next.done || next.value.index !== index) throw new Error(`internal: tensor ${t.name} ended after ${got} of ${t.byteLength} bytes`);
      got += next.value.bytes.length;
      yield next.value.bytes;
      // The writer asks for more only once it is done with this chunk (see writeTensorData).
      if (next.value.pooled) outputs.give(next.value.bytes);
    }
    tensorsDone++;
    report();
  }

  return Object.assign(stream, { bytesTotal, start });
}

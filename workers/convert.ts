/**
 * `magus convert <hf-dir> --format gguf|dllama --weights q40|q80|f16|f32 [-o out] [--threads N]`
 * (the weights formats are shared/weights.ts's).
 */
import { basename, resolve } from 'node:path';
import { convertModel, isConvertError, OUTPUT_FORMATS, type OutputFormat } from '../convert';
import { isWeightsFormat, weightsFormat, WEIGHTS_FORMATS, type WeightsFormat } from '../shared/weights';
import { formatBytes, TerminalProgress } from './progress';
import { usageFailure, UsageError } from '../platform/cli';

export const CONVERT_USAGE = `usage: magus convert <hf-dir> --format ${OUTPUT_FORMATS.join('|')} --weights ${WEIGHTS_FORMATS.join('|')} [-o out] [--threads N]`;

function parseArgs(args: string[]): { dir: string; format: OutputFormat; weights: WeightsFormat; output?: string; threads?: number } {
  let dir: string | undefined;
  const opts: Record<string, string> = {};
  for (let i = 0; i < args.length; i++) {
    const a = args[i] as string;
    if (a === '-o' || a === '--output' || a === '--format' || a === '--weights' || a === '--threads') {
      const v = args[++i];
      if (v === undefined) throw new UsageError(`${a} needs a value`);
      opts[a === '-o' ? '--output' : a] = v;
    } else if (a.startsWith('-')) {
      throw new UsageError(`unknown option ${a}`);
    } else if (dir === undefined) {
      dir = a;
    } else {
      throw new UsageError(`unexpected argument ${a}`);
    }
  }
  if (!dir) throw new UsageError('missing <hf-dir>');
  const format = opts['--format'];
  const weights = opts['--weights'];
  if (!format || !(OUTPUT_FORMATS as readonly string[]).includes(format)) throw new UsageError(`--format must be one of ${OUTPUT_FORMATS.join(', ')}`);
  if (!weights || !isWeightsFormat(weights)) throw new UsageError(`--weights must be one of ${WEIGHTS_FORMATS.join(', ')}`);
  let threads: number | undefined;
  if (opts['--threads'] !== undefined) {
    threads = Number(opts['--threads']);
    if (!Number.isInteger(threads) || threads < 1 || threads > 256) throw new UsageError('--threads must be a whole number from 1 to 256');
  }
  return { dir, format: format as OutputFormat, weights, output: opts['--output'], threads };
}

export async function convertCommand(args: string[]): Promise<number> {
  let parsed;
  try {
    parsed = parseArgs(args);
  } catch (err) {
    return usageFailure('magus convert', CONVERT_USAGE, err);
  }
  const dir = resolve(parsed.dir);
  const name = basename(dir);
  const output = resolve(
    parsed.output ?? (parsed.format === 'gguf' ? `${name}-${weightsFormat(parsed.weights).ggml}.gguf` : `${name}-dllama-${parsed.weights}`),
  );
  const progress = new TerminalProgress();
  const started = Date.now();
  try {
    const result = await convertModel({
      source: dir,
      format: parsed.format,
      weights: parsed.weights,
      output,
      threads: parsed.threads,
      name,
      onProgress: (p) =>
        progress.update({
          bytesDone: p.bytesDone,
          bytesTotal: p.bytesTotal,
          itemsDone: p.tensorsDone,
          itemsTotal: p.tensorsTotal,
          itemLabel: 'tensors',
          current: p.tensor,
        }),
    });
    progress.finish();
    const sec = (Date.now() - started) / 1000;
    for (const f of result.files) process.stdout.write(`${f.path}  ${formatBytes(f.bytes)}\n`);
    // maxRSS is in KiB.
    const peakRss = process.resourceUsage().maxRSS * 1024;
    process.stderr.write(
      `converted ${result.tensors} tensors, ${formatBytes(result.inputBytes)} in ${sec.toFixed(1)}s ` +
        `(${formatBytes(result.inputBytes / Math.max(sec, 1e-3))}/s, ${result.threads} threads, peak RSS ${formatBytes(peakRss)})\n`,
    );
    return 0;
  } catch (err) {
    progress.finish();
    if (isConvertError(err)) {
      process.stderr.write(`magus convert: ${err.code}: ${err.message}\n`);
      return 1;
    }
    throw err;
  }
}

/**
 * `magus model tiny <dir> [--seed N] [--arch llama|qwen3] [--dtype F16|F32|BF16]`: writes a tiny
 * synthetic Hugging Face model folder (config, safetensors weights, tokenizer, chat template), the
 * kind `magus dev` serves as its demo: a second model to try `magus convert`, a hub or a pull with.
 * Its weights are random, so what it says is gibberish.
 */
import { existsSync, readdirSync } from 'node:fs';
import { resolve } from 'node:path';
import { writeTinyModel, type TinyModelOptions } from './dev/tiny-model';
import { usageFailure, UsageError } from '../platform/cli';

export const TINY_USAGE = [
  'usage: magus model tiny <dir> [--seed N] [--arch llama|qwen3] [--dtype F16|F32|BF16]',
  '',
  'Writes a tiny synthetic model (Hugging Face layout: config.json, model.safetensors, tokenizer.json …) into',
  '<dir>, a new or empty folder; the same seed gives the same bytes. Its weights are random: expect gibberish.',
].join('\n');

/** The folder and generator options of a `magus model tiny` command line. */
export function parseTinyArgs(args: string[]): { dir: string; options: TinyModelOptions } {
  let dir: string | undefined;
  const options: TinyModelOptions = {};
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    const value = (): string => {
      const v = args[++i];
      if (v === undefined) throw new UsageError(`${a} needs a value`);
      return v;
    };
    if (a === '--seed') {
      const v = value();
      options.seed = Number(v);
      if (!Number.isInteger(options.seed) || options.seed < 0) throw new UsageError(`--seed ${v} is not a whole number`);
    } else if (a === '--arch') {
      const v = value();
      if (v !== 'llama' && v !== 'qwen3') throw new UsageError(`--arch ${v}: llama or qwen3`);
      options.arch = v;
    } else if (a === '--dtype') {
      const v = value();
      if (v !== 'F16' && v !== 'F32' && v !== 'BF16') throw new UsageError(`--dtype ${v}: F16, F32 or BF16`);
      options.dtype = v;
    } else if (a.startsWith('-')) throw new UsageError(`unknown option ${a}`);
    else if (dir === undefined) dir = a;
    else throw new UsageError(`unexpected argument ${a}`);
  }
  if (!dir) throw new UsageError('missing <dir>');
  return { dir: resolve(dir), options };
}

export async function modelTinyCommand(args: string[]): Promise<number> {
  let parsed;
  try {
    parsed = parseTinyArgs(args);
    // Never mixes its files into someone's folder.
    if (existsSync(parsed.dir) && readdirSync(parsed.dir).length > 0) throw new UsageError(`${parsed.dir} is not empty`);
  } catch (err) {
    return usageFailure('magus model tiny', TINY_USAGE, err);
  }
  const model = await writeTinyModel(parsed.dir, parsed.options);
  process.stdout.write(`${parsed.dir}  ${model.tensors.length} tensors, ${model.totalSize} bytes of weights\n`);
  process.stderr.write(
    `a tiny random ${parsed.options.arch ?? 'llama'} model (expect gibberish); e.g. magus convert ${parsed.dir} --format gguf --weights q80\n`,
  );
  return 0;
}

/**
 * A GGUF file taken from a repository as it is (a model's `source.gguf`): checked before it is
 * published as a `gguf:source` artifact — every part a GGUF whose header and tensor table read
 * and whose tensor data lies inside the file, the parts of a split GGUF numbered as llama.cpp
 * numbers them, an architecture the llama.cpp engine runs — and read for what sizing needs.
 * Only headers are read, never tensor data. Pure: I/O only through {@link ByteSource}.
 */
import { ConvertError } from './errors';
import { readGguf, type GgufFile } from './gguf-reader';
import type { ByteSource } from './types';
import type { GgufValue } from './gguf';

/**
 * The architectures (`general.architecture`) of the llama.cpp that magus's engine bundles
 * (node-llama-cpp's, `src/llama-arch.cpp`) that generate text: its vision projectors (`clip`),
 * encoders, embedding-only and speech models are left out — the engine serves chat.
 */
export const LLAMA_CPP_TEXT_ARCHITECTURES: ReadonlySet<string> = new Set(
  (
    'llama llama4 deci falcon grok gpt2 gptj gptneox mpt baichuan starcoder refact bloom stablelm qwen qwen2 qwen2moe qwen2vl ' +
    'qwen3 qwen3moe qwen3next qwen3vl qwen3vlmoe qwen35 qwen35moe phi2 phi3 phimoe plamo plamo2 plamo3 codeshell orion internlm2 ' +
    'minicpm minicpm3 gemma gemma2 gemma3 gemma3n gemma4 starcoder2 mamba mamba2 jamba falcon-h1 xverse command-r cohere2 ' +
    'dbrx olmo olmo2 olmoe openelm arctic deepseek deepseek2 chatglm glm4 glm4moe bitnet t5 jais nemotron nemotron_h exaone ' +
    'exaone4 rwkv6 rwkv6qwen2 rwkv7 arwkv7 granite granitemoe granitehybrid chameleon plm bailingmoe bailingmoe2 dots1 arcee ' +
    'ernie4_5 ernie4_5-moe hunyuan-moe hunyuan-dense smollm3 gpt-oss lfm2 lfm2moe dream smallthinker llada llada-moe seed_oss ' +
    'grovemoe apertus minimax-m2 mistral3 cogvlm'
  ).split(' '),
);

/** llama.cpp's `llama_ftype` (`general.file_type`): the names quantizations go by. */
const FILE_TYPES: Readonly<Record<number, string>> = {
  0: 'F32',
  1: 'F16',
  2: 'Q4_0',
  3: 'Q4_1',
  7: 'Q8_0',
  8: 'Q5_0',
  9: 'Q5_1',
  10: 'Q2_K',
  11: 'Q3_K_S',
  12: 'Q3_K_M',
  13: 'Q3_K_L',
  14: 'Q4_K_S',
  15: 'Q4_K_M',
  16: 'Q5_K_S',
  17: 'Q5_K_M',
  18: 'Q6_K',
  19: 'IQ2_XXS',
  20: 'IQ2_XS',
  21: 'Q2_K_S',
  22: 'IQ3_XS',
  23: 'IQ3_XXS',
  24: 'IQ1_S',
  25: 'IQ4_NL',
  26: 'IQ3_S',
  27: 'IQ3_M',
  28: 'IQ2_S',
  29: 'IQ2_M',
  30: 'IQ4_XS',
  31: 'IQ1_M',
  32: 'BF16',
  36: 'TQ1_0',
  37: 'TQ2_0',
  38: 'MXFP4_MOE',
};

/** What llama.cpp's memory needs of a model (activities/size/memory.ts `llamaCppMemory`). */
export interface GgufSizing {
  layers: number;
  hidden: number;
  intermediate: number;
  heads: number;
  kvHeads: number;
  headDim: number;
  vocab: number;
  ctx: number;
}

export interface GgufSource {
  architecture: string;
  /** `general.file_type` by name (`Q4_K_M`), or `type <n>` for one this table does not know; null when absent. */
  fileType: string | null;
  sizing: GgufSizing;
  tensors: number;
}

const numberOf = (v: GgufValue | undefined): number | undefined => {
  if (!v) return undefined;
  if (v.type === 'array') {
    // Per-layer values (some architectures vary heads or FFN width by layer): the largest sizes.
    const items = Array.from(v.value as ArrayLike<number | bigint>, Number).filter((n) => Number.isFinite(n));
    return items.length > 0 ? Math.max(...items) : undefined;
  }
  if (typeof v.value === 'number' || typeof v.value === 'bigint') return Number(v.value);
  return undefined;
};

/** The reader's format errors as conversion errors: a file cut short, or anything else malformed. */
export async function readGgufHeader(source: ByteSource): Promise<GgufFile> {
  try {
    return await readGguf(source);
  } catch (err) {
    if ((err as Error).name !== 'GgufFormatError') throw err;
    const { message: what } = err as Error;
    const message = what.startsWith(source.name) ? what : `${source.name}: ${what}`;
    const truncated = /truncated|beyond the file size/.test(what);
    throw new ConvertError(truncated ? 'TruncatedFile' : 'BadHeader', message, { cause: err });
  }
}

/** Reads every part's header and checks the file as described above; `ConvertError` when it is no servable GGUF. */
export async function readGgufSource(parts: readonly ByteSource[]): Promise<GgufSource> {
  if (parts.length === 0) throw new ConvertError('MissingFile', 'no GGUF file given');
  const headers: GgufFile[] = [];
  for (const part of parts) {
    const size = await part.size();
    const file = await readGgufHeader(part);
    if (file.dataEnd > size) throw new ConvertError('TruncatedFile', `${part.name}: its tensors end at byte ${file.dataEnd}, past the file's ${size} bytes`);
    headers.push(file);
  }
  const first = headers[0]!;
  const name = parts[0]!.name;
  if (parts.length > 1 || first.metadata.has('split.count')) {
    const count = numberOf(first.metadata.get('split.count'));
    if (count !== parts.length) throw new ConvertError('MissingFile', `${name}: a split GGUF of ${count ?? '?'} parts, given ${parts.length}`);
    headers.forEach((h, k) => {
      const no = numberOf(h.metadata.get('split.no'));
      if (no !== k) throw new ConvertError('BadIndex', `${parts[k]!.name}: is split part ${no ?? '?'} (from 0), expected ${k}`);
    });
  }
  const arch = first.metadata.get('general.architecture');
  if (arch?.type !== 'string') throw new ConvertError('BadHeader', `${name}: no general.architecture`);
  const architecture = arch.value;
  if (!LLAMA_CPP_TEXT_ARCHITECTURES.has(architecture)) {
    throw new ConvertError('UnsupportedArchitecture', `${name}: architecture ${architecture} is not one magus's llama.cpp engine serves as a chat model`);
  }
  const tensors = headers.reduce((n, h) => n + h.tensors.length, 0);
  if (tensors === 0) throw new ConvertError('MissingTensor', `${name}: no tensors`);
  const unknown = headers.flatMap((h) => h.tensors).find((t) => t.byteLength === null);
  if (unknown)
    throw new ConvertError('UnsupportedDType', `${name}: tensor ${unknown.name} has ggml type ${unknown.ggmlType}, which this llama.cpp does not know`);
  const ft = numberOf(first.metadata.get('general.file_type'));
  return { architecture, fileType: ft === undefined ? null : (FILE_TYPES[ft] ?? `type ${ft}`), sizing: ggufSizing(first, architecture, name), tensors };
}

/** The sizes llama.cpp's memory depends on, from `<architecture>.*` metadata (as llama.cpp reads them). */
function ggufSizing(file: GgufFile, arch: string, name: string): GgufSizing {
  const get = (key: string) => numberOf(file.metadata.get(`${arch}.${key}`));
  const need = (key: string): number => {
    const v = get(key);
    if (v === undefined || !Number.isInteger(v) || v <= 0) throw new ConvertError('BadHeader', `${name}: no ${arch}.${key}`);
    return v;
  };
  const hidden = need('embedding_length');
  const heads = get('attention.head_count') || 1; // recurrent architectures (mamba, rwkv) have none
  const tokens = file.metadata.get('tokenizer.ggml.tokens');
  const vocab = get('vocab_size') ?? (tokens?.type === 'array' ? tokens.value.length : undefined);
  if (!vocab) throw new ConvertError('BadHeader', `${name}: no vocabulary size (${arch}.vocab_size or tokenizer.ggml.tokens)`);
  return {
    layers: need('block_count'),
    hidden,
    intermediate: get('feed_forward_length') ?? 4 * hidden,
    heads,
    kvHeads: get('attention.head_count_kv') ?? heads,
    headDim: get('attention.key_length') ?? Math.floor(hidden / heads),
    vocab,
    ctx: need('context_length'),
  };
}

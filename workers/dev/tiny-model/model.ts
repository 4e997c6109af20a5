/**
 * {@link writeTinyModel}: what a real Llama 3 / Qwen3 repository holds — `config.json`,
 * `model.safetensors` (or shards + `model.safetensors.index.json`), `tokenizer.json`,
 * `tokenizer_config.json` and `generation_config.json` — written from a layout, its weights and
 * its tokenizer. Everything is a pure function of the options: the same seed gives the same bytes.
 */
import { mkdir, writeFile } from 'node:fs/promises';
import * as path from 'node:path';
import { tinyModelLayout, tinyModelTensors, tinyTensorValues, type TinyModelLayout, type TinyModelOptions, type TinyTensor } from './layout';
import { encodeValues, writeSafetensorsFile } from './safetensors';
import { buildTokenizer, type TokenizerFiles } from './tokenizer';

/** What {@link writeTinyModel} wrote. */
export interface TinyModel {
  dir: string;
  layout: TinyModelLayout;
  config: Record<string, unknown>;
  tensors: TinyTensor[];
  /** Weight files relative to `dir`, in shard order. */
  weightFiles: string[];
  /** Special token ids by content. */
  specialIds: Record<string, number>;
  /** Total bytes of tensor data. */
  totalSize: number;
}

function configFor(l: TinyModelLayout, tok: TokenizerFiles): Record<string, unknown> {
  const id = (s: string): number => tok.ids[s]!;
  const eos = tok.specials.eosList.map(id);
  const torchDtype = { F32: 'float32', F16: 'float16', BF16: 'bfloat16' }[l.dtype];
  if (l.arch === 'qwen3') {
    return {
      architectures: ['Qwen3ForCausalLM'],
      attention_bias: false,
      attention_dropout: 0.0,
      bos_token_id: id('<|endoftext|>'),
      eos_token_id: id('<|im_end|>'),
      head_dim: l.headDim,
      hidden_act: 'silu',
      hidden_size: l.hidden,
      initializer_range: 0.02,
      intermediate_size: l.intermediate,
      max_position_embeddings: l.ctx,
      max_window_layers: l.layers,
      model_type: 'qwen3',
      num_attention_heads: l.heads,
      num_hidden_layers: l.layers,
      num_key_value_heads: l.kvHeads,
      rms_norm_eps: 1e-6,
      rope_scaling: null,
      rope_theta: 1000000.0,
      sliding_window: null,
      tie_word_embeddings: l.tied,
      torch_dtype: torchDtype,
      transformers_version: '4.51.0',
      use_cache: true,
      use_sliding_window: false,
      vocab_size: l.vocab,
    };
  }
  const config: Record<string, unknown> = {
    architectures: ['LlamaForCausalLM'],
    attention_bias: false,
    attention_dropout: 0.0,
    bos_token_id: id('<|begin_of_text|>'),
    eos_token_id: eos,
    ...(l.headDimExplicit ? { head_dim: l.headDim } : {}),
    hidden_act: 'silu',
    hidden_size: l.hidden,
    initializer_range: 0.02,
    intermediate_size: l.intermediate,
    max_position_embeddings: l.ctx,
    mlp_bias: false,
    model_type: 'llama',
    num_attention_heads: l.heads,
    num_hidden_layers: l.layers,
    num_key_value_heads: l.kvHeads,
    pretraining_tp: 1,
    rms_norm_eps: 1e-5,
    rope_scaling: l.ropeScaling
      ? { factor: 8.0, high_freq_factor: 4.0, low_freq_factor: 1.0, original_max_position_embeddings: Math.max(1, l.ctx / 4), rope_type: 'llama3' }
      : null,
    rope_theta: 500000.0,
    tie_word_embeddings: l.tied,
    torch_dtype: torchDtype,
    transformers_version: '4.45.0',
    use_cache: true,
    vocab_size: l.vocab,
  };
  return config;
}

function shardName(i: number, n: number): string {
  const pad = (k: number): string => String(k).padStart(5, '0');
  return `model-${pad(i + 1)}-of-${pad(n)}.safetensors`;
}

const json = (v: unknown): string => `${JSON.stringify(v, null, 2)}\n`;

/**
 * Writes a complete synthetic Hugging Face model directory (created if needed). Tensor data is
 * streamed, so large layouts (for benchmarks) need only a few MB of memory.
 */
export async function writeTinyModel(dir: string, opts: TinyModelOptions = {}): Promise<TinyModel> {
  const l = tinyModelLayout(opts);
  const tensors = tinyModelTensors(l);
  if (l.shards > tensors.length) throw new Error(`${l.shards} shards for ${tensors.length} tensors`);
  const tok = buildTokenizer(l);
  const config = configFor(l, tok);
  await mkdir(dir, { recursive: true });

  const elementBytes = l.dtype === 'F32' ? 4 : 2;
  const entries = tensors.map((t) => ({ name: t.name, dtype: l.dtype, shape: t.shape }));
  const perShard = Math.ceil(tensors.length / l.shards);
  const weightFiles: string[] = [];
  const weightMap: Record<string, string> = {};
  let totalSize = 0;
  for (let s = 0; s < l.shards; s++) {
    const file = l.shards === 1 ? 'model.safetensors' : shardName(s, l.shards);
    const slice = entries.slice(s * perShard, (s + 1) * perShard);
    const sliceTensors = tensors.slice(s * perShard, (s + 1) * perShard);
    await writeSafetensorsFile(
      path.join(dir, file),
      slice,
      function* (_e, i) {
        for (const chunk of tinyTensorValues(l.seed, sliceTensors[i]!)) yield encodeValues(chunk, l.dtype);
      },
      { format: 'pt' },
    );
    weightFiles.push(file);
    for (const e of slice) {
      weightMap[e.name] = file;
      totalSize += e.shape.reduce((a, b) => a * b, 1) * elementBytes;
    }
  }
  if (l.shards > 1) {
    const sorted = Object.fromEntries(Object.entries(weightMap).sort(([a], [b]) => (a < b ? -1 : 1)));
    await writeFile(path.join(dir, 'model.safetensors.index.json'), json({ metadata: { total_size: totalSize }, weight_map: sorted }));
  }

  const eosIds = tok.specials.eosList.map((s) => tok.ids[s]!);
  await writeFile(path.join(dir, 'config.json'), json(config));
  await writeFile(path.join(dir, 'tokenizer.json'), json(tok.tokenizer));
  await writeFile(path.join(dir, 'tokenizer_config.json'), json(tok.tokenizerConfig));
  await writeFile(
    path.join(dir, 'generation_config.json'),
    json({
      bos_token_id: tok.ids[tok.specials.bos],
      do_sample: true,
      eos_token_id: eosIds,
      temperature: 0.6,
      top_p: 0.9,
      transformers_version: config.transformers_version,
    }),
  );
  return { dir, layout: l, config, tensors, weightFiles, specialIds: tok.ids, totalSize };
}

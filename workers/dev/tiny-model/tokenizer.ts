/**
 * A tiny model's tokenizer: byte-level BPE as Llama 3 and Qwen3 ship it (`tokenizer.json` in the
 * tokenizers library's format, with the real pre-tokenizer regexes), merges learned on a small
 * built-in corpus and then extended deterministically until the vocabulary has exactly the
 * model's size, its special tokens, and `tokenizer_config.json` with a Jinja chat template.
 */
import type { TinyModelLayout } from './layout';

/** GPT-2's `bytes_to_unicode`: byte → printable character, in GPT-2 vocabulary order. */
export function gpt2ByteChars(): { order: number[]; char: string[] } {
  const order: number[] = [];
  for (let b = 0x21; b <= 0x7e; b++) order.push(b);
  for (let b = 0xa1; b <= 0xac; b++) order.push(b);
  for (let b = 0xae; b <= 0xff; b++) order.push(b);
  const char: string[] = new Array<string>(256);
  for (const b of order) char[b] = String.fromCharCode(b);
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (char[b] === undefined) {
      order.push(b);
      char[b] = String.fromCharCode(256 + n++);
    }
  }
  return { order, char };
}

// The real Llama 3 and Qwen2 pre-tokenizer regexes (tokenizers syntax, `(?i:...)` included).
const LLAMA3_SPLIT = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2_SPLIT = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
// JavaScript has no inline `(?i:)`; close enough for training merges.
const TRAIN_SPLIT = /'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL]|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+/gu;

const CORPUS = [
  'The quick brown fox jumps over the lazy dog while the other dogs sleep in the sun.',
  'A model is converted from safetensors into GGUF and into the distributed format, then served.',
  'Tokens are learned from the most frequent pairs of bytes; the merges are applied in order.',
  'In the beginning there was the word, and the word was split into the smallest pieces there are.',
  'Workers read the weights, quantize them in blocks of thirty-two, and write the blocks to files.',
  "It's the 1st of May, 2025: they've said we'll meet at 10:30 and we're there, aren't we?",
  'Hello, world! Hello again, world. The world says hello back to everyone in the room.',
  'def main():\n    return sum(range(10)) * 2  # the answer is ninety\n',
].join('\n');

/** Learns merges on {@link CORPUS} (then synthesizes more) until `vocab` holds `size` tokens. */
function trainMerges(size: number, char: string[], vocab: Map<string, number>): [string, string][] {
  const words = new Map<string, number>();
  for (const w of CORPUS.match(TRAIN_SPLIT) ?? []) {
    const key = [...Buffer.from(w, 'utf8')].map((b) => char[b]!).join('\u0000');
    words.set(key, (words.get(key) ?? 0) + 1);
  }
  let pieces = [...words.entries()].map(([k, n]) => ({ parts: k.split('\u0000'), n }));
  const merges: [string, string][] = [];
  while (vocab.size < size) {
    const pairs = new Map<string, number>();
    for (const { parts, n } of pieces) {
      for (let i = 0; i + 1 < parts.length; i++) {
        const k = `${parts[i]}\u0000${parts[i + 1]}`;
        pairs.set(k, (pairs.get(k) ?? 0) + n);
      }
    }
    let best: string | undefined;
    let bestN = 1; // only pairs seen at least twice
    for (const [k, n] of pairs) {
      if (n > bestN || (n === bestN && best !== undefined && k < best)) {
        best = k;
        bestN = n;
      }
    }
    if (best === undefined) break;
    const [a, b] = best.split('\u0000') as [string, string];
    merges.push([a, b]);
    if (!vocab.has(a + b)) vocab.set(a + b, vocab.size); // two merge paths can spell the same token
    pieces = pieces.map(({ parts, n }) => {
      const merged: string[] = [];
      for (let i = 0; i < parts.length; i++) {
        if (i + 1 < parts.length && parts[i] === a && parts[i + 1] === b) {
          merged.push(a + b);
          i++;
        } else {
          merged.push(parts[i]!);
        }
      }
      return { parts: merged, n };
    });
  }
  // Past what the corpus supports, extend deterministically: token + byte pairs not yet present.
  const tokens = [...vocab.keys()];
  const bytes = tokens.slice(0, 256);
  for (let i = 0; vocab.size < size; i++) {
    const left = tokens[i % tokens.length]!;
    for (const right of bytes) {
      if (vocab.size >= size) break;
      if (vocab.has(left + right)) continue;
      merges.push([left, right]);
      vocab.set(left + right, vocab.size);
      tokens.push(left + right);
    }
  }
  return merges;
}

export interface Specials {
  list: string[];
  bos: string;
  eos: string;
  /** config.json / generation_config.json eos ids, by name */
  eosList: string[];
}

function specialsFor(arch: 'llama' | 'qwen3'): Specials {
  return arch === 'llama'
    ? {
        list: ['<|begin_of_text|>', '<|end_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>'],
        bos: '<|begin_of_text|>',
        eos: '<|eot_id|>',
        eosList: ['<|end_of_text|>', '<|eot_id|>'],
      }
    : { list: ['<|endoftext|>', '<|im_start|>', '<|im_end|>'], bos: '<|endoftext|>', eos: '<|im_end|>', eosList: ['<|im_end|>', '<|endoftext|>'] };
}

const LLAMA3_TEMPLATE =
  "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";
const CHATML_TEMPLATE =
  "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/** What {@link buildTokenizer} makes: the two tokenizer files, the special tokens' ids and names. */
export interface TokenizerFiles {
  tokenizer: Record<string, unknown>;
  tokenizerConfig: Record<string, unknown>;
  ids: Record<string, number>;
  specials: Specials;
}

/** A byte-level BPE tokenizer of exactly `l.vocab` tokens, merges learned on a small corpus, in the tokenizers library's format. */
export function buildTokenizer(l: TinyModelLayout): TokenizerFiles {
  const specials = specialsFor(l.arch);
  const regular = l.vocab - specials.list.length;
  if (regular < 257) throw new Error(`vocabSize ${l.vocab} leaves no room for merges (256 bytes + ${specials.list.length} specials)`);
  const { order, char } = gpt2ByteChars();
  const vocab = new Map<string, number>();
  for (const b of order) vocab.set(char[b]!, vocab.size);
  const merges = trainMerges(regular, char, vocab);
  const ids: Record<string, number> = {};
  for (const s of specials.list) ids[s] = vocab.size + Object.keys(ids).length;
  const addedTokens = specials.list.map((content) => ({
    id: ids[content]!,
    content,
    single_word: false,
    lstrip: false,
    rstrip: false,
    normalized: false,
    special: true,
  }));
  const split = { type: 'Split', pattern: { Regex: l.arch === 'llama' ? LLAMA3_SPLIT : QWEN2_SPLIT }, behavior: 'Isolated', invert: false };
  const bos = specials.bos;
  const tokenizer: Record<string, unknown> = {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: addedTokens,
    normalizer: l.arch === 'qwen3' ? { type: 'NFC' } : null,
    pre_tokenizer: {
      type: 'Sequence',
      pretokenizers: [split, { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }],
    },
    post_processor:
      l.arch === 'llama'
        ? {
            type: 'TemplateProcessing',
            single: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
            pair: [
              { SpecialToken: { id: bos, type_id: 0 } },
              { Sequence: { id: 'A', type_id: 0 } },
              { SpecialToken: { id: bos, type_id: 1 } },
              { Sequence: { id: 'B', type_id: 1 } },
            ],
            special_tokens: { [bos]: { id: bos, ids: [ids[bos]], tokens: [bos] } },
          }
        : { type: 'ByteLevel', add_prefix_space: false, trim_offsets: false, use_regex: false },
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: {
      type: 'BPE',
      dropout: null,
      unk_token: null,
      continuing_subword_prefix: null,
      end_of_word_suffix: null,
      fuse_unk: false,
      byte_fallback: false,
      ignore_merges: l.arch === 'llama',
      vocab: Object.fromEntries(vocab),
      merges: merges.map(([a, b]) => `${a} ${b}`),
    },
  };
  const tokenizerConfig: Record<string, unknown> = {
    add_bos_token: l.arch === 'llama',
    add_prefix_space: false,
    added_tokens_decoder: Object.fromEntries(addedTokens.map(({ id, ...rest }) => [String(id), rest])),
    bos_token: l.arch === 'llama' ? bos : null,
    chat_template: l.arch === 'llama' ? LLAMA3_TEMPLATE : CHATML_TEMPLATE,
    clean_up_tokenization_spaces: l.arch === 'llama',
    eos_token: specials.eos,
    model_input_names: ['input_ids', 'attention_mask'],
    model_max_length: l.ctx,
    pad_token: l.arch === 'qwen3' ? '<|endoftext|>' : null,
    tokenizer_class: l.arch === 'llama' ? 'PreTrainedTokenizerFast' : 'Qwen2Tokenizer',
  };
  return { tokenizer, tokenizerConfig, ids, specials };
}

/**
 * A {@link ParsedTokenizer} from a GGUF's `tokenizer.*` metadata, the inverse of gguf.ts
 * `ggufTokenizerMetadata`, so that a GGUF model's distributed-llama `.t` is written by the same
 * code as a Hugging Face model's.
 *
 * Token bytes follow tokenizer.ts: `gpt2` vocabularies are byte-level (GPT-2's printable-byte
 * table), `llama` (SentencePiece) ones are pieces with `▁` for a space and `<0xNN>` byte tokens.
 * Scores: a `gpt2` vocabulary carries none and gets −id, as the Hugging Face path gives every
 * BPE vocabulary; a `llama` one keeps its own. The `[PADn]` unused tokens a writer appends up to
 * the embedding's row count are dropped again, as the Hugging Face path never had them.
 *
 * Pure code: no I/O.
 */
import { ConvertError } from './errors';
import type { GgufFile } from './gguf-reader';
import { ggufTokenId } from './gguf-spec';
import { byteLevelTokenBytes, type ParsedTokenizer, pieceBytes, TokenType, type TokenTypeId } from './tokenizer';

function bad(message: string): ConvertError {
  return new ConvertError('UnsupportedConfig', `GGUF ${message}`);
}

function stringArray(file: GgufFile, key: string, required: boolean): string[] {
  const v = file.metadata.get(key);
  if (v === undefined) {
    if (required) throw bad(`${key} is missing`);
    return [];
  }
  if (v.type !== 'array' || v.itemType !== 'string') throw bad(`${key} is not an array of strings`);
  return [...v.value];
}

function numberArray(file: GgufFile, key: string, length: number): number[] | null {
  const v = file.metadata.get(key);
  if (v === undefined) return null;
  if (v.type !== 'array' || v.itemType === 'string' || v.itemType === 'bool' || v.itemType === 'array' || typeof v.value[0] === 'bigint') {
    throw bad(`${key} is not an array of numbers`);
  }
  if (v.value.length !== length) throw bad(`${key} has ${v.value.length} entries for ${length} tokens`);
  return Array.from(v.value as ArrayLike<number>);
}

function optional(file: GgufFile, key: string, type: 'string'): string | null;
function optional(file: GgufFile, key: string, type: 'bool'): boolean | null;
function optional(file: GgufFile, key: string, type: 'string' | 'bool'): string | boolean | null {
  const v = file.metadata.get(key);
  if (v === undefined) return null;
  if (v.type !== type || (typeof v.value !== 'string' && typeof v.value !== 'boolean')) throw bad(`${key} is a ${v.type}, not a ${type}`);
  return v.value;
}

const KNOWN_TOKEN_TYPES: ReadonlySet<number> = new Set(Object.values(TokenType));

/** Ids of the trailing `[PADn]` unused tokens, which start at the returned count. */
function withoutPadding(tokens: readonly string[], types: readonly number[]): number {
  let n = tokens.length;
  while (n > 0 && types[n - 1] === TokenType.unused && tokens[n - 1] === `[PAD${n - 1}]`) n--;
  return n;
}

/**
 * Reads the tokenizer of a GGUF model (see the module comment).
 * @throws ConvertError `UnsupportedConfig` for a tokenizer model other than `gpt2` or `llama`,
 *   malformed arrays, or special token ids outside the vocabulary.
 */
export function tokenizerFromGguf(file: GgufFile): ParsedTokenizer {
  const model = optional(file, 'tokenizer.ggml.model', 'string');
  if (model !== 'gpt2' && model !== 'llama') {
    throw bad(`tokenizer.ggml.model ${JSON.stringify(model)} is not supported (gpt2 or llama)`);
  }
  const allTokens = stringArray(file, 'tokenizer.ggml.tokens', true);
  const allTypes = numberArray(file, 'tokenizer.ggml.token_type', allTokens.length) ?? allTokens.map(() => TokenType.normal);
  const size = withoutPadding(allTokens, allTypes);
  if (size === 0) throw bad('tokenizer.ggml.tokens is empty');
  const tokens = allTokens.slice(0, size);
  const types = allTypes.slice(0, size).map((t, id) => {
    if (!KNOWN_TOKEN_TYPES.has(t)) throw bad(`tokenizer.ggml.token_type of token ${id} is ${t}`);
    return t as TokenTypeId;
  });
  const byteLevel = model === 'gpt2';
  const tokenBytes = tokens.map((text, id) => (byteLevel ? byteLevelTokenBytes(text) : pieceBytes(text, types[id] === TokenType.byte)));
  const ggufScores = byteLevel ? null : numberArray(file, 'tokenizer.ggml.scores', allTokens.length);
  const scores = Float32Array.from(tokens, (_t, id) => ggufScores?.[id] ?? -id);

  const id = (key: string): number | null => {
    const v = ggufTokenId(file, `tokenizer.ggml.${key}`);
    if (v !== null && v >= size) throw bad(`tokenizer.ggml.${key} ${v} is outside the vocabulary of ${size} tokens`);
    return v;
  };
  const eosId = id('eos_token_id');
  const eosIds = [eosId, id('eot_token_id'), id('eom_token_id')].filter((v): v is number => v !== null);
  const templateNames = stringArray(file, 'tokenizer.chat_templates', false);
  return {
    kind: byteLevel ? 'byte-level-bpe' : 'sentencepiece-bpe',
    ggmlModel: model,
    pre: optional(file, 'tokenizer.ggml.pre', 'string') ?? 'default',
    tokens,
    tokenBytes,
    scores,
    types,
    merges: stringArray(file, 'tokenizer.ggml.merges', false),
    bosId: id('bos_token_id'),
    eosId,
    eosIds: [...new Set(eosIds)],
    unkId: id('unknown_token_id'),
    padId: id('padding_token_id'),
    eotId: id('eot_token_id'),
    addBos: optional(file, 'tokenizer.ggml.add_bos_token', 'bool'),
    addEos: optional(file, 'tokenizer.ggml.add_eos_token', 'bool'),
    addSpacePrefix: optional(file, 'tokenizer.ggml.add_space_prefix', 'bool'),
    chatTemplate: optional(file, 'tokenizer.chat_template', 'string'),
    namedChatTemplates: templateNames.map((name) => {
      const template = optional(file, `tokenizer.chat_template.${name}`, 'string');
      if (template === null) throw bad(`tokenizer.chat_templates names ${name}, but tokenizer.chat_template.${name} is missing`);
      return { name, template };
    }),
  };
}

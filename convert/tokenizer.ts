/**
 * One parsed tokenizer representation from Hugging Face `tokenizer.json` + `tokenizer_config.json`,
 * shared by the GGUF metadata builder and the distributed-llama `.t` writer.
 *
 * Supported vocabularies:
 * - byte-level BPE (GPT-2 style, Llama 3, Qwen): GGUF `tokenizer.ggml.model = "gpt2"` with merges;
 * - SentencePiece-style BPE with `byte_fallback` and `<0xNN>` byte tokens (Llama 2, Mistral) and
 *   Unigram vocabularies with scores: GGUF `tokenizer.ggml.model = "llama"` with scores.
 * Anything else (WordPiece, WordLevel, plain BPE without byte handling) is rejected.
 *
 * Pure code: no I/O.
 */
import { ConvertError } from './errors';

/** GGUF token types (gguf-py `TokenType`, llama.cpp `llama_token_attr` source values). */
export const TokenType = {
  normal: 1,
  unknown: 2,
  control: 3,
  userDefined: 4,
  unused: 5,
  byte: 6,
} as const;
export type TokenTypeId = (typeof TokenType)[keyof typeof TokenType];

export type TokenizerKind = 'byte-level-bpe' | 'sentencepiece-bpe' | 'sentencepiece-unigram';

/** The tokenizer as both writers need it. Arrays are indexed by token id. */
export interface ParsedTokenizer {
  kind: TokenizerKind;
  /** GGUF `tokenizer.ggml.model` */
  ggmlModel: 'gpt2' | 'llama';
  /** GGUF `tokenizer.ggml.pre`; see {@link detectPreTokenizer}. */
  pre: string;
  /** Token text as GGUF stores it (byte-level or `▁` pieces as in the vocabulary). */
  tokens: string[];
  /** The bytes each token stands for, as distributed-llama stores them. Never empty. */
  tokenBytes: Uint8Array[];
  scores: Float32Array;
  types: TokenTypeId[];
  /** BPE merges as `"left right"` strings (empty for Unigram). */
  merges: string[];
  bosId: number | null;
  eosId: number | null;
  /** config.json's `eos_token_id` list, then `eosId` if not already in it. */
  eosIds: number[];
  unkId: number | null;
  padId: number | null;
  eotId: number | null;
  /** null when neither tokenizer_config.json nor the post-processor says. */
  addBos: boolean | null;
  addEos: boolean | null;
  addSpacePrefix: boolean | null;
  chatTemplate: string | null;
  /** Extra named templates (tokenizer_config `chat_template` given as a list). */
  namedChatTemplates: { name: string; template: string }[];
}

export interface TokenizerInput {
  /** Parsed `tokenizer.json`. */
  tokenizerJson: unknown;
  /** Parsed `tokenizer_config.json`, if the repository has one. */
  tokenizerConfig?: unknown;
  /** Contents of `chat_template.jinja`, used when tokenizer_config.json has no `chat_template`. */
  chatTemplateFile?: string | null;
  /** From config.json: used when tokenizer_config.json names no BOS/EOS token. */
  bosTokenId?: number | null;
  eosTokenIds?: readonly number[];
}

type Json = Record<string, unknown>;

function isObject(v: unknown): v is Json {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

function bad(message: string): ConvertError {
  return new ConvertError('UnsupportedConfig', message);
}

/** Ids may leave holes up to this many per token defined, plus {@link MAX_HOLES} (real vocabularies have a few). */
const MAX_HOLES_PER_TOKEN = 1;
const MAX_HOLES = 1024;

const SPIECE_SPACE = '\u2581';
const BYTE_TOKEN = /^<0x([0-9A-Fa-f]{2})>$/;
const utf8 = new TextEncoder();

let byteDecoder: Map<string, number> | undefined;

/**
 * GPT-2's reversible byte <-> printable-unicode table (openai/gpt-2 encoder.py `bytes_to_unicode`),
 * inverted: printable char -> byte.
 */
function gpt2ByteDecoder(): Map<string, number> {
  if (byteDecoder) return byteDecoder;
  const bs: number[] = [];
  for (let b = 0x21; b <= 0x7e; b++) bs.push(b);
  for (let b = 0xa1; b <= 0xac; b++) bs.push(b);
  for (let b = 0xae; b <= 0xff; b++) bs.push(b);
  const cs = [...bs];
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (!bs.includes(b)) {
      bs.push(b);
      cs.push(256 + n);
      n++;
    }
  }
  byteDecoder = new Map(cs.map((c, i) => [String.fromCodePoint(c), bs[i] as number]));
  return byteDecoder;
}

/**
 * Bytes of a byte-level token: each char maps back through the GPT-2 table, and chars outside it
 * are UTF-8 encoded. This is exactly distributed-llama's convert-tokenizer-hf.py, which applies
 * the mapping to every token including added ones.
 */
export function byteLevelTokenBytes(token: string): Uint8Array {
  const table = gpt2ByteDecoder();
  const out: number[] = [];
  for (const ch of token) {
    const b = table.get(ch);
    if (b !== undefined) out.push(b);
    else out.push(...utf8.encode(ch));
  }
  return Uint8Array.from(out);
}

/** Bytes of a SentencePiece piece: `<0xNN>` byte tokens are that byte, `▁` is a space. */
export function pieceBytes(piece: string, isByteToken: boolean): Uint8Array {
  const m = isByteToken ? BYTE_TOKEN.exec(piece) : null;
  if (m?.[1]) return Uint8Array.of(parseInt(m[1], 16));
  return utf8.encode(piece.replaceAll(SPIECE_SPACE, ' '));
}

// The Split regexes of the two byte-level families we serve (copied from their tokenizer.json).
const LLAMA3_REGEX = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2_REGEX = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

function flattenSteps(step: unknown, key: 'pretokenizers' | 'processors' | 'decoders'): Json[] {
  if (!isObject(step)) return [];
  if (step.type === 'Sequence' && Array.isArray(step[key])) return (step[key] as unknown[]).flatMap((s) => flattenSteps(s, key));
  return [step];
}

/**
 * The GGUF `tokenizer.ggml.pre` name for a tokenizer.json. llama.cpp's converter recognises
 * pre-tokenizers by hashing a test string's tokenization; we recognise them by their Split regex,
 * which is what differs between the families:
 * - the Llama 3 regex (digits in groups of up to three) -> `llama-bpe`;
 * - the Qwen2/Qwen3 regex (single digits) -> `qwen2`;
 * - a bare GPT-2 `ByteLevel` pre-tokenizer with its built-in regex -> `gpt-2`;
 * - SentencePiece-style vocabularies and anything unrecognised -> `default`. For an unrecognised
 *   byte-level tokenizer llama.cpp will then split text with its default regex, which may not
 *   match the original tokenizer exactly.
 */
export function detectPreTokenizer(tokenizerJson: unknown): string {
  if (!isObject(tokenizerJson)) return 'default';
  const steps = flattenSteps(tokenizerJson.pre_tokenizer, 'pretokenizers');
  for (const step of steps) {
    if (step.type !== 'Split' || !isObject(step.pattern)) continue;
    const regex = step.pattern.Regex;
    if (regex === LLAMA3_REGEX) return 'llama-bpe';
    if (regex === QWEN2_REGEX) return 'qwen2';
  }
  if (steps.length === 1 && steps[0]?.type === 'ByteLevel' && steps[0].use_regex !== false) return 'gpt-2';
  return 'default';
}

interface AddedToken {
  id: number;
  content: string;
  special: boolean;
}

function addedTokens(tokenizerJson: Json): AddedToken[] {
  const list = tokenizerJson.added_tokens ?? [];
  if (!Array.isArray(list)) throw bad('tokenizer.json added_tokens is not a list');
  return list.map((t: unknown) => {
    if (!isObject(t) || typeof t.id !== 'number' || !Number.isSafeInteger(t.id) || t.id < 0 || typeof t.content !== 'string') {
      throw bad(`tokenizer.json has a malformed added token: ${JSON.stringify(t)}`);
    }
    return { id: t.id, content: t.content, special: t.special === true };
  });
}

/** llama.cpp's `does_token_look_special`: some models mark control tokens as not special. */
function looksSpecial(text: string): boolean {
  return (
    ['<pad>', '<mask>', '<2mass>', '[@BOS@]'].includes(text) ||
    (text.startsWith('<|') && text.endsWith('|>')) ||
    (text.startsWith('<\uff5c') && text.endsWith('\uff5c>')) ||
    (text.startsWith('<unused') && text.endsWith('>'))
  );
}

function tokenContent(v: unknown): string | null {
  if (typeof v === 'string') return v;
  if (isObject(v) && typeof v.content === 'string') return v.content;
  return null;
}

function parseMerges(model: Json): string[] {
  const merges = model.merges ?? [];
  if (!Array.isArray(merges)) throw bad('tokenizer.json model.merges is not a list');
  return merges.map((m: unknown) => {
    if (typeof m === 'string') return m;
    // transformers >= 4.45 stores pairs; spaces inside a part are encoded as in llama.cpp's
    // SpecialVocab (U+0120) so that "a b" stays splittable.
    if (Array.isArray(m) && m.length === 2 && typeof m[0] === 'string' && typeof m[1] === 'string') {
      return (m as string[]).map((part) => part.replaceAll(' ', '\u0120')).join(' ');
    }
    throw bad(`tokenizer.json has a malformed merge: ${JSON.stringify(m)}`);
  });
}

function classify(tokenizerJson: Json): { kind: TokenizerKind; model: Json } {
  const model = tokenizerJson.model;
  if (!isObject(model)) throw bad('tokenizer.json has no model');
  if (model.type === 'Unigram') return { kind: 'sentencepiece-unigram', model };
  if (model.type === 'BPE' || (model.type === undefined && isObject(model.vocab) && Array.isArray(model.merges))) {
    if (model.byte_fallback === true) return { kind: 'sentencepiece-bpe', model };
    const steps = [...flattenSteps(tokenizerJson.pre_tokenizer, 'pretokenizers'), ...flattenSteps(tokenizerJson.decoder, 'decoders')];
    const usesByteLevel = steps.some((s) => s.type === 'ByteLevel');
    if (usesByteLevel) return { kind: 'byte-level-bpe', model };
    throw bad('tokenizer.json BPE model is neither byte-level nor byte_fallback; not supported');
  }
  throw bad(`tokenizer.json model type ${JSON.stringify(model.type)} is not supported`);
}

/** Parses a Hugging Face tokenizer. @throws ConvertError `UnsupportedConfig` */
export function parseTokenizer(input: TokenizerInput): ParsedTokenizer {
  const tj = input.tokenizerJson;
  if (!isObject(tj)) throw bad('tokenizer.json is not a JSON object');
  const tc: Json = isObject(input.tokenizerConfig) ? input.tokenizerConfig : {};
  const { kind, model } = classify(tj);

  // Base vocabulary: id -> text (and score for Unigram).
  const base = new Map<number, string>();
  const baseScores = new Map<number, number>();
  if (kind === 'sentencepiece-unigram') {
    if (!Array.isArray(model.vocab)) throw bad('tokenizer.json Unigram vocab is not a list');
    (model.vocab as unknown[]).forEach((entry, id) => {
      if (!Array.isArray(entry) || typeof entry[0] !== 'string' || typeof entry[1] !== 'number') {
        throw bad(`tokenizer.json has a malformed Unigram entry at ${id}`);
      }
      base.set(id, entry[0]);
      baseScores.set(id, entry[1]);
    });
  } else {
    if (!isObject(model.vocab)) throw bad('tokenizer.json BPE vocab is not an object');
    for (const [text, id] of Object.entries(model.vocab)) {
      if (typeof id !== 'number' || !Number.isSafeInteger(id) || id < 0) throw bad(`tokenizer.json vocab entry ${JSON.stringify(text)} has a bad id`);
      base.set(id, text);
    }
  }
  const added = addedTokens(tj);
  const addedById = new Map(added.map((t) => [t.id, t]));
  let size = 0;
  for (const id of base.keys()) size = Math.max(size, id + 1);
  for (const t of added) size = Math.max(size, t.id + 1);
  if (size === 0) throw bad('tokenizer.json has an empty vocabulary');
  // Holes in the ids become unused `[PADn]` tokens, one object each: ids running far past the
  // tokens defined (a corrupt id like 2^40, found by fuzzing) would make billions of them.
  const defined = new Set([...base.keys(), ...added.map((t) => t.id)]).size;
  if (size > MAX_HOLES_PER_TOKEN * defined + MAX_HOLES) {
    throw bad(`tokenizer.json ids reach ${size - 1}, but it defines only ${defined} tokens: too many holes to fill`);
  }

  const idOf = new Map<string, number>();
  for (const [id, text] of base) if (!idOf.has(text)) idOf.set(text, id);
  for (const t of added) idOf.set(t.content, t.id);

  let unkId: number | null = null;
  if (kind === 'sentencepiece-unigram' && typeof model.unk_id === 'number') unkId = model.unk_id;
  if (kind === 'sentencepiece-bpe' && typeof model.unk_token === 'string') unkId = idOf.get(model.unk_token) ?? null;
  const unkFromConfig = tokenContent(tc.unk_token);
  if (unkFromConfig !== null && idOf.has(unkFromConfig)) unkId = idOf.get(unkFromConfig) ?? unkId;

  const spm = kind !== 'byte-level-bpe';
  const tokens: string[] = [];
  const tokenBytes: Uint8Array[] = [];
  const scores = new Float32Array(size);
  const types: TokenTypeId[] = [];
  for (let id = 0; id < size; id++) {
    const addedToken = addedById.get(id);
    const baseText = base.get(id);
    let text: string;
    let type: TokenTypeId;
    let bytes: Uint8Array;
    if (addedToken) {
      text = addedToken.content;
      bytes = spm ? pieceBytes(text, false) : byteLevelTokenBytes(text);
      if (spm && id === unkId) type = TokenType.unknown;
      else if (addedToken.special || looksSpecial(text)) type = TokenType.control;
      else {
        type = TokenType.userDefined;
        // llama.cpp pre-normalises spaces of user-defined tokens.
        text = text.replaceAll(SPIECE_SPACE, ' ');
      }
    } else if (baseText !== undefined) {
      text = baseText;
      const isByte = spm && BYTE_TOKEN.test(text);
      type = isByte ? TokenType.byte : spm && id === unkId ? TokenType.unknown : TokenType.normal;
      bytes = spm ? pieceBytes(text, isByte) : byteLevelTokenBytes(text);
    } else {
      text = `[PAD${id}]`;
      type = TokenType.unused;
      bytes = utf8.encode(text);
    }
    if (bytes.length === 0) throw bad(`token ${id} (${JSON.stringify(text)}) has no bytes`);
    tokens.push(text);
    types.push(type);
    tokenBytes.push(bytes);
    // distributed-llama scores every token of a fast tokenizer by -id (lower ids merge first);
    // Unigram keeps its own log-probabilities, added pieces get llama.cpp's -1000.
    scores[id] = kind === 'sentencepiece-unigram' ? (baseScores.get(id) ?? -1000) : -id;
  }

  const lookup = (key: string): number | null => {
    const content = tokenContent(tc[key]);
    if (content === null) return null;
    const id = idOf.get(content);
    if (id === undefined) throw bad(`tokenizer_config.json ${key} ${JSON.stringify(content)} is not in the vocabulary`);
    return id;
  };
  const bosId = lookup('bos_token') ?? input.bosTokenId ?? null;
  const eosId = lookup('eos_token') ?? input.eosTokenIds?.[0] ?? null;
  // distributed-llama's converter takes config.json's list; we append the tokenizer's own EOS in
  // case config.json omits it (Llama 3 Instruct ends turns with <|eot_id|>).
  const eosIds = [...new Set([...(input.eosTokenIds ?? []), ...(eosId === null ? [] : [eosId])])];
  for (const id of [bosId, ...eosIds]) {
    if (id !== null && id >= size) throw bad(`special token id ${id} is outside the vocabulary of ${size} tokens`);
  }

  const { addBos, addEos } = addSpecialTokens(tj, tc, bosId === null ? null : (tokens[bosId] ?? null), eosId === null ? null : (tokens[eosId] ?? null));
  const { chatTemplate, namedChatTemplates } = chatTemplates(tc.chat_template, input.chatTemplateFile ?? null);

  return {
    kind,
    ggmlModel: spm ? 'llama' : 'gpt2',
    pre: spm ? 'default' : detectPreTokenizer(tj),
    tokens,
    tokenBytes,
    scores,
    types,
    merges: spm ? [] : parseMerges(model),
    bosId,
    eosId,
    eosIds,
    unkId,
    padId: lookup('pad_token'),
    eotId: lookup('eot_token'),
    addBos,
    addEos,
    addSpacePrefix: typeof tc.add_prefix_space === 'boolean' ? tc.add_prefix_space : null,
    chatTemplate,
    namedChatTemplates,
  };
}

/**
 * Whether BOS/EOS are added: tokenizer_config.json `add_bos_token`/`add_eos_token` when present,
 * else what a `TemplateProcessing` post-processor puts around a single sequence (as llama.cpp's
 * SpecialVocab reads it; Llama 3 only says it there).
 */
function addSpecialTokens(tj: Json, tc: Json, bos: string | null, eos: string | null): { addBos: boolean | null; addEos: boolean | null } {
  let addBos: boolean | null = null;
  let addEos: boolean | null = null;
  const template = flattenSteps(tj.post_processor, 'processors').find((p) => p.type === 'TemplateProcessing');
  if (template && Array.isArray(template.single) && template.single.length > 0) {
    const special = (item: unknown): string | null => {
      if (!isObject(item) || !isObject(item.SpecialToken)) return null;
      return typeof item.SpecialToken.id === 'string' ? item.SpecialToken.id : null;
    };
    const single = template.single as unknown[];
    const first = special(single[0]);
    const last = single.length > 1 ? special(single[single.length - 1]) : null;
    addBos = first !== null && first === bos;
    addEos = last !== null && last === eos;
  }
  if (typeof tc.add_bos_token === 'boolean') addBos = tc.add_bos_token;
  if (typeof tc.add_eos_token === 'boolean') addEos = tc.add_eos_token;
  return { addBos, addEos };
}

function chatTemplates(value: unknown, file: string | null): { chatTemplate: string | null; namedChatTemplates: { name: string; template: string }[] } {
  if (typeof value === 'string') return { chatTemplate: value, namedChatTemplates: [] };
  if (Array.isArray(value)) {
    let chatTemplate: string | null = null;
    const namedChatTemplates: { name: string; template: string }[] = [];
    for (const entry of value) {
      if (!isObject(entry) || typeof entry.name !== 'string' || typeof entry.template !== 'string') continue;
      if (entry.name === 'default') chatTemplate = entry.template;
      // gguf-py keeps only [A-Za-z0-9_] in template names.
      else namedChatTemplates.push({ name: entry.name.replace(/[^A-Za-z0-9]/g, '_'), template: entry.template });
    }
    return { chatTemplate, namedChatTemplates };
  }
  return { chatTemplate: file, namedChatTemplates: [] };
}

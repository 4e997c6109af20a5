import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { TokenType, byteLevelTokenBytes, detectPreTokenizer, parseTokenizer } from './tokenizer';

const dir = join(__dirname, 'testdata', 'tiny-llama');
const json = (name: string): Record<string, unknown> => JSON.parse(readFileSync(join(dir, name), 'utf8')) as Record<string, unknown>;
const hex = (b: Uint8Array): string => Buffer.from(b).toString('hex');
const text = (b: Uint8Array): string => Buffer.from(b).toString('utf8');

const QWEN2_REGEX = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

function failure(fn: () => unknown): { name: string; code: string; message: string } {
  try {
    fn();
  } catch (err) {
    return err as { name: string; code: string; message: string };
  }
  throw new Error('expected a failure');
}

/** GPT-2's bytes_to_unicode, written independently of the implementation. */
function bytesToUnicode(): Map<number, string> {
  const printable = (b: number): boolean => (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
  const map = new Map<number, string>();
  let next = 256;
  for (let b = 0; b < 256; b++) map.set(b, String.fromCodePoint(printable(b) ? b : next++));
  return map;
}

describe('parseTokenizer: byte-level BPE (Llama 3 style)', () => {
  const tok = parseTokenizer({ tokenizerJson: json('tokenizer.json'), tokenizerConfig: json('tokenizer_config.json'), bosTokenId: 17, eosTokenIds: [18, 19] });

  it('keeps the byte-level token text for GGUF and decodes bytes for dllama', () => {
    expect(tok).toMatchObject({ kind: 'byte-level-bpe', ggmlModel: 'gpt2', pre: 'llama-bpe' });
    expect(tok.tokens).toEqual([
      'h',
      'e',
      'l',
      'o',
      'Ġ',
      'w',
      'r',
      'd',
      'Ċ',
      'Ã',
      '©',
      'he',
      'll',
      'hell',
      'hello',
      'Ġw',
      'Ã©',
      '<|begin_of_text|>',
      '<|end_of_text|>',
      '<|eot_id|>',
      '<think>',
      '<|reserved_0|>',
    ]);
    expect(text(tok.tokenBytes[4] as Uint8Array)).toBe(' ');
    expect(text(tok.tokenBytes[8] as Uint8Array)).toBe('\n');
    expect(hex(tok.tokenBytes[9] as Uint8Array)).toBe('c3');
    expect(hex(tok.tokenBytes[10] as Uint8Array)).toBe('a9');
    expect(text(tok.tokenBytes[15] as Uint8Array)).toBe(' w');
    expect(text(tok.tokenBytes[16] as Uint8Array)).toBe('\u00e9');
    expect(text(tok.tokenBytes[17] as Uint8Array)).toBe('<|begin_of_text|>');
  });

  it('types added tokens: special and special-looking are control, others user-defined', () => {
    expect(tok.types).toEqual([...Array<number>(17).fill(TokenType.normal), 3, 3, 3, TokenType.userDefined, TokenType.control]);
  });

  it('scores by -id, keeps merges, special ids, add_bos from the post-processor and the chat template', () => {
    expect(Array.from(tok.scores.subarray(0, 3))).toEqual([-0, -1, -2]);
    expect(Object.is(tok.scores[0], -0)).toBe(true); // struct.pack('f', -float(0)) in the reference
    expect(tok.merges).toEqual(['h e', 'l l', 'he ll', 'hell o', 'Ġ w', 'Ã ©']);
    expect(tok).toMatchObject({
      bosId: 17,
      eosId: 19,
      eosIds: [18, 19],
      unkId: null,
      padId: null,
      eotId: null,
      addBos: true,
      addEos: false,
      addSpacePrefix: null,
    });
    expect(tok.chatTemplate).toContain('{% for m in messages %}');
    expect(tok.namedChatTemplates).toEqual([]);
  });

  it('appends the tokenizer EOS to config.json eos ids when missing', () => {
    const t = parseTokenizer({ tokenizerJson: json('tokenizer.json'), tokenizerConfig: json('tokenizer_config.json'), eosTokenIds: [18] });
    expect(t.eosIds).toEqual([18, 19]);
    expect(t.bosId).toBe(17); // from tokenizer_config.json
  });

  it('maps every byte through the GPT-2 table', () => {
    for (const [byte, ch] of bytesToUnicode()) expect(Array.from(byteLevelTokenBytes(ch))).toEqual([byte]);
    expect(hex(byteLevelTokenBytes('\u2581x'))).toBe('e2968178'); // outside the table: UTF-8, as dllama
  });
});

describe('parseTokenizer: Qwen style', () => {
  const tj = json('tokenizer.json');
  (tj.pre_tokenizer as { pretokenizers: { pattern: { Regex: string } }[] }).pretokenizers[0]!.pattern.Regex = QWEN2_REGEX;
  tj.post_processor = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: false, use_regex: false };
  (tj.model as { merges: unknown }).merges = ['h e', 'l l', 'he ll', 'hell o', 'Ġ w', 'Ã ©'];
  const tc = {
    ...json('tokenizer_config.json'),
    bos_token: null,
    eos_token: '<|eot_id|>',
    pad_token: '<|end_of_text|>',
    add_bos_token: false,
    chat_template: [
      { name: 'default', template: 'T' },
      { name: 'tool use', template: 'U' },
    ],
  };

  it('detects the qwen2 pre-tokenizer, takes BOS from config.json and honours add_bos_token', () => {
    const tok = parseTokenizer({ tokenizerJson: tj, tokenizerConfig: tc, bosTokenId: 18, eosTokenIds: [19] });
    expect(tok).toMatchObject({ pre: 'qwen2', bosId: 18, eosId: 19, eosIds: [19], padId: 18, addBos: false, addEos: null });
    expect(tok.merges[4]).toBe('Ġ w');
    expect(tok.chatTemplate).toBe('T');
    expect(tok.namedChatTemplates).toEqual([{ name: 'tool_use', template: 'U' }]);
  });

  it('names other pre-tokenizers', () => {
    expect(detectPreTokenizer({ pre_tokenizer: { type: 'ByteLevel', add_prefix_space: false, use_regex: true } })).toBe('gpt-2');
    expect(
      detectPreTokenizer({
        pre_tokenizer: {
          type: 'Sequence',
          pretokenizers: [
            { type: 'Split', pattern: { Regex: '\\s+' } },
            { type: 'ByteLevel', use_regex: false },
          ],
        },
      }),
    ).toBe('default');
    expect(detectPreTokenizer(null)).toBe('default');
  });

  it('reads chat_template.jinja when tokenizer_config.json has none', () => {
    const { chat_template: _, ...rest } = json('tokenizer_config.json');
    const tok = parseTokenizer({ tokenizerJson: json('tokenizer.json'), tokenizerConfig: rest, chatTemplateFile: 'J', eosTokenIds: [19] });
    expect(tok.chatTemplate).toBe('J');
  });
});

/** A Llama 2 style tokenizer.json: BPE with byte_fallback, `▁` for spaces, `<0xNN>` byte tokens. */
function spmBpe(): Record<string, unknown> {
  const vocab = ['<unk>', '<s>', '</s>', '<0x0A>', '<0xC3>', '<0xA9>', '▁', 'h', 'i', '▁h', '▁hi', 'é'];
  return {
    version: '1.0',
    added_tokens: [
      { id: 0, content: '<unk>', special: true, normalized: false },
      { id: 1, content: '<s>', special: true, normalized: false },
      { id: 2, content: '</s>', special: true, normalized: false },
      { id: 12, content: '▁<user>', special: false, normalized: false },
    ],
    normalizer: {
      type: 'Sequence',
      normalizers: [
        { type: 'Prepend', prepend: '▁' },
        { type: 'Replace', pattern: { String: ' ' }, content: '▁' },
      ],
    },
    pre_tokenizer: null,
    post_processor: { type: 'TemplateProcessing', single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }] },
    decoder: { type: 'Sequence', decoders: [{ type: 'Replace', pattern: { String: '▁' }, content: ' ' }, { type: 'ByteFallback' }, { type: 'Fuse' }] },
    model: {
      type: 'BPE',
      unk_token: '<unk>',
      fuse_unk: true,
      byte_fallback: true,
      vocab: Object.fromEntries(vocab.map((t, i) => [t, i])),
      merges: ['▁ h', '▁h i'],
    },
  };
}

describe('parseTokenizer: SentencePiece style', () => {
  it('reads a byte_fallback BPE vocabulary: byte, unknown and control types, ▁ as space', () => {
    const tok = parseTokenizer({
      tokenizerJson: spmBpe(),
      tokenizerConfig: {
        bos_token: '<s>',
        eos_token: '</s>',
        unk_token: '<unk>',
        add_bos_token: true,
        add_eos_token: false,
        tokenizer_class: 'LlamaTokenizer',
      },
    });
    expect(tok).toMatchObject({
      kind: 'sentencepiece-bpe',
      ggmlModel: 'llama',
      pre: 'default',
      merges: [],
      bosId: 1,
      eosId: 2,
      eosIds: [2],
      unkId: 0,
      addBos: true,
      addEos: false,
    });
    expect(tok.types).toEqual([TokenType.unknown, TokenType.control, TokenType.control, 6, 6, 6, 1, 1, 1, 1, 1, 1, TokenType.userDefined]);
    expect(tok.tokens.slice(3, 13)).toEqual(['<0x0A>', '<0xC3>', '<0xA9>', '▁', 'h', 'i', '▁h', '▁hi', 'é', ' <user>']);
    expect(tok.tokenBytes.map(hex)).toEqual([
      '3c756e6b3e',
      '3c733e',
      '3c2f733e',
      '0a',
      'c3',
      'a9',
      '20',
      '68',
      '69',
      '2068',
      '206869',
      'c3a9',
      '203c757365723e',
    ]);
    expect(Array.from(tok.scores)).toEqual([-0, -1, -2, -3, -4, -5, -6, -7, -8, -9, -10, -11, -12]);
  });

  it('reads a Unigram vocabulary with its scores', () => {
    const tok = parseTokenizer({
      tokenizerJson: {
        added_tokens: [
          { id: 1, content: '<s>', special: true },
          { id: 2, content: '</s>', special: true },
          { id: 6, content: '<extra>', special: false },
        ],
        decoder: { type: 'Metaspace', replacement: '▁' },
        model: {
          type: 'Unigram',
          unk_id: 0,
          byte_fallback: true,
          vocab: [
            ['<unk>', 0],
            ['<s>', 0],
            ['</s>', 0],
            ['<0x41>', 0],
            ['▁', -2.5],
            ['▁hi', -3.25],
          ],
        },
      },
      tokenizerConfig: { bos_token: { content: '<s>' }, eos_token: '</s>' },
    });
    expect(tok).toMatchObject({ kind: 'sentencepiece-unigram', ggmlModel: 'llama', unkId: 0, bosId: 1, eosId: 2, addBos: null });
    expect(tok.types).toEqual([TokenType.unknown, 3, 3, TokenType.byte, 1, 1, TokenType.userDefined]);
    expect(Array.from(tok.scores)).toEqual([0, 0, 0, 0, -2.5, -3.25, -1000]);
    expect(tok.tokenBytes.map(hex)).toEqual(['3c756e6b3e', '3c733e', '3c2f733e', '41', '20', '206869', '3c65787472613e']);
  });

  it('fills holes in the ids with unused [PADn] tokens', () => {
    const tj = spmBpe();
    (tj.added_tokens as { id: number }[])[3]!.id = 14;
    const tok = parseTokenizer({ tokenizerJson: tj });
    expect(tok.tokens.slice(12)).toEqual(['[PAD12]', '[PAD13]', ' <user>']);
    expect(tok.types.slice(12)).toEqual([TokenType.unused, TokenType.unused, TokenType.userDefined]);
  });
});

describe('parseTokenizer: rejections', () => {
  it('ids far past the tokens defined (more holes than tokens + 1024) are refused before any hole is filled', () => {
    const tj = spmBpe();
    (tj.added_tokens as { id: number }[])[3]!.id = 2 ** 40;
    expect(failure(() => parseTokenizer({ tokenizerJson: tj }))).toMatchObject({
      name: 'ConvertError',
      code: 'UnsupportedConfig',
      message: expect.stringContaining('too many holes') as unknown,
    });
    // 13 tokens defined (ids 0–11 and the moved one): ids up to 13 + 1024 − 1 are allowed, one more is not.
    (tj.added_tokens as { id: number }[])[3]!.id = 13 + 1024 - 1;
    expect(parseTokenizer({ tokenizerJson: tj }).tokens).toHaveLength(13 + 1024);
    (tj.added_tokens as { id: number }[])[3]!.id = 13 + 1024;
    expect(failure(() => parseTokenizer({ tokenizerJson: tj }))).toMatchObject({ code: 'UnsupportedConfig' });
  });

  it.each([
    ['WordPiece', { model: { type: 'WordPiece', vocab: { a: 0 } } }, 'WordPiece'],
    ['plain BPE', { model: { type: 'BPE', vocab: { a: 0 }, merges: [] } }, 'neither byte-level nor byte_fallback'],
    ['no model', {}, 'no model'],
  ])('rejects %s', (_, tokenizerJson, message) => {
    expect(failure(() => parseTokenizer({ tokenizerJson }))).toMatchObject({
      name: 'ConvertError',
      code: 'UnsupportedConfig',
      message: expect.stringContaining(message) as unknown,
    });
  });

  it('rejects special tokens outside the vocabulary', () => {
    expect(failure(() => parseTokenizer({ tokenizerJson: spmBpe(), tokenizerConfig: { bos_token: '<nope>' } }))).toMatchObject({
      code: 'UnsupportedConfig',
      message: expect.stringContaining('<nope>') as unknown,
    });
    expect(failure(() => parseTokenizer({ tokenizerJson: spmBpe(), eosTokenIds: [99] }))).toMatchObject({
      code: 'UnsupportedConfig',
      message: expect.stringContaining('99') as unknown,
    });
  });
});

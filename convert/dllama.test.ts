/**
 * distributed-llama `.m` and `.t` files. Expected bytes come from two places:
 * - testdata/*.hex, written by distributed-llama's own converter code (convert-hf.py loadConfig +
 *   writer.py writeHeader; convert-tokenizer-hf.py TokensResolver + tokenizer-writer.py) on the
 *   testdata/tiny-* inputs, see testdata/README.md;
 * - a small independent encoder below, from the format as src/llm.cpp and src/tokenizer.cpp read it.
 */
import { mkdtemp, readFile, readdir, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { type ArchName, type ModelSpec, parseModelSpec } from './arch';
import {
  checkDllamaModel,
  checkDllamaTokenizer,
  checkDllamaWeights,
  dllamaChatTemplateKind,
  dllamaHeaderEntries,
  encodeDllamaTokenizer,
  planDllama,
  writeDllamaModel,
  writeDllamaTokenizer,
} from './dllama';
import { type ParsedTokenizer, parseTokenizer, TokenType } from './tokenizer';

const testdata = join(__dirname, 'testdata');

async function readJson(...path: string[]): Promise<Record<string, unknown>> {
  return JSON.parse(await readFile(join(testdata, ...path), 'utf8')) as Record<string, unknown>;
}

async function golden(name: string): Promise<Buffer> {
  return Buffer.from((await readFile(join(testdata, name), 'utf8')).replace(/\s+/g, ''), 'hex');
}

/** Independent encoder: int32 magic, int32 total header size, int32 key/value pairs. */
function kvHeader(magic: number, pairs: [number, number][]): Buffer {
  const b = Buffer.alloc(8 + pairs.length * 8);
  b.writeInt32LE(magic, 0);
  b.writeInt32LE(b.length, 4);
  pairs.forEach(([k, v], i) => {
    b.writeInt32LE(k, 8 + 8 * i);
    b.writeInt32LE(v, 12 + 8 * i);
  });
  return b;
}

function failure(fn: () => unknown): { name: string; code: string; message: string } {
  try {
    fn();
  } catch (err) {
    return err as { name: string; code: string; message: string };
  }
  throw new Error('expected a failure');
}

async function tinyLlama(): Promise<{ spec: ModelSpec; tok: ParsedTokenizer }> {
  const spec = parseModelSpec(await readJson('tiny-llama', 'config.json'));
  const tok = parseTokenizer({
    tokenizerJson: await readJson('tiny-llama', 'tokenizer.json'),
    tokenizerConfig: await readJson('tiny-llama', 'tokenizer_config.json'),
    bosTokenId: spec.bosTokenId,
    eosTokenIds: spec.eosTokenIds,
  });
  return { spec, tok };
}

const noLmHead = (n: string): boolean => n !== 'lm_head.weight';

describe('distributed-llama model header', () => {
  it('equals the reference converter for Llama 3 with rope scaling (q40)', async () => {
    const { spec } = await tinyLlama();
    const plan = planDllama(spec, 'q40', noLmHead);
    const expected = kvHeader(0x0a00abcd, [
      [0, 0],
      [1, 0xabcd00],
      [11, 1],
      [2, 64],
      [3, 128],
      [4, 2],
      [5, 4],
      [6, 2],
      [13, 2],
      [10, 131072],
      [9, 32],
      [7, 0],
      [8, 0],
      [12, 500000],
      [14, 32],
      [15, 1],
      [16, 4],
      [17, 8192],
      [18, 2],
      [19, 16],
      [20, 5],
    ]);
    expect(Buffer.from(plan.headerBytes).equals(expected)).toBe(true);
    expect(Buffer.from(plan.headerBytes).equals(await golden('dllama-tiny-llama-q40.m-header.hex'))).toBe(true);
  });

  it('equals the reference converter for Qwen3 (f16)', async () => {
    const spec = parseModelSpec(await readJson('tiny-qwen3', 'config.json'));
    const plan = planDllama(spec, 'f16', noLmHead);
    const expected = kvHeader(0x0a00abcd, [
      [0, 0],
      [1, 0xabcd01],
      [11, 1],
      [2, 64],
      [3, 96],
      [4, 2],
      [5, 4],
      [6, 2],
      [13, 1],
      [10, 40960],
      [9, 40],
      [7, 0],
      [8, 0],
      [12, 1000000],
      [19, 32],
      [20, 6],
    ]);
    expect(Buffer.from(plan.headerBytes).equals(expected)).toBe(true);
    expect(Buffer.from(plan.headerBytes).equals(await golden('dllama-tiny-qwen3-f16.m-header.hex'))).toBe(true);
    // qwen3 tensors are not permuted and carry q/k norms
    expect(plan.tensors.every((t) => t.permute === null)).toBe(true);
    expect(plan.tensors.filter((t) => t.name.endsWith('_norm.weight')).map((t) => [t.name, t.format, t.byteLength])).toEqual([
      ['model.layers.0.self_attn.q_norm.weight', 'f32', 128],
      ['model.layers.0.self_attn.k_norm.weight', 'f32', 128],
      ['model.layers.1.self_attn.q_norm.weight', 'f32', 128],
      ['model.layers.1.self_attn.k_norm.weight', 'f32', 128],
    ]);
  });

  it('writes head_dim when it differs from dim/heads even if config.json lacks it, and omits defaults like the reference', async () => {
    const q = await readJson('tiny-qwen3', 'config.json');
    delete q.head_dim; // Qwen3Config default: 128
    expect(dllamaHeaderEntries(parseModelSpec(q), 'f32')).toContainEqual(['head_dim', 128]);
    const l = await readJson('tiny-llama', 'config.json');
    for (const k of ['head_dim', 'rope_theta', 'rope_scaling']) delete l[k];
    const keys = dllamaHeaderEntries(parseModelSpec(l), 'f32').map(([k]) => k);
    expect(keys).not.toContain('head_dim');
    expect(keys).not.toContain('rope_theta');
    expect(keys).not.toContain('rope_type');
    expect(keys.at(-1)).toBe('norm_epsilon');
  });

  it('refuses values the header would truncate', async () => {
    const { spec } = await tinyLlama();
    const scaling = spec.ropeScaling as NonNullable<ModelSpec['ropeScaling']>;
    expect(failure(() => dllamaHeaderEntries({ ...spec, ropeScaling: { ...scaling, factor: 2.5 } }, 'q40'))).toMatchObject({
      code: 'UnsupportedConfig',
      message: expect.stringContaining('2.5') as unknown,
    });
    expect(failure(() => dllamaHeaderEntries({ ...spec, ropeTheta: 10000.5 }, 'q40'))).toMatchObject({ code: 'UnsupportedConfig' });
    expect(failure(() => dllamaHeaderEntries({ ...spec, rmsNormEps: 1e-4 }, 'q40'))).toMatchObject({
      code: 'UnsupportedConfig',
      message: expect.stringContaining('0.0001') as unknown,
    });
  });
});

describe('distributed-llama model file', () => {
  it('streams the header and the tensors in plan order, atomically', async () => {
    const { spec } = await tinyLlama();
    const plan = planDllama(spec, 'q80', noLmHead);
    expect(plan.totalSize).toBe(plan.headerBytes.length + plan.tensors.reduce((n, t) => n + t.byteLength, 0));
    const dir = await mkdtemp(join(tmpdir(), 'dllama-test-'));
    try {
      const path = join(dir, 'model.m');
      await writeDllamaModel(path, plan, async function* (i, t) {
        // two chunks, to exercise streaming
        const data = new Uint8Array(t.byteLength).fill(i + 1);
        yield data.subarray(0, 5);
        await Promise.resolve();
        yield data.subarray(5);
      });
      expect(await readdir(dir)).toEqual(['model.m']);
      const bytes = await readFile(path);
      expect(bytes.length).toBe(plan.totalSize);
      expect(bytes.subarray(0, plan.headerBytes.length).equals(Buffer.from(plan.headerBytes))).toBe(true);
      let at = plan.headerBytes.length;
      plan.tensors.forEach((t, i) => {
        expect([t.name, bytes[at], bytes[at + t.byteLength - 1]]).toEqual([t.name, i + 1, i + 1]);
        at += t.byteLength;
      });

      const short = join(dir, 'short.m');
      await expect(writeDllamaModel(short, plan, () => new Uint8Array(3))).rejects.toThrow(/expected/);
      expect(await readdir(dir)).toEqual(['model.m']);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

/** Independent `.t` encoder following tokenizer-writer.py. */
function expectedTokenizer(o: { bos: number; tokens: Buffer[]; scores: number[]; template: string | null; eos: number[]; addBos: boolean }): Buffer {
  const template = o.template === null ? null : Buffer.from(o.template, 'utf8');
  const pairs: [number, number][] = [
    [3, o.bos],
    [0, 1],
    [1, o.tokens.length],
    [2, Math.max(...o.tokens.map((t) => t.length))],
  ];
  if (template) pairs.push([7, template.length]);
  pairs.push([9, o.eos.length], [10, o.addBos ? 1 : 0]);
  const parts = [kvHeader(0x567124, pairs)];
  if (template) parts.push(template);
  for (const id of o.eos) {
    const b = Buffer.alloc(4);
    b.writeInt32LE(id);
    parts.push(b);
  }
  o.tokens.forEach((t, i) => {
    const b = Buffer.alloc(8);
    b.writeFloatLE(o.scores[i] as number, 0);
    b.writeUInt32LE(t.length, 4);
    parts.push(b, t);
  });
  return Buffer.concat(parts);
}

describe('distributed-llama tokenizer', () => {
  it('equals the reference converter for a byte-level BPE tokenizer', async () => {
    const { tok } = await tinyLlama();
    const ours = Buffer.from(encodeDllamaTokenizer(tok));
    expect(ours.equals(await golden('dllama-tiny-llama.t.hex'))).toBe(true);
    const tokens = [
      'h',
      'e',
      'l',
      'o',
      ' ',
      'w',
      'r',
      'd',
      '\n',
      Buffer.of(0xc3),
      Buffer.of(0xa9),
      'he',
      'll',
      'hell',
      'hello',
      ' w',
      '\u00e9',
      '<|begin_of_text|>',
      '<|end_of_text|>',
      '<|eot_id|>',
      '<think>',
      '<|reserved_0|>',
    ].map((t) => (typeof t === 'string' ? Buffer.from(t, 'utf8') : t));
    const template = (await readJson('tiny-llama', 'tokenizer_config.json')).chat_template as string;
    const scores = tokens.map((_, i) => -i);
    expect(ours.equals(expectedTokenizer({ bos: 17, tokens, scores, template, eos: [18, 19], addBos: true }))).toBe(true);
  });

  it('encodes a SentencePiece-style tokenizer: bytes for <0xNN>, spaces for ▁, no template', () => {
    const tok = parseTokenizer({
      tokenizerJson: {
        added_tokens: [
          { id: 0, content: '<unk>', special: true },
          { id: 1, content: '<s>', special: true },
          { id: 2, content: '</s>', special: true },
        ],
        model: { type: 'BPE', byte_fallback: true, unk_token: '<unk>', vocab: { '<unk>': 0, '<s>': 1, '</s>': 2, '<0x0A>': 3, '▁': 4, '▁hi': 5 }, merges: [] },
      },
      tokenizerConfig: { bos_token: '<s>', eos_token: '</s>' },
    });
    const tokens = ['<unk>', '<s>', '</s>', '\n', ' ', ' hi'].map((t) => Buffer.from(t, 'utf8'));
    const expected = expectedTokenizer({ bos: 1, tokens, scores: [-0, -1, -2, -3, -4, -5], template: null, eos: [2], addBos: false });
    expect(Buffer.from(encodeDllamaTokenizer(tok)).equals(expected)).toBe(true);
  });

  it('needs BOS and EOS ids', async () => {
    const { tok } = await tinyLlama();
    expect(failure(() => encodeDllamaTokenizer({ ...tok, bosId: null }))).toMatchObject({
      code: 'UnsupportedConfig',
      message: expect.stringContaining('BOS') as unknown,
    });
    expect(failure(() => encodeDllamaTokenizer({ ...tok, eosIds: [] }))).toMatchObject({
      code: 'UnsupportedConfig',
      message: expect.stringContaining('EOS') as unknown,
    });
  });

  it('writes the .t file atomically', async () => {
    const { tok } = await tinyLlama();
    const dir = await mkdtemp(join(tmpdir(), 'dllama-test-'));
    try {
      await writeDllamaTokenizer(join(dir, 'tok.t'), tok);
      expect(await readdir(dir)).toEqual(['tok.t']);
      expect((await readFile(join(dir, 'tok.t'))).equals(await golden('dllama-tiny-llama.t.hex'))).toBe(true);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe('what distributed-llama can serve', () => {
  const LLAMA3_TEMPLATE = "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}";

  it('runs f32 and q40 weights only', () => {
    expect(() => checkDllamaWeights('f32')).not.toThrow();
    expect(() => checkDllamaWeights('q40')).not.toThrow();
    for (const weights of ['f16', 'q80'] as const) {
      expect(failure(() => checkDllamaWeights(weights))).toMatchObject({
        name: 'ConvertError',
        code: 'UnsupportedWeights',
        message: `distributed-llama cannot run ${weights} weights: its CPU matmuls take q40 or f32 weights only (${weights} stops at the first matmul: "Unsupported op quant"); convert to q40 or f32`,
      });
    }
  });

  it('refuses an architecture it does not run, and a model no topology runs, naming the dimensions', async () => {
    const { spec } = await tinyLlama();
    expect(() => checkDllamaModel(spec, 'f32')).not.toThrow();
    expect(failure(() => checkDllamaModel({ ...spec, arch: 'gemma' as ArchName }, 'q40'))).toMatchObject({
      code: 'UnsupportedArchitecture',
      message: 'distributed-llama does not run gemma models (it runs llama, qwen3)',
    });
    // head_dim 12 (48 / 4 heads) and an FFN of 100: no node count runs, in either format.
    expect(failure(() => checkDllamaModel({ ...spec, hidden: 48, headDim: 12, intermediate: 100 }, 'f32'))).toMatchObject({
      code: 'NoTopology',
      message:
        "distributed-llama cannot run this model in f32 on any number of nodes: head_dim 12 is not a multiple of 8 (attention's F32 dot product); intermediate_size 100 / 1 node = 100 values per node, not a multiple of 8 (F32 matmul)",
    });
    // f32 runs on 1 and 2 nodes (2 KV heads) where q40's blocks do not fit hidden_size 40.
    expect(failure(() => checkDllamaModel({ ...spec, hidden: 40, headDim: 8, heads: 4, kvHeads: 2, intermediate: 64 }, 'q40'))).toMatchObject({
      code: 'NoTopology',
      message:
        'distributed-llama cannot run this model in q40 on any number of nodes: hidden_size 40 is not a whole number of 32-value q40 blocks (Q40 matmul) (f32 runs on 1, 2 nodes)',
    });
  });

  /** A byte-level BPE tokenizer of `regular` tokens and specials at `specialIds` (BOS the first). */
  const byteLevel = (regular: number, specialIds: number[], chatTemplate: string | null = LLAMA3_TEMPLATE): ParsedTokenizer => {
    const size = regular + specialIds.length;
    const types = Array.from({ length: size }, (_, id) => (specialIds.includes(id) ? TokenType.control : TokenType.normal));
    return {
      kind: 'byte-level-bpe',
      ggmlModel: 'gpt2',
      pre: 'gpt-2',
      tokens: types.map((_, id) => (specialIds.includes(id) ? `<|special_${id}|>` : `t${id}`)),
      tokenBytes: types.map((_, id) => Buffer.from(`t${id}`)),
      scores: Float32Array.from(types, (_, id) => -id),
      types,
      merges: [],
      bosId: specialIds[0]!,
      eosId: specialIds[1]!,
      eosIds: [specialIds[1]!],
      unkId: null,
      padId: null,
      eotId: null,
      addBos: true,
      addEos: false,
      addSpacePrefix: null,
      chatTemplate,
      namedChatTemplates: [],
    };
  };

  it('takes a byte-level BPE vocabulary whose special tokens follow it (Llama 3, Qwen), and refuses one whose BOS comes first (GPT-2 style)', () => {
    expect(() => checkDllamaTokenizer(byteLevel(300, [300, 301]))).not.toThrow();
    expect(failure(() => checkDllamaTokenizer(byteLevel(300, [0, 1, 2])))).toMatchObject({
      code: 'UnsupportedTokenizer',
      message:
        'distributed-llama takes the ids below BOS as its regular vocabulary and merges only those, and this byte-level BPE vocabulary has BOS ("<|special_0|>", id 0) before all of its 300 regular tokens (special tokens first, GPT-2 style): every prompt would reach the model as single bytes; serve this model with llama.cpp (gguf)',
    });
  });

  it("takes a SentencePiece vocabulary (BOS 1), as distributed-llama's own converter does", () => {
    const tok = parseTokenizer({
      tokenizerJson: {
        added_tokens: [
          { id: 0, content: '<unk>', special: true },
          { id: 1, content: '<s>', special: true },
          { id: 2, content: '</s>', special: true },
        ],
        model: { type: 'BPE', byte_fallback: true, unk_token: '<unk>', vocab: { '<unk>': 0, '<s>': 1, '</s>': 2, '<0x0A>': 3, '▁': 4, '▁hi': 5 }, merges: [] },
      },
      tokenizerConfig: { bos_token: '<s>', eos_token: '</s>', chat_template: "{{ bos_token + '[INST] ' + messages[0]['content'] + ' [/INST]' }}" },
    });
    expect(() => checkDllamaTokenizer(tok)).not.toThrow();
  });

  it('needs a chat template dllama-api recognizes, and BOS and EOS ids', () => {
    expect(failure(() => checkDllamaTokenizer(byteLevel(300, [300, 301], null)))).toMatchObject({
      code: 'UnsupportedChatTemplate',
      message:
        'distributed-llama\'s dllama-api serves chat only with a chat template it recognizes ("[INST]" (llama2), "<|start_header_id|>" (llama3), "<｜Assistant｜>" (deepSeek3), "<|im_start|>" (chatml)), and the tokenizer has none (tokenizer_config.json chat_template, chat_template.jinja): it would stop at start with "The tokenizer does not include chat template"',
    });
    expect(failure(() => checkDllamaTokenizer(byteLevel(300, [300, 301], '{% for m in messages %}<|user|>{{ m.content }}{% endfor %}')))).toMatchObject({
      code: 'UnsupportedChatTemplate',
      message:
        'distributed-llama\'s dllama-api recognizes a chat template by "[INST]" (llama2), "<|start_header_id|>" (llama3), "<｜Assistant｜>" (deepSeek3), "<|im_start|>" (chatml), and the tokenizer\'s has none of them: it would stop at start with "Not supported chat template"',
    });
    expect(failure(() => checkDllamaTokenizer({ ...byteLevel(300, [300, 301]), bosId: null }))).toMatchObject({ code: 'UnsupportedConfig' });
    expect(failure(() => checkDllamaTokenizer({ ...byteLevel(300, [300, 301]), eosIds: [] }))).toMatchObject({ code: 'UnsupportedConfig' });
  });

  it('recognizes templates as dllama-api does: by substring, in its order', () => {
    expect(dllamaChatTemplateKind("{{ '[INST] ' + m }}")).toBe('llama2');
    expect(dllamaChatTemplateKind(LLAMA3_TEMPLATE)).toBe('llama3');
    expect(dllamaChatTemplateKind('{{ "<｜User｜>" + m + "<｜Assistant｜>" }}')).toBe('deepSeek3');
    expect(dllamaChatTemplateKind("{{ '<|im_start|>' + m['role'] }}")).toBe('chatml');
    expect(dllamaChatTemplateKind("{{ '<|im_start|>[INST]' }}")).toBe('llama2');
    expect(dllamaChatTemplateKind('{{ "<start_of_turn>" }}')).toBeNull();
  });
});

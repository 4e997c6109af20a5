/**
 * The converter's grammars in llama.cpp itself (node-llama-cpp 3.22.1, its prebuilt CPU binary,
 * run by test/reference/llama-grammar-runner.mjs): each one parses (no model needed: a grammar is
 * parsed when it is created); llama.cpp's own matcher agrees with ./gbnf-match.ts on samples, near
 * misses and the cases' texts; and a tiny random model sampling under a grammar, token by token,
 * only ever completes answers that validate — as llama.cpp reads the tokens' bytes. It reads an
 * overlong UTF-8 form as the code point it spells (no grammar can tell the two apart), which the
 * engine must keep out: the random model here does write one (`E0 9D B5` under "map with counted
 * entries"), and a strict decoder turns it into three U+FFFD.
 */
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { convertModel } from '../../convert/convert';
import { GRAMMAR_CASES, prng, validator } from '../../test/fixtures/grammar-schemas';
import { writeTinyModel } from '../../workers/dev/tiny-model';
import { matches, parseGbnf, sample } from './gbnf-match';
import { schemaToGbnf } from './index';

interface RunnerOutput {
  checks: { error?: string; matches: boolean[] }[];
  generated: { tokens: number[]; bytes: string; eog: boolean }[][];
}

function runLlama(input: unknown): Promise<RunnerOutput> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [join(__dirname, '../../test/reference/llama-grammar-runner.mjs')], { stdio: ['pipe', 'pipe', 'pipe'] });
    let out = '';
    let err = '';
    child.stdout.on('data', (d: Buffer) => (out += d.toString()));
    child.stderr.on('data', (d: Buffer) => (err += d.toString()));
    child.on('error', reject);
    child.on('close', (code) => (code === 0 ? resolve(JSON.parse(out) as RunnerOutput) : reject(new Error(`runner exited ${code}: ${err}`))));
    child.stdin.end(JSON.stringify(input));
  });
}

const gbnfOf = (schema: unknown) => {
  const r = schemaToGbnf(schema);
  if (!r.ok) throw new Error(r.message);
  return r.gbnf;
};

/** Texts one edit away from `text`: a character dropped, doubled or replaced. */
function nearMisses(text: string, random: () => number): string[] {
  const cps = [...text];
  if (cps.length === 0) return ['x'];
  const at = Math.floor(random() * cps.length);
  const other = String.fromCodePoint([0x22, 0x5c, 0x30, 0x2c, 0x20, 0x61, 0xe9, 0x1f600][Math.floor(random() * 8)]!);
  return [
    [...cps.slice(0, at), ...cps.slice(at + 1)].join(''),
    [...cps.slice(0, at), cps[at]!, ...cps.slice(at)].join(''),
    [...cps.slice(0, at), other, ...cps.slice(at + 1)].join(''),
  ];
}

/**
 * Bytes to code points as llama.cpp's `decode_utf8` does: the lead byte's high bits give the
 * length, continuation bytes are not checked against it. So an overlong form (E0 9D B5 for U+0775)
 * is a code point to the grammar but invalid UTF-8 to everyone else (TextDecoder: three U+FFFD).
 */
function decodeAsLlamaCpp(bytes: Uint8Array): string {
  const cps: number[] = [];
  for (let i = 0; i < bytes.length;) {
    const first = bytes[i]!;
    const len = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4][first >> 4]!;
    if (len === 0) throw new Error(`a continuation byte leads at ${i}`);
    let value = first & ((1 << (8 - len)) - 1);
    for (let k = 1; k < len; k++) value = (value << 6) + (bytes[i + k]! & 0x3f);
    cps.push(value);
    i += len;
  }
  return String.fromCodePoint(...cps);
}
/** An overlong three- or four-byte form (in a latin1 view of the bytes). */
const OVERLONG = /\xe0[\x80-\x9f]|\xf0[\x80-\x8f]/;

const DIALECT = ['# a comment', 'root ::= ("a" | b{2,3})+ [^x-z\\]] . tail', 'b ::= [b-d] | "\\x41"', 'tail ::= "" | "-" tail? # trailing', ''].join('\n');
const DIALECT_TEXTS = ['aa.q', 'bbA]q-', 'abbbw😀--', 'x', 'bq.', 'ab]]', 'ccc]]', 'zq.', 'aa\nq'];

describe('llama.cpp reads the grammars as gbnf-match does', () => {
  const checks = [
    { name: 'the dialect: groups, repetitions, classes, comments', gbnf: DIALECT, texts: DIALECT_TEXTS },
    ...GRAMMAR_CASES.map((c) => {
      const gbnf = gbnfOf(c.schema);
      const g = parseGbnf(gbnf);
      const random = prng(11);
      const samples = Array.from({ length: 6 }, () => sample(g, random));
      return {
        name: c.name,
        gbnf,
        texts: [...samples, ...samples.flatMap((s) => nearMisses(s, random)), ...(c.accept ?? []), ...(c.reject ?? []), ...(c.stricter ?? [])],
      };
    }),
  ];
  let results: RunnerOutput['checks'];
  beforeAll(async () => {
    results = (await runLlama({ checks: checks.map(({ gbnf, texts }) => ({ gbnf, texts })) })).checks;
  });

  test.each(checks.map((c, i) => [c.name, i] as const))('%s', (_, i) => {
    const { gbnf, texts } = checks[i]!;
    expect(results[i]!.error).toBeUndefined();
    const g = parseGbnf(gbnf);
    expect(texts.map((t) => [t, results[i]!.matches[texts.indexOf(t)]])).toEqual(texts.map((t) => [t, matches(g, t)]));
  });
});

describe('a tiny random model sampling under the grammars', () => {
  const chosen = [
    'pydantic model',
    'integer multipleOf',
    'number range',
    'price in cents',
    'string lengths',
    'pattern with lengths',
    'pattern beyond ASCII',
    'date-time',
    'ipv6',
    'map with counted entries',
    'recursive tree',
    'enum of every kind',
    'order',
  ].map((name) => GRAMMAR_CASES.find((c) => c.name === name)!);
  let dir: string;
  let generated: RunnerOutput['generated'];

  beforeAll(async () => {
    dir = mkdtempSync(join(tmpdir(), 'magus-grammar-'));
    await writeTinyModel(join(dir, 'hf'), { seed: 5, maxPositionEmbeddings: 1024 });
    const model = join(dir, 'tiny.gguf');
    await convertModel({ source: join(dir, 'hf'), format: 'gguf', weights: 'f16', output: model, threads: 1 });
    // The order's and the person's strings are unbounded and a random model's are long: more
    // tokens each (a string ends by chance).
    const jobs = chosen.map((c) => ({
      gbnf: gbnfOf(c.schema),
      count: c.name === 'order' ? 8 : 10,
      maxTokens: c.name === 'order' ? 1000 : c.name === 'pydantic model' ? 600 : 256,
      temperature: 1.5,
    }));
    generated = (await runLlama({ generate: { model, jobs } })).generated;
  });
  afterAll(() => {
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  test.each(chosen.map((c, i) => [c.name, i] as const))('%s', (_, i) => {
    const c = chosen[i]!;
    const validate = validator({ decimalStep: c.decimalStep }).compile(c.schema);
    const complete = generated[i]!.filter((run) => run.eog);
    expect(complete.length).toBeGreaterThan(0);
    for (const run of complete) {
      const bytes = Buffer.from(run.bytes, 'hex');
      // The answer as the grammar saw it: the tokens' bytes joined, decoded as llama.cpp decodes.
      const text = decodeAsLlamaCpp(bytes);
      // Where that differs from UTF-8, it is llama.cpp reading an overlong sequence as a code point.
      if (text !== bytes.toString('utf8')) expect(OVERLONG.test(bytes.toString('latin1'))).toBe(true);
      let value: unknown;
      try {
        value = JSON.parse(text);
      } catch {
        throw new Error(`generated text that is not JSON: ${text}`);
      }
      if (!validate(value)) throw new Error(`generated ${text}: ${JSON.stringify(validate.errors)}`);
    }
  });
});

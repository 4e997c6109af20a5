/**
 * Fuzzing the readers of untrusted model files (issue 14): a real tiny checkpoint (safetensors,
 * config.json, tokenizer files from `writeTinyModel`, plus the hand-made tokenizer of testdata)
 * and the every-type GGUF golden, mutated at random — byte flips, truncations, a rewritten header
 * length, huge or negative numbers and garbage in the JSON header, structural edits of the
 * tokenizer and config JSON. Every case must end in a result or a typed error (`ConvertError`
 * with a code, `GgufFormatError` for the GGUF reader): never a TypeError, RangeError or other
 * crash, never a hang (each case is timed), and no read outside the file it was given (so a
 * header claiming 2^40 bytes cannot make a reader allocate them).
 *
 * The seed is fixed (20261124) unless `MAGUS_FUZZ_SEED=random`; it is printed, `MAGUS_FUZZ_SEED=<seed>` replays a run, and every
 * failure names its seed and case. `MAGUS_FUZZ_CASES` runs more cases than CI's 400 per reader.
 */
import { randomInt } from 'node:crypto';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { mulberry32, writeTinyModel } from '../workers/dev/tiny-model';
import { loadModelSpec, loadTokenizer } from './convert';
import { isConvertError } from './errors';
import { readGguf } from './gguf-reader';
import { bytesSource, openSafetensors, readTensorF32 } from './safetensors';
import type { ByteSource, CheckpointFiles } from './types';

// A fixed seed by default, so a CI run fails only on a change; MAGUS_FUZZ_SEED=random explores new ground (a campaign).
const SEED = process.env.MAGUS_FUZZ_SEED === 'random' ? randomInt(2 ** 31) : Number(process.env.MAGUS_FUZZ_SEED ?? 20261124);
/** Mutated files per reader and run (`MAGUS_FUZZ_CASES` for a longer run by hand). */
const CASES = Number(process.env.MAGUS_FUZZ_CASES ?? 400);
/**
 * A case slower than this counts as a hang (every real one takes well under 50 ms): 5× the 2 s that
 * would do on a quiet machine, since the integration suites run alongside.
 */
const CASE_BUDGET_MS = 10_000;

// Printed before any case runs, so even a run killed by a hang says how to replay it.
console.log(`readers fuzz: seed ${SEED} (MAGUS_FUZZ_SEED=${SEED} replays it), ${CASES} cases per reader`);

/** A seeded source of mutations. */
class Mutator {
  private readonly next: () => number;
  constructor(seed: number) {
    this.next = mulberry32(seed);
  }
  int(n: number): number {
    return this.next() % Math.max(1, n);
  }
  pick<T>(items: readonly T[]): T {
    return items[this.int(items.length)]!;
  }
  /** Numbers that break sizes and offsets: zero, negative, fractional, past 2^53, absurd. */
  nastyNumber(): number {
    return this.pick([0, -1, 1.5, 2 ** 31, 2 ** 32 + 1, 2 ** 40, 2 ** 53 + 2, 1e308, -1e308, Number.MAX_SAFE_INTEGER, this.int(1 << 20)]);
  }
  /** A JSON value of any kind, some of them large. */
  nastyValue(): unknown {
    switch (this.int(9)) {
      case 0:
        return null;
      case 1:
        return this.nastyNumber();
      case 2:
        return 'x'.repeat(this.int(64));
      case 3:
        return [];
      case 4:
        return {};
      case 5:
        return [this.nastyNumber(), this.nastyNumber()];
      case 6:
        return this.int(2) === 0;
      case 7:
        return Array.from({ length: this.int(8) }, () => this.nastyNumber());
      default:
        return { type: this.pick(['BPE', 'Unigram', 'WordPiece', 'ByteLevel', 'Sequence']), vocab: { a: this.nastyNumber() } };
    }
  }

  /** Raw bytes: flips, truncation, splices of random bytes, a duplicated stretch. */
  bytes(input: Uint8Array, hot: number): Uint8Array {
    const out = Uint8Array.from(input);
    // Most edits land in the first `hot` bytes (headers), where they change what gets parsed.
    const at = () => (this.int(4) === 0 ? this.int(out.length) : this.int(Math.min(hot, out.length)));
    switch (this.int(4)) {
      case 0: {
        for (let i = 0, n = 1 + this.int(8); i < n; i++) {
          const j = at();
          out[j] = out[j]! ^ (1 << this.int(8));
        }
        return out;
      }
      case 1:
        return out.subarray(0, at());
      case 2: {
        const start = at();
        const junk = Uint8Array.from({ length: 1 + this.int(16) }, () => this.int(256));
        return concat(out.subarray(0, start), junk, out.subarray(start + this.int(16)));
      }
      default: {
        const start = at();
        const piece = out.subarray(start, start + 1 + this.int(64));
        return concat(out.subarray(0, start), piece, out.subarray(start));
      }
    }
  }

  /** A JSON document with one node replaced, removed or duplicated (found by walking at random). */
  json(doc: unknown): unknown {
    const root: unknown = structuredClone(doc);
    const edits = 1 + this.int(3);
    for (let e = 0; e < edits; e++) {
      let parent: Record<string, unknown> | unknown[] | undefined;
      let key: string | number | undefined;
      let node: unknown = root;
      for (let depth = 0; depth < 8 && typeof node === 'object' && node !== null && this.int(5) !== 0; depth++) {
        const keys: (string | number)[] = Array.isArray(node) ? node.map((_v, i) => i) : Object.keys(node);
        if (keys.length === 0) break;
        parent = node as Record<string, unknown>;
        key = this.pick(keys);
        node = parent[key];
      }
      if (parent === undefined || key === undefined) continue;
      const p = parent as Record<string | number, unknown>;
      switch (this.int(3)) {
        case 0:
          p[key] = this.nastyValue();
          break;
        case 1:
          if (Array.isArray(parent)) parent.splice(key as number, 1);
          else delete p[key];
          break;
        default:
          // The same node under another key (or at the end of a list): duplicated ids and names.
          if (Array.isArray(parent)) parent.push(structuredClone(node));
          else p[`${String(key)}_`] = structuredClone(node);
      }
    }
    return root;
  }
}

function concat(...parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

/** A byte source that fails the test on any read outside the file (the allocation it would cost). */
function watchedSource(name: string, bytes: Uint8Array, outside: string[]): ByteSource {
  const inner = bytesSource(name, bytes);
  return {
    name,
    size: () => inner.size(),
    read(offset, length, into) {
      if (!(offset >= 0 && length >= 0 && offset + length <= bytes.length)) outside.push(`read(${offset}, ${length}) of a ${bytes.length}-byte file`);
      return inner.read(offset, length, into);
    },
  };
}

interface Outcome {
  ok: number;
  /** Typed errors by code. */
  codes: Map<string, number>;
}

/**
 * Runs `cases` mutated inputs through `run`; each must resolve or throw a typed error within the
 * budget. Returns what happened, for the counts the test also checks.
 */
async function fuzz(
  reader: string,
  isTyped: (err: unknown) => string | undefined,
  makeCase: (m: Mutator, i: number) => () => Promise<unknown>,
): Promise<Outcome> {
  const outcome: Outcome = { ok: 0, codes: new Map() };
  for (let i = 0; i < CASES; i++) {
    // One PRNG per case, from the run's seed and the case number: a case replays on its own.
    const m = new Mutator(SEED ^ Math.imul(i + 1, 0x9e3779b1));
    const where = `${reader}, seed ${SEED}, case ${i}`;
    const started = Date.now();
    try {
      await makeCase(m, i)();
      outcome.ok++;
    } catch (err) {
      const code = isTyped(err);
      if (code === undefined) throw new Error(`${where}: untyped ${(err as Error)?.name}: ${(err as Error)?.message}`, { cause: err });
      outcome.codes.set(code, (outcome.codes.get(code) ?? 0) + 1);
    }
    const ms = Date.now() - started;
    if (ms > CASE_BUDGET_MS) throw new Error(`${where}: took ${ms} ms`);
  }
  return outcome;
}

const convertCode = (err: unknown) => (isConvertError(err) ? err.code : undefined);

let dir: string;
let weights: Uint8Array;
let files: Record<'config' | 'tokenizer' | 'tokenizerConfig' | 'handTokenizer' | 'handTokenizerConfig', unknown>;
let gguf: Uint8Array;
const rssBefore = process.memoryUsage().rss;
let rssPeak = 0;

beforeAll(async () => {
  dir = await mkdtemp(path.join(tmpdir(), 'magus-readers-fuzz-'));
  await writeTinyModel(dir, { dtype: 'F16' });
  weights = await readFile(path.join(dir, 'model.safetensors'));
  const json = async (file: string) => JSON.parse(await readFile(file, 'utf8')) as unknown;
  const testdata = path.join(__dirname, 'testdata');
  files = {
    config: await json(path.join(dir, 'config.json')),
    tokenizer: await json(path.join(dir, 'tokenizer.json')),
    tokenizerConfig: await json(path.join(dir, 'tokenizer_config.json')),
    handTokenizer: await json(path.join(testdata, 'tiny-llama', 'tokenizer.json')),
    handTokenizerConfig: await json(path.join(testdata, 'tiny-llama', 'tokenizer_config.json')),
  };
  gguf = Buffer.from((await readFile(path.join(testdata, 'gguf-every-type.hex'), 'utf8')).replace(/\s+/g, ''), 'hex');
});

afterAll(async () => {
  await rm(dir, { recursive: true, force: true });
});

afterEach(() => {
  rssPeak = Math.max(rssPeak, process.memoryUsage().rss);
});

/** The safetensors header's end: 8 + its declared length. */
const headerEnd = (b: Uint8Array) => 8 + Number(new DataView(b.buffer, b.byteOffset, 8).getBigUint64(0, true));

describe('safetensors', () => {
  it('mutated files open and read in full, or fail with a ConvertError; no read outside the file', async () => {
    const outside: string[] = [];
    const header = new TextDecoder().decode(weights.subarray(8, headerEnd(weights)));
    const data = weights.subarray(headerEnd(weights));
    const outcome = await fuzz('safetensors', convertCode, (m) => {
      let bytes: Uint8Array;
      switch (m.int(4)) {
        case 0:
          bytes = m.bytes(weights, headerEnd(weights));
          break;
        case 1: {
          // The header length alone: a little off, or absurd (2^40, 2^63, 2^64 - 1).
          bytes = Uint8Array.from(weights);
          const view = new DataView(bytes.buffer);
          const was = view.getBigUint64(0, true);
          view.setBigUint64(0, m.pick([was + 1n, was - 1n, 0n, 7n, 2n ** 40n, 2n ** 63n, 2n ** 64n - 1n, BigInt(m.int(weights.length))]), true);
          break;
        }
        case 2: {
          // The header as JSON, edited (numbers past 2^53, negative shapes, …), re-framed correctly.
          const edited = new TextEncoder().encode(JSON.stringify(m.json(JSON.parse(header))));
          const prefix = new Uint8Array(8);
          new DataView(prefix.buffer).setBigUint64(0, BigInt(edited.length), true);
          bytes = concat(prefix, edited, data);
          break;
        }
        default: {
          // Garbage text spliced into the header, the length field kept consistent.
          const text = m.bytes(new TextEncoder().encode(header), header.length);
          const prefix = new Uint8Array(8);
          new DataView(prefix.buffer).setBigUint64(0, BigInt(text.length), true);
          bytes = concat(prefix, text, data);
        }
      }
      return async () => {
        const file = await openSafetensors(watchedSource('model.safetensors', bytes, outside));
        for (const t of file.tensors) for await (const _chunk of readTensorF32(t, { chunkElements: 4096 })) void _chunk;
      };
    });
    expect(outside).toEqual([]);
    // Both ends were reached: some mutations are harmless, most are refused for what they broke.
    expect(outcome.ok).toBeGreaterThan(0);
    expect([...outcome.codes.keys()]).toEqual(expect.arrayContaining(['BadHeader', 'HeaderTooLarge', 'TruncatedFile']));
  });
});

describe('GGUF', () => {
  it('mutated files parse or fail with a GgufFormatError; the header window never reads past the file', async () => {
    const outside: string[] = [];
    const ggufCode = (err: unknown) => ((err as Error)?.name === 'GgufFormatError' ? 'GgufFormatError' : undefined);
    const outcome = await fuzz('gguf', ggufCode, (m) => {
      const bytes = m.bytes(gguf, 1024);
      // Through a byte source (the growing window of ranged reads) and from memory, in turn.
      return m.int(2) === 0 ? () => readGguf(watchedSource('model.gguf', bytes, outside)) : () => readGguf(bytes);
    });
    expect(outside).toEqual([]);
    expect(outcome.ok).toBeGreaterThan(0);
    expect(outcome.codes.get('GgufFormatError')).toBeGreaterThan(0);
  });
});

describe('config.json and the tokenizer files', () => {
  /** A checkpoint in memory with these texts (null: no such file). */
  const checkpoint = (texts: Record<string, string | null>): CheckpointFiles => ({
    location: 'fuzz',
    readText: (name) => Promise.resolve(texts[name] ?? null),
    open: () => Promise.reject(new Error('no weights here')),
  });

  it('mutated files load into a spec and a tokenizer, or fail with a ConvertError', async () => {
    const outcome = await fuzz('tokenizer', convertCode, (m) => {
      const hand = m.int(2) === 0;
      const docs: Record<string, unknown> = {
        'config.json': files.config,
        'tokenizer.json': hand ? files.handTokenizer : files.tokenizer,
        'tokenizer_config.json': hand ? files.handTokenizerConfig : files.tokenizerConfig,
      };
      const target = m.pick(Object.keys(docs));
      const texts: Record<string, string | null> = Object.fromEntries(Object.entries(docs).map(([k, v]) => [k, JSON.stringify(v)]));
      switch (m.int(3)) {
        case 0:
          // As bytes: flips and cuts make most of them invalid JSON (or invalid UTF-8).
          texts[target] = Buffer.from(m.bytes(new TextEncoder().encode(texts[target]!), texts[target]!.length)).toString('utf8');
          break;
        case 1: {
          // A token id (of the vocabulary or an added token) set to a nasty number: the declared sizes of a tokenizer.
          const tokenizer = structuredClone(docs['tokenizer.json']) as { model: { vocab: Record<string, unknown> }; added_tokens: { id: unknown }[] };
          if (m.int(2) === 0) tokenizer.model.vocab[m.pick(Object.keys(tokenizer.model.vocab))] = m.nastyNumber();
          else m.pick(tokenizer.added_tokens).id = m.nastyNumber();
          texts['tokenizer.json'] = JSON.stringify(tokenizer);
          break;
        }
        default:
          texts[target] = JSON.stringify(m.json(docs[target]));
      }
      return async () => {
        const files = checkpoint(texts);
        await loadTokenizer(files, await loadModelSpec(files));
      };
    });
    expect(outcome.ok).toBeGreaterThan(0);
    expect(outcome.codes.size).toBeGreaterThan(1);
  });
});

test('memory stayed bounded over every case', () => {
  // The inputs are a few hundred kB; a reader that believed a declared size would need gigabytes.
  expect(rssPeak - rssBefore).toBeLessThan(512 * 1024 * 1024);
});

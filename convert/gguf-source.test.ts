/**
 * readGgufSource on split GGUFs, laid out as llama.cpp's gguf-split writes them
 * (test/fixtures/split-gguf.ts): the parts are read as one model; a part missing, out of order or
 * from another split is refused with a typed error naming it.
 */
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { splitGguf } from '../test/fixtures/split-gguf';
import { writeTinyModel } from '../workers/dev/tiny-model';
import { convertModel } from './convert';
import { readGguf } from './gguf-reader';
import { readGgufSource } from './gguf-source';
import { bytesSource } from './safetensors';

let root: string;
let whole: string;
let parts: string[];
beforeAll(async () => {
  root = mkdtempSync(join(tmpdir(), 'magus-gguf-source-'));
  await writeTinyModel(join(root, 'tiny'), { seed: 7 });
  whole = join(root, 'Tiny.F16.gguf');
  await convertModel({ source: join(root, 'tiny'), format: 'gguf', weights: 'f16', output: whole, threads: 2 });
  parts = await splitGguf(whole, root, 'Tiny.F16', 3);
});
afterAll(() => rmSync(root, { recursive: true, force: true }));

const source = (name: string) => bytesSource(name, new Uint8Array(readFileSync(join(root, name))));

test('the parts of a split GGUF read as the whole file: architecture, file type, tensors, sizing', async () => {
  expect(parts).toEqual(['Tiny.F16-00001-of-00003.gguf', 'Tiny.F16-00002-of-00003.gguf', 'Tiny.F16-00003-of-00003.gguf']);
  const one = await readGgufSource([bytesSource('Tiny.F16.gguf', new Uint8Array(readFileSync(whole)))]);
  const split = await readGgufSource(parts.map(source));
  expect(split).toEqual(one);
  // Each part is a GGUF of its own with a share of the tensors; only the first carries the model's metadata.
  const headers = await Promise.all(parts.map(async (p) => readGguf(new Uint8Array(readFileSync(join(root, p))))));
  expect(headers.map((h) => h.tensors.length).reduce((a, b) => a + b)).toBe(one.tensors);
  expect(headers.every((h) => h.tensors.length > 0)).toBe(true);
  expect(headers[1]!.metadata.has('general.architecture')).toBe(false);
  expect(headers.map((h) => h.metadata.get('split.no')?.value)).toEqual([0, 1, 2]);
});

test('a part missing, or the parts out of order, is refused naming the part', async () => {
  await expect(readGgufSource([parts[0]!, parts[1]!].map(source))).rejects.toMatchObject({
    code: 'MissingFile',
    message: 'Tiny.F16-00001-of-00003.gguf: a split GGUF of 3 parts, given 2',
  });
  await expect(readGgufSource([parts[0]!, parts[2]!, parts[1]!].map(source))).rejects.toMatchObject({
    code: 'BadIndex',
    message: 'Tiny.F16-00003-of-00003.gguf: is split part 2 (from 0), expected 1',
  });
  await expect(readGgufSource([parts[1]!, parts[0]!, parts[2]!].map(source))).rejects.toMatchObject({
    code: 'BadIndex',
    message: 'Tiny.F16-00002-of-00003.gguf: is split part 1 (from 0), expected 0',
  });
});

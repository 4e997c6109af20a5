import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { main } from './magus';
import { parseTinyArgs } from './model-tiny';

let dir: string;
let out: string[];
beforeEach(() => {
  dir = mkdtempSync(join(tmpdir(), 'magus-tiny-'));
  out = [];
  const keep = (s: string | Uint8Array) => out.push(String(s)) > 0;
  jest.spyOn(process.stdout, 'write').mockImplementation(keep);
  jest.spyOn(process.stderr, 'write').mockImplementation(keep);
});
afterEach(() => {
  jest.restoreAllMocks();
  rmSync(dir, { recursive: true, force: true });
});

test('magus model tiny <dir> writes a Hugging Face model folder, and never into a full one', async () => {
  const model = join(dir, 'tiny');
  expect(await main(['model', 'tiny', model, '--seed', '7'])).toBe(0);
  for (const f of ['config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']) expect(existsSync(join(model, f))).toBe(true);
  expect((JSON.parse(readFileSync(join(model, 'config.json'), 'utf8')) as { architectures: string[] }).architectures).toEqual(['LlamaForCausalLM']);
  expect(out.join('')).toMatch(/gibberish/);
  expect(await main(['model', 'tiny', model])).toBe(1);
  expect(out.join('')).toMatch(/is not empty/);
});

test('its options, and --help names it', async () => {
  expect(parseTinyArgs(['m', '--arch', 'qwen3', '--dtype', 'F32', '--seed', '3']).options).toEqual({ arch: 'qwen3', dtype: 'F32', seed: 3 });
  expect(() => parseTinyArgs(['m', '--arch', 'gpt'])).toThrow(/llama or qwen3/);
  expect(() => parseTinyArgs([])).toThrow(/missing <dir>/);
  expect(await main(['model', '--help'])).toBe(0);
  expect(out.join('')).toMatch(/^usage: magus model pull[\s\S]*usage: magus model tiny <dir>/);
});

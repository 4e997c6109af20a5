import { selectGgufFiles, validateModelSpec, type SourceFile } from './model';

const file = (path: string): SourceFile => ({ path, size: 1000, sha256: 'a'.repeat(64) });
/** A repository of one model's quantizations, as GGUF repositories on the hub look. */
const repo = [
  'README.md',
  'config.json',
  'SmolLM2-135M-Instruct.Q4_K_M.gguf',
  'SmolLM2-135M-Instruct.Q4_K_S.gguf',
  'SmolLM2-135M-Instruct.Q8_0.gguf',
  'SmolLM2-135M-Instruct-f16.gguf',
  'big/Big-Q5_K_M-00001-of-00003.gguf',
  'big/Big-Q5_K_M-00002-of-00003.gguf',
  'big/Big-Q5_K_M-00003-of-00003.gguf',
  'broken/Broken-Q6_K-00001-of-00002.gguf',
].map(file);
const pick = (choice: { file?: string; quantization?: string }) => {
  const r = selectGgufFiles(repo, choice);
  return 'error' in r ? r.error : r.files.map((f) => f.path);
};

describe('choosing a GGUF of a repository', () => {
  test('a glob or a quantization type that matches one file takes it', () => {
    expect(pick({ file: '*Q4_K_M.gguf' })).toEqual(['SmolLM2-135M-Instruct.Q4_K_M.gguf']);
    expect(pick({ quantization: 'Q8_0' })).toEqual(['SmolLM2-135M-Instruct.Q8_0.gguf']);
    expect(pick({ quantization: 'q4_k_m' })).toEqual(['SmolLM2-135M-Instruct.Q4_K_M.gguf']);
    expect(pick({ quantization: 'F16' })).toEqual(['SmolLM2-135M-Instruct-f16.gguf']);
    expect(pick({ file: 'SmolLM2-135M-Instruct.Q4_K_?.gguf' })).toMatch(/matches 2 files, not one: .*Q4_K_M.gguf, .*Q4_K_S.gguf; name one of them/);
  });

  test('a quantization type matches whole words only: Q4_K does not take Q4_K_M', () => {
    expect(pick({ quantization: 'Q4_K' })).toMatch(/quantization Q4_K matches none of the repository's GGUF files: SmolLM2-135M-Instruct.Q4_K_M.gguf, /);
  });

  test('one part of a split GGUF stands for all its parts, in order', () => {
    const all = ['big/Big-Q5_K_M-00001-of-00003.gguf', 'big/Big-Q5_K_M-00002-of-00003.gguf', 'big/Big-Q5_K_M-00003-of-00003.gguf'];
    expect(pick({ quantization: 'Q5_K_M' })).toEqual(all);
    expect(pick({ file: 'big/*-00002-of-00003.gguf' })).toEqual(all);
    expect(pick({ file: 'Big-Q5_K_M-*.gguf' })).toEqual(all);
    expect(pick({ quantization: 'Q6_K' })).toBe(
      'source.gguf: broken/Broken-Q6_K-00001-of-00002.gguf is part of a split GGUF of 2 parts, but part 2 (broken/Broken-Q6_K-00002-of-00002.gguf) is not in the repository',
    );
  });

  test('nothing matching names the GGUF files there are', () => {
    expect(pick({ quantization: 'IQ2_XS' })).toMatch(
      /^source.gguf: quantization IQ2_XS matches none of the repository's GGUF files: SmolLM2-135M-Instruct.Q4_K_M.gguf, .*Big-Q5_K_M-00003-of-00003.gguf/,
    );
    expect(selectGgufFiles([file('config.json'), file('model.safetensors')], { quantization: 'Q4_0' })).toEqual({
      error: 'source.gguf: quantization Q4_0 matches nothing: the repository has no .gguf file',
    });
  });
});

describe('a spec with a GGUF source', () => {
  const spec = (gguf: unknown, artifacts: unknown[] = [{ format: 'gguf', weights: 'source' }]) =>
    validateModelSpec({ source: { repo: 'org/model-GGUF', gguf }, artifacts });

  test('names exactly one of file or quantization', () => {
    expect(spec({ file: '*Q4_K_M.gguf' })).toEqual([]);
    expect(spec({ quantization: 'Q4_K_M' })).toEqual([]);
    expect(spec({})).toEqual(['source.gguf: name exactly one of file (a glob such as "*Q4_K_M.gguf") or quantization (such as "Q4_K_M"), not neither']);
    expect(spec({ file: '*.gguf', quantization: 'Q8_0' })).toEqual([
      'source.gguf: name exactly one of file (a glob such as "*Q4_K_M.gguf") or quantization (such as "Q4_K_M"), not both',
    ]);
    expect(spec({ file: '' })[0]).toMatch(/^source.gguf.file: "" is not a file glob/);
    expect(spec({ file: '*.gguf' })).toEqual(['source.gguf.file: "*.gguf" would match any GGUF; name the file (e.g. "*Q4_K_M.gguf")']);
    expect(spec({ file: '../x.gguf' })[0]).toMatch(/is not a file glob/);
    expect(spec({ quantization: 'Q4 K' })).toEqual(['source.gguf.quantization: "Q4 K" is not a quantization type such as Q4_K_M, Q8_0 or F16']);
    expect(spec({ quantization: 'Q8_0', extra: 1 })).toEqual(['source.gguf: unknown field extra']);
  });

  test('is published as it is: gguf:source, not a re-quantization; source needs a GGUF source', () => {
    expect(spec({ quantization: 'Q8_0' }, [{ format: 'gguf', weights: 'q80' }])[0]).toMatch(/a GGUF source is served as it is published: ask for gguf:source/);
    expect(validateModelSpec({ source: { repo: 'org/model' }, artifacts: [{ format: 'gguf', weights: 'source' }] })[0]).toMatch(
      /gguf:source takes a GGUF source's file as it is; this source has no source.gguf/,
    );
    expect(spec({ quantization: 'Q8_0' }, [{ format: 'dllama', weights: 'source' }])[0]).toMatch(/dllama:source does not exist/);
  });

  test.each(['f16', 'q80'])('dllama:%s is refused before anything is fetched: distributed-llama cannot run it', (weights) => {
    expect(validateModelSpec({ source: { repo: 'org/model' }, artifacts: [{ format: 'dllama', weights }] })).toEqual([
      `artifacts[0]: distributed-llama runs only q40 and f32 weights on a CPU (its matmuls stop at ${weights}): ask for dllama:q40 or dllama:f32`,
    ]);
  });
});

describe('a hub URL', () => {
  const errorsOf = (hubUrl: unknown) => validateModelSpec({ source: { repo: 'org/model', hubUrl }, artifacts: [{ format: 'gguf', weights: 'q40' }] });
  it('is an http(s) URL; one holding a user name or password is refused without being echoed', () => {
    expect(errorsOf('https://hub.example.com/mirror')).toEqual([]);
    expect(errorsOf('ftp://hub.example.com')).toEqual(['source.hubUrl: "ftp://hub.example.com" is not an http(s) URL']);
    for (const url of ['https://user:s3cret@hub.example.com/', 'http://token@hub.example.com']) {
      const errors = errorsOf(url);
      expect(errors).toEqual(['source.hubUrl holds a user name or password: give the hub token as a Secret (tokenSecretRef), never in the URL']);
      expect(errors.join()).not.toContain('s3cret');
    }
  });
});

import { defaultModelName, parsePullArgs } from './model-pull';

test('a repo, revision, formats and token reference become a spec', () => {
  const a = parsePullArgs(['TinyLlama/TinyLlama-1.1B-Chat@v1.0', '--format', 'gguf:q40,dllama:q80', '--hub', 'http://127.0.0.1:9000', '--token-env', 'HF_TOKEN', '--context', '4096']);
  expect(a).toEqual({
    namespace: 'default',
    name: 'tinyllama-1-1b-chat',
    detach: false,
    spec: {
      source: { repo: 'TinyLlama/TinyLlama-1.1B-Chat', revision: 'v1.0', hubUrl: 'http://127.0.0.1:9000', tokenRef: { env: 'HF_TOKEN' } },
      artifacts: [
        { format: 'gguf', weights: 'q40' },
        { format: 'dllama', weights: 'q80' },
      ],
      contextLength: 4096,
    },
  });
});

test.each([
  [['org/model'], /--format is required/],
  [['org/model', '--format', 'gguf:q3'], /weights: "q3"/],
  [['org/model', '--format', 'onnx:q40'], /format: "onnx"/],
  [['not-a-repo', '--format', 'gguf:q40'], /source.repo/],
  [['org/model', '--format', 'gguf:q40', '--token-env', 'A', '--token-file', '/b'], /not both/],
  [['org/model', '--format', 'gguf:q40', '--name', 'Bad_Name'], /DNS label/],
  [['org/model', '--format', 'gguf:q40', '--context', '7'], /contextLength/],
  [['org/model', '--format', 'gguf:q40,gguf:q40'], /listed twice/],
])('rejects %j', (args, why) => {
  expect(() => parsePullArgs(args)).toThrow(why);
});

test('default names are DNS labels', () => {
  expect(defaultModelName('Qwen/Qwen3-0.6B')).toBe('qwen3-0-6b');
  expect(defaultModelName('org/___')).toBe('model');
});

import { createServer, type AddressInfo } from 'node:net';
import type { PipelineProgress } from '../workflows/model/definitions';
import { connectTemporal, defaultHub, defaultModelName, parsePullArgs, pipelineBar, RetryReport } from './model-pull';

test('a repo, revision, formats and token reference become a spec', () => {
  const a = parsePullArgs([
    'TinyLlama/TinyLlama-1.1B-Chat@v1.0',
    '--format',
    'gguf:q40,dllama:f32',
    '--hub',
    'http://127.0.0.1:9000',
    '--token-env',
    'HF_TOKEN',
    '--context',
    '4096',
  ]);
  expect(a).toEqual({
    namespace: 'default',
    name: 'tinyllama-1-1b-chat',
    detach: false,
    spec: {
      source: { repo: 'TinyLlama/TinyLlama-1.1B-Chat', revision: 'v1.0', hubUrl: 'http://127.0.0.1:9000', tokenRef: { env: 'HF_TOKEN' } },
      artifacts: [
        { format: 'gguf', weights: 'q40' },
        { format: 'dllama', weights: 'f32' },
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
  [['org/model-GGUF', '--gguf', '*Q8_0.gguf', '--quantization', 'Q8_0'], /give --gguf or --quantization, not both/],
  [['org/model-GGUF', '--gguf', '*.gguf'], /would match any GGUF; name the file/],
  [['org/model-GGUF', '--quantization', 'Q8_0', '--format', 'gguf:q40'], /a GGUF source is served as it is published: ask for gguf:source/],
  [['org/model', '--format', 'gguf:source'], /this source has no source.gguf/],
])('rejects %j', (args, why) => {
  expect(() => parsePullArgs(args)).toThrow(why);
});

test('a GGUF repository: --gguf or --quantization chooses the file, served as it is', () => {
  expect(parsePullArgs(['org/SmolLM2-GGUF', '--gguf', '*Q4_1.gguf']).spec).toEqual({
    source: { repo: 'org/SmolLM2-GGUF', gguf: { file: '*Q4_1.gguf' } },
    artifacts: [{ format: 'gguf', weights: 'source' }],
  });
  expect(parsePullArgs(['org/SmolLM2-GGUF', '--quantization', 'Q4_1']).spec.source.gguf).toEqual({ quantization: 'Q4_1' });
});

test('default names are DNS labels', () => {
  expect(defaultModelName('Qwen/Qwen3-0.6B')).toBe('qwen3-0-6b');
  expect(defaultModelName('org/___')).toBe('model');
});

test("without --hub, the running dev's demo hub serves its own repos, and only those", () => {
  const dev = { connection: { hub: { url: 'http://127.0.0.1:35000', repos: ['magus-demo/tiny-llama'] } } } as Parameters<typeof parsePullArgs>[1];
  expect(parsePullArgs(['magus-demo/tiny-llama', '--format', 'gguf:q40'], dev).spec.source.hubUrl).toBe('http://127.0.0.1:35000');
  expect(parsePullArgs(['magus-demo/tiny-llama', '--format', 'gguf:q40', '--hub', 'http://h:1'], dev).spec.source.hubUrl).toBe('http://h:1');
  expect(parsePullArgs(['Qwen/Qwen3-0.6B', '--format', 'gguf:q40'], dev).spec.source.hubUrl).toBeUndefined();
  expect(defaultHub('magus-demo/tiny-llama', undefined)).toBeUndefined();
});

test('an unreachable Temporal fails at once, naming the address and where it came from', async () => {
  const port = await new Promise<number>((ok) => {
    const srv = createServer().listen(0, '127.0.0.1', () => {
      const { port } = srv.address() as AddressInfo;
      srv.close(() => ok(port));
    });
  });
  const err = await connectTemporal(`127.0.0.1:${port}`, 'MAGUS_TEMPORAL_ADDRESS').catch((e: Error) => e);
  expect((err as Error).name).toBe('TemporalUnreachable');
  expect((err as Error).message).toBe(
    `cannot reach Temporal at 127.0.0.1:${port} (MAGUS_TEMPORAL_ADDRESS): ECONNREFUSED. Start magus dev, or set MAGUS_TEMPORAL_ADDRESS.`,
  );
});

test('a retried activity is one line per failed attempt, its first line only', async () => {
  const lines: string[] = [];
  const report = new RetryReport((l) => lines.push(l));
  let pending = [
    {
      activityId: '1',
      activityType: { name: 'resolveSource' },
      attempt: 3,
      lastFailure: { message: 'fetch failed: getaddrinfo ENOTFOUND huggingface.co\n    at stack…' },
      nextAttemptScheduleTime: { seconds: Math.round(Date.now() / 1000) + 4 },
    },
  ];
  const handle = { describe: () => Promise.resolve({ raw: { pendingActivities: pending } }) } as unknown as Parameters<RetryReport['check']>[0];
  await report.check(handle);
  await report.check(handle);
  expect(lines).toHaveLength(1);
  expect(lines[0]).toMatch(/^resolveSource failed \(attempt 2\): fetch failed: getaddrinfo ENOTFOUND huggingface\.co; attempt 3 in [3-5] s$/);
  pending = [{ ...pending[0]!, attempt: 4 }];
  await report.check(handle);
  expect(lines).toHaveLength(2);
});

test('converting two artifacts: tensors of the current one, and an overall share that never falls back', () => {
  const requested = parsePullArgs(['org/model', '--format', 'gguf:q40,gguf:q80']).spec.artifacts;
  const at = (artifacts: PipelineProgress['artifacts']) => {
    const tensors = (artifacts ?? []).reduce((t, a) => ({ done: t.done + a.done, total: t.total + a.total }), { done: 0, total: 0 });
    return pipelineBar(
      {
        phase: 'converting',
        generation: 1,
        repo: 'org/model',
        sha: 'abc',
        files: { done: 2, total: 2 },
        bytes: { done: 9, total: 9 },
        tensors,
        etaSeconds: null,
        failure: null,
        artifacts,
      },
      requested,
    )!;
  };
  const steps = [
    at([{ key: 'gguf:q40', done: 45, total: 90 }]),
    at([{ key: 'gguf:q40', done: 90, total: 90 }]),
    at([
      { key: 'gguf:q40', done: 90, total: 90 },
      { key: 'gguf:q80', done: 1, total: 90 },
    ]),
    at([
      { key: 'gguf:q40', done: 90, total: 90 },
      { key: 'gguf:q80', done: 90, total: 90 },
    ]),
  ];
  expect(steps.map((s) => s.fraction)).toEqual([0.25, 0.5, 0.5 + 1 / 180, 1]);
  expect(steps[2]).toMatchObject({ itemsDone: 1, itemsTotal: 90, itemLabel: 'tensors', label: 'gguf:q80 (2/2)' });
  expect(steps.every((s) => s.bytesTotal === undefined)).toBe(true);
  // The first artifact was there already: it counts as done once the second starts.
  expect(at([{ key: 'gguf:q80', done: 45, total: 90 }]).fraction).toBe(0.75);
});

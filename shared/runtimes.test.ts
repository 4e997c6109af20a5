import type { ReadyModel } from './model';
import { modelCapabilities, modelEngines, type RuntimeAdvert } from './runtimes';

const artifact = (format: 'gguf' | 'dllama', weights: string) => ({ format, weights, files: [] }) as unknown as ReadyModel['artifacts'][number];
const model = (artifacts: ReadyModel['artifacts'], nodes: number[] = []): ReadyModel => ({
  namespace: 'default',
  name: 'm',
  source: { repo: 'org/m', revision: 'main', sha: 'a'.repeat(40) },
  artifacts,
  memory: nodes.length ? ([{ format: 'dllama', weights: 'q40', topologies: nodes.map((n) => ({ nodes: n })) }] as unknown as ReadyModel['memory']) : [],
  readyAt: '2025-01-02T03:04:05.000Z',
});
const NOW = 1_000_000;
const local: RuntimeAdvert = { worker: 'w', runtime: 'local', formats: ['gguf'], at: NOW };
const localDllama: RuntimeAdvert = { worker: 'w', runtime: 'local', formats: ['gguf', 'dllama'], dllamaNodes: 2, at: NOW };
const kube: RuntimeAdvert = { worker: 'k', runtime: 'kubernetes', formats: ['gguf', 'dllama'], at: NOW };

describe('the engines a model may run on, and what it can do there', () => {
  test.each([
    ['gguf only, local llama.cpp', model([artifact('gguf', 'q80')]), [local], ['llamacpp'], ['json_schema', 'tools', 'logprobs', 'embeddings', 'completions']],
    [
      'both, local with distributed-llama on 2 nodes, a 2-node split',
      model([artifact('gguf', 'q80'), artifact('dllama', 'q40')], [1, 2]),
      [localDllama],
      ['dllama'],
      [],
    ],
    [
      'both, local with distributed-llama on 2 nodes, no 2-node split',
      model([artifact('gguf', 'q80'), artifact('dllama', 'q40')], [1, 4]),
      [localDllama],
      ['llamacpp'],
      ['json_schema', 'tools', 'logprobs', 'embeddings', 'completions'],
    ],
    ['both, Kubernetes (its Dllama resource decides)', model([artifact('gguf', 'q80'), artifact('dllama', 'q40')], [1]), [kube], ['dllama', 'llamacpp'], []],
    [
      'both, no live advert: what the artifacts allow',
      model([artifact('gguf', 'q80'), artifact('dllama', 'q40')], [1]),
      [{ ...kube, at: 0 }],
      ['dllama', 'llamacpp'],
      [],
    ],
    ['gguf only, Kubernetes', model([artifact('gguf', 'q80')]), [kube], ['llamacpp'], ['json_schema', 'tools', 'logprobs', 'embeddings', 'completions']],
    [
      'both, a local runtime that runs only llama.cpp (MAGUS_ENGINES)',
      model([artifact('gguf', 'q80'), artifact('dllama', 'q40')], [1, 2]),
      [{ ...localDllama, engines: ['llamacpp'] as RuntimeAdvert['engines'] }],
      ['llamacpp'],
      ['json_schema', 'tools', 'logprobs', 'embeddings', 'completions'],
    ],
    ['a hand-made entry without artifacts', model([]), [local], [], ['json_schema', 'tools', 'logprobs', 'embeddings', 'completions']],
  ])('%s', (_what, m, adverts, engines, capabilities) => {
    const got = modelEngines(m, adverts, NOW);
    expect(got).toEqual(engines);
    expect(modelCapabilities(got)).toEqual(capabilities);
  });
});

import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { connect, createServer, type AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Artifact, MemoryPlan, ReadyModel } from '../../shared/model';
import { chooseDllamaArtifact, dllamaApiArgs, dllamaWorkerArgs, listensOn, netTurboFits } from './dllama';

const node = (total: number) => ({ weights: total, kvCache: 0, buffers: 0, total });
const artifact = (weights: Artifact['weights'], files = ['model.m', 'tokenizer.t']): Artifact => ({
  format: 'dllama',
  weights,
  converterVersion: '1',
  files: files.map((f) => ({ key: `artifacts/org/m/sha/dllama-${weights}/1/${f}`, bytes: 10, sha256: `${weights}-${f}` })),
});
const plan = (weights: MemoryPlan['weights'], nodes: number[], contextLength = 512): MemoryPlan => ({
  format: 'dllama',
  weights,
  contextLength,
  topologies: nodes.map((n) => ({ nodes: n, root: node(1000 * n), worker: n > 1 ? node(100 * n) : null })),
});
const model = (artifacts: Artifact[], memory: MemoryPlan[]): ReadyModel => ({
  namespace: 'default',
  name: 'm',
  source: { repo: 'org/m', revision: 'main', sha: 'sha' },
  artifacts,
  memory,
  readyAt: '2026-01-01T00:00:00Z',
});

describe('command lines', () => {
  test('a worker listens on a loopback port', () => {
    expect(dllamaWorkerArgs({ port: 9998, threads: 2 })).toEqual(['worker', '--host', '127.0.0.1', '--port', '9998', '--nthreads', '2']);
  });

  test('the root names every worker, last', () => {
    expect(
      dllamaApiArgs({ port: 9990, model: '/c/a.m', tokenizer: '/c/b.t', buffer: 'q80', threads: 3, maxSeqLen: 2048, workerPorts: [9991, 9992, 9993] }),
    ).toEqual([
      '--host',
      '127.0.0.1',
      '--port',
      '9990',
      '--model',
      '/c/a.m',
      '--tokenizer',
      '/c/b.t',
      '--buffer-float-type',
      'q80',
      '--nthreads',
      '3',
      '--max-seq-len',
      '2048',
      '--workers',
      '127.0.0.1:9991',
      '127.0.0.1:9992',
      '127.0.0.1:9993',
    ]);
  });

  test('net turbo off: --net-turbo 0 for the root and every worker; on when each process has a core', () => {
    expect(dllamaWorkerArgs({ port: 1, threads: 1, netTurbo: false })).toEqual([
      'worker',
      '--host',
      '127.0.0.1',
      '--port',
      '1',
      '--nthreads',
      '1',
      '--net-turbo',
      '0',
    ]);
    expect(dllamaApiArgs({ port: 1, model: 'a', tokenizer: 'b', buffer: 'f32', threads: 1, maxSeqLen: 16, workerPorts: [2], netTurbo: false })).toEqual(
      expect.arrayContaining(['--net-turbo', '0', '--workers', '127.0.0.1:2']),
    );
    expect(netTurboFits(2, 1, 2)).toBe(true);
    expect(netTurboFits(4, 1, 2)).toBe(false);
    expect(netTurboFits(2, 2, 2)).toBe(false);
  });

  test('a single-node root has no --workers', () => {
    expect(dllamaApiArgs({ port: 1, model: 'a', tokenizer: 'b', buffer: 'f32', threads: 1, maxSeqLen: 16, workerPorts: [] })).not.toContain('--workers');
  });
});

describe('chooseDllamaArtifact', () => {
  test('no distributed-llama artifact: null (llama.cpp serves)', () => {
    expect(chooseDllamaArtifact(model([{ ...artifact('q40'), format: 'gguf' }], []), 2)).toBeNull();
  });

  test('the most compact weights that split into the nodes, with the planned context and memory', () => {
    const ready = model([artifact('f32'), artifact('q80'), artifact('q40')], [plan('q40', [1, 2]), plan('q80', [1, 2, 4], 1024), plan('f32', [1, 2, 4])]);
    expect(chooseDllamaArtifact(ready, 2)).toMatchObject({
      artifact: { weights: 'q40' },
      model: { sha256: 'q40-model.m' },
      tokenizer: { sha256: 'q40-tokenizer.t' },
      maxSeqLen: 512,
      memory: { root: 2000, worker: 200 },
    });
    expect(chooseDllamaArtifact(ready, 1)).toMatchObject({ buffer: 'q80', memory: { root: 1000, worker: null } });
    // q80 weights split into 4 nodes, but distributed-llama cannot run them: f32, with f32 buffers.
    expect(chooseDllamaArtifact(ready, 4)).toMatchObject({ artifact: { weights: 'f32' }, buffer: 'f32', memory: { root: 4000, worker: 400 } });
  });

  test('the memory plan says why a node count does not split: the reason is quoted', () => {
    const withReason = {
      ...plan('q40', [1, 2]),
      refused: [{ nodes: 4, reason: 'num_key_value_heads 2 / 4 nodes is not a whole number of KV heads per node' }],
    };
    expect(chooseDllamaArtifact(model([artifact('q40')], [withReason]), 4)).toEqual({
      problem:
        'model default/m has no distributed-llama artifact that runs on 4 nodes (q40: splits into 1, 2 nodes (num_key_value_heads 2 / 4 nodes is not a whole number of KV heads per node))',
    });
  });

  test('weights distributed-llama cannot run on a CPU (f16, q80) are never chosen, and say so', () => {
    expect(chooseDllamaArtifact(model([artifact('q80'), artifact('f16')], [plan('q80', [1]), plan('f16', [1])]), 1)).toEqual({
      problem:
        'model default/m has no distributed-llama artifact that runs on 1 nodes (q80: distributed-llama runs only f32 and q40 weights on a CPU; f16: distributed-llama runs only f32 and q40 weights on a CPU)',
    });
  });

  test('without a memory plan: trusted, with the default context', () => {
    expect(chooseDllamaArtifact(model([artifact('q40')], []), 8)).toMatchObject({ artifact: { weights: 'q40' }, maxSeqLen: 4096 });
  });

  test('no artifact runs on that many nodes: the reason, per artifact', () => {
    const ready = model([artifact('q40'), artifact('f32', ['model.m'])], [plan('q40', [1, 2])]);
    expect(chooseDllamaArtifact(ready, 4)).toEqual({
      problem: 'model default/m has no distributed-llama artifact that runs on 4 nodes (q40: splits into 1, 2 nodes; f32: no .m and .t files)',
    });
  });
});

test('listensOn: only a LISTEN socket of that very process', async () => {
  const server = createServer();
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const { port } = server.address() as AddressInfo;
  try {
    expect(await listensOn(process.pid, port)).toBe(true);
    expect(await listensOn(process.pid, port === 65535 ? 1 : port + 1)).toBe(false);
    const other = spawn('sleep', ['30']);
    try {
      expect(await listensOn(other.pid!, port)).toBe(false);
    } finally {
      other.kill();
    }
  } finally {
    server.close();
  }
});

describe('the distributed-llama stand-in (test/fixtures/fake-dllama.js) refuses what the real programs would', () => {
  // Made while the tests are collected: the table below names its files.
  const bin = mkdtempSync(join(tmpdir(), 'fake-dllama-'));
  for (const name of ['dllama', 'dllama-api']) symlinkSync(join(__dirname, '..', '..', 'test', 'fixtures', 'fake-dllama.js'), join(bin, name));
  writeFileSync(join(bin, 'a.m'), 'm');
  writeFileSync(join(bin, 'a.t'), 't');
  afterAll(() => rmSync(bin, { recursive: true, force: true }));

  const run = (program: string, args: string[]) => spawnSync(join(bin, program), args, { encoding: 'utf8', timeout: 10_000 });
  const api = (...extra: string[]) => ['--host', '127.0.0.1', '--port', '1', '--model', join(bin, 'a.m'), '--tokenizer', join(bin, 'a.t'), ...extra];

  test.each([
    ['dllama-api', 'Unknown option: --weights-float-type', api('--weights-float-type', 'q40')], // in its usage text, not in its parser
    ['dllama-api', '--nthreads needs a value', api('--nthreads')],
    ['dllama-api', 'Invalid value of --nthreads: 0', api('--nthreads', '0')],
    ['dllama-api', 'Invalid value of --buffer-float-type: q8', api('--buffer-float-type', 'q8')],
    ['dllama-api', '--port is given twice', api('--port', '2')],
    ['dllama-api', '--workers needs at least one', api('--workers', '--nthreads', '1')],
    ['dllama-api', 'Invalid worker address: 127.0.0.1', api('--workers', '127.0.0.1')],
    ['dllama-api', '3 nodes: distributed-llama runs on 2^n nodes', api('--workers', '127.0.0.1:2', '127.0.0.1:3')],
    ['dllama-api', 'Invalid value of --host: localhost', ['--host', 'localhost', '--port', '1']],
    ['dllama-api', '--model and --tokenizer are required', ['--port', '1', '--tokenizer', 'x']],
    ['dllama-api', 'cannot read model /nonexistent.m', ['--port', '1', '--model', '/nonexistent.m', '--tokenizer', join(bin, 'a.t')]],
    ['dllama', 'Unsupported mode', ['--port', '1']],
    ['dllama', "plays only 'dllama worker'", ['inference', '--port', '1']],
    ['dllama', 'dllama worker ignores --model', ['worker', '--port', '1', '--model', 'x.m']],
    ['dllama', 'Invalid value of --port: 70000', ['worker', '--port', '70000']],
  ])('%s: %s', (program, message, args) => {
    const r = run(program, args);
    expect(r.status).toBe(1);
    expect(r.stderr).toContain(message);
  });

  test('a worker takes the first connection for its root and dies when it closes early', async () => {
    const probe = createServer();
    await new Promise<void>((r) => probe.listen(0, '127.0.0.1', r));
    const { port } = probe.address() as AddressInfo;
    await new Promise((r) => probe.close(r));
    const worker = spawn(join(bin, 'dllama'), ['worker', '--host', '127.0.0.1', '--port', String(port), '--nthreads', '1'], {
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let err = '';
    worker.stderr.on('data', (d: Buffer) => (err += d.toString()));
    await new Promise<void>((r) => worker.stdout.once('data', () => r()));
    const code = new Promise((r) => worker.once('exit', r));
    connect(port, '127.0.0.1').once('connect', function (this: ReturnType<typeof connect>) {
      this.end();
    });
    expect(await code).toBe(1);
    expect(err).toContain('Socket closed');
  });
});

import { chmodSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, relative } from 'node:path';
import { loadConfig } from './config';

let dir: string;
let api: string;
let worker: string;

beforeAll(() => {
  dir = mkdtempSync(join(tmpdir(), 'magus-config-'));
  api = join(dir, 'dllama-api');
  worker = join(dir, 'dllama');
  for (const f of [api, worker]) {
    writeFileSync(f, '#!/bin/sh\n');
    chmodSync(f, 0o755);
  }
  writeFileSync(join(dir, 'not-executable'), '');
});

afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** The message of the ConfigError `env` raises. */
function problem(env: NodeJS.ProcessEnv): string {
  try {
    loadConfig(env);
  } catch (err) {
    expect((err as Error).name).toBe('ConfigError');
    return (err as Error).message;
  }
  throw new Error('no ConfigError');
}

test('defaults: llama.cpp only', () => {
  const cfg = loadConfig({});
  expect(cfg.dllama).toBeUndefined();
  expect(cfg.nats.servers).toBe('nats://127.0.0.1:4222');
});

test('both binaries enable distributed-llama with 2 nodes and 1 thread by default', () => {
  expect(loadConfig({ MAGUS_DLLAMA_API_BIN: api, MAGUS_DLLAMA_BIN: worker }).dllama).toEqual({ apiBin: api, workerBin: worker, nodes: 2, threads: 1 });
});

test('nodes, threads, relative paths and names found in PATH', () => {
  const cfg = loadConfig({ MAGUS_DLLAMA_API_BIN: 'dllama-api', MAGUS_DLLAMA_BIN: `./${relative(process.cwd(), worker)}`, PATH: `/nonexistent:${dir}`, MAGUS_DLLAMA_NODES: '8', MAGUS_DLLAMA_THREADS: '3' });
  expect(cfg.dllama).toEqual({ apiBin: api, workerBin: worker, nodes: 8, threads: 3 });
  expect(loadConfig({ MAGUS_DLLAMA_API_BIN: api, MAGUS_DLLAMA_BIN: worker, MAGUS_DLLAMA_NODES: '1' }).dllama?.nodes).toBe(1);
});

test.each(['3', '6', '0', '32', '-2', '2.0x', 'two'])('MAGUS_DLLAMA_NODES=%s is not a power of two the runtime can start', (nodes) => {
  expect(problem({ MAGUS_DLLAMA_API_BIN: api, MAGUS_DLLAMA_BIN: worker, MAGUS_DLLAMA_NODES: nodes })).toContain(
    `MAGUS_DLLAMA_NODES=${nodes} must be a power of two from 1 to 16 (the root plus 2^n − 1 workers): one of 1, 2, 4, 8, 16`,
  );
});

test.each([
  [{ MAGUS_DLLAMA_API_BIN: 'x' }, 'distributed-llama needs both MAGUS_DLLAMA_API_BIN (dllama-api) and MAGUS_DLLAMA_BIN (dllama); only MAGUS_DLLAMA_API_BIN is set'],
  [{ MAGUS_DLLAMA_BIN: 'x' }, 'only MAGUS_DLLAMA_BIN is set'],
  [{ MAGUS_DLLAMA_NODES: '4' }, 'MAGUS_DLLAMA_NODES is set, but distributed-llama is off: set MAGUS_DLLAMA_API_BIN and MAGUS_DLLAMA_BIN'],
  [{ MAGUS_DLLAMA_NODES: '4', MAGUS_DLLAMA_THREADS: '2' }, 'MAGUS_DLLAMA_NODES and MAGUS_DLLAMA_THREADS are set, but distributed-llama is off'],
  [{ MAGUS_DLLAMA_THREADS: '0', MAGUS_DLLAMA_API_BIN: '<api>', MAGUS_DLLAMA_BIN: '<worker>' }, 'MAGUS_DLLAMA_THREADS=0 must be 1..256'],
  [{ MAGUS_DLLAMA_THREADS: '1.5', MAGUS_DLLAMA_API_BIN: '<api>', MAGUS_DLLAMA_BIN: '<worker>' }, 'MAGUS_DLLAMA_THREADS=1.5 must be 1..256'],
  [{ MAGUS_DLLAMA_API_BIN: '/nonexistent/dllama-api', MAGUS_DLLAMA_BIN: '<worker>' }, 'MAGUS_DLLAMA_API_BIN=/nonexistent/dllama-api is not an executable file'],
  [{ MAGUS_DLLAMA_API_BIN: '<api>', MAGUS_DLLAMA_BIN: '<dir>/not-executable' }, 'is not an executable file'],
  [{ MAGUS_DLLAMA_API_BIN: '<api>', MAGUS_DLLAMA_BIN: '<dir>' }, 'is not an executable file'],
  [{ MAGUS_DLLAMA_API_BIN: '<api>', MAGUS_DLLAMA_BIN: 'dllama', PATH: '/nonexistent' }, 'MAGUS_DLLAMA_BIN=dllama is not an executable file in PATH'],
])('%j is refused', (vars, message) => {
  const env = Object.fromEntries(Object.entries(vars).map(([k, v]) => [k, v.replace('<api>', api).replace('<worker>', worker).replace('<dir>', dir)]));
  expect(problem(env)).toContain(message);
});

test('every problem is reported at once, each naming its variable', () => {
  const message = problem({ MAGUS_DLLAMA_API_BIN: '/nonexistent/a', MAGUS_DLLAMA_BIN: '/nonexistent/b', MAGUS_DLLAMA_NODES: '3', MAGUS_DLLAMA_THREADS: '0', MAGUS_S3_BUCKET: 'X' });
  for (const name of ['MAGUS_S3_BUCKET', 'MAGUS_DLLAMA_NODES', 'MAGUS_DLLAMA_THREADS', 'MAGUS_DLLAMA_API_BIN', 'MAGUS_DLLAMA_BIN']) expect(message).toContain(`${name}=`);
});

import { spawnSync } from 'node:child_process';
import { chmodSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { homedir, tmpdir } from 'node:os';
import { join, relative } from 'node:path';
import { dataPlaneEnv, devDataDir, loadConfig, readDevConnection, useDevConnection, type MagusConfig } from './config';
import { natsServerList } from '../platform/config';
import { settingsOf } from '../activities/runtime';
import { kubernetes } from '../activities/runtime/kubernetes-entry';
import { local, localEngines } from '../activities/runtime/local-entry';

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

/** The settings the runtimes' entries read (activities/runtime/index.ts). */
const dllamaOf = (cfg: MagusConfig) => settingsOf(cfg.runtime, local)?.dllama;
const kubernetesOf = (cfg: MagusConfig) => settingsOf(cfg.runtime, kubernetes);

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
  expect(dllamaOf(cfg)).toBeUndefined();
  expect(cfg.nats.servers).toBe('nats://127.0.0.1:4222');
});

describe('MAGUS_ENGINES: the engines the local runtime runs, in the order it tries them', () => {
  const localOf = (cfg: MagusConfig) => settingsOf(cfg.runtime, local)!;
  const withDllama = () => ({ MAGUS_DLLAMA_API_BIN: api, MAGUS_DLLAMA_BIN: worker });

  test('unset: every engine it can run, distributed ones first; the advert says the same', () => {
    expect(localEngines(localOf(loadConfig({})))).toEqual(['llamacpp']);
    expect(localEngines(localOf(loadConfig(withDllama())))).toEqual(['dllama', 'llamacpp']);
    expect(local.advert(localOf(loadConfig(withDllama())))).toEqual({ formats: ['dllama', 'gguf'], engines: ['dllama', 'llamacpp'], dllamaNodes: 2 });
    expect(local.advert(localOf(loadConfig({})))).toEqual({ formats: ['gguf'], engines: ['llamacpp'] });
  });

  test('a list: only those, in that order', () => {
    expect(localEngines(localOf(loadConfig({ ...withDllama(), MAGUS_ENGINES: 'llamacpp, dllama' })))).toEqual(['llamacpp', 'dllama']);
    // distributed-llama configured but not chosen: not advertised either.
    expect(local.advert(localOf(loadConfig({ ...withDllama(), MAGUS_ENGINES: 'llamacpp' })))).toEqual({ formats: ['gguf'], engines: ['llamacpp'] });
  });

  test('an unknown kind, or a distributed engine without its binaries, is refused naming it', () => {
    expect(problem({ MAGUS_ENGINES: 'llamacpp,vllm' })).toContain('MAGUS_ENGINES=llamacpp,vllm: vllm is not an engine; the engines are llamacpp, dllama');
    expect(problem({ MAGUS_ENGINES: 'dllama' })).toContain(
      "MAGUS_ENGINES lists dllama, which needs distributed-llama's binaries: set MAGUS_DLLAMA_API_BIN and MAGUS_DLLAMA_BIN",
    );
  });
});

test('MAGUS_ENGINE_STANDBY: an engine on standby beside each, auto unless said (warm, mapped) or 0; anything else is refused', () => {
  const standby = (value?: string) => settingsOf(loadConfig(value === undefined ? {} : { MAGUS_ENGINE_STANDBY: value }).runtime, local)!.standby;
  expect([undefined, '', '1', 'auto'].map(standby)).toEqual([undefined, undefined, undefined, undefined]);
  expect(['warm', 'mapped', '0'].map(standby)).toEqual(['warm', 'mapped', 'none']);
  expect(problem({ MAGUS_ENGINE_STANDBY: 'yes' })).toContain('MAGUS_ENGINE_STANDBY=yes must be auto or 1');
});

test('both binaries enable distributed-llama with 2 nodes and 1 thread by default', () => {
  expect(dllamaOf(loadConfig({ MAGUS_DLLAMA_API_BIN: api, MAGUS_DLLAMA_BIN: worker }))).toEqual({ apiBin: api, workerBin: worker, nodes: 2, threads: 1 });
});

test('nodes, threads, relative paths and names found in PATH', () => {
  const cfg = loadConfig({
    MAGUS_DLLAMA_API_BIN: 'dllama-api',
    MAGUS_DLLAMA_BIN: `./${relative(process.cwd(), worker)}`,
    PATH: `/nonexistent:${dir}`,
    MAGUS_DLLAMA_NODES: '8',
    MAGUS_DLLAMA_THREADS: '3',
  });
  expect(dllamaOf(cfg)).toEqual({ apiBin: api, workerBin: worker, nodes: 8, threads: 3 });
  expect(dllamaOf(loadConfig({ MAGUS_DLLAMA_API_BIN: api, MAGUS_DLLAMA_BIN: worker, MAGUS_DLLAMA_NODES: '1' }))?.nodes).toBe(1);
});

test.each(['3', '6', '0', '32', '-2', '2.0x', 'two'])('MAGUS_DLLAMA_NODES=%s is not a power of two the runtime can start', (nodes) => {
  expect(problem({ MAGUS_DLLAMA_API_BIN: api, MAGUS_DLLAMA_BIN: worker, MAGUS_DLLAMA_NODES: nodes })).toContain(
    `MAGUS_DLLAMA_NODES=${nodes} must be a power of two from 1 to 16 (the root plus 2^n − 1 workers): one of 1, 2, 4, 8, 16`,
  );
});

test.each([
  [
    { MAGUS_DLLAMA_API_BIN: 'x' },
    'distributed-llama needs both MAGUS_DLLAMA_API_BIN (dllama-api) and MAGUS_DLLAMA_BIN (dllama); only MAGUS_DLLAMA_API_BIN is set',
  ],
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
  const message = problem({
    MAGUS_DLLAMA_API_BIN: '/nonexistent/a',
    MAGUS_DLLAMA_BIN: '/nonexistent/b',
    MAGUS_DLLAMA_NODES: '3',
    MAGUS_DLLAMA_THREADS: '0',
    MAGUS_S3_BUCKET: 'X',
  });
  for (const name of ['MAGUS_S3_BUCKET', 'MAGUS_DLLAMA_NODES', 'MAGUS_DLLAMA_THREADS', 'MAGUS_DLLAMA_API_BIN', 'MAGUS_DLLAMA_BIN'])
    expect(message).toContain(`${name}=`);
});

test('the response stream is sized from MAGUS_RESPONSES_PEAK_BYTES_PER_SEC and MAGUS_RESPONSES_RETENTION_MS', () => {
  expect(loadConfig({}).responses).toEqual({});
  expect(loadConfig({ MAGUS_RESPONSES_PEAK_BYTES_PER_SEC: '2097152', MAGUS_RESPONSES_RETENTION_MS: '900000' }).responses).toEqual({
    responsePeakBytesPerSec: 2_097_152,
    responseRetentionMs: 900_000,
  });
  expect(problem({ MAGUS_RESPONSES_PEAK_BYTES_PER_SEC: '1M' })).toMatch(/MAGUS_RESPONSES_PEAK_BYTES_PER_SEC=1M must be a byte rate/);
  expect(problem({ MAGUS_RESPONSES_RETENTION_MS: '5' })).toMatch(/MAGUS_RESPONSES_RETENTION_MS=5 must be milliseconds/);
});

test('a NATS cluster: every URL of MAGUS_NATS_URL, MAGUS_NATS_REPLICAS, and both handed to instance bridges', () => {
  const cfg = loadConfig({ MAGUS_NATS_URL: 'nats://a:4222, nats://b:4222,nats://c:4222', MAGUS_NATS_REPLICAS: '3', MAGUS_RESPONSES_RETENTION_MS: '600000' });
  expect(natsServerList(cfg.nats.servers)).toEqual(['nats://a:4222', 'nats://b:4222', 'nats://c:4222']);
  expect(cfg.natsReplicas).toBe(3);
  expect(dataPlaneEnv(cfg)).toEqual({ MAGUS_NATS_REPLICAS: '3', MAGUS_RESPONSES_RETENTION_MS: '600000' });
  expect(loadConfig({}).natsReplicas).toBeUndefined();
  for (const bad of ['0', '6', '2.5', 'three'])
    expect(() => loadConfig({ MAGUS_NATS_REPLICAS: bad })).toThrow(`MAGUS_NATS_REPLICAS=${bad} must be an integer from 1 to 5`);
  expect(() => loadConfig({ MAGUS_NATS_URL: 'nats://a:4222,,http://b' })).toThrow(/MAGUS_NATS_URL=.* is not a list of nats:\/\/ URLs/);
});

test('MAGUS_RUNTIME=kubernetes: the images are required, the rest has defaults; K8S variables without it are refused', () => {
  const cfg = loadConfig({
    MAGUS_RUNTIME: 'kubernetes',
    MAGUS_K8S_MAGUS_IMAGE: 'magus:1',
    MAGUS_K8S_DLLAMA_IMAGE: 'magus-dllama:1',
    MAGUS_NATS_URL: 'nats://nats:4222',
    MAGUS_K8S_S3_SECRET: 's3',
  });
  expect(kubernetesOf(cfg)).toEqual({
    images: { magus: 'magus:1', dllama: 'magus-dllama:1' },
    natsUrl: 'nats://nats:4222',
    s3Secret: 's3',
    defaultNodes: 1,
    unschedulableAfterMs: 30000,
  });
  expect(() => loadConfig({ MAGUS_RUNTIME: 'kubernetes' })).toThrow(/MAGUS_K8S_MAGUS_IMAGE is required[\s\S]*MAGUS_K8S_DLLAMA_IMAGE is required/);
  expect(() => loadConfig({ MAGUS_RUNTIME: 'pods' })).toThrow(/MAGUS_RUNTIME=pods must be local or kubernetes/);
  expect(() => loadConfig({ MAGUS_K8S_NODES: '2' })).toThrow(/MAGUS_K8S_NODES set, but MAGUS_RUNTIME is not kubernetes/);
  expect(kubernetesOf(loadConfig({}))).toBeUndefined();
});

test('MAGUS_K8S_NAMESPACES: the only namespaces of instances (a namespaced install), each a namespace name', () => {
  const base = { MAGUS_RUNTIME: 'kubernetes', MAGUS_K8S_MAGUS_IMAGE: 'magus:1', MAGUS_K8S_DLLAMA_IMAGE: 'magus-dllama:1' };
  expect(kubernetesOf(loadConfig({ ...base, MAGUS_K8S_NAMESPACES: 'team-a, team-b,team-a' }))?.namespaces).toEqual(['team-a', 'team-b']);
  expect(kubernetesOf(loadConfig(base))?.namespaces).toBeUndefined();
  expect(() => loadConfig({ ...base, MAGUS_K8S_NAMESPACES: 'team-a,Team_B' })).toThrow('MAGUS_K8S_NAMESPACES: "Team_B" is not a namespace name');
});

test('MAGUS_WORKER_QUEUES picks the queues a worker polls', () => {
  expect(loadConfig({}).queues).toBeUndefined();
  expect(loadConfig({ MAGUS_WORKER_QUEUES: 'pipeline' }).queues).toBe('pipeline');
  expect(() => loadConfig({ MAGUS_WORKER_QUEUES: 'both' })).toThrow(/MAGUS_WORKER_QUEUES=both must be all, control or pipeline/);
});

test('MAGUS_WORKFLOW_CACHE sizes the control worker’s workflow cache', () => {
  expect(loadConfig({}).workflowCache).toBe(256);
  expect(loadConfig({ MAGUS_WORKFLOW_CACHE: '2000' }).workflowCache).toBe(2000);
  expect(() => loadConfig({ MAGUS_WORKFLOW_CACHE: '1' })).toThrow(/MAGUS_WORKFLOW_CACHE=1 must be an integer from 2 to 100000/);
  expect(() => loadConfig({ MAGUS_WORKFLOW_CACHE: 'lots' })).toThrow(/MAGUS_WORKFLOW_CACHE=lots must be/);
});

describe("a running magus dev's connection settings", () => {
  let home: string;
  const connection = () => ({
    pid: process.pid,
    dataDir: join(home, 'magus', 'dev'),
    temporal: { address: '127.0.0.1:17233', namespace: 'default', uiUrl: 'http://127.0.0.1:18233' },
    taskQueue: 'magus-control',
    nats: { servers: 'nats://127.0.0.1:14222' },
    s3: { endpoint: 'http://127.0.0.1:19000', region: 'us-east-1', bucket: 'magus', accessKeyId: 'AK', secretAccessKey: 'SK' },
    gateway: { url: 'http://127.0.0.1:8080', tokenFile: '/x/api-token' },
  });
  const write = (c: object) => {
    mkdirSync(join(home, 'magus', 'dev'), { recursive: true });
    writeFileSync(join(home, 'magus', 'dev', 'connection.json'), JSON.stringify(c));
  };
  beforeEach(() => {
    home = mkdtempSync(join(tmpdir(), 'magus-xdg-'));
  });
  afterEach(() => rmSync(home, { recursive: true, force: true }));

  test('the data folder: MAGUS_DEV_DATA_DIR, else $XDG_DATA_HOME/magus/dev, else ~/.local/share/magus/dev', () => {
    expect(devDataDir({ MAGUS_DEV_DATA_DIR: '/a/b', XDG_DATA_HOME: '/x' })).toBe('/a/b');
    expect(devDataDir({ XDG_DATA_HOME: '/x' })).toBe('/x/magus/dev');
    expect(devDataDir({ XDG_DATA_HOME: 'relative' })).toBe(join(homedir(), '.local', 'share', 'magus', 'dev'));
    expect(devDataDir({})).toBe(join(homedir(), '.local', 'share', 'magus', 'dev'));
  });

  test('fills in what the environment leaves unset, each server whole; names what it took, never a value', () => {
    write(connection());
    const env: NodeJS.ProcessEnv = { XDG_DATA_HOME: home, MAGUS_NATS_URL: 'nats://elsewhere:4222' };
    const used = useDevConnection(env);
    expect(used?.taken).toEqual([
      'MAGUS_TEMPORAL_ADDRESS',
      'MAGUS_TEMPORAL_NAMESPACE',
      'MAGUS_TASK_QUEUE',
      'MAGUS_S3_ENDPOINT',
      'MAGUS_S3_BUCKET',
      'MAGUS_S3_REGION',
      'AWS_ACCESS_KEY_ID',
      'AWS_SECRET_ACCESS_KEY',
    ]);
    expect(loadConfig(env)).toMatchObject({
      temporal: { address: '127.0.0.1:17233' },
      nats: { servers: 'nats://elsewhere:4222' },
      s3: { endpoint: 'http://127.0.0.1:19000' },
    });
    expect([env.AWS_ACCESS_KEY_ID, env.AWS_SECRET_ACCESS_KEY]).toEqual(['AK', 'SK']);
    // An S3 endpoint of one's own keeps one's own keys (or none) with it.
    const own: NodeJS.ProcessEnv = { XDG_DATA_HOME: home, MAGUS_S3_ENDPOINT: 'http://s3.example:9000' };
    expect(useDevConnection(own)?.taken).not.toContain('AWS_ACCESS_KEY_ID');
  });

  test('its NATS has a user per role: a command beside it connects as its own role, unless it names credentials of its own', () => {
    write({ ...connection(), nats: { servers: 'nats://127.0.0.1:14222', credentialsDir: '/dev-data/nats-auth' } });
    const worker: NodeJS.ProcessEnv = { XDG_DATA_HOME: home };
    expect(useDevConnection(worker)?.taken).toContain('MAGUS_NATS_CREDENTIALS');
    expect(worker.MAGUS_NATS_CREDENTIALS).toBe('/dev-data/nats-auth/worker.creds');
    const gateway: NodeJS.ProcessEnv = { XDG_DATA_HOME: home };
    useDevConnection(gateway, 'gateway');
    expect(gateway.MAGUS_NATS_CREDENTIALS).toBe('/dev-data/nats-auth/gateway.creds');
    const own: NodeJS.ProcessEnv = { XDG_DATA_HOME: home, MAGUS_NATS_CREDENTIALS: '/mine.creds' };
    useDevConnection(own, 'controller');
    expect(own.MAGUS_NATS_CREDENTIALS).toBe('/mine.creds');
    // Its NATS, not another: another server's credentials are not taken from it.
    const elsewhere: NodeJS.ProcessEnv = { XDG_DATA_HOME: home, MAGUS_NATS_URL: 'nats://elsewhere:4222' };
    useDevConnection(elsewhere);
    expect(elsewhere.MAGUS_NATS_CREDENTIALS).toBeUndefined();
  });

  test("a worker beside it may fetch from its demo hub and that hub's CDN, and from nothing else inside", () => {
    write({ ...connection(), hub: { url: 'http://127.0.0.1:35000', cdnUrl: 'http://127.0.0.2:35001', repos: ['magus-demo/tiny-llama'] } });
    const env: NodeJS.ProcessEnv = { XDG_DATA_HOME: home };
    expect(useDevConnection(env)?.taken).toContain('MAGUS_HUB_ALLOW_NETWORKS');
    expect(loadConfig(env).hubAllowNetworks).toEqual(['127.0.0.1', '127.0.0.2']);
    // One's own setting stands.
    const own: NodeJS.ProcessEnv = { XDG_DATA_HOME: home, MAGUS_HUB_ALLOW_NETWORKS: '10.0.0.0/8' };
    expect(useDevConnection(own)?.taken).not.toContain('MAGUS_HUB_ALLOW_NETWORKS');
    expect(loadConfig(own).hubAllowNetworks).toEqual(['10.0.0.0/8']);
  });

  test('a file left by a dev that no longer runs is ignored, and said to be stale', () => {
    const gone = spawnSync(process.execPath, ['-e', 'process.stdout.write(String(process.pid))'], { encoding: 'utf8' });
    write({ ...connection(), pid: Number(gone.stdout) });
    const env: NodeJS.ProcessEnv = { XDG_DATA_HOME: home };
    expect(useDevConnection(env)).toBeUndefined();
    expect(env.MAGUS_TEMPORAL_ADDRESS).toBeUndefined();
    expect(readDevConnection(env)).toEqual({ file: join(home, 'magus', 'dev', 'connection.json'), stalePid: Number(gone.stdout) });
    expect(readDevConnection({ XDG_DATA_HOME: join(home, 'none') })).toEqual({ file: join(home, 'none', 'magus', 'dev', 'connection.json') });
  });
});

test("MAGUS_HUB_ALLOW_NETWORKS: CIDRs and kind keywords a Model's hub may be at; unset, none", () => {
  expect(loadConfig({}).hubAllowNetworks).toBeUndefined();
  expect(loadConfig({ MAGUS_HUB_ALLOW_NETWORKS: ' ' }).hubAllowNetworks).toBeUndefined();
  expect(loadConfig({ MAGUS_HUB_ALLOW_NETWORKS: '10.20.0.0/16, fd00:1::/64,Private,192.168.1.5' }).hubAllowNetworks).toEqual([
    '10.20.0.0/16',
    'fd00:1::/64',
    'private',
    '192.168.1.5',
  ]);
  expect(problem({ MAGUS_HUB_ALLOW_NETWORKS: '10.0.0.0/8,intranet,10.0.0.0/40' })).toMatch(
    /MAGUS_HUB_ALLOW_NETWORKS: "intranet" is neither a CIDR[^\n]*\n {2}MAGUS_HUB_ALLOW_NETWORKS: "10.0.0.0\/40" is neither a CIDR/,
  );
});

test('MAGUS_INSTANCE_MEMORY is the memory budget that sizes engine slots (bytes or a quantity)', () => {
  expect(loadConfig({}).instanceMemory).toBeUndefined();
  expect(loadConfig({ MAGUS_INSTANCE_MEMORY: '12Gi' }).instanceMemory).toBe(12 * 2 ** 30);
  expect(loadConfig({ MAGUS_INSTANCE_MEMORY: '2000000000' }).instanceMemory).toBe(2e9);
  expect(() => loadConfig({ MAGUS_INSTANCE_MEMORY: 'lots' })).toThrow(/MAGUS_INSTANCE_MEMORY=lots must be bytes or a quantity such as 8Gi/);
  expect(() => loadConfig({ MAGUS_INSTANCE_MEMORY: '1Ki' })).toThrow(/MAGUS_INSTANCE_MEMORY=1Ki must be/);
});

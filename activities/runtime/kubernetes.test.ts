/** The Kubernetes runtime's pure parts: quantities, object names, and `magus fetch`'s arguments. */
import { parseFetchArgs } from '../../workers/fetch';
import { DEFAULT_DRAIN_SECONDS, parseMemory } from '../../shared/kube';
import { DEFAULT_PORTS, DRAIN_MARGIN_SECONDS, instanceBase, instanceManifests, type InstancePlan } from './kubernetes-manifests';
import type { ReadyModel } from '../../shared/model';
import { engineArgs, llamaCppLauncher } from './llama-cpp';

test('memory quantities', () => {
  expect(parseMemory('8Gi')).toBe(8 * 2 ** 30);
  expect(parseMemory('512Mi')).toBe(512 * 2 ** 20);
  expect(parseMemory('1G')).toBe(1e9);
  expect(parseMemory('1048576')).toBe(1048576);
  expect(parseMemory('1e9')).toBe(1e9);
  expect(parseMemory('12345Ki')).toBe(12345 * 1024);
  expect(parseMemory('lots')).toBeNaN();
});

test('object names stay DNS labels with room for pod suffixes, distinct for distinct instances', () => {
  expect(instanceBase('tiny-3')).toBe('mg-tiny-3');
  const long = instanceBase(`${'a'.repeat(60)}-1`);
  const other = instanceBase(`${'a'.repeat(60)}-2`);
  expect(long.length).toBeLessThanOrEqual(40);
  expect(long).toMatch(/^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/);
  expect(long).not.toBe(other);
});

test('magus fetch arguments: each file with its sha256, a plain link name; problems named', () => {
  const sha = 'a'.repeat(64);
  expect(parseFetchArgs(['--dir', '/models', '--file', `k/m.gguf=${sha}=model.gguf`])).toEqual({
    dir: '/models',
    files: [{ key: 'k/m.gguf', sha256: sha, name: 'model.gguf' }],
  });
  expect(parseFetchArgs(['--dir', '/models', '--file', `k/m.t=${sha}`])).toEqual({ dir: '/models', files: [{ key: 'k/m.t', sha256: sha }] });
  expect(parseFetchArgs(['--file', `k=${sha}`])).toBe('--dir is required');
  expect(parseFetchArgs(['--dir', '/m'])).toBe('at least one --file is required');
  expect(parseFetchArgs(['--dir', '/m', '--file', 'k=nothex'])).toMatch(/hex sha256/);
  expect(parseFetchArgs(['--dir', '/m', '--file', `k=${sha}=../x`])).toMatch(/plain file name/);
  expect(parseFetchArgs(['--dir', '/m', '--bogus', 'x'])).toBe('unknown option --bogus');
});

test('the engine command line carries the sized context only when one was sized', () => {
  const base = { model: '/m.gguf', modelId: 'm', port: 8080, slots: 6, threads: 2 };
  expect(engineArgs(base)).toEqual(['--model', '/m.gguf', '--model-id', 'm', '--port', '8080', '--json', '--slots', '6', '--threads', '2']);
  expect(engineArgs({ ...base, ctx: 2048 }).slice(-2)).toEqual(['--ctx', '2048']);
});

test("a Dllama's resumeSlots reach llama.cpp's command line and its pod's memory", () => {
  const ready = {
    namespace: 'ns',
    name: 'm',
    artifacts: [{ format: 'gguf', weights: 'q40', files: [{ key: 'k/m.gguf', bytes: 100 * 2 ** 20, sha256: 'a'.repeat(64) }] }],
    memory: [
      {
        format: 'gguf',
        weights: 'q40',
        contextLength: 8192,
        topologies: [{ nodes: 1, root: { weights: 100 * 2 ** 20, kvCache: 64 * 2 ** 20, buffers: 20 * 2 ** 20, total: 184 * 2 ** 20 } }],
      },
    ],
  } as unknown as ReadyModel;
  const planFor = (resumeSlots: number | undefined) =>
    llamaCppLauncher.kubernetes!.plan({ ready, nodes: 1, fixedSlots: 4, resumeSlots, instanceMemory: 8 * 2 ** 30 });
  const kvPerSlot = 32 * 2 ** 20;
  expect(planFor(undefined)).toMatchObject({ slots: 4, memory: { root: 120 * 2 ** 20 + 5 * kvPerSlot } });
  expect(planFor(undefined).resumeSlots).toBeUndefined();
  const two = planFor(2);
  expect(two).toMatchObject({ slots: 4, resumeSlots: 2, memory: { root: 120 * 2 ** 20 + 6 * kvPerSlot } });
  const containers = llamaCppLauncher.kubernetes!.containers(
    { ...two, threads: 1, model: 'm', images: { magus: 'magus', dllama: 'dllama' } } as unknown as Parameters<
      NonNullable<typeof llamaCppLauncher.kubernetes>['containers']
    >[0],
    DEFAULT_PORTS,
    (name) => `/models/${name}`,
    [],
  );
  expect(containers.engine.args.slice(-4)).toEqual(['--resume-slots', '2', '--snapshots', '/tmp/magus-kv']);
});

test("an instance's pods drain: the engine's preStop waits for the bridge's /drained, within a grace of the drain timeout plus a margin", () => {
  const plan: InstancePlan = {
    namespace: 'ns',
    pool: 'm',
    instance: 'm-1-0a1b2c3d',
    model: 'm',
    revision: '0123456789abcdef',
    owner: { apiVersion: 'v1', kind: 'ConfigMap', name: 'o', uid: 'u' },
    engine: 'dllama',
    containers: { engine: { name: 'engine', image: 'e', args: [] }, worker: { name: 'worker', image: 'e', args: [] } },
    nodes: 2,
    files: [],
    maxSeqLen: 256,
    threads: 1,
    slots: 1,
    memory: { root: 2 ** 30, worker: 2 ** 30 },
    images: { magus: 'magus', dllama: 'dllama' },
    nats: { url: 'nats://n:4222', prefix: '' },
    s3: { region: 'r', bucket: 'b' },
    startupSeconds: 60,
    drainSeconds: 90,
  };
  const objects = instanceManifests(plan);
  const sets = objects.filter((o) => o.kind === 'StatefulSet') as unknown as { spec: { template: { spec: Record<string, unknown> } } }[];
  expect(sets).toHaveLength(2); // workers and root
  for (const s of sets) expect(s.spec.template.spec.terminationGracePeriodSeconds).toBe(90 + DRAIN_MARGIN_SECONDS);
  const root = sets[1]!.spec.template.spec.containers as { name: string; args?: string[]; lifecycle?: unknown }[];
  expect(root[0]!.lifecycle).toEqual({ preStop: { httpGet: { path: '/drained', port: DEFAULT_PORTS.bridgeHealth } } });
  const bridge = root.find((c) => c.name === 'bridge')!;
  expect(bridge.args!.slice(bridge.args!.indexOf('--drain-timeout-ms'), bridge.args!.indexOf('--drain-timeout-ms') + 2)).toEqual([
    '--drain-timeout-ms',
    '90000',
  ]);
  expect((objects[0] as { data?: Record<string, string> }).data?.revision).toBe('0123456789abcdef');
  // Without a drain timeout: the Dllama's default.
  const plain = instanceManifests({ ...plan, drainSeconds: undefined }).filter((o) => o.kind === 'StatefulSet') as unknown as typeof sets;
  expect(plain[1]!.spec.template.spec.terminationGracePeriodSeconds).toBe(DEFAULT_DRAIN_SECONDS + DRAIN_MARGIN_SECONDS);
});

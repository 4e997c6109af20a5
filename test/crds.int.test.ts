/**
 * The CRDs in crds/ against the real kube-apiserver: every schema constraint and CEL rule is
 * exercised with an object it must refuse (HTTP 422, with that rule's own message) next to
 * objects it must accept, and full specs and statuses typed by shared/kube.ts must survive a
 * round trip unpruned (what the schema leaves out, the apiserver silently drops).
 */
import { execFile } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { ApiextensionsV1Api, CoreV1Api, CustomObjectsApi, loadAllYaml, PatchStrategy, setHeaderOptions } from '@kubernetes/client-node';
import { ObjectSerializer } from '@kubernetes/client-node/dist/serializer.js';
import { CRD_FIELD_MANAGER, CRD_FILES, crdsDir, installCrds, loadCrdManifests, loadRawCrdManifests } from '../kube/crds';
import {
  Kind,
  Plural,
  type ApiKeyResourceSpec,
  type ApiKeyResourceStatus,
  type DllamaResourceSpec,
  type DllamaResourceStatus,
  type ModelResourceSpec,
  type ModelResourceStatus,
  type SessionResourceStatus,
} from '../shared/kube';
import { declareDemoDllama, withdrawDemoDllama } from '../workers/dev/dllama-demo';
import { endpoint, isolation } from './harness';
import { kubeConfig } from './harness/kube';

const execFileP = promisify(execFile);
const iso = isolation();
const ns = iso.namespace;
const group = 'magus.dev';
const version = 'v1alpha1';
const apiVersion = `${group}/${version}`;

const kc = kubeConfig();
const custom = kc.makeApiClient(CustomObjectsApi);
const mergePatch = setHeaderOptions('Content-Type', PatchStrategy.MergePatch);

type Obj = { apiVersion: string; kind: string; metadata: { name: string; resourceVersion?: string }; spec?: unknown; status?: unknown };
type PluralName = (typeof Plural)[keyof typeof Plural];

let seq = 0;
const uniqueName = (prefix: string) => `${prefix}-${++seq}`;

function create(plural: PluralName, body: Obj): Promise<Obj> {
  return custom.createNamespacedCustomObject({ group, version, namespace: ns, plural, body }) as Promise<Obj>;
}
function get(plural: PluralName, name: string): Promise<Obj> {
  return custom.getNamespacedCustomObject({ group, version, namespace: ns, plural, name }) as Promise<Obj>;
}
function patchSpec(plural: PluralName, name: string, spec: Record<string, unknown>): Promise<Obj> {
  return custom.patchNamespacedCustomObject({ group, version, namespace: ns, plural, name, body: { spec } }, mergePatch) as Promise<Obj>;
}
function patchStatus(plural: PluralName, name: string, status: unknown): Promise<Obj> {
  return custom.patchNamespacedCustomObjectStatus({ group, version, namespace: ns, plural, name, body: { status } }, mergePatch) as Promise<Obj>;
}

/** The apiserver's refusal: 422 and the Status message, which lists every failed rule. */
async function refusal(p: Promise<unknown>): Promise<{ code: number; message: string }> {
  try {
    await p;
  } catch (err) {
    const e = err as { code?: number; body?: unknown };
    const body = typeof e.body === 'string' ? (JSON.parse(e.body) as { message?: string }) : (e.body as { message?: string } | undefined);
    return { code: e.code ?? 0, message: body?.message ?? String(err) };
  }
  throw new Error('the apiserver accepted an object it should have refused');
}
async function expectRefused(p: Promise<unknown>, message: string): Promise<void> {
  const r = await refusal(p);
  expect(r).toMatchObject({ code: 422 });
  expect(r.message).toContain(message);
}

const model = (name: string, spec: Record<string, unknown>): Obj => ({ apiVersion, kind: Kind.model, metadata: { name }, spec });
const dllama = (name: string, spec: Record<string, unknown>): Obj => ({ apiVersion, kind: Kind.dllama, metadata: { name }, spec });
const session = (name: string, spec: Record<string, unknown>): Obj => ({ apiVersion, kind: Kind.session, metadata: { name }, spec });

const modelSpec = (over: Record<string, unknown> = {}, source: Record<string, unknown> = {}) => ({
  source: { repo: 'magus-test/tiny-llama', ...source },
  artifacts: [{ format: 'gguf', weights: 'q40' }],
  ...over,
});
const dllamaSpec = (over: Record<string, unknown> = {}) => ({ model: 'tiny-llama', engine: 'llamacpp', ...over });

beforeAll(async () => {
  // Twice, the second time against the installed CRDs: the installer is called by many test
  // files against one apiserver, so re-running it must be a harmless no-op.
  await installCrds(kc);
  await installCrds(kc);
  await kc.makeApiClient(CoreV1Api).createNamespace({ body: { metadata: { name: ns } } });
});

describe('installCrds', () => {
  test('applies the four CRDs under its own field manager, with the names and columns users see', async () => {
    const ext = kc.makeApiClient(ApiextensionsV1Api);
    const byKind = new Map((await ext.listCustomResourceDefinition({})).items.filter((c) => c.spec.group === group).map((c) => [c.spec.names.kind, c]));
    expect([...byKind.keys()].sort()).toEqual(['ApiKey', 'Dllama', 'Model', 'Session']);
    for (const [kind, short] of [
      ['Model', ['mgmodel', 'mgm']],
      ['Dllama', ['mgdllama', 'mgd']],
      ['Session', ['mgsession', 'mgs']],
      ['ApiKey', ['mgkey', 'mgk']],
    ] as const) {
      const crd = byKind.get(kind)!;
      expect(crd.spec.names).toMatchObject({ shortNames: short, categories: ['magus'] });
      expect(crd.spec.scope).toBe('Namespaced');
      expect(crd.metadata?.managedFields?.map((f) => f.manager)).toContain(CRD_FIELD_MANAGER);
      expect(crd.spec.versions.map((v) => v.subresources?.status as unknown)).toEqual([{}]);
    }
    expect(byKind.get('Dllama')!.spec.versions[0]!.subresources?.scale).toEqual({
      specReplicasPath: '.spec.replicas',
      statusReplicasPath: '.status.replicas',
      labelSelectorPath: '.status.selector',
    });
    expect(byKind.get('Model')!.spec.versions[0]!.additionalPrinterColumns?.map((c) => c.name)).toEqual(['Repo', 'Phase', 'Progress', 'Size', 'Ready', 'Age']);
    expect(byKind.get('Dllama')!.spec.versions[0]!.additionalPrinterColumns?.map((c) => c.name)).toEqual([
      'Model',
      'Engine',
      'Nodes',
      'Replicas',
      'Ready',
      'Phase',
      'Age',
    ]);
    expect(byKind.get('Session')!.spec.versions[0]!.additionalPrinterColumns?.map((c) => c.name)).toEqual(['Pool', 'Model', 'Instance', 'Expires', 'Age']);
    expect(byKind.get('ApiKey')!.spec.versions[0]!.additionalPrinterColumns?.map((c) => c.name)).toEqual([
      'Secret',
      'Models',
      'Suspended',
      'Budget',
      'Period',
      'Used',
      'Remaining',
      'Ready',
      'Reason',
      'Age',
    ]);
  });

  test('loadCrdManifests gives typed models that serialize back to the YAML unchanged', () => {
    const typed = loadCrdManifests();
    expect(typed.map((c) => c.metadata?.name)).toEqual(['models.magus.dev', 'dllamas.magus.dev', 'sessions.magus.dev', 'apikeys.magus.dev']);
    // The typed models rename wire keys; the rules must be reachable under the typed names.
    const dllamaSpecSchema = typed[1]!.spec.versions[0]!.schema!.openAPIV3Schema!.properties!.spec!;
    expect(dllamaSpecSchema.x_kubernetes_validations?.map((v) => v.message)).toContain('replicas must not exceed maxReplicas');
    expect(dllamaSpecSchema.properties!.replicas!._default).toBe(1);
    const serialize = (c: unknown): unknown => ObjectSerializer.serialize(c, 'V1CustomResourceDefinition') as unknown;
    expect(typed.map(serialize)).toEqual(loadRawCrdManifests());
  });

  test('no schema keeps unknown fields: an unknown spec field is pruned', async () => {
    expect(CRD_FILES.map((f) => readFileSync(join(crdsDir(), f), 'utf8')).join('')).not.toContain('preserve-unknown-fields');
    const name = uniqueName('pruned');
    await create(Plural.model, model(name, { ...modelSpec(), surprise: 'x' }));
    expect((await get(Plural.model, name)).spec).not.toHaveProperty('surprise');
  });
});

describe('Model', () => {
  test('a full spec typed by ModelResourceSpec survives unpruned, and defaults apply', async () => {
    const spec: ModelResourceSpec = {
      source: {
        repo: 'meta-llama/Llama-3.1-8B-Instruct',
        revision: 'refs/pr/12',
        hubUrl: 'http://127.0.0.1:8900/hub',
        tokenSecretRef: { name: 'hf-token', key: 'hf.token' },
      },
      artifacts: [
        { format: 'gguf', weights: 'q40' },
        { format: 'gguf', weights: 'q80' },
        { format: 'dllama', weights: 'q40' },
      ],
      contextLength: 8192,
      rerun: 'after-access-granted',
      deletionPolicy: 'Delete',
      sampling: { temperature: 0.2, top_p: 0.9, top_k: 40, repetition_penalty: 1.1 },
    };
    const name = uniqueName('full');
    await create(Plural.model, model(name, spec as unknown as Record<string, unknown>));
    expect((await get(Plural.model, name)).spec).toEqual(spec);

    const minimal = uniqueName('minimal');
    await create(Plural.model, model(minimal, modelSpec({}, { tokenSecretRef: { name: 'hf-token' } })));
    expect((await get(Plural.model, minimal)).spec).toMatchObject({ deletionPolicy: 'Retain', source: { tokenSecretRef: { name: 'hf-token', key: 'token' } } });
  });

  test.each([
    ['the smallest context length', modelSpec({ contextLength: 16 })],
    ['the largest context length', modelSpec({ contextLength: 10_000_000 })],
    [
      'every artifact pair that can be served (four GGUF, distributed-llama q40 and f32)',
      modelSpec({
        artifacts: [
          ...['q40', 'q80', 'f16', 'f32'].map((weights) => ({ format: 'gguf', weights })),
          ...['q40', 'f32'].map((weights) => ({ format: 'dllama', weights })),
        ],
      }),
    ],
    ['a dotted repo and a commit revision', modelSpec({}, { repo: 'Qwen/Qwen3-0.6B.v2', revision: '0123456789abcdef0123456789abcdef01234567' })],
    ['an https hub', modelSpec({}, { hubUrl: 'https://hub.example.com' })],
    ['the widest sampling defaults', modelSpec({ sampling: { temperature: 2, top_p: 1, top_k: 1_000_000, repetition_penalty: 2 } })],
    ['greedy sampling defaults', modelSpec({ sampling: { temperature: 0, top_k: 0, repetition_penalty: 0.5 } })],
    [
      'a GGUF repository by file glob',
      modelSpec({ artifacts: [{ format: 'gguf', weights: 'source' }] }, { repo: 'org/Model-GGUF', gguf: { file: '*Q4_K_M.gguf' } }),
    ],
    [
      'a GGUF repository by quantization',
      modelSpec({ artifacts: [{ format: 'gguf', weights: 'source' }] }, { repo: 'org/Model-GGUF', gguf: { quantization: 'Q8_0' } }),
    ],
    [
      'a GGUF repository converted for distributed-llama',
      modelSpec(
        {
          artifacts: [
            { format: 'gguf', weights: 'source' },
            { format: 'dllama', weights: 'q40' },
          ],
        },
        { repo: 'org/Model-GGUF', gguf: { quantization: 'Q8_0' } },
      ),
    ],
  ])('accepts %s', async (_what, spec) => {
    await expect(create(Plural.model, model(uniqueName('good'), spec))).resolves.toMatchObject({ kind: 'Model' });
  });

  test('accepts a 63-character name', async () => {
    await expect(create(Plural.model, model('m'.repeat(63), modelSpec()))).resolves.toMatchObject({ kind: 'Model' });
  });

  const NAME_MSG = "a Model's name must be a DNS label (at most 63 characters of a-z, 0-9 and '-') so that a Dllama can reference it";
  test.each<[string, string, Record<string, unknown>, string]>([
    ['a 64-character name', 'm'.repeat(64), modelSpec(), NAME_MSG],
    ['a dotted name', 'tiny.llama', modelSpec(), NAME_MSG],
    ['no artifacts field', 'x', { source: { repo: 'a/b' } }, 'spec.artifacts: Required value'],
    ['a repo without an org', 'x', modelSpec({}, { repo: 'tiny-llama' }), 'spec.source.repo in body should match'],
    ['a repo with a leading dot', 'x', modelSpec({}, { repo: 'org/.hidden' }), 'spec.source.repo in body should match'],
    ['a repo with ..', 'x', modelSpec({}, { repo: 'org/a..b' }), "source.repo must not contain '..'"],
    [
      'distributed-llama f16 weights',
      'x',
      modelSpec({ artifacts: [{ format: 'dllama', weights: 'f16' }] }),
      'distributed-llama runs only q40 and f32 weights on a CPU: ask for dllama:q40 or dllama:f32',
    ],
    ['a revision with ..', 'x', modelSpec({}, { revision: 'main/../secret' }), "source.revision must not contain '..'"],
    ['a revision starting with /', 'x', modelSpec({}, { revision: '/main' }), 'spec.source.revision in body should match'],
    ['an ftp hub', 'x', modelSpec({}, { hubUrl: 'ftp://hub.example.com' }), 'source.hubUrl must be an http:// or https:// URL'],
    ['a hub URL that does not parse', 'x', modelSpec({}, { hubUrl: 'https://bad host/' }), 'source.hubUrl must be an http:// or https:// URL'],
    [
      'a hub URL with a password',
      'x',
      modelSpec({}, { hubUrl: 'https://user:s3cret@hub.example.com/' }),
      'source.hubUrl must not hold a user name or password: give the hub token as a Secret (tokenSecretRef)',
    ],
    ['a token Secret without a name', 'x', modelSpec({}, { tokenSecretRef: { key: 'token' } }), 'spec.source.tokenSecretRef.name: Required value'],
    [
      'a token Secret name that is not a DNS subdomain',
      'x',
      modelSpec({}, { tokenSecretRef: { name: 'HF_Token' } }),
      'spec.source.tokenSecretRef.name in body should match',
    ],
    ['empty artifacts', 'x', modelSpec({ artifacts: [] }), 'spec.artifacts in body should have at least 1 items'],
    [
      'nine artifacts',
      'x',
      modelSpec({ artifacts: Array.from({ length: 9 }, (_, i) => ({ format: i % 2 ? 'gguf' : 'dllama', weights: ['q40', 'q80', 'f16', 'f32'][i % 4] })) }),
      'must have at most 8 items',
    ],
    [
      'a duplicate artifact',
      'x',
      modelSpec({
        artifacts: [
          { format: 'gguf', weights: 'q40' },
          { format: 'dllama', weights: 'q40' },
          { format: 'gguf', weights: 'q40' },
        ],
      }),
      'spec.artifacts[2]: Duplicate value',
    ],
    ['an unknown format', 'x', modelSpec({ artifacts: [{ format: 'onnx', weights: 'q40' }] }), 'spec.artifacts[0].format: Unsupported value: "onnx"'],
    [
      'an unknown weights type',
      'x',
      modelSpec({ artifacts: [{ format: 'gguf', weights: 'q4_k_m' }] }),
      'spec.artifacts[0].weights: Unsupported value: "q4_k_m"',
    ],
    ['an artifact without weights', 'x', modelSpec({ artifacts: [{ format: 'gguf' }] }), 'spec.artifacts[0].weights: Required value'],
    ['a context length below 16', 'x', modelSpec({ contextLength: 15 }), 'spec.contextLength in body should be greater than or equal to 16'],
    ['a context length above 10M', 'x', modelSpec({ contextLength: 10_000_001 }), 'spec.contextLength in body should be less than or equal to 10000000'],
    ['a 64-character rerun', 'x', modelSpec({ rerun: 'r'.repeat(64) }), 'spec.rerun: Too long: may not be more than 63'],
    ['an unknown deletion policy', 'x', modelSpec({ deletionPolicy: 'Keep' }), 'spec.deletionPolicy: Unsupported value: "Keep"'],
    ['a temperature above 2', 'x', modelSpec({ sampling: { temperature: 2.5 } }), 'spec.sampling.temperature in body should be less than or equal to 2'],
    ['a negative temperature', 'x', modelSpec({ sampling: { temperature: -0.1 } }), 'spec.sampling.temperature in body should be greater than or equal to 0'],
    ['a top_p of 0', 'x', modelSpec({ sampling: { top_p: 0 } }), 'spec.sampling.top_p in body should be greater than 0'],
    ['a top_p above 1', 'x', modelSpec({ sampling: { top_p: 1.5 } }), 'spec.sampling.top_p in body should be less than or equal to 1'],
    ['a fractional top_k', 'x', modelSpec({ sampling: { top_k: 4.5 } }), 'spec.sampling.top_k in body must be of type integer'],
    ['a repetition penalty of 0', 'x', modelSpec({ sampling: { repetition_penalty: 0 } }), 'spec.sampling.repetition_penalty in body should be greater than 0'],
    [
      'a GGUF choice naming neither',
      'x',
      modelSpec({ artifacts: [{ format: 'gguf', weights: 'source' }] }, { gguf: {} }),
      'source.gguf needs exactly one of file or quantization',
    ],
    [
      'a GGUF choice naming both',
      'x',
      modelSpec({ artifacts: [{ format: 'gguf', weights: 'source' }] }, { gguf: { file: '*Q8_0.gguf', quantization: 'Q8_0' } }),
      'source.gguf needs exactly one of file or quantization',
    ],
    [
      'an empty GGUF glob',
      'x',
      modelSpec({ artifacts: [{ format: 'gguf', weights: 'source' }] }, { gguf: { file: '' } }),
      'spec.source.gguf.file in body should be at least 1 chars long',
    ],
    [
      'a GGUF glob with ..',
      'x',
      modelSpec({ artifacts: [{ format: 'gguf', weights: 'source' }] }, { gguf: { file: '../*.gguf' } }),
      "source.gguf.file must not contain '..' or start with '/'",
    ],
    [
      'a quantization with a space',
      'x',
      modelSpec({ artifacts: [{ format: 'gguf', weights: 'source' }] }, { gguf: { quantization: 'Q4 K' } }),
      'spec.source.gguf.quantization in body should match',
    ],
    [
      'gguf:source without a GGUF source',
      'x',
      modelSpec({ artifacts: [{ format: 'gguf', weights: 'source' }] }),
      "gguf:source takes a GGUF source's file as it is: it needs source.gguf",
    ],
    [
      'a GGUF source re-quantized',
      'x',
      modelSpec({ artifacts: [{ format: 'gguf', weights: 'q40' }] }, { gguf: { quantization: 'Q8_0' } }),
      'a GGUF source is served as it is published (gguf:source) or converted for distributed-llama',
    ],
  ])('refuses %s', async (_what, name, spec, message) => {
    await expectRefused(create(Plural.model, model(name === 'x' ? uniqueName('bad') : name, spec)), message);
  });

  test('a full status typed by ModelResourceStatus survives unpruned; conditions are a list-map by type', async () => {
    const name = uniqueName('status');
    await create(
      Plural.model,
      model(
        name,
        modelSpec({
          artifacts: [
            { format: 'gguf', weights: 'q40' },
            { format: 'dllama', weights: 'q40' },
          ],
        }),
      ),
    );
    const status: ModelResourceStatus = {
      observedGeneration: 1,
      phase: 'Converting',
      progress: {
        files: { done: 3, total: 5 },
        bytes: { done: 1_200_000_000, total: 2_900_000_000 },
        tensors: { done: 40, total: 291 },
        percent: 42.5,
        etaSeconds: 61.5,
        summary: '42% 1.2 GB/2.9 GB',
      },
      revision: '0123456789abcdef0123456789abcdef01234567',
      artifacts: [
        { format: 'gguf', weights: 'q40', uri: 's3://models/tiny/model-q40.gguf', bytes: 4_500_000_000, sha256: 'a'.repeat(64) },
        { format: 'dllama', weights: 'q40', uri: 's3://models/tiny/model-q40.m', bytes: 4_400_000_000, sha256: 'b'.repeat(64) },
      ],
      size: '8.9 GB',
      sizing: [
        { format: 'gguf', weights: 'q40', contextLength: 8192, nodes: 1, rootBytes: 5_000_000_000 },
        { format: 'dllama', weights: 'q40', contextLength: 8192, nodes: 2, rootBytes: 2_600_000_000, workerBytes: 2_300_000_000 },
      ],
      refusedTopologies: [
        { format: 'dllama', weights: 'q40', nodes: 16, reason: 'num_key_value_heads 8 / 16 nodes is not a whole number of KV heads per node' },
      ],
      workflowId: 'model/default/tiny',
      conditions: [
        {
          type: 'Downloaded',
          status: 'True',
          reason: 'Downloaded',
          message: 'all files downloaded',
          observedGeneration: 1,
          lastTransitionTime: '2026-01-02T03:04:05Z',
        },
        { type: 'Ready', status: 'False', reason: 'Converting', message: '', observedGeneration: 1, lastTransitionTime: '2026-01-02T03:04:06Z' },
      ],
    };
    await patchStatus(Plural.model, name, status);
    expect((await get(Plural.model, name)).status).toEqual(status);

    const cond = { status: 'True', reason: 'R', message: '', observedGeneration: 1, lastTransitionTime: '2026-01-02T03:04:05Z' };
    await expectRefused(
      patchStatus(Plural.model, name, {
        conditions: [
          { type: 'Ready', ...cond },
          { type: 'Ready', ...cond },
        ],
      }),
      'status.conditions[1]: Duplicate value',
    );
    await expectRefused(
      patchStatus(Plural.model, name, { conditions: [{ type: 'Ready', ...cond, status: 'Yes' }] }),
      'status.conditions[0].status: Unsupported value: "Yes"',
    );
    await expectRefused(
      patchStatus(Plural.model, name, { conditions: [{ type: 'Ready', status: 'True', lastTransitionTime: '2026-01-02T03:04:05Z' }] }),
      'status.conditions[0].reason: Required value',
    );
    await expectRefused(
      patchStatus(Plural.model, name, { conditions: [{ type: 'Ready', ...cond, lastTransitionTime: 'yesterday' }] }),
      'conditions[0].lastTransitionTime in body must be of type date-time',
    );
  });

  test('the status subresource keeps spec and status apart', async () => {
    const name = uniqueName('split');
    await create(Plural.model, { ...model(name, modelSpec()), status: { phase: 'Injected' } });
    expect((await get(Plural.model, name)).status).toBeUndefined();
    await patchStatus(Plural.model, name, { phase: 'Ready', observedGeneration: 1 });
    const changed = (await custom.patchNamespacedCustomObject(
      { group, version, namespace: ns, plural: Plural.model, name, body: { spec: { rerun: 'again' }, status: { phase: 'Hacked' } } },
      mergePatch,
    )) as Obj;
    expect(changed).toMatchObject({ spec: { rerun: 'again' }, status: { phase: 'Ready' } });
  });
});

describe('Dllama', () => {
  test('a full spec typed by DllamaResourceSpec survives unpruned, and defaults apply', async () => {
    const spec: DllamaResourceSpec = {
      model: 'tiny-llama',
      engine: 'dllama',
      nodesPower: 4,
      replicas: 64,
      minReplicas: 2,
      maxReplicas: 64,
      leasesPerInstance: 1024,
      idleTimeout: '1h30m',
      drainTimeout: '1h',
      resources: { requests: { cpu: '500m', memory: '4Gi', 'nvidia.com/gpu': '1' }, limits: { memory: '8Gi', 'ephemeral-storage': '10G' } },
      nodeSelector: { 'magus.dev/inference': 'true', 'kubernetes.io/arch': 'amd64' },
      tolerations: [
        { key: 'magus.dev/inference', operator: 'Exists', effect: 'NoSchedule' },
        { key: 'node.kubernetes.io/unreachable', operator: 'Equal', value: 'x', effect: 'NoExecute', tolerationSeconds: 30 },
      ],
      images: { magus: 'registry.example.com/magus:1.0.0', dllama: 'registry.example.com/dllama:0.16' },
    };
    const name = uniqueName('full');
    await create(Plural.dllama, dllama(name, spec as unknown as Record<string, unknown>));
    expect((await get(Plural.dllama, name)).spec).toEqual(spec);

    const minimal = uniqueName('minimal');
    await create(Plural.dllama, dllama(minimal, dllamaSpec()));
    expect((await get(Plural.dllama, minimal)).spec).toEqual({
      model: 'tiny-llama',
      engine: 'llamacpp',
      nodesPower: 0,
      replicas: 1,
      minReplicas: 0,
      maxReplicas: 1,
      leasesPerInstance: 4,
      idleTimeout: '10m',
      drainTimeout: '5m',
    });
  });

  test.each([
    ['zero replicas', dllamaSpec({ replicas: 0, minReplicas: 0, maxReplicas: 2 })],
    ['replicas at min = max', dllamaSpec({ replicas: 3, minReplicas: 3, maxReplicas: 3 })],
    ['the 30s idle floor', dllamaSpec({ idleTimeout: '30s' })],
    ['hours, minutes and seconds', dllamaSpec({ idleTimeout: '2h5m30s' })],
    ['no drain', dllamaSpec({ drainTimeout: '0s' })],
    ['the longest drain', dllamaSpec({ drainTimeout: '60m' })],
    ['distributed-llama on one node', dllamaSpec({ engine: 'dllama', nodesPower: 0 })],
    ['empty resource maps', dllamaSpec({ resources: { requests: {}, limits: {} } })],
  ])('accepts %s', async (_what, spec) => {
    await expect(create(Plural.dllama, dllama(uniqueName('good'), spec))).resolves.toMatchObject({ kind: 'Dllama' });
  });

  test("magus dev's demo Dllama: declared by --engine dllama, deleted by a later run without it; one another wrote to stays", async () => {
    const demo = `${iso.id}-demo`.slice(0, 40);
    const inDefault = { group, version, namespace: 'default', plural: Plural.dllama };
    await declareDemoDllama(kc, demo, 2);
    expect(((await custom.getNamespacedCustomObject({ ...inDefault, name: demo })) as Obj).spec).toMatchObject({ engine: 'dllama', nodesPower: 1 });
    await expect(withdrawDemoDllama(kc, demo)).resolves.toBe(true);
    await expect(custom.getNamespacedCustomObject({ ...inDefault, name: demo })).rejects.toMatchObject({ code: 404 });
    await expect(withdrawDemoDllama(kc, demo)).resolves.toBe(false); // none left: nothing to do
    // Someone scaled the demo's Dllama by hand: theirs too now, so it stays.
    await declareDemoDllama(kc, demo, 2);
    await custom.patchNamespacedCustomObject({ ...inDefault, name: demo, body: { spec: { maxReplicas: 2 } }, fieldManager: 'kubectl-edit' }, mergePatch);
    await expect(withdrawDemoDllama(kc, demo)).resolves.toBe(false);
    expect(((await custom.getNamespacedCustomObject({ ...inDefault, name: demo })) as Obj).spec).toMatchObject({ maxReplicas: 2 });
    await custom.deleteNamespacedCustomObject({ ...inDefault, name: demo });
  });

  test('accepts a 40-character name', async () => {
    await expect(create(Plural.dllama, dllama('d'.repeat(40), dllamaSpec()))).resolves.toMatchObject({ kind: 'Dllama' });
  });

  const NAME_MSG = "a Dllama's name must be a DNS label of at most 40 characters (its pods and services append suffixes to it)";
  const GRAMMAR_MSG = 'idleTimeout must be a duration of whole hours, minutes and seconds, e.g. 90s, 10m or 1h30m';
  test.each<[string, string, Record<string, unknown>, string]>([
    ['a 41-character name', 'd'.repeat(41), dllamaSpec(), NAME_MSG],
    ['a dotted name', 'tiny.pool', dllamaSpec(), NAME_MSG],
    ['no model', 'x', { engine: 'llamacpp' }, 'spec.model: Required value'],
    ['no engine', 'x', { model: 'tiny-llama' }, 'spec.engine: Required value'],
    ['a model name that is not a DNS label', 'x', dllamaSpec({ model: 'Tiny_Llama' }), 'spec.model in body should match'],
    ['an unknown engine', 'x', dllamaSpec({ engine: 'vllm' }), 'spec.engine: Unsupported value: "vllm"'],
    ['nodesPower 5', 'x', dllamaSpec({ engine: 'dllama', nodesPower: 5 }), 'spec.nodesPower in body should be less than or equal to 4'],
    ['a negative nodesPower', 'x', dllamaSpec({ engine: 'dllama', nodesPower: -1 }), 'spec.nodesPower in body should be greater than or equal to 0'],
    ['llama.cpp on two nodes', 'x', dllamaSpec({ nodesPower: 1 }), 'engine llamacpp runs on a single node: nodesPower must be 0'],
    ['minReplicas above maxReplicas', 'x', dllamaSpec({ minReplicas: 3, maxReplicas: 2, replicas: 2 }), 'minReplicas must not exceed maxReplicas'],
    ['replicas above maxReplicas', 'x', dllamaSpec({ replicas: 3, maxReplicas: 2 }), 'replicas must not exceed maxReplicas'],
    ['replicas below minReplicas', 'x', dllamaSpec({ replicas: 0, minReplicas: 1, maxReplicas: 2 }), 'replicas must not be below minReplicas'],
    ['65 replicas', 'x', dllamaSpec({ replicas: 65, maxReplicas: 64 }), 'spec.replicas in body should be less than or equal to 64'],
    ['maxReplicas 0', 'x', dllamaSpec({ replicas: 0, maxReplicas: 0 }), 'spec.maxReplicas in body should be greater than or equal to 1'],
    ['zero leases per instance', 'x', dllamaSpec({ leasesPerInstance: 0 }), 'spec.leasesPerInstance in body should be greater than or equal to 1'],
    ['an idle timeout without a unit', 'x', dllamaSpec({ idleTimeout: '600' }), GRAMMAR_MSG],
    ['a fractional idle timeout', 'x', dllamaSpec({ idleTimeout: '1.5h' }), GRAMMAR_MSG],
    ['an idle timeout in milliseconds', 'x', dllamaSpec({ idleTimeout: '45000ms' }), GRAMMAR_MSG],
    ['an empty idle timeout', 'x', dllamaSpec({ idleTimeout: '' }), GRAMMAR_MSG],
    ['an idle timeout below 30s', 'x', dllamaSpec({ idleTimeout: '29s' }), 'idleTimeout must be at least 30s'],
    ['a drain beyond 1h', 'x', dllamaSpec({ drainTimeout: '61m' }), 'drainTimeout must be at most 1h'],
    [
      'a drain that is no duration',
      'x',
      dllamaSpec({ drainTimeout: '5 minutes' }),
      'drainTimeout must be a duration of whole hours, minutes and seconds, e.g. 90s, 5m or 1h',
    ],
    [
      'a request that is not a quantity',
      'x',
      dllamaSpec({ resources: { requests: { cpu: 'lots' } } }),
      'resources.requests values must be Kubernetes quantities, e.g. 500m, 4Gi',
    ],
    [
      'a limit that is not a quantity',
      'x',
      dllamaSpec({ resources: { limits: { memory: '1GB' } } }),
      'resources.limits values must be Kubernetes quantities, e.g. 500m, 4Gi',
    ],
    [
      'an unknown toleration operator',
      'x',
      dllamaSpec({ tolerations: [{ key: 'k', operator: 'Maybe' }] }),
      'spec.tolerations[0].operator: Unsupported value: "Maybe"',
    ],
    [
      'an unknown toleration effect',
      'x',
      dllamaSpec({ tolerations: [{ key: 'k', operator: 'Exists', effect: 'NoLunch' }] }),
      'spec.tolerations[0].effect: Unsupported value: "NoLunch"',
    ],
  ])('refuses %s', async (_what, name, spec, message) => {
    await expectRefused(create(Plural.dllama, dllama(name === 'x' ? uniqueName('bad') : name, spec)), message);
  });

  test('engine and model are immutable; the other fields are not', async () => {
    const name = uniqueName('immutable');
    await create(Plural.dllama, dllama(name, dllamaSpec({ maxReplicas: 4 })));
    // A PUT of the whole object, as `kubectl replace` sends it.
    const current = await get(Plural.dllama, name);
    const replaced = { ...current, spec: { ...(current.spec as object), engine: 'dllama' } };
    await expectRefused(
      custom.replaceNamespacedCustomObject({ group, version, namespace: ns, plural: Plural.dllama, name, body: replaced }),
      'spec.engine is immutable: create a new Dllama to change engines',
    );
    await expectRefused(patchSpec(Plural.dllama, name, { model: 'other-model' }), 'spec.model is immutable: create a new Dllama to serve another model');
    const updated = await patchSpec(Plural.dllama, name, { replicas: 3, leasesPerInstance: 8, idleTimeout: '1m' });
    expect(updated.spec).toMatchObject({ model: 'tiny-llama', engine: 'llamacpp', replicas: 3, leasesPerInstance: 8, idleTimeout: '1m' });
    // Cross-field rules hold on updates too: lowering max under the current replicas is refused.
    await expectRefused(patchSpec(Plural.dllama, name, { maxReplicas: 2 }), 'replicas must not exceed maxReplicas');
  });

  test('the scale subresource: bounds enforced, selector reported from status', async () => {
    const name = uniqueName('scale');
    await create(Plural.dllama, dllama(name, dllamaSpec({ minReplicas: 1, maxReplicas: 3 })));
    const scaleArgs = { group, version, namespace: ns, plural: Plural.dllama, name };
    type Scale = { spec: { replicas: number }; status: { replicas: number; selector?: string } };

    const before = (await custom.getNamespacedCustomObjectScale(scaleArgs)) as Scale;
    expect(before).toMatchObject({ spec: { replicas: 1 }, status: { replicas: 0 } });
    expect(before.status.selector).toBeUndefined();

    const status: DllamaResourceStatus = { replicas: 1, readyReplicas: 1, selector: 'magus.dev/pool=' + name, nodesPerInstance: 1, phase: 'Serving' };
    await patchStatus(Plural.dllama, name, status);
    expect((await custom.getNamespacedCustomObjectScale(scaleArgs)) as Scale).toMatchObject({
      spec: { replicas: 1 },
      status: { replicas: 1, selector: `magus.dev/pool=${name}` },
    });

    // PATCH /scale, as `kubectl scale` sends it, and PUT /scale, as an HPA writes it.
    await custom.patchNamespacedCustomObjectScale({ ...scaleArgs, body: { spec: { replicas: 3 } } }, mergePatch);
    expect((await get(Plural.dllama, name)).spec).toMatchObject({ replicas: 3 });
    await expectRefused(
      custom.patchNamespacedCustomObjectScale({ ...scaleArgs, body: { spec: { replicas: 4 } } }, mergePatch),
      'replicas must not exceed maxReplicas',
    );
    const scale = (await custom.getNamespacedCustomObjectScale(scaleArgs)) as Scale & Record<string, unknown>;
    await expectRefused(
      custom.replaceNamespacedCustomObjectScale({ ...scaleArgs, body: { ...scale, spec: { replicas: 0 } } }),
      'replicas must not be below minReplicas',
    );
    const replaced = (await custom.replaceNamespacedCustomObjectScale({ ...scaleArgs, body: { ...scale, spec: { replicas: 2 } } })) as Scale;
    expect(replaced.spec.replicas).toBe(2);
    expect((await get(Plural.dllama, name)).spec).toMatchObject({ replicas: 2 });
  });

  test('a full status typed by DllamaResourceStatus survives unpruned', async () => {
    const name = uniqueName('status');
    await create(Plural.dllama, dllama(name, dllamaSpec({ engine: 'dllama', nodesPower: 1, maxReplicas: 2, replicas: 2 })));
    const status: DllamaResourceStatus = {
      observedGeneration: 1,
      phase: 'Scaling',
      replicas: 2,
      readyReplicas: 1,
      nodesPerInstance: 2,
      selector: `magus.dev/pool=${name}`,
      instances: [
        { id: 'i-1', phase: 'Serving', leases: 3 },
        { id: 'i-2', phase: 'Starting', leases: 0 },
      ],
      lastError: 'worker i-2-1 not ready yet',
      workflowId: `pool/${ns}/${name}`,
      conditions: [
        { type: 'Ready', status: 'Unknown', reason: 'Scaling', message: '1/2 ready', observedGeneration: 1, lastTransitionTime: '2026-01-02T03:04:05Z' },
      ],
    };
    await patchStatus(Plural.dllama, name, status);
    expect((await get(Plural.dllama, name)).status).toEqual(status);
    await expectRefused(
      patchStatus(Plural.dllama, name, {
        instances: [
          { id: 'i-1', phase: 'Serving', leases: 1 },
          { id: 'i-1', phase: 'Serving', leases: 2 },
        ],
      }),
      'status.instances[1]: Duplicate value',
    );
  });
});

describe('Session', () => {
  test('a full spec and status survive unpruned; pool and model are immutable', async () => {
    const name = uniqueName('s');
    await create(Plural.session, session(name, { pool: 'tiny', model: 'tiny-llama' }));
    const status: SessionResourceStatus = { instance: 'tiny-i-1', turns: 3, expiresAt: '2026-01-02T03:14:05Z' };
    await patchStatus(Plural.session, name, status);
    expect(await get(Plural.session, name)).toMatchObject({ spec: { pool: 'tiny', model: 'tiny-llama' }, status });

    await expectRefused(patchSpec(Plural.session, name, { pool: 'other' }), 'spec.pool is immutable');
    await expectRefused(patchSpec(Plural.session, name, { model: 'other' }), 'spec.model is immutable');
    await expectRefused(
      patchStatus(Plural.session, name, { turns: -1 }),
      'status.turns: Invalid value: -1: turns in body should be greater than or equal to 0',
    );
    await expectRefused(
      patchStatus(Plural.session, name, { expiresAt: 'soon' }),
      'status.expiresAt: Invalid value: "soon": expiresAt in body must be of type date-time',
    );
  });

  test.each<[string, Record<string, unknown>, string]>([
    ['no pool', { model: 'm' }, 'spec.pool: Required value'],
    ['no model', { pool: 'p' }, 'spec.model: Required value'],
    ['a pool that is not a DNS label', { pool: 'Pool_1', model: 'm' }, 'spec.pool in body should match'],
    ['an empty model', { pool: 'p', model: '' }, 'spec.model in body should be at least 1 chars long'],
  ])('refuses %s', async (_what, spec, message) => {
    await expectRefused(create(Plural.session, session(uniqueName('bad'), spec)), message);
  });
});

describe('ApiKey', () => {
  const apiKey = (name: string, spec: Record<string, unknown>): Obj => ({ apiVersion, kind: Kind.apiKey, metadata: { name }, spec });
  test('a full spec and status typed by ApiKeyResource survive unpruned, and defaults apply', async () => {
    const name = uniqueName('k');
    const spec: ApiKeyResourceSpec = {
      secretRef: { name: 'team.token', key: 'api-token' },
      models: ['tiny', '*', 'platform/llama', 'platform/*'],
      suspended: true,
      limits: { requestsPerMinute: 60, tokensPerMinute: 100_000_000_000, concurrency: 1_000_000, budget: { tokens: 1_000_000_000_000_000, period: 'month' } },
    };
    await create(Plural.apiKey, apiKey(name, spec as unknown as Record<string, unknown>));
    const status: ApiKeyResourceStatus = {
      observedGeneration: 1,
      tokenId: 'a1b2c3d4e5f60718',
      models: ['ns/tiny', 'platform/*'],
      modelsSummary: 'ns/tiny,platform/*',
      conditions: [
        { type: 'Ready', status: 'False', reason: 'IdConflict', message: 'taken', observedGeneration: 1, lastTransitionTime: '2026-01-02T03:04:05Z' },
      ],
    };
    await patchStatus(Plural.apiKey, name, status);
    expect(await get(Plural.apiKey, name)).toMatchObject({ spec, status });
    const plain = uniqueName('k');
    await create(Plural.apiKey, apiKey(plain, { secretRef: { name: 's' } }));
    expect(await get(Plural.apiKey, plain)).toMatchObject({ spec: { secretRef: { name: 's', key: 'token' }, suspended: false } });
  });

  test.each<[string, string, Record<string, unknown>, string]>([
    ['no secretRef', 'k', {}, 'spec.secretRef: Required value'],
    ['a secretRef that is not a Secret name', 'k', { secretRef: { name: 'Team_Token' } }, 'spec.secretRef.name in body should match'],
    ['a model that is neither name, *, ns/name nor ns/*', 'k', { secretRef: { name: 's' }, models: ['a/b/c'] }, 'spec.models[0] in body should match'],
    ['a model given twice', 'k', { secretRef: { name: 's' }, models: ['tiny', 'tiny'] }, 'Duplicate value'],
    ['a name that is not a DNS label', 'k.dotted', { secretRef: { name: 's' } }, "an ApiKey's name must be a DNS label"],
    [
      'requestsPerMinute 0',
      'k',
      { secretRef: { name: 's' }, limits: { requestsPerMinute: 0 } },
      'spec.limits.requestsPerMinute: Invalid value: 0: spec.limits.requestsPerMinute in body should be greater than or equal to 1',
    ],
    ['a fraction of a request', 'k', { secretRef: { name: 's' }, limits: { concurrency: 1.5 } }, 'spec.limits.concurrency: Invalid value: "number"'],
    [
      'tokensPerMinute above its bound',
      'k',
      { secretRef: { name: 's' }, limits: { tokensPerMinute: 100_000_000_001 } },
      'spec.limits.tokensPerMinute in body should be less than or equal to 100000000000',
    ],
    [
      'a budget above its bound',
      'k',
      { secretRef: { name: 's' }, limits: { budget: { tokens: 1_000_000_000_000_001, period: 'day' } } },
      'spec.limits.budget.tokens in body should be less than or equal to 1000000000000000',
    ],
    [
      'a budget period other than day or month',
      'k',
      { secretRef: { name: 's' }, limits: { budget: { tokens: 300, period: 'week' } } },
      'spec.limits.budget.period: Unsupported value: "week": supported values: "day", "month"',
    ],
    ['a budget without its period', 'k', { secretRef: { name: 's' }, limits: { budget: { tokens: 300 } } }, 'spec.limits.budget.period: Required value'],
  ])('refuses %s', async (_what, prefix, spec, message) => {
    await expectRefused(
      create(Plural.apiKey, apiKey(prefix === 'k' ? uniqueName('bad') : `${prefix}-${Math.random().toString(36).slice(2, 8)}`, spec)),
      message,
    );
  });

  test('a limit it does not know is pruned; empty limits are kept empty', async () => {
    const name = uniqueName('k');
    await create(
      Plural.apiKey,
      apiKey(name, { secretRef: { name: 's' }, limits: { rpm: 5, requestsPerMinute: 5, budget: { tokens: 9, period: 'day', rollover: true } } }),
    );
    expect((await get(Plural.apiKey, name)).spec).toMatchObject({ limits: { requestsPerMinute: 5, budget: { tokens: 9, period: 'day' } } });
    expect(JSON.stringify((await get(Plural.apiKey, name)).spec)).not.toMatch(/rpm|rollover/);
    const empty = uniqueName('k');
    await create(Plural.apiKey, apiKey(empty, { secretRef: { name: 's' }, limits: {} }));
    expect((await get(Plural.apiKey, empty)).spec).toMatchObject({ limits: {} });
  });
});

describe('crds/examples', () => {
  const dir = join(crdsDir(), 'examples');
  const files = readdirSync(dir)
    .filter((f) => f.endsWith('.yaml'))
    .sort();

  test('there are examples of both editable kinds', () => {
    const kinds = files.flatMap((f) => (loadAllYaml(readFileSync(join(dir, f), 'utf8')) as Obj[]).map((o) => o.kind));
    expect(new Set(kinds)).toEqual(new Set(['Model', 'Dllama']));
  });

  test.each(files)('%s is accepted as written', async (file) => {
    for (const doc of loadAllYaml(readFileSync(join(dir, file), 'utf8')) as Obj[]) {
      const plural = doc.kind === 'Model' ? Plural.model : Plural.dllama;
      // Server-side apply, as `kubectl apply --server-side -f crds/examples/` sends it.
      await custom.patchNamespacedCustomObject(
        { group, version, namespace: ns, plural, name: doc.metadata.name, body: doc, fieldManager: 'crds-test', force: true },
        setHeaderOptions('Content-Type', PatchStrategy.ServerSideApply),
      );
      expect((await get(plural, doc.metadata.name)).spec).toMatchObject(doc.spec as object);
    }
  });
});

// The real kubectl (from PATH, as every test that runs it; without one this fails): proves short
// names, the category and the printer columns as a user meets them. The client checks above stay
// the assertions of record.
describe('kubectl', () => {
  let dir: string;
  let kubeconfig: string;
  const kubectl = (...args: string[]) => execFileP('kubectl', ['--kubeconfig', kubeconfig, '-n', ns, ...args], { timeout: 60_000 });

  beforeAll(() => {
    dir = mkdtempSync(join(tmpdir(), 'magus-crds-'));
    kubeconfig = join(dir, 'kubeconfig');
    const k = endpoint('kubernetes');
    writeFileSync(
      kubeconfig,
      [
        'apiVersion: v1',
        'kind: Config',
        `clusters: [{name: t, cluster: {server: "${k.server}", insecure-skip-tls-verify: true}}]`,
        `users: [{name: t, user: {token: "${k.token}"}}]`,
        'contexts: [{name: t, context: {cluster: t, user: t}}]',
        'current-context: t',
        '',
      ].join('\n'),
      { mode: 0o600 },
    );
  });
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  test('kubectl scale stops at maxReplicas and `kubectl get magus` shows the printer columns', async () => {
    const name = uniqueName('kubectl');
    await create(Plural.model, model('kubectl-model', modelSpec()));
    await patchStatus(Plural.model, 'kubectl-model', {
      phase: 'Ready',
      size: '1.5 MB',
      progress: { files: { done: 1, total: 1 }, bytes: { done: 1, total: 1 }, tensors: { done: 1, total: 1 }, percent: 100, summary: '100% 1.5 MB' },
      conditions: [{ type: 'Ready', status: 'True', reason: 'Ready', message: '', observedGeneration: 1, lastTransitionTime: '2026-01-02T03:04:05Z' }],
    });
    await create(Plural.dllama, dllama(name, dllamaSpec({ model: 'kubectl-model', maxReplicas: 2 })));
    await patchStatus(Plural.dllama, name, { replicas: 1, readyReplicas: 1, nodesPerInstance: 1, phase: 'Serving', selector: `magus.dev/pool=${name}` });
    await create(Plural.session, session('kubectl-session', { pool: name, model: 'kubectl-model' }));
    await patchStatus(Plural.session, 'kubectl-session', { instance: `${name}-i-1`, turns: 7, expiresAt: '2099-01-01T00:00:00Z' });

    await kubectl('scale', `mgd/${name}`, '--replicas=2');
    expect((await get(Plural.dllama, name)).spec).toMatchObject({ replicas: 2 });
    const over = await kubectl('scale', `dllama/${name}`, '--replicas=3').then(
      () => '',
      (err: { stderr?: string }) => err.stderr ?? '',
    );
    expect(over).toContain('replicas must not exceed maxReplicas');

    const { stdout } = await kubectl('get', 'magus');
    const lines = stdout.split('\n');
    const row = (prefix: string) => lines.find((l) => l.startsWith(prefix))?.split(/\s{2,}/);
    expect(lines).toContainEqual(expect.stringMatching(/^NAME\s+REPO\s+PHASE\s+PROGRESS\s+SIZE\s+READY\s+AGE$/));
    expect(lines).toContainEqual(expect.stringMatching(/^NAME\s+MODEL\s+ENGINE\s+NODES\s+REPLICAS\s+READY\s+PHASE\s+AGE$/));
    expect(lines).toContainEqual(expect.stringMatching(/^NAME\s+POOL\s+MODEL\s+INSTANCE\s+EXPIRES\s+AGE$/));
    expect(row('model.magus.dev/kubectl-model')?.slice(0, 6)).toEqual([
      'model.magus.dev/kubectl-model',
      'magus-test/tiny-llama',
      'Ready',
      '100% 1.5 MB',
      '1.5 MB',
      'True',
    ]);
    expect(row(`dllama.magus.dev/${name} `)?.slice(0, 7)).toEqual([`dllama.magus.dev/${name}`, 'kubectl-model', 'llamacpp', '1', '2', '1', 'Serving']);
    expect(row('session.magus.dev/kubectl-session')?.slice(0, 5)).toEqual([
      'session.magus.dev/kubectl-session',
      name,
      'kubectl-model',
      `${name}-i-1`,
      '2099-01-01T00:00:00Z',
    ]);
  });
});

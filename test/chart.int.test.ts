/**
 * The Helm chart `charts/magus`, with the real helm (v3.22.0, scripts/dev-services) and, for the
 * second half, a private cluster (etcd + kube-apiserver + kube-controller-manager + kube-scheduler
 * + kwok: test/harness/cluster.ts), where Pods become Ready on fake Nodes without running anything.
 *
 * Without a cluster: its CRDs and RBAC are the repository's (`crds/`, byte for byte, and as
 * rendered: ClusterRoles by default, only Roles in namespaced mode), `helm lint --strict` and
 * `helm template` pass with every `examples/values-*.yaml`, every pod is non-root on a read-only
 * root filesystem, the defaults include the NetworkPolicies, and values.schema.json refuses
 * nonsense naming the field. On the cluster: every example's manifests pass the API server's own
 * validation (server-side dry-run), `helm install` gets every Deployment available, `kubectl auth
 * can-i --as` each ServiceAccount gets exactly its role's rights (cluster-wide, and namespaced
 * with two namespaces: nothing elsewhere, nothing cluster-scoped), `helm upgrade` rolls out
 * changed values, and `helm uninstall` leaves the CRDs and the resources in them.
 */
import { dataPlaneNames } from '../dataplane';
import { newNatsAuthority, roleCredentialsText, signerFileText } from '../dataplane/roles';
import { execFile } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import {
  ApiextensionsV1Api,
  AppsV1Api,
  CoreV1Api,
  CustomObjectsApi,
  loadAllYaml,
  NetworkingV1Api,
  RbacAuthorizationV1Api,
  type V1Deployment,
} from '@kubernetes/client-node';
import { loadGatewayConfig } from '../gateway/config';
import { loadConfig } from '../workers/config';
import { writeKubeconfig } from '../workers/dev/services';
import { startTestCluster, type TestCluster } from './harness/cluster';
import { eventually } from './harness/wait';

const execFileP = promisify(execFile);

const REPO = join(__dirname, '..');
const CHART = join(REPO, 'charts', 'magus');
const EXAMPLES = readdirSync(join(CHART, 'examples'))
  .filter((f) => /^values-.+\.yaml$/.test(f))
  .sort();
/** Where the chart is installed in the cluster tests (and what `helm template` is told). */
const NS = 'magus-system';

interface Obj {
  apiVersion: string;
  kind: string;
  metadata: { name: string; namespace?: string; labels?: Record<string, string>; annotations?: Record<string, string> };
  [key: string]: unknown;
}
interface Rule {
  apiGroups?: string[];
  resources?: string[];
  resourceNames?: string[];
  verbs: string[];
}
interface EnvVar {
  name: string;
  value?: string;
  valueFrom?: unknown;
}
interface Container {
  name: string;
  args?: string[];
  env?: EnvVar[];
  ports?: { name?: string; containerPort: number }[];
  securityContext?: { readOnlyRootFilesystem?: boolean; allowPrivilegeEscalation?: boolean; capabilities?: { drop?: string[] } };
  volumeMounts?: { name: string; mountPath: string }[];
  livenessProbe?: { httpGet?: { path: string; port: string | number } };
  readinessProbe?: { httpGet?: { path: string; port: string | number } };
  startupProbe?: { httpGet?: { path: string; port: string | number } };
  image?: string;
}
interface PodSpec {
  securityContext?: { runAsNonRoot?: boolean };
  containers: Container[];
  volumes?: { name: string; emptyDir?: unknown; secret?: { secretName: string; items?: { key: string; path: string }[] } }[];
  serviceAccountName?: string;
  automountServiceAccountToken?: boolean;
}
type Deployment = Obj & { spec: { replicas: number; template: { spec: PodSpec } } };
type Binding = Obj & { roleRef: { kind: string; name: string }; subjects: { kind: string; name: string; namespace: string }[] };

/** helm's own folders, so the tests neither read nor write the user's ~/.config/helm. */
const helmHome = mkdtempSync(join(tmpdir(), 'magus-chart-test-'));
let helmBin = '';
let kubeconfigFile = '';

interface Ran {
  code: number;
  stdout: string;
  stderr: string;
}

async function run(cmd: string, args: string[], input?: string): Promise<Ran> {
  const env = {
    ...process.env,
    HELM_CACHE_HOME: join(helmHome, 'cache'),
    HELM_CONFIG_HOME: join(helmHome, 'config'),
    HELM_DATA_HOME: join(helmHome, 'data'),
    KUBECONFIG: kubeconfigFile || join(helmHome, 'no-kubeconfig'),
  };
  const child = execFileP(cmd, args, { env, maxBuffer: 64 << 20, timeout: 300_000 });
  if (input !== undefined) child.child.stdin?.end(input);
  try {
    const { stdout, stderr } = await child;
    return { code: 0, stdout, stderr };
  } catch (err) {
    const e = err as { code?: number | string; stdout?: string; stderr?: string; message: string };
    return { code: typeof e.code === 'number' ? e.code : 1, stdout: e.stdout ?? '', stderr: e.stderr ?? e.message };
  }
}

/** helm, which must succeed; its stdout. */
async function helm(...args: string[]): Promise<string> {
  const r = await run(helmBin, args);
  if (r.code !== 0) throw new Error(`helm ${args.join(' ')} failed (${r.code}):\n${r.stderr}`);
  return r.stdout;
}

const examplePath = (file: string) => join(CHART, 'examples', file);

/** `helm template` of the chart with these values files, parsed. */
async function render(...valuesFiles: string[]): Promise<Obj[]> {
  const out = await helm('template', 'magus', CHART, '--namespace', NS, ...valuesFiles.flatMap((f) => ['--values', f]));
  return (loadAllYaml(out) as (Obj | null)[]).filter((o): o is Obj => o !== null);
}

const ofKind = <T extends Obj = Obj>(objs: Obj[], kind: string): T[] => objs.filter((o) => o.kind === kind) as T[];

/** crds/<file> for every CustomResourceDefinition file in crds/. */
function repoCrdFiles(): string[] {
  return readdirSync(join(REPO, 'crds'))
    .filter((f) => f.endsWith('.yaml'))
    .filter((f) => (loadAllYaml(readFileSync(join(REPO, 'crds', f), 'utf8')) as (Obj | null)[]).some((o) => o?.kind === 'CustomResourceDefinition'))
    .sort();
}

/** crds/rbac.yaml's ClusterRoles: role name → rules. */
function repoRoles(): Map<string, Rule[]> {
  const docs = (loadAllYaml(readFileSync(join(REPO, 'crds', 'rbac.yaml'), 'utf8')) as ((Obj & { rules: Rule[] }) | null)[]).filter((o) => o !== null);
  return new Map(docs.map((d) => [d.metadata.name, d.rules]));
}

const env = (c: Container, name: string) => c.env?.find((e) => e.name === name);

interface ExampleValues {
  crds?: { install?: boolean };
  rbac?: { namespaces?: string[] };
  controller?: { watchNamespace?: string };
  worker?: { pipeline?: { secretNames?: string[] } };
}

/** Which process's ServiceAccount each role of crds/rbac.yaml is bound to. */
const ROLE_ACCOUNTS: Record<string, string> = {
  'magus-controller': 'magus-controller',
  'magus-controller-leader-election': 'magus-controller',
  'magus-runtime': 'magus-runtime',
  'magus-pipeline': 'magus-pipeline',
};

/** crds/rbac.yaml's rules of `role` as the chart must grant them with these values. */
function expectedRules(role: string, rules: Rule[], values: ExampleValues): Rule[] {
  const namespaced = (values.rbac?.namespaces ?? []).length > 0 || !!values.controller?.watchNamespace;
  const secretNames = values.worker?.pipeline?.secretNames ?? [];
  return rules.flatMap((r): Rule[] => {
    if (role === 'magus-pipeline' && r.resources?.includes('secrets')) return secretNames.length > 0 ? [{ ...r, resourceNames: secretNames }] : [];
    const resources = namespaced ? (r.resources ?? []).filter((x) => x !== 'nodes') : r.resources;
    return resources?.length ? [{ ...r, resources }] : [];
  });
}

/** The rendered RBAC against crds/rbac.yaml and the values (see the test that calls it). */
function expectRbac(objs: Obj[], values: ExampleValues): void {
  const watched = values.rbac?.namespaces?.length ? values.rbac.namespaces : values.controller?.watchNamespace ? [values.controller.watchNamespace] : [];
  const kind = watched.length > 0 ? 'Role' : 'ClusterRole';
  if (watched.length > 0) expect([...ofKind(objs, 'ClusterRole'), ...ofKind(objs, 'ClusterRoleBinding')]).toEqual([]);
  else expect(ofKind(objs, 'Role')).toEqual([]);
  const roles = ofKind<Obj & { rules: Rule[] }>(objs, kind);
  const bindings = [...ofKind<Binding>(objs, 'ClusterRoleBinding'), ...ofKind<Binding>(objs, 'RoleBinding')];
  const places = new Map<string, string[]>();
  for (const r of roles) {
    const name = `magus-${r.metadata.labels?.['magus.dev/role']}`;
    places.set(name, [...(places.get(name) ?? []), r.metadata.namespace ?? 'cluster']);
    expect({ role: name, rules: r.rules }).toEqual({ role: name, rules: expectedRules(name, repoRoles().get(name) ?? [], values) });
  }
  for (const b of bindings) {
    const name = `magus-${b.metadata.labels?.['magus.dev/role']}`;
    const role = roles.find((r) => r.metadata.name === b.roleRef.name && (kind === 'ClusterRole' || r.metadata.namespace === b.metadata.namespace));
    expect({ binding: b.metadata.name, roleRef: b.roleRef.kind, found: role !== undefined }).toEqual({ binding: b.metadata.name, roleRef: kind, found: true });
    expect({ name, subjects: b.subjects }).toEqual({ name, subjects: [{ kind: 'ServiceAccount', name: ROLE_ACCOUNTS[name], namespace: NS }] });
  }
  // Where each role is bound: the Lease role in the release namespace; the others cluster-wide or in each listed namespace.
  const boundAt = (name: string) =>
    bindings
      .filter((b) => `magus-${b.metadata.labels?.['magus.dev/role']}` === name)
      .map((b) => (b.kind === 'RoleBinding' ? b.metadata.namespace : 'cluster'))
      .sort();
  for (const name of repoRoles().keys()) {
    const at = name === 'magus-controller-leader-election' ? [NS] : watched.length > 0 ? [...watched].sort() : ['cluster'];
    expect({ name, boundAt: boundAt(name) }).toEqual({ name, boundAt: at });
    if (watched.length > 0) expect({ name, roles: (places.get(name) ?? []).sort() }).toEqual({ name, roles: at });
    else expect({ name, roles: places.get(name) }).toEqual({ name, roles: ['cluster'] });
  }
}

/** Values that must each be refused, and what the message must say. */
const BAD_VALUES: { why: string; values: string; message: RegExp; lintFails?: false }[] = [
  {
    why: 'a Temporal address that is not host:port',
    values: 'temporal: {address: "temporal frontend"}',
    message: /at '\/temporal\/address': 'temporal frontend' does not match pattern/,
  },
  { why: 'a NATS URL that is http://', values: 'nats: {url: "http://nats:4222"}', message: /at '\/nats\/url': 'http:\/\/nats:4222' does not match pattern/ },
  { why: 'negative replicas', values: 'worker: {pipeline: {replicas: -1}}', message: /at '\/worker\/pipeline\/replicas': minimum: got -1, want 0/ },
  { why: 'replicas as words', values: 'gateway: {replicas: two}', message: /at '\/gateway\/replicas': got string, want integer/ },
  { why: 'a misspelt key', values: 'gatway: {replicas: 2}', message: /additional properties 'gatway' not allowed/ },
  { why: 'a misspelt nested key', values: 'worker: {pipline: {replicas: 2}}', message: /at '\/worker': additional properties 'pipline' not allowed/ },
  {
    why: 'an unknown pull policy',
    values: 'image: {pullPolicy: Sometimes}',
    message: /at '\/image\/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'/,
  },
  {
    why: 'an allowed hub network that is neither a CIDR nor a kind',
    values: 'worker: {hubAllowNetworks: [intranet]}',
    message: /at '\/worker\/hubAllowNetworks\/0': 'intranet' does not match pattern/,
  },
  { why: 'an unknown runtime', values: 'worker: {runtime: docker}', message: /at '\/worker\/runtime': value must be one of 'kubernetes', 'local'/ },
  { why: 'an Ingress without hosts', values: 'gateway: {ingress: {enabled: true}}', message: /at '\/gateway\/ingress\/hosts': minItems: got 0, want 1/ },
  { why: 'a gateway without its Secret', values: 'gateway: {existingSecret: ""}', message: /at '\/gateway\/existingSecret': minLength: got 0, want 1/ },
  {
    why: 'a memory request that is no quantity',
    values: 'worker: {control: {resources: {requests: {memory: lots}}}}',
    message: /at '\/worker\/control\/resources\/requests\/memory'.*\n.*'lots' does not match pattern/,
  },
  { why: 'an S3 bucket name S3 refuses', values: 's3: {bucket: My_Bucket}', message: /at '\/s3\/bucket': 'My_Bucket' does not match pattern/ },
  {
    why: 'a cleanup timeout that is no duration',
    values: 'controller: {cleanupTimeout: soon}',
    message: /at '\/controller\/cleanupTimeout': 'soon' does not match pattern/,
  },
  { why: 'a watched namespace that is no namespace name', values: 'controller: {watchNamespace: Team_A}', message: /at '\/controller\/watchNamespace'/ },
  { why: 'a namespaced-mode namespace that is no namespace name', values: 'rbac: {namespaces: [team-a, Team_B]}', message: /at '\/rbac\/namespaces\/1'/ },
  { why: 'a namespace listed twice', values: 'rbac: {namespaces: [team-a, team-a]}', message: /at '\/rbac\/namespaces'.*items at 0 and 1 are equal/ },
  {
    why: 'a pipeline Secret name that is no Secret name',
    values: 'worker: {pipeline: {secretNames: [HF_TOKEN]}}',
    message: /at '\/worker\/pipeline\/secretNames\/0': 'HF_TOKEN' does not match pattern/,
  },
  { why: 'a privileged gateway port', values: 'gateway: {port: 80}', message: /at '\/gateway\/port': minimum: got 80, want 1,?024/ },
  { why: 'a session TTL under a minute', values: 'gateway: {sessionTtlMs: 5000}', message: /at '\/gateway\/sessionTtlMs': minimum: got 5,?000, want 60,?000/ },
  {
    why: 'a responses TTL that is no duration',
    values: 'gateway: {responsesTtl: a month}',
    message: /at '\/gateway\/responsesTtl': 'a month' does not match pattern/,
  },
  {
    why: 'a queue wait that is no duration',
    values: 'gateway: {maxQueueWait: 5 seconds}',
    message: /at '\/gateway\/maxQueueWait': '5 seconds' does not match pattern/,
  },
  // A cross-field rule JSON Schema cannot state: a `fail` in the template. helm lint reports it
  // (as [INFO] Fail: …) but passes: Helm's lint mode never fails on `fail`.
  {
    why: 'both rbac.namespaces and the deprecated controller.watchNamespace',
    values: 'rbac: {namespaces: [team-a]}\ncontroller: {watchNamespace: team-b}',
    message: /set rbac\.namespaces or the deprecated controller\.watchNamespace, not both/,
    lintFails: false,
  },
  {
    why: 'the worker’s two ports the same',
    values: 'worker: {healthPort: 9464}',
    message: /worker\.metricsPort and worker\.healthPort must differ \(both are 9464\)/,
    lintFails: false,
  },
  {
    why: 'the gateway’s API and operations ports the same',
    values: 'gateway: {healthPort: 8080}',
    message: /gateway\.port and gateway\.healthPort must differ \(both are 8080\)/,
    lintFails: false,
  },
  { why: 'a privileged gateway operations port', values: 'gateway: {healthPort: 443}', message: /at '\/gateway\/healthPort': minimum: got 443, want 1,?024/ },
  {
    why: 'an OpenAPI access the gateway does not know',
    values: 'gateway: {openApi: private}',
    message: /at '\/gateway\/openApi': value must be one of 'public', 'authenticated', 'off'/,
  },
];

beforeAll(async () => {
  // Resolves (and, the first time, builds) the pinned helm like the other servers.
  const { stdout } = await execFileP(join(REPO, 'scripts', 'dev-services'), ['--json', 'helm'], { maxBuffer: 1 << 20, timeout: 30 * 60_000 });
  helmBin = (JSON.parse(stdout.trim().split('\n').pop() ?? '{}') as { helm?: string }).helm ?? '';
  expect(helmBin).not.toBe('');
}, 30 * 60_000);

afterAll(() => rmSync(helmHome, { recursive: true, force: true }));

describe('the chart, rendered', () => {
  test('its CRDs are byte-identical copies of crds/*.yaml and files/rbac.yaml of crds/rbac.yaml', () => {
    const sync =
      'refresh the copies: cp crds/{model,dllama,session,apikey}.yaml charts/magus/files/crds/ && cp crds/rbac.yaml charts/magus/files/ (adjust to the CRD files crds/ holds)';
    const repo = repoCrdFiles();
    expect({ files: readdirSync(join(CHART, 'files', 'crds')).sort(), sync }).toEqual({ files: repo, sync });
    for (const f of repo) {
      const same = readFileSync(join(REPO, 'crds', f)).equals(readFileSync(join(CHART, 'files', 'crds', f)));
      expect({ file: f, same, sync }).toEqual({ file: f, same: true, sync });
    }
    const rbacSame = readFileSync(join(REPO, 'crds', 'rbac.yaml')).equals(readFileSync(join(CHART, 'files', 'rbac.yaml')));
    expect({ file: 'rbac.yaml', same: rbacSame, sync }).toEqual({ file: 'rbac.yaml', same: true, sync });
  });

  test('helm lint --strict passes with the defaults and with every example values file', async () => {
    expect(EXAMPLES.length).toBeGreaterThanOrEqual(4);
    for (const values of [[], ...EXAMPLES.map((f) => ['--values', examplePath(f)])]) {
      const r = await run(helmBin, ['lint', CHART, '--strict', ...values]);
      expect({ values, code: r.code, out: r.stdout + r.stderr }).toEqual({
        values,
        code: 0,
        out: expect.stringContaining('1 chart(s) linted, 0 chart(s) failed') as unknown,
      });
    }
  });

  test.each(EXAMPLES)('helm template %s: CRDs and RBAC as in crds/, secrets only by reference, pods non-root on a read-only root with /tmp', async (file) => {
    const objs = await render(examplePath(file));
    const values = loadAllYaml(readFileSync(examplePath(file), 'utf8'))[0] as ExampleValues;

    // CRDs: the repository's, annotated to be kept on uninstall.
    const crds = ofKind<Obj & { spec: unknown }>(objs, 'CustomResourceDefinition');
    if (values.crds?.install === false) expect(crds).toEqual([]);
    else {
      const repo = repoCrdFiles().map(
        (f) =>
          (loadAllYaml(readFileSync(join(REPO, 'crds', f), 'utf8')) as Obj[]).find((o) => o.kind === 'CustomResourceDefinition') as Obj & { spec: unknown },
      );
      expect(crds.map((c) => c.metadata.name).sort()).toEqual(repo.map((c) => c.metadata.name).sort());
      for (const c of crds) {
        expect(c.spec).toEqual(repo.find((r) => r.metadata.name === c.metadata.name)?.spec);
        expect(c.metadata.annotations?.['helm.sh/resource-policy']).toBe('keep');
      }
    }

    // RBAC: every role of crds/rbac.yaml with its rules (the pipeline's Secret rule narrowed to
    // worker.pipeline.secretNames; in namespaced mode the cluster-scoped rules left out), bound
    // once per place to its process's ServiceAccount: cluster-wide as ClusterRoles, namespaced as
    // Roles in every listed namespace and no ClusterRole or ClusterRoleBinding at all.
    expectRbac(objs, values);

    // No Secret is rendered, and no secret value is inline.
    expect(ofKind(objs, 'Secret')).toEqual([]);

    const deployments = ofKind<Deployment>(objs, 'Deployment');
    expect(deployments.map((d) => d.metadata.name).sort()).toEqual(['magus-controller', 'magus-gateway', 'magus-worker-control', 'magus-worker-pipeline']);
    for (const d of deployments) {
      const pod = d.spec.template.spec;
      const where = d.metadata.name;
      expect({ where, runAsNonRoot: pod.securityContext?.runAsNonRoot }).toEqual({ where, runAsNonRoot: true });
      const tmp = pod.volumes?.find((v) => v.name === 'tmp');
      expect({ where, tmpIsEmptyDir: tmp?.emptyDir !== undefined }).toEqual({ where, tmpIsEmptyDir: true });
      for (const c of pod.containers) {
        expect({ where, securityContext: c.securityContext }).toEqual({
          where,
          securityContext: { readOnlyRootFilesystem: true, allowPrivilegeEscalation: false, capabilities: { drop: ['ALL'] } },
        });
        expect({ where, tmp: c.volumeMounts?.find((m) => m.mountPath === '/tmp')?.name, home: env(c, 'HOME')?.value }).toEqual({
          where,
          tmp: 'tmp',
          home: '/tmp',
        });
        // Every probe names a port the container declares.
        const portNames = (c.ports ?? []).map((p) => p.name);
        for (const probe of [c.startupProbe, c.livenessProbe, c.readinessProbe]) {
          expect({ where, port: probe?.httpGet?.port, declared: portNames.includes(String(probe?.httpGet?.port)) }).toEqual({
            where,
            port: probe?.httpGet?.port,
            declared: true,
          });
        }
        for (const name of ['AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY', 'MAGUS_GATEWAY_SECRET', 'MAGUS_GATEWAY_TOKENS']) {
          expect({ where, name, inline: env(c, name)?.value }).toEqual({ where, name, inline: undefined });
        }
      }
    }
    // The gateway alone has no API token in its pods.
    for (const d of deployments)
      expect({ d: d.metadata.name, automount: d.spec.template.spec.automountServiceAccountToken }).toEqual({
        d: d.metadata.name,
        automount: d.metadata.name === 'magus-gateway' ? false : undefined,
      });
  });

  test('the defaults include the NetworkPolicies: the gateway open on its API port, it, the controller and the workers only on their health/metrics ports, instance pods only from each other', async () => {
    type Policy = Obj & {
      spec: {
        podSelector: { matchLabels: Record<string, string> };
        policyTypes: string[];
        ingress?: { from?: unknown[]; ports?: { port: number }[] }[];
        egress?: { to?: unknown[]; ports?: { port: number; protocol: string }[] }[];
      };
    };
    const policies = async (...set: string[]) => {
      const out = await helm('template', 'magus', CHART, '--namespace', NS, ...set.flatMap((v) => ['--set', v]));
      return ofKind<Policy>(
        (loadAllYaml(out) as (Obj | null)[]).filter((o): o is Obj => o !== null),
        'NetworkPolicy',
      );
    };
    const defaults = await policies();
    const byName = new Map(defaults.map((p) => [p.metadata.name, p]));
    expect(defaults.map((p) => `${p.metadata.namespace}/${p.metadata.name}`).sort()).toEqual(
      ['magus-controller', 'magus-gateway', 'magus-instances', 'magus-worker'].map((n) => `${NS}/${n}`),
    );
    const ingressPorts = (name: string) => byName.get(name)?.spec.ingress?.map((r) => ({ from: r.from, ports: r.ports?.map((p) => p.port) }));
    expect({
      gateway: ingressPorts('magus-gateway'),
      controller: ingressPorts('magus-controller'),
      worker: ingressPorts('magus-worker'),
    }).toEqual({
      gateway: [
        { from: undefined, ports: [8080] },
        { from: undefined, ports: [9467] },
      ],
      controller: [{ from: undefined, ports: [9466] }],
      worker: [{ from: undefined, ports: [9464, 9465] }],
    });
    for (const name of ['magus-gateway', 'magus-controller', 'magus-worker'])
      expect({ name, types: byName.get(name)?.spec.policyTypes }).toEqual({ name, types: ['Ingress'] });
    const instanceLabels = { 'app.kubernetes.io/part-of': 'magus', 'app.kubernetes.io/component': 'instance' };
    const instances = byName.get('magus-instances')!;
    expect(instances.spec.podSelector.matchLabels).toEqual(instanceLabels);
    expect(instances.spec.policyTypes).toEqual(['Ingress', 'Egress']);
    expect(instances.spec.ingress).toEqual([{ from: [{ podSelector: { matchLabels: instanceLabels } }] }]);
    expect(instances.spec.egress?.map((r) => r.ports?.map((p) => `${p.port}/${p.protocol}`) ?? 'instance pods')).toEqual([
      'instance pods',
      ['4222/TCP'],
      ['443/TCP', '9000/TCP'],
      ['53/UDP', '53/TCP'],
    ]);
    // Namespaced mode: the instance policy in every listed namespace; switched off: none at all.
    expect(
      (await policies('rbac.namespaces={team-a,team-b}'))
        .filter((p) => p.metadata.name === 'magus-instances')
        .map((p) => p.metadata.namespace)
        .sort(),
    ).toEqual(['team-a', 'team-b']);
    expect(await policies('networkPolicy.enabled=false')).toEqual([]);
  });

  test('the workers: two Deployments (control, pipeline) scaled and sized apart, running the Kubernetes runtime with its settings', async () => {
    const objs = await render(examplePath('values-production.yaml'));
    const worker = (queue: string) => ofKind<Deployment>(objs, 'Deployment').find((d) => d.metadata.name === `magus-worker-${queue}`)!;
    expect([worker('control').spec.replicas, worker('pipeline').spec.replicas]).toEqual([2, 3]);
    const c = worker('pipeline').spec.template.spec.containers[0]!;
    expect(c.args).toEqual(['worker']);
    const value = (name: string) => env(c, name)?.value;
    expect({
      MAGUS_RUNTIME: value('MAGUS_RUNTIME'),
      MAGUS_K8S_MAGUS_IMAGE: value('MAGUS_K8S_MAGUS_IMAGE'),
      MAGUS_K8S_DLLAMA_IMAGE: value('MAGUS_K8S_DLLAMA_IMAGE'),
      MAGUS_K8S_NATS_URL: value('MAGUS_K8S_NATS_URL'),
      MAGUS_K8S_S3_SECRET: value('MAGUS_K8S_S3_SECRET'),
      MAGUS_K8S_INSTANCE_SERVICE_ACCOUNT: value('MAGUS_K8S_INSTANCE_SERVICE_ACCOUNT'),
      MAGUS_HEALTH_ADDRESS: value('MAGUS_HEALTH_ADDRESS'),
      MAGUS_METRICS_ADDRESS: value('MAGUS_METRICS_ADDRESS'),
      MAGUS_MODEL_CACHE: value('MAGUS_MODEL_CACHE'),
      MAGUS_TEMPORAL_NAMESPACE: value('MAGUS_TEMPORAL_NAMESPACE'),
      MAGUS_S3_ENDPOINT: value('MAGUS_S3_ENDPOINT'),
      MAGUS_CONVERT_THREADS: value('MAGUS_CONVERT_THREADS'),
      MAGUS_RESPONSES_RETENTION_MS: value('MAGUS_RESPONSES_RETENTION_MS'),
      MAGUS_NATS_REPLICAS: value('MAGUS_NATS_REPLICAS'),
      MAGUS_HUB_ALLOW_NETWORKS: value('MAGUS_HUB_ALLOW_NETWORKS'),
    }).toEqual({
      MAGUS_RUNTIME: 'kubernetes',
      MAGUS_K8S_MAGUS_IMAGE: 'registry.example.com/magus/magus:0.1.0',
      MAGUS_K8S_DLLAMA_IMAGE: 'registry.example.com/magus/magus-dllama:0.1.0',
      MAGUS_K8S_NATS_URL: 'nats://nats.nats.svc:4222',
      MAGUS_K8S_S3_SECRET: 'magus-s3',
      MAGUS_K8S_INSTANCE_SERVICE_ACCOUNT: 'magus-instance',
      MAGUS_HEALTH_ADDRESS: '0.0.0.0:9465',
      MAGUS_METRICS_ADDRESS: '0.0.0.0:9464',
      MAGUS_MODEL_CACHE: '/tmp/models',
      MAGUS_TEMPORAL_NAMESPACE: 'magus',
      MAGUS_S3_ENDPOINT: 'https://s3.example.com',
      MAGUS_CONVERT_THREADS: '4',
      MAGUS_RESPONSES_RETENTION_MS: '600000',
      MAGUS_NATS_REPLICAS: '3',
      MAGUS_HUB_ALLOW_NETWORKS: '10.20.0.0/16',
    });
    expect(env(c, 'AWS_SECRET_ACCESS_KEY')?.valueFrom).toEqual({ secretKeyRef: { name: 'magus-s3', key: 'AWS_SECRET_ACCESS_KEY' } });
    const pdb = ofKind<Obj & { spec: { minAvailable?: number; maxUnavailable?: number } }>(objs, 'PodDisruptionBudget').find(
      (p) => p.metadata.name === 'magus-worker-pipeline',
    );
    expect(pdb?.spec).toMatchObject({ minAvailable: 2 });
    expect(pdb?.spec.maxUnavailable).toBeUndefined();
  });

  test('the gateway: its HMAC key from an existing Secret as a file, replica id = pod name, the Ingress serving /v1 only', async () => {
    const objs = await render(examplePath('values-production.yaml'));
    const gw = ofKind<Deployment>(objs, 'Deployment').find((d) => d.metadata.name === 'magus-gateway')!;
    const pod = gw.spec.template.spec;
    const c = pod.containers[0]!;
    expect(c.args).toEqual(['gateway']);
    expect(env(c, 'MAGUS_GATEWAY_SECRET_FILE')?.value).toBe('/etc/magus/gateway-secret/secret');
    expect(pod.volumes?.find((v) => v.name === 'gateway-secret')?.secret?.secretName).toBe('magus-gateway');
    expect(env(c, 'MAGUS_GATEWAY_REPLICA_ID')?.valueFrom).toEqual({ fieldRef: { fieldPath: 'metadata.name' } });
    expect(env(c, 'MAGUS_GATEWAY_REQUEST_TIMEOUT_MS')?.value).toBe('600000');
    expect(env(c, 'MAGUS_SESSION_TTL_MS')?.value).toBe('1800000');
    // Its NATS user: the gateway role's file of the Secret magus nats-auth's files are in; the workers' and the controller's likewise.
    expect(env(c, 'MAGUS_NATS_CREDENTIALS')?.value).toBe('/etc/magus/nats/creds');
    const natsVolume = (d: Deployment) => d.spec.template.spec.volumes?.find((v) => v.name === 'nats-credentials')?.secret;
    expect(natsVolume(gw)).toMatchObject({ secretName: 'magus-nats', items: [{ key: 'gateway.creds', path: 'creds' }] });
    for (const d of ofKind<Deployment>(objs, 'Deployment').filter((x) => x.metadata.name !== 'magus-gateway')) {
      const role = d.metadata.name === 'magus-controller' ? 'controller' : 'worker';
      expect(natsVolume(d)?.items).toEqual([
        { key: `${role}.creds`, path: 'creds' },
        // The signer only for the worker that runs instances (the pipeline's runs none).
        ...(role === 'worker' && !d.metadata.name.endsWith('-pipeline') ? [{ key: 'bridge-signer.nk', path: 'bridge-signer' }] : []),
      ]);
    }
    // Two ports: the API, and the operations listener the probes use and the ServiceMonitor scrapes;
    // the gateway's own Service (a LoadBalancer, say) publishes only the API.
    expect(c.ports).toEqual([
      { name: 'http', containerPort: 8080, protocol: 'TCP' },
      { name: 'health', containerPort: 9467, protocol: 'TCP' },
    ]);
    expect([c.startupProbe, c.livenessProbe, c.readinessProbe].map((p) => `${p?.httpGet?.path} ${p?.httpGet?.port}`)).toEqual([
      '/healthz health',
      '/healthz health',
      '/readyz health',
    ]);
    expect([env(c, 'MAGUS_GATEWAY_HEALTH_ADDRESS')?.value, env(c, 'MAGUS_GATEWAY_OPENAPI')?.value]).toEqual(['0.0.0.0:9467', 'authenticated']);
    type Service = Obj & { spec: { clusterIP?: string; ports: { name: string; port: number; targetPort: string }[] } };
    const service = (name: string) => ofKind<Service>(objs, 'Service').find((x) => x.metadata.name === name)!;
    expect(service('magus-gateway').spec.ports.map((p) => `${p.name} ${p.port}→${p.targetPort}`)).toEqual(['http 80→http']);
    expect(service('magus-gateway-metrics').spec).toMatchObject({ clusterIP: 'None', ports: [{ name: 'health', port: 9467, targetPort: 'health' }] });
    expect(service('magus-gateway-metrics').metadata.labels?.['magus.dev/metrics']).toBe('true');
    const monitor = ofKind<Obj & { spec: { selector: { matchLabels: Record<string, string> }; endpoints: { port: string; path: string }[] } }>(
      objs,
      'ServiceMonitor',
    ).find((m) => m.metadata.name === 'magus-gateway')!;
    expect(monitor.spec.endpoints.map((e) => `${e.port} ${e.path}`)).toEqual(['health /metrics']);
    expect(monitor.spec.selector.matchLabels['magus.dev/metrics']).toBe('true');
    const ingress = ofKind<Obj & { spec: { rules: { host: string; http: { paths: { path: string }[] } }[] } }>(objs, 'Ingress');
    expect(ingress.flatMap((i) => i.spec.rules.flatMap((r) => r.http.paths.map((p) => `${r.host}${p.path}`)))).toEqual(['llm.example.com/v1']);
    // NetworkPolicies: the instance policy lives in the model namespace; ServiceMonitors for all three.
    expect(
      ofKind(objs, 'NetworkPolicy')
        .map((n) => `${n.metadata.namespace}/${n.metadata.name}`)
        .sort(),
    ).toEqual([`${NS}/magus-controller`, `${NS}/magus-gateway`, `${NS}/magus-worker`, 'models/magus-instances']);
    expect(
      ofKind(objs, 'ServiceMonitor')
        .map((s) => s.metadata.name)
        .sort(),
    ).toEqual(['magus-controller', 'magus-gateway', 'magus-worker']);
  });

  test.each(EXAMPLES)('the environment %s gives the worker and the gateway is one their own configuration loaders accept', async (file) => {
    const objs = await render(examplePath(file));
    const dir = mkdtempSync(join(tmpdir(), 'magus-chart-env-'));
    try {
      // What the kubelet would fill in: the pod's fields, the Secrets' values, the mounted files.
      const resolve = (c: Container, files: Record<string, string>): NodeJS.ProcessEnv =>
        Object.fromEntries(
          (c.env ?? []).map((e) => {
            if (e.value !== undefined) return [e.name, files[e.value] ?? e.value];
            const from = e.valueFrom as { fieldRef?: { fieldPath: string }; secretKeyRef?: unknown };
            return [e.name, from.fieldRef ? (from.fieldRef.fieldPath === 'metadata.namespace' ? NS : 'magus-gateway-7d9f8-abcde') : 'from-a-secret'];
          }),
        );
      const secretFile = join(dir, 'secret');
      const tokensFile = join(dir, 'tokens.json');
      writeFileSync(secretFile, 'k'.repeat(64));
      writeFileSync(tokensFile, '{}');
      // The files of magus nats-auth the pods mount (a role's own credentials, and the signer the worker makes bridge users with).
      const credsFile = join(dir, 'creds');
      const signerFile = join(dir, 'bridge-signer');
      const authority = await newNatsAuthority();
      writeFileSync(
        credsFile,
        await roleCredentialsText({ account: authority.account.publicKey, signerSeed: authority.signerSeed }, 'worker', dataPlaneNames('')),
      );
      writeFileSync(signerFile, signerFileText(authority));
      const files = {
        '/etc/magus/gateway-secret/secret': secretFile,
        '/etc/magus/gateway-tokens/tokens.json': tokensFile,
        '/etc/magus/nats/creds': credsFile,
        '/etc/magus/nats/bridge-signer': signerFile,
      };
      for (const d of ofKind<Deployment>(objs, 'Deployment')) {
        const c = d.spec.template.spec.containers[0]!;
        const env = resolve(c, files);
        if (c.args?.[0] === 'worker') {
          const cfg = loadConfig(env);
          expect({ d: d.metadata.name, runtime: cfg.runtime?.kind }).toEqual({ d: d.metadata.name, runtime: env.MAGUS_RUNTIME });
          // Each worker Deployment polls its own queue only.
          expect(cfg.queues).toBe(d.metadata.name.endsWith('-pipeline') ? 'pipeline' : 'control');
        }
        if (c.args?.[0] === 'gateway') {
          const cfg = loadGatewayConfig(env);
          expect(cfg.port).toBe(8080);
          expect([cfg.healthAddress, cfg.settings.openApi]).toEqual([{ host: '0.0.0.0', port: 9467 }, 'authenticated']);
          // First turns start session workflows: the gateway reaches the chart's Temporal, not its default.
          expect(cfg.temporal).toEqual({ address: env.MAGUS_TEMPORAL_ADDRESS, namespace: env.MAGUS_TEMPORAL_NAMESPACE, taskQueue: env.MAGUS_TASK_QUEUE });
        }
        if (c.args?.[0] === 'controller') expect(loadConfig(env).temporal.address).toBe(env.MAGUS_TEMPORAL_ADDRESS);
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test.each(BAD_VALUES)('the chart refuses $why, naming the field (helm lint and helm template)', async ({ values, message, lintFails }) => {
    const dir = mkdtempSync(join(tmpdir(), 'magus-bad-values-'));
    try {
      const file = join(dir, 'values.yaml');
      writeFileSync(file, `${values}\n`);
      const lint = await run(helmBin, ['lint', CHART, '--values', file]);
      expect({ code: lint.code, out: lint.stdout + lint.stderr }).toEqual({
        code: lintFails === false ? 0 : 1,
        out: expect.stringMatching(message) as unknown,
      });
      const template = await run(helmBin, ['template', 'magus', CHART, '--values', file]);
      expect({ code: template.code, out: template.stderr }).toEqual({ code: 1, out: expect.stringMatching(message) as unknown });
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('on a test cluster (kube-apiserver, controller-manager, scheduler, kwok)', () => {
  let cluster: TestCluster;
  let apps: AppsV1Api;
  let core: CoreV1Api;

  /** A stand-in for the Prometheus Operator's ServiceMonitor CRD (not vendored here): the kind exists, its spec is not checked. */
  const serviceMonitorCrd = {
    apiVersion: 'apiextensions.k8s.io/v1',
    kind: 'CustomResourceDefinition',
    metadata: { name: 'servicemonitors.monitoring.coreos.com' },
    spec: {
      group: 'monitoring.coreos.com',
      scope: 'Namespaced',
      names: { kind: 'ServiceMonitor', listKind: 'ServiceMonitorList', plural: 'servicemonitors', singular: 'servicemonitor' },
      versions: [
        {
          name: 'v1',
          served: true,
          storage: true,
          schema: { openAPIV3Schema: { type: 'object', properties: { spec: { type: 'object', 'x-kubernetes-preserve-unknown-fields': true } } } },
        },
      ],
    },
  };

  beforeAll(async () => {
    cluster = await startTestCluster();
    apps = cluster.kubeConfig.makeApiClient(AppsV1Api);
    core = cluster.kubeConfig.makeApiClient(CoreV1Api);
    kubeconfigFile = join(helmHome, 'kubeconfig');
    writeKubeconfig(kubeconfigFile, { server: cluster.server, token: cluster.token });
    for (const ns of [NS, 'models', 'team-a', 'team-b']) await cluster.createNamespace(ns);
    const extensions = cluster.kubeConfig.makeApiClient(ApiextensionsV1Api);
    await extensions.createCustomResourceDefinition({ body: serviceMonitorCrd });
    // The Secrets the values name (kwok runs nothing, so nothing reads them; they make the install what a user's is).
    await core.createNamespacedSecret({ namespace: NS, body: { metadata: { name: 'magus-gateway' }, stringData: { secret: 'x'.repeat(64) } } });
    await core.createNamespacedSecret({
      namespace: NS,
      body: { metadata: { name: 'magus-s3' }, stringData: { AWS_ACCESS_KEY_ID: 'test', AWS_SECRET_ACCESS_KEY: 'test-secret' } },
    });
    await eventually(async () => {
      const crd = await extensions.readCustomResourceDefinition({ name: serviceMonitorCrd.metadata.name });
      expect(crd.status?.conditions?.find((c) => c.type === 'Established')?.status).toBe('True');
    });
  }, 300_000);

  afterAll(async () => {
    await cluster?.stop();
  }, 60_000);

  test.each(EXAMPLES)('the API server accepts every object %s renders (server-side dry-run, strict field validation)', async (file) => {
    const manifests = await helm('template', 'magus', CHART, '--namespace', NS, '--values', examplePath(file));
    const r = await run(
      'kubectl',
      ['apply', '--server-side', '--dry-run=server', '--field-manager=magus-chart-test', '--validate=strict', '-f', '-'],
      manifests,
    );
    expect({ code: r.code, stderr: r.stderr }).toEqual({ code: 0, stderr: '' });
    // One line per object: nothing was skipped.
    expect(r.stdout.trim().split('\n')).toHaveLength((loadAllYaml(manifests) as unknown[]).filter(Boolean).length);
  });

  /** The release's Deployments, each available with all its replicas. */
  async function expectAllAvailable(expected: Record<string, number>): Promise<V1Deployment[]> {
    return eventually(async () => {
      const list = (await apps.listNamespacedDeployment({ namespace: NS, labelSelector: 'app.kubernetes.io/instance=magus' })).items;
      const state = Object.fromEntries(
        list.map((d) => [
          d.metadata!.name!,
          {
            replicas: d.spec?.replicas,
            available: d.status?.availableReplicas ?? 0,
            updated: d.status?.updatedReplicas ?? 0,
            total: d.status?.replicas ?? 0,
            condition: d.status?.conditions?.find((c) => c.type === 'Available')?.status,
            observed: (d.status?.observedGeneration ?? 0) >= (d.metadata?.generation ?? 1),
          },
        ]),
      );
      const want = Object.fromEntries(
        Object.entries(expected).map(([name, n]) => [name, { replicas: n, available: n, updated: n, total: n, condition: 'True', observed: true }]),
      );
      expect(state).toEqual(want);
      return list;
    }, 120_000);
  }

  test('helm install: every Deployment becomes available, the CRDs are Established, NOTES show the first kubectl and curl', async () => {
    // The pipeline may read the hub token Secret hf-token, and no other (the can-i test below).
    const out = await helm(
      'install',
      'magus',
      CHART,
      '--namespace',
      NS,
      '--values',
      examplePath('values-minimal.yaml'),
      '--set',
      'worker.pipeline.secretNames={hf-token}',
      '--wait',
      '--timeout',
      '3m',
    );
    expect(out).toContain('STATUS: deployed');
    expect(out).toContain(`kubectl -n ${NS} get deployments -l app.kubernetes.io/instance=magus`);
    expect(out).toContain('kubectl label secret my-key-token magus.dev/api-key=my-key');
    expect(out).toContain('kind: ApiKey');
    expect(out).toContain(`kubectl -n ${NS} port-forward service/magus-gateway 8080:80`);
    expect(out).toContain('curl -N http://127.0.0.1:8080/v1/chat/completions');
    await expectAllAvailable({ 'magus-controller': 2, 'magus-gateway': 2, 'magus-worker-control': 1, 'magus-worker-pipeline': 1 });

    const extensions = cluster.kubeConfig.makeApiClient(ApiextensionsV1Api);
    for (const name of ['models.magus.dev', 'dllamas.magus.dev', 'sessions.magus.dev', 'apikeys.magus.dev']) {
      const crd = await extensions.readCustomResourceDefinition({ name });
      expect({ name, established: crd.status?.conditions?.find((c) => c.type === 'Established')?.status }).toEqual({ name, established: 'True' });
    }
    // The pods run as the chart's ServiceAccounts, with the settings of values-minimal.yaml.
    const pods = (await core.listNamespacedPod({ namespace: NS, labelSelector: 'app.kubernetes.io/instance=magus' })).items;
    expect(pods).toHaveLength(6);
    for (const p of pods) {
      expect({ pod: p.metadata?.name, ready: p.status?.conditions?.find((c) => c.type === 'Ready')?.status }).toEqual({ pod: p.metadata?.name, ready: 'True' });
      const component = p.metadata?.labels?.['app.kubernetes.io/component'];
      const queue = p.metadata?.labels?.['magus.dev/task-queue'];
      // The workers run as two accounts: the control queue's (status, instances) and the pipeline's.
      const account = component === 'worker' ? (queue === 'pipeline' ? 'magus-pipeline' : 'magus-runtime') : `magus-${component}`;
      expect({ pod: p.metadata?.name, account: p.spec?.serviceAccountName }).toEqual({ pod: p.metadata?.name, account });
    }
    const worker = pods.find((p) => p.metadata?.labels?.['magus.dev/task-queue'] === 'pipeline')!;
    expect(worker.spec?.containers[0]?.env?.find((e) => e.name === 'MAGUS_S3_ENDPOINT')?.value).toBe('http://minio.minio.svc:9000');
  });

  /**
   * `kubectl auth can-i VERB RESOURCE --as system:serviceaccount:<saNamespace>:<sa>` on the test
   * cluster: 'yes' or 'no' (anything else fails the test). `resource` may be `kind/name`;
   * `namespace` '' asks about a cluster-scoped resource.
   */
  async function canI(
    sa: string,
    verb: string,
    resource: string,
    namespace: string,
    opts: { saNamespace?: string; subresource?: string } = {},
  ): Promise<string> {
    const args = ['auth', 'can-i', verb, resource, `--as=system:serviceaccount:${opts.saNamespace ?? NS}:${sa}`];
    if (namespace) args.push('--namespace', namespace);
    if (opts.subresource) args.push('--subresource', opts.subresource);
    const r = await run('kubectl', args);
    const answer = r.stdout.trim();
    if (answer !== 'yes' && answer !== 'no') throw new Error(`kubectl ${args.join(' ')}: ${r.code} ${r.stdout} ${r.stderr}`);
    return answer;
  }

  /** `kubectl auth can-i --list` of a ServiceAccount in `namespace`: every rule it holds there, cluster-wide ones included. */
  async function rulesOf(sa: string, namespace: string, saNamespace = NS): Promise<string> {
    const r = await run('kubectl', ['auth', 'can-i', '--list', '--namespace', namespace, `--as=system:serviceaccount:${saNamespace}:${sa}`]);
    if (r.code !== 0) throw new Error(`kubectl auth can-i --list: ${r.stderr}`);
    return r.stdout;
  }

  test('cluster-wide (the defaults): kubectl auth can-i --as each ServiceAccount — the runtime runs instances but reads no Secret, the pipeline reads only its named Secret and runs nothing', async () => {
    const runtime = (verb: string, resource: string, ns = 'models', subresource?: string) => canI('magus-runtime', verb, resource, ns, { subresource });
    const pipeline = (verb: string, resource: string, ns = 'models', subresource?: string) => canI('magus-pipeline', verb, resource, ns, { subresource });
    const controller = (verb: string, resource: string, ns = 'models', subresource?: string) => canI('magus-controller', verb, resource, ns, { subresource });
    expect({
      runtimePatchesModelStatus: await runtime('patch', 'models.magus.dev', 'models', 'status'),
      runtimePatchesModels: await runtime('patch', 'models.magus.dev'),
      runtimeCreatesStatefulSets: await runtime('create', 'statefulsets.apps'),
      runtimeDeletesServices: await runtime('delete', 'services'),
      runtimePatchesNetworkPolicies: await runtime('patch', 'networkpolicies.networking.k8s.io'),
      runtimeWatchesPods: await runtime('watch', 'pods'),
      runtimeCreatesPods: await runtime('create', 'pods'),
      runtimeListsNodes: await runtime('list', 'nodes', ''),
      runtimePatchesDllamas: await runtime('patch', 'dllamas.magus.dev'),
      // Each instance's network key and NATS credentials: created, never read back.
      runtimeCreatesSecrets: await runtime('create', 'secrets'),
      runtimeGetsSecrets: await runtime('get', 'secrets'),
      runtimeListsSecrets: await runtime('list', 'secrets'),
      runtimeGetsTheHubToken: await runtime('get', 'secrets/hf-token'),
      runtimeGetsItsOwnNamespacesSecrets: await runtime('get', 'secrets', NS),
      pipelineGetsTheHubToken: await pipeline('get', 'secrets/hf-token'),
      pipelineGetsAnotherSecret: await pipeline('get', 'secrets/magus-s3', NS),
      pipelineGetsSecrets: await pipeline('get', 'secrets'),
      pipelineListsSecrets: await pipeline('list', 'secrets'),
      pipelineCreatesStatefulSets: await pipeline('create', 'statefulsets.apps'),
      pipelineCreatesPods: await pipeline('create', 'pods'),
      pipelineCreatesServices: await pipeline('create', 'services'),
      pipelineCreatesConfigMaps: await pipeline('create', 'configmaps'),
      pipelinePatchesNetworkPolicies: await pipeline('patch', 'networkpolicies.networking.k8s.io'),
      pipelinePatchesModelStatus: await pipeline('patch', 'models.magus.dev', 'models', 'status'),
      pipelineListsNodes: await pipeline('list', 'nodes', ''),
      controllerPatchesModels: await controller('patch', 'models.magus.dev'),
      controllerPatchesModelStatus: await controller('patch', 'models.magus.dev', 'models', 'status'),
      controllerTakesItsLease: await controller('update', 'leases.coordination.k8s.io', NS),
      controllerTakesLeasesElsewhere: await controller('update', 'leases.coordination.k8s.io'),
      gatewayGetsModels: await canI('magus-gateway', 'get', 'models.magus.dev', 'models'),
      gatewayGetsSecrets: await canI('magus-gateway', 'get', 'secrets', NS),
    }).toEqual({
      runtimePatchesModelStatus: 'yes',
      runtimePatchesModels: 'no',
      runtimeCreatesStatefulSets: 'yes',
      runtimeDeletesServices: 'yes',
      runtimePatchesNetworkPolicies: 'yes',
      runtimeWatchesPods: 'yes',
      runtimeCreatesPods: 'no',
      runtimeListsNodes: 'yes',
      runtimePatchesDllamas: 'no',
      runtimeCreatesSecrets: 'yes',
      runtimeGetsSecrets: 'no',
      runtimeListsSecrets: 'no',
      runtimeGetsTheHubToken: 'no',
      runtimeGetsItsOwnNamespacesSecrets: 'no',
      pipelineGetsTheHubToken: 'yes',
      pipelineGetsAnotherSecret: 'no',
      pipelineGetsSecrets: 'no',
      pipelineListsSecrets: 'no',
      pipelineCreatesStatefulSets: 'no',
      pipelineCreatesPods: 'no',
      pipelineCreatesServices: 'no',
      pipelineCreatesConfigMaps: 'no',
      pipelinePatchesNetworkPolicies: 'no',
      pipelinePatchesModelStatus: 'no',
      pipelineListsNodes: 'no',
      controllerPatchesModels: 'yes',
      controllerPatchesModelStatus: 'no',
      controllerTakesItsLease: 'yes',
      controllerTakesLeasesElsewhere: 'no',
      gatewayGetsModels: 'no',
      gatewayGetsSecrets: 'no',
    });
  });

  test('namespaced mode (values-namespaced.yaml: team-a, team-b) applied to the API server: no ClusterRole or ClusterRoleBinding, every account confined to the listed namespaces (kubectl auth can-i --as)', async () => {
    // Its own release and namespace, beside the cluster-wide install of the other tests.
    const release = 'magus-teams';
    const home = 'magus-ns';
    await cluster.createNamespace(home);
    const objs = (
      loadAllYaml(await helm('template', release, CHART, '--namespace', home, '--values', examplePath('values-namespaced.yaml'))) as (Obj | null)[]
    ).filter((o): o is Obj => o !== null);
    const kinds = [...new Set(objs.map((o) => o.kind))];
    expect(kinds.filter((k) => k.startsWith('Cluster') || k === 'CustomResourceDefinition')).toEqual([]);
    const rbac = objs.filter((o) => ['ServiceAccount', 'Role', 'RoleBinding'].includes(o.kind));
    expect(
      rbac
        .filter((o) => o.kind === 'Role')
        .map((o) => `${o.metadata.namespace}/${o.metadata.name}`)
        .sort(),
    ).toEqual([
      `${home}/${release}-controller-leader-election`,
      ...['team-a', 'team-b'].flatMap((ns) => ['controller', 'pipeline', 'runtime'].map((r) => `${ns}/${release}-${r}`)),
    ]);
    const applied = await run(
      'kubectl',
      ['apply', '--server-side', '--field-manager=magus-chart-test', '-f', '-'],
      JSON.stringify({ apiVersion: 'v1', kind: 'List', items: rbac }),
    );
    expect({ code: applied.code, stderr: applied.stderr }).toEqual({ code: 0, stderr: '' });

    const as = (sa: string, verb: string, resource: string, ns: string, subresource?: string) =>
      canI(`${release}-${sa}`, verb, resource, ns, { saNamespace: home, subresource });
    const answers: Record<string, string> = {};
    for (const ns of ['team-a', 'team-b', 'models', home]) {
      answers[`${ns}: runtime creates StatefulSets`] = await as('runtime', 'create', 'statefulsets.apps', ns);
      answers[`${ns}: runtime creates Secrets`] = await as('runtime', 'create', 'secrets', ns);
      answers[`${ns}: runtime gets Secrets`] = await as('runtime', 'get', 'secrets', ns);
      answers[`${ns}: runtime lists Secrets`] = await as('runtime', 'list', 'secrets', ns);
      answers[`${ns}: pipeline gets hf-token`] = await as('pipeline', 'get', 'secrets/hf-token', ns);
      answers[`${ns}: pipeline gets magus-s3`] = await as('pipeline', 'get', 'secrets/magus-s3', ns);
      answers[`${ns}: pipeline creates Pods`] = await as('pipeline', 'create', 'pods', ns);
      answers[`${ns}: pipeline creates StatefulSets`] = await as('pipeline', 'create', 'statefulsets.apps', ns);
      answers[`${ns}: pipeline creates Services`] = await as('pipeline', 'create', 'services', ns);
      answers[`${ns}: controller watches Models`] = await as('controller', 'watch', 'models.magus.dev', ns);
      answers[`${ns}: controller lists Secrets`] = await as('controller', 'list', 'secrets', ns);
      answers[`${ns}: controller takes the Lease`] = await as('controller', 'update', 'leases.coordination.k8s.io', ns);
    }
    for (const sa of ['controller', 'runtime', 'pipeline', 'gateway']) answers[`cluster: ${sa} lists Nodes`] = await as(sa, 'list', 'nodes', '');
    const listed = (ns: string) => ns === 'team-a' || ns === 'team-b';
    expect(answers).toEqual({
      ...Object.fromEntries(
        ['team-a', 'team-b', 'models', home].flatMap((ns) => [
          [`${ns}: runtime creates StatefulSets`, listed(ns) ? 'yes' : 'no'],
          [`${ns}: runtime creates Secrets`, listed(ns) ? 'yes' : 'no'],
          [`${ns}: runtime gets Secrets`, 'no'],
          [`${ns}: runtime lists Secrets`, 'no'],
          [`${ns}: pipeline gets hf-token`, listed(ns) ? 'yes' : 'no'],
          [`${ns}: pipeline gets magus-s3`, 'no'],
          [`${ns}: pipeline creates Pods`, 'no'],
          [`${ns}: pipeline creates StatefulSets`, 'no'],
          [`${ns}: pipeline creates Services`, 'no'],
          [`${ns}: controller watches Models`, listed(ns) ? 'yes' : 'no'],
          [`${ns}: controller lists Secrets`, listed(ns) ? 'yes' : 'no'],
          [`${ns}: controller takes the Lease`, ns === home ? 'yes' : 'no'],
        ]),
      ),
      'cluster: controller lists Nodes': 'no',
      'cluster: runtime lists Nodes': 'no',
      'cluster: pipeline lists Nodes': 'no',
      'cluster: gateway lists Nodes': 'no',
    });

    // Nothing at all in a namespace it was not given, cluster-wide rules included: every account's
    // rules there are those of an account with no binding; in a listed namespace they are more.
    const nobody = await rulesOf(`${release}-nobody`, 'models', home);
    expect(nobody).toContain('selfsubjectrulesreviews.authorization.k8s.io');
    for (const sa of ['controller', 'runtime', 'pipeline', 'gateway']) {
      expect({ sa, rulesInAnUnlistedNamespace: await rulesOf(`${release}-${sa}`, 'models', home) }).toEqual({ sa, rulesInAnUnlistedNamespace: nobody });
      const inTeamA = await rulesOf(`${release}-${sa}`, 'team-a', home);
      expect({ sa, moreInAListedNamespace: inTeamA !== (await rulesOf(`${release}-nobody`, 'team-a', home)) }).toEqual({
        sa,
        moreInAListedNamespace: sa !== 'gateway',
      });
    }
    await run('kubectl', ['delete', '-f', '-', '--wait=false'], JSON.stringify({ apiVersion: 'v1', kind: 'List', items: rbac }));
  });

  test('helm upgrade with changed values rolls them out: replicas, image, NetworkPolicies', async () => {
    await helm(
      'upgrade',
      'magus',
      CHART,
      '--namespace',
      NS,
      '--values',
      examplePath('values-minimal.yaml'),
      '--set',
      'worker.pipeline.replicas=3',
      '--set',
      'gateway.replicas=1',
      '--set',
      'image.tag=0.1.1',
      '--set',
      'networkPolicy.enabled=true',
      '--wait',
      '--timeout',
      '3m',
    );
    const list = await expectAllAvailable({ 'magus-controller': 2, 'magus-gateway': 1, 'magus-worker-control': 1, 'magus-worker-pipeline': 3 });
    for (const d of list) {
      const c = d.spec?.template.spec?.containers[0];
      expect({ d: d.metadata?.name, image: c?.image }).toEqual({ d: d.metadata?.name, image: 'magus:0.1.1' });
    }
    const pipeline = list.find((d) => d.metadata?.name === 'magus-worker-pipeline')!;
    expect(pipeline.spec?.template.spec?.containers[0]?.env?.find((e) => e.name === 'MAGUS_K8S_MAGUS_IMAGE')?.value).toBe('magus:0.1.1');
    // The old pods go (kwok ends them at once); every pod left runs the new image.
    await eventually(async () => {
      const pods = (await core.listNamespacedPod({ namespace: NS, labelSelector: 'app.kubernetes.io/instance=magus' })).items.filter(
        (p) => !p.metadata?.deletionTimestamp,
      );
      expect(pods.map((p) => p.spec?.containers[0]?.image)).toEqual(pods.map(() => 'magus:0.1.1'));
      expect(pods).toHaveLength(7);
    }, 60_000);
    // With no watched namespace, instances run in the release namespace: their policy is there too.
    const networking = cluster.kubeConfig.makeApiClient(NetworkingV1Api);
    const policies = (await networking.listNamespacedNetworkPolicy({ namespace: NS })).items;
    expect(policies.map((p) => p.metadata?.name).sort()).toEqual(['magus-controller', 'magus-gateway', 'magus-instances', 'magus-worker']);
    const history = await helm('history', 'magus', '--namespace', NS, '--output', 'json');
    expect((JSON.parse(history) as { revision: number; status: string }[]).map((h) => [h.revision, h.status])).toEqual([
      [1, 'superseded'],
      [2, 'deployed'],
    ]);
  });

  test('helm uninstall removes magus but leaves the CRDs and the Models in them; a new install takes the CRDs back', async () => {
    const custom = cluster.kubeConfig.makeApiClient(CustomObjectsApi);
    await custom.createNamespacedCustomObject({
      group: 'magus.dev',
      version: 'v1alpha1',
      namespace: 'models',
      plural: 'models',
      body: {
        apiVersion: 'magus.dev/v1alpha1',
        kind: 'Model',
        metadata: { name: 'kept' },
        spec: { source: { repo: 'org/model' }, artifacts: [{ format: 'gguf', weights: 'q40' }] },
      },
    });
    const out = await run(helmBin, ['uninstall', 'magus', '--namespace', NS, '--wait', '--timeout', '2m']);
    expect(out.code).toBe(0);
    expect(out.stdout).toContain('These resources were kept due to the resource policy:');
    for (const name of ['models.magus.dev', 'dllamas.magus.dev', 'sessions.magus.dev', 'apikeys.magus.dev'])
      expect(out.stdout).toContain(`[CustomResourceDefinition] ${name}`);

    const rbac = cluster.kubeConfig.makeApiClient(RbacAuthorizationV1Api);
    await eventually(async () => {
      expect((await apps.listNamespacedDeployment({ namespace: NS, labelSelector: 'app.kubernetes.io/instance=magus' })).items).toEqual([]);
      expect((await rbac.listClusterRole({ labelSelector: 'app.kubernetes.io/instance=magus' })).items).toEqual([]);
      expect((await rbac.listClusterRoleBinding({ labelSelector: 'app.kubernetes.io/instance=magus' })).items).toEqual([]);
      expect((await core.listNamespacedServiceAccount({ namespace: NS, labelSelector: 'app.kubernetes.io/instance=magus' })).items).toEqual([]);
    }, 60_000);
    const extensions = cluster.kubeConfig.makeApiClient(ApiextensionsV1Api);
    const left = (await extensions.listCustomResourceDefinition({})).items.map((c) => c.metadata?.name).filter((n) => n?.endsWith('.magus.dev'));
    expect(left.sort()).toEqual(['apikeys.magus.dev', 'dllamas.magus.dev', 'models.magus.dev', 'sessions.magus.dev']);
    const kept = (await custom.getNamespacedCustomObject({
      group: 'magus.dev',
      version: 'v1alpha1',
      namespace: 'models',
      plural: 'models',
      name: 'kept',
    })) as Obj;
    expect(kept.metadata.name).toBe('kept');

    // Installing again adopts the kept CRDs (they still carry this release's ownership).
    await helm('install', 'magus', CHART, '--namespace', NS, '--values', examplePath('values-minimal.yaml'), '--wait', '--timeout', '3m');
    await expectAllAvailable({ 'magus-controller': 2, 'magus-gateway': 2, 'magus-worker-control': 1, 'magus-worker-pipeline': 1 });
  });
});

/**
 * The rendered pods really serve: the Kubernetes runtime creates an instance on the test control
 * plane (kwok: its pods are Ready without running), then the pod specs it wrote — its
 * containers, images, commands, env, init container and volumes — run under `podman kube play`
 * from the images CI built (scripts/images), and a chat completion goes gateway → NATS → the
 * `magus bridge` sidecar → the engine container and back. A llama.cpp instance (`magus engine`
 * over the tiny GGUF, fetched from S3 by `magus fetch`), a distributed-llama topology (root +
 * 1 worker) of the strict stand-in binaries of `localhost/magus-dllama:stand-in`, and one of the
 * real programs (`localhost/magus-dllama:0.16.4`, built by scripts/images from the vendored source)
 * serving the padded stories260K, whose answer must be llama.cpp's on the same token ids; its
 * worker pod first refuses a connection that cannot prove the topology's network key (the Secret
 * the runtime created, given to the pods by `secretKeyRef`).
 *
 * The pods run on a bridge network of this test's own (created here, removed after: a fresh
 * machine has no podman network but the default, and `podman-default-kube-network` exists only
 * once something ran `podman kube play`); this run's NATS and s3proxy listen on loopback, so the
 * runtime is given their addresses through TCP proxies on the bridge's gateway address.
 * What the test changes in the specs, and why: `hostAliases` for the workers' Service names (no
 * cluster DNS under podman: they point at the worker pod's address), the S3 Secret's keys and the
 * network key given as env values (podman 4.3's kube play reads Secrets only from its own secret
 * store), and no
 * `ports` (declarative in Kubernetes; podman would publish them on the host), and a termination grace
 * of 10 s (the runtime's is minutes, for a drain).
 */
import { PutObjectCommand } from '@aws-sdk/client-s3';
import { AppsV1Api, CoreV1Api, type V1PodSpec } from '@kubernetes/client-node';
import { createHash, randomBytes } from 'node:crypto';
import { chmodSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { connect } from 'node:net';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import OpenAI from 'openai';
import { installCrds } from '../kube/crds';
import { dataPlaneNames } from '../dataplane';
import { openModelRegistry, type ModelRegistry } from '../dataplane/registry';
import type { KubernetesRuntime } from '../activities/runtime/kubernetes';
import { instanceBase } from '../activities/runtime/kubernetes-manifests';
import type { RunningGateway } from '../gateway/server';
import type { ReadyModel } from '../shared/model';
import { publishTinyGguf } from './fixtures/tiny-gguf';
import { dllamaPromptIds, dllamaText, publishPaddedStories, writePaddedStories } from './fixtures/stories260k-dllama';
import { runLlamaCpp } from './reference/llama-cpp';
import { endpoint, isolation } from './harness';
import { startTestCluster, type TestCluster } from './harness/cluster';
import { startTcpProxy, type TcpProxy } from './harness/tcp-proxy';
import { createDllama, podsRuntime } from './harness/kube';
import { podman } from './harness/podman';
import { pinConversation } from './harness/gateway';
import { gatewayStack, natsStack, s3Stack, tempDir, TestStack } from './harness/stack';
import { sleep } from './harness/wait';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
const NS = 'pods';
const IMAGES = { magus: 'localhost/magus:0.1.0', dllama: 'localhost/magus-dllama:stand-in' };
/** distributed-llama itself (a `Dllama`'s `spec.images.dllama` picks it over the runtime's stand-in). */
const REAL_DLLAMA = 'localhost/magus-dllama:0.16.4';
const STORY = [{ role: 'user' as const, content: 'Once upon a time' }];
/** llama.cpp's greedy answer to {@link STORY} on the ids dllama-api evaluates, as distributed-llama spells it. */
let storyAnswer: string;
const SECRET = randomBytes(32).toString('hex');
const TOKEN_ID = 'pods';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(16).toString('hex')}`;

let dir: string;
let cluster: TestCluster;
let nc: NatsConnection;
let registry: ModelRegistry;
let runtime: KubernetesRuntime;
/** Where the gateway's cold start pins a conversation: the instance under test. */
let pinTo: { pool: string; instance: string } | undefined;
let gateway: RunningGateway;
let openai: OpenAI;
const proxies: TcpProxy[] = [];
const stack = new TestStack();
const KUBE_NETWORK = `magus-pods-${iso.id}`;

/** The address of a kube-played pod on the kube network (its infra container holds the network). */
async function podAddress(pod: string): Promise<string> {
  const infra = (await podman('pod', 'inspect', pod, '--format', '{{.InfraContainerID}}')).stdout.trim();
  const ip = (await podman('inspect', infra, '--format', '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}')).stdout.trim();
  if (!ip) throw new Error(`pod ${pod} has no address on ${KUBE_NETWORK}`);
  return ip;
}

/** A pod that only holds the kube network's bridge up (it exists while a container uses it), so proxies can listen on its gateway. */
const HOLDER = `magus-net-${iso.id}`;

/** Proxies on the kube network's gateway to a loopback server. */
async function proxyFromPods(target: string): Promise<string> {
  const gateway = (await podman('network', 'inspect', KUBE_NETWORK, '--format', '{{range .Subnets}}{{.Gateway}}{{end}}')).stdout.trim();
  const [host, port] = target.split(':');
  const proxy = await startTcpProxy({ host: host!, port: Number(port) }, gateway);
  proxies.push(proxy);
  return proxy.address;
}

beforeAll(async () => {
  for (const image of [...Object.values(IMAGES), REAL_DLLAMA]) {
    await podman('image', 'exists', image).catch(() => {
      throw new Error(`image ${image} is missing: build it with scripts/images (npm test does)`);
    });
  }
  ({ dir } = stack.open(tempDir('magus-pods-')));
  cluster = await startTestCluster({ nodes: 2 });
  stack.defer(() => cluster.stop());
  await installCrds(cluster.kubeConfig);
  await cluster.createNamespace(NS);
  ({ nc } = await stack.open(natsStack(iso, { declare: true })));
  registry = await openModelRegistry(nc, names.modelsBucket);
  const { s3 } = await stack.open(s3Stack(iso));
  // llama.cpp: the tiny synthetic Llama as GGUF, in S3 and the registry.
  const tiny = await publishTinyGguf({ dir, s3, bucket: iso.bucket, registry, name: 'tiny' });
  await registry.put({ ...tiny, namespace: NS });
  // distributed-llama: files the stand-in only checks are readable, with their real sha256.
  const put = async (key: string, body: Buffer) => {
    await s3.send(new PutObjectCommand({ Bucket: iso.bucket, Key: key, Body: body }));
    return { key, bytes: body.length, sha256: createHash('sha256').update(body).digest('hex') };
  };
  // The real programs: the padded stories260K, F32 (q40 blocks do not fit its 64-wide rows on more than 2 nodes).
  const stories = await writePaddedStories(join(dir, 'stories'), ['f32']);
  const published = await publishPaddedStories(stories, 'f32', { s3, bucket: iso.bucket, registry, name: 'storiesd' });
  await registry.put({ ...published, namespace: NS });
  const reference = await runLlamaCpp({ model: stories.gguf.f32!, promptTokens: dllamaPromptIds(stories, STORY), nTokens: 16 });
  storyAnswer = dllamaText(stories, reference.tokens);
  const m = await put('artifacts/tinyd/model.m', randomBytes(4096));
  const t = await put('artifacts/tinyd/tokenizer.t', randomBytes(512));
  await registry.put({
    namespace: NS,
    name: 'tinyd',
    source: { repo: 'org/tinyd', revision: 'main', sha: 'd'.repeat(40) },
    artifacts: [{ format: 'dllama', weights: 'q40', files: [m, t] }],
    memory: [],
    readyAt: new Date().toISOString(),
  } as unknown as ReadyModel);

  const s3e = endpoint('s3');
  await podman('network', 'rm', '--force', KUBE_NETWORK).catch(() => undefined);
  stack.defer(async () => {
    await podman('pod', 'rm', '--force', HOLDER).catch(() => undefined);
    await podman('network', 'rm', '--force', KUBE_NETWORK).catch(() => undefined);
  });
  await podman('network', 'create', KUBE_NETWORK);
  await podman('pod', 'create', '--name', HOLDER, '--network', KUBE_NETWORK);
  await podman('pod', 'start', HOLDER);
  stack.defer(() => Promise.all(proxies.map((p) => p.close())));
  const natsAddress = await proxyFromPods(
    endpoint('nats')
      .servers.replace(/^nats:\/\//, '')
      .split(',')[0]!,
  );
  const s3Address = await proxyFromPods(new URL(s3e.endpoint).host);
  // Each instance's bridge as its own NATS user, from the Secret the runtime writes (podOf mounts it).
  runtime = podsRuntime({ kc: cluster.kubeConfig, registry, nc, names, images: IMAGES, natsAddress, s3Address, bucket: iso.bucket });
  // A conversation's session is its pin to the instance under test (no Temporal here), written
  // when the gateway asks for it: a pin written beforehand races the gateway's watch of the bucket.
  ({ gateway } = await stack.open(
    gatewayStack(names, {
      secret: SECRET,
      tokens: { [TOKEN_ID]: TOKEN },
      env: { MAGUS_LOG_LEVEL: 'silent', MAGUS_GATEWAY_REQUEST_TIMEOUT_MS: '60000' },
      deps: {
        coldStart: (req) =>
          pinTo ? pinConversation(nc, names, req.conversationKey, pinTo.pool, pinTo.instance) : Promise.reject(new Error('no instance under test')),
      },
    }),
  ));
  openai = new OpenAI({ baseURL: `${gateway.url}/v1`, apiKey: TOKEN, maxRetries: 0 });
}, 600_000);

afterAll(() => stack.close(), 120_000);

/** The runtime's pod template of StatefulSet `name`, as a Pod podman can play. */
async function podOf(name: string, workers: { names: string[]; ip?: string }): Promise<Record<string, unknown>> {
  const sts = await cluster.kubeConfig.makeApiClient(AppsV1Api).readNamespacedStatefulSet({ name, namespace: NS });
  const spec = structuredClone(sts.spec!.template.spec!) as V1PodSpec & Record<string, unknown>;
  const s3e = endpoint('s3');
  for (const c of [...(spec.initContainers ?? []), ...spec.containers]) {
    delete c.ports; // declarative only; podman maps them to host ports, which host networking refuses
    if (c.envFrom?.some((e) => e.secretRef?.name === 'magus-s3')) {
      delete c.envFrom;
      c.env = [...(c.env ?? []), { name: 'AWS_ACCESS_KEY_ID', value: s3e.accessKeyId }, { name: 'AWS_SECRET_ACCESS_KEY', value: s3e.secretAccessKey }];
    }
    // The topology's network key, from the Secret the runtime created.
    for (const e of c.env ?? []) {
      const ref = e.valueFrom?.secretKeyRef;
      if (!ref) continue;
      const secret = await cluster.kubeConfig.makeApiClient(CoreV1Api).readNamespacedSecret({ name: ref.name!, namespace: NS });
      e.value = Buffer.from(secret.data![ref.key]!, 'base64').toString();
      delete e.valueFrom;
    }
  }
  // A short stop: the runtime's grace is the drain timeout plus 15 s (minutes), for answers in
  // flight; here nothing is in flight at teardown, and a container slow to exit should not hold it.
  spec.terminationGracePeriodSeconds = 10;
  // Secret volumes (the bridge's NATS user) as host folders holding the Secret's files: podman's kube play reads Secrets only from its own store.
  for (const v of spec.volumes ?? []) {
    if (!v.secret) continue;
    const secret = await cluster.kubeConfig.makeApiClient(CoreV1Api).readNamespacedSecret({ name: v.secret.secretName!, namespace: NS });
    const dir = mkdtempSync(join(tmpdir(), 'magus-pod-secret-'));
    chmodSync(dir, 0o755);
    for (const [key, value] of Object.entries(secret.data ?? {})) writeFileSync(join(dir, key), Buffer.from(value, 'base64'), { mode: 0o644 });
    delete v.secret;
    v.hostPath = { path: dir, type: 'Directory' };
  }
  spec.restartPolicy = 'Never';
  if (workers.ip) spec.hostAliases = [{ ip: workers.ip, hostnames: workers.names }];
  return { apiVersion: 'v1', kind: 'Pod', metadata: { name: `${name}-0`, labels: sts.spec!.template.metadata?.labels }, spec };
}

/**
 * Connects to the worker pod at `ip` before its root does, with bytes that prove nothing: the
 * worker closes the connection and says so in its log (images/dllama/patches/0003), keeping its
 * place for the root that holds the instance's network key.
 */
async function rogueRefused(ip: string, pod: string): Promise<void> {
  const deadline = Date.now() + 60_000;
  for (;;) {
    const closed = await new Promise<boolean>((resolve) => {
      const s = connect(9998, ip);
      s.on('error', () => resolve(false));
      s.resume(); // its challenge read and dropped, so the close is seen
      s.on('connect', () => s.write('mgs-rogue-hello'));
      s.on('close', (hadError) => resolve(!hadError));
    });
    const logs = await podman('pod', 'logs', pod).then((r) => r.stdout + r.stderr);
    if (closed && /⭕ Refused a connection from [\d.]+:\d+: /.test(logs)) return;
    if (Date.now() > deadline) throw new Error(`the worker never refused a rogue connection; its log:\n${logs.slice(-2000)}`);
    await sleep(500); // not listening yet
  }
}

async function serveThroughPods(
  model: string,
  engine: 'llamacpp' | 'dllama',
  nodesPower: number,
  expectText: RegExp | string,
  opts: {
    images?: { dllama: string };
    messages?: { role: 'user'; content: string }[];
    maxTokens?: number;
    /** Before the root, something else connects to the worker first: it must be refused (the real image). */
    rogue?: boolean;
  } = {},
): Promise<void> {
  await createDllama(cluster.kubeConfig, NS, model, {
    model,
    engine,
    nodesPower,
    replicas: 1,
    minReplicas: 0,
    maxReplicas: 1,
    leasesPerInstance: 1,
    idleTimeout: '10m',
    ...(opts.images ? { images: opts.images } : {}),
  });
  const instance = `${model}-1`;
  await runtime.create({ namespace: NS, model, pool: model, instance }, new AbortController().signal);
  const base = instanceBase(instance);
  const workers = 2 ** nodesPower - 1;
  const workerNames = Array.from({ length: workers }, (_, k) => `${base}-w-${k}.${base}-w.${NS}.svc`);
  // The worker pod first: the root's hostAliases point its Service name at the worker's address.
  const workerFile = join(dir, `${model}-workers.yaml`);
  const rootFile = join(dir, `${model}.yaml`);
  try {
    let workerIp: string | undefined;
    if (workers > 0) {
      writeFileSync(workerFile, JSON.stringify(await podOf(`${base}-w`, { names: [] })));
      await podman('kube', 'play', '--network', KUBE_NETWORK, workerFile);
      workerIp = await podAddress(`${base}-w-0`);
      if (opts.rogue) await rogueRefused(workerIp, `${base}-w-0`);
    }
    writeFileSync(rootFile, JSON.stringify(await podOf(base, { names: workerNames, ...(workerIp ? { ip: workerIp } : {}) })));
    await podman('kube', 'play', '--network', KUBE_NETWORK, rootFile);
    const engineUrl = `http://${await podAddress(`${base}-0`)}:8080`;
    // The engine container answers once the init container has fetched (and checked) the files.
    const deadline = Date.now() + 120_000;
    for (;;) {
      const ok = await fetch(`${engineUrl}/v1/models`, { signal: AbortSignal.timeout(2000) }).then(
        (r) => r.ok,
        () => false,
      );
      if (ok) break;
      if (Date.now() > deadline) {
        const logs = await podman('pod', 'logs', `${base}-0`).then(
          (r) => r.stdout + r.stderr,
          (e: Error) => e.message,
        );
        throw new Error(`the engine container never answered; pod logs:\n${logs.slice(-3000)}`);
      }
      await sleep(500);
    }
    const sessionId = `pods-${model}`;
    pinTo = { pool: model, instance };
    const r = await openai.chat.completions
      .create(
        { model: `${NS}/${model}`, messages: opts.messages ?? [{ role: 'user', content: 'Hello!' }], max_tokens: opts.maxTokens ?? 4, temperature: 0 },
        { headers: { 'x-session-id': sessionId } },
      )
      .catch(async (err: Error) => {
        const logs = await podman('pod', 'logs', `${base}-0`).then(
          (x) => x.stdout + x.stderr,
          (e: Error) => e.message,
        );
        throw new Error(`${err.message}; pod logs:\n${logs.slice(-3000)}`);
      });
    if (typeof expectText === 'string') expect(r.choices[0]?.message.content).toBe(expectText);
    else expect(r.choices[0]?.message.content ?? '').toMatch(expectText);
  } finally {
    pinTo = undefined;
    await podman('kube', 'down', rootFile).catch(() => undefined);
    if (workers > 0) await podman('kube', 'down', workerFile).catch(() => undefined);
    await runtime.destroy(model, instance);
  }
}

test('a llama.cpp instance: fetch (init), magus engine and the bridge, as the runtime wrote them, answer a chat completion', async () => {
  await serveThroughPods('tiny', 'llamacpp', 0, /./);
}, 300_000);

test('a distributed-llama topology (root + 1 worker, stand-in binaries) as the runtime wrote it answers', async () => {
  await serveThroughPods('tinyd', 'dllama', 1, /\[2 nodes\]/);
}, 300_000);

test('distributed-llama for real (root + 1 worker pod of the real image): the worker refuses a connection without the network key, and the answer is llama.cpp’s on the same token ids', async () => {
  await serveThroughPods('storiesd', 'dllama', 1, storyAnswer, { images: { dllama: REAL_DLLAMA }, messages: STORY, maxTokens: 16, rogue: true });
}, 300_000);

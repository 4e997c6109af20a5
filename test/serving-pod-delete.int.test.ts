/**
 * An instance's pod deleted mid-answer on a real node: the Kubernetes runtime creates a llama.cpp
 * instance (SmolLM2-135M-Instruct, the demo model, fetched from S3 by its init container) whose
 * pod the real kubelet runs (harness/kubelet.ts: containerd, the images scripts/images built);
 * a streamed greedy answer goes gateway → NATS → the pod's `magus bridge` → its engine; midway
 * the pod is deleted (`kubectl delete pod`, the default grace, at piece 50 of 200). The kubelet runs the engine
 * container's preStop (`GET /drained` on the bridge) while it sends the bridge SIGTERM: the bridge
 * finishes the answer in flight, then answers `/drained`, so the engine is stopped only after the
 * last piece. The client gets the whole answer, the same as undisturbed, with one usage record.
 * Then a pod force-deleted at piece 50 and, the other's, at piece 150 of 200 (grace 0: the kubelet
 * kills it after its 2-s minimum, as a lost node's pods): the answer goes on on the pool's other
 * instance from the tokens said, its silence measured — or, what is left said within those 2 s
 * (at piece 150 here), ends where it is. Last, a pod force-deleted in the prompt phase (its engine
 * container frozen there, as a prompt that takes a big model longer than the grace to evaluate):
 * nothing said, the answer comes whole from the other instance.
 *
 * Two instances of one pool on the node (the pool view, which the pool workflow writes, written
 * here; a conversation pinned as its session would pin it). The pods reach this run's loopback
 * NATS and S3 through TCP proxies on the node's pod gateway.
 */
import { PutObjectCommand } from '@aws-sdk/client-s3';
import { CoreV1Api } from '@kubernetes/client-node';
import { createHash, randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import type { NatsConnection } from 'nats';
import OpenAI from 'openai';
import { podReady, type KubernetesRuntime } from '../activities/runtime/kubernetes';
import { instanceBase } from '../activities/runtime/kubernetes-manifests';
import { dataPlaneNames } from '../dataplane';
import { openModelRegistry } from '../dataplane/registry';
import { installCrds } from '../kube/crds';
import type { ReadyModel } from '../shared/model';
import { demoModelFile } from '../workers/dev/demo-model';
import { endpoint, isolation } from './harness';
import { startTestCluster, type TestCluster } from './harness/cluster';
import { pinConversation, publishPoolView } from './harness/gateway';
import { containerProcesses, startKubeletNode, type KubeletNode } from './harness/kubelet';
import { gatewayStack, natsStack, s3Stack, TestStack } from './harness/stack';
import { startTcpProxy } from './harness/tcp-proxy';
import { createDllama, podsRuntime } from './harness/kube';
import { readTimed, textAt, gapAfter, type TimedAnswer } from './harness/timed-stream';
import { sleep, until } from './harness/wait';

const iso = isolation();
const names = dataPlaneNames(iso.natsPrefix);
const NS = 'default';
const MODEL = 'smol';
const INSTANCES = [`${MODEL}-1`, `${MODEL}-2`];
const IMAGES = { magus: 'localhost/magus:0.1.0', dllama: 'localhost/magus-dllama:stand-in' };
const TOKEN_ID = 'poddelete';
const TOKEN = `mgs_${TOKEN_ID}_${randomBytes(16).toString('hex')}`;
const MESSAGES = [{ role: 'user' as const, content: 'Tell me a long story about a lighthouse keeper.' }];
const MAX_TOKENS = 200;
/**
 * A long prompt (~590 tokens): its engine is frozen 150 ms after it is sent, surely in its prompt
 * phase (SmolLM2 evaluates it in under a second on this machine's 2 cores, idle; in 2.5 s loaded).
 */
const LONG_REPEATS = 30;
const LONG_MESSAGES = [
  {
    role: 'user' as const,
    content: `${'The harbour master counted the fishing boats that came in with the evening tide, one by one. '.repeat(LONG_REPEATS)}Now tell me a long story about a lighthouse keeper.`,
  },
];

let cluster: TestCluster;
let node: KubeletNode;
let nc: NatsConnection;
let runtime: KubernetesRuntime;
let openai: OpenAI;
/** Where a new conversation is pinned. */
let pinTo = INSTANCES[0]!;
let reference: TimedAnswer;
const stack = new TestStack();

beforeAll(async () => {
  cluster = await startTestCluster({ nodes: 1 });
  stack.defer(() => cluster.stop());
  node = await startKubeletNode({ kubeConfig: cluster.kubeConfig, server: cluster.server, token: cluster.token, images: [IMAGES.magus] });
  stack.defer(() => node.stop());
  await installCrds(cluster.kubeConfig);
  ({ nc } = await stack.open(natsStack(iso, { declare: true })));
  const registry = await openModelRegistry(nc, names.modelsBucket);
  const { s3 } = await stack.open(s3Stack(iso));
  const gguf = readFileSync(await demoModelFile(() => undefined));
  const key = `artifacts/${NS}/${MODEL}/gguf-source/model.gguf`;
  await s3.send(new PutObjectCommand({ Bucket: iso.bucket, Key: key, Body: gguf }));
  await registry.put({
    namespace: NS,
    name: MODEL,
    source: { repo: 'test/smollm2', revision: 'main', sha: 'e'.repeat(40) },
    artifacts: [{ format: 'gguf', weights: 'source', files: [{ key, bytes: gguf.length, sha256: createHash('sha256').update(gguf).digest('hex') }] }],
    memory: [],
    readyAt: new Date().toISOString(),
  } as unknown as ReadyModel);

  const proxy = async (target: string) => {
    const [host, port] = target.split(':');
    const p = await startTcpProxy({ host: host!, port: Number(port) }, node.gateway);
    stack.defer(() => p.close());
    return p.address;
  };
  const s3e = endpoint('s3');
  const natsAddress = await proxy(
    endpoint('nats')
      .servers.replace(/^nats:\/\//, '')
      .split(',')[0]!,
  );
  const s3Address = await proxy(new URL(s3e.endpoint).host);
  // The instance pods' S3 keys, as an operator would give them (MAGUS_K8S_S3_SECRET).
  await cluster.kubeConfig.makeApiClient(CoreV1Api).createNamespacedSecret({
    namespace: NS,
    body: { metadata: { name: 'magus-s3' }, stringData: { AWS_ACCESS_KEY_ID: s3e.accessKeyId, AWS_SECRET_ACCESS_KEY: s3e.secretAccessKey } },
  });
  runtime = podsRuntime({ kc: cluster.kubeConfig, registry, nc, names, images: IMAGES, natsAddress, s3Address, bucket: iso.bucket });
  ({
    gateway: { url: gatewayUrl },
  } = await stack.open(
    gatewayStack(names, {
      secret: randomBytes(32).toString('hex'),
      tokens: { [TOKEN_ID]: TOKEN },
      env: { MAGUS_LOG_LEVEL: 'silent', MAGUS_GATEWAY_REQUEST_TIMEOUT_MS: '120000' },
      deps: { coldStart: (req) => pinConversation(nc, names, req.conversationKey, MODEL, pinTo) },
    }),
  ));
  openai = new OpenAI({ baseURL: `${gatewayUrl}/v1`, apiKey: TOKEN, maxRetries: 0 });

  await createDllama(cluster.kubeConfig, NS, MODEL, {
    model: MODEL,
    engine: 'llamacpp',
    replicas: 2,
    minReplicas: 0,
    maxReplicas: 2,
    leasesPerInstance: 1,
    drainTimeout: '60s',
    // The real node, not kwok's.
    nodeSelector: { 'kubernetes.io/hostname': node.name },
  });
  for (const instance of INSTANCES) {
    await runtime.create({ namespace: NS, model: MODEL, pool: MODEL, instance }, AbortSignal.timeout(300_000));
    stack.defer(() => runtime.destroy(MODEL, instance));
  }
  await publishPoolView(nc, names, MODEL, INSTANCES, 1);
}, 900_000);

afterAll(() => stack.close(), 180_000);

let gatewayUrl: string;

/** A streamed greedy answer of a new conversation pinned to `instance`; `onPiece` as readTimed's. */
async function streamed(
  session: string,
  instance: string,
  onPiece?: (pieces: number) => Promise<void> | void,
  messages: OpenAI.ChatCompletionMessageParam[] = MESSAGES,
): Promise<TimedAnswer> {
  pinTo = instance;
  const stream = await openai.chat.completions.create(
    { model: `${NS}/${MODEL}`, messages, max_tokens: MAX_TOKENS, temperature: 0, stream: true, stream_options: { include_usage: true } },
    { headers: { 'x-session-id': session } },
  );
  return readTimed(stream, onPiece);
}

const podOf = (instance: string) => `${instanceBase(instance)}-0`;

/** When the pod `name` of uid `uid` is gone (its StatefulSet may have made another of that name). */
async function goneAt(name: string, uid: string): Promise<number> {
  const core = cluster.kubeConfig.makeApiClient(CoreV1Api);
  await until(
    `pod ${name} (uid ${uid}) gone`,
    async () => (await core.readNamespacedPod({ name, namespace: NS }).catch(() => undefined))?.metadata?.uid !== uid,
    120_000,
  );
  return Date.now();
}

test('the premise: an undisturbed answer on each instance, the same, on pods of the real node', async () => {
  const core = cluster.kubeConfig.makeApiClient(CoreV1Api);
  for (const instance of INSTANCES) expect((await core.readNamespacedPod({ name: podOf(instance), namespace: NS })).spec?.nodeName).toBe(node.name);
  reference = await streamed('pod-delete-reference-1', INSTANCES[0]!);
  expect(reference).toMatchObject({ finish: 'length', usage: { completion_tokens: MAX_TOKENS } });
  expect((await streamed('pod-delete-reference-2', INSTANCES[1]!)).text).toBe(reference.text);
}, 120_000);

test('the pod deleted mid-answer: the kubelet runs the preStop, the bridge finishes the answer, then the pod goes', async () => {
  const core = cluster.kubeConfig.makeApiClient(CoreV1Api);
  const pod = podOf(INSTANCES[0]!);
  const { uid } = (await core.readNamespacedPod({ name: pod, namespace: NS })).metadata!;
  let deletedAt = 0;
  let gone: Promise<number> | undefined;
  const answer = await streamed('pod-delete-graceful', INSTANCES[0]!, async (pieces) => {
    if (pieces !== 50) return;
    deletedAt = Date.now();
    await core.deleteNamespacedPod({ name: pod, namespace: NS });
    gone = goneAt(pod, uid!);
  });
  const endedAt = Date.now();
  // Whole and the same: the answer finished where it was.
  expect(answer).toMatchObject({ finish: 'length', roles: 1, usage: { completion_tokens: MAX_TOKENS } });
  expect(answer.text).toBe(reference.text);
  // The pod outlived the answer: the kubelet stopped it after the last piece, not under it.
  const goneTime = await gone!;
  console.log(`graceful delete: ${endedAt - deletedAt} ms from the delete to the answer's end, the pod gone ${goneTime - endedAt} ms after it`);
  expect(endedAt - deletedAt).toBeGreaterThan(1000);
  expect(goneTime).toBeGreaterThan(endedAt);
}, 300_000);

/** Waits until `instance`'s pod (made again by its StatefulSet after a delete) is Ready and answers as undisturbed. */
async function servingAgain(instance: string): Promise<void> {
  const core = cluster.kubeConfig.makeApiClient(CoreV1Api);
  await until(
    `pod ${podOf(instance)} Ready`,
    async () => podReady((await core.readNamespacedPod({ name: podOf(instance), namespace: NS }).catch(() => undefined)) ?? {}),
    180_000,
  );
  expect((await streamed(`pod-delete-${instance}-again-${Date.now()}`, instance)).text).toBe(reference.text);
}

describe.each([
  { victim: INSTANCES[1]!, other: INSTANCES[0]!, at: 50 },
  { victim: INSTANCES[0]!, other: INSTANCES[1]!, at: 150 },
])('a pod force-deleted (grace 0, as a lost node’s pods) at piece $at', ({ victim, other, at }) => {
  test('the answer ends whole, each piece once: in place if its bridge ends it within the 2-s grace, else on the other instance from its tokens', async () => {
    const core = cluster.kubeConfig.makeApiClient(CoreV1Api);
    // The other instance serves: its pod, deleted by an earlier test, made again and Ready.
    await servingAgain(other);
    const pod = podOf(victim);
    const { uid } = (await core.readNamespacedPod({ name: pod, namespace: NS })).metadata!;
    let deletedAt = 0;
    const answer = await streamed(`pod-delete-forced-${at}`, victim, async (pieces) => {
      if (pieces !== at) return;
      deletedAt = Date.now();
      await core.deleteNamespacedPod({ name: pod, namespace: NS, gracePeriodSeconds: 0 });
    });
    await goneAt(pod, uid!);
    expect(answer).toMatchObject({ finish: 'length', roles: 1, usage: { completion_tokens: MAX_TOKENS } });
    // What the client had before the delete is the undisturbed answer's beginning; the rest continued it.
    const before = textAt(answer, deletedAt);
    expect(before.length).toBeGreaterThan(0);
    expect(reference.text.startsWith(before)).toBe(true);
    expect(answer.text.startsWith(before)).toBe(true);
    const gap = gapAfter(answer, deletedAt);
    // Where it began: the kubelet kills the pod's containers ~2 s after the delete.
    const after = [deletedAt, ...answer.times.filter((t) => t > deletedAt)];
    const began = after.find((t, i) => after[i + 1] !== undefined && after[i + 1]! - t === gap) ?? deletedAt;
    console.log(`forced delete at piece ${at}: longest silence after it ${gap} ms, from ${began - deletedAt} ms after the delete`);
    // The rest continued it exactly (the engines' numerics do not depend on how a token was evaluated: engine/llama.ts `EXACT_BATCH`).
    expect(answer.text).toBe(reference.text);
    // Printed, bounded loosely (a loaded machine): what matters is that no ack deadline (30 s) is waited out.
    expect(gap).toBeLessThan(10_000);
  }, 300_000);
});

test('a pod force-deleted in the prompt phase, nothing said yet: the answer comes whole from the other instance, as undisturbed', async () => {
  const core = cluster.kubeConfig.makeApiClient(CoreV1Api);
  const [other, victim] = [INSTANCES[0]!, INSTANCES[1]!];
  // Both serve again (each was force-deleted above); the reference for the long prompt, cold, from the one that will answer it.
  await servingAgain(other);
  await servingAgain(victim);
  const longReference = await streamed('pod-delete-long-reference', other, undefined, LONG_MESSAGES);
  expect(longReference).toMatchObject({ finish: 'length', usage: { completion_tokens: MAX_TOKENS } });
  const pod = podOf(victim);
  const { metadata, status } = await core.readNamespacedPod({ name: pod, namespace: NS });
  const engine = containerProcesses(status!.containerStatuses!.find((c) => c.name === 'engine')!.containerID!);
  expect(engine.length).toBeGreaterThan(0);
  const answering = streamed('pod-delete-prompt-phase', victim, undefined, LONG_MESSAGES);
  // The request is at the engine well within this (its headers come back at once), and the
  // prompt's evaluation far from done; the engine container is frozen there: on an idle machine
  // this model evaluates the prompt in under a second, a big model would take longer than the grace.
  await sleep(150);
  for (const pid of engine) process.kill(pid, 'SIGSTOP');
  const deletedAt = Date.now();
  await core.deleteNamespacedPod({ name: pod, namespace: NS, gracePeriodSeconds: 0 });
  const answer = await answering;
  await goneAt(pod, metadata!.uid!);
  const first = answer.times[0]! - deletedAt;
  console.log(`forced delete in the prompt phase (${longReference.usage?.prompt_tokens} prompt tokens): the first piece ${first} ms after the delete`);
  // Nothing came before the kubelet killed the pod (its 2-s grace): the engine was frozen in the prompt phase.
  expect(first).toBeGreaterThan(2000);
  expect(answer).toMatchObject({
    finish: 'length',
    roles: 1,
    usage: { completion_tokens: MAX_TOKENS, prompt_tokens: longReference.usage!.prompt_tokens },
  });
  expect(answer.text).toBe(longReference.text);
}, 300_000);

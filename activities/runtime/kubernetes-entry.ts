/**
 * The `kubernetes` runtime's entry in the registry (./index.ts): instances are pods in the
 * model's namespace (kubernetes.ts), selected with `MAGUS_RUNTIME=kubernetes`, configured with
 * the `MAGUS_K8S_*` variables. The runtime itself, and with it the Kubernetes client, is loaded
 * only when a worker builds it: every `magus` command reads its configuration through here.
 */
import { readNatsSigner } from '../../dataplane/roles';
import { formatsLoadedBy } from '../../shared/engines';
import type * as EnginesModule from './engines';
import { checkNatsServerList } from '../../platform/config';
import { DLLAMA_NODE_COUNTS } from '../size/memory';
import type { RuntimeEntry } from './entry';
import type * as KubernetesModule from './kubernetes';

/**
 * The Kubernetes runtime's settings: `MAGUS_K8S_MAGUS_IMAGE` and `MAGUS_K8S_DLLAMA_IMAGE`
 * (required: the images instance pods run), `MAGUS_K8S_NATS_URL` (NATS as instance
 * pods reach it; default MAGUS_NATS_URL), `MAGUS_K8S_S3_SECRET` (a Secret in each model namespace
 * with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for the pods' `magus fetch`),
 * `MAGUS_K8S_INSTANCE_SERVICE_ACCOUNT`, `MAGUS_K8S_BRIDGE_NATS_SIGNER` (`magus nats-auth`'s `bridge-signer.nk`: each instance's bridge
 * gets a NATS user of its own, signed with it, in a Secret of the instance), `MAGUS_K8S_NODES` (distributed-llama nodes of a pool
 * without a `Dllama`; default 1: llama.cpp), `MAGUS_K8S_UNSCHEDULABLE_AFTER_MS` (default 30000),
 * `MAGUS_K8S_NAMESPACES` (comma-separated: the only namespaces instances may be placed in, for a
 * worker whose roles are Roles there; default any).
 */
export interface KubernetesRuntimeConfig {
  images: { magus: string; dllama: string };
  natsUrl: string;
  /** `MAGUS_K8S_BRIDGE_NATS_SIGNER`: the signer file (magus nats-auth) each instance's bridge user is made with. */
  bridgeSigner?: string;
  s3Secret?: string;
  serviceAccount?: string;
  defaultNodes: number;
  unschedulableAfterMs: number;
  /** `MAGUS_K8S_NAMESPACES`: the only namespaces of instances; absent: any. */
  namespaces?: string[];
}

/** {@link KubernetesRuntimeConfig} from `env`; `natsServers` (`MAGUS_NATS_URL`) is the default NATS of the pods. */
function kubernetesRuntimeConfig(env: NodeJS.ProcessEnv, natsServers: string, problems: string[]): KubernetesRuntimeConfig {
  const nodes = Number(env.MAGUS_K8S_NODES?.trim() || '1');
  if (!(DLLAMA_NODE_COUNTS as readonly number[]).includes(nodes))
    problems.push(`MAGUS_K8S_NODES=${env.MAGUS_K8S_NODES} must be one of ${DLLAMA_NODE_COUNTS.join(', ')}`);
  const after = Number(env.MAGUS_K8S_UNSCHEDULABLE_AFTER_MS?.trim() || '30000');
  if (!Number.isInteger(after) || after < 1000)
    problems.push(`MAGUS_K8S_UNSCHEDULABLE_AFTER_MS=${env.MAGUS_K8S_UNSCHEDULABLE_AFTER_MS} must be an integer ≥ 1000`);
  for (const name of ['MAGUS_K8S_MAGUS_IMAGE', 'MAGUS_K8S_DLLAMA_IMAGE'])
    if (!env[name]?.trim()) problems.push(`${name} is required with MAGUS_RUNTIME=kubernetes (the image instance pods run)`);
  const namespaces = (env.MAGUS_K8S_NAMESPACES ?? '')
    .split(',')
    .map((n) => n.trim())
    .filter(Boolean);
  for (const n of namespaces)
    if (!/^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$/.test(n)) problems.push(`MAGUS_K8S_NAMESPACES: ${JSON.stringify(n)} is not a namespace name`);
  const natsUrl = env.MAGUS_K8S_NATS_URL?.trim() || natsServers;
  checkNatsServerList('MAGUS_K8S_NATS_URL', natsUrl, problems);
  if (env.MAGUS_K8S_BRIDGE_NATS_CREDENTIALS?.trim())
    problems.push(
      'MAGUS_K8S_BRIDGE_NATS_CREDENTIALS is no longer read: each instance gets a bridge user of its own; set MAGUS_K8S_BRIDGE_NATS_SIGNER to bridge-signer.nk of magus nats-auth',
    );
  const bridgeSigner = env.MAGUS_K8S_BRIDGE_NATS_SIGNER?.trim();
  if (bridgeSigner) {
    try {
      readNatsSigner(bridgeSigner, `MAGUS_K8S_BRIDGE_NATS_SIGNER=${bridgeSigner}`);
    } catch (err) {
      problems.push((err as Error).message);
    }
  }
  return {
    ...(bridgeSigner ? { bridgeSigner } : {}),
    images: { magus: env.MAGUS_K8S_MAGUS_IMAGE?.trim() ?? '', dllama: env.MAGUS_K8S_DLLAMA_IMAGE?.trim() ?? '' },
    natsUrl,
    ...(env.MAGUS_K8S_S3_SECRET?.trim() ? { s3Secret: env.MAGUS_K8S_S3_SECRET.trim() } : {}),
    ...(env.MAGUS_K8S_INSTANCE_SERVICE_ACCOUNT?.trim() ? { serviceAccount: env.MAGUS_K8S_INSTANCE_SERVICE_ACCOUNT.trim() } : {}),
    defaultNodes: nodes,
    unschedulableAfterMs: after,
    ...(namespaces.length > 0 ? { namespaces: [...new Set(namespaces)] } : {}),
  };
}

/** Pods in the model's namespace (kubernetes.ts): any worker answers for any instance, from the cluster. */
export const kubernetes: RuntimeEntry<KubernetesRuntimeConfig> = {
  kind: 'kubernetes',
  ownsInstances: false,
  settingsFrom: (env, problems, common) => kubernetesRuntimeConfig(env, common.nats.servers, problems),
  // A MAGUS_K8S_* variable on a worker of another runtime is a deployment mistake: say so.
  unselected: (env, problems) => {
    const stray = Object.keys(env).filter((k) => k.startsWith('MAGUS_K8S_') && env[k]?.trim());
    if (stray.length > 0) problems.push(`${stray.join(', ')} set, but MAGUS_RUNTIME is not kubernetes`);
  },
  create: (k, { s3, instanceMemory }, deps) => {
    if (!deps.kube) throw new Error('MAGUS_RUNTIME=kubernetes needs a cluster: run in a pod or set KUBECONFIG');
    // eslint-disable-next-line @typescript-eslint/no-require-imports -- loaded only by a worker that runs it (the file's comment)
    const { createKubernetesRuntime } = require('./kubernetes') as typeof KubernetesModule;
    return createKubernetesRuntime({
      kc: deps.kube,
      registry: deps.registry,
      nc: deps.nc,
      names: deps.names,
      images: k.images,
      natsUrl: k.natsUrl,
      ...(k.bridgeSigner ? { bridgeSigner: k.bridgeSigner } : {}),
      dataPlaneEnv: deps.dataPlaneEnv,
      s3: { endpoint: s3.endpoint, region: s3.region, bucket: s3.bucket, ...(k.s3Secret ? { secret: k.s3Secret } : {}) },
      ...(k.serviceAccount ? { serviceAccount: k.serviceAccount } : {}),
      defaultNodes: k.defaultNodes,
      unschedulableAfterMs: k.unschedulableAfterMs,
      ...(k.namespaces ? { namespaces: k.namespaces } : {}),
      ...(instanceMemory ? { instanceMemory } : {}),
      log: deps.log,
    });
  },
  // Every engine that runs in a pod: a model's `Dllama` says which runs.
  advert: () => {
    // eslint-disable-next-line @typescript-eslint/no-require-imports -- the launchers load the S3 client: a worker's, not every command's
    const engines = (require('./engines') as typeof EnginesModule).kubernetesEngines();
    return { formats: formatsLoadedBy(engines), engines };
  },
};

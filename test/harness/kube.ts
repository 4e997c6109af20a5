/** Kubernetes client configurations for the test kube-apiserver (bearer token, self-signed TLS): the admin's, a ServiceAccount's, and crds/rbac.yaml's roles. */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { CoreV1Api, CustomObjectsApi, KubeConfig, loadAllYaml, RbacAuthorizationV1Api, type V1ClusterRole } from '@kubernetes/client-node';
import type { NatsConnection } from 'nats';
import { createKubernetesRuntime, type KubernetesRuntime } from '../../activities/runtime/kubernetes';
import type { DataPlaneNames } from '../../dataplane';
import type { ModelRegistry } from '../../dataplane/registry';
import { CRD_GROUP, CRD_VERSION } from '../../shared/constants';
import { endpoint, natsSignerFile } from '.';

export function kubeConfig(): KubeConfig {
  const kubernetes = endpoint('kubernetes');
  const kc = new KubeConfig();
  kc.loadFromOptions({
    clusters: [{ name: 'magus-test', server: kubernetes.server, skipTLSVerify: true }],
    users: [{ name: 'magus-admin', token: kubernetes.token }],
    contexts: [{ name: 'magus-test', cluster: 'magus-test', user: 'magus-admin' }],
    currentContext: 'magus-test',
  });
  return kc;
}

/** crds/rbac.yaml's ClusterRoles, created (or replaced) with `admin`. */
export async function installRbacRoles(admin: KubeConfig): Promise<void> {
  const rbac = admin.makeApiClient(RbacAuthorizationV1Api);
  for (const role of loadAllYaml(readFileSync(join(__dirname, '..', '..', 'crds', 'rbac.yaml'), 'utf8')) as V1ClusterRole[]) {
    try {
      await rbac.createClusterRole({ body: role });
    } catch (err) {
      if ((err as { code?: number }).code !== 409) throw err;
      await rbac.replaceClusterRole({ name: role.metadata!.name!, body: role });
    }
  }
}

/**
 * A ServiceAccount `name` in `namespace` bound to `clusterRoles` (cluster-wide) and
 * `namespaceRoles` (in `namespace` only), and a KubeConfig that authenticates as it.
 */
export async function serviceAccountKubeConfig(
  admin: KubeConfig,
  namespace: string,
  name: string,
  clusterRoles: string[],
  namespaceRoles: string[] = [],
): Promise<KubeConfig> {
  const core = admin.makeApiClient(CoreV1Api);
  const rbac = admin.makeApiClient(RbacAuthorizationV1Api);
  await core.createNamespacedServiceAccount({ namespace, body: { metadata: { name } } });
  const subjects = [{ kind: 'ServiceAccount', name, namespace }];
  for (const role of clusterRoles) {
    await rbac.createClusterRoleBinding({
      body: {
        metadata: { name: `${namespace}-${name}-${role}` },
        roleRef: { apiGroup: 'rbac.authorization.k8s.io', kind: 'ClusterRole', name: role },
        subjects,
      },
    });
  }
  for (const role of namespaceRoles) {
    await rbac.createNamespacedRoleBinding({
      namespace,
      body: { metadata: { name: `${name}-${role}` }, roleRef: { apiGroup: 'rbac.authorization.k8s.io', kind: 'ClusterRole', name: role }, subjects },
    });
  }
  const { status } = await core.createNamespacedServiceAccountToken({ namespace, name, body: { spec: { audiences: [], expirationSeconds: 3600 } } });
  const sa = new KubeConfig();
  sa.loadFromOptions({
    // The admin's API server: the harness's, or a test's private cluster (test/harness/cluster.ts).
    clusters: [{ name: 't', server: admin.getCurrentCluster()?.server ?? endpoint('kubernetes').server, skipTLSVerify: true }],
    users: [{ name, token: status!.token }],
    contexts: [{ name: 't', cluster: 't', user: name }],
    currentContext: 't',
  });
  return sa;
}

/** Creates the `Dllama` `name` in `namespace` (the resource the Kubernetes runtime builds a pool's instances from) with `spec`. */
export async function createDllama(kc: KubeConfig, namespace: string, name: string, spec: Record<string, unknown>): Promise<void> {
  await kc.makeApiClient(CustomObjectsApi).createNamespacedCustomObject({
    group: CRD_GROUP,
    version: CRD_VERSION,
    namespace,
    plural: 'dllamas',
    body: { apiVersion: `${CRD_GROUP}/${CRD_VERSION}`, kind: 'Dllama', metadata: { name }, spec },
  });
}

/**
 * The Kubernetes runtime as the tests whose pods run use it (`runtime-pods.int`, under podman;
 * `serving-pod-delete.int`, on a real kubelet): the pods reach this run's NATS and S3 at
 * `natsAddress` and `s3Address` (proxies to the loopback servers), with the S3 keys of Secret
 * `magus-s3`, and each instance's bridge is a NATS user of its own when the test server has users.
 */
export function podsRuntime(o: {
  kc: KubeConfig;
  registry: ModelRegistry;
  nc: NatsConnection;
  names: DataPlaneNames;
  images: { magus: string; dllama: string };
  natsAddress: string;
  s3Address: string;
  bucket: string;
}): KubernetesRuntime {
  const s3e = endpoint('s3');
  return createKubernetesRuntime({
    kc: o.kc,
    registry: o.registry,
    nc: o.nc,
    names: o.names,
    images: o.images,
    natsUrl: `nats://${o.natsAddress}`,
    ...(natsSignerFile() ? { bridgeSigner: natsSignerFile() } : {}),
    s3: { endpoint: `http://${o.s3Address}`, region: s3e.region, bucket: o.bucket, secret: 'magus-s3' },
  });
}

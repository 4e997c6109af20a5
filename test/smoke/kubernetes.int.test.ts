import { ApiextensionsV1Api, CoreV1Api, CustomObjectsApi, type V1CustomResourceDefinition } from '@kubernetes/client-node';
import { isolation } from '../harness';
import { kubeConfig } from '../harness/kube';
import { sleep } from '../harness/wait';

const iso = isolation();
const group = 'smoke.magus.dev';
const plural = `widgets${iso.id.replace(/[^a-z0-9]/g, '')}`;

const crd: V1CustomResourceDefinition = {
  apiVersion: 'apiextensions.k8s.io/v1',
  kind: 'CustomResourceDefinition',
  metadata: { name: `${plural}.${group}` },
  spec: {
    group,
    scope: 'Namespaced',
    names: {
      plural,
      singular: plural.slice(0, -1),
      kind: `Widget${iso.id.replace(/[^a-z0-9]/g, '')}`,
      listKind: `Widget${iso.id.replace(/[^a-z0-9]/g, '')}List`,
    },
    versions: [
      {
        name: 'v1alpha1',
        served: true,
        storage: true,
        subresources: { status: {} },
        schema: {
          openAPIV3Schema: {
            type: 'object',
            properties: {
              spec: {
                type: 'object',
                required: ['replicas'],
                properties: { replicas: { type: 'integer', minimum: 1, maximum: 8 } },
                x_kubernetes_validations: [
                  {
                    rule: 'self.replicas % 2 == 1 || self.replicas == 2 || self.replicas == 4 || self.replicas == 8',
                    message: 'replicas must be odd or a power of two',
                  },
                ],
              },
            },
          },
        },
      },
    ],
  },
};

test('a CRD is applied and a custom object is created and validated on kube-apiserver', async () => {
  const kc = kubeConfig();
  const ext = kc.makeApiClient(ApiextensionsV1Api);
  const core = kc.makeApiClient(CoreV1Api);
  const custom = kc.makeApiClient(CustomObjectsApi);

  await core.createNamespace({ body: { metadata: { name: iso.namespace } } });
  await ext.createCustomResourceDefinition({ body: crd });

  // Wait until the API server has established the new type.
  const deadline = Date.now() + 30_000;
  for (;;) {
    const got = await ext.readCustomResourceDefinition({ name: crd.metadata!.name! });
    if (got.status?.conditions?.some((c) => c.type === 'Established' && c.status === 'True')) break;
    if (Date.now() > deadline) throw new Error('CRD never became Established');
    await sleep(200);
  }

  const kind = crd.spec.names.kind;
  const obj = { apiVersion: `${group}/v1alpha1`, kind, metadata: { name: 'w1' }, spec: { replicas: 4 } };
  // Discovery of a freshly established type can lag a moment; retry creation briefly on 404.
  let created: { metadata?: { uid?: string } } | undefined;
  for (let i = 0; !created; i++) {
    try {
      created = (await custom.createNamespacedCustomObject({ group, version: 'v1alpha1', namespace: iso.namespace, plural, body: obj })) as typeof created;
    } catch (err) {
      if (i > 50 || (err as { code?: number }).code !== 404) throw err;
      await sleep(200);
    }
  }
  expect(created?.metadata?.uid).toMatch(/^[0-9a-f-]{36}$/);

  const read = (await custom.getNamespacedCustomObject({ group, version: 'v1alpha1', namespace: iso.namespace, plural, name: 'w1' })) as {
    spec: { replicas: number };
  };
  expect(read.spec.replicas).toBe(4);

  // The schema and its CEL rule are enforced by the real API server.
  const bad = { ...obj, metadata: { name: 'w2' }, spec: { replicas: 6 } };
  await expect(custom.createNamespacedCustomObject({ group, version: 'v1alpha1', namespace: iso.namespace, plural, body: bad })).rejects.toMatchObject({
    code: 422,
  });
  await expect(
    custom.createNamespacedCustomObject({ group, version: 'v1alpha1', namespace: iso.namespace, plural, body: { ...obj, metadata: { name: 'w3' }, spec: {} } }),
  ).rejects.toMatchObject({ code: 422 });
});

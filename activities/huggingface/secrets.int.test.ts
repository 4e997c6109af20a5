/** SecretRef resolution against the real kube-apiserver started by the test harness. */
import { CoreV1Api } from '@kubernetes/client-node';
import { isolation } from '../../test/harness';
import { kubeConfig } from '../../test/harness/kube';
import { createSecretResolver, isSecretUnavailable, type SecretResolver } from './secrets';

const iso = isolation();
const VALUE = 'hf_integrationSecretValue42';
const OTHER_NS = `${iso.namespace}-b`;

let core: CoreV1Api;
let resolve: SecretResolver;

beforeAll(async () => {
  core = kubeConfig().makeApiClient(CoreV1Api);
  for (const name of [iso.namespace, OTHER_NS]) await core.createNamespace({ body: { metadata: { name } } });
  await core.createNamespacedSecret({
    namespace: iso.namespace,
    // `stringData` as `kubectl create secret --from-file` would store it: with a trailing newline.
    body: { metadata: { name: 'hf-token' }, stringData: { token: `${VALUE}\n`, empty: '' } },
  });
  await core.createNamespacedSecret({
    namespace: OTHER_NS,
    body: { metadata: { name: 'shared' }, data: { token: Buffer.from('other-ns-value').toString('base64') } },
  });
  resolve = createSecretResolver({ kube: { coreApi: core, defaultNamespace: iso.namespace }, env: {} });
});

afterAll(async () => {
  for (const name of [iso.namespace, OTHER_NS]) await core?.deleteNamespace({ name }).catch(() => undefined);
});

async function unavailable(p: Promise<unknown>): Promise<string> {
  const err = await p.then(
    () => {
      throw new Error('expected SecretUnavailable');
    },
    (e: unknown) => e,
  );
  expect(isSecretUnavailable(err)).toBe(true);
  const e = err as Error & { code: string };
  expect(e.code).toBe('SecretUnavailable');
  expect(e.message).not.toContain(VALUE);
  expect(JSON.stringify(e)).not.toContain(VALUE);
  return e.message;
}

test('a Secret key is read (base64-decoded, trimmed) from the default namespace', async () => {
  await expect(resolve({ secret: { name: 'hf-token', key: 'token' } })).resolves.toBe(VALUE);
});

test('an explicit namespace wins over the default', async () => {
  await expect(resolve({ secret: { name: 'shared', key: 'token', namespace: OTHER_NS } })).resolves.toBe('other-ns-value');
});

test('a missing Secret, key or value is SecretUnavailable naming the reference, never a value', async () => {
  expect(await unavailable(resolve({ secret: { name: 'nope', key: 'token' } }))).toBe(
    `key token of Secret ${iso.namespace}/nope does not exist (Secret not found)`,
  );
  expect(await unavailable(resolve({ secret: { name: 'hf-token', key: 'missing' } }))).toBe(
    `key missing of Secret ${iso.namespace}/hf-token does not exist (the Secret has no such key)`,
  );
  expect(await unavailable(resolve({ secret: { name: 'hf-token', key: 'empty' } }))).toBe(`key empty of Secret ${iso.namespace}/hf-token is empty`);
  expect(await unavailable(resolve({ secret: { name: 'hf-token', key: 'token', namespace: OTHER_NS } }))).toBe(
    `key token of Secret ${OTHER_NS}/hf-token does not exist (Secret not found)`,
  );
});

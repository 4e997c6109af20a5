/**
 * ApiKeys end to end: the real kube-apiserver, `magus controller` (its core, in process, as the
 * ServiceAccount crds/rbac.yaml's role allows and nothing more), real NATS and a real gateway. A
 * key's identity is `<namespace>/<name>`, and its token id is registered once:
 * - two namespaces declaring keys of the same name are two keys, and neither reads the other's
 *   stored responses;
 * - a key presenting a token id another namespace's key holds is refused with a condition, writes
 *   nothing, and deleting it leaves the holder's key working (the take-over the old
 *   Secret-per-token scheme allowed);
 * - rotation, suspension, a missing Secret, models of an unshared namespace, a labelled Secret
 *   that an ApiKey names, and a key deleted while no controller ran;
 * - `spec.limits` copied into the key's entry, rewritten when patched (and only then), gone when
 *   removed; `kubectl get apikeys` shows the budget;
 * - `status.usage` from the usage ledger and the gateways' limit counts (controller/usage-status.ts).
 */
import { execFile } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { CoreV1Api, CustomObjectsApi, PatchStrategy, setHeaderOptions, type KubeConfig } from '@kubernetes/client-node';
import type { KV, NatsConnection } from 'nats';
import { installCrds } from '../kube/crds';
import { dataPlaneNames } from '../dataplane';
import { startKeys, type Keys } from '../controller/keys';
import { startUsageStatus } from '../controller/usage-status';
import { LimitStore } from '../dataplane/limits';
import { meterKeyOf, meterSignature, MeterVerifier } from '../dataplane/meter';
import { UsageLedger } from '../dataplane/usage';
import type { ResourceWatch } from '../kube/watch';
import type { UsageRecord } from '../shared/usage';
import { startGateway, type RunningGateway } from '../gateway/server';
import type { StoredResponse } from '../gateway/serving/response-store';
import { CRD_GROUP, CRD_VERSION } from '../shared/constants';
import { ApiKeyReason, TOKEN_SECRET_LABEL, type ApiKeyResource } from '../shared/kube';
import { pendingResponse } from '../shared/responses';
import { keyOwner, type TokenEntry } from '../shared/serving';
import { writeKubeconfig } from '../workers/dev/services';
import { endpoint, isolation, natsConnectAs } from './harness';
import { gatewayConfigAs } from './harness/gateway';
import { installRbacRoles, kubeConfig, serviceAccountKubeConfig } from './harness/kube';
import { natsStack, TestStack } from './harness/stack';
import { until } from './harness/wait';

const execFileP = promisify(execFile);
const iso = isolation();
const nsA = `${iso.namespace}-a`;
const nsB = `${iso.namespace}-b`;
const stack = new TestStack();

let kc: KubeConfig;
let controllerKc: KubeConfig;
let core: CoreV1Api;
let custom: CustomObjectsApi;
let nc: NatsConnection;
/** The controller's connection (its role's user): what its keys and usage parts run on. */
let ctl: NatsConnection;
let tokens: KV;
let controller: Keys & { synced: Promise<void>; idle(): Promise<void> };
let gw: RunningGateway;
let kubeconfigFile: string;
const controllerLog: string[] = [];

const token = (id: string) => `mgs_${id}_${randomBytes(24).toString('hex')}`;
/**
 * The controller's keys part (what `startController` runs with a tokens bucket), cluster-wide: the
 * test is about two namespaces. Only the keys part: a whole controller cluster-wide would take
 * other test files' Models.
 */
const start = () => {
  const keys = startKeys({
    kc: controllerKc,
    core: controllerKc.makeApiClient(CoreV1Api),
    custom: controllerKc.makeApiClient(CustomObjectsApi),
    kv: tokens,
    sharedModelNamespaces: ['platform'],
    log: (l) => controllerLog.push(l),
  });
  return { ...keys, synced: Promise.all(Object.values(keys.watches).map((w) => w.synced)).then(() => undefined), idle: () => keys.drained() };
};

async function secret(namespace: string, name: string, value: string, labels: Record<string, string> = {}): Promise<void> {
  await core.createNamespacedSecret({ namespace, body: { metadata: { name, labels }, stringData: { token: value } } });
}
async function apiKey(namespace: string, name: string, spec: Partial<ApiKeyResource['spec']> & { secretRef: { name: string } }): Promise<void> {
  await custom.createNamespacedCustomObject({
    group: CRD_GROUP,
    version: CRD_VERSION,
    namespace,
    plural: 'apikeys',
    body: { apiVersion: `${CRD_GROUP}/${CRD_VERSION}`, kind: 'ApiKey', metadata: { name, namespace }, spec },
  });
}
/** A JSON merge patch of an ApiKey's spec (`null` removes a field). */
const patchSpec = (namespace: string, name: string, spec: Record<string, unknown>) =>
  custom.patchNamespacedCustomObject(
    { group: CRD_GROUP, version: CRD_VERSION, namespace, plural: 'apikeys', name, body: { spec } },
    setHeaderOptions('Content-Type', PatchStrategy.MergePatch),
  );
const getKey = async (namespace: string, name: string) =>
  (await custom.getNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace, plural: 'apikeys', name })) as ApiKeyResource;
const ready = (k: ApiKeyResource) => k.status?.conditions?.find((c) => c.type === 'Ready');
async function readyAs(namespace: string, name: string, reason: string): Promise<ApiKeyResource> {
  let last: ApiKeyResource | undefined;
  await until(`ApiKey ${namespace}/${name} is ${reason}`, async () => ready((last = await getKey(namespace, name)))?.reason === reason, 15_000);
  return last!;
}
const status = (t: string, path = '/v1/models') => fetch(`${gw.url}${path}`, { headers: { authorization: `Bearer ${t}` } }).then((r) => r.status);
const answers = (t: string, code: number, path?: string) => until(`the gateway answers ${code}`, async () => (await status(t, path)) === code, 10_000);
const entryOf = async (id: string): Promise<TokenEntry | undefined> => {
  const e = await tokens.get(id);
  return e?.operation === 'PUT' ? (JSON.parse(new TextDecoder().decode(e.value)) as TokenEntry) : undefined;
};

beforeAll(async () => {
  kc = kubeConfig();
  core = kc.makeApiClient(CoreV1Api);
  custom = kc.makeApiClient(CustomObjectsApi);
  await installCrds(kc);
  for (const ns of [iso.namespace, nsA, nsB]) await core.createNamespace({ body: { metadata: { name: ns } } });
  // The controller runs as a ServiceAccount bound to crds/rbac.yaml's role, cluster-wide.
  await installRbacRoles(kc);
  controllerKc = await serviceAccountKubeConfig(kc, iso.namespace, 'ctl', ['magus-controller']);
  const dir = mkdtempSync(join(tmpdir(), 'magus-apikeys-'));
  kubeconfigFile = join(dir, 'kubeconfig');
  writeKubeconfig(kubeconfigFile, endpoint('kubernetes'));

  ({ nc } = await stack.open(natsStack(iso, { declare: true })));
  const names = dataPlaneNames(iso.natsPrefix);
  gw = await startGateway(await gatewayConfigAs(iso.natsPrefix, { secret: 'x'.repeat(32), tokens: {}, env: { MAGUS_LOG_LEVEL: 'warn' } }));
  stack.defer(() => gw.close());
  ctl = await natsConnectAs('controller', names);
  stack.defer(() => ctl.drain());
  tokens = await ctl.jetstream().views.kv(names.tokensBucket, { bindOnly: true });
  controller = start();
  stack.defer(() => controller.stop());
  await controller.synced;
}, 120_000);

afterAll(() => stack.close());

test('two namespaces declare keys of the same name: two keys, each reads only its own stored responses', async () => {
  const tA = token(`same-name-${randomBytes(4).toString('hex')}`);
  const tB = token(`same-name-${randomBytes(4).toString('hex')}`);
  await secret(nsA, 'team-token', tA);
  await secret(nsB, 'team-token', tB);
  await apiKey(nsA, 'team', { secretRef: { name: 'team-token' } });
  await apiKey(nsB, 'team', { secretRef: { name: 'team-token' } });
  const a = await readyAs(nsA, 'team', ApiKeyReason.registered);
  const b = await readyAs(nsB, 'team', ApiKeyReason.registered);
  expect(a.status?.models).toEqual([`${nsA}/*`]);
  expect(b.status?.models).toEqual([`${nsB}/*`]);
  await answers(tA, 200);
  await answers(tB, 200);

  // A response A stored (as the gateway stores it: owned by A's identity and uid).
  const responses = await nc.jetstream().views.kv(dataPlaneNames(iso.natsPrefix).responsesBucket);
  const id = `resp_${randomBytes(8).toString('hex')}`;
  const record: StoredResponse = {
    owner: keyOwner(`${nsA}/team`, a.metadata.uid),
    model: `${nsA}/m`,
    root: id,
    previous: null,
    depth: 0,
    input: [],
    output: [],
    response: pendingResponse(id, { model: 'm', input: 'hi' }, 1),
  };
  await responses.put(id, JSON.stringify(record));
  expect(await status(tA, `/v1/responses/${id}`)).toBe(200);
  expect(await status(tB, `/v1/responses/${id}`)).toBe(404);
  const del = await fetch(`${gw.url}/v1/responses/${id}`, { method: 'DELETE', headers: { authorization: `Bearer ${tB}` } });
  expect(del.status).toBe(404);
  expect(await status(tA, `/v1/responses/${id}`)).toBe(200);

  // A deleted and declared again under the same name is a new owner: the old key's response is not its.
  await custom.deleteNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: nsA, plural: 'apikeys', name: 'team' });
  await answers(tA, 401);
  await apiKey(nsA, 'team', { secretRef: { name: 'team-token' } });
  await readyAs(nsA, 'team', ApiKeyReason.registered);
  await answers(tA, 200);
  expect(await status(tA, `/v1/responses/${id}`)).toBe(404);
}, 90_000);

test('a token id another namespace holds is refused, never written over; deleting the refused key leaves the holder working', async () => {
  const id = `victim-${randomBytes(4).toString('hex')}`;
  const victim = token(id);
  const attacker = token(id); // the same id, another secret
  await secret(nsA, 'victim-token', victim);
  await apiKey(nsA, 'victim', { secretRef: { name: 'victim-token' } });
  await readyAs(nsA, 'victim', ApiKeyReason.registered);
  const before = await tokens.get(id);

  await secret(nsB, 'attacker-token', attacker);
  await apiKey(nsB, 'attacker', { secretRef: { name: 'attacker-token' }, models: ['*'] });
  const refused = await readyAs(nsB, 'attacker', ApiKeyReason.idConflict);
  expect(ready(refused)).toMatchObject({ status: 'False' });
  expect(ready(refused)!.message).toContain(`token id '${id}' is already registered to a key in another namespace`);
  expect(ready(refused)!.message).not.toContain(nsA); // another namespace's key is not named
  expect(refused.status?.tokenId).toBeUndefined();
  // Nothing was written: the same revision, the victim's digest.
  expect((await tokens.get(id))!.revision).toBe(before!.revision);
  await answers(victim, 200);
  expect(await status(attacker)).toBe(401);

  // The same conflict within one namespace names the holder.
  await secret(nsA, 'copy-token', token(id));
  await apiKey(nsA, 'copy', { secretRef: { name: 'copy-token' } });
  expect(ready(await readyAs(nsA, 'copy', ApiKeyReason.idConflict))!.message).toContain(`key ${nsA}/victim`);

  // `kubectl get apikeys` shows why.
  const { stdout } = await execFileP('kubectl', ['--kubeconfig', kubeconfigFile, '-n', nsB, 'get', 'apikeys'], { timeout: 30_000 });
  expect(stdout).toMatch(/NAME\s+SECRET\s+MODELS\s+SUSPENDED\s+BUDGET\s+PERIOD\s+USED\s+REMAINING\s+READY\s+REASON\s+AGE/);
  expect(stdout).toMatch(/attacker\s+attacker-token\s+\S+\s+false\s+False\s+IdConflict/); // no budget: blank Budget and Period

  // Deleting the refused keys leaves the victim's entry alone.
  for (const [ns, name] of [
    [nsB, 'attacker'],
    [nsA, 'copy'],
  ] as const)
    await custom.deleteNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: ns, plural: 'apikeys', name });
  await controller.idle();
  await new Promise((r) => setTimeout(r, 500));
  await controller.idle();
  expect((await tokens.get(id))!.revision).toBe(before!.revision);
  expect(await status(victim)).toBe(200);

  // Once the holder is gone, the id is free: a key refused for it then takes it.
  await apiKey(nsB, 'attacker', { secretRef: { name: 'attacker-token' } });
  await readyAs(nsB, 'attacker', ApiKeyReason.idConflict);
  await custom.deleteNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: nsA, plural: 'apikeys', name: 'victim' });
  await answers(victim, 401);
  await readyAs(nsB, 'attacker', ApiKeyReason.registered);
  await answers(attacker, 200);
  expect((await entryOf(id))?.key).toBe(`${nsB}/attacker`);
}, 90_000);

test('rotation, suspension, a missing Secret and models of a namespace that does not share them', async () => {
  // Declared before its Secret: SecretMissing, then Ready once the Secret exists (labelled: seen at once).
  await apiKey(nsA, 'rotating', { secretRef: { name: 'rotating-token' }, models: ['tiny', 'platform/*'] });
  const missing = await readyAs(nsA, 'rotating', ApiKeyReason.secretMissing);
  expect(ready(missing)!.message).toContain('rotating-token');
  const first = token(`rot-${randomBytes(4).toString('hex')}`);
  await secret(nsA, 'rotating-token', first, { 'magus.dev/api-key': 'rotating' });
  const k = await readyAs(nsA, 'rotating', ApiKeyReason.registered);
  expect(k.status?.models).toEqual([`${nsA}/tiny`, 'platform/*']);
  await answers(first, 200);

  // Rotated: the new token works, the old one is revoked and its entry gone.
  const second = token(`rot-${randomBytes(4).toString('hex')}`);
  await core.patchNamespacedSecret({
    namespace: nsA,
    name: 'rotating-token',
    body: [{ op: 'replace', path: '/data/token', value: Buffer.from(second).toString('base64') }],
  });
  await answers(second, 200);
  await answers(first, 401);
  expect(await entryOf(first.split('_')[1]!)).toBeUndefined();
  await until('the status names the new id', async () => (await getKey(nsA, 'rotating')).status?.tokenId === second.split('_')[1], 10_000);

  // Suspended: 403 key_suspended; resumed: 200.
  await custom.patchNamespacedCustomObject(
    {
      group: CRD_GROUP,
      version: CRD_VERSION,
      namespace: nsA,
      plural: 'apikeys',
      name: 'rotating',
      body: [{ op: 'replace', path: '/spec/suspended', value: true }],
    },
    { headers: { 'Content-Type': 'application/json-patch+json' } } as never,
  );
  await readyAs(nsA, 'rotating', ApiKeyReason.suspended);
  await answers(second, 403);
  const body = (await (await fetch(`${gw.url}/v1/models`, { headers: { authorization: `Bearer ${second}` } })).json()) as {
    error: { code: string; type: string };
  };
  expect(body.error).toMatchObject({ code: 'key_suspended', type: 'permission_error' });
  await custom.patchNamespacedCustomObject(
    {
      group: CRD_GROUP,
      version: CRD_VERSION,
      namespace: nsA,
      plural: 'apikeys',
      name: 'rotating',
      body: [{ op: 'replace', path: '/spec/suspended', value: false }],
    },
    { headers: { 'Content-Type': 'application/json-patch+json' } } as never,
  );
  await answers(second, 200);

  // Another namespace's models, not shared: refused, and no token registered.
  const t = token(`grab-${randomBytes(4).toString('hex')}`);
  await secret(nsB, 'grab-token', t);
  await apiKey(nsB, 'grab', { secretRef: { name: 'grab-token' }, models: [`${nsA}/*`] });
  const grab = await readyAs(nsB, 'grab', ApiKeyReason.modelNotShared);
  expect(ready(grab)!.message).toContain(`${nsA}/*`);
  expect(ready(grab)!.message).toContain('platform');
  expect(await status(t)).toBe(401);

  // A Secret that is not a token: SecretInvalid, naming the form.
  await core.createNamespacedSecret({ namespace: nsB, body: { metadata: { name: 'bad-token' }, stringData: { token: 'sk-not-ours' } } });
  await apiKey(nsB, 'bad', { secretRef: { name: 'bad-token' } });
  expect(ready(await readyAs(nsB, 'bad', ApiKeyReason.secretInvalid))!.message).toContain('mgs_<id>_<secret>');
}, 90_000);

test('a labelled token Secret is a key of its own namespace until an ApiKey names it; a key deleted while no controller ran is revoked at start', async () => {
  const id = `legacy-${randomBytes(4).toString('hex')}`;
  const t = token(id);
  await core.createNamespacedSecret({
    namespace: nsA,
    body: { metadata: { name: 'legacy', labels: { [TOKEN_SECRET_LABEL]: 'true' } }, stringData: { token: t, models: `tiny,${nsB}/other` } },
  });
  await answers(t, 200);
  // Confined to its namespace: the other namespace's model is dropped, a bare name is its own; no limits.
  expect(await entryOf(id)).toMatchObject({ key: `${nsA}/legacy`, origin: `secret/${nsA}/legacy`, models: [`${nsA}/tiny`] });
  expect(await entryOf(id)).not.toHaveProperty('limits');
  expect(controllerLog.some((l) => l.includes(`${nsA}/legacy`) && l.includes(`${nsB}/other`))).toBe(true);

  // An ApiKey naming that Secret takes its token over.
  await apiKey(nsA, 'adopter', { secretRef: { name: 'legacy' } });
  await readyAs(nsA, 'adopter', ApiKeyReason.registered);
  expect(await entryOf(id)).toMatchObject({ key: `${nsA}/adopter`, origin: `apikey/${nsA}/adopter` });
  await answers(t, 200);

  // Deleted while the controller is stopped: the token works until a controller starts, then not.
  await controller.stop();
  await custom.deleteNamespacedCustomObject({ group: CRD_GROUP, version: CRD_VERSION, namespace: nsA, plural: 'apikeys', name: 'adopter' });
  await core.deleteNamespacedSecret({ namespace: nsA, name: 'legacy' });
  expect(await status(t)).toBe(200);
  controller = start();
  await controller.synced;
  await answers(t, 401);
  expect(await entryOf(id)).toBeUndefined();
}, 90_000);

test('spec.limits: copied into the entry, rewritten when patched and only then, gone when removed; kubectl shows the budget', async () => {
  const id = `limited-${randomBytes(4).toString('hex')}`;
  const t = token(id);
  await secret(nsA, 'limited-token', t);
  await apiKey(nsA, 'limited', { secretRef: { name: 'limited-token' }, limits: { budget: { tokens: 300, period: 'day' }, requestsPerMinute: 5 } });
  const k = await readyAs(nsA, 'limited', ApiKeyReason.registered);
  expect(ready(k)!.message).toContain('limits: rpm 5, budget 300/day');
  expect((await entryOf(id))?.limits).toEqual({ requestsPerMinute: 5, budget: { tokens: 300, period: 'day' } });
  await answers(t, 200);

  // Looked at again with the same limits (an annotation changed): nothing is written.
  const first = (await tokens.get(id))!.revision;
  await custom.patchNamespacedCustomObject(
    { group: CRD_GROUP, version: CRD_VERSION, namespace: nsA, plural: 'apikeys', name: 'limited', body: { metadata: { annotations: { touched: 'yes' } } } },
    setHeaderOptions('Content-Type', PatchStrategy.MergePatch),
  );
  await controller.idle();
  await new Promise((r) => setTimeout(r, 300));
  await controller.idle();
  expect((await tokens.get(id))!.revision).toBe(first);

  const { stdout } = await execFileP('kubectl', ['--kubeconfig', kubeconfigFile, '-n', nsA, 'get', 'apikey', 'limited'], { timeout: 30_000 });
  expect(stdout).toMatch(/limited\s+limited-token\s+\S+\s+false\s+300\s+day\s+True\s+Registered/); // no usage written here

  // Patched: the budget raised, tokens per minute added — the entry is rewritten with both.
  await patchSpec(nsA, 'limited', { limits: { tokensPerMinute: 10000, budget: { tokens: 600 } } });
  await until(
    'the entry has the patched limits',
    async () =>
      JSON.stringify((await entryOf(id))?.limits) === JSON.stringify({ requestsPerMinute: 5, tokensPerMinute: 10000, budget: { tokens: 600, period: 'day' } }),
    10_000,
  );
  expect((await tokens.get(id))!.revision).toBeGreaterThan(first);
  await until(
    'the status says the new limits',
    async () => ready(await getKey(nsA, 'limited'))?.message.includes('limits: rpm 5, tpm 10000, budget 600/day') === true,
    10_000,
  );

  // Emptied, then removed: no limits in the entry; the token keeps working throughout.
  await patchSpec(nsA, 'limited', { limits: { requestsPerMinute: null, tokensPerMinute: null, budget: null } });
  await until('the entry has no limits', async () => (await entryOf(id))?.limits === undefined && (await entryOf(id)) !== undefined, 10_000);
  await patchSpec(nsA, 'limited', { limits: { concurrency: 3 } });
  await until('the entry has the new limits', async () => (await entryOf(id))?.limits?.concurrency === 3, 10_000);
  // Limits of one model (a bare name is a Model of the key's namespace) and a storage quota.
  await patchSpec(nsA, 'limited', { limits: { storageBytes: 1_000_000, models: { echo: { requestsPerMinute: 2 }, [`${nsB}/other`]: { concurrency: 1 } } } });
  await until(
    'the entry has the model limits',
    async () =>
      JSON.stringify((await entryOf(id))?.limits) ===
      JSON.stringify({ concurrency: 3, models: { [`${nsA}/echo`]: { requestsPerMinute: 2 }, [`${nsB}/other`]: { concurrency: 1 } }, storageBytes: 1_000_000 }),
    10_000,
  );
  await until(
    'the status says them',
    async () =>
      ready(await getKey(nsA, 'limited'))?.message.includes(`limits: concurrency 3, storage 1000000 bytes; ${nsA}/echo: rpm 2; ${nsB}/other: concurrency 1`) ===
      true,
    10_000,
  );
  // The apiserver refuses a model not named as a Model is.
  await expect(patchSpec(nsA, 'limited', { limits: { models: { 'Not A Model': { concurrency: 1 } } } })).rejects.toThrow(
    /each model is named by a Model's name/,
  );
  await patchSpec(nsA, 'limited', { limits: { models: null, storageBytes: null } });
  await patchSpec(nsA, 'limited', { limits: null });
  await until('the entry has no limits again', async () => (await entryOf(id))?.limits === undefined, 10_000);
  expect(await entryOf(id)).toMatchObject({ key: `${nsA}/limited`, origin: `apikey/${nsA}/limited` });
  // The status follows the entry (written after it): it stops naming limits.
  await until('the status names no limits', async () => ready(await getKey(nsA, 'limited'))?.message.includes('limits') === false, 10_000);
  expect(ready(await getKey(nsA, 'limited'))?.reason).toBe(ApiKeyReason.registered);
  expect(await status(t)).toBe(200);
}, 90_000);

test("status.usage: the ledger's records of the key in its budget's period and what the budget has left, written as they change; kubectl shows Used and Remaining", async () => {
  const names = dataPlaneNames(iso.natsPrefix);
  // The gateways' count (written here as they write it), which the controller only reads.
  const limits = new LimitStore(await nc.jetstream().views.kv(names.limitsBucket, { bindOnly: true }));
  const usage = await startUsageStatus({
    js: ctl.jetstream(),
    bucket: names.usageBucket,
    custom: controllerKc.makeApiClient(CustomObjectsApi),
    apikeys: () => (controller.watches.apikeys as ResourceWatch<ApiKeyResource>).list(),
    limits: new LimitStore(await ctl.jetstream().views.kv(names.limitsBucket, { bindOnly: true })),
    verifier: new MeterVerifier(await ctl.jetstream().views.kv(names.limitsBucket, { bindOnly: true })),
    intervalMs: 60_000, // flushed by the test
    log: (l) => controllerLog.push(l),
  });
  stack.defer(() => usage.stop());
  const id = `metered-${randomBytes(4).toString('hex')}`;
  await secret(nsB, 'metered-token', token(id));
  const budget = { tokens: 1000, period: 'day' as const };
  await apiKey(nsB, 'metered', { secretRef: { name: 'metered-token' }, limits: { budget } });
  await readyAs(nsB, 'metered', ApiKeyReason.registered);
  const identity = `${nsB}/metered`;
  const ledger = await UsageLedger.open(nc.jetstream(), names);
  const now = Date.now();
  const record = (n: number, key: string, total: number): UsageRecord => ({
    id: `req-${id}-${n}`,
    key,
    model: `${nsB}/demo`,
    kind: 'chat',
    start: now - 1000,
    end: now - 500 + n,
    outcome: 'completed',
    tokens: { prompt: total - 10, cached: 0, completion: 10, total },
    reported: true,
  });
  // Signed as the gateway signs each request's meter (dataplane/meter.ts).
  const meterKey = (await meterKeyOf(await nc.jetstream().views.kv(names.limitsBucket, { bindOnly: true }), { create: true }))!;
  const signed = (r: UsageRecord): UsageRecord => ({ ...r, sig: meterSignature(meterKey, r) });
  await ledger.record(signed(record(1, identity, 100)));
  await ledger.record(signed(record(2, identity, 50)));
  await ledger.record(signed(record(3, `${nsA}/metered`, 999))); // a key of the same name in another namespace
  await ledger.record(record(90, identity, 5000)); // no gateway signed it: not counted
  await ledger.record({ ...signed(record(91, `${nsA}/metered`, 70)), key: identity }); // signed for another key: not counted
  // The gateways charged the budget 150 and hold 200 for a request in flight.
  const admitted = await limits.admit(identity, { budget }, { id: 'settled', tokens: 150, replica: 'gw-test', leaseMs: 60_000 });
  expect(admitted.ok).toBe(true);
  await limits.settle(identity, { budget }, 'settled', 150);
  expect((await limits.admit(identity, { budget }, { id: 'in-flight', tokens: 200, replica: 'gw-test', leaseMs: 60_000 })).ok).toBe(true);

  const expected = {
    period: new Date(now).toISOString().slice(0, 10),
    requests: 2,
    promptTokens: 130,
    completionTokens: 20,
    totalTokens: 150,
    remainingTokens: 650,
    models: [{ model: `${nsB}/demo`, requests: 2, promptTokens: 130, completionTokens: 20, totalTokens: 150 }],
    lastUsed: new Date(now - 500 + 2).toISOString().replace(/\.\d{3}Z$/, 'Z'),
  };
  await until(
    'the usage status is written',
    async () => {
      await usage.flush();
      return sameJson((await getKey(nsB, 'metered')).status?.usage, expected);
    },
    15_000,
  );
  // The key reconciler's fields are its own still.
  expect(ready(await getKey(nsB, 'metered'))?.reason).toBe(ApiKeyReason.registered);
  const { stdout } = await execFileP('kubectl', ['--kubeconfig', kubeconfigFile, '-n', nsB, 'get', 'apikey', 'metered'], { timeout: 30_000 });
  expect(stdout).toMatch(/metered\s+metered-token\s+\S+\s+false\s+1000\s+day\s+150\s+650\s+True\s+Registered/);

  // A new record: written at the next flush; nothing new: nothing written.
  await ledger.record(signed(record(4, identity, 25)));
  await until(
    'the new record is counted',
    async () => {
      await usage.flush();
      return (await getKey(nsB, 'metered')).status?.usage?.totalTokens === 175;
    },
    15_000,
  );
  const version = (await getKey(nsB, 'metered')).metadata.resourceVersion;
  await usage.flush();
  expect((await getKey(nsB, 'metered')).metadata.resourceVersion).toBe(version);

  // A budget of the model's own (a bare name: the key's namespace) and a storage quota: what each has left, and what is stored.
  const limitsNow = { budget, models: { [`${nsB}/demo`]: { budget: { tokens: 400, period: 'day' as const } } }, storageBytes: 5000 };
  await patchSpec(nsB, 'metered', { limits: { models: { demo: { budget: { tokens: 400, period: 'day' } } }, storageBytes: 5000 } });
  await until('the entry has the model budget', async () => (await entryOf(id))?.limits?.storageBytes === 5000, 10_000);
  expect((await limits.admit(identity, limitsNow, { id: 'demo-in-flight', tokens: 100, model: `${nsB}/demo`, replica: 'gw-test', leaseMs: 60_000 })).ok).toBe(
    true,
  );
  await limits.storage(identity, limitsNow, { bytes: 1234, expiresAtMs: Date.now() + 86_400_000 });
  await until(
    'the status has what the model budget has left and what is stored',
    async () => {
      await usage.flush();
      const got = (await getKey(nsB, 'metered')).status?.usage;
      return (
        got?.remainingTokens === 1000 - 175 - 200 - 100 + 25 && // the ledger's 25 were not charged to the gateways' count
        got.storedBytes === 1234 &&
        sameJson(got.models, [{ model: `${nsB}/demo`, requests: 3, promptTokens: 145, completionTokens: 30, totalTokens: 175, remainingTokens: 300 }])
      );
    },
    15_000,
  );
}, 60_000);

/** Whether `a` and `b` are the same JSON, whatever the order of their objects' keys. */
function sameJson(a: unknown, b: unknown): boolean {
  const sorted = (v: unknown): unknown =>
    Array.isArray(v)
      ? v.map(sorted)
      : v && typeof v === 'object'
        ? Object.fromEntries(
            Object.entries(v)
              .sort(([x], [y]) => (x < y ? -1 : 1))
              .map(([k, x]) => [k, sorted(x)]),
          )
        : v;
  return JSON.stringify(sorted(a)) === JSON.stringify(sorted(b));
}

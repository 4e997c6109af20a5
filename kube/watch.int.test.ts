/**
 * watchResource against the real kube-apiserver + etcd of the harness: ConfigMaps in this file's
 * namespace (built-in, so no dependency on our CRDs), a TCP proxy to cut the watcher off from
 * the API server while changes are made directly, and etcd compaction to force a 410.
 *
 * Bookmarks are not exercised here: the harness runs kube-apiserver with --watch-cache=false,
 * and only the watch cache sends BOOKMARK events. watch.test.ts checks against a scripted
 * server that every watch asks for them and that their resourceVersion is used.
 */
import { CoreV1Api, KubeConfig, type V1ConfigMap } from '@kubernetes/client-node';
import { endpoint, isolation } from '../test/harness';
import { kubeConfig } from '../test/harness/kube';
import { startTcpProxy, type TcpProxy } from '../test/harness/tcp-proxy';
import { sleep, until } from '../test/harness/wait';
import { watchNamespaces, watchResource, type ResourceWatch, type WatchEventType } from './watch';

const iso = isolation();
const ns = iso.namespace;
const path = `/api/v1/namespaces/${ns}/configmaps`;
const LABEL = 'magus.dev/watch-test';
const FAST_BACKOFF = { initialMs: 50, maxMs: 400 };

let core: CoreV1Api;
const proxies: TcpProxy[] = [];
const watches: ResourceWatch<V1ConfigMap>[] = [];

beforeAll(async () => {
  core = kubeConfig().makeApiClient(CoreV1Api);
  await core.createNamespace({ body: { metadata: { name: ns } } });
});

afterAll(async () => {
  for (const w of watches) await w.stop();
  for (const p of proxies) await p.close();
  await core?.deleteNamespace({ name: ns }).catch(() => undefined);
});

/** What a test sees: `TYPE name=value` (value = data.v), or the uid for identity checks. */
interface Seen {
  type: WatchEventType;
  name: string;
  v: string | undefined;
  uid: string | undefined;
}

function start(kc: KubeConfig, group: string, extra: { timeoutSeconds?: number } = {}) {
  const seen: Seen[] = [];
  const logs: string[] = [];
  let syncs = 0;
  const watch = watchResource<V1ConfigMap>(kc, {
    path,
    labelSelector: `${LABEL}=${group}`,
    backoff: FAST_BACKOFF,
    onEvent: (type, cm) => seen.push({ type, name: cm.metadata!.name!, v: cm.data?.v, uid: cm.metadata!.uid }),
    onSynced: () => syncs++,
    log: (line) => logs.push(line),
    ...extra,
  });
  watches.push(watch);
  return { watch, seen, logs, syncs: () => syncs, show: () => seen.map((s) => `${s.type} ${s.name}=${s.v ?? ''}`) };
}

const create = (name: string, group: string | undefined, v: string) =>
  core.createNamespacedConfigMap({ namespace: ns, body: { metadata: { name, labels: group ? { [LABEL]: group } : {} }, data: { v } } });
const update = (name: string, v: string) => core.patchNamespacedConfigMap({ namespace: ns, name, body: [{ op: 'replace', path: '/data/v', value: v }] });
const remove = (name: string) => core.deleteNamespacedConfigMap({ namespace: ns, name });

/** A client that reaches the API server only through a cuttable TCP proxy. */
async function proxied(): Promise<{ kc: KubeConfig; proxy: TcpProxy }> {
  const { server, token } = endpoint('kubernetes');
  const target = new URL(server);
  const proxy = await startTcpProxy({ host: target.hostname, port: Number(target.port) });
  proxies.push(proxy);
  const kc = new KubeConfig();
  kc.loadFromOptions({
    clusters: [{ name: 'proxied', server: `https://${proxy.address}`, skipTLSVerify: true }],
    users: [{ name: 'magus-admin', token }],
    contexts: [{ name: 'proxied', cluster: 'proxied', user: 'magus-admin' }],
    currentContext: 'proxied',
  });
  return { kc, proxy };
}

/** Compacts etcd at its current revision (physically), through its HTTP/JSON gateway. */
async function compactEtcd(): Promise<void> {
  const { etcdUrl } = endpoint('kubernetes');
  const post = async (p: string, body: unknown): Promise<unknown> => {
    const res = await fetch(`${etcdUrl}${p}`, { method: 'POST', body: JSON.stringify(body) });
    if (!res.ok) throw new Error(`etcd ${p}: HTTP ${res.status} ${await res.text()}`);
    return res.json();
  };
  const range = (await post('/v3/kv/range', { key: 'AA==' })) as { header: { revision: string } };
  await post('/v3/kv/compaction', { revision: range.header.revision, physical: true });
}

test('create, update and delete arrive in order, filtered by label, across server-side watch timeouts; nothing after stop()', async () => {
  await create('a', 't1', '1');
  // A 2 s server-side timeout: the watch is re-made several times during the test, each time
  // from the last resourceVersion (no relist, no error).
  const { watch, seen, syncs, show } = start(kubeConfig(), 't1', { timeoutSeconds: 2 });
  await watch.synced;
  expect(show()).toEqual(['ADDED a=1']);
  expect(syncs()).toBe(1);

  await create('b', 't1', '1');
  await until('ADDED b', () => seen.length === 2);
  await until('a watch to end on its timeout and be re-made', () => watch.stats.watches >= 3, 15_000);
  await update('b', '2');
  // Another group's ConfigMap, created before the last change: if the selector let it through,
  // it would arrive before DELETED b.
  await create('other', 't1-other', '1');
  await remove('b');
  await until('DELETED b', () => seen.some((s) => s.type === 'DELETED'));

  expect(show()).toEqual(['ADDED a=1', 'ADDED b=1', 'MODIFIED b=2', 'DELETED b=2']);
  expect(watch.list().map((cm) => cm.metadata?.name)).toEqual(['a']);
  expect(watch.get(ns, 'a')?.data?.v).toBe('1');
  expect(watch.get(ns, 'b')).toBeUndefined();
  // Listed and watched objects look alike (a typed list's items carry no apiVersion/kind).
  expect(watch.get(ns, 'a')).toMatchObject({ apiVersion: 'v1', kind: 'ConfigMap' });
  expect(watch.stats).toMatchObject({ lists: 1, errors: 0, relistsOn410: 0, events: 3 });

  await watch.stop();
  await create('c', 't1', '1');
  await update('a', '2');
  // Absence can only be shown by waiting: longer than the watch took above to report a change.
  await sleep(1_000);
  expect(show()).toEqual(['ADDED a=1', 'ADDED b=1', 'MODIFIED b=2', 'DELETED b=2']);
  expect(syncs()).toBe(1);
});

test('an API server unreachable at start, then a cut connection: it retries until it lists, and resumes from its resourceVersion seeing every change made meanwhile', async () => {
  const { kc, proxy } = await proxied();
  await create('x', 't2', '1');
  await create('y', 't2', '1');

  proxy.cut();
  const { watch, seen, logs, show } = start(kc, 't2');
  await until('two failed lists', () => watch.stats.errors >= 2);
  proxy.restore();
  await watch.synced;
  expect(show().sort()).toEqual(['ADDED x=1', 'ADDED y=1']);

  // The watch is live: a change arrives through it.
  await create('w', 't2', '1');
  await until('ADDED w', () => seen.length === 3);

  const errorsBefore = watch.stats.errors;
  proxy.cut();
  await until('the watcher to notice the cut', () => watch.stats.errors > errorsBefore);
  await create('z', 't2', '1');
  await update('x', '2');
  await remove('y');
  proxy.restore();
  await until('the changes made while cut', () => seen.length === 6, 20_000);

  expect(show().slice(3)).toEqual(['ADDED z=1', 'MODIFIED x=2', 'DELETED y=1']);
  // Resumed from the last resourceVersion: the changes came from the watch, not from a relist.
  expect(watch.stats).toMatchObject({ lists: 1, relistsOn410: 0, events: 4 });
  expect(
    watch
      .list()
      .map((cm) => cm.metadata?.name)
      .sort(),
  ).toEqual(['w', 'x', 'z']);
  expect(logs.some((l) => l.includes('watch failed'))).toBe(true);

  // stop() while the watcher is between retries returns at once and ends the callbacks.
  const errorsNow = watch.stats.errors;
  proxy.cut();
  await until('a failure after the second cut', () => watch.stats.errors > errorsNow);
  const stopping = Date.now();
  await watch.stop();
  expect(Date.now() - stopping).toBeLessThan(1_000);
  proxy.restore();
  await create('after-stop', 't2', '1');
  await sleep(1_000);
  expect(seen).toHaveLength(6);
});

test('a resourceVersion compacted away while cut off: 410, relist, and the relist reports changes including deletions and a re-creation', async () => {
  const { kc, proxy } = await proxied();
  for (const name of ['p', 'q', 'r']) await create(name, 't3', '1');
  const { watch, seen, logs, show } = start(kc, 't3');
  await watch.synced;
  expect(show().sort()).toEqual(['ADDED p=1', 'ADDED q=1', 'ADDED r=1']);
  const oldR = watch.get(ns, 'r')!.metadata!.uid!;

  proxy.cut();
  await until('the watcher to notice the cut', () => watch.stats.errors > 0);
  await create('s', 't3', '1');
  await update('p', '2');
  await remove('q');
  await remove('r');
  const newR = (await create('r', 't3', '2')).metadata!.uid!;
  await compactEtcd();
  proxy.restore();

  await until('a relist on 410', () => watch.stats.relistsOn410 >= 1, 20_000);
  await until('the relist to be delivered', () => watch.stats.lists === 2);
  const afterRelist = seen.slice(3);
  // Objects gone from the list first, then the list in its (name) order; a re-created name is
  // its old object's DELETED followed by the new one's ADDED.
  expect(afterRelist.map((s) => `${s.type} ${s.name}=${s.v ?? ''}`)).toEqual(['DELETED q=1', 'MODIFIED p=2', 'DELETED r=1', 'ADDED r=2', 'ADDED s=1']);
  expect(afterRelist.find((s) => s.type === 'DELETED' && s.name === 'r')?.uid).toBe(oldR);
  expect(afterRelist.find((s) => s.type === 'ADDED' && s.name === 'r')?.uid).toBe(newR);
  expect(watch.get(ns, 'q')).toBeUndefined();
  expect(watch.get(ns, 'r')?.metadata?.uid).toBe(newR);
  expect(logs.some((l) => /410/.test(l))).toBe(true);
  process.stderr.write(`410 as seen by the watcher: ${logs.filter((l) => /410/.test(l)).join(' | ')}\n`);

  // And it watches again from the relist.
  await update('s', '2');
  await until('MODIFIED s', () => seen.some((s) => s.type === 'MODIFIED' && s.name === 's'));
  await watch.stop();
});

test('watchNamespaces: one watch per listed namespace seen as one — their objects and no other namespace’s, synced once all have listed, counters summed', async () => {
  const [a, b, other] = [`${ns}-a`, `${ns}-b`, `${ns}-c`];
  for (const n of [a, b, other]) await core.createNamespace({ body: { metadata: { name: n } } });
  try {
    const made = (namespace: string, name: string) =>
      core.createNamespacedConfigMap({ namespace, body: { metadata: { name, labels: { [LABEL]: 'ns' } }, data: { v: namespace } } });
    await made(a, 'before');
    await made(other, 'before');
    const seen: string[] = [];
    let syncs = 0;
    const watch = watchNamespaces<V1ConfigMap>(kubeConfig(), [a, b], {
      path: (scope) => `/api/v1${scope}/configmaps`,
      labelSelector: `${LABEL}=ns`,
      backoff: FAST_BACKOFF,
      onEvent: (type, cm) => seen.push(`${type} ${cm.metadata!.namespace}/${cm.metadata!.name}`),
      onSynced: () => syncs++,
    });
    watches.push(watch);
    await watch.synced;
    expect({ seen: [...seen], syncs }).toEqual({ seen: [`ADDED ${a}/before`], syncs: 1 });
    await made(b, 'after');
    await made(other, 'after');
    await until('the new ConfigMap in b is seen', () => seen.includes(`ADDED ${b}/after`), 10_000);
    await sleep(300);
    expect(seen).toEqual([`ADDED ${a}/before`, `ADDED ${b}/after`]);
    expect([watch.get(a, 'before')?.data?.v, watch.get(b, 'after')?.data?.v, watch.get(other, 'before')]).toEqual([a, b, undefined]);
    expect(
      watch
        .list()
        .map((cm) => `${cm.metadata!.namespace}/${cm.metadata!.name}`)
        .sort(),
    ).toEqual([`${a}/before`, `${b}/after`]);
    // Two namespaces, two lists; each watch's own events.
    expect({ lists: watch.stats.lists, events: watch.stats.events }).toEqual({ lists: 2, events: 1 });
    await watch.stop();
  } finally {
    for (const n of [a, b, other]) await core.deleteNamespace({ name: n }).catch(() => undefined);
  }
});

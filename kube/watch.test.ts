/**
 * watchResource against a scripted HTTP server on loopback, for what the real API server of the
 * integration tests cannot be made to do on demand: send BOOKMARKs (it runs without the watch
 * cache), answer a watch with HTTP 410 or 500, send a non-410 ERROR event, expire a list's
 * continue token, or end every watch at once. watch.int.test.ts covers the real thing.
 */
import { createServer, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo, Socket } from 'node:net';
import { KubeConfig } from '@kubernetes/client-node';
import { sleep, until } from '../test/harness/wait';
import { backoffDelay, watchResource, type ResourceWatch, type WatchEventType, type WatchedObject } from './watch';

const PATH = '/api/v1/namespaces/ns/configmaps';

interface Request {
  kind: 'list' | 'watch';
  /** 0-based index among requests of the same kind. */
  n: number;
  q: URLSearchParams;
}
/** Answers a request, or returns false to leave it hanging (an idle watch, a slow list). */
type Script = (req: Request, res: ServerResponse) => boolean | void;

let server: Server | undefined;
const sockets = new Set<Socket>();
const running: ResourceWatch<WatchedObject>[] = [];

afterEach(async () => {
  for (const w of running.splice(0)) await w.stop();
  for (const s of sockets) s.destroy();
  await new Promise<void>((resolve) => (server ? server.close(() => resolve()) : resolve()));
  server = undefined;
});

async function fakeApiServer(script: Script): Promise<{ kc: KubeConfig; requests: Request[] }> {
  const requests: Request[] = [];
  const counts = { list: 0, watch: 0 };
  server = createServer((req, res) => {
    const url = new URL(req.url ?? '/', 'http://x');
    if (url.pathname !== PATH || req.headers.authorization !== 'Bearer t0ken') {
      res.writeHead(404).end();
      return;
    }
    const kind = url.searchParams.get('watch') === 'true' ? 'watch' : 'list';
    const r: Request = { kind, n: counts[kind]++, q: url.searchParams };
    requests.push(r);
    if (script(r, res) === false) {
      // Hanging: a watch sends its headers at once, as the API server does.
      if (kind === 'watch') res.writeHead(200, { 'Content-Type': 'application/json' }).flushHeaders();
    }
  });
  server.on('connection', (s) => {
    sockets.add(s);
    s.on('close', () => sockets.delete(s));
  });
  await new Promise<void>((resolve) => server!.listen(0, '127.0.0.1', resolve));
  const kc = new KubeConfig();
  kc.loadFromOptions({
    clusters: [{ name: 'fake', server: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, skipTLSVerify: true }],
    users: [{ name: 'u', token: 't0ken' }],
    contexts: [{ name: 'fake', cluster: 'fake', user: 'u' }],
    currentContext: 'fake',
  });
  return { kc, requests };
}

const cm = (name: string, rv: string, uid = `uid-${name}`): WatchedObject => ({ metadata: { name, namespace: 'ns', uid, resourceVersion: rv } });
const list = (res: ServerResponse, rv: string, items: WatchedObject[], cont?: string): void => {
  res
    .writeHead(200, { 'Content-Type': 'application/json' })
    .end(JSON.stringify({ apiVersion: 'v1', kind: 'ConfigMapList', metadata: { resourceVersion: rv, continue: cont }, items }));
};
const status = (res: ServerResponse, code: number, reason: string): void => {
  res
    .writeHead(code, { 'Content-Type': 'application/json' })
    .end(JSON.stringify({ kind: 'Status', status: 'Failure', code, reason, message: `${reason} (scripted)` }));
};
/** A watch response with these events, then the end of the stream. */
const stream = (res: ServerResponse, events: { type: string; object: unknown }[]): void => {
  res.writeHead(200, { 'Content-Type': 'application/json' });
  for (const e of events) res.write(`${JSON.stringify(e)}\n`);
  res.end();
};

function start(kc: KubeConfig, extra: { pageSize?: number; timeoutSeconds?: number; throwOn?: string } = {}) {
  const seen: string[] = [];
  const logs: string[] = [];
  const watch = watchResource<WatchedObject>(kc, {
    path: PATH,
    timeoutSeconds: extra.timeoutSeconds ?? 7,
    pageSize: extra.pageSize,
    backoff: { initialMs: 20, maxMs: 100 },
    onEvent: (type: WatchEventType, o) => {
      seen.push(`${type} ${o.metadata?.name}@${o.metadata?.resourceVersion}`);
      if (o.metadata?.name === extra.throwOn) throw new Error('handler bug');
    },
    log: (line) => logs.push(line),
  });
  running.push(watch);
  return { watch, seen, logs };
}

test('every watch asks for bookmarks with its timeout, and resumes from the last BOOKMARK or event', async () => {
  const { kc, requests } = await fakeApiServer((r, res) => {
    if (r.kind === 'list') return list(res, '10', [cm('a', '5')]);
    if (r.n === 0) return stream(res, [{ type: 'BOOKMARK', object: { kind: 'ConfigMap', apiVersion: 'v1', metadata: { resourceVersion: '20' } } }]);
    if (r.n === 1) return stream(res, [{ type: 'MODIFIED', object: cm('a', '21') }]);
    return false;
  });
  const { watch, seen, logs } = start(kc, { throwOn: 'a' });
  await until('a third watch', () => requests.filter((r) => r.kind === 'watch').length === 3, 5_000);

  const watches = requests.filter((r) => r.kind === 'watch');
  for (const w of watches) {
    expect(w.q.get('allowWatchBookmarks')).toBe('true');
    expect(w.q.get('timeoutSeconds')).toBe('7');
  }
  expect(watches.map((w) => w.q.get('resourceVersion'))).toEqual(['10', '20', '21']);
  expect(seen).toEqual(['ADDED a@5', 'MODIFIED a@21']);
  // onEvent threw both times: logged, and the watch carried on.
  expect(logs.filter((l) => l.includes('onEvent') && l.includes('threw: handler bug'))).toHaveLength(2);
  expect(watch.stats).toMatchObject({ lists: 1, watches: 3, errors: 0, relistsOn410: 0, events: 1, bookmarks: 1 });
});

test('HTTP 410 or an ERROR 410 event relists; HTTP 5xx and other ERROR events back off and resume from the same resourceVersion', async () => {
  const { kc, requests } = await fakeApiServer((r, res) => {
    if (r.kind === 'list') {
      if (r.n === 0) return list(res, '10', [cm('a', '1'), cm('b', '2')]);
      if (r.n === 1) return list(res, '30', [cm('a', '1')]); // b deleted meanwhile
      return list(res, '40', [cm('a', '35', 'uid-a2')]); // a re-created meanwhile
    }
    if (r.n === 0) return status(res, 500, 'InternalError');
    if (r.n === 1) return stream(res, [{ type: 'ERROR', object: { kind: 'Status', code: 500, reason: 'InternalError', message: 'etcd hiccup' } }]);
    if (r.n === 2) return status(res, 410, 'Gone');
    if (r.n === 3)
      return stream(res, [{ type: 'ERROR', object: { kind: 'Status', code: 410, reason: 'Expired', message: 'too old resource version: 30 (35)' } }]);
    return false;
  });
  const { watch, seen, logs } = start(kc);
  await until('a fifth watch', () => requests.filter((r) => r.kind === 'watch').length === 5, 5_000);

  expect(requests.filter((r) => r.kind === 'watch').map((w) => w.q.get('resourceVersion'))).toEqual(['10', '10', '10', '30', '40']);
  expect(seen).toEqual(['ADDED a@1', 'ADDED b@2', 'DELETED b@2', 'DELETED a@1', 'ADDED a@35']);
  expect(watch.get('ns', 'a')?.metadata?.uid).toBe('uid-a2');
  expect(watch.stats).toMatchObject({ lists: 3, watches: 5, errors: 2, relistsOn410: 2 });
  expect(logs.filter((l) => l.includes('retrying in'))).toHaveLength(2);
});

test('list pages are followed; an expired continue token lists again from the start; nothing is delivered from a partial list', async () => {
  const { kc, requests } = await fakeApiServer((r, res) => {
    if (r.kind === 'watch') return false;
    const cont = r.q.get('continue');
    if (!cont) return list(res, '50', [cm('a', '1'), cm('b', '2')], r.n === 0 ? 'tok1' : 'tok2');
    if (cont === 'tok1') return status(res, 410, 'Expired');
    return list(res, '50', [cm('c', '3')]);
  });
  const { watch, seen } = start(kc, { pageSize: 2 });
  await watch.synced;

  expect(requests.filter((r) => r.kind === 'list').map((r) => `${r.q.get('limit')}:${r.q.get('continue') ?? ''}`)).toEqual(['2:', '2:tok1', '2:', '2:tok2']);
  expect(seen).toEqual(['ADDED a@1', 'ADDED b@2', 'ADDED c@3']);
  // Typed list items get the list's apiVersion and kind.
  expect(watch.get('ns', 'c')).toMatchObject({ apiVersion: 'v1', kind: 'ConfigMap' });
  await until('the watch', () => requests.some((r) => r.kind === 'watch'));
  expect(requests.find((r) => r.kind === 'watch')?.q.get('resourceVersion')).toBe('50');
  expect(watch.stats).toMatchObject({ lists: 1, errors: 0 });
});

test('a watch that ends as soon as it starts counts as a failure and backs off instead of spinning', async () => {
  const { kc } = await fakeApiServer((r, res) => (r.kind === 'list' ? list(res, '1', []) : stream(res, [])));
  const { watch } = start(kc);
  await watch.synced;
  await sleep(600);
  // Backoff 20 → 100 ms: about 8 attempts in 600 ms; without it, hundreds.
  expect(watch.stats.watches).toBeLessThan(15);
  expect(watch.stats.errors).toBeGreaterThanOrEqual(watch.stats.watches - 1);
});

test('stop() during a list that never answers aborts it at once and rejects synced', async () => {
  const { kc, requests } = await fakeApiServer(() => false);
  const { watch } = start(kc);
  await until('the list request', () => requests.length === 1);
  // The list never answers: a stop that waited for it would never resolve (the test times out).
  await watch.stop();
  await expect(watch.synced).rejects.toThrow(/stopped before the first list/);
  await until('the aborted request to close its socket', () => sockets.size === 0, 30_000);
});

test('backoff doubles from initialMs up to maxMs, jittered within the upper half', () => {
  const b = { initialMs: 100, maxMs: 1_000 };
  for (let i = 0; i < 50; i++) {
    const d1 = backoffDelay(b, 1);
    const d3 = backoffDelay(b, 3);
    const d10 = backoffDelay(b, 10);
    expect(d1).toBeGreaterThanOrEqual(50);
    expect(d1).toBeLessThanOrEqual(100);
    expect(d3).toBeGreaterThanOrEqual(200);
    expect(d3).toBeLessThanOrEqual(400);
    expect(d10).toBeGreaterThanOrEqual(500);
    expect(d10).toBeLessThanOrEqual(1_000);
  }
});

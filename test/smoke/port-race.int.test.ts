/**
 * Ports under pressure: a port chosen for a server can be taken by another process before the
 * server binds it. Here the test takes them itself — for each server, the first start gets a port
 * a listener of this test already holds (then, where a server has two, the second start gets the
 * other one taken) — and every server must still come up, on new ports, saying how often it retried.
 * Also: restartKubernetes keeps what etcd holds, and `magus dev`'s port rule (`listenOnPort`).
 */
import { request } from 'node:https';
import { connect, createServer, type AddressInfo, type Server } from 'node:net';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { freePort, listenOnPort, startServices, type PortRequest, type RunningServices, type ServerName } from '../../workers/dev/services';
import { s3Answers } from '../../workers/dev/services/probes';

/** For each server: which port is taken from it on its 1st, 2nd, … start. */
const TAKE: Record<ServerName, string[]> = {
  temporal: ['frontend', 'ui'],
  nats: ['client', 'monitor'],
  s3proxy: ['api'],
  minio: [],
  etcd: ['client', 'peer'],
  'kube-apiserver': ['api'],
};

/** What each server printed about it (exact text, `N` for the port). */
const SAYS: Record<ServerName, Record<string, string>> = {
  temporal: {
    frontend: "can't set frontend port N: listen tcp 127.0.0.1:N: bind: address already in use",
    ui: "can't set UI port N: listen tcp 127.0.0.1:N: bind: address already in use",
  },
  nats: {
    client: 'Error listening on port: 127.0.0.1:N, "listen tcp 127.0.0.1:N: bind: address already in use"',
    monitor: "Can't start monitoring: can't listen to the monitor port: listen tcp 127.0.0.1:N: bind: address already in use",
  },
  s3proxy: { api: 'Failed to bind to /127.0.0.1:N' },
  minio: {},
  etcd: {
    client: '"error":"listen tcp 127.0.0.1:N: bind: address already in use"',
    peer: '"error":"listen tcp 127.0.0.1:N: bind: address already in use"',
  },
  'kube-apiserver': { api: 'failed to create listener: failed to listen on 127.0.0.1:N: listen tcp 127.0.0.1:N: bind: address already in use' },
};

const squatters: Server[] = [];
/** A port that a listener of this test holds: "another process" got there first. */
async function squat(): Promise<number> {
  const srv = createServer((s) => s.destroy());
  await new Promise<void>((ok) => srv.listen(0, '127.0.0.1', ok));
  squatters.push(srv);
  return (srv.address() as AddressInfo).port;
}

afterAll(() => Promise.all(squatters.map((s) => new Promise((r) => s.close(r)))));

/** A request to a kube-apiserver (self-signed TLS); `json` when it answered JSON. */
function kube(server: string, token: string, method: string, path: string, body?: unknown): Promise<{ status: number; json?: Record<string, unknown> }> {
  return new Promise((ok, fail) => {
    const headers = { authorization: `Bearer ${token}`, 'content-type': 'application/json' };
    const req = request(`${server}${path}`, { method, rejectUnauthorized: false, agent: false, headers }, (res) => {
      let text = '';
      res.on('data', (d: Buffer) => (text += d.toString()));
      res.on('end', () => {
        const isJson = res.headers['content-type']?.startsWith('application/json') === true;
        ok({ status: res.statusCode ?? 0, json: isJson ? (JSON.parse(text) as Record<string, unknown>) : undefined });
      });
    });
    req.on('error', fail);
    req.end(body === undefined ? undefined : JSON.stringify(body));
  });
}

const get = (url: string) => fetch(url, { signal: AbortSignal.timeout(10_000) });

const tcpAccepts = (address: string) =>
  new Promise<boolean>((ok) => {
    const [host, port] = address.split(':');
    const sock = connect(Number(port), host);
    sock.once('connect', () => {
      sock.destroy();
      ok(true);
    });
    sock.once('error', () => ok(false));
  });

describe('servers started under port pressure', () => {
  const taken: (PortRequest & { port: number })[] = [];
  const notes: string[] = [];
  let services: RunningServices;
  let startedIn = 0;

  beforeAll(async () => {
    const t0 = Date.now();
    services = await startServices({
      readyTimeoutSec: 180,
      log: (line) => notes.push(line),
      portPicker: async (req) => {
        if (TAKE[req.server][req.attempt - 1] !== req.role) return freePort();
        const port = await squat();
        taken.push({ ...req, port });
        return port;
      },
    });
    startedIn = Date.now() - t0;
  }, 300_000);

  afterAll(() => services?.stop());

  test('every server comes up on new ports after its first ones were taken, and says how often it retried', async () => {
    process.stderr.write(`port-race: all servers ready in ${(startedIn / 1000).toFixed(1)}s with ${taken.length} ports taken\n`);
    expect(services.retries).toEqual({ temporal: 2, nats: 2, s3proxy: 1, etcd: 2, 'kube-apiserver': 1 });
    expect(taken).toHaveLength(8);
    for (const t of taken) {
      // Our note, and the server's own words in its log.
      expect(notes).toContainEqual(expect.stringContaining(`${t.server}: port ${t.port} (${t.role}) was taken by another process`));
      const log = readFileSync(join(services.dataDir, 'logs', `${t.server}.log`), 'utf8');
      expect(log).toContain(SAYS[t.server][t.role]!.replaceAll('N', String(t.port)));
    }

    const e = services.endpoints;
    const inUse = JSON.stringify(e);
    for (const t of taken) expect(inUse).not.toMatch(new RegExp(`:${t.port}(?!\\d)`));
    expect(await tcpAccepts(e.temporal!.address)).toBe(true);
    expect((await get(e.temporal!.uiUrl)).ok).toBe(true);
    expect((await get(`${e.nats!.monitorUrl}/healthz?js-enabled-only=true`)).status).toBe(200);
    expect(await s3Answers(e.s3!.endpoint, e.s3!)).toBe(true);
    const readyz = await kube(e.kubernetes!.server, e.kubernetes!.token, 'GET', '/readyz');
    expect(readyz.status).toBe(200);
    expect((await get(`${e.kubernetes!.etcdUrl}/health`)).status).toBe(200);
  });

  test('restartKubernetes: a new kube-apiserver on the same port, etcd kept, a ConfigMap still there', async () => {
    const { server, token } = services.endpoints.kubernetes!;
    const ns = `port-race-${process.pid}`;
    expect((await kube(server, token, 'POST', '/api/v1/namespaces', { metadata: { name: ns } })).status).toBe(201);
    const created = await kube(server, token, 'POST', `/api/v1/namespaces/${ns}/configmaps`, { metadata: { name: 'kept' }, data: { answer: '42' } });
    expect(created.status).toBe(201);
    const before = services.pids;

    const t0 = Date.now();
    await services.restartKubernetes();
    process.stderr.write(`port-race: kube-apiserver restarted in ${((Date.now() - t0) / 1000).toFixed(1)}s\n`);

    const after = services.pids;
    expect(before.filter((pid) => !after.includes(pid))).toHaveLength(1); // only the apiserver is new
    expect(after).toHaveLength(before.length);
    expect(services.endpoints.kubernetes!.server).toBe(server);
    const read = await kube(server, token, 'GET', `/api/v1/namespaces/${ns}/configmaps/kept`);
    expect([read.status, (read.json?.data as Record<string, string> | undefined)?.answer]).toEqual([200, '42']);
  }, 120_000);
});

test('a server whose ports keep being taken fails after 5 starts, naming it and the port', async () => {
  const requests: PortRequest[] = [];
  const started = startServices({
    services: ['nats'],
    log: () => undefined,
    portPicker: (req) => {
      requests.push(req);
      return squat();
    },
  });
  await expect(started).rejects.toThrow(
    /^nats could not start: on each of its 5 starts another process took a port chosen for it before it could bind it \(last: port \d+ \((client|monitor)\)\)/,
  );
  expect(requests.map((r) => `${r.attempt}:${r.role}`)).toEqual([1, 2, 3, 4, 5].flatMap((a) => [`${a}:client`, `${a}:monitor`]));
});

describe("magus dev's gateway port (listenOnPort)", () => {
  const listen = (port: number) =>
    new Promise<Server>((ok, fail) => {
      const srv = createServer();
      srv.once('error', fail);
      srv.listen(port, '127.0.0.1', () => ok(srv));
    });

  test('a port the user gave that is taken is an error naming it, not a retry', async () => {
    const busy = await squat();
    await expect(listenOnPort('the gateway', listen, { port: busy, preferred: 8080, flag: '--port' })).rejects.toThrow(
      `the gateway cannot listen on port ${busy}: another process already uses it; choose another port with --port`,
    );
  });

  test('the default port taken: one the kernel picks', async () => {
    const busy = await squat();
    const srv = await listenOnPort('the gateway', listen, { preferred: busy });
    squatters.push(srv);
    const port = (srv.address() as AddressInfo).port;
    expect(port).not.toBe(busy);
    expect(port).toBeGreaterThan(0);
  });
});

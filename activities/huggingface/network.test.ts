/**
 * Model sources that cannot reach inside: the hub client's address checks, decided on the
 * resolved address before any connection is made. Names resolve through a resolver the test
 * controls; every server is on loopback, and `beforeConnect` stops any connection that would
 * leave it, so no test sends a packet anywhere else even if a check were broken.
 */
import type { LookupAddress } from 'node:dns';
import { createServer as createHttpServer, type IncomingMessage, type Server as HttpServer } from 'node:http';
import { connect, createServer, isIP, type AddressInfo, type Server, type Socket } from 'node:net';
import { startTestHub, type TestHub } from '../../test/fixtures/hub';
import { addressKind, allowedNetworks, embeddedIpv4, parseAllowedNetworks, refusedKind, type AddressKind } from './addresses';
import { HubClient, isHubError, type HubError } from './client';
import { hubFetch, type HubResolver } from './network';

const TOKEN = 'hf_networkTestSecretToken321';
const SHA = 'a'.repeat(40);
/** What a failing or redirecting server writes; never to be seen in an error. */
const MARKER = 'INTERNAL-ONLY-9f3c';

describe('address kinds', () => {
  test.each<[string, AddressKind | null]>([
    ['127.0.0.1', 'loopback'],
    ['127.255.1.2', 'loopback'],
    ['::1', 'loopback'],
    ['::ffff:127.0.0.1', 'loopback'],
    ['::ffff:7f00:1', 'loopback'],
    ['10.0.0.5', 'private'],
    ['172.16.0.1', 'private'],
    ['172.31.255.255', 'private'],
    ['192.168.1.1', 'private'],
    ['fd12:3456::1', 'private'],
    ['::ffff:10.1.2.3', 'private'],
    ['169.254.1.1', 'link-local'],
    ['fe80::1', 'link-local'],
    ['fe80::1%eth0', 'link-local'],
    ['169.254.169.254', 'metadata'],
    ['::ffff:169.254.169.254', 'metadata'],
    ['fd00:ec2::254', 'metadata'],
    ['100.100.100.200', 'metadata'],
    ['100.64.0.1', 'shared'],
    ['0.0.0.0', 'unspecified'],
    ['0.1.2.3', 'unspecified'],
    ['::', 'unspecified'],
    ['224.0.0.1', 'reserved'],
    ['255.255.255.255', 'reserved'],
    ['ff02::1', 'reserved'],
    ['::7f00:1', 'reserved'],
    // NAT64 and 6to4 carry an IPv4 address: judged by it.
    ['64:ff9b::a00:5', 'private'],
    ['64:ff9b::169.254.169.254', 'metadata'],
    ['2002:7f00:1::1', 'loopback'],
    ['64:ff9b::102:304', null],
    // Public addresses (strings only: nothing connects to them).
    ['1.2.3.4', null],
    ['172.32.0.1', null],
    ['100.128.0.1', null],
    ['2a00:1450::1', null],
    ['::ffff:1.2.3.4', null],
    ['not an address', 'reserved'],
  ])('%s is %s', (address, kind) => {
    expect(addressKind(address)).toBe(kind);
  });

  test('embedded IPv4 of NAT64 and 6to4 addresses', () => {
    expect(embeddedIpv4('64:ff9b::c0a8:101')).toBe('192.168.1.1');
    expect(embeddedIpv4('2002:c0a8:101::')).toBe('192.168.1.1');
    expect(embeddedIpv4('2001:db8::1')).toBeNull();
    expect(embeddedIpv4('10.0.0.1')).toBeNull();
  });

  test('allowed networks: keywords and CIDRs; a CIDR allows what is in it, a keyword its kind only', () => {
    const allow = allowedNetworks(' loopback , 10.1.0.0/16, fd00:1::/64,192.168.7.7, 169.254.169.254');
    expect(allow.entries).toEqual(['loopback', '10.1.0.0/16', 'fd00:1::/64', '192.168.7.7', '169.254.169.254']);
    expect(refusedKind('127.0.0.9', allow)).toBeNull();
    expect(refusedKind('::1', allow)).toBeNull();
    expect(refusedKind('10.1.200.3', allow)).toBeNull();
    expect(refusedKind('::ffff:10.1.200.3', allow)).toBeNull();
    expect(refusedKind('10.2.0.1', allow)).toBe('private');
    expect(refusedKind('fd00:1::5', allow)).toBeNull();
    expect(refusedKind('fd00:2::5', allow)).toBe('private');
    expect(refusedKind('192.168.7.7', allow)).toBeNull();
    expect(refusedKind('192.168.7.8', allow)).toBe('private');
    expect(refusedKind('169.254.169.254', allow)).toBeNull();
    expect(refusedKind('169.254.1.1', allow)).toBe('link-local');
    // The keyword link-local does not take metadata with it.
    const linkLocal = allowedNetworks(['link-local']);
    expect(refusedKind('169.254.1.1', linkLocal)).toBeNull();
    expect(refusedKind('169.254.169.254', linkLocal)).toBe('metadata');
    expect(refusedKind('1.2.3.4', allowedNetworks([]))).toBeNull();
  });

  test('a bad entry is named', () => {
    const { problems } = parseAllowedNetworks(['private', 'intranet', '10.0.0.0/33', '10.0.0.0/x', '300.1.1.1']);
    expect(problems).toHaveLength(4);
    expect(problems[0]).toContain('"intranet" is neither a CIDR');
    expect(problems[0]).toContain('loopback, private, link-local, metadata, shared, unspecified, reserved');
    expect(() => allowedNetworks('10.0.0.0/8,nope')).toThrow(/"nope" is neither a CIDR/);
  });
});

/** A loopback TCP server that counts connections and pipes them to `target` (the test hub). */
interface Counter {
  port: number;
  connections: number;
  close(): Promise<void>;
}

async function countingProxy(host: string, target: { host: string; port: number }): Promise<Counter> {
  const sockets = new Set<Socket>();
  const counter = { port: 0, connections: 0, close: () => Promise.resolve() };
  const server: Server = createServer((client) => {
    counter.connections++;
    const upstream = connect(target);
    for (const s of [client, upstream]) {
      sockets.add(s);
      s.on('close', () => sockets.delete(s));
      s.on('error', () => undefined);
    }
    client.pipe(upstream).pipe(client);
  });
  await new Promise<void>((r) => server.listen(0, host, r));
  counter.port = (server.address() as AddressInfo).port;
  counter.close = async () => {
    for (const s of sockets) s.destroy();
    await new Promise<void>((r) => server.close(() => r()));
  };
  return counter;
}

/** The test's own resolver: `names` only; anything else does not exist. */
function resolverOf(names: Record<string, string[]>, asked: string[] = []): HubResolver {
  return (hostname) => {
    asked.push(hostname);
    const addresses = names[hostname];
    if (!addresses) return Promise.reject(Object.assign(new Error(`getaddrinfo ENOTFOUND ${hostname}`), { code: 'ENOTFOUND' }));
    return Promise.resolve(addresses.map((address): LookupAddress => ({ address, family: isIP(address) })));
  };
}

const isLoopback = (address: string): boolean => address === '::1' || /^(::ffff:)?127\./.test(address);

/** Records what passed the checks; refuses (no packet) anything that is not loopback. */
function loopbackOnly(seen: string[]): (host: string, addresses: readonly LookupAddress[]) => void {
  return (host, addresses) => {
    seen.push(...addresses.map((a) => `${host}=${a.address}`));
    const outside = addresses.find((a) => !isLoopback(a.address));
    if (outside) throw new Error(`test stop: ${outside.address} passed the checks; not connecting off loopback`);
  };
}

async function failure(p: Promise<unknown>): Promise<HubError> {
  try {
    await p;
  } catch (err) {
    if (isHubError(err)) return err;
    throw err;
  }
  throw new Error('expected a HubError');
}

let hub: TestHub;
let v4: Counter;
let v6: Counter;

beforeAll(async () => {
  hub = await startTestHub({ repos: [{ id: 'org/tiny', files: { 'config.json': '{}' } }] });
  const target = { host: '127.0.0.1', port: Number(new URL(hub.url).port) };
  v4 = await countingProxy('127.0.0.1', target);
  v6 = await countingProxy('::1', target);
});
afterAll(async () => {
  await v4?.close();
  await v6?.close();
  await hub?.stop();
});
beforeEach(() => {
  v4.connections = 0;
  v6.connections = 0;
  hub.stats.reset();
});

/** Each refused kind, by a name that resolves to it; the port is the loopback counter it would reach. */
const CASES: [name: string, address: string, kind: string][] = [
  ['loop.test', '127.0.0.1', 'a loopback address'],
  ['loop6.test', '::1', 'a loopback address'],
  ['mapped.test', '::ffff:127.0.0.1', 'a loopback address'],
  ['ten.test', '10.0.0.5', 'a private address'],
  ['corp.test', '172.16.0.1', 'a private address'],
  ['home.test', '192.168.1.1', 'a private address'],
  ['metadata.google.internal', '169.254.169.254', 'a cloud metadata address'],
  ['link.test', 'fe80::1', 'a link-local address'],
  ['cgnat.test', '100.64.0.1', 'a carrier-grade NAT (shared) address'],
];
const NAMES = Object.fromEntries(CASES.map(([name, address]) => [name, [address]]));
const portFor = (address: string): number => (address === '::1' ? v6.port : v4.port);

describe('a hub URL', () => {
  test.each(CASES)('%s → %s is refused before any connection, with a reason', async (name, address, kind) => {
    const seen: string[] = [];
    const client = new HubClient({ baseUrl: `http://${name}:${portFor(address)}`, token: TOKEN, resolve: resolverOf(NAMES) });
    // The same client as the default one, with a last look that keeps a broken check on loopback.
    const guarded = new HubClient({
      baseUrl: `http://${name}:${portFor(address)}`,
      token: TOKEN,
      fetch: hubFetch({ resolve: resolverOf(NAMES), beforeConnect: loopbackOnly(seen) }),
    });
    for (const c of isLoopback(address) ? [client, guarded] : [guarded]) {
      const err = await failure(c.resolve('org/tiny'));
      expect({ code: err.code, permanent: err.permanent }).toEqual({ code: 'AddressRefused', permanent: true });
      expect(err.message).toBe(
        `request to http://${name}:${portFor(address)}/api/models/org/tiny/revision/main refused: ${name} resolves to ${address}, ${kind}; refused (MAGUS_HUB_ALLOW_NETWORKS allows networks)`,
      );
      expect(err.message).not.toContain(TOKEN);
    }
    expect(seen).toEqual([]);
    expect(v4.connections + v6.connections).toBe(0);
    expect(hub.stats.requests).toEqual([]);
  });

  test('literal addresses are checked too, without a resolver', async () => {
    const asked: string[] = [];
    const seen: string[] = [];
    const fetch = hubFetch({ resolve: resolverOf({}, asked), beforeConnect: loopbackOnly(seen) });
    for (const [host, kind] of [
      [`127.0.0.1:${v4.port}`, 'a loopback address'],
      [`[::1]:${v6.port}`, 'a loopback address'],
      [`[::ffff:127.0.0.1]:${v4.port}`, 'a loopback address'],
      [`0.0.0.0:${v4.port}`, 'an unspecified address'],
      ['169.254.169.254', 'a cloud metadata address'],
      ['[fd00:ec2::254]', 'a cloud metadata address'],
      // The URL parser's forms of 127.0.0.1.
      [`2130706433:${v4.port}`, 'a loopback address'],
      [`0x7f.1:${v4.port}`, 'a loopback address'],
    ]) {
      const err = await failure(new HubClient({ baseUrl: `http://${host}`, fetch }).resolve('org/tiny'));
      expect(err.code).toBe('AddressRefused');
      expect(err.message).toContain(`is ${kind}; refused`);
    }
    expect(asked).toEqual([]);
    expect(seen).toEqual([]);
    expect(v4.connections + v6.connections).toBe(0);
  });

  test('one refused address among several refuses the name', async () => {
    const seen: string[] = [];
    const names = { 'split.test': ['127.0.0.1', '10.0.0.5'] };
    const fetch = hubFetch({ resolve: resolverOf(names), beforeConnect: loopbackOnly(seen), allow: allowedNetworks(['loopback']) });
    const err = await failure(new HubClient({ baseUrl: `http://split.test:${v4.port}`, fetch }).resolve('org/tiny'));
    expect(err.message).toContain('split.test resolves to 10.0.0.5, a private address');
    expect(seen).toEqual([]);
    expect(v4.connections).toBe(0);
  });

  test('allowed networks let the same requests through, to the addresses that were checked', async () => {
    // Loopback: the request goes through, to the counting server the name resolves to.
    for (const [name, address] of CASES.filter(([, a]) => isLoopback(a))) {
      const client = new HubClient({ baseUrl: `http://${name}:${portFor(address)}`, allowNetworks: ['loopback'], resolve: resolverOf(NAMES) });
      expect((await client.resolve('org/tiny')).files.map((f) => f.path)).toEqual(['config.json']);
    }
    expect({ v4: v4.connections, v6: v6.connections }).toEqual({ v4: 4, v6: 2 }); // revision + tree, per name
    // Elsewhere: the check passes, and the test's last look stops the connection (no packet leaves loopback).
    const seen: string[] = [];
    const allow = allowedNetworks(['private', 'link-local', 'metadata', 'shared']);
    for (const [name, address] of CASES.filter(([, a]) => !isLoopback(a))) {
      const fetch = hubFetch({ resolve: resolverOf(NAMES), allow, beforeConnect: loopbackOnly(seen) });
      const err = await failure(new HubClient({ baseUrl: `http://${name}:${v4.port}`, fetch }).resolve('org/tiny'));
      expect(err.code).toBe('Transient');
      expect(err.message).toContain('test stop');
      expect(seen.at(-1)).toBe(`${name}=${address}`);
    }
    expect(seen).toHaveLength(6);
    // A CIDR allows exactly its network.
    const cidr = hubFetch({ resolve: resolverOf(NAMES), allow: allowedNetworks(['127.0.0.1/32']) });
    await new HubClient({ baseUrl: `http://loop.test:${v4.port}`, fetch: cidr }).resolve('org/tiny');
    expect((await failure(new HubClient({ baseUrl: `http://loop6.test:${v6.port}`, fetch: cidr }).resolve('org/tiny'))).code).toBe('AddressRefused');
  });
});

describe('a redirect', () => {
  let origin: HttpServer;
  let originUrl: string;
  let inside: Counter;
  const originRequests: { path: string; authorization: boolean }[] = [];
  let location = '';

  beforeAll(async () => {
    // "Inside": a server on 127.0.0.2 that the allowed origin (127.0.0.1) points at.
    inside = await countingProxy('127.0.0.2', { host: '127.0.0.1', port: Number(new URL(hub.url).port) });
    origin = createHttpServer((req: IncomingMessage, res) => {
      originRequests.push({ path: req.url ?? '', authorization: req.headers.authorization !== undefined });
      res.writeHead(302, { Location: location, 'Content-Type': 'text/plain', 'X-Error-Message': MARKER });
      res.end(`${MARKER}: moved`);
    });
    await new Promise<void>((r) => origin.listen(0, '127.0.0.1', r));
    originUrl = `http://127.0.0.1:${(origin.address() as AddressInfo).port}`;
  });
  afterAll(async () => {
    await inside?.close();
    await new Promise<void>((r) => origin?.close(() => r()));
  });
  beforeEach(() => {
    originRequests.length = 0;
    inside.connections = 0;
  });

  test.each<[string, Record<string, string[]>, string]>([
    ['a name inside loopback', { 'cdn.evil.test': ['127.0.0.2'] }, 'cdn.evil.test resolves to 127.0.0.2, a loopback address'],
    ['a metadata name', { 'cdn.evil.test': ['169.254.169.254'] }, 'cdn.evil.test resolves to 169.254.169.254, a cloud metadata address'],
    ['a private name', { 'cdn.evil.test': ['10.0.0.5'] }, 'cdn.evil.test resolves to 10.0.0.5, a private address'],
    ['a link-local IPv6 name', { 'cdn.evil.test': ['fe80::1'] }, 'cdn.evil.test resolves to fe80::1, a link-local address'],
    ['an IPv4-mapped name', { 'cdn.evil.test': ['::ffff:127.0.0.2'] }, 'cdn.evil.test resolves to ::ffff:127.0.0.2, a loopback address'],
  ])('to %s is refused at the hop: nothing connects, nothing is echoed, the token stays home', async (_what, names, reason) => {
    const seen: string[] = [];
    location = `http://cdn.evil.test:${inside.port}/latest/meta-data?sig=${MARKER}`;
    const client = new HubClient({
      baseUrl: originUrl,
      token: TOKEN,
      fetch: hubFetch({ resolve: resolverOf(names), allow: allowedNetworks(['127.0.0.1/32']), beforeConnect: loopbackOnly(seen) }),
    });
    const err = await failure(client.download('org/tiny', SHA, 'model.safetensors'));
    expect({ code: err.code, permanent: err.permanent }).toEqual({ code: 'AddressRefused', permanent: true });
    expect(err.message).toBe(
      `request to http://cdn.evil.test:${inside.port}/latest/meta-data refused: ${reason}; refused (MAGUS_HUB_ALLOW_NETWORKS allows networks)`,
    );
    expect(err.message).not.toContain(MARKER);
    expect(err.message).not.toContain(TOKEN);
    // The origin was asked once (with the token: it is the hub); the hop's target never was.
    expect(originRequests).toEqual([{ path: `/org/tiny/resolve/${SHA}/model.safetensors`, authorization: true }]);
    expect(seen).toEqual([`127.0.0.1=127.0.0.1`]);
    expect(inside.connections).toBe(0);
  });

  test('to a literal inside address is refused the same way', async () => {
    const client = new HubClient({ baseUrl: originUrl, token: TOKEN, allowNetworks: ['127.0.0.1/32'] });
    for (const [target, reason] of [
      [`http://127.0.0.2:${inside.port}/x`, '127.0.0.2 is a loopback address'],
      [`http://[::ffff:7f00:2]:${inside.port}/x`, '::ffff:7f00:2 is a loopback address'],
    ]) {
      location = target!;
      const err = await failure(client.download('org/tiny', SHA, 'model.safetensors'));
      expect(err.code).toBe('AddressRefused');
      expect(err.message).toContain(reason);
    }
    expect(inside.connections).toBe(0);
  });

  test('allowed, the hop goes through (to the address that was checked), without the token or credentials of its own', async () => {
    // User info in a Location is dropped (node:http would send it as Basic credentials).
    location = `http://someone:secret@cdn.ok.test:${inside.port}/org/tiny/resolve/main/config.json`;
    const client = new HubClient({
      baseUrl: originUrl,
      token: TOKEN,
      allowNetworks: ['127.0.0.1/32', '127.0.0.2/32'],
      resolve: resolverOf({ 'cdn.ok.test': ['127.0.0.2'] }),
    });
    const d = await client.download('org/tiny', SHA, 'config.json');
    const chunks: Uint8Array[] = [];
    for await (const c of d.body) chunks.push(c);
    expect(Buffer.concat(chunks).toString()).toBe('{}');
    expect(inside.connections).toBe(1);
    expect(hub.stats.requests.map((r) => r.authorization)).toEqual([false]);
  });
});

test('a hub URL with credentials is refused before any request (a token goes in tokenRef)', () => {
  expect(() => new HubClient({ baseUrl: `http://user:pw@127.0.0.1:${v4.port}` })).toThrow(/must not carry credentials/);
  expect(v4.connections).toBe(0);
});

describe('a failing hub', () => {
  test('its body and its message header are never echoed: status, a known code and fixed words only', async () => {
    const server = createHttpServer((req, res) => {
      const status = req.url?.includes('/revision/') ? 404 : 500;
      res.writeHead(status, {
        'Content-Type': 'application/json',
        'X-Error-Code': req.url?.includes('/revision/') ? 'RepoNotFound' : `${MARKER}Code`,
        'X-Error-Message': `${MARKER} message`,
      });
      res.end(JSON.stringify({ error: `${MARKER}: db at 10.9.8.7 said no`, detail: 'x'.repeat(5000) }));
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    const base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    try {
      const client = new HubClient({ baseUrl: base, allowNetworks: ['loopback'] });
      const notFound = await failure(client.resolve('org/tiny'));
      expect(notFound.message).toBe(`${base}/api/models/org/tiny/revision/main: HTTP 404 RepoNotFound: no such repository, or not visible to this token`);
      const failed = await failure(client.download('org/tiny', SHA, 'config.json'));
      expect(failed.code).toBe('Transient');
      expect(failed.message).toBe(`org/tiny@${SHA.slice(0, 12)}:config.json: HTTP 500: server error`);
      for (const e of [notFound, failed]) expect(JSON.stringify({ ...e, message: e.message, stack: e.stack })).not.toContain(MARKER);
    } finally {
      await new Promise<void>((r) => server.close(() => r()));
    }
  });
});

/**
 * The hub client against the fixture hub (a real HTTP server standing in for huggingface.co and
 * its CDN, which live outside our control).
 */
import { createHash } from 'node:crypto';
import { createServer } from 'node:http';
import type { AddressInfo, Socket } from 'node:net';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { startTestHub, type HubCommit, type TestHub } from '../../test/fixtures/hub';
import { writeTinyModel } from '../../workers/dev/tiny-model';
import { HubClient, hubErrorType, isHubError, type HubDownload, type HubError, type HubErrorCode } from './client';

const TOKEN = 'hf_clientTestSecretToken987';
/** The fixture hub and its CDN listen on 127.0.0.1 and 127.0.0.2: allowed here, as the harness allows them. */
const LOOPBACK = ['loopback'];
const sha256 = (b: Uint8Array): string => createHash('sha256').update(b).digest('hex');

let root: string;
let modelDir: string;
let hub: TestHub;
let tiny: HubCommit;
let gated: HubCommit;

beforeAll(async () => {
  root = await mkdtemp(path.join(tmpdir(), 'magus-hubclient-'));
  modelDir = path.join(root, 'tiny');
  await writeTinyModel(modelDir, { shards: 2 });
  hub = await startTestHub({ treePageSize: 2 });
  tiny = await hub.addRepo({ id: 'org/tiny', dir: modelDir, files: { 'docs/nested/README.md': '# tiny\n' }, tags: ['v1.0'] });
  gated = await hub.addRepo({ id: 'meta-llama/Gated-1B', dir: modelDir, gated: true, access: [TOKEN], formerIds: ['meta-llama/Old-1B'] });
});
afterAll(async () => {
  await hub?.stop();
  await rm(root, { recursive: true, force: true });
});
beforeEach(() => {
  hub.setFaults({});
  hub.stats.reset();
});

const anonymous = (): HubClient => new HubClient({ allowNetworks: LOOPBACK, baseUrl: hub.url });
const authed = (token = TOKEN): HubClient => new HubClient({ allowNetworks: LOOPBACK, baseUrl: hub.url, token });

async function collect(d: HubDownload): Promise<Buffer> {
  const chunks: Uint8Array[] = [];
  for await (const c of d.body) chunks.push(c);
  return Buffer.concat(chunks);
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

async function expectCode(p: Promise<unknown>, code: HubErrorCode, permanent = code !== 'Transient'): Promise<HubError> {
  const err = await failure(p);
  expect({ code: err.code, permanent: err.permanent }).toEqual({ code, permanent });
  return err;
}

describe('resolve', () => {
  test('pins the revision to a sha and lists every file, paging through the tree, with real sizes and sha256', async () => {
    const resolved = await anonymous().resolve('org/tiny');
    expect(resolved.repo).toBe('org/tiny');
    expect(resolved.revision).toBe('main');
    expect(resolved.sha).toBe(tiny.sha);
    expect(resolved.files.map((f) => f.path)).toEqual([
      'config.json',
      'docs/nested/README.md',
      'generation_config.json',
      'model-00001-of-00002.safetensors',
      'model-00002-of-00002.safetensors',
      'model.safetensors.index.json',
      'tokenizer.json',
      'tokenizer_config.json',
    ]);
    for (const f of resolved.files) {
      if (f.path.startsWith('docs/')) continue;
      const bytes = await readFile(path.join(modelDir, f.path));
      expect(f.size).toBe(bytes.length);
      // LFS files carry the sha256 of the real content; small git files carry null.
      expect(f.sha256).toBe(f.path.endsWith('.safetensors') || bytes.length >= 1024 ? sha256(bytes) : null);
    }
    // 8 files + 2 directories, 2 per page = 5 tree pages, all at the pinned sha.
    const paths = hub.stats.requests.map((r) => r.path);
    expect(paths[0]).toBe('/api/models/org/tiny/revision/main');
    expect(paths.slice(1)).toEqual(Array(5).fill(`/api/models/org/tiny/tree/${tiny.sha}`));
  });

  test('tags and shas resolve to the same commit; a later commit on main does not change a pinned sha', async () => {
    const client = anonymous();
    expect((await client.resolve('org/tiny', 'v1.0')).sha).toBe(tiny.sha);
    expect((await client.resolve('org/tiny', tiny.sha)).sha).toBe(tiny.sha);

    const first = await hub.addRepo({ id: 'org/evolving', files: { 'notes.txt': 'first' } });
    const pinned = await client.resolve('org/evolving');
    await hub.addRepo({ id: 'org/evolving', files: { 'notes.txt': 'second, longer' } });
    expect((await client.resolve('org/evolving')).sha).not.toBe(first.sha);
    expect((await collect(await client.download('org/evolving', pinned.sha, 'notes.txt'))).toString()).toBe('first');
  });

  test('a renamed repo is followed on the same origin with the token', async () => {
    const resolved = await authed().resolve('meta-llama/Old-1B');
    expect(resolved.sha).toBe(gated.sha);
    expect(hub.stats.requests.every((r) => r.server === 'hub' && r.authorization)).toBe(true);
    expect(hub.stats.requests.some((r) => r.status === 307)).toBe(true);
  });

  test('a repository listing unsafe paths is refused', async () => {
    await hub.addRepo({ id: 'evil/repo', files: { '../../etc/passwd': 'x', 'ok.txt': 'y' } });
    const err = await expectCode(anonymous().resolve('evil/repo'), 'InvalidInput');
    expect(err.message).toContain('unsafe');
  });
});

describe('download', () => {
  test('whole files, byte-exact, LFS via the CDN and small files from the hub', async () => {
    const client = anonymous();
    for (const f of tiny.files) {
      const d = await client.download('org/tiny', tiny.sha, f.path);
      expect({ size: d.size, offset: d.offset, commit: d.commit, rangeIgnored: d.rangeIgnored }).toEqual({
        size: f.size,
        offset: 0,
        commit: tiny.sha,
        rangeIgnored: false,
      });
      expect(d.etag).toBe(f.lfs ? f.sha256 : f.oid);
      expect((await collect(d)).equals(f.content)).toBe(true);
    }
  });

  test('ranges at several offsets are byte-exact; offset = size is an empty body; beyond is invalid', async () => {
    const f = tiny.files.find((x) => x.path === 'model-00001-of-00002.safetensors')!;
    const client = anonymous();
    for (const offset of [1, 7, 4096, 65_537, Math.floor(f.size / 2), f.size - 1]) {
      const d = await client.download('org/tiny', tiny.sha, f.path, { offset });
      expect({ size: d.size, offset: d.offset, rangeIgnored: d.rangeIgnored }).toEqual({ size: f.size, offset, rangeIgnored: false });
      expect((await collect(d)).equals(f.content.subarray(offset))).toBe(true);
    }
    const end = await client.download('org/tiny', tiny.sha, f.path, { offset: f.size });
    expect(end.size).toBe(f.size);
    expect((await collect(end)).length).toBe(0);
    await expectCode(client.download('org/tiny', tiny.sha, f.path, { offset: f.size + 1 }), 'InvalidInput');

    const small = tiny.files.find((x) => x.path === 'config.json')!;
    expect((await collect(await client.download('org/tiny', tiny.sha, small.path, { offset: 100 }))).equals(small.content.subarray(100))).toBe(true);
    expect(hub.stats.requests.filter((r) => r.range !== null).every((r) => /^bytes=\d+-$/.test(r.range!))).toBe(true);
  });

  test('a server that ignores Range: the client skips to the offset itself and says so', async () => {
    hub.setFaults({ ignoreRange: true });
    const f = tiny.files.find((x) => x.path === 'tokenizer.json')!;
    const d = await anonymous().download('org/tiny', tiny.sha, f.path, { offset: 5000 });
    expect({ size: d.size, offset: d.offset, rangeIgnored: d.rangeIgnored }).toEqual({ size: f.size, offset: 5000, rangeIgnored: true });
    expect((await collect(d)).equals(f.content.subarray(5000))).toBe(true);
  });

  test('the token goes to the hub only: the redirect to the CDN host carries no Authorization', async () => {
    const f = gated.files.find((x) => x.path === 'model-00002-of-00002.safetensors')!;
    const d = await authed().download('meta-llama/Gated-1B', gated.sha, f.path, { offset: 10 });
    expect((await collect(d)).equals(f.content.subarray(10))).toBe(true);
    // Through the old name as well: hub → hub (307, same origin) → hub (302) → CDN.
    await collect(await authed().download('meta-llama/Old-1B', gated.sha, f.path));

    const hubRequests = hub.stats.requests.filter((r) => r.server === 'hub');
    const cdnRequests = hub.stats.requests.filter((r) => r.server === 'cdn');
    expect(hubRequests.map((r) => r.status)).toEqual([302, 307, 302]);
    expect(hubRequests.every((r) => r.authorization && r.host === new URL(hub.url).host)).toBe(true);
    expect(cdnRequests).toHaveLength(2);
    expect(cdnRequests.every((r) => !r.authorization && r.host.startsWith('127.0.0.2:'))).toBe(true);
    expect(cdnRequests[0]!.range).toBe('bytes=10-');
  });

  test('a mid-stream disconnect surfaces as Transient from the body, and the transfer resumes from there', async () => {
    const f = tiny.files.find((x) => x.path === 'model-00002-of-00002.safetensors')!;
    hub.setFaults({ disconnectAfterBytes: 50_000, path: f.path, times: 1 });
    const client = anonymous();
    const d = await client.download('org/tiny', tiny.sha, f.path);
    const got: Uint8Array[] = [];
    let received = 0;
    const err = await failure(
      (async () => {
        for await (const c of d.body) {
          got.push(c);
          received += c.length;
        }
      })(),
    );
    expect({ code: err.code, permanent: err.permanent }).toEqual({ code: 'Transient', permanent: false });
    expect(received).toBe(50_000);
    expect(err.message).toContain(`stopped at byte 50000 of ${f.size}`);
    const rest = await collect(await client.download('org/tiny', tiny.sha, f.path, { offset: received }));
    expect(Buffer.concat([...got, rest]).equals(f.content)).toBe(true);
  });

  test('a corrupted byte is delivered as served (verifying checksums is the transfer activity’s job)', async () => {
    const f = tiny.files.find((x) => x.path === 'tokenizer.json')!;
    hub.setFaults({ corrupt: { path: f.path, offset: 321, times: 1 } });
    const bytes = await collect(await anonymous().download('org/tiny', tiny.sha, f.path));
    expect(bytes.length).toBe(f.size);
    expect(sha256(bytes)).not.toBe(f.sha256);
    expect(bytes[321]).toBe(f.content[321]! ^ 0xff);
    expect(sha256(await collect(await anonymous().download('org/tiny', tiny.sha, f.path)))).toBe(f.sha256);
  });

  test('breaking out of the body closes the transfer; an abort rejects with its reason', async () => {
    const f = tiny.files.find((x) => x.path === 'model-00001-of-00002.safetensors')!;
    const d = await anonymous().download('org/tiny', tiny.sha, f.path);
    for await (const _ of d.body) break;

    hub.setFaults({ bytesPerSecond: 100_000 });
    const controller = new AbortController();
    const slow = await anonymous().download('org/tiny', tiny.sha, f.path, { signal: controller.signal });
    const reason = new Error('activity cancelled');
    setTimeout(() => controller.abort(reason), 50);
    await expect(collect(slow)).rejects.toBe(reason);
    expect(hub.stats.served('org/tiny', f.path)).toBeLessThan(2 * f.size);
    await expect(anonymous().download('org/tiny', tiny.sha, f.path, { signal: controller.signal })).rejects.toBe(reason);
  });
});

describe('errors', () => {
  test('unknown repo, revision and file map to their codes (permanent)', async () => {
    const client = authed();
    await expectCode(client.resolve('org/does-not-exist'), 'RepoNotFound');
    await expectCode(client.resolve('org/tiny', 'no-such-branch'), 'RevisionNotFound');
    await expectCode(client.download('org/tiny', tiny.sha, 'missing.bin'), 'EntryNotFound');
    await expectCode(client.download('org/tiny', 'f'.repeat(40), 'config.json'), 'RevisionNotFound');
    await expectCode(client.download('org/does-not-exist', tiny.sha, 'config.json'), 'RepoNotFound');
  });

  test('401 + RepoNotFound (the hub’s answer to anonymous requests) is RepoNotFound', async () => {
    const strict = await startTestHub({ anonymousRepoNotFoundStatus: 401 });
    try {
      const err = await expectCode(new HubClient({ allowNetworks: LOOPBACK, baseUrl: strict.url }).resolve('org/secret'), 'RepoNotFound');
      expect(err.status).toBe(401);
    } finally {
      await strict.stop();
    }
  });

  test('gated without a token, with a token lacking access, and with a wrong token: Unauthorized', async () => {
    const other = await startTestHub({ tokens: ['hf_valid_but_no_access'] });
    try {
      await other.addRepo({ id: 'org/gated', files: { 'w.safetensors': 'x' }, gated: true, access: [TOKEN] });
      const { sha } = await new HubClient({ allowNetworks: LOOPBACK, baseUrl: other.url }).resolve('org/gated'); // listing is public
      const noToken = await expectCode(
        new HubClient({ allowNetworks: LOOPBACK, baseUrl: other.url }).download('org/gated', sha, 'w.safetensors'),
        'Unauthorized',
      );
      expect(noToken.status).toBe(401);
      expect(noToken.message).toContain('GatedRepo');
      const noAccess = await expectCode(
        new HubClient({ allowNetworks: LOOPBACK, baseUrl: other.url, token: 'hf_valid_but_no_access' }).download('org/gated', sha, 'w.safetensors'),
        'Unauthorized',
      );
      expect(noAccess.status).toBe(403);
      await expectCode(new HubClient({ allowNetworks: LOOPBACK, baseUrl: other.url, token: 'hf_wrong' }).resolve('org/gated'), 'Unauthorized');
      expect(hubErrorType(noAccess.code)).toBe('Unauthorized');
    } finally {
      await other.stop();
    }
  });

  test('5xx, 429 and CDN failures are Transient; Retry-After is kept', async () => {
    const client = anonymous();
    hub.setFaults({ status: { path: '/api/models/org/tiny/tree/', code: 500, times: 1 } });
    const e500 = await expectCode(client.resolve('org/tiny'), 'Transient');
    expect(e500.status).toBe(500);
    expect(hubErrorType(e500.code)).toBeNull();

    hub.setFaults({ status: { path: 'config.json', code: 429, retryAfter: 3, times: 1 } });
    const e429 = await expectCode(client.download('org/tiny', tiny.sha, 'config.json'), 'Transient');
    expect(e429.retryAfterMs).toBe(3000);

    hub.setFaults({ status: { path: 'tokenizer.json', code: 503, server: 'cdn', times: 1 } });
    await expectCode(client.download('org/tiny', tiny.sha, 'tokenizer.json'), 'Transient');
    // The next attempt succeeds: nothing was cached from the failure.
    expect((await collect(await client.download('org/tiny', tiny.sha, 'tokenizer.json'))).length).toBe(
      tiny.files.find((f) => f.path === 'tokenizer.json')!.size,
    );
  });

  test('an expired or refused CDN URL is Transient (a fresh redirect renews it)', async () => {
    const expired = await startTestHub({ cdnUrlTtlSeconds: -1, repos: [{ id: 'o/r', files: { 'w.safetensors': 'abc' } }] });
    try {
      const client = new HubClient({ allowNetworks: LOOPBACK, baseUrl: expired.url });
      const { sha } = await client.resolve('o/r');
      const err = await expectCode(client.download('o/r', sha, 'w.safetensors'), 'Transient');
      expect(err.status).toBe(403);
      expect(err.message).not.toContain('Signature');
    } finally {
      await expired.stop();
    }
  });

  test('network errors, timeouts, stalled bodies and redirect loops are Transient', async () => {
    const dead = new HubClient({ allowNetworks: LOOPBACK, baseUrl: 'http://127.0.0.1:1' });
    await expectCode(dead.resolve('org/tiny'), 'Transient');

    const sockets = new Set<Socket>();
    const server = createServer((req, res) => {
      if (req.url?.includes('/loop/')) {
        res.writeHead(302, { Location: req.url });
        res.end();
      } else if (req.url?.includes('/stall/')) {
        res.writeHead(200, { 'Content-Length': 100 });
        res.write(Buffer.alloc(10)); // then nothing more
      }
      // anything else: never answer
    });
    server.on('connection', (s) => sockets.add(s));
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    const base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    try {
      const loop = await expectCode(
        new HubClient({ allowNetworks: LOOPBACK, baseUrl: base, maxRedirects: 3 }).download('org/loop', tiny.sha, 'x'),
        'Transient',
      );
      expect(loop.message).toContain('too many redirects');
      const slow = await expectCode(new HubClient({ allowNetworks: LOOPBACK, baseUrl: base, timeoutMs: 100 }).resolve('org/slow'), 'Transient');
      expect(slow.message).toContain('no response within 100 ms');
      const stalled = await new HubClient({ allowNetworks: LOOPBACK, baseUrl: base, timeoutMs: 100 }).download('org/stall', tiny.sha, 'x');
      const idle = await expectCode(collect(stalled), 'Transient');
      expect(idle.message).toContain('stopped at byte 10 of 100: no data for 100 ms');
    } finally {
      for (const s of sockets) s.destroy();
      await new Promise<void>((r) => server.close(() => r()));
    }
  });

  test('bad repo ids, revisions, shas, paths and offsets are rejected without any request', async () => {
    const client = authed();
    const badRepos = [
      '',
      'tiny',
      'org/tiny/extra',
      '../tiny',
      'org/..',
      'org/ti ny',
      'org/ti--ny',
      'org/-tiny',
      'org/tiny.git',
      'org/tiny?x=1',
      'org/%2e%2e',
      `org/${'a'.repeat(97)}`,
    ];
    for (const repo of badRepos) {
      await expectCode(client.resolve(repo), 'InvalidInput');
      await expectCode(client.download(repo, tiny.sha, 'config.json'), 'InvalidInput');
    }
    for (const revision of ['', 'a..b', '/main', 'main/', 'ma in', 'x\u0000', 'refs//heads']) {
      await expectCode(client.resolve('org/tiny', revision), 'InvalidInput');
    }
    for (const sha of ['main', tiny.sha.slice(0, 12), tiny.sha.toUpperCase(), `${tiny.sha}0`]) {
      await expectCode(client.download('org/tiny', sha, 'config.json'), 'InvalidInput');
    }
    for (const p of ['', '../config.json', 'a/../../b', '/etc/passwd', 'a//b', './a', 'a/.', 'C:\\x', 'dir\\file', 'x\u0000y', 'x\ny']) {
      await expectCode(client.download('org/tiny', tiny.sha, p), 'InvalidInput');
    }
    for (const offset of [-1, 1.5, Number.NaN]) {
      await expectCode(client.download('org/tiny', tiny.sha, 'config.json', { offset }), 'InvalidInput');
    }
    expect(hub.stats.requests).toEqual([]);
  });

  test('no error message and no recorded request contains the token', async () => {
    const client = authed();
    const errors: unknown[] = [];
    const attempts: (() => Promise<unknown>)[] = [
      () => client.resolve('org/nope'),
      () => client.resolve('org/tiny', 'nope'),
      () => client.download('org/tiny', tiny.sha, 'nope'),
      () => new HubClient({ allowNetworks: LOOPBACK, baseUrl: hub.url, token: `${TOKEN}x` }).resolve('org/tiny'),
      () => client.resolve('bad id'),
    ];
    hub.setFaults({ status: { path: 'config.json', code: 500 } });
    attempts.push(() => client.download('org/tiny', tiny.sha, 'config.json'));
    for (const attempt of attempts) errors.push(await attempt().catch((e: unknown) => e));
    // A (hypothetical) server that echoes the Authorization header in its error message.
    const echoing = new HubClient({
      baseUrl: hub.url,
      token: TOKEN,
      fetch: (_url, init) => {
        const header = new Headers(init?.headers).get('authorization') ?? '';
        return Promise.resolve(
          new Response(JSON.stringify({ error: `bad credentials: ${header}` }), { status: 400, headers: { 'X-Error-Message': `bad credentials: ${header}` } }),
        );
      },
    });
    errors.push(await echoing.resolve('org/tiny').catch((e: unknown) => e));

    expect(errors.every((e) => isHubError(e))).toBe(true);
    for (const e of errors as HubError[]) {
      expect(e.message).not.toContain(TOKEN);
      expect(JSON.stringify({ ...e, message: e.message, stack: e.stack })).not.toContain(TOKEN);
    }
    // What the server said is not echoed at all (its status and a known code are).
    expect((errors.at(-1) as HubError).message).not.toContain('bad credentials');
    expect((errors.at(-1) as HubError).message).toContain('HTTP 400');
    expect(JSON.stringify(hub.stats.requests)).not.toContain(TOKEN);
    expect(hub.stats.requests.some((r) => r.authorization)).toBe(true);
  });
});

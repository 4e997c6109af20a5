/**
 * The demo hub: a Hugging Face-compatible hub that `magus dev` serves its demo models from, so
 * they are pulled through the real pipeline and hub client, offline. It speaks the subset of the
 * hub's HTTP protocol magus's hub client uses, on two real `node:http` listeners:
 *
 * - the **hub** on `127.0.0.1` answers the API (`/api/models/{repo}/revision/{rev}`,
 *   `/api/models/{repo}/tree/{rev}[/{path}]` with `Link: <…>; rel="next"` paging) and
 *   `/{repo}/resolve/{rev}/{path}`: small files directly, LFS files as a 302 to the CDN, with the
 *   headers the real hub sends (`X-Repo-Commit`, `ETag`, `X-Linked-Etag`, `X-Linked-Size`), and
 *   errors as the real hub reports them (`X-Error-Code`: `RepoNotFound`, `RevisionNotFound`,
 *   `EntryNotFound`; `X-Error-Message`);
 * - the **CDN** on `127.0.0.2` (another loopback *host*, as the real CDN is another host than the
 *   hub) serves LFS bytes at signed, expiring URLs and refuses tampered or expired ones.
 *
 * Both honour `Range` (`a-`, `a-b`, `-n`; 206 + `Content-Range`, 416 when unsatisfiable). Every
 * repository is public. The hub's behaviour follows huggingface_hub (`file_download.py`,
 * `hf_api.py`, `utils/_http.py`).
 *
 * The tests' hub (test/fixtures/hub.ts) extends this one through its protected seams —
 * {@link DemoHub.handle}, {@link DemoHub.rangeOf}, {@link DemoHub.deliver},
 * {@link DemoHub.repoInfo} — with access control, renamed repos, request records and faults.
 */
import { createHmac, randomBytes, timingSafeEqual } from 'node:crypto';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import * as path from 'node:path';
import { cdnFilePath, contentType, decodeSegments, hubRoute, parseRange, sendError, sendJson, sendRepoNotFound, type HubRoute } from './protocol';
import { HubRepos, repoHash, repoInfo, treeEntries, type AddRepoInput, type HubCommit, type HubFile, type HubRepo } from './repos';

export interface DemoHubOptions {
  /** Files of at least this many bytes are stored in LFS (default 1024). */
  lfsThreshold?: number;
  /** File extensions always stored in LFS, whatever their size (default `.safetensors`, `.bin`, `.gguf`, `.pt`, `.pth`). */
  lfsExtensions?: string[];
  /** Entries per page of the tree API; more entries are paged with a `Link` header (default 1000, as the hub). */
  treePageSize?: number;
  /** Lifetime of signed CDN URLs in seconds (default 3600). A CDN request after expiry gets 403. */
  cdnUrlTtlSeconds?: number;
  /** Repositories to add once the servers listen. */
  repos?: AddRepoInput[];
}

/** Which of the two listeners a request came to. */
export type HubServer = 'hub' | 'cdn';

/** A file's bytes being served: whose, and from which offset of the file. */
export interface ServedBytes {
  repo: string;
  path: string;
  /** Offset in the file of the body's first byte (the start of the range). */
  offset: number;
  /** The request's URL path. */
  urlPath: string;
}

const DEFAULT_LFS_EXTENSIONS = ['.safetensors', '.bin', '.gguf', '.pt', '.pth'];

export class DemoHub {
  protected readonly repos: HubRepos;
  private readonly pageSize: number;
  private readonly ttlSeconds: number;
  private readonly signingKey = randomBytes(32);
  private readonly servers: Record<HubServer, Server>;
  private origins: Record<HubServer, string> = { hub: '', cdn: '' };

  constructor(private readonly opts: DemoHubOptions = {}) {
    const lfsThreshold = opts.lfsThreshold ?? 1024;
    const lfsExtensions = opts.lfsExtensions ?? DEFAULT_LFS_EXTENSIONS;
    this.repos = new HubRepos((p, size) => size >= lfsThreshold || lfsExtensions.some((e) => p.endsWith(e)));
    this.pageSize = opts.treePageSize ?? 1000;
    this.ttlSeconds = opts.cdnUrlTtlSeconds ?? 3600;
    this.servers = { hub: createServer(this.listener('hub')), cdn: createServer(this.listener('cdn')) };
  }

  /** Hub base URL, `http://127.0.0.1:<port>`. */
  get url(): string {
    return this.origins.hub;
  }

  /** CDN origin, `http://127.0.0.2:<port>`: another host than the hub. */
  get cdnUrl(): string {
    return this.origins.cdn;
  }

  /** Starts the hub (127.0.0.1) and its CDN (127.0.0.2), each on a free port, and adds the options' repos. */
  async listen(): Promise<this> {
    const listen = (server: Server, host: string): Promise<string> =>
      new Promise((resolve, reject) => {
        server.once('error', reject);
        server.listen(0, host, () => resolve(`http://${host}:${(server.address() as AddressInfo).port}`));
      });
    this.origins = { hub: await listen(this.servers.hub, '127.0.0.1'), cdn: await listen(this.servers.cdn, '127.0.0.2') };
    for (const r of this.opts.repos ?? []) await this.addRepo(r);
    return this;
  }

  addRepo(input: AddRepoInput): Promise<HubCommit> {
    return this.repos.add(input);
  }

  /** Closes both listeners and every open connection. */
  async stop(): Promise<void> {
    const close = (server: Server): Promise<void> =>
      new Promise((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections();
      });
    await Promise.all([close(this.servers.hub), close(this.servers.cdn)]);
  }

  // -- the seams ------------------------------------------------------------------------------

  /** Answers one request to `server`. */
  protected async handle(server: HubServer, req: IncomingMessage, res: ServerResponse, url: URL, rawUrl: string): Promise<void> {
    const segments = decodeSegments(url.pathname);
    if (!segments) return sendError(res, 400, null, 'Bad request path');
    return server === 'hub' ? this.handleHub(req, res, url, hubRoute(segments)) : this.handleCdn(req, res, url, rawUrl);
  }

  /** The bytes of `size` that `req` asks for: a range, the whole content (null), or none. */
  protected rangeOf(req: IncomingMessage, size: number): { start: number; end: number } | 'unsatisfiable' | null {
    return parseRange(req.headers.range, size);
  }

  /** Writes `body`, the bytes `at` says, after the response head; resolves when it is written or the client left. */
  protected deliver(res: ServerResponse, body: Buffer, _at: ServedBytes): Promise<void> {
    return new Promise((resolve) => {
      res.once('close', resolve);
      res.end(body, resolve);
    });
  }

  /** The model info of `commit` (the revision API's answer). */
  protected repoInfo(repo: HubRepo, commit: HubCommit): Record<string, unknown> {
    return repoInfo(repo, commit);
  }

  // -- the hub --------------------------------------------------------------------------------

  private async handleHub(req: IncomingMessage, res: ServerResponse, url: URL, route: HubRoute | null): Promise<void> {
    if (req.method !== 'GET' && req.method !== 'HEAD') return sendError(res, 405, null, 'Method not allowed');
    if (!route) return sendError(res, 404, null, 'Not Found');
    const repo = this.repos.get(route.repo);
    if (!repo) return sendRepoNotFound(res);
    switch (route.kind) {
      case 'revision': {
        const commit = this.commitAt(res, repo, route.revision);
        if (commit) sendJson(res, 200, this.repoInfo(repo, commit));
        return;
      }
      case 'tree':
        return this.tree(res, url, repo, route.revision, route.prefix);
      case 'resolve':
        return this.resolve(req, res, url, repo, route.revision, route.path);
      case 'unknown':
        return sendError(res, 404, null, 'Not Found');
    }
  }

  private commitAt(res: ServerResponse, repo: HubRepo, revision: string): HubCommit | null {
    const commit = this.repos.commitAt(repo, revision);
    if (!commit) sendError(res, 404, 'RevisionNotFound', `Invalid rev id: ${revision}`);
    return commit ?? null;
  }

  private tree(res: ServerResponse, url: URL, repo: HubRepo, revision: string, prefix: string): void {
    const commit = this.commitAt(res, repo, revision);
    if (!commit) return;
    if (prefix && !commit.files.some((f) => f.path.startsWith(`${prefix}/`))) {
      return sendError(res, 404, 'EntryNotFound', `${prefix} does not exist on "${revision}"`);
    }
    const recursive = ['true', 'True', '1'].includes(url.searchParams.get('recursive') ?? '');
    const all = treeEntries(commit, prefix, recursive);
    const cursor = url.searchParams.get('cursor');
    const start = cursor ? Number(Buffer.from(cursor, 'base64url').toString()) : 0;
    if (!Number.isInteger(start) || start < 0 || start > all.length) return sendError(res, 400, null, 'Invalid cursor');
    const page = all.slice(start, start + this.pageSize);
    const headers: Record<string, string> = {};
    if (start + this.pageSize < all.length) {
      const next = new URL(`${this.url}${url.pathname}`);
      for (const [k, v] of url.searchParams) if (k !== 'cursor') next.searchParams.set(k, v);
      next.searchParams.set('cursor', Buffer.from(String(start + this.pageSize)).toString('base64url'));
      headers.Link = `<${next.toString()}>; rel="next"`;
    }
    sendJson(res, 200, page, headers);
  }

  /** A small file directly; an LFS file as a 302 to its signed CDN URL. */
  private async resolve(req: IncomingMessage, res: ServerResponse, url: URL, repo: HubRepo, revision: string, filePath: string): Promise<void> {
    const commit = this.commitAt(res, repo, revision);
    if (!commit) return;
    const file = commit.files.find((f) => f.path === filePath);
    if (!file) return sendError(res, 404, 'EntryNotFound', 'Entry not found');
    const common = { 'X-Repo-Commit': commit.sha, ETag: `"${file.oid}"` };
    if (file.lfs) {
      const location = this.cdnLocation(repo.id, file);
      const body = Buffer.from(`Found. Redirecting to ${location}`);
      res.writeHead(302, {
        ...common,
        Location: location,
        'X-Linked-Etag': `"${file.sha256}"`,
        'X-Linked-Size': String(file.size),
        'Content-Type': 'text/plain; charset=utf-8',
        'Content-Length': body.length,
      });
      res.end(req.method === 'HEAD' ? undefined : body);
      return;
    }
    const name = path.posix.basename(file.path);
    const disposition = `inline; filename*=UTF-8''${encodeURIComponent(name)}; filename="${name}";`;
    const headers = { ...common, 'Content-Type': contentType(file.path, false), 'Content-Disposition': disposition };
    return this.sendContent(req, res, { repo: repo.id, path: file.path, content: file.content }, headers, url.pathname);
  }

  // -- the CDN --------------------------------------------------------------------------------

  private sign(pathAndQuery: string): string {
    return createHmac('sha256', this.signingKey).update(pathAndQuery).digest('hex');
  }

  /** A CloudFront-style signed URL for an LFS object; the full repo path rides in the signed content-disposition. */
  private cdnLocation(repo: string, file: HubFile): string {
    const hash = repoHash(repo);
    const q = new URLSearchParams({
      'response-content-disposition': `inline; filename*=UTF-8''${encodeURIComponent(file.path)}`,
      'response-content-type': 'application/octet-stream',
      Expires: String(Math.floor(Date.now() / 1000) + this.ttlSeconds),
      'Key-Pair-Id': 'KDEMOHUB',
    });
    const unsigned = `/repos/${hash.slice(0, 2)}/${hash.slice(2, 4)}/${hash}/${file.sha256}?${q.toString()}`;
    return `${this.cdnUrl}${unsigned}&Signature=${this.sign(unsigned)}`;
  }

  private async handleCdn(req: IncomingMessage, res: ServerResponse, url: URL, rawUrl: string): Promise<void> {
    const xmlError = (status: number, code: string, message: string): void => {
      const body = Buffer.from(`<?xml version="1.0" encoding="UTF-8"?><Error><Code>${code}</Code><Message>${message}</Message></Error>`);
      res.writeHead(status, { 'Content-Type': 'application/xml', 'Content-Length': body.length });
      res.end(req.method === 'HEAD' ? undefined : body);
    };
    if (req.method !== 'GET' && req.method !== 'HEAD') return xmlError(405, 'MethodNotAllowed', 'Method not allowed');
    const sigAt = rawUrl.lastIndexOf('&Signature=');
    const signature = sigAt < 0 ? '' : rawUrl.slice(sigAt + '&Signature='.length);
    const expected = sigAt < 0 ? '' : this.sign(rawUrl.slice(0, sigAt));
    const valid = signature.length === expected.length && expected.length > 0 && timingSafeEqual(Buffer.from(signature), Buffer.from(expected));
    if (!valid) return xmlError(403, 'AccessDenied', 'Invalid signature');
    if (Number(url.searchParams.get('Expires')) * 1000 < Date.now()) return xmlError(403, 'AccessDenied', 'Request has expired');
    const m = /^\/repos\/[0-9a-f]{2}\/[0-9a-f]{2}\/([0-9a-f]{64})\/([0-9a-f]{64})$/.exec(url.pathname);
    const object = m ? this.repos.lfsObject(m[1]!, m[2]!) : undefined;
    const filePath = cdnFilePath(url);
    if (!m || !object || !filePath) return xmlError(404, 'NoSuchKey', 'The specified key does not exist.');
    const headers = {
      ETag: `"${m[2]}"`,
      'Content-Type': 'application/octet-stream',
      'Content-Disposition': url.searchParams.get('response-content-disposition')!,
    };
    return this.sendContent(req, res, { repo: object.repo, path: filePath, content: object.content }, headers, url.pathname);
  }

  // -- both -----------------------------------------------------------------------------------

  /** `file`'s content as the body, honouring Range (206, or 416 when unsatisfiable). */
  private async sendContent(
    req: IncomingMessage,
    res: ServerResponse,
    file: { repo: string; path: string; content: Buffer },
    headers: Record<string, string | number>,
    urlPath: string,
  ): Promise<void> {
    const size = file.content.length;
    const range = this.rangeOf(req, size);
    if (range === 'unsatisfiable') {
      res.writeHead(416, { ...headers, 'Content-Range': `bytes */${size}`, 'Content-Length': 0 });
      res.end();
      return;
    }
    const start = range?.start ?? 0;
    const end = range?.end ?? size - 1;
    const length = end - start + 1;
    res.writeHead(range ? 206 : 200, {
      ...headers,
      'Accept-Ranges': 'bytes',
      'Content-Length': length,
      ...(range ? { 'Content-Range': `bytes ${start}-${end}/${size}` } : {}),
    });
    if (req.method === 'HEAD' || length === 0) {
      res.end();
      return;
    }
    await this.deliver(res, file.content.subarray(start, end + 1), { repo: file.repo, path: file.path, offset: start, urlPath });
  }

  private listener(server: HubServer) {
    return (req: IncomingMessage, res: ServerResponse): void => {
      const rawUrl = req.url ?? '/';
      this.handle(server, req, res, new URL(rawUrl, 'http://demo-hub'), rawUrl).catch((err: unknown) => {
        if (!res.headersSent) sendError(res, 500, null, `demo hub error: ${String(err)}`);
        else res.destroy();
      });
    };
  }
}

/** Starts a demo hub: the hub (127.0.0.1) and its CDN (127.0.0.2), each on a free port. */
export function startDemoHub(opts: DemoHubOptions = {}): Promise<DemoHub> {
  return new DemoHub(opts).listen();
}

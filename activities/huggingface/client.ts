/**
 * A small Hugging Face Hub client: resolve a revision to a commit and its file list, and stream
 * one file (optionally from an offset) at a pinned commit. Pure I/O over `fetch`; no Temporal.
 *
 * Security invariants: the token is sent only to the configured hub origin. Redirects are
 * followed by hand so that a hop to another origin (the LFS CDN, a mirror's object store) never
 * carries the `Authorization` header, and no error message ever contains the token. Every
 * connection, the first and each redirect's, goes through network.ts: a host that is (or resolves
 * to) a loopback, private, link-local, metadata … address outside the allowed networks is refused
 * before anything is sent. No error message carries what a server said beyond its status and a
 * known error code: a failing server's body (or its message header) is never echoed.
 *
 * Errors are {@link HubError}s with a stable `code` and a `permanent` flag; callers (activities)
 * turn permanent ones into non-retryable failures (see {@link hubErrorType}).
 */
import type { ResolvedSource, SourceFile } from '../../shared/model';
import { emptyBody, streamBody } from './body';
import { allowedNetworks, type AllowedNetworks } from './addresses';
import { HubError, isHubError, type HubErrorCode } from './errors';
import { describe, discard, errorText, headerText, nextLink, normalizeEtag, parseRetryAfter, parseSize } from './http';
import { hubFetch, type HubResolver } from './network';
import { assertCommitSha, assertFilePath, assertRepoId, assertRevision, COMMIT_SHA, SHA256_HEX } from './validate';

export { HUB_ERROR_NAME, HubError, hubErrorType, isHubError, type HubErrorCode } from './errors';

/** The public hub. */
export const DEFAULT_HUB_URL = 'https://huggingface.co';

export interface HubClientOptions {
  /** Hub base URL (default {@link DEFAULT_HUB_URL}); self-hosted mirrors speak the same protocol. */
  baseUrl?: string;
  /** Bearer token; sent only to `baseUrl`'s origin. */
  token?: string;
  /**
   * Networks the hub (and its redirects) may be at despite their kind: kind keywords (`loopback`,
   * `private` …) and CIDRs (addresses.ts). Default none: loopback, private, link-local, metadata,
   * shared, unspecified and reserved addresses are refused.
   */
  allowNetworks?: AllowedNetworks | readonly string[];
  /** Name resolution for those checks (default the system's); tests inject their own. */
  resolve?: HubResolver;
  /**
   * `fetch` implementation; default {@link hubFetch} with `allowNetworks` and `resolve`. One of
   * your own replaces the address checks with whatever it does (tests).
   */
  fetch?: typeof fetch;
  userAgent?: string;
  /** Redirect hops followed per request (default 5). */
  maxRedirects?: number;
  /**
   * Longest wait for a response's headers, and for each next chunk of a download body (default
   * 60 s): a stalled connection fails as `Transient` instead of hanging. Time the consumer spends
   * on a chunk does not count.
   */
  timeoutMs?: number;
}

export interface DownloadOptions {
  /** First byte to send (default 0): resumes an interrupted transfer. */
  offset?: number;
  /** Aborts the request and the body stream; the abort reason is thrown as is. */
  signal?: AbortSignal;
}

/** A file being downloaded. Iterate `body` once; breaking out of the loop closes the connection. */
export interface HubDownload {
  /** The bytes from `offset` to the end of the file. Errors are {@link HubError}s (`Transient` for disconnects). */
  body: AsyncIterable<Uint8Array>;
  /** Size of the whole file. */
  size: number;
  /** Position of the body's first byte in the file (the requested offset). */
  offset: number;
  /** The commit the hub served (`X-Repo-Commit`), or null when not reported. */
  commit: string | null;
  /** The content's ETag (`X-Linked-Etag` for LFS files: their sha256), unquoted, or null. */
  etag: string | null;
  /**
   * True when the server ignored `Range` and sent the whole file: the client then discarded the
   * first `offset` bytes itself (correct, since content at a commit is immutable, but not cheap).
   */
  rangeIgnored: boolean;
}

type RequestKind = 'revision' | 'tree' | 'file';

interface Hop {
  response: Response;
  url: URL;
  /** Headers of the last response from the hub's origin (its LFS metadata lives on the redirect to the CDN). */
  hubHeaders: Headers;
  /** Aborts the final response (its body), e.g. when it stalls. */
  abort: (reason: Error) => void;
}

const REDIRECTS = new Set([301, 302, 303, 307, 308]);

export class HubClient {
  readonly baseUrl: string;
  private readonly origin: string;
  private readonly token: string | undefined;
  private readonly fetchImpl: typeof fetch;
  private readonly userAgent: string;
  private readonly maxRedirects: number;
  private readonly timeoutMs: number;

  constructor(opts: HubClientOptions = {}) {
    const base = new URL(opts.baseUrl ?? DEFAULT_HUB_URL);
    if (base.protocol !== 'https:' && base.protocol !== 'http:') throw new HubError('InvalidInput', `hub URL must be http(s): ${base.origin}`);
    if (base.username || base.password) throw new HubError('InvalidInput', `hub URL ${base.origin} must not carry credentials (a token goes in tokenRef)`);
    this.baseUrl = base.toString().replace(/\/+$/, '');
    this.origin = base.origin;
    this.token = opts.token || undefined;
    const allow = isAllowList(opts.allowNetworks) ? opts.allowNetworks : opts.allowNetworks && allowedNetworks(opts.allowNetworks);
    this.fetchImpl = opts.fetch ?? hubFetch({ ...(allow ? { allow } : {}), ...(opts.resolve ? { resolve: opts.resolve } : {}) });
    this.userAgent = opts.userAgent ?? 'magus-hub-client/0.1';
    this.maxRedirects = opts.maxRedirects ?? 5;
    this.timeoutMs = opts.timeoutMs ?? 60_000;
  }

  /**
   * Resolves `revision` to a commit sha, then lists every file at that sha (following the tree
   * API's pagination), sorted by path. LFS files carry their sha256; small git files carry null.
   */
  async resolve(repo: string, revision = 'main', opts: { signal?: AbortSignal } = {}): Promise<ResolvedSource> {
    assertRepoId(repo);
    assertRevision(revision);
    const info = await this.getJson<{ sha?: unknown }>(
      new URL(`${this.baseUrl}/api/models/${repo}/revision/${encodeURIComponent(revision)}`),
      'revision',
      opts.signal,
    );
    const sha = info.sha;
    if (typeof sha !== 'string' || !COMMIT_SHA.test(sha)) {
      throw new HubError('Transient', `hub answered revision ${revision} of ${repo} without a commit sha`);
    }

    const files: SourceFile[] = [];
    const seen = new Set<string>();
    let next: URL | null = new URL(`${this.baseUrl}/api/models/${repo}/tree/${sha}?recursive=true`);
    for (let page = 0; next; page++) {
      if (page >= 10_000 || seen.has(next.href)) throw new HubError('Transient', `tree listing of ${repo}@${sha} does not end`);
      seen.add(next.href);
      const { body, link } = await this.getJsonWithLink(next, opts.signal);
      if (!Array.isArray(body)) throw new HubError('Transient', `tree listing of ${repo}@${sha} is not a list`);
      for (const entry of body as unknown[]) {
        const file = toSourceFile(entry, repo);
        if (file) files.push(file);
      }
      next = link;
    }
    files.sort((a, b) => (a.path < b.path ? -1 : a.path > b.path ? 1 : 0));
    return { repo, revision, sha, files };
  }

  /**
   * Streams `path` at commit `sha` from `offset` on. Asks for `Range: bytes=<offset>-` and checks
   * the 206's `Content-Range`; a server that ignores Range (200) gets its first `offset` bytes
   * skipped (see {@link HubDownload.rangeIgnored}). An offset equal to the size yields an empty body.
   */
  async download(repo: string, sha: string, filePath: string, opts: DownloadOptions = {}): Promise<HubDownload> {
    assertRepoId(repo);
    assertCommitSha(sha);
    assertFilePath(filePath);
    const offset = opts.offset ?? 0;
    if (!Number.isSafeInteger(offset) || offset < 0) throw new HubError('InvalidInput', `invalid offset ${offset} for ${filePath}`);
    const where = `${repo}@${sha.slice(0, 12)}:${filePath}`;
    const url = new URL(`${this.baseUrl}/${repo}/resolve/${sha}/${filePath.split('/').map(encodeURIComponent).join('/')}`);
    const headers: Record<string, string> = { 'Accept-Encoding': 'identity' };
    if (offset > 0) headers.Range = `bytes=${offset}-`;
    const { response, hubHeaders: first, url: finalUrl, abort } = await this.request(url, 'file', headers, 'GET', opts.signal);

    const commit = first.get('x-repo-commit') ?? response.headers.get('x-repo-commit');
    const etag = normalizeEtag(first.get('x-linked-etag') ?? response.headers.get('etag'));
    const linkedSize = parseSize(first.get('x-linked-size'));
    const encoding = response.headers.get('content-encoding');
    if (encoding && encoding !== 'identity') {
      await discard(response);
      throw new HubError(
        'Transient',
        `download of ${where} came with Content-Encoding ${headerText(encoding, /^[A-Za-z0-9._-]+$/)}; byte offsets would be wrong`,
      );
    }

    if (response.status === 416) {
      await discard(response);
      const total = /^bytes \*\/(\d+)$/.exec(response.headers.get('content-range') ?? '');
      if (total && Number(total[1]) === offset) {
        return { body: emptyBody(), size: offset, offset, commit, etag, rangeIgnored: false };
      }
      throw new HubError('InvalidInput', `offset ${offset} is beyond the end of ${where}${total ? ` (${total[1]} bytes)` : ''}`, { status: 416 });
    }

    let size: number;
    let skip = 0;
    let rangeIgnored = false;
    if (response.status === 206) {
      const cr = /^bytes (\d+)-(\d+)\/(\d+)$/.exec(response.headers.get('content-range') ?? '');
      if (!cr || Number(cr[1]) !== offset || Number(cr[2]) !== Number(cr[3]) - 1) {
        await discard(response);
        throw new HubError(
          'Transient',
          `download of ${where}: asked for bytes ${offset}-, got Content-Range ${headerText(response.headers.get('content-range'), /^bytes [0-9*/ -]+$/)}`,
        );
      }
      size = Number(cr[3]);
    } else if (response.status === 200) {
      const length = parseSize(response.headers.get('content-length')) ?? linkedSize;
      if (length === null) {
        await discard(response);
        throw new HubError('Transient', `download of ${where}: the server did not announce the size`);
      }
      size = length;
      if (offset > 0) {
        if (offset > size) {
          await discard(response);
          throw new HubError('InvalidInput', `offset ${offset} is beyond the end of ${where} (${size} bytes)`);
        }
        rangeIgnored = true;
        skip = offset;
      }
    } else {
      throw await this.errorFrom(response, 'file', finalUrl, where);
    }
    if (linkedSize !== null && linkedSize !== size) {
      await discard(response);
      throw new HubError('Transient', `download of ${where}: the hub announced ${linkedSize} bytes, the server sends ${size}`);
    }
    if (!response.body) throw new HubError('Transient', `download of ${where}: response without a body`);
    return {
      body: streamBody(response.body, {
        skip,
        expected: size - offset,
        offset,
        size,
        where,
        signal: opts.signal,
        idleMs: this.timeoutMs,
        abort,
        scrub: this.scrub,
      }),
      size,
      offset,
      commit,
      etag,
      rangeIgnored,
    };
  }

  // -- plumbing -------------------------------------------------------------------------------

  /** Replaces the token wherever it might appear in text that leaves this module. */
  private readonly scrub = (text: string): string => (this.token ? text.split(this.token).join('***') : text);

  private async getJson<T>(url: URL, kind: RequestKind, signal: AbortSignal | undefined): Promise<T> {
    const { response, url: finalUrl } = await this.request(url, kind, { Accept: 'application/json' }, 'GET', signal);
    if (response.status !== 200) throw await this.errorFrom(response, kind, finalUrl);
    return this.readJson<T>(response, url, signal);
  }

  private async getJsonWithLink(url: URL, signal: AbortSignal | undefined): Promise<{ body: unknown; link: URL | null }> {
    const { response, url: finalUrl } = await this.request(url, 'tree', { Accept: 'application/json' }, 'GET', signal);
    if (response.status !== 200) throw await this.errorFrom(response, 'tree', finalUrl);
    const link = nextLink(response.headers.get('link'), finalUrl);
    return { body: await this.readJson<unknown>(response, url, signal), link };
  }

  private async readJson<T>(response: Response, url: URL, signal: AbortSignal | undefined): Promise<T> {
    let text: string;
    try {
      text = await response.text();
    } catch (err) {
      if (signal?.aborted) throw signal.reason;
      throw new HubError('Transient', this.scrub(`reading ${describe(url)} failed: ${errorText(err)}`), { cause: err });
    }
    try {
      return JSON.parse(text) as T;
    } catch {
      throw new HubError('Transient', `${describe(url)} answered with invalid JSON`);
    }
  }

  /**
   * One request with redirects followed by hand: the token goes only to the hub's origin, a hop
   * elsewhere is made without it. Network failures and timeouts become `Transient` errors; an
   * abort through `signal` rethrows its reason.
   */
  private async request(url: URL, kind: RequestKind, extra: Record<string, string>, method: 'GET' | 'HEAD', signal: AbortSignal | undefined): Promise<Hop> {
    let hubHeaders: Headers | null = null;
    for (let hop = 0; ; hop++) {
      if (url.protocol !== 'https:' && url.protocol !== 'http:') {
        throw new HubError('Transient', `redirected to an unsupported URL scheme ${url.protocol}`);
      }
      const headers: Record<string, string> = { 'User-Agent': this.userAgent, ...extra };
      if (this.token && url.origin === this.origin) headers.Authorization = `Bearer ${this.token}`;
      const { response, abort } = await this.fetchWithTimeout(url, { method, headers, redirect: 'manual' }, signal);
      if (url.origin === this.origin || hubHeaders === null) hubHeaders = response.headers;
      const location = response.headers.get('location');
      if (!REDIRECTS.has(response.status) || location === null) return { response, url, hubHeaders, abort };
      await discard(response);
      if (hop >= this.maxRedirects) throw new HubError('Transient', `too many redirects for ${describe(url)} (${kind})`);
      url = new URL(location, url);
    }
  }

  private async fetchWithTimeout(
    url: URL,
    init: RequestInit,
    signal: AbortSignal | undefined,
  ): Promise<{ response: Response; abort: (reason: Error) => void }> {
    signal?.throwIfAborted();
    // The caller's signal governs headers and body; our own controller adds the header timeout
    // here and the body's idle timeout in streamBody.
    const own = new AbortController();
    const timer = setTimeout(() => own.abort(new Error('timeout')), this.timeoutMs);
    try {
      const response = await this.fetchImpl(url, { ...init, signal: signal ? AbortSignal.any([signal, own.signal]) : own.signal });
      return { response, abort: (reason) => own.abort(reason) };
    } catch (err) {
      if (signal?.aborted) throw signal.reason;
      // Refused before any connection: permanent, and what to allow is in the message.
      if (isHubError(err, 'AddressRefused')) throw new HubError('AddressRefused', `request to ${describe(url)} refused: ${err.message}`);
      const timedOut = own.signal.aborted;
      const what = timedOut ? `no response within ${this.timeoutMs} ms` : errorText(err);
      throw new HubError('Transient', this.scrub(`request to ${describe(url)} failed: ${what}`), timedOut ? {} : { cause: err });
    } finally {
      clearTimeout(timer);
    }
  }

  /**
   * Maps an error response: the hub's `X-Error-Code` first, then the status. The message says
   * the status, a known error code and a fixed description, never what the server wrote (its
   * body is discarded unread; `X-Error-Message` is not echoed): a Model's status must not become
   * a window onto whatever answered.
   */
  private async errorFrom(response: Response, kind: RequestKind, url: URL, where = describe(url)): Promise<HubError> {
    const status = response.status;
    const header = response.headers.get('x-error-code');
    const hubCode = header !== null && KNOWN_HUB_CODES.has(header) ? header : null;
    await discard(response);
    const detail = this.scrub(`${where}: HTTP ${status}${hubCode ? ` ${hubCode}` : ''}: ${statusText(status, hubCode)}`);
    const retryAfterMs = parseRetryAfter(response.headers.get('retry-after'));
    const fromHub = url.origin === this.origin;
    const err = (code: HubErrorCode): HubError => new HubError(code, detail, { status, ...(retryAfterMs === undefined ? {} : { retryAfterMs }) });

    switch (hubCode) {
      case 'RepoNotFound':
        return err('RepoNotFound');
      case 'RevisionNotFound':
        return err('RevisionNotFound');
      case 'EntryNotFound':
        return err('EntryNotFound');
      case 'GatedRepo':
        return err('Unauthorized');
    }
    if (status === 408 || status === 425 || status === 429 || status >= 500) return err('Transient');
    // A signed CDN URL that expired or was refused is the hub's to renew: asking again helps.
    if (!fromHub) return err('Transient');
    if (status === 401 || status === 403) return err('Unauthorized');
    if (status === 404) return err(kind === 'file' ? 'EntryNotFound' : 'RepoNotFound');
    return err('InvalidInput');
  }
}

const isAllowList = (a: AllowedNetworks | readonly string[] | undefined): a is AllowedNetworks => a !== undefined && 'kinds' in a;

/** The hub's `X-Error-Code` values that are named in messages (anything else is left out). */
const KNOWN_HUB_CODES = new Set(['RepoNotFound', 'RevisionNotFound', 'EntryNotFound', 'GatedRepo']);

/** A fixed description of an error status, for messages (the server's own words are not used). */
function statusText(status: number, hubCode: string | null): string {
  switch (hubCode) {
    case 'RepoNotFound':
      return 'no such repository, or not visible to this token';
    case 'RevisionNotFound':
      return 'no such revision';
    case 'EntryNotFound':
      return 'no such file at this revision';
    case 'GatedRepo':
      return 'a gated repository: the token is missing or has no access';
  }
  if (status === 401) return 'unauthorized: the token is missing or invalid';
  if (status === 403) return 'forbidden';
  if (status === 404) return 'not found';
  if (status === 408) return 'request timeout';
  if (status === 416) return 'range not satisfiable';
  if (status === 429) return 'too many requests';
  if (status >= 500) return 'server error';
  return 'request refused';
}

/** A tree listing's entry as a {@link SourceFile}; null for what is not a file. */
function toSourceFile(entry: unknown, repo: string): SourceFile | null {
  if (typeof entry !== 'object' || entry === null) throw new HubError('Transient', `tree listing of ${repo} has a malformed entry`);
  const e = entry as { type?: unknown; path?: unknown; size?: unknown; lfs?: { oid?: unknown; size?: unknown } | null };
  if (e.type !== 'file') return null;
  if (typeof e.path !== 'string') throw new HubError('Transient', `tree listing of ${repo} has an entry without a path`);
  try {
    assertFilePath(e.path);
  } catch {
    throw new HubError('InvalidInput', `repository ${repo} lists an unsafe file path ${JSON.stringify(e.path)}`);
  }
  const lfs = e.lfs ?? null;
  const size = lfs ? lfs.size : e.size;
  if (typeof size !== 'number' || !Number.isSafeInteger(size) || size < 0) {
    throw new HubError('Transient', `tree listing of ${repo} has no valid size for ${e.path}`);
  }
  let sha256: string | null = null;
  if (lfs) {
    if (typeof lfs.oid !== 'string' || !SHA256_HEX.test(lfs.oid))
      throw new HubError('InvalidInput', `repository ${repo} lists ${e.path} with an invalid LFS sha256`);
    sha256 = lfs.oid;
  }
  return { path: e.path, size, sha256 };
}

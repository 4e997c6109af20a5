/**
 * The Hugging Face hub's HTTP protocol as the demo hub speaks it: its routes, its error answers
 * (`X-Error-Code`, `X-Error-Message`, a JSON body), byte ranges, and the URL of a file.
 */
import type { ServerResponse } from 'node:http';

/** What a hub path asks for; `repoAt` is the index of the repo id's first segment in the path. */
export type HubRoute =
  | { kind: 'revision'; repo: string; repoAt: number; revision: string }
  | { kind: 'tree'; repo: string; repoAt: number; revision: string; prefix: string }
  | { kind: 'resolve'; repo: string; repoAt: number; revision: string; path: string }
  /** Under a repo's API path, but nothing the hub answers. */
  | { kind: 'unknown'; repo: string; repoAt: number };

/**
 * `/api/models/{org}/{name}[/revision/{rev} | /tree/{rev}[/{path}]]` and
 * `/{org}/{name}/resolve/{rev}/{path...}`, from the decoded path segments; null for anything else.
 */
export function hubRoute(segments: readonly string[]): HubRoute | null {
  if (segments[0] === 'api' && segments[1] === 'models' && segments.length >= 4) {
    const repo = `${segments[2]}/${segments[3]}`;
    const kind = segments[4];
    if (kind === undefined || kind === 'revision')
      return { kind: 'revision', repo, repoAt: 2, revision: kind === undefined ? 'main' : segments.slice(5).join('/') };
    if (kind === 'tree' && segments.length >= 6)
      return { kind: 'tree', repo, repoAt: 2, revision: segments[5]!, prefix: segments.slice(6).filter(Boolean).join('/') };
    return { kind: 'unknown', repo, repoAt: 2 };
  }
  if (segments.length >= 5 && segments[2] === 'resolve') {
    return { kind: 'resolve', repo: `${segments[0]}/${segments[1]}`, repoAt: 0, revision: segments[3]!, path: segments.slice(4).join('/') };
  }
  return null;
}

/** The path's segments, decoded; null when one does not decode. */
export function decodeSegments(pathname: string): string[] | null {
  try {
    return pathname
      .split('/')
      .slice(1)
      .map((s) => decodeURIComponent(s));
  } catch {
    return null;
  }
}

/** The repo path of the file a CDN URL serves, from its signed content-disposition. */
export function cdnFilePath(url: URL): string | null {
  const m = /filename\*=UTF-8''([^;]+)/.exec(url.searchParams.get('response-content-disposition') ?? '');
  return m ? decodeURIComponent(m[1]!) : null;
}

const encodePath = (p: string): string => p.split('/').map(encodeURIComponent).join('/');

/** URL of a file on a hub as the hub client builds it (for raw-protocol tests and benches). */
export function resolveUrl(hubUrl: string, repo: string, revision: string, filePath: string): string {
  return `${hubUrl}/${repo}/resolve/${encodeURIComponent(revision)}/${encodePath(filePath)}`;
}

/**
 * The range a `Range` header asks of `size` bytes (`a-`, `a-b`, `-n`); null for none (and for a
 * multi-range or malformed one: the whole content is served, as RFC 9110 allows).
 */
export function parseRange(header: string | undefined, size: number): { start: number; end: number } | 'unsatisfiable' | null {
  if (!header) return null;
  const m = /^bytes=(\d*)-(\d*)$/.exec(header.trim());
  if (!m) return null;
  const [, a, b] = m;
  if (a === '' && b === '') return null;
  if (a === '') {
    const n = Number(b);
    if (n === 0 || size === 0) return 'unsatisfiable';
    return { start: Math.max(0, size - n), end: size - 1 };
  }
  const start = Number(a);
  const end = b === '' ? size - 1 : Math.min(Number(b), size - 1);
  if (start >= size || end < start) return 'unsatisfiable';
  return { start, end };
}

export function contentType(filePath: string, lfs: boolean): string {
  if (lfs) return 'application/octet-stream';
  if (filePath.endsWith('.json')) return 'application/json; charset=utf-8';
  return 'text/plain; charset=utf-8';
}

export function sendJson(res: ServerResponse, status: number, body: unknown, headers: Record<string, string> = {}): void {
  const data = Buffer.from(JSON.stringify(body));
  res.writeHead(status, { 'Content-Type': 'application/json; charset=utf-8', 'Content-Length': data.length, ...headers });
  res.end(res.req.method === 'HEAD' ? undefined : data);
}

/** An error as the hub answers it: `X-Error-Code` (when it has one), `X-Error-Message`, `{"error"}`. */
export function sendError(res: ServerResponse, status: number, code: string | null, message: string, headers: Record<string, string> = {}): void {
  sendJson(res, status, { error: message }, { ...(code ? { 'X-Error-Code': code } : {}), 'X-Error-Message': message, ...headers });
}

/** The hub's answer for a repo that does not exist, or that this request may not see. */
export function sendRepoNotFound(res: ServerResponse, status: 401 | 404 = 404): void {
  sendError(
    res,
    status,
    'RepoNotFound',
    'Repository Not Found for url: the repository does not exist, or it is private and you are not authenticated or lack access.',
  );
}

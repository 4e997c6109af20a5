/**
 * The demo hub's repositories: commits of files, the identifiers git and the hub derive from them
 * (blob oids, LFS pointers and their sha256), branches and tags, and the LFS objects the CDN
 * serves. A commit's sha is the sha1 of its file listing, so the same files always give the same
 * sha; a new commit on a branch moves it, and older commits stay addressable by sha.
 */
import { createHash } from 'node:crypto';
import { readdir, readFile } from 'node:fs/promises';
import * as path from 'node:path';

export interface AddRepoInput {
  /** `org/name`. Adding to an existing id creates a new commit on `branch`; older commits stay addressable by sha. */
  id: string;
  /** A local directory whose files (recursively, `.git` excluded) become the commit's files. */
  dir?: string;
  /** In-memory files, merged over `dir`'s (path → content). */
  files?: Record<string, string | Uint8Array>;
  /** Branch the commit lands on (default `main`). */
  branch?: string;
  /** Tags pointing at this commit. */
  tags?: string[];
}

/** One file of a commit, with the identifiers the hub derives from it. */
export interface HubFile {
  path: string;
  size: number;
  content: Buffer;
  /** Git blob sha1 of what git stores: the content, or for LFS files the pointer file. */
  oid: string;
  /** sha256 of the content (what the hub reports as `lfs.oid` for LFS files). */
  sha256: string;
  lfs: boolean;
  /** Size of the LFS pointer file (LFS files only). */
  pointerSize?: number;
}

export interface HubCommit {
  repo: string;
  /** 40-hex commit id: sha1 of the file listing, so the same files always give the same sha. */
  sha: string;
  files: HubFile[];
}

export interface HubRepo {
  id: string;
  /** Branch and tag names → commit sha. */
  refs: Map<string, string>;
  commits: Map<string, HubCommit>;
}

/** An LFS object as the CDN serves it. */
export interface LfsObject {
  repo: string;
  content: Buffer;
}

export const sha1 = (data: string | Uint8Array): string => createHash('sha1').update(data).digest('hex');
export const sha256 = (data: Uint8Array): string => createHash('sha256').update(data).digest('hex');
const gitBlobOid = (data: Uint8Array): string => sha1(Buffer.concat([Buffer.from(`blob ${data.length}\0`), data]));
/** The hash a repository's LFS objects are stored under on the CDN. */
export const repoHash = (repo: string): string => sha256(Buffer.from(repo));

const byPath = (a: string, b: string): number => (a < b ? -1 : a > b ? 1 : 0);

export class HubRepos {
  private readonly repos = new Map<string, HubRepo>();
  /** `<repoHash>/<sha256>` → the object. */
  private readonly lfsObjects = new Map<string, LfsObject>();

  /** `isLfs`: whether a file of this path and size is stored in LFS. */
  constructor(private readonly isLfs: (filePath: string, size: number) => boolean) {}

  async add(input: AddRepoInput): Promise<HubCommit> {
    const contents = new Map<string, Buffer>();
    if (input.dir) for (const [p, data] of await listDir(input.dir)) contents.set(p, data);
    for (const [p, data] of Object.entries(input.files ?? {})) contents.set(p, Buffer.from(data));
    const files = [...contents.entries()]
      .sort(([a], [b]) => byPath(a, b))
      .map(([p, content]): HubFile => {
        const digest = sha256(content);
        if (!this.isLfs(p, content.length)) return { path: p, size: content.length, content, oid: gitBlobOid(content), sha256: digest, lfs: false };
        const pointer = lfsPointer(digest, content.length);
        return { path: p, size: content.length, content, oid: gitBlobOid(pointer), sha256: digest, lfs: true, pointerSize: pointer.length };
      });
    const sha = sha1(`${input.id}\n${files.map((f) => `${f.path}\0${f.oid}\n`).join('')}`);
    const commit: HubCommit = { repo: input.id, sha, files };
    let repo = this.repos.get(input.id);
    if (!repo) {
      repo = { id: input.id, refs: new Map(), commits: new Map() };
      this.repos.set(input.id, repo);
    }
    repo.commits.set(sha, commit);
    repo.refs.set(input.branch ?? 'main', sha);
    for (const tag of input.tags ?? []) repo.refs.set(tag, sha);
    const hash = repoHash(input.id);
    for (const f of files) if (f.lfs) this.lfsObjects.set(`${hash}/${f.sha256}`, { repo: input.id, content: f.content });
    return commit;
  }

  get(id: string): HubRepo | undefined {
    return this.repos.get(id);
  }

  /** The commit a branch, tag or full sha names. */
  commitAt(repo: HubRepo, revision: string): HubCommit | undefined {
    const sha = repo.refs.get(revision) ?? (/^[0-9a-f]{40}$/.test(revision) ? revision : undefined);
    return sha === undefined ? undefined : repo.commits.get(sha);
  }

  lfsObject(repoHashHex: string, sha256Hex: string): LfsObject | undefined {
    return this.lfsObjects.get(`${repoHashHex}/${sha256Hex}`);
  }
}

/** The model info the hub's `/api/models/{repo}/revision/{rev}` answers. */
export function repoInfo(repo: HubRepo, commit: HubCommit): Record<string, unknown> {
  const tags = [...repo.refs.entries()].filter(([name, sha]) => name !== 'main' && sha === commit.sha).map(([name]) => name);
  return {
    _id: sha1(repo.id).slice(0, 24),
    id: repo.id,
    modelId: repo.id,
    author: repo.id.split('/')[0],
    sha: commit.sha,
    private: false,
    gated: false,
    disabled: false,
    tags,
    lastModified: new Date(0).toISOString(),
    siblings: commit.files.map((f) => ({ rfilename: f.path })),
  };
}

/** The entries of the tree API under `prefix` (directories too), sorted by path as the hub sorts them. */
export function treeEntries(commit: HubCommit, prefix: string, recursive: boolean): unknown[] {
  const under = prefix ? `${prefix}/` : '';
  const dirs = new Set<string>();
  const files: HubFile[] = [];
  for (const f of commit.files) {
    if (!f.path.startsWith(under)) continue;
    const parts = f.path.slice(under.length).split('/');
    if (!recursive && parts.length > 1) {
      dirs.add(under + parts[0]!);
      continue;
    }
    for (let i = 1; i < parts.length; i++) dirs.add(under + parts.slice(0, i).join('/'));
    files.push(f);
  }
  const entries: { path: string; entry: unknown }[] = [
    ...[...dirs].map((d) => ({ path: d, entry: { type: 'directory', oid: sha1(`tree ${commit.sha} ${d}`), size: 0, path: d } })),
    ...files.map((f) => ({
      path: f.path,
      entry: {
        type: 'file',
        oid: f.oid,
        size: f.size,
        path: f.path,
        ...(f.lfs ? { lfs: { oid: f.sha256, size: f.size, pointerSize: f.pointerSize } } : {}),
      },
    })),
  ];
  return entries.sort((a, b) => byPath(a.path, b.path)).map((e) => e.entry);
}

async function listDir(root: string, rel = ''): Promise<[string, Buffer][]> {
  const out: [string, Buffer][] = [];
  for (const entry of await readdir(path.join(root, rel), { withFileTypes: true })) {
    if (entry.name === '.git') continue;
    const relPath = rel ? `${rel}/${entry.name}` : entry.name;
    if (entry.isDirectory()) out.push(...(await listDir(root, relPath)));
    else if (entry.isFile()) out.push([relPath, await readFile(path.join(root, relPath))]);
  }
  return out;
}

function lfsPointer(sha: string, size: number): Buffer {
  return Buffer.from(`version https://git-lfs.github.com/spec/v1\noid sha256:${sha}\nsize ${size}\n`);
}

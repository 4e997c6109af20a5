/**
 * Input validation of the hub client: bad input must never reach the network, so repository ids,
 * revisions, commit shas and file paths are checked before any request (`InvalidInput`).
 */
import { HubError } from './errors';

const REPO_PART = /^[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$/;
/** A full git commit sha. */
export const COMMIT_SHA = /^[0-9a-f]{40}$/;
/** An LFS file's sha256. */
export const SHA256_HEX = /^[0-9a-f]{64}$/;
// eslint-disable-next-line no-control-regex
const CONTROL_CHARS = /[\u0000-\u001f\u007f]/;

/** Validates `org/name` as the hub does (letters, digits, `_.-`, no `--`/`..`, ≤ 96 chars per part). */
export function assertRepoId(repo: string): void {
  const parts = typeof repo === 'string' ? repo.split('/') : [];
  const ok =
    parts.length === 2 && parts.every((p) => p.length <= 96 && REPO_PART.test(p)) && !repo.includes('--') && !repo.includes('..') && !repo.endsWith('.git');
  if (!ok) throw new HubError('InvalidInput', `invalid repository id ${JSON.stringify(repo)}: expected "org/name"`);
}

/** Validates a branch, tag or commit name (git ref rules, loosely). */
export function assertRevision(revision: string): void {
  const ok =
    typeof revision === 'string' &&
    revision.length > 0 &&
    revision.length <= 255 &&
    !CONTROL_CHARS.test(revision) &&
    !/[\s~^:?*[\\]/.test(revision) &&
    !revision.includes('..') &&
    !revision.startsWith('/') &&
    !revision.endsWith('/') &&
    !revision.includes('//');
  if (!ok) throw new HubError('InvalidInput', `invalid revision ${JSON.stringify(revision)}`);
}

/** Validates a relative file path: no empty, `.` or `..` segments, no absolute or Windows paths, no control characters. */
export function assertFilePath(filePath: string): void {
  const ok =
    typeof filePath === 'string' &&
    filePath.length > 0 &&
    filePath.length <= 1024 &&
    !CONTROL_CHARS.test(filePath) &&
    !filePath.includes('\\') &&
    !/^[A-Za-z]:/.test(filePath) &&
    filePath.split('/').every((s) => s !== '' && s !== '.' && s !== '..');
  if (!ok) throw new HubError('InvalidInput', `invalid file path ${JSON.stringify(filePath)}: must be relative, without "." or ".." segments`);
}

/** Validates a 40-hex commit sha: downloads are pinned to one. */
export function assertCommitSha(sha: string): void {
  if (typeof sha !== 'string' || !COMMIT_SHA.test(sha)) {
    throw new HubError('InvalidInput', `invalid commit ${JSON.stringify(sha)}: downloads are pinned to a 40-hex commit sha`);
  }
}

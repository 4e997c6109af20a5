/**
 * The hub client's errors: a {@link HubError} has a stable `code` and a `permanent` flag; callers
 * (activities) turn permanent ones into non-retryable failures ({@link hubErrorType}).
 */
import { ErrorType } from '../../shared/errors';

/** Stable reasons. Append new codes; never rename (they appear in workflow histories). */
export type HubErrorCode =
  /** The repository does not exist, or is private and the token (if any) has no access. */
  | 'RepoNotFound'
  /** The branch, tag or commit does not exist in the repository. */
  | 'RevisionNotFound'
  /** The file does not exist at that revision. */
  | 'EntryNotFound'
  /** 401/403: missing or invalid token, or no access to a gated repository. */
  | 'Unauthorized'
  /** A bad repo id, revision, sha, path or offset (rejected before any request), or a repository listing unsafe paths. */
  | 'InvalidInput'
  /** Retrying may help: 5xx, 408, 429, network errors, timeouts, mid-stream disconnects, protocol hiccups. */
  | 'Transient'
  /**
   * The hub's host, or a redirect's, is (or resolves to) an address of a kind the worker refuses
   * (loopback, private, link-local, metadata …) and its allowed networks do not cover: nothing was sent.
   */
  | 'AddressRefused';

/** The `name` of every {@link HubError}. */
export const HUB_ERROR_NAME = 'HubError';

export class HubError extends Error {
  override readonly name = HUB_ERROR_NAME;
  /** True when no retry can fix it. */
  readonly permanent: boolean;
  /** HTTP status, when the error comes from a response. */
  readonly status?: number;
  /** From `Retry-After` on 429/503, in milliseconds. */
  readonly retryAfterMs?: number;

  constructor(
    readonly code: HubErrorCode,
    message: string,
    options: { status?: number; retryAfterMs?: number; cause?: unknown } = {},
  ) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.permanent = code !== 'Transient';
    if (options.status !== undefined) this.status = options.status;
    if (options.retryAfterMs !== undefined) this.retryAfterMs = options.retryAfterMs;
  }
}

/** True when `err` is a {@link HubError} (by name, so it works across realms), optionally with `code`. */
export function isHubError(err: unknown, code?: HubErrorCode): err is HubError {
  if (typeof err !== 'object' || err === null) return false;
  const e = err as { name?: unknown; code?: unknown };
  return e.name === HUB_ERROR_NAME && typeof e.code === 'string' && (code === undefined || e.code === code);
}

/** The Temporal failure type for a hub error code; null for transient errors (retry them). */
export function hubErrorType(code: HubErrorCode): ErrorType | null {
  switch (code) {
    case 'RepoNotFound':
    case 'RevisionNotFound':
    case 'EntryNotFound':
      return ErrorType.RepoNotFound;
    case 'Unauthorized':
      return ErrorType.Unauthorized;
    case 'InvalidInput':
      return ErrorType.InvalidSpec;
    case 'AddressRefused':
      return ErrorType.AddressRefused;
    case 'Transient':
      return null;
  }
}

/**
 * Failure types (Temporal `ApplicationFailure.type`) shared by activities and workflows.
 * Permanent ones are raised non-retryable; the workflow records the reason and waits for a spec
 * change instead of retrying.
 */
export const ErrorType = {
  /** The repository or revision does not exist (HTTP 404 from the hub). */
  RepoNotFound: 'RepoNotFound',
  /** The token is missing, invalid, or lacks access to a gated/private repo (401/403). */
  Unauthorized: 'Unauthorized',
  /** Architecture, dtype or config the converter does not support. */
  UnsupportedModel: 'UnsupportedModel',
  /** Content did not match the source's sha256, even after a fresh download. */
  ChecksumMismatch: 'ChecksumMismatch',
  /** The spec itself is invalid. */
  InvalidSpec: 'InvalidSpec',
  /** A referenced secret could not be resolved. */
  SecretUnavailable: 'SecretUnavailable',
  /** The file the spec chooses (`source.gguf`) is not in the pinned revision, or not one file. */
  NoSuchFile: 'NoSuchFile',
} as const;
export type ErrorType = (typeof ErrorType)[keyof typeof ErrorType];

/** Types that no retry can fix. */
export const PERMANENT_ERROR_TYPES: readonly string[] = Object.values(ErrorType);

/**
 * A status write whose resource no longer exists, or is another object under the same name
 * (its uid differs): never retried; the workflow writes again when a resource comes back.
 */
export const RESOURCE_GONE = 'ResourceGone';

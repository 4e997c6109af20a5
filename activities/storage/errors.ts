/**
 * Errors raised by the S3 side of the pipeline. Failures of S3 itself (network, 5xx, throttling)
 * and of the byte source are passed through as they are: they are transient and a retry resumes.
 * A {@link StorageError} is raised when the *content* is wrong.
 *
 * Tests and callers match on `name` and `code`, never on `instanceof` (errors cross activity
 * boundaries, where class identity is lost).
 */
import type { ErrorType } from '../../shared/errors';

/** Stable reasons. Append new codes; never rename (they appear in workflow histories). */
export type StorageErrorCode =
  /**
   * The bytes' sha256 differs from the source's. The multipart upload has been aborted, so a
   * retry downloads afresh; the Temporal failure type is {@link ErrorType.ChecksumMismatch}.
   */
  | typeof ErrorType.ChecksumMismatch
  /**
   * The source yielded more bytes than its listed size (permanent: the upload has been aborted),
   * or ended before it (`permanent: false`: a cut-off stream; the upload is kept and a retry resumes).
   */
  | 'SizeMismatch'
  /** An S3 object is shorter than a read asked for, or a response body ended early. */
  | 'ShortRead'
  /** A caller passed an impossible argument (negative size, malformed sha256, bad part size). */
  | 'InvalidArgument';

/** The `name` of every {@link StorageError}. */
export const STORAGE_ERROR_NAME = 'StorageError';

export class StorageError extends Error {
  override readonly name = STORAGE_ERROR_NAME;
  /** True when no retry can fix it. */
  readonly permanent: boolean;

  constructor(
    readonly code: StorageErrorCode,
    message: string,
    options: { permanent: boolean; cause?: unknown },
  ) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.permanent = options.permanent;
  }
}

/** True when `err` is a {@link StorageError} (by name, so it works across realms), optionally with `code`. */
export function isStorageError(err: unknown, code?: StorageErrorCode): err is StorageError {
  if (typeof err !== 'object' || err === null) return false;
  const e = err as { name?: unknown; code?: unknown };
  return e.name === STORAGE_ERROR_NAME && typeof e.code === 'string' && (code === undefined || e.code === code);
}

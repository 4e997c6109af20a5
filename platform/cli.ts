/**
 * What the `magus` commands share about their command lines: the error a bad one raises, and how
 * a command answers it.
 */

/** The name of {@link UsageError}: checked by name, not `instanceof`, across module boundaries. */
export const USAGE_ERROR = 'UsageError';

/** A bad command line; its message is for the user, printed above the command's usage. */
export class UsageError extends Error {
  override readonly name = USAGE_ERROR;
}

/**
 * A command's answer to `err`, thrown while it read its command line: a {@link UsageError} is
 * printed to stderr as `<command>: <message>` followed by `usage`, for exit status 1; any other
 * error is thrown on.
 */
export function usageFailure(command: string, usage: string, err: unknown): 1 {
  if (!(err instanceof Error) || err.name !== USAGE_ERROR) throw err;
  process.stderr.write(`${command}: ${err.message}\n${usage}\n`);
  return 1;
}

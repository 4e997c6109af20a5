/**
 * Incomplete multipart uploads cost storage until someone aborts them. Transfers keep theirs on
 * failure so that a retry can resume; uploads whose retries never came are aborted here once
 * they are older than any retry could be.
 */
import type { S3Client } from '@aws-sdk/client-s3';
import { abortUpload, listUploads, type IncompleteUpload } from './multipart';

export type { IncompleteUpload };

/** Incomplete uploads of every key starting with `prefix` ('' = the whole bucket). */
export function listIncompleteUploads(s3: S3Client, bucket: string, prefix = '', signal?: AbortSignal): Promise<IncompleteUpload[]> {
  return listUploads(s3, bucket, { prefix }, signal);
}

export interface AbortStaleOptions {
  /** Only keys starting with this. */
  prefix: string;
  /** Uploads started more than this long ago are aborted. */
  olderThanMs: number;
  /** The clock (default `Date.now()`). */
  now?: number;
  signal?: AbortSignal;
}

/**
 * Aborts incomplete uploads under `prefix` started before `now − olderThanMs`; uploads whose
 * start time the server does not report are left alone.
 * @returns how many were aborted
 */
export async function abortStaleUploads(s3: S3Client, bucket: string, opts: AbortStaleOptions): Promise<number> {
  const cutoff = (opts.now ?? Date.now()) - opts.olderThanMs;
  let aborted = 0;
  for (const u of await listUploads(s3, bucket, { prefix: opts.prefix }, opts.signal)) {
    if (u.initiated === null || u.initiated.getTime() >= cutoff) continue;
    await abortUpload({ s3, bucket, key: u.key }, u.uploadId, opts.signal);
    aborted++;
  }
  return aborted;
}

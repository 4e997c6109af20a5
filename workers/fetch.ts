/**
 * `magus fetch`: the init container of a Kubernetes instance's root pod. Downloads artifact files
 * from S3 into a folder through the local runtime's model cache (activities/runtime/cache.ts:
 * temporary name, sha256 verified, renamed only when it matches), so the pod gets exactly the
 * registry's bytes or fails with a reason. Each file is `--file <key>=<sha256>[=<name>]`; the
 * file lands at `<dir>/<sha256><extension of key>` and, with a name, is also linked as `<dir>/<name>`.
 * S3 as for the worker: MAGUS_S3_ENDPOINT, MAGUS_S3_REGION, MAGUS_S3_BUCKET; credentials from
 * the SDK's default chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from the pod's Secret).
 */
import { S3Client } from '@aws-sdk/client-s3';
import { symlinkSync, rmSync } from 'node:fs';
import { basename, extname, join } from 'node:path';
import { cachedFile } from '../activities/runtime/cache';

export const FETCH_USAGE =
  'usage: magus fetch --dir DIR --file KEY=SHA256[=NAME] [--file …]\n' +
  'environment: MAGUS_S3_ENDPOINT, MAGUS_S3_REGION (us-east-1), MAGUS_S3_BUCKET (magus); S3 credentials from the default chain';

export interface FetchSpec {
  dir: string;
  files: { key: string; sha256: string; name?: string }[];
}

/** Parses `magus fetch` arguments; a string is the problem. */
export function parseFetchArgs(args: readonly string[]): FetchSpec | string {
  let dir: string | undefined;
  const files: FetchSpec['files'] = [];
  for (let i = 0; i < args.length; i += 2) {
    const flag = args[i];
    const value = args[i + 1];
    if (value === undefined || value.startsWith('--')) return `${flag} needs a value`;
    if (flag === '--dir') dir = value;
    else if (flag === '--file') {
      const [key, sha256, name, ...rest] = value.split('=');
      if (!key || !sha256 || rest.length > 0 || !/^[0-9a-f]{64}$/.test(sha256)) return `--file ${value}: expected KEY=SHA256[=NAME] with a hex sha256`;
      if (name !== undefined && (name === '' || name !== basename(name))) return `--file ${value}: NAME must be a plain file name`;
      files.push({ key, sha256, ...(name ? { name } : {}) });
    } else return `unknown option ${flag}`;
  }
  if (!dir) return '--dir is required';
  if (files.length === 0) return 'at least one --file is required';
  return { dir, files };
}

export async function fetchCommand(args: string[]): Promise<number> {
  if (args.includes('--help') || args.includes('-h')) {
    process.stdout.write(`${FETCH_USAGE}\n`);
    return 0;
  }
  const spec = parseFetchArgs(args);
  if (typeof spec === 'string') {
    process.stderr.write(`magus fetch: ${spec}\n${FETCH_USAGE}\n`);
    return 2;
  }
  const endpoint = process.env.MAGUS_S3_ENDPOINT?.trim() || undefined;
  const s3 = new S3Client({ region: process.env.MAGUS_S3_REGION?.trim() || 'us-east-1', ...(endpoint ? { endpoint, forcePathStyle: true } : {}) });
  const bucket = process.env.MAGUS_S3_BUCKET?.trim() || 'magus';
  const abort = new AbortController();
  const stop = () => abort.abort(new Error('stopped by a signal'));
  process.once('SIGTERM', stop);
  process.once('SIGINT', stop);
  try {
    for (const f of spec.files) {
      const t0 = Date.now();
      const path = await cachedFile({ s3, bucket, dir: spec.dir }, { key: f.key, sha256: f.sha256, bytes: 0 }, extname(f.key), abort.signal);
      if (f.name) {
        const link = join(spec.dir, f.name);
        rmSync(link, { force: true });
        symlinkSync(basename(path), link);
      }
      process.stdout.write(`${JSON.stringify({ event: 'fetched', key: f.key, path, ms: Date.now() - t0 })}\n`);
    }
    return 0;
  } catch (err) {
    // Also what Kubernetes shows as the init container's termination message.
    process.stderr.write(`magus fetch: ${(err as Error).message}\n`);
    return 1;
  } finally {
    s3.destroy();
  }
}
